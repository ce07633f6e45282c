"""Codec for vLLM's KV cache events: ZMQ frames <-> msgspec structs. Pure: no sockets, no clocks.

Wire format (vllm/distributed/kv_events.py): frames `[topic, seq (8-byte big-endian), payload]`, payload msgpack
`[ts, [events...], data_parallel_rank]`. vLLM 0.32 encodes each event as a map tagged by "type" with defaulted
trailing fields omitted; older vLLM (and the llm-d reference) encode each event as a tagged array. Both decode here.

Decoded block hashes are always 64-bit ints, the form vLLM publishes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1):
a full-digest bytes hash is reduced to `int.from_bytes(digest, "big") & (2**64 - 1)`, so the index has one key type.
The full digest is not kept: the int form is all an int-mode engine ever publishes, so nothing downstream can use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import msgspec

MASK64 = (1 << 64) - 1
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# Event kinds, a class attribute so consumers dispatch on an int instead of isinstance chains.
STORED = 0
REMOVED = 1
CLEARED = 2
KIND_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")

REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)

BytesLike = bytes | bytearray | memoryview


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three event types; the msgpack "type" tag is the class name, as in vLLM."""

    kind: ClassVar[int] = -1


class BlockStored(KVCacheEvent):
    """Blocks that became cached, in order along one request's chain.

    Field order, defaults and tag mirror vLLM 0.32 exactly: that is what makes `encode_batch(form="map")`
    byte-identical to vLLM's publisher. `token_ids` is a `msgspec.Raw` (undecoded msgpack, holding on to the payload
    it came in) on events decoded by a `KVEventDecoder(token_ids=False)`; `tokens()` decodes it on demand.
    """

    kind: ClassVar[int] = STORED
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def tokens(self) -> list[int]:
        t = self.token_ids
        if type(t) is msgspec.Raw:
            return _TOKENS_DECODER.decode(t)
        return t


class BlockRemoved(KVCacheEvent):
    kind: ClassVar[int] = REMOVED
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    kind: ClassVar[int] = CLEARED


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish: every event of one engine step."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class DecodedBatch(NamedTuple):
    topic: str
    seq: int
    batch: EventBatch


# --- decode-side variants -------------------------------------------------------------------------------------------
# Subclasses so that `isinstance(ev, BlockStored)` and `ev.kind` hold whatever form an event arrived in. Decoding
# 64-token blocks' token ids costs ~3x the rest of an event, and the index never reads them: the lazy variants keep
# them as msgspec.Raw, which msgspec skips without building ints.


class _LazyBlockStored(BlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw  # type: ignore[assignment]


# Older vLLM: tagged arrays. Fields that versions before `medium`/`lora_name` lacked get defaults here, so their
# shorter arrays decode; extra trailing elements from newer versions are ignored by msgspec.
class _ArrBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _ArrLazyBlockStored(_ArrBlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw  # type: ignore[assignment]


class _ArrBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    medium: str | None = None


class _ArrAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class _MapLazyBatch(EventBatch):
    events: list[_LazyBlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class _ArrBatch(EventBatch):
    events: list[_ArrBlockStored | _ArrBlockRemoved | _ArrAllBlocksCleared]  # type: ignore[assignment]


class _ArrLazyBatch(EventBatch):
    events: list[_ArrLazyBlockStored | _ArrBlockRemoved | _ArrAllBlocksCleared]  # type: ignore[assignment]


class _RawBatch(EventBatch):
    events: list[msgspec.Raw]  # type: ignore[assignment]


_MAP_UNION = BlockStored | BlockRemoved | AllBlocksCleared
_ARR_UNION = _ArrBlockStored | _ArrBlockRemoved | _ArrAllBlocksCleared
_PLAIN = {STORED: BlockStored, REMOVED: BlockRemoved, CLEARED: AllBlocksCleared}
_ARRAY = {STORED: _ArrBlockStored, REMOVED: _ArrBlockRemoved, CLEARED: _ArrAllBlocksCleared}
_KNOWN_TAGS = frozenset(KIND_NAMES)
_TOKENS_DECODER = msgspec.msgpack.Decoder(list[int])
_ANY_DECODER = msgspec.msgpack.Decoder()
_RAW_BATCH_DECODER = msgspec.msgpack.Decoder(_RawBatch)
_ENCODER = msgspec.msgpack.Encoder()
_ERROR_TEXT_MAX = 300


def hash64(block_hash: int | bytes) -> int:
    """The 64-bit int form of a block hash, as vLLM publishes it in int mode."""
    if type(block_hash) is int:
        return block_hash
    return int.from_bytes(block_hash, "big") & MASK64


def to_plain(event: KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The plain map-form event class with token ids decoded: what you compare decoded events against."""
    plain = _PLAIN[event.kind]
    if type(event) is plain:
        return event  # type: ignore[return-value]
    fields = list(msgspec.structs.astuple(event))
    if event.kind == STORED and type(fields[2]) is msgspec.Raw:
        fields[2] = _TOKENS_DECODER.decode(fields[2])
    return plain(*fields)


def _to_array(event: KVCacheEvent) -> KVCacheEvent:
    arr = _ARRAY[event.kind]
    if isinstance(event, arr):
        return event
    return arr(*msgspec.structs.astuple(event))


def _to_map(event: KVCacheEvent) -> KVCacheEvent:
    # Lazy map-form events re-encode their Raw token ids verbatim, so only array-form ones need converting.
    if type(event) in _ARRAY_TYPES:
        return _PLAIN[event.kind](*msgspec.structs.astuple(event))
    return event


_ARRAY_TYPES = frozenset({_ArrBlockStored, _ArrLazyBlockStored, _ArrBlockRemoved, _ArrAllBlocksCleared})


def encode_batch(
    events: Iterable[KVCacheEvent],
    ts: float,
    dp_rank: int | None = 0,
    form: Literal["map", "array"] = "map",
) -> bytes:
    """A payload as vLLM publishes it: form="map" is vLLM 0.32 (byte-identical), "array" the older tagged arrays.

    Hashes are written as given (ints, or bytes for a bytes-mode engine).
    """
    if form == "map":
        evs = [_to_map(e) for e in events]
    elif form == "array":
        evs = [_to_array(e) for e in events]
    else:
        raise ValueError(f"form must be 'map' or 'array', got {form!r}")
    return _ENCODER.encode(EventBatch(float(ts), evs, dp_rank))


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [topic.encode("utf-8"), seq.to_bytes(8, "big"), payload]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the publisher's replay ROUTER to get every buffered batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def _strip_delimiter(frames: Sequence[BytesLike]) -> Sequence[BytesLike]:
    # A DEALER receives the ROUTER's empty delimiter frame in front of (topic, seq, payload).
    if len(frames) == 4 and len(frames[0]) == 0:
        return frames[1:]
    return frames


def is_replay_end(frames: Sequence[BytesLike]) -> bool:
    """The replay socket's end marker `(b"", -1 as 8 signed bytes, b"")`, with or without the DEALER delimiter."""
    frames = _strip_delimiter(frames)
    return len(frames) == 3 and len(frames[0]) == 0 and frames[1] == REPLAY_END_SEQ and len(frames[2]) == 0


def _norm_hashes(value: Any) -> Any:
    if type(value) is list:
        return [int.from_bytes(h, "big") & MASK64 if type(h) is bytes else h for h in value]
    return value


class KVEventDecoder:
    """Decodes KV event frames, counting (never raising) whatever is malformed.

    The fast path is one typed msgspec decode per batch, in the form (map or array) the last batch came in.
    Anything else (the other form, bytes hashes, unknown tags, bad fields) falls back to decoding event by event,
    which keeps every good event of a batch and counts the bad ones.
    """

    def __init__(self, *, token_ids: bool = False) -> None:
        self.token_ids = token_ids
        if token_ids:
            self._map = msgspec.msgpack.Decoder(_MapBatch)
            self._arr = msgspec.msgpack.Decoder(_ArrBatch)
        else:
            self._map = msgspec.msgpack.Decoder(_MapLazyBatch)
            self._arr = msgspec.msgpack.Decoder(_ArrLazyBatch)
        self._fast = self._map
        self._other = self._arr
        # The C fast path (llmd/kv/compact.py): plain batches straight into records the index core applies; it
        # declines (None) anything else, which the typed path below then decodes and judges.
        self._scan = None
        if not token_ids:
            global _CompactEvents
            from llmd.kv.compact import CompactEvents, scan

            self._scan = scan
            _CompactEvents = CompactEvents
        self.batches = 0
        self.kind_counts = [0, 0, 0]
        self.unknown_tags: dict[str, int] = {}
        self.bad_events = 0
        self.garbage: dict[str, int] = {}
        self.replay_ends = 0
        self.errors = 0  # garbage frames plus bad events: one number a consumer can watch for change
        self.last_error: str | None = None

    @property
    def garbage_frames(self) -> int:
        return sum(self.garbage.values())

    @property
    def events(self) -> dict[str, int]:
        return dict(zip(KIND_NAMES, self.kind_counts, strict=True))

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "events": self.events,
            "unknown_tags": dict(self.unknown_tags),
            "bad_events": self.bad_events,
            "garbage_frames": self.garbage_frames,
            "garbage": dict(self.garbage),
            "replay_ends": self.replay_ends,
            "last_error": self.last_error,
        }

    def _garbage(self, reason: str, text: str) -> None:
        self.errors += 1
        self.garbage[reason] = self.garbage.get(reason, 0) + 1
        self.last_error = f"{reason}: {text}"[:_ERROR_TEXT_MAX]

    def decode_frames(self, frames: Sequence[BytesLike]) -> DecodedBatch | None:
        """`[topic, seq, payload]` (or a DEALER's `[b"", topic, seq, payload]`) -> DecodedBatch, None if unusable."""
        try:
            frames = _strip_delimiter(frames)
            if len(frames) != 3:
                self._garbage("frame_count", f"expected 3 frames, got {len(frames)}")
                return None
            topic, seq_b, payload = frames
            if len(seq_b) != 8:
                self._garbage("seq", f"sequence frame has {len(seq_b)} bytes, expected 8")
                return None
            if seq_b == REPLAY_END_SEQ and len(payload) == 0:
                self.replay_ends += 1
                return None
            batch = self.decode_payload(payload)
            if batch is None:
                return None
            return DecodedBatch(str(topic, "utf-8", "replace"), int.from_bytes(seq_b, "big"), batch)
        except Exception as exc:  # a consumer loop must survive any input; the text says what happened
            self._garbage("frames", f"{type(exc).__name__}: {exc}")
            return None

    def decode_payload(self, payload: BytesLike) -> EventBatch | None:
        if self._scan is not None:
            got = self._scan(payload)
            if got is not None:
                return self._compact(payload, got)
        try:
            try:
                b = self._fast.decode(payload)
            except msgspec.ValidationError:
                try:
                    b = self._other.decode(payload)
                except msgspec.ValidationError:
                    return self._decode_slow(payload)
                # Publishers don't switch forms mid-stream: make the form that worked the first try.
                self._fast, self._other = self._other, self._fast
            evs = b.events
            counts = self.kind_counts
            if self.token_ids and self._fast is self._arr:
                evs = [to_plain(e) for e in evs]
            for e in evs:
                counts[e.kind] += 1
            self.batches += 1
            return EventBatch(b.ts, evs, b.data_parallel_rank)
        except msgspec.DecodeError as exc:
            self._garbage("msgpack", str(exc))
        except Exception as exc:
            self._garbage("payload", f"{type(exc).__name__}: {exc}")
        return None

    def _compact(self, payload: BytesLike, got: tuple) -> EventBatch:
        ts, rank, records, stored, removed, cleared = got
        counts = self.kind_counts
        counts[STORED] += stored
        counts[REMOVED] += removed
        counts[CLEARED] += cleared
        self.batches += 1
        return EventBatch(ts, _CompactEvents(payload, records, stored + removed + cleared), rank)  # type: ignore[arg-type]

    def _decode_slow(self, payload: BytesLike) -> EventBatch | None:
        try:
            raw = _RAW_BATCH_DECODER.decode(payload)
        except msgspec.ValidationError as exc:
            self._garbage("batch_shape", str(exc))
            return None
        evs = []
        counts = self.kind_counts
        for r in raw.events:
            try:
                ev = self._decode_event(r)
            except Exception as exc:  # one odd event must not cost the rest of the batch
                self._bad_event(f"{type(exc).__name__}: {exc}")
                continue
            if ev is not None:
                evs.append(ev)
                counts[ev.kind] += 1
        self.batches += 1
        return EventBatch(raw.ts, evs, raw.data_parallel_rank)

    def _decode_event(self, raw: msgspec.Raw) -> KVCacheEvent | None:
        """One event of a batch the typed fast path refused: generic decode, normalise hashes, then validate."""
        try:
            obj = _ANY_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            self._bad_event(str(exc))
            return None
        if type(obj) is dict:
            tag = obj.get("type")
            target: Any = _MAP_UNION
            known = type(tag) is str and tag in _KNOWN_TAGS
            if known and "block_hashes" in obj:
                obj["block_hashes"] = _norm_hashes(obj["block_hashes"])
                if type(obj.get("parent_block_hash")) is bytes:
                    obj["parent_block_hash"] = hash64(obj["parent_block_hash"])
        elif type(obj) is list and obj:
            tag = obj[0]
            target = _ARR_UNION
            known = type(tag) is str and tag in _KNOWN_TAGS
            if known and len(obj) > 1:
                obj[1] = _norm_hashes(obj[1])
                if tag == "BlockStored" and len(obj) > 2 and type(obj[2]) is bytes:
                    obj[2] = hash64(obj[2])
        else:
            self._bad_event(f"event is neither a tagged map nor a tagged array: {obj!r}"[:_ERROR_TEXT_MAX])
            return None
        if not known:
            key = tag[:64] if type(tag) is str else repr(tag)[:64]
            self.unknown_tags[key] = self.unknown_tags.get(key, 0) + 1
            self.last_error = f"unknown_tag: {key}"
            return None
        try:
            ev = msgspec.convert(obj, target)
        except msgspec.ValidationError as exc:
            self._bad_event(f"{tag}: {exc}")
            return None
        return to_plain(ev) if self.token_ids else ev

    def _bad_event(self, text: str) -> None:
        self.errors += 1
        self.bad_events += 1
        self.last_error = f"bad_event: {text}"[:_ERROR_TEXT_MAX]


_CompactEvents: Any = None  # llmd.kv.compact.CompactEvents, imported by the first decoder (it imports this module)
_DEFAULT_DECODER = KVEventDecoder()


def decode_frames(frames: Sequence[BytesLike]) -> DecodedBatch | None:
    """Module-level convenience on a shared decoder (its counters are `default_decoder()`'s)."""
    return _DEFAULT_DECODER.decode_frames(frames)


def default_decoder() -> KVEventDecoder:
    return _DEFAULT_DECODER
