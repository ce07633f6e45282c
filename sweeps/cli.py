"""`llmd sweep SWEEP`: a grid of spec variants (sweeps.grid) run as one Slurm job array (sweeps.array)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("sweep", help="run a grid of spec variants as one Slurm job array")
    w.add_argument("sweep", help="sweep YAML: base spec + grid of dotted-key overrides (see sweeps/README.md)")
    w.add_argument("--dry-run", action="store_true", help="list the variants and print the array script; no job")
    w.add_argument("--no-follow", action="store_true", help="return once submitted")
    w.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from sweeps.array import run_sweep

    return run_sweep(Path(args.sweep), dry_run=args.dry_run, follow=not args.no_follow)
