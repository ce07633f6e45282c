"""Simulated engines' own HDF5 (`llmd engine sim --metrics-out FILE`): one time-series row per second per DP rank,
from the engine core's cumulative counters (llmd.metrics' schema, source = the pod name, or "<pod>/dp<rank>")."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from llmd.engines.sim.core import EngineStats
from llmd.metrics.sampler import PeriodicRecorder
from llmd.metrics.writer import MetricsWriter


def _share(part: int, whole: int) -> float:
    return part / whole if whole > 0 else math.nan


def engine_row(source: str, t: float, dt: float, prev: EngineStats, cur: EngineStats) -> dict[str, Any]:
    """One bin of one rank: rates over the bin from two cumulative readings, gauges as read at its end."""
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    finished = sum(cur.request_success.values()) - sum(prev.request_success.values())
    errors = cur.request_success.get("error", 0) - prev.request_success.get("error", 0)
    return {
        "t": t,
        "source": source,
        "tokens_in_per_s": (cur.prompt_tokens_total - prev.prompt_tokens_total) / dt,
        "tokens_out_per_s": (cur.generation_tokens_total - prev.generation_tokens_total) / dt,
        "requests_per_s": finished / dt,
        "queue_len": cur.num_requests_waiting,
        "running": cur.num_requests_running,
        "kv_usage": cur.kv_cache_usage_perc,
        "hit_share_gpu": _share(cur.prefix_cache_hits - prev.prefix_cache_hits, queries),
        "hit_share_cpu": _share(cur.cpu_prefix_cache_hits - prev.cpu_prefix_cache_hits, queries),
        "preemptions": cur.num_preemptions - prev.num_preemptions,
        "errors": errors + cur.num_pulls_failed - prev.num_pulls_failed,
        "kv_transfers": cur.num_pulls_ok - prev.num_pulls_ok,
    }


def _source(server: Any, rank: int) -> str:
    name = server.config.name or f"engine-{server.port}"
    return f"{name}/dp{rank}" if server.config.dp_size > 1 else name


class EngineSeries:
    """Records every rank of `servers` (started SimServers in this event loop) into `path` until `close()`."""

    def __init__(
        self,
        servers: Sequence[Any],
        path: str | os.PathLike[str],
        *,
        producer: str | None = None,
        meta: dict[str, Any] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        if producer is None:
            producer = (servers[0].config.name or "engine") if len(servers) == 1 else "engines"
        meta = dict(meta or {})
        meta.setdefault("engines", [s.config.name or s.url for s in servers])
        self.writer = MetricsWriter(path, producer, meta)
        self._ranks = [(_source(s, r.rank), r) for s in servers for r in s.ranks]
        self._prev = {src: r.core.stats() for src, r in self._ranks}
        self.recorder = PeriodicRecorder(self.writer, self._sample, interval_s).start()

    def _sample(self, t: float, dt: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows = []
        for src, rank in self._ranks:
            cur = rank.core.stats()
            rows.append(engine_row(src, t, dt, self._prev[src], cur))
            self._prev[src] = cur
        return [], rows

    async def close(self) -> None:
        await self.recorder.close()
