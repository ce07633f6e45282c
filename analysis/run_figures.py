"""Figures of one run, or of a few runs side by side: TTFT CDFs, throughput over time, hit share per turn (the
demo's three), the run's time series, its KV transfers and the fabric's bandwidth matrix. Each function takes frames
and returns a matplotlib Figure; it raises style.NoData rather than draw empty axes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs import Fabric
from analysis.style import WIDE, colors, log_if_spans, plt, require, save, spans_decades, thousands
from analysis.transfers import sizes_mib, transfer_rows
from llmd.report.summary import client_rows, failed, hit_share_per_turn, throughput_series

DEMO_FIGURES = ("ttft_cdf.png", "throughput.png", "cache_hit_per_turn.png")


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    df = client_rows(df)
    return df[~failed(df)] if len(df) else df


def ttft_cdf(runs: Mapping[str, pd.DataFrame]) -> Any:
    """The TTFT distribution of each run (its /requests rows), on a log time axis: TTFTs span decades between a cache
    hit on an idle engine and a cold prompt behind a queue."""
    data = {}
    for label, df in runs.items():
        ttft = _ok(df)["ttft_s"].to_numpy(dtype=float) if len(df) else np.empty(0)
        ttft = np.sort(ttft[np.isfinite(ttft) & (ttft > 0)])
        if ttft.size:
            data[label] = ttft
    require(bool(data), "no request has a TTFT")
    fig, ax = plt().subplots(figsize=WIDE)
    col = colors(list(data))
    for label, ttft in data.items():
        ax.step(ttft * 1e3, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label, color=col[label])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("Time to first token (CDF)")
    ax.legend(title="run" if len(data) > 1 else None)
    return fig


def throughput_over_time(runs: Mapping[str, pd.DataFrame]) -> Any:
    """Input and output tokens per second, binned by request completion."""
    series = {label: throughput_series(df) for label, df in runs.items() if len(df)}
    series = {k: v for k, v in series.items() if len(v)}
    require(bool(series), "no request completed")
    fig, (ax_in, ax_out) = plt().subplots(2, 1, figsize=(8, 6), sharex=True)
    col = colors(list(series))
    for label, ts in series.items():
        ax_in.plot(ts["t"], ts["tokens_in_per_s"], label=label, color=col[label])
        ax_out.plot(ts["t"], ts["tokens_out_per_s"], label=label, color=col[label])
    ax_in.set_ylabel("input tokens/s")
    ax_out.set_ylabel("output tokens/s")
    ax_out.set_xlabel("time since start (s)")
    ax_in.set_title("Throughput over time (1 s bins, by request completion)")
    thousands(ax_in.yaxis)
    thousands(ax_out.yaxis)
    ax_in.legend()
    return fig


def hit_share_by_turn(runs: Mapping[str, pd.DataFrame]) -> Any:
    """Prefix-cache hit share (cached / prompt tokens) by turn index within a session."""
    shares = {label: hit_share_per_turn(df) for label, df in runs.items() if len(df)}
    shares = {k: v for k, v in shares.items() if len(v)}
    require(bool(shares), "no request reports both prompt and cached tokens with a turn")
    fig, ax = plt().subplots(figsize=WIDE)
    col = colors(list(shares))
    for label, share in shares.items():
        ax.plot(share.index.to_numpy(), share.to_numpy(), marker="o", ms=3, label=label, color=col[label])
    ax.set_xlabel("turn within the session")
    ax.set_ylabel("cached / prompt tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title("Prefix-cache hit share per turn")
    ax.legend()
    return fig


def write_demo_figures(runs: Mapping[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """The demo's three figures (DEMO_FIGURES) for `runs` ({label: /requests rows}); one left out when it has no
    data."""
    from analysis.style import NoData

    out = Path(out_dir)
    paths = []
    for name, draw in zip(DEMO_FIGURES, (ttft_cdf, throughput_over_time, hit_share_by_turn), strict=True):
        try:
            paths.append(save(draw(runs), out / name))
        except NoData:
            continue
    return paths


def _by_second(df: pd.DataFrame, column: str, how: str = "sum") -> pd.Series:
    v = df[["t", column]].copy()
    v[column] = v[column].astype(float)
    v = v[v[column] >= 0] if how == "sum" else v[np.isfinite(v[column])]
    return v.groupby("t")[column].agg(how)


def timeseries(router: pd.DataFrame, engines: pd.DataFrame, title: str = "") -> Any:
    """A run second by second: requests in flight, waiting (router queue and engine queues), each engine's KV use,
    and the share of prompt tokens the engines hit in GPU KV and the CPU tier."""
    require(len(router) > 0 or len(engines) > 0, "no router or engine time series")
    fig, axes = plt().subplots(4, 1, figsize=(8, 9), sharex=True)
    ax_fl, ax_q, ax_kv, ax_hit = axes
    if len(router):
        ax_fl.plot(*_xy(_by_second(router, "inflight")), label="router: in flight", color="C0")
        ax_q.plot(*_xy(_by_second(router, "queue_len")), label="router queue", color="C0")
    if len(engines):
        ax_fl.plot(*_xy(_by_second(engines, "running")), label="engines: running", color="C1", ls="--")
        ax_q.plot(*_xy(_by_second(engines, "queue_len")), label="engine queues (sum)", color="C1", ls="--")
        names = sorted(engines["source"].astype(str).unique())
        if len(names) <= 8:
            for i, name in enumerate(names):
                e = engines[engines["source"] == name]
                ax_kv.plot(e["t"], 100 * e["kv_usage"].astype(float), label=name, color=f"C{i}", lw=1)
        else:
            kv = engines.groupby("t")["kv_usage"].agg(["mean", "min", "max"]) * 100
            ax_kv.fill_between(kv.index, kv["min"], kv["max"], alpha=0.3, label=f"min-max of {len(names)} engines")
            ax_kv.plot(kv.index, kv["mean"], label="mean")
        tok = engines.assign(
            gpu=engines["tokens_in_per_s"].astype(float) * engines["hit_share_gpu"].astype(float),
            cpu=engines["tokens_in_per_s"].astype(float) * engines["hit_share_cpu"].astype(float),
        )
        g = tok.groupby("t")[["gpu", "cpu", "tokens_in_per_s"]].sum(min_count=1)
        g = g[g["tokens_in_per_s"] > 0]
        gpu = (g["gpu"] / g["tokens_in_per_s"]).fillna(0)
        cpu = (g["cpu"] / g["tokens_in_per_s"]).fillna(0)
        ax_hit.stackplot(g.index, 100 * gpu, 100 * cpu, labels=["GPU KV hit", "CPU tier"], colors=["C2", "C4"])
    ax_fl.set_ylabel("requests")
    ax_fl.set_title(f"Run over time{': ' + title if title else ''}")
    ax_q.set_ylabel("requests waiting")
    ax_kv.set_ylabel("KV cache used (%)")
    ax_kv.set_ylim(0, 102)
    ax_hit.set_ylabel("prompt tokens hit (%)")
    ax_hit.set_ylim(0, 102)
    ax_hit.set_xlabel("time since start (s)")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", ncol=2)
    return fig


def _xy(s: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    return s.index.to_numpy(dtype=float), s.to_numpy(dtype=float)


def transfers(client: pd.DataFrame, engines: pd.DataFrame, router: pd.DataFrame | None = None) -> Any:
    """KV handed between engines: transfers completed per second (P/D handoffs and P2P pulls, the engines' count),
    and each request's transfer from the router's rows: its size (MiB, or tokens where the model's geometry was
    unknown) and its time against its size. A run whose router rows predate those columns (or that has none) shows
    the prompt size of each request that took the P/D or P2P path instead: the most its handoff could carry."""
    rows = transfer_rows(router) if router is not None else None
    if rows is None:
        return _prompt_sizes(client, engines)
    per_s = _by_second(engines, "kv_transfers") if len(engines) else pd.Series(dtype=float)
    require(len(rows) > 0 or float(per_s.sum()) > 0, "no KV transfer")
    fig, (ax_t, ax_s, ax_x) = plt().subplots(1, 3, figsize=(15, 4.5))
    _per_second(ax_t, per_s)
    mib = sizes_mib(rows)
    size = mib if mib is not None else rows["kv_transfer_tokens"].to_numpy(dtype=float)
    unit = "MiB" if mib is not None else "tokens"
    seconds = rows["kv_transfer_s"].to_numpy(dtype=float)
    timed = np.isfinite(seconds) & (seconds > 0)
    log_size = spans_decades(size)
    bins = np.geomspace(size.min(), size.max() * 1.001, 30) if log_size else 30
    for i, path in enumerate(sorted(rows["pd_path"].astype(str).unique())):
        mine = (rows["pd_path"] == path).to_numpy()
        color = f"C{i + 1}"
        ax_s.hist(size[mine], bins=bins, alpha=0.6, label=f"{path} ({mine.sum():,} requests)", color=color)
        ax_x.scatter(size[mine & timed], seconds[mine & timed], s=8, alpha=0.6, label=path, color=color)
    for ax in (ax_s, ax_x):
        if log_size:
            ax.set_xscale("log")
        ax.set_xlabel(f"KV per transfer ({unit}, log)" if log_size else f"KV per transfer ({unit})")
    ax_s.set_ylabel("requests")
    ax_s.set_title("Size of each transfer")
    ax_x.set_title("Time of each transfer against its size")
    log_t = log_if_spans(ax_x, seconds[timed], axis="y")
    ax_x.set_ylabel("handoff time (s, log)" if log_t else "handoff time (s)")
    if timed.any():
        ax_s.legend()
        ax_x.legend()
    elif len(rows):
        ax_s.legend()
        ax_x.text(0.5, 0.5, "no transfer time recorded\n(responses not streamed)", ha="center", va="center",
                  transform=ax_x.transAxes)  # fmt: skip
    return fig


def _per_second(ax: Any, per_s: pd.Series) -> None:
    if len(per_s):
        ax.plot(per_s.index, per_s.to_numpy(), color="C0")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV transfers completed per second")
    ax.set_title("KV transfers over time (all engines)")


def _prompt_sizes(client: pd.DataFrame, engines: pd.DataFrame) -> Any:
    ok = _ok(client) if len(client) else client
    moved = ok[ok["pd_path"].isin(["pd", "p2p"])] if len(ok) else ok
    per_s = _by_second(engines, "kv_transfers") if len(engines) else pd.Series(dtype=float)
    require(len(moved) > 0 or float(per_s.sum()) > 0, "no P/D or P2P request and no KV transfer")
    fig, (ax_t, ax_s) = plt().subplots(1, 2, figsize=(11, 4.5))
    _per_second(ax_t, per_s)
    if len(moved):
        for i, (path, rows) in enumerate(moved.groupby("pd_path")):
            tokens = rows["input_tokens"].to_numpy(dtype=float)
            tokens = tokens[tokens > 0]
            log = log_if_spans(ax_s, tokens)
            bins = np.geomspace(tokens.min(), tokens.max() + 1, 30) if log else 30
            ax_s.hist(tokens, bins=bins, alpha=0.6, label=f"{path} ({len(rows):,} requests)", color=f"C{i + 1}")
        ax_s.legend()
    log = ax_s.get_xscale() == "log"
    ax_s.set_xlabel("prompt tokens per request" + (" (log)" if log else ""))
    ax_s.set_ylabel("requests")
    ax_s.set_title("Size of each handoff (prompt tokens, an upper bound)")
    return fig


def fabric_heatmap(fabrics: Sequence[Fabric]) -> Any:
    """The preflight's bandwidth matrix per role, GB/s from row rank to column rank (blank: not measured)."""
    mats = [f for f in fabrics if f.gbps.size and np.isfinite(f.gbps).any()]
    require(bool(mats), "no fabric preflight matrix")
    fig, axes = plt().subplots(1, len(mats), figsize=(5.5 * len(mats), 4.8), squeeze=False)
    for ax, m in zip(axes[0], mats, strict=True):
        n = m.gbps.shape[0]
        im = ax.imshow(m.gbps, cmap="viridis", vmin=0)
        fig.colorbar(im, ax=ax, label="bandwidth (GB/s)")
        names = [str(i) for i in range(n)]
        if len(m.hostnames) == n:
            names = [f"{i}: {h}" for i, h in enumerate(m.hostnames)]
        if n <= 16:  # beyond that the names overlap: rank numbers alone
            ax.set_xticks(range(n), names, rotation=45, ha="right", fontsize=7)
            ax.set_yticks(range(n), names, fontsize=7)
        ax.grid(False)
        if n <= 12:
            top = np.nanmax(m.gbps)
            for i in range(n):
                for j in range(n):
                    v = m.gbps[i, j]
                    if np.isfinite(v):  # dark text on viridis' bright end, light on its dark end
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="k" if v > 0.6 * top else "w")
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        size = f", {m.nbytes / 2**20:,.0f} MiB transfers" if m.nbytes else ""
        ax.set_title(f"Fabric bandwidth: {m.role}{size}")
    return fig
