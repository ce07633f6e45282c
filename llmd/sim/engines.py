"""The fleet's engines in virtual time: every DP rank an `EngineCore` (the simulated engine's own scheduler and KV
cache) stepped by the latency model, its outputs delivered when its step ends, its KV events to the router's index
after a delay, its transfers (P/D hand-offs, P2P pulls) over the link the latency model prices.

The engines are the live simulated engine's core unchanged; what the server does with sockets (HTTP, ZMQ, the NIXL
side channel) happens here as events on the loop.
"""

from __future__ import annotations

import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from llmd.discovery import PodInfo
from llmd.engines.kinds import engine_kind
from llmd.engines.sim.core import EngineCore, PullTask, RequestOutput, StepResult
from llmd.engines.sim.decode_run import DecodeRun
from llmd.engines.sim.request import RequestStatus, SimRequest
from llmd.engines.sim.server_config import SimServerConfig
from llmd.perf.latency import LatencyModel
from llmd.router.pods import Pod
from llmd.sim.params import SimParams
from llmd.spec.layout import engine_endpoints

_RUNNING = RequestStatus.RUNNING

# The loop (llmd/sim/loop.py): the C EventLoop where it was built. Typed loosely on purpose: this module is compiled
# with the engine core (llmd/compiled.py), and mypyc would check every loop handed in against the Python class.
Loop = Any

OutputSink = Callable[[RequestOutput, float], None]
# A sink's other half, for outputs inside a decode run that it would only record (a streamed token nobody reacts to):
# (the end times of the steps, the tokens they gained in all). Called after those ends, at the run's end or when
# something outside touches the rank, so a run needs no event per step; never for a request's first output.
StreamRecord = Callable[[list[float], int], None]

# Decode fast-forward: the most steps a rank plans at once. Longer runs save plans; a run ends at the next arrival,
# pull or release anyway, and the steps planned past that are work thrown away. A plan costs about its steps (~1.7 us
# each compiled); at 3,000 agents on 544 GPUs a run carried out a third of what 256 planned (median 10 steps), and the
# first 75 simulated s took 41.3 CPU s at 64 (41.7 at 32, 42.7 at 16) against 47.3 at 256.
MAX_RUN_STEPS = 64


@dataclass(slots=True)
class TransferStats:
    pulls: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: float = 0.0
    seconds: float = 0.0
    p2p: int = 0  # pulls by hash from a peer's prefix cache (the rest are P/D hand-offs)


class SimRank:
    """One DP rank: its core, where it runs, and whose outputs go where."""

    def __init__(self, fleet: Fleet, core: EngineCore, latency: LatencyModel, pod: Pod, rank: int, node: str) -> None:
        self.fleet = fleet
        self.loop = fleet.loop
        self.core = core
        self.latency = latency
        self.pod = pod
        self.rank = rank
        self.node = node
        self.holder = (pod.name, rank)
        self.engine_id = core.config.engine_id
        self.sinks: dict[str, OutputSink] = {}
        self.records: dict[str, StreamRecord] = {}
        self.busy = False
        self.steps = 0
        self.runs = 0  # decode fast-forward runs (their steps count in `steps`)
        self._expiry_armed: float | None = None
        self._run: DecodeRun | None = None
        self._run_ends: list[float] = []  # loop time each step of the run ends
        self._run_done = 0  # steps whose outputs have gone out
        self._run_next = 0  # the step whose end is the run's next event
        self._run_quiet = False  # every request of the run has a StreamRecord: events only where steps have KV work
        self._run_events: list = []  # KV events of the step under way, carried out early by a sync
        st = pod.ranks[rank]
        st.kv_capacity_blocks = core.config.num_gpu_blocks
        st.cpu_capacity_blocks = core.config.num_cpu_blocks
        st.engine_id = self.engine_id

    @property
    def name(self) -> str:
        return f"{self.pod.name}/dp{self.rank}" if self.pod.info.dp_size > 1 else self.pod.name

    def model_time(self) -> float:
        """The core's clock: model seconds (the loop's seconds are wall seconds of the run being predicted)."""
        return self.loop.now / self.fleet.time_scale

    def submit(self, req: SimRequest, sink: OutputSink, record: StreamRecord | None = None) -> None:
        """The request reaches the engine now (ValueError from the core: the engine refuses it, as with a 400).
        `record`: what `sink` does with an output inside a decode run, when all it does is record it."""
        self.interrupt()
        req.arrival_time = self.model_time()
        self.core.add_request(req)
        self.sinks[req.request_id] = sink
        if record is not None:
            self.records[req.request_id] = record
        self.kick()

    def abort(self, request_id: str) -> None:
        self.interrupt()
        self.sinks.pop(request_id, None)
        self.records.pop(request_id, None)
        if self.core.abort_request(request_id):
            self.kick()

    def kick(self) -> None:
        """Step now if idle and there is work (a new request, freed blocks, a finished pull)."""
        if not self.busy and self.core.has_work():
            self.busy = True
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        core = self.core
        if self.fleet.fast_forward:
            run = core.plan_decode(self.model_time(), MAX_RUN_STEPS)
            if run is not None:
                self._start_run(run)
                return
        result = core.step(self.model_time())
        self.steps += 1
        if result.duration_s <= 0 and not result.outputs and not result.scheduled_tokens:
            # Nothing could be scheduled (waiting for blocks a lease or a pull holds): idle until something frees.
            self.busy = False
            self._deliver(result, self.loop.now)
            self._arm_expiry()
            return
        self.loop.after(result.duration_s * self.fleet.time_scale, self._end_step, result)

    def _end_step(self, result: StepResult) -> None:
        self.busy = False
        self._deliver(result, self.loop.now)
        self.kick()
        if not self.busy:
            self._arm_expiry()

    def _deliver(self, result: StepResult, end: float) -> None:
        sinks = self.sinks
        for out in result.outputs:
            if out.finished:
                sink = sinks.pop(out.request_id, None)
                self.records.pop(out.request_id, None)
            else:
                sink = sinks.get(out.request_id)
            if sink is not None:
                sink(out, end)
        if result.events:
            self.fleet.publish(self, result.events)
        for task in self.core.pending_pulls():
            self.fleet.start_pull(self, task)

    # ---- decode fast-forward ---------------------------------------------------------------------------------------
    # A run is one event per step where single steps make two: at each step's end the step is carried out on the core,
    # its outputs go to their sinks and its KV events out, at the times single steps would send them. Something from
    # outside that reads the core during a step (a scrape, a P2P lookup) or changes it (an arrival, a finished pull, a
    # released lease) first carries out the step under way, whose state single steps set up when it began; a change
    # also ends the run with that step. Step ends are summed in the order single steps add them: the same times.
    # A quiet run (every request's sink only records its outputs) has events only at steps with KV events and at its
    # last; its outputs go out together, with their times, at its end or when something outside touches the rank
    # (an abort among them), before anything could read what they record.
    def _start_run(self, run: DecodeRun) -> None:
        self._run = run
        self.runs += 1
        scale = self.fleet.time_scale
        d = run.durations if scale == 1.0 else [x * scale for x in run.durations]
        self._run_ends = list(accumulate(d, initial=self.loop.now))[1:]
        self._run_done = 0
        records = self.records
        self._run_quiet = all(r.request_id in records for r in run.requests)
        self._schedule_run_step(run, 0)

    def _schedule_run_step(self, run: DecodeRun, s: int) -> None:
        """The run's next event: the end of step s, or of the first step from s on that must have one."""
        if self._run_quiet:
            s = min(run.next_event_step(s), run.cut - 1)
        self._run_next = s
        self.loop.at(self._run_ends[s], self._run_step_end, run, s)

    def sync(self, complete: bool = True) -> None:
        """The core as single steps would have left it by now: the run's step under way is carried out.
        `complete=False` for a reader of the prefix cache, leases or gauges only: the KV work (DecodeRun.apply)."""
        run = self._run
        if run is None:
            return
        # Step s > 0 begins when step s - 1 ends; one that would begin exactly now comes after whatever else happens
        # now, as the _step event single steps schedule then.
        begun = min(1 + bisect_left(self._run_ends, self.loop.now), run.cut)
        if begun > run.applied or complete:
            self._advance(run, begun, complete)

    def interrupt(self) -> None:
        """Something from outside is about to change the core: the run ends with the step under way (or now)."""
        run = self._run
        if run is None:
            return
        self.sync()
        if self._run_quiet:
            # Steps that ended before now have gone out, as their events would have before this one.
            self._run_outputs(run, min(bisect_left(self._run_ends, self.loop.now), run.cut))
        if run.applied == self._run_done:
            self._end_run()
        else:
            run.cut = run.applied
            if self._run_next >= run.cut:
                self._schedule_run_step(run, run.cut - 1)  # the event already scheduled comes too late: dropped

    def _run_step_end(self, run: DecodeRun, s: int) -> None:
        if run is not self._run or s != self._run_next:
            return  # the run ended early, or this event was replaced by an earlier one
        last = s + 1 >= run.cut
        quiet = self._run_quiet
        if last or (run.applied <= s and (quiet or not run.scripted or run.has_events(s))):
            # Steps without KV work change nothing anyone sees before the next one that has some, a read of the core
            # (sync) or the run's end: they are carried out then, several at once; a quiet run's requests' tokens
            # too, but for those whose blocks need them. At the end every request is brought up to date.
            self._advance(run, s + 1, complete=last or not quiet)
        if quiet:
            if last:
                self._run_outputs(run, s + 1)
        else:
            self._run_done = s + 1
            t = self.loop.now
            sinks = self.sinks
            for out in self.core.decode_outputs(run, s, s + 1):
                sink = sinks.get(out.request_id)
                if sink is not None:
                    sink(out, t)
        if self._run_events:
            self.fleet.publish(self, self._run_events)
            self._run_events = []
        if last:
            self._end_run()
        else:
            self._schedule_run_step(run, s + 1)

    def _run_outputs(self, run: DecodeRun, b: int) -> None:
        """A quiet run's outputs of the steps up to b that have not gone out: to each request's StreamRecord."""
        a = self._run_done
        if b <= a:
            return
        self._run_done = b
        times = self._run_ends[a:b]
        records = self.records
        for i, r in enumerate(run.requests):
            record = records.get(r.request_id)
            if record is not None and r.status == _RUNNING:
                record(times, run.gained_between(i, a, b))

    def _advance(self, run: DecodeRun, steps: int, complete: bool = True) -> None:
        before = run.applied
        self._run_events += self.core.advance(run, steps, complete)
        self.steps += run.applied - before

    def _end_run(self) -> None:
        self._run = None
        self.busy = False
        for task in self.core.pending_pulls():
            self.fleet.start_pull(self, task)
        self.kick()
        if not self.busy:
            self._arm_expiry()

    def flush(self) -> None:
        """A quiet run's outputs of every step that has ended by now (the loop has run every event up to now)."""
        run = self._run
        if run is not None and self._run_quiet:
            self._run_outputs(run, min(bisect_right(self._run_ends, self.loop.now), run.cut))

    def _arm_expiry(self) -> None:
        """An idle rank still frees leases nobody pulled when they run out (vLLM's kv_lease_duration)."""
        nxt = self.core.next_lease_expiry()
        if nxt is not None and (self._expiry_armed is None or nxt < self._expiry_armed):
            self._expiry_armed = nxt
            self.loop.at((nxt + 1e-6) * self.fleet.time_scale, self._expire)

    def _expire(self) -> None:
        self._expiry_armed = None
        self.interrupt()
        if self.core.expire_leases(self.model_time()):
            self.publish_pending()
            self.kick()
        if not self.busy:
            self._arm_expiry()

    def publish_pending(self) -> None:
        events = self.core.take_events()
        if events:
            self.fleet.publish(self, events)

    def scrape(self) -> None:
        """What the router's /metrics poll reads: the rank's gauges now."""
        self.sync(complete=False)
        s = self.core.scheduler
        st = self.pod.ranks[self.rank]
        # Written only when moved: each write counts as new gauges (RankState.written) and costs a Python __setattr__,
        # 544 ranks x 3 gauges a simulated second.
        running, waiting, usage = len(s.running), s.num_waiting, self.core.kv.usage
        if st.running != running:
            st.running = running
        if st.waiting != waiting:
            st.waiting = waiting
        if st.kv_usage != usage:
            st.kv_usage = usage


class Fleet:
    """Every engine of a spec: pods as the router sees them, ranks as the simulator steps them."""

    def __init__(self, loop: Loop, spec: Any, params: SimParams, on_events: Callable[[SimRank, list], None]) -> None:
        self.loop = loop
        self.params = params
        self._on_events = on_events
        self.pods: list[Pod] = []
        self.ranks: list[SimRank] = []
        self.by_holder: dict[tuple[str, int], SimRank] = {}
        self.by_engine_id: dict[str, SimRank] = {}
        self.transfers = TransferStats()
        # Each pull as it ends: (engine request id, ok, tokens, bytes, seconds), for the router's per-request rows.
        self.on_pull: Callable[[str, bool, int, float, float], None] | None = None
        # Decode fast-forward (decode_run.py): stretches of decode-only steps planned at once.
        self.fast_forward = True
        # Simulated engines run at engine.time_scale wall seconds per model second; the loop keeps wall seconds, so
        # what it predicts is the live run of the same spec (vLLM engines: real time).
        scale = spec.engine.time_scale if engine_kind(spec.engine.kind).simulated else 1.0
        self.time_scale = scale if scale > 0 else 1.0
        for ep in engine_endpoints(spec):
            role: Any = ep.role  # "prefill" or "decode": the spec's pools
            cfg = SimServerConfig.from_spec(spec, role, name=ep.name, engine_id=ep.engine_id, side_channel_port=0)
            pool = spec.pools[ep.role]
            info = PodInfo(
                name=ep.name,
                role=ep.role,
                url=f"http://{ep.name}:{ep.http_port}",
                dp_size=cfg.dp_size,
                side_channel_host=ep.name,
                side_channel_port=ep.side_channel_port,
                engine_id=ep.engine_id,
                replica=ep.replica,
            )
            pod = Pod(info, healthy=True)
            self.pods.append(pod)
            latency = cfg.latency
            assert latency is not None
            for r in range(cfg.dp_size):
                ecfg = _rank_config(cfg, r, info)
                core = EngineCore(ecfg, latency)
                node = f"{ep.name}/n{r // max(1, pool.gpus_per_node // max(1, pool.tp_size))}"
                rank = SimRank(self, core, latency, pod, r, node)
                self.ranks.append(rank)
                self.by_holder[rank.holder] = rank
                self.by_engine_id[rank.engine_id] = rank

    # ---- KV events ------------------------------------------------------------------------------------------------
    def publish(self, rank: SimRank, events: list) -> None:
        delay = self.params.kv_event_delay_s
        if delay > 0:
            self.loop.after(delay, self._on_events, rank, events)
        else:
            self._on_events(rank, events)

    # ---- transfers (the NIXL side channel and the pull) -------------------------------------------------------------
    def start_pull(self, puller: SimRank, task: PullTask) -> None:
        src = self.by_engine_id.get(task.remote_engine_id or "")
        ok, tokens, lease = False, 0, task.remote_request_id is not None
        if src is not None and src.pod.healthy:
            src.sync(complete=False)  # its prefix cache and leases as of now
            if lease:
                r = src.core.leases.get(task.remote_request_id or "")
                expired = (
                    r is None
                    or r.finished_time is None
                    or src.model_time() > r.finished_time + src.core.config.kv_lease_s
                )
                ok, tokens = not expired, task.num_tokens
            else:
                n = src.core.lookup_cached(task.block_hashes)
                ok, tokens = True, min(n * src.core.config.block_size, task.num_tokens)
        seconds = 0.0
        if ok:
            same_node = src is not None and src.node == puller.node
            seconds = self.params.transfer_overhead_s + self.time_scale * (
                puller.latency.kv_transfer_time(tokens, same_node) if tokens > 0 else 0.0
            )
        self.loop.after(seconds, self._pull_done, puller, src, task, ok, tokens, seconds)

    def _pull_done(
        self, puller: SimRank, src: SimRank | None, task: PullTask, ok: bool, tokens: int, seconds: float
    ) -> None:
        t = self.transfers
        puller.interrupt()
        if task.remote_request_id is not None:
            if src is not None and ok:
                src.interrupt()
                src.core.release_lease(task.remote_request_id)
                src.kick()
            puller.core.finish_pull(task.request_id, ok)
        else:
            t.p2p += 1
            puller.core.finish_pull(task.request_id, ok, tokens if ok else None)
        nbytes = puller.latency.kv_transfer_bytes(tokens) if ok else 0.0
        if ok:
            t.pulls += 1
            t.tokens += tokens
            t.bytes += nbytes
            t.seconds += seconds
        else:
            t.failed += 1
        if self.on_pull is not None:
            self.on_pull(task.request_id, ok, tokens, nbytes, seconds)
        puller.publish_pending()
        puller.kick()

    def scrape(self) -> None:
        for r in self.ranks:
            r.scrape()

    def flush(self) -> None:
        """Every quiet run's outputs of the steps ended by now: before reading calls still in flight."""
        for r in self.ranks:
            r.flush()

    def sync(self) -> None:
        """Every core as single steps would have left it by now: a rank in a decode run carries out the steps begun.
        For readers of the cores outside the loop's events (a scrape syncs the ranks it reads; the recorder's
        per-second engine rows and end-of-run stats should sync first)."""
        for r in self.ranks:
            r.sync()


def _rank_config(cfg: SimServerConfig, rank: int, info: PodInfo) -> Any:
    from dataclasses import replace

    side = info.side_channel_of(rank)
    return replace(
        cfg.engine,
        event_token_ids=False,  # the router's index reads the hashes only
        coalesce_events=True,  # ... and applies them in order: one event per eviction run or CPU store job
        dp_rank=rank,
        engine_id=info.engine_id_of(rank) or f"{info.name}-{rank}",
        side_channel_host=side[0] if side else info.name,
        side_channel_port=side[1] if side else 0,
        seed=cfg.engine.seed * 1_000_003 + zlib.crc32(info.name.encode()) % 1_000_003 + rank,
    )
