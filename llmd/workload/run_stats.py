"""What a load run measured: running totals, per-second bins and latency samples, and the summary it ends with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ABORTED = "aborted"  # the error of a request cancelled when the run stopped


@dataclass
class LoadSummary:
    requests: int = 0  # rows written (errors and aborted included)
    errors: int = 0  # rows with an error (aborted included)
    aborted: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    duration_s: float = 0.0
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    ttft_p99_s: float = math.nan
    e2e_p50_s: float = math.nan
    e2e_p90_s: float = math.nan
    itl_p50_s: float = math.nan
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    cache_hit_share: float = math.nan  # cached / input tokens over successful requests
    sessions: int = 0  # main-agent sessions started
    subagent_sessions: int = 0
    client_delay_mean_s: float = 0.0  # mean lateness of a turn's send vs its planned time
    client_delay_share: float = 0.0  # total lateness / total planned gap (0 when no gaps)
    stopped: bool = False  # ended by `stop` / Ctrl-C
    output: str = ""

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a summary table."""

        def ms(v: float) -> str:
            return "-" if math.isnan(v) else f"{v * 1000:.1f} ms"

        return [
            ("requests", f"{self.requests:,} ({self.errors:,} errors, {self.aborted:,} aborted)"),
            ("sessions", f"{self.sessions:,} main, {self.subagent_sessions:,} sub-agent"),
            ("duration", f"{self.duration_s:.1f} s"),
            ("input tokens", f"{self.input_tokens:,}"),
            ("output tokens", f"{self.output_tokens:,} ({self.output_tokens_per_s:,.1f}/s)"),
            ("cached tokens", f"{self.cached_tokens:,}" + _share(self.cache_hit_share)),
            ("requests/s", f"{self.requests_per_s:,.2f}"),
            ("TTFT p50 / p90 / p99", f"{ms(self.ttft_p50_s)} / {ms(self.ttft_p90_s)} / {ms(self.ttft_p99_s)}"),
            ("E2E p50 / p90", f"{ms(self.e2e_p50_s)} / {ms(self.e2e_p90_s)}"),
            ("ITL p50", ms(self.itl_p50_s)),
            ("client delay", f"{ms(self.client_delay_mean_s)} mean, {self.client_delay_share:.2%} of gaps"),
            ("metrics", self.output),
        ]


def _share(v: float) -> str:
    return "" if math.isnan(v) else f" ({v:.1%} of input)"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


class RunStats:
    """Running totals, per-second bins and the latency samples of the summary."""

    def __init__(self) -> None:
        self.requests = self.errors = self.aborted = 0
        self.input = self.output = self.cached = 0
        self.ok_input = self.ok_cached = 0
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.itl: list[float] = []
        self.bins: dict[int, list[float]] = {}  # second -> [tokens in, tokens out, requests, errors]
        self.started = 0
        self.sessions = self.subagent_sessions = 0
        self.delay_sum = 0.0
        self.gap_sum = 0.0
        self.delay_n = 0

    def add(self, row: dict[str, Any], t_done: float) -> None:
        self.requests += 1
        err = bool(row.get("error"))
        inp = max(0, row.get("input_tokens", -1))
        out = max(0, row.get("output_tokens", -1))
        cached = max(0, row.get("cached_tokens", -1))
        self.input += inp
        self.output += out
        self.cached += cached
        b = self.bins.setdefault(int(t_done), [0.0, 0.0, 0.0, 0.0])
        b[0] += inp
        b[1] += out
        b[2] += 1
        if err:
            self.errors += 1
            b[3] += 1
            if row.get("error") == ABORTED:
                self.aborted += 1
            return
        self.ok_input += inp
        self.ok_cached += cached
        ttft = row.get("ttft_s", math.nan)
        if not math.isnan(ttft):
            self.ttft.append(ttft)
        self.e2e.append(row.get("e2e_s", math.nan))
        itl = row.get("itl_p50_s", math.nan)
        if not math.isnan(itl):
            self.itl.append(itl)

    def take_bins(self, before: int | None) -> list[dict[str, Any]]:
        keys = sorted(k for k in self.bins if before is None or k < before)
        out = []
        for k in keys:
            tin, tout, reqs, errs = self.bins.pop(k)
            out.append(
                {
                    "t": float(k),
                    "tokens_in_per_s": tin,
                    "tokens_out_per_s": tout,
                    "requests_per_s": reqs,
                    "errors": int(errs),
                }
            )
        return out

    def summary(self, duration_s: float, stopped: bool, output: str) -> LoadSummary:
        """The run's summary after `duration_s` seconds."""
        return LoadSummary(
            requests=self.requests,
            errors=self.errors,
            aborted=self.aborted,
            input_tokens=self.input,
            output_tokens=self.output,
            cached_tokens=self.cached,
            duration_s=duration_s,
            ttft_p50_s=pct(self.ttft, 50),
            ttft_p90_s=pct(self.ttft, 90),
            ttft_p99_s=pct(self.ttft, 99),
            e2e_p50_s=pct(self.e2e, 50),
            e2e_p90_s=pct(self.e2e, 90),
            itl_p50_s=pct(self.itl, 50),
            requests_per_s=self.requests / duration_s if duration_s > 0 else 0.0,
            output_tokens_per_s=self.output / duration_s if duration_s > 0 else 0.0,
            cache_hit_share=self.ok_cached / self.ok_input if self.ok_input else math.nan,
            sessions=self.sessions,
            subagent_sessions=self.subagent_sessions,
            client_delay_mean_s=self.delay_sum / self.delay_n if self.delay_n else 0.0,
            client_delay_share=self.delay_sum / self.gap_sum if self.gap_sum > 0 else 0.0,
            stopped=stopped,
            output=output,
        )
