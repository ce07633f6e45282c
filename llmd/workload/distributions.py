"""Distributions fitted to published percentiles (p50/p90/p99), sampled deterministically from a numpy Generator.

Agentic traffic is heavy-tailed and no single lognormal matches p50, p90 and p99 at once, so `Quantiles` is a
piecewise lognormal: log(x) is linear in the standard-normal z between the knots (z50=0, z90, z99), the lower tail
keeps the 50-90 slope, the upper tail the 90-99 slope. It reproduces the given percentiles exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z90 = 1.2815515655446004
Z99 = 2.3263478740408408
# A fixed grid over z for means (quadrature); +-8 sigma covers the mass a float can see.
_Z_GRID = np.linspace(-8.0, 8.0, 4001)
_Z_PDF = np.exp(-0.5 * _Z_GRID**2) / math.sqrt(2 * math.pi)


@dataclass(frozen=True, slots=True)
class Quantiles:
    """A positive distribution given by p50, p90 and (optionally) p99, clipped to [lo, hi]."""

    p50: float
    p90: float
    p99: float | None = None
    lo: float = 0.0
    hi: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.p50 < self.p90:
            raise ValueError(f"need 0 < p50 < p90, got p50={self.p50}, p90={self.p90}")
        if self.p99 is not None and not self.p90 < self.p99:
            raise ValueError(f"need p90 < p99, got p90={self.p90}, p99={self.p99}")
        if self.lo > self.hi:
            raise ValueError(f"need lo <= hi, got lo={self.lo}, hi={self.hi}")

    @classmethod
    def lognormal(cls, mean: float, sd: float, lo: float = 0.0, hi: float = math.inf) -> Quantiles:
        """The lognormal with this mean and standard deviation (llm-d-benchmark states its profiles this way)."""
        if mean <= 0 or sd <= 0:
            raise ValueError(f"need mean > 0 and sd > 0, got mean={mean}, sd={sd}")
        sigma2 = math.log1p((sd / mean) ** 2)
        mu = math.log(mean) - sigma2 / 2
        sigma = math.sqrt(sigma2)
        return cls(math.exp(mu), math.exp(mu + Z90 * sigma), math.exp(mu + Z99 * sigma), lo, hi)

    def scaled(self, factor: float) -> Quantiles:
        """The same shape with every value (and the clip bounds) multiplied by `factor`."""
        p99 = None if self.p99 is None else self.p99 * factor
        return Quantiles(self.p50 * factor, self.p90 * factor, p99, self.lo * factor, self.hi * factor)

    def ppf_z(self, z: np.ndarray) -> np.ndarray:
        """Value at standard-normal z (vectorized): the inverse CDF composed with Phi."""
        l50, l90 = math.log(self.p50), math.log(self.p90)
        s1 = (l90 - l50) / Z90
        s2 = s1 if self.p99 is None else (math.log(self.p99) - l90) / (Z99 - Z90)
        z = np.asarray(z, dtype=float)
        # One slope: no knot to switch at (np.where costs as much as the rest).
        logx = l50 + s1 * z if s2 == s1 else np.where(z <= Z90, l50 + s1 * z, l90 + s2 * (z - Z90))
        x = np.exp(logx)
        # np.clip costs several times two plain ufuncs on the short arrays a session plan draws.
        if self.lo > 0:
            x = np.maximum(x, self.lo)
        if self.hi < math.inf:
            x = np.minimum(x, self.hi)
        return x

    def sample(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray | float:
        if n is None:
            return float(self.ppf_z(rng.standard_normal()))
        return self.ppf_z(rng.standard_normal(n))

    def sample_int(self, rng: np.random.Generator, n: int, minimum: int = 1) -> np.ndarray:
        """n draws rounded to integers of at least `minimum` (token counts, turn counts, group sizes)."""
        return np.maximum(np.rint(self.ppf_z(rng.standard_normal(n))).astype(np.int64), minimum)

    def mean(self) -> float:
        return float(np.sum(self.ppf_z(_Z_GRID) * _Z_PDF) * (_Z_GRID[1] - _Z_GRID[0]))


def fixed(value: float) -> Quantiles:
    """A point mass (within float rounding): handy to pin a profile's dimension, e.g. CyberGym's 10 turns."""
    return Quantiles(value, value * (1 + 1e-9), None, value, value)


def percentile(values: np.ndarray | list[float], q: float) -> float:
    """The q-th percentile (0-100) of observed values, the statistic the traffic table reports."""
    return float(np.percentile(np.asarray(values, dtype=float), q))
