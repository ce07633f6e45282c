"""The router core driven as the cluster simulator drives it: a plain loop with a fake clock, fake engines, no sockets,
no asyncio. Admission (fair queueing, the queue limit, waiting for a prefix holder, KV admission), the in-flight
ledger, the hop plans and what a failed hop leads to."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from llmd.discovery import PodInfo
from llmd.kv.index import KVIndex
from llmd.perf import MODELS, get_gpu
from llmd.perf.latency import LatencyModel
from llmd.router.core import Job, QueueFull, RouterCore
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
    _seq: Iterable[int] = field(default_factory=itertools.count)
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
            heapq.heappush(self._events, (self.now + t, next(self._seq), j))  # type: ignore[call-overload]

    def run(self, until: float = 1e9, on_finish: Any = None) -> None:
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
