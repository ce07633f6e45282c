"""`llmd simulate SPEC`: the spec's deployment, llmd's router and the spec's agents in virtual time on one core.

Writes the same HDF5 as a live run (client, router and engine rows merged into OUTPUT/<run>/metrics.h5), so
`llmd export`, `llmd report` and the figures read it unchanged; prints the summary table and the simulator's own
figures (transfers, CPU-tier restores, P2P lookups, events/s). Ctrl-C stops it and keeps what was simulated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from llmd.errors import UserError


def load_sim_spec(path: Path, args: argparse.Namespace) -> Any:
    """The spec with the command line's overrides applied to its workload and router."""
    from llmd.router.scheduling import POLICIES
    from llmd.spec import SpecError, load_spec

    try:
        spec = load_spec(path)
    except SpecError as exc:
        raise UserError(str(exc)) from exc
    w = spec.workload.model_dump()
    if args.agents is not None:
        if args.agents < 1:
            raise UserError(f"--agents must be at least 1, got {args.agents}")
        w["concurrency"] = args.agents
        # Profiles with a fixed number of agents (agentx, cybergym) take it from their params.
        w["params"] = {**(w.get("params") or {}), "agents": args.agents}
    if args.duration is not None:
        if not args.duration > 0:
            raise UserError(f"--duration must be > 0 seconds, got {args.duration:g}")
        w["duration_s"] = args.duration
    if args.seed is not None:
        w["seed"] = args.seed
    if args.policy is not None and args.policy not in POLICIES:
        raise UserError(f"unknown --policy {args.policy!r}; choose one of {', '.join(POLICIES)}")
    try:
        spec = spec.model_copy(update={"workload": type(spec.workload).model_validate(w)})
    except ValueError as exc:
        raise UserError(f"bad workload settings: {exc}") from exc
    return spec


def run_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmd.metrics import read_requests, read_timeseries
    from llmd.report.summary import summarize_frames, summary_table
    from llmd.sim.params import SimParams
    from llmd.sim.run import Simulation

    spec = load_sim_spec(Path(args.spec), args)
    params = SimParams.load(args.params) if args.params else SimParams()
    for folder in args.perf_dir or ():
        from llmd.perf import add_profile_dir

        add_profile_dir(folder)  # a calibration's efficiency.yaml, or the user's own GPU and model profiles
    run_id = time.strftime("sim-%Y%m%d-%H%M%S")
    out = Path(args.output) / run_id
    if out.exists():
        raise UserError(f"{out} exists already; a run never overwrites another's results")
    if args.calibrate is not None:
        return _calibrate(spec, args, params, out)
    try:
        sim = Simulation(spec, out_dir=out, policy=args.policy, params=params, run_id=run_id)
    except (ValueError, OSError) as exc:  # TraceError is a ValueError naming the file and line
        raise UserError(f"cannot simulate {args.spec}: {exc}") from exc
    n_ranks = len(sim.fleet.ranks)
    print(
        f"simulating {spec.name}: {n_ranks} engine ranks, {spec.workload.concurrency} agents "
        f"({spec.workload.profile}), {spec.workload.duration_s:g} s, policy {sim.router.policy}"
    )
    tty = sys.stdout.isatty()
    last = [0.0]

    def progress(t: float, s: Any) -> None:
        if not tty and t - last[0] < 30:
            return
        last[0] = t
        line = (
            f"simulated {t:7.1f} s  wall {s.wall_s:6.1f} s  {s.events / max(s.wall_s, 1e-9):,.0f} events/s  "
            f"requests {len(sim.calls):,}  in flight {len(sim.inflight):,}"
        )
        print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

    stats = sim.run(progress)
    if tty:
        print()
    if stats.interrupted:
        print(f"interrupted at {stats.sim_s:.1f} simulated seconds; kept what was simulated")
    assert sim.metrics_path is not None
    df = read_requests(sim.metrics_path)
    summary = summarize_frames(df, read_timeseries(sim.metrics_path), label=sim.router.policy)
    console = Console(width=None if tty else 140)
    console.print(summary_table([summary], title=f"llmd simulate: {spec.name}"))
    print(
        f"requests/min {stats.requests_per_min:,.0f}  engines' hit share {stats.hit_share:.1%}  "
        f"input served from cache {stats.cached_input_share:.1%}  preemptions {stats.preemptions}"
        + (f"  sessions compacted or reset to fit max_model_len {stats.overflows:,}" if stats.overflows else "")
    )
    print(
        f"KV transfers {stats.kv_transfers:,} ({stats.kv_transfer_bytes_mean / 2**20:,.1f} MiB each)  "
        f"P2P lookups {stats.p2p_lookups:,}  CPU-tier restores {stats.cpu_restores:,}"
        + (f" ({stats.cpu_restore_mean_s * 1000:.2f} ms mean)" if stats.cpu_restores else "")
    )
    print(
        f"simulated {stats.sim_s:,.1f} s in {stats.wall_s:,.1f} s wall ({stats.sim_speedup:,.1f}x), "
        f"{stats.events:,} events ({stats.events_per_s:,.0f}/s)"
    )
    print(f"metrics: {sim.metrics_path}")
    return 130 if stats.interrupted else 0


def _calibrate(spec: Any, args: argparse.Namespace, params: Any, out: Path) -> int:
    from llmd.perf import dump_efficiency
    from llmd.sim.calibrate import calibrate

    if not args.calibrate > 0:
        raise UserError(f"--calibrate takes the measured requests per minute (> 0), got {args.calibrate:g}")
    duration = float(spec.workload.duration_s)
    warmup = args.warmup if args.warmup is not None else duration / 4
    if not 0 <= warmup < duration:
        raise UserError(f"--warmup must be in [0, duration {duration:g} s), got {warmup:g}")
    print(f"calibrating {spec.engine.gpu} efficiencies of {spec.name} to {args.calibrate:,.0f} requests/min "
          f"(steady state after {warmup:g} s of {duration:g} s)")  # fmt: skip

    def show(t: Any) -> None:
        f = ", ".join(f"{k} {v:.3f}" for k, v in t.factors.items())
        print(f"  scale {t.scale:.3f} ({f}): {t.requests_per_min:,.0f} requests/min, {t.preemptions} preemptions "
              f"[{t.stats.wall_s:.0f} s]")  # fmt: skip

    best, _ = calibrate(spec, args.calibrate, warmup_s=warmup, on_trial=show, policy=args.policy, params=params)
    out.mkdir(parents=True)
    path = dump_efficiency(out / "efficiency.yaml", spec.engine.gpu, best.factors)
    print(f"fitted scale {best.scale:.3f}: {best.requests_per_min:,.0f} requests/min; frozen in {path}")
    print(f"predict with it: llmd simulate SPEC --perf-dir {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a deployment in virtual time: llmd's router core over simulated engines, on one core",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", type=Path, help="deployment spec (YAML)")
    p.add_argument("--agents", type=int, help="concurrent agents (default: the spec's workload.concurrency)")
    p.add_argument("--duration", type=float, help="simulated seconds of load (default: workload.duration_s)")
    p.add_argument("--policy", help="routing policy (default: the spec's router.policy)")
    p.add_argument("--seed", type=int, help="workload seed (default: workload.seed)")
    p.add_argument("--output", default="results", help="results folder (default results/)")
    p.add_argument("--params", type=Path, help="YAML file of simulator parameters (llmd/sim/params.py)")
    p.add_argument(
        "--perf-dir",
        action="append",
        type=Path,
        help="profile folder (gpus.yaml, models.yaml, efficiency.yaml) over the built-ins; repeatable",
    )
    p.add_argument(
        "--calibrate",
        type=float,
        metavar="RPM",
        help="fit the GPU's efficiency factors to this measured requests/min and write them to OUTPUT/<run>/",
    )
    p.add_argument("--warmup", type=float, help="with --calibrate: seconds before the steady state is measured")
    p.set_defaults(func=run_simulate)
