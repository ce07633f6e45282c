"""Agents' token streams without storing them: a context is a list of runs of pseudo-random tokens, each run a
(seed, length) whose i-th token is a hash of (seed, i), so any slice is computed on demand in O(slice).

A 195K-token context held as Python ints costs ~7 MB; three thousand agents and their requests in flight would not fit
a laptop. As runs, a context is a few dozen tuples, and extending it by a turn shares every earlier run. The engine
core reads tokens only where vLLM does real work with them (hashing the blocks a step completes, the BlockStored
events of newly cached blocks), so the simulator pays per prefilled token, as the engine it models does.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

_MASK = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_U_GOLDEN, _U_MIX1, _U_MIX2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Below this many tokens plain ints beat numpy, whose fixed cost per call is ~20 us (a prefill leg's one-token
# output script, the few tokens that complete a block).
_SMALL = 16


def py_run_tokens(seed: int, start: int, stop: int, vocab: int) -> list[int]:
    """Tokens [start, stop) of run `seed`: splitmix64 of (seed, position) modulo the vocabulary (specials aside, a
    random-weight model's text)."""
    if stop - start <= _SMALL:
        out = []
        for i in range(start, stop):
            x = (i * _GOLDEN + seed) & _MASK
            x = ((x ^ (x >> 30)) * _MIX1) & _MASK
            x = ((x ^ (x >> 27)) * _MIX2) & _MASK
            out.append((x ^ (x >> 31)) % vocab)
        return out
    # In place: uint64 arrays wrap silently (only numpy scalars warn on overflow), and each temporary costs.
    a = np.arange(start, stop, dtype=np.uint64)
    a *= _U_GOLDEN
    a += np.uint64(seed & _MASK)
    a ^= a >> _U30
    a *= _U_MIX1
    a ^= a >> _U27
    a *= _U_MIX2
    a ^= a >> _U31
    a %= np.uint64(vocab)
    return a.view(np.int64).tolist()  # < 2**63: the same values, and int64's tolist is a third faster than uint64's


try:
    if os.environ.get("LLMD_SIM_TOKENS_PURE_PYTHON") == "1":
        raise ImportError("LLMD_SIM_TOKENS_PURE_PYTHON=1")
    from llmd.sim._tokens import run_tokens as native_run_tokens
    from llmd.sim._tokens import span_packed
except ImportError:  # no compiler where llmd was installed (or asked not to): numpy serves, the same values
    native_run_tokens = span_packed = None
run_tokens = native_run_tokens or py_run_tokens


class TokenRuns(Sequence[int]):
    """An immutable token sequence made of runs: `extend` and `prefix` make new sequences sharing the runs."""

    __slots__ = ("_len", "_runs", "_starts", "vocab")

    def __init__(self, runs: tuple[tuple[int, int, int], ...] = (), vocab: int = 32000) -> None:
        # (seed, offset into that run's stream, length); offsets let `prefix` cut a run without copying tokens.
        self._runs = runs
        starts, n = [], 0
        for _, _, length in runs:
            starts.append(n)
            n += length
        self._starts = starts
        self._len = n
        self.vocab = vocab

    def extend(self, seed: int, n: int) -> TokenRuns:
        if n <= 0:
            return self
        return TokenRuns((*self._runs, (seed, 0, n)), self.vocab)

    def concat(self, other: TokenRuns) -> TokenRuns:
        return TokenRuns(self._runs + other._runs, self.vocab)

    def prefix(self, n: int) -> TokenRuns:
        """The first `n` tokens (compaction keeps a summary; a reset cuts back to the shared system prompt)."""
        if n >= self._len:
            return self
        out = []
        for (seed, off, length), s in zip(self._runs, self._starts, strict=True):
            if s >= n:
                break
            out.append((seed, off, min(length, n - s)))
        return TokenRuns(tuple(out), self.vocab)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return self.tokens(0, self._len)[i]
            return self.tokens(start, stop)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("token index out of range")
        return self.tokens(i, i + 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens(0, self._len))

    def __add__(self, other: object) -> list[int]:
        # SimRequest.tokens joins a prompt slice with output tokens: slices are lists already; this covers whole runs.
        return self.tokens(0, self._len) + list(other)  # type: ignore[call-overload]

    def packed(self, start: int, stop: int) -> bytes | list[int]:
        """Tokens [start, stop) as native int64s in bytes, for a reader that hashes them (BlockHasher.chain) and
        never looks at one: no int object a token. A list (`tokens`) where the C runs are not built."""
        if span_packed is None:
            return self.tokens(start, stop)
        return span_packed(self._runs, self._starts, start, stop, self.vocab)  # type: ignore[no-any-return]

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) as a list."""
        pieces = self._pieces(start, stop)
        if len(pieces) == 1:  # most reads (an output script, a block inside one turn): the run's own list, no copy
            seed, a, b = pieces[0]
            return run_tokens(seed, a, b, self.vocab)
        out: list[int] = []
        for seed, a, b in pieces:
            out += run_tokens(seed, a, b, self.vocab)
        return out

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Tokens [start, stop) as (seed, start, stop) in each run's own stream, in order."""
        stop = min(stop, self._len)
        out = []
        if start < stop:
            k = bisect_right(self._starts, start) - 1
            runs, starts = self._runs, self._starts
            while start < stop:
                seed, off, length = runs[k]
                s = starts[k]
                end = min(stop, s + length)
                out.append((seed, off + start - s, off + end - s))
                start = end
                k += 1
        return out
