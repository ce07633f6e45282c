"""Where a run stands: run.json (what the job says) merged with Slurm's view (what the job cannot say after being
killed), found by run folder or job id, printed once (`llmd status`) or followed until the end (`llmd launch`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launchers.runstate import is_final, read_state, update_state
from llmd.errors import UserError

FOLLOW_POLL_S = 2.0
SLURM_GRACE_S = 60.0


def index_path() -> Path:
    """Job id -> run folder, so `llmd status 123` works from anywhere: $LLMD_STATE_DIR or ~/.local/state/llmd."""
    root = Path(os.environ.get("LLMD_STATE_DIR") or Path.home() / ".local" / "state" / "llmd")
    return root / "runs.jsonl"


def remember(job_id: str, run_dir: Path) -> None:
    path = index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"job_id": job_id, "run_dir": str(run_dir)}) + "\n")


def find_run(run: str) -> Path:
    """A run folder from what the user typed: a folder with run.json, or a Slurm job id."""
    p = Path(run)
    if p.is_dir():
        if not (p / "run.json").exists():
            raise UserError(f"{p} is a folder but not an llmd run folder (no run.json)")
        return p.resolve()
    if run.isdigit():
        found = None
        if index_path().exists():
            for line in index_path().read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if str(row.get("job_id")) == run:
                    found = Path(row["run_dir"])
        if found is not None and (found / "run.json").exists():
            return found
        raise UserError(f"no llmd run is known for job {run} (looked in {index_path()}); give the run folder instead")
    raise UserError(f"{run!r} is neither a run folder nor a Slurm job id")


def current(run_dir: Path, slurm: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """run.json, corrected by Slurm: a job Slurm says ended while run.json still says running was killed from
    outside (scancel, node failure, time limit); that is recorded, with Slurm's reason as the cause."""
    state = read_state(run_dir)
    job_id = state.get("job_id")
    if not job_id or slurm is None:
        return state
    try:
        js = slurm(str(job_id))
    except UserError:
        return state  # no Slurm here: run.json is all we know
    state["slurm"] = {"state": js.state, "reason": js.reason, "components": [list(c) for c in js.components]}
    mine = state.get("state", "")
    if js.state in ("PENDING", "REQUEUED") and mine in ("SUBMITTED", "PENDING", "INTERRUPTED", "REQUEUED", ""):
        state["state"] = "PENDING"
        again = " again (requeued)" if mine in ("INTERRUPTED", "REQUEUED") else ""
        state["phase"] = f"pending{again}" + (f": {js.reason}" if js.reason else "")
    elif is_final(js.state) and not is_final(mine):
        cause = f"Slurm ended the job: {js.state}" + (f" ({js.reason})" if js.reason else "")
        state = {**update_state(run_dir, state=js.state, cause=cause), "slurm": state["slurm"]}
    return state


def describe(state: dict[str, Any]) -> str:
    lines = [f"run:      {state.get('run_dir', '?')}", f"job:      {state.get('job_id') or '(not submitted)'}"]
    slurm = state.get("slurm")
    st = state.get("state", "?")
    lines.append(f"state:    {st}" + (f"  (Slurm: {slurm['state']})" if slurm else ""))
    if state.get("phase"):
        lines.append(f"phase:    {state['phase']}")
    if state.get("cause"):
        lines.append(f"cause:    {state['cause']}")
    prog = state.get("progress") or {}
    if prog:
        attempt = f", attempt {state['attempt']}" if state.get("attempt") else ""
        lines.append(f"progress: {prog.get('requests', 0)} requests{attempt}")
    nodes = state.get("nodes") or {}
    if nodes:
        lines.append("nodes:    " + "; ".join(f"{role} {','.join(n)}" for role, n in sorted(nodes.items())))
    for name, path in sorted((state.get("logs") or {}).items()):
        lines.append(f"log:      {name:8s} {path}")
    if state.get("result"):
        lines.append(f"result:   {state['result']}")
    return "\n".join(lines)


def follow(
    run_dir: Path, slurm: Callable[[str], Any], limit_s: float, out: Callable[[str], None] = print
) -> dict[str, Any]:
    """Print state and phase changes and progress until the run ends or `limit_s` passes; return the last state."""
    seen: tuple[Any, ...] = ()
    deadline = time.monotonic() + limit_s
    state = current(run_dir, slurm)
    ended_at = float("inf")
    while True:
        key = (state.get("state"), state.get("phase"), (state.get("progress") or {}).get("requests"))
        if key != seen:
            seen = key
            prog = state.get("progress") or {}
            extra = f", {prog['requests']} requests" if "requests" in prog else ""
            out(f"[{time.strftime('%H:%M:%S')}] {state.get('state')}: {state.get('phase') or ''}{extra}")
        if time.monotonic() > deadline:
            return state
        if is_final(state.get("state", "")):
            # The main job writes its verdict just before it exits; return once Slurm has ended the job too, so
            # nothing of it is left running when `llmd launch` returns.
            slurm_state = (state.get("slurm") or {}).get("state", "UNKNOWN")
            if is_final(slurm_state) or slurm_state == "UNKNOWN" or time.monotonic() > ended_at + SLURM_GRACE_S:
                return state
            ended_at = min(ended_at, time.monotonic())
        time.sleep(FOLLOW_POLL_S)
        state = current(run_dir, slurm)
