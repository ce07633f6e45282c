"""The KV index: tiers, consecutive prefixes, holders, sequence gaps, LRU cap, and a brute-force reference model.

Every test runs on both implementations: the C core (NativeKVIndex, what KVIndex is where it is built) and the
pure-Python fallback (PyKVIndex)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvutil import brute_prefixes

from llmd.kv import index as kv_index
from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from llmd.kv.index import KVIndex, NativeKVIndex, PrefixMatch, PyKVIndex

IMPLS = [pytest.param(PyKVIndex, id="python")]
if kv_index.Core is not None:
    IMPLS.append(pytest.param(NativeKVIndex, id="native"))


@pytest.fixture(params=IMPLS, autouse=True)
def impl(request, monkeypatch):
    monkeypatch.setitem(globals(), "KVIndex", request.param)
    return request.param


A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)


def stored(hashes, medium="GPU", parent=None) -> BlockStored:
    return BlockStored(list(hashes), parent, [], 16, None, medium, None)


def batch(*events, rank: int | None = 0) -> EventBatch:
    return EventBatch(0.0, list(events), rank)


def by_holder(ix: KVIndex, hashes) -> dict:
    """`query`'s answer by holder, checked against `query_columns` (the same answer by holder id)."""
    got = {m.holder: (m.blocks_any, m.blocks_gpu, m.blocks_gpu_prefix) for m in ix.query(hashes)}
    assert columns_by_holder(ix, hashes) == got
    return got


def columns_by_holder(ix: KVIndex, hashes) -> dict:
    cols = ix.query_columns(hashes)
    known = ix.holders()
    ids = ix.holder_ids([*known, ("nobody", 0)])
    assert ids[-1] == -1
    rows = zip(*(c[ids].tolist() for c in cols), strict=True)
    got = {h: r for h, r in zip(known, rows, strict=False) if r[0]}
    assert all(c[-1] == 0 for c in cols)  # an unknown holder reads 0
    return got


def test_store_query_remove() -> None:
    ix = KVIndex()
    ix.apply("a", batch(stored([1, 2, 3])))
    assert ix.query([1, 2, 3, 4]) == [PrefixMatch(A0, 3, 3, 3)]
    assert ix.query([9, 1, 2]) == []  # the first block decides who is in
    assert ix.query([]) == []
    ix.apply("a", batch(BlockRemoved([3], "GPU")))
    assert by_holder(ix, [1, 2, 3]) == {A0: (2, 2, 2)}
    assert 3 not in ix and len(ix) == 2
    ix.apply("a", batch(BlockRemoved([1], None)))  # medium None is GPU
    assert ix.query([1, 2]) == []
    assert ix.holders_of(2) == {A0: ("GPU",)}


def test_tiers() -> None:
    ix = KVIndex()
    ix.apply("a", batch(stored([1, 2, 3, 4], "CPU"), stored([3, 4, 5], "GPU")))
    ix.apply("b", batch(stored([1, 2], "STORAGE"), stored([1], "GPU")))
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (5, 3, 0), B0: (2, 1, 1)}
    assert ix.holders_of(3) == {A0: ("GPU", "CPU")}
    assert ix.holders_of(1) == {A0: ("CPU",), B0: ("GPU", "CPU")}
    # removing one tier leaves the other
    ix.apply("a", batch(BlockRemoved([3, 4], "GPU")))
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (5, 1, 0), B0: (2, 1, 1)}
    ix.apply("a", batch(BlockRemoved([3], "CPU")))
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (2, 0, 0), B0: (2, 1, 1)}


def test_gpu_prefix_and_count_differ() -> None:
    ix = KVIndex()
    ix.store(A0, [1, 2, 3, 4, 5, 6], "CPU")
    ix.store(A0, [1, 2], "GPU")
    ix.store(A0, [4, 5], "GPU", parent=3)
    assert ix.query([1, 2, 3, 4, 5, 6]) == [PrefixMatch(A0, 6, 4, 2)]


def test_a_hole_stops_the_prefix() -> None:
    ix = KVIndex()
    ix.store(A0, [1, 2, 3, 4, 5])
    ix.store(B0, [1, 2, 3, 4, 5])
    ix.remove(A0, [3])
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (2, 2, 2), B0: (5, 5, 5)}
    ix.remove(B0, [3])
    assert 3 not in ix
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (2, 2, 2), B0: (2, 2, 2)}
    # the rest of the chain is still known, from its own first block
    assert by_holder(ix, [4, 5]) == {A0: (2, 2, 2), B0: (2, 2, 2)}


def test_results_longest_first() -> None:
    ix = KVIndex()
    ix.store(("p", 0), [1])
    ix.store(("q", 0), [1, 2, 3])
    ix.store(("r", 0), [1, 2])
    assert [m.holder for m in ix.query([1, 2, 3])] == [("q", 0), ("r", 0), ("p", 0)]


def test_dp_ranks_are_distinct_holders() -> None:
    ix = KVIndex()
    ix.apply("a", batch(stored([1, 2, 3]), rank=0))
    ix.apply("a", batch(stored([1, 2]), rank=1))
    ix.apply("a", batch(stored([1]), rank=None))  # no rank in the batch: rank 0
    assert by_holder(ix, [1, 2, 3]) == {A0: (3, 3, 3), A1: (2, 2, 2)}
    assert ix.holders() == [A0, A1]
    ix.apply("a", batch(AllBlocksCleared(), rank=1))
    assert by_holder(ix, [1, 2, 3]) == {A0: (3, 3, 3)}


def test_a_holders_epoch_moves_with_each_update_of_it_and_only_its() -> None:
    """The router keeps a decision to wait for a prefix holder while the holder's epoch stays: every update of what
    the holder has moves it (batches, bulk stores and removals, clears, its pod dropped); other holders' do not."""
    ix = KVIndex()
    assert ix.epoch(A0) == 0
    ix.apply("a", batch(stored([1, 2, 3])))
    ix.apply("b", batch(stored([1, 2])))
    a0, b0 = ix.epoch(A0), ix.epoch(B0)
    assert a0 > 0 and b0 > 0
    ix.query([1, 2, 3])
    ix.query_columns([1, 2, 3])
    assert (ix.epoch(A0), ix.epoch(B0)) == (a0, b0)  # reading changes nothing
    ix.apply("a", batch(BlockRemoved([3], "GPU")))
    a1 = ix.epoch(A0)
    assert a1 > a0 and ix.epoch(B0) == b0
    ix.store(A0, [7, 8], "CPU")
    a2 = ix.epoch(A0)
    assert a2 > a1
    ix.remove(A0, [7], "CPU")
    a3 = ix.epoch(A0)
    assert a3 > a2 and ix.epoch(A1) == 0 and ix.epoch(B0) == b0
    ix.apply("b", batch(AllBlocksCleared()))
    b1 = ix.epoch(B0)
    assert b1 > b0
    ix.apply("a", batch(stored([5]), rank=1))
    a1_rank1 = ix.epoch(A1)
    ix.drop_pod("a")
    assert ix.epoch(A0) > a3 and ix.epoch(A1) > a1_rank1 and ix.epoch(B0) == b1


def test_all_blocks_cleared_mid_batch() -> None:
    ix = KVIndex()
    ix.apply("a", batch(stored([1, 2]), stored([3], "CPU"), AllBlocksCleared(), stored([7, 8])))
    assert ix.query([1, 2]) == [] and ix.query([3]) == []
    assert by_holder(ix, [7, 8]) == {A0: (2, 2, 2)}
    assert len(ix) == 2 and ix.stats()["clears"] == 1


def test_drop_pod_forgets_every_rank() -> None:
    ix = KVIndex()
    ix.apply("a", batch(stored([1, 2, 3]), rank=0))
    ix.apply("a", batch(stored([1, 2, 9]), rank=1))
    ix.apply("b", batch(stored([1, 2])))
    assert ix.drop_pod("a") == 4  # entries touched: 1, 2, 3, 9
    assert by_holder(ix, [1, 2, 3]) == {B0: (2, 2, 2)}
    assert 3 not in ix and 9 not in ix and len(ix) == 2
    assert ix.holders() == [B0]
    assert ix.drop_pod("a") == 0
    ix.drop_pod("b")
    assert len(ix) == 0 and ix.query([1]) == []
    # holder ids are reused: masks stay short
    ix.store(("c", 0), [1])
    assert ix._ids[("c", 0)] == 0


def test_chains_across_events_and_branches() -> None:
    ix = KVIndex()
    # one request's blocks in several events, interleaved with another request branching off its prefix
    ix.apply("a", batch(stored([1, 2]), stored([10, 11], parent=None)))
    ix.apply("a", batch(stored([3], parent=2), stored([12], parent=11)))
    ix.apply("b", batch(stored([1, 2]), stored([20, 21], parent=2)))
    ix.apply("a", batch(stored([4, 5], parent=3)))
    assert by_holder(ix, [1, 2, 3, 4, 5, 6]) == {A0: (5, 5, 5), B0: (2, 2, 2)}
    assert by_holder(ix, [1, 2, 20, 21]) == {A0: (2, 2, 2), B0: (4, 4, 4)}
    assert by_holder(ix, [10, 11, 12]) == {A0: (3, 3, 3)}
    ix.remove(A0, [3])
    ix.store(A0, [3], parent=2)  # re-stored after removal: a new place, same answer
    assert by_holder(ix, [1, 2, 3, 4, 5]) == {A0: (5, 5, 5), B0: (2, 2, 2)}


# --- sequence numbers -------------------------------------------------------------------------------------------------


def test_seq_gap_duplicate_restart() -> None:
    ix = KVIndex()
    pub = ("a", 0)
    assert ix.ingest("a", 10, batch(stored([1, 2]))) is None  # first contact: whatever seq
    assert ix.ingest("a", 11, batch(stored([3], parent=2))) is None
    gap = ix.ingest("a", 15, batch(stored([4], parent=3)))
    assert gap is not None and (gap.kind, gap.expected, gap.got, gap.missed) == ("gap", 12, 15, 3)
    assert ix.stats()["gaps"] == 1 and ix.stats()["missed_batches"] == 3
    # the missed batches, replayed, are accepted in any order
    assert ix.ingest("a", 12, batch()) is None
    assert ix.ingest("a", 14, batch()) is None
    assert ix.ingest("a", 13, batch()) is None
    assert ix.stats()["replayed"] == 3
    dup = ix.ingest("a", 15, batch(stored([99])))
    assert dup is not None and dup.kind == "duplicate"
    assert 99 not in ix  # a duplicate is not applied
    assert by_holder(ix, [1, 2, 3, 4]) == {A0: (4, 4, 4)}
    # seq going backwards outside any gap: the engine restarted and forgot everything
    restart = ix.ingest("a", 0, batch(stored([7])))
    assert restart is not None and restart.kind == "restart"
    assert ix.query([1, 2]) == [] and by_holder(ix, [7]) == {A0: (1, 1, 1)}
    assert ix.stats()["restarts"] == 1
    assert ix.ingest("a", 1, batch()) is None
    assert [g.kind for g in ix.gaps()] == ["gap", "duplicate", "restart"]
    assert ix.observe_seq(pub, 2) is None


def test_restart_resets_only_that_publisher() -> None:
    ix = KVIndex()
    ix.ingest("a", 5, batch(stored([1]), rank=0))
    ix.ingest("a", 8, batch(stored([1]), rank=1))
    ix.ingest("b", 3, batch(stored([1])))
    gap = ix.ingest("a", 0, batch(rank=1))
    assert gap is not None and gap.kind == "restart" and gap.publisher == ("a", 1)
    assert set(by_holder(ix, [1])) == {A0, B0}


def test_shared_endpoint_publisher_resets_all_its_ranks() -> None:
    """One endpoint publishing for two DP ranks: its restart forgets both."""
    ix = KVIndex()
    ix.ingest("a", 1, batch(stored([1]), rank=0), publisher="tcp://a:5557")
    ix.ingest("a", 2, batch(stored([2]), rank=1), publisher="tcp://a:5557")
    ix.ingest("b", 1, batch(stored([1])), publisher="tcp://b:5557")
    assert ix.ingest("a", 0, batch(), publisher="tcp://a:5557").kind == "restart"  # type: ignore[union-attr]
    assert by_holder(ix, [1]) == {B0: (1, 1, 1)} and 2 not in ix


# --- the LRU cap ------------------------------------------------------------------------------------------------------


def test_lru_cap_evicts_least_recently_stored() -> None:
    ix = KVIndex(max_entries=4)
    ix.store(A0, [1, 2, 3, 4])
    ix.store(B0, [1])  # a store by anyone refreshes the whole entry
    ix.remove(A0, [2])  # a removal doesn't refresh: 2 is still held by nobody else, so it is gone
    assert 2 not in ix and len(ix) == 3
    ix.store(A0, [5, 6], parent=4)
    assert len(ix) == 4 and ix.evictions == 1
    assert 3 not in ix and all(h in ix for h in (1, 4, 5, 6))
    ix.store(A0, [7])
    assert 4 not in ix and 1 in ix and ix.stats()["evictions"] == 2
    assert by_holder(ix, [1]) == {A0: (1, 1, 1), B0: (1, 1, 1)}
    assert by_holder(ix, [5, 6, 7]) == {A0: (3, 3, 3)}  # held is held, whatever chain it was stored in


def test_evict_batch_overshoots_by_design() -> None:
    ix = KVIndex(max_entries=10, evict_batch=3)
    ix.store(A0, list(range(11)))
    assert len(ix) == 7 and ix.evictions == 4
    assert [h for h in range(11) if h in ix] == list(range(4, 11))
    assert KVIndex(max_entries=10_000_000).evict_batch == 156_250
    with pytest.raises(ValueError):
        KVIndex(max_entries=0)


# --- against a brute-force model --------------------------------------------------------------------------------------


class Model:
    """Sets of hashes per (holder, tier), an OrderedDict for recency: the definition the index must agree with."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[tuple, set[int]] = {}
        self.recency: OrderedDict[int, None] = OrderedDict()

    def _alive(self, h: int) -> bool:
        return any(h in s for s in self.held.values())

    def store(self, holder, hashes, tier) -> None:
        for h in hashes:
            self.held.setdefault((holder, tier), set()).add(h)
            self.recency.pop(h, None)
            self.recency[h] = None

    def remove(self, holder, hashes, tier) -> None:
        s = self.held.get((holder, tier), set())
        for h in hashes:
            s.discard(h)
            if not self._alive(h):
                self.recency.pop(h, None)

    def clear(self, pred) -> None:
        for key in [k for k in self.held if pred(k[0])]:
            del self.held[key]
        for h in [h for h in self.recency if not self._alive(h)]:
            del self.recency[h]

    def evict(self) -> None:
        while len(self.recency) > self.cap:
            h, _ = self.recency.popitem(last=False)
            for s in self.held.values():
                s.discard(h)

    def query(self, hashes) -> dict:
        return brute_prefixes(self.held, hashes)


HOLDERS = [("a", 0), ("a", 1), ("b", 0)]
hash_st = st.integers(0, 12)
medium_st = st.sampled_from([None, "GPU", "CPU", "STORAGE"])
event_st = st.one_of(
    st.tuples(st.just("store"), st.lists(hash_st, min_size=1, max_size=5), st.none() | hash_st, medium_st),
    st.tuples(st.just("remove"), st.lists(hash_st, min_size=1, max_size=4), medium_st),
    st.tuples(st.just("clear")),
)
op_st = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(HOLDERS), st.lists(event_st, min_size=1, max_size=4)),
    st.tuples(st.just("drop"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("query"), st.lists(hash_st, max_size=8)),
)


def tier(medium) -> str:
    return "GPU" if medium in (None, "GPU") else "CPU"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(op_st, max_size=30), st.sampled_from([3, 6, 1000]))
def test_matches_brute_force_model(ops, cap) -> None:
    ix = KVIndex(max_entries=cap)
    model = Model(cap)
    for op in ops:
        if op[0] == "apply":
            _, holder, evs = op
            events = []
            for ev in evs:
                if ev[0] == "store":
                    events.append(stored(ev[1], ev[3], parent=ev[2]))
                    model.store(holder, ev[1], tier(ev[3]))
                elif ev[0] == "remove":
                    events.append(BlockRemoved(ev[1], ev[2]))
                    model.remove(holder, ev[1], tier(ev[2]))
                else:
                    events.append(AllBlocksCleared())
                    model.clear(lambda h, holder=holder: h == holder)
            ix.apply(holder[0], EventBatch(0.0, events, holder[1]))
            model.evict()
        elif op[0] == "drop":
            ix.drop_pod(op[1])
            model.clear(lambda h, pod=op[1]: h[0] == pod)
        else:
            assert by_holder(ix, op[1]) == model.query(op[1])
        assert len(ix) == len(model.recency)
        assert [h for h in range(13) if h in ix] == sorted(model.recency)
        for h in range(13):
            expect = {}
            for (holder, t), s in model.held.items():
                if h in s:
                    expect.setdefault(holder, set()).add(t)
            assert {k: set(v) for k, v in ix.holders_of(h).items()} == expect
    for q in ([], *(list(range(i, 13)) for i in range(13)), [3, 1, 2, 3, 1]):
        assert by_holder(ix, q) == model.query(q)
    # the index's own bookkeeping, and its recency order
    if isinstance(ix, PyKVIndex):  # runs and tails only for live blocks
        live = sum(len(s.hashes) - s.dead for s in ix._segs.values())
        assert live == len(ix)
        for h, seg in ix._tails.items():
            assert seg.hashes[-1] == h and ix._segs[seg.sid] is seg
        assert list(ix._where) == list(model.recency)
    else:  # table, recency list and mask references agree
        ix._core.check()
        assert ix._core.keys() == list(model.recency)


def test_holder_ids_follow_the_ids_version() -> None:
    ix = KVIndex()
    v0 = ix.ids_version
    ix.store(A0, [1, 2])
    ix.store(B0, [1])
    v1 = ix.ids_version
    assert v1 != v0 and ix.holder_ids([B0, A0, A1]).tolist() == [1, 0, -1]
    ix.store(A0, [3], parent=2)
    assert ix.ids_version == v1  # no holder came or went
    ix.apply("a", batch(AllBlocksCleared()))  # the holder restarts under a new id
    assert ix.ids_version != v1
    assert columns_by_holder(ix, [1, 2]) == {B0: (1, 1, 1)}
    assert KVIndex().ids_version != ix.ids_version  # unique across indexes: a cache keyed by it cannot mix them


def test_many_holders() -> None:
    """More holders than fit a machine word: masks are plain Python ints."""
    ix = KVIndex()
    chain = list(range(100, 140))
    for p in range(200):
        ix.store((f"pod-{p}", p % 4), chain[: p % 40 + 1], "GPU" if p % 3 else "CPU")
    got = by_holder(ix, chain)
    assert len(got) == 200
    for p in range(200):
        n = p % 40 + 1
        assert got[(f"pod-{p}", p % 4)] == ((n, n, n) if p % 3 else (n, 0, 0))
