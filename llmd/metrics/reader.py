"""Read metrics files into pandas: finished files, files still being written (SWMR) and files whose writer died."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h5py
import numpy as np
import pandas as pd

from llmd.metrics.schema import REQUEST_DTYPE, TIMESERIES_DTYPE, decode_columns


@contextmanager
def open_metrics(path: str | os.PathLike[str]) -> Iterator[h5py.File]:
    """Open read-only as a SWMR reader, so a live writer (or a killed one, whose SWMR flag stays set) is fine."""
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError:
        # Files not written in the latest format (e.g. by another tool) cannot be opened as SWMR readers.
        f = h5py.File(path, "r")
    try:
        yield f
    finally:
        f.close()


def _read_table(f: h5py.File, name: str, dtype: np.dtype) -> np.ndarray:
    if name not in f:
        return np.empty(0, dtype=dtype)
    ds = f[name]
    if f.swmr_mode:
        ds.refresh()  # pick up rows the writer flushed since the file was opened
    return ds[()] if ds.shape[0] else np.empty(0, dtype=ds.dtype)


def _frame(arr: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(decode_columns(arr))


def read_requests_array(path: str | os.PathLike[str]) -> np.ndarray:
    """The /requests table as a raw structured array (bytes fields undecoded)."""
    with open_metrics(path) as f:
        return _read_table(f, "requests", REQUEST_DTYPE)


def read_requests(path: str | os.PathLike[str]) -> pd.DataFrame:
    """/requests as a DataFrame, strings decoded, one row per request (NaN / -1 / "" where unknown)."""
    return _frame(read_requests_array(path))


def read_timeseries(path: str | os.PathLike[str], source: str | None = None) -> pd.DataFrame:
    """/timeseries as a DataFrame; `source` keeps only that producer's rows."""
    with open_metrics(path) as f:
        arr = _read_table(f, "timeseries", TIMESERIES_DTYPE)
    df = _frame(arr)
    if source is not None:
        df = df[df["source"] == source].reset_index(drop=True)
    return df


def _attrs(obj: h5py.Group) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.attrs.items():
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def _spec(group: h5py.Group) -> str:
    if "meta/spec" not in group:
        return ""
    value = group["meta/spec"][()]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Root attributes plus "spec" (the YAML text); merged files add "sources": {name: that input's meta}."""
    with open_metrics(path) as f:
        meta = _attrs(f)
        meta["spec"] = _spec(f)
        if "sources" in f:
            meta["sources"] = {name: {**_attrs(g), "spec": _spec(g)} for name, g in f["sources"].items()}
    return meta
