"""A sweep on the local Slurm cluster: a 2x2 grid of simulated deployments (1 prefill + 1 decode node each, plus the
router's node), one array task per point on one homogeneous allocation. One point is made to fail at runtime (its
model folder is gone), the rest complete; `--retry-failed` reruns that point alone, and a resumed sweep
submits nothing. One point at a time (`throttle: 1`), so which point runs last is known.

The failure: once point 2 is done, the model folder the points share is moved away, so point 3's engines cannot start
(a taken port no longer fails a point: components bind a free one and publish it); it is moved back for the retry."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import llmd, llmd_start, wait_for, write_spec

from llmd.metrics import read_meta

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.usefixtures("slurm_cluster")]


def _sacct(job: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State,NodeList"], capture_output=True, text=True, timeout=30
    )
    return {ln.split("|")[0]: ln for ln in out.stdout.splitlines() if "|" in ln}


def _run(root: Path, i: int) -> dict:
    return json.loads((root / str(i) / "run.json").read_text())


def test_sweep_fails_one_point_retries_it_and_resumes(tmp_path: Path, tiny_tokenizer: Path, jobs: list[str]) -> None:
    model = tmp_path / "model"  # this test's own copy: it is moved away while point 3 runs
    shutil.copytree(tiny_tokenizer, model)
    base = write_spec(tmp_path, model, "base", workload={"duration_s": 3})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"name: grid\nbase: {base.name}\nthrottle: 1\n"
        "grid:\n  router.policy: [precise, round-robin]\n  workload.concurrency: [2, 4]\n"
    )
    root = tmp_path / "results" / "grid"
    args = ("sweep", str(sweep), "--gpus", "no", "--starter", "basic")

    res = llmd(*args, "--no-follow", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (array,) = [json.loads(ln)["job_id"] for ln in (root / "arrays.jsonl").read_text().splitlines()]
    jobs.append(array)
    assert "#SBATCH --array=0-3%1" in (root / "scripts" / "array-0.sbatch").read_text()
    # Resume at once (every point checked, nothing to submit) and follow the array to its end, while point 3, the
    # last, loses its model folder as soon as point 2 is done.
    proc = llmd_start(*args, cwd=tmp_path)
    away = tmp_path / "model-away"
    try:
        wait_for(lambda: (root / "2" / "run.json").exists() and _run(root, 2).get("recorded_at"), 240, "points 0-2")
        model.rename(away)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        if away.exists():
            away.rename(model)
    follow = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert follow.returncode == 1, follow.stdout + follow.stderr
    assert "nothing to submit" in follow.stdout and "point 3 failed" in follow.stdout, follow.stdout

    status = llmd("sweep", "status", str(root), cwd=tmp_path)
    print(status.stdout)
    assert status.returncode == 0
    lines = {ln.split()[0]: ln for ln in status.stdout.splitlines()[2:] if ln[:1].isdigit()}
    assert all(" done " in lines[i] for i in "012") and " failed " in lines["3"], status.stdout
    assert f"{array}_3" in lines["3"], lines["3"]
    assert "4 points: 0 pending, 0 running, 3 done, 1 failed" in status.stdout

    # Every point spanned its own nodes (router, prefill and decode on three different ones), and its metrics.h5
    # says which point it is.
    rows = json.loads((root / "sweep.json").read_text())
    for i in range(3):
        nodes = _run(root, i)["nodes"]
        assert len({n for ns in nodes.values() for n in ns}) == 3 and set(nodes) == {"main", "prefill", "decode"}
        meta = read_meta(root / str(i) / "metrics.h5")
        assert meta["sweep"] == "grid" and meta["sweep_index"] == i
        assert json.loads(meta["sweep_params"]) == {k: v for k, v in rows[i].items() if k != "index"}
    before = {i: ((root / str(i) / "metrics.h5").stat().st_mtime, _run(root, i)["job_id"]) for i in range(3)}

    retry = llmd(*args, "--retry-failed", cwd=tmp_path, timeout=240)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    arrays = [json.loads(ln) for ln in (root / "arrays.jsonl").read_text().splitlines()]
    assert len(arrays) == 2 and arrays[1]["indices"] == [3]
    jobs.append(arrays[1]["job_id"])
    assert _run(root, 3)["array_task"] == f"{arrays[1]['job_id']}_3" and _run(root, 3)["state"] == "COMPLETED"
    assert (root / "retried" / "3-1" / "run.json").exists()  # the failed attempt, kept
    assert {i: ((root / str(i) / "metrics.h5").stat().st_mtime, _run(root, i)["job_id"]) for i in range(3)} == before

    again = llmd(*args, cwd=tmp_path)
    assert again.returncode == 0 and "nothing to submit" in again.stdout and "4 done (skipped)" in again.stdout
    assert len((root / "arrays.jsonl").read_text().splitlines()) == 2
    final = llmd("sweep", "status", str(sweep), cwd=tmp_path)
    print(final.stdout)
    assert "0 pending, 0 running, 4 done, 0 failed" in final.stdout
    assert set(_sacct(arrays[1]["job_id"])) == {f"{arrays[1]['job_id']}_3"}
