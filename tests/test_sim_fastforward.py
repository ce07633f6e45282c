"""Decode fast-forward (llmd/engines/sim/decode_run.py) against single steps: the same tokens, times and KV events.

Two engine cores get the same random workload (arrivals during decode runs, shared prefixes, a KV cache and CPU tier
small enough to evict, prefill legs whose leases expire, aborts); one is only ever stepped, the other plans decode
runs and carries out the steps begun before each outside change. Everything either hands out must agree, the times
within float rounding (run steps are interpolated along the latency model's straight stretches).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from llmd.demo import embedded_spec
from llmd.engines.sim import EngineCore, SimEngineConfig, SimRequest
from llmd.engines.sim.uniforms import UniformStream, accepted
from llmd.perf import MODELS, LatencyModel, get_gpu
from llmd.perf.latency import Parallelism
from llmd.sim.params import SimParams
from llmd.sim.run import Simulation

LAT = LatencyModel(get_gpu("H100-80GB"), MODELS["glm-5.2"], Parallelism(dp=8, ep=True), mtp_draft_tokens=3)
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False}


def test_uniform_stream_is_random_random() -> None:
    ref = random.Random("7/mtp")
    s = UniformStream("7/mtp")
    got = [s.random() for _ in range(1500)]
    got += s.peek(3000)
    s.skip(3000)
    got += [s.random() for _ in range(10)]
    assert got == [ref.random() for _ in range(4510)]


@pytest.mark.parametrize(("beta", "k"), [(0.8, 3), (0.5, 1), (1.0, 2), (0.0, 3), (0.9, 5)])
def test_bulk_acceptance_draws_are_the_latency_models(beta: float, k: int) -> None:
    lat = LatencyModel(get_gpu("H100-80GB"), MODELS["glm-5.2"], mtp_draft_tokens=k)
    lat.draft_beta = beta
    s = UniformStream("x")
    u = s.peek(5000)
    bulk, i = [], 0
    while i + k <= len(u):
        a, i = accepted(u, i, beta, k)
        bulk.append((a, i))
    one = [(lat.sample_accepted(s), s._i) for _ in range(len(bulk))]
    assert one == bulk and len(bulk) >= 5000 // (k + 1)


@dataclass
class Log:
    outputs: list[tuple[float, str, tuple[int, ...], bool]] = field(default_factory=list)
    events: list[tuple[float, list[Any]]] = field(default_factory=list)  # per step with events: (its end, events)
    runs: int = 0


def _workload(seed: int) -> list[tuple[float, str, Any]]:
    """(time, "add"/"abort", request or id): sessions growing their prompts, some sharing a system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(rng.choice((0, 40, 300, 2100)))]  # 2100: decodes past DSA's top-k
    out: list[tuple[float, str, Any]] = []
    t = 0.0
    rate = rng.choice((4.0, 25.0))  # arrivals per second: runs cut often, or a backlog
    for i in range(rng.randrange(12, 30)):
        t += rng.expovariate(rate)
        prompt = system + [rng.randrange(1000) for _ in range(rng.randrange(1, 2500))]
        leg = rng.random() < 0.15
        req = SimRequest(
            f"r{i}",
            prompt,
            1 if leg else rng.randrange(2, 400),
            kv_transfer_params=dict(PREFILL_LEG) if leg else None,
            output_script=[rng.randrange(1000) for _ in range(rng.randrange(0, 500))] if rng.random() < 0.5 else None,
        )
        out.append((t, "add", req))
        if rng.random() < 0.1:
            out.append((t + rng.uniform(0.01, 0.5), "abort", req.request_id))
    return sorted(out, key=lambda e: e[0])


def _core(seed: int) -> EngineCore:
    rng = random.Random(seed)
    cfg = SimEngineConfig(
        block_size=16,
        num_gpu_blocks=rng.choice((600, 1200, 6000)),
        num_cpu_blocks=rng.choice((0, 300)),
        max_model_len=8192,
        vocab_size=1000,
        max_num_seqs=rng.choice((4, 16)),
        max_num_batched_tokens=rng.choice((512, 4096)),
        num_speculative_tokens=rng.choice((0, 3, 3, 2)),
        kv_lease_s=0.05,
        seed=seed,
    )
    return EngineCore(cfg, LAT)


def _drive(core: EngineCore, work: list[tuple[float, str, Any]], fast: bool, per_step: bool = True) -> Log:
    """Steps `core` through `work`; outside changes land between steps, at the step boundary after their time (what
    the simulator's ranks do: a change during a step waits for the next one)."""
    log = Log()
    now = 0.0
    i = 0

    def land(upto: float) -> None:
        nonlocal i
        while i < len(work) and work[i][0] <= upto:
            _, kind, x = work[i]
            i += 1
            if kind == "add":
                r = SimRequest(x.request_id, x.prompt_token_ids, x.max_tokens, kv_transfer_params=x.kv_transfer_params)
                r.output_script = x.output_script
                core.add_request(r)
            else:
                core.abort_request(x)

    def record(end: float, outputs: list[Any], events: list[Any]) -> None:
        for o in outputs:
            log.outputs.append((end, o.request_id, tuple(o.new_token_ids), o.finished))
        if events:
            log.events.append((end, events))

    while True:
        land(now)
        if not core.has_work():
            nxt = core.next_lease_expiry()
            if i == len(work) and nxt is None:
                break
            now = max(now, min(work[i][0] if i < len(work) else float("inf"), (nxt or float("inf")) + 1e-6))
            core.expire_leases(now)
            record(now, [], core.take_events())
            continue
        run = core.plan_decode(now, 64) if fast else None
        if run is None:
            res = core.step(now)
            now += res.duration_s
            record(now, res.outputs, res.events)
            continue
        log.runs += 1
        ends = np.cumsum(np.concatenate(((now,), run.durations)))[1:].tolist()
        j = len(run)
        if i < len(work) and work[i][0] < ends[-1]:
            j = min(j, 1 + bisect_left(ends, work[i][0]))  # the steps begun before the change
        if per_step:
            for s in range(j):
                events = core.advance(run, s + 1)
                record(ends[s], core.decode_outputs(run, s, s + 1), events)
        else:
            events = core.advance(run, j)
            for s in range(j):
                record(ends[s], core.decode_outputs(run, s, s + 1), [])
            if events:
                log.events.append((ends[j - 1], events))
        now = ends[j - 1]
        core.check_invariants()
    core.check_invariants()
    return log


def _same_times(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == pytest.approx(y, rel=1e-12, abs=1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", range(24))
def test_fast_forward_matches_single_steps(seed: int) -> None:
    work = _workload(seed)
    slow = _drive(_core(seed), work, fast=False)
    core = _core(seed)
    fast = _drive(core, work, fast=True)
    assert [o[1:] for o in fast.outputs] == [o[1:] for o in slow.outputs]
    assert _same_times([o[0] for o in fast.outputs], [o[0] for o in slow.outputs])
    assert [e for _, e in fast.events] == [e for _, e in slow.events]
    assert _same_times([t for t, _ in fast.events], [t for t, _ in slow.events])
    s1, s2 = core.stats(), _core(seed).stats()
    assert s1.generation_tokens_total > s2.generation_tokens_total
    if core.config.num_speculative_tokens:
        assert fast.runs > 0 or len(fast.outputs) < 50


@pytest.mark.parametrize("seed", range(6))
def test_a_run_carried_out_at_once_gives_the_same_events_in_order(seed: int) -> None:
    work = _workload(100 + seed)
    slow = _drive(_core(100 + seed), work, fast=False)
    fast = _drive(_core(100 + seed), work, fast=True, per_step=False)
    assert [o[1:] for o in fast.outputs] == [o[1:] for o in slow.outputs]
    assert [ev for _, e in fast.events for ev in e] == [ev for _, e in slow.events for ev in e]


def test_a_run_stops_before_anything_that_changes_the_batch() -> None:
    core = EngineCore(
        SimEngineConfig(block_size=16, num_gpu_blocks=4000, max_model_len=4096, num_speculative_tokens=3), LAT
    )
    core.add_request(SimRequest("a", list(range(100)), 60))
    assert core.plan_decode(0.0) is None  # a prefill first
    now = core.step(0.0).duration_s
    run = core.plan_decode(now)
    assert run is not None and 2 <= len(run) < 60 / 1.0
    # no finish inside a run: the request has tokens to go after its last step
    assert 59 - run.gained_between(0, 0, len(run)) >= 1
    core.add_request(SimRequest("b", list(range(50)), 10))
    assert core.plan_decode(now) is None  # an arrival waits: the next step admits it


def test_a_run_goes_on_while_a_request_near_its_end_has_its_drafts_capped() -> None:
    """A request with fewer than k + 1 tokens left is scheduled only the drafts it can use: the run goes on through
    those steps and ends before the one that finishes it, which is a single step's (that such runs are what single
    steps do is test_fast_forward_matches_single_steps')."""
    core = EngineCore(
        SimEngineConfig(block_size=16, num_gpu_blocks=4000, max_model_len=4096, num_speculative_tokens=3), LAT
    )
    core.add_request(SimRequest("a", list(range(100)), 60))
    core.add_request(SimRequest("b", list(range(200, 300)), 10))
    now = core.step(0.0).duration_s  # both prefilled: one token each
    run = core.plan_decode(now)
    assert run is not None
    left = [9 - run.gained_between(1, 0, s) for s in range(len(run) + 1)]  # b's tokens to go at each step's start
    assert left == [9, 5, 2, 1]  # the last step began with 2 to go: one draft, not three
    core.advance(run, len(run))
    assert core.plan_decode(now + sum(run.durations)) is None  # b finishes in the next step: a single step
    out = {o.request_id: o for o in core.step(now + sum(run.durations)).outputs}
    assert out["b"].finished and not out["a"].finished and "b" not in core.requests


def _steps_seen(core: EngineCore, now: float) -> list[tuple[bool, bool, bool]]:
    """Per step of the next run, carried out one at a time: (has_events, it sent KV events, it took blocks)."""
    run = core.plan_decode(now)
    assert run is not None
    out = []
    for s in range(len(run)):
        free = core.kv.num_free_blocks
        events = core.advance(run, s + 1)
        out.append((run.has_events(s), bool(events), core.kv.num_free_blocks < free))
    return out


def test_a_run_has_events_only_at_steps_whose_kv_work_is_seen_outside() -> None:
    """A step that only takes blocks holding no hash sends nothing (no eviction, nothing cached): it needs no event,
    and its work is carried out with the next step that has one. Taking a cached block evicts it (BlockRemoved)."""

    def core_with(num_gpu_blocks: int) -> EngineCore:
        cfg = SimEngineConfig(
            block_size=16, num_gpu_blocks=num_gpu_blocks, max_model_len=600, num_speculative_tokens=3, seed=3
        )
        return EngineCore(cfg, LAT)

    # A fresh pool: every free block is unhashed.
    core = core_with(4000)
    for i in range(3):
        core.add_request(SimRequest(f"r{i}", list(range(i * 50, i * 50 + 90 + 7 * i)), 200))
    now = core.step(0.0).duration_s
    seen = _steps_seen(core, now)
    assert all(has == sent for has, sent, _ in seen)
    assert any(took and not has for has, _, took in seen)  # blocks taken silently
    # Cached blocks at the queue's front: a finished request's blocks are all that is free, its full ones hashed.
    core = core_with(40)
    core.add_request(SimRequest("old", list(range(1000, 1000 + 16 * 30)), 1))
    t = 0.0
    while core.has_work():
        t += core.step(t).duration_s
    core.add_request(SimRequest("new", list(range(2000, 2000 + 16 * 8 + 5)), 120))  # takes the 9 unhashed
    t += core.step(t).duration_s
    assert core.kv.unhashed_free_front(40) == 0
    seen = _steps_seen(core, t)
    assert all(has == sent for has, sent, _ in seen)
    assert any(took and has for has, _, took in seen)  # a taken block evicted a cached one


@pytest.mark.parametrize(
    "params",
    [
        SimParams(),
        # Scrapes inside most runs: ranks carry out a run's KV work early and its requests' tokens later.
        SimParams(scrape_interval_s=0.007),
        # Every streamed token relayed through the router (a run's outputs step by step, not recorded in bulk).
        SimParams(stream_cpu_s=1e-5),
    ],
    ids=["quiet", "scraped", "streamed"],
)
def test_the_cluster_simulator_gives_the_same_run_with_and_without_fast_forward(params: SimParams) -> None:
    """Ranks carry out a run's steps when an arrival, a pull or a scrape touches them: every request sees the same
    engine, the same times and the same routing as with single steps."""
    spec = embedded_spec(8.0)
    spec = spec.model_copy(update={"mtp": spec.mtp.model_copy(update={"draft_tokens": 3})})
    calls = {}
    for ff in (True, False):
        sim = Simulation(spec, run_id="ff", params=params)
        sim.fleet.fast_forward = ff
        sim.run()
        assert (sum(r.runs for r in sim.fleet.ranks) > 0) == ff
        calls[ff] = {c.request_id: c for c in sim.calls}
    fast, slow = calls[True], calls[False]
    assert fast.keys() == slow.keys() and len(fast) > 100
    for rid, c in fast.items():
        s = slow[rid]
        assert (c.status, c.pod, c.prefill_pod, c.output_tokens, c.cached_tokens) == (
            s.status,
            s.pod,
            s.prefill_pod,
            s.output_tokens,
            s.cached_tokens,
        )
        assert _same_times(c.token_times, s.token_times)


def test_outputs_of_scripted_requests_need_no_step_carried_out() -> None:
    """A run's outputs come from the requests' output scripts before its steps are carried out (the simulator then
    carries out only steps with KV work at their ends), and are what carrying them out gives."""

    def start() -> tuple[EngineCore, Any]:
        core = EngineCore(
            SimEngineConfig(block_size=16, num_gpu_blocks=4000, max_model_len=8192, num_speculative_tokens=3), LAT
        )
        for i in range(3):
            core.add_request(SimRequest(f"r{i}", list(range(2200 + i)), 300, output_script=list(range(5, 305))))
        now = 0.0
        while any(not r.output_token_ids for r in core.requests.values()):
            now += core.step(now).duration_s
        run = core.plan_decode(now)
        assert run is not None and run.scripted
        return core, run

    core, run = start()
    early = [[(o.request_id, o.new_token_ids) for o in core.decode_outputs(run, s, s + 1)] for s in range(len(run))]
    assert run.applied == 0
    core2, run2 = start()
    late = []
    for s in range(len(run2)):
        core2.advance(run2, s + 1)
        late.append([(o.request_id, o.new_token_ids) for o in core2.decode_outputs(run2, s, s + 1)])
    assert early == late
