"""The preflight's bandwidth matrix in HDF5: DIR/fabric-<role>.h5, a metrics file (llmd.metrics root attributes and
spec, no tables) holding the group /fabric/<role>, which llmd.metrics.merge.merge_runs carries into the run file.

    /fabric/<role>/bandwidth_gbps   float64 [n, n]: link rank i -> rank j in GB/s (10^9 B/s), median over iterations;
                                    NaN on the diagonal (not measured) and for a failed link
    /fabric/<role>/times_s          float64 [n, n, iterations]: every transfer's time, NaN where none
      attrs: hostnames, ranks, bytes, iterations, backend, statistic, time (unix s), time_iso, min_gbps, errors
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from llmd.fabric.preflight import PreflightResult
from llmd.metrics.run_files import fresh_path
from llmd.metrics.writer import run_attrs


def fabric_path(run_dir: Path, role: str) -> Path:
    """DIR/fabric-<role>.h5, or -2, -3, ... if an earlier attempt (a requeued job) left one: never overwritten."""
    return fresh_path(run_dir, f"fabric-{role}")


def write_matrix(
    run_dir: Path, result: PreflightResult, *, min_gbps: float, spec_text: str = "", meta: dict[str, Any] | None = None
) -> Path:
    path = fabric_path(run_dir, result.role)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w", libver="latest") as f:
        for key, value in run_attrs(f"fabric-{result.role}", meta or {}, result.started).items():
            f.attrs[key] = value
        f.create_group("meta").create_dataset("spec", data=spec_text, dtype=h5py.string_dtype())
        g = f.create_group("fabric").create_group(result.role)
        g.create_dataset("bandwidth_gbps", data=result.gbps.astype(np.float64))
        g.create_dataset("times_s", data=result.times_s.astype(np.float64))
        g.attrs["hostnames"] = np.array(result.hostnames, dtype=h5py.string_dtype())
        g.attrs["ranks"] = np.arange(result.size, dtype=np.int32)
        g.attrs["bytes"] = result.nbytes
        g.attrs["iterations"] = result.iterations
        g.attrs["backend"] = result.backend
        g.attrs["statistic"] = "median"
        g.attrs["time"] = result.started
        g.attrs["time_iso"] = dt.datetime.fromtimestamp(result.started, dt.UTC).isoformat()
        g.attrs["min_gbps"] = min_gbps
        g.attrs["errors"] = json.dumps(result.errors)
    tmp.replace(path)  # a reader (or merge) never sees a half-written matrix
    return path
