"""`llmd analyze RUN_OR_SWEEP`: a report folder (PNG figures, CSV tables, report.md embedding them) for one run or a
whole sweep; analysis.report says what it holds."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="figures, tables and a Markdown report for a run or a sweep folder",
        description=__doc__,
    )
    p.add_argument("target", metavar="RUN_OR_SWEEP", type=Path, help="a metrics.h5, a run folder or a sweep folder")
    p.add_argument("--out", type=Path, help="report folder (default: RUN_OR_SWEEP/report, or beside a .h5 file)")
    p.add_argument(
        "--gpu-hour-usd",
        type=float,
        metavar="USD",
        help="price of one GPU-hour, for the cost per 1M tokens (default: the spec's cost.gpu_hour_usd, if any)",
    )
    p.add_argument(
        "--api-prices",
        type=Path,
        metavar="FILE",
        help="YAML of API prices to compare with (format: analysis/data/api_prices.yaml, also the default)",
    )
    p.set_defaults(func=run_analyze)


def run_analyze(args: argparse.Namespace) -> int:
    from analysis.report import write_report
    from analysis.sweeps import load
    from llmd.errors import UserError

    target: Path = args.target
    if args.gpu_hour_usd is not None and not args.gpu_hour_usd >= 0:
        raise UserError(f"--gpu-hour-usd must be a price in USD, e.g. 2.5; got {args.gpu_hour_usd:g}")
    try:
        loaded = load(target)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    if not getattr(loaded, "points", [loaded]):
        raise UserError(f"{target}: no run there (a metrics.h5, a run folder, or a folder of run folders)")
    out = args.out or (target.with_name(f"{target.stem}-report") if target.is_file() else target / "report")
    try:
        rep = write_report(loaded, out, gpu_hour_usd=args.gpu_hour_usd, api_prices=args.api_prices)
    except OSError as exc:
        raise UserError(f"cannot read or write: {exc}") from exc
    except ValueError as exc:  # a bad API price file names its entry
        raise UserError(str(exc)) from None
    print(f"wrote {out / 'report.md'}: {len(rep.figures)} figures, {len(rep.tables)} tables")
    for name, why in rep.skipped.items():
        print(f"  left out {name}: {why}")
    return 0
