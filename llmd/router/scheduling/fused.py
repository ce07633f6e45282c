"""The pipeline's passes over a hop's columns: the scoring pass (`pick`: every scorer in use scores the hop's
positions, the columns are weighted and summed and the highest totals found), the capacity filters' pass (`room`) and
the precise prefix source's hit columns (`hits`) and what the pipeline's tests read of them over a hop (`summary`).

A scorer describes its score over the snapshot's columns as a term (`TermScorer.term`): a kind and the columns and
constants it reads. `column` evaluates one term with numpy (the scorers' `score_columns`; the list `score` stays each
scorer's reference).

Each pass is written twice: in C (_fused.c, built by `pip install -e .`: over numpy a decision was some sixty array
operations, each a few hundred elements of work behind a microsecond of dispatch and allocation, ~15% of a 544-GPU
simulation's CPU) and here (py_pick, py_room, py_hits, py_summary: the reference the C is tested against,
tests/test_fused_native.py, and what runs where no compiler was at install time, or with LLMD_FUSED_PURE_PYTHON=1).
Both compute every value by the same operations in the same order, so a decision is the same bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from llmd.router.scheduling.columns import kv_need
from llmd.router.scheduling.picker import column_totals_array, tied

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
    """Writes each candidate's total (picker.column_totals_array of the terms' columns) into `totals` and, unless
    None, each term's raw scores into a row of `scores`; returns the positions in `idx` of the tied best totals
    (picker.tied)."""
    columns = [("", weight, column(term, idx)) for term, weight in zip(terms, weights, strict=True)]
    if scores is not None:
        for k, (_, _, col) in enumerate(columns):
            scores[k] = col
    totals[:] = column_totals_array(len(idx), columns)
    return tied(totals)


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


def room(
    idx: np.ndarray,
    inflight: np.ndarray,
    max_inflight: int | None,
    kv_capacity_blocks: np.ndarray,
    kv_tokens: np.ndarray,
    cached: np.ndarray | None,
    units: int,
    unit: int,
    need_tokens: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, fit, doubt): the positions from `idx` (in its order) with a slot (in flight below `max_inflight`; all
    of them when it is None); those of the slots the request's KV may fit at (filters.kv_fits over the KV in flight
    `kv_tokens`); and the offsets in `fit` of those it fits at only if it shares enough of its `units` prompt units
    (of `unit` tokens, at most `cached` of them per endpoint where given) with the KV in flight there: the caller
    works those out (RequestColumns.inflight_kv) and takes out the ones that do not."""
    n = len(idx)
    if _fused is not None:
        out = np.empty(3 * n, np.intp)
        most = -1 if max_inflight is None else max_inflight
        got = _fused.room(idx, inflight, most, kv_capacity_blocks, kv_tokens, cached, units, unit, need_tokens,
                          block_size, out)  # fmt: skip
        if got is not NotImplemented:
            k, f, d = got
            return out[:k], out[n : n + f], out[2 * n : 2 * n + d]
    return py_room(idx, inflight, max_inflight, kv_capacity_blocks, kv_tokens, cached, units, unit, need_tokens,
                   block_size)  # fmt: skip


def py_room(
    idx: np.ndarray,
    inflight: np.ndarray,
    max_inflight: int | None,
    kv_capacity_blocks: np.ndarray,
    kv_tokens: np.ndarray,
    cached: np.ndarray | None,
    units: int,
    unit: int,
    need_tokens: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`room` with numpy."""
    slots = idx if max_inflight is None else idx[inflight[idx] < max_inflight]
    cap, kv = kv_capacity_blocks[slots], kv_tokens[slots]
    limit = (cap - 1) * block_size - kv_need(need_tokens, block_size)
    loose = (cap <= 0) | (inflight[slots] <= 0) | (kv <= limit)
    if not unit:
        return slots, slots[loose], np.zeros(0, np.intp)
    # Sharing takes off at most the request's units the engine has cached: where even that would not make it fit,
    # it does not, without the search per endpoint.
    most = units if cached is None else np.minimum(cached[slots], units)
    could = ~loose & (kv - most * unit <= limit)
    maybe = loose | could
    return slots, slots[maybe], np.flatnonzero(could[maybe])


def hits(
    blocks_any: np.ndarray,
    blocks_gpu: np.ndarray,
    ids: np.ndarray,
    spec: np.ndarray | None,
    spec_ids: np.ndarray | None,
    cap: int,
    block_size: int,
) -> tuple[np.ndarray, ...]:
    """A precise prefix source's hit columns from a KV index's answer by holder id (`blocks_any`, `blocks_gpu`,
    gathered through the endpoints' `ids`) and the speculative entries' (`spec` through `spec_ids`, or None): (has,
    gpu, cpu, gpu_tokens, cpu_tokens, tokens) per endpoint (HitColumns' arrays), tokens capped at `cap`. A
    speculative prefix counts only where it beats the real GPU blocks: at least as long as the real prefix it
    replaces it, shorter it is the GPU share (PrecisePrefixScorer._hits holder by holder)."""
    if _fused is not None:
        m = len(ids)
        out = np.empty((5, m), np.int64)
        has = np.empty(m, bool)
        if _fused.hits(blocks_any, blocks_gpu, ids, spec, spec_ids, cap, block_size, out, has) is not NotImplemented:
            return (has, *out)
    return py_hits(blocks_any, blocks_gpu, ids, spec, spec_ids, cap, block_size)


def py_hits(
    blocks_any: np.ndarray,
    blocks_gpu: np.ndarray,
    ids: np.ndarray,
    spec: np.ndarray | None,
    spec_ids: np.ndarray | None,
    cap: int,
    block_size: int,
) -> tuple[np.ndarray, ...]:
    """`hits` with numpy."""
    held = blocks_any[ids]  # fancy indexing: fresh arrays, ours to change
    gpu = blocks_gpu[ids]
    has = held > 0  # every holder of the first block holds at least it
    if spec is not None:
        assert spec_ids is not None
        s = spec[spec_ids]
        s[s <= gpu] = 0
        on = s > 0
        if on.any():
            longer = on & (s >= held)
            held[longer] = s[longer]
            gpu[on] = s[on]
            has |= on
    gpu_t = np.minimum(cap, gpu * block_size)
    tokens = np.minimum(cap, held * block_size)
    return has, gpu, held - gpu, gpu_t, tokens - gpu_t, tokens


class HopHits(NamedTuple):
    """A prefix source's hits over one hop's positions, as the pipeline's cold, reason and P2P tests read them."""

    first: bool  # the hop's first endpoint has a hit
    any: bool  # some endpoint has one
    all: bool  # every endpoint has one
    same_tokens: bool  # every endpoint's hit is as many tokens (none included)
    best_units: int  # the most units (GPU + CPU) an endpoint with a hit holds; 0 when none has one
    best_weighted: float  # the most tier-weighted units (gpu * gpu_w + cpu * cpu_w) an endpoint holds
    best_tokens: int  # the most hit tokens an endpoint holds


def summary(
    has: np.ndarray,
    gpu: np.ndarray,
    cpu: np.ndarray,
    tokens: np.ndarray,
    idx: np.ndarray,
    gpu_w: float,
    cpu_w: float,
) -> HopHits:
    """HopHits over positions `idx` (not empty)."""
    if _fused is not None:
        got = _fused.summary(has, gpu, cpu, tokens, idx, gpu_w, cpu_w)
        if got is not NotImplemented:
            return HopHits(*got)
    return py_summary(has, gpu, cpu, tokens, idx, gpu_w, cpu_w)


def py_summary(
    has: np.ndarray,
    gpu: np.ndarray,
    cpu: np.ndarray,
    tokens: np.ndarray,
    idx: np.ndarray,
    gpu_w: float,
    cpu_w: float,
) -> HopHits:
    """`summary` with numpy."""
    h, g, c, t = has[idx], gpu[idx], cpu[idx], tokens[idx]
    units = (g + c)[h]
    return HopHits(
        bool(h[0]),
        bool(h.any()),
        bool(h.all()),
        bool((t == t[0]).all()),
        int(units.max()) if len(units) else 0,
        float((g * gpu_w + c * cpu_w).max()),
        int(t.max()),
    )


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
