"""llmd's hasher and codec against KV events recorded from a real vLLM CPU server (scripts/record_golden_events.py).

Every BlockStored event is re-derived bit for bit: each block's hash is recomputed from its parent's full hash (looked
up by the event form the parent was published under), its token ids and its extra keys, then compared with the hash
the engine published. Prompts are also hashed up front, as the router does, and must name the blocks the engine stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmd.kv.hashing import BlockHasher, event_hash

FIXTURE = Path(__file__).parent / "fixtures" / "golden_kv_events.json"
GOLDEN = json.loads(FIXTURE.read_text())
CONFIGS = {c["name"]: c for c in GOLDEN["configs"]}


def _batches(cfg: dict) -> list[tuple[bytes, int, Any]]:
    out = []
    for topic, seq, payload in cfg["frames"]:
        out.append(
            (
                bytes.fromhex(topic),
                int.from_bytes(bytes.fromhex(seq), "big"),
                msgspec.msgpack.decode(bytes.fromhex(payload)),
            )
        )
    return out


def _stored(cfg: dict) -> list[dict]:
    return [ev for _, _, batch in _batches(cfg) for ev in batch[1] if ev["type"] == "BlockStored"]


def _tag_extra_keys(untagged: list | None) -> tuple | None:
    # Events publish extra keys untagged; the recorded requests use only cache_salt, which vLLM tags as below.
    if not untagged:
        return None
    return tuple(("cache_salt", key) for key in untagged)


def test_fixture_covers_every_hash_algorithm_and_both_seed_modes() -> None:
    assert {c["algo"] for c in GOLDEN["configs"]} == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    assert any(c["seed"] is None for c in GOLDEN["configs"]) and any(c["seed"] for c in GOLDEN["configs"])
    assert any(not c["int_hashes"] for c in GOLDEN["configs"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_published_block_hash_is_reproduced_bit_for_bit(name: str) -> None:
    cfg = CONFIGS[name]
    hasher = BlockHasher(block_size=GOLDEN["block_size"], algo=cfg["algo"], seed=cfg["seed"])
    full_by_event: dict[Any, bytes] = {}
    checked = 0
    for ev in _stored(cfg):
        bs = ev["block_size"]
        assert bs == hasher.block_size
        parent_ev = ev["parent_block_hash"]
        parent = None if parent_ev is None else full_by_event[parent_ev]
        extras = ev.get("extra_keys") or [None] * len(ev["block_hashes"])
        for i, published in enumerate(ev["block_hashes"]):
            ours = hasher.hash_block(parent, ev["token_ids"][i * bs : (i + 1) * bs], _tag_extra_keys(extras[i]))
            if cfg["int_hashes"]:
                assert isinstance(published, int)
                assert event_hash(ours) == published, f"{name}: block {checked} differs"
            else:
                assert published == ours, f"{name}: block {checked} differs (full digest)"
            full_by_event[published] = ours
            parent = ours
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_router_side_prompt_hashes_name_the_blocks_the_engine_stored(name: str) -> None:
    cfg = CONFIGS[name]
    hasher = BlockHasher(block_size=GOLDEN["block_size"], algo=cfg["algo"], seed=cfg["seed"])
    stored = {h for ev in _stored(cfg) for h in ev["block_hashes"]}
    for req in cfg["requests"]:
        hashes = hasher.hash_tokens(req["prompt_token_ids"], cache_salt=req["cache_salt"])
        published = [event_hash(h) for h in hashes] if cfg["int_hashes"] else hashes
        assert hashes, f"{req['kind']} has no full block"
        if name.endswith("-evict"):
            continue  # stored then evicted blocks still appeared in events; the subset check below is exact
        assert set(published) <= stored, f"{name}/{req['kind']}: a prompt block was never published"


def test_salted_prompt_shares_no_block_with_the_same_unsalted_prompt() -> None:
    cfg = CONFIGS["sha256"]
    reqs = {r["kind"]: r for r in cfg["requests"]}
    assert reqs["salted"]["prompt_token_ids"] == reqs["text"]["prompt_token_ids"]
    hasher = BlockHasher(block_size=GOLDEN["block_size"])
    salted = set(hasher.event_hashes(reqs["salted"]["prompt_token_ids"], cache_salt="tenant-a"))
    plain = set(hasher.event_hashes(reqs["text"]["prompt_token_ids"]))
    assert salted and not salted & plain


def test_eviction_config_recorded_block_removed_events() -> None:
    removed = [ev for _, _, b in _batches(CONFIGS["sha256-evict"]) for ev in b[1] if ev["type"] == "BlockRemoved"]
    assert removed, "the 12-block cache should have evicted blocks"


def test_sequence_numbers_are_dense_from_zero() -> None:
    for cfg in GOLDEN["configs"]:
        seqs = [seq for _, seq, _ in _batches(cfg)]
        assert seqs == list(range(len(seqs)))
