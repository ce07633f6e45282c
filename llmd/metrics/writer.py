"""Streaming HDF5 writer for the metrics schema: buffers rows, flushes under SWMR so the file is readable mid-run
and consistent after a SIGKILL (losing at most the rows since the last flush)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from llmd.metrics.schema import (
    NAME_BYTES,
    REQUEST_DTYPE,
    SCHEMA_VERSION,
    TIMESERIES_DTYPE,
    encode_str,
    to_rows,
)

REQUEST_CHUNK_ROWS = 8192
TIMESERIES_CHUNK_ROWS = 1024
# lzf meets the 200k rows/s target, gzip-1 does not (benchmarks/metrics_h5.py, dict rows: lzf ~234k rows/s at
# ~118 B/row, gzip-1 ~147k rows/s at ~75 B/row; rows are 655 B uncompressed).
COMPRESSION = "lzf"
# A chunk cache big enough for the chunk a timed flush leaves half-filled, so the next write does not re-read
# and re-decompress it.
CHUNK_CACHE_BYTES = 64 * 1024 * 1024

_STR = h5py.string_dtype("utf-8")


def _git_commit() -> str:
    # Best effort: no git, no repo or a slow filesystem must never stop a run from recording metrics.
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=2,
        )
        return out.stdout.strip() if out.returncode == 0 else ""
    except Exception:
        return ""


def _spec_text(spec: Any) -> str:
    # A metrics file is shared and archived: tokens the spec carries (engine env, --api-key) are stored as ***.
    from llmd.spec.redact import redact_data, redact_spec_text

    if spec is None:
        return ""
    if isinstance(spec, str):
        return redact_spec_text(spec)
    if isinstance(spec, bytes):
        return redact_spec_text(spec.decode("utf-8", "replace"))
    import yaml  # only when a spec object is given; the text form needs no YAML

    if hasattr(spec, "model_dump"):
        spec = spec.model_dump(mode="json")
    return yaml.safe_dump(redact_data(spec), sort_keys=False)


def _attr_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (str, bool, int, float, np.integer, np.floating)):
        return value
    return json.dumps(value, default=str)


def run_attrs(producer: str, meta: dict[str, Any], start_time: float) -> dict[str, Any]:
    """Root attributes of a metrics file: versions, host, git commit, start time, plus the caller's meta."""
    import llmd

    attrs: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "producer": producer,
        "start_time": start_time,
        "start_time_iso": _dt.datetime.fromtimestamp(start_time, _dt.UTC).isoformat(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "seed": -1,
        "llmd_version": getattr(llmd, "__version__", ""),
        "python_version": platform.python_version(),
        "h5py_version": h5py.version.version,
        "hdf5_version": h5py.version.hdf5_version,
        "git_commit": _git_commit(),
    }
    for key, value in meta.items():
        if key != "spec":
            attrs[key] = _attr_value(value)
    return attrs


def add_run_attrs(path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    """Add `meta` to a closed metrics file's root attributes, as the writer stores its own: for what the run's
    producers did not know when they wrote it (a sweep point's parameters, known to the job that ran the point)."""
    with h5py.File(path, "a") as f:
        for key, value in meta.items():
            f.attrs[key] = _attr_value(value)


def _owned(given: Any, arr: np.ndarray) -> np.ndarray:
    # The buffer outlives the call: a caller reusing its array must not change rows already appended.
    return arr.copy() if arr is given else arr


class MetricsWriter:
    """Append request rows and time-series rows to one HDF5 file, flushed at least every `flush_interval_s`.

    Appends are thread-safe. Full chunks are written by the appending thread; a daemon thread writes what is left
    every `flush_interval_s` so a quiet producer still reaches the disk.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        producer: str,
        meta: dict[str, Any] | None = None,
        flush_interval_s: float = 1.0,
        *,
        overwrite: bool = False,
        compression: str | None = COMPRESSION,
        chunk_rows: int = REQUEST_CHUNK_ROWS,
    ) -> None:
        meta = dict(meta or {})
        self.path = Path(path)
        self.producer = producer
        self.flush_interval_s = flush_interval_s
        self.start_time = float(meta.pop("start_time", time.time()))
        self._producer_b = encode_str(producer, NAME_BYTES)
        self._chunk_rows = chunk_rows
        self._lock = threading.Lock()
        self._pending: dict[str, list[np.ndarray]] = {"requests": [], "timeseries": []}
        self._pending_n: dict[str, int] = {"requests": 0, "timeseries": 0}
        self._closed = False
        self._written: dict[str, int] = {"requests": 0, "timeseries": 0}

        # "w-" fails if the file exists: a rerun must never truncate the previous run's metrics by accident.
        mode = "w" if overwrite else "w-"
        try:
            self._f = h5py.File(self.path, mode, libver="latest", rdcc_nbytes=CHUNK_CACHE_BYTES)
        except (FileExistsError, OSError) as e:
            if not overwrite and self.path.exists():
                raise FileExistsError(f"{self.path} exists; pass overwrite=True or choose another path") from e
            raise
        f = self._f
        for key, value in run_attrs(producer, meta, self.start_time).items():
            f.attrs[key] = value
        # Everything (datasets, attributes) must exist before SWMR mode: SWMR forbids creating objects.
        f.create_group("meta").create_dataset("spec", data=_spec_text(meta.get("spec")), dtype=_STR)
        self._ds = {
            "requests": f.create_dataset(
                "requests",
                shape=(0,),
                maxshape=(None,),
                dtype=REQUEST_DTYPE,
                chunks=(chunk_rows,),
                compression=compression,
            ),
            "timeseries": f.create_dataset(
                "timeseries",
                shape=(0,),
                maxshape=(None,),
                dtype=TIMESERIES_DTYPE,
                chunks=(TIMESERIES_CHUNK_ROWS,),
                compression=compression,
            ),
        }
        f.swmr_mode = True
        f.flush()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name=f"metrics-flush-{producer}", daemon=True)
        self._thread.start()

    # -- appending -----------------------------------------------------------------------------------------------

    def append_request(self, row: Any) -> None:
        """One request row: a dict (missing keys = unknown) or a tuple in REQUEST_DTYPE field order."""
        self.append_requests([row])

    def append_requests(self, rows: Any) -> None:
        """A batch of request rows: a REQUEST_DTYPE array, or a list of dicts or tuples."""
        self._append("requests", _owned(rows, to_rows(rows, REQUEST_DTYPE)))

    def append_timeseries(self, rows: Any) -> None:
        """One dict or a batch of time-series rows (TIMESERIES_DTYPE array, list of dicts or tuples)."""
        self._append("timeseries", _owned(rows, to_rows(rows, TIMESERIES_DTYPE)))

    def _append(self, name: str, arr: np.ndarray) -> None:
        if len(arr) == 0:
            return
        missing = arr["source"] == b""
        if missing.any():
            arr["source"][missing] = self._producer_b
        with self._lock:
            if self._closed:
                raise ValueError(f"MetricsWriter({self.path}) is closed")
            self._pending[name].append(arr)
            self._pending_n[name] += len(arr)
            if self._pending_n[name] >= self._chunk_rows:
                self._write(name, full_chunks_only=True)

    # -- flushing ------------------------------------------------------------------------------------------------

    def _write(self, name: str, full_chunks_only: bool = False) -> None:
        # Caller holds the lock.
        n = self._pending_n[name]
        if n == 0:
            return
        parts = self._pending[name]
        buf = parts[0] if len(parts) == 1 else np.concatenate(parts)
        take = n
        if full_chunks_only:
            # Writing whole chunks keeps compressed chunks write-once; the remainder waits for the timer or more
            # rows.
            take = (n // self._chunk_rows) * self._chunk_rows
        ds = self._ds[name]
        start = ds.shape[0]
        ds.resize((start + take,))
        ds[start : start + take] = buf[:take]
        ds.flush()  # SWMR: makes the new extent and data visible to readers in a consistent order
        self._written[name] = start + take
        rest = buf[take:]
        self._pending[name] = [rest] if len(rest) else []
        self._pending_n[name] = len(rest)

    def flush(self) -> None:
        """Write every buffered row and make it visible to SWMR readers."""
        with self._lock:
            if self._closed:
                return
            self._write("requests")
            self._write("timeseries")

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception as e:  # a failing disk must not kill the process; report it once per interval
                print(f"metrics: flush of {self.path} failed: {e!r}", file=sys.stderr)

    def close(self) -> None:
        """Flush and close; idempotent."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._write("requests")
            self._write("timeseries")
            self._closed = True
            self._f.close()

    @property
    def rows_written(self) -> int:
        """Request rows on disk (not counting the buffer)."""
        return self._written["requests"]

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
