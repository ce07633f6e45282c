"""Which engine holds which KV block, in which tier: the state behind precise prefix-aware routing. Pure, deterministic.

Built from the engines' own KV events (llmd.kv.events). A holder is `(pod, dp_rank)`: every DP rank of an engine has
its own KV cache and its own publisher, so each is routed to separately.

Tiers: holder id i owns two adjacent bits of a block's holder mask, GPU at 2i and CPU at 2i+1. "CPU" stands for every
tier beyond GPU memory: vLLM's "CPU" and "STORAGE" media (and any medium other than GPU) land there. Medium None means
GPU, as in vLLM. A block held in both tiers counts as GPU.

Bounded memory: at most `max_entries` hashes. Recency is store order: a store (by any holder) makes its blocks the
most recent, so eviction takes the least recently stored blocks, whole entries (every holder, both tiers) at a time,
`evict_batch` more than the excess each time the cap is exceeded (checked after each batch of events). Removals and
queries do not refresh recency: the cap is a safety net (engines report their own evictions as BlockRemoved), sized
above the fleet's total KV capacity in blocks so it only bites when removals are lost. Hybrid models' `group_idx` is
not distinguished: a hash is a hash. Hashes are 64-bit ints (`hash64`); the C core keys them modulo 2**64.

Storage: a C core (llmd/kv/_kvnative.c: a slab of 20-byte entries, a 4-byte-slot hash table, interned holder masks;
~27 bytes an entry, >1M events/s decoded and applied, see benchmarks/kv_identity.py), or, where it is not built, the
pure-Python index of llmd/kv/pyindex.py with the same semantics. `KVIndex` is the C one when it is there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from llmd.kv.compact import CompactEvents
from llmd.kv.events import CLEARED, REMOVED, STORED, KVCacheEvent
from llmd.kv.indexbase import (
    _GPU_MEDIA,
    CPU,
    GPU,
    Gap,
    Holder,
    IndexBase,
    PrefixColumns,
    PrefixMatch,
    default_evict_batch,
)
from llmd.kv.pyindex import PyKVIndex

try:
    from llmd.kv._kvnative import Core
except ImportError:  # no compiler where llmd was installed: the pure-Python index serves
    Core = None

__all__ = [
    "CPU",
    "GPU",
    "AnyKVIndex",
    "Gap",
    "Holder",
    "KVIndex",
    "NativeKVIndex",
    "PrefixColumns",
    "PrefixMatch",
    "PyKVIndex",
]


class NativeKVIndex(IndexBase):
    """Block hash -> holders and tiers, fed by KV events; answers each holder's cached prefix of a request.

    Updates: `apply`/`ingest` per event batch (`ingest` also checks the publisher's sequence numbers),
    `apply_events` per holder, `store`/`remove` in bulk (index builds, simulators), `clear_holder`, `drop_pod`.
    Reads: `query` (or `query_columns` with `holder_ids`), `holders_of`, `len`, `in`, `holders`, `stats`, `gaps`.
    """

    def __init__(self, max_entries: int = 10_000_000, *, evict_batch: int | None = None, gap_log: int = 1024) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if Core is None:
            raise RuntimeError("llmd.kv._kvnative is not built (pip install -e .); use PyKVIndex")
        self._init_common(gap_log)
        batch = default_evict_batch(max_entries) if evict_batch is None else evict_batch
        self._core = Core(max_entries, batch, self._holders, PrefixMatch)
        self._order_stale = True

    # The cap and the counters live in the core.
    @property
    def max_entries(self) -> int:  # type: ignore[override]
        return self._core.max_entries

    @max_entries.setter
    def max_entries(self, value: int) -> None:
        self._core.max_entries = value

    @property
    def evict_batch(self) -> int:
        return self._core.evict_batch

    @evict_batch.setter
    def evict_batch(self, value: int) -> None:
        self._core.evict_batch = value

    @property
    def evictions(self) -> int:  # type: ignore[override]
        return self._core.counters[0]

    @property
    def blocks_stored(self) -> int:  # type: ignore[override]
        return self._core.counters[1]

    @property
    def blocks_removed(self) -> int:  # type: ignore[override]
        return self._core.counters[2]

    def _id(self, holder: Holder) -> int:
        hid = self._ids.get(holder)
        if hid is None:
            hid = self._new_id(holder)
            self._core.ensure_holders(len(self._holders))
            self._order_stale = True
        return hid

    # --- updates ----------------------------------------------------------------------------------------------------
    def apply_events(self, holder: Holder, events: Iterable[KVCacheEvent]) -> None:
        g = 2 * self._id(holder)
        core = self._core
        if type(events) is CompactEvents:  # straight from the decoder's fast path: records the core reads itself
            records = events.records
            off = core.apply_records(records, 0, g)
            while off >= 0:  # an AllBlocksCleared: the holder restarts under a new id
                self.clear_holder(holder)
                g = 2 * self._id(holder)
                off = core.apply_records(records, off, g)
        else:
            gpu_media = _GPU_MEDIA
            for ev in events:
                kind = ev.kind
                if kind == STORED:
                    core.store(ev.block_hashes, g if ev.medium in gpu_media else g + 1)  # type: ignore[attr-defined]
                elif kind == REMOVED:
                    core.remove(ev.block_hashes, g if ev.medium in gpu_media else g + 1)  # type: ignore[attr-defined]
                elif kind == CLEARED:
                    self.clear_holder(holder)
                    g = 2 * self._id(holder)
        self._updated(holder)
        core.evict()

    def store(
        self, holder: Holder, block_hashes: Sequence[int], medium: str | None = GPU, parent: int | None = None
    ) -> None:
        """The bulk path: one run of consecutive blocks (`parent`: the block before the first), in one tier."""
        g = 2 * self._id(holder)
        self._updated(holder)
        self._core.store(block_hashes, g if medium in _GPU_MEDIA else g + 1)
        self._core.evict()

    def remove(self, holder: Holder, block_hashes: Iterable[int], medium: str | None = GPU) -> None:
        hid = self._ids.get(holder)
        if hid is not None:
            self._updated(holder)
            self._core.remove(block_hashes, 2 * hid + (0 if medium in _GPU_MEDIA else 1))

    def _clear_ids(self, ids: Sequence[int]) -> int:
        """Forget every block of these holder ids, both tiers: one pass over the entries."""
        if not ids:
            return 0
        self._release_ids(ids)
        self._order_stale = True
        return self._core.clear(list(ids))

    # --- reads ------------------------------------------------------------------------------------------------------
    def query(self, block_hashes: Sequence[int]) -> list[PrefixMatch]:
        """For every holder of the first block, its longest consecutive cached prefix; longest first, then most in
        GPU, then by holder."""
        if self._order_stale:
            self._core.set_order([hid for _, hid in sorted(self._ids.items())])
            self._order_stale = False
        return self._core.query(block_hashes)

    def query_columns(self, block_hashes: Sequence[int]) -> PrefixColumns:
        """`query`'s answer by holder id (PrefixColumns): the same walk, without a PrefixMatch per holder or a sort."""
        out = self._columns_buffer()
        self._core.query_into(block_hashes, out)
        return PrefixColumns(out[0], out[1], out[2])

    def holders_of(self, block_hash: int) -> dict[Holder, tuple[str, ...]]:
        """Who holds one block, and in which tiers ("GPU", "CPU")."""
        out: dict[Holder, tuple[str, ...]] = {}
        holders = self._holders
        for b in self._core.bits_of(block_hash):
            h = holders[b >> 1]
            out[h] = (*out.get(h, ()), CPU if b & 1 else GPU)  # type: ignore[index]
        return out

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, block_hash: object) -> bool:
        return self._core.contains(block_hash)

    def nbytes(self) -> int:
        """Bytes the core's arrays take (entries, table, masks), allocated capacity included."""
        return self._core.nbytes()


# What an annotation names: either index (KVIndex is a variable, the class chosen at import, so no type).
AnyKVIndex = NativeKVIndex | PyKVIndex

KVIndex: type[NativeKVIndex] | type[PyKVIndex] = (
    NativeKVIndex if Core is not None and not os.environ.get("LLMD_KV_PURE_PYTHON") else PyKVIndex
)
