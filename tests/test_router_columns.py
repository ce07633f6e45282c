"""The router's array paths against their references, on random inputs: every scorer's `score_columns` against its
list `score` (bit for bit), the array picker and P2P choice against the list ones, the core's incremental columns
(llmd/router/fleet.py) against the snapshot's definition after random ledger and gauge changes, and InflightKV's
C-speed counting against a plain per-unit count."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from llmd.discovery import PodInfo
from llmd.kv.index import KVIndex
from llmd.router.core import Job, RouterCore
from llmd.router.pods import Pod
from llmd.router.scheduling import Endpoint, EndpointState, RouteRequest, Scheduler, Snapshot, Tuning
from llmd.router.scheduling import chains as chains_mod
from llmd.router.scheduling.filters import kv_fits
from llmd.router.scheduling.kv_demand import InflightKV
from llmd.router.scheduling.pd import decide_p2p, decide_p2p_columns
from llmd.router.scheduling.picker import pick_max, pick_max_array
from llmd.router.scheduling.plugins import SCORERS, ScorerSetup, ScoringContext
from llmd.router.scheduling.speculative import SpeculativeIndex
from llmd.spec import RouterSpec


def _snapshot(rng: random.Random, n: int) -> Snapshot:
    pairs = []
    for i in range(n):
        ep = Endpoint(f"p{i // 4}", i % 4, rng.choice(("decode", "prefill", "both")), ranks=4)
        st = EndpointState(
            healthy=rng.random() < 0.9,
            waiting=rng.choice((0, 0, 1, 3, 20, 200)),
            running=rng.randrange(64),
            kv_usage=rng.choice((0.0, 1.0, 1.5, -0.1, rng.random())),
            inflight=rng.randrange(5),
            inflight_tokens=rng.choice((0, rng.randrange(1 << 23))),
            inflight_kv_tokens=rng.randrange(100_000),
            kv_capacity_blocks=rng.choice((0, 500, 2000)),
        )
        pairs.append((ep, st))
    return Snapshot.of(pairs)


@pytest.mark.parametrize("seed", range(40))
def test_every_scorer_scores_its_columns_as_its_list(seed: int) -> None:
    rng = random.Random(seed)
    snap = _snapshot(rng, rng.randrange(1, 40))
    index = KVIndex()
    chain = [rng.getrandbits(64) for _ in range(50)]
    for ep in snap.endpoints:
        if rng.random() < 0.6:
            index.store(ep.holder, chain[: rng.randrange(1, 51)], rng.choice(("GPU", "CPU")), None)
    setup = ScorerSetup(RouterSpec(), Tuning(), 1.0, 0.8)
    req = RouteRequest("r", chain, rng.randrange(1, 4000), 64, "s", text_chunk_hashes=chain[:20])
    cols = snap.columns
    idx = np.array(sorted(rng.sample(range(cols.n), rng.randrange(1, cols.n + 1))), dtype=np.intp)
    cands = [snap.candidates[i] for i in idx]
    for name, plugin in SCORERS.items():
        scorer = plugin.factory(setup)
        if name == "prefix":
            spec = SpeculativeIndex(2.0)
            spec.insert(snap.endpoints[0].holder, chain[:30], 0.0)
            scorer.speculative = spec  # type: ignore[attr-defined]
        if name == "no-hit-lru":
            # Stamps on some endpoints, some stamped again, then maybe a pod forgotten (its stamps gone, its ids
            # kept), stamped again after: the columns read them by the scorer's own holder ids.
            for ep in rng.choices(snap.endpoints, k=rng.randrange(0, 12)):
                scorer.record_cold(ep.holder)  # type: ignore[attr-defined]
            if rng.random() < 0.5:
                scorer.forget_pod(snap.endpoints[0].pod)  # type: ignore[attr-defined]
                if rng.random() < 0.5:
                    scorer.record_cold(snap.endpoints[-1].holder)  # type: ignore[attr-defined]
        for cold in (None, True, False):
            a = ScoringContext(req, 0.5, index, cold=cold)
            a.hits = SCORERS["prefix"].factory(setup).hits(a)  # type: ignore[attr-defined]
            b = ScoringContext(req, 0.5, index, cold=cold, columns=cols)
            b.hit_cols = SCORERS["prefix"].factory(setup).hit_columns(b)  # type: ignore[attr-defined]
            want = scorer.score(a, cands)
            got = scorer.score_columns(b, idx).tolist()  # type: ignore[attr-defined]
            assert [x.hex() for x in got] == [float(x).hex() for x in want], name


@pytest.mark.parametrize("seed", range(20))
def test_array_picker_and_p2p_choose_as_the_list_ones(seed: int) -> None:
    rng = random.Random(seed)
    snap = _snapshot(rng, rng.randrange(2, 30))
    cols = snap.columns
    totals = [rng.choice((0.5, 1.0, 0.25, rng.random())) for _ in range(cols.n)]
    r1, r2 = random.Random(seed), random.Random(seed)
    assert pick_max(totals, r1) == pick_max_array(np.array(totals), r2)
    assert r1.random() == r2.random()  # the same draws
    idx = np.arange(cols.n)
    tokens = [rng.randrange(0, 3000) for _ in range(cols.n)]
    holder = rng.randrange(cols.n)
    target = rng.randrange(cols.n)
    kw = dict(min_tokens=16, max_inflight=3, max_waiting=16, load_ratio=0.5)
    want = decide_p2p(target, list(snap.candidates), totals, tokens, snap.candidates[holder], 3000, **kw)
    got = decide_p2p_columns(target, cols, idx, np.array(totals), np.array(tokens), holder, 3000, **kw)
    assert want == got
    need = rng.randrange(0, 200_000)
    assert cols.kv_fits(idx, need, 64).tolist() == [kv_fits(c.state, need, 64) for c in snap.candidates]


def _core(rng: random.Random) -> tuple[RouterCore, list[Pod]]:
    sched = Scheduler(RouterSpec(max_inflight_per_pod=4), 0)
    core = RouterCore(sched, KVIndex(), max_inflight=4, queue_limit=1000)
    pods = []
    for role, n, dp in (("prefill", 2, 4), ("decode", 3, 8)):
        for k in range(n):
            pod = Pod(PodInfo(f"{role}-{k}", role, f"http://{role}-{k}:8000", dp), healthy=True)
            for st in pod.ranks:
                st.kv_capacity_blocks = rng.choice((0, 60, 400))
            pods.append(pod)
            core.pod_up(pod)
    return core, pods


def _naive(core: RouterCore, excluded: set[str], hashes: list[int], unit: int, cached: dict) -> dict:
    out = {}
    for name in sorted(core._pods):
        if name in excluded:
            continue
        for r, st in enumerate(core._pods[name].ranks):
            ld = core.ledger.load((name, r))
            upto = cached.get((name, r), 0)
            shared = ld.kv.shared_tokens(hashes[:upto], unit) if unit and upto else 0
            out[(name, r)] = EndpointState(True, st.waiting, st.running, st.kv_usage, ld.inflight,
                                           ld.inflight_tokens, ld.kv.tokens - shared, st.kv_capacity_blocks,
                                           st.cpu_capacity_blocks)  # fmt: skip
    return out


@pytest.mark.parametrize("seed", range(6))
def test_incremental_columns_are_the_snapshot_definition(seed: int) -> None:
    rng = random.Random(seed)
    core, pods = _core(rng)
    system = [rng.getrandbits(64) for _ in range(8)]
    chains: list[list[int]] = []
    flights = []
    for step in range(300):
        r = rng.random()
        if r < 0.15 and flights:
            core.complete(flights.pop(rng.randrange(len(flights))), float(step))
        elif r < 0.25:
            for st in rng.choice(pods).ranks:
                st.waiting, st.running, st.kv_usage = rng.randrange(30), rng.randrange(64), rng.random()
                st.cpu_capacity_blocks = rng.choice((0, 900))
        elif r < 0.28:
            pod = rng.choice(pods)
            core.pod_down(pod.name)
            core.pod_up(pod)
        else:
            chain = (rng.choice(chains)[: rng.randrange(1, 30)] if chains and rng.random() < 0.5 else system) + [
                rng.getrandbits(64) for _ in range(rng.randrange(1, 20))
            ]
            chains.append(chain)
            req = RouteRequest(f"q{step}", chain, len(chain) * 16 + 5, 16, f"s{step % 7}", max_tokens=100)
            for holder, got in core.index.holders_of(chain[0]).items():
                del got
                core.index.store(holder, chain[: rng.randrange(1, len(chain) + 1)])
            excluded = set(rng.sample([p.name for p in pods], 1)) if rng.random() < 0.2 else set()
            cached = {m.holder: m.blocks_gpu for m in core.index.query(chain)}
            snap = core.snapshot(excluded, (chain, 16, 0), cached, float(step))
            want = _naive(core, excluded, chain, 16, cached)
            assert {ep.holder: st for ep, st in snap.states.items()} == want
            cols = snap.columns
            need = rng.randrange(0, 3000)
            assert cols.kv_fits(np.arange(cols.n), need, 16).tolist() == [
                kv_fits(want[ep.holder], need, 16) for ep in cols.endpoints
            ]
            # The capacity filters' one pass (fused.room, and what the request shares worked out where it decides).
            mx = rng.choice([None, 0, 1, 2, 64])
            idx = np.array(sorted(rng.sample(range(cols.n), rng.randrange(0, cols.n + 1))), dtype=np.intp)
            slots, fit = cols.room(idx, mx, need, 16)
            states = [want[cols.endpoints[i].holder] for i in idx.tolist()]
            want_slots = [i for i, st in zip(idx.tolist(), states, strict=True) if mx is None or st.inflight < mx]
            assert slots.tolist() == want_slots
            assert fit.tolist() == [i for i in want_slots if kv_fits(want[cols.endpoints[i].holder], need, 16)]
            job = Job(req, req.session_id or "")
            for j in core.submit(job, float(step)):
                if j.flight is not None:
                    flights.append(j.flight)
                    core.index.store(j.flight.decision.target.holder, chain)


class _PerUnit:
    """The meaning of InflightKV: a count per unit, each unit's tokens those it was first added with."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()
        self.tokens_of: dict[int, int] = {}
        self.shared = self.extra = 0

    def apply(self, op: str, hashes: list[int], unit: int, ex: int) -> None:
        for h in hashes:
            if op == "add":
                if h not in self.refs:
                    self.shared += unit
                    self.tokens_of[h] = unit
                self.refs[h] += 1
            elif h in self.refs:
                self.refs[h] -= 1
                if not self.refs[h]:
                    del self.refs[h]
                    self.shared = max(0, self.shared - self.tokens_of.pop(h))
        self.extra = self.extra + ex if op == "add" else max(0, self.extra - ex)

    @property
    def tokens(self) -> int:
        return self.shared + self.extra


def _chain(rng: random.Random, chains: list[list[int]]) -> list[int]:
    """A chain as a router's requests make them: a prefix of one seen before (a session's earlier turn, a shared
    system prompt, a fork's parent, all of it, or nothing) and new units after it; sometimes the very same list."""
    if chains and rng.random() < 0.15:
        return rng.choice(chains)
    base = rng.choice(chains) if chains and rng.random() < 0.8 else []
    return base[: rng.randrange(0, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))]


@pytest.mark.parametrize("short", [256, 8, 0])
@pytest.mark.parametrize("seed", range(30))
def test_inflight_kv_counts_as_a_plain_per_unit_count(seed: int, short: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # `short`: chains below it are counted per unit, the rest searched one by one (all, some, none of them).
    monkeypatch.setattr(chains_mod, "SHORT_UNITS", short)
    rng = random.Random(seed)
    kv = InflightKV()
    chains: list[list[int]] = []
    live: list[tuple[list[int], int, int]] = []
    ref = _PerUnit()
    # Odd seeds: block hashes (one unit size); even: chunks whose unit changes mid-way (the per-unit count from then).
    units = (16,) if seed % 2 else (16, 16, 16, 9)
    for _ in range(300):
        if live and rng.random() < 0.45:
            args = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                args = (list(args[0]), *args[1:])  # an equal chain, not the one added
            kv.remove(*args)
            ref.apply("remove", *args)
        else:
            hashes = _chain(rng, chains)
            chains.append(hashes)
            args = (hashes, rng.choice(units), rng.randrange(0, 100))
            kv.add(*args)
            live.append(args)
            ref.apply("add", *args)
        assert kv.tokens == ref.tokens
        held = ref.refs
        probe = _chain(rng, chains)
        want = next((i for i, h in enumerate(probe) if h not in held), len(probe))
        upto = rng.randrange(0, len(probe) + 1)
        assert kv.held_prefix(probe) == want
        assert kv.held_prefix(probe, 0, upto) == min(want, upto)
        assert kv.shared_tokens(probe, 16, upto) == min(want, upto) * 16
        if want:
            start = rng.randrange(0, want + 1)
            assert kv.held_prefix(probe, start) == want
