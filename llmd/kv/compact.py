"""KV event batches as the decoder's fast path leaves them: packed records the C index core applies without a Python
object per event, and that still read as a list of events (decoded by msgspec, on first access).

Records (llmd/kv/_kvnative.c `scan`): per event a u64 header (kind | GPU-medium << 8 | array form << 9 | hashes << 32),
a u64 span (start | end << 32: the event's bytes in the payload) and its block hashes as u64.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from llmd.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    _ArrAllBlocksCleared,
    _ArrBlockRemoved,
    _ArrLazyBlockStored,
    _LazyBlockStored,
)

try:
    from llmd.kv._kvnative import scan
except ImportError:
    scan = None

# The types the typed lazy path decodes to, so a compact batch reads exactly as that path's would.
_MAP_EVENT = msgspec.msgpack.Decoder(_LazyBlockStored | BlockRemoved | AllBlocksCleared)
_ARR_EVENT = msgspec.msgpack.Decoder(_ArrLazyBlockStored | _ArrBlockRemoved | _ArrAllBlocksCleared)


class CompactEvents(Sequence[KVCacheEvent]):
    """The events of one batch: `records` for the index core, the events themselves decoded on demand."""

    __slots__ = ("_events", "_n", "payload", "records")

    def __init__(self, payload: Any, records: bytes, n: int) -> None:
        self.payload = payload
        self.records = records
        self._n = n
        self._events: list[KVCacheEvent] | None = None

    def _decode(self) -> list[KVCacheEvent]:
        if self._events is None:
            hdr = memoryview(self.records).cast("Q")
            payload = bytes(self.payload)
            evs = []
            i = 0
            while i < len(hdr):
                h, span = hdr[i], hdr[i + 1]
                raw = payload[span & 0xFFFFFFFF : span >> 32]
                evs.append((_ARR_EVENT if h >> 9 & 1 else _MAP_EVENT).decode(raw))
                i += 2 + (h >> 32)
            self._events = evs
        return self._events

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        return self._decode()[i]

    def __iter__(self) -> Iterator[KVCacheEvent]:
        return iter(self._decode())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, CompactEvents)):
            return self._decode() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CompactEvents({self._decode()!r})"
