"""The numbers of a run's summary table, from the /requests (and, when present, /timeseries) of a metrics HDF5.

Rows of every producer can sit in one file (a merged run): the client's rows are preferred, since they are what the
user saw; a file without client rows is summarized from whatever rows it has.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

CLIENT_SOURCES = ("client", "loadgen")


@dataclass
class RunSummary:
    """One run's headline numbers. Times in seconds; None when the file has no data for a number."""

    label: str
    requests: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    input_tokens_per_min: float
    output_tokens_per_min: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    router_queue_p90_s: float | None
    hit_share: float | None  # cached / prompt tokens over requests that report both
    hit_share_gpu: float | None = None  # tier split, when a producer recorded it (time-series hit_share_*)
    hit_share_cpu: float | None = None
    preemptions: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    return arr[np.isfinite(arr)]


def _pct(values: Any, q: float) -> float | None:
    arr = _finite(values)
    return float(np.percentile(arr, q)) if arr.size else None


def client_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The load generator's rows when the file holds several producers' rows, else all of them."""
    if "source" in df and len(df):
        # A merged run of several attempts names its clients client, client#2, ... (llmd.metrics.merge).
        mine = df[df["source"].astype(str).str.split("#").str[0].isin(CLIENT_SOURCES)]
        if len(mine) and len(mine) < len(df):
            return mine
    return df


def failed(df: pd.DataFrame) -> pd.Series:
    """True for a request that got no 2xx answer or reported an error (the summary's and analysis' one rule)."""
    status = df["status"].astype(int)
    return (status < 200) | (status >= 300) | (df["error"].astype(str) != "")


def _duration(df: pd.DataFrame) -> float:
    send = _finite(df["send_time"])
    if not send.size:
        return 0.0
    end = _finite(df["send_time"] + df["e2e_s"].fillna(0.0))
    return float(max(end.max() if end.size else send.max(), send.max()) - send.min())


def engine_series(ts: pd.DataFrame | None) -> pd.DataFrame | None:
    """The engines' own time-series rows of a merged file (not the client's, not the router's predictions); a file
    without such rows as it is."""
    if ts is None or "source" not in ts or not len(ts):
        return ts
    src = ts["source"].astype(str)
    others = src.isin(CLIENT_SOURCES) | (src == "router") | src.str.startswith("router/")
    return ts[~others] if (~others).any() else ts


def _tier_shares(ts: pd.DataFrame | None) -> tuple[float | None, float | None]:
    """Mean GPU/CPU hit shares over the time-series bins that recorded them (weighted by prompt tokens if known)."""
    ts = engine_series(ts)
    if ts is None or not len(ts):
        return None, None
    out: list[float | None] = []
    for col in ("hit_share_gpu", "hit_share_cpu"):
        rows = ts[np.isfinite(ts[col].astype(float))]
        if not len(rows):
            out.append(None)
            continue
        w = rows["tokens_in_per_s"].astype(float).fillna(0.0).to_numpy()
        v = rows[col].astype(float).to_numpy()
        out.append(float((v * w).sum() / w.sum()) if w.sum() > 0 else float(v.mean()))
    return out[0], out[1]


def _preemptions(ts: pd.DataFrame | None) -> int | None:
    """Preemptions the engines recorded in their series (None when no engine wrote any)."""
    eng = engine_series(ts)
    if eng is None or not len(eng):
        return None
    p = eng["preemptions"].astype(int)
    p = p[p >= 0]
    return int(p.sum()) if len(p) else None


def summarize_frames(
    requests: pd.DataFrame,
    timeseries: pd.DataFrame | None = None,
    *,
    label: str = "",
    preemptions: int | None = None,
) -> RunSummary:
    df = client_rows(requests)
    n = len(df)
    if n == 0:
        return RunSummary(label, 0, 0, 0.0, 0, 0, 0, 0.0, 0.0, None, None, None, None, None, preemptions=preemptions)
    err = failed(df)
    ok = df[~err]
    inp = ok["input_tokens"].astype(int)
    out = ok["output_tokens"].astype(int)
    cached = ok["cached_tokens"].astype(int)
    input_tokens = int(inp[inp >= 0].sum())
    output_tokens = int(out[out >= 0].sum())
    both = (inp > 0) & (cached >= 0)
    hit = float(cached[both].sum() / inp[both].sum()) if both.any() else None
    duration = _duration(df)
    per_min = 60.0 / duration if duration > 0 else 0.0
    gpu, cpu = _tier_shares(timeseries)
    if preemptions is None:
        preemptions = _preemptions(timeseries)
    return RunSummary(
        label=label,
        requests=n,
        errors=int(err.sum()),
        duration_s=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=int(cached[cached >= 0].sum()),
        input_tokens_per_min=input_tokens * per_min,
        output_tokens_per_min=output_tokens * per_min,
        ttft_p50_s=_pct(ok["ttft_s"], 50),
        ttft_p90_s=_pct(ok["ttft_s"], 90),
        e2e_p50_s=_pct(ok["e2e_s"], 50),
        router_queue_p90_s=_pct(df["router_queue_s"], 90),
        hit_share=hit,
        hit_share_gpu=gpu,
        hit_share_cpu=cpu,
        preemptions=preemptions,
    )


def summarize(path: str | os.PathLike[str], *, label: str = "", preemptions: int | None = None) -> RunSummary:
    """The summary of one metrics HDF5."""
    from llmd.metrics import read_requests, read_timeseries

    return summarize_frames(read_requests(path), read_timeseries(path), label=label, preemptions=preemptions)


def hit_share_per_turn(requests: pd.DataFrame) -> pd.Series:
    """Cache-hit share (cached / prompt tokens) by turn index, over successful requests reporting both."""
    df = client_rows(requests)
    df = df[~failed(df) & (df["input_tokens"] > 0) & (df["cached_tokens"] >= 0) & (df["turn"] >= 0)]
    if not len(df):
        return pd.Series(dtype=float)
    g = df.groupby("turn")[["cached_tokens", "input_tokens"]].sum()
    return (g["cached_tokens"] / g["input_tokens"]).astype(float)


def throughput_series(df: pd.DataFrame, bin_s: float = 1.0) -> pd.DataFrame:
    """Tokens per second by completion time bin: columns t, tokens_in_per_s, tokens_out_per_s, requests_per_s."""
    ok = client_rows(df)
    ok = ok[~failed(ok)] if len(ok) else ok
    done = (ok["send_time"] + ok["e2e_s"]).to_numpy(dtype=float)
    keep = np.isfinite(done)
    if not keep.any():
        return pd.DataFrame({"t": [], "tokens_in_per_s": [], "tokens_out_per_s": [], "requests_per_s": []})
    done = done[keep]
    bins = np.floor(done / bin_s).astype(int)
    n = int(bins.max()) + 1
    inp = np.bincount(bins, ok["input_tokens"].to_numpy()[keep].clip(min=0), n) / bin_s
    out = np.bincount(bins, ok["output_tokens"].to_numpy()[keep].clip(min=0), n) / bin_s
    req = np.bincount(bins, None, n) / bin_s
    return pd.DataFrame(
        {"t": np.arange(n) * bin_s, "tokens_in_per_s": inp, "tokens_out_per_s": out, "requests_per_s": req}
    )


# ---- rendering ---------------------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 1e3:,.1f} ms"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _hits(s: RunSummary) -> str:
    if s.hit_share_gpu is None and s.hit_share_cpu is None:
        return _share(s.hit_share)
    return f"{_share(s.hit_share)} (GPU {_share(s.hit_share_gpu)}, CPU {_share(s.hit_share_cpu)})"


ROWS: tuple[tuple[str, Any], ...] = (
    ("requests", lambda s: f"{s.requests:,}"),
    ("input tokens / min", lambda s: f"{s.input_tokens_per_min:,.0f}"),
    ("output tokens / min", lambda s: f"{s.output_tokens_per_min:,.0f}"),
    ("TTFT p50", lambda s: _ms(s.ttft_p50_s)),
    ("TTFT p90", lambda s: _ms(s.ttft_p90_s)),
    ("router queue p90", lambda s: _ms(s.router_queue_p90_s)),
    ("cache-hit share", _hits),
    ("preemptions", lambda s: "-" if s.preemptions is None else f"{s.preemptions:,}"),
    ("errors", lambda s: f"{s.errors:,}"),
)


def summary_rows(summaries: list[RunSummary]) -> list[list[str]]:
    """[metric, value per run] rows: the table as plain strings (for tests and logs)."""
    return [[name, *(fmt(s) for s in summaries)] for name, fmt in ROWS]


def summary_table(summaries: list[RunSummary], title: str = "") -> Any:
    """A rich Table, one column per run (side by side under --compare)."""
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.label or "run", justify="right")
    for row in summary_rows(summaries):
        table.add_row(*row)
    return table
