"""What every KV index implementation shares: the answer type, holder ids, publisher sequence tracking, counters.

The storage (which holder holds which block, in which tier, and the recency order) is the subclass's: the C core
(llmd/kv/index.py) or the pure-Python fallback (llmd/kv/pyindex.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from llmd.kv.events import EventBatch, KVCacheEvent

Holder = tuple[str, int]
GPU = "GPU"
CPU = "CPU"
# Media that mean GPU memory; everything else is the beyond-GPU tier.
_GPU_MEDIA = frozenset({None, "GPU", "gpu"})


class PrefixMatch(NamedTuple):
    """How much of a request one holder has cached, as a consecutive prefix of its blocks.

    blocks_any: leading blocks held in any tier; blocks_gpu: how many of those are in GPU;
    blocks_gpu_prefix: leading blocks held in GPU alone (<= blocks_gpu).
    """

    holder: Holder
    blocks_any: int
    blocks_gpu: int
    blocks_gpu_prefix: int


class PrefixColumns(NamedTuple):
    """`query`'s answer by holder id, for callers that want columns, not one PrefixMatch per holder: element i of
    each array is holder id i's match (0 where id i does not hold the first block; every holder that does has
    blocks_any >= 1). Each array has one more element than there are ids, a 0 at -1: `holder_ids` maps a holder the
    index does not know to -1, so `cols.blocks_any[index.holder_ids(holders)]` is aligned with `holders`."""

    blocks_any: np.ndarray
    blocks_gpu: np.ndarray
    blocks_gpu_prefix: np.ndarray


# Holder-id versions are unique across indexes, so a cache of `holder_ids` keyed by the version alone cannot mix
# two indexes up.
_ID_VERSIONS = itertools.count(1)


def new_ids_version() -> int:
    """A holder-id version no other holder-id mapping has had (Columns.holder_ids caches gathers by version)."""
    return next(_ID_VERSIONS)


@dataclass(frozen=True, slots=True)
class Gap:
    """A break in one publisher's sequence numbers.

    kind "gap": batches expected..got-1 were missed (ask the replay socket for them, starting at `expected`);
    "duplicate": got == the last seq seen, skip the batch; "restart": the seq went backwards outside any known gap,
    so the publisher restarted and everything it had told us was forgotten.
    """

    publisher: Hashable
    expected: int
    got: int
    kind: Literal["gap", "duplicate", "restart"]

    @property
    def missed(self) -> int:
        return self.got - self.expected if self.kind == "gap" else 0


class _SeqState:
    __slots__ = ("holders", "last", "missing")

    def __init__(self, last: int) -> None:
        self.last = last
        self.missing: list[list[int]] = []  # [lo, hi) ranges reported as gaps and not yet replayed
        self.holders: set[Holder] = set()


_MAX_MISSING_RANGES = 64


def default_evict_batch(max_entries: int) -> int:
    """1/64 of the cap from 65,536 entries on, exact (0) below: the pure-Python index pays a scan past its dict's
    deleted slots per eviction, so it evicts in batches; the C core keeps the same rule, so both agree."""
    return max_entries // 64 if max_entries >= 65_536 else 0


class IndexBase:
    """Holder ids (`_ids`, `_holders`, a heap of free ids: the lowest is reused first, which keeps masks short),
    sequence tracking and the counters. Subclasses store blocks: `apply_events`, `_clear_ids`, `query`, ..."""

    _ids: dict[Holder, int]
    _holders: list[Holder | None]
    _free: list[int]

    def _init_common(self, gap_log: int) -> None:
        self._ids = {}
        self._holders = []
        self._free = []
        self.ids_version = next(_ID_VERSIONS)  # changes whenever a holder gets or loses an id
        self._seq: dict[Hashable, _SeqState] = {}
        self._gaps: deque[Gap] = deque(maxlen=gap_log)
        # Per holder, how many updates it had (batches, bulk stores and removals, clears): a reader holding a
        # decision on a holder's cache (the router's wait for a prefix holder) re-decides when this moves.
        self._epochs: dict[Holder, int] = {}
        self.clears = 0
        self.batches = 0
        self.gap_count = 0
        self.missed_batches = 0
        self.duplicates = 0
        self.restarts = 0
        self.replayed = 0

    def _new_id(self, holder: Holder) -> int:
        if self._free:
            hid = heapq.heappop(self._free)
            self._holders[hid] = holder
        else:
            hid = len(self._holders)
            self._holders.append(holder)
        self._ids[holder] = hid
        self.ids_version = next(_ID_VERSIONS)
        return hid

    def _release_ids(self, ids: Sequence[int]) -> None:
        for hid in ids:
            holder = self._holders[hid]
            self._holders[hid] = None
            del self._ids[holder]  # type: ignore[arg-type]
            heapq.heappush(self._free, hid)
        self.ids_version = next(_ID_VERSIONS)

    def holders(self) -> list[Holder]:
        return sorted(self._ids)

    def holder_ids(self, holders: Iterable[Holder]) -> np.ndarray:
        """Each holder's id, -1 for one the index does not know (as `query_columns` reads it); valid until
        `ids_version` changes."""
        return np.fromiter(map(self._ids.get, holders, itertools.repeat(-1)), np.intp)

    def _columns_buffer(self) -> np.ndarray:
        """Zeroed rows for `query_columns`: one element per holder id, and the 0 at -1."""
        return np.zeros((3, len(self._holders) + 1), np.int64)

    # --- updates ----------------------------------------------------------------------------------------------------
    def apply_events(self, holder: Holder, events: Iterable[KVCacheEvent]) -> None:
        raise NotImplementedError

    def _clear_ids(self, ids: Sequence[int]) -> int:
        raise NotImplementedError

    def epoch(self, holder: Holder) -> int:
        """Moves with every update of what `holder` has (an event batch, a bulk store or removal, a clear, its pod
        dropped); stays while nothing about it was told. Evictions at the index's own entry cap do not move it."""
        return self._epochs.get(holder, 0)

    def _updated(self, holder: Holder) -> None:
        self._epochs[holder] = self._epochs.get(holder, 0) + 1

    def apply(self, pod: str, batch: EventBatch, publisher: Hashable | None = None) -> None:
        """Apply one publisher batch; the holder is (pod, the batch's DP rank or 0).

        `publisher` (default: the holder) names the sequence the batch belongs to, so a restart of that publisher
        resets what it told us.
        """
        holder = (pod, batch.data_parallel_rank or 0)
        if publisher is None:
            publisher = holder
        st = self._seq.get(publisher)
        if st is not None:
            st.holders.add(holder)
        self.batches += 1
        self.apply_events(holder, batch.events)

    def clear_holder(self, holder: Holder) -> int:
        """AllBlocksCleared: the holder forgets everything, GPU and CPU tier alike (a stale hit misroutes a request;
        a forgotten one only costs a routing preference). Returns how many entries it touched."""
        self.clears += 1
        self._updated(holder)
        hid = self._ids.get(holder)
        return self._clear_ids([hid]) if hid is not None else 0

    def drop_pod(self, pod: str) -> int:
        """A pod is gone: forget every DP rank of it, in one pass."""
        ids = [hid for h, hid in self._ids.items() if h[0] == pod]
        for h in [h for h in self._epochs if h[0] == pod]:
            self._updated(h)
        for st in self._seq.values():
            st.holders = {h for h in st.holders if h[0] != pod}
        return self._clear_ids(ids)

    # --- sequence tracking ------------------------------------------------------------------------------------------
    def observe_seq(self, publisher: Hashable, seq: int) -> Gap | None:
        """Check one publisher's next seq. None: apply the batch. A Gap of kind "gap": apply it, and replay the
        missed ones (their seqs are then accepted). "duplicate": skip it. "restart": the publisher's holders were
        reset; apply it."""
        st = self._seq.get(publisher)
        if st is None:
            self._seq[publisher] = _SeqState(seq)
            return None
        last = st.last
        if seq == last + 1:
            st.last = seq
            return None
        if seq > last:
            gap = Gap(publisher, last + 1, seq, "gap")
            st.missing.append([last + 1, seq])
            del st.missing[:-_MAX_MISSING_RANGES]
            st.last = seq
            self.gap_count += 1
            self.missed_batches += seq - last - 1
        elif self._fill(st, seq):
            self.replayed += 1
            return None
        elif seq == last:
            gap = Gap(publisher, last + 1, seq, "duplicate")
            self.duplicates += 1
        else:
            gap = Gap(publisher, last + 1, seq, "restart")
            self.restarts += 1
            self._clear_ids([self._ids[h] for h in st.holders if h in self._ids])
            st.holders = set()
            st.missing = []
            st.last = seq
        self._gaps.append(gap)
        return gap

    @staticmethod
    def _fill(st: _SeqState, seq: int) -> bool:
        for i, (lo, hi) in enumerate(st.missing):
            if lo <= seq < hi:
                if seq == lo:  # replays arrive in order: the common case just shrinks the range
                    st.missing[i][0] = lo + 1
                else:
                    st.missing[i : i + 1] = [[lo, seq], [seq + 1, hi]]
                st.missing = [r for r in st.missing if r[0] < r[1]]
                return True
        return False

    def ingest(self, pod: str, seq: int, batch: EventBatch, publisher: Hashable | None = None) -> Gap | None:
        """observe_seq + apply (skipping duplicates). The publisher defaults to (pod, the batch's DP rank)."""
        if publisher is None:
            publisher = (pod, batch.data_parallel_rank or 0)
        gap = self.observe_seq(publisher, seq)
        if gap is None or gap.kind != "duplicate":
            self.apply(pod, batch, publisher)
        return gap

    def gaps(self) -> list[Gap]:
        return list(self._gaps)

    # --- reads ------------------------------------------------------------------------------------------------------
    evictions: int
    blocks_stored: int
    blocks_removed: int
    max_entries: int

    def __len__(self) -> int:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self),
            "max_entries": self.max_entries,
            "holders": len(self._ids),
            "batches": self.batches,
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "clears": self.clears,
            "evictions": self.evictions,
            "gaps": self.gap_count,
            "missed_batches": self.missed_batches,
            "replayed": self.replayed,
            "duplicates": self.duplicates,
            "restarts": self.restarts,
        }
