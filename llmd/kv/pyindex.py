"""The pure-Python KV index: the fallback where the C core (llmd/kv/_kvnative.c) is not built, with the same
semantics (tests/test_kv_index.py runs both against a brute-force model and against each other).

Layout: masks live in runs (`_Seg`), the blocks of one chain in order, appended as the engine reports them (a
BlockStored whose parent is a run's last block extends that run); a dict maps each hash to its run and offset. A query
finds the run of its first block and compares the request against it a slice at a time. Tiers: holder id i owns two
adjacent bits of a Python-int mask, GPU at 2i and CPU at 2i+1. The hash dict's insertion order is the recency order:
a store re-inserts its hashes at the end, eviction takes them from the front.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, groupby, islice
from typing import Any

import numpy as np

from llmd.kv.events import CLEARED, REMOVED, STORED, BlockStored, KVCacheEvent
from llmd.kv.indexbase import _GPU_MEDIA, CPU, GPU, Holder, IndexBase, PrefixColumns, PrefixMatch, default_evict_batch


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    """Length of the common prefix of two equally long lists that differ and agree on their first element.

    By slice compares (C speed); a run usually parts from the request at its very end, where a chain branched.
    """
    k = len(a)
    if a[: k - 1] == b[: k - 1]:
        return k - 1
    lo, hi = 1, k - 1  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _bits(mask: int) -> Iterable[int]:
    """Positions of the set bits of `mask`, lowest first (through its binary digits: C speed, no bigint per bit)."""
    digits = bin(mask)[:1:-1]
    return compress(range(len(digits)), map(_ONE, digits))


_ONE = "1".__eq__
_DIGIT_ONE = ord("1")


class _Walk:
    """Per-holder bookkeeping of one query, kept per group of holders whose walk has been the same so far.

    Holders are keyed by their GPU bit position (2 * id); masks hold both bits of every holder. A group is a mask of
    GPU bits with (start of its current GPU run or -1, GPU blocks in finished runs, first non-GPU position or -1):
    a request's blocks are mostly held by many holders alike (a shared system prompt), so a change of the matching
    set splits a few groups with big-int operations instead of touching every holder.
    """

    __slots__ = ("alive", "alive_even", "ended", "even", "groups")

    def __init__(self, m: int, even: int) -> None:
        self.even = even
        gpu = m & even
        self.alive_even = alive_even = (m | (m >> 1)) & even
        self.alive = alive_even | (alive_even << 1)
        self.groups: list[tuple[int, int, int, int]] = []
        if gpu:
            self.groups.append((gpu, 0, 0, -1))
        if alive_even & ~gpu:
            self.groups.append((alive_even & ~gpu, -1, 0, 0))
        self.ended: list[tuple[int, int, int, int]] = []  # (GPU bits, blocks_any, blocks_gpu, blocks_gpu_prefix)

    def change(self, i: int, mm: int) -> int:
        """Block i's mask (restricted to the alive holders) differs from block i-1's; returns the new alive mask."""
        even = self.even
        new_gpu = mm & even
        new_even = (mm | (mm >> 1)) & even
        groups = []
        ended = self.ended
        for mask, start, total, prefix in self.groups:
            gone = mask & ~new_even
            if gone:
                if start >= 0:
                    ended.append((gone, i, total + i - start, prefix if prefix >= 0 else i))
                else:
                    ended.append((gone, i, total, prefix))
            on = mask & new_gpu
            off = mask & new_even & ~new_gpu
            if start >= 0:  # in a GPU run until now
                if on:
                    groups.append((on, start, total, prefix))
                if off:
                    groups.append((off, -1, total + i - start, prefix if prefix >= 0 else i))
            else:
                if on:
                    groups.append((on, i, total, prefix))
                if off:
                    groups.append((off, -1, total, prefix))
        self.groups = groups
        self.alive_even = new_even
        self.alive = new_even | (new_even << 1)
        return self.alive

    def finish(self, n: int) -> None:
        """The walk reached block n (the request's end, or nobody is left): every group has ended."""
        if self.alive_even:
            self.change(n, 0)

    def result(self, n: int, holders: list[Holder | None], order: list[tuple[int, Holder]]) -> list[PrefixMatch]:
        """The matches, longest first, then most in GPU, then by holder; `order`: (GPU bit, holder) of every holder
        in holder order, read through for a group of many holders (a few are sorted instead)."""
        self.finish(n)
        by_len: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for mask, blocks_any, blocks_gpu, prefix in self.ended:
            by_len.setdefault((blocks_any, blocks_gpu), []).append((mask, prefix))
        out: list[PrefixMatch] = []
        new = tuple.__new__
        many = len(order) // 8
        for (blocks_any, blocks_gpu), parts in sorted(by_len.items(), reverse=True):
            if len(parts) == 1 and parts[0][0].bit_count() > many:
                mask, prefix = parts[0]
                out += [new(PrefixMatch, (h, blocks_any, blocks_gpu, prefix)) for b, h in order if mask & b]
                continue
            got = sorted((holders[b >> 1], prefix) for mask, prefix in parts for b in _bits(mask))
            out += [new(PrefixMatch, (h, blocks_any, blocks_gpu, prefix)) for h, prefix in got]
        return out


_OFF_BITS = 32
_OFF_MASK = (1 << _OFF_BITS) - 1


class _Seg:
    """A run of blocks that follow each other in one chain, stored contiguously so a query reads them in order.

    Dead blocks (removed from every holder, or evicted) keep their slot as (None, 0) until the whole run dies.
    """

    __slots__ = ("base", "dead", "hashes", "masks", "sid", "ubit", "union")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.base = sid << _OFF_BITS
        self.hashes: list[int | None] = []
        self.masks: list[int] = []
        self.dead = 0  # counted where blocks die, so the store path touches no counter
        self.union = 0  # OR of every mask ever stored here: clears skip runs a holder never touched
        self.ubit = 0  # the bit last ORed into `union`


class PyKVIndex(IndexBase):
    """Block hash -> holders and tiers, fed by KV events; answers each holder's cached prefix of a request.

    Updates: `apply`/`ingest` per event batch (`ingest` also checks the publisher's sequence numbers),
    `apply_events` per holder, `store`/`remove` in bulk (index builds, simulators), `clear_holder`, `drop_pod`.
    Reads: `query` (or `query_columns` with `holder_ids`), `holders_of`, `len`, `in`, `holders`, `stats`, `gaps`.
    Hashes are 64-bit ints (`hash64`).
    """

    def __init__(self, max_entries: int = 10_000_000, *, evict_batch: int | None = None, gap_log: int = 1024) -> None:
        """`evict_batch`: extra entries evicted each time the cap is exceeded. Finding the oldest entry means
        scanning past the dict's deleted slots at its front, so large indexes evict in batches to pay that scan
        once per batch; by default 1/64 of the cap from 65,536 entries on, exact (0) below.
        """
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.evict_batch = default_evict_batch(max_entries) if evict_batch is None else evict_batch
        # hash -> (segment id << 32 | offset); insertion order is recency order
        self._where: dict[int, int] = {}
        self._segs: dict[int, _Seg] = {}
        self._tails: dict[int, _Seg] = {}  # hash of a run's last (live) block -> the run: where chains grow
        self._next_sid = 1  # from 1, so a packed location is never a cached small int (stores test identity)
        self._even = 0  # the GPU bit of every id ever allocated
        self._bit_objs: list[tuple[int, int]] = []
        self._order: list[tuple[int, Holder]] | None = None  # (GPU bit, holder) by holder: queries' tie order
        self.evictions = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self._init_common(gap_log)

    # --- holders ----------------------------------------------------------------------------------------------------
    def _id(self, holder: Holder) -> int:
        hid = self._ids.get(holder)
        if hid is None:
            hid = self._new_id(holder)
            self._even |= 1 << (2 * hid)
            self._order = None
        return hid

    def _bits_of(self, holder: Holder) -> tuple[int, int]:
        """The holder's (GPU, CPU) bits, the same int objects every call: runs recognise their last writer by
        identity."""
        hid = self._id(holder)
        bits = self._bit_objs
        while len(bits) <= hid:
            g = 1 << (2 * len(bits))
            bits.append((g, g << 1))
        return bits[hid]

    # --- updates ----------------------------------------------------------------------------------------------------
    def apply_events(self, holder: Holder, events: Iterable[KVCacheEvent]) -> None:
        gbit, cbit = self._bits_of(holder)
        gpu_media = _GPU_MEDIA
        where = self._where
        setdefault = where.setdefault
        segs = self._segs
        tails = self._tails
        tails_pop = tails.pop
        stored = removed = 0
        for ev in events:
            kind = ev.kind
            if kind == STORED:
                bit = gbit if ev.medium in gpu_media else cbit  # type: ignore[attr-defined]
                hashes = ev.block_hashes  # type: ignore[attr-defined]
                parent = ev.parent_block_hash  # type: ignore[attr-defined]
                stored += len(hashes)
                if hashes and hashes[0] in where:
                    # Known from the start (another engine's copy, a CPU-tier write of a GPU block): block by block.
                    self._store_slow(hashes, parent, bit)
                    continue
                # The common case, kept lean: every block is new and extends the run that ends at the parent (a new
                # run when there is none), each taking the next offset of that run as its location.
                seg = tails_pop(parent, None)
                if seg is None:
                    seg = _Seg(self._next_sid)
                    self._next_sid += 1
                hs = seg.hashes
                ms = seg.masks
                n0 = len(hs)
                base = seg.base
                for h in hashes:
                    cand = base | len(hs)
                    if setdefault(h, cand) is not cand:
                        break
                    hs.append(h)
                    ms.append(bit)
                else:
                    if hashes:
                        if not n0:
                            segs[seg.sid] = seg
                        if seg.ubit is not bit:  # bits are per-holder constants: mostly the run's last writer
                            seg.union |= bit
                            seg.ubit = bit
                        tails[h] = seg
                    elif n0:
                        tails[parent] = seg
                    continue
                # A known block: take back the blocks that went in and go block by block.
                for h in hs[n0:]:
                    del where[h]
                del hs[n0:]
                del ms[n0:]
                if n0:
                    tails[parent] = seg
                self._store_slow(hashes, parent, bit)
            elif kind == REMOVED:
                removed += self._remove(ev.block_hashes, gbit if ev.medium in gpu_media else cbit)  # type: ignore[attr-defined]
            elif kind == CLEARED:
                self.clear_holder(holder)
                # clear_holder freed the id; later events of this batch belong to the holder's new id
                gbit, cbit = self._bits_of(holder)
        self.blocks_stored += stored
        self.blocks_removed += removed
        self._updated(holder)
        if len(where) > self.max_entries:
            self._evict()

    def _store_slow(self, hashes: Sequence[int], parent: int | None, bit: int) -> None:
        # Known blocks gain the bit and move to the recent end, a stretch at a time where the request follows a stored
        # run (a prompt re-stored by another engine: its shared prefix is mostly known); new ones are appended to the
        # run whose last block is the previous block. `seg` is that run (the cursor), its tail entry taken out.
        where = self._where
        get = where.get
        setdefault = where.setdefault
        segs = self._segs
        tails = self._tails
        tails_pop = tails.pop
        seg = tails_pop(parent, None)
        i, n = 0, len(hashes)
        while i < n:
            loc = get(hashes[i])
            if loc is None:  # new blocks, up to the next known one: onto the cursor run, or a new one
                if seg is None:
                    seg = _Seg(self._next_sid)
                    self._next_sid += 1
                hs = seg.hashes
                ms = seg.masks
                base = seg.base
                n0 = len(hs)
                while i < n:
                    h = hashes[i]
                    cand = base | len(hs)
                    if setdefault(h, cand) is not cand:
                        break
                    hs.append(h)
                    ms.append(bit)
                    i += 1
                if not n0:
                    segs[seg.sid] = seg
                seg.union |= bit
                tails[hs[-1]] = seg  # type: ignore[index]
                seg = None
                continue
            if seg is not None:  # the cursor run gets nothing more: its tail goes back
                if seg.hashes:
                    tails[seg.hashes[-1]] = seg  # type: ignore[index]
                seg = None
            kseg = segs[loc >> _OFF_BITS]
            off = loc & _OFF_MASK
            khs = kseg.hashes
            kms = kseg.masks
            m = min(n - i, len(khs) - off)
            k = 1
            if m > 1:
                a = list(hashes[i : i + m])
                b = khs[off : off + m]
                k = m if a == b else _common_prefix(a, b)
            base = kseg.base
            for t in range(k):
                h = hashes[i + t]
                del where[h]
                where[h] = base | (off + t)
                mm = kms[off + t]
                if not mm & bit:
                    kms[off + t] = mm | bit
                    kseg.union |= bit
            i += k
            last = off + k - 1
            if last == len(khs) - 1:  # a run's last block: what follows can extend that run
                tails_pop(khs[last], None)
                seg = kseg
        if seg is not None and seg.hashes:
            tails[seg.hashes[-1]] = seg  # type: ignore[index]

    def store(
        self, holder: Holder, block_hashes: Sequence[int], medium: str | None = GPU, parent: int | None = None
    ) -> None:
        """The bulk path: one run of consecutive blocks (`parent`: the block before the first), in one tier."""
        self.apply_events(holder, (BlockStored(block_hashes, parent, [], 0, None, medium, None),))

    def remove(self, holder: Holder, block_hashes: Iterable[int], medium: str | None = GPU) -> None:
        hid = self._ids.get(holder)
        if hid is not None:
            self._updated(holder)
            self.blocks_removed += self._remove(block_hashes, 1 << (2 * hid + (0 if medium in _GPU_MEDIA else 1)))

    def _remove(self, hashes: Iterable[int], bit: int) -> int:
        # Only the mask changes: a removal from one holder doesn't make a block recent.
        n = 0
        keep = ~bit
        where = self._where
        get = where.get
        segs = self._segs
        for h in hashes:
            loc = get(h)
            if loc is None:
                continue
            s = segs[loc >> _OFF_BITS]
            off = loc & _OFF_MASK
            ms = s.masks
            m = ms[off]
            if m & bit:
                m &= keep
                if m:
                    ms[off] = m
                else:
                    del where[h]
                    self._kill(s, off, h)
                n += 1
        return n

    def _kill(self, s: _Seg, off: int, h: int) -> None:
        """Forget one block whose `where` entry is already gone."""
        hs = s.hashes
        if off == len(hs) - 1:
            self._tails.pop(h, None)
        hs[off] = None
        s.masks[off] = 0
        self._settle(s, 1)

    def _evict(self) -> None:
        where = self._where
        segs = self._segs
        tails = self._tails
        victims = list(islice(where, len(where) - self.max_entries + self.evict_batch))
        pop = where.pop
        # Victims come oldest first, so neighbours in a run mostly go together: settle the count once per run.
        s: _Seg | None = None
        dead = 0
        for h in victims:
            loc = pop(h)
            sid = loc >> _OFF_BITS
            if s is None or sid != s.sid:
                if s is not None:
                    self._settle(s, dead)
                s = segs[sid]
                dead = 0
            off = loc & _OFF_MASK
            hs = s.hashes
            if off == len(hs) - 1:
                tails.pop(h, None)
            hs[off] = None
            s.masks[off] = 0
            dead += 1
        if s is not None:
            self._settle(s, dead)
        self.evictions += len(victims)

    def _settle(self, s: _Seg, dead: int) -> None:
        s.dead += dead
        if s.dead == len(s.hashes):
            del self._segs[s.sid]

    def _clear_ids(self, ids: Sequence[int]) -> int:
        """Forget every block of these holder ids, both tiers: one pass over the runs they appear in."""
        if not ids:
            return 0
        mask = 0
        for hid in ids:
            mask |= 3 << (2 * hid)
        self._release_ids(ids)
        self._order = None
        keep = ~mask
        where = self._where
        touched = 0
        for s in list(self._segs.values()):
            if not s.union & mask:
                continue
            ms = s.masks
            hs = s.hashes
            union = 0
            for off, m in enumerate(ms):
                if m & mask:
                    touched += 1
                    m &= keep
                    if m:
                        ms[off] = m
                    else:
                        h = hs[off]
                        del where[h]  # type: ignore[arg-type]
                        self._kill(s, off, h)  # type: ignore[arg-type]
                union |= m
            s.union = union
            s.ubit = 0
        return touched

    # --- queries ----------------------------------------------------------------------------------------------------
    def query(self, block_hashes: Sequence[int]) -> list[PrefixMatch]:
        """For every holder of the first block, its longest consecutive cached prefix; longest first."""
        st = self._walk(block_hashes)
        if st is None:
            return []
        order = self._order
        if order is None:
            order = self._order = [(1 << (2 * hid), h) for h, hid in sorted(self._ids.items())]
        return st.result(len(block_hashes), self._holders, order)

    def query_columns(self, block_hashes: Sequence[int]) -> PrefixColumns:
        """`query`'s answer by holder id (PrefixColumns), a group of holders at a time."""
        out = self._columns_buffer()
        st = self._walk(block_hashes)
        if st is not None:
            st.finish(len(block_hashes))
            for mask, blocks_any, blocks_gpu, prefix in st.ended:
                # the mask's GPU bits (2 * id) from its binary digits, lowest first: C speed, no bigint per holder
                ids = np.flatnonzero(np.frombuffer(bin(mask)[:1:-1].encode(), np.uint8) == _DIGIT_ONE) >> 1
                out[0, ids] = blocks_any
                out[1, ids] = blocks_gpu
                out[2, ids] = prefix
        return PrefixColumns(out[0], out[1], out[2])

    def _walk(self, block_hashes: Sequence[int]) -> _Walk | None:
        """The walk behind both query forms; None when nobody holds the first block.

        The request is matched against stored runs a slice at a time (C-speed list compares and run-length grouping
        of the masks); per-holder work happens only where the set of matching holders or their tiers change, and
        the walk stops as soon as no holder is left.
        """
        req = block_hashes if type(block_hashes) is list else list(block_hashes)
        n = len(req)
        if not n:
            return None
        where_get = self._where.get
        segs = self._segs
        loc = where_get(req[0])
        if loc is None:
            return None
        s = segs[loc >> _OFF_BITS]
        off = loc & _OFF_MASK
        m = s.masks[off]
        even = self._even
        st = _Walk(m, even)
        prev = m
        alive = st.alive
        pos = 0
        while True:
            hs = s.hashes
            k = min(len(hs) - off, n - pos)
            a = hs[off : off + k]
            b = req[pos : pos + k]
            # the run usually parts from the request at its last block, where a chain branched: look there first
            matched = k if a[-1] == b[-1] and a == b else _common_prefix(a, b)
            ms = s.masks[off : off + matched]
            if ms.count(prev) != matched:  # somebody's holding or tier changes along this stretch
                p = pos
                for v, g in groupby(ms):
                    mm = v & alive
                    if mm != prev:
                        alive = st.change(p, mm)
                        if not alive:
                            break
                        prev = mm
                    p += len(list(g))
                if not alive:
                    break
            pos += matched
            if pos >= n:
                break
            loc = where_get(req[pos])
            if loc is None:
                st.change(pos, 0)
                break
            s = segs[loc >> _OFF_BITS]
            off = loc & _OFF_MASK
        return st

    def holders_of(self, block_hash: int) -> dict[Holder, tuple[str, ...]]:
        """Who holds one block, and in which tiers ("GPU", "CPU")."""
        loc = self._where.get(block_hash)
        if loc is None:
            return {}
        m = self._segs[loc >> _OFF_BITS].masks[loc & _OFF_MASK]
        out: dict[Holder, tuple[str, ...]] = {}
        for b in _bits((m | (m >> 1)) & self._even):
            g = m >> b & 1
            c = m >> (b + 1) & 1
            out[self._holders[b >> 1]] = (GPU, CPU) if g and c else (GPU,) if g else (CPU,)  # type: ignore[index]
        return out

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._where
