"""The fabric for real: NIXL transfers, `mpiexec -n 2|4 python -m llmd.fabric` (preflight matrix, fail-fast, sim
engines, discovery, SIGTERM), a singleton, and `llmd fabric preflight` as srun would start it without PMI."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import h5py
import numpy as np
import pytest
from netutil import free_ports

from llmd.spec.layout import DP_RPC_OFFSET

pytest.importorskip("nixl._api")
pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def pool_port(replicas: int, dp: int = 1) -> int:
    """A base port whose layout bands (HTTP, KV events, side channel, replay, per-rank HTTP, DP RPC: +0/1000/.../5000)
    are all free, and all ports: free_ports draws from the ephemeral range, which reaches 60999."""
    for _ in range(100):
        base = free_ports(replicas)
        ranks = replicas * dp
        bands = [base + band + k for band in (1000, 2000, 3000, 4000) for k in range(ranks)]
        if base + DP_RPC_OFFSET + ranks < 65536 and all(
            _free(port) for port in [*bands, *(base + DP_RPC_OFFSET + r for r in range(replicas))]
        ):
            return base
    raise RuntimeError("no free port layout")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_spec(path: Path, model_dir: Path, nodes: int, replicas: int, dp: int = 1) -> Path:
    port = pool_port(replicas, dp)
    path.write_text(
        f"name: fabric-test\nmodel:\n  path: {model_dir}\n  served_name: tiny\n  max_model_len: 512\n"
        "prefill:\n  nodes: 0\n"
        f"decode:\n  nodes: {nodes}\n  replicas: {replicas}\n  dp_size: {dp}\n  port: {port}\n"
        "engine:\n  kind: sim\n  time_scale: 0\n  startup_timeout_s: 120\n"
    )
    return path


def clean_env() -> dict[str, str]:
    # Tests may run inside a Slurm job; its variables would make the bootstrap follow that job's layout.
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PMI_", "HYDRA"))}


def fabric_cmd(spec: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmd.fabric", "--spec", str(spec), "--run-dir", str(run_dir), "--role", "decode"]


def check_matrix(path: Path, n: int, nbytes: int) -> np.ndarray:
    with h5py.File(path) as f:
        g = f["fabric/decode"]
        m = g["bandwidth_gbps"][()]
        assert m.shape == (n, n)
        assert all(math.isnan(m[i, i]) for i in range(n)), "no link from a node to itself"
        off = m[~np.eye(n, dtype=bool)]
        assert np.all(np.isfinite(off)) and np.all(off > 0)
        assert g["times_s"].shape[:2] == (n, n)
        assert list(g.attrs["ranks"]) == list(range(n)) and len(g.attrs["hostnames"]) == n
        assert g.attrs["bytes"] == nbytes and g.attrs["iterations"] >= 1 and g.attrs["backend"] == "UCX"
        assert g.attrs["time"] > 1.6e9 and json.loads(g.attrs["errors"]) == []
        assert f.attrs["producer"] == "fabric-decode"
    return m


@pytest.mark.parametrize("progress_thread", [True, False])
def test_nixl_pair_bandwidth_in_process(progress_thread: bool) -> None:
    from llmd.fabric.preflight import pair_bandwidth

    gbps, errors = pair_bandwidth(4 << 20, 3, progress_thread=progress_thread)
    assert errors == [] and gbps > 0.05


@pytest.mark.integration
def test_mpiexec_4_ranks_measure_every_link_and_fail_fast_naming_them(tmp_path: Path, model_dir: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", model_dir, nodes=4, replicas=2, dp=2)
    run_dir = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "4", *fabric_cmd(spec, run_dir)]
    cmd += ["--preflight-mib", "4", "--preflight-iterations", "2", "--min-gbps", "100000"]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode != 0, out.stderr
    links = re.findall(r"decode rank (\d) \(\S+\) -> rank (\d) \(\S+\): [0-9.]+ GB/s < 100000 GB/s", out.stderr)
    assert {(int(a), int(b)) for a, b in links} == {(i, j) for i in range(4) for j in range(4) if i != j}
    check_matrix(run_dir / "fabric-decode.h5", 4, 4 << 20)
    plan = json.loads((run_dir / "fabric-decode-plan.json").read_text())
    assert [(n["replica"], n["dp_ranks"]) for n in plan["nodes"]] == [(0, [0]), (0, [1]), (1, [0]), (1, [1])]
    assert not (run_dir / "discovery.json").exists(), "no engine starts on a failed fabric"


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _entries(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _complete(url: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "hello fabric", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`: an engine and every child it spawned."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _serve_and_stop(cmd: list[str], run_dir: Path, replicas: int, stderr_path: Path, stop: str = "sigterm") -> str:
    """Start, wait for every replica in discovery, ask each one, then stop: "sigterm" the task (exit 0), "kill-engine"
    (SIGKILL the engine: the task exits 128 + 9) or "kill-task" (SIGKILL the task: its engine must follow it); check
    nothing is left running; returns the task's stderr."""
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stderr=err, start_new_session=True)
    try:
        disc = run_dir / "discovery.json"
        _wait_for(lambda: len(_entries(disc)) == replicas, 420, "discovery entries", proc)
        entries = _entries(disc)
        assert sorted(e["name"] for e in entries) == [f"decode-{r}" for r in range(replicas)]
        for e in entries:
            assert e["url"].startswith("http://127.0.0.1:")
            assert _complete(e["url"])["usage"]["completion_tokens"] >= 1
        if stop == "kill-engine":
            pid = int(re.findall(r"started decode-0 \(pid (\d+)\)", stderr_path.read_text())[0])
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=90) == 128 + signal.SIGKILL
        elif stop == "kill-task":
            proc.kill()
            assert proc.wait(timeout=30) == -signal.SIGKILL
        else:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            # SIGTERM first: a task killed outright could not stop its engines (they would only get PDEATHSIG).
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = stderr_path.read_text()
    pids = [int(p) for p in re.findall(r"started decode-\d+ \(pid (\d+)\)", text)]
    assert len(pids) == replicas
    deadline = time.monotonic() + 30
    while any(_alive(p) or _group_members(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) or _group_members(p) for p in pids), "an engine (or its children) outlived the task"
    assert len(_entries(run_dir / "discovery.json")) == replicas, "nothing written is removed"
    return text


@pytest.mark.integration
def test_mpiexec_2_ranks_preflight_engines_discovery_and_sigterm(tmp_path: Path, model_dir: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", model_dir, nodes=2, replicas=2)
    run_dir = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", *fabric_cmd(spec, run_dir), "--preflight-mib", "4", "--preflight-iterations", "2"]
    text = _serve_and_stop(cmd, run_dir, 2, tmp_path / "stderr.txt")
    check_matrix(run_dir / "fabric-decode.h5", 2, 4 << 20)
    assert "signal SIGTERM: stopping the engines" in text
    assert sorted(p.name for p in (run_dir / "logs" / "engines").iterdir()) == ["decode-0.log", "decode-1.log"]


@pytest.mark.integration
def test_mpiexec_2_ranks_agree_on_a_dp_replicas_rpc_port_and_side_channels(tmp_path: Path) -> None:
    """vLLM with P/D on `port: auto` with one DP replica over both nodes: the plan each rank starts from gives the head
    and the headless node the same free RPC port, and each its own nonzero NIXL side-channel base, no two ports alike
    (both ranks share 127.0.0.1: rank 0 chose for both). Engines that exit at once stand in for vLLM: only the plan is
    checked."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: fabric-dp-rpc\nmodel:\n  path: models/tiny\n  max_model_len: 512\nprefill:\n  nodes: 1\n  port: auto\n"
        "decode:\n  nodes: 2\n  dp_size: 2\n  gpus_per_node: 1\n  port: auto\nengine:\n  kind: vllm\n"
    )
    run_dir = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", *fabric_cmd(spec, run_dir), "--no-preflight", "--python", "/bin/false"]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "decode-0 exited with code 1 before it was healthy" in out.stderr, out.stderr
    plan = json.loads((run_dir / "fabric-decode-plan.json").read_text())
    procs = [proc for node in plan["nodes"] for proc in node["processes"]]
    ports = {int(p["argv"][p["argv"].index("--data-parallel-rpc-port") + 1]) for p in procs}
    assert len(procs) == 2 and len(ports) == 1 and 0 not in ports, ports
    assert [p["dp_ranks"] for p in procs] == [[0], [1]]
    bases = [int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for p in procs]  # rank 0's: vLLM adds the rank
    sides = [base + p["dp_ranks"][0] for base, p in zip(bases, procs, strict=True)]
    assert 0 not in bases and len({*sides, *ports}) == 3, (sides, ports)


@pytest.mark.integration
def test_mpiexec_one_rank_failing_before_the_engines_start_stops_every_rank_at_once(
    tmp_path: Path, model_dir: Path
) -> None:
    """Rank 1 alone fails while bringing the component up (here: started for a pool the spec does not have) after
    rank 0 went on to the next collective step. Rank 0 must not wait there for its 600 s timeout (nor the failed rank
    in MPI_Finalize for rank 0): the job ends at once with rank 1's reason and its exit code, no engine started."""
    spec = write_spec(tmp_path / "spec.yaml", model_dir, nodes=2, replicas=2)
    run_dir = tmp_path / "run"
    rank0 = [*fabric_cmd(spec, run_dir), "--no-preflight"]
    rank1 = [*rank0[: rank0.index("--role")], "--role", "prefill", "--no-preflight"]
    cmd = [str(MPIEXEC), "-n", "1", *rank0, ":", "-n", "1", *rank1]
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60, out.stderr
    assert out.returncode == 2, out.stderr
    # What rank 1 printed before MPI_Abort reaches mpiexec's stderr only if hydra forwarded it before the kill (on a
    # loaded machine it may not): the exit code and the time are what the abort guarantees.
    assert not (run_dir / "logs" / "engines").exists(), out.stderr


@pytest.mark.integration
def test_mpiexec_2_ranks_a_headless_node_moves_its_taken_replay_port(tmp_path: Path) -> None:
    """The same replica on the layout's ports, rank 1's KV replay port (P + 3000 + 1) taken: the headless node hands
    that socket to vLLM as `tcp://*:0` and keeps its agreed side channel; the head keeps its free replay port.
    Engines that print their command line and exit stand in for vLLM."""
    base = pool_port(1, 2)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: fabric-replay\nmodel:\n  path: models/tiny\n  max_model_len: 512\nprefill:\n  nodes: 1\n  port: auto\n"
        f"decode:\n  nodes: 2\n  dp_size: 2\n  gpus_per_node: 1\n  port: {base}\nengine:\n  kind: vllm\n"
    )
    run_dir = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", *fabric_cmd(spec, run_dir), "--no-preflight", "--python", "/bin/echo"]
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", base + 3001))
        squat.listen()
        out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert "decode-0 exited with code 0 before it was healthy" in out.stderr, out.stderr
    logs = run_dir / "logs" / "engines"

    def started_with(name: str) -> tuple[list[str], dict]:
        argv = (logs / f"{name}.log").read_text().split()
        return argv, json.loads(argv[argv.index("--kv-events-config") + 1])

    head_argv, head = started_with("decode-0")
    headless_argv, headless = started_with("decode-0-node1")
    assert head["replay_endpoint"] == f"tcp://127.0.0.1:{base + 3000}", "free at rank 0: kept"
    assert headless["replay_endpoint"] == "tcp://*:0", "taken at rank 1: vLLM binds a free one"
    assert "--headless" in headless_argv and head_argv[head_argv.index("--port") + 1] == str(base)
    plan = json.loads((run_dir / "fabric-decode-plan.json").read_text())
    env = [proc["env"] for node in plan["nodes"] for proc in node["processes"]]
    assert [e["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in env] == [str(base + 2000)] * 2, "free: the layout's, agreed"


@pytest.mark.integration
def test_singleton_without_a_launcher_is_one_node_and_dies_with_its_engine(tmp_path: Path, model_dir: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", model_dir, nodes=1, replicas=1)
    run_dir = tmp_path / "run"
    cmd = [*fabric_cmd(spec, run_dir), "--preflight-mib", "1", "--preflight-iterations", "1"]
    text = _serve_and_stop(cmd, run_dir, 1, tmp_path / "stderr.txt", stop="kill-engine")
    assert text.splitlines()[-1].endswith("decode-0: engine exited with code -9"), "the cause comes last"
    log_lines = (run_dir / "logs" / "engines" / "decode-0.log").read_text().splitlines()
    assert log_lines and log_lines[-1] in text, "the engine's log tail is on stderr"
    with h5py.File(run_dir / "fabric-decode.h5") as f:
        assert f["fabric/decode/bandwidth_gbps"].shape == (1, 1)


@pytest.mark.integration
def test_engine_follows_a_task_killed_outright(tmp_path: Path, model_dir: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", model_dir, nodes=1, replicas=1)
    run_dir = tmp_path / "run"
    _serve_and_stop([*fabric_cmd(spec, run_dir), "--no-preflight"], run_dir, 1, tmp_path / "stderr.txt", "kill-task")


@pytest.mark.integration
def test_preflight_cli_as_srun_tasks_without_pmi(tmp_path: Path) -> None:
    """Two singleton tasks that only Slurm's variables tie together exchange metadata through the run folder."""
    procs = []
    for rank in range(2):
        env = {**clean_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77"}
        cmd = [sys.executable, "-m", "llmd.cli", "fabric", "preflight", "--run-dir", str(tmp_path), "--mib", "2"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1].decode()[-2000:]
    assert "GB/s (row: from, column: to)" in outs[0][0].decode()
    assert list((tmp_path / ".fabric").iterdir()), "the exchange went through files"
    with h5py.File(tmp_path / "fabric-preflight.h5") as f:
        m = f["fabric/preflight/bandwidth_gbps"][()]
        assert m.shape == (2, 2) and m[0, 1] > 0 and m[1, 0] > 0


@pytest.mark.vllm
def test_singleton_starts_real_vllm_from_the_plan(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """engine.kind vllm: the plan's own command line (llmd.engines.vllm) serves, is announced, and stops cleanly."""
    pytest.importorskip("vllm")
    from llmd.models.tiny import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("models") / "tiny", weights=True)
    port = pool_port(1)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: fabric-vllm\nmodel:\n  path: {model}\n  served_name: tiny\n  block_size: 32\n  max_model_len: 1024\n"
        f"prefill:\n  nodes: 0\ndecode:\n  nodes: 1\n  port: {port}\n  max_num_seqs: 8\n"
        '  extra_args: ["--enforce-eager", "--kv-cache-memory-bytes", "268435456"]\n'
        "kv:\n  gpu_memory_fraction: 0.25\nengine:\n  kind: vllm\n  startup_timeout_s: 400\n"
        '  env:\n    HF_HUB_OFFLINE: "1"\n'
    )
    run_dir = tmp_path / "run"
    text = _serve_and_stop([*fabric_cmd(spec, run_dir), "--no-preflight"], run_dir, 1, tmp_path / "stderr.txt")
    assert "signal SIGTERM: stopping the engines" in text
    assert not (run_dir / "fabric-decode.h5").exists(), "--no-preflight measures nothing"
    assert "vllm.entrypoints.openai.api_server" in (run_dir / "fabric-decode-plan.json").read_text()


@pytest.mark.vllm
def test_mpiexec_2_ranks_real_vllm_headless_replay_port_taken(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A real vLLM DP replica over two nodes whose headless rank's layout replay port (P + 3000 + 1) is taken: that
    node hands it to vLLM to pick, the head's /kv_event_sources reports what rank 1 bound, and the head's discovery
    entry lists it (the replica serves, so rank 1 started)."""
    pytest.importorskip("vllm")
    from llmd.models.tiny import make_tiny

    model = make_tiny(tmp_path_factory.mktemp("models") / "tiny", weights=True)
    port = pool_port(1, 2)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: fabric-vllm-dp\nmodel:\n  path: {model}\n  served_name: tiny\n  block_size: 32\n  max_model_len: 1024\n"
        f"prefill:\n  nodes: 0\ndecode:\n  nodes: 2\n  dp_size: 2\n  gpus_per_node: 1\n  port: {port}\n"
        '  max_num_seqs: 8\n  extra_args: ["--enforce-eager", "--kv-cache-memory-bytes", "134217728"]\n'
        "kv:\n  gpu_memory_fraction: 0.25\nengine:\n  kind: vllm\n  startup_timeout_s: 400\n"
        '  env:\n    HF_HUB_OFFLINE: "1"\n'
    )
    run_dir = tmp_path / "run"
    cmd = [str(MPIEXEC), "-n", "2", *fabric_cmd(spec, run_dir), "--no-preflight"]
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", port + 3001))
        squat.listen()
        _serve_and_stop(cmd, run_dir, 1, tmp_path / "stderr.txt")
    (entry,) = _entries(run_dir / "discovery.json")
    head, rank1 = entry["kv_events_replay_endpoints"]
    assert head == f"tcp://127.0.0.1:{port + 3000}", "free at rank 0: the layout's"
    assert rank1.startswith("tcp://127.0.0.1:") and rank1 != f"tcp://127.0.0.1:{port + 3001}", entry


def _slurm_problem() -> str | None:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "no Slurm here (srun/sinfo not on PATH)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s"
    up = [ln for ln in out.stdout.splitlines() if ln.split()[-1].rstrip("*") in ("idle", "mixed", "allocated")]
    return None if out.returncode == 0 and len(up) >= 2 else f"fewer than 2 usable nodes: {out.stdout.strip()!r}"


@pytest.mark.slurm
@pytest.mark.parametrize("mpi", ["pmi2", "none"])
def test_preflight_under_srun(tmp_path: Path, mpi: str) -> None:
    """One task per node under srun: an MPI world through Slurm's PMI2, or singletons that meet through files."""
    problem = _slurm_problem()
    if problem:
        if os.environ.get("LLMD_REQUIRE_SLURM") == "1":
            pytest.fail(f"LLMD_REQUIRE_SLURM=1 but {problem}")
        pytest.skip(problem)
    cmd = ["srun", "-N2", "--ntasks-per-node=1", f"--mpi={mpi}", "-t", "5", sys.executable, "-m", "llmd.cli"]
    cmd += ["fabric", "preflight", "--run-dir", str(tmp_path), "--mib", "4", "--iterations", "2", "--label", "decode"]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / ".fabric").exists() == (mpi == "none")
    m = check_matrix(tmp_path / "fabric-decode.h5", 2, 4 << 20)
    with h5py.File(tmp_path / "fabric-decode.h5") as f:
        names = list(f["fabric/decode"].attrs["hostnames"])
    assert len(set(names)) == 2, f"Slurm's node names, not the shared hostname: {names}"
    assert m.shape == (2, 2)
