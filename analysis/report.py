"""`llmd analyze`'s report folder for a run or a sweep: PNG figures, CSV tables and report.md, which embeds them.

report.md                  the summary tables, every figure, and why any figure was left out
points.csv                 one row per run: its parameters and every number of analysis.summary.Summary
cost.csv, api_prices.csv   GPU cost per 1M tokens per run; the API prices it is set beside (with their sources)
ttft_cdf.png, throughput.png, cache_hit_per_turn.png       the runs side by side (the demo's three)
throughput_vs_concurrency.png, pareto.png                  across the points (two or more)
hit_decomposition.png, cost_vs_api.png
runs/<point>/timeseries.png, transfers.png, fabric.png     per run
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import run_figures as rf
from analysis import sweep_figures as sf
from analysis.cost import APIPrice, GPUPrices, api_table, load_api_prices, run_cost
from analysis.runs import Run
from analysis.spec import cost_block
from analysis.style import NoData, save
from analysis.summary import summarize
from analysis.sweeps import Sweep
from analysis.transfers import MIB

POLICY, CONCURRENCY = "router.policy", "workload.concurrency"


def runs_of(target: Run | Sweep) -> list[Run]:
    return list(target.points) if isinstance(target, Sweep) else [target]


def points(target: Run | Sweep) -> pd.DataFrame:
    """One row per run: `point`, the sweep's parameters, `policy`, `concurrency`, `series` (what tells lines apart:
    the policy and any other parameter but concurrency), `bar` (a short label) and the run's Summary row."""
    rows = []
    for run in runs_of(target):
        flat = run.flat_spec
        policy = str(run.params.get(POLICY, flat.get(POLICY, "")))
        conc = run.params.get(CONCURRENCY, flat.get(CONCURRENCY))
        others = [f"{k.split('.')[-1]}={v}" for k, v in run.params.items() if k not in (POLICY, CONCURRENCY)]
        series = ", ".join([policy or run.label, *others])
        bar = ", ".join([series, *([f"c={conc}"] if conc is not None else [])])
        row = {"point": run.label, **run.params, "policy": policy, "series": series, "bar": bar}
        row["concurrency"] = float(conc) if isinstance(conc, int | float) else math.nan
        row.update(summarize(run).row())
        rows.append(row)
    return pd.DataFrame(rows)


def costs(target: Run | Sweep, table: pd.DataFrame, apis: list[APIPrice], gpu_hour_usd: float | None) -> pd.DataFrame:
    """GPU cost per 1M tokens per run (NaN without a GPU-hour price) and each API's bill per 1M of its traffic."""
    rows = []
    for run, (_, p) in zip(runs_of(target), table.iterrows(), strict=True):
        prices = GPUPrices.of(gpu_hour_usd, cost_block(run.spec))
        row: dict[str, Any] = {"point": p["point"], "bar": p["bar"]}
        row["gpu_hour_usd"] = prices.decode if prices and prices.decode == prices.prefill else math.nan
        if prices is not None:
            row.update(run_cost(run.gpus, p["duration_s"], p["input_tokens"], p["output_tokens"], prices))
        else:
            row.update(dict.fromkeys(("gpu_hours", "gpu_cost_usd", "usd_per_m_input", "usd_per_m_output"), math.nan))
            row["usd_per_m_tokens"] = math.nan
        for a in api_table(apis, int(p["input_tokens"]), int(p["cached_tokens"]), int(p["output_tokens"])):
            row[f"api_usd_per_m:{a['name']}"] = a["usd_per_m_tokens"]
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class Report:
    out: Path
    figures: dict[str, Path] = field(default_factory=dict)  # name -> PNG
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was left out
    tables: dict[str, Path] = field(default_factory=dict)

    def draw(self, name: str, path: Path, make: Callable[[], Any]) -> None:
        try:
            self.figures[name] = save(make(), path)
        except NoData as exc:
            self.skipped[name] = str(exc)


def write_report(
    target: Run | Sweep,
    out: str | Path,
    *,
    gpu_hour_usd: float | None = None,
    api_prices: str | Path | None = None,
) -> Report:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    apis = load_api_prices(api_prices)
    table = points(target)
    cost = costs(target, table, apis, gpu_hour_usd)
    api_df = pd.DataFrame([a.__dict__ for a in apis])
    for name, df in (("points", table), ("cost", cost), ("api_prices", api_df)):
        rep.tables[name] = out / f"{name}.csv"
        df.to_csv(rep.tables[name], index=False)

    runs = runs_of(target)
    names = dict(zip(table["point"], table["bar"], strict=True)) if len(runs) > 1 else {runs[0].label: runs[0].label}
    frames = {names[r.label]: r.requests for r in runs}
    rep.draw("TTFT CDF", out / "ttft_cdf.png", lambda: rf.ttft_cdf(frames))
    rep.draw("Throughput over time", out / "throughput.png", lambda: rf.throughput_over_time(frames))
    rep.draw("Hit share per turn", out / "cache_hit_per_turn.png", lambda: rf.hit_share_by_turn(frames))
    if len(table) > 1:
        vs_conc = out / "throughput_vs_concurrency.png"
        rep.draw("Throughput vs concurrency", vs_conc, lambda: sf.throughput_vs_concurrency(table))
        rep.draw("Pareto frontier", out / "pareto.png", lambda: sf.pareto(table))
    rep.draw("Hit decomposition", out / "hit_decomposition.png", lambda: sf.hit_decomposition(table))
    rep.draw("Cost vs API prices", out / "cost_vs_api.png", lambda: sf.cost_vs_api(cost, api_df))
    for run in runs:
        _draw_run(rep, run, names[run.label], out / "runs" / run.label)
    (out / "report.md").write_text(markdown(target, table, cost, apis, rep, gpu_hour_usd))
    return rep


def _draw_run(rep: Report, run: Run, title: str, d: Path) -> None:
    router, engines = run.series("router"), run.series("engines")
    rep.draw(f"{run.label}: time series", d / "timeseries.png", lambda: rf.timeseries(router, engines, title))
    rep.draw(f"{run.label}: KV transfers", d / "transfers.png", lambda: rf.transfers(run.client, engines, run.router))
    rep.draw(f"{run.label}: fabric bandwidth", d / "fabric.png", lambda: rf.fabric_heatmap(run.fabric))


# ---- report.md -------------------------------------------------------------------------------------------------------


def _fmt(v: Any, scale: float = 1.0, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, int | float | np.integer | np.floating):
        return f"{float(v) * scale:,.{digits}f}"
    return str(v)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


THROUGHPUT_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("requests", "requests", 1, 0),
    ("requests/min", "requests_per_min", 1, 0),
    ("input tok/min", "input_tokens_per_min", 1, 0),
    ("output tok/min", "output_tokens_per_min", 1, 0),
    ("output tok/s/GPU", "output_tokens_per_s_per_gpu", 1, 1),
    ("tok/s/user", "tokens_per_s_per_user", 1, 1),
    ("TTFT p50 (ms)", "ttft_p50_s", 1e3, 1),
    ("TTFT p90 (ms)", "ttft_p90_s", 1e3, 1),
    ("TTFT p99 (ms)", "ttft_p99_s", 1e3, 1),
    ("TPOT p50 (ms)", "tpot_p50_s", 1e3, 2),
    ("ITL p90 (ms)", "itl_p90_s", 1e3, 2),
    ("E2E p90 (ms)", "e2e_p90_s", 1e3, 1),
    ("queue p90 (ms)", "queue_p90_s", 1e3, 1),
)
HIT_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("GPU hit %", "hit_gpu", 100, 1),
    ("CPU tier %", "hit_cpu", 100, 1),
    ("P2P pull %", "hit_p2p", 100, 1),
    ("computed %", "hit_computed", 100, 1),
    ("engines' GPU hit %", "hit_measured_gpu", 100, 1),
    ("cached (reported) %", "cached_share", 100, 1),
    ("preemptions", "preemptions", 1, 0),
    ("errors", "errors", 1, 0),
    ("rejected", "rejected", 1, 0),
)
TRANSFER_COLUMNS: tuple[tuple[str, str, float, int], ...] = (
    ("engines' transfers", "kv_transfers", 1, 0),
    ("requests with one", "kv_transfer_requests", 1, 0),
    ("MiB mean", "kv_transfer_bytes_mean", 1 / MIB, 1),
    ("MiB p90", "kv_transfer_bytes_p90", 1 / MIB, 1),
    ("time mean (ms)", "kv_transfer_s_mean", 1e3, 2),
    ("time p90 (ms)", "kv_transfer_s_p90", 1e3, 2),
)


def _numbers(table: pd.DataFrame, columns: tuple[tuple[str, str, float, int], ...], params: list[str]) -> str:
    header = ["point", *params, *(c[0] for c in columns)]
    rows = []
    for _, r in table.iterrows():
        row = [str(r["point"]), *(str(r.get(p)) for p in params)]
        row += [_fmt(r.get(col), scale, digits) for _, col, scale, digits in columns]
        rows.append(row)
    return _md_table(header, rows)


def markdown(
    target: Run | Sweep,
    table: pd.DataFrame,
    cost: pd.DataFrame,
    apis: list[APIPrice],
    rep: Report,
    gpu_hour_usd: float | None,
) -> str:
    params = target.parameters if isinstance(target, Sweep) else []
    what = f"sweep `{target.path}` ({len(table)} points)" if isinstance(target, Sweep) else f"run `{target.path}`"
    live = [r.label for r in runs_of(target) if r.live]
    parts = [f"# Analysis of {what.split(' ', 1)[1]}", ""]
    if params:
        parts += [f"Parameters: {', '.join(f'`{p}`' for p in params)}.", ""]
    if live:
        parts += [f"Still being written (read as far as they got): {', '.join(live)}.", ""]
    parts += ["## Throughput and latency", "", _numbers(table, THROUGHPUT_COLUMNS, params), ""]
    parts += [
        "Latencies are quantiles over successful requests as the client saw them; TPOT = (E2E - TTFT) / (output "
        "tokens - 1); tok/s/user is the median of 1 / TPOT.",
        "",
        "## Where prompt tokens came from, and what went wrong",
        "",
        _numbers(table, HIT_COLUMNS, params),
        "",
        "GPU / CPU / P2P / computed: the router's split of the prompt tokens it routed, made at routing time. "
        "*engines' GPU hit*: the engines' own prefix-cache counters (per engine request: a P/D request counts on "
        "both engines). *cached (reported)*: prompt tokens the serving engine did not compute, as it reported them "
        "(KV handed over by a P/D prefill counts as cached there).",
        "",
        "## KV transfers",
        "",
        _numbers(table, TRANSFER_COLUMNS, params),
        "",
        "*engines' transfers*: P/D handoffs and P2P pulls the engines completed. The rest from the router's rows, "
        "per request whose serving pod pulled KV: its size (the tokens it did not hold in GPU KV, times the model's "
        "KV bytes per token) and time. A simulated run's time is the modelled pull (link time plus NIXL's overhead); "
        "a live run's is the serving leg's time to its first output, which holds the pull, that pod's wait and its "
        "first step (streamed responses only). `-` where the run's files predate these columns.",
        "",
        "## Cost",
        "",
    ]
    if cost["usd_per_m_tokens"].notna().any():
        rows = [
            [str(r["point"]), _fmt(r["gpu_hours"], 1, 4), _fmt(r["gpu_cost_usd"], 1, 4),
             _fmt(r["usd_per_m_input"], 1, 3), _fmt(r["usd_per_m_output"], 1, 3), _fmt(r["usd_per_m_tokens"], 1, 3)]
            for _, r in cost.iterrows()
        ]  # fmt: skip
        header = ["point", "GPU-hours", "GPU cost (USD)", "USD/1M input", "USD/1M output", "USD/1M tokens"]
        parts += [_md_table(header, rows), ""]
        source = f"`--gpu-hour-usd {gpu_hour_usd:g}`" if gpu_hour_usd is not None else "the spec's `cost:` section"
        parts += [
            f"GPU-hour price from {source}. With a prefill pool, input tokens carry the prefill GPUs' cost and output "
            "tokens the decode GPUs'; without one, each carries the whole cost. USD/1M tokens: the whole cost over "
            "all tokens, set beside each API's bill for the same traffic (cached prompt tokens at its cached price).",
            "",
        ]
    else:
        parts += ["No GPU-hour price: give `--gpu-hour-usd` (or a `cost:` section in the spec) for the GPU side.", ""]
    api_rows = [
        [a.name, _fmt(a.input, 1, 3), _fmt(a.cached_input, 1, 3), _fmt(a.output, 1, 3), a.source, a.date] for a in apis
    ]
    parts += ["API prices (USD per 1M tokens):", ""]
    parts += [_md_table(["API", "input", "cached input", "output", "source", "date"], api_rows), ""]
    parts += ["## Figures", ""]
    for name, path in rep.figures.items():
        parts += [f"### {name}", "", f"![{name}]({path.relative_to(rep.out).as_posix()})", ""]
    if rep.skipped:
        parts += ["## Left out", ""]
        parts += [f"- {name}: {why}" for name, why in rep.skipped.items()]
        parts += [""]
    parts += ["Tables: " + ", ".join(f"[{p.name}]({p.name})" for p in rep.tables.values()), ""]
    return "\n".join(parts)
