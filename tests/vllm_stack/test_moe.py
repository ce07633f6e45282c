"""`llmd model make-tiny --moe` makes a Qwen3-MoE that vLLM's CPU build loads and serves (one instance: DP/EP of MoE
fails on CPU, see the platform notes), deployed through llmd.engines.vllm_deploy like any spec."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllmutil import BLOCK_SIZE, MAX_MODEL_LEN, START_TIMEOUT_S, metric, metrics_text, post, require_vllm

from llmd.engines.vllm_deploy import VllmDeployment, with_free_ports
from llmd.spec.model import DeploymentSpec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "tiny-moe"
    # Through the command line, as a user makes it.
    done = subprocess.run(
        [sys.executable, "-m", "llmd.cli", "model", "make-tiny", str(out), "--moe"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def moe_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    require_vllm()
    spec = DeploymentSpec.model_validate(
        {
            "name": "tiny-moe",
            "model": {"path": str(moe_model), "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN},
            "prefill": {"nodes": 0},
            "kv": {"gpu_blocks": 64},
            "engine": {"kind": "vllm"},
        }
    )
    with VllmDeployment(with_free_ports(spec), tmp_path_factory.mktemp("moe-logs"), timeout_s=START_TIMEOUT_S) as dep:
        yield dep


def test_make_tiny_moe_writes_a_qwen3_moe(moe_model: Path) -> None:
    cfg = json.loads((moe_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (8, 2)


def test_vllm_serves_the_tiny_moe(moe_server: VllmDeployment) -> None:
    (pod,) = moe_server.pods
    assert pod.role == "decode" and pod.side_channel_port is None  # no P/D: no NIXL
    log = moe_server.processes[0].log.read_text(errors="replace")
    assert "Qwen3MoeForCausalLM" in log  # vLLM resolved the MoE architecture, not a fallback
    body = {"model": "tiny-moe", "prompt": "def route(tokens, experts): " * 8, "max_tokens": 8, "temperature": 0}
    status, first = post(pod.url + "/v1/completions", body)
    assert status == 200, first
    assert first["usage"]["completion_tokens"] == 8
    status, again = post(pod.url + "/v1/completions", body)
    assert status == 200, again
    # Deterministic at temperature 0, and the second run reuses the first one's full blocks.
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (first["usage"]["prompt_tokens"] // BLOCK_SIZE) * BLOCK_SIZE - BLOCK_SIZE
    assert metric(metrics_text(pod.url), "vllm:prefix_cache_hits_total") >= cached
