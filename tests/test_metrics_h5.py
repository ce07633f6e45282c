"""llmd.metrics: schema round trip, streaming writer (SWMR, SIGKILL), reader, merge."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from llmd.metrics import (
    REQUEST_COLUMNS,
    REQUEST_DTYPE,
    SCHEMA_VERSION,
    TIMESERIES_DTYPE,
    MetricsWriter,
    column_docs,
    merge_runs,
    read_meta,
    read_requests,
    read_requests_array,
    read_timeseries,
    to_rows,
)

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "request_id": f"r{start + i}",
            "session": f"s{(start + i) % 7}",
            "turn": (start + i) % 5,
            "is_subagent": i % 3 == 0,
            "send_time": (start + i) * 0.01,
            "router_queue_s": 0.001,
            "ttft_s": 0.1 + i * 1e-4,
            "e2e_s": 1.5,
            "itl_mean_s": 0.02,
            "itl_p50_s": 0.019,
            "itl_max_s": 0.1,
            "input_tokens": 1000 + i,
            "output_tokens": 50,
            "cached_tokens": 900,
            "pod": f"decode-{i % 4}",
            "prefill_pod": "prefill-0" if i % 2 else "",
            "pd_path": "pd" if i % 2 else "decode-only",
            "status": 200,
            "error": "",
        }
        for i in range(n)
    ]


def test_schema_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    spec = "name: demo\npods: 2\n"
    rows = _rows(50)
    with MetricsWriter(path, "client", {"spec": spec, "seed": 7, "workload": {"sessions": 3}}) as w:
        w.append_requests(rows)
        w.append_timeseries([{"t": float(t), "tokens_out_per_s": 10.0 * t, "queue_len": t} for t in range(3)])
    arr = read_requests_array(path)
    assert arr.dtype == REQUEST_DTYPE
    assert [c.name for c in REQUEST_COLUMNS] == list(arr.dtype.names)
    df = read_requests(path)
    assert len(df) == 50
    for key, value in rows[13].items():
        got = df.iloc[13][key]
        assert got == pytest.approx(value, rel=1e-6) if isinstance(value, float) else got == value, key
    assert (df["source"] == "client").all()
    ts = read_timeseries(path)
    assert list(ts["queue_len"]) == [0, 1, 2] and list(ts["source"]) == ["client"] * 3
    assert read_timeseries(path, source="router").empty
    meta = read_meta(path)
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["producer"] == "client" and meta["seed"] == 7 and meta["spec"] == spec
    assert json.loads(meta["workload"]) == {"sessions": 3}
    for key in ("llmd_version", "python_version", "h5py_version", "host", "start_time", "git_commit"):
        assert key in meta
    assert set(column_docs()["requests"]) == set(REQUEST_DTYPE.names)


def test_append_forms_agree(tmp_path: Path) -> None:
    rows = _rows(20)
    arr = to_rows(rows)
    tuples = [tuple(r) for r in arr[list(arr.dtype.names[:-1])].tolist()]  # short: the last column is filled in
    paths = []
    for i, form in enumerate((rows, arr, tuples)):
        p = tmp_path / f"{i}.h5"
        with MetricsWriter(p, "client", {}) as w:
            w.append_requests(form[:10])
            for r in form[10:]:
                w.append_request(r)
        paths.append(p)
    a, b, c = (read_requests_array(p) for p in paths)
    # Bytes, not ==: the unknown (NaN) floats are equal bit for bit, never as numbers.
    assert a.tobytes() == b.tobytes() == c.tobytes()
    # The caller's array is copied, not filled in place.
    assert (arr["source"] == b"").all()


def test_unknown_column_rejected(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path / "m.h5", "client", {}) as w, pytest.raises(ValueError, match="ttft"):
        w.append_request({"request_id": "x", "ttft": 1.0})


def test_nan_and_missing_values(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    with MetricsWriter(path, "router", {}) as w:
        w.append_requests(
            [
                {"request_id": "a", "ttft_s": float("nan"), "e2e_s": None, "input_tokens": None, "status": 0},
                {"request_id": "b", "ttft_s": 0.25, "e2e_s": 2.0, "input_tokens": 10, "status": 503},
            ]
        )
        w.append_timeseries({"t": 0.0, "kv_usage": None})
    df = read_requests(path)
    assert math.isnan(df.ttft_s[0]) and math.isnan(df.e2e_s[0]) and math.isnan(df.itl_p50_s[0])
    assert df.input_tokens[0] == -1 and df.input_tokens[1] == 10
    assert df.ttft_s[1] == 0.25 and df.status[1] == 503
    assert df.ttft_s.mean() == 0.25  # pandas skips NaN: unknown never counts as zero
    assert math.isnan(read_timeseries(path).kv_usage[0])


def test_long_strings_truncated_not_rejected(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    long_ascii = "x" * 1000
    long_utf8 = "é" * 200  # 400 bytes; a cut in the middle of a character must not leave invalid UTF-8
    with MetricsWriter(path, "client", {}) as w:
        w.append_request({"request_id": long_ascii, "pod": long_utf8, "error": long_utf8 + long_ascii})
        w.append_request({"request_id": b"\xff\xfebytes", "session": 12345, "error": None})
    df = read_requests(path)
    assert df.request_id[0] == "x" * 64
    assert df.pod[0] == "é" * 32
    assert df.error[0] == "é" * 128
    assert df.request_id[1].endswith("bytes") and df.session[1] == "12345" and df.error[1] == ""


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    with MetricsWriter(path, "client", {}) as w:
        w.append_requests(_rows(5))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        MetricsWriter(path, "client", {})
    assert len(read_requests(path)) == 5  # the earlier run is intact
    with MetricsWriter(path, "client", {}, overwrite=True) as w:
        w.append_requests(_rows(2))
    assert len(read_requests(path)) == 2


def _count_rows(path: Path) -> int:
    code = "import sys; from llmd.metrics import read_requests; print(len(read_requests(sys.argv[1])))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=ENV, capture_output=True, text=True, timeout=60, check=True
    )
    return int(out.stdout)


@pytest.mark.timeout(120)
def test_readable_mid_run_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "live.h5"
    with MetricsWriter(path, "client", {}, flush_interval_s=60) as w:
        w.append_requests(_rows(100))
        w.flush()
        assert _count_rows(path) == 100
        w.append_requests(_rows(250, start=100))
        w.flush()
        assert _count_rows(path) == 350
        w.append_requests(_rows(10, start=350))  # buffered, not flushed: invisible until close
    assert len(read_requests(path)) == 360


@pytest.mark.timeout(120)
def test_timed_flush_without_explicit_flush(tmp_path: Path) -> None:
    path = tmp_path / "timed.h5"
    with MetricsWriter(path, "client", {}, flush_interval_s=0.1) as w:
        w.append_requests(_rows(42))
        deadline = time.monotonic() + 10
        while w.rows_written < 42 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _count_rows(path) == 42


CHILD = textwrap.dedent(
    """
    import sys, time
    from llmd.metrics import MetricsWriter
    w = MetricsWriter(sys.argv[1], "client", {"seed": 1}, flush_interval_s=0.2)
    n = 0
    t0 = time.monotonic()
    while True:
        w.append_requests([{"request_id": f"r{n + i}", "ttft_s": 0.1, "send_time": time.monotonic() - t0}
                           for i in range(10)])
        n += 10
        print(n, time.monotonic() - t0, flush=True)
        time.sleep(0.005)
    """
)


@pytest.mark.timeout(120)
def test_sigkill_loses_at_most_the_last_flush_window(tmp_path: Path) -> None:
    path = tmp_path / "killed.h5"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the writer is up and appending
    assert first
    time.sleep(2.0)
    os.kill(proc.pid, signal.SIGKILL)
    lines = [first, *proc.stdout.readlines()]
    proc.wait(timeout=30)
    total, elapsed = (float(x) for x in lines[-1].split())
    total = int(total)

    df = read_requests(path)
    rate = total / elapsed
    assert 0 < len(df) <= total
    # The file holds a prefix of what was appended, in order, nothing torn.
    assert list(df.request_id) == [f"r{i}" for i in range(len(df))]
    # At most one flush interval (0.2 s) of rows lost, plus slack for scheduling jitter on a loaded machine.
    assert total - len(df) <= rate * (0.2 + 0.5), (total, len(df), rate)
    print(f"sigkill: appended {total}, read back {len(df)}, {rate:.0f} rows/s")
    assert read_meta(path)["seed"] == 1
    # A killed writer's file still merges (its SWMR flag stays set; inputs are read as SWMR).
    assert len(read_requests(merge_runs([path], tmp_path / "merged.h5"))) == len(df)


def test_merge_three_files(tmp_path: Path) -> None:
    inputs = []
    for k, producer in enumerate(("client", "router", "decode-0")):
        p = tmp_path / f"{producer}.h5"
        with MetricsWriter(p, producer, {"spec": "pods: 1\n", "seed": k, "start_time": 1000.0 + k}) as w:
            w.append_requests(_rows(10 * (k + 1)))
            w.append_timeseries([{"t": float(t), "running": k} for t in range(2)])
        inputs.append(p)
    out = merge_runs(inputs, tmp_path / "run.h5")
    df = read_requests(out)
    assert len(df) == 10 + 20 + 30
    assert df.groupby("source").size().to_dict() == {"client": 10, "router": 20, "decode-0": 30}
    # One clock: each input's times move by its start offset from the earliest start.
    assert df[df.source == "decode-0"].send_time.iloc[0] == pytest.approx(2.0)
    ts = read_timeseries(out)
    assert len(ts) == 6 and list(read_timeseries(out, source="router").t) == [1.0, 2.0]
    meta = read_meta(out)
    assert meta["producer"] == "merge" and meta["start_time"] == 1000.0
    assert set(meta["sources"]) == {"client", "router", "decode-0"}
    assert meta["sources"]["router"]["seed"] == 1 and meta["sources"]["router"]["spec"] == "pods: 1\n"
    with pytest.raises(FileExistsError):
        merge_runs(inputs, out)


def test_merge_keeps_duplicate_producers_apart(tmp_path: Path) -> None:
    inputs = []
    for k in range(2):
        p = tmp_path / f"e{k}.h5"
        with MetricsWriter(p, "engine", {"start_time": 5.0}) as w:
            w.append_requests(_rows(3))
        inputs.append(p)
    out = merge_runs(inputs, tmp_path / "run.h5")
    assert sorted(read_requests(out).source.unique()) == ["engine", "engine#2"]
    assert set(read_meta(out)["sources"]) == {"engine", "engine#2"}


def test_empty_file_reads_as_empty_frames(tmp_path: Path) -> None:
    path = tmp_path / "m.h5"
    MetricsWriter(path, "sim", {}).close()
    assert read_requests(path).empty and list(read_requests(path).columns) == list(REQUEST_DTYPE.names)
    assert list(read_timeseries(path).columns) == list(TIMESERIES_DTYPE.names)


def test_a_file_of_an_earlier_schema_reads_and_merges_with_the_new_columns_unknown(tmp_path: Path) -> None:
    """Runs on disk from schema 2 (no KV transfer columns) read as the current schema and merge with new files."""
    from metricsutil import V3_REQUEST_COLUMNS, schema2_file

    old = schema2_file(tmp_path / "old.h5", "router", _rows(4), [{"t": 0.0, "inflight": 3}])
    df = read_requests(old)
    assert list(df.columns) == list(REQUEST_DTYPE.names) and len(df) == 4
    assert (df["kv_transfer_tokens"] == -1).all() and (df["kv_transfer_bytes"] == -1).all()
    assert df["kv_transfer_s"].isna().all() and (df["input_tokens"] == [1000, 1001, 1002, 1003]).all()
    assert read_requests_array(old).dtype == REQUEST_DTYPE
    new = tmp_path / "new.h5"
    with MetricsWriter(new, "client", {"start_time": 1000.0}) as w:
        w.append_requests([{**r, "kv_transfer_tokens": 7} for r in _rows(2)])
    out = read_requests(merge_runs([old, new], tmp_path / "run.h5"))
    assert out.groupby("source")["kv_transfer_tokens"].max().to_dict() == {"router": -1, "client": 7}
    assert set(V3_REQUEST_COLUMNS) <= set(out.columns) and out["pod"].iloc[0] == "decode-0"
    # A table that is no version of the schema is still refused.
    import h5py

    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w", libver="latest") as f:
        f.attrs.update({"producer": "x", "start_time": 1000.0})
        f.create_dataset("requests", data=np.zeros(2, dtype=[("request_id", "<f8")]), maxshape=(None,))
    with pytest.raises(ValueError, match="expected schema"):
        merge_runs([bad, new], tmp_path / "bad-run.h5")
