"""Cost per million tokens from GPU-hour prices, beside the API prices a user compares with.

A run's GPU cost is its GPUs x its duration x the GPU-hour price. Per million tokens:
- input: the prefill pool's cost over the prompt tokens, output: the decode pool's over the generated tokens, when the
  deployment is disaggregated (each pool does one of the two jobs); without a prefill pool every GPU does both, and
  each figure carries the whole cost (the usual "all-in" $/1M output or input of a throughput benchmark);
- blended: the whole cost over all tokens, which an API bill for the same traffic (prompt cache hits at the cached
  price) is set beside.

GPU prices come from `--gpu-hour-usd`, else from a `cost:` section of the run's stored spec (`gpu_hour_usd`, and
optionally `prefill_gpu_hour_usd` / `decode_gpu_hour_usd`); API prices from a YAML file (data/api_prices.yaml is the
format and the built-in example).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

PRICE_KEYS = ("name", "input", "cached_input", "output", "source", "date")


@dataclass(frozen=True)
class APIPrice:
    """USD per 1M tokens."""

    name: str
    input: float
    output: float
    cached_input: float
    source: str = ""
    date: str = ""

    def bill(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """USD for this traffic: cached prompt tokens at the cached price, the rest of the prompt at the input price."""
        cached = min(max(cached_tokens, 0), input_tokens)
        return ((input_tokens - cached) * self.input + cached * self.cached_input + output_tokens * self.output) / 1e6


@dataclass(frozen=True)
class GPUPrices:
    """USD per GPU-hour, per pool."""

    prefill: float
    decode: float

    @classmethod
    def of(cls, gpu_hour_usd: float | None, spec_cost: dict[str, Any]) -> GPUPrices | None:
        """The command line's one price, else the spec's `cost:` block; None when neither gives one."""
        if gpu_hour_usd is not None:
            return cls(gpu_hour_usd, gpu_hour_usd)
        # A stored spec writes every field of the section, unset ones as null: null means "the fleet's price".
        base = spec_cost.get("gpu_hour_usd")
        prefill = spec_cost.get("prefill_gpu_hour_usd")
        decode = spec_cost.get("decode_gpu_hour_usd")
        prefill = base if prefill is None else prefill
        decode = base if decode is None else decode
        if not all(isinstance(v, int | float) and v >= 0 for v in (prefill, decode)):
            return None
        return cls(float(prefill), float(decode))


def load_api_prices(path: str | Path | None = None) -> list[APIPrice]:
    """API prices from a YAML file (None: the built-in example). Raises ValueError naming the file and the entry."""
    if path is None:
        text = resources.files("analysis").joinpath("data/api_prices.yaml").read_text()
        where = "analysis/data/api_prices.yaml"
    else:
        text, where = Path(path).read_text(), str(path)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None
    entries = doc.get("prices") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected `prices:`, a list of {{name, input, output[, cached_input]}} in USD/1M")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ValueError(f"{where}: prices[{i}] needs a name")
        unknown = sorted(set(e) - set(PRICE_KEYS))
        if unknown:
            raise ValueError(f"{where}: prices[{i}] ({e['name']}): unknown key(s) {', '.join(unknown)}")
        for key in ("input", "output"):
            if not isinstance(e.get(key), int | float) or e[key] < 0:
                raise ValueError(f"{where}: prices[{i}] ({e['name']}): {key} must be USD per 1M tokens, e.g. 2.5")
        cached = e.get("cached_input", e["input"])
        if not isinstance(cached, int | float) or cached < 0:
            raise ValueError(f"{where}: prices[{i}] ({e['name']}): cached_input must be USD per 1M tokens")
        source, date = str(e.get("source", "")), str(e.get("date", ""))
        out.append(APIPrice(e["name"], float(e["input"]), float(e["output"]), float(cached), source, date))
    return out


def run_cost(
    gpus: dict[str, int],
    duration_s: float,
    input_tokens: int,
    output_tokens: int,
    prices: GPUPrices,
) -> dict[str, float]:
    """gpu_hours, gpu_cost_usd and USD per 1M input / output / all tokens (NaN where a count is zero)."""
    hours = duration_s / 3600.0
    decode = gpus.get("decode", 0) * hours * prices.decode
    prefill = gpus.get("prefill", 0) * hours * prices.prefill
    total = prefill + decode
    disaggregated = "prefill" in gpus
    return {
        "gpu_hours": (gpus.get("prefill", 0) + gpus.get("decode", 0)) * hours,
        "gpu_cost_usd": total,
        "usd_per_m_input": _per_m(prefill if disaggregated else total, input_tokens),
        "usd_per_m_output": _per_m(decode if disaggregated else total, output_tokens),
        "usd_per_m_tokens": _per_m(total, input_tokens + output_tokens),
    }


def api_table(prices: list[APIPrice], input_tokens: int, cached_tokens: int, output_tokens: int) -> list[dict]:
    """Each API's list prices and its bill for this traffic (in USD, and per 1M tokens of it)."""
    rows = []
    for p in prices:
        bill = p.bill(input_tokens, cached_tokens, output_tokens)
        rows.append({**asdict(p), "bill_usd": bill, "usd_per_m_tokens": _per_m(bill, input_tokens + output_tokens)})
    return rows


def _per_m(usd: float, tokens: int) -> float:
    return usd / tokens * 1e6 if tokens > 0 else math.nan
