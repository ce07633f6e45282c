"""The router core driven as the cluster simulator drives it: a plain loop with a fake clock, fake engines, no sockets,
no asyncio. Admission (fair queueing, the queue limit, waiting for a prefix holder, KV admission), the in-flight
ledger, the hop plans and what a failed hop leads to."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from llmd.discovery import PodInfo
from llmd.kv.events import BlockRemoved, EventBatch
from llmd.kv.index import KVIndex
from llmd.perf import MODELS, get_gpu
from llmd.perf.latency import LatencyModel
from llmd.router.core import NO_HOPS, Job, QueueFull, RouterCore
from llmd.router.ledger import Flight
from llmd.router.pods import Pod
from llmd.router.scheduling import NoEndpointError, RouteRequest, Scheduler
from llmd.spec.model import RouterSpec

BS = 16


def pod(name: str, role: str = "both", **kw: Any) -> Pod:
    info = PodInfo(name, role, f"http://{name}:8000", engine_id=f"engine-{name}", side_channel_host=f"{name}-host",
                   side_channel_port=5600, **kw)  # fmt: skip
    return Pod(info, healthy=True)


def make_core(
    pods: Iterable[Pod],
    *,
    max_inflight: int = 4,
    queue_limit: int = 100,
    latency: Any = None,
    index: KVIndex | None = None,
    **spec: Any,
) -> RouterCore:
    spec.setdefault("pd_threshold", 10_000_000)  # no P/D unless a test asks for it
    settings = RouterSpec(max_inflight_per_pod=max_inflight, queue_limit=queue_limit, **spec)
    core = RouterCore(
        Scheduler(settings, seed=0, latency=latency),
        index if index is not None else KVIndex(),
        max_inflight=max_inflight,
        queue_limit=queue_limit,
        max_attempts=3,
    )
    for p in pods:
        core.pod_up(p)
    return core


def context(session: int, blocks: int) -> list[int]:
    """A session's prompt as block hashes: its context only grows, so block i's hash is the session's and i's."""
    return [session * 1_000_000 + i + 1 for i in range(blocks)]


def job(session: int | str, blocks: int = 0, max_tokens: int = 16, rid: str = "", **kw: Any) -> Job:
    hashes = context(session, blocks) if isinstance(session, int) else []
    req = RouteRequest(rid or f"{session}-{blocks}", hashes, blocks * BS, BS, str(session), max_tokens=max_tokens)
    return Job(req, str(session), **kw)


def admitted(core: RouterCore, j: Job, now: float) -> Flight:
    decided = core.submit(j, now)
    assert j in decided and j.flight is not None, "expected an admission"
    return j.flight


# ---- a plain loop over fake engines ----------------------------------------------------------------------------------


@dataclass
class FakeCluster:
    """Engines that take `LatencyModel.prefill_time` for a request's uncached prompt plus a fixed time per output
    token, cache what they computed (KV events into the core's index) and finish; the loop advances virtual time to
    the next completion or the core's asked-for wakeup."""

    core: RouterCore
    latency: LatencyModel
    tpot_s: float = 0.002
    now: float = 0.0
    _events: list[tuple[float, int, Job]] = field(default_factory=list)
    _seq: Iterator[int] = field(default_factory=itertools.count)
    finished: list[tuple[float, Job, Flight]] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)
    waited: list[float] = field(default_factory=list)

    def submit(self, j: Job) -> None:
        self._start(self.core.submit(j, self.now))

    def _start(self, jobs: Sequence[Job]) -> None:
        for j in jobs:
            f = j.flight
            assert f is not None
            holder = f.decision.target.holder
            self.peak[holder[0]] = max(self.peak.get(holder[0], 0), self.core.ledger.inflight(holder))
            self.waited.append(self.now - j.queued_at)
            cached = f.decision.expected_hit_tokens
            t = self.latency.prefill_time(f.uncached, cached) + j.req.max_tokens * self.tpot_s
            heapq.heappush(self._events, (self.now + t, next(self._seq), j))

    def run(self, until: float = 1e9, on_finish: Callable[[Job], None] | None = None) -> None:
        while self._events or self.core.next_wakeup() is not None:
            wake = self.core.next_wakeup()
            t_done = self._events[0][0] if self._events else None
            if wake is not None and (t_done is None or wake < t_done):
                self.now = wake
                self._start(self.core.pump(self.now))
                continue
            assert t_done is not None
            if t_done > until:
                return
            self.now, _, j = heapq.heappop(self._events)
            f = j.flight
            assert f is not None
            self.core.index.store(f.decision.target.holder, list(j.req.block_hashes))
            self._start(self.core.complete(f, self.now))
            self.finished.append((self.now, j, f))
            if on_finish is not None:
                on_finish(j)


def _agent_sessions(n_sessions: int = 8, turns: int = 5) -> FakeCluster:
    """Eight agent sessions of five turns each, every turn its session's context plus 20 blocks, on three engines of
    two slots each: more sessions than slots, so some wait and some move."""
    model = _latency()
    core = make_core([pod(f"e{i}") for i in range(3)], max_inflight=2, latency=model)
    cluster = FakeCluster(core, model)
    done = dict.fromkeys(range(n_sessions), 0)

    def next_turn(j: Job) -> None:
        s = int(j.session)
        done[s] += 1
        if done[s] < turns:
            cluster.submit(job(s, 40 + 20 * done[s], rid=f"{s}/{done[s]}"))

    for s in done:
        cluster.submit(job(s, 40, rid=f"{s}/0"))
    cluster.run(on_finish=next_turn)
    return cluster


def test_a_plain_loop_drives_the_core_sessions_stick_to_their_prefix_and_no_pod_overfills() -> None:
    cluster = _agent_sessions()
    core = cluster.core
    assert len(cluster.finished) == 8 * 5
    assert max(cluster.peak.values()) <= 2  # admission never over-fills an engine
    assert core.stats() == {"waiting": 0, "sessions_waiting": 0, "inflight": 0, "admitted": 40, "rejected": 0}
    assert max(cluster.waited) > 0  # eight sessions, six slots: some waited in the router
    first = [f.decision.reason for _, j, f in cluster.finished if j.req.request_id.endswith("/0")]
    assert first == ["cold"] * 8  # new sessions are spread, not piled on one pod
    later = [f for _, j, f in cluster.finished if not j.req.request_id.endswith("/0")]
    assert sum(f.decision.reason == "prefix-hit" for f in later) >= 2 * len(later) // 3  # later turns follow it
    assert all(f.decision.expected_hit_tokens > 0 for f in later if f.decision.reason == "prefix-hit")
    # Deterministic: the same calls in the same order give the same decisions.
    again = _agent_sessions()
    trace = [(t, j.req.request_id, f.target.name) for t, j, f in cluster.finished]
    assert trace == [(t, j.req.request_id, f.target.name) for t, j, f in again.finished]


def _latency() -> LatencyModel:
    return LatencyModel(get_gpu("H100-80GB"), MODELS["llama-3.1-8b"])


# ---- admission ---------------------------------------------------------------------------------------------------


def test_fair_queueing_round_robins_sessions() -> None:
    core = make_core([pod("e0")], max_inflight=1)
    first = admitted(core, job("blocker"), 0.0)
    jobs = [job("a", rid=f"a{i}") for i in range(4)] + [job(s, rid=f"{s}0") for s in "bc"]  # a burst from one session
    for j in jobs:
        assert core.submit(j, 0.0) == []
    order = []
    flight = first
    for t in range(1, 7):
        (got,) = core.complete(flight, float(t))
        order.append(got.req.request_id)
        assert got.flight is not None
        flight = got.flight
    assert order == ["a0", "b0", "c0", "a1", "a2", "a3"]


def test_a_full_queue_refuses_and_counts() -> None:
    core = make_core([pod("e0")], max_inflight=1, queue_limit=1)
    admitted(core, job("x"), 0.0)
    assert core.submit(job("y"), 0.0) == []
    with pytest.raises(QueueFull) as err:
        core.submit(job("z"), 0.0)
    assert err.value.retry_after_s >= 1
    assert core.stats()["rejected"] == 1 and core.queue.waiting == 1


def test_a_request_whose_endpoint_has_room_passes_requests_waiting_for_full_ones() -> None:
    """A waiter held for a full engine (here: its retry excludes the other) does not hold back a newcomer whose
    choice has room: the newcomer is admitted when it arrives, not at the next release."""
    core = make_core([pod("holder"), pod("other")], max_inflight=1)
    blocker = admitted(core, job("z", excluded={"other"}), 0.0)
    assert blocker.target.name == "holder"
    waiting = job("a", excluded={"other"})
    assert core.submit(waiting, 0.0) == [] and core.queue.waiting == 1
    newcomer = job("b")
    assert core.submit(newcomer, 0.1) == [newcomer]  # admitted at once, past the waiter
    assert newcomer.flight is not None and newcomer.flight.target.name == "other" and core.queue.waiting == 1
    assert core.complete(blocker, 0.2) == [waiting]  # the holder freed
    assert waiting.flight is not None and waiting.flight.target.name == "holder" and core.queue.waiting == 0


def test_a_withdrawn_request_leaves_the_queue_and_an_admitted_one_gives_its_slot_back() -> None:
    core = make_core([pod("e0")], max_inflight=1)
    a = job("a")
    first = admitted(core, a, 0.0)
    b, c = job("b"), job("c")
    core.submit(b, 0.0)
    core.submit(c, 0.0)
    assert core.withdraw(b, 0.1) == [] and core.queue.waiting == 1
    assert core.withdraw(a, 0.2) == [c] and first.released  # cancelled after admission: its slot goes to c
    assert core.ledger.inflight(("e0", 0)) == 1


def test_no_healthy_decode_pod_is_no_endpoint() -> None:
    core = make_core([pod("p0", "prefill")])
    with pytest.raises(NoEndpointError):
        core.submit(job("a"), 0.0)


# ---- helpers for the tests that need a placed session --------------------------------------------------------------


def _placed(core: RouterCore, session: int, blocks: int, now: float = 0.0) -> Pod:
    """Route a session's first turn, finish it and index its blocks where it ran; returns that pod."""
    j = job(session, blocks)
    f = admitted(core, j, now)
    core.complete(f, now)
    core.index.store(f.decision.target.holder, list(j.req.block_hashes))
    return f.target


def test_a_request_waits_for_its_prefix_holder_until_the_patience_runs_out() -> None:
    """Delay scheduling: the holder of a 4,000-token prefix is full and another pod is free; the request waits for
    the holder as long as the prefill it would save elsewhere (0.2 s at ConstantRateModel's 20K tokens/s), and the
    core asks to be pumped then."""
    for holder_frees in (True, False):
        core = make_core([pod("e0"), pod("e1")], max_inflight=1)
        holder = _placed(core, 1, 250)
        other = "e1" if holder.name == "e0" else "e0"
        blocker = admitted(core, job("z", excluded={other}), 0.0)
        turn = job(1, 260)
        assert core.submit(turn, 0.0) == [] and turn.flight is None
        wake = core.next_wakeup()
        assert wake is not None and wake == pytest.approx(0.2 + 0.001, abs=0.01)
        if holder_frees:
            assert core.complete(blocker, 0.1) == [turn]  # the holder freed first: the request goes there
            assert turn.flight is not None and turn.flight.target is holder
            assert turn.flight.decision.reason == "prefix-hit"
        else:
            assert core.pump(wake - 0.01) == [] and core.next_wakeup() is not None  # not yet
            assert core.pump(wake) == [turn] and core.next_wakeup() is None  # patience ran out: recompute elsewhere
            assert turn.flight is not None and turn.flight.target.name == other


def test_a_request_waiting_for_its_holder_is_not_rescored_until_the_holder_changes(monkeypatch) -> None:
    """The decision to wait for the prefix holder stands while nothing changes there: completions at other pods pump
    the queue without a scoring pass for it (under load that was a pass per waiting head per completion), and a
    take or give at the holder, or the patience running out, has it decided again."""
    core = make_core([pod("e0"), pod("e1"), pod("e2")], max_inflight=1)
    holder = _placed(core, 1, 250)
    others = [p for p in ("e0", "e1", "e2") if p != holder.name]
    blocker = admitted(core, job("z", excluded=set(others)), 0.0)
    holder.ranks[0].kv_usage = 0.3  # its engine's gauge when the turn decides to wait
    turn = job(1, 260)
    assert core.submit(turn, 0.0) == [] and turn.patience is not None
    passes = []
    schedule = core.scheduler.schedule
    monkeypatch.setattr(core.scheduler, "schedule", lambda *a, **k: passes.append(1) or schedule(*a, **k))
    busy = admitted(core, job("y", excluded={holder.name, others[1]}), 0.01)
    assert busy.target.name == others[0] and len(passes) == 1
    assert core.complete(busy, 0.05) == [] and len(passes) == 1  # elsewhere: the waiting turn is not scored again
    holder.ranks[0].kv_usage = 0.5
    assert core.pump(0.06) == [] and len(passes) == 1  # its engine reports less room: still waiting, not scored
    holder.ranks[0].kv_usage = 0.2
    assert core.pump(0.07) == [] and len(passes) == 2  # more room: decided again (the slot is still taken)
    assert core.complete(blocker, 0.1) == [turn] and len(passes) == 3  # the holder freed: decided again, admitted
    assert turn.flight is not None and turn.flight.target is holder and turn.patience is None


def test_a_wait_for_the_holder_is_decided_again_when_the_holders_kv_events_change(monkeypatch) -> None:
    """The holder's KV events removed the prefix while the request waited for it: the next pump decides it again
    (without that it would wait out a patience the holder no longer earns) and it goes to a free pod."""
    core = make_core([pod("e0"), pod("e1"), pod("e2")], max_inflight=1)
    holder = _placed(core, 1, 250)
    others = [p for p in ("e0", "e1", "e2") if p != holder.name]
    t = 0.5  # the first turn's speculative entries have settled: the index alone says what the holder has
    admitted(core, job("z", excluded=set(others)), t)  # the holder is full
    turn = job(1, 260)
    assert core.submit(turn, t) == [] and turn.patience is not None
    passes = []
    schedule = core.scheduler.schedule
    monkeypatch.setattr(core.scheduler, "schedule", lambda *a, **k: passes.append(1) or schedule(*a, **k))
    busy = admitted(core, job("y", excluded={holder.name, others[1]}), t + 0.01)
    assert core.complete(busy, t + 0.02) == [] and len(passes) == 1  # nothing changed at the holder: still waiting
    core.index.apply(holder.name, EventBatch(t, [BlockRemoved(list(turn.req.block_hashes[1:250]), "GPU")], 0))
    assert core.pump(t + 0.04) == [turn] and len(passes) == 2
    assert turn.flight is not None and turn.flight.target.name in others


def test_a_holder_is_waited_for_longer_while_other_requests_wait_too() -> None:
    """A saturated fleet: two sessions' holder is full; each request alone would wait 0.2 s for it, but while the
    other waits too a recompute elsewhere would delay it as well, so each waits twice as long. When the holder frees,
    the first goes there, and the second, alone in the queue now and past its own patience, goes to the free pod."""
    core = make_core([pod("e0"), pod("e1")], max_inflight=1)
    for s in (1, 2):
        core.index.store(("e0", 0), list(job(s, 250).req.block_hashes))
    blocker = admitted(core, job("z", excluded={"e1"}), 0.0)
    t1, t2 = job(1, 260), job(2, 260)
    assert core.submit(t1, 0.0) == [] and core.next_wakeup() == pytest.approx(0.201, abs=0.01)
    assert core.submit(t2, 0.0) == []
    assert core.pump(0.25) == []  # alone, t1 would have left for e1 by now
    assert core.next_wakeup() == pytest.approx(0.401, abs=0.01)
    assert core.complete(blocker, 0.3) == [t1, t2]
    assert t1.flight is not None and t1.flight.target.name == "e0" and t1.flight.decision.reason == "prefix-hit"
    assert t2.flight is not None and t2.flight.target.name == "e1"


def test_kv_admission_holds_a_request_until_kv_frees_and_counts_a_cached_shared_prefix_once() -> None:
    """100 blocks of 16 tokens (99 usable): two forks of a cached 60-block context fit together, since the engine
    holds the shared blocks once; a third session's request waits although slots are free."""
    e0 = pod("e0")
    e0.ranks[0].kv_capacity_blocks = 100
    core = make_core([e0], max_inflight=4)
    first = job(1, 60, max_tokens=64)
    core.complete(admitted(core, first, 0.0), 1.0)
    core.index.store(("e0", 0), list(first.req.block_hashes))
    forks = [job(1, 61, max_tokens=64, rid="f1"), job(1, 62, max_tokens=64, rid="f2")]
    flights = [admitted(core, f, 2.0) for f in forks]  # 1,040 + 1,056 tokens, 960 of them shared: they fit
    other = job(2, 40, max_tokens=64)  # 704 more tokens do not
    assert core.submit(other, 2.0) == [] and core.ledger.inflight(("e0", 0)) == 2
    assert core.complete(flights[0], 3.0) == []  # 1,056 + 704 still exceed 1,584
    assert core.complete(flights[1], 4.0) == [other]
    assert core.ledger.load(("e0", 0)).kv.tokens == 40 * 16 + 64


def test_a_failed_hop_is_retried_on_another_pod_without_kv_transfer_then_given_up() -> None:
    pods = [pod(f"e{i}") for i in range(3)]
    core = make_core(pods)
    j = job("a")
    first = admitted(core, j, 0.0)
    bad = first.target.name
    core.index.store((bad, 0), [1, 2, 3])
    out = core.fail(j, "connect", pod_down=True, now=0.1)  # the connection was refused: the pod is gone
    assert out.retry and out.down == bad and out.admitted == [] and not out.error
    assert core.pod(bad) is None and all(h[0] != bad for h in core.index.holders())
    assert first.released and core.stats()["inflight"] == 0
    assert j.excluded == {bad} and j.no_kv_transfer
    second = admitted(core, j, 0.2)
    assert second.target.name != bad and core.hop_plan(j) is NO_HOPS
    out = core.fail(j, "status_500", pod_down=False, now=0.3)  # an error status: the pod stays
    assert out.retry and out.down is None and core.pod(second.target.name) is not None
    third = admitted(core, j, 0.4)
    assert third.target.name not in (bad, second.target.name) and j.attempts == 3
    out = core.fail(j, "body", pod_down=False, now=0.5)
    assert not out.retry and out.error == "engines failed 3 times: body"


def test_a_retry_that_excludes_every_pod_falls_back_to_a_healthy_one() -> None:
    core = make_core([pod("e0"), pod("e1")])
    j = job("a")
    for _ in range(2):
        admitted(core, j, 0.0)
        assert core.fail(j, "stream_error", pod_down=False, now=0.0).retry
    assert j.excluded == {"e0", "e1"}
    assert admitted(core, j, 0.0).target.name in ("e0", "e1")  # served plainly beats answering with an error


def test_pd_plan_holds_both_slots_until_each_hop_ends_and_learns_the_prefill_engine() -> None:
    pre, dec = pod("p0", "prefill"), pod("d0", "decode")
    core = make_core([pre, dec], pd_threshold=16, p2p=False)
    j = job(1, 40)
    f = admitted(core, j, 0.0)
    assert f.decision.pd is not None and f.prefill is pre and f.target is dec
    assert core.ledger.inflight(("p0", 0)) == core.ledger.inflight(("d0", 0)) == 1
    plan = core.hop_plan(j)
    assert plan.prefill is pre and plan.why == "pd"
    kv = {"do_remote_prefill": True, "remote_engine_id": "E", "remote_host": "h", "remote_port": 7}
    out = core.prefill_done(f, plan, kv, unreachable=False, now=0.5)
    assert out.down is None and core.ledger.inflight(("p0", 0)) == 0 and core.ledger.inflight(("d0", 0)) == 1
    assert pre.ranks[0].engine_id == "E" and pre.ranks[0].side_channel == ("h", 7)
    core.complete(f, 1.0)
    assert core.stats()["inflight"] == 0
    # Each hop's end settled the speculative entries it made: from a moment later the KV index alone says what the
    # prefill pod (computed at 0.5) and the decode pod (done at 1.0) hold.
    spec = core.scheduler.speculative
    assert spec is not None and len(spec._settled) == 2
    hashes = j.req.block_hashes
    assert set(spec.match(hashes, 0.55)) == {("p0", 0), ("d0", 0)}
    assert set(spec.match(hashes, 0.55 + spec.settle_s)) == {("d0", 0)}
    assert spec.match(hashes, 1.0 + spec.settle_s) == {}
    # A prefill pod that refuses the connection leaves routing; the request goes on decode-only.
    j2 = job(2, 40)
    f2 = admitted(core, j2, 2.0)
    out = core.prefill_done(f2, core.hop_plan(j2), None, unreachable=True, now=2.1)
    assert out.down == "p0" and core.pod("p0") is None
    assert admitted(core, job(3, 40), 2.2).decision.pd is None


@pytest.mark.parametrize("mode", ["hash", "two-hop"])
def test_p2p_plan_pulls_from_an_overloaded_holder(mode: str) -> None:
    core = make_core([pod("e0"), pod("e1")], max_inflight=2, pd_threshold=16)
    core.p2p_mode = mode  # type: ignore[assignment]
    holder = _placed(core, 1, 40)
    other = "e1" if holder.name == "e0" else "e0"
    for i in range(2):  # the holder's own session fills it
        assert admitted(core, job(1, 41, rid=f"fill{i}"), 0.1).target is holder
    j = job(1, 42)
    f = admitted(core, j, 0.2)
    assert f.target.name == other and f.decision.reason == "p2p" and f.decision.p2p_source is not None
    plan = core.hop_plan(j)
    if mode == "hash":
        assert plan.p2p_outcome == "sent" and plan.source == holder.name and plan.prefill is None
        assert plan.kv_params == {
            "do_remote_prefill": True,
            "remote_engine_id": f"engine-{holder.name}",
            "remote_host": f"{holder.name}-host",
            "remote_port": 5600,
            "remote_num_tokens": f.decision.expected_hit_tokens,
        }
    else:
        assert plan.prefill is holder and plan.why == "p2p" and plan.kv_params is None
    core.pod_down(holder.name)
    assert core.hop_plan(j).p2p_outcome == "source_gone"


def test_one_kv_index_query_per_decision() -> None:
    """The snapshot's KV-fit check and the scheduler's prefix hits share one query of the index (in either form)."""

    class Counting(KVIndex):
        queries = 0

        def query(self, block_hashes: Sequence[int]) -> Any:
            Counting.queries += 1
            return super().query(block_hashes)

        def query_columns(self, block_hashes: Sequence[int]) -> Any:
            Counting.queries += 1
            return super().query_columns(block_hashes)

    core = make_core([pod("e0"), pod("e1")], index=Counting())
    _placed(core, 1, 40)
    Counting.queries = 0
    admitted(core, job(1, 41), 1.0)
    assert Counting.queries == 1


def test_gauges_are_read_again_only_after_a_write() -> None:
    """The core keeps its gauge columns between decisions until some rank's gauges are written (RankState.written,
    counted on every write however it is made)."""
    p = pod("e0")
    core = make_core([p, pod("e1")])
    first = core.snapshot(set()).columns
    again = core.snapshot(set()).columns
    assert again.waiting.tolist() == first.waiting.tolist() == [0, 0]
    before = type(p.ranks[0]).written
    p.ranks[0].engine_id = "x"  # not a gauge
    assert type(p.ranks[0]).written == before
    p.ranks[0].waiting = 7
    assert type(p.ranks[0]).written == before + 1
    assert core.snapshot(set()).columns.waiting.tolist() == [7, 0]


def test_a_max_tokens_past_int64_is_routed_not_a_router_failure() -> None:
    # The HTTP fuzz test's find: max_tokens 2**63 - 28 overflowed the int64 KV columns (a 500 from the router). The
    # engine answers it (a 400); the router's KV need is capped far above any cache and the request goes there.
    core = make_core([pod("e0"), pod("e1")])
    core._pods["e0"].ranks[0].kv_capacity_blocks = 1_000
    first = admitted(core, job(1, blocks=4), 0.0)  # KV in flight on its pod: the need is compared with it
    huge = job(2, blocks=2, max_tokens=2**63 - 28)
    admitted(core, huge, 0.0)
    assert huge.req.max_tokens == 2**53 and huge.req.kv_tokens == 2**53 + huge.req.num_tokens
    assert first.target.name in ("e0", "e1")
