"""No engine outlives the task that started it: a Slurm engine task killed outright (SIGKILL at the end of KillWait,
an OOM kill, a requeue) takes its engine with it, though the engine runs in a session of its own (llmd.children).
Seen before the fix: `llmd engine sim` processes of requeued Slurm jobs still running after the job was gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmd import runid

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent, init, reaps it).
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] != "Z"


def test_an_engine_task_killed_outright_takes_its_engine_with_it(tmp_path: Path, model_dir: Path) -> None:
    spec = {
        "name": "orphan",
        "model": {"path": str(model_dir)},
        "prefill": {"nodes": 0},
        "decode": {"port": "auto"},
        "engine": {"time_scale": 0, "startup_timeout_s": 60},
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec_path = run_dir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMD_ENGINE_HOST": "127.0.0.1", runid.ENV: runid.new_run_id()}
    cmd = [sys.executable, "-m", "launchers.engine_task", "--spec", str(spec_path), "--run-dir", str(run_dir)]
    cmd += ["--role", "decode", "--node-index", "0"]
    with open(tmp_path / "task.log", "wb") as log:
        task = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    pid_file = run_dir / "engines" / "decode-0.pid"
    engine_pid = None
    try:
        deadline = time.monotonic() + 90
        while not pid_file.exists():  # written once the engine answers as this run's
            assert task.poll() is None, (tmp_path / "task.log").read_text()
            assert time.monotonic() < deadline, "the engine did not come up"
            time.sleep(0.2)
        engine_pid = int(pid_file.read_text())
        assert _alive(engine_pid)
        task.send_signal(signal.SIGKILL)  # no handler runs: only the kernel can stop the engine now
        task.wait(10)
        deadline = time.monotonic() + 20
        while _alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine_pid), "the engine outlived its task"
    finally:
        if task.poll() is None:
            task.kill()
        if engine_pid is not None and _alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
