"""The discovery file every engine node appends its endpoints to once healthy, and the router follows (on mtime).

Appends are atomic and safe across processes and nodes on a shared filesystem: an exclusive fcntl lock on a side
file (`discovery.json.lock`) serialises writers, each writes the whole list to a temp file and renames it over the
old one, so a reader sees the old list or the new one, never half of either. Entries of other nodes are kept; an
entry of the same name (an engine restarted on a requeued job) is replaced.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmd.errors import UserError

FILE_NAME = "discovery.json"


def read_entries(path: Path) -> list[dict[str, Any]]:
    """The entries in `path`; [] when it does not exist. UserError (and nothing touched) when it is not a list."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"discovery file {path} is not valid JSON ({exc}); fix or move it, then restart") from exc
    if not isinstance(data, list):
        raise UserError(f"discovery file {path} holds a {type(data).__name__}, not a list of engine entries")
    return data


def publish(path: str | os.PathLike[str], entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add (or replace, by name) `entries` in the discovery file at `path`; returns the list as written."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            names = {e["name"] for e in entries}
            merged = [e for e in read_entries(path) if e.get("name") not in names] + list(entries)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "w") as out:
                json.dump(merged, out, indent=1)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
            return merged
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
