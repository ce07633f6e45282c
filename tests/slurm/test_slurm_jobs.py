"""Real jobs on the local Slurm cluster (slurm/local-cluster.sh: slurmctld, 4 slurmd, slurmdbd): a spec as one het
job with simulated engines, end to end into HDF5; a dying engine tearing the whole job down with its cause; cancel;
the plain sbatch template; requeue keeping the rows of the first attempt."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import h5py
import pytest
import yaml
from conftest import job_active, llmd, run_dirs, run_state, wait_for, write_spec

from llmd.metrics import read_meta, read_requests, read_timeseries
from llmd.report.summary import client_rows

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.usefixtures("slurm_cluster")]

# A workload that keeps going until its duration is up (smoke alone ends after a few sessions).
LONG = {"profile": "smoke", "concurrency": 4, "params": {"sessions_per_agent": 1000}}


def _sacct(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
    )
    return dict(ln.split("|", 1) for ln in out.stdout.splitlines() if "|" in ln)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


STARTERS = ["basic"] + (["fabric"] if importlib.util.find_spec("llmd.fabric") else [])


def _squat(port: int) -> tuple[ThreadingHTTPServer, list[str]]:
    """Someone else's server on the spec's router port (the local cluster's nodes share this machine's loopback)."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hits


@pytest.mark.parametrize("starter", STARTERS)
def test_het_job_runs_end_to_end_into_hdf5(tmp_path: Path, tiny_tokenizer: Path, jobs: list[str], starter: str) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "e2e")
    # The spec's router port is taken: the router takes a free one, publishes it, and the client follows that.
    squatter, hits = _squat(int(yaml.safe_load(spec.read_text())["router"]["port"]))
    try:
        res = llmd("launch", str(spec), "--starter", starter, "--gpus", "no", cwd=tmp_path)
    finally:
        squatter.shutdown()
        squatter.server_close()
    (run,) = run_dirs(tmp_path, "e2e")
    state = run_state(run)
    jobs.append(state["job_id"])
    assert res.returncode == 0, res.stdout + res.stderr + (run / "logs" / "main.log").read_text()
    assert "submitted job" in res.stdout and "COMPLETED" in res.stdout
    assert state["state"] == "COMPLETED" and state["cause"] is None
    assert hits == [] and not state["router"]["url"].endswith(f":{yaml.safe_load(spec.read_text())['router']['port']}")
    assert len(state["run_id"]) == 16
    # three components on three different nodes, read from `scontrol show hostnames`
    nodes = state["nodes"]
    assert set(nodes) == {"main", "prefill", "decode"}
    assert len({n for ns in nodes.values() for n in ns}) == 3
    every = read_requests(run / "metrics.h5")
    df = client_rows(every)
    assert len(df) == state["progress"]["requests"] > 0
    assert (df["status"] == 200).mean() > 0.9
    entries = {e["name"] for e in json.loads((run / "discovery.json").read_text())}
    assert entries == {"prefill-0", "decode-0"}
    # One run file from every producer: the router saw each client request, the engines wrote their series.
    sources = set(read_meta(run / "metrics.h5")["sources"])
    assert {"client", "router"} <= sources and any(s.startswith(("prefill-0", "decode-0")) for s in sources)
    routed = every[every["source"] == "router"]
    assert set(df["request_id"]) <= set(routed["request_id"])
    engine_ts = read_timeseries(run / "metrics.h5")
    assert engine_ts["source"].astype(str).str.startswith("decode-0").any()
    if starter == "fabric":
        assert (run / "fabric-decode.h5").exists()
        with h5py.File(run / "metrics.h5", "r") as f:
            assert "fabric" in f and "decode" in f["fabric"]
    assert set(_sacct(state["job_id"]).values()) == {"COMPLETED"}
    status = llmd("status", state["job_id"], cwd=tmp_path)
    assert status.returncode == 0 and "COMPLETED" in status.stdout and str(run / "metrics.h5") in status.stdout


@pytest.mark.parametrize("how", ["kill-engine", "scancel-component"])
def test_dead_component_tears_the_job_down_and_says_why(
    tmp_path: Path, tiny_tokenizer: Path, jobs: list[str], how: str
) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "kill", workload={**LONG, "duration_s": 120}, engine={"time_scale": 1})
    res = llmd("launch", str(spec), "--starter", "basic", "--gpus", "no", "--no-follow", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (run,) = run_dirs(tmp_path, "kill")
    job_id = run_state(run)["job_id"]
    jobs.append(job_id)
    wait_for(lambda: run_state(run).get("progress", {}).get("requests", 0) > 0, 90, "requests flowing")
    pids = {p.stem: int(p.read_text()) for p in (run / "engines").glob("*.pid")}
    if how == "kill-engine":
        os.kill(pids["decode-0"], signal.SIGKILL)
        said = "decode-0: engine exited with code -9"
    else:  # cancel the decode component alone (het component 2), not the job
        subprocess.run(["scancel", f"{job_id}+2"], check=True, timeout=30)
        said = "CANCELLED"
    wait_for(lambda: not job_active(job_id), 60, "the whole job to end")
    status = llmd("status", str(run), cwd=tmp_path)
    assert "state:    FAILED" in status.stdout, status.stdout
    assert "decode component exited" in status.stdout and said in status.stdout, status.stdout
    components = _sacct(job_id)
    assert components[f"{job_id}+0"] == "FAILED"  # the main job's verdict
    assert {st.split()[0] for st in components.values()} <= {"FAILED", "CANCELLED"}
    assert not _alive(pids["prefill-0"]), "the prefill engine outlived the job"
    # the rows recorded before the failure are kept
    state = run_state(run)
    assert (
        state["state"] == "FAILED"
        and len(client_rows(read_requests(run / "metrics.h5"))) == state["progress"]["requests"] > 0
    )


def test_cancel_ends_the_job(tmp_path: Path, tiny_tokenizer: Path, jobs: list[str]) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "cancel", workload={**LONG, "duration_s": 120})
    assert llmd("launch", str(spec), "--starter", "basic", "--gpus", "no", "--no-follow", cwd=tmp_path).returncode == 0
    (run,) = run_dirs(tmp_path, "cancel")
    job_id = run_state(run)["job_id"]
    jobs.append(job_id)
    wait_for(lambda: run_state(run).get("phase") == "benchmark", 90, "the benchmark to start")
    res = llmd("cancel", job_id, cwd=tmp_path)
    assert res.returncode == 0 and f"cancelled job {job_id}" in res.stdout
    wait_for(lambda: not job_active(job_id), 60, "the job to end")
    status = llmd("status", str(run), cwd=tmp_path)
    assert "state:    CANCELLED" in status.stdout and "llmd cancel" in status.stdout, status.stdout
    again = llmd("cancel", str(run), cwd=tmp_path)
    assert again.returncode == 0 and "already ended" in again.stdout


def test_plain_sbatch_template_submits_and_runs(tmp_path: Path, tiny_tokenizer: Path) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "plain")
    res = llmd("launch", str(spec), "--render-sbatch", "--gpus", "no", "--starter", "basic", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(res.stdout)
    sub = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.split()[-1]
    try:
        (run,) = run_dirs(tmp_path, "plain")
        wait_for(lambda: not job_active(job_id), 180, "the hand-submitted job to end")
        state = run_state(run)
        assert state["state"] == "COMPLETED" and state["job_id"] == job_id, state
        assert len(client_rows(read_requests(run / "metrics.h5"))) == state["progress"]["requests"] > 0
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def test_aggregated_spec_runs_two_decode_replicas(tmp_path: Path, tiny_tokenizer: Path, jobs: list[str]) -> None:
    """prefill.nodes 0: no prefill component; two decode nodes, one replica each, both listed for the router."""
    spec = write_spec(tmp_path, tiny_tokenizer, "agg", prefill={"nodes": 0}, decode={"nodes": 2, "replicas": 2})
    res = llmd("launch", str(spec), "--starter", "basic", "--gpus", "no", cwd=tmp_path)
    (run,) = run_dirs(tmp_path, "agg")
    state = run_state(run)
    jobs.append(state["job_id"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(2 components)" in res.stdout
    assert set(state["nodes"]) == {"main", "decode"} and len(state["nodes"]["decode"]) == 2
    entries = {e["name"] for e in json.loads((run / "discovery.json").read_text())}
    assert entries == {"decode-0", "decode-1"}
    df = read_requests(run / "metrics.h5")
    assert len(df) > 0 and set(df["pod"].astype(str)) <= {"decode-0", "decode-1"}


def test_sbatch_refusal_is_a_user_error(tmp_path: Path, tiny_tokenizer: Path) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "refused", slurm={"partition": "no-such-partition"})
    res = llmd("launch", str(spec), "--starter", "basic", cwd=tmp_path)
    assert res.returncode == 2 and "llmd: error: sbatch refused the job" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    (run,) = run_dirs(tmp_path, "refused")
    assert run_state(run)["state"] == "FAILED" and "partition" in run_state(run)["cause"]


def _interrupt(how: str, job_id: str, run: Path) -> str | None:
    """End the first attempt of a --requeue run the way `how` names; returns a node to put back in service."""
    if how == "scontrol-requeue":
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        return None
    if how == "preemption-signal":
        # Preemption and the time limit reach the job as submitit's signal (USR2, --signal=USR2@90): the main job
        # is checkpointed and submitit requeues it.
        subprocess.run(["scancel", "--signal=USR2", f"{job_id}+0"], check=True, timeout=30)
        return None
    # A node going DOWN, what slurmctld does when a node stops answering.
    (node,) = run_state(run)["nodes"]["decode"]
    cmd = ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=llmd-test-node-failure"]
    subprocess.run(cmd, check=True, timeout=30)
    return node


def _nudge_if_eligible(job_id: str) -> None:
    """A pending het job past its begin time gets a no-op update (its own comment), which wakes the backfill pass."""
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    if out[:2] == ["PENDING", "None"]:
        cmd = ["scontrol", "update", f"JobId={job_id}", "Comment=llmd-requeue-test"]
        subprocess.run(cmd, capture_output=True, timeout=30)


@pytest.mark.parametrize("how", ["scontrol-requeue", "preemption-signal", "node-failure"])
def test_requeue_resumes_and_keeps_earlier_rows(
    tmp_path: Path, tiny_tokenizer: Path, jobs: list[str], how: str
) -> None:
    spec = write_spec(tmp_path, tiny_tokenizer, "rq", workload={**LONG, "duration_s": 14}, engine={"time_scale": 1})
    res = llmd("launch", str(spec), "--starter", "basic", "--gpus", "no", "--requeue", "--no-follow", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (run,) = run_dirs(tmp_path, "rq")
    job_id = run_state(run)["job_id"]
    jobs.append(job_id)
    wait_for(lambda: run_state(run).get("progress", {}).get("requests", 0) > 0, 90, "requests flowing")
    node = _interrupt(how, job_id, run)
    try:
        # Slurm holds a requeued het job for cred_expire (10 s here); then only a backfill pass starts it (het jobs),
        # and backfill skips its passes while nothing on the cluster changes: on this otherwise idle cluster the job
        # sat pending for 50-100 s. A no-op update of the pending job is such a change (a busy cluster has plenty).
        def second_attempt() -> bool:
            if run_state(run).get("attempt") == 1:
                return True
            _nudge_if_eligible(job_id)
            return False

        wait_for(second_attempt, 240, "the second attempt", step=2)
        wait_for(lambda: not job_active(job_id), 120, "the job to end", step=2)
    finally:
        if node is not None:  # ReturnToService=2 here: its slurmd re-registering may have brought it back already
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)
    state = run_state(run)
    assert state["state"] == "COMPLETED", state
    first = read_requests(run / "parts" / "attempt-0" / "metrics.h5")
    second = read_requests(run / "parts" / "attempt-1" / "metrics.h5")
    assert len(first) > 0 and len(second) > 0
    assert len(client_rows(read_requests(run / "metrics.h5"))) == len(first) + len(second)
    # each attempt's engines wrote their own files; none was overwritten
    assert {p.name.split("-a")[-1][0] for p in (run / "parts" / "engines").glob("*.h5")} == {"0", "1"}
    if how == "node-failure":
        history = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "JobID,State"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert "NODE_FAIL" in history, history  # Slurm's own record of why the first attempt ended
