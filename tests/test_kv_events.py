"""The KV event codec: both wire forms, byte equality with vLLM's own encoder, garbage counted and never raised."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.kv.events import (
    MASK64,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecoder,
    decode_frames,
    encode_batch,
    encode_frames,
    hash64,
    is_replay_end,
    replay_request,
    to_plain,
)
from llmd.kv.index import KVIndex

H1, H2, H3 = 0xFFFF_FFFF_FFFF_FFFF, 2**63 + 5, 12345


def stored(hashes=(H1, H2), parent=None, medium="GPU", **kw) -> BlockStored:
    return BlockStored(list(hashes), parent, list(range(16 * len(hashes))), 16, None, medium, None, **kw)


SAMPLE = [
    stored(),
    stored([H3], parent=H2, medium="CPU", group_idx=1, kv_cache_spec_kind="full", extra_keys=[("salt",)]),
    BlockRemoved([H1], "GPU"),
    BlockRemoved([H3], None, group_idx=0),
    AllBlocksCleared(),
]


def plain(batch: EventBatch) -> list:
    return [to_plain(e) for e in batch.events]


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("token_ids", [False, True])
def test_round_trip(form: str, token_ids: bool) -> None:
    dec = KVEventDecoder(token_ids=token_ids)
    out = dec.decode_frames(encode_frames("kv@pod-a", 7, encode_batch(SAMPLE, 1.25, 3, form=form)))
    assert out is not None
    assert out.topic == "kv@pod-a" and out.seq == 7
    assert out.batch.ts == 1.25 and out.batch.data_parallel_rank == 3
    assert plain(out.batch) == SAMPLE
    assert [e.kind for e in out.batch.events] == [0, 0, 1, 1, 2]
    assert all(isinstance(e, type(s)) for e, s in zip(out.batch.events, SAMPLE, strict=True))
    assert dec.events == {"BlockStored": 2, "BlockRemoved": 2, "AllBlocksCleared": 1}
    assert dec.batches == 1 and dec.garbage_frames == 0 and dec.bad_events == 0
    if token_ids:  # the exact public classes, comparable as they are
        assert out.batch.events == SAMPLE
    else:  # token ids stay undecoded until asked for
        assert isinstance(out.batch.events[0].token_ids, msgspec.Raw)
        assert out.batch.events[0].tokens() == list(range(32))


def test_lazy_map_events_reencode_byte_identically() -> None:
    payload = encode_batch(SAMPLE, 2.5, 0)
    batch = KVEventDecoder().decode_payload(payload)
    assert batch is not None
    assert encode_batch(batch.events, 2.5, 0) == payload


@pytest.mark.parametrize("form", ["map", "array"])
def test_forms_switch_mid_stream(form: str) -> None:
    dec = KVEventDecoder()
    other = "array" if form == "map" else "map"
    for f in (form, other, other, form):
        b = dec.decode_payload(encode_batch(SAMPLE, 1.0, 0, form=f))
        assert b is not None and plain(b) == SAMPLE
    assert dec.garbage_frames == 0 and dec.bad_events == 0 and dec.batches == 4


def test_map_form_wire_shape() -> None:
    """vLLM 0.32: each event a map tagged "type", defaulted trailing fields left out."""
    raw = msgspec.msgpack.decode(encode_batch([stored([1, 2]), BlockRemoved([3], None), AllBlocksCleared()], 1.5, 0))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": None}
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_array_form_wire_shape() -> None:
    raw = msgspec.msgpack.decode(
        encode_batch([stored([1]), BlockRemoved([3], "CPU"), AllBlocksCleared()], 1.5, 0, "array")
    )
    assert raw[1][0][:8] == ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None]
    assert raw[1][1][:3] == ["BlockRemoved", [3], "CPU"]
    assert raw[1][2] == ["AllBlocksCleared"]


def test_old_array_form_without_trailing_fields() -> None:
    """Older vLLM: BlockStored before `medium`/`lora_name` existed, BlockRemoved before `medium`; no DP rank."""
    payload = msgspec.msgpack.encode(
        [3.0, [["BlockStored", [H1, H2], None, [1, 2, 3], 16, None], ["BlockRemoved", [H1]], ["AllBlocksCleared"]]]
    )
    dec = KVEventDecoder()
    b = dec.decode_payload(payload)
    assert b is not None and b.data_parallel_rank is None
    s, r, c = b.events
    assert s.block_hashes == [H1, H2] and s.medium is None and s.lora_name is None and s.tokens() == [1, 2, 3]
    assert r.block_hashes == [H1] and r.medium is None
    assert isinstance(c, AllBlocksCleared)
    assert dec.garbage_frames == 0 and dec.bad_events == 0


def test_unknown_fields_are_ignored() -> None:
    """Newer vLLM: unknown keys in the map form, extra trailing elements in the array form."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "locality": "LOCAL",
        "some_future_field": {"x": [1, 2]},
    }
    arr = ["BlockRemoved", [2], "CPU", 0, "REMOTE", "owner", "a", "future", 1, [2]]
    for payload in (msgspec.msgpack.encode([1.0, [ev], 0]), msgspec.msgpack.encode([1.0, [arr], 0, "future"])):
        dec = KVEventDecoder()
        b = dec.decode_payload(payload)
        assert b is not None and len(b.events) == 1, dec.stats()
        assert dec.garbage_frames == 0 and dec.bad_events == 0
    b = KVEventDecoder().decode_payload(msgspec.msgpack.encode([1.0, [ev], 0]))
    assert b is not None and b.events[0].locality == "LOCAL"


@pytest.mark.parametrize("form", ["map", "array"])
def test_bytes_hashes_become_64_bit_ints(form: str) -> None:
    digest = bytes(range(32))
    parent = bytes(range(100, 132))
    events = [
        BlockStored([digest, digest[::-1]], parent, [1], 1, None, "GPU", None),
        BlockRemoved([digest], "CPU"),
    ]
    dec = KVEventDecoder()
    b = dec.decode_payload(encode_batch(events, 1.0, 0, form=form))
    assert b is not None, dec.stats()
    s, r = b.events
    low = int.from_bytes(digest, "big") & MASK64
    assert s.block_hashes == [low, int.from_bytes(digest[::-1], "big") & MASK64]
    assert s.parent_block_hash == hash64(parent) == int.from_bytes(parent, "big") & MASK64
    assert r.block_hashes == [low]
    assert low == int.from_bytes(digest[-8:], "big")
    assert dec.bad_events == 0


def test_unknown_tag_is_skipped_not_fatal() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [],
                 "block_size": 1, "lora_id": None, "medium": None, "lora_name": None},
                {"type": "BlockPinned", "block_hashes": [1]},
                ["SomethingNew", 1, 2],
                {"type": "BlockRemoved", "block_hashes": [1], "medium": None},
            ],
            0,
        ]
    )  # fmt: skip
    dec = KVEventDecoder()
    b = dec.decode_payload(payload)
    assert b is not None
    assert [e.kind for e in b.events] == [0, 1]
    assert dec.unknown_tags == {"BlockPinned": 1, "SomethingNew": 1}
    assert dec.garbage_frames == 0 and "unknown_tag" in (dec.last_error or "")


def test_wrong_field_types_skip_only_that_event() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    bad = [
        {"type": "BlockRemoved", "block_hashes": "nope", "medium": None},
        {"type": "BlockRemoved", "block_hashes": [1.5], "medium": None},
        {"type": "BlockStored", "block_hashes": [1]},  # required fields missing
        ["BlockStored", [1], None, [1], "sixteen"],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": 3},
        42,
        None,
        [],
    ]
    dec = KVEventDecoder()
    b = dec.decode_payload(msgspec.msgpack.encode([1.0, [good, *bad, good], 0]))
    assert b is not None and [e.block_hashes for e in b.events] == [[9], [9]]
    assert dec.bad_events == len(bad)
    assert dec.last_error and dec.last_error.startswith("bad_event")


GARBAGE_FRAMES = {
    "frame_count": [[b"kv", (1).to_bytes(8, "big")], [b"kv", b"\0" * 8, b"", b"x", b"y"], []],
    "seq": [[b"kv", b"\x01\x02", encode_batch(SAMPLE, 1.0, 0)]],
    "msgpack": [
        [b"kv", b"\0" * 8, b"\xc1"],
        [b"kv", b"\0" * 8, encode_batch(SAMPLE, 1.0, 0)[:-3]],
        [b"kv", b"\0" * 8, b""],
    ],
    "batch_shape": [
        [b"kv", b"\0" * 8, msgspec.msgpack.encode({"ts": 1.0})],
        [b"kv", b"\0" * 8, msgspec.msgpack.encode(["yesterday", [], 0])],
        [b"kv", b"\0" * 8, msgspec.msgpack.encode([1.0, "events", 0])],
        [b"kv", b"\0" * 8, msgspec.msgpack.encode([1.0, [], "rank"])],
        [b"kv", b"\0" * 8, msgspec.msgpack.encode(7)],
    ],
}


@pytest.mark.parametrize("reason", sorted(GARBAGE_FRAMES))
def test_garbage_frames_are_counted(reason: str) -> None:
    dec = KVEventDecoder()
    for frames in GARBAGE_FRAMES[reason]:
        assert dec.decode_frames(frames) is None
    assert dec.garbage == {reason: len(GARBAGE_FRAMES[reason])}
    assert dec.garbage_frames == len(GARBAGE_FRAMES[reason])
    assert dec.last_error and dec.last_error.startswith(reason)
    assert dec.batches == 0
    # a good frame after the garbage still decodes
    assert dec.decode_frames(encode_frames("kv", 1, encode_batch(SAMPLE, 1.0, 0))) is not None


def test_non_bytes_frames_do_not_raise() -> None:
    dec = KVEventDecoder()
    assert dec.decode_frames([None, None, None]) is None  # type: ignore[list-item]
    assert dec.decode_frames(None) is None  # type: ignore[arg-type]
    assert dec.garbage_frames == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5), st.binary(max_size=300))
def test_random_bytes_never_raise(frames: list[bytes], payload: bytes) -> None:
    dec = KVEventDecoder()
    dec.decode_frames(frames)
    dec.decode_frames([b"kv", b"\0" * 8, payload])
    dec.decode_payload(payload)
    assert dec.batches + dec.garbage_frames + dec.replay_ends >= 1


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8), st.binary(max_size=8)
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
field_names = st.sampled_from(
    ["block_hashes", "medium", "token_ids", "parent_block_hash", "block_size", "lora_id", "lora_name", "x"]
)
event_like = st.one_of(
    st.tuples(tags, st.lists(json_like, max_size=12)).map(lambda t: [t[0], *t[1]]),
    st.tuples(tags, st.dictionaries(field_names, json_like)).map(lambda t: {"type": t[0], **t[1]}),
    json_like,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(event_like, max_size=6), json_like)
def test_structured_garbage_never_raises(events: list, junk: object) -> None:
    dec = KVEventDecoder()
    b = dec.decode_payload(msgspec.msgpack.encode([1.0, events, 0]))
    assert b is not None  # the batch shape is right: bad events are skipped, not the batch
    assert len(b.events) + dec.bad_events + sum(dec.unknown_tags.values()) == len(events)
    for e in b.events:
        assert all(type(h) is int for h in getattr(e, "block_hashes", []))
    dec.decode_payload(msgspec.msgpack.encode(junk))


def test_module_level_decode_frames() -> None:
    out = decode_frames(encode_frames("t", 2**64 - 2, encode_batch(SAMPLE, 1.0, None)))
    assert out is not None and out.seq == 2**64 - 2 and out.batch.data_parallel_rank is None


def test_replay_helpers() -> None:
    assert replay_request(5) == [b"", b"\0\0\0\0\0\0\0\x05"]
    assert REPLAY_END_SEQ == b"\xff" * 8
    assert is_replay_end([b"", REPLAY_END_SEQ, b""])
    assert is_replay_end([b"", b"", REPLAY_END_SEQ, b""])  # as a DEALER receives it
    assert not is_replay_end([b"kv", REPLAY_END_SEQ, b""])
    assert not is_replay_end(encode_frames("", 1, b""))
    dec = KVEventDecoder()
    assert dec.decode_frames([b"", b"", REPLAY_END_SEQ, b""]) is None
    assert dec.replay_ends == 1 and dec.garbage_frames == 0
    out = dec.decode_frames([b"", *encode_frames("kv", 3, encode_batch(SAMPLE, 1.0, 0))])
    assert out is not None and out.seq == 3


def test_encode_batch_rejects_unknown_form() -> None:
    with pytest.raises(ValueError, match="form"):
        encode_batch(SAMPLE, 1.0, 0, form="json")  # type: ignore[arg-type]


# --- against vLLM's own structs (the full install) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def vkv():
    """vLLM's kv_events module; importing vLLM takes ~10 s, so once per module."""
    return pytest.importorskip("vllm.distributed.kv_events")


def vllm_sample(vkv, hashes: list) -> list:
    return [
        vkv.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2, 3], block_size=16, lora_id=None,
            medium="GPU", lora_name=None,
        ),
        vkv.BlockStored(
            block_hashes=hashes[:1], parent_block_hash=hashes[-1], token_ids=list(range(100, 164)), block_size=64,
            lora_id=7, medium="CPU", lora_name="adapter", extra_keys=[("adapter",), None], group_idx=1,
            kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096, locality="LOCAL", ownership="x",
            session_id="s-1",
        ),
        vkv.BlockRemoved(block_hashes=hashes, medium="GPU"),
        vkv.BlockRemoved(block_hashes=hashes[:1], medium=None, group_idx=2, locality="REMOTE", ownership="y"),
        vkv.AllBlocksCleared(),
    ]  # fmt: skip


def ours(vkv, events: list) -> list:
    out = []
    for e in events:
        cls = {vkv.BlockStored: BlockStored, vkv.BlockRemoved: BlockRemoved, vkv.AllBlocksCleared: AllBlocksCleared}
        out.append(cls[type(e)](*msgspec.structs.astuple(e)))
    return out


@pytest.mark.parametrize("hash_kind", ["int", "bytes"])
def test_map_form_is_byte_identical_to_vllm(vkv, hash_kind: str) -> None:
    hashes = [H1, H2, H3] if hash_kind == "int" else [bytes([i]) * 32 for i in range(3)]
    events = vllm_sample(vkv, hashes)
    # what ZmqEventPublisher does: msgspec.msgpack.Encoder().encode(batch) with its DP rank filled in
    theirs = msgspec.msgpack.Encoder().encode(vkv.KVEventBatch(ts=1712345678.25, events=events, data_parallel_rank=2))
    assert encode_batch(ours(vkv, events), 1712345678.25, 2) == theirs
    dec = KVEventDecoder(token_ids=True)
    b = dec.decode_payload(theirs)
    assert b is not None and dec.bad_events == 0 and len(b.events) == 5
    if hash_kind == "int":
        assert b.events == ours(vkv, events)
    else:
        assert b.events[0].block_hashes == [hash64(h) for h in hashes]


def test_vllm_decodes_our_map_form(vkv) -> None:
    payload = encode_batch(SAMPLE, 3.5, 1)
    back = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(payload)
    assert back.ts == 3.5 and back.data_parallel_rank == 1
    assert [type(e).__name__ for e in back.events] == [type(e).__name__ for e in SAMPLE]
    assert back.events[1].group_idx == 1 and back.events[1].medium == "CPU"


GOLDEN = Path(__file__).parent / "fixtures" / "golden_kv_events.json"


@pytest.mark.skipif(not GOLDEN.exists(), reason="no recorded vLLM events (scripts/record_golden_events.py)")
def test_frames_recorded_from_a_real_vllm_server() -> None:
    """Every frame a vLLM 0.32 CPU server published decodes cleanly, re-encodes to the same bytes (int-hash
    configs), and drives the index to the holdings the events describe."""
    golden = json.loads(GOLDEN.read_text())
    for cfg in golden["configs"]:
        dec = KVEventDecoder(token_ids=True)
        index = KVIndex()
        held: set[int] = set()
        for topic, seq, payload in cfg["frames"]:
            frames = [bytes.fromhex(topic), bytes.fromhex(seq), bytes.fromhex(payload)]
            out = dec.decode_frames(frames)
            assert out is not None, (cfg["name"], dec.stats())
            b = out.batch
            if cfg["int_hashes"]:
                assert encode_batch(b.events, b.ts, b.data_parallel_rank) == frames[2]
            raw = msgspec.msgpack.decode(frames[2])
            for ev, r in zip(b.events, raw[1], strict=True):
                assert type(ev).__name__ == r["type"]
                if r["type"] == "AllBlocksCleared":
                    held.clear()
                    continue
                assert ev.block_hashes == [hash64(h) for h in r["block_hashes"]]
                if r["type"] == "BlockStored":
                    assert ev.tokens() == r["token_ids"] and ev.block_size == golden["block_size"]
                    held.update(ev.block_hashes)
                else:
                    held.difference_update(ev.block_hashes)
            assert index.ingest("vllm", out.seq, b) is None
        assert dec.garbage_frames == 0 and dec.bad_events == 0 and not dec.unknown_tags
        assert {h for h in held if h in index} == held and len(index) == len(held), cfg["name"]


# --- real sockets -----------------------------------------------------------------------------------------------------


def _recv(sock, timeout_ms: int):
    import zmq

    return sock.recv_multipart() if sock.poll(timeout_ms, zmq.POLLIN) else None


@pytest.mark.integration
@pytest.mark.timeout(10)
def test_zmq_pub_sub_to_index() -> None:
    """PUB -> SUB on 127.0.0.1 with encode_frames, decoded and applied: the index answers from what went over."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sub = ctx.socket(zmq.SUB)
    try:
        pub.bind("tcp://127.0.0.1:*")
        sub.connect(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        hashes = list(range(1000, 1010))
        batches = [
            encode_batch([stored(hashes[:6])], 1.0, 0),
            encode_batch([stored(hashes[6:], parent=hashes[5]), BlockRemoved(hashes[8:9], "GPU")], 2.0, 0),
            encode_batch([stored(hashes[:4], medium="CPU")], 3.0, 1),
        ]
        # PUB drops what it sends before the subscription lands: send a probe until one arrives
        deadline = time.monotonic() + 5
        while _recv(sub, 20) is None:
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.send_multipart(encode_frames("kv", 0, encode_batch([], 0.0, 0)))
        while _recv(sub, 50) is not None:  # drain probes
            pass
        for seq, payload in enumerate(batches, start=1):
            pub.send_multipart(encode_frames("kv", seq, payload))
        dec = KVEventDecoder()
        index = KVIndex()
        for _ in batches:
            frames = _recv(sub, 2000)
            assert frames is not None
            out = dec.decode_frames(frames)
            assert out is not None
            assert index.ingest("pod-a", out.seq, out.batch, publisher=("pod-a", "tcp")) is None or out.seq == 1
        assert dec.garbage_frames == 0 and dec.events["BlockStored"] == 3
        matches = {m.holder: m for m in index.query(hashes)}
        assert matches[("pod-a", 0)].blocks_any == 8 and matches[("pod-a", 0)].blocks_gpu == 8
        assert matches[("pod-a", 1)].blocks_any == 4 and matches[("pod-a", 1)].blocks_gpu == 0
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()


@pytest.mark.integration
@pytest.mark.timeout(10)
def test_zmq_replay_dealer_router() -> None:
    """The replay exchange as vLLM's publisher serves it (ROUTER side copied from ZmqEventPublisher._service_replay)."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        router.bind("tcp://127.0.0.1:*")
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        buffer = [(seq, encode_batch([stored([seq])], float(seq), 0)) for seq in range(5)]
        dealer.send_multipart(replay_request(2))
        frame = _recv(router, 2000)
        assert frame is not None and len(frame) == 3
        client_id, _, start = frame
        for seq, buf in buffer:
            if seq >= int.from_bytes(start, "big"):
                router.send_multipart((client_id, b"", b"kv", seq.to_bytes(8, "big"), buf))
        router.send_multipart((client_id, b"", b"", REPLAY_END_SEQ, b""))
        dec = KVEventDecoder()
        got = []
        while True:
            frames = _recv(dealer, 2000)
            assert frames is not None
            if is_replay_end(frames):
                break
            out = dec.decode_frames(frames)
            assert out is not None
            got.append((out.seq, out.batch.events[0].block_hashes))
        assert got == [(2, [2]), (3, [3]), (4, [4])]
        assert dec.garbage_frames == 0
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
