"""The block stores under KVCacheManager: the GPU block pool (ref counts, vLLM's LRU free queue, each block's hash and
the hash -> block map) and the CPU tier (an LRU set of block hashes). Two implementations of each with the same
results: the C ones (`_blockpool.c`, built by `pip install -e .`) and `PyBlockPool`/`PyCpuTier` here, where it is not
built or `LLMD_BLOCK_POOL_PURE_PYTHON=1`.

Why in C: their work is per block (a 195K-token context is ~3,000 blocks of 64 tokens, each referenced and freed
again every turn, and every block a P/D hand-off lands is written through to the CPU tier); at 544 engine ranks
Python's per-block loops were a third of the cluster simulator's time, and 544 tiers of 39K blocks as OrderedDicts
~1.8 GB (~32 bytes a block in C).

The queue's order is vLLM's FreeKVCacheBlockQueue (tests/test_sim_kv_cache.py holds both to a plain linked list):
`take` hands out the front; `free_reversed` returns a request's blocks tail first, hashed ones to the back, unhashed
ones (which can never serve a hit) to the front in order; `touch` on a free block (a prefix hit) takes it out.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any, Protocol

from llmd.kv.events import MASK64, hash64


class BlockPoolLike(Protocol):
    num_blocks: int

    @property
    def cached(self) -> dict[bytes, Any]: ...  # the hash -> block map (the C pool's: a copy, made when read)
    @property
    def n_free(self) -> int: ...
    def __contains__(self, h: object) -> bool: ...
    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]: ...
    def num_evictable(self, blocks: Sequence[int]) -> int: ...
    def touch(self, blocks: Sequence[int]) -> None: ...
    def take(self, k: int) -> tuple[list[int], list[int]]: ...
    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> list[int]: ...
    def free_reversed(self, blocks: Sequence[int]) -> None: ...
    def free_queue(self) -> list[int]: ...
    def unhashed_front(self, limit: int) -> int: ...
    def ref_counts(self) -> list[int]: ...
    def hashes(self) -> list[bytes | None]: ...
    def clear_hashes(self) -> None: ...


class CpuTierLike(Protocol):
    capacity: int

    def __len__(self) -> int: ...
    def __contains__(self, h: object) -> bool: ...
    def run(self, hashes: Sequence[bytes], start: int, stop: int) -> int: ...
    def touch(self, hashes: Sequence[bytes]) -> None: ...
    def store(self, hashes: Sequence[bytes]) -> tuple[list[int] | None, list[int]] | None: ...
    def keys(self) -> list[bytes]: ...


def py_h64_list(hashes: Sequence[bytes]) -> list[int]:
    """Each hash's 64-bit form, as vLLM publishes it in int mode (llmd.kv.events.hash64 for bytes)."""
    from_bytes = int.from_bytes
    return [from_bytes(h, "big") & MASK64 for h in hashes]


class PyBlockPool:
    """The pure-Python pool. Block ids index parallel lists: cheaper than block objects.

    The free queue is kept lazily: segments [stamp, next index, blocks] in queue order, one per free (its unhashed
    blocks in one at the front). A block is in the queue at the entry whose stamp is `_stamp[block]` while its ref
    count is 0: a prefix hit takes it out, and freeing it again moves it, by setting a number, where a linked queue
    costs a node operation per block each time. Stale entries are skipped when the front reaches them, or dropped when
    they pile up (_compact)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._stamp = [0] * num_blocks
        self._segs: deque[list[Any]] = deque([[0, 0, list(range(1, num_blocks))]])
        self._next_stamp = 1
        self._n_free = num_blocks - 1
        self._entries = num_blocks - 1  # unread segment entries, valid or stale
        # hash -> block id, or {block id: None} when several blocks hold the same hash (rare; first one serves hits).
        self.cached: dict[bytes, int | dict[int, None]] = {}

    @property
    def n_free(self) -> int:
        return self._n_free

    def __contains__(self, h: object) -> bool:
        return h in self.cached

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        # One lookup per block in C (map), past the first miss too: prompts mostly hit most of their blocks.
        found = list(map(self.cached.get, hashes[:max_blocks] if max_blocks < len(hashes) else hashes))
        blocks: list = found[: found.index(None)] if None in found else found
        if dict in set(map(type, blocks)):  # a hash held by several blocks: the first one serves the hit
            blocks = [v if type(v) is int else next(iter(v)) for v in blocks]
        return blocks

    def num_evictable(self, blocks: Sequence[int]) -> int:
        return list(map(self.ref_cnt.__getitem__, blocks)).count(0)

    def touch(self, blocks: Sequence[int]) -> None:
        ref_cnt = self.ref_cnt
        # Taking a free block's reference takes it out of the free queue (its entry goes stale).
        n_free = self._n_free
        for b in blocks:
            if ref_cnt[b] == 0:
                n_free -= 1
            ref_cnt[b] += 1
        self._n_free = n_free

    def take(self, k: int) -> tuple[list[int], list[int]]:
        if not 0 <= k <= self._n_free:
            raise ValueError(f"cannot take {k} blocks: {self._n_free} are free")
        ref_cnt = self.ref_cnt
        stamps = self._stamp
        segs = self._segs
        out: list[int] = []
        need = k
        while need:
            seg = segs[0]
            stamp, i, blocks = seg
            start, m = i, len(blocks)
            while i < m:
                b = blocks[i]
                i += 1
                if ref_cnt[b] == 0 and stamps[b] == stamp:
                    ref_cnt[b] = 1
                    out.append(b)
                    need -= 1
                    if not need:
                        break
            self._entries -= i - start
            if i >= m:
                segs.popleft()
            else:
                seg[1] = i
        self._n_free -= k
        block_hash = self.block_hash
        hashed = [b for b in out if block_hash[b] is not None]
        if not hashed:
            return out, []
        cached = self.cached
        hashes = [block_hash[b] for b in hashed]
        for b, h in zip(hashed, hashes, strict=True):  # evicted in the order handed out
            v = cached.get(h)  # type: ignore[arg-type]
            if v is not None:
                if type(v) is int:
                    if v == b:
                        del cached[h]  # type: ignore[arg-type]
                else:
                    v.pop(b, None)  # type: ignore[union-attr]
                    if len(v) == 1:  # type: ignore[arg-type]
                        cached[h] = next(iter(v))  # type: ignore[arg-type, call-overload]
            block_hash[b] = None
        return out, py_h64_list(hashes)  # type: ignore[arg-type]

    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> list[int]:
        cached = self.cached
        block_hash = self.block_hash
        fresh = None
        olds = list(map(block_hash.__getitem__, blocks))
        if olds.count(None) == len(olds) and cached.keys().isdisjoint(hashes):
            fresh = dict(zip(hashes, blocks, strict=True))
        if fresh is not None and len(fresh) == len(blocks):
            # The usual case, fresh blocks with distinct hashes not cached elsewhere: the map in one C call.
            cached.update(fresh)
            for b, h in zip(blocks, hashes, strict=True):
                block_hash[b] = h
        else:
            for b, h in zip(blocks, hashes, strict=True):
                if block_hash[b] is None:
                    block_hash[b] = h
                    v = cached.get(h)
                    if v is None:
                        cached[h] = b
                    elif type(v) is int:
                        if v != b:
                            cached[h] = {v: None, b: None}
                    else:
                        v[b] = None
        return py_h64_list(hashes)

    def free_reversed(self, blocks: Sequence[int]) -> None:
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        stamps = self._stamp
        stamp = self._next_stamp
        self._next_stamp = stamp + 1
        first: list[int] = []
        tail: list[int] = []
        for b in reversed(blocks):
            rc = ref_cnt[b] - 1
            if rc < 0:
                raise ValueError(f"block {b} freed more often than referenced")
            ref_cnt[b] = rc
            if rc == 0:
                stamps[b] = stamp
                if block_hash[b] is None:
                    first.append(b)
                else:
                    tail.append(b)  # cached blocks join the tail: least recently used goes first
        if tail:
            self._segs.append([stamp, 0, tail])
        if first:
            # Unhashed blocks can never serve a hit: at the head, in order, to be reused first.
            self._segs.appendleft([stamp, 0, first])
        n = len(first) + len(tail)
        self._n_free += n
        self._entries += n
        if self._entries > 2 * self.num_blocks:
            self._compact()

    def _iter_free(self) -> Iterator[int]:
        ref_cnt, stamps = self.ref_cnt, self._stamp
        for stamp, i, blocks in self._segs:
            for b in blocks[i:]:
                if ref_cnt[b] == 0 and stamps[b] == stamp:
                    yield b

    def _compact(self) -> None:
        """The free queue as one segment of its valid entries: stale ones (blocks hit or freed again since) go."""
        blocks = list(self._iter_free())
        stamp = self._next_stamp
        self._next_stamp = stamp + 1
        stamps = self._stamp
        for b in blocks:
            stamps[b] = stamp
        self._segs = deque([[stamp, 0, blocks]])
        self._entries = len(blocks)

    def free_queue(self) -> list[int]:
        return list(self._iter_free())

    def unhashed_front(self, limit: int) -> int:
        """How many blocks at the free queue's front, at most `limit`, hold no hash (taking them evicts nothing)."""
        n = 0
        block_hash = self.block_hash
        for b in self._iter_free():
            if n >= limit or block_hash[b] is not None:
                break
            n += 1
        return n

    def ref_counts(self) -> list[int]:
        return list(self.ref_cnt)

    def hashes(self) -> list[bytes | None]:
        return list(self.block_hash)

    def clear_hashes(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks


class PyCpuTier:
    """The CPU tier in Python: an OrderedDict of hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def run(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        # One C-level lookup per block, past the first miss too: runs are mostly long.
        found = list(map(self._lru.__contains__, hashes[max(start, 0) : stop]))
        return found.index(False) if False in found else len(found)

    def touch(self, hashes: Sequence[bytes]) -> None:
        lru = self._lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)

    def store(self, hashes: Sequence[bytes]) -> tuple[list[int] | None, list[int]] | None:
        """One store job: see _blockpool.c's CpuTier.store."""
        lru = self._lru
        kept: list[int] | None = None
        new = hashes
        if not lru.keys().isdisjoint(hashes):
            kept = [i for i, h in enumerate(hashes) if h not in lru]
            new = [hashes[i] for i in kept]
        n_new = len(new)
        n_evict = len(lru) + n_new - self.capacity
        if not n_new or (n_evict > 0 and n_new > self.capacity):
            return None
        victims: list[bytes] = []
        if n_evict > 0:
            # The job's hashes already in the tier must stay (vLLM protects them): look past at most those.
            victims = list(islice(lru, n_evict + len(hashes) - n_new))
            if kept is not None:
                protected = set(hashes)
                victims = [h for h in victims if h not in protected][:n_evict]
                if len(victims) < n_evict:
                    return None  # the job's own held blocks leave too little to evict: vLLM stores none of it
            for h in victims:
                del lru[h]
        lru.update(dict.fromkeys(new))
        return kept, py_h64_list(victims)

    def keys(self) -> list[bytes]:
        return list(self._lru)


try:
    if os.environ.get("LLMD_BLOCK_POOL_PURE_PYTHON") == "1":
        raise ImportError("LLMD_BLOCK_POOL_PURE_PYTHON=1")
    from llmd.engines.sim._blockpool import BlockPool as NativeBlockPool
    from llmd.engines.sim._blockpool import CpuTier as NativeCpuTier
    from llmd.engines.sim._blockpool import h64_tuple as native_h64_tuple
except ImportError:  # no compiler where llmd was installed (or asked not to): the pure-Python ones serve
    NativeBlockPool = NativeCpuTier = native_h64_tuple = None


def py_h64_tuple(hashes: Sequence[bytes | int]) -> tuple[int, ...]:
    """Each hash's 64-bit form (llmd.kv.events.hash64: bytes converted, ints kept)."""
    return tuple(map(hash64, hashes))


h64_tuple: Callable[[Sequence[bytes | int]], tuple[int, ...]] = native_h64_tuple or py_h64_tuple


def make_pool(num_blocks: int) -> BlockPoolLike:
    """The C pool where it is built, else the Python one."""
    if NativeBlockPool is not None:
        return NativeBlockPool(num_blocks)  # type: ignore[no-any-return]
    return PyBlockPool(num_blocks)


def make_cpu_tier(capacity: int) -> CpuTierLike:
    """The C tier where it is built, else the Python one."""
    if NativeCpuTier is not None:
        return NativeCpuTier(capacity)  # type: ignore[no-any-return]
    return PyCpuTier(capacity)


__all__ = [
    "BlockPoolLike",
    "CpuTierLike",
    "NativeBlockPool",
    "NativeCpuTier",
    "PyBlockPool",
    "PyCpuTier",
    "make_cpu_tier",
    "make_pool",
]
