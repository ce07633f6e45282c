"""The router in virtual time: llmd's own `RouterCore` (admission, ledger, scheduling pipeline, KV index, speculative
entries, P/D and P2P plans) driven by events instead of HTTP. What the live proxy does with sockets, this does with
the loop: hops take `hop_s`, the router's own work `router_overhead_s`; every decision is the core's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from llmd.engines.kinds import engine_kind
from llmd.engines.sim.core import RequestOutput
from llmd.engines.sim.request import FinishReason, SimRequest
from llmd.kv.index import KVIndex
from llmd.router.config import cost_models
from llmd.router.core import HopPlan, Job, QueueFull, RouterCore
from llmd.router.pd import PREFILL_KV_PARAMS
from llmd.router.scheduling import NoEndpointError, RouteRequest, Scheduler, Tuning
from llmd.sim.context import Context
from llmd.sim.engines import Fleet, SimRank, StreamRecord
from llmd.sim.host import Host
from llmd.sim.loop import EventLoop
from llmd.sim.params import SimParams
from llmd.sim.tokens import TokenRuns

Sink = Callable[[RequestOutput, float], None]


@dataclass(slots=True, eq=False)
class Call:
    """One client request on its way: the turn, its prompt, and what came back (the client's and router's rows)."""

    request_id: str
    session: str
    turn: int
    is_subagent: bool
    ctx: Context
    max_tokens: int
    output: TokenRuns  # the tokens the agent will read back in its next prompt (the engine replays them)
    send_time: float
    on_done: Callable[[Call], None]
    new_tokens: int = 0  # tokens the turn adds to its session's context: what an incremental tokenizer has to read
    input_tokens: int = 0  # len(ctx), kept when a finished call lets its context go
    received: float = 0.0  # at the router
    parsed: float = 0.0  # the router has read and hashed it: admission starts
    admitted: float | None = None
    first_token: float | None = None
    done_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = -1
    status: int = 0
    error: str = ""
    pod: str = ""
    prefill_pod: str = ""
    pd_path: str = ""
    expected_hit_tokens: int = -1
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    route_reason: str = ""
    # The KV its serving engine pulled (P/D handoff, P2P pull), as the fleet modelled it; zeros without one.
    kv_transfer_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    pull_id: str = ""  # the engine request of the attempt that pulls KV, while its pull may still come


class SimRouter:
    def __init__(self, loop: EventLoop, spec: Any, fleet: Fleet, params: SimParams, policy: str | None = None) -> None:
        self.loop = loop
        self.fleet = fleet
        self.params = params
        rspec = spec.router if policy is None else spec.router.model_copy(update={"policy": policy})
        self.policy = rspec.policy
        models = cost_models(spec)
        self.scheduler = Scheduler(
            rspec,
            spec.workload.seed,
            latency=models.get("latency"),
            prefill_latency=models.get("prefill_latency"),
            tuning=Tuning(time_scale=fleet.time_scale),  # as the live router: wall seconds per model second
        )
        self.index = KVIndex()
        self.core = RouterCore(
            self.scheduler,
            self.index,
            max_inflight=rspec.max_inflight_per_pod,
            queue_limit=rspec.queue_limit,
            p2p_mode=engine_kind(spec.engine.kind).p2p_mode,
            now=0.0,
        )
        for pod in fleet.pods:
            self.core.pod_up(pod)
        self.block_size = spec.model.block_size
        self.uses_tokens = "tokens" in self.scheduler.inputs
        self.uses_text = "text" in self.scheduler.inputs
        # The processes around the GPUs (llmd.sim.host): the router's own, each engine pod's API server, the client's.
        self.router_host = Host(loop, "router")
        if params.colocated:
            self.client_host: Host | None = self.router_host
            self.engine_hosts = {pod.name: self.router_host for pod in fleet.pods}
        else:
            self.client_host = Host(loop, "client") if params.client_cpu_s > 0 else None
            self.engine_hosts = {pod.name: Host(loop, pod.name) for pod in fleet.pods}
        self._stream = params.stream_cpu_s > 0 or params.colocated
        self._armed: float | None = None
        self.finished: list[Call] = []  # the router's rows, taken by the recorder
        self.p2p_lookups = 0
        self._pulling: dict[str, Call] = {}  # engine request id -> its call, for legs sent with KV to pull
        # A decode run hands every request of its batch the same list of step ends (_record_run): the last list seen
        # and its times at the client, worked out once for the batch.
        self._shifted: list[Any] = [None, []]
        fleet.on_pull = self._pulled

    # ---- KV events into the index ---------------------------------------------------------------------------------
    def on_events(self, rank: SimRank, events: list) -> None:
        if rank.pod.healthy:
            self.index.apply_events(rank.holder, events)

    # ---- a request arrives ------------------------------------------------------------------------------------------
    def send(self, call: Call) -> None:
        """The client sends `call` now (after its own CPU time, where it has a process here)."""
        if self.client_host is not None:
            p = self.params
            # A session's first prompt is written whole (a sub-agent's inherits its parent's messages); later turns
            # append their new text.
            written = len(call.ctx) if call.turn == 0 else call.new_tokens
            self.client_host.run(p.client_cpu_s + p.client_cpu_per_token_s * written, self._to_router, call)
        else:
            self._to_router(call)

    def _to_router(self, call: Call) -> None:
        call.received = self.loop.now
        p = self.params
        # The router tokenizes incrementally: a turn costs what it adds to the session's prompt.
        self.router_host.run(p.router_cpu_s + p.router_cpu_per_token_s * call.new_tokens, self._receive, call)

    def _receive(self, call: Call) -> None:
        now = self.loop.now
        call.parsed = now
        ctx = call.ctx
        rr = RouteRequest(
            request_id=call.request_id,
            block_hashes=ctx.h64 if self.uses_tokens else (),
            num_tokens=len(ctx),
            block_size=self.block_size,
            session_id=call.session,
            text_chunk_hashes=ctx.chunks if self.uses_text else (),
            max_tokens=call.max_tokens,
        )
        job = Job(rr, call.session, handle=call)
        try:
            decided = self.core.submit(job, now)
        except QueueFull:
            self._end(call, 429, "router queue full")
            return
        except NoEndpointError as e:
            self._end(call, 503, str(e))
            return
        self._settle(decided)

    def _settle(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.error is not None:
                self._end(job.handle, 503, str(job.error))
            else:
                self._dispatch(job)
        self._arm()

    def _arm(self) -> None:
        """The core asks to be pumped at a time (a request waiting for its prefix holder stops waiting then)."""
        w = self.core.next_wakeup()
        if w is not None and (self._armed is None or w < self._armed):
            self._armed = w
            self.loop.at(w, self._wake, w)

    def _wake(self, w: float) -> None:
        if self._armed == w:
            self._armed = None
        self._settle(self.core.pump(self.loop.now))

    # ---- hops -------------------------------------------------------------------------------------------------------
    def _dispatch(self, job: Job) -> None:
        call: Call = job.handle
        flight = job.flight
        assert flight is not None
        if call.admitted is None:
            call.admitted = self.loop.now
        d = flight.decision
        call.pod = flight.target.name
        call.expected_hit_tokens = d.expected_hit_tokens
        call.gpu_hit_tokens, call.cpu_hit_tokens = d.gpu_hit_tokens, d.cpu_hit_tokens
        call.route_reason = d.reason
        call.kv_transfer_tokens, call.kv_transfer_bytes, call.kv_transfer_s = 0, 0, 0.0  # this attempt's, if any
        self._pulling.pop(call.pull_id, None)
        plan = self.core.hop_plan(job)
        if plan.prefill is not None:
            rank = self.fleet.by_holder[(plan.prefill.name, plan.prefill_rank)]
            call.prefill_pod = plan.prefill.name
            req = self._engine_request(job, f"{call.request_id}/{job.attempts}/p", 1, dict(PREFILL_KV_PARAMS))
            self.loop.after(
                self.params.hop_s, self._submit, rank, req, job, lambda out, t: self._prefill_out(job, plan, out)
            )
            return
        if plan.p2p_outcome == "sent":
            self.p2p_lookups += 1
        call.pd_path = "p2p" if plan.kv_params is not None else "decode-only"
        self._decode(job, plan.kv_params)

    def _engine_request(self, job: Job, rid: str, max_tokens: int, kv: dict[str, Any] | None) -> SimRequest:
        call: Call = job.handle
        return SimRequest(
            rid,
            call.ctx.tokens,
            max_tokens,
            kv_transfer_params=kv,
            output_script=call.output,
            prompt_block_hashes=call.ctx.hashes,  # the engine copies what it keeps
        )

    def _to_engine(
        self, rank: SimRank, req: SimRequest, job: Job, sink: Sink, record: StreamRecord | None = None
    ) -> None:
        """One hop to the engine's API server, which parses and tokenizes the prompt before the core has it."""
        p = self.params
        host = self.engine_hosts[rank.pod.name]
        cost = p.engine_cpu_s + p.engine_cpu_per_token_s * len(req.prompt_token_ids)
        self.loop.after(p.hop_s, host.run, cost, self._submit, rank, req, job, sink, record)

    def _submit(self, rank: SimRank, req: SimRequest, job: Job, sink: Sink, record: StreamRecord | None = None) -> None:
        try:
            rank.submit(req, sink, record)
        except ValueError as e:  # the engine refuses the request (vLLM answers 400): no retry helps
            flight = job.flight
            assert flight is not None
            self._settle(self.core.complete(flight, self.loop.now))
            self._end(job.handle, 400, str(e))

    def _back(self, fn: Callable[..., Any], *args: Any) -> None:
        """Engine output travels to the router (a hop) and through it (relaying costs router CPU)."""
        p = self.params
        if self._stream:
            self.loop.after(p.hop_s, self.router_host.run, p.stream_cpu_s, fn, *args)
        else:
            self.loop.after(p.hop_s, fn, *args)

    def _prefill_out(self, job: Job, plan: HopPlan, out: RequestOutput) -> None:
        if out.finished:
            self._back(self._prefill_back, job, plan, out)

    def _prefill_back(self, job: Job, plan: HopPlan, out: RequestOutput) -> None:
        flight = job.flight
        assert flight is not None
        kv = out.kv_transfer_params if out.finish_reason != FinishReason.ERROR else None
        outcome = self.core.prefill_done(flight, plan, kv, False, self.loop.now)
        call: Call = job.handle
        if plan.why == "p2p":
            call.pd_path = "p2p"
            self.p2p_lookups += 1
        else:
            call.pd_path = "pd" if kv is not None else "pd-fallback"
        self._settle(outcome.admitted)
        self._decode(job, kv)

    def _decode(self, job: Job, kv: dict[str, Any] | None) -> None:
        call: Call = job.handle
        flight = job.flight
        assert flight is not None
        rank = self.fleet.by_holder[(flight.target.name, flight.rank)]
        req = self._engine_request(job, f"{call.request_id}/{job.attempts}", call.max_tokens, kv)
        if kv is not None:
            call.pull_id = req.request_id
            self._pulling[req.request_id] = call
        # partial, not lambdas: called for every output and decode run, and a partial adds no Python frame.
        record = None if self._stream else partial(_record_run, job.handle, hop_s=self.params.hop_s, memo=self._shifted)
        self._to_engine(rank, req, job, partial(self._decode_out, job), record)

    def _pulled(self, request_id: str, ok: bool, tokens: int, nbytes: float, seconds: float) -> None:
        """A serving engine's pull ended: what it moved is the request's transfer (a failed one moved nothing)."""
        call = self._pulling.pop(request_id, None)
        if call is not None and ok:
            call.kv_transfer_tokens, call.kv_transfer_bytes, call.kv_transfer_s = tokens, round(nbytes), seconds

    def _decode_out(self, job: Job, out: RequestOutput, t: float) -> None:
        if out.finished or self._stream:
            self._back(self._relay, job, out)
            return
        # A token inside the stream changes nothing but the call's own record, read when the run ends: written now, at
        # the time it reaches the client, instead of as an event of its own (most of a run's events at 544 GPUs).
        _record_tokens(job.handle, out, t + self.params.hop_s)

    def _relay(self, job: Job, out: RequestOutput) -> None:
        """An engine output as the client receives it (its first token, the rest of the stream, its end)."""
        call: Call = job.handle
        t = self.loop.now
        if out.finished and out.finish_reason == FinishReason.ERROR:
            outcome = self.core.fail(job, "KV transfer failed", False, self.loop.now)
            self._settle(outcome.admitted)
            if outcome.retry:
                try:
                    self._settle(self.core.submit(job, self.loop.now))
                except (QueueFull, NoEndpointError) as e:
                    self._end(call, 503, str(e) or "router queue full")
            else:
                self._end(call, 502, outcome.error)
            return
        _record_tokens(call, out, t)
        if out.finished:
            flight = job.flight
            assert flight is not None
            self._settle(self.core.complete(flight, self.loop.now))
            self._end(call, 200, "")

    def _end(self, call: Call, status: int, error: str) -> None:
        self._pulling.pop(call.pull_id, None)  # a leg whose engine had the whole prompt pulls nothing
        call.status = status
        call.error = error
        call.done_time = self.loop.now
        self.finished.append(call)
        call.on_done(call)

    def scrape(self) -> None:
        """Every engine's /metrics is read: its API server renders it, the router parses it."""
        cost = self.params.scrape_cpu_s
        if cost > 0:
            for pod in self.fleet.pods:
                self.engine_hosts[pod.name].stall(cost)


def _record_tokens(call: Call, out: RequestOutput, at: float) -> None:
    """An output's tokens as the client sees them arrive at `at`: its first token, then each one's time."""
    if out.new_token_ids:
        if call.first_token is None:
            call.first_token = at
            call.cached_tokens = out.num_cached_tokens
        call.token_times.append(at)
        call.output_tokens += len(out.new_token_ids)


def _record_run(call: Call, times: list[float], tokens: int, hop_s: float, memo: list[Any]) -> None:
    """Outputs inside a decode run, after the first: what _record_tokens does for each, their step ends + a hop.
    `memo`: [the step ends last shifted, their shifted times] (held, so `is` cannot match a new list at its address)."""
    if memo[0] is not times:
        memo[0], memo[1] = times, [t + hop_s for t in times]
    call.token_times += memo[1]
    call.output_tokens += tokens
