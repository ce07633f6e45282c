"""Per-second recording for long-running producers (router, engines): a task on the producer's event loop that
asks for one bin's rows every interval and appends them to a MetricsWriter."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from llmd.metrics.writer import MetricsWriter

log = logging.getLogger(__name__)

# sample(t, dt) -> (request rows, time-series rows) of the bin [t, t + dt), t in seconds since the writer's start.
SampleFn = Callable[[float, float], tuple[list[dict[str, Any]], list[dict[str, Any]]]]


class PeriodicRecorder:
    """Calls `sample` every `interval_s` (aligned to the writer's start, so bins are whole seconds) and once more
    on close, so the last partial bin is kept. The writer is the recorder's: close() closes it."""

    def __init__(self, writer: MetricsWriter, sample: SampleFn, interval_s: float = 1.0) -> None:
        self.writer = writer
        self.sample = sample
        self.interval_s = interval_s
        # The writer's start_time is wall time; bins are measured on the monotonic clock from the same moment.
        self.mono0 = time.monotonic() - (time.time() - writer.start_time)
        self._last = max(0.0, time.monotonic() - self.mono0)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def since_start(self, mono: float) -> float:
        """A time.monotonic() reading as seconds since the run file's start_time."""
        return mono - self.mono0

    def start(self) -> PeriodicRecorder:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="metrics-sampler")
        return self

    async def _loop(self) -> None:
        k = int(self._last // self.interval_s) + 1
        while True:
            await asyncio.sleep(max(0.0, k * self.interval_s - (time.monotonic() - self.mono0)))
            try:
                self.tick()
            except Exception:  # a bad row must not stop the producer; the next bin tries again
                log.exception("metrics sampling failed")
            k = int(self._last // self.interval_s) + 1

    def tick(self) -> None:
        now = time.monotonic() - self.mono0
        dt = now - self._last
        if dt <= 0:
            return
        requests, series = self.sample(self._last, dt)
        self._last = now
        if requests:
            self.writer.append_requests(requests)
        if series:
            self.writer.append_timeseries(series)

    async def close(self) -> None:
        """The last bin, then the file; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            self.tick()
        finally:
            self.writer.close()
