"""llmd.fabric without MPI: the per-node plan (tiny spec, the 544-GPU example), the ports a per-rank vLLM server
probes, node ordering, the file channel, the slow-link verdict, the HDF5 record and its merge."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from llmd.discovery import parse_discovery
from llmd.engines.vllm import NODE_ADDRESS
from llmd.engines.vllm_server import port_free
from llmd.errors import UserError
from llmd.fabric.bootstrap import FabricError, _bind_first, _dp_ranks, failing_together
from llmd.fabric.comm import FabricTimeout, FileComm, PeerFailed, slurm_world
from llmd.fabric.nodes import order_nodes, slurm_node_order
from llmd.fabric.plan import plan_nodes
from llmd.fabric.preflight import PreflightResult, _link_of, slow_links
from llmd.fabric.record import write_matrix
from llmd.metrics.merge import merge_runs
from llmd.spec import DeploymentSpec, load_spec

ROOT = Path(__file__).resolve().parent.parent
GLM = ROOT / "examples" / "glm52-544gpu.yaml"


def tiny_spec(**decode: object) -> DeploymentSpec:
    return DeploymentSpec.model_validate(
        {
            "model": {"path": "models/tiny", "max_model_len": 512},
            "prefill": {"nodes": 0},
            "decode": {"nodes": 2, "replicas": 2, "port": 31200, **decode},
        }
    )


# ---- the plan ----------------------------------------------------------------------------------------------------


def test_sim_plan_one_server_per_replica_on_the_layout_ports() -> None:
    plans = plan_nodes(tiny_spec(), "decode", ["n1", "n2"], ["10.0.0.1", "10.0.0.2"], spec_path="/s.yaml", python="py")
    assert [(p.index, p.node, p.replica, p.node_in_replica, p.dp_ranks) for p in plans] == [
        (0, "n1", 0, 0, [0]),
        (1, "n2", 1, 0, [0]),
    ]
    second = plans[1].processes[0]
    argv = second.argv
    assert argv[:5] == ["py", "-m", "llmd.cli", "engine", "sim"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert flags["--spec"] == "/s.yaml" and flags["--role"] == "decode" and flags["--host"] == "10.0.0.2"
    assert flags["--port"] == "31201" and flags["--engine-id"] == "decode-1" and flags["--node"] == "n2"
    assert flags["--kv-events-endpoint"] == "tcp://*:32201" and flags["--side-channel-port"] == "33201"
    assert flags["--kv-events-replay-endpoint"] == "tcp://*:34201"
    assert second.health_url == "http://10.0.0.2:31201/health"
    # The entry is one the router accepts, pointing at this node.
    (pod,) = parse_discovery([e.to_json() for e in second.discovery])
    assert pod.name == "decode-1" and pod.url == "http://10.0.0.2:31201" and pod.engine_id == "decode-1"
    assert pod.side_channel_of(0) == ("10.0.0.2", 33201) and pod.events_address(0) == ("tcp://10.0.0.2:32201", False)


def test_sim_replica_over_two_nodes_runs_on_its_first_node() -> None:
    plans = plan_nodes(tiny_spec(nodes=4, dp_size=2), "decode", ["a", "b", "c", "d"])
    assert [len(p.processes) for p in plans] == [1, 0, 1, 0]
    # The layout is vLLM's (one DP rank per GPU, one GPU per node here), though one sim server runs both ranks.
    assert [p.dp_ranks for p in plans] == [[0], [1], [0], [1]]
    entry = plans[2].processes[0].discovery[0]
    assert entry.dp_size == 2 and entry.url == "http://c:31201" and entry.rank_hosts == ("c", "d")


def test_node_count_must_match_the_pool() -> None:
    with pytest.raises(UserError, match=r"needs 2 nodes .* has 3 tasks"):
        plan_nodes(tiny_spec(), "decode", ["a", "b", "c"])
    with pytest.raises(UserError, match="no prefill pool"):
        plan_nodes(tiny_spec(), "prefill", ["a"])


def test_glm_decode_nodes_replicas_ranks_ports() -> None:
    spec = load_spec(GLM)
    nodes = [f"gpu{k:03d}" for k in range(48)]
    addrs = [f"10.1.0.{k}" for k in range(48)]
    plans = plan_nodes(spec, "decode", nodes, addrs, spec_path="/glm.yaml", python="py")
    assert len(plans) == 48
    for p in plans:
        assert p.replica == p.index // 16 and p.node_in_replica == p.index % 16
        assert p.dp_ranks == list(range(8 * p.node_in_replica, 8 * p.node_in_replica + 8))
        assert len(p.processes) == 1
        text = json.dumps([p.processes[0].argv, p.processes[0].env])
        assert "@" not in text, "every placeholder is resolved"
        env = p.processes[0].env
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == addrs[p.index]
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(10200 + 128 * p.replica)
        argv = p.processes[0].argv
        assert argv[argv.index("--data-parallel-address") + 1] == addrs[16 * p.replica]
        assert argv[argv.index("--data-parallel-rpc-port") + 1] == str(13200 + p.replica)
        if p.node_in_replica == 0:
            assert "--headless" not in argv and p.ports == [8200 + p.replica]
            (entry,) = p.processes[0].discovery
            assert entry.url == f"http://{addrs[p.index]}:{8200 + p.replica}" and entry.dp_size == 128
            assert entry.rank_hosts[8:16] == (addrs[p.index + 1],) * 8
        else:
            assert "--headless" in argv and p.ports == [] and p.processes[0].discovery == []
            assert argv[argv.index("--data-parallel-start-rank") + 1] == str(8 * p.node_in_replica)
    assert [p.index for p in plans if p.processes[0].discovery] == [0, 16, 32]
    prefill = plan_nodes(spec, "prefill", nodes[:20], addrs[:20])
    assert [p.replica for p in prefill] == [k // 2 for k in range(20)]
    assert prefill[7].dp_ranks == list(range(8, 16)) and prefill[6].ports == [8103]


def test_glm_per_rank_mode_announces_every_rank() -> None:
    spec = load_spec(GLM)
    plans = plan_nodes(spec, "prefill", [f"n{k}" for k in range(20)], mode="per-rank")
    node3 = plans[3]  # replica 1, ranks 8-15
    assert [p.name for p in node3.processes] == [f"prefill-1-dp{r}" for r in range(8, 16)]
    entry = node3.processes[0].discovery[0]
    assert entry.dp_size == 1 and entry.engine_id == "prefill-1_dp8"
    assert entry.side_channel_host == "n3" and entry.side_channel_port == 10100 + 16 + 8
    assert NODE_ADDRESS not in json.dumps(node3.processes[0].env)


def vllm_spec(port: int) -> DeploymentSpec:
    """P/D on vLLM: one prefill node running two DP ranks."""
    return DeploymentSpec.model_validate(
        {
            "model": {"path": "models/tiny", "max_model_len": 512},
            "prefill": {"nodes": 1, "dp_size": 2, "gpus_per_node": 2, "port": port},
            "decode": {"nodes": 1, "port": port + 100},
            "engine": {"kind": "vllm"},
        }
    )


def test_a_per_rank_server_moves_and_publishes_its_own_ranks_side_channel() -> None:
    """vLLM adds the global DP rank to VLLM_NIXL_SIDE_CHANNEL_PORT: rank 1 binds base + 1, so that is the port probed
    (and published), not base + 0."""
    for _ in range(50):
        with socket.socket() as squat:
            squat.bind(("127.0.0.1", 0))
            squat.listen()
            taken = squat.getsockname()[1]  # rank 1's side channel: base + 2000 + 1
            if not port_free("127.0.0.1", taken - 1) or taken < 4000:
                continue
            spec = vllm_spec(taken - 2001)
            plans = plan_nodes(spec, "prefill", ["a"], ["127.0.0.1"], mode="per-rank")
            head, rank1 = plans[0].processes
            assert (_dp_ranks(head), _dp_ranks(rank1)) == ([0], [1])
            assert rank1.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(taken - 1), "rank 0's: vLLM adds the rank"
            base = int(_bind_first(rank1).env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            assert base != taken - 1 and port_free("127.0.0.1", base + 1)
            return
    raise RuntimeError("no squattable side-channel port")


# ---- nodes and the file channel -------------------------------------------------------------------------------------


def test_node_order_follows_slurm_when_it_agrees() -> None:
    order = {"node[1-3]": ["node1", "node2", "node3"]}
    env = {
        "SLURM_JOB_NODELIST_HET_GROUP_0": "r1",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "node[1-3]",
        "SLURMD_NODENAME": "node2",
    }
    listed = slurm_node_order(env, expand=lambda h: order.get(h, ["r1"]))
    assert listed == ["node1", "node2", "node3"]
    assert order_nodes(["node3", "node1", "node2"], listed) == [2, 0, 1]
    # Names that are not exactly Slurm's (one host under mpiexec, a stray task): rank order.
    assert order_nodes(["vm", "vm", "vm"], listed) == [0, 1, 2]
    assert order_nodes(["a", "b"], None) == [0, 1]
    assert slurm_node_order({"SLURM_STEP_NODELIST": "x[1-2]"}, expand=lambda h: ["x1", "x2"]) == ["x1", "x2"]


def test_file_comm_allgathers_between_tasks(tmp_path: Path) -> None:
    results: dict[int, list[object]] = {}

    def task(rank: int) -> None:
        comm = FileComm(tmp_path, rank, 3)
        comm.barrier(timeout_s=20)
        results[rank] = comm.allgather({"rank": rank}, timeout_s=20) + comm.allgather(rank * 10, timeout_s=20)

    threads = [threading.Thread(target=task, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(results[r] == [{"rank": 0}, {"rank": 1}, {"rank": 2}, 0, 10, 20] for r in range(3))
    assert slurm_world({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}) == (1, 4)
    assert slurm_world({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}) is None


def test_file_comm_names_missing_ranks(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"ranks \[1\] did not reach step 0"):
        FileComm(tmp_path, 0, 2).allgather("x", timeout_s=0.2)


def test_file_comm_a_failed_rank_stops_the_others_waits_at_once_with_its_reason(tmp_path: Path) -> None:
    """Rank 1 fails before a collective step: rank 0's wait there ends at once with rank 1's last line, not after
    its timeout; the failing rank's own waits never read its own file."""
    waiting = FileComm(tmp_path, 0, 2)
    failed = FileComm(tmp_path, 1, 2)
    failed.fail("Traceback (most recent call last):\n  ...\nOverflowError: bind(): port must be 0-65535.", 1)
    start = time.monotonic()
    with pytest.raises(PeerFailed, match=r"rank 1 of the component failed.*: OverflowError: bind\(\): port must"):
        waiting.allgather("x", timeout_s=30)
    assert time.monotonic() - start < 5
    alone = FileComm(tmp_path / "alone", 1, 2)
    alone.fail("its own reason", 1)
    with pytest.raises(FabricTimeout, match=r"ranks \[0\] did not reach step 0"):
        alone.allgather("y", timeout_s=0.2)


class _Recorder:
    """A two-rank Comm that records what `fail` was told (MpiComm would abort the job there)."""

    kind = "mpi"
    rank = 1
    size = 2

    def __init__(self) -> None:
        self.failed: list[tuple[str, int]] = []

    def barrier(self, timeout_s: float = 600.0) -> None:
        return None

    def allgather(self, obj: object, timeout_s: float = 600.0) -> list[object]:
        return [obj, obj]

    def fail(self, message: str, code: int) -> None:
        self.failed.append((message, code))


def test_failing_together_reports_a_ranks_own_failure_and_stops_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    comm = _Recorder()
    with pytest.raises(SystemExit) as stop, failing_together(comm, "decode"):
        raise OverflowError("bind(): port must be 0-65535.")
    err = capsys.readouterr().err
    assert stop.value.code == 1 and comm.failed and comm.failed[0][1] == 1
    message = comm.failed[0][0]
    assert "Traceback" in message and message.endswith("OverflowError: bind(): port must be 0-65535.")
    assert message in err and "rank 1 failed: stopping the component's other 1 ranks" in err
    comm = _Recorder()
    with pytest.raises(SystemExit) as stop, failing_together(comm, "decode"):
        raise FabricTimeout("rank 1: the other ranks did not reach the barrier in 600 s")
    assert stop.value.code == FabricTimeout.exit_code
    assert comm.failed == [("llmd fabric: error: rank 1: the other ranks did not reach the barrier in 600 s", 2)]


@pytest.mark.parametrize("exc", [FabricError("fabric preflight failed: a slow link"), PeerFailed("rank 0 failed")])
def test_failing_together_leaves_failures_every_rank_has_alone(exc: UserError) -> None:
    """The preflight's verdict is raised on every rank alike, and PeerFailed is another rank's failure arriving:
    neither stops the others again. A world of one has no others."""
    comm = _Recorder()
    with pytest.raises(type(exc)), failing_together(comm, "decode"):
        raise exc
    alone = _Recorder()
    alone.size = 1
    with pytest.raises(RuntimeError), failing_together(alone, "decode"):
        raise RuntimeError("x")
    assert comm.failed == [] and alone.failed == []


# ---- the verdict and the record --------------------------------------------------------------------------------------


def test_slow_links_name_each_link_slowest_first() -> None:
    gbps = np.array([[np.nan, 5.0, 0.41], [2.0, np.nan, np.nan], [9.0, 9.0, np.nan]])
    lines = slow_links(gbps, 1.0, ["node1", "node2", "node3"], "prefill")
    assert lines == [
        "prefill rank 1 (node2) -> rank 2 (node3): 0.00 GB/s < 1 GB/s",
        "prefill rank 0 (node1) -> rank 2 (node3): 0.41 GB/s < 1 GB/s",
    ]
    assert slow_links(gbps, 0.3, ["a", "b", "c"], "d") == ["d rank 1 (b) -> rank 2 (c): 0.00 GB/s < 0.3 GB/s"]
    assert _link_of("decode rank 12 (gpu-7) -> rank 3 (gpu 2): data arrived corrupted") == (12, 3)


def _result(n: int = 3) -> PreflightResult:
    gbps = np.arange(n * n, dtype=float).reshape(n, n) + 1.0
    np.fill_diagonal(gbps, np.nan)
    return PreflightResult(
        "decode", 4 << 20, 2, [f"n{k}" for k in range(n)], gbps, np.full((n, n, 2), 0.001), [], "UCX", 1.7e9
    )


def test_record_never_overwrites_and_merge_carries_it(tmp_path: Path) -> None:
    first = write_matrix(tmp_path, _result(), min_gbps=1.0, spec_text="name: x\n")
    second = write_matrix(tmp_path, _result(2), min_gbps=1.0)
    assert first.name == "fabric-decode.h5" and second.name == "fabric-decode-2.h5"
    with h5py.File(first) as f:
        g = f["fabric/decode"]
        assert g["bandwidth_gbps"].shape == (3, 3) and g["times_s"].shape == (3, 3, 2)
        assert list(g.attrs["hostnames"]) == ["n0", "n1", "n2"] and g.attrs["bytes"] == 4 << 20
        assert g.attrs["backend"] == "UCX" and f.attrs["producer"] == "fabric-decode"
    merged = merge_runs([first, second], tmp_path / "run.h5")
    with h5py.File(merged) as f:
        assert sorted(f["fabric"]) == ["decode", "decode#2"]
        np.testing.assert_array_equal(f["fabric/decode/bandwidth_gbps"][()], _result().gbps)
        assert f["fabric/decode#2/bandwidth_gbps"].shape == (2, 2)


def test_fabric_plan_cli_prints_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    from llmd.cli import main

    assert (
        main(
            ["fabric", "plan", "--spec", str(GLM), "--role", "prefill", "--nodes", ",".join(f"g{k}" for k in range(20))]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert [n["node"] for n in doc["nodes"]] == [f"g{k}" for k in range(20)]
    assert doc["nodes"][5]["replica"] == 2 and doc["nodes"][5]["processes"][0]["argv"][2] == "llmd.engines.vllm"
    assert main(["fabric", "plan", "--spec", str(GLM), "--role", "decode", "--nodes", "a,b"]) == 2
    assert "needs 48 nodes" in capsys.readouterr().err


def test_open_comm_without_mpi4py_is_a_world_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmd.fabric import comm as comm_mod

    def no_mpi() -> None:
        raise ImportError("No module named 'mpi4py'")

    monkeypatch.setattr(comm_mod, "MpiComm", no_mpi)
    alone = comm_mod.open_comm(tmp_path, "decode", env={})
    assert (alone.kind, alone.rank, alone.size, alone.allgather("x")) == ("local", 0, 1, ["x"])
    # Still part of a multi-task srun step: the file channel, whatever MPI says.
    step = comm_mod.open_comm(tmp_path, "decode", env={"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "9"})
    assert (step.kind, step.rank, step.size) == ("file", 1, 2)
    assert step.folder == tmp_path / ".fabric" / "decode-9.step.0"
