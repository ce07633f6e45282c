"""Metrics files as earlier schema versions wrote them: runs on disk from before a column was added must still read,
merge and analyse."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from llmd.metrics import REQUEST_COLUMNS, TIMESERIES_DTYPE, to_rows

# Schema 3 added these to /requests.
V3_REQUEST_COLUMNS = ("kv_transfer_tokens", "kv_transfer_bytes", "kv_transfer_s")
V2_REQUEST_DTYPE = np.dtype([(c.name, c.dtype) for c in REQUEST_COLUMNS if c.name not in V3_REQUEST_COLUMNS])


def schema2_file(
    path: Path, producer: str, requests: Sequence[dict[str, Any]], timeseries: Sequence[dict[str, Any]] = ()
) -> Path:
    """A metrics file as schema 2 wrote it: /requests without the KV transfer columns."""
    full = to_rows(list(requests))
    rows = np.empty(len(full), dtype=V2_REQUEST_DTYPE)
    for name in V2_REQUEST_DTYPE.names or ():
        rows[name] = full[name]
    rows["source"][rows["source"] == b""] = producer.encode()
    series = to_rows(list(timeseries), TIMESERIES_DTYPE) if timeseries else np.empty(0, TIMESERIES_DTYPE)
    series["source"][series["source"] == b""] = producer.encode()
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs.update({"schema_version": 2, "producer": producer, "start_time": 1000.0, "seed": 0})
        f.create_dataset("requests", data=rows, maxshape=(None,), chunks=True)
        f.create_dataset("timeseries", data=series, maxshape=(None,), chunks=True)
        f.create_group("meta").create_dataset("spec", data="", dtype=h5py.string_dtype())
    return path
