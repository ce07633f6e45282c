"""Where every point of a sweep stands: its folder's run.json (what its task recorded) merged with Slurm's view of its
array task (what a task killed from outside cannot record), read for all points at once.

A sweep folder: sweep.json (one row per point: its index and parameters, the file analysis/ keys the points by),
arrays.jsonl (one line per submitted array), and <index>/ per point, a run folder as `llmd launch` makes one (spec.yaml,
run.json, logs/, metrics.h5). A point is done when its run.json says COMPLETED, its task recorded the result
(`recorded_at`: parameters stamped into metrics.h5) and metrics.h5 is there; nothing else counts as done.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launchers.runstate import FINAL, read_state
from llmd.errors import UserError

SWEEP_FILE = "sweep.json"  # analysis/sweeps.py reads its rows' keys: keep it a list of {index, key: value, ...}
ARRAYS_FILE = "arrays.jsonl"
RETRIED = "retried"  # failed attempts of points rerun with --retry-failed, kept as <index>-<n>/
STATES = ("pending", "running", "done", "failed")
# A point submitted this long ago that neither squeue nor sacct knows is lost (sbatch died, accounting purged).
LOST_AFTER_S = 120.0
SLURM_ACTIVE = ("PENDING", "REQUEUED", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING")


@dataclass(frozen=True)
class SlurmTask:
    state: str
    reason: str = ""
    job_id: str = ""  # the task's own job id (sacct's JobIDRaw)


@dataclass(frozen=True)
class PointStatus:
    index: int
    params: dict[str, Any]
    state: str  # one of STATES
    job: str = ""  # <array>_<index> once submitted
    reason: str = ""
    requests: int | None = None
    errors: int | None = None


def point_dir(root: Path, index: int) -> Path:
    return root / str(index)


def is_done(run: dict[str, Any], has_result: bool) -> bool:
    return run.get("state") == "COMPLETED" and bool(run.get("recorded_at")) and has_result


def classify(
    index: int,
    params: dict[str, Any],
    run: dict[str, Any] | None,
    has_result: bool,
    slurm: SlurmTask | None,
    now: float | None = None,
) -> PointStatus:
    """One point's status from its run.json (None: never submitted), whether metrics.h5 exists, and Slurm's view of
    its array task (None: Slurm does not know it, or was not asked)."""
    if run is None:
        return PointStatus(index, params, "pending", reason="not submitted")
    job = str(run.get("array_task") or "")
    result = run.get("result_summary") or {}
    requests = result.get("requests", (run.get("progress") or {}).get("requests"))
    errors = result.get("errors")

    def status(state: str, reason: str = "") -> PointStatus:
        return PointStatus(index, params, state, job, reason, requests, errors)

    own = str(run.get("state") or "")
    if is_done(run, has_result):
        return status("done")
    if slurm is not None and slurm.state in SLURM_ACTIVE:
        if slurm.state in ("PENDING", "REQUEUED"):
            return status("pending", f"queued: {slurm.reason}" if slurm.reason not in ("", "None") else "queued")
        phase = str(run.get("phase") or "")
        return status("running", "starting" if phase in ("", "queued", "submitting") else phase)
    if own.split()[0:1] and own.split()[0] in FINAL:
        # The task's own words first; Slurm's state explains a task that never got to write them.
        cause = run.get("cause") or (f"Slurm: {slurm.state}" if slurm else own)
        return status("failed", f"{own}: {cause}" if own != "FAILED" else str(cause))
    if slurm is not None:  # Slurm says it ended, run.json does not: killed from outside, or it died unrecorded
        said = f" ({slurm.reason})" if slurm.reason not in ("", "None") else ""
        if slurm.state == "COMPLETED":
            return status("failed", "the task ended without recording a result; see logs/main.log")
        return status("failed", f"Slurm: {slurm.state}{said}")
    if own == "SUBMITTED":
        age = (now or time.time()) - float(run.get("created_at") or 0)
        if job and age > LOST_AFTER_S:
            return status("failed", f"Slurm has no record of {job}")
        return status("pending", "submitted")
    if own in ("RUNNING", "REQUEUED", "INTERRUPTED"):
        return status("running", str(run.get("phase") or own))  # no Slurm here to ask
    return status("pending", own.lower() or "not submitted")


def read_rows(root: Path) -> list[dict[str, Any]]:
    """sweep.json's rows ([] when there is none)."""
    try:
        rows = json.loads((root / SWEEP_FILE).read_text())
    except FileNotFoundError:
        return []
    return rows if isinstance(rows, list) else []


def write_rows(root: Path, rows: list[dict[str, Any]]) -> None:
    tmp = root / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    tmp.replace(root / SWEEP_FILE)


def read_run(folder: Path) -> dict[str, Any] | None:
    if not (folder / "run.json").exists():
        return None
    try:
        return read_state(folder)
    except Exception:  # half-written by hand or a full disk: the point shows as pending, never crashes status
        return None


def array_ids(root: Path) -> list[str]:
    path = root / ARRAYS_FILE
    if not path.exists():
        return []
    ids = []
    for line in path.read_text().splitlines():
        try:
            ids.append(str(json.loads(line)["job_id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def slurm_tasks(arrays: list[str]) -> dict[str, SlurmTask]:
    """Slurm's view of every task of `arrays`, by <array>_<index>: squeue for live ones, sacct for the rest. {} when
    Slurm is not here (a copied sweep folder, a laptop)."""
    import shutil

    if not arrays or shutil.which("squeue") is None:
        return {}
    ids = ",".join(arrays)
    out: dict[str, SlurmTask] = {}
    try:
        acct = subprocess.run(
            ["sacct", "-j", ids, "-X", "-n", "-P", "-o", "JobID,State,Reason,JobIDRaw"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        for line in acct.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 4 and "_" in parts[0] and "[" not in parts[0]:
                out[parts[0]] = SlurmTask(parts[1].split()[0], parts[2], parts[3])
        live = subprocess.run(
            ["squeue", "-h", "-r", "-j", ids, "-o", "%i|%T|%r|%A"], capture_output=True, text=True, timeout=30
        )
        for line in live.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 4:
                out[parts[0]] = SlurmTask(parts[1], parts[2], parts[3])
    except (subprocess.TimeoutExpired, OSError):
        return out
    return out


def sweep_status(root: Path, rows: list[dict[str, Any]] | None = None, *, slurm: bool = True) -> list[PointStatus]:
    """Every point's status, in index order; `rows` default to sweep.json's."""
    rows = read_rows(root) if rows is None else rows
    tasks = slurm_tasks(array_ids(root)) if slurm else {}
    out = []
    for row in rows:
        index = int(row["index"])
        params = row_params(row)
        folder = point_dir(root, index)
        run = read_run(folder)
        task = tasks.get(str(run.get("array_task"))) if run else None
        out.append(classify(index, params, run, (folder / "metrics.h5").is_file(), task))
    return out


def row_params(row: dict[str, Any]) -> dict[str, Any]:
    """A sweep.json row's parameters: its dotted spec keys (a simulated sweep's rows also carry the run's figures)."""
    return {k: v for k, v in row.items() if "." in k}


def check_unchanged(root: Path, name: str, rows: list[dict[str, Any]], specs: dict[int, str]) -> None:
    """A sweep folder holds one experiment: refuse to resume it with a sweep file whose points differ (their
    parameters, per sweep.json, or the spec a point was given, per its spec.yaml)."""
    old_rows = read_rows(root)
    if not old_rows:
        return
    old = {int(r["index"]): json.dumps(row_params(r), sort_keys=True, default=str) for r in old_rows}
    new = {int(r["index"]): json.dumps(row_params(r), sort_keys=True, default=str) for r in rows}
    differ = [i for i in sorted(set(old) | set(new)) if old.get(i) != new.get(i)]
    for i, text in specs.items():
        stored = point_dir(root, i) / "spec.yaml"
        if i not in differ and stored.exists() and stored.read_text() != text:
            differ.append(i)
    if differ:
        shown = ", ".join(map(str, differ[:10])) + (" ..." if len(differ) > 10 else "")
        raise UserError(
            f"{root} holds sweep {name} with other points (points {shown} differ: the grid or the base spec changed, "
            "or it is run from another folder); results are never mixed: rename the sweep (name:) or restore the "
            "sweep file"
        )


def counts(points: list[PointStatus]) -> dict[str, int]:
    return {s: sum(p.state == s for p in points) for s in STATES}
