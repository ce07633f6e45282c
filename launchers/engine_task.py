"""One engine component task per node (under `srun --het-group=K --ntasks-per-node=1`), without MPI: the node's
index picks its replica, the replica's head node starts `llmd engine sim` on the layout's ports (a taken one, or
`port: auto`, becomes a free one the engine reports in its --ports-file), waits for /health with this run's id
(llmd.runid), appends its discovery entry with the ports really bound, and exits with the engine's code when the
engine ends (so the step, and then the job, fail with it). Other nodes of a multi-node replica hold their place
until the job ends.

The MPI path (`python -m llmd.fabric`, with the NIXL preflight and vLLM) replaces this when available.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llmd import runid
from llmd.children import die_with_parent
from llmd.discovery import FILE_NAME, entry_for, publish, with_bound_ports
from llmd.engines.kinds import engine_kind
from llmd.engines.sim_kind import sim_argv
from llmd.engines.vllm_server import EngineStartError, stop_process_group, wait_healthy
from llmd.errors import UserError
from llmd.metrics.run_files import engine_metrics_path
from llmd.spec import load_spec
from llmd.spec.layout import engine_endpoints


def node_address() -> str:
    """The address other nodes reach this one at: $LLMD_ENGINE_HOST, else what this hostname resolves to."""
    if os.environ.get("LLMD_ENGINE_HOST"):
        return os.environ["LLMD_ENGINE_HOST"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def wait_ports_file(path: Path, proc: subprocess.Popen, timeout_s: float, name: str) -> dict[str, Any]:
    """The ports a simulated engine bound, once it has written them (whole: it renames the file into place)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return dict(json.loads(path.read_text()))
        except (FileNotFoundError, ValueError):
            pass
        if proc.poll() is not None:
            raise EngineStartError(f"{name} exited with code {proc.returncode} before it listened")
        time.sleep(0.1)
    raise EngineStartError(f"{name} did not listen within {timeout_s:.0f} s")


def run(spec_path: Path, run_dir: Path, role: str, node_index: int) -> int:
    spec = load_spec(spec_path)
    if engine_kind(spec.engine.kind).needs_fabric:
        raise UserError(f"engine.kind {spec.engine.kind!r} is started by llmd.fabric; this starter runs sim engines")
    pool = spec.pools.get(role)
    if pool is None:
        raise UserError(f"the spec has no {role} pool (prefill.nodes is 0?)")
    per_replica = max(1, pool.nodes_per_replica)
    replica, offset = divmod(node_index, per_replica)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    stop = {"sig": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if offset or replica >= pool.replicas:
        print(f"{role} node {node_index} ({node}): part of replica {replica}, nothing to start; waiting", flush=True)
        while not stop["sig"]:
            time.sleep(1)
        return 0
    ep = next(e for e in engine_endpoints(spec, host=node_address()) if e.role == role and e.replica == replica)
    print(f"{role} node {node_index} ({node}): starting {ep.name} at {ep.url}", flush=True)
    # The same command line llmd.fabric's plan gives a sim replica; -u: its log lines reach the job's log as they come.
    cmd = sim_argv(str(spec_path), ep, ep.host, node, True, sys.executable)
    cmd[1:1] = ["-u"]
    cmd += ["--metrics-out", str(engine_metrics_path(run_dir, ep.name))]
    (run_dir / "engines").mkdir(exist_ok=True)
    # The engine binds first (a taken layout port moves to a free one) and writes what it bound; that is published.
    ports_file = run_dir / "engines" / f"{ep.name}.ports.json"
    ports_file.unlink(missing_ok=True)
    cmd += ["--ports-file", str(ports_file)]
    run_id = runid.from_env()
    # Its own session (stopped in order below), and SIGTERM should this task die outright (llmd.children).
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent())
    try:
        bound = wait_ports_file(ports_file, proc, spec.engine.startup_timeout_s, ep.name)
        entry = with_bound_ports(entry_for(ep), bound)
        wait_healthy(f"{entry.url}/health", proc, spec.engine.startup_timeout_s, name=ep.name, run_id=run_id)
        (run_dir / "engines" / f"{ep.name}.pid").write_text(f"{proc.pid}\n")
        publish(run_dir / FILE_NAME, [entry])
        print(f"{ep.name}: healthy at {entry.url}, listed in {run_dir / FILE_NAME}", flush=True)
        while proc.poll() is None and not stop["sig"]:
            time.sleep(0.5)
    except EngineStartError as exc:
        print(f"{ep.name}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_process_group(proc, grace_s=5)
    if stop["sig"]:
        return 0
    code = proc.returncode
    print(f"{ep.name}: engine exited with code {code}", file=sys.stderr, flush=True)
    return code if code > 0 else 1 if code == 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launchers.engine_task", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--node-index", type=int, default=None, help="default: $SLURM_PROCID (one task per node)")
    args = ap.parse_args(argv)
    index = args.node_index if args.node_index is not None else int(os.environ.get("SLURM_PROCID", "0"))
    try:
        return run(args.spec, args.run_dir, args.role, index)
    except UserError as exc:
        print(f"llmd engine task: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
