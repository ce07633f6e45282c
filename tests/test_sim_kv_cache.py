"""The engine core's block pool against a plain model of vLLM's free queue (a linked LRU list).

KVCacheManager keeps its free queue lazily (stamped segments, stale entries skipped or compacted away); whatever it
does inside, the order blocks are handed out and evicted in must be the linked list's, over many hits and frees.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from llmd.engines.sim.kv_cache import KVCacheManager
from llmd.engines.sim.request import SimRequest
from llmd.kv.hashing import BlockHasher


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


def test_free_queue_order_matches_the_linked_list_through_hits_frees_and_compactions(monkeypatch) -> None:
    compactions = []
    compact = KVCacheManager._compact
    monkeypatch.setattr(KVCacheManager, "_compact", lambda self: (compactions.append(1), compact(self)))
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
        kv.check_invariants(live)
    assert len(compactions) > 3


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


def test_coalesced_events_carry_the_same_hashes_in_the_same_order_and_leave_the_index_the_same() -> None:
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
