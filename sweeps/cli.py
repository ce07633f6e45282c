"""`llmd sweep SWEEP`: a grid of spec variants (sweeps.grid) run as one Slurm job array (sweeps.array)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("sweep", help="run a grid of spec variants as one Slurm job array")
    w.add_argument("sweep", help="sweep YAML: base spec + grid of dotted-key overrides (see sweeps/README.md)")
    w.add_argument("--dry-run", action="store_true", help="list the variants and print the array script; no job")
    w.add_argument("--no-follow", action="store_true", help="return once submitted")
    w.add_argument(
        "--simulate",
        action="store_true",
        help="run every variant through the cluster simulator here, in parallel on the local cores (no Slurm)",
    )
    w.add_argument("--workers", type=int, help="with --simulate: processes (default: one per core)")
    w.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.simulate:
        from sweeps.simulate import run_simulated_sweep

        return run_simulated_sweep(Path(args.sweep), workers=args.workers)
    from sweeps.array import run_sweep

    return run_sweep(Path(args.sweep), dry_run=args.dry_run, follow=not args.no_follow)
