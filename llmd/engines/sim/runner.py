"""Drives simulated engine cores in (scaled) real time: one asyncio task per DP rank, plus fault injection.

Each step of a core takes `duration_s` of simulated time; its outputs and KV events are delivered when the step ends.
The loop keeps an absolute simulated clock and sleeps until `wall0 + sim_end * time_scale`, so sleep overshoot and
loop overhead do not accumulate (time_scale 1 is real time, 0.01 a hundred times faster, 0 as fast as possible).
While busy the clock advances only by step durations (an overloaded host falls behind, then catches up without
sleeping); when idle it jumps to the wall clock, so idle time passes as it does for a real engine.

Timestamps the core and the metrics see are simulated seconds from the runner's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.perf.latency import LatencyModel

from .core import EngineCore, PullTask, RequestOutput, StepResult
from .metrics import RankMetrics
from .publisher import KVEventPublisher
from .request import SimRequest
from .transfer import PullResult, pull_blocks

log = logging.getLogger(__name__)

# While idle the loop still wakes this often (wall seconds) to expire KV leases and refresh gauges.
IDLE_TICK_S = 0.5


class SimClock:
    """Simulated seconds since start, tied to the wall clock by `time_scale` (wall = sim * time_scale)."""

    def __init__(self, time_scale: float) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.scale = time_scale
        self.wall0 = time.monotonic()
        self.sim = 0.0

    def wall_to_sim(self, wall: float) -> float:
        # At time_scale 0 idle time passes 1:1: the engine is as fast as possible, the world is not.
        return (wall - self.wall0) / (self.scale or 1.0)

    def sync(self) -> float:
        """Idle: catch up with the wall clock (never backwards)."""
        self.sim = max(self.sim, self.wall_to_sim(time.monotonic()))
        return self.sim

    def wall_delay(self, sim_t: float) -> float:
        """Wall seconds from now until simulated time `sim_t` (<= 0: already due)."""
        if self.scale == 0:
            return 0.0
        return self.wall0 + sim_t * self.scale - time.monotonic()

    async def sleep_until(self, sim_t: float) -> None:
        delay = self.wall_delay(sim_t)
        # sleep(0) still yields, so a loop that is behind lets HTTP handlers run between steps.
        await asyncio.sleep(delay if delay > 0 else 0)
        self.sim = max(self.sim, sim_t)

    async def sleep_for(self, sim_s: float) -> None:
        await asyncio.sleep(sim_s * self.scale if sim_s > 0 else 0)


@dataclass(slots=True)
class FaultConfig:
    """Injected failures. Counts are of generate requests (completions and chat) per server."""

    failure_rate: float = 0.0  # fraction answered 500 InternalServerError
    slow_start_s: float = 0.0  # /health answers 503 (and requests 503) until this many wall seconds after start
    hang_after: int | None = None  # requests after the Nth are accepted but never answered; running streams stall
    crash_after: int | None = None  # the (N+1)th request crashes the server: listener closed, engines stopped
    # Fraction of KV pulls (P/D, P2P) that fail as a failed NIXL READ does: the pull reports an error, the request
    # goes to the pull failure policy, and the remote lease is left to expire.
    kv_transfer_failure_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be in [0, 1], got {self.failure_rate}")
        if self.slow_start_s < 0:
            raise ValueError(f"slow_start_s must be >= 0, got {self.slow_start_s}")
        if not 0.0 <= self.kv_transfer_failure_rate <= 1.0:
            raise ValueError(f"kv_transfer_failure_rate must be in [0, 1], got {self.kv_transfer_failure_rate}")


class FaultInjector:
    """Decides, request by request, what the fault config does to it."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(f"faults/{config.seed}")
        self.started = time.monotonic()
        self.requests = 0
        self.hung = False
        self.crashed = False
        self.fail_next_transfers = 0  # armed at run time (`llmd engine sim` on SIGUSR2): these pulls fail next
        self.failed_transfers = 0

    def ready(self) -> bool:
        return time.monotonic() - self.started >= self.config.slow_start_s

    def admit(self) -> str:
        """One generate request arrives: "ok", "fail", "hang" or "crash"."""
        c = self.config
        self.requests += 1
        if self.crashed or (c.crash_after is not None and self.requests > c.crash_after):
            self.crashed = True
            return "crash"
        if self.hung or (c.hang_after is not None and self.requests > c.hang_after):
            self.hung = True
            return "hang"
        if c.failure_rate and self._rng.random() < c.failure_rate:
            return "fail"
        return "ok"

    def transfer_fails(self) -> bool:
        """One KV pull starts: True when it is to fail."""
        fail = self.fail_next_transfers > 0 or (
            self.config.kv_transfer_failure_rate > 0 and self._rng.random() < self.config.kv_transfer_failure_rate
        )
        if fail:
            self.fail_next_transfers = max(0, self.fail_next_transfers - 1)
            self.failed_transfers += 1
        return fail


@dataclass(slots=True, eq=False)
class RequestHandle:
    """A request in flight on one rank: its engine request and the outputs the loop delivers to it."""

    req: SimRequest
    rank: int
    arrival: float
    max_tokens: int
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    first_token_t: float | None = None
    last_token_t: float | None = None
    num_output: int = 0
    pulled: bool = False  # a pull ran for it (ok or not)
    pulled_tokens: int = 0
    finished: bool = False


class RankRunner:
    """One DP rank: an EngineCore stepped on the event loop, its KV event publisher and its metrics."""

    def __init__(
        self,
        core: EngineCore,
        latency: LatencyModel,
        clock: SimClock,
        metrics: RankMetrics,
        *,
        publisher: KVEventPublisher | None = None,
        node: str = "localhost",
        pull_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.latency = latency
        self.clock = clock
        self.metrics = metrics
        self.publisher = publisher
        self.node = node
        self.pull_timeout_s = pull_timeout_s
        self.rank = core.config.dp_rank
        self.engine_id = core.config.engine_id
        self.handles: dict[str, RequestHandle] = {}
        self.stalled = False  # fault injection: a hung engine stops stepping
        self.steps = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pulls: set[asyncio.Task[None]] = set()
        self._busy_until: float | None = None  # end of the step being "computed" (sleeping until then)
        self._last_stats = core.stats()
        self.faults: FaultInjector | None = None  # the server's, set by EngineRunner

    # ---- the side channel's view of this rank (transfer.LeaseOwner) ------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.core.config.block_size

    def lookup_lease(
        self, remote_request_id: str, block_ids: Sequence[int]
    ) -> list[tuple[bytes | None, list[int]]] | None:
        return self.core.lookup_lease(remote_request_id, block_ids, self.arrival_time())

    def release_lease(self, remote_request_id: str) -> bool:
        ok = self.core.release_lease(remote_request_id)
        self._wake.set()  # freed blocks may let waiting requests in
        return ok

    def lookup_cached(self, block_hashes: Sequence[bytes]) -> int:
        return self.core.lookup_cached(block_hashes)

    # ---- requests --------------------------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests in flight on this rank (vLLM's per-engine in-flight count in internal DP load balancing)."""
        return len(self.handles)

    def arrival_time(self) -> float:
        clock = self.clock
        if self._busy_until is None:
            return clock.sync()
        if clock.scale == 0:
            return self._busy_until
        # Mid-step: the request arrived at wall time, but never later than the step end it will be admitted at.
        return min(clock.wall_to_sim(time.monotonic()), self._busy_until)

    def submit(self, req: SimRequest, queue: asyncio.Queue[RequestOutput] | None = None) -> RequestHandle:
        """Adds the request to the core (ValueError from the core goes to the caller) and wakes the loop. Outputs go
        to `queue` (several requests may share one, e.g. the prompts of a batch), else to a queue of its own."""
        req.arrival_time = self.arrival_time()
        self.core.add_request(req)
        handle = RequestHandle(req, self.rank, req.arrival_time, req.max_tokens)
        if queue is not None:
            handle.queue = queue
        self.handles[req.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        handle = self.handles.pop(request_id, None)
        if handle is not None and not handle.finished and self.core.abort_request(request_id):
            self.metrics.request_success["abort"].inc()
            self._wake.set()

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-rank-{self.rank}")

    async def stop(self) -> None:
        for t in [self._task, *self._pulls]:
            if t is not None:
                t.cancel()
        for t in [self._task, *self._pulls]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._task = None
        self._pulls.clear()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in the core must not leave clients waiting forever: fail everything in flight, loudly.
            log.exception("simulated engine rank %d crashed", self.rank)
            for h in list(self.handles.values()):
                h.queue.put_nowait(RequestOutput(h.req.request_id, [], True, None, max(h.req.num_cached_tokens, 0)))
            raise

    async def _loop(self) -> None:
        core = self.core
        clock = self.clock
        while True:
            if self.stalled:
                await asyncio.Event().wait()  # hung for good
            now = clock.sim if self._busy_until is not None else clock.sync()
            expired = core.expire_leases(now)
            if expired:
                self.metrics.nixl_expired.inc(expired)
            if not core.has_work():
                self._busy_until = None
                self._publish(core.take_events())
                self._refresh_gauges()
                timeout = IDLE_TICK_S
                nxt = core.next_lease_expiry()
                if nxt is not None:
                    timeout = min(timeout, max(clock.wall_delay(nxt), 0.001))
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            result = core.step(now)
            end = now + result.duration_s
            self._busy_until = end
            await clock.sleep_until(end)
            self.steps += 1
            self._deliver(result, end)
            for task in core.pending_pulls():
                self._start_pull(task)

    def _deliver(self, result: StepResult, end: float) -> None:
        m = self.metrics
        gen = 0
        for out in result.outputs:
            handle = self.handles.get(out.request_id)
            n = len(out.new_token_ids)
            gen += n
            if handle is None:
                continue
            if n:
                if handle.first_token_t is None:
                    handle.first_token_t = end
                    self._first_token(handle, end)
                else:
                    m.itl.observe(end - (handle.last_token_t or end))
                handle.last_token_t = end
                handle.num_output += n
            if out.finished:
                handle.finished = True
                self.handles.pop(out.request_id, None)
                self._finished(handle, out, end)
            handle.queue.put_nowait(out)
        if result.scheduled_tokens:
            m.iteration_tokens.observe(result.scheduled_tokens)
        if gen:
            m.generation_tokens.inc(gen)
        if result.num_preempted:
            m.preemptions.inc(result.num_preempted)
        if result.work is not None:
            m.step_work(*result.work)
        self._publish(result.events)
        self._refresh_gauges(result.num_running, result.num_waiting)

    def _first_token(self, handle: RequestHandle, end: float) -> None:
        m = self.metrics
        req = handle.req
        m.ttft.observe(end - handle.arrival)
        prompt_len = req.num_prompt_tokens
        external = min(handle.pulled_tokens, prompt_len)
        cached = max(req.num_cached_tokens, 0)
        # After a pull the core's num_cached_tokens counts what the pull was meant to bring (and the decode side may
        # report the prefill's hits); the local part is what it had before pulling.
        local = req.pull_local_tokens if handle.pulled else min(cached, prompt_len - external)
        m.prompt_admitted(prompt_len, local, external)
        m.req_prefill_computed.observe(max(prompt_len - local - external, 0))

    def _finished(self, handle: RequestHandle, out: RequestOutput, end: float) -> None:
        m = self.metrics
        req = handle.req
        reason = out.finish_reason.value if out.finish_reason is not None else "error"
        m.request_success[reason].inc()
        if reason == "error":
            return
        scheduled = req.first_scheduled_time if req.first_scheduled_time is not None else handle.arrival
        first = handle.first_token_t if handle.first_token_t is not None else end
        m.e2e.observe(end - handle.arrival)
        m.queue_time.observe(max(scheduled - handle.arrival, 0.0))
        m.inference_time.observe(end - scheduled)
        m.prefill_time.observe(max(first - scheduled, 0.0))
        m.decode_time.observe(end - first)
        if handle.num_output > 1:
            m.tpot.observe((end - first) / (handle.num_output - 1))
        m.req_prompt_tokens.observe(req.num_prompt_tokens)
        m.req_gen_tokens.observe(handle.num_output)
        m.req_max_gen_tokens.observe(handle.max_tokens)
        m.req_params_max_tokens.observe(handle.max_tokens)
        m.req_params_n.observe(1)
        m.req_preemptions.observe(req.num_preemptions)

    def _refresh_gauges(self, running: int | None = None, waiting: int | None = None) -> None:
        core = self.core
        s = core.stats()
        m = self.metrics
        sched = core.scheduler
        m.scheduler_state(
            s.num_requests_running if running is None else running,
            s.num_requests_waiting if waiting is None else waiting,
            s.kv_cache_usage_perc,
            len(sched.pulling),
            len(sched.kv_ready),
        )
        last = self._last_stats
        # The core keeps cumulative counters; Prometheus counters take the increments.
        for child, new, old in (
            (m.prefix_queries, s.prefix_cache_queries, last.prefix_cache_queries),
            (m.prefix_hits, s.prefix_cache_hits, last.prefix_cache_hits),
            (m.ext_prefix_queries, s.external_prefix_cache_queries, last.external_prefix_cache_queries),
            (m.ext_prefix_hits, s.external_prefix_cache_hits, last.external_prefix_cache_hits),
        ):
            if new > old:
                child.inc(new - old)
        self._last_stats = s

    def _publish(self, events: list) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)

    # ---- pulls (the decode side of P/D, P2P) -------------------------------------------------------------------------
    def _start_pull(self, task: PullTask) -> None:
        t = asyncio.get_running_loop().create_task(self._pull(task), name=f"kv-pull-{task.request_id}")
        self._pulls.add(t)
        t.add_done_callback(self._pulls.discard)

    async def _pull(self, task: PullTask) -> None:
        if task.remote_host is None or task.remote_port is None:
            result = PullResult(False, error="no remote side channel in kv_transfer_params")
        elif self.faults is not None and self.faults.transfer_fails():
            # What vLLM's NixlConnector sees when a READ fails: the transfer's status is an error, nothing arrives.
            result = PullResult(False, error="injected fault: NIXL transfer failed (NIXL_ERR_REMOTE_DISCONNECT)")
        else:
            result = await pull_blocks(
                task.remote_host,
                task.remote_port,
                engine_id=task.remote_engine_id,
                remote_request_id=task.remote_request_id,
                block_ids=task.remote_block_ids,
                block_hashes=task.block_hashes,
                max_tokens=task.num_tokens,
                node=self.node,
                transfer_time=self.latency.kv_transfer_time,
                sleep=self.clock.sleep_for,
                timeout_s=self.pull_timeout_s,
            )
        if not result.ok:
            log.info("KV pull for %s failed: %s", task.request_id, result.error)
        handle = self.handles.get(task.request_id)
        if handle is not None:
            handle.pulled = True
            handle.pulled_tokens = result.num_tokens if result.ok else 0
        if task.remote_request_id is None:
            # P2P: only what the peer had arrives; zero tokens is a miss and the request prefills locally.
            self.core.finish_pull(task.request_id, result.ok, result.num_tokens if result.ok else None)
        else:
            self.core.finish_pull(task.request_id, result.ok)
        nbytes = int(self.latency.kv_transfer_bytes(result.num_tokens))
        self.metrics.transfer(result.seconds, nbytes, result.num_blocks, result.ok)
        # The pulled blocks are cached now: publish their BlockStored without waiting for the next step.
        self._publish(self.core.take_events())
        self._wake.set()


class EngineRunner:
    """All DP ranks of one server, with fault injection and vLLM's rank selection."""

    def __init__(self, ranks: Sequence[RankRunner], faults: FaultConfig | None = None) -> None:
        self.ranks = list(ranks)
        self.faults = FaultInjector(faults or FaultConfig())
        for r in self.ranks:
            r.faults = self.faults
        self._rr = 0

    def pick(self, requested: int | None) -> RankRunner:
        """The X-data-parallel-rank header's rank, else vLLM's internal DP load balancing (DPLBAsyncMPClient): the
        least score max(in flight, waiting + running), plus a waiting penalty growing with KV usage above 50%,
        scanning from a rotating start so ties go round robin. The sim reads live counts where vLLM's coordinator
        publishes them every 100 ms."""
        if requested is not None:
            return self.ranks[requested]
        n = len(self.ranks)
        best, best_score = 0, float("inf")
        for i in range(n):
            idx = (self._rr + i) % n
            r = self.ranks[idx]
            st = r.core.stats()
            waiting = st.num_requests_waiting
            score = float(max(r.load, waiting + st.num_requests_running))
            if waiting:
                score += waiting * 6.0 * max(0.0, st.kv_cache_usage_perc - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self._rr = (self._rr + 1) % n
        return self.ranks[best]

    def start(self) -> None:
        for r in self.ranks:
            r.start()

    def stall(self) -> None:
        for r in self.ranks:
            r.stalled = True
            r._wake.set()

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.ranks))
