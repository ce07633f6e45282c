"""CPU time on the processes around the GPUs: a `Host` is one single-threaded process (an asyncio event loop: the
router, an engine's API server, the benchmark client) whose work runs one piece at a time in arrival order.

The GPUs' time is the latency model's; this is the rest: parsing and tokenizing a prompt, a scheduling decision,
relaying a streamed token, rendering /metrics. On a cluster each component is its own process and this is small
next to prefill; in `llmd demo` every component shares one event loop on one core, and its queue is a visible part of
TTFT. `SimParams.colocated` makes every component one Host, as there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmd.sim.loop import EventLoop


class Host:
    __slots__ = ("busy_s", "free_at", "loop", "name")

    def __init__(self, loop: EventLoop, name: str) -> None:
        self.loop = loop
        self.name = name
        self.free_at = 0.0
        self.busy_s = 0.0

    def run(self, cost_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` once `cost_s` of this process's time, queued behind what it already has, has been spent."""
        now = self.loop.now
        start = self.free_at if self.free_at > now else now
        self.free_at = done = start + cost_s
        self.busy_s += cost_s
        self.loop.at(done, fn, *args)

    def stall(self, cost_s: float) -> None:
        """Work that delays everything queued after it and calls nothing (a /metrics render, a GC pause)."""
        now = self.loop.now
        start = self.free_at if self.free_at > now else now
        self.free_at = start + cost_s
        self.busy_s += cost_s
