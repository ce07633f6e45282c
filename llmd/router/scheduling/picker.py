"""The picker: weighted sum of the scorers' scores, highest total wins, exact ties broken by the seeded RNG."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from llmd.router.scheduling.plugins import PickerPlugin, register_picker

# Totals this close are a tie: float sums of the same parts in another order differ in the last bits.
TIE_EPS = 1e-9


def weighted_totals(
    n: int, columns: Sequence[tuple[str, float, Sequence[float]]]
) -> tuple[list[float], list[dict[str, float]]]:
    """`columns`: (scorer name, weight, its scores for the n candidates). Returns per candidate the total and its
    parts (weight x score per scorer); each total is the sum of its parts in column order."""
    parts: list[dict[str, float]] = [{} for _ in range(n)]
    for name, weight, scores in columns:
        for p, s in zip(parts, scores, strict=True):
            p[name] = weight * s
    return [sum(p.values()) for p in parts], parts


def column_totals(n: int, columns: Sequence[tuple[str, float, Sequence[float]]]) -> list[float]:
    """`weighted_totals`' totals alone, the same floats (each the sum of weight x score in column order, from 0),
    without a dict of parts per candidate: the picker needs only the totals."""
    totals: list[float] = [0.0] * n
    for _, weight, scores in columns:
        totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
    return totals


def column_totals_array(n: int, columns: Sequence[tuple[str, float, np.ndarray]]) -> np.ndarray:
    """`column_totals` over arrays: the same IEEE operations in the same order, element by element."""
    totals = np.zeros(n)
    for _, weight, scores in columns:
        totals = totals + weight * scores
    return totals


def tied(totals: np.ndarray) -> list[int]:
    """Positions of an array's totals within TIE_EPS of the highest (none of no totals)."""
    if not len(totals):
        return []
    return np.flatnonzero(totals >= totals.max() - TIE_EPS).tolist()  # type: ignore[no-any-return]


def choose(ties: Sequence[int], rng: random.Random) -> int:
    """The one tied position, or a seeded-random one of several (the RNG is drawn only when there is a tie, so
    untied decisions don't shift later draws)."""
    if not ties:
        raise ValueError("no candidates to pick from")
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def pick_max_array(totals: np.ndarray, rng: random.Random) -> int:
    """`pick_max` of an array of totals (the same choice and the same RNG draws)."""
    return choose(tied(totals), rng)


def pick_max(totals: Sequence[float], rng: random.Random) -> int:
    """Index of the highest total; among ties, a seeded-random one (`choose`)."""
    if not totals:
        raise ValueError("no candidates to pick from")
    best = max(totals)
    return choose([i for i, t in enumerate(totals) if t >= best - TIE_EPS], rng)


def pick_min(values: Sequence[float], rng: random.Random) -> int:
    """Index of the lowest value, ties broken as in `pick_max`."""
    return pick_max([-v for v in values], rng)


register_picker(PickerPlugin("max-score", pick_max))
register_picker(PickerPlugin("min-value", pick_min))
