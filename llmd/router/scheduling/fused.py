"""The scoring pass: a hop's positions scored by every scorer in use, weighted, summed, and the highest totals found.

A scorer describes its score over the snapshot's columns as a term (`TermScorer.term`): a kind and the columns and
constants it reads. `column` evaluates one term with numpy (the scorers' `score_columns`: the list `score` stays each
scorer's reference); `pick` runs the whole pass. That pass is written twice: in C (_fused.c, built by
`pip install -e .`: over numpy it was some twenty array operations per hop, ~8% of a 544-GPU simulation's CPU, nearly
all of it dispatch and allocation) and here (`py_pick`: the reference the C is tested against,
tests/test_fused_native.py, and what runs where no compiler was at install time, or with LLMD_FUSED_PURE_PYTHON=1).
Both compute every value by the same IEEE operations in the same order, so a decision is the same bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmd.router.scheduling.picker import TIE_EPS

if TYPE_CHECKING:
    from llmd.router.scheduling.plugins import ScoringContext

# Term kinds (_fused.c's enum, in this order) and what follows the kind in each term:
K_CONST = 0  # value: every position scores it
K_PREFIX = 1  # gpu, cpu (units per endpoint), gpu_w, cpu_w, scale: min(1, (gpu * gpu_w + cpu * cpu_w) * scale)
K_KVUTIL = 2  # kv_usage: 1 - usage, clipped to [0, 1] (NaN: 0)
K_QUEUE = 3  # waiting: (max - q) / (max - min) over the positions; 1 for all when equal
K_LOAD = 4  # waiting, threshold: 0.5 * max(0, 1 - max(0, q) / threshold)
K_TOKENLOAD = 5  # inflight_tokens, hit tokens (or None), request tokens, limit: 1 - min(1, work / limit)
K_LRU = 6  # stamps, ids (per endpoint, -1: never stamped): 1 where never stamped, else (m - rank) / (m + 1)
KINDS = 7

Term = tuple[Any, ...]


class TermScorer(Protocol):
    """A scorer whose column score is a term (`score_columns` is then `column(term(ctx), idx)`)."""

    def term(self, ctx: ScoringContext) -> Term: ...


def column(term: Term, idx: np.ndarray) -> np.ndarray:
    """One term's raw scores at positions `idx`, with numpy."""
    kind = term[0]
    if kind == K_CONST:
        return np.full(len(idx), term[1], dtype=np.float64)
    if kind == K_PREFIX:
        _, gpu, cpu, gpu_w, cpu_w, scale = term
        return np.minimum(1.0, (gpu[idx] * gpu_w + cpu[idx] * cpu_w) * scale)
    if kind == K_KVUTIL:
        free = 1.0 - term[1][idx]
        return np.where(free > 0.0, np.minimum(free, 1.0), 0.0)
    if kind == K_QUEUE:
        qs = term[1][idx]
        if not len(qs):
            return np.zeros(0)
        lo, hi = int(qs.min()), int(qs.max())
        if hi == lo:
            return np.ones(len(qs))
        return (hi - qs) / (hi - lo)  # int64 / int: each the correctly rounded quotient, as Python's
    if kind == K_LOAD:
        _, waiting, threshold = term
        return 0.5 * np.maximum(0.0, 1.0 - np.maximum(0, waiting[idx]) / threshold)
    if kind == K_TOKENLOAD:
        _, inflight_tokens, hit_tokens, n, limit = term
        own = n - hit_tokens[idx] if hit_tokens is not None else np.full(len(idx), n)
        work = np.maximum(0, inflight_tokens[idx]) + np.maximum(0, own)
        return 1.0 - np.minimum(1.0, work / limit)
    if kind == K_LRU:
        _, all_stamps, ids = term
        stamps = all_stamps[ids[idx]]  # fancy indexing: a copy
        # Each holder's stamp is its own clock tick: the used ones are distinct, and sorting them is np.unique's
        # answer without its deduplication pass.
        used = np.sort(stamps[stamps != 0])
        if not len(used):
            return np.ones(len(idx))
        m = len(used)
        return np.where(stamps == 0, 1.0, (m - np.searchsorted(used, stamps)) / (m + 1))
    raise ValueError(f"unknown term kind {kind!r}")


def py_pick(
    idx: np.ndarray, terms: Sequence[Term], weights: Sequence[float], totals: np.ndarray, scores: np.ndarray | None
) -> list[int]:
    """Writes each candidate's total (the sum from 0 of weight x score, in term order) into `totals` and, unless
    None, each term's raw scores into a row of `scores`; returns the positions in `idx` of the totals within
    picker.TIE_EPS of the best."""
    totals[:] = 0.0
    acc = totals
    for k, (term, weight) in enumerate(zip(terms, weights, strict=True)):
        col = column(term, idx)
        if scores is not None:
            scores[k] = col
        acc = acc + weight * col
    totals[:] = acc
    if not len(idx):
        return []
    return np.flatnonzero(totals >= totals.max() - TIE_EPS).tolist()  # type: ignore[no-any-return]


def pick(
    idx: np.ndarray, terms: Sequence[Term], weights: tuple[float, ...], keep_scores: bool = True
) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    """The pass over positions `idx`: (totals, a row of raw scores per term or None, the tied best positions)."""
    n = len(idx)
    totals = np.empty(n)
    scores = np.empty((len(terms), n)) if keep_scores else None
    if _fused is not None:
        ties = _fused.pick(idx, tuple(terms), weights, totals, scores)
        if ties is not NotImplemented:
            return totals, scores, ties
    return totals, scores, py_pick(idx, terms, weights, totals, scores)


class WeightedRows:
    """A pass's columns as ScoreTable reads them, (name, weight, raw scores) per term, made when iterated."""

    __slots__ = ("_names", "_scores", "_weights")

    def __init__(self, names: Sequence[str], weights: Sequence[float], scores: np.ndarray) -> None:
        self._names = names
        self._weights = weights
        self._scores = scores

    def __iter__(self) -> Iterator[tuple[str, float, np.ndarray]]:
        return iter(zip(self._names, self._weights, self._scores, strict=True))

    def __len__(self) -> int:
        return len(self._names)


try:
    if os.environ.get("LLMD_FUSED_PURE_PYTHON") == "1":
        raise ImportError("LLMD_FUSED_PURE_PYTHON=1")
    from llmd.router.scheduling import _fused
except ImportError:  # no compiler where llmd was installed (or asked not to): py_pick serves, the same answers
    _fused = None
