"""A small real sweep for the analysis tests: four points of the cluster simulator (two policies x two concurrencies,
5 simulated seconds each, P/D on 2 + 2 simulated GPUs), as `llmd sweep FILE --simulate` leaves them, plus a fabric
preflight matrix beside point 0 (simulated runs have none) so every figure has data. Made once per test session."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import yaml

SWEEP_NAME = "tiny"
GRID = {"router.policy": ["precise", "round-robin"], "workload.concurrency": [4, 16]}


def _sweep_file(root: Path) -> Path:
    doc = {
        "name": SWEEP_NAME,
        "base": {
            "name": "tiny",
            "prefill": {"nodes": 2, "replicas": 2},
            "decode": {"nodes": 2, "replicas": 2},
            "kv": {"cpu_bytes": "64MiB", "gpu_blocks": 264},
            "workload": {
                "profile": "automationbench",
                "duration_s": 5,
                "context_scale": 0.04,
                "params": {"initial": 12000, "growth_p99": 12000, "output_p50": 60, "gap_s": 0.3},
            },
            "output": {"dir": str(root / "results")},
        },
        "grid": GRID,
    }
    path = root / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _fabric(run_dir: Path) -> None:
    from llmd.fabric.preflight import PreflightResult
    from llmd.fabric.record import write_matrix

    n = 4
    gbps = np.full((n, n), 40.0) + np.arange(n)[:, None]
    np.fill_diagonal(gbps, np.nan)
    times = np.repeat((2**26 / (gbps * 1e9))[:, :, None], 3, axis=2)
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    result = PreflightResult("decode", 2**26, 3, hosts, gbps, times, started=time.time())
    write_matrix(run_dir, result, min_gbps=10.0)


def make_sweep(base: Path) -> Path:
    """The sweep folder under `base` (made on the first call, reused after)."""
    root = base / "analysis-sweep"
    folder = root / "results" / SWEEP_NAME
    if (folder / "sweep.json").exists():
        return folder
    from sweeps.simulate import run_simulated_sweep

    root.mkdir(parents=True, exist_ok=True)
    assert run_simulated_sweep(_sweep_file(root), workers=2) == 0
    _fabric(folder / "0")
    return folder
