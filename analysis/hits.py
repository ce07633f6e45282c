"""Where a run's prompt tokens came from: a hit in the chosen engine's GPU KV, a restore from its CPU tier, KV pulled
from a peer (P2P), or computed. As shares of the prompt tokens the router routed.

The split is the router's, made when it routed each request: its series give the GPU and CPU shares of every
second's routed tokens, its request rows the expected hits (own tiers plus the P2P pull), so the pull is what is
expected beyond the two tiers and the rest is computed. The engines' own counters measure the GPU and CPU shares
again (`measured_gpu`, `measured_cpu`): the check on what the router expected. A run without router rows is split
from the engines' counters alone, with no P2P share.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

PARTS = ("gpu", "cpu", "p2p", "computed")
LABELS = {"gpu": "GPU KV hit", "cpu": "CPU tier", "p2p": "P2P pull", "computed": "computed"}


def weighted_share(series: pd.DataFrame, column: str) -> float:
    """A share column of per-second rows, weighted by each row's prompt tokens (NaN when no row has one)."""
    if not len(series) or column not in series:
        return math.nan
    v = series[column].to_numpy(dtype=float)
    w = series["tokens_in_per_s"].to_numpy(dtype=float)
    keep = np.isfinite(v) & np.isfinite(w)
    if not keep.any():
        return math.nan
    if w[keep].sum() > 0:
        return float((v[keep] * w[keep]).sum() / w[keep].sum())
    return float(v[keep].mean())


def decompose(router_rows: pd.DataFrame, router_series: pd.DataFrame, engine_series: pd.DataFrame) -> dict[str, float]:
    """{gpu, cpu, p2p, computed, measured_gpu, measured_cpu}: shares in [0, 1], NaN where the run has no data."""
    out = dict.fromkeys((*PARTS, "measured_gpu", "measured_cpu"), math.nan)
    out["measured_gpu"] = weighted_share(engine_series, "hit_share_gpu")
    out["measured_cpu"] = weighted_share(engine_series, "hit_share_cpu")
    routed = (
        router_rows[(router_rows["pod"].astype(str) != "") & (router_rows["input_tokens"] > 0)]
        if len(router_rows)
        else router_rows
    )
    if len(routed) and (routed["expected_hit_tokens"] >= 0).any():
        gpu = _zero_if_nan(weighted_share(router_series, "hit_share_gpu"))
        cpu = _zero_if_nan(weighted_share(router_series, "hit_share_cpu"))
        expected = float(routed["expected_hit_tokens"].clip(lower=0).sum() / routed["input_tokens"].sum())
    elif math.isfinite(out["measured_gpu"]):
        gpu, cpu = out["measured_gpu"], _zero_if_nan(out["measured_cpu"])
        out.update(gpu=gpu, cpu=cpu, computed=max(0.0, 1.0 - gpu - cpu))  # the engines cannot tell a pull apart
        return out
    else:
        return out
    out["gpu"], out["cpu"] = gpu, cpu
    out["p2p"] = max(0.0, expected - gpu - cpu)
    out["computed"] = max(0.0, 1.0 - max(expected, gpu + cpu))
    return out


def _zero_if_nan(v: float) -> float:
    return v if math.isfinite(v) else 0.0
