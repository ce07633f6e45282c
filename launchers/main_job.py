"""Component 0 of a run's het job: wait for the engines in the discovery file, start the router on it, drive the
benchmark client through the router into this attempt's HDF5 part, and merge every attempt's part into metrics.h5.

It watches the engine components all along (their srun exit codes land in RUN/exit/<role>.rc): when one dies, the
benchmark stops (its rows so far are kept), the run is marked FAILED with the cause, and the non-zero exit ends the
batch script, so Slurm kills every step left and nothing keeps holding nodes. Run by submitit (`MainJob`, which also
checkpoints for requeue) or directly (`python -m launchers.main_job`, the plain sbatch template).

In one homogeneous allocation (a sweep's array task; Slurm has no arrays of het jobs) `run_allocation` first does what
the het job's batch script does: it splits the allocation's nodes into the same groups (main, prefill, decode), starts
each engine group as an srun step on its nodes, and then runs this same main job on the first node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from launchers.plan import ENGINE_STARTERS, plan_job
from launchers.runstate import is_final, read_state, update_state
from llmd import runid
from llmd.children import die_with_parent
from llmd.discovery import FILE_NAME, read_discovery
from llmd.engines.vllm_server import EngineStartError, log_tail, stop_process_group, wait_healthy
from llmd.errors import UserError
from llmd.metrics.run_files import run_inputs
from llmd.spec import DeploymentSpec, load_spec
from llmd.spec.layout import engine_endpoints
from llmd.spec.redact import redact_text

POLL_S = 1.0
PROGRESS_EVERY_S = 3.0


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the cause recorded in run.json."""


class Interrupted(Exception):
    """Slurm is ending this attempt (requeue, preemption, time limit, cancel): keep the rows, leave the verdict to
    Slurm's state."""


def _engine_exit(run_dir: Path) -> str | None:
    """The cause, if an engine component's srun has ended (engines never end on their own while the run is on)."""
    for rc_file in sorted((run_dir / "exit").glob("*.rc")):
        role = rc_file.stem
        code = rc_file.read_text().strip() or "?"
        logs = sorted((run_dir / "logs").glob(f"{role}-*.log"))
        last = ""
        for log in logs:
            lines = [ln for ln in log_tail(log, 20).splitlines() if ln.strip()]
            if lines:
                last = lines[-1].strip()
        where = f"; logs {', '.join(str(p) for p in logs)}" if logs else ""
        said = f": {last}" if last else ""
        return f"{role} component exited with code {code}{said}{where}"
    return None


def _rows(path: Path) -> int:
    if not path.exists():
        return 0
    try:
        from llmd.metrics.reader import open_metrics

        with open_metrics(path) as f:
            if "requests" not in f:
                return 0
            if f.attrs.get("producer") != "merge":
                return int(f["requests"].shape[0])
        # A merged file also holds the router's row for each request: count the clients' rows only.
        from llmd.metrics.reader import read_requests
        from llmd.report.summary import client_rows

        return len(client_rows(read_requests(path)))
    except (OSError, KeyError, ValueError):
        return 0  # being created, or a killed writer's file: counted once it is readable


def _readable(path: Path) -> bool:
    try:
        from llmd.metrics.reader import open_metrics

        with open_metrics(path):
            return True
    except (OSError, KeyError, ValueError):
        return False


def _parts(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "parts").glob("attempt-*/metrics.h5"), key=lambda p: int(p.parent.name.split("-")[1]))


def merge_parts(run_dir: Path) -> Path | None:
    """metrics.h5 = every attempt's rows; rebuilt beside and swapped in, so a failed merge never loses the old one."""
    from llmd.metrics.merge import merge_runs

    clients = [p for p in _parts(run_dir) if _rows(p) > 0]
    if not clients:
        return None
    # The router's, the engines' and the fabric preflight's files join the clients' (llmd.metrics.run_files); one
    # that cannot be read yet (a writer that has not flushed its first chunk) is left out rather than failing the run.
    others = [p for p in run_inputs(run_dir) if p not in clients and p.name != "metrics.h5" and _readable(p)]
    out = run_dir / "metrics.h5"
    tmp = run_dir / ".metrics.h5.merging"
    merge_runs([*clients, *others], tmp, overwrite=True)
    os.replace(tmp, out)
    return out


def _listed(discovery: Path) -> set[str]:
    try:
        return {e.name for e in read_discovery(discovery)}
    except UserError as exc:  # only publish writes it, atomically: a bad file will not mend itself
        raise RunFailed(str(exc)) from None


def _wait_for_engines(run_dir: Path, names: set[str], timeout_s: float, stop: dict[str, int]) -> None:
    deadline = time.monotonic() + timeout_s
    discovery = run_dir / FILE_NAME
    while time.monotonic() < deadline:
        if stop["sig"]:
            raise Interrupted()
        cause = _engine_exit(run_dir)
        if cause:
            raise RunFailed(f"before all engines were ready: {cause}")
        if names <= _listed(discovery):
            return
        time.sleep(POLL_S)
    missing = sorted(names - _listed(discovery))
    raise RunFailed(f"engines {', '.join(missing)} not ready after {timeout_s:.0f} s; see {run_dir / 'logs'}")


def _router_url(port_file: Path, proc: subprocess.Popen, timeout_s: float, log: Path) -> str:
    """The URL the router bound and wrote to `port_file` (the spec's port, or a free one when that was taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return str(json.loads(port_file.read_text())["url"])
        except (FileNotFoundError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            raise EngineStartError(f"router exited with code {proc.returncode} before it listened; log {log}:\n"
                                   f"{log_tail(log)}")  # fmt: skip
        time.sleep(0.1)
    raise EngineStartError(f"router did not listen within {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")


def _start_router(spec_path: Path, run_dir: Path, metrics_out: Path, run_id: str) -> tuple[subprocess.Popen, str]:
    """The router, started on this node and proven to be this run's: (process, the URL it published)."""
    log = run_dir / "logs" / "router.log"
    port_file = metrics_out.parent / "router-port.json"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-u", "-m", "llmd.cli", "router", "--spec", str(spec_path)]
    cmd += ["--discovery", str(run_dir / FILE_NAME), "--host", "127.0.0.1", "--port-file", str(port_file)]
    cmd += ["--metrics-out", str(metrics_out)]
    env = {**os.environ, runid.ENV: run_id}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env, preexec_fn=die_with_parent()
        )
    try:
        url = _router_url(port_file, proc, 120, log)
        wait_healthy(f"{url}/health", proc, 120, log, name="router", run_id=run_id)
    except EngineStartError as exc:
        stop_process_group(proc, grace_s=5)
        raise RunFailed(str(exc)) from None
    return proc, url


def run_main(spec_path: Path, run_dir: Path) -> int:
    spec = load_spec(spec_path)
    # Made by the launcher and exported by the batch script to every component; a main job started by hand makes one.
    run_id = runid.from_env() or runid.new_run_id()
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    job_id = os.environ.get("SLURM_JOB_ID") or None
    nodes = {}
    for f in sorted(run_dir.glob("nodes-*.txt")):
        nodes[f.stem.removeprefix("nodes-")] = f.read_text().split()
    before = read_state(run_dir) if (run_dir / "run.json").exists() else {}
    done_s = sum(float(v) for k, v in before.get("attempt_elapsed_s", {}).items() if int(k) < attempt)
    remaining = spec.workload.duration_s - done_s
    update_state(
        run_dir, state="RUNNING", phase="starting engines", attempt=attempt, nodes=nodes, cause=None, job_id=job_id,
        run_id=run_id,
        logs={"main": str(run_dir / "logs" / "main.log"), "router": str(run_dir / "logs" / "router.log"),
              "engines": str(run_dir / "logs" / "{prefill,decode}-*.log")},
    )  # fmt: skip
    router: subprocess.Popen | None = None
    bench: subprocess.Popen | None = None
    stop = {"sig": 0}

    def on_term(signum: int, _frame: object) -> None:
        stop["sig"] = signum

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        names = {ep.name for ep in engine_endpoints(spec)}
        _wait_for_engines(run_dir, names, spec.engine.startup_timeout_s + 30, stop)
        update_state(run_dir, phase="starting router")
        part = run_dir / "parts" / f"attempt-{attempt}"
        while part.exists():  # an attempt re-run under the same restart count: never overwrite its rows
            part = part.with_name(part.name + "b")
        part.mkdir(parents=True)
        router, url = _start_router(spec_path, run_dir, part / "router.h5", run_id)
        # What the router bound, not the spec's number: `llmd status` and anyone sending load read it here.
        update_state(run_dir, router={"url": url})
        if remaining <= 0:
            update_state(run_dir, phase="benchmark already complete in earlier attempts")
        else:
            bench_log = run_dir / "logs" / f"bench-{attempt}.log"
            cmd = [sys.executable, "-u", "-m", "llmd.cli", "bench", "--spec", str(spec_path)]
            cmd += ["--url", url, "--run-id", run_id, "--output", str(part.parent), "--run", part.name]
            cmd += ["--duration", f"{remaining:g}", "--no-progress"]
            update_state(run_dir, phase="benchmark", logs={"bench": str(bench_log)})
            with open(bench_log, "ab") as fh:
                bench = subprocess.Popen(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent()
                )
            t0, last = time.monotonic(), 0.0
            earlier = sum(_rows(p) for p in _parts(run_dir) if p.parent != part)
            while bench.poll() is None:
                if stop["sig"]:
                    bench.send_signal(signal.SIGINT)
                    raise Interrupted()
                cause = _engine_exit(run_dir)
                if cause is None and router.poll() is not None:
                    cause = f"router exited with code {router.returncode}; see {run_dir / 'logs' / 'router.log'}"
                if cause:
                    bench.send_signal(signal.SIGINT)  # stops cleanly: in-flight requests recorded, file closed
                    raise RunFailed(cause)
                if time.monotonic() - last > PROGRESS_EVERY_S:
                    last = time.monotonic()
                    elapsed = last - t0
                    update_state(
                        run_dir,
                        progress={"requests": earlier + _rows(part / "metrics.h5"), "elapsed_s": round(elapsed, 1)},
                        attempt_elapsed_s={str(attempt): round(elapsed, 1)},
                    )
                time.sleep(POLL_S)
            update_state(run_dir, attempt_elapsed_s={str(attempt): round(time.monotonic() - t0, 1)})
            if stop["sig"]:
                raise Interrupted()
            if bench.returncode != 0:
                raise RunFailed(f"benchmark client exited with code {bench.returncode}:\n{log_tail(bench_log, 15)}")
        stop_process_group(router, grace_s=10)  # SIGTERM: the router closes its file, so the merge has every row
        result = merge_parts(run_dir)
        total = _rows(result) if result else 0
        update_state(
            run_dir, state="COMPLETED", phase="done", result=str(result) if result else None,
            progress={"requests": total},
        )  # fmt: skip
        print(f"llmd main job: done, {total} requests in {result}", flush=True)
        return 0
    except Interrupted:
        # Slurm gives KillWait seconds before SIGKILL: enough for the client to close its file and for the merge.
        if bench is not None:
            try:
                bench.wait(timeout=3)
            except subprocess.TimeoutExpired:
                stop_process_group(bench, grace_s=1)
        try:
            merge_parts(run_dir)
        except Exception as merge_exc:
            print(f"llmd main job: merging parts failed: {merge_exc}", file=sys.stderr)
        if not is_final(read_state(run_dir).get("state", "")):  # `llmd cancel` may have said why already
            update_state(
                run_dir, state="INTERRUPTED", phase="stopped by Slurm (requeue, preemption, time limit or cancel)"
            )
        print("llmd main job: stopped by SIGTERM; rows so far kept", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except RunFailed as exc:
        if bench is not None:
            try:
                bench.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop_process_group(bench, grace_s=5)
        result = None
        try:
            result = merge_parts(run_dir)
        except Exception as merge_exc:  # the cause matters more than the merge; the parts stay on disk
            print(f"llmd main job: merging parts failed: {merge_exc}", file=sys.stderr)
        update_state(
            run_dir, state="FAILED", phase="failed", cause=str(exc), result=str(result) if result else None,
            progress={"requests": _rows(result) if result else 0},
        )  # fmt: skip
        # The cause may quote an engine's or the client's log: no token it printed goes on to main.log.
        print(f"llmd main job: FAILED: {redact_text(str(exc))}", file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in (bench, router):
            if proc is not None:
                stop_process_group(proc, grace_s=2)


class MainJob:
    """The callable submitit pickles: on preemption or timeout submitit calls `checkpoint` and requeues the job; the
    next attempt starts fresh engines and benchmarks for the remaining duration into a new part file."""

    def __init__(self, spec_path: Path, run_dir: Path) -> None:
        self.spec_path = Path(spec_path)
        self.run_dir = Path(run_dir)

    def __call__(self) -> int:
        return run_main(self.spec_path, self.run_dir)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        update_state(self.run_dir, state="REQUEUED", phase="requeued (preempted or out of time)")
        return submitit.helpers.DelayedSubmission(self)


def allocation_nodes() -> list[str]:
    """This job's nodes in Slurm's order (the first is the batch host), from `scontrol show hostnames`."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise RunFailed("SLURM_JOB_NODELIST is not set: run_allocation runs inside a Slurm allocation")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RunFailed(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


def split_nodes(spec: DeploymentSpec, hosts: list[str]) -> dict[str, list[str]]:
    """The het job's groups cut from one node list: the first node runs the main job (component 0), then the prefill
    nodes, then the decode nodes; nodes beyond those are left idle."""
    need = 1 + sum(pool.nodes for pool in spec.pools.values())
    if len(hosts) < need:
        raise RunFailed(f"the allocation has {len(hosts)} nodes ({','.join(hosts)}); the spec needs {need}")
    groups = {"main": hosts[:1]}
    at = 1
    for role, pool in spec.pools.items():
        groups[role] = hosts[at : at + pool.nodes]
        at += pool.nodes
    return groups


def _start_step(cmd: list[str], rc_file: Path) -> subprocess.Popen:
    # As the het job's `( srun ...; echo $? > exit/<role>.rc ) &`: the main job learns of a dead engine group from it.
    proc = subprocess.Popen(cmd)

    def wait() -> None:
        rc_file.write_text(f"{proc.wait()}\n")

    threading.Thread(target=wait, name=f"step-{rc_file.stem}", daemon=True).start()
    return proc


def run_allocation(spec_path: Path, run_dir: Path, starter: str = "basic", hosts: list[str] | None = None) -> int:
    """The main job in a homogeneous allocation: engine groups as srun steps on their share of the nodes, then
    `run_main` here on the first node. `spec_path` is the run folder's spec.yaml, as for a het job."""
    if starter not in ENGINE_STARTERS:
        raise ValueError(f"unknown engine starter {starter!r}")
    spec = load_spec(spec_path)
    plan = plan_job(spec, run_dir, Path.cwd(), gpus=False, starter=starter)
    # As the het job's batch script exports it: the engine steps and run_main below inherit this run's id.
    os.environ[runid.ENV] = runid.from_env() or plan.run_id
    try:
        groups = split_nodes(spec, hosts if hosts is not None else allocation_nodes())
    except RunFailed as exc:
        update_state(run_dir, state="FAILED", phase="failed", cause=str(exc))
        raise
    for sub in ("logs", "exit", "parts"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    # A rerun starts from fresh engines: forget the last attempt's endpoints and exits.
    (run_dir / FILE_NAME).unlink(missing_ok=True)
    for rc in (run_dir / "exit").glob("*.rc"):
        rc.unlink()
    for role, nodes in groups.items():
        (run_dir / f"nodes-{role}.txt").write_text("\n".join(nodes) + "\n")
    steps = []
    for comp in plan.engines:
        cmd = plan.srun_prefix(comp, f"{comp.role}-%t.log", nodelist=groups[comp.role]) + plan.engine_command(comp)
        steps.append(_start_step(cmd, run_dir / "exit" / f"{comp.role}.rc"))
    try:
        return run_main(spec_path, run_dir)
    finally:
        # The engines have no one to serve; in a het job the batch script's exit ends them, here the steps are
        # ended before the caller goes on (a sweep task records the point's result after this).
        for proc in steps:
            if proc.poll() is None:
                proc.terminate()
        for proc in steps:
            try:
                proc.wait(timeout=3)  # srun waits KillWait for its tasks; the job's end kills what is left
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launchers.main_job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument(
        "--allocation",
        action="store_true",
        help="in one homogeneous allocation (sbatch --nodes=N): split its nodes into the groups and start the "
        "engines first",
    )
    ap.add_argument("--starter", choices=ENGINE_STARTERS, default="basic", help="with --allocation: engine tasks")
    args = ap.parse_args(argv)
    try:
        if args.allocation:
            return run_allocation(args.spec, args.run_dir, args.starter)
        return run_main(args.spec, args.run_dir)
    except RunFailed:
        return 1


if __name__ == "__main__":
    sys.exit(main())
