"""One engine component task per node (under `srun --het-group=K --ntasks-per-node=1`), without MPI: the node's
index picks its replica, the replica's head node starts `llmd engine sim` on the layout's ports, waits for /health,
appends its discovery entry, and exits with the engine's code when the engine ends (so the step, and then the job,
fail with it). Other nodes of a multi-node replica hold their place until the job ends.

The MPI path (`python -m llmd.fabric`, with the NIXL preflight and vLLM) replaces this when available.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmd.discovery import FILE_NAME, entry_for, publish
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
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_healthy(f"{ep.url}/health", proc, spec.engine.startup_timeout_s, name=ep.name)
        (run_dir / "engines").mkdir(exist_ok=True)
        (run_dir / "engines" / f"{ep.name}.pid").write_text(f"{proc.pid}\n")
        publish(run_dir / FILE_NAME, [entry_for(ep)])
        print(f"{ep.name}: healthy, listed in {run_dir / FILE_NAME}", flush=True)
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
