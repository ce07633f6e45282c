"""`llmd export RUN_DIR_OR_H5 [--out FILE]`: a run's metrics as an llm-d Benchmark Report v0.2 (YAML, or JSON for a
.json --out), validated with the llmd_benchmark_report package before it is written."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a run's metrics as an llm-d Benchmark Report v0.2 (YAML/JSON)",
        description=__doc__,
    )
    p.add_argument("target", metavar="RUN_DIR_OR_H5", help="a metrics.h5, or a run folder holding one (or several)")
    p.add_argument(
        "--out",
        type=Path,
        help="output file (.json: JSON, else YAML; default: benchmark_report.yaml next to each metrics.h5)",
    )
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from llmd.report.export import find_metrics, report_for_file, write_report

    files = find_metrics(args.target)
    if not files:
        raise UserError(f"{args.target}: no metrics.h5 there (give a run folder or an HDF5 file)")
    if args.out is not None and len(files) > 1:
        raise UserError(f"{args.target} holds {len(files)} runs; drop --out to write one report next to each")
    for f in files:
        try:
            report = report_for_file(f)
        except OSError as exc:
            raise UserError(f"cannot read {f}: {exc}") from exc
        except ValueError as exc:
            raise UserError(f"{f}: the report does not validate: {exc}") from exc
        out = write_report(report, args.out or f.with_name("benchmark_report.yaml"))
        print(f"wrote {out}")
    return 0
