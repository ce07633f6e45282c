"""One run on disk, read lazily: its metrics HDF5 (or, while it is still being written, the per-process files that
will be merged into it) as pandas frames, its stored spec and its fabric matrices.

A run folder holds metrics.h5 once the run is over; before that, the producers' own files (client.h5, router.h5,
engines.h5, ...) which llmd.metrics reads under SWMR, so a live run reads as far as its writers have flushed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from analysis.spec import flatten, pool_gpus, spec_dict
from llmd.metrics import open_metrics, read_meta, read_requests, read_timeseries
from llmd.report.summary import client_rows, engine_series

RUN_FILE = "metrics.h5"


def run_files(path: Path) -> list[Path]:
    """The metrics files of a run: the merged file when there is one, else every producer's own (a live run)."""
    if path.is_file():
        return [path]
    merged = path / RUN_FILE
    if merged.is_file():
        return [merged]
    return sorted(p for p in path.glob("*.h5") if not p.name.startswith(("fabric-", ".")))


def is_run(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".h5") or (path.is_dir() and bool(run_files(path)))


@dataclass
class Fabric:
    """One preflight bandwidth matrix (llmd.fabric.record): link rank i -> rank j in GB/s, NaN where not measured."""

    role: str
    gbps: np.ndarray
    times_s: np.ndarray
    hostnames: list[str]
    nbytes: int


@dataclass
class Run:
    """A run folder (or one metrics file). Frames are read on first use and kept; `reload()` reads again (a live
    run that has grown since)."""

    path: Path
    label: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not self.label:
            self.label = self.path.stem if self.path.is_file() else self.path.name

    @property
    def files(self) -> list[Path]:
        return run_files(self.path)

    @property
    def live(self) -> bool:
        """True while the run has no merged metrics.h5 yet (its producers may still be writing)."""
        return self.path.is_dir() and not (self.path / RUN_FILE).is_file()

    def reload(self) -> Run:
        for name in ("requests", "timeseries", "meta", "spec", "fabric"):
            self.__dict__.pop(name, None)
        return self

    @cached_property
    def requests(self) -> pd.DataFrame:
        """Every producer's /requests rows (the column `source` tells them apart)."""
        return _concat([read_requests(f) for f in self.files])

    @cached_property
    def timeseries(self) -> pd.DataFrame:
        df = _concat([read_timeseries(f) for f in self.files])
        return df.sort_values("t", kind="stable", ignore_index=True) if "t" in df else df

    @cached_property
    def meta(self) -> dict[str, Any]:
        files = self.files
        return read_meta(files[0]) if files else {}

    @cached_property
    def spec(self) -> dict[str, Any]:
        """The deployment spec the run stored ({} when none): the HDF5's own, else spec.yaml beside it."""
        text = self.meta.get("spec") or ""
        if not text:
            for sub in self.meta.get("sources", {}).values():
                text = text or sub.get("spec", "")
        folder = self.path if self.path.is_dir() else self.path.parent
        if not text and (folder / "spec.yaml").is_file():
            text = (folder / "spec.yaml").read_text()
        return spec_dict(text)

    @property
    def flat_spec(self) -> dict[str, Any]:
        return flatten(self.spec)

    @property
    def gpus(self) -> dict[str, int]:
        return pool_gpus(self.spec)

    @property
    def client(self) -> pd.DataFrame:
        """The requests as the client saw them (what the user got)."""
        return client_rows(self.requests)

    @property
    def router(self) -> pd.DataFrame:
        """The router's own request rows ({} frame when it wrote none)."""
        df = self.requests
        if not len(df):
            return df
        return df[_producer(df["source"]) == "router"]

    def series(self, source: str) -> pd.DataFrame:
        """Time-series rows of one producer: "client", "router", or "engines" (every engine rank's own rows)."""
        ts = self.timeseries
        if not len(ts):
            return ts
        if source == "engines":
            eng = engine_series(ts)
            return eng if eng is not None and len(eng) < len(ts) else ts.iloc[:0]
        return ts[_producer(ts["source"]) == source]

    @cached_property
    def fabric(self) -> list[Fabric]:
        """The fabric preflight's matrices: from the run file, else from fabric-<role>.h5 beside it."""
        folder = self.path if self.path.is_dir() else self.path.parent
        files = [*self.files, *sorted(folder.glob("fabric-*.h5"))]
        out: dict[str, Fabric] = {}
        for f in files:
            out.update({m.role: m for m in read_fabric(f) if m.role not in out})
        return list(out.values())


def read_fabric(path: str | os.PathLike[str]) -> list[Fabric]:
    out = []
    with open_metrics(path) as f:
        if "fabric" not in f:
            return []
        for role, g in f["fabric"].items():
            if not isinstance(g, h5py.Group) or "bandwidth_gbps" not in g:
                continue
            names = [h.decode() if isinstance(h, bytes) else str(h) for h in g.attrs.get("hostnames", [])]
            times = g["times_s"][()] if "times_s" in g else np.empty((0, 0, 0))
            out.append(Fabric(role, g["bandwidth_gbps"][()], times, names, int(g.attrs.get("bytes", 0))))
    return out


def _producer(source: pd.Series) -> pd.Series:
    # A merged run of several attempts names its producers router, router#2, ... (llmd.metrics.merge).
    return source.astype(str).str.split("#").str[0]


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if len(f.columns)]
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
