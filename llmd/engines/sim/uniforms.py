"""The MTP acceptance draws of one engine core, readable one at a time or in bulk.

`UniformStream(seed)` yields exactly what `random.Random(seed).random()` yields (CPython and numpy's MT19937 share the
generator and the 53-bit double), so swapping it in changes no result. The single-step path hands it to the latency
model's `sample_accepted` as before; decode fast-forward (decode_run.py) reads the next draws without consuming them
(`ahead`), works out how many k steps use (`accepted`, one sample at a time), and consumes only those (`skip`), so the
stream is where single-stepping would have left it. The draws are kept as C doubles (an array): the planner's C pass
reads them in place; a single step reads one at a time, where numpy's per-element cost is what it would save.
"""

from __future__ import annotations

import importlib
import os
import random
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_CHUNK = 1024
_TWO53 = 1.0 / 9007199254740992.0


class UniformStream:
    """`random.Random(seed).random()`'s sequence with a cursor: `random()` reads one, `ahead(m)`/`peek(m)` show the
    next m, `skip(c)` consumes c."""

    __slots__ = ("_bits", "_buf", "_i")

    def __init__(self, seed: str) -> None:
        state = random.Random(seed).getstate()[1]
        self._bits = np.random.MT19937()
        key = np.array(state[:624], dtype=np.uint32)
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": state[624]}}
        # C doubles, not a list of floats: the planner's C pass reads them in place, so a draw becomes a float object
        # only where a single step reads it, and a refill moves the unread ones (memmove) instead of copying
        # references to them into a new list.
        self._buf = array("d")
        self._i = 0

    def _fill(self, need: int) -> None:
        """Keeps the unread draws and adds at least `need` more (in bulk: numpy's MT19937, CPython's maths)."""
        m = max(need, _CHUNK)
        buf = self._buf
        del buf[: self._i]
        buf.frombytes(_make_doubles(self._bits.random_raw(2 * m)))
        self._i = 0

    def random(self) -> float:
        i = self._i
        if i >= len(self._buf):
            self._fill(1)
            i = 0
        self._i = i + 1
        return self._buf[i]  # type: ignore[no-any-return]

    def ahead(self, m: int) -> tuple[Any, int]:
        """(buffer, cursor): the next `m` draws are buffer[cursor:cursor + m], not consumed (read, never written; an
        array of doubles, valid until the next read that refills it)."""
        if self._i + m > len(self._buf):
            self._fill(m)
        return self._buf, self._i

    def peek(self, m: int) -> list[float]:
        """The next `m` draws, not consumed."""
        buf, i = self.ahead(m)
        return buf[i : i + m].tolist()  # type: ignore[no-any-return]

    def skip(self, c: int) -> None:
        """Consumes `c` draws (at most what `ahead` showed)."""
        self._i += c


def _doubles(raw: np.ndarray) -> bytes:
    """CPython random()'s doubles from MT19937 words, packed: (a >> 5) * 2**26 + (b >> 6), over 2**53, for each pair
    (a, b) of `raw`; exact in doubles. `_decodeplan.doubles` is this in C (one pass, no arrays)."""
    return (((raw[0::2] >> 5).astype(np.float64) * 67108864.0 + (raw[1::2] >> 6)) * _TWO53).tobytes()


def accepted(u: Sequence[float], i: int, beta: float, k: int) -> tuple[int, int]:
    """One `sample_accepted` outcome read from the draws u[i:]: (drafts accepted, where the next sample reads).
    Drafts are accepted while draws are < `beta`, up to `k`; a rejection reads its draw, the k-th accept ends it."""
    a = 0
    while a < k:
        x = u[i]
        i += 1
        if x >= beta:
            break
        a += 1
    return a, i


def vectorisable(sample_accepted: Callable[[UniformStream], int], beta: float, k: int) -> bool:
    """Whether `sample_accepted` is the chained draw `accepted` reproduces (the latency model's): the same outcomes
    and the same draws read, on a probe stream."""
    probe = UniformStream("llmd/mtp-probe")
    u = probe.peek(4000)
    i = 0
    try:
        for _ in range(400):
            a, i = accepted(u, i, beta, k)
            if sample_accepted(probe) != a or probe._i != i:
                return False
    except AttributeError:  # it wants more of the generator than random()
        return False
    return True


def _decode_plan_c() -> Any:
    """llmd.engines.sim._decodeplan (the decode planner's pass and the draws' refills in C), or None where it was not
    built or with LLMD_DECODE_PLAN_PURE_PYTHON=1: the Python twins serve then (here and in decode_run.py)."""
    if os.environ.get("LLMD_DECODE_PLAN_PURE_PYTHON") == "1":
        return None
    try:
        # By name: the C module has no stubs, and mypyc (which compiles this file) would have its attributes checked.
        return importlib.import_module("llmd.engines.sim._decodeplan")
    except ImportError:
        return None


DECODE_PLAN_C: Any = _decode_plan_c()
_make_doubles: Callable[[np.ndarray], bytes] = DECODE_PLAN_C.doubles if DECODE_PLAN_C is not None else _doubles
