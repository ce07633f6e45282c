"""The MTP acceptance draws of one engine core, readable one at a time or in bulk.

`UniformStream(seed)` yields exactly what `random.Random(seed).random()` yields (CPython and numpy's MT19937 share the
generator and the 53-bit double), so swapping it in changes no result. The single-step path hands it to the latency
model's `sample_accepted` as before; decode fast-forward (decode_run.py) reads the next draws as an array without
consuming them (`peek`), works out how many k steps use, and consumes only those (`skip`), so the stream is where
single-stepping would have left it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

_CHUNK = 1024
_TWO53 = 1.0 / 9007199254740992.0


class UniformStream:
    """`random.Random(seed).random()`'s sequence with a cursor: `random()` reads one, `peek(m)` shows the next m,
    `skip(c)` consumes c."""

    __slots__ = ("_arr", "_bits", "_i", "_list", "_n")

    def __init__(self, seed: str) -> None:
        state = random.Random(seed).getstate()[1]
        self._bits = np.random.MT19937()
        key = np.array(state[:624], dtype=np.uint32)
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": state[624]}}
        self._arr = np.empty(0)
        self._list: list[float] | None = None
        self._i = 0
        self._n = 0

    def _fill(self, need: int) -> None:
        """Keeps the unread draws and adds at least `need` more."""
        m = max(need, _CHUNK)
        raw = self._bits.random_raw(2 * m)
        # CPython's random(): (a >> 5) * 2**26 + (b >> 6), over 2**53; exact in doubles.
        new = ((raw[0::2] >> 5).astype(np.float64) * 67108864.0 + (raw[1::2] >> 6)) * _TWO53
        self._arr = np.concatenate((self._arr[self._i :], new)) if self._i < self._n else new
        self._n = len(self._arr)
        self._i = 0
        self._list = None

    def random(self) -> float:
        i = self._i
        if i >= self._n:
            self._fill(1)
            i = 0
        lst = self._list
        if lst is None:
            lst = self._list = self._arr.tolist()
        self._i = i + 1
        return lst[i]

    def peek(self, m: int) -> np.ndarray:
        """The next `m` draws, not consumed."""
        if self._i + m > self._n:
            self._fill(m)
        return self._arr[self._i : self._i + m]

    def skip(self, c: int) -> None:
        """Consumes `c` draws (at most what `peek` showed)."""
        self._i += c


def parse_accepted(u: np.ndarray, beta: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Successive `sample_accepted` outcomes over the draws `u`: each sample reads draws until one is >= `beta` or `k`
    have been accepted. Returns (accepted, draws read) per sample, as many samples as `u` completes.

    Vectorised: a run of r accepts ended by a rejection holds r // k full samples (k accepts, k draws each) and then
    one sample of r % k accepts (r % k + 1 draws); a trailing run without its rejection holds only its full samples.
    """
    zeros = np.flatnonzero(u >= beta)
    # np.diff(zeros, prepend=-1) - 1 without np.diff's generic machinery (a third of this function's time).
    runs = np.empty_like(zeros)
    if len(zeros):
        runs[0] = zeros[0]
        np.subtract(zeros[1:], zeros[:-1], out=runs[1:])
        runs[1:] -= 1
    tail = len(u) - 1 - (int(zeros[-1]) if len(zeros) else -1)
    full = runs // k
    ends = np.cumsum(full + 1)  # one past each rejection's sample
    n = int(ends[-1]) if len(ends) else 0
    n_tail = tail // k
    acc = np.full(n + n_tail, k, dtype=np.int64)
    draws = np.full(n + n_tail, k, dtype=np.int64)
    if n:
        rest = runs - full * k
        acc[ends - 1] = rest
        draws[ends - 1] = rest + 1
    return acc, draws


def vectorisable(sample_accepted: Callable[[UniformStream], int], beta: float, k: int) -> bool:
    """Whether `sample_accepted` is the chained draw `parse_accepted` reproduces (the latency model's): the same
    outcomes and the same draws read, on a probe stream."""
    probe = UniformStream("llmd/mtp-probe")
    u = probe.peek(4000).copy()
    acc, draws = parse_accepted(u, beta, k)
    try:
        for a, d in zip(acc[:400].tolist(), draws[:400].tolist(), strict=True):
            before = probe._i
            if sample_accepted(probe) != a or probe._i - before != d:
                return False
    except AttributeError:  # it wants more of the generator than random()
        return False
    return True
