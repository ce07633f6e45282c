"""`llmd export RUN_DIR_OR_H5 [--out FILE]`: a run's metrics as an llm-d Benchmark Report v0.2 (YAML, or JSON for a
.json --out), validated with the llmd_benchmark_report package before it is written.

`llmd merge RUN_DIR [FILE.h5 ...]`: the per-process metrics files of one run (the client's metrics.h5 from `llmd
bench`, the router's and engines' from their --metrics-out) merged into RUN_DIR/metrics.h5; the client's own file is
kept as client.h5. Without FILEs: every other *.h5 in RUN_DIR."""

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
    m = subparsers.add_parser(
        "merge",
        help="merge a run's per-process metrics files (client, router, engines) into RUN_DIR/metrics.h5",
        description=__doc__,
    )
    m.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run folder (where `llmd bench` wrote metrics.h5)")
    m.add_argument("files", metavar="FILE.h5", type=Path, nargs="*", help="files to merge (default: every *.h5 there)")
    m.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from llmd.metrics import merge_runs, read_meta

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder; give the run folder that holds the metrics files")
    target = run_dir / "metrics.h5"
    client = run_dir / "client.h5"
    # The files to merge, by the names they have now (the client's metrics.h5 becomes client.h5 below).
    if args.files:
        files = list(args.files)
    else:
        files = sorted(f for f in run_dir.glob("*.h5") if f.name != "metrics.h5")
        if target.exists():
            files.append(target)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"no such metrics file: {', '.join(missing)}")
    if not files:
        raise UserError(f"{run_dir} holds no metrics files (*.h5) to merge")
    # Every input is read before anything in the folder changes: a damaged one leaves the run as it was.
    # (read_meta's UnreadableMetrics is a UserError that names the file and what to do.)
    metas = {f.resolve(): read_meta(f) for f in files}
    if target.exists():
        meta = metas[target.resolve()] if target.resolve() in metas else read_meta(target)
        if meta.get("producer") == "merge":
            raise UserError(f"{target} is already a merged run file; merge the per-process files into another run")
        if client.exists():
            raise UserError(f"{client} exists beside {target}; move one of them away first")
        target.rename(client)  # the client's rows stay on disk as they were
        files = [client if f.resolve() == target.resolve() else f for f in files]
    try:
        merge_runs(files, target)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot merge into {target}: {exc}") from exc
    print(f"merged {len(files)} files ({', '.join(f.name for f in files)}) into {target}")
    return 0


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
        except UserError:
            raise  # UnreadableMetrics names the file and what to do already
        except OSError as exc:
            raise UserError(f"cannot read {f}: {exc}") from exc
        except ValueError as exc:
            raise UserError(f"{f}: the report does not validate: {exc}") from exc
        out = write_report(report, args.out or f.with_name("benchmark_report.yaml"))
        print(f"wrote {out}")
    return 0
