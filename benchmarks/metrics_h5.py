"""Metrics HDF5 writer benchmark: request rows appended per second, file size per row. One run, one core.

Prints `name: value  # target ... (ratio R)` lines (R >= 1: target met) and `# name: value` context lines.
`python benchmarks/metrics_h5.py`: ~15 s.

Scenario: a load generator appends finished requests in batches of 1,000 (`append_requests`), as dicts with every
column set (headline) or as a ready REQUEST_DTYPE array; the clock covers conversion, the appends, the background
flushes (default 1 s interval) and `close()`. Rows look like an agentic run: ~40-char request ids, session ids,
pod names of a 64-pod deployment, 1% errors with a ~120-char message. Compression: lzf (the writer's choice) vs
gzip level 1, for the record.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from _report import report

from llmd.metrics import MetricsWriter, read_requests_array, to_rows

TARGET_ROWS_PER_S = 200_000


def make_batches(n_rows: int, batch: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    pods = [f"decode-{i:02d}.llmd-engine.svc" for i in range(64)]
    paths = ["decode-only", "pd", "pd-fallback", "p2p"]
    sessions = rng.integers(0, 2_000, n_rows)
    ttft = rng.lognormal(-1.0, 0.8, n_rows)
    out_tok = rng.integers(1, 2_000, n_rows)
    rows = []
    for i in range(n_rows):
        err = i % 100 == 0
        rows.append(
            {
                "request_id": f"chatcmpl-{i:012d}-{int(sessions[i]):08x}-agentic",
                "session": f"session-{int(sessions[i]):06d}",
                "turn": int(i % 37),
                "is_subagent": bool(i % 5 == 0),
                "send_time": i * 1e-3,
                "router_queue_s": float(ttft[i]) * 0.1,
                "ttft_s": float(ttft[i]),
                "e2e_s": float(ttft[i]) + int(out_tok[i]) * 0.02,
                "itl_mean_s": 0.02,
                "itl_p50_s": 0.019,
                "itl_max_s": 0.11,
                "input_tokens": int(20_000 + i % 50_000),
                "output_tokens": int(out_tok[i]),
                "cached_tokens": int(18_000 + i % 40_000),
                "pod": pods[i % 64],
                "prefill_pod": pods[(i * 7) % 64] if i % 4 == 1 else "",
                "pd_path": paths[i % 4],
                "status": 500 if err else 200,
                "error": "upstream engine closed the connection before the first token: " * 2 if err else "",
            }
        )
    return [rows[i : i + batch] for i in range(0, n_rows, batch)]


def run(path: Path, batches: list[Any], compression: str | None) -> float:
    t0 = time.perf_counter()
    with MetricsWriter(path, "bench-client", {"seed": 0}, compression=compression, overwrite=True) as w:
        for b in batches:
            w.append_requests(b)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1_000)
    args = ap.parse_args()

    dict_batches = make_batches(args.rows, args.batch)
    array_batches = [to_rows(b) for b in dict_batches]
    n = args.rows
    with tempfile.TemporaryDirectory() as d:
        results: dict[tuple[str, str], tuple[float, int]] = {}
        for comp in ("lzf", "gzip"):
            for kind, batches in (("dicts", dict_batches), ("array", array_batches)):
                p = Path(d) / f"{comp}-{kind}.h5"
                dt = run(p, batches, comp)
                results[(comp, kind)] = (n / dt, p.stat().st_size)
        check = read_requests_array(Path(d) / "lzf-dicts.h5")
        assert len(check) == n and check["request_id"][-1] == array_batches[-1]["request_id"][-1]

    rate, size = results[("lzf", "dicts")]
    report("h5_rows_per_s", rate, TARGET_ROWS_PER_S, higher_is_better=True, fmt="{:,.0f}")
    print(f"# h5_bytes_per_row: {size / n:.1f}  (lzf; uncompressed row {array_batches[0].dtype.itemsize} B)")
    for (comp, kind), (r, s) in results.items():
        print(f"# {comp:>4} {kind:>5}: {r:>12,.0f} rows/s  {s / n:6.1f} B/row")
    print(f"# rows: {n:,} in batches of {args.batch:,}")


if __name__ == "__main__":
    main()
