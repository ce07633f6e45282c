"""Replay of a recorded agentic trace: JSONL lines {session, parent?, t, input_text | input_tokens, output_tokens},
validated line by line, as the same `Turn`s the generated profiles produce (plus the text when the trace has it)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.workload.sessions import Turn


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceTurn:
    turn: Turn
    t: float  # start offset from the beginning of the run (scaled), seconds
    input_text: str | None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object")
    if not isinstance(rec.get("session"), str | int) or isinstance(rec.get("session"), bool) or rec["session"] == "":
        raise TraceError(f"{where}: field 'session' must be a non-empty string or integer")
    parent = rec.get("parent")
    if parent is not None and (not isinstance(parent, str | int) or isinstance(parent, bool)):
        raise TraceError(f"{where}: field 'parent' must be a string or integer when given")
    t = rec.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: field 't' must be a number of seconds >= 0")
    has_text, has_tokens = "input_text" in rec, "input_tokens" in rec
    if has_text == has_tokens:
        raise TraceError(f"{where}: give exactly one of fields 'input_text' and 'input_tokens'")
    if has_text and (not isinstance(rec["input_text"], str) or not rec["input_text"]):
        raise TraceError(f"{where}: field 'input_text' must be a non-empty string")
    if has_tokens and (not _int(rec["input_tokens"]) or rec["input_tokens"] < 1):
        raise TraceError(f"{where}: field 'input_tokens' must be an integer >= 1")
    if not _int(rec.get("output_tokens")) or rec["output_tokens"] < 1:
        raise TraceError(f"{where}: field 'output_tokens' must be an integer >= 1")
    return rec


def read_trace(
    path: str | Path, *, tokenizer: Any = None, context_scale: float = 1.0, time_scale: float = 1.0
) -> Iterator[TraceTurn]:
    """Yield the trace's turns in file order. Token counts of `input_text` come from `tokenizer` when given (else
    ~4 characters a token); `context_scale` scales token counts (not the text), `time_scale` times. A turn whose
    input does not extend the previous turn's (text not a prefix, or fewer tokens) is marked a reset."""
    path = Path(path)
    state: dict[str, tuple[int, int, int, float, str | None]] = {}  # session -> (index, input, output, t, text)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            rec = _parse(line, where)
            sid = str(rec["session"])
            parent = None if rec.get("parent") is None else str(rec["parent"])
            text = rec.get("input_text")
            if text is not None:
                raw = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else max(1, len(text) // 4)
            else:
                raw = rec["input_tokens"]
            inp = max(1, round(raw * context_scale))
            out = max(1, round(rec["output_tokens"] * context_scale))
            t = float(rec["t"]) * time_scale
            prev = state.get(sid)
            if prev is None:
                turn = Turn(sid, 0, parent, parent is not None, inp, inp, out, t)
            else:
                index, p_in, p_out, p_t, p_text = prev
                if t < p_t:
                    raise TraceError(f"{where}: field 't' goes back in time for session {sid!r} ({t} < {p_t})")
                extends = inp >= p_in + p_out if text is None or p_text is None else text.startswith(p_text)
                new = inp - p_in - p_out if extends else inp
                turn = Turn(sid, index + 1, parent, parent is not None, inp, max(0, new), out, t - p_t, not extends)
            state[sid] = (turn.turn_index, inp, out, t, text)
            yield TraceTurn(turn, t, text)


@dataclass(slots=True)
class TraceSession:
    """One session of a trace: its turns in order, the absolute start offset of each (seconds from the run's start,
    scaled) and the session it was forked from (None for a main session)."""

    session_id: str
    parent: str | None
    turns: list[TraceTurn]

    @property
    def start(self) -> float:
        return self.turns[0].t


def trace_sessions(turns: Iterator[TraceTurn] | list[TraceTurn], where: str = "trace") -> list[TraceSession]:
    """Group a trace's turns by session, sessions ordered by their first turn's time (file order on ties). A parent
    must be a session of the trace that starts no later than its child (a sub-agent forks from a running context)."""
    by_id: dict[str, TraceSession] = {}
    for tt in turns:
        sid = tt.turn.session_id
        s = by_id.get(sid)
        if s is None:
            by_id[sid] = TraceSession(sid, tt.turn.parent_session_id, [tt])
        else:
            if tt.turn.parent_session_id != s.parent:
                raise TraceError(f"{where}: session {sid!r} names parent {tt.turn.parent_session_id!r}, "
                                 f"its first line {s.parent!r}")  # fmt: skip
            s.turns.append(tt)
    for s in by_id.values():
        if s.parent is None:
            continue
        p = by_id.get(s.parent)
        if p is None:
            raise TraceError(f"{where}: session {s.session_id!r} names parent {s.parent!r}, which is not in the trace")
        if p.start > s.start:
            raise TraceError(
                f"{where}: session {s.session_id!r} starts at {s.start:g} s, before its parent {s.parent!r} "
                f"({p.start:g} s)"
            )
        seen = {s.session_id}
        while p is not None and p.parent is not None:  # a cycle would have every session wait for another
            if p.session_id in seen:
                raise TraceError(f"{where}: sessions {sorted(seen)} name each other as parents (a cycle)")
            seen.add(p.session_id)
            p = by_id.get(p.parent)
    return sorted(by_id.values(), key=lambda s: s.start)
