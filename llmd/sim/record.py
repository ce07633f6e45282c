"""The simulated run's metrics in llmd's one schema, written as the live stack writes them: the client's rows and
series (client.h5), the router's (router.h5), every engine rank's per-second series (engines.h5), merged into the
run's metrics.h5 at the end, so `llmd export`, the summary table and the figures read a simulated run unchanged.

Rows are taken once per simulated second, as the live producers batch theirs; times are virtual seconds from the
run's start.
"""

from __future__ import annotations

import math
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

from llmd.engines.sim.series import engine_row
from llmd.metrics.writer import MetricsWriter
from llmd.sim.engines import Fleet
from llmd.sim.router import Call, SimRouter
from llmd.workload.run_stats import RunStats

PARTS = ("client", "router", "engines")


def client_row(call: Call) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": call.request_id,
        "session": call.session,
        "turn": call.turn,
        "is_subagent": call.is_subagent,
        "send_time": call.send_time,
        "status": call.status,
        "input_tokens": call.input_tokens,
    }
    if call.done_time is not None:
        row["e2e_s"] = call.done_time - call.send_time
    if call.admitted is not None:
        row["router_queue_s"] = call.admitted - call.parsed
    if call.error:
        row["error"] = call.error
        return row
    row["output_tokens"] = call.output_tokens
    row["cached_tokens"] = max(call.cached_tokens, 0)
    row["pod"] = call.pod
    row["prefill_pod"] = call.prefill_pod
    row["pd_path"] = call.pd_path
    if call.first_token is not None:
        row["ttft_s"] = call.first_token - call.send_time
    times = call.token_times
    if len(times) > 1:
        gaps = [b - a for a, b in pairwise(times)]
        row["itl_mean_s"] = sum(gaps) / len(gaps)
        row["itl_p50_s"] = statistics.median(gaps)
        row["itl_max_s"] = max(gaps)
    return row


def router_row(call: Call) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": call.request_id,
        "session": call.session,
        "send_time": call.received,
        "status": call.status,
        "input_tokens": call.input_tokens,
    }
    if call.done_time is not None:
        row["e2e_s"] = call.done_time - call.received
    if call.admitted is not None:
        row["router_queue_s"] = call.admitted - call.parsed
        row["pod"] = call.pod
        row["prefill_pod"] = call.prefill_pod
        row["pd_path"] = call.pd_path
        row["expected_hit_tokens"] = call.expected_hit_tokens
        row["route_reason"] = call.route_reason
        row["kv_transfer_tokens"] = call.kv_transfer_tokens
        row["kv_transfer_bytes"] = call.kv_transfer_bytes
        row["kv_transfer_s"] = call.kv_transfer_s
    if call.first_token is not None:
        row["ttft_s"] = call.first_token - call.received
    if call.error:
        row["error"] = call.error
    return row


class SimRecorder:
    """Writes the three parts every simulated second (`tick`) and merges them at `close`."""

    def __init__(self, out_dir: Path, fleet: Fleet, router: SimRouter, meta: dict[str, Any]) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.paths = {name: out_dir / f"{name}.h5" for name in PARTS}
        self.writers = {name: MetricsWriter(self.paths[name], name, meta) for name in PARTS}
        self.fleet = fleet
        self.router = router
        self.client = RunStats()
        self.pending: list[Call] = []
        self._engines = [(r.name, r) for r in fleet.ranks]
        self._prev = {name: r.core.stats() for name, r in self._engines}
        self._t = 0.0
        self._rejected = router.core.queue.rejected
        self.closed = False

    def finished(self, call: Call) -> None:
        self.pending.append(call)

    def tick(self, t: float) -> None:
        """Rows for the second that ends at `t`."""
        dt = t - self._t
        if dt <= 0:
            return
        calls, self.pending = self.pending, []
        rows = []
        for c in calls:
            row = client_row(c)
            self.client.add(row, c.done_time or t)
            rows.append(row)
        if rows:
            self.writers["client"].append_requests(rows)
        bins = self.client.take_bins(int(t))
        if bins:
            self.writers["client"].append_timeseries(bins)
        routed, self.router.finished = self.router.finished, []
        if routed:
            self.writers["router"].append_requests([router_row(c) for c in routed])
        self.writers["router"].append_timeseries(self._router_series(self._t, dt, routed))
        self.fleet.sync()  # ranks in a decode fast-forward carry out the steps begun by now before they are read
        series = []
        for name, rank in self._engines:
            cur = rank.core.stats()
            series.append(engine_row(name, self._t, dt, self._prev[name], cur))
            self._prev[name] = cur
        self.writers["engines"].append_timeseries(series)
        self._t = t

    def _router_series(self, t: float, dt: float, routed: list[Call]) -> list[dict[str, Any]]:
        core = self.router.core
        prompt = sum(c.input_tokens for c in routed)
        on_pod = [c for c in routed if c.pod]
        routed_tokens = sum(c.input_tokens for c in on_pod)
        gpu = sum(c.gpu_hit_tokens for c in on_pod)
        cpu = sum(c.cpu_hit_tokens for c in on_pod)
        errors = sum(1 for c in routed if c.status >= 400 or c.error)
        rejected = core.queue.rejected
        out: list[dict[str, Any]] = [
            {
                "t": t,
                "source": "router",
                "tokens_in_per_s": prompt / dt,
                "requests_per_s": len(routed) / dt,
                "queue_len": core.queue.waiting,
                "inflight": core.ledger.total(),
                "hit_share_gpu": gpu / routed_tokens if routed_tokens else math.nan,
                "hit_share_cpu": cpu / routed_tokens if routed_tokens else math.nan,
                "errors": errors,
                "rejected": rejected - self._rejected,
            }
        ]
        self._rejected = rejected
        for name, rank in self._engines:
            st = rank.pod.ranks[rank.rank]
            out.append(
                {
                    "t": t,
                    "source": f"router/{name}",
                    "inflight": core.ledger.inflight(rank.holder),
                    "queue_len": st.waiting,
                    "running": st.running,
                    "kv_usage": st.kv_usage,
                }
            )
        return out

    def close(self, merged: Path) -> Path:
        from llmd.metrics import merge_runs

        if not self.closed:
            self.closed = True
            for w in self.writers.values():
                w.close()
        return merge_runs([p for p in self.paths.values() if p.exists()], merged)
