"""One point's folder: made before it runs (its spec, run.json saying which point it is; a failed earlier attempt moved
aside under retried/), and recorded after (its parameters stamped into metrics.h5, requests and errors counted once,
`recorded_at` in run.json: what makes the point done). Both `llmd sweep` on Slurm and `--simulate` use it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from launchers.prepare import write_spec_copy
from launchers.runstate import update_state
from sweeps.state import RETRIED, point_dir


def point_meta(sweep: str, index: int, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a point is, as stored in its run.json and its metrics.h5 (attributes sweep, sweep_index, ...)."""
    return {"sweep": sweep, "index": index, "params": params, "seed": seed}


def set_aside(root: Path, index: int) -> Path | None:
    """Move a point's earlier attempt to retried/<index>-<n>/ (kept for its logs, never read as a point)."""
    folder = point_dir(root, index)
    if not folder.exists():
        return None
    n = 1
    while (root / RETRIED / f"{index}-{n}").exists():
        n += 1
    target = root / RETRIED / f"{index}-{n}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(target))
    return target


def prepare(root: Path, index: int, spec_text: str, meta: dict[str, Any], **state: Any) -> Path:
    """The point's run folder with its spec and a run.json naming the point (the previous run.json, if any, is
    replaced: the caller set a failed attempt aside first)."""
    folder = point_dir(root, index)
    for sub in ("logs", "exit", "parts"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    write_spec_copy(folder / "spec.yaml", spec_text)  # owner-only when it holds a token
    (folder / "run.json").unlink(missing_ok=True)
    update_state(
        folder, run_dir=str(folder), name=meta["sweep"], spec=str(folder / "spec.yaml"), created_at=time.time(),
        point=meta, **state,
    )  # fmt: skip
    return folder


def record(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """After the run: the point's parameters into metrics.h5, its request and error counts into run.json; a run that
    completed becomes done here. Returns the counts ({} without metrics.h5)."""
    from llmd.metrics import read_requests
    from llmd.metrics.writer import add_run_attrs
    from llmd.report.summary import client_rows, failed

    result = folder / "metrics.h5"
    if not result.is_file():
        update_state(folder, result_summary={})
        return {}
    add_run_attrs(
        result,
        {
            "sweep": meta["sweep"],
            "sweep_index": meta["index"],
            "sweep_params": meta["params"],
            "sweep_seed": meta["seed"],
        },
    )
    rows = client_rows(read_requests(result))
    summary = {"requests": len(rows), "errors": int(failed(rows).sum()) if len(rows) else 0}
    update_state(folder, result_summary=summary, recorded_at=time.time())
    return summary
