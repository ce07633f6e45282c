"""The simulator's clock: a discrete-event loop in virtual seconds. Nothing sleeps; time jumps to the next event.

Events at the same instant run in the order they were scheduled (a sequence number breaks ties), so a run is a pure
function of its inputs and seed. `EventLoop` is the C build of this class (llmd/sim/_loop.c: the same order and clock,
without a tuple per event) where it was compiled; `PyEventLoop` is this source, which serves where it was not.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any


class PyEventLoop:
    """`at(t, fn, *args)` schedules; `run(until)` executes events in time order up to `until` (inclusive)."""

    __slots__ = ("_heap", "_seq", "events", "now", "stopped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.stopped = False

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        # Never in the past: a model that computes an earlier time (rounding) runs now.
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        # `at` inlined: one call less on the loop's busiest path.
        now = self.now
        t = now + dt
        heapq.heappush(self._heap, (t if t > now else now, next(self._seq), fn, args))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until: float) -> bool:
        """Runs events up to `until`; True when events remain after it (or `stop()` was called)."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap and heap[0][0] <= until and not self.stopped:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
        self.events += n
        if not self.stopped and (not heap or heap[0][0] > until):
            self.now = max(self.now, until) if heap else self.now
        return bool(heap)

    def stop(self) -> None:
        self.stopped = True


if TYPE_CHECKING:
    EventLoop = PyEventLoop  # what annotations name: the C class has the same methods and attributes
else:
    try:
        if os.environ.get("LLMD_SIM_LOOP_PURE_PYTHON") == "1":
            raise ImportError("LLMD_SIM_LOOP_PURE_PYTHON=1")
        from llmd.sim._loop import EventLoop
    except ImportError:  # no compiler where llmd was installed (or asked not to): the same loop in Python
        EventLoop = PyEventLoop
