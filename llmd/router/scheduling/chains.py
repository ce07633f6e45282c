"""Chained hashes (a block's or a text chunk's hash names every unit before it): two chains agree up to a point and
differ from there on, so how far they agree is a binary search, not a walk. The router's bookkeeping of what it sent
where (kv_demand, speculative) keeps requests' chains in a ChainSet and asks how much of a chain it holds, instead of
writing and taking away an entry for each of a long request's units.

All three are written twice: in C (_chains.c, built by `pip install -e .`: their loops' interpreter overhead was ~6% of
a cluster simulation's CPU) and here in Python (py_common_prefix, py_held_prefix, PyChainSet: the reference the C is
tested against, tests/test_chains_native.py, and what runs where no compiler was at install time, or with
LLMD_CHAINS_PURE_PYTHON=1). The same answers, errors and unit counts, in the same dict order.
"""

from __future__ import annotations

import os
from collections import _count_elements, deque  # type: ignore[attr-defined]  # Counter.update's C loop
from collections.abc import Container, Sequence
from itertools import islice, repeat
from typing import TYPE_CHECKING


def py_common_prefix(a: Sequence[int], b: Sequence[int], n: int, hint: int = 0) -> int:
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


def py_held_prefix(chain: Sequence[int], units: Container[int], lo: int, hi: int) -> int:
    """How many leading units of chain[:hi] are in `units`, given that chain[:lo] are: one binary search, for a set
    of units that is prefix-closed (a unit's presence means every unit before it in its chain is there too: units
    counted from whole chains)."""
    if lo >= hi or chain[lo] not in units:
        return lo
    lo += 1  # chain[:lo] are in; find the largest such lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] in units:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Chains shorter than this are kept as a count per unit: for a few dozen units that is a few C-speed dict operations,
# cheaper than a search per chain in the set (short prompts come many at a time: 64 in flight at one endpoint);
# longer ones as themselves, searched one by one: few fit one engine's KV at once, and a 3,000-block chain would
# cost 3,000 dict operations to add and as many to take away. PyChainSet reads it when used, a C set when made.
SHORT_UNITS = 256


class PyChainSet:
    """A multiset of chains (a request's units: chained hashes, each naming every unit before it, all distinct):
    `longest` is the longest prefix of a chain that one of them has, i.e. how much of it their trie holds.

    Short chains are counted per unit, and membership of a chain's unit at position p then means a short chain
    agrees with it up to p: prefix-closed, so a binary search answers. Long chains are compared one by one, each
    costing a probe unless it agrees past what is known already."""

    __slots__ = ("_long", "_refs")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # unit -> short chains having it
        self._long: list[Sequence[int]] = []

    def __bool__(self) -> bool:
        return bool(self._refs) or bool(self._long)

    def add(self, chain: Sequence[int]) -> None:
        if len(chain) < SHORT_UNITS:
            _count_elements(self._refs, chain)  # refs[u] += 1 for each, in C
        else:
            self._long.append(chain)

    def remove(self, chain: Sequence[int]) -> bool:
        """Take away one chain equal to `chain`, one the caller added; False (and nothing changes) where there is
        certainly none (a short chain's units are counted, not the chain: one whose units all lie in others' passes)."""
        n = len(chain)
        if n < SHORT_UNITS:
            if not n:
                return True
            refs = self._refs
            # Counts never grow along a chain (a chain with a unit has every unit before it), so the last unit's
            # presence means the chain's, and the units only this chain has (count 1) are a tail found by bisection:
            # they go, the shared head's counts drop by one. Most units are in the tail or the head is short (a
            # system prompt), where counting every unit took four passes over the chain.
            last = refs.get(chain[-1])
            if last is None:
                return False
            if last > 1:
                p = n
            elif refs[chain[0]] == 1:
                p = 0
            else:
                lo, p = 0, n - 1  # refs[chain[lo]] > 1, refs[chain[p]] == 1
                while p - lo > 1:
                    mid = (lo + p) // 2
                    if refs[chain[mid]] > 1:
                        lo = mid
                    else:
                        p = mid
            if p < n:
                deque(map(refs.pop, islice(chain, p, n)), maxlen=0)  # in C
            if p:
                head = chain[:p]
                refs.update(zip(head, map(int.__sub__, map(refs.__getitem__, head), repeat(1)), strict=True))
            return True
        chains = self._long
        at = next((i for i, c in enumerate(chains) if c is chain), None)
        if at is None:  # an equal chain, not the same object
            at = next((i for i, c in enumerate(chains) if len(c) == n and py_common_prefix(chain, c, n) == n), None)
        if at is None:
            return False
        chains[at] = chains[-1]
        chains.pop()
        return True

    def unit_counts(self) -> dict[int, int]:
        """Each unit's count over the chains (a copy)."""
        refs = dict(self._refs)
        for c in self._long:
            _count_elements(refs, c)
        return refs

    def longest(self, chain: Sequence[int], hi: int | None = None, lo: int = 0) -> int:
        """The longest prefix of chain[:hi] one of the chains has, or `lo` if that is more (the caller knows
        chain[:lo] is held, or cares only whether the answer beats lo)."""
        hi = len(chain) if hi is None else min(hi, len(chain))
        best = lo
        if best >= hi:
            return best
        refs = self._refs
        if refs:
            best = py_held_prefix(chain, refs, best, min(hi, SHORT_UNITS - 1))  # a short chain has < SHORT_UNITS
        got = 0
        for c in self._long:
            m = min(hi, len(c))
            if m > best and c[best] == chain[best]:  # agrees past what is known: worth a search
                got = py_common_prefix(chain, c, m, got)
                if got > best:
                    best = got
                    if best >= hi:
                        break
        return best


try:
    if os.environ.get("LLMD_CHAINS_PURE_PYTHON") == "1":
        raise ImportError("LLMD_CHAINS_PURE_PYTHON=1")
    from llmd.router.scheduling import _chains
except ImportError:  # no compiler where llmd was installed (or asked not to): the Python ones serve, the same answers
    _chains = None

if TYPE_CHECKING or _chains is None:
    common_prefix = py_common_prefix
    held_prefix = py_held_prefix
    ChainSet = PyChainSet
else:
    # A C set reads SHORT_UNITS from this module's globals when it is made, as PyChainSet reads it when used: tests
    # set chains.SHORT_UNITS to split short and long chains elsewhere, and must reach both.
    _chains.split_from(globals())
    common_prefix = _chains.common_prefix
    held_prefix = _chains.held_prefix
    ChainSet = _chains.ChainSet
