"""`python -m llmd.fabric`: bring up one node of an engine component (see llmd/fabric/__init__.py for the contract).

Order of events on every rank: rank and size, node names and addresses (allgather), the node plan (pure,
llmd.fabric.plan), the NIXL preflight (every rank, same verdict), the probed ports (each DP replica's RPC port, every
vLLM process's NIXL side channel) chosen on the node that binds them and shared (llmd.fabric.settle), then MPI is
finalised together and each rank starts its node's engine processes, waits for /health, appends its discovery
entries and supervises the engines until a signal or an engine's death.
Nothing in the supervision talks to MPI, so one node's failure never blocks another's.
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
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from llmd import runid
from llmd.children import die_with_parent
from llmd.discovery import PodInfo
from llmd.engines.kinds import engine_kind
from llmd.errors import UserError
from llmd.fabric.comm import Comm, PeerFailed, open_comm
from llmd.fabric.plan import ROLES, EngineProcess, NodePlan
from llmd.fabric.settle import agree_ports
from llmd.metrics.run_files import engine_metrics_path
from llmd.spec.redact import redact_spec_text

DEFAULT_MIB = 64
DEFAULT_ITERATIONS = 5
DEFAULT_MIN_GBPS = 1.0
# Launcher variables a child must not inherit: an engine that imports MPI would think it is one of our ranks.
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_")


class FabricError(UserError):
    """The fabric is not fit to serve (a slow or broken link); every rank exits with this code."""

    exit_code = 3


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT; BaseException so no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmd.fabric",
        description="Start one node of an engine component: rank layout, NIXL preflight, engine, discovery. "
        "Run one task per node (srun, or mpiexec -n N locally); a single process without a launcher is 1 node.",
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", required=True, help="deployment spec YAML")
    p.add_argument("--run-dir", required=True, help="the run's folder on shared storage (HDF5, discovery, logs)")
    p.add_argument("--role", required=True, choices=ROLES, help="which pool these tasks are")
    p.add_argument(
        "--preflight-mib", type=int, default=DEFAULT_MIB, metavar="N", help=f"MiB per transfer (default {DEFAULT_MIB})"
    )
    p.add_argument("--preflight-iterations", type=int, default=DEFAULT_ITERATIONS, metavar="K")
    p.add_argument(
        "--min-gbps",
        type=float,
        default=DEFAULT_MIN_GBPS,
        metavar="X",
        help=f"fail when a link is slower than X GB/s (default {DEFAULT_MIN_GBPS:g}; 0 = never)",
    )
    p.add_argument("--no-preflight", action="store_true", help="skip the NIXL preflight")
    p.add_argument("--launch-mode", choices=("head-headless", "per-rank"), default="head-headless")
    p.add_argument("--startup-timeout", type=float, help="seconds to wait for /health (default: the spec's)")
    p.add_argument("--python", default=sys.executable, help="interpreter the engines run with")


def _log(role: str, index: int | str, msg: str) -> None:
    print(f"llmd fabric [{role} node {index}]: {msg}", file=sys.stderr, flush=True)


def load_spec_checked(path: str) -> Any:
    from llmd.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as exc:
        raise UserError(str(exc)) from exc


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    return {**env, **extra}


def plan_doc(plans: Sequence[NodePlan]) -> list[dict[str, Any]]:
    return [
        {
            "index": p.index,
            "node": p.node,
            "address": p.address,
            "replica": p.replica,
            "node_in_replica": p.node_in_replica,
            "dp_ranks": p.dp_ranks,
            "ports": p.ports,
            "processes": [
                {"name": e.name, "argv": e.argv, "env": e.env, "http_port": e.http_port, "dp_ranks": e.ranks}
                for e in p.processes
            ],
        }
        for p in plans
    ]


def bring_up(args: argparse.Namespace, spec: Any, comm: Comm) -> tuple[list[NodePlan], int]:
    """The node plans, which need every rank's name and address: returns (plans, this rank's node index)."""
    from llmd.fabric.nodes import local_address, local_node_name, order_nodes, slurm_node_order
    from llmd.fabric.plan import plan_nodes

    spec_path = os.path.abspath(args.spec)
    run_dir = Path(args.run_dir)
    env = dict(os.environ)
    names = comm.allgather((local_node_name(env), socket.gethostname()))
    single_host = len({host for _, host in names}) == 1
    addresses = comm.allgather(local_address(env, single_host))
    slurm_order = slurm_node_order(env) if env.get("SLURM_JOB_ID") else None
    where = order_nodes([n for n, _ in names], slurm_order)
    nodes = [""] * comm.size
    node_addresses = [""] * comm.size
    for rank, k in enumerate(where):
        nodes[k], node_addresses[k] = names[rank][0], addresses[rank]
    plans = plan_nodes(
        spec,
        args.role,
        nodes,
        node_addresses,
        spec_path=spec_path,
        python=args.python,
        mode=args.launch_mode,
        run_id=runid.from_env(),  # exported by the batch script (llmd.runid)
    )
    write_plan(run_dir, args.role, comm, plans)
    return plans, where[comm.rank]


def write_plan(run_dir: Path, role: str, comm: Any, plans: Sequence[NodePlan]) -> None:
    """Rank 0 writes every node's plan to DIR/fabric-<role>-plan.json (again once the probed ports are agreed)."""
    if comm.rank == 0:
        doc = {"role": role, "comm": comm.kind, "ranks": comm.size, "nodes": plan_doc(plans)}
        (run_dir / f"fabric-{role}-plan.json").write_text(json.dumps(doc, indent=1) + "\n")


def preflight(args: argparse.Namespace, comm: Any, spec_text: str, node: str) -> None:
    """Measure, record (rank 0), judge (every rank alike). FabricError names every link below the threshold."""
    try:
        from llmd.fabric.preflight import run_preflight, slow_links
    except ImportError as exc:
        raise UserError(f"the preflight needs nixl ({exc}); pip install 'llmd[fabric]' or pass --no-preflight") from exc
    from llmd.fabric.record import write_matrix

    if args.preflight_mib < 1 or args.preflight_iterations < 1:
        raise UserError("--preflight-mib and --preflight-iterations must be >= 1")
    result = run_preflight(comm, args.preflight_mib << 20, args.preflight_iterations, args.role, node)
    if comm.rank == 0:
        path = write_matrix(Path(args.run_dir), result, min_gbps=args.min_gbps, spec_text=spec_text)
        _log(args.role, 0, f"preflight: {result.size}x{result.size} bandwidth matrix in {path}")
    problems = list(result.errors)
    if args.min_gbps > 0:
        problems += slow_links(result.gbps, args.min_gbps, result.hostnames, args.role)
    problems = list(dict.fromkeys(problems))
    if problems and comm.rank == 0:
        raise FabricError("fabric preflight failed:\n  " + "\n  ".join(problems))
    if problems:
        # Every rank fails; one full list (rank 0's) is enough in a job log of many nodes.
        more = f" (and {len(problems) - 1} more, listed by rank 0)" if len(problems) > 1 else ""
        raise FabricError(f"fabric preflight failed: {problems[0]}{more}")


def _start(proc: EngineProcess, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log = log_dir / f"{proc.name}.log"
    with open(log, "ab") as fh:  # appended: a restarted node keeps the earlier attempt's log
        child = subprocess.Popen(
            proc.argv,
            env=_child_env(proc.env),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # no engine outlives its task, even one killed outright
        )
    return child, log


def _bind_first(proc: EngineProcess) -> EngineProcess:
    """A vLLM process's ports that are taken on this node (all, with `port: auto`) handed to vLLM to pick
    (llmd.engines.vllm_server.move_taken_ports). A server's bound ports are read back by _wait_bound; a headless
    node's KV-event sockets are reported by its head's /kv_event_sources, with every rank's, and published from there.
    Side channels were settled with the other nodes (llmd.fabric.settle): a server's moves only if it was taken since
    (it publishes its own ranks' ports itself); a headless node's never does, as its head publishes the agreed one."""
    from llmd.engines.vllm_server import move_taken_kv_ports, move_taken_ports

    host = proc.argv[proc.argv.index("--host") + 1]
    move = move_taken_kv_ports if proc.health_url is None else move_taken_ports
    argv, env = move(proc.argv, proc.env, host, _dp_ranks(proc))
    return replace(proc, argv=argv, env=env)


def _dp_ranks(proc: EngineProcess) -> list[int]:
    """The DP ranks vLLM adds to the rank-0 ports it is given (KV events, NIXL side channel): those the process runs,
    replica-wide (a per-rank server's own, a head's local ones, a headless node's from its start rank on)."""
    return proc.ranks or [0]


def _wait_bound(
    proc: EngineProcess, child: subprocess.Popen, children: list[subprocess.Popen], timeout: float, log: Path
) -> list[PodInfo]:
    """Wait for `proc` to answer as this run's; its discovery entries with the ports it really bound."""
    from llmd.engines.vllm_server import wait_bound_http, wait_healthy

    run_id = runid.from_env()
    port = int(proc.argv[proc.argv.index("--port") + 1])
    if port:
        assert proc.health_url is not None
        wait_healthy(proc.health_url, children, timeout, log, name=proc.name, run_id=run_id)
    else:
        host = proc.argv[proc.argv.index("--host") + 1]
        others = [c for c in children if c is not child]
        port = wait_bound_http(child, host, timeout, log, name=proc.name, run_id=run_id, others=others)
    return [_bound_entry(proc, entry, port) for entry in proc.discovery]


def _bound_entry(proc: EngineProcess, entry: PodInfo, port: int) -> PodInfo:
    """`entry` as published once `proc` serves on `port`: the KV-event endpoints of every DP rank it fronts as its
    /kv_event_sources reports them (a head's engine client has every rank's, those its headless nodes run too), and
    each rank's side channel (llmd.fabric.side_channel.published_ports)."""
    from llmd.discovery import with_bound_ports
    from llmd.engines.vllm_server import required_kv_sources
    from llmd.fabric.side_channel import published_ports

    url = entry.url.rsplit(":", 1)[0] + f":{port}"
    bound: dict[str, Any] = {"http_port": port, **required_kv_sources(url, proc.name)}
    if entry.side_channel_port is not None:
        bound["side_channel_ports"] = published_ports(entry, proc.env, _dp_ranks(proc))
    return with_bound_ports(entry, bound)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def serve(args: argparse.Namespace, spec: Any, plan: NodePlan) -> int:
    """Start this node's engines, announce them once healthy, supervise until a signal or an engine's death."""
    from llmd.discovery import FILE_NAME, publish
    from llmd.engines.vllm_server import log_tail, stop_process_group, wait_healthy

    run_dir = Path(args.run_dir)
    # A folder of their own: the launcher's srun writes each task's output to logs/<role>-<task>.log.
    log_dir = run_dir / "logs" / "engines"
    log_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.startup_timeout or spec.engine.startup_timeout_s
    started: list[tuple[EngineProcess, subprocess.Popen, Path]] = []
    try:
        for proc in plan.processes:
            if engine_kind(spec.engine.kind).streams_metrics and proc.health_url is not None:
                # Each simulated engine streams its per-second series into the run folder's engine files.
                proc = replace(proc, argv=[*proc.argv, "--metrics-out", str(engine_metrics_path(run_dir, proc.name))])
            if not engine_kind(spec.engine.kind).simulated:
                proc = _bind_first(proc)
            child, log = _start(proc, log_dir)
            started.append((proc, child, log))
            _log(plan.role, plan.index, f"started {proc.name} (pid {child.pid}), log {log}")
        children = [c for _, c, _ in started]
        entries = []
        for proc, child, log in started:
            if proc.health_url is None:
                continue
            if engine_kind(spec.engine.kind).simulated:
                wait_healthy(proc.health_url, children, timeout, log, name=proc.name, run_id=runid.from_env())
                entries += proc.discovery
            else:
                entries += _wait_bound(proc, child, children, timeout, log)
        if entries:
            publish(run_dir / FILE_NAME, entries)
        ready = ", ".join(f"{e.name} at {e.url}" for e in entries) or "no HTTP endpoint on this node"
        _log(plan.role, plan.index, f"ready: {ready}")
        while True:
            for proc, child, log in started:
                if child.poll() is not None:
                    _log(plan.role, plan.index, f"{proc.name} ended; the tail of {log}:")
                    print(log_tail(log), file=sys.stderr, flush=True)
                    # Last, so a reader of the task's output (the main job) finds the cause in its final line.
                    _log(plan.role, plan.index, f"{proc.name}: engine exited with code {child.returncode}")
                    return _exit_code(child.returncode)
            time.sleep(0.5)
    except _Stop as stop:
        _log(plan.role, plan.index, f"signal {signal.Signals(stop.signum).name}: stopping the engines")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for _, child, _ in started:
            stop_process_group(child)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        spec = load_spec_checked(os.path.abspath(args.spec))
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        comm = open_comm(run_dir, args.role, dict(os.environ))
        with failing_together(comm, args.role):
            plans, index = bring_up(args, spec, comm)
            plan = plans[index]
            _log(args.role, index, f"{plan.node} ({plan.address}): replica {plan.replica}, DP ranks {plan.dp_ranks}")
            if not args.no_preflight:
                spec_text = redact_spec_text(Path(args.spec).read_text())  # the fabric file is a result: no tokens
                preflight(args, comm, spec_text, plan.node)
            # After the preflight, the last step with the other ranks: the shorter the wait between the probe and
            # vLLM's bind, the smaller the chance another program takes the port first (llmd.fabric.settle).
            agreed = agree_ports(comm, plans, index)
            if agreed != plans:
                plans, plan = agreed, agreed[index]
                write_plan(run_dir, args.role, comm, plans)
            _finalize_mpi(comm)
    except _Stop as stop:
        _log(args.role, "?", f"signal {signal.Signals(stop.signum).name} before the engines started")
        return 0
    return serve(args, spec, plan)


@contextmanager
def failing_together(comm: Comm, role: str) -> Iterator[None]:
    """Up to MPI's finalisation, a failure on one rank stops every rank. Left alone, the others would wait at their
    next collective step until its timeout (600 s), and the failed rank in MPI_Finalize for them: the component would
    hang rather than fail (a probe error on one node did, in CI). So the rank says why, as `main` would, and stops the
    rest (comm.fail: MPI_Abort, or a file the others' waits read). A FabricError is raised on every rank alike (the
    preflight's verdict) and PeerFailed is another rank's failure arriving: both just end this rank."""
    try:
        yield
    except (FabricError, PeerFailed):
        raise
    except Exception as exc:
        if comm.size == 1:
            raise
        if isinstance(exc, UserError):
            code, message = exc.exit_code, _error_line(exc)
        else:
            code, message = 1, "".join(traceback.format_exception(exc)).rstrip()
        print(message, file=sys.stderr, flush=True)
        _log(role, comm.rank, f"rank {comm.rank} failed: stopping the component's other {comm.size - 1} ranks")
        comm.fail(message, code)
        raise SystemExit(code) from exc


def _error_line(exc: UserError) -> str:
    return f"llmd fabric: error: {exc}"


def _finalize_mpi(comm: Any) -> None:
    # Together, now: every rank is here at the same moment. Left to exit time, a rank whose engine died could wait
    # in MPI_Finalize for ranks that are still serving.
    if getattr(comm, "kind", "") == "mpi":
        comm.barrier()
        from mpi4py import MPI

        if not MPI.Is_finalized():
            MPI.Finalize()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(_error_line(exc), file=sys.stderr, flush=True)
        return exc.exit_code
