"""The C index core against the pure-Python index, operation by operation (ordered answers, recency order, counters),
and the C event fast path against the msgspec decoder (same events, same index afterwards)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.kv import index as kv_index
from llmd.kv.compact import CompactEvents
from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventDecoder, encode_batch
from llmd.kv.index import NativeKVIndex, PyKVIndex

# Without a compiler the extension is skipped and llmd runs on the pure-Python index; `make test` sets
# LLMD_REQUIRE_NATIVE=1 so a build that silently failed there cannot pass as "skipped".
if kv_index.Core is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError("llmd.kv._kvnative is not built (pip install -e . compiles llmd/kv/_kvnative.c): see its output")
pytestmark = pytest.mark.skipif(kv_index.Core is None, reason="llmd.kv._kvnative is not built")

HOLDERS = [(f"pod-{p}", r) for p in range(40) for r in range(2)]  # 80 holders: masks wider than a machine word
hash_st = st.integers(0, 40) | st.integers(2**63, 2**64 - 1)
medium_st = st.sampled_from([None, "GPU", "gpu", "CPU", "STORAGE"])
event_st = st.one_of(
    st.builds(
        lambda hs, parent, medium: BlockStored(hs, parent, [1, 2], 16, None, medium, None),
        st.lists(hash_st, min_size=0, max_size=6),
        st.none() | hash_st,
        medium_st,
    ),
    st.builds(lambda hs, medium: BlockRemoved(hs, medium), st.lists(hash_st, max_size=4), medium_st),
    st.just(AllBlocksCleared()),
)
op_st = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(HOLDERS), st.lists(event_st, max_size=5)),
    st.tuples(st.just("drop"), st.sampled_from([h[0] for h in HOLDERS[:10]])),
    st.tuples(st.just("query"), st.lists(hash_st, max_size=10)),
)


def same(a: PyKVIndex, b: NativeKVIndex, probe: list[int]) -> None:
    assert len(a) == len(b) and list(a._where) == b._core.keys()
    assert a.holders() == b.holders()
    for h in probe:
        assert a.holders_of(h) == b.holders_of(h)
    sa, sb = a.stats(), b.stats()
    assert sa == sb
    b._core.check()


def test_full_table_deletes_and_evicts_like_python() -> None:
    """Tens of thousands of entries, so table runs are long and slot distances saturate (7 and more): removals and
    evictions shift entries back by stored distances, and the table must still find everything (check())."""
    import random

    rnd = random.Random(7)
    # 23,000 entries: the table (32,768 slots) runs at 0.7 load, where runs are long
    a, b = PyKVIndex(max_entries=23_000, evict_batch=0), NativeKVIndex(max_entries=23_000, evict_batch=0)
    keys = [rnd.getrandbits(64) for _ in range(40_000)]
    for i in range(0, 40_000, 500):
        for ix in (a, b):
            ix.store(("pod-0", 0), keys[i : i + 500], "GPU")
            ix.store(("pod-1", 0), keys[i : i + 250 : 3], "CPU")
    gone = rnd.sample(keys, 12_000)
    for ix in (a, b):
        ix.remove(("pod-0", 0), gone, "GPU")
        ix.remove(("pod-1", 0), gone, "CPU")
        ix.store(("pod-2", 0), keys[:5_000], "GPU")  # old blocks stored again: the most recent now
    same(a, b, keys[:50] + gone[:50] + keys[-50:])
    assert b.evictions == a.evictions > 0


def _mix64(h: int) -> int:
    """The core's hash of a key (llmd/kv/_kvnative.c mix64): where its home slot is."""
    m = 2**64 - 1
    h ^= h >> 32
    h = (h * 0xD6E8FEB86659FD93) & m
    h ^= h >> 32
    h = (h * 0xD6E8FEB86659FD93) & m
    return h ^ (h >> 32)


def test_the_table_grows_a_few_slots_at_a_time_and_loses_nothing() -> None:
    """A doubling moves the old table's slots a few at a time (whole runs: every insertion moves MIGRATE_STEP slots,
    then on to its run's end). In the middle of a move, lookups, removals (backward shifts in either table), evictions
    and queries answer as the Python index does; keys crowd a few homes, some at the table's end, so runs are long,
    wrap round and have saturated distances on both sides of the move."""
    import random

    rnd = random.Random(3)
    crowded: list[int] = []
    while len(crowded) < 400:
        k = rnd.getrandbits(64)
        if _mix64(k) & 1023 in (5, 6, 1022, 1023):  # the first table's homes; the grown one splits them in two
            crowded.append(k)
    keys = crowded + [rnd.getrandbits(64) for _ in range(9000)]
    rnd.shuffle(keys)
    a, b = PyKVIndex(max_entries=5_000, evict_batch=0), NativeKVIndex(max_entries=5_000, evict_batch=0)
    mid_move = 0
    done: list[int] = []
    for step in range(300):
        run = keys[step * 30 : step * 30 + 30] or rnd.sample(keys, 30)
        holder = (f"pod-{step % 4}", 0)
        for ix in (a, b):
            ix.store(holder, run, "GPU" if step % 2 else "CPU")
        done += run
        gone = rnd.sample(done, 8)
        for ix in (a, b):
            ix.remove(holder, gone, "GPU" if step % 2 else "CPU")
            ix.remove((f"pod-{(step + 1) % 4}", 0), gone[:3], "GPU")
        if b._core.growing:
            mid_move += 1
            b._core.check()
            probe = run[:10] + gone[:4] + crowded[step % 40 : step % 40 + 10]
            assert all((k in a) == (k in b) for k in probe)
            assert a.query(run) == b.query(run)
            same_columns(a, b, run)
        if step % 25 == 24:
            same(a, b, crowded[:60])
    assert mid_move >= 20  # the checks above did run in the middle of moves (1,024 -> 8,192 slots)
    assert b.evictions == a.evictions > 0
    same(a, b, crowded)


def test_crowded_homes_at_cap_keep_the_table_ordered() -> None:
    """Keys whose homes crowd into a few slots of the 2,048-slot table: runs of dozens, distances far past the 7 a
    slot can say, so probes, Robin Hood insertions, deletions and evictions read keys to learn true distances. Every
    store at the cap evicts; after each step the table must find everything, in home order (check())."""
    import random

    rnd = random.Random(11)
    crowded: list[int] = []
    while len(crowded) < 300:
        k = rnd.getrandbits(64)
        if _mix64(k) & 2047 in (100, 101, 102, 2046, 2047):  # 2046-2047: runs that wrap round the table's end
            crowded.append(k)
    spread = [rnd.getrandbits(64) for _ in range(900)]
    a, b = PyKVIndex(max_entries=1_000, evict_batch=0), NativeKVIndex(max_entries=1_000, evict_batch=0)
    keys = crowded + spread
    rnd.shuffle(keys)
    for step in range(60):
        run = rnd.sample(keys, 40)
        holder = (f"pod-{step % 3}", 0)
        for ix in (a, b):
            ix.store(holder, run, "GPU" if step % 2 else "CPU")
            ix.remove(holder, run[:7], "GPU")
        b._core.check()
        if step % 10 == 9:
            same(a, b, crowded[:40] + run)
    assert b.evictions == a.evictions > 0
    assert len(b) == len(a) and all((k in b) == (k in a) for k in keys)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40), st.sampled_from([4, 16, 1000]), st.sampled_from([0, 3]), st.booleans())
def test_native_matches_python(ops, cap, batch, wire) -> None:
    a, b = PyKVIndex(max_entries=cap, evict_batch=batch), NativeKVIndex(max_entries=cap, evict_batch=batch)
    dec = KVEventDecoder()
    seen: list[int] = []
    for op in ops:
        if op[0] == "apply":
            _, (pod, rank), evs = op
            seen += [h for e in evs for h in getattr(e, "block_hashes", ())]
            a.apply(pod, EventBatch(0.0, evs, rank))
            if wire:  # the C fast path: payload -> records -> core
                got = dec.decode_payload(encode_batch(evs, 1.0, rank))
                assert got is not None and type(got.events) is CompactEvents
                b.apply(pod, got)
            else:
                b.apply(pod, EventBatch(0.0, evs, rank))
        elif op[0] == "drop":
            assert a.drop_pod(op[1]) == b.drop_pod(op[1])
        else:
            assert a.query(op[1]) == b.query(op[1])
            same_columns(a, b, op[1])
    same(a, b, seen[:50])
    holders = {(op[1][0], op[1][1] or 0) for op in ops if op[0] == "apply"}
    assert {h: a.epoch(h) for h in holders} == {h: b.epoch(h) for h in holders}
    for q in (seen, seen[::-1], seen[3:]):
        assert a.query(q) == b.query(q)
        same_columns(a, b, q)


def same_columns(a: PyKVIndex, b: NativeKVIndex, q: list[int]) -> None:
    """query_columns: the same answers by holder (holder ids agree too: both reuse the lowest free id)."""
    ca, cb = a.query_columns(q), b.query_columns(q)
    assert [c.tolist() for c in ca] == [c.tolist() for c in cb]
    hs = a.holders()
    assert a.holder_ids(hs).tolist() == b.holder_ids(hs).tolist()


SAMPLE = [
    BlockStored([1, 2**64 - 1], None, list(range(64)), 16, None, "GPU", None),
    BlockStored([3], 2, [5] * 16, 16, 7, "CPU", "lora", [("x", 1), None], 0, "full", None, "LOCAL", "me", "s1"),
    BlockRemoved([1], None),
    BlockRemoved([2**64 - 1], "STORAGE", 1, "LOCAL", "me"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("form", ["map", "array"])
def test_fast_path_reads_as_the_typed_decoder(form: str) -> None:
    payload = encode_batch(SAMPLE, 3.5, 2, form=form)
    fast, typed = KVEventDecoder(), KVEventDecoder()
    typed._scan = None
    a, b = fast.decode_payload(payload), typed.decode_payload(payload)
    assert a is not None and b is not None and type(a.events) is CompactEvents
    assert (a.ts, a.data_parallel_rank, len(a.events)) == (b.ts, b.data_parallel_rank, 5)
    assert list(a.events) == b.events and a.events == b.events
    assert [type(e) for e in a.events] == [type(e) for e in b.events]
    assert fast.stats() == typed.stats()


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",  # truncated
        encode_batch(SAMPLE, 1.0, 0)[:-3],  # truncated inside an event
        encode_batch(SAMPLE, 1.0, 0) + b"\x00",  # trailing bytes
        encode_batch([BlockStored([b"\x01" * 32], None, [], 16, None, None, None)], 1.0, 0),  # bytes hashes
    ],
)
def test_fast_path_declines_what_it_does_not_take(payload: bytes) -> None:
    """Anything but a whole, plain batch goes to the msgspec decoder, which decides (and counts) what it is."""
    from llmd.kv.compact import scan

    assert scan(payload) is None


# --- the SIMD int skip (scan's token ids) against the scalar loop -------------------------------------------------
# scan skips token ids 16 bytes at a time where the CPU has SSSE3/AVX2 (_kvnative.simd_level); every level must
# read a payload exactly as the scalar loop does (level 0): same records, same refusals, at every cut.
_WIDE_INTS = [(0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)]  # tag, bytes


def _non_int(t: int) -> bytes:
    """A well-formed msgpack value whose first byte is t (any tag but an int's), or the never-used 0xc1 alone."""
    small = {0xC0: b"", 0xC1: b"", 0xC2: b"", 0xC3: b"", 0xCA: bytes(4), 0xCB: bytes(8), 0xC4: b"\x01\xff",
             0xC5: b"\x00\x01\xff", 0xC6: b"\x00\x00\x00\x01\xff", 0xC7: b"\x01\x05\x07", 0xC8: b"\x00\x01\x05\x07",
             0xC9: b"\x00\x00\x00\x01\x05\x07", 0xD4: b"\x01\x02", 0xD5: b"\x01" + bytes(2), 0xD6: b"\x01" + bytes(4),
             0xD7: b"\x01" + bytes(8), 0xD8: b"\x01" + bytes(16), 0xD9: b"\x02hi", 0xDA: b"\x00\x02hi",
             0xDB: b"\x00\x00\x00\x02hi", 0xDC: b"\x00\x01\xcd\x01\x00", 0xDD: b"\x00\x00\x00\x01\x01",
             0xDE: b"\x00\x01\x01\x01", 0xDF: b"\x00\x00\x00\x01\xe0\x01"}  # fmt: skip
    if t in small:
        return bytes([t]) + small[t]
    n = t & 0x1F if t >= 0xA0 else t & 0x0F
    return bytes([t]) + (b"a" * n if t >= 0xA0 else b"\x01" * (n * (2 if t < 0x90 else 1)))


_NON_INTS = [_non_int(t) for t in range(0x80, 0xE0) if not 0xCC <= t <= 0xD3]


def _int_item(rnd, wide_share: float) -> bytes:
    if rnd.random() >= wide_share:
        return bytes([rnd.choice([rnd.randrange(0x80), rnd.randrange(0xE0, 0x100)])])
    tag, n = rnd.choice(_WIDE_INTS)
    # payload bytes of every kind, tag-like ones (0xcc-0xd3, 0xe0-0xff) included: the window tables must not care
    return bytes([tag]) + bytes(
        rnd.choice([rnd.randrange(256), rnd.randrange(0xCC, 0xD4), 0x7F, 0x80]) for _ in range(n)
    )


def _token_array(rnd) -> tuple[bytes, bool]:
    """A token-id array: mostly ints of every width (BPE-like mixes, all-narrow, all-wide), sometimes a non-int item
    mid-array, sometimes a count that is not the items' count (then False: not honest)."""
    n = rnd.choice([0, 1, 15, 16, 17, 31, 64, 65, 128, 200, rnd.randrange(300)])
    wide = rnd.choice([0.0, 0.1, 0.6, 1.0])
    items = [_int_item(rnd, wide) for _ in range(n)]
    for _ in range(rnd.choice([0, 0, 1, 3]) if n else 0):
        items[rnd.randrange(n)] = rnd.choice(_NON_INTS)
    count = n if rnd.random() < 0.8 else max(0, n + rnd.choice([-3, -1, 1, 2, 40]))
    head = bytes([0x90 | count]) if count < 16 else b"\xdc" + count.to_bytes(2, "big")
    return head + b"".join(items), count == n


def _levels() -> list[int]:
    from llmd.kv import _kvnative

    top = _kvnative.simd_level(-1)
    return list(range(top + 1))


def _scan_at(level: int, payload: bytes):
    from llmd.kv import _kvnative

    was = _kvnative.simd_level(-1)
    _kvnative.simd_level(level)
    try:
        return _kvnative.scan(payload)
    finally:
        _kvnative.simd_level(was)


def test_simd_skip_reads_token_ids_as_the_scalar_loop() -> None:
    import random

    import msgspec

    levels = _levels()
    rnd = random.Random(5)
    typed = KVEventDecoder()
    typed._scan = None
    accepted = 0
    for case in range(600):
        arrays = [_token_array(rnd) for _ in range(rnd.choice([1, 1, 3]))]
        raws = [r for r, _ in arrays]
        honest = all(h for _, h in arrays)
        evs = [BlockStored([rnd.getrandbits(64)], None, msgspec.Raw(r), 16, None, "GPU", None) for r in raws]
        form = "map" if case % 2 else "array"  # array form: the ids end a few bytes before the payload does
        payload = encode_batch(evs, 1.0, case % 3, form=form)
        want = _scan_at(0, payload)
        for lv in levels[1:]:
            assert _scan_at(lv, payload) == want, (case, lv)
        if want is not None:  # what the fast path takes, msgspec takes too, as the same events
            accepted += 1
            got = typed.decode_payload(payload)
            assert got is not None and len(got.events) == len(evs)
        # cut at every offset: the buffer's end falls inside the ids at every position, and nothing reads past it
        # (a count that is not the items' count can make a cut payload well formed: levels must still agree)
        for cut in range(len(payload)):
            w = _scan_at(0, payload[:cut])
            assert w is None or not honest
            for lv in levels[1:]:
                assert _scan_at(lv, payload[:cut]) == w, (case, lv, cut)
    assert accepted > 200


def test_simd_skip_finds_every_int_width_and_sign() -> None:
    """Each int form as a run, both signs, at every alignment against the 16-byte windows: the tokens msgspec reads
    back are the ones written, and every level's records agree."""
    import msgspec

    typed = KVEventDecoder(token_ids=True)
    typed._scan = None
    levels = _levels()
    values = [0, 1, 127, -1, -32, -33, 128, 255, -128, -129, 256, 65535, -32768, 65536, 2**32 - 1, -(2**31), 2**32,
              2**64 - 1, -(2**63)]  # fmt: skip
    for lead in range(17):  # ints of one byte before the run: shifts it against the windows
        for v in values:
            toks = [3] * lead + [v] * 40 + [5] * 9
            raw = msgspec.msgpack.encode(toks)
            ev = BlockStored([lead], None, msgspec.Raw(raw), 16, None, "GPU", None)
            payload = encode_batch([ev], 2.0, 0)
            want = _scan_at(0, payload)
            assert want is not None
            assert all(_scan_at(lv, payload) == want for lv in levels[1:])
            assert typed.decode_payload(payload).events[0].tokens() == toks


def test_simd_skip_stops_at_every_other_kind_of_value() -> None:
    """A value of every non-int tag among the ids, at every alignment against the windows: every level stops at it and
    reads on exactly as the scalar loop does."""
    import msgspec

    levels = _levels()
    typed = KVEventDecoder()
    typed._scan = None
    ints = msgspec.msgpack.encode([1, 200, 70000, -5, 3, 40000, 9] * 6)[3:]  # the 42 items, without their header
    for k, odd in enumerate(_NON_INTS):
        for lead in range(17):
            raw = b"\xdc\x00\x56" + b"\x01" * lead + odd + ints + b"\x00" * (85 - lead - 42)
            ev = BlockStored([k], None, msgspec.Raw(raw), 16, None, "GPU", None)
            payload = encode_batch([ev], 2.0, 0, form="array" if lead % 2 else "map")
            want = _scan_at(0, payload)
            assert (want is None) == (odd == b"\xc1")
            assert all(_scan_at(lv, payload) == want for lv in levels[1:]), (odd, lead)
            if want is not None:
                assert typed.decode_payload(payload) is not None


def test_fast_path_reads_keys_in_any_order_and_form() -> None:
    """scan compares the next field's key as bytes, in declaration order; keys in another order, or written as str8,
    take the slow reading and give the same records (but for the event's byte span)."""
    import msgspec

    from llmd.kv.compact import scan

    ev = BlockStored([5, 2**64 - 1], 7, list(range(40)), 16, None, "CPU", None)
    canon = encode_batch([ev], 1.0, 0)
    fields = msgspec.msgpack.decode(canon)[1][0]
    rev = {"type": fields.pop("type"), **dict(reversed(fields.items()))}
    others = [
        msgspec.msgpack.encode([1.0, [rev], 0]),
        canon.replace(b"\xa6medium", b"\xd9\x06medium"),
        canon.replace(b"\xa4type\xabBlockStored", b"\xa4type\xd9\x0bBlockStored"),
    ]
    want = memoryview(scan(canon)[2]).cast("Q").tolist()
    for p in others:
        got = memoryview(scan(p)[2]).cast("Q").tolist()
        assert got[0] == want[0] and got[2:] == want[2:] == [5, 2**64 - 1]
