"""Sweeps without Slurm: grid, zip and seeds expansion over the axes researchers ask for, arrays grouped by allocation
shape and their quoted scripts, each point's state from its run.json and Slurm's view, the status table, resuming."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmd.errors import UserError
from sweeps.array import array_range, group_points, render
from sweeps.grid import expand
from sweeps.point import point_meta, prepare, record, set_aside
from sweeps.state import SlurmTask, check_unchanged, classify, sweep_status, write_rows
from sweeps.status import render_table

BASE = {"name": "x", "prefill": {"nodes": 1}, "decode": {"nodes": 1}, "workload": {"seed": 7}}


def test_grid_zip_and_seeds_expand_in_order() -> None:
    doc = {
        "name": "pd",
        "base": BASE,
        "grid": {"router.policy": ["precise", "round-robin"]},
        # P:D node ratio at a fixed total: one replica per node
        "zip": {"prefill.nodes": [1, 3], "prefill.replicas": [1, 3], "decode.nodes": [3, 1], "decode.replicas": [3, 1]},
        "seeds": 2,
        "throttle": 3,
    }
    sweep = expand(doc, Path("s.yaml"))
    assert len(sweep.variants) == 8 and sweep.throttle == 3
    assert sweep.keys == [
        "router.policy", "prefill.nodes", "prefill.replicas", "decode.nodes", "decode.replicas", "workload.seed"
    ]  # fmt: skip
    # seeds vary fastest, then the zip's rows, then the grid; the same seeds at every other point
    assert [v.overrides["workload.seed"] for v in sweep.variants] == [7, 8] * 4
    v = sweep.variants[3]
    assert v.label() == "router.policy=precise, prefill.nodes=3, prefill.replicas=3, decode.nodes=1, " + (
        "decode.replicas=1, workload.seed=8"
    )
    assert (v.spec.prefill.nodes, v.spec.decode.nodes, v.seed) == (3, 1, 8)
    assert sweep.variants[5].spec.name == "pd-5"


def test_the_axes_researchers_ask_for_are_plain_dotted_keys() -> None:
    grid = {
        "router.policy": ["precise", "approximate"],
        "router.weights.queue": [0.5, 2.0],
        "workload.concurrency": [4, 64],
        "kv.cpu_bytes": [0, "64GiB"],
        "mtp.draft_tokens": [0, 3],
        "model.block_size": [16, 64],
        "workload.profile": ["smoke", "automationbench"],
    }
    pd = {"prefill.nodes": [1, 2], "prefill.replicas": [1, 2], "decode.nodes": [3, 2], "decode.replicas": [3, 2]}
    doc = {"name": "axes", "base": BASE, "grid": grid, "zip": pd}
    sweep = expand(doc, Path("s.yaml"))
    assert len(sweep.variants) == 2**8
    last = sweep.variants[-1].spec
    assert (last.router.policy, last.workload.concurrency, last.kv.cpu_bytes) == ("approximate", 64, 64 * 2**30)
    assert (last.mtp.draft_tokens, last.model.block_size, last.workload.profile) == (3, 64, "automationbench")
    # One weight overridden, the others kept at their defaults.
    assert last.router.weights == {"prefix": 2.0, "kv-util": 1.0, "queue": 2.0, "no-hit-lru": 1.0}


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        ({"zip": {"prefill.nodes": [1, 2], "prefill.replicas": [1]}}, "one length"),
        ({"zip": {"router.policy": ["precise"]}}, "both grid and zip"),
        ({"seeds": 0}, "seeds must be"),
        ({"seeds": 2, "grid": {"workload.seed": [1, 2]}}, "seeds: sets workload.seed"),
        ({"throttle": 0}, "throttle must be"),
        ({"grid": None}, "needs grid:, zip: or seeds:"),
        ({"zip": {"router.weights.bogus": [1]}}, r"point 0 \(.*router.weights.bogus=1\):\n  .*unknown scorer"),
    ],
)
def test_sweep_mistakes_name_the_block_and_key(change: dict, msg: str) -> None:
    doc = {"name": "bad", "base": BASE, "grid": {"router.policy": ["precise"]}, **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(UserError, match=msg):
        expand(doc, Path("s.yaml"))


def test_points_group_into_one_array_per_allocation_shape_and_scripts_quote_paths(tmp_path: Path) -> None:
    doc = {"name": "pd", "base": BASE, "zip": {"prefill.nodes": [1, 2, 1], "prefill.replicas": [1, 2, 1]}}
    sweep = expand(doc, Path("s.yaml"))
    arrays = group_points([(v.index, v.spec) for v in sweep.variants], gpus=True)
    assert [(a.nodes, a.indices) for a in arrays] == [(3, (0, 2)), (4, (1,))]
    assert "#SBATCH --gpus-per-node=1" in arrays[0].header and "#SBATCH --nodes=4" in arrays[1].header
    root = tmp_path / "my results" / "pd"
    text = render(arrays[0], "pd", root, tmp_path, throttle=2, starter="basic", python="/opt/py thon/bin/python")
    assert "#SBATCH --array=0,2%2" in text
    assert f"#SBATCH --output='{root}/%a/logs/main.log'" in text
    assert f"exec '/opt/py thon/bin/python' -u -m sweeps.task '{root}' --starter basic" in text
    assert array_range([0, 1, 2, 3, 5, 7, 8], None) == "0-3,5,7-8" and array_range([4], 1) == "4%1"


def test_point_state_from_run_json_and_slurm() -> None:
    p = {"router.policy": "precise"}
    now = time.time()
    assert classify(0, p, None, False, None).reason == "not submitted"
    sub = {"state": "SUBMITTED", "array_task": "9_0", "created_at": now, "phase": "queued"}
    queued = classify(0, p, sub, False, SlurmTask("PENDING", "JobArrayTaskLimit"))
    assert (queued.state, queued.reason, queued.job) == ("pending", "queued: JobArrayTaskLimit", "9_0")
    assert classify(0, p, sub, False, SlurmTask("RUNNING")).reason == "starting"
    running = {**sub, "state": "RUNNING", "phase": "benchmark", "progress": {"requests": 12}}
    live = classify(0, p, running, False, SlurmTask("RUNNING"))
    assert (live.state, live.reason, live.requests) == ("running", "benchmark", 12)
    # killed from outside: run.json still says running, Slurm says how it ended
    assert classify(0, p, running, False, SlurmTask("CANCELLED", "by 0")).reason == "Slurm: CANCELLED (by 0)"
    failed = {**running, "state": "FAILED", "cause": "router exited with code 2"}
    assert classify(0, p, failed, True, SlurmTask("FAILED")).reason == "router exited with code 2"
    # done needs all three: COMPLETED, recorded (parameters stamped) and metrics.h5
    completed = {**running, "state": "COMPLETED", "result_summary": {"requests": 30, "errors": 1}}
    assert classify(0, p, completed, True, SlurmTask("COMPLETED")).state == "failed"
    done = classify(0, p, {**completed, "recorded_at": now}, True, SlurmTask("COMPLETED"))
    assert (done.state, done.requests, done.errors) == ("done", 30, 1)
    assert classify(0, p, {**completed, "recorded_at": now}, False, None).state != "done"
    # submitted long ago and unknown to Slurm: lost
    old = {**sub, "created_at": now - 3600}
    assert classify(0, p, old, False, None).reason == "Slurm has no record of 9_0"


def test_status_table_and_resume_rules(tmp_path: Path) -> None:
    root = tmp_path / "grid"
    rows = [{"index": i, "router.policy": pol, "workload.seed": 0} for i, pol in enumerate(("precise", "rr", "rr"))]
    root.mkdir()
    write_rows(root, rows)
    meta = point_meta("grid", 0, {"router.policy": "precise"}, 0)
    prepare(root, 0, "name: grid-0\n", meta, state="COMPLETED", array_task="5_0")
    assert record(root / "0", meta) == {}  # no metrics.h5: not done
    prepare(root, 1, "name: grid-1\n", meta, state="FAILED", cause="boom\nlog:\nlast words", array_task="5_1")
    points = sweep_status(root, slurm=False)
    assert [p.state for p in points] == ["failed", "failed", "pending"]
    table = render_table(points)
    assert table.splitlines()[0].split() == ["#", "router.policy", "workload.seed", "state", "job", "requests",
                                             "errors", "reason"]  # fmt: skip
    assert "boom ... last words" in table and table.endswith("3 points: 1 pending, 0 running, 0 done, 2 failed")
    # a failed attempt is set aside, never read as a point
    assert set_aside(root, 1) == root / "retried" / "1-1" and not (root / "1").exists()
    # resuming with other points (or another spec for a point that ran) is refused
    check_unchanged(root, "grid", rows, {0: "name: grid-0\n"})
    with pytest.raises(UserError, match="points 2 differ"):
        check_unchanged(root, "grid", [*rows[:2], {**rows[2], "router.policy": "precise"}], {})
    with pytest.raises(UserError, match="points 0 differ"):
        check_unchanged(root, "grid", rows, {0: "name: grid-0\nworkload: {}\n"})
    assert json.loads((root / "sweep.json").read_text()) == rows


def test_point_done_only_once_recorded_with_its_parameters_in_hdf5(tmp_path: Path) -> None:
    from llmd.metrics import MetricsWriter, read_meta

    root = tmp_path / "grid"
    root.mkdir()
    write_rows(root, [{"index": 0, "router.policy": "precise"}])
    meta = point_meta("grid", 0, {"router.policy": "precise"}, 3)
    folder = prepare(root, 0, "name: grid-0\n", meta, state="COMPLETED")
    with MetricsWriter(folder / "metrics.h5", "client", {"spec": "name: grid-0\n"}) as w:
        w.append_request({"request_id": "a", "status": 200})
        w.append_request({"request_id": "b", "status": 500})
    assert sweep_status(root, slurm=False)[0].state == "failed"  # completed, not recorded: the task died between
    assert record(folder, meta) == {"requests": 2, "errors": 1}
    (point,) = sweep_status(root, slurm=False)
    assert (point.state, point.requests, point.errors) == ("done", 2, 1)
    m = read_meta(folder / "metrics.h5")
    assert (m["sweep"], m["sweep_index"], m["sweep_seed"]) == ("grid", 0, 3)
    assert json.loads(m["sweep_params"]) == {"router.policy": "precise"} and m["producer"] == "client"


def test_allocation_splits_into_the_het_jobs_groups() -> None:
    from launchers.main_job import RunFailed, split_nodes

    doc = {"name": "s", "base": BASE, "zip": {"decode.nodes": [2], "decode.replicas": [2]}}
    spec = expand(doc, Path("s.yaml")).variants[0].spec
    groups = split_nodes(spec, ["n1", "n2", "n3", "n4", "n5"])
    assert groups == {"main": ["n1"], "prefill": ["n2"], "decode": ["n3", "n4"]}
    with pytest.raises(RunFailed, match=r"has 2 nodes .* needs 4"):
        split_nodes(spec, ["n1", "n2"])


def test_live_progress_display_runs_until_nothing_is_active() -> None:
    from sweeps.state import PointStatus
    from sweeps.status import _follow_live

    frames = iter(
        [
            [
                PointStatus(0, {"a.b": 1}, "running", "4_0", "benchmark", 3),
                PointStatus(1, {"a.b": 2}, "pending", "4_1"),
            ],
            [PointStatus(0, {"a.b": 1}, "done", "4_0", "", 9, 0), PointStatus(1, {"a.b": 2}, "failed", "4_1", "x\ny")],
        ]
    )
    last = _follow_live(lambda: next(frames), 0.01)
    assert [p.state for p in last] == ["done", "failed"]
