"""Efficiency factors in their own file, efficiency.yaml: GPU name -> only the fields a calibration fits (what
serving kernels reach of the datasheet peaks, and the fixed costs). A profile folder's efficiency.yaml applies after
every gpus.yaml, so factors frozen by a calibration win over the profiles they were fitted on."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from llmd.errors import UserError
from llmd.perf.profile_file import check_fields, read_entries

# Field -> its unit (None: a plain fraction). The same fields, with the same meaning, as GPUProfile's.
EFFICIENCY_UNITS: dict[str, str | None] = {
    "mfu": None,
    "bw_efficiency": None,
    "link_efficiency": None,
    "step_overhead_s": "s",
    "layer_overhead_s": "s",
    "nvlink_latency_s": "s",
    "net_latency_s": "s",
}
EFFICIENCY_FIELDS = tuple(EFFICIENCY_UNITS)
FRACTIONS = frozenset({"mfu", "bw_efficiency", "link_efficiency"})

_HEADER = (
    "# Efficiency factors per GPU (llmd/perf/efficiency.py): fractions of peak (mfu, bw_efficiency, link_efficiency)\n"
    "# and fixed costs in seconds. Applied over the GPU profiles of every gpus.yaml. Written by dump_efficiency.\n"
)


def check_efficiency(path: str | os.PathLike[str], gpu_name: str, fields: Mapping[str, Any]) -> dict[str, float]:
    """`fields` as efficiency factors of `gpu_name`, or a UserError naming `path`, the GPU and the field."""
    units = {name: unit for name, unit in EFFICIENCY_UNITS.items() if unit is not None}
    types = dict.fromkeys(EFFICIENCY_FIELDS, float)
    return check_fields(path, "GPU", gpu_name, fields, types, units, fractions=FRACTIONS)


def load_efficiency(path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """An efficiency file's factors: {GPU name: {field: value}}, checked."""
    return {name: check_efficiency(path, name, raw) for name, raw in read_entries(path, "GPU").items()}


def dump_efficiency(path: str | os.PathLike[str], gpu_name: str, fields: Mapping[str, Any]) -> Path:
    """Freeze fitted factors of `gpu_name` in the efficiency file at `path` (created if missing).

    The given fields replace those of the same name; others the file held for that GPU, and other GPUs' entries,
    are kept. The file is rewritten whole (comments in it are not kept) and replaced atomically. Returns the path.
    """
    target = Path(path)
    checked = check_efficiency(target, gpu_name, fields)
    if not checked:
        raise UserError(f"dump_efficiency: no factors given for {gpu_name!r}; give at least one of {EFFICIENCY_FIELDS}")
    if not target.parent.is_dir():
        raise UserError(f"dump_efficiency: {target.parent} is not a folder; create it or give another path")
    table = load_efficiency(target) if target.exists() else {}
    table[gpu_name] = {**table.get(gpu_name, {}), **checked}
    text = _HEADER + yaml.safe_dump(table, sort_keys=False, default_flow_style=False)
    # A crash mid-write must not leave a half file that breaks every later load: write beside it, then rename.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
