"""The KV index's definition, read the slow way: what the index tests compare its answers with."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def brute_prefixes(held: dict[tuple[Hashable, str], set[int]], hashes: Sequence[int]) -> dict[Hashable, tuple]:
    """Per holder with the request's first block: (leading blocks held in any tier, how many of those in GPU, leading
    blocks held in GPU alone), from `held`: (holder, "GPU" | "CPU") -> the hashes stored there."""
    out = {}
    holders = {h for (h, _), s in held.items() if hashes and hashes[0] in s}
    for holder in holders:
        gpu = held.get((holder, "GPU"), set())
        cpu = held.get((holder, "CPU"), set())
        n = 0
        while n < len(hashes) and (hashes[n] in gpu or hashes[n] in cpu):
            n += 1
        g = sum(1 for h in hashes[:n] if h in gpu)
        gp = 0
        while gp < n and hashes[gp] in gpu:
            gp += 1
        out[holder] = (n, g, gp)
    return out
