"""A sweep folder as one table: every point a Run, keyed by the sweep's parameters.

Points are the sub-folders that hold a run (`llmd sweep` writes <sweep>/<index>/metrics.h5; `llmd demo --compare`
writes <run>/<policy>/metrics.h5). The parameters are the grid's keys when the sweep left a sweep.json naming them,
else the spec keys whose values differ between the points' stored specs, so a folder without one (a compare run, runs
gathered by hand) is keyed as well. Nothing is read until asked for, and then one point at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.runs import Run, is_run

SWEEP_FILE = "sweep.json"
# Keys every variant sets to its own value (its name, its folder): not a parameter of the experiment.
NOT_PARAMETERS = ("name", "output.dir")


@dataclass
class Sweep:
    path: Path
    points: list[Run]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parameters(self) -> list[str]:
        """The keys the points differ in, in the grid's order."""
        return list(self.points[0].params) if self.points else []

    def __iter__(self) -> Iterator[Run]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def table(self, fn: Callable[[Run], dict[str, Any]]) -> pd.DataFrame:
        """One row per point: its parameters, then what `fn(run)` returns."""
        rows = [{"point": r.label, **r.params, **fn(r)} for r in self.points]
        return pd.DataFrame(rows)

    def frames(self, fn: Callable[[Run], pd.DataFrame]) -> pd.DataFrame:
        """`fn(run)` of every point, concatenated, each row tagged with its point's parameters."""
        parts = []
        for r in self.points:
            df = fn(r)
            parts.append(df.assign(point=r.label, **r.params))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def reload(self) -> Sweep:
        for r in self.points:
            r.reload()
        return self


def _order(path: Path) -> tuple[int, Any]:
    # 0, 1, ..., 10 in index order, then named points (a compare run's policies) by name.
    return (0, int(path.name)) if path.name.isdigit() else (1, path.name)


def find_points(root: Path) -> list[Path]:
    """The run folders under a sweep folder (one level down; a point's own demo/ folder is not another point)."""
    return sorted((p for p in root.iterdir() if p.is_dir() and is_run(p)), key=_order)


def _grid_keys(root: Path, runs: list[Run]) -> list[str]:
    """The grid's keys as sweep.json names them (its rows carry them beside the run's figures)."""
    try:
        rows = json.loads((root / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return []
    flat = runs[0].flat_spec if runs else {}
    return [k for k in rows[0] if k in flat and k not in NOT_PARAMETERS]


def _differing_keys(runs: list[Run]) -> list[str]:
    flats = [r.flat_spec for r in runs]
    keys: list[str] = []
    for f in flats:
        keys += [k for k in f if k not in keys]
    return [
        k
        for k in keys
        if k not in NOT_PARAMETERS
        and not k.startswith("output.")
        and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1
    ]


def load_sweep(root: str | Path) -> Sweep:
    root = Path(root)
    runs = [Run(p) for p in find_points(root)]
    keys = _grid_keys(root, runs) or (_differing_keys(runs) if len(runs) > 1 else [])
    for r in runs:
        flat = r.flat_spec
        r.params = {k: flat.get(k) for k in keys}
    return Sweep(root, runs)


def load(path: str | Path) -> Run | Sweep:
    """A run (a metrics file, or a folder holding one or a live run's files) or a sweep (a folder of runs)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if is_run(path):
        return Run(path)
    return load_sweep(path)
