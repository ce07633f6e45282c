"""benchmarks/routing_fleet.py's statistics: req/s over the load window (not the client's wall time), per-slice rates
and hit shares, and the comparison that counts a difference within two paired standard errors as a tie. The benchmark's
verdict on "precise >= every other router at every level" rests on these, so they are checked on rows whose answers
are known."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pandas as pd
import pytest
from benchutil import load_benchmark


@pytest.fixture(scope="module")
def fleet() -> ModuleType:
    return load_benchmark("routing_fleet")


def rows(ends: np.ndarray, hit: np.ndarray | float = 0.5) -> pd.DataFrame:
    n = len(ends)
    inp = np.full(n, 1000)
    return pd.DataFrame({"send_time": ends - 0.5, "e2e_s": np.full(n, 0.5), "input_tokens": inp,
                         "cached_tokens": (inp * hit).astype(int)})  # fmt: skip


def test_rate_counts_only_requests_that_ended_within_the_load(fleet: ModuleType) -> None:
    # 10 requests a second for 40 s, then a drain of 30 more over 5 s that a wall-clock rate would count.
    ends = np.concatenate([np.arange(400) / 10 + 0.05, 40 + (1 + np.arange(30)) / 6])
    rate, rates, hits = fleet.window_stats(rows(ends), 40.0)
    assert rate == pytest.approx(10.0)
    assert rates == pytest.approx([10.0] * 8)
    assert hits == pytest.approx([0.5] * 8)


def test_slices_hold_each_slice_rate_and_hit_share(fleet: ModuleType) -> None:
    rng = np.random.default_rng(1)
    ends = np.sort(rng.uniform(0, 40, 800))
    rate, rates, hits = fleet.window_stats(rows(ends, np.where(ends < 20, 0.4, 0.6)), 40.0)
    assert rate == pytest.approx(20.0)
    assert rates == pytest.approx(np.bincount(np.minimum((ends / 5).astype(int), 7), minlength=8) / 5.0)
    assert hits == pytest.approx([0.4] * 4 + [0.6] * 4)
    _, _, empty = fleet.window_stats(rows(np.array([1.0, 2.0])), 40.0)
    assert math.isnan(empty[-1])  # a slice without requests has no hit share


def result(fleet: ModuleType, hit: float, rps: float, hits: list[float], rates: list[float]) -> object:
    return fleet.Result("x", 1.0, False, hit_share=hit, req_per_s=rps, hit_slices=hits, rate_slices=rates)


def test_a_difference_within_paired_noise_ties_and_one_beyond_it_loses(fleet: ModuleType) -> None:
    scale = fleet.TIME_SCALE
    ramp = [0.3, 0.7, 0.8, 0.85, 0.86, 0.87, 0.86, 0.87]  # the ramp both runs share cancels in the pairs
    base = [20.0, 26.0, 27.0, 26.0, 27.0, 26.0, 27.0, 26.0]
    p = result(fleet, 0.851, 41.4, ramp, base)
    noisy = [b + d for b, d in zip(base, [0.4, -0.4, 0.4, -0.4, 0.4, -0.4, 0.4, 0.4], strict=True)]
    se = fleet.paired_se(base, noisy) * scale
    assert 0 < se < 0.5
    assert fleet.not_worse(p, result(fleet, 0.851, 41.4 + 1.5 * se, ramp, noisy))
    assert not fleet.not_worse(p, result(fleet, 0.851, 41.4 + 2.5 * se, ramp, noisy))
    # A rival ahead in every slice by the same margin has no noise to hide in: any lead of its counts.
    ahead = [h + 0.02 for h in ramp]
    assert fleet.paired_se(ramp, ahead) == pytest.approx(0.0, abs=1e-12)
    assert not fleet.not_worse(p, result(fleet, 0.871, 41.4, ahead, base))
    # Without slices to pair (too short a run) only >= counts.
    assert not fleet.not_worse(result(fleet, 0.85, 41.0, [], []), result(fleet, 0.85, 41.1, [], []))
    assert fleet.not_worse(result(fleet, 0.85, 41.1, [], []), result(fleet, 0.85, 41.1, [], []))
