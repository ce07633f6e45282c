"""The discovery file the router follows (format: llmd/router/endpoints.py): engines append their entry once healthy.

Several engine tasks on several nodes append to one file on the shared filesystem, so each append holds an flock on a
side file and replaces the file atomically: the router, which reloads on mtime, never reads half a list.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from llmd.spec.layout import EngineEndpoint

DISCOVERY_FILE = "discovery.json"


def entry_for(ep: EngineEndpoint) -> dict[str, Any]:
    """The discovery entry of an engine serving `ep`'s layout ports (KV events bound on `*`: the router connects)."""
    return {
        "name": ep.name,
        "role": ep.role,
        "url": ep.url,
        "dp_size": ep.dp_size,
        "kv_events_endpoint": ep.kv_events_endpoint(bind=True),
        "kv_events_replay_endpoint": ep.replay_endpoint(bind=True),
        "side_channel_host": ep.host,
        "side_channel_port": ep.side_channel_port,
        "engine_id": ep.engine_id,
    }


def read_entries(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return data if isinstance(data, list) else []


def append_entry(path: Path, entry: dict[str, Any]) -> None:
    """Add `entry` (replacing one of the same name: a restarted engine) to the discovery file."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entries = [e for e in read_entries(path) if e.get("name") != entry["name"]] + [entry]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=2) + "\n")
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
