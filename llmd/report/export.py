"""A run's metrics HDF5 -> the llm-d Benchmark Report v0.2 format (JSON or YAML), validated with
`llmd_benchmark_report.load_benchmark_report`.

What a run has is filled: run id and times, the stack (one inference_engine component per pool of the run's spec, the
router as a generic component), the load (the spec's workload section), request counts, lengths, latencies and
throughputs with units, throughput time series, and the prefix-cache hit share and preemptions as ad-hoc
observability entries. What it does not have (accelerator telemetry, pod startup, replica status, per-modality
payloads) is left out; the simulated engine's accelerator is the spec's GPU profile, marked as simulated.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from llmd.engines.kinds import engine_kind
from llmd.report.summary import client_rows, failed, summarize_frames, throughput_series

REPORT_VERSION = "0.2"
SUMMARY_FILE = "summary.json"  # written by `llmd demo` next to metrics.h5; adds what the HDF5 lacks (preemptions)

PCTS = (("p0p1", 0.1), ("p1", 1), ("p5", 5), ("p10", 10), ("p25", 25), ("p50", 50), ("p75", 75), ("p90", 90))
PCTS += (("p95", 95), ("p99", 99), ("p99p9", 99.9))


def stats(values: Any, units: str) -> dict[str, Any] | None:
    """A Statistics block (mean, stddev, min, percentiles, max) over the finite values; None when there are none."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if not arr.size:
        return None
    out: dict[str, Any] = {"units": units, "mean": float(arr.mean()), "stddev": float(arr.std())}
    out["min"] = float(arr.min())
    for key, q in PCTS:
        out[key] = float(np.percentile(arr, q))
    out["max"] = float(arr.max())
    return out


def _cfg_id(obj: Any) -> str:
    return hashlib.md5(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _spec_dict(meta: dict[str, Any]) -> dict[str, Any]:
    text = meta.get("spec") or ""
    if not text:
        return {}
    import yaml

    from llmd.spec.yaml_input import load

    try:
        data = load(text)  # the file may come from anywhere: an alias bomb in its spec must not hang the export
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _stack(spec: dict[str, Any], version: str) -> list[dict[str, Any]]:
    if not spec:
        return []
    model = spec.get("model") or {}
    engine = spec.get("engine") or {}
    kind = engine.get("kind", "sim")
    backend = engine_kind(kind)
    prefill = spec.get("prefill") or {}
    pools = {"prefill": prefill} if prefill.get("nodes", 0) > 0 else {}
    pools["decode"] = spec.get("decode") or {}
    stack = []
    for role, pool in pools.items():
        tp, dp, replicas = int(pool.get("tp_size", 1)), int(pool.get("dp_size", 1)), int(pool.get("replicas", 1))
        gpu = str(engine.get("gpu", "unknown"))
        native = {k: pool[k] for k in ("max_num_seqs", "max_num_batched_tokens", "port", "extra_args") if k in pool}
        stack.append(
            {
                "metadata": {
                    "label": f"{role}-pool",
                    "cfg_id": _cfg_id({"pool": pool, "model": model, "engine": engine}),
                    "description": f"{role} pool ({kind} engine)",
                },
                "standardized": {
                    "kind": "inference_engine",
                    "tool": backend.report_tool,
                    "tool_version": version,
                    "role": role,
                    "replicas": max(replicas, 1),
                    "model": {"name": str(model.get("served_name") or model.get("path") or "unknown")},
                    "accelerator": {
                        "model": f"{gpu} (simulated)" if backend.simulated else gpu,
                        "count": replicas * tp * dp,
                        "parallelism": {
                            "tp": tp,
                            "dp": dp,
                            "dp_local": dp,
                            "workers": 1,
                            "ep": dp if pool.get("ep") else 1,
                        },
                    },
                },
                "native": {"args": native, "envars": dict(pool.get("env") or {}) or None},
            }
        )
    router = spec.get("router") or {}
    stack.append(
        {
            "metadata": {"label": "router", "cfg_id": _cfg_id(router), "description": "llmd prefix-aware router"},
            "standardized": {
                "kind": "generic",
                "tool": "llmd-router",
                "tool_version": version,
                "policy": router.get("policy"),
            },
            "native": {"config": router},
        }
    )
    return stack


def _seq(values: pd.Series) -> dict[str, Any]:
    arr = values[values >= 0].to_numpy(dtype=float)
    if not arr.size:
        return {"distribution": "other", "value": 0}
    return {"distribution": "other", "value": float(arr.mean()), "std_dev": float(arr.std()), "min": int(arr.min()),
            "max": max(int(arr.max()), 1)}  # fmt: skip


def _load(spec: dict[str, Any], meta: dict[str, Any], ok: pd.DataFrame, version: str) -> dict[str, Any]:
    workload = dict(spec.get("workload") or {})
    for key in ("profile", "seed", "concurrency", "duration_s", "context_scale"):
        if key in meta and meta[key] not in ("", None):
            workload.setdefault(key, meta[key])
    std: dict[str, Any] = {
        "tool": "llmd-loadgen",
        "tool_version": version,
        "source": "random",
        "input_seq_len": _seq(ok["input_tokens"]),
        "output_seq_len": _seq(ok["output_tokens"]),
    }
    turns = ok["turn"][ok["turn"] >= 0]
    if len(turns):
        std["multi_turn"] = {"enabled": True, "max_turns": {"distribution": "other", "value": int(turns.max()) + 1}}
    conc = workload.get("concurrency")
    if isinstance(conc, int) and conc >= 1:
        std["concurrency"] = conc
    return {
        "metadata": {
            "cfg_id": _cfg_id(workload),
            "description": f"agentic sessions, profile {workload.get('profile', 'unknown')}",
            "treatment": str(meta.get("policy")) if meta.get("policy") else None,
        },
        "standardized": std,
        "native": {"config": workload or None},
    }


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


def build_report(
    requests: pd.DataFrame,
    timeseries: pd.DataFrame | None,
    meta: dict[str, Any],
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict for one run (requests/timeseries as read_requests/read_timeseries give them)."""
    import llmd

    version = str(getattr(llmd, "__version__", "") or "unknown")
    extra = extra or {}
    summary = summarize_frames(requests, timeseries, preemptions=extra.get("preemptions"))
    df = client_rows(requests)
    err = failed(df) if len(df) else pd.Series(dtype=bool)
    ok = df[~err] if len(df) else df
    spec = _spec_dict(meta)
    start = float(meta.get("start_time") or 0.0)
    duration = summary.duration_s
    uid_src = f"{meta.get('host', '')}:{meta.get('pid', '')}:{start}:{meta.get('producer', '')}"
    run: dict[str, Any] = {
        "uid": hashlib.md5(uid_src.encode()).hexdigest(),
        "eid": str(meta["run_id"]) if meta.get("run_id") else None,
        "pid": f"{meta.get('host', '')}:{meta.get('pid', '')}",
        "description": f"llmd run of {spec.get('name', 'an unknown spec')}"
        + (f", policy {meta['policy']}" if meta.get("policy") else ""),
        "keywords": ["llmd", "agentic"] + ([str(meta["policy"])] if meta.get("policy") else []),
    }
    if start > 0:
        run["time"] = {"start": _iso(start), "end": _iso(start + duration), "duration": f"PT{duration:.3f}S"}

    requests_block: dict[str, Any] = {"total": len(df), "failures": int(err.sum()) if len(df) else 0}
    for key, col in (("input_length", "input_tokens"), ("output_length", "output_tokens")):
        s = stats(ok[col][ok[col] >= 0], "count") if len(ok) else None
        if s:
            requests_block[key] = s
    latency: dict[str, Any] = {}
    if len(ok):
        out = ok["output_tokens"].astype(float)
        tpot = (ok["e2e_s"] - ok["ttft_s"]) / (out - 1).where(out > 1)
        for key, values, units in (
            ("time_to_first_token", ok["ttft_s"], "s"),
            ("time_per_output_token", tpot, "s/token"),
            ("inter_token_latency", ok["itl_mean_s"], "s/token"),
            ("normalized_time_per_output_token", ok["e2e_s"] / out.where(out > 0), "s/token"),
            ("request_latency", ok["e2e_s"], "s"),
        ):
            s = stats(values, units)
            if s:
                latency[key] = s
    rate = 1.0 / duration if duration > 0 else 0.0
    throughput = {
        "input_token_rate": {"units": "tokens/s", "mean": summary.input_tokens * rate},
        "output_token_rate": {"units": "tokens/s", "mean": summary.output_tokens * rate},
        "total_token_rate": {"units": "tokens/s", "mean": (summary.input_tokens + summary.output_tokens) * rate},
        "request_rate": {"units": "queries/s", "mean": (len(ok)) * rate},
    }
    aggregate: dict[str, Any] = {"requests": requests_block, "throughput": throughput}
    if latency:
        aggregate["latency"] = latency
    performance: dict[str, Any] = {"aggregate": aggregate}
    series = _time_series(ok, start) if start > 0 and len(ok) else None
    if series:
        performance["time_series"] = series

    observability: dict[str, Any] = {}
    if summary.hit_share is not None:
        observability["prefix_cache_hit_rate"] = {
            "aggregated": {"units": "fraction", "mean": summary.hit_share},
            "gpu": summary.hit_share_gpu,
            "cpu": summary.hit_share_cpu,
            "source": "client usage.prompt_tokens_details.cached_tokens",
        }
    if summary.router_queue_p90_s is not None:
        observability["router_queue_time"] = {"statistics": stats(requests["router_queue_s"], "s")}
    if extra.get("preemptions") is not None:
        observability["vllm_num_preemptions_total"] = {"aggregated": {"units": "count", "mean": extra["preemptions"]}}
    results: dict[str, Any] = {"request_performance": performance}
    if observability:
        results["observability"] = observability
    sessions = df["session"][df["session"] != ""] if len(df) else pd.Series(dtype=str)
    if len(sessions):
        per = df[df["session"] != ""].groupby("session")
        results["session_performance"] = {
            "sessions": {
                "total": int(sessions.nunique()),
                "total_events": len(sessions),
                "total_events_completed": int((~err[df["session"] != ""]).sum()),
                "events_per_session": stats(per.size(), "count"),
                "input_tokens_per_session": stats(per["input_tokens"].sum(), "count"),
                "output_tokens_per_session": stats(per["output_tokens"].sum(), "count"),
            }
        }
    scenario: dict[str, Any] = {"load": _load(spec, meta, ok, version)}
    stack = _stack(spec, version)
    if stack:
        scenario["stack"] = stack
    return _clean({"version": REPORT_VERSION, "run": run, "scenario": scenario, "results": results})


def _time_series(ok: pd.DataFrame, start: float) -> dict[str, Any] | None:
    ts = throughput_series(ok)
    if not len(ts):
        return None

    def points(col: pd.Series) -> list[dict[str, Any]]:
        return [{"ts": _iso(start + float(t)), "value": float(v)} for t, v in zip(ts["t"], col, strict=True)]

    return {
        "throughput": {
            "input_token_rate": {"units": "tokens/s", "series": points(ts["tokens_in_per_s"])},
            "output_token_rate": {"units": "tokens/s", "series": points(ts["tokens_out_per_s"])},
            "total_token_rate": {"units": "tokens/s", "series": points(ts["tokens_in_per_s"] + ts["tokens_out_per_s"])},
            "request_rate": {"units": "queries/s", "series": points(ts["requests_per_s"])},
        }
    }


def _clean(obj: Any) -> Any:
    """Drop None values (the schema's optional fields) and non-finite floats (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if v is not None and not _bad_float(v)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _bad_float(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def report_for_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated report dict of one metrics HDF5 (plus summary.json next to it, when there is one)."""
    from llmd.metrics import read_meta, read_requests, read_timeseries

    path = Path(path)
    extra: dict[str, Any] = {}
    side = path.with_name(SUMMARY_FILE)
    if side.exists():
        try:
            extra = json.loads(side.read_text())
        except (OSError, json.JSONDecodeError):
            extra = {}
    report = build_report(read_requests(path), read_timeseries(path), read_meta(path), extra=extra)
    validate(report)
    return report


def validate(report: dict[str, Any]) -> Any:
    """Validate with the llm-d benchmark report package; raises ValueError (pydantic's) on a schema violation."""
    from llmd_benchmark_report import load_benchmark_report

    return load_benchmark_report(report)


def write_report(report: dict[str, Any], out: str | os.PathLike[str]) -> Path:
    """Write JSON for *.json, else YAML."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".json":
        out.write_text(json.dumps(report, indent=2) + "\n")
    else:
        import yaml

        out.write_text(yaml.safe_dump(report, sort_keys=False))
    return out


def find_metrics(target: str | os.PathLike[str]) -> list[Path]:
    """The metrics files a RUN_DIR_OR_H5 names: the file itself, DIR/metrics.h5, or DIR/*/metrics.h5 (--compare)."""
    p = Path(target)
    if p.is_file():
        return [p]
    if (p / "metrics.h5").is_file():
        return [p / "metrics.h5"]
    if p.is_dir():
        return sorted(p.glob("*/metrics.h5"))
    return []
