"""Admission control: a bounded number of requests in flight per engine endpoint, the rest waiting in the router.

Why in the router: an engine given more than it can batch preempts (recomputes) running requests, which agentic
contexts of 100K+ tokens make very expensive; waiting here costs nothing and lets the scheduler decide late, with the
freshest index. Waiting is fair across sessions: the queue is a round-robin over sessions, each with its own FIFO, so
one agent's burst of sub-agents cannot starve the others. Only a full router queue is refused (429 + Retry-After).

The scheduling decision is made by the caller's `choose()`, run at admission time (no await between choosing and
taking the slot, so two requests never take the last slot of one endpoint).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")
_HEAD_TRIES = 16


class QueueFull(Exception):
    """The router's own queue is full: the client should come back after `retry_after_s`."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"router queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class _Waiter(Generic[T]):
    __slots__ = ("choose", "future", "session", "since")

    def __init__(self, session: str, choose: Callable[[], T | None], future: asyncio.Future[T]) -> None:
        self.session = session
        self.choose = choose
        self.future = future
        self.since = time.monotonic()


class Admission:
    """Per-endpoint in-flight slots plus a session-fair wait queue."""

    def __init__(self, max_inflight: int, queue_limit: int) -> None:
        if max_inflight < 1 or queue_limit < 0:
            raise ValueError("max_inflight must be >= 1 and queue_limit >= 0")
        self.max_inflight = max_inflight
        self.queue_limit = queue_limit
        self.inflight: dict[Hashable, int] = {}
        self._sessions: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # round-robin order: first is next
        self.waiting = 0
        self.admitted = 0
        self.rejected = 0
        self._done_rate = _Rate()

    # -- slots
    def has_room(self, key: Hashable) -> bool:
        return self.inflight.get(key, 0) < self.max_inflight

    def take(self, key: Hashable) -> None:
        self.inflight[key] = self.inflight.get(key, 0) + 1

    def release(self, key: Hashable) -> None:
        n = self.inflight.get(key, 0) - 1
        if n > 0:
            self.inflight[key] = n
        else:
            self.inflight.pop(key, None)
        self._done_rate.tick()
        if self.waiting:
            self.pump()

    # -- queue
    async def admit(self, session: str, choose: Callable[[], T | None], undo: Callable[[T], None]) -> T:
        """`choose()` returns a decision having taken its slot(s) with `take`, or None when no endpoint has room.

        Requests wait while others wait (no overtaking the queue) or while nothing has room. `undo` gives back what a
        decision took when its request was cancelled between being chosen and resuming.
        """
        queued = self.waiting
        if not queued:
            got = choose()
            if got is not None:
                self.admitted += 1
                return got
        if self.waiting >= self.queue_limit:
            self.rejected += 1
            raise QueueFull(self.retry_after())
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        w = _Waiter(session, choose, fut)
        q = self._sessions.get(session)
        if q is None:
            q = self._sessions[session] = deque()
        q.append(w)
        self.waiting += 1
        if queued:
            # Others wait, maybe for endpoints that are full while this one's is not (a request waits for the engine
            # holding its prefix): give it its turn in the round now rather than at the next release.
            self.pump()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                undo(fut.result())
            else:
                self._remove(w)
            raise

    def _remove(self, w: _Waiter) -> None:
        q = self._sessions.get(w.session)
        if q is None:
            return
        try:
            q.remove(w)
        except ValueError:
            return
        self.waiting -= 1
        if not q:
            del self._sessions[w.session]

    def pump(self) -> int:
        """Admit waiters, one per session in turn, while endpoints have room; returns how many were admitted.

        A head that finds no room (one waiting for the engine that holds its prefix, or whose retry excludes the only
        endpoint with room) lets the next sessions' heads try before the pump gives up, so one constrained request
        cannot hold the queue.
        """
        n = 0
        sessions = self._sessions
        misses = 0
        while sessions and misses < min(len(sessions), _HEAD_TRIES):
            session, q = next(iter(sessions.items()))
            w = q[0]
            if w.future.done():  # cancelled; its task has not run its cleanup yet
                self._pop_head(session, q)
                continue
            try:
                got = w.choose()
            except Exception as exc:  # a failing decision fails its request, not the queue
                self._pop_head(session, q)
                if not w.future.done():
                    w.future.set_exception(exc)
                continue
            if got is None:
                misses += 1
                sessions.move_to_end(session)
                continue
            misses = 0
            self._pop_head(session, q)
            w.future.set_result(got)
            self.admitted += 1
            n += 1
        return n

    def _pop_head(self, session: str, q: deque[_Waiter]) -> None:
        q.popleft()
        self.waiting -= 1
        if q:
            self._sessions.move_to_end(session)
        else:
            del self._sessions[session]

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained enough to take a request: its length over the recent rate."""
        rate = self._done_rate.per_second()
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil(self.waiting / rate)))

    def stats(self) -> dict[str, int]:
        return {
            "waiting": self.waiting,
            "sessions_waiting": len(self._sessions),
            "inflight": sum(self.inflight.values()),
            "admitted": self.admitted,
            "rejected": self.rejected,
        }


class _Rate:
    """Completions per second over a sliding ~10 s window, in two buckets (cheap: one add per release)."""

    __slots__ = ("count", "prev", "start")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.count = 0
        self.prev = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.start > 5.0:
            self.prev = self.count / (now - self.start)
            self.start = now
            self.count = 0
        self.count += 1

    def per_second(self) -> float:
        span = time.monotonic() - self.start
        cur = self.count / span if span > 0.5 else 0.0
        return max(cur, self.prev)
