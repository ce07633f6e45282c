"""A run's numbers for a paper's table: throughput, latency quantiles, where prompt tokens came from, preemptions,
errors and KV transfers (their count, size and time). The headline numbers (token and request counts, duration,
errors) are llmd.report's, so the demo's table and this one never disagree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from analysis import transfers
from analysis.hits import decompose
from analysis.runs import Run
from llmd.report.summary import failed, summarize_frames

QUANTILES = (50, 90, 99)
# name -> what it measures; every one in seconds, quantiles over successful requests
LATENCIES = {
    "ttft": "time to first token",
    "tpot": "time per output token after the first: (E2E - TTFT) / (output tokens - 1)",
    "itl": "inter-token latency: each request's mean gap between tokens",
    "e2e": "end-to-end latency",
    "queue": "time waiting in the router before dispatch",
}


@dataclass
class Summary:
    """One run. Times in seconds, shares in [0, 1]; NaN where the run has no data for a number."""

    label: str
    requests: int
    errors: int
    duration_s: float
    gpus: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    requests_per_min: float
    input_tokens_per_min: float
    output_tokens_per_min: float
    output_tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float  # median over requests of 1 / TPOT: the interactivity a user sees
    latency: dict[str, float]  # "<name>_p<q>_s" for each of LATENCIES and QUANTILES, plus "<name>_mean_s"
    hits: dict[str, float]  # analysis.hits.decompose
    cached_share: float  # cached / prompt tokens the serving engines reported (includes KV handed over by P/D)
    preemptions: int | None
    kv_transfers: int | None  # KV transfers (P/D handoffs and P2P pulls) the engines completed
    # Per request, from the router's rows (analysis.transfers): how many pulled KV (None: the run's files predate the
    # columns), bytes and seconds per transfer (the simulator's modelled pull; live, the serving leg until its first
    # output, the pull within)
    kv_transfer_requests: int | None
    kv_transfer_bytes_mean: float
    kv_transfer_bytes_p90: float
    kv_transfer_s_mean: float
    kv_transfer_s_p90: float
    rejected: int | None  # refused by the router with 429
    pd_paths: dict[str, int]  # requests per path: decode-only, pd, pd-fallback, p2p

    def row(self) -> dict[str, Any]:
        """Flat: one CSV row or DataFrame row."""
        d = asdict(self)
        latency, hits, paths = d.pop("latency"), d.pop("hits"), d.pop("pd_paths")
        d.update(latency)
        d.update({f"hit_{k}": v for k, v in hits.items()})
        d.update({f"path_{k}": v for k, v in paths.items()})
        return d


def _latencies(ok: pd.DataFrame) -> dict[str, np.ndarray]:
    out_tokens = ok["output_tokens"].to_numpy(dtype=float)
    decode_s = (ok["e2e_s"] - ok["ttft_s"]).to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out_tokens > 1, decode_s / (out_tokens - 1), np.nan)
    return {
        "ttft": ok["ttft_s"].to_numpy(dtype=float),
        "tpot": tpot,
        "itl": ok["itl_mean_s"].to_numpy(dtype=float),
        "e2e": ok["e2e_s"].to_numpy(dtype=float),
        "queue": ok["router_queue_s"].to_numpy(dtype=float),
    }


def latency_values(run: Run) -> dict[str, np.ndarray]:
    """Each of LATENCIES per successful request, seconds (NaN where a request lacks it)."""
    df = run.client
    return _latencies(df[~failed(df)] if len(df) else df)


def _quantiles(values: dict[str, np.ndarray]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, arr in values.items():
        arr = arr[np.isfinite(arr)]
        out[f"{name}_mean_s"] = float(arr.mean()) if arr.size else math.nan
        for q in QUANTILES:
            out[f"{name}_p{q}_s"] = float(np.percentile(arr, q)) if arr.size else math.nan
    return out


def _count(series: pd.DataFrame, column: str) -> int | None:
    if not len(series):
        return None
    v = series[column].to_numpy(dtype=float)
    v = v[v >= 0]
    return int(v.sum()) if v.size else None


def summarize(run: Run) -> Summary:
    base = summarize_frames(run.requests, run.timeseries, label=run.label)
    values = latency_values(run)
    tpot = values["tpot"]
    tpot = tpot[np.isfinite(tpot) & (tpot > 0)]
    gpus = sum(run.gpus.values())
    duration = base.duration_s
    per_s = 1.0 / duration if duration > 0 else math.nan
    client = run.client
    paths = client["pd_path"].astype(str).value_counts().to_dict() if len(client) else {}
    engines = run.series("engines")
    return Summary(
        label=run.label,
        requests=base.requests,
        errors=base.errors,
        duration_s=duration,
        gpus=gpus,
        input_tokens=base.input_tokens,
        output_tokens=base.output_tokens,
        cached_tokens=base.cached_tokens,
        requests_per_min=(base.requests - base.errors) * per_s * 60,
        input_tokens_per_min=base.input_tokens_per_min,
        output_tokens_per_min=base.output_tokens_per_min,
        output_tokens_per_s_per_gpu=base.output_tokens * per_s / gpus if gpus else math.nan,
        tokens_per_s_per_user=float(np.median(1.0 / tpot)) if tpot.size else math.nan,
        latency=_quantiles(values),
        hits=decompose(run.router, run.series("router"), engines),
        cached_share=math.nan if base.hit_share is None else base.hit_share,
        preemptions=base.preemptions,
        kv_transfers=_count(engines, "kv_transfers"),
        **transfers.numbers(run.router),
        rejected=_count(run.series("router"), "rejected"),
        pd_paths={str(k): int(v) for k, v in paths.items() if k},
    )
