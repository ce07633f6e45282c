"""A run's id: a random word made once per launch (or demo, or sweep point) that every component of the run answers
with, so a client can tell this run's router or engine from whatever else listens on the same host and port.

It identifies, it does not authorize: it travels in the environment ($LLMD_RUN_ID), on command lines and in run.json,
and is no secret (hence "id": llmd hides values of *_TOKEN names from logs and run.json). The router and the simulated
engine answer /health with the header `x-llmd-run: ID`. Real vLLM's /health cannot say it, so vLLM is started with a
second served model name, `llmd-run-ID`, which its /v1/models lists: vLLM itself vouches for the id, and the first
served name stays the one responses and metrics carry.

`identify(url, run_id)` is the one check every waiter and client runs (sync, urllib); the router's pod health loop
runs the same rules over aiohttp with `answers_for`.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ENV = "LLMD_RUN_ID"
HEADER = "x-llmd-run"
MODEL_PREFIX = "llmd-run-"


def new_run_id() -> str:
    return secrets.token_hex(8)


def from_env() -> str | None:
    return os.environ.get(ENV) or None


def served_name(run_id: str) -> str:
    """The extra served model name that makes vLLM's /v1/models vouch for the run."""
    return f"{MODEL_PREFIX}{run_id}"


def models_vouch(models: Any, run_id: str) -> bool:
    """Whether a /v1/models body lists this run's served name."""
    data = models.get("data") if isinstance(models, dict) else None
    want = served_name(run_id)
    return isinstance(data, list) and any(isinstance(m, dict) and m.get("id") == want for m in data)


def where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def foreign_message(url: str, answered: str, name: str = "component") -> str:
    return (
        f"something else is listening on {where(url)} (its /health did not answer with this run's id): {answered}; "
        f"it is not this run's {name}, so nothing is sent there"
    )


@dataclass(frozen=True)
class Answer:
    """What one identity check found: `ok`; `foreign` (a server answered, but not this run's: a message says what
    answered); or neither (nothing answers yet, or it is not ready: `reason`)."""

    ok: bool
    foreign: bool = False
    reason: str = ""


def answers_for(status: int, header: str | None, body: bytes, run_id: str | None) -> Answer | None:
    """The verdict on a /health answer; None when only /v1/models can tell (a 200 without the header: vLLM)."""
    if status != 200:
        if header is not None and run_id is not None and header != run_id:
            return Answer(False, True, f"/health answered {status} for run {header!r}")
        return Answer(False, reason=f"/health answered {status}")
    if run_id is None or header == run_id:
        return Answer(True)
    if header is not None:
        return Answer(False, True, f"an llmd component of another run ({header!r})")
    return None


def describe(status: int, headers: Any, body: bytes) -> str:
    """A short account of a foreign answer, for the message: status, server, the start of the body."""
    server = headers.get("Server") if headers is not None else None
    text = body[:80].decode("utf-8", "replace").strip()
    parts = [f"HTTP {status}"] + ([f"Server: {server}"] if server else []) + ([repr(text)] if text else [])
    return ", ".join(parts)


def _get(url: str, timeout_s: float) -> tuple[int, Any, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.headers, resp.read(65536)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read(65536) if exc.fp is not None else b""


def identify(url: str, run_id: str | None, timeout_s: float = 2.0, name: str = "component") -> Answer:
    """Ask the server at base `url` whether it belongs to run `run_id` (None: any healthy server will do).
    Connection errors are "not yet" (ok False, foreign False)."""
    base = url.rstrip("/")
    try:
        status, headers, body = _get(base + "/health", timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        # Not HTTP (BadStatusLine...) is "not yet" too: a probe of a free port in the ephemeral range can connect to
        # itself and read its own request back. Whatever else it is, the waiter's timeout names it.
        return Answer(False, reason=f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")
    got = answers_for(status, headers.get(HEADER) if headers is not None else None, body, run_id)
    if got is not None:
        if got.foreign:
            return Answer(False, True, foreign_message(url, got.reason, name))
        return got
    assert run_id is not None
    try:
        m_status, _, m_body = _get(base + "/v1/models", timeout_s)
        models = json.loads(m_body) if m_status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        models = None
    if models_vouch(models, run_id):
        return Answer(True)
    return Answer(False, True, foreign_message(url, describe(status, headers, body), name))
