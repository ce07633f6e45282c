"""Shared pieces of the Slurm tests: the local cluster (slurm/local-cluster.sh), a tiny tokenizer, specs on free
ports, and `llmd` run as a user would run it. Tests marked `slurm` skip when no cluster answers, unless
LLMD_REQUIRE_SLURM=1 (set by `make test` after starting the cluster), where they fail instead."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REQUIRED = os.environ.get("LLMD_REQUIRE_SLURM") == "1"


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "no Slurm here (sinfo not on PATH); start it with `slurm/local-cluster.sh start`"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    up = [ln for ln in out.stdout.splitlines() if ln.split()[-1].rstrip("*") in ("idle", "mixed", "allocated")]
    if len(up) < 3:
        return f"the cluster needs 3 usable nodes for a het job; sinfo says: {out.stdout.strip()!r}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = _cluster_problem()
    if problem:
        if REQUIRED:
            pytest.fail(f"LLMD_REQUIRE_SLURM=1 but the Slurm cluster is not usable: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmd.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny(out, weights=False)
    return out


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pool_ports() -> tuple[int, int, int]:
    """(router, prefill base, decode base): each pool base with its layout bands (+1000, +2000, +3000) free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 28000, 10)
        # up to 4 replicas/ranks per pool: base + replica (HTTP) and base + band + rank (events, side channel, replay)
        ports = [base + d + band + k for d in (0, 100) for band in (0, 1000, 2000, 3000) for k in range(4)]
        ports.append(base + 500)
        if all(_free(p) for p in ports):
            return base + 500, base, base + 100
    raise RuntimeError("no free port layout")


def write_spec(folder: Path, tokenizer: Path, name: str, **sections: Any) -> Path:
    router, prefill, decode = pool_ports()
    data: dict[str, Any] = {
        "name": name,
        "model": {"path": str(tokenizer)},
        "prefill": {"nodes": 1, "port": prefill},
        "decode": {"nodes": 1, "port": decode},
        "router": {"port": router},
        "engine": {"time_scale": 0},
        "workload": {"profile": "smoke", "duration_s": 5, "concurrency": 4},
        "output": {"dir": str(folder / "results")},
        "slurm": {"time": "00:10:00", "cpus_per_task": 2},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def llmd(*args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = llmd_start(*args, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def llmd_start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`llmd ARGS` started in `cwd` with this test's own state folder, its output captured; `llmd` waits for it."""
    full_env = {**os.environ, "LLMD_STATE_DIR": str(cwd / ".llmd-state"), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "llmd.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def run_dirs(folder: Path, name: str) -> list[Path]:
    return sorted((folder / "results").glob(f"{name}-*"))


def run_state(run: Path) -> dict[str, Any]:
    return json.loads((run / "run.json").read_text())


def wait_for(predicate: Any, timeout: float, what: str, step: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_active(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
    return bool(out.stdout.strip())


@pytest.fixture
def jobs() -> Any:
    """Job ids a test submitted; any still queued or running at the end are cancelled."""
    submitted: list[str] = []
    yield submitted
    for job_id in submitted:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
