"""Figures across the points of a sweep (or the runs of a compare), from its points table (analysis.report.points:
one row per run, its parameters, `policy`, `concurrency`, `series` and its Summary row): throughput against
concurrency per policy, the Pareto frontier of throughput per GPU against interactivity, where prompt tokens came
from per policy, and cost per million tokens beside API prices. Each raises style.NoData rather than draw nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.hits import LABELS, PARTS
from analysis.style import WIDE, colors, log_if_spans, plt, require, spans_decades, thousands

HIT_COLORS = {"gpu": "C2", "cpu": "C4", "p2p": "C1", "computed": "0.7"}


def _concurrency_axis(ax: Any, values: Any) -> None:
    ax.set_xlabel("concurrency (agents)")
    vals = np.asarray(values, dtype=float)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if vals.size >= 2 and vals.max() / vals.min() >= 8:  # powers of two are the usual grid
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (agents, log)")
        ax.set_xticks(sorted(set(vals)), [f"{v:g}" for v in sorted(set(vals))])


def throughput_vs_concurrency(points: pd.DataFrame) -> Any:
    """Input and output tokens per second against concurrency, one line per series (the policy, plus any other
    parameter the sweep varies)."""
    df = points[np.isfinite(points["concurrency"].astype(float))]
    require(len(df) > 0, "no point has a concurrency")
    fig, (ax_in, ax_out) = plt().subplots(1, 2, figsize=(11, 4.5))
    col = colors(list(df["series"]))
    for name, g in df.groupby("series", sort=True):
        g = g.sort_values("concurrency")
        kw = {"marker": "o", "label": name, "color": col[name]}
        ax_in.plot(g["concurrency"], g["input_tokens_per_min"] / 60, **kw)
        ax_out.plot(g["concurrency"], g["output_tokens_per_min"] / 60, **kw)
    for ax, what in ((ax_in, "input"), (ax_out, "output")):
        _concurrency_axis(ax, df["concurrency"])
        log = log_if_spans(ax, df[f"{what}_tokens_per_min"] / 60, "y")
        ax.set_ylabel(f"{what} tokens/s" + (" (log)" if log else ""))
        thousands(ax.yaxis)
        ax.set_title(f"{what.capitalize()} throughput vs concurrency")
    ax_out.legend(title="policy")
    return fig


def pareto_frontier(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both axes (more is better on each), by increasing x."""
    order = np.argsort(-xs, kind="stable")
    keep, best = [], -np.inf
    for i in order:
        if ys[i] > best:
            keep.append(i)
            best = ys[i]
    return np.array(keep[::-1], dtype=int)


def pareto(points: pd.DataFrame) -> Any:
    """Output tokens/s per GPU (what the fleet earns) against output tokens/s per user (what each user feels), every
    point of the sweep, with the frontier of the points no other point beats on both."""
    x = points["tokens_per_s_per_user"].to_numpy(dtype=float)
    y = points["output_tokens_per_s_per_gpu"].to_numpy(dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    require(bool(ok.any()), "no point has both interactivity and throughput per GPU")
    df = points[ok]
    x, y = x[ok], y[ok]
    fig, ax = plt().subplots(figsize=WIDE)
    col = colors(list(df["series"]))
    for name, g in df.groupby("series", sort=True):
        ax.scatter(g["tokens_per_s_per_user"], g["output_tokens_per_s_per_gpu"], label=name, color=col[name], zorder=3)
        for _, r in g.iterrows():
            if np.isfinite(r["concurrency"]):
                ax.annotate(
                    f"{r['concurrency']:g}",
                    (r["tokens_per_s_per_user"], r["output_tokens_per_s_per_gpu"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    front = pareto_frontier(x, y)
    ax.plot(x[front], y[front], ls="--", color="k", lw=1, label="Pareto frontier", zorder=2)
    log_x, log_y = spans_decades(x), spans_decades(y)
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("interactivity: output tokens/s per user (median of 1/TPOT)" + (" (log)" if log_x else ""))
    ax.set_ylabel("output tokens/s per GPU" + (" (log)" if log_y else ""))
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "linear":
            thousands(axis)  # and no "+1.849e3" corner offset: the ticks say the values
    ax.set_title("Throughput per GPU vs interactivity (labels: concurrency)")
    ax.legend(title="policy")
    return fig


def hit_decomposition(points: pd.DataFrame) -> Any:
    """Where each point's prompt tokens came from (the router's view at routing time), one bar per point grouped by
    policy, with the engines' measured GPU share as a tick for comparison."""
    cols = [f"hit_{p}" for p in PARTS]
    df = points.dropna(subset=["hit_gpu", "hit_computed"]).sort_values(["policy", "concurrency", "point"])
    require(len(df) > 0, "no point has a hit decomposition")
    fig, ax = plt().subplots(figsize=(10, 1.6 + 0.45 * len(df)))
    y = np.arange(len(df))[::-1]
    left = np.zeros(len(df))
    for part, c in zip(PARTS, cols, strict=True):
        v = df[c].fillna(0).to_numpy(dtype=float) * 100
        ax.barh(y, v, left=left, color=HIT_COLORS[part], label=LABELS[part], height=0.7)
        left += v
    measured = df["hit_measured_gpu"].to_numpy(dtype=float) * 100
    has = np.isfinite(measured)
    if has.any():
        label = "GPU hit, engines' own count\n(per engine request)"
        ax.scatter(measured[has], y[has], marker="|", s=250, color="k", label=label, zorder=3)
    ax.set_yticks(y, df["bar"].tolist())
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of routed prompt tokens (%): the router's split at routing time")
    ax.set_title("Where prompt tokens came from, per policy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    ax.grid(axis="y", visible=False)
    return fig


def cost_vs_api(costs: pd.DataFrame, apis: pd.DataFrame) -> Any:
    """USD per million tokens of each point on its GPUs, beside the APIs' list prices (left: input and output; right:
    the run's own traffic, prompt cache hits billed at each API's cached price). Log scale: they span decades."""
    df = costs.dropna(subset=["usd_per_m_tokens"])
    require(len(df) > 0 and len(apis) > 0, "no GPU cost (give a GPU-hour price) or no API price")
    fig, (ax_l, ax_r) = plt().subplots(1, 2, figsize=(12, 5))
    names = [*df["bar"], *apis["name"]]
    x = np.arange(len(names))
    w = 0.4
    inp = [*df["usd_per_m_input"], *apis["input"]]
    out = [*df["usd_per_m_output"], *apis["output"]]
    ax_l.bar(x - w / 2, inp, w, label="input (prompt)", color="C0")
    ax_l.bar(x + w / 2, out, w, label="output (generated)", color="C3")
    ax_l.axvline(len(df) - 0.5, color="k", lw=0.8)
    ax_l.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    ax_l.set_yscale("log")
    ax_l.set_ylabel("USD per 1M tokens (log)")
    ax_l.set_title("Self-hosted (left of the line) vs API list prices")
    ax_l.legend()
    xs = np.arange(len(df))
    ax_r.bar(xs, df["usd_per_m_tokens"], 0.6, color="0.4", label="self-hosted GPUs")
    markers = "os^Dv<>p*h"
    for i, api in enumerate(apis["name"]):
        per_m = df[f"api_usd_per_m:{api}"].to_numpy(dtype=float)
        ax_r.scatter(xs, per_m, marker=markers[i % len(markers)], color=f"C{i}", label=api, zorder=3)
    ax_r.set_xticks(xs, df["bar"], rotation=45, ha="right", fontsize=7)
    ax_r.set_yscale("log")
    ax_r.set_ylabel("USD per 1M tokens of the run's traffic (log)")
    ax_r.set_title("The same traffic: GPUs vs API bills")
    ax_r.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
