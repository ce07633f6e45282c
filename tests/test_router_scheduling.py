"""The router's scheduling pipeline: filters, each scorer alone, picker, policies, speculative entries, the approximate
LRU, P/D and P2P decisions, and determinism. Pure and fast: KV index states and snapshots are built by hand."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.kv.index import KVIndex
from llmd.router.scheduling import (
    Decision,
    Endpoint,
    EndpointState,
    NoEndpointError,
    RouteRequest,
    Scheduler,
    Snapshot,
    Tuning,
    filters,
    text_chunk_hashes,
)
from llmd.router.scheduling import chains as chains_mod
from llmd.router.scheduling.approximate import ApproxPrefixCache
from llmd.router.scheduling.chains import common_prefix
from llmd.router.scheduling.load import KVUtilScorer, LoadAwareScorer, QueueScorer, TokenLoadScorer
from llmd.router.scheduling.no_hit_lru import NoHitLRUScorer
from llmd.router.scheduling.pd import (
    ConstantRateModel,
    PDInputs,
    decide_queue_aware,
    decide_threshold,
    estimate_disagg_s,
    estimate_local_s,
)
from llmd.router.scheduling.picker import pick_max, weighted_totals
from llmd.router.scheduling.plugins import (
    ScorerPlugin,
    ScoringContext,
    register_scorer,
    scorer_names,
    unregister_scorer,
)
from llmd.router.scheduling.prefix import ApproximatePrefixScorer, PrecisePrefixScorer
from llmd.router.scheduling.speculative import SpeculativeIndex
from llmd.router.scheduling.state import Candidate
from llmd.spec.model import RouterSpec

BS = 64


def ep(pod: str, role: str = "both", rank: int = 0) -> Endpoint:
    return Endpoint(pod, rank, role, f"http://{pod}:8000")  # type: ignore[arg-type]


def snap(states: dict[Endpoint, EndpointState]) -> Snapshot:
    return Snapshot(states)


def blocks(n: int, tag: int) -> list[int]:
    """n distinct fake block hashes; `tag` keeps families apart."""
    return [(tag << 32) | i for i in range(n)]


def request(hashes: list[int], rid: str = "r", **kw) -> RouteRequest:
    kw.setdefault("num_tokens", len(hashes) * BS)
    return RouteRequest(rid, hashes, block_size=BS, **kw)


def cands(*pairs: tuple[Endpoint, EndpointState]) -> list[Candidate]:
    return [Candidate(e, s) for e, s in pairs]


def spec(**kw) -> RouterSpec:
    return RouterSpec(**kw)


IDLE = EndpointState()
A, B, C, D = ep("a"), ep("b"), ep("c"), ep("d")


# --- state and filters ----------------------------------------------------------------------------------------------


def test_snapshot_is_sorted_and_immutable() -> None:
    s = snap({B: IDLE, A: EndpointState(waiting=3)})
    assert s.endpoints == (A, B)
    assert s.state(A).waiting == 3
    with pytest.raises(TypeError):
        s.states[C] = IDLE  # type: ignore[index]
    assert A.holder == ("a", 0)
    assert Endpoint("p", 1, ranks=2).name == "p/1"
    assert Snapshot.of([(A, IDLE)]).endpoints == (A,)


def test_filters() -> None:
    p, d, b = ep("p", "prefill"), ep("d", "decode"), ep("b", "both")
    sick = EndpointState(healthy=False)
    cs = cands((p, IDLE), (d, sick), (b, IDLE))
    assert [c.endpoint for c in filters.healthy(cs)] == [p, b]
    assert [c.endpoint for c in filters.role(cs, "decode")] == [d, b]
    assert [c.endpoint for c in filters.role(cs, "prefill")] == [p]
    assert [c.endpoint for c in filters.routable(cs, "decode")] == [b]
    full, free = EndpointState(inflight=4), EndpointState(inflight=3)
    assert [c.endpoint for c in filters.has_capacity(cands((A, full), (B, free)), 4)] == [B]
    # all full: keep them all, admission control queues
    assert [c.endpoint for c in filters.has_capacity(cands((A, full), (B, full)), 4)] == [A, B]
    assert filters.has_capacity([], 4) == []


# --- scorers alone --------------------------------------------------------------------------------------------------


def ctx(req: RouteRequest | None = None, index: KVIndex | None = None, now: float = 0.0, **kw) -> ScoringContext:
    return ScoringContext(req or request([]), now, index, **kw)


def test_queue_scorer() -> None:
    q = QueueScorer()
    assert q.score(ctx(), []) == []
    cs = cands((A, EndpointState(waiting=0)), (B, EndpointState(waiting=5)), (C, EndpointState(waiting=10)))
    assert q.score(ctx(), cs) == [1.0, 0.5, 0.0]
    same = cands((A, EndpointState(waiting=7)), (B, EndpointState(waiting=7)))
    assert q.score(ctx(), same) == [1.0, 1.0]


def test_kv_util_scorer() -> None:
    k = KVUtilScorer()
    cs = cands((A, EndpointState(kv_usage=0.25)), (B, EndpointState(kv_usage=1.3)), (C, EndpointState(kv_usage=-1)))
    assert k.score(ctx(), cs) == [0.75, 0.0, 1.0]
    assert k.score(ctx(), []) == []


def test_load_aware_scorer() -> None:
    s = LoadAwareScorer()
    qs = [0, 64, 128, 500]
    cs = cands(*[(ep(f"e{q}"), EndpointState(waiting=q)) for q in qs])
    assert s.score(ctx(), cs) == [0.5, 0.25, 0.0, 0.0]
    with pytest.raises(ValueError):
        LoadAwareScorer(0)


def test_token_load_scorer() -> None:
    s = TokenLoadScorer()
    cs = cands(*[(ep(f"e{t}"), EndpointState(inflight_tokens=t)) for t in (0, 2 * 2**20, 8 * 2**20)])
    assert s.score(ctx(), cs) == [1.0, 0.5, 0.0]


def test_no_hit_lru_scorer() -> None:
    s = NoHitLRUScorer()
    cs = cands((A, IDLE), (B, IDLE), (C, IDLE))
    assert s.score(ctx(cold=True), cs) == [1.0, 1.0, 1.0]
    s.record_cold(A.holder)
    s.record_cold(B.holder)
    got = s.score(ctx(cold=True), cs)
    assert got[2] == 1.0 and got[0] > got[1] > 0  # never used, then least recently used
    assert all(0 <= x <= 1 for x in got)
    assert s.score(ctx(cold=False), cs) == [0.5, 0.5, 0.5]  # warm: neutral
    s.forget_pod("a")
    assert s.score(ctx(cold=True), cs)[0] == 1.0


def test_precise_prefix_scorer_tiers() -> None:
    ix = KVIndex()
    h = blocks(10, 1)
    ix.store(A.holder, h[:4])  # A: 4 GPU blocks
    ix.store(B.holder, h[:2])  # B: 2 GPU then 4 CPU-only blocks
    ix.store(B.holder, h[2:6], "CPU", parent=h[1])
    ix.store(C.holder, h[:5], "CPU")  # C: 5 CPU blocks
    s = PrecisePrefixScorer(None, 1.0, 0.8)
    c = ctx(request(h), ix)
    got = s.score(c, cands((A, IDLE), (B, IDLE), (C, IDLE), (D, IDLE)))
    assert got == pytest.approx([0.4, (2 + 4 * 0.8) / 10, 5 * 0.8 / 10, 0.0])
    hits = s.hits(c).by_holder
    assert hits[B.holder].gpu == 2 and hits[B.holder].cpu == 4
    assert hits[B.holder].gpu_tokens == 128 and hits[B.holder].cpu_tokens == 256
    # no index, no hashes: all zero
    assert s.score(ctx(request(h)), cands((A, IDLE))) == [0.0]
    assert s.score(ctx(request([]), ix), cands((A, IDLE))) == [0.0]
    assert s.score(ctx(request(h), ix), []) == []


def test_precise_prefix_scorer_tier_weights_above_one_stay_in_bounds() -> None:
    ix = KVIndex()
    h = blocks(4, 1)
    ix.store(A.holder, h)
    got = PrecisePrefixScorer(None, 3.0, 0.8).score(ctx(request(h), ix), cands((A, IDLE)))
    assert got == [1.0]


def test_precise_prefix_scorer_counts_speculative_as_gpu() -> None:
    ix = KVIndex()
    h = blocks(10, 1)
    ix.store(A.holder, h[:3], "CPU")
    sp = SpeculativeIndex(2.0)
    sp.insert(A.holder, h[:6], now=0.0)
    sp.insert(B.holder, h[:8], now=0.0)
    s = PrecisePrefixScorer(sp, 1.0, 0.8)
    hits = s.hits(ctx(request(h), ix, now=1.0)).by_holder
    assert (hits[A.holder].gpu, hits[A.holder].cpu) == (6, 0)
    assert (hits[B.holder].gpu, hits[B.holder].cpu) == (8, 0)
    later = s.hits(ctx(request(h), ix, now=2.5)).by_holder  # expired: only the real CPU blocks are left
    assert (later[A.holder].gpu, later[A.holder].cpu) == (0, 3) and B.holder not in later
    # real GPU 4 + CPU 4 (8 held): a speculative prefix of 6 lifts the GPU share; one of 3 adds nothing
    ix2 = KVIndex()
    ix2.store(C.holder, h[:4])
    ix2.store(C.holder, h[4:8], "CPU", parent=h[3])
    sp2 = SpeculativeIndex(2.0)
    sp2.insert(C.holder, h[:6], now=0.0)
    sp2.insert(D.holder, h[:3], now=0.0)
    ix2.store(D.holder, h[:5])
    got = PrecisePrefixScorer(sp2).hits(ctx(request(h), ix2, now=0.0)).by_holder
    assert (got[C.holder].gpu, got[C.holder].cpu) == (6, 2)
    assert (got[D.holder].gpu, got[D.holder].cpu) == (5, 0)


def test_approximate_prefix_scorer_alone() -> None:
    cache = ApproxPrefixCache()
    text = "x" * 256 * 3 + "y" * 256 * 7
    chain = text_chunk_hashes(text)
    cache.record(A.holder, chain[:5], 100, 0, BS)
    s = ApproximatePrefixScorer(cache)
    got = s.score(ctx(RouteRequest("r", text_chunk_hashes=chain, num_tokens=640)), cands((A, IDLE), (B, IDLE)))
    assert got == pytest.approx([0.5, 0.0])
    assert s.score(ctx(RouteRequest("r")), cands((A, IDLE))) == [0.0]


# --- text chunk hashes and the approximate LRU ----------------------------------------------------------------------


def test_text_chunk_hashes() -> None:
    t = "".join(chr(0x41 + i % 50) for i in range(1000))
    h = text_chunk_hashes(t, 100)
    assert len(h) == 10 and h == text_chunk_hashes(t, 100)
    assert text_chunk_hashes(t + "tail", 100)[:10] == h  # growth keeps earlier chunks
    assert text_chunk_hashes(t[:999], 100) == h[:9]  # partial chunk left out
    other = text_chunk_hashes("Z" + t[1:], 100)
    assert all(a != b for a, b in zip(h, other, strict=True))  # chained: one early change changes every later hash
    assert text_chunk_hashes("") == []
    assert all(0 <= x < 2**64 for x in h)
    with pytest.raises(ValueError):
        text_chunk_hashes(t, 0)


def test_approximate_cache_lru_eviction_keeps_prefixes() -> None:
    cache = ApproxPrefixCache(chunk_chars=256, chars_per_token=4.0)  # 1 chunk per 64-token block
    a, b = blocks(10, 1), blocks(5, 2)
    cache.record(A.holder, a, 12, 0, BS)
    assert cache.match(A.holder, a) == (10, 10)
    cache.record(A.holder, b, 12, 0, BS)  # 15 chunks in 12 slots: a's 3 tail chunks go first
    assert cache.size(A.holder) == (12, 0)
    assert cache.match(A.holder, a) == (7, 7)
    assert cache.match(A.holder, b) == (5, 5)
    cache.record(A.holder, blocks(12, 3), 12, 0, BS)
    assert cache.match(A.holder, a) == (0, 0)
    assert cache.match(B.holder, a) == (0, 0)
    assert cache.matches([]) == {}


def test_approximate_cache_cpu_tier_extends_memory() -> None:
    a, b = blocks(10, 1), blocks(10, 2)
    ours = ApproxPrefixCache()
    llmd_bug = ApproxPrefixCache(cpu_tier=False)
    for cache in (ours, llmd_bug):
        cache.record(A.holder, a, 10, 20, BS)
        cache.record(A.holder, b, 10, 20, BS)
    assert ours.match(A.holder, b) == (10, 10)
    assert ours.match(A.holder, a) == (10, 0)  # offloaded to the CPU part, still remembered
    assert llmd_bug.match(A.holder, a) == (0, 0)  # GPU-sized LRU forgot it
    # routed again: back to GPU, and b moves to CPU
    ours.record(A.holder, a, 10, 20, BS)
    assert ours.match(A.holder, a) == (10, 10) and ours.match(A.holder, b) == (10, 0)
    # the CPU-part hit is weighted by the CPU tier weight
    s = ApproximatePrefixScorer(ours, 1.0, 0.8)
    r = RouteRequest("r", text_chunk_hashes=b, num_tokens=640)
    assert s.score(ctx(r), cands((A, IDLE))) == pytest.approx([0.8])
    hit = s.hits(ctx(r)).by_holder[A.holder]
    assert (hit.gpu_tokens, hit.cpu_tokens) == (0, 640)
    ours.forget_pod("a")
    assert ours.match(A.holder, a) == (0, 0)


def test_approximate_cache_gpu_then_cpu_prefix() -> None:
    cache = ApproxPrefixCache()
    a = blocks(10, 1)
    cache.record(A.holder, a, 4, 100, BS)  # head in GPU, the rest spilled to CPU
    assert cache.match(A.holder, a) == (10, 4)
    cache.record(A.holder, a, 4, 3, BS)  # shrink: only 7 remembered now
    assert cache.match(A.holder, a) == (7, 4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_approximate_matches_equal_each_holders_own_match(seed: int) -> None:
    """`matches` tries each holder at the previous holder's answer before searching: whatever was routed, spilled
    to CPU, dropped, resized or forgotten, it must give exactly what each holder's own search gives, and a search
    from any hint what one from none gives."""
    rng = random.Random(seed)
    cache = ApproxPrefixCache(chunk_chars=256, chars_per_token=4.0)  # 1 chunk per block
    system = blocks(rng.randint(1, 6), 1)
    sessions = [system + blocks(rng.randint(0, 12), 100 + k) for k in range(6)]
    holders = [ep(f"p{i}", rank=rank).holder for i in range(5) for rank in range(2)]
    for _ in range(rng.randint(1, 40)):
        op = rng.random()
        h = rng.choice(holders)
        if op < 0.75:
            k = rng.randrange(len(sessions))
            chain = sessions[k]
            # A turn's growth: chunks of this session's own (chained hashes name the whole text before them).
            growth = blocks(rng.randint(0, 4), 1000 + 10 * k + rng.randint(0, 2)) if rng.random() < 0.3 else []
            grown = chain + growth
            cache.record(h, grown[: rng.randint(1, len(grown))], rng.randint(1, 20), rng.choice((0, 0, 5, 30)), BS)
        elif op < 0.9:
            cache.forget_pod(h[0])
        for chain in [*sessions, blocks(3, 7), system[:1]]:
            want = {x: cache.match(x, chain) for x in holders if cache.match(x, chain)[0] > 0}
            assert cache.matches(chain) == want
            for x, got in want.items():
                lru = cache._lrus[x]
                for hint in ((0, 0), got, (got[0] + 1, got[1]), (got[0], max(0, got[1] - 1)), (len(chain), 1)):
                    assert lru.match(chain, hint) == got, hint


# --- speculative index ----------------------------------------------------------------------------------------------


def test_speculative_index_match_expire_prune_bound() -> None:
    sp = SpeculativeIndex(ttl_s=2.0, max_blocks=100)
    h = blocks(50, 1)
    sp.insert(A.holder, h[:20], now=0.0)
    sp.insert(A.holder, h[:30], now=1.0)  # refreshes the first 20
    assert sp.match(h, now=1.5) == {A.holder: 30}
    assert sp.match(h, now=2.5) == {A.holder: 30}
    assert sp.match(h, now=3.0) == {}  # every entry expired at 3.0
    sp.prune(2.5)
    assert len(sp) == 30
    sp.prune(3.0)
    assert len(sp) == 0
    sp.insert(B.holder, h, now=10.0)
    sp.insert(C.holder, h, now=10.0)
    sp.insert(D.holder, blocks(50, 2), now=10.0)  # 150 > 100: the oldest insert goes
    assert set(sp.match(h, now=10.5)) == {C.holder}
    assert len(sp) <= 100
    sp.forget_pod("c")
    assert sp.match(h, now=10.5) == {}
    off = SpeculativeIndex(ttl_s=0.0)
    off.insert(A.holder, h, now=0.0)
    assert off.match(h, now=0.0) == {}


def test_speculative_settle_ends_an_entry_soon_unless_a_later_insert_refreshed_it() -> None:
    sp = SpeculativeIndex(ttl_s=2.0, settle_s=0.1)
    h = blocks(50, 1)
    sp.insert(A.holder, h[:40], now=0.0)
    sp.insert(A.holder, h[:10], now=0.5)  # a burst sibling on its way: shares the first 10 blocks
    sp.settle(A.holder, h[:40], routed_at=0.0, now=1.0)  # the first request was computed
    assert sp.match(h, now=1.05) == {A.holder: 40}  # its KV events are on their way
    assert sp.match(h, now=1.2) == {A.holder: 10}  # the sibling's part stays until it is computed or expires
    sp.settle(A.holder, h[:40], routed_at=0.0, now=1.0)  # again, or for a request never inserted: nothing changes
    sp.settle(B.holder, h, routed_at=0.0, now=1.0)
    assert sp.match(h, now=2.4) == {A.holder: 10}
    assert sp.match(h, now=2.5) == {}
    sp.prune(3.0)
    assert len(sp) == 0 and not sp._settled


def test_a_computed_prefix_the_engine_evicted_stops_counting() -> None:
    """Speculative entries bridge the time until the engine's KV events arrive, no longer: once the routed request is
    computed, the index's eviction events are what counts (before, an entry outlived an eviction by up to its TTL and
    sent the session's next turn back to recompute its prefix where it no longer was)."""
    s = Scheduler(spec(speculative_ttl_s=2.0), seed=0)
    prefix = blocks(50, 7)
    turn = request(prefix, "turn")
    first = s.schedule(turn, snap(FOUR), KVIndex(), now=0.0)
    s.observe_routed(turn, first, 0.0)
    ix = KVIndex()
    ix.store(first.target.holder, prefix)  # computed: the engine said so...
    ix.remove(first.target.holder, prefix[10:])  # ...and evicted most of it again under KV pressure
    r = request([*prefix, 99], "next-turn")
    assert s.schedule(r, snap(FOUR), ix, now=0.5).gpu_hit_tokens == 50 * BS  # the entry still overrides the index
    s.observe_computed(first.target.holder, turn.block_hashes, routed_at=0.0, now=0.5)
    assert s.schedule(r, snap(FOUR), ix, now=0.55).gpu_hit_tokens == 50 * BS  # its events may still be on their way
    assert s.schedule(r, snap(FOUR), ix, now=0.7).gpu_hit_tokens == 10 * BS  # the index alone: what is really there


def test_speculative_partial_prefix_binary_search() -> None:
    sp = SpeculativeIndex(2.0)
    h = blocks(100, 1)
    for k in (1, 2, 37, 99, 100):
        sp.insert((f"p{k}", 0), h[:k], now=0.0)
    assert sp.match(h, now=0.0) == {(f"p{k}", 0): k for k in (1, 2, 37, 99, 100)}


def _match_by_ids(sp: SpeculativeIndex, h: list[int], now: float, floor: dict) -> dict:
    got = sp.match_ids(h, now)
    holders = sorted(sp._by_holder)
    ids = sp.holder_ids(holders)
    return {k: v for k, v in zip(holders, got[ids].tolist(), strict=True) if v > floor.get(k, 0)}


def _next_chain(rng: random.Random, chains: list[list[int]]) -> list[int]:
    """A new request's chain: a prefix of an earlier one (a session's turn, a fork, the system prompt), new blocks."""
    base = rng.choice(chains)
    chain = base[: rng.randrange(1, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))]
    chains.append(chain)
    return chain


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([60, 400, 1_000_000]))
def test_speculative_match_ids_is_match(seed, max_blocks) -> None:
    """match_ids (every holder in one walk of the mirror index) answers as match (holder by holder), through
    inserts, expiry, pruning, the block bound and forgotten pods."""
    rng = random.Random(seed)
    sp = SpeculativeIndex(ttl_s=2.0, max_blocks=max_blocks)
    holders = [(f"p{k}", r) for k in range(4) for r in range(3)]
    system = [rng.getrandbits(64) for _ in range(5)]
    chains = [system]
    now = 0.0
    for _ in range(60):
        now += rng.choice((0.0, 0.1, 0.5, 1.5))
        r = rng.random()
        if r < 0.5:
            chain = _next_chain(rng, chains)
            for holder in rng.sample(holders, rng.choice((1, 1, 2))):
                sp.insert(holder, chain, now)
        elif r < 0.53 and chains:
            # A request computed where it went: its entries settle (a later insert's refreshed prefix keeps its own).
            sp.settle(rng.choice(holders), rng.choice(chains), now - rng.choice((0.0, 0.5, 1.5)), now)
        elif r < 0.55:
            sp.forget_pod(rng.choice(holders)[0])
        elif r < 0.6:
            sp.prune(now)
        req = rng.choice(chains)
        req = req[: rng.randrange(1, len(req) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 3))]
        at = now + rng.choice((0.0, 0.05, 1.0, 2.5))  # a match before the next insert: some entries expired unpruned
        floor = {h: rng.randrange(0, 8) for h in rng.sample(holders, 4)}
        assert _match_by_ids(sp, req, at, floor) == sp.match(req, at, floor)
        assert _match_by_ids(sp, req, at, {}) == sp.match(req, at)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_common_prefix_of_two_chains_from_any_hint(seed) -> None:
    rng = random.Random(seed)
    base = [rng.getrandbits(64) for _ in range(rng.randrange(0, 40))]
    a = base[: rng.randrange(0, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]
    b = base[: rng.randrange(0, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]
    n = rng.randrange(0, min(len(a), len(b)) + 1)
    want = next((i for i in range(n) if a[i] != b[i]), n)
    for hint in (0, want, rng.randrange(0, n + 2)):
        assert common_prefix(a, b, n, hint) == want


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([256, 8, 0]))
def test_chain_set_is_a_multiset_of_chains(seed, short) -> None:
    """Adds and removes of chains sharing prefixes (turns, forks, the system prompt, the same chain twice): the unit
    counts and every longest-held prefix as a plain list of the chains says; removing one never added is refused."""
    rng = random.Random(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chains_mod, "SHORT_UNITS", short)
        cs, held = chains_mod.ChainSet(), []
        chains = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 6))]]
        for _ in range(60):
            if held and rng.random() < 0.4:
                c = held.pop(rng.randrange(len(held)))
                assert cs.remove(tuple(c) if rng.random() < 0.5 else c)
            else:
                c = rng.choice(chains) if rng.random() < 0.2 else _next_chain(rng, chains)
                cs.add(c)
                held.append(c)
            want: dict[int, int] = {}
            for c in held:
                for u in c:
                    want[u] = want.get(u, 0) + 1
            assert cs.unit_counts() == want and bool(cs) == bool(held)
            q = _next_chain(rng, list(chains))
            assert cs.longest(q) == max((common_prefix(q, c, min(len(q), len(c))) for c in held), default=0)
        assert not cs.remove([rng.getrandbits(64)])


class _NaiveSpeculative:
    """What SpeculativeIndex means, block by block: a holder holds a block while an alive record of a request sent
    there has it in its chain and has not expired; records leave when they expire (as pruned), when the bound drops
    the oldest, or with their pod; settling brings one record's expiry forward."""

    def __init__(self, ttl_s: float, max_blocks: int, settle_s: float) -> None:
        self.ttl_s, self.max_blocks, self.settle_s = ttl_s, max_blocks, settle_s
        self.records: list[dict] = []  # in insert order
        self.open: dict[tuple, dict] = {}

    def alive(self) -> list[dict]:
        return [r for r in self.records if r["alive"]]

    def prune(self, now: float) -> None:
        for r in self.alive():
            if r["exp"] <= now:
                r["alive"] = False

    def insert(self, holder, chain: list[int], now: float) -> None:
        self.prune(now)
        r = {"holder": holder, "chain": tuple(chain), "exp": now + self.ttl_s, "alive": True}
        self.records.append(r)
        self.open[(holder, now, len(chain), chain[-1])] = r
        while sum(len(x["chain"]) for x in self.alive()) > self.max_blocks and len(self.alive()) > 1:
            self.alive()[0]["alive"] = False

    def settle(self, holder, chain: list[int], routed_at: float, now: float) -> None:
        r = self.open.pop((holder, routed_at, len(chain), chain[-1]), None)
        if r is not None and r["alive"]:
            r["exp"] = min(r["exp"], now + self.settle_s)

    def forget_pod(self, pod: str) -> None:
        for r in self.alive():
            if r["holder"][0] == pod:
                r["alive"] = False

    def match(self, req: list[int], now: float, floor: dict) -> dict:
        out: dict = {}
        for r in self.alive():
            if r["exp"] > now:
                n = 0
                while n < min(len(req), len(r["chain"])) and req[n] == r["chain"][n]:
                    n += 1
                out[r["holder"]] = max(out.get(r["holder"], 0), n)
        return {h: n for h, n in out.items() if n > floor.get(h, 0)}

    def entries(self) -> int:
        held: set = set()
        for r in self.alive():
            held.update((r["holder"], b) for b in r["chain"])
        return len(held)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([60, 400, 1_000_000]), st.sampled_from([256, 8, 0]))
def test_speculative_index_is_its_block_by_block_meaning(seed, max_blocks, short) -> None:
    """Inserts, settles, expiry, pruning, the block bound and forgotten pods: match and len as the naive model says,
    for chains that share prefixes as sessions, bursts and the system prompt make them (`short`: chains below it
    counted per unit, the rest searched one by one)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chains_mod, "SHORT_UNITS", short)
        _speculative_against_naive(random.Random(seed), max_blocks)


def _speculative_against_naive(rng: random.Random, max_blocks: int) -> None:
    sp = SpeculativeIndex(ttl_s=2.0, max_blocks=max_blocks, settle_s=0.1)
    ref = _NaiveSpeculative(2.0, max_blocks, 0.1)
    holders = [(f"p{k}", r) for k in range(3) for r in range(2)]
    system = [rng.getrandbits(64) for _ in range(5)]
    chains = [system]
    sent: list[tuple] = []  # (holder, chain, routed_at) of inserts, for settles
    now = 0.0
    for _ in range(80):
        now += rng.choice((0.0, 0.05, 0.1, 0.5, 1.5))
        r = rng.random()
        if r < 0.5:
            chain = _next_chain(rng, chains)
            for holder in rng.sample(holders, rng.choice((1, 1, 2))):
                sp.insert(holder, chain, now)
                ref.insert(holder, chain, now)
                sent.append((holder, chain, now))
        elif r < 0.75 and sent:
            holder, chain, at = rng.choice(sent)
            sp.settle(holder, chain, at, now)
            ref.settle(holder, chain, at, now)
        elif r < 0.78:
            pod = rng.choice(holders)[0]
            sp.forget_pod(pod)
            ref.forget_pod(pod)
        elif r < 0.85:
            sp.prune(now)
            ref.prune(now)
        assert len(sp) == ref.entries()
        req = rng.choice(chains)
        req = req[: rng.randrange(1, len(req) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 3))]
        at = now + rng.choice((0.0, 0.05, 0.12, 1.0, 2.5))
        floor = {h: rng.randrange(0, 8) for h in rng.sample(holders, 3)}
        assert sp.match(req, at, floor) == ref.match(req, at, floor)
        want = ref.match(req, at, {})
        assert sp.match(req, at) == want
        # The mirror index, for every holder (one whose records all left must hold nothing there either).
        got = sp.match_ids(req, at)[sp.holder_ids(holders)].tolist()
        assert got == [want.get(h, 0) for h in holders]


# --- picker ---------------------------------------------------------------------------------------------------------


def test_picker() -> None:
    totals, parts = weighted_totals(2, [("x", 2.0, [0.5, 1.0]), ("y", 1.0, [1.0, 0.0])])
    assert totals == [2.0, 2.0] and parts == [{"x": 1.0, "y": 1.0}, {"x": 2.0, "y": 0.0}]
    assert pick_max([0.1, 0.9, 0.3], random.Random(0)) == 1
    picks = [pick_max([1.0, 1.0, 0.5, 1.0], random.Random(s)) for s in range(30)]
    assert set(picks) == {0, 1, 3}
    assert picks == [pick_max([1.0, 1.0, 0.5, 1.0], random.Random(s)) for s in range(30)]
    with pytest.raises(ValueError):
        pick_max([], random.Random(0))


# --- policies -------------------------------------------------------------------------------------------------------


FOUR = {A: IDLE, B: IDLE, C: IDLE, D: IDLE}


def test_round_robin_cycles() -> None:
    s = Scheduler(spec(policy="round-robin"), seed=1)
    got = [s.schedule(request(blocks(3, i), f"r{i}"), snap(FOUR)).target for i in range(8)]
    assert got == [A, B, C, D, A, B, C, D]
    assert s.schedule(request([]), snap(FOUR)).reason == "round-robin"


def test_least_loaded() -> None:
    states = {
        A: EndpointState(inflight=5, waiting=5),
        B: EndpointState(inflight=2, waiting=1),
        C: EndpointState(inflight=0, waiting=4),
        D: EndpointState(healthy=False),
    }
    s = Scheduler(spec(policy="least-loaded"))
    d = s.schedule(request([]), snap(states))
    assert d.target == B and d.reason == "least-loaded" and d.scores == {}


def test_random_is_seeded_and_deterministic() -> None:
    def run(seed: int) -> list[Endpoint]:
        s = Scheduler(spec(policy="random"), seed=seed)
        return [s.schedule(request([]), snap(FOUR)).target for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert set(run(7)) == {A, B, C, D}


def test_no_endpoint() -> None:
    s = Scheduler(spec())
    with pytest.raises(NoEndpointError):
        s.schedule(request([]), snap({A: EndpointState(healthy=False), ep("p", "prefill"): IDLE}))
    with pytest.raises(NoEndpointError):
        s.schedule(request([]), snap({}))


def test_only_healthy() -> None:
    d = Scheduler(spec()).schedule(request([]), snap({A: EndpointState(healthy=False), B: IDLE}))
    assert d.target == B and d.reason == "only-healthy"


def test_forget_pod() -> None:
    s = Scheduler(spec(weights={"prefix": 1.0, "approximate-prefix": 1.0, "no-hit-lru": 1.0}))
    r = request(blocks(10, 1), text_chunk_hashes=blocks(10, 2))
    d = s.schedule(r, snap({A: IDLE}))
    s.observe_routed(r, d, 0.0)
    assert s.speculative.match(r.block_hashes, 0.5) and s.approx_cache.size(A.holder) != (0, 0)
    s.forget_pod("a")
    assert not s.speculative.match(r.block_hashes, 0.5) and s.approx_cache.size(A.holder) == (0, 0)


def test_endpoint_identity() -> None:
    import dataclasses

    e = Endpoint("p", 1, "decode", "u", ranks=2)
    f = dataclasses.replace(e, dp_rank=0)
    assert f.holder == ("p", 0) and e.holder == ("p", 1)
    assert e == Endpoint("p", 1, "decode", "u", ranks=2) and hash(e) == hash(Endpoint("p", 1, "decode", "u", ranks=2))
    assert e != f and len({e, f, Endpoint("p", 1, "decode", "u", ranks=2)}) == 2


# --- plugins --------------------------------------------------------------------------------------------------------


class FewestRunning:
    """A scorer as a user would add one: prefers the endpoints with the fewest running requests (1 for the fewest,
    0 for the most); remembers where requests were routed, to show the learning hooks are called."""

    name = "fewest-running"

    def __init__(self) -> None:
        self.routed: list[str] = []

    def score(self, ctx: ScoringContext, cands: list[Candidate]) -> list[float]:
        runs = [c.state.running for c in cands]
        lo, hi = min(runs, default=0), max(runs, default=0)
        return [1.0 if hi == lo else (hi - r) / (hi - lo) for r in runs]

    def observe_routed(self, req: RouteRequest, decision: Decision, now: float, capacity: object) -> None:
        self.routed.append(decision.target.pod)

    def forget_pod(self, pod: str) -> None:
        self.routed = [p for p in self.routed if p != pod]


def test_adding_a_scorer_is_one_class_and_one_registration() -> None:
    register_scorer(ScorerPlugin("fewest-running", lambda setup: FewestRunning(), frozenset({"engine_state"})))
    try:
        assert scorer_names()[-1] == "fewest-running"
        s = Scheduler(spec(weights={"fewest-running": 1.0}), seed=0)  # the spec accepts the new key
        assert s.weights == {"fewest-running": 1.0}
        assert "engine_state" in s.inputs and "text" not in s.inputs
        states = {A: EndpointState(running=5), B: EndpointState(running=1), C: EndpointState(running=3)}
        r = request(blocks(4, 1))
        d = s.schedule(r, snap(states))
        assert d.target == B and d.scores[B].parts == {"fewest-running": 1.0} and d.scores[A].total == 0.0
        s.observe_routed(r, d, 0.0)
        scorer = s.columns[0][2]
        assert isinstance(scorer, FewestRunning) and scorer.routed == ["b"]
        s.forget_pod("b")
        assert scorer.routed == []
        # Weighed beside the built-in ones, after them (registration order).
        mixed = Scheduler(spec(weights={"queue": 1.0, "fewest-running": 2.0}), seed=0)
        assert list(mixed.weights) == ["queue", "fewest-running"]
        assert mixed.schedule(r, snap(states)).target == B
    finally:
        unregister_scorer("fewest-running")
    with pytest.raises(ValueError, match="'prefix', 'approximate-prefix'"):
        spec(weights={"fewest-running": 1.0})


def test_a_scorers_declared_inputs_reach_the_scheduler() -> None:
    # A scorer reading text chunk hashes under the precise policy: the scheduler (and so the proxy) must keep text.
    register_scorer(ScorerPlugin("text-length", lambda setup: QueueScorer(), frozenset({"text"})))
    try:
        assert "text" in Scheduler(spec(weights={"prefix": 1.0, "text-length": 1.0})).inputs
        assert "text" not in Scheduler(spec(weights={"prefix": 1.0, "text-length": 0.0})).inputs
        with pytest.raises(ValueError, match="already registered"):
            register_scorer(ScorerPlugin("text-length", lambda setup: QueueScorer()))
    finally:
        unregister_scorer("text-length")
    with pytest.raises(ValueError, match="unknown input"):
        ScorerPlugin("bad", lambda setup: QueueScorer(), frozenset({"gpu"}))  # type: ignore[arg-type]


def test_builtin_scorers_keep_their_column_order() -> None:
    # The weighted parts of a total are summed in registration order: another order changes totals in the last bits
    # and with them seeded tie-breaks, so the built-in modules are imported in this order (scheduling/__init__.py).
    assert scorer_names()[:7] == (
        "prefix",
        "approximate-prefix",
        "kv-util",
        "queue",
        "load-aware",
        "token-load",
        "no-hit-lru",
    )


def test_policies_declare_what_the_router_must_gather() -> None:
    assert Scheduler(spec()).inputs == {"tokens", "kv_index", "engine_state"}
    assert Scheduler(spec(policy="approximate")).inputs == {"text", "engine_state"}
    assert "text" in Scheduler(spec(weights={"prefix": 1.0, "approximate-prefix": 1.0})).inputs


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="policy"):
        Scheduler(spec().model_copy(update={"policy": "nope"}))
    with pytest.raises(ValueError, match="scorer"):
        Scheduler(spec().model_copy(update={"weights": {"bogus": 1.0}}))


# --- precise policy -------------------------------------------------------------------------------------------------


def test_precise_picks_the_prefix_holder() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(C.holder, h[:80])
    ix.store(B.holder, h[:10])
    d = Scheduler(spec()).schedule(request(h), snap(FOUR), ix)
    assert d.target == C and d.reason == "prefix-hit"
    assert d.gpu_hit_tokens == 80 * BS and d.cpu_hit_tokens == 0 and d.expected_hit_tokens == 80 * BS
    assert d.scores[C].parts["prefix"] == pytest.approx(2 * 0.8)
    assert set(d.scores[C].parts) == {"prefix", "kv-util", "queue", "no-hit-lru"}


def test_gpu_hit_beats_equal_cpu_hit() -> None:
    ix = KVIndex()
    h = blocks(40, 1)
    ix.store(A.holder, h[:10], "CPU")
    ix.store(B.holder, h[:10], "GPU")
    d = Scheduler(spec()).schedule(request(h), snap({A: IDLE, B: IDLE}), ix)
    assert d.target == B


def test_long_cpu_hit_beats_short_gpu_hit() -> None:
    ix = KVIndex()
    h = blocks(40, 1)
    ix.store(A.holder, h[:30], "CPU")
    ix.store(B.holder, h[:10], "GPU")
    d = Scheduler(spec()).schedule(request(h), snap({A: IDLE, B: IDLE}), ix)
    assert d.target == A and d.cpu_hit_tokens == 30 * BS and d.gpu_hit_tokens == 0


def test_load_outweighs_a_small_prefix_hit() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(A.holder, h[:10])
    states = {A: EndpointState(waiting=10, kv_usage=0.9), B: EndpointState(waiting=0, kv_usage=0.1)}
    cfg = spec(weights={"prefix": 2.0, "kv-util": 1.0, "queue": 1.0})
    d = Scheduler(cfg).schedule(request(h), snap(states), ix)
    assert d.target == B and d.reason == "load"
    # ...but not a big one
    ix.store(A.holder, h[10:], parent=h[9])
    d = Scheduler(cfg).schedule(request(h), snap(states), ix)
    assert d.target == A and d.reason == "prefix-hit"


def test_cold_request_reason() -> None:
    d = Scheduler(spec()).schedule(request(blocks(5, 9)), snap(FOUR), KVIndex())
    assert d.cold and d.reason == "cold" and d.expected_hit_tokens == 0


def test_dp_ranks_are_separate_holders() -> None:
    ix = KVIndex()
    h = blocks(20, 1)
    r0, r1 = ep("pod", rank=0), ep("pod", rank=1)
    ix.store(r1.holder, h)
    d = Scheduler(spec()).schedule(request(h), snap({r0: IDLE, r1: IDLE}), ix)
    assert d.target == r1 and d.target.url == r0.url


def test_capacity_filter_skips_full_endpoints() -> None:
    ix = KVIndex()
    h = blocks(20, 1)
    ix.store(A.holder, h)
    states = {A: EndpointState(inflight=64), B: IDLE}
    d = Scheduler(spec(p2p=False), tuning=Tuning(holder_patience=False)).schedule(request(h), snap(states), ix)
    assert d.target == B and A not in d.scores and d.reason == "load" and d.wait_s == 0


def test_full_prefix_holder_is_waited_for_while_that_saves_prefill_time() -> None:
    """Delay scheduling: the full holder stays the choice (with how long to wait for it) while the request has waited
    less than the prefill time its hit saves; after that the request goes where there is room."""
    ix = KVIndex()
    h = blocks(50, 1)
    saves = 50 * BS / 20_000  # the fallback cost model prefills 20K tokens/s
    ix.store(A.holder, h)
    states = {A: EndpointState(inflight=64), B: IDLE}
    sched = Scheduler(spec(p2p=False))
    d = sched.schedule(request(h), snap(states), ix, waited_s=0.0)
    assert d.target == A and d.reason == "prefix-hit"
    assert d.wait_s == pytest.approx(saves, rel=0.01)
    d = sched.schedule(request(h), snap(states), ix, waited_s=saves / 4)
    assert d.target == A and d.wait_s == pytest.approx(saves * 3 / 4, rel=0.01)
    d = sched.schedule(request(h), snap(states), ix, waited_s=saves * 1.01)
    assert d.target == B and d.wait_s == 0 and A not in d.scores
    # A holder is waited for in the scheduler's own time units: engines simulated twice as fast wait half as long.
    fast = Scheduler(spec(p2p=False), tuning=Tuning(time_scale=0.5))
    assert fast.schedule(request(h), snap(states), ix).wait_s == pytest.approx(saves / 2, rel=0.01)


def test_a_saturated_fleet_waits_longer_for_the_prefix_holder() -> None:
    """While other requests wait for room too, a recompute elsewhere delays each of them by its prefill time: the
    holder is worth (1 + queued) times the saved prefill time of waiting."""
    ix = KVIndex()
    h = blocks(50, 1)
    saves = 50 * BS / 20_000
    ix.store(A.holder, h)
    states = {A: EndpointState(inflight=64), B: IDLE}
    sched = Scheduler(spec(p2p=False))
    assert sched.schedule(request(h), snap(states), ix, queued=3).wait_s == pytest.approx(4 * saves, rel=0.01)
    # Past the quiet fleet's patience, still waiting while three others wait...
    d = sched.schedule(request(h), snap(states), ix, waited_s=2 * saves, queued=3)
    assert d.target == A and d.wait_s == pytest.approx(2 * saves, rel=0.01)
    # ...and gone elsewhere when nobody else does.
    assert sched.schedule(request(h), snap(states), ix, waited_s=2 * saves, queued=0).target == B


# --- speculative co-location ----------------------------------------------------------------------------------------


def burst(
    sched: Scheduler, n: int, prefix: list[int], now: float = 0.0, index: KVIndex | None = None
) -> list[Decision]:
    out = []
    for i in range(n):
        r = request(prefix + blocks(3, 1000 + i), f"sub{i}", is_subagent=True, parent_session_id="s")
        d = sched.schedule(r, snap(FOUR), index if index is not None else KVIndex(), now + i * 0.01)
        sched.observe_routed(r, d, now + i * 0.01)
        out.append(d)
    return out


def test_speculative_entries_colocate_a_subagent_burst() -> None:
    prefix = blocks(200, 7)  # a fresh prefix: no engine has reported it
    ds = burst(Scheduler(spec(), seed=3), 8, prefix)
    assert len({d.target for d in ds}) == 1
    assert ds[0].cold and all(d.reason == "prefix-hit" for d in ds[1:])
    assert all(d.gpu_hit_tokens == 200 * BS for d in ds[1:])
    # without speculative entries the burst scatters
    ds = burst(Scheduler(spec(speculative_ttl_s=0.0), seed=3), 8, prefix)
    assert len({d.target for d in ds}) > 1


def test_speculative_entries_expire_after_ttl() -> None:
    s = Scheduler(spec(speculative_ttl_s=2.0), seed=0)
    prefix = blocks(50, 7)
    first = burst(s, 1, prefix, now=0.0)[0]
    r = request([*prefix, 99], "late")
    assert s.schedule(r, snap(FOUR), KVIndex(), now=1.9).target == first.target
    late = s.schedule(r, snap(FOUR), KVIndex(), now=2.5)
    assert late.cold and late.expected_hit_tokens == 0
    # real events confirm: the hit outlives the TTL
    ix = KVIndex()
    ix.store(first.target.holder, prefix)
    assert s.schedule(r, snap(FOUR), ix, now=100.0).target == first.target


def test_advancing_time_drops_expired_speculative_entries_and_no_answer_changes() -> None:
    """Scheduler.advance (the router core's clock moving on) drops what expired by then; a decision after it is
    the one it would have been (expired entries were only set aside before)."""
    s, t = Scheduler(spec(speculative_ttl_s=2.0), seed=0), Scheduler(spec(speculative_ttl_s=2.0), seed=0)
    prefix = blocks(50, 7)
    for sched in (s, t):
        burst(sched, 1, prefix, now=0.0)
        burst(sched, 1, blocks(20, 9), now=1.0)
    held = len(s.speculative)
    s.advance(1.9)
    assert len(s.speculative) == held
    s.advance(2.5)  # the first entry expired, the second has not
    assert 0 < len(s.speculative) < held
    r = request([*prefix, 99], "late")
    a, b = s.schedule(r, snap(FOUR), KVIndex(), now=2.5), t.schedule(r, snap(FOUR), KVIndex(), now=2.5)
    assert (a.target, a.expected_hit_tokens, a.cold) == (b.target, b.expected_hit_tokens, b.cold) == (a.target, 0, True)
    s.advance(3.5)
    assert len(s.speculative) == 0


def test_speculative_works_without_an_index() -> None:
    s = Scheduler(spec(), seed=0)
    prefix = blocks(30, 7)
    ds = []
    for i in range(5):
        r = request([*prefix, i], f"r{i}")
        d = s.schedule(r, snap(FOUR), None, now=0.0)
        s.observe_routed(r, d, 0.0)
        ds.append(d)
    assert len({d.target for d in ds}) == 1


# --- no-hit LRU -----------------------------------------------------------------------------------------------------


def test_no_hit_lru_spreads_cold_sessions() -> None:
    cfg = spec(weights={"prefix": 2.0, "kv-util": 1.0, "queue": 1.0, "no-hit-lru": 1.0}, speculative_ttl_s=0.0)
    s = Scheduler(cfg, seed=0)
    targets = []
    for i in range(8):
        r = request(blocks(10, 100 + i), f"s{i}", session_id=f"s{i}")
        d = s.schedule(r, snap(FOUR), KVIndex(), now=float(i))
        assert d.cold
        s.observe_routed(r, d, float(i))
        targets.append(d.target)
    assert Counter(targets) == {A: 2, B: 2, C: 2, D: 2}
    assert targets[:4] != targets[4:] or len(set(targets[:4])) == 4


# --- approximate policy ---------------------------------------------------------------------------------------------


def test_approximate_policy_learns_from_observe_routed() -> None:
    s = Scheduler(spec(policy="approximate"), seed=5)
    assert s.weights == {"approximate-prefix": 2.0, "kv-util": 1.0, "queue": 1.0, "no-hit-lru": 1.0}
    text = "".join(chr(0x61 + (i * 7) % 26) for i in range(256 * 40))
    states = {e: EndpointState(kv_capacity_blocks=1000) for e in FOUR}
    r1 = RouteRequest("r1", num_tokens=len(text) // 4, text_chunk_hashes=text_chunk_hashes(text))
    d1 = s.schedule(r1, snap(states))
    assert d1.cold
    s.observe_routed(r1, d1, 0.0)
    text2 = text + "more " * 200
    r2 = RouteRequest("r2", num_tokens=len(text2) // 4, text_chunk_hashes=text_chunk_hashes(text2))
    d2 = s.schedule(r2, snap(states), now=1.0)
    assert d2.target == d1.target and d2.reason == "prefix-hit"
    assert d2.gpu_hit_tokens == 40 * 64  # 40 chunks of 256 chars = 40 blocks of 64 tokens


def test_approximate_policy_respects_capacity() -> None:
    s = Scheduler(spec(policy="approximate", weights={"approximate-prefix": 1.0}), seed=5)
    small = {A: EndpointState(kv_capacity_blocks=10), B: EndpointState(kv_capacity_blocks=10)}
    first = RouteRequest("r1", num_tokens=640, text_chunk_hashes=blocks(10, 1))
    d = s.schedule(first, snap({A: small[A]}))
    s.observe_routed(first, d, 0.0)
    filler = RouteRequest("f", num_tokens=640, text_chunk_hashes=blocks(10, 2))
    s.observe_routed(filler, s.schedule(filler, snap({A: small[A]})), 0.0)
    d = s.schedule(first, snap(small))
    assert d.cold  # evicted from A's LRU: 10 blocks of capacity, 20 chunks sent
    with_cpu = {A: EndpointState(kv_capacity_blocks=10, cpu_capacity_blocks=10), B: small[B]}
    s2 = Scheduler(spec(policy="approximate", weights={"approximate-prefix": 1.0}), seed=5)
    for r in (first, filler):
        s2.observe_routed(r, s2.schedule(r, snap({A: with_cpu[A]})), 0.0)
    d = s2.schedule(first, snap(with_cpu))
    assert d.target == A and d.cpu_hit_tokens == 640 and d.gpu_hit_tokens == 0
    assert d.scores[A].parts["approximate-prefix"] == pytest.approx(0.8)


# --- P/D ------------------------------------------------------------------------------------------------------------


P1, P2 = ep("p1", "prefill"), ep("p2", "prefill")
D1, D2 = ep("d1", "decode"), ep("d2", "decode")
PD_FLEET = {P1: IDLE, P2: IDLE, D1: IDLE, D2: IDLE}


def test_pd_threshold_on_off() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(D1.holder, h[:99])
    ix.store(P2.holder, h[:50])
    s = Scheduler(spec(pd_threshold=128), seed=0)
    warm = s.schedule(request(h), snap(PD_FLEET), ix)  # 64 uncached tokens < 128: decode-only
    assert warm.target == D1 and warm.pd is None and warm.pd_reason == "below-threshold"
    cold = s.schedule(request(blocks(100, 2)), snap(PD_FLEET), ix)
    assert cold.pd is not None and cold.pd.prefill.role == "prefill" and cold.pd.reason == "threshold"
    assert cold.pd.uncached_tokens == 6400
    # the prefill hop is scored too: the prefill endpoint holding part of the prefix wins
    h2 = h[:60] + blocks(40, 3)
    d = s.schedule(request(h2), snap(PD_FLEET), ix)
    assert d.pd is not None and d.pd.prefill == P2
    # no prefill pool: never P/D
    assert s.schedule(request(blocks(100, 2)), snap({D1: IDLE}), ix).pd_reason == ""
    # unhealthy prefill pool: decode-only
    sick = {P1: EndpointState(healthy=False), D1: IDLE}
    down = s.schedule(request(blocks(100, 2)), snap(sick), ix)
    assert down.pd is None and down.pd_reason == "prefill-unhealthy"
    # threshold 0 disaggregates everything
    assert Scheduler(spec(pd_threshold=0)).schedule(request(h), snap(PD_FLEET), ix).pd is not None


def test_pd_prefill_endpoints_never_serve_decode() -> None:
    s = Scheduler(spec(policy="round-robin"))
    for i in range(6):
        d = s.schedule(request(blocks(10, i), f"r{i}"), snap(PD_FLEET))
        assert d.target.role == "decode"
        assert d.pd is not None and d.pd.prefill.role == "prefill"


def test_queue_aware_decider() -> None:
    busy_decode = EndpointState(waiting=10, running=200, inflight=210, inflight_tokens=210 * 20_000)
    fleet = {P1: IDLE, D1: busy_decode}
    s = Scheduler(spec(pd_decider="queue-aware"), seed=0)
    r = request(blocks(800, 1))  # 51,200 uncached tokens
    accept = s.schedule(r, snap(fleet), KVIndex())
    assert accept.pd is not None and accept.pd.reason == "queue-aware"
    assert accept.pd.est_disagg_s is not None and accept.pd.est_local_s is not None
    assert accept.pd.est_disagg_s < accept.pd.est_local_s
    backed_up = {P1: EndpointState(inflight=50, inflight_tokens=4_000_000), D1: busy_decode}
    decline = s.schedule(r, snap(backed_up), KVIndex())
    assert decline.pd is None and decline.pd_reason == "local-faster"
    # both idle: local prefill skips the transfer, so it wins
    idle = s.schedule(r, snap({P1: IDLE, D1: IDLE}), KVIndex())
    assert idle.pd is None and idle.pd_reason == "local-faster"
    # the threshold decider is queue-blind
    blind = Scheduler(spec(pd_decider="threshold")).schedule(r, snap(backed_up), KVIndex())
    assert blind.pd is not None


def test_queue_aware_pure_functions_and_latency_model() -> None:
    from llmd.perf.latency import LatencyModel
    from llmd.spec.model import DeploymentSpec

    lm = LatencyModel.from_spec(DeploymentSpec(), "decode")
    busy = EndpointState(waiting=4, running=100, inflight=104, inflight_tokens=104 * 50_000)
    inp = PDInputs(Candidate(D1, busy), Candidate(P1, IDLE), 60_000, 0, 0)
    dec, why = decide_queue_aware(inp, 16, lm, lm)
    assert dec is not None and why == "queue-aware"
    assert decide_threshold(PDInputs(Candidate(D1, IDLE), Candidate(P1, IDLE), 100, 90, 0), 16) == (
        None,
        "below-threshold",
    )
    m = ConstantRateModel()
    assert estimate_local_s(m, IDLE, 20_000, 0, 8192) == pytest.approx(1.0)
    assert estimate_disagg_s(m, IDLE, 20_000, 0, 20_000, False) == pytest.approx(1.0 + 20_000 / 250_000 + 0.001)
    assert m.kv_transfer_time(0, True) == 0.0


# --- P2P ------------------------------------------------------------------------------------------------------------


def test_p2p_moves_off_an_overloaded_holder() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(A.holder, h)
    full = EndpointState(inflight=64, waiting=20)
    states = {A: full, B: EndpointState(inflight=2), C: EndpointState(inflight=30, waiting=5)}
    d = Scheduler(spec(p2p=True)).schedule(request([*h, 5]), snap(states), ix)
    assert d.target == B and d.p2p_source == A and d.reason == "p2p"
    assert d.p2p_tokens == 100 * BS and d.expected_hit_tokens == 100 * BS and d.gpu_hit_tokens == 0
    assert d.pd is None and d.pd_reason == "p2p"
    # p2p off: the full holder is waited for while that saves prefill time; then moved off, recomputing
    sched = Scheduler(spec(p2p=False))
    d = sched.schedule(request([*h, 5]), snap(states), ix)
    assert d.target == A and d.wait_s > 0
    d = sched.schedule(request([*h, 5]), snap(states), ix, waited_s=d.wait_s + 0.01)
    assert d.target == B and d.p2p_source is None and d.expected_hit_tokens == 0 and d.wait_s == 0


def test_p2p_overloaded_by_queue_even_if_picker_keeps_the_holder() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(A.holder, h)
    states = {A: EndpointState(inflight=40, waiting=16), B: EndpointState(inflight=1)}
    d = Scheduler(spec(p2p=True)).schedule(request(h), snap(states), ix)
    assert d.target == B and d.p2p_source == A
    d = Scheduler(spec(p2p=False)).schedule(request(h), snap(states), ix)
    assert d.target == A and d.p2p_source is None


def test_p2p_needs_an_overloaded_holder_a_worthwhile_prefix_and_a_much_lighter_peer() -> None:
    ix = KVIndex()
    h = blocks(100, 1)
    ix.store(A.holder, h)
    # holder not overloaded: stay
    d = Scheduler(spec()).schedule(request(h), snap({A: EndpointState(inflight=10), B: IDLE}), ix)
    assert d.target == A and d.p2p_source is None
    # peer not much lighter
    busy = {A: EndpointState(inflight=40, waiting=16), B: EndpointState(inflight=40, waiting=10)}
    assert Scheduler(spec()).schedule(request(h), snap(busy), ix).p2p_source is None
    # prefix too short to be worth pulling
    ix2 = KVIndex()
    ix2.store(A.holder, h[:1])
    states = {A: EndpointState(inflight=64), B: IDLE}
    d = Scheduler(spec(pd_threshold=128)).schedule(request(h), snap(states), ix2)
    assert d.p2p_source is None
    # not under the approximate policy (no engine state to pull from)
    d = Scheduler(spec(policy="approximate")).schedule(request(h), snap(states), ix)
    assert d.p2p_source is None


# --- determinism and invariants -------------------------------------------------------------------------------------


def test_same_seed_same_decisions() -> None:
    def run(seed: int) -> list[tuple]:
        ix = KVIndex()
        rng = random.Random(1)
        eps = [ep(f"e{i}") for i in range(6)]
        fams = [blocks(40, f) for f in range(5)]
        for f, fam in enumerate(fams):
            ix.store(eps[f].holder, fam[: 10 + f])
        s = Scheduler(spec(weights={"prefix": 2.0, "queue": 1.0, "no-hit-lru": 1.0}), seed=seed)
        out = []
        for i in range(60):
            states = {e: EndpointState(waiting=rng.randrange(3), kv_usage=rng.choice([0.0, 0.5])) for e in eps}
            fam = fams[rng.randrange(5)] if rng.random() < 0.7 else blocks(10, 50 + i)
            r = request([*fam, i], f"r{i}")
            d = s.schedule(r, snap(states), ix, now=i * 0.5)
            s.observe_routed(r, d, i * 0.5)
            out.append((d.target, d.reason, d.expected_hit_tokens))
        return out

    assert run(11) == run(11)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Snapshot, KVIndex, list[int]]:
    n = draw(st.integers(1, 7))
    states: dict[Endpoint, EndpointState] = {}
    for i in range(n):
        e = Endpoint(f"p{i % 4}", i // 4, draw(st.sampled_from(["prefill", "decode", "both"])), f"u{i % 4}")
        states[e] = EndpointState(
            healthy=draw(st.booleans()),
            waiting=draw(st.integers(0, 200)),
            running=draw(st.integers(0, 300)),
            kv_usage=draw(st.floats(0, 1)),
            inflight=draw(st.integers(0, 80)),
            inflight_tokens=draw(st.integers(0, 10_000_000)),
            kv_capacity_blocks=draw(st.integers(0, 50)),
            cpu_capacity_blocks=draw(st.integers(0, 50)),
        )
    ix = KVIndex()
    h = blocks(30, 1)
    for e in states:
        k = draw(st.integers(0, 30))
        if k:
            ix.store(e.holder, h[:k], draw(st.sampled_from(["GPU", "CPU"])))
    return Snapshot(states), ix, h[: draw(st.integers(0, 30))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fleets(),
    st.sampled_from(["precise", "approximate", "round-robin", "least-loaded", "random"]),
    st.sampled_from(["threshold", "queue-aware"]),
    st.integers(0, 2**32),
    st.booleans(),
)
def test_decisions_are_valid_and_deterministic(fleet, policy, decider, seed, p2p) -> None:
    snapshot, ix, h = fleet
    weights = {"prefix": 2.0, "kv-util": 1.0, "queue": 1.0, "load-aware": 0.5, "token-load": 0.5, "no-hit-lru": 0.5}
    cfg = spec(policy=policy, weights=weights, pd_decider=decider, p2p=p2p, pd_threshold=64)
    ok = [e for e, s in snapshot.states.items() if s.healthy and e.role in ("decode", "both")]
    prefill_ok = [e for e, s in snapshot.states.items() if s.healthy and e.role == "prefill"]

    def run() -> list[Decision]:
        s = Scheduler(cfg, seed=seed)
        out = []
        for i in range(3):
            r = request([*h, i], f"r{i}", text_chunk_hashes=h[:10])
            try:
                d = s.schedule(r, snapshot, ix, now=float(i))
            except NoEndpointError:
                assert not ok
                return out
            s.observe_routed(r, d, float(i))
            out.append(d)
        return out

    ds = run()
    for d in ds:
        assert d.target in ok
        assert d.p2p_source is None or (d.p2p_source in ok and d.p2p_source != d.target)
        assert d.pd is None or d.pd.prefill in prefill_ok
        assert 0 <= d.expected_hit_tokens <= max(len(h) + 1, 1) * BS
        for score in d.scores.values():
            assert math.isclose(score.total, sum(score.parts.values()), abs_tol=1e-12)
            for name, part in score.parts.items():
                # under "approximate" the "prefix" weight goes to the approximate scorer
                w = weights["prefix"] if name == "approximate-prefix" else weights[name]
                assert -1e-12 <= part <= w + 1e-12, (name, part)
    assert [(d.target, d.reason, d.pd, d.p2p_source) for d in ds] == [
        (d.target, d.reason, d.pd, d.p2p_source) for d in run()
    ]


@pytest.mark.parametrize(
    "scorer",
    [QueueScorer(), KVUtilScorer(), LoadAwareScorer(), TokenLoadScorer(), NoHitLRUScorer()],
    ids=lambda s: s.name,
)
@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-5, 10_000), st.floats(-1, 2), st.integers(-5, 10**8)),
        max_size=10,
    ),
    st.sampled_from([None, True, False]),
)
def test_load_scorers_in_bounds(scorer, rows, cold) -> None:
    cs = [
        Candidate(ep(f"e{i}"), EndpointState(waiting=w, kv_usage=u, inflight_tokens=t))
        for i, (w, u, t) in enumerate(rows)
    ]
    got = scorer.score(ctx(cold=cold), cs)
    assert len(got) == len(cs)
    assert all(0.0 <= x <= 1.0 for x in got)


def test_a_prefix_every_endpoint_holds_counts_as_cold_so_new_sessions_spread() -> None:
    """A system prompt every pod holds cannot tell pods apart: new sessions are spread by the no-hit LRU instead of
    piling onto whichever pods look idle (which overflows their caches once the sessions grow)."""
    s = Scheduler(spec(), seed=3)
    ix = KVIndex()
    system = blocks(20, 9)
    for e in FOUR:
        ix.store(e.holder, system)
    targets = []
    for k in range(8):
        r = request(system + blocks(30, 100 + k), rid=f"s{k}")
        d = s.schedule(r, snap(FOUR), ix, now=float(k))
        assert d.cold and d.expected_hit_tokens == 20 * BS
        s.observe_routed(r, d, float(k))
        targets.append(d.target)
    assert Counter(targets) == {A: 2, B: 2, C: 2, D: 2}
    # Once a session's own blocks sit on one pod, it is warm and sticks there.
    ix.store(targets[0].holder, system + blocks(30, 100))
    d = s.schedule(request(system + blocks(30, 100) + blocks(5, 999), rid="s0b"), snap(FOUR), ix, now=10.0)
    assert not d.cold and d.target == targets[0]


# --- KV admission, prefill placement, approximate without a tokenizer -----------------------------------------------


def test_kv_room_filter_keeps_what_fits() -> None:
    # 10 blocks of 64 tokens, block 0 being vLLM's null block: 576 tokens of KV, allocated in whole blocks
    cap = EndpointState(inflight=2, inflight_kv_tokens=900, kv_capacity_blocks=10)
    roomy = EndpointState(inflight=2, inflight_kv_tokens=100, kv_capacity_blocks=10)
    assert not filters.kv_fits(cap, 1, BS) and filters.kv_fits(roomy, 7 * BS, BS)
    assert not filters.kv_fits(roomy, 7 * BS + 1, BS)  # an 8th block: 100 + 512 > 576
    assert filters.kv_fits(EndpointState(kv_capacity_blocks=1), 10_000, BS)  # idle: even a huge request goes
    assert filters.kv_fits(EndpointState(inflight=5, inflight_kv_tokens=10**9), 1, BS)  # capacity unknown
    assert [c.endpoint for c in filters.kv_room(cands((A, cap), (B, roomy)), 200, BS)] == [B]
    # none fits: all of them (the proxy's admission holds the request until one has room)
    assert [c.endpoint for c in filters.kv_room(cands((A, cap), (B, cap)), 200, BS)] == [A, B]


def test_decode_target_is_never_given_more_kv_than_it_holds() -> None:
    """The pod holding the session's prefix is passed over while the KV already sent there would overflow it: an
    engine past its KV preempts (recomputes) running requests."""
    s = Scheduler(spec(), seed=1)
    ix = KVIndex()
    h = blocks(40, 3)
    ix.store(A.holder, h)
    r = request(h + blocks(2, 4), session_id="s", max_tokens=256)
    s.observe_routed(r, s.schedule(r, snap(FOUR), ix), 0.0)  # the session is known now
    roomy = {e: EndpointState(kv_capacity_blocks=100) for e in FOUR}
    assert s.schedule(r, snap(roomy), ix).target == A
    full = dict(roomy)
    full[A] = EndpointState(inflight=3, inflight_kv_tokens=100 * BS - 100, kv_capacity_blocks=100)
    d = s.schedule(r, snap(full), ix)
    # chosen, but to wait for: the caller holds the request while the prefill its hit saves outweighs the wait
    assert d.target == A and d.wait_s > 0 and not filters.kv_fits(full[A], r.kv_tokens, BS)
    d = s.schedule(r, snap(full), ix, waited_s=d.wait_s + 0.01)
    assert d.target != A and r.kv_tokens == 42 * BS + 256


def _pd_fleet(n_prefill: int) -> dict[Endpoint, EndpointState]:
    fleet = {ep(f"p{i}", "prefill"): IDLE for i in range(n_prefill)}
    fleet.update({ep("d0", "decode"): IDLE, ep("d1", "decode"): IDLE})
    return fleet


def test_new_sessions_are_spread_over_the_prefill_pool_not_piled_on_the_system_prompt_holder() -> None:
    """One prefill pod holds the system prompt every agent shares: new sessions must not all prefill there (one pod
    would compute every session while the others idle); each session then sticks to its own prefill pod."""
    s = Scheduler(spec(), seed=2)
    ix = KVIndex()
    system = blocks(8, 9)
    fleet = _pd_fleet(3)
    ix.store(ep("p0", "prefill").holder, system)
    firsts = {}
    for k in range(6):
        r = request(system + blocks(30, 100 + k), rid=f"s{k}", session_id=f"s{k}")
        d = s.schedule(r, snap(fleet), ix, now=float(k))
        assert d.pd is not None and d.pd.cold
        s.observe_routed(r, d, float(k))
        firsts[k] = d.pd.prefill
        ix.store(d.pd.prefill.holder, system + blocks(30, 100 + k))
    assert Counter(firsts.values()) == {ep(f"p{i}", "prefill"): 2 for i in range(3)}
    # A later turn of a session prefills where its context is.
    r = request(system + blocks(30, 102) + blocks(4, 500), rid="s2b", session_id="s2")
    d = s.schedule(r, snap(fleet), ix, now=10.0)
    assert d.pd is not None and not d.pd.cold and d.pd.prefill == firsts[2]


def test_approximate_places_new_sessions_by_chunks_and_disaggregates_on_estimated_tokens() -> None:
    """Without a tokenizer (num_tokens estimated from characters by the proxy) the approximate policy gets the same
    cold placement of new sessions as precise, in its own units (text chunks), and the same P/D decision."""
    s = Scheduler(spec(policy="approximate"), seed=4)
    system = "".join(chr(0x61 + (i * 5) % 26) for i in range(256 * 4))
    fleet = _pd_fleet(2)
    for e in list(fleet):
        fleet[e] = EndpointState(kv_capacity_blocks=10_000)
    targets = []
    for k in range(4):
        text = system + "".join(chr(0x61 + (i * (k + 3)) % 26) for i in range(256 * 12))
        r = RouteRequest(f"r{k}", num_tokens=len(text) // 4, block_size=16, session_id=f"s{k}",
                         text_chunk_hashes=text_chunk_hashes(text))  # fmt: skip
        d = s.schedule(r, snap(fleet), now=float(k))
        # Only the shared system prompt is remembered anywhere: a minority of the prompt, so cold.
        assert d.cold and d.pd is not None
        s.observe_routed(r, d, float(k))
        targets.append(d.target)
    assert Counter(targets) == {ep("d0", "decode"): 2, ep("d1", "decode"): 2}


# --- llm-d's affinity decode profile --------------------------------------------------------------------------------


def test_affinity_filter_keeps_sticky_pods_until_their_queue_costs_more_than_the_penalty() -> None:
    c = cands((A, IDLE), (B, IDLE), (C, IDLE))
    assert filters.prefix_affinity(c, [0.9, 0.5, 0.85], 0.8, [0.0, 0.0, 0.0], 18.0) == [c[0], c[2]]
    assert filters.prefix_affinity(c, [0.1, 0.5, 0.2], 0.8, [0.0, 0.0, 0.0], 18.0) == c  # nobody sticky: no-op
    # the sticky pods' queued prefill would cost 20 s more than the idle one's: stickiness breaks
    assert filters.prefix_affinity(c, [0.9, 0.5, 0.85], 0.8, [20.0, 0.0, 25.0], 18.0) == c
    assert filters.prefix_affinity(c, [0.9, 0.5, 0.85], 0.8, [10.0, 0.0, 25.0], 18.0) == [c[0], c[2]]


def test_affinity_profile_routes_among_holders_by_token_load() -> None:
    """affinity_threshold 0.8 + token-load alone: of the two pods holding the whole prefix, the one with less
    prefill queued gets the request; a pod holding a fifth of it is not considered however idle it is."""
    ix = KVIndex()
    h = blocks(50, 1)
    ix.store(A.holder, h)
    ix.store(B.holder, h)
    ix.store(C.holder, h[:10])
    cfg = spec(affinity_threshold=0.8, weights={"token-load": 1.0}, p2p=False)
    states = {
        A: EndpointState(inflight=3, inflight_tokens=30_000),
        B: EndpointState(inflight=3, inflight_tokens=10_000),
        C: IDLE,
        D: IDLE,
    }
    d = Scheduler(cfg).schedule(request(h, session_id="s"), snap(states), ix)
    assert d.target == B and set(d.scores) == {A, B}
    # without the filter, token-load counts the prefill each pod would have with this request, its own uncached
    # tokens included: the idle pod holding 10 of the 50 blocks (40 to compute) beats the idle one holding none
    d = Scheduler(spec(weights={"token-load": 1.0}, p2p=False)).schedule(request(h, session_id="s"), snap(states), ix)
    assert d.target == C
