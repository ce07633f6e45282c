"""Real prefill/decode disaggregation: a vLLM prefill server and a decode server with NixlConnector on host memory
(UCX over loopback), driven by the router's two-hop flow (llmd.router.pd), deployed by llmd.engines.vllm_deploy from
a spec (which also sends the decode server the warm-up request a CPU decode server needs before its first KV pull)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllmutil import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    SERVED_NAME,
    START_TIMEOUT_S,
    metric,
    metrics_text,
    pod_named,
    post,
    post_async,
    process_tree,
    require_vllm,
    router_config,
    run_bounded,
    until_ready,
    words,
)

from llmd.engines.vllm_deploy import VllmDeployment, with_free_ports
from llmd.engines.vllm_server import listening_ports
from llmd.router.proxy import Router
from llmd.spec.model import DeploymentSpec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture(scope="module")
def pd(dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    require_vllm()
    spec = DeploymentSpec.model_validate(
        {
            "name": "vllm-pd",
            "model": {
                "path": str(dense_model),
                "served_name": SERVED_NAME,
                "block_size": BLOCK_SIZE,
                "max_model_len": MAX_MODEL_LEN,
            },
            "prefill": {"nodes": 1, "max_num_seqs": 16},
            "decode": {"nodes": 1, "max_num_seqs": 16},
            "kv": {"gpu_blocks": 96},
            "engine": {"kind": "vllm"},
        }
    )
    with VllmDeployment(with_free_ports(spec), tmp_path_factory.mktemp("pd"), timeout_s=START_TIMEOUT_S) as dep:
        yield dep


def test_pd_two_hop_transfers_the_prompt_and_matches_a_single_server(pd: VllmDeployment) -> None:
    """prefill-0 computes the prompt, decode-0 pulls its KV over NIXL: the decode engine counts the whole prompt as
    external_kv_transfer and computes none of it; the text equals a plain run of the same request
    on one server at temperature 0 (on decode-0 itself, under another cache_salt so that it caches nothing the P/D
    request could hit)."""
    prefill, decode = pod_named(pd, "prefill-0"), pod_named(pd, "decode-0")
    # Under a loaded CI box the router once served the request decode-only (route reason only-healthy, no P/D header;
    # 1 run in 3, never reproduced alone). A second, fresh prompt (no cache shared with the first) then gets its
    # chance; every attempt's headers are kept for the failure message.
    tried: list[str] = []
    for seed in (31337, 4242):
        prompt = "P/D check. " + words(random.Random(seed), 200)
        req = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        status, single = post(decode.url + "/v1/completions", {**req, "cache_salt": f"pd-single-{seed}"})
        assert status == 200, single
        prompt_tokens = single["usage"]["prompt_tokens"]
        assert prompt_tokens > 4 * BLOCK_SIZE
        before = metrics_text(decode.url)

        async def body(req: dict[str, Any] = req) -> tuple[dict, Any]:
            async with Router(router_config(pd, "precise"), [prefill, decode]) as router:
                await until_ready(router, 2)
                async with aiohttp.ClientSession() as http:
                    return await post_async(http, router.url + "/v1/completions", req, "pd-session")

        headers, data = run_bounded(body())
        after = metrics_text(decode.url)
        tried.append(json.dumps(dict(headers)))
        if headers.get("x-llmd-pd") == "ok":
            break
    assert headers.get("x-llmd-pd") == "ok", "\n".join(tried)
    assert headers["x-llmd-prefill-pod"] == "prefill-0" and headers["x-llmd-pod"] == "decode-0"

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    by_source = "vllm:prompt_tokens_by_source_total"
    external, computed = delta(by_source, source="external_kv_transfer"), delta(by_source, source="local_compute")
    nixl_bytes = delta("vllm:nixl_bytes_transferred_sum")
    print(f"prompt {prompt_tokens} tokens: decode got {external:g} over NIXL ({nixl_bytes:g} B), computed {computed:g}")
    # vLLM 0.32 books the whole prompt, partial last block included, as transferred (measured: 579 of 579 tokens).
    assert external == prompt_tokens, (external, computed, prompt_tokens)
    assert computed == 0, f"decode recomputed {computed} prompt tokens (external {external})"
    assert nixl_bytes > 0
    assert data["choices"][0]["text"] == single["choices"][0]["text"]


def test_every_listener_binds_the_node_address(pd: VllmDeployment) -> None:
    """No socket of either server (API servers, engine cores, NIXL side channels, KV-event PUB and replay) listens on
    every interface: each binds the node's own address, here 127.0.0.1. The KV-event PUB sockets are where vLLM
    said they are (vLLM reads `tcp://*:P` as every interface, so llmd gives it `tcp://*:0` on VLLM_HOST_IP)."""
    for p in pd.processes:
        assert p.pod is not None and p.pod.kv_events_endpoint is not None
        listeners = [(pid, a) for pid in process_tree(p.proc.pid) for a in listening_ports(pid)]
        wide = [(pid, a, Path(f"/proc/{pid}/cmdline").read_text()[:80]) for pid, a in listeners if a[0] != "127.0.0.1"]
        assert listeners and not wide, (p.pod.name, wide)
        ports = {port for _, (_, port) in listeners}
        host, _, port = p.pod.kv_events_endpoint.removeprefix("tcp://").rpartition(":")
        assert host == "127.0.0.1" and int(port) in ports, (p.pod.kv_events_endpoint, listeners)
