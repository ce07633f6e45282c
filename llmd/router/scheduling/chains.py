"""Chained hashes (a block's or a text chunk's hash names every unit before it): two chains agree up to a point and
differ from there on, so how far they agree is a binary search, not a walk. The router's bookkeeping of what it sent
where (kv_demand, speculative) keeps requests' chains as they are and asks this instead of counting every unit.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int], n: int, hint: int = 0) -> int:
    """How many leading units of a[:n] and b[:n] agree. Chains agree up to a point and differ from there on (a unit
    names all before it), so a binary search answers; the shared system prompt and a turn's own earlier turns make
    "none" and "all" the common answers, looked at first."""
    if n <= 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    if 0 < hint < n and a[hint - 1] == b[hint - 1] and a[hint] != b[hint]:
        return hint  # the answer the caller's previous chain gave (the system prompt, most often)
    lo, hi = 1, n - 1  # a[:lo] == b[:lo]; they differ before n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
