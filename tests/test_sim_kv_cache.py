"""The engine core's block pool against a plain model of vLLM's free queue (a linked LRU list), and its C pool
against the Python one.

The Python pool keeps its free queue lazily (stamped segments, stale entries skipped or compacted away), the C pool as
a linked list; whatever each does inside, the order blocks are handed out and evicted in must be the linked list's,
over many hits and frees, and the two pools must agree call for call.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict

import pytest

from llmd.engines.sim import kv_cache
from llmd.engines.sim.block_pool import (
    NativeBlockPool,
    NativeCpuTier,
    PyBlockPool,
    PyCpuTier,
    native_h64_tuple,
    py_h64_tuple,
)
from llmd.engines.sim.kv_cache import KVCacheManager
from llmd.engines.sim.request import SimRequest
from llmd.kv.events import hash64
from llmd.kv.hashing import BlockHasher

# Without a compiler the C pool is not built and the simulated engine runs on the Python one; `make test` sets
# LLMD_REQUIRE_NATIVE=1 so a build that silently failed there cannot pass as "skipped".
if NativeBlockPool is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError("llmd.engines.sim._blockpool is not built (pip install -e . compiles it): see its output")
needs_native = pytest.mark.skipif(NativeBlockPool is None, reason="llmd.engines.sim._blockpool is not built")
POOLS = [pytest.param("python", id="python"), pytest.param("native", id="native", marks=needs_native)]


@pytest.fixture
def pool_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """KVCacheManagers made in the test use this pool."""
    kind = request.param
    monkeypatch.setattr(kv_cache, "make_pool", PyBlockPool if kind == "python" else NativeBlockPool)
    monkeypatch.setattr(kv_cache, "make_cpu_tier", PyCpuTier if kind == "python" else NativeCpuTier)
    return kind


class LinkedQueue:
    """vLLM's FreeKVCacheBlockQueue semantics over an OrderedDict, as the pool kept them before."""

    def __init__(self, n: int) -> None:
        self.q: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
        self.ref = [0] * n

    def take_hits(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.q[b]
            self.ref[b] += 1

    def pop(self, n: int) -> list[int]:
        out = [self.q.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def free(self, blocks: list[int], hashed: list[bool]) -> None:
        first = []
        for b, h in zip(blocks, hashed, strict=True):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if h:
                    self.q[b] = None
                else:
                    first.append(b)
        for b in reversed(first):
            self.q[b] = None
            self.q.move_to_end(b, last=False)


@pytest.mark.parametrize("pool_kind", POOLS, indirect=True)
def test_free_queue_order_matches_the_linked_list_through_hits_frees_and_compactions(pool_kind, monkeypatch) -> None:
    compactions = []
    compact = PyBlockPool._compact
    monkeypatch.setattr(PyBlockPool, "_compact", lambda self: (compactions.append(1), compact(self)))
    bs, n_blocks = 4, 40
    kv = KVCacheManager(n_blocks, bs)
    ref = LinkedQueue(n_blocks)
    hasher = BlockHasher(bs)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(bs * rng.randint(1, 5))] for _ in range(4)]
    live: list[SimRequest] = []
    for i in range(3000):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 12):
            req = live.pop(rng.randrange(len(live)))
            blocks = list(reversed(req.block_ids))
            hashed = [kv.block_hash[b] is not None for b in blocks]
            kv.free(req)
            ref.free(blocks, hashed)
        else:
            # Mostly a cached prefix and a token: hits that leave stale entries behind, few blocks popped.
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.choice((1, 1, 1, 9)))]
            req = SimRequest(f"r{i}", tokens, 1)
            req.init_engine_state(hasher, random.Random(i))
            hits, n_hit, _ = kv.get_computed_blocks(req)
            n_before = len(hits)
            if not kv.allocate_slots(req, req.num_tokens - n_hit, hits):
                continue
            ref.take_hits(hits)
            assert req.block_ids[n_before:] == ref.pop(len(req.block_ids) - n_before)
            live.append(req)
        assert kv.free_queue == list(ref.q)
        assert kv.num_free_blocks == len(ref.q)
        # What the decode planner reads: blocks it can take without evicting a cached one.
        limit = rng.choice((0, 3, 40))
        front = 0
        for b in list(ref.q)[:limit]:
            if kv.block_hash[b] is not None:
                break
            front += 1
        assert kv.unhashed_free_front(limit) == front
        kv.check_invariants(live)
    assert len(compactions) > 3 if pool_kind == "python" else not compactions


def _drive(kv: KVCacheManager, seed: int) -> list:
    """A random workload under eviction pressure (GPU and CPU tiers): the events it published, in order."""
    hasher = BlockHasher(kv.block_size)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(kv.block_size * rng.randint(2, 8))] for _ in range(6)]
    live: list[SimRequest] = []
    events: list = []
    for i in range(1500):
        if live and (rng.random() < 0.4 or kv.num_free_blocks < 16):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            req = SimRequest(f"r{i}", tokens, 1)
            req.init_engine_state(hasher, random.Random(i))
            hits, n_hit, _ = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - n_hit, hits):
                live.append(req)
        kv.flush_cpu_stores()
        events += kv.take_events()
    return events


@pytest.mark.parametrize("pool_kind", POOLS, indirect=True)
def test_coalesced_events_carry_the_same_hashes_in_the_same_order_and_leave_the_index_the_same(pool_kind) -> None:
    from llmd.kv.events import BlockRemoved, BlockStored
    from llmd.kv.index import KVIndex

    per_block = _drive(KVCacheManager(48, 4, num_cpu_blocks=40, event_token_ids=False), 3)
    coalesced = _drive(KVCacheManager(48, 4, num_cpu_blocks=40, event_token_ids=False, coalesce_events=True), 3)

    def flat(events: list) -> list[tuple[str, str | None, int]]:
        return [(type(e).__name__, e.medium, h) for e in events for h in e.block_hashes]

    assert flat(coalesced) == flat(per_block)
    removed = [e for e in coalesced if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    cpu_stored = [e for e in coalesced if isinstance(e, BlockStored) and e.medium == "CPU"]
    # The workload evicted runs of blocks and wrote CPU jobs of several blocks: coalescing had something to merge.
    assert any(len(e.block_hashes) > 1 for e in removed) and any(len(e.block_hashes) > 1 for e in cpu_stored)
    assert len(coalesced) < len(per_block)
    ix_a, ix_b = KVIndex(), KVIndex()
    ix_a.apply_events(("pod", 0), per_block)
    ix_b.apply_events(("pod", 0), coalesced)
    every = sorted({h for _, _, h in flat(per_block)})
    assert len(ix_a) == len(ix_b) > 0
    for h in every:
        assert ix_a.query([h]) == ix_b.query([h])


@needs_native
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_c_pool_answers_every_call_as_the_python_pool(seed: int) -> None:
    """Random calls on both pools, hashes shared by several blocks and evictions among them: the same answers, the
    same free queue, ref counts, block hashes and hash map after every call. Hashes come as the objects the pool
    holds or as equal copies (the C map compares by identity first, then by content)."""
    rng = random.Random(seed)
    n = 24
    py, c = PyBlockPool(n), NativeBlockPool(n)
    originals = [bytes([i]) * rng.choice((8, 16, 32)) for i in range(12)] + [b"\x01\x02", b""]
    hashes = originals + [bytes(bytearray(h)) for h in originals]  # equal, not identical
    held: list[list[int]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and py.n_free:
            k = rng.randint(1, min(5, py.n_free))
            got = py.take(k)
            assert c.take(k) == got
            held.append(got[0])
        elif op < 0.55 and held:
            blocks = held[rng.randrange(len(held))]
            hs = [rng.choice(hashes) for _ in blocks]
            assert c.cache(blocks, hs) == py.cache(blocks, hs) == [hash64(h) for h in hs]  # events' 64-bit form
        elif op < 0.7:
            chain = [rng.choice(hashes) for _ in range(rng.randint(0, 6))]
            m = rng.randint(0, 7)
            hits = py.lookup(chain, m)
            assert c.lookup(chain, m) == hits
            assert c.num_evictable(hits) == py.num_evictable(hits)
            if hits and rng.random() < 0.5:
                py.touch(hits)
                c.touch(hits)
                held.append(list(hits))
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            py.free_reversed(blocks)
            c.free_reversed(blocks)
        if rng.random() < 0.01 and py.n_free == n - 1:
            py.clear_hashes()
            c.clear_hashes()
        assert c.n_free == py.n_free
        assert c.free_queue() == py.free_queue()
        m = rng.randint(-1, n)
        assert c.unhashed_front(m) == py.unhashed_front(m)
        assert c.ref_counts() == py.ref_counts()
        assert c.hashes() == py.hashes()
        assert c.cached == py.cached
        probe = rng.choice([*hashes, b"absent"])
        assert (probe in c) == (probe in py)


@pytest.mark.parametrize("pool", [PyBlockPool, pytest.param(NativeBlockPool, marks=needs_native)])
def test_a_pool_refuses_calls_that_would_corrupt_it(pool) -> None:
    p = pool(4)
    with pytest.raises(ValueError, match="cannot take 4 blocks: 3 are free"):
        p.take(4)
    blocks, _ = p.take(2)
    p.free_reversed(blocks)
    with pytest.raises(ValueError, match="freed more often than referenced"):
        p.free_reversed([blocks[0]])
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        pool(1)
    if pool is NativeBlockPool:
        with pytest.raises(IndexError, match="out of range"):
            p.touch([0])


@needs_native
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_c_cpu_tier_answers_every_call_as_the_python_tier(seed: int) -> None:
    """Store jobs with hashes already held (protected from eviction), repeated within a job, or more than the tier
    holds; touches and runs: the same answers and the same LRU order after every call, also past many evictions
    (the C tier's table deletes by shifting entries back)."""
    rng = random.Random(seed)
    cap = rng.choice((5, 17, 64))
    py, c = PyCpuTier(cap), NativeCpuTier(cap)
    universe = [rng.randbytes(rng.choice((8, 16, 32))) for _ in range(4 * cap)]
    for _ in range(4000):
        op = rng.random()
        if op < 0.6:
            job = [rng.choice(universe) for _ in range(rng.randint(0, cap + 3))]
            assert c.store(job) == py.store(job)
        elif op < 0.8:
            hs = [rng.choice(universe) for _ in range(rng.randint(0, 8))]
            lo, hi = rng.randint(0, 4), rng.randint(0, 9)
            assert c.run(hs, lo, hi) == py.run(hs, lo, hi)
            c.touch(hs[lo:hi])
            py.touch(hs[lo:hi])
        else:
            h = rng.choice(universe)
            assert (h in c) == (h in py)
        assert len(c) == len(py) <= cap
        assert c.keys() == py.keys()
    assert all((h in c) == (h in py) for h in universe)


@pytest.mark.parametrize("tier", [PyCpuTier, pytest.param(NativeCpuTier, marks=needs_native)])
def test_a_store_job_passes_over_its_own_held_blocks_and_one_that_cannot_make_room_is_dropped(tier) -> None:
    a, b, c, d, e = (bytes([i]) * 8 for i in range(1, 6))
    t = tier(3)
    assert t.store([a, b, c]) == (None, [])
    # b is held and in the job: the victims are a and c (least recently used first), not b
    assert t.store([b, d, e]) == ([1, 2], [int.from_bytes(a, "big"), int.from_bytes(c, "big")])
    assert t.keys() == [b, d, e]
    assert t.store([b, d]) is None  # nothing new
    assert t.store([a, c, b"\x09" * 8, b"\x0a" * 8]) is None  # 4 new blocks never fit 3
    assert t.store([b, d, a, c]) is None  # b and d stay: e alone cannot make room for two (vLLM: no store)
    assert t.keys() == [b, d, e]
    t.touch([b])
    assert t.keys() == [d, e, b] and t.run([d, e, a], 0, 3) == 2


@needs_native
def test_the_c_64_bit_forms_are_hash64s() -> None:
    rng = random.Random(3)
    hashes: list[bytes | int] = [rng.randbytes(n) for n in (32, 8, 3, 0, 40)] + [7, 2**64 - 1]
    assert native_h64_tuple(hashes) == py_h64_tuple(hashes) == tuple(hash64(h) for h in hashes)
    assert native_h64_tuple(()) == ()
    with pytest.raises(TypeError, match="bytes"):
        native_h64_tuple(["not a hash"])
    with pytest.raises(TypeError, match="sequence"):
        native_h64_tuple(5)
