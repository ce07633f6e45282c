"""A run's state file, RUN/run.json: what the launcher submitted and what the job reports about itself.

The launcher writes it at submit; the main job (component 0) updates state, progress, node lists and, on failure, the
cause. Every write replaces the file atomically, so a reader never sees half a file. Slurm's own view (sacct) is merged
in by `llmd status`: a job killed from outside never gets to write its end.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmd.errors import UserError
from llmd.spec.redact import redact_data

STATE_FILE = "run.json"
# States the job writes itself; Slurm's (PENDING, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED...) come from sacct.
ACTIVE = ("SUBMITTED", "PENDING", "STARTING", "RUNNING", "REQUEUED", "INTERRUPTED", "RENDERED")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def read_state(run_dir: Path) -> dict[str, Any]:
    path = state_path(run_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not an llmd run folder (no {STATE_FILE}); give a run folder or job id") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); was it edited by hand?") from None


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    # The launcher following the job and the main job may both write; a lock file keeps updates whole.
    with open(run_dir / ".run.json.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def update_state(run_dir: Path, /, **changes: Any) -> dict[str, Any]:
    """Merge `changes` into run.json (nested dicts merged one level deep) and return the new state. Secrets in them
    (a token in a log tail quoted as the cause) are stored as ***: run.json is shown by `llmd status` and shared."""
    changes = redact_data(changes)
    with _locked(run_dir):
        path = state_path(run_dir)
        try:
            state = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            state = {}
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(state.get(key), dict):
                state[key] = {**state[key], **value}
            else:
                state[key] = value
        state["updated_at"] = time.time()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return state


def is_final(state: str) -> bool:
    return state.split()[0] in FINAL if state else False
