"""One array task of a sweep (`python -m sweeps.task ROOT`, run by the array's batch script): the point that
$SLURM_ARRAY_TASK_ID names runs as a whole deployment on this allocation, through the main job `llmd launch` runs
(launchers.main_job.run_allocation), then sweeps.point records it."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from launchers.main_job import RunFailed, run_allocation
from launchers.plan import ENGINE_STARTERS
from launchers.runstate import read_state, update_state
from sweeps.point import record
from sweeps.state import point_dir


def run_point(root: Path, index: int, starter: str) -> int:
    folder = point_dir(root, index)
    meta = read_state(folder)["point"]
    try:
        code = run_allocation(folder / "spec.yaml", folder, starter)
    except RunFailed:
        code = 1  # run_main recorded the cause
    except Exception as exc:  # a bug or a broken node: say so in run.json, where `llmd sweep status` looks
        traceback.print_exc()
        update_state(folder, state="FAILED", phase="failed", cause=f"{type(exc).__name__}: {exc}")
        code = 1
    try:
        record(folder, meta)
    except Exception as exc:
        traceback.print_exc()
        update_state(folder, state="FAILED", cause=f"recording the result failed: {type(exc).__name__}: {exc}")
        return 1
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweeps.task", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="the sweep folder")
    ap.add_argument("--starter", choices=ENGINE_STARTERS, default="basic")
    ap.add_argument("--index", type=int, help="default: $SLURM_ARRAY_TASK_ID")
    args = ap.parse_args(argv)
    index = args.index if args.index is not None else int(os.environ["SLURM_ARRAY_TASK_ID"])
    return run_point(args.root, index, args.starter)


if __name__ == "__main__":
    sys.exit(main())
