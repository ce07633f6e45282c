"""llmd.engines.vllm_deploy without starting vLLM: the CPU argv and env of each launch, the router's PodInfo, free port
bands and the checks made before minutes of start-up are spent. Real servers: tests/vllm_stack."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest

from llmd.engines import vllm_deploy, vllm_server
from llmd.engines.vllm import vllm_launches
from llmd.engines.vllm_deploy import (
    CPU_KV_CACHE_BYTES,
    VllmDeployment,
    _ports_of,
    check_cpu_spec,
    core_binds,
    cpu_argv,
    cpu_env,
    demo_spec,
    pods_of,
    settle_ports,
    with_free_ports,
)
from llmd.engines.vllm_server import EngineStartError
from llmd.errors import UserError
from llmd.spec.model import DeploymentSpec


def _spec(tmp_path: Path, **kw: object) -> DeploymentSpec:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    data = {
        "model": {"path": str(model), "block_size": 32, "max_model_len": 1024},
        "prefill": {"nodes": 1},
        "decode": {"nodes": 2, "replicas": 2},
        "engine": {"kind": "vllm"},
    }
    data.update(kw)
    return DeploymentSpec.model_validate(data)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_argv_resolves_placeholders_and_sets_cpu_flags(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    for launch in vllm_launches(spec, python="py", mode="per-rank"):
        argv = cpu_argv(launch)
        assert not any("@" in a for a in argv), argv
        assert _flag(argv, "--host") == "127.0.0.1"
        assert _flag(argv, "--gpu-memory-utilization") == "0.25"
        assert _flag(argv, "--kv-cache-memory-bytes") == str(CPU_KV_CACHE_BYTES)
        assert "--enforce-eager" in argv and argv.count("--gpu-memory-utilization") == 1
        env = cpu_env(launch)
        assert env["HF_HUB_OFFLINE"] == "1" and env["UCX_NET_DEVICES"] == "lo"  # NIXL on loopback, nothing wider
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert "PYTHONHASHSEED" not in env
    # Every server its own NIXL side channel.
    ports = [cpu_env(la)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for la in vllm_launches(spec)]
    assert len(set(ports)) == 3


def test_a_spec_hash_seed_reaches_the_engines(tmp_path: Path) -> None:
    spec = _spec(tmp_path, model={**_spec(tmp_path).model.model_dump(), "hash_seed": "7"})
    assert all(cpu_env(la)["PYTHONHASHSEED"] == "7" for la in vllm_launches(spec))


def test_pods_match_the_layout(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    launches = vllm_launches(spec, mode="per-rank")
    pods = pods_of(spec, launches, "per-rank")
    assert [p.name for p in pods] == ["prefill-0", "decode-0", "decode-1"]
    for launch, pod in zip(launches, pods, strict=True):
        assert pod.url == f"http://127.0.0.1:{launch.http_port}"
        events = json.loads(launch.argv[launch.argv.index("--kv-events-config") + 1])
        # The PUB port is vLLM's to pick (tcp://*:0): unknown until the server says; the replay one is laid out.
        assert pod.kv_events_endpoint is None and events["endpoint"] == "tcp://*:0"
        assert pod.kv_events_replay_endpoint is not None
        assert pod.kv_events_replay_endpoint.rsplit(":", 1)[1] == events["replay_endpoint"].rsplit(":", 1)[1]
        assert pod.engine_id == pod.name and pod.side_channel_port == int(
            cpu_env(launch)["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        )
    # Without P/D there is no NIXL: no side channel, no engine id.
    plain = _spec(tmp_path, prefill={"nodes": 0}, decode={"nodes": 1})
    (pod,) = pods_of(plain, vllm_launches(plain), "per-rank")
    assert pod.role == "decode" and pod.side_channel_port is None and pod.engine_id is None


def test_with_free_ports_moves_every_pool_to_a_free_band(tmp_path: Path) -> None:
    spec = with_free_ports(_spec(tmp_path), seed=1)
    bands = {role: set(_ports_of(spec, role)) for role in spec.pools}
    assert not bands["prefill"] & bands["decode"]
    for ports in bands.values():
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_checks_before_start(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="multiple of 32"):
        check_cpu_spec(_spec(tmp_path, model={"path": str(tmp_path / "m"), "block_size": 16}))
    with pytest.raises(UserError, match="llmd model make-tiny"):
        VllmDeployment(_spec(tmp_path, model={"path": str(tmp_path / "nothing"), "block_size": 32}), tmp_path)


def test_demo_spec_is_one_prefill_and_one_decode_on_blocks_of_32(tmp_path: Path) -> None:
    base = _spec(tmp_path, engine={"kind": "sim"})
    spec = demo_spec(base, embedded=True)
    assert spec.engine.kind == "vllm" and spec.model.block_size == 32
    assert (spec.prefill.replicas, spec.decode.replicas) == (1, 1)
    assert spec.decode.port != base.decode.port or spec.prefill.port != base.prefill.port  # free bands
    assert demo_spec(base, embedded=False).decode.replicas == 2  # a spec file runs as written


def test_core_binds_split_the_cores() -> None:
    assert core_binds(3, [0, 1]) == ["0", "1", "0"]
    assert core_binds(2, [0, 1, 2, 3]) == ["0,1", "2,3"]
    assert core_binds(1, [4, 5]) == ["4,5"]


def test_pods_of_data_parallel_replicas(tmp_path: Path) -> None:
    spec = _spec(tmp_path, prefill={"nodes": 0}, decode={"nodes": 2, "gpus_per_node": 2, "dp_size": 4})
    per_rank = pods_of(spec, vllm_launches(spec, mode="per-rank"), "per-rank")
    assert [(p.name, p.dp_size) for p in per_rank] == [(f"decode-0-rank{r}", 1) for r in range(4)]
    assert len({p.kv_events_replay_endpoint for p in per_rank}) == 4
    head = [p for p in pods_of(spec, vllm_launches(spec), "head-headless") if p is not None]
    assert [(p.name, p.dp_size) for p in head] == [("decode-0", 4)]


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python -m vllm...`: the deployment's process handling without vLLM."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_that_dies_fails_the_start_with_its_log(tmp_path: Path) -> None:
    spec = with_free_ports(_spec(tmp_path, prefill={"nodes": 0}, decode={"nodes": 1}), seed=2)
    python = _fake_python(tmp_path, 'echo "no such model: $3"; exit 3')
    dep = VllmDeployment(spec, tmp_path / "logs", python=python, timeout_s=30)
    with pytest.raises(EngineStartError, match=r"(?s)exited with code 3.*no such model"):
        dep.start()
    assert dep.processes == []


def test_cancelled_start_up_stops_every_server(tmp_path: Path) -> None:
    spec = with_free_ports(_spec(tmp_path), seed=3)
    python = _fake_python(tmp_path, "exec sleep 60")  # never healthy
    dep = VllmDeployment(spec, tmp_path / "logs", python=python, timeout_s=60)

    async def body() -> list[int]:
        task = asyncio.ensure_future(dep.__aenter__())
        for _ in range(100):  # until all three are running
            await asyncio.sleep(0.05)
            if len(dep.processes) == 3:
                break
        pids = [p.proc.pid for p in dep.processes]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pids

    t0 = time.monotonic()
    pids = asyncio.run(asyncio.wait_for(body(), 30))
    assert len(pids) == 3 and time.monotonic() - t0 < 20
    assert not any(_alive(pid) for pid in pids)


def test_auto_ports_give_each_dp_replica_one_free_rpc_port(tmp_path: Path) -> None:
    spec = _spec(tmp_path, prefill={"nodes": 0}, decode={"nodes": 2, "replicas": 2, "dp_size": 2, "gpus_per_node": 2})
    auto = spec.model_copy(update={"decode": spec.decode.model_copy(update={"port": "auto"})})
    launches = settle_ports(vllm_launches(auto, mode="per-rank"))
    ports = [(x.replica, int(_flag(x.argv, "--data-parallel-rpc-port"))) for x in launches]
    assert len(ports) == 4 and len(set(ports)) == 2 and all(port for _, port in ports)  # vLLM refuses 0 there
    fixed = with_free_ports(spec, seed=5)  # free layout ports are kept
    assert settle_ports(vllm_launches(fixed)) == vllm_launches(fixed)


def test_a_taken_headless_side_channel_moves_and_the_head_lists_it(tmp_path: Path) -> None:
    """P/D with a decode replica of dp_size 2 at one GPU per node: its head (rank 0) and headless process (rank 1)
    both on this machine. Rank 1's layout side channel is taken: that process gets a base of its own before any
    starts, the head keeps the layout's, and the head's pod lists each rank's port from the process that runs it."""
    decode = {"nodes": 2, "dp_size": 2, "gpus_per_node": 1}
    spec = with_free_ports(_spec(tmp_path, decode=decode), seed=6)
    side = spec.decode.port + 2000  # rank 0's; rank 1 listens on side + 1
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", side + 1))
        squat.listen()
        head, headless = [x for x in settle_ports(vllm_launches(spec)) if x.role == "decode"]
        moved = int(headless.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert head.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(side) and moved not in (0, side)
        assert vllm_server.port_free("127.0.0.1", moved + 1) and moved + 1 != side
    ports = vllm_server.rank_side_channel_ports((x.env, x.ranks) for x in (head, headless))
    assert ports == {0: side, 1: moved + 1}


def test_auto_pd_replicas_over_two_nodes_get_free_side_channels_no_two_alike(tmp_path: Path) -> None:
    """P/D with dp_size 2 at one GPU per node: each replica's head and headless process on this machine, every side
    channel 0 in the layout (`port: auto`, once refused for this shape). Settled together, each gets a base of its
    own, and the head's pod lists every rank's port from the process that runs it."""
    decode = {"nodes": 4, "replicas": 2, "dp_size": 2, "gpus_per_node": 1, "port": "auto"}
    spec = _spec(tmp_path, prefill={"nodes": 1, "port": "auto"}, decode=decode)
    launches = settle_ports(vllm_launches(spec))
    listens = [int(x.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + r for x in launches for r in x.ranks]
    rpc = {int(_flag(x.argv, "--data-parallel-rpc-port")) for x in launches if x.role == "decode"}
    assert len(listens) == 5 and 0 not in listens and len(set(listens) | rpc) == 7
    head = [x for x in launches if (x.role, x.replica) == ("decode", 1)]
    ports = vllm_server.rank_side_channel_ports((x.env, x.ranks) for x in head)
    assert ports == {
        0: int(head[0].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
        1: int(head[1].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + 1,
    }


def test_a_replica_whose_rpc_port_is_taken_at_bind_starts_again_on_a_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe found the DP RPC port free, then another program took it: rank 0 exits with EADDRINUSE, and both
    ranks (rank 1 dials that port) start again on one free port."""
    spec = _spec(tmp_path, prefill={"nodes": 0}, decode={"nodes": 1, "dp_size": 2, "gpus_per_node": 2})
    spec = with_free_ports(spec, seed=4)
    rpc = spec.decode.port + 5000
    calls = tmp_path / "calls"
    python = _fake_python(
        tmp_path,
        f'echo "$*" >> {calls}\n'
        f'case "$*" in *"--data-parallel-rank 0 "*"--data-parallel-rpc-port {rpc} "*)\n'
        '  echo "zmq.error.ZMQError: Address already in use"; exit 1;;\nesac\nexec sleep 60',
    )
    real, probed = vllm_deploy.port_free, []

    def racy(host: str, port: int) -> bool:
        probed.append(port)
        return probed.count(rpc) == 1 if port == rpc else real(host, port)  # free at the first probe only

    monkeypatch.setattr(vllm_deploy, "port_free", racy)
    monkeypatch.setattr(vllm_server, "port_free", racy)  # settle_ports probes through it
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", rpc))
        squat.listen()
        dep = VllmDeployment(spec, tmp_path / "logs", python=python, timeout_s=5)
        with pytest.raises(EngineStartError, match="not healthy"):  # the fake never serves: the end of this test
            dep.start()
    runs = [line.split() for line in calls.read_text().splitlines()]
    started = [(_flag(a, "--data-parallel-rank"), int(_flag(a, "--data-parallel-rpc-port"))) for a in runs]
    rank0 = [port for rank, port in started if rank == "0"]
    rank1 = [port for rank, port in started if rank == "1"]  # its first start may be stopped before it writes a line
    assert len(rank0) == 2 and rank0[0] == rpc and rank0[1] not in (0, rpc)
    assert rank1[-1] == rank0[1] and set(rank1) <= {rpc, rank0[1]}
