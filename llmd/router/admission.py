"""Admission's wait queue: requests the engines have no room for wait here, fair across sessions. Pure, no I/O.

Why in the router: an engine given more than it can batch preempts (recomputes) running requests, which agentic
contexts of 100K+ tokens make very expensive; waiting here costs nothing and lets the scheduler decide late, with the
freshest index. Waiting is fair across sessions: the queue is a round-robin over sessions, each with its own FIFO, so
one agent's burst of sub-agents cannot starve the others. Only a full router queue is refused (429 + Retry-After).

The queue holds plain entries; `pump(choose)` runs the caller's decision for the heads in turn and returns which were
admitted. Slots (how many requests each endpoint may have in flight) are the router core's ledger.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

E = TypeVar("E", bound=Hashable)
T = TypeVar("T")
_HEAD_TRIES = 16


class QueueFull(Exception):
    """The router's own queue is full: the client should come back after `retry_after_s`."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"router queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class WaitQueue(Generic[E]):
    """A session-fair queue of waiting entries: round-robin over sessions, FIFO within one."""

    def __init__(self, queue_limit: int) -> None:
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.queue_limit = queue_limit
        self._sessions: OrderedDict[str, deque[E]] = OrderedDict()  # round-robin order: first is next
        self.waiting = 0
        self.admitted = 0
        self.rejected = 0

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def full(self) -> bool:
        return self.waiting >= self.queue_limit

    def push(self, session: str, entry: E) -> None:
        """Queue `entry` behind its session's (the caller checks `full` first and counts what it refuses)."""
        q = self._sessions.get(session)
        if q is None:
            q = self._sessions[session] = deque()
        q.append(entry)
        self.waiting += 1

    def remove(self, session: str, entry: E) -> bool:
        """Take a waiting entry out (its request gave up); False if it was not waiting."""
        q = self._sessions.get(session)
        if q is None:
            return False
        try:
            q.remove(entry)
        except ValueError:
            return False
        self.waiting -= 1
        if not q:
            del self._sessions[session]
        return True

    def pump(
        self, choose: Callable[[E], T | None], alive: Callable[[E], bool] | None = None
    ) -> list[tuple[E, T | Exception]]:
        """Admit heads, one per session in turn, while `choose(entry)` finds room; returns what each admitted entry
        got (a failing decision fails its entry, not the queue: the exception is its result).

        A head that finds no room (one waiting for the engine that holds its prefix, or whose retry excludes the only
        endpoint with room) lets the next sessions' heads try before the pump gives up, so one constrained request
        cannot hold the queue. Heads that are no longer `alive` (their request went away) are dropped untried.
        """
        out: list[tuple[E, T | Exception]] = []
        sessions = self._sessions
        misses = 0
        while sessions and misses < min(len(sessions), _HEAD_TRIES):
            session, q = next(iter(sessions.items()))
            entry = q[0]
            if alive is not None and not alive(entry):
                self._pop_head(session, q)
                continue
            try:
                got = choose(entry)
            except Exception as exc:
                self._pop_head(session, q)
                out.append((entry, exc))
                continue
            if got is None:
                misses += 1
                sessions.move_to_end(session)
                continue
            misses = 0
            self._pop_head(session, q)
            out.append((entry, got))
            self.admitted += 1
        return out

    def _pop_head(self, session: str, q: deque[E]) -> None:
        q.popleft()
        self.waiting -= 1
        if q:
            self._sessions.move_to_end(session)
        else:
            del self._sessions[session]


class Rate:
    """Events per second over a sliding ~10 s window, in two buckets (cheap: one add per event); time is passed in."""

    __slots__ = ("count", "prev", "start")

    def __init__(self, now: float) -> None:
        self.start = now
        self.count = 0
        self.prev = 0.0

    def tick(self, now: float) -> None:
        if now - self.start > 5.0:
            self.prev = self.count / (now - self.start)
            self.start = now
            self.count = 0
        self.count += 1

    def per_second(self, now: float) -> float:
        span = now - self.start
        cur = self.count / span if span > 0.5 else 0.0
        return max(cur, self.prev)


def retry_after(waiting: int, rate: float) -> int:
    """Seconds until a queue of `waiting` has likely drained enough to take a request at `rate` completions/s."""
    if rate <= 0:
        return 1
    return max(1, min(60, math.ceil(waiting / rate)))
