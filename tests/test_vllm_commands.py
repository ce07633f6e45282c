"""The vLLM command lines the launcher produces, pinned, and checked against the installed vLLM's own parser."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from llmd.engines.vllm import (
    API_SERVER_MODULE,
    HEADLESS_MODULE,
    NODE_ADDRESS,
    head_placeholder,
    rank_http_port,
    vllm_launches,
)
from llmd.spec import load_spec
from llmd.spec.layout import engine_endpoints
from llmd.spec.model import DeploymentSpec, EngineSpec, KVSpec, ModelSpec, MTPSpec, PoolSpec

GLM = Path(__file__).resolve().parent.parent / "examples" / "glm52-544gpu.yaml"


def tiny_spec(**update) -> DeploymentSpec:
    return DeploymentSpec(
        model=ModelSpec(path="models/tiny", max_model_len=1024, hash_seed="0"),
        prefill=PoolSpec(nodes=1, port=8100, extra_args=["--enforce-eager"]),
        decode=PoolSpec(nodes=1, port=8200, env={"FOO": "bar"}),
        engine=EngineSpec(kind="vllm"),
        **update,
    )


@pytest.fixture(scope="module")
def glm() -> DeploymentSpec:
    return load_spec(GLM)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_tiny_full_command_lines():
    launches = vllm_launches(tiny_spec(), head_addresses={("prefill", 0): "10.0.0.1", ("decode", 0): "10.0.0.2"})
    assert [(x.role, x.replica, x.node_index, x.http_port, x.ranks) for x in launches] == [
        ("prefill", 0, 0, 8100, [0]),
        ("decode", 0, 0, 8200, [0]),
    ]
    common = (
        "--model models/tiny --served-model-name tiny --host {host} --port {port} --block-size 16 "
        "--enable-prefix-caching --prefix-caching-hash-algo sha256 --max-model-len 1024 --max-num-seqs 256 "
        "--max-num-batched-tokens 8192 --tensor-parallel-size 1 --gpu-memory-utilization 0.9 "
        "--kv-events-config "
        """'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","""
        """"replay_endpoint":"tcp://{host}:{rp}","topic":"kv"}}' """
        """--kv-transfer-config '{{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"{eid}"}}'"""
    )
    assert shlex.join(launches[0].argv) == (
        f"python -m {API_SERVER_MODULE} "
        + common.format(host="10.0.0.1", port=8100, rp=11100, eid="prefill-0")
        + " --enforce-eager"
    )
    assert shlex.join(launches[1].argv) == f"python -m {API_SERVER_MODULE} " + common.format(
        host="10.0.0.2", port=8200, rp=11200, eid="decode-0"
    )
    assert launches[0].env == {
        "PYTHONHASHSEED": "0",
        "VLLM_HOST_IP": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "10100",
    }
    assert launches[1].env == {
        "PYTHONHASHSEED": "0",
        "VLLM_HOST_IP": "10.0.0.2",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "10200",
        "FOO": "bar",
    }
    assert all("HF_HUB_OFFLINE" not in x.env for x in launches)


def test_tiny_python_and_placeholders():
    launches = vllm_launches(tiny_spec(), python="/venv/bin/python")
    assert launches[0].argv[:3] == ["/venv/bin/python", "-m", API_SERVER_MODULE]
    assert launches[0].env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == head_placeholder("prefill", 0)


def test_aggregated_cpu_tier_uses_offloading_flags_and_mtp_on_decode():
    spec = tiny_spec(kv=KVSpec(cpu_bytes=3 * 2**30), mtp=MTPSpec(draft_tokens=2))
    spec = spec.model_copy(update={"prefill": PoolSpec(nodes=0)})
    (launch,) = vllm_launches(spec)
    assert launch.role == "decode"
    assert "--kv-transfer-config" not in launch.argv
    assert _flag(launch.argv, "--kv-offloading-size") == "3"
    assert _flag(launch.argv, "--kv-offloading-backend") == "native"
    assert json.loads(_flag(launch.argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 2}
    assert not any(k.startswith("VLLM_NIXL") for k in launch.env)


def test_glm_head_headless_layout(glm):
    launches = vllm_launches(glm)
    prefill = [x for x in launches if x.role == "prefill"]
    decode = [x for x in launches if x.role == "decode"]
    assert len(prefill) == 10 * 2 and len(decode) == 3 * 16
    for pool_launches, pool, dp in ((prefill, glm.prefill, 16), (decode, glm.decode, 128)):
        for x in pool_launches:
            argv = x.argv
            assert argv[argv.index("--data-parallel-size") + 1] == str(dp)
            assert _flag(argv, "--data-parallel-size-local") == "8"
            assert _flag(argv, "--data-parallel-address") == head_placeholder(x.role, x.replica)
            assert _flag(argv, "--data-parallel-rpc-port") == str(pool.port + 5000 + x.replica)
            assert "--enable-expert-parallel" in argv
            assert x.ranks == list(range(8 * x.node_index, 8 * x.node_index + 8))
            if x.node_index == 0:
                assert argv[2] == API_SERVER_MODULE and "--headless" not in argv
                assert "--data-parallel-start-rank" not in argv
                assert x.http_port == pool.port + x.replica
                assert x.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == head_placeholder(x.role, x.replica)
            else:
                assert argv[2:4] == [HEADLESS_MODULE, "--headless"]
                assert _flag(argv, "--data-parallel-start-rank") == str(8 * x.node_index)
                assert x.http_port is None
                assert x.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == NODE_ADDRESS
    nodes = {(x.role, x.replica): [] for x in launches}
    for x in launches:
        nodes[(x.role, x.replica)].append(x.node_index)
    assert all(v == list(range(len(v))) for v in nodes.values())


def test_glm_mtp_only_on_decode(glm):
    for x in vllm_launches(glm):
        if x.role == "decode":
            assert json.loads(_flag(x.argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 3}
        else:
            assert "--speculative-config" not in x.argv


def test_glm_kv_events_nixl_and_multiconnector_per_replica(glm):
    endpoints = {(e.role, e.replica): e for e in engine_endpoints(glm)}
    for x in vllm_launches(glm):
        ep = endpoints[(x.role, x.replica)]
        events = json.loads(_flag(x.argv, "--kv-events-config"))
        # The node's own address (a placeholder the launcher fills), never every interface; vLLM binds the replay
        # socket wherever it is told, but reads an explicit PUB host as "connect" and `tcp://*:P` as every interface:
        # the PUB takes `tcp://*:0`, a free port on VLLM_HOST_IP.
        host = _flag(x.argv, "--host")
        assert host == (head_placeholder(x.role, x.replica) if x.node_index == 0 else NODE_ADDRESS)
        assert x.env["VLLM_HOST_IP"] == host
        assert events == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",
            "replay_endpoint": f"tcp://{host}:{ep.replay_port}",
            "topic": "kv",
        }
        assert x.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(ep.side_channel_port)
        assert x.env["PYTHONHASHSEED"] == "0"
        transfer = json.loads(_flag(x.argv, "--kv-transfer-config"))
        assert transfer == {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "engine_id": f"{x.role}-{x.replica}",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 128 * 2**30},
                    },
                ]
            },
        }
        # vLLM would overwrite the MultiConnector with OffloadingConnector if these were given too.
        assert "--kv-offloading-size" not in x.argv
        assert _flag(x.argv, "--block-size") == "64"
        assert _flag(x.argv, "--prefix-caching-hash-algo") == "sha256_cbor"


def test_glm_per_rank_mode(glm):
    launches = vllm_launches(glm, mode="per-rank", head_addresses={("decode", 1): "10.1.0.1"})
    decode1 = [x for x in launches if x.role == "decode" and x.replica == 1]
    assert len(launches) == 10 * 16 + 3 * 128 and len(decode1) == 128
    ports = [x.http_port for x in launches if x.role == "decode"]
    assert len(set(ports)) == len(ports)
    reserved = {e.http_port for e in engine_endpoints(glm)}
    for e in engine_endpoints(glm):
        reserved |= {p + k for p in (e.kv_events_port, e.side_channel_port, e.replay_port) for k in range(e.dp_size)}
    assert not reserved & {x.http_port for x in launches}
    for x in decode1:
        (rank,) = x.ranks
        assert x.node_index == rank // 8
        assert x.http_port == rank_http_port(glm.decode, 1, rank) == int(_flag(x.argv, "--port"))
        assert _flag(x.argv, "--data-parallel-rank") == str(rank)
        assert _flag(x.argv, "--data-parallel-address") == "10.1.0.1"
        assert "--headless" not in x.argv and "--data-parallel-start-rank" not in x.argv


def test_bad_mode():
    with pytest.raises(ValueError, match="launch mode"):
        vllm_launches(tiny_spec(), mode="bogus")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:  # pragma: no cover - another vLLM layout
        pytest.skip(f"vLLM's serve argument parser is not importable: {exc}")
    return make_arg_parser(FlexibleArgumentParser())


def _all_launches(glm: DeploymentSpec):
    aggregated = tiny_spec(kv=KVSpec(cpu_bytes=3 * 2**30, gpu_blocks=96), mtp=MTPSpec(draft_tokens=2))
    aggregated = aggregated.model_copy(update={"prefill": PoolSpec(nodes=0)})
    return [
        *vllm_launches(tiny_spec()),
        *vllm_launches(aggregated),
        *vllm_launches(glm),
        *vllm_launches(glm, mode="per-rank")[:20],
    ]


def test_every_argv_parses_with_vllms_own_parser(vllm_parser, glm):
    for x in _all_launches(glm):
        assert x.argv[1] == "-m"
        args = vllm_parser.parse_args(x.argv[3:])
        assert args.model == x.argv[x.argv.index("--model") + 1]
        assert args.port == int(_flag(x.argv, "--port"))
        assert args.block_size == int(_flag(x.argv, "--block-size"))
        assert args.enable_prefix_caching is True
        assert args.prefix_caching_hash_algo == _flag(x.argv, "--prefix-caching-hash-algo")
        assert args.kv_events_config.enable_kv_cache_events is True
        assert args.kv_events_config.replay_endpoint.startswith("tcp://")
        assert args.headless == ("--headless" in x.argv)
        if "--kv-transfer-config" in x.argv:
            assert args.kv_transfer_config.kv_connector in ("NixlConnector", "MultiConnector")
            assert args.kv_transfer_config.engine_id == f"{x.role}-{x.replica}"
        if "--kv-offloading-size" in x.argv:
            assert args.kv_offloading_size == 3.0 and args.kv_offloading_backend == "native"
        if "--data-parallel-start-rank" in x.argv:
            assert args.data_parallel_start_rank == x.ranks[0]
            assert args.data_parallel_size_local == len(x.ranks)
        if "--data-parallel-rank" in x.argv:
            assert args.data_parallel_rank == x.ranks[0]
        if "--speculative-config" in x.argv:
            assert args.speculative_config["method"] == "mtp"
        assert args.enable_expert_parallel == ("--enable-expert-parallel" in x.argv)


def test_wait_healthy_names_the_engine_and_shows_the_log_it_wrote_before_dying(tmp_path: Path) -> None:
    """The tail is read when the error is raised, so what the engine printed on its way down is in the message."""
    import subprocess
    import sys

    from llmd.engines.vllm_server import EngineStartError, wait_healthy

    log = tmp_path / "engine.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(0.5); print('ValueError: no such model', flush=True)"],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    with pytest.raises(EngineStartError) as err:
        wait_healthy("http://127.0.0.1:9/health", proc, 30, log, name="decode-0")
    assert "decode-0 exited with code 0 before it was healthy" in str(err.value)
    assert "ValueError: no such model" in str(err.value)


def test_a_run_id_is_a_second_served_name_vllm_lists():
    """vLLM's /health cannot carry the run id; its /v1/models lists every served name, and the first stays the one
    responses and metrics carry."""
    for x in vllm_launches(tiny_spec(), run_id="feedc0de"):
        i = x.argv.index("--served-model-name")
        assert x.argv[i + 1 : i + 3] == ["tiny", "llmd-run-feedc0de"] and x.argv[i + 3].startswith("--")
