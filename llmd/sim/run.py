"""One simulated run: a spec's fleet, llmd's router core and the spec's agents on one event loop, in virtual time.

`Simulation(spec, ...).run()` advances the loop a simulated second at a time (the recorder's bins, the progress
callback), stops when the workload's duration and the stop grace are over or nothing is left in flight, and on
Ctrl-C keeps what was simulated: every part file is closed and merged into the run's metrics.h5 either way.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd.kv.hashing import BlockHasher
from llmd.sim import hugepages
from llmd.sim.agents import Agents
from llmd.sim.context import ContextBuilder
from llmd.sim.engines import Fleet
from llmd.sim.loop import EventLoop
from llmd.sim.params import SimParams
from llmd.sim.record import SimRecorder
from llmd.sim.router import Call, SimRouter
from llmd.workload.profiles import profile_from_spec

ABORTED = "aborted: the run ended"
SIM_HASHING = {"hash_algo": "xxhash", "hash_seed": "0"}


@dataclass
class SimStats:
    """The run's figures, from the client's rows and the engines' own counters."""

    sim_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0
    interrupted: bool = False
    requests: int = 0
    errors: int = 0  # refused or failed requests; the run's cut-off is counted apart, in `aborted`
    aborted: int = 0  # still running when the run ended (the client's stop, not a failure)
    overflows: int = 0  # whole run: turns compacted or reset so the prompt fits the model's window (max_model_len)
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    queue_p90_s: float = math.nan
    hit_share: float = math.nan  # engines' prefix-cache hits over queries (local GPU + CPU tier)
    hit_share_gpu: float = math.nan
    cached_input_share: float = math.nan  # input tokens not computed: local hits + pulled KV
    preemptions: int = 0
    kv_transfers: int = 0
    kv_transfer_bytes_mean: float = math.nan
    p2p_lookups: int = 0
    cpu_restores: int = 0
    cpu_restore_mean_s: float = math.nan
    makespan_s: float = math.nan  # when the last successful request ended (a fixed batch of sessions: its duration)
    since_s: float = 0.0  # the window's start: requests sent from then on, engine counters accrued from then on
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_min(self) -> float:
        return self.requests / self.sim_s * 60 if self.sim_s > 0 else math.nan

    @property
    def sim_speedup(self) -> float:
        return self.sim_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else math.nan


@dataclass(frozen=True)
class Counters:
    """The fleet's and router's cumulative counters at one moment; a window's figures are two snapshots' difference,
    so a run's warm-up (cold caches, every agent's first prompt at once) can be left out of its steady state."""

    queries: int = 0
    hits_gpu: int = 0
    hits: int = 0  # local GPU + CPU tier
    preemptions: int = 0
    cpu_restores: int = 0
    cpu_restore_s: float = 0.0
    pulls: int = 0
    pull_bytes: float = 0.0
    p2p_lookups: int = 0

    def __sub__(self, o: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) - getattr(o, f.name) for f in dataclasses.fields(self)))


class Simulation:
    def __init__(
        self,
        spec: Any,
        *,
        out_dir: Path | None = None,
        policy: str | None = None,
        params: SimParams | None = None,
        run_id: str = "sim",
        keep_contexts: bool = False,
    ) -> None:
        """`keep_contexts`: finished calls keep their prompt's tokens and hashes (to inspect them); by default they
        let them go, as a 15-minute run at 3,000 agents finishes ~100K calls of up to ~3K blocks each."""
        # Block identity is what the simulation needs, not the digest: xxhash names the same blocks the same way at a
        # fifth of sha256_cbor's cost, and hashing every new block of every agent's context is the simulator's
        # largest fixed cost.
        spec = spec.model_copy(update={"model": spec.model.model_copy(update=SIM_HASHING)})
        # Before the fleet is built: its state is most of what a run reads (llmd/sim/_hugepages.c says why).
        hugepages.enable()
        self.spec = spec
        self.params = p = params or SimParams()
        self.loop = loop = EventLoop()
        self.fleet = Fleet(loop, spec, p, self._on_events)
        self.router = SimRouter(loop, spec, self.fleet, p, policy)
        m = spec.model
        tuning = self.router.scheduler.tuning
        vocab = self.fleet.ranks[0].core.config.vocab_size
        builder = ContextBuilder(
            BlockHasher(m.block_size, m.hash_algo, m.hash_seed),
            round(tuning.chunk_chars / tuning.chars_per_token),
            vocab,
            chunks=self.router.uses_text,
        )
        w = spec.workload
        self.trace = None
        if w.profile == "trace":
            from llmd.workload.trace import read_trace, trace_sessions

            if not w.trace_path:
                raise ValueError("workload.profile is trace but workload.trace_path is not set")
            # Token counts of a trace's text: ~4 characters a token (no tokenizer is loaded to simulate).
            turns = read_trace(w.trace_path, context_scale=w.context_scale, time_scale=w.time_scale)
            self.trace = trace_sessions(turns, str(w.trace_path))
            w = w.model_copy(update={"profile": "smoke"})  # the profile only seeds and salts a replayed run
        workload = profile_from_spec(w, run_id=run_id, max_model_len=m.max_model_len)
        self.duration_s = float(spec.workload.duration_s)
        self.agents = Agents(loop, workload, builder, self._send, self.duration_s)
        # In sending order (a dict, not a set of objects hashed by address): the requests cut at the end are written
        # in the same order every run.
        self.inflight: dict[Call, None] = {}
        self.recorder: SimRecorder | None = None
        if out_dir is not None:
            meta = {
                "spec": spec,
                "policy": self.router.policy,
                "run_id": run_id,
                "concurrency": spec.workload.concurrency,
                "simulated": True,
                "start_time": time.time(),
            }
            self.recorder = SimRecorder(Path(out_dir), self.fleet, self.router, meta)
        self.metrics_path = Path(out_dir) / "metrics.h5" if out_dir is not None else None
        self.calls: list[Call] = []
        self.steady: SimStats | None = None
        self._keep = keep_contexts
        self._empty = builder.empty

    def _on_events(self, rank: Any, events: list) -> None:
        self.router.on_events(rank, events)

    def _send(self, call: Call) -> None:
        call.input_tokens = len(call.ctx)
        self.inflight[call] = None
        done = call.on_done

        def finished(c: Call) -> None:
            self.inflight.pop(c, None)
            self.calls.append(c)
            if self.recorder is not None:
                self.recorder.finished(c)
            done(c)  # the agent builds its next prompt from this one
            if not self._keep:
                c.ctx = self._empty

        call.on_done = finished
        self.router.send(call)

    def _scrape(self) -> None:
        self.fleet.scrape()
        self.router.scrape()
        self.loop.after(self.params.scrape_interval_s, self._scrape)

    def run(self, progress: Callable[[float, SimStats], None] | None = None, warmup_s: float = 0.0) -> SimStats:
        """The whole run's figures; with `warmup_s` > 0, `self.steady` also holds those of the requests sent from
        `warmup_s` on (engine counters accrued from then on)."""
        loop = self.loop
        stats = SimStats()
        # The fleet, index and agents built so far live for the whole run: frozen out of the collector's walks. And no
        # automatic collections while it runs: the run makes next to no cyclic garbage (544 GPUs, 3,000 agents, 300
        # simulated s: 1,519 objects found in 263 young collections), while each collection walked the ~100K
        # containers made since the last one that were still alive (contexts, requests, block lists), ~11 ms each:
        # 2.8 s of a 64 s run. Raising the threshold does not help: fewer collections walk as many more survivors.
        # Earlier, full collections walking the engines' block tables had taken a third of the wall time.
        gc.collect()
        gc.freeze()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(loop, stats, progress, warmup_s)
        finally:
            if was_enabled:
                gc.enable()
            gc.unfreeze()

    def _run(
        self, loop: EventLoop, stats: SimStats, progress: Callable[[float, SimStats], None] | None, warmup_s: float
    ) -> SimStats:
        wall0 = time.perf_counter()
        base: Counters | None = Counters() if warmup_s <= 0 else None
        self._scrape()
        if self.trace is not None:
            self.agents.replay(self.trace)
        else:
            self.agents.start()
        end = self.duration_s + self.params.stop_grace_s
        t = 0.0
        try:
            while t < end:
                t = min(t + 1.0, end)
                loop.run(t)
                hugepages.grow()
                if base is None and t >= warmup_s:
                    base = self.counters()
                if self.recorder is not None:
                    self.recorder.tick(t)
                if progress is not None:
                    stats.sim_s, stats.events, stats.wall_s = t, loop.events, time.perf_counter() - wall0
                    progress(t, stats)
                if not self.inflight and (t >= self.duration_s or self.agents.done):
                    break
        except KeyboardInterrupt:
            stats.interrupted = True
        stats.sim_s = min(t, self.duration_s) if not stats.interrupted else loop.now
        self._abort_inflight()
        if self.recorder is not None:
            self.recorder.tick(max(t, loop.now) + 1.0)
        stats.wall_s = time.perf_counter() - wall0
        stats.events = loop.events
        self._fill(stats, 0.0, Counters())
        if warmup_s > 0:
            self.steady = SimStats(stats.sim_s, stats.wall_s, stats.events, stats.interrupted)
            self._fill(self.steady, warmup_s, base if base is not None else self.counters())
        if self.recorder is not None and self.metrics_path is not None:
            self.recorder.close(self.metrics_path)
        return stats

    def _abort_inflight(self) -> None:
        """Requests still running at the end are cut, as the live client's are at its stop: rows marked aborted."""
        self.fleet.flush()  # their tokens streamed by now
        for call in list(self.inflight):
            call.status = 0
            call.error = ABORTED
            call.done_time = self.loop.now
            del self.inflight[call]
            self.calls.append(call)
            if self.recorder is not None:
                self.recorder.finished(call)

    def counters(self) -> Counters:
        self.fleet.sync()  # the engines' counters as single steps would have left them
        q = h = hg = pre = restores = 0
        restore_s = 0.0
        for r in self.fleet.ranks:
            st = r.core.stats()
            q += st.prefix_cache_queries
            hg += st.prefix_cache_hits
            h += st.prefix_cache_hits + st.cpu_prefix_cache_hits
            pre += st.num_preemptions
            restores += r.core.cpu_restores
            restore_s += r.core.cpu_restore_s
        t = self.fleet.transfers
        return Counters(q, hg, h, pre, restores, restore_s, t.pulls, t.bytes, self.router.p2p_lookups)

    def _fill(self, s: SimStats, since: float, base: Counters) -> None:
        """`s` from the requests sent at or after `since` and the counters accrued since the snapshot `base`."""
        import numpy as np

        calls = [c for c in self.calls if c.send_time >= since]
        ok = [c for c in calls if c.status == 200 and not c.error]
        s.since_s = since
        s.requests = len(calls)
        s.aborted = sum(1 for c in calls if c.error == ABORTED)
        s.errors = len(calls) - len(ok) - s.aborted
        s.input_tokens = sum(c.input_tokens for c in ok)
        s.output_tokens = sum(c.output_tokens for c in ok)
        ttft = [c.first_token - c.send_time for c in ok if c.first_token is not None]
        queue = [c.admitted - c.parsed for c in ok if c.admitted is not None]
        if ttft:
            s.ttft_p50_s, s.ttft_p90_s = (float(v) for v in np.percentile(ttft, [50, 90]))
        if ok:
            s.makespan_s = max(c.done_time or 0.0 for c in ok)
        if queue:
            s.queue_p90_s = float(np.percentile(queue, 90))
        d = self.counters() - base
        if d.queries:
            s.hit_share, s.hit_share_gpu = d.hits / d.queries, d.hits_gpu / d.queries
        if s.input_tokens:
            s.cached_input_share = min(1.0, sum(max(c.cached_tokens, 0) for c in ok) / s.input_tokens)
        s.preemptions, s.cpu_restores = d.preemptions, d.cpu_restores
        if d.cpu_restores:
            s.cpu_restore_mean_s = d.cpu_restore_s / d.cpu_restores
        s.kv_transfers = d.pulls
        if d.pulls:
            s.kv_transfer_bytes_mean = d.pull_bytes / d.pulls
        s.p2p_lookups = d.p2p_lookups
        s.overflows = self.agents.stats.overflows
