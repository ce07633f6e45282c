"""llmd's block hasher against vLLM's own hashing code, and its incremental form against the full one."""

from __future__ import annotations

import array
import os
import pickle

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.kv import hashing
from llmd.kv.hashing import HASH_ALGOS, BlockHasher, block_extra_keys, event_hash, to_event_extra_keys

tokens_st = st.lists(st.integers(min_value=0, max_value=200_000), max_size=400)


@pytest.fixture(scope="module")
def vllm_hashing():
    """vLLM's own functions, when the full install is present (the golden-event tests cover the light install)."""
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    hashing = pytest.importorskip("vllm.utils.hashing")
    return kcu, hashing


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("seed", [None, "0", "1234"])
def test_matches_vllm_hash_block_tokens(vllm_hashing, monkeypatch, algo, seed) -> None:
    kcu, hashing = vllm_hashing
    if seed is None and algo.startswith("xxhash"):
        pytest.skip("vLLM seeds xxhash randomly per process without PYTHONHASHSEED (tested below)")
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    ours = BlockHasher(block_size=16, algo=algo, seed=seed)
    assert ours.none_hash == kcu.NONE_HASH
    tokens = list(range(7, 7 + 16 * 5 + 3))
    parent = None
    expected = []
    for i in range(5):
        extra = (("cache_salt", "s1"),) if i == 0 else None
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * 16 : (i + 1) * 16], extra)
        expected.append(parent)
    assert ours.hash_tokens(tokens, cache_salt="s1") == expected
    assert [event_hash(h) for h in expected] == ours.event_hashes(tokens, cache_salt="s1")
    # The event form is exactly vLLM's conversion.
    assert [kcu.maybe_convert_block_hash(h) for h in expected] == ours.event_hashes(tokens, cache_salt="s1")


def test_xxhash_without_seed_is_refused_with_the_fix_named() -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        BlockHasher(block_size=16, algo="xxhash")
    with pytest.raises(ValueError, match="expected one of sha256"):
        BlockHasher(block_size=16, algo="md5")


@settings(max_examples=60, deadline=None)
@given(
    tokens=tokens_st,
    split=st.integers(min_value=0, max_value=400),
    algo=st.sampled_from(HASH_ALGOS),
    salt=st.sampled_from([None, "", "tenant"]),
)
def test_incremental_equals_full(tokens, split, algo, salt) -> None:
    h = BlockHasher(block_size=8, algo=algo, seed="3")
    full = h.hash_tokens(tokens, cache_salt=salt)
    head = h.hash_tokens(tokens[: min(split, len(tokens))], cache_salt=salt)
    assert h.hash_tokens(tokens, head, cache_salt=salt) == full
    assert len(full) == len(tokens) // 8


def test_chain_is_hash_block_block_after_block_from_any_offset() -> None:
    h = BlockHasher(block_size=4, algo="xxhash", seed="3")
    toks = list(range(100, 130))
    want, parent = [], None
    for i in range(1, 7):  # the blocks at offsets 4, 8, ... 24
        parent = h.hash_block(parent, toks[i * 4 : i * 4 + 4])
        want.append(parent)
    assert h.chain(None, toks, 4, 6) == want
    assert h.chain(want[1], toks, 12, 4) == want[2:]
    assert h.chain(want[0], toks, 8, 0) == []


# `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently left out the C pickle fails here, not skips.
if hashing._native_chain is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError("llmd.kv._blockpickle is not built (pip install -e . with a C compiler)")
native = pytest.mark.skipif(hashing._native_chain is None, reason="llmd.kv._blockpickle not built")
int32_st = st.one_of(
    st.integers(0, 255), st.integers(256, 65_535), st.integers(65_536, 2**31 - 1), st.integers(-(2**31), -1)
)


@native
@settings(max_examples=300, deadline=None)
@given(
    bs=st.sampled_from([1, 2, 3, 4, 5, 64]),
    blocks=st.integers(0, 4),
    offset=st.integers(0, 3),
    data=st.data(),
    form=st.sampled_from(["list", "tuple", "packed"]),
)
def test_the_c_pickle_is_pickles_own_bytes(bs, blocks, offset, data, form) -> None:
    """Each block's bytes the C chain hands the digest are pickle.dumps((parent, tuple(tokens), None), protocol 5),
    for every int32 token (BININT1, BININT2, BININT) and every tuple opcode (TUPLE1..3, MARK..TUPLE), with the
    tokens as a list, a tuple or native int64s packed in bytes."""
    toks = data.draw(st.lists(int32_st, min_size=offset + blocks * bs, max_size=offset + blocks * bs + 3))
    seen: list[bytes] = []

    def digest(b: bytes) -> bytes:
        seen.append(b)
        return xxhash.xxh3_128_digest(b)

    parent = b"p" * data.draw(st.sampled_from([16, 32]))
    tokens_in = {"list": toks, "tuple": tuple(toks), "packed": array.array("q", toks).tobytes()}[form]
    got = hashing._native_chain(digest, parent, tokens_in, offset, blocks, bs)
    want, h = [], parent
    for i in range(blocks):
        block = tuple(toks[offset + i * bs : offset + (i + 1) * bs])
        assert seen[i] == pickle.dumps((h, block, None), protocol=5)
        h = xxhash.xxh3_128_digest(seen[i])
        want.append(h)
    assert got == want and len(seen) == blocks


@native
def test_tokens_the_c_pickle_does_not_write_go_to_pickle() -> None:
    """Ints past int32, bools, sequences other than lists and tuples: the C chain declines (None) and the hasher
    pickles them, with the same hashes as hash_block."""
    h = BlockHasher(block_size=4, algo="xxhash", seed="3")
    digest = xxhash.xxh3_128_digest
    for toks in ([1, 2, 3, 2**31], [1, 2, 3, -(2**31) - 1], [True, 2, 3, 4], [1, 2, 3, 4.0]):
        assert hashing._native_chain(digest, h.none_hash, toks, 0, 1, 4) is None
        assert h.chain(None, toks, 0, 1) == [h.hash_block(None, toks)]
    assert hashing._native_chain(digest, h.none_hash, range(8), 0, 2, 4) is None
    big = array.array("q", [1, 2, 3, 2**40]).tobytes()  # packed, past int32: declined, and pickle hashes the ints
    assert hashing._native_chain(digest, h.none_hash, big, 0, 1, 4) is None
    assert h.chain(None, big, 0, 1) == [h.hash_block(None, [1, 2, 3, 2**40])]
    # The largest block written in C is one pickle frame at most (pickle splits frames past 64 KiB): the next size is
    # left to pickle.
    parent, wide = b"x" * 255, [2**31 - 1] * 13_055
    seen: list[bytes] = []
    assert hashing._native_chain(lambda b: seen.append(b) or digest(b), parent, wide, 0, 1, 13_054) is not None
    assert seen == [pickle.dumps((parent, tuple(wide[:13_054]), None), protocol=5)]
    assert hashing._native_chain(digest, parent, wide, 0, 1, 13_055) is None
    with pytest.raises(ValueError, match="whole int64s"):
        hashing._native_chain(digest, h.none_hash, b"\x00" * 12, 0, 1, 1)
    assert h.chain(None, range(8), 0, 2) == h.chain(None, list(range(8)), 0, 2)
    with pytest.raises(ValueError, match="past the tokens"):
        hashing._native_chain(digest, h.none_hash, [1, 2, 3], 0, 1, 4)
    with pytest.raises(TypeError, match="must return bytes"):
        hashing._native_chain(lambda b: 1, h.none_hash, [1, 2, 3, 4], 0, 1, 4)
    for algo in ("sha256", "xxhash"):  # the pickling algorithms take the C path, with their own digests
        hasher = BlockHasher(block_size=4, algo=algo, seed="3")
        assert hasher._digest is not None
        toks = list(range(60_000, 60_012))
        first = hasher.hash_block(None, toks[:4])
        want = [first, (second := hasher.hash_block(first, toks[4:8])), hasher.hash_block(second, toks[8:])]
        assert hasher.chain(None, toks, 0, 3) == want


def test_only_full_blocks_are_hashed_and_chain_depends_on_everything_before() -> None:
    h = BlockHasher(block_size=4)
    assert h.hash_tokens([1, 2, 3]) == []
    a = h.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash_tokens([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert h.hash_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a


def test_cache_salt_enters_the_first_block_and_lora_every_block() -> None:
    assert block_extra_keys(0, cache_salt="s") == (("cache_salt", "s"),)
    assert block_extra_keys(1, cache_salt="s") is None
    assert block_extra_keys(2, lora=("ad", "/p")) == (("lora", "ad", "/p"),)
    assert block_extra_keys(0, cache_salt="s", lora=("ad", "/p")) == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert to_event_extra_keys((("lora", "ad", "/p"), ("cache_salt", "s"))) == ("ad", "s")
    h = BlockHasher(block_size=4)
    plain, salted = h.hash_tokens(list(range(8))), h.hash_tokens(list(range(8)), cache_salt="s")
    assert plain[0] != salted[0] and plain[1] != salted[1]


def test_seed_changes_every_hash_and_event_hash_is_low_64_bits() -> None:
    a, b = BlockHasher(4, seed=None), BlockHasher(4, seed="1")
    assert a.hash_tokens([1, 2, 3, 4]) != b.hash_tokens([1, 2, 3, 4])
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert event_hash(2**70 + 5) == 5


def test_prefix_longer_than_the_tokens_is_an_error() -> None:
    h = BlockHasher(4)
    with pytest.raises(ValueError, match="full blocks"):
        h.hash_tokens([1, 2, 3, 4], prefix=[b"x", b"y"])
