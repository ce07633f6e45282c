"""The router's core: every routing decision and its state, no I/O. The live proxy and the cluster simulator drive it.

It holds the routable pods, the in-flight ledger, the admission queue and the KV index the scheduler reads. A driver
feeds it requests (`submit`), engine state (`pod_up` / `pod_down`, the pods' scraped gauges, `learn`), KV events (into
`index`) and outcomes (`complete`, `prefill_done`, `fail`), and carries out what it answers: which requests were
admitted where (a `Flight` on their `Job`), which hops to make (`hop_plan`), when to ask again (`next_wakeup`), which
pod to take down, whether to retry or give up. Time comes in as `now` (seconds, any monotonic clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from llmd.router import pd as hops
from llmd.router.admission import QueueFull, Rate, WaitQueue, retry_after
from llmd.router.fleet import Fleet, RequestColumns
from llmd.router.ledger import NO_KV, Flight, KVKey, Ledger, Load
from llmd.router.pods import Pod
from llmd.router.scheduling import (
    Decision,
    Endpoint,
    NoEndpointError,
    RouteRequest,
    Scheduler,
    Snapshot,
    holder_patience_s,
)
from llmd.router.scheduling.filters import kv_fits
from llmd.router.scheduling.kv_demand import request_kv

if TYPE_CHECKING:
    from llmd.kv.index import AnyKVIndex, PrefixColumns, PrefixMatch
    from llmd.router.scheduling.columns import IndexReader

# Asked-for re-runs of the queue come this much after the patience runs out, so the request has waited it all.
_WAKE_MARGIN_S = 0.001


@dataclass(frozen=True, slots=True, eq=False)
class HolderWait:
    """A request's decision to wait for the endpoint holding its prefix, and what it was taken on: it stands while
    nothing was taken or given at the holder, its engine reports no more room (KV use, queue) than then, it holds
    the same (its KV index epoch; -1: a policy that does not read the index) and the patience lasts (`each_s`
    per request waiting, Decision.wait_each_s)."""

    pod: Pod
    holder: tuple[str, int]
    load: Load
    version: int  # the Load's then: any take or give there (a sibling's take shares blocks with this request)
    kv_usage: float  # the holder's gauges then: a scrape showing more free KV or a shorter queue may let it in
    queued: int
    each_s: float
    epoch: int

    def stands(self, index: AnyKVIndex, pods: dict[str, Pod]) -> bool:
        """Nothing at the holder changed for the better (room, KV, its queue) or the worse (blocks it holds)."""
        ld, st = self.load, self.pod.ranks[self.holder[1]]
        return (
            ld.version == self.version
            and st.kv_usage >= self.kv_usage
            and st.running + st.waiting >= self.queued
            and pods.get(self.pod.name) is self.pod
            and (self.epoch < 0 or index.epoch(self.holder) == self.epoch)
        )


@dataclass(slots=True, eq=False)
class Job:
    """One request as the core sees it, across its attempts. `flight` is set when an attempt is admitted, `error`
    when its admission failed while it waited; `handle` is the driver's own (the proxy's future)."""

    req: RouteRequest
    session: str
    excluded: set[str] = field(default_factory=set)  # pods that failed it
    no_kv_transfer: bool = False  # a failed attempt took whatever its hops had set up
    attempts: int = 0
    queued_at: float = 0.0
    flight: Flight | None = None
    error: Exception | None = None
    handle: Any = None
    patience: HolderWait | None = None  # the decision to wait for its prefix holder, while it stands


@dataclass(frozen=True, slots=True)
class HopPlan:
    """What to do before sending an admitted request to its target.

    prefill: a prefill hop first (P/D; or, `why` "p2p", the prefix holder serving as prefill pod in two-hop P2P).
    kv_params: the target's kv_transfer_params for a P2P pull by hash from `source`.
    p2p_outcome: how a P2P choice turned out ("sent", or why none was made: "source_gone", "unknown_engine_id",
    "no_side_channel"); "" when the decision had no P2P, or it goes through `prefill`.
    transfer_tokens: prompt tokens of KV the target is to pull, as the decision expects: what it does not hold in GPU
    KV of what the other side will have (after a prefill hop the whole prompt; by hash the holder's prefix). Its CPU
    tier counts as not held: the engine's NIXL connector claims a pulled request, so that tier is not read for it.
    """

    prefill: Pod | None = None
    prefill_rank: int = 0
    why: Literal["pd", "p2p", ""] = ""
    kv_params: dict[str, Any] | None = None
    source: str = ""
    p2p_outcome: str = ""
    transfer_tokens: int = 0


NO_HOPS = HopPlan()


@dataclass(slots=True)
class Outcome:
    """What follows a finished hop. admitted: requests the freed slots let in; down: a pod the core took out of
    routing (a driver with its own health tracking tells it); retry: send the request again (`submit`); error: why
    it gives up, when neither."""

    admitted: list[Job]
    down: str | None = None
    retry: bool = False
    error: str = ""


def _snapshot_order(ep: Endpoint) -> tuple[str, int, str, str]:
    return ep.pod, ep.dp_rank, ep.role, ep.url


class _QueriedIndex:
    """The KV index with one query answered already: the snapshot's KV-fit check and the scheduler's prefix hits ask
    the same question of it within one decision, both by holder id (`query_columns`); the list form is asked of the
    index only by a list-based reader."""

    __slots__ = ("columns", "hashes", "index", "matches")

    def __init__(self, index: AnyKVIndex, hashes: Sequence[int], columns: PrefixColumns) -> None:
        self.index = index
        self.hashes = hashes
        self.columns = columns
        self.matches: list[PrefixMatch] | None = None

    @property
    def ids_version(self) -> int:
        return self.index.ids_version

    def holder_ids(self, holders: Iterable[tuple[str, int]]) -> np.ndarray:
        return self.index.holder_ids(holders)

    def query_columns(self, block_hashes: Sequence[int]) -> PrefixColumns:
        if block_hashes is self.hashes:
            return self.columns
        return self.index.query_columns(block_hashes)

    def query(self, block_hashes: Sequence[int]) -> list[PrefixMatch]:
        if block_hashes is not self.hashes:
            return self.index.query(block_hashes)
        if self.matches is None:
            self.matches = self.index.query(block_hashes)
        return self.matches


class RouterCore:
    """Routing state and decisions for one router. Not thread-safe; every call runs to completion."""

    def __init__(
        self,
        scheduler: Scheduler,
        index: AnyKVIndex,
        *,
        max_inflight: int,
        queue_limit: int,
        max_attempts: int = 3,
        p2p_mode: hops.P2PMode = "hash",
        alive: Callable[[Job], bool] | None = None,
        now: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.index = index
        self.ledger = Ledger(max_inflight)
        self.queue: WaitQueue[Job] = WaitQueue(queue_limit)
        self.max_attempts = max_attempts
        self.p2p_mode = p2p_mode
        self._alive = alive  # a waiting job the driver has given up on is dropped, not admitted
        # Shared prompt blocks count once only where the engine has them cached, which the KV index knows for block
        # hashes; the approximate policy's text chunks are no such proof.
        self._cached_from_index = "kv_index" in scheduler.inputs
        # Approximate routing's characters per token: the tuning's guess, then learned from the engines' usage.
        self.chars_per_token = float(scheduler.tuning.chars_per_token)
        self._pods: dict[str, Pod] = {}  # routable (healthy) pods
        self._fleet: Fleet | None = None  # every rank of every routable pod, in Snapshot's order
        self._endpoints_stale = True
        self._done = Rate(now)
        self._wake_at: float | None = None

    # ---- engine state ----------------------------------------------------------------------------------------------
    def pod_up(self, pod: Pod) -> None:
        """`pod` is healthy: route to it. Its `ranks` carry the engine's gauges, which the driver keeps current.
        Run `pump` after a change of the pod set: waiting requests may fit now."""
        self._pods[pod.name] = pod
        self._endpoints_stale = True

    def pod_down(self, name: str) -> None:
        """Out of routing, out of the index, forgotten by the scheduler. Requests in flight there still end."""
        if self._pods.pop(name, None) is not None:
            self._endpoints_stale = True
        self.index.drop_pod(name)
        self.scheduler.forget_pod(name)

    def pod(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def learn(self, pod: Pod, rank: int, kv: dict[str, Any]) -> None:
        """A prefill response names the pod's engine id and side channel: what a later P2P pull from it needs."""
        st = pod.ranks[rank]
        eid = kv.get("remote_engine_id")
        if isinstance(eid, str):
            st.engine_id = eid
        host, port = kv.get("remote_host"), kv.get("remote_port")
        if isinstance(host, str) and isinstance(port, int):
            st.side_channel = (host, port)

    def calibrate(self, text_chars: int, prompt_tokens: int) -> None:
        """Approximate routing estimates prompt tokens from characters (P/D threshold, KV admission); an engine's
        usage.prompt_tokens says how many there were: a moving average of the ratio keeps the estimate near the
        model's tokenizer without tokenizing anything."""
        if text_chars > 0 and prompt_tokens > 0:
            cpt = self.chars_per_token + 0.2 * (text_chars / prompt_tokens - self.chars_per_token)
            self.chars_per_token = min(16.0, max(0.5, cpt))

    # ---- admission ---------------------------------------------------------------------------------------------------
    def submit(self, job: Job, now: float) -> list[Job]:
        """A new attempt at `job`: admitted now (`job.flight` set) or queued. Returns the jobs this call decided
        (admitted, or `error` set), `job` among them if it was. Raises NoEndpointError when no healthy pod can
        serve it, QueueFull (counted) when it would have to wait and the queue is full."""
        job.attempts += 1
        job.queued_at = now
        job.flight = None
        job.error = None
        job.patience = None  # a new attempt decides afresh (it may exclude the pod it waited for)
        q = self.queue
        queued = q.waiting
        if not queued:  # requests wait while others wait: no overtaking the queue
            flight = self._choose(job, now, 0)
            if flight is not None:
                q.admitted += 1
                job.flight = flight
                return [job]
        if q.full:
            q.rejected += 1
            raise QueueFull(self.retry_after(now))
        q.push(job.session, job)
        if queued:
            # Others wait, maybe for endpoints that are full while this one's is not (a request waits for the engine
            # holding its prefix): give it its turn in the round now rather than at the next release.
            return self.pump(now)
        return []

    def pump(self, now: float) -> list[Job]:
        """Admit waiting requests, one per session in turn, while endpoints have room; returns those decided."""
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
        out = []
        q = self.queue
        # A pumped job is still counted in the queue while it is decided: the others are one fewer.
        for job, got in q.pump(lambda j: self._choose(j, now, q.waiting - 1), self._alive):
            if isinstance(got, Exception):
                job.error = got
            else:
                job.flight = got
            out.append(job)
        return out

    def withdraw(self, job: Job, now: float) -> list[Job]:
        """The request went away: out of the queue, or, if already admitted, its slots given back."""
        if job.flight is not None:
            return self.release(job.flight, now)
        self.queue.remove(job.session, job)
        return []

    def next_wakeup(self) -> float | None:
        """When to `pump` even if nothing frees before: a request waiting for its prefix holder stops waiting then."""
        return self._wake_at

    def retry_after(self, now: float) -> int:
        """Seconds until the queue has likely drained enough to take a request: its length over the recent rate."""
        return retry_after(self.queue.waiting, self._done.per_second(now))

    def stats(self) -> dict[str, int]:
        q = self.queue
        return {
            "waiting": q.waiting,
            "sessions_waiting": q.sessions,
            "inflight": self.ledger.total(),
            "admitted": q.admitted,
            "rejected": q.rejected,
        }

    def _ask_at(self, at: float) -> None:
        if self._wake_at is None or at < self._wake_at:
            self._wake_at = at

    # ---- the decision ------------------------------------------------------------------------------------------------
    def _routable(self) -> Fleet:
        """Every rank of every routable pod, in the order Snapshot keeps; rebuilt only when the pod set changes."""
        if self._endpoints_stale:
            slots = []
            for pod in self._pods.values():
                info = pod.info
                for r in range(info.dp_size):
                    ep = Endpoint(info.name, r, info.role, info.url, info.dp_size, info.host)  # type: ignore[arg-type]
                    slots.append((ep, pod.ranks[r]))
            slots.sort(key=lambda s: _snapshot_order(s[0]))
            self._fleet = Fleet(slots, self.ledger)
            self._endpoints_stale = False
        fleet = self._fleet
        assert fleet is not None
        return fleet

    def _columns(
        self, excluded: set[str], kv: KVKey = NO_KV, cached: dict[tuple[str, int], int] | np.ndarray | None = None
    ) -> RequestColumns:
        hashes, unit, _ = kv
        return self._routable().columns(excluded, hashes, unit, cached)

    def snapshot(
        self, excluded: set[str], kv: KVKey = NO_KV, cached: dict[tuple[str, int], int] | None = None, now: float = 0.0
    ) -> Snapshot:
        """Every routable endpoint's state; with `kv` (the request's InflightKV key), inflight_kv_tokens counts only
        the KV in flight there that this request does not share (its prefix held once, however many requests hold
        it), so kv_fits(state, request's whole need) is exact. `cached`: GPU blocks of the prefix each holder has
        cached (None: all of it): shared blocks count once only as far as the engine has them cached
        (InflightKV.shared_tokens). Kept as columns (fleet.RequestColumns); the states are built when read."""
        return Snapshot.of_columns(self._columns(excluded, kv, cached), now)

    def _choose(self, job: Job, now: float, others: int) -> Flight | None:
        """The scheduling decision, taken only when its target has room (else None: wait). `others`: requests
        waiting besides this one (how saturated the fleet is, for the scheduler's holder patience)."""
        req = job.req
        w = job.patience
        if w is not None:
            # A decision to wait for the holder stands until something changes there (a take or give, more room in
            # its gauges, its KV events: the request may fit, or the wait no longer pay) or the patience runs out
            # (as the scheduler weighs it, for as many others waiting as now). Re-deciding at every completion
            # anywhere was a scoring pass per waiting head per completion (an approximate-routed fleet under load:
            # 40 passes a request, nearly all of the simulator's time).
            until = job.queued_at + holder_patience_s(w.each_s, max(0, others))
            if now < until and w.stands(self.index, self._pods):
                self._ask_at(until + _WAKE_MARGIN_S)
                return None
            job.patience = None
        hashes = req.block_hashes or req.text_chunk_hashes
        if req.block_hashes:
            unit = req.block_size
        else:  # text chunks: the tokens a chunk of characters holds, as far as the router knows
            unit = max(1, round(self.scheduler.tuning.chunk_chars / self.chars_per_token))
        unit, extra = request_kv(hashes, req.num_tokens, req.max_tokens, unit, req.block_size)
        kv = (hashes, unit, extra)
        index: IndexReader = self.index
        cached: np.ndarray | None = None
        if unit and hashes:
            fleet = self._routable()
            if self._cached_from_index:
                # One index query for the KV-fit check and the scheduler's prefix hits (same hashes, same moment),
                # by holder id: each endpoint's GPU blocks are a gather, not a loop over the holders.
                got = self.index.query_columns(hashes)
                cached = got.blocks_gpu[fleet.holder_ids(self.index)]
                index = _QueriedIndex(self.index, hashes, got)
            else:
                cached = fleet.no_blocks
        cols = self._columns(job.excluded, kv, cached)
        serving = cols.routable("decode")  # every endpoint not in the prefill pool (the core's are all healthy)
        if job.excluded and not len(serving):
            # Every other pod failed this request too; a pod that is still healthy may serve it plainly (the retry
            # carries no KV-transfer parameters), which beats answering with its error.
            cols = self._columns(set(), kv, cached)
            serving = cols.routable("decode")
        if not len(serving):
            raise NoEndpointError("no healthy decode endpoint")
        need, bs = req.kv_tokens, req.block_size
        if not len(cols.room(serving, self.ledger.max_inflight, need, bs)[1]):
            return None  # every one full (slots or KV): wait without paying for a scoring pass
        snap = Snapshot.of_columns(cols, now)
        self.scheduler.advance(now)
        d = self.scheduler.schedule(req, snap, index, now, waited_s=now - job.queued_at, queued=max(0, others))
        target = self._pods.get(d.target.pod)
        if target is None:
            return None
        slot = cols.slot_of()
        assert slot is not None  # one endpoint per holder
        if not self.ledger.has_room(d.target.holder) or not kv_fits(cols.state(slot[d.target.holder]), need, bs):
            if d.wait_s > 0:  # waiting for the prefix holder: ask again when that stops paying, if nothing frees first
                self._ask_at(now + d.wait_s + _WAKE_MARGIN_S)
                holder = d.target.holder
                load = self.ledger.load(holder)
                epoch = self.index.epoch(holder) if self._cached_from_index else -1
                st = target.ranks[d.target.dp_rank]
                job.patience = HolderWait(
                    target, holder, load, load.version, st.kv_usage, st.running + st.waiting,
                    d.wait_each_s, epoch,
                )  # fmt: skip
            return None
        self.scheduler.observe_routed(req, d, now)
        uncached = max(0, req.num_tokens - d.expected_hit_tokens)
        ld = self.ledger.take(d.target.holder, uncached, kv)
        flight = Flight(d, target, d.target.dp_rank, uncached, ld, kv, routed_at=now)
        if d.pd is not None and not job.no_kv_transfer:
            pre = self._pods.get(d.pd.prefill.pod)
            if pre is not None:
                flight.prefill = pre
                flight.prefill_rank = d.pd.prefill.dp_rank
                # The prefill pod holds the prompt (and one token) until the decode pod pulls it.
                flight.prefill_kv = (hashes, unit, extra - req.max_tokens + 1)
                # Counted, not gated: a prefill hop is short and its pod's queue is what the decider weighed.
                flight.prefill_load = self.ledger.take(d.pd.prefill.holder, d.pd.uncached_tokens, flight.prefill_kv)
        return flight

    # ---- hops and their outcomes -------------------------------------------------------------------------------------
    def hop_plan(self, job: Job) -> HopPlan:
        """The hops before the serving pod: the P/D prefill hop, or the P2P pull (by hash, or through the holder as a
        prefill pod in two-hop mode); none on a retry, which drops whatever KV transfer the failed attempt set up."""
        flight = job.flight
        assert flight is not None
        if job.no_kv_transfer:
            return NO_HOPS
        d = flight.decision
        prompt = job.req.num_tokens
        if d.pd is not None and flight.prefill is not None:
            return HopPlan(flight.prefill, flight.prefill_rank, "pd", transfer_tokens=_beyond(prompt, d))
        src_ep = d.p2p_source
        if src_ep is None:
            return NO_HOPS
        src = self._pods.get(src_ep.pod)
        if src is None:
            return HopPlan(p2p_outcome="source_gone")
        if self.p2p_mode == "two-hop":
            return HopPlan(src, src_ep.dp_rank, "p2p", source=src.name, transfer_tokens=_beyond(prompt, d))
        eid = src.engine_id_of(src_ep.dp_rank)
        side = src.side_channel_of(src_ep.dp_rank)
        if eid is None or side is None:
            # Without the holder's engine id the pull would be refused; recomputing is the safe choice.
            return HopPlan(p2p_outcome="unknown_engine_id" if eid is None else "no_side_channel")
        tokens = d.gpu_hit_tokens + d.cpu_hit_tokens + d.p2p_tokens
        params = hops.p2p_params(eid, side[0], side[1], tokens)
        pulled = _beyond(min(tokens, prompt) if prompt > 0 else tokens, d)
        return HopPlan(kv_params=params, source=src.name, p2p_outcome="sent", transfer_tokens=pulled)

    def prefill_done(
        self, flight: Flight, plan: HopPlan, kv_params: dict[str, Any] | None, unreachable: bool, now: float
    ) -> Outcome:
        """The prefill hop ended: its slot is free; with `kv_params` the serving pod pulls the KV, without them (the
        hop failed) it computes the prompt itself, and a prefill pod that refused the connection leaves routing."""
        out = Outcome(self.release_prefill(flight, now))
        pre = plan.prefill
        assert pre is not None
        if kv_params is not None:
            self.learn(pre, plan.prefill_rank, kv_params)
        elif unreachable:
            self.pod_down(pre.name)
            out.down = pre.name
        return out

    def complete(self, flight: Flight, now: float) -> list[Job]:
        """The request ended (answered, or its stream broke after bytes reached the client): give back its slots."""
        return self.release(flight, now)

    def fail(self, job: Job, reason: str, pod_down: bool, now: float) -> Outcome:
        """An attempt failed before anything reached the client: give back its slots, take its pod out if it is gone
        (`pod_down`: the connection was refused or dropped), keep the request off that pod and off KV transfers, and
        retry unless it has had `max_attempts`."""
        flight = job.flight
        assert flight is not None
        out = Outcome(self.release(flight, now))
        pod = flight.target.name
        if pod_down:
            self.pod_down(pod)
            out.down = pod
        job.excluded.add(pod)
        job.no_kv_transfer = True
        if job.attempts >= self.max_attempts:
            out.error = f"engines failed {job.attempts} times: {reason}"
        else:
            out.retry = True
        return out

    def release(self, flight: Flight, now: float) -> list[Job]:
        if flight.released:
            return []
        flight.released = True
        self.scheduler.observe_computed(flight.decision.target.holder, flight.kv[0], flight.routed_at, now)
        out = self.release_prefill(flight, now)
        out += self._give(flight.load, flight.uncached, flight.kv, now)
        return out

    def release_prefill(self, flight: Flight, now: float) -> list[Job]:
        ld = flight.prefill_load
        if ld is None:
            return []
        flight.prefill = flight.prefill_load = None
        assert flight.decision.pd is not None
        self.scheduler.observe_computed(flight.decision.pd.prefill.holder, flight.prefill_kv[0], flight.routed_at, now)
        return self._give(ld, flight.decision.pd.uncached_tokens, flight.prefill_kv, now)

    def _give(self, ld: Load, tokens: int, kv: KVKey, now: float) -> list[Job]:
        self.ledger.give(ld, tokens, kv)
        self._done.tick(now)
        return self.pump(now) if self.queue.waiting else []


def _beyond(tokens: int, d: Decision) -> int:
    """Of the first `tokens` prompt tokens, those the decision's target does not hold in GPU KV."""
    return max(0, tokens - d.gpu_hit_tokens)


__all__ = ["NO_HOPS", "Flight", "HopPlan", "Job", "NoEndpointError", "Outcome", "QueueFull", "RouterCore"]
