"""`llmd sweep SWEEP`: a sweep file's points (sweeps.grid) run on Slurm as job arrays (sweeps.array) or here through the
cluster simulator (sweeps.simulate); `llmd sweep status SWEEP_OR_FOLDER`: where every point stands (sweeps.status)."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmd.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "sweep",
        help="run a sweep's points as Slurm job arrays (resumable), or `llmd sweep status SWEEP` to see them",
        description="`llmd sweep FILE` submits the points not done yet; `llmd sweep status FILE_OR_FOLDER` prints "
        "a table of every point.",
    )
    w.add_argument("sweep", help="sweep YAML: base spec + grid/zip/seeds of dotted-key overrides (sweeps/README.md)")
    w.add_argument("target", nargs="?", help=argparse.SUPPRESS)  # `llmd sweep status TARGET`
    w.add_argument("--dry-run", action="store_true", help="list the points and print the array scripts; no job")
    w.add_argument("--no-follow", action="store_true", help="return once submitted")
    w.add_argument("--retry-failed", action="store_true", help="rerun the points that failed (done ones never rerun)")
    w.add_argument("--throttle", type=int, help="at most N points at once (the array's %%N); default: the file's")
    w.add_argument(
        "--gpus",
        choices=("auto", "yes", "no"),
        default="auto",
        help="ask for --gpus-per-node, as `llmd launch --gpus` (no: the local test cluster)",
    )
    w.add_argument(
        "--starter",
        choices=("auto", "fabric", "basic"),
        default="auto",
        help="engine tasks, as `llmd launch --starter` (vLLM points need fabric)",
    )
    w.add_argument(
        "--simulate",
        action="store_true",
        help="run every point through the cluster simulator here, in parallel on the local cores (no Slurm)",
    )
    w.add_argument("--workers", type=int, help="with --simulate: processes (default: one per core)")
    w.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.sweep == "status" and args.target:
        return cmd_status(Path(args.target))
    if args.target:
        raise UserError(f"llmd sweep takes one sweep file; {args.target!r} is extra (status: llmd sweep status X)")
    if args.throttle is not None and args.throttle < 1:
        raise UserError("--throttle must be at least 1")
    if args.simulate:
        from sweeps.simulate import run_simulated_sweep

        return run_simulated_sweep(Path(args.sweep), workers=args.workers, retry_failed=args.retry_failed)
    from sweeps.array import run_sweep

    return run_sweep(
        Path(args.sweep),
        dry_run=args.dry_run,
        follow=not args.no_follow,
        retry_failed=args.retry_failed,
        throttle=args.throttle,
        gpus=args.gpus,
        starter=args.starter,
    )


def cmd_status(target: Path) -> int:
    from sweeps.state import SWEEP_FILE, sweep_status
    from sweeps.status import render_table

    if target.is_file():
        from launchers.prepare import absolute_spec
        from sweeps.grid import load_sweep

        sweep = load_sweep(target)
        root = Path(absolute_spec(sweep.variants[0].spec, Path.cwd()).output.dir) / sweep.name
        rows = [{"index": v.index, **v.overrides} for v in sweep.variants]
    elif (target / SWEEP_FILE).is_file():
        root, rows = target, None
    else:
        raise UserError(f"{target} is neither a sweep file nor a sweep folder (one holding {SWEEP_FILE})")
    points = sweep_status(root, rows)
    print(f"sweep {root}")
    print(render_table(points))
    return 0
