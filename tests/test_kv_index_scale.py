"""KVIndex.query with hundreds of holders sharing prefixes (the 544-rank fleet's shape: every engine caches the system
prompt, a few a session's context, in GPU and CPU tiers): each holder's counts and the order of the answer (longest,
then most in GPU, then by holder) against a brute-force reading of what each holder stored."""

from __future__ import annotations

import random

import pytest
from kvutil import brute_prefixes

from llmd.kv.index import KVIndex


def _brute(stored: dict[tuple[tuple[str, int], str], set[int]], hashes: list[int]) -> list[tuple]:
    """brute_prefixes in the index's answer order: by holder, then longest and most in GPU first (stable)."""
    out = [(holder, *counts) for holder, counts in brute_prefixes(stored, hashes).items()]
    out.sort(key=lambda m: m[0])
    out.sort(key=lambda m: (m[1], m[2]), reverse=True)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_query_over_many_holders_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    holders = [(f"{role}-{k}", r) for role, n, dp in (("prefill", 4, 16), ("decode", 2, 96)) for k in range(n)
               for r in range(dp)]  # fmt: skip
    rng.shuffle(holders)  # ids in another order than holders sort
    ix = KVIndex()
    stored: dict[tuple[tuple[str, int], str], set[int]] = {}
    system = [rng.getrandbits(64) for _ in range(40)]
    sessions = [system + [rng.getrandbits(64) for _ in range(rng.randrange(1, 60))] for _ in range(30)]

    def put(holder: tuple[str, int], chain: list[int], tier: str) -> None:
        ix.store(holder, chain, tier)
        stored.setdefault((holder, tier), set()).update(chain)

    for h in holders:
        put(h, system[: rng.choice((40, 40, 40, 25, 39))], "GPU")
        if rng.random() < 0.2:
            put(h, system[:40], "CPU")
    for chain in sessions:
        for h in rng.sample(holders, rng.randrange(1, 6)):
            put(h, chain[: rng.randrange(1, len(chain) + 1)], rng.choice(("GPU", "GPU", "CPU")))
    for h in rng.sample(holders, 20):  # some evicted a middle block of their GPU copy
        victim = rng.choice(system[5:40])
        ix.remove(h, [victim], "GPU")
        stored.get((h, "GPU"), set()).discard(victim)
    for chain in [system, *sessions, [*system[:10], 1, 2, 3]]:
        got = [tuple(m) for m in ix.query(chain)]
        assert got == _brute(stored, chain)
