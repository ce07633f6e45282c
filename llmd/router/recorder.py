"""The router's own HDF5 (`llmd router --metrics-out FILE`): a row per routed request and, per second, the router's
totals (source "router") and its view of each pod (source "router/<pod>"), in llmd.metrics' one schema.

A request row as the router sees it: send_time = when the router received it, ttft_s = until the first response byte
passed on, e2e_s = until the response ended, input_tokens = the router's own count (its tokenization; under the
approximate policy an estimate from characters), expected_hit_tokens and route_reason from the scheduling decision,
session from X-Session-Id or the body's `user` ("" when neither). The KV transfer: kv_transfer_tokens as the hop plan
expected it (llmd.router.core.HopPlan.transfer_tokens; 0 when the last attempt carried none), kv_transfer_bytes from
the decode pool's model geometry (-1 without a latency model), kv_transfer_s the serving leg's seconds from being sent
to its first output, which hold the pull and that pod's wait and first step (NaN when the response was not streamed).

Request rows are buffered on the event loop and written in one batch per second, so the request path pays for a
dict, not for an HDF5 append.
"""

from __future__ import annotations

import math
import os
from typing import Any

from llmd.metrics.sampler import PeriodicRecorder
from llmd.metrics.writer import MetricsWriter


class _Bin:
    __slots__ = ("cpu_hit", "errors", "gpu_hit", "prompt_tokens", "requests", "routed_tokens")

    def __init__(self) -> None:
        self.requests = self.errors = self.prompt_tokens = 0
        self.gpu_hit = self.cpu_hit = self.routed_tokens = 0


class RouterRecorder:
    """`request(row, ...)` per finished request; the sampler writes rows and series every `interval_s`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        registry: Any,
        core: Any,
        *,
        meta: dict[str, Any] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.registry = registry
        self.core = core
        self.writer = MetricsWriter(path, "router", meta)
        self._rows: list[dict[str, Any]] = []
        self._bin = _Bin()
        self._rejected = core.queue.rejected
        self.recorder = PeriodicRecorder(self.writer, self._sample, interval_s)

    def start(self) -> RouterRecorder:
        self.recorder.start()
        return self

    def since_start(self, mono: float) -> float:
        return self.recorder.since_start(mono)

    def request(self, row: dict[str, Any], gpu_hit_tokens: int = 0, cpu_hit_tokens: int = 0) -> None:
        """One finished request (any status). Hit tokens are the router's prediction for the chosen pod."""
        self._rows.append(row)
        b = self._bin
        b.requests += 1
        if row.get("status", 0) >= 400 or row.get("error"):
            b.errors += 1
        tokens = row.get("input_tokens", -1)
        if tokens > 0:
            b.prompt_tokens += tokens
            if row.get("pod"):
                b.routed_tokens += tokens
                b.gpu_hit += gpu_hit_tokens
                b.cpu_hit += cpu_hit_tokens

    def _sample(self, t: float, dt: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows, self._rows = self._rows, []
        b, self._bin = self._bin, _Bin()
        rejected = self.core.queue.rejected
        inflight_total = 0
        series: list[dict[str, Any]] = []
        for pod in self.registry.pods.values():
            for r, st in enumerate(pod.ranks):
                inflight = self.core.ledger.inflight((pod.name, r))
                inflight_total += inflight
                name = pod.name if len(pod.ranks) == 1 else f"{pod.name}/dp{r}"
                series.append(
                    {
                        "t": t,
                        "source": f"router/{name}",
                        "inflight": inflight,
                        "queue_len": st.waiting,
                        "running": st.running,
                        "kv_usage": st.kv_usage if pod.healthy else math.nan,
                    }
                )
        share = (lambda n: n / b.routed_tokens) if b.routed_tokens else (lambda n: math.nan)
        series.insert(
            0,
            {
                "t": t,
                "source": "router",
                "tokens_in_per_s": b.prompt_tokens / dt,
                "requests_per_s": b.requests / dt,
                "queue_len": self.core.queue.waiting,
                "inflight": inflight_total,
                "hit_share_gpu": share(b.gpu_hit),
                "hit_share_cpu": share(b.cpu_hit),
                "errors": b.errors,
                "rejected": rejected - self._rejected,
            },
        )
        self._rejected = rejected
        return rows, series

    async def close(self) -> None:
        await self.recorder.close()
