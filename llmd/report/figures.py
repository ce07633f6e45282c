"""PNG figures of one run or several side by side (matplotlib, Agg backend: no display needed).

- ttft_cdf.png: the TTFT distribution (CDF) per run
- throughput.png: input and output tokens per second over time, binned by request completion
- cache_hit_per_turn.png: prefix-cache hit share (cached / prompt tokens) by turn index
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from llmd.report.summary import client_rows, failed, hit_share_per_turn

FIGURES = ("ttft_cdf.png", "throughput.png", "cache_hit_per_turn.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    df = client_rows(df)
    return df[~failed(df)] if len(df) else df


def throughput_series(df: pd.DataFrame, bin_s: float = 1.0) -> pd.DataFrame:
    """Tokens per second by completion time bin: columns t, tokens_in_per_s, tokens_out_per_s, requests_per_s."""
    ok = _ok(df)
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


def write_figures(runs: Mapping[str, pd.DataFrame], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write FIGURES for `runs` ({label: /requests DataFrame}) into `out_dir`; returns the paths written."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, df in runs.items():
        ttft = np.sort(_ok(df)["ttft_s"].to_numpy(dtype=float))
        ttft = ttft[np.isfinite(ttft)]
        if ttft.size:
            ax.step(ttft * 1e3, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label)
    _share_axes(ax, "TTFT (ms)", "share of requests", "Time to first token (CDF)", legend=bool(runs))
    paths.append(_save(fig, out / FIGURES[0], plt))

    fig, (ax_in, ax_out) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, df in runs.items():
        ts = throughput_series(df)
        ax_in.plot(ts["t"], ts["tokens_in_per_s"], label=label)
        ax_out.plot(ts["t"], ts["tokens_out_per_s"], label=label)
    ax_in.set_ylabel("input tokens/s")
    ax_out.set_ylabel("output tokens/s")
    ax_out.set_xlabel("time since start (s)")
    ax_in.set_title("Throughput over time (by request completion)")
    for a in (ax_in, ax_out):
        a.grid(alpha=0.3)
    if runs:
        ax_in.legend()
    paths.append(_save(fig, out / FIGURES[1], plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, df in runs.items():
        share = hit_share_per_turn(df)
        if len(share):
            ax.plot(share.index.to_numpy(), share.to_numpy(), marker="o", label=label)
    _share_axes(ax, "turn", "cached / prompt tokens", "Prefix-cache hit share per turn", legend=bool(runs))
    paths.append(_save(fig, out / FIGURES[2], plt))
    return paths


def _share_axes(ax, xlabel: str, ylabel: str, title: str, legend: bool) -> None:
    """The look of a panel whose y axis is a share (0-1)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend()


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figures_for_files(files: Mapping[str, str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """write_figures for metrics HDF5 files ({label: path})."""
    from llmd.metrics import read_requests

    return write_figures({label: read_requests(p) for label, p in files.items()}, out_dir)
