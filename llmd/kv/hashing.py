"""vLLM-exact KV block identity: the one block hasher of the project.

A block's hash chains its parent's hash, its token ids and its extra keys, exactly as vLLM's
`hash_block_tokens` does (vllm/v1/core/kv_cache_utils.py), so the router, the simulated engine and the cluster
simulator name blocks the way real vLLM servers do in their KV events.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's NONE_HASH seed when PYTHONHASHSEED is unset and the algorithm is cryptographic.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
MASK64 = (1 << 64) - 1

_PICKLE = pickle.HIGHEST_PROTOCOL
_sha256 = hashlib.sha256
_xxh3_128 = xxhash.xxh3_128_digest
_pickle_dumps = pickle.dumps
_cbor_dumps = cbor2.dumps


def _h_sha256(obj: Any) -> bytes:
    return _sha256(_pickle_dumps(obj, protocol=_PICKLE)).digest()


def _h_sha256_cbor(obj: Any) -> bytes:
    return _sha256(_cbor_dumps(obj, canonical=True)).digest()


def _h_xxhash(obj: Any) -> bytes:
    return _xxh3_128(_pickle_dumps(obj, protocol=_PICKLE))


def _h_xxhash_cbor(obj: Any) -> bytes:
    return _xxh3_128(_cbor_dumps(obj, canonical=True))


try:
    # The same bytes as pickle.dumps for a plain-text block, written in C (see the file): without it, pickle.
    from llmd.kv._blockpickle import chain as _native_chain
except ImportError:
    _native_chain = None


def _sha256_digest(data: bytes) -> bytes:
    return _sha256(data).digest()


# What the pickling algorithms apply to a block's pickle: the native chain writes the pickle, these hash it.
_PICKLE_DIGESTS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256_digest, "xxhash": _xxh3_128}

HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _h_sha256,
    "sha256_cbor": _h_sha256_cbor,
    "xxhash": _h_xxhash,
    "xxhash_cbor": _h_xxhash_cbor,
}


def event_hash(block_hash: bytes | int) -> int:
    """The 64-bit form KV events carry (vLLM's default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).

    Ints pass through so callers can normalise whatever an event gave them.
    """
    if isinstance(block_hash, int):
        return block_hash & MASK64
    return int.from_bytes(block_hash, "big") & MASK64


def block_extra_keys(
    block_index: int, *, cache_salt: str | None = None, lora: tuple[str, str] | None = None
) -> tuple[Any, ...] | None:
    """Extra keys vLLM mixes into a text block's hash, in vLLM's order (LoRA, multimodal, cache_salt, embeds).

    `lora` is (lora_name, lora_path). The cache salt only enters the first block: every later block inherits it
    through the parent chain.
    """
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def to_event_extra_keys(extra_keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """vLLM publishes extra keys untagged in events: bare LoRA names and cache salts, (mm_id, offset) pairs."""
    if extra_keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in extra_keys)


class BlockHasher:
    """Hashes token sequences into vLLM's chained full-block hashes.

    `seed` is the PYTHONHASHSEED the engines run with (None when unset). With the xxhash algorithms and no seed,
    vLLM draws a random per-process seed that no outside party can reproduce, so that combination is refused:
    match such engines through the token ids their events carry instead.
    """

    __slots__ = ("_digest", "algo", "block_size", "hash_fn", "none_hash", "seed")

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; expected one of {', '.join(HASH_ALGOS)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if seed is None and algo in _NON_CRYPTO:
            raise ValueError(
                f"{algo} without PYTHONHASHSEED makes vLLM seed its hashes randomly per process; "
                "run the engines with PYTHONHASHSEED set (model.hash_seed) or use sha256"
            )
        self.algo = algo
        self.block_size = block_size
        self.seed = seed
        self.hash_fn = HASH_FUNCTIONS[algo]
        self.none_hash = self.hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)
        self._digest = _PICKLE_DIGESTS.get(algo) if _native_chain is not None else None

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
    ) -> bytes:
        """One block: H((parent or NONE_HASH, tuple(tokens), extra_keys))."""
        return self.hash_fn((parent or self.none_hash, tuple(tokens), extra_keys))

    def chain(self, parent: bytes | None, tokens: Sequence[int] | bytes, offset: int, count: int) -> list[bytes]:
        """The hashes of `count` plain-text blocks (no extra keys) of `tokens` from `offset`, chained after `parent`
        (None: the first block): `hash_block` for each, without a call per block (agents' contexts hash thousands).
        `tokens` may be native int64s packed in bytes (the cluster simulator's token runs)."""
        fn, bs = self.hash_fn, self.block_size
        h = parent or self.none_hash
        if self._digest is not None:
            got = _native_chain(self._digest, h, tokens, offset, count, bs)
            if got is not None:  # None: tokens it does not write (not a list or tuple of int32s): pickle does
                return got  # type: ignore[no-any-return]
        if isinstance(tokens, bytes):
            tokens = memoryview(tokens).cast("q").tolist()
        out: list[bytes] = []
        append = out.append
        for a in range(offset, offset + count * bs, bs):
            h = fn((h, tuple(tokens[a : a + bs]), None))
            append(h)
        return out

    def hash_tokens(
        self,
        tokens: Sequence[int],
        prefix: Sequence[bytes] = (),
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """Hashes of every full block of `tokens`.

        `prefix` holds hashes already computed for the leading blocks of the same sequence (a session's earlier
        turn); they are reused as they are and only the new full blocks are hashed, so extending a 195K-token
        context by a few hundred tokens costs a few blocks, not three thousand.
        """
        bs = self.block_size
        n_full = len(tokens) // bs
        start = len(prefix)
        if start > n_full:
            raise ValueError(f"prefix has {start} block hashes but the tokens hold only {n_full} full blocks")
        out = list(prefix)
        parent = out[-1] if out else self.none_hash
        if lora is None and not cache_salt:
            # The hot path: plain text, no extra keys.
            out += self.chain(parent, tokens, start * bs, n_full - start)
            return out
        fn = self.hash_fn
        for i in range(start, n_full):
            extra = block_extra_keys(i, cache_salt=cache_salt, lora=lora)
            parent = fn((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
            out.append(parent)
        return out

    def event_hashes(self, tokens: Sequence[int], **kwargs: Any) -> list[int]:
        """The 64-bit hashes a vLLM server would publish for these tokens."""
        return [event_hash(h) for h in self.hash_tokens(tokens, **kwargs)]
