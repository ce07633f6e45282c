"""A sweep on Slurm: every point a whole deployment, run as one task of a job array of homogeneous allocations.

Slurm has no arrays of het jobs, so each array task asks for the point's nodes as one allocation (1 for the router and
benchmark client, then prefill.nodes + decode.nodes) and runs `python -m sweeps.task`, which splits them into the het
job's groups and runs the main job `llmd launch` runs (launchers.main_job.run_allocation). Points whose allocations
differ (a P:D sweep over total size, a slurm.* axis) go to one array each; the array task id is the point's index, so
`squeue` and `sacct` name points as the sweep folder does. See sweeps/README.md for why this design.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launchers.plan import SOURCE, Component, plan_job, pythonpath_line
from launchers.prepare import absolute_spec, check_launchable
from launchers.runstate import update_state
from llmd.engines.kinds import engine_kind
from llmd.errors import UserError
from llmd.spec import DeploymentSpec, dump_spec
from sweeps.grid import Sweep, Variant, load_sweep
from sweeps.point import point_meta, prepare, set_aside
from sweeps.state import ARRAYS_FILE, PointStatus, check_unchanged, point_dir, sweep_status, write_rows

POLL_S = 3.0


@dataclass(frozen=True)
class ArrayPlan:
    """One job array: the points that share an allocation shape, and that shape's #SBATCH lines."""

    nodes: int
    header: tuple[str, ...]
    indices: tuple[int, ...]


def allocation_size(spec: DeploymentSpec) -> int:
    """Nodes one point takes: the main job's node, as component 0 of a het job has, plus every engine pool's."""
    return 1 + sum(pool.nodes for pool in spec.pools.values())


def _header(spec: DeploymentSpec, gpus: bool) -> tuple[str, ...]:
    # The het job's own option lines (launchers.plan), for one component the size of the whole allocation. Every node
    # of a homogeneous allocation gets the same GPUs, so the main job's node gets them too: the price of the design.
    gpus_per_node = max(pool.gpus_per_node for pool in spec.pools.values()) if gpus else 0
    plan = plan_job(spec, Path("/"), Path("/"), gpus=gpus)
    return tuple(
        plan.header_lines(Component(0, "sweep", allocation_size(spec), spec.slurm.cpus_per_task, gpus_per_node))
    )


def group_points(points: list[tuple[int, DeploymentSpec]], gpus: bool) -> list[ArrayPlan]:
    """One array per allocation shape, in order of first appearance; indices ascending within each."""
    groups: dict[tuple[str, ...], list[int]] = {}
    sizes: dict[tuple[str, ...], int] = {}
    for index, spec in points:
        key = _header(spec, gpus)
        groups.setdefault(key, []).append(index)
        sizes[key] = allocation_size(spec)
    return [ArrayPlan(sizes[k], k, tuple(v)) for k, v in groups.items()]


def array_range(indices: tuple[int, ...] | list[int], throttle: int | None) -> str:
    """sbatch --array's value: runs folded (0-3,5,7-9), then %throttle."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts) + (f"%{throttle}" if throttle else "")


def render(
    array: ArrayPlan,
    sweep: str,
    root: Path,
    workdir: Path,
    *,
    throttle: int | None,
    starter: str,
    python: str = sys.executable,
    source: Path = SOURCE,
) -> str:
    """The array's batch script. Values are ints, choices or paths, and every path is shell-quoted."""
    q = shlex.quote
    log = root / "%a" / "logs" / "main.log"  # %a: the array task id, which is the point's index
    lines = [
        "#!/bin/bash",
        f"# llmd sweep {sweep}: points {array_range(array.indices, None)}, one array task each, on {array.nodes} "
        "node(s): the first runs the router and benchmark client, the rest the engines (prefill, then decode).",
        "# Written by `llmd sweep`; `llmd sweep status` follows it.",
        f"#SBATCH --job-name={q('llmd-sweep-' + sweep)}",
        f"#SBATCH --chdir={q(str(workdir))}",
        f"#SBATCH --output={q(str(log))}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --array={array_range(array.indices, throttle)}",
        *array.header,
        "",
        pythonpath_line(source),
        f"exec {q(python)} -u -m sweeps.task {q(str(root))} --starter {q(starter)}",
        "",
    ]
    return "\n".join(lines)


def _specs(sweep: Sweep, check: bool) -> dict[int, DeploymentSpec]:
    specs = {}
    for v in sweep.variants:
        spec = absolute_spec(v.spec, Path.cwd())
        if check:  # a dry run shows the scripts before the model folder exists
            check_launchable(spec)
        specs[v.index] = spec
    dirs = {s.output.dir for s in specs.values()}
    if len(dirs) > 1:
        raise UserError(f"output.dir must be the same for every point of a sweep; the points have {sorted(dirs)}")
    return specs


def _to_run(points: list[PointStatus], retry_failed: bool) -> tuple[list[int], list[str]]:
    """Indices to submit now, and what is said about the rest."""
    run = [p.index for p in points if p.state == "pending" and p.reason == "not submitted"]
    failed = [p.index for p in points if p.state == "failed"]
    notes = []
    done = sum(p.state == "done" for p in points)
    active = sum(p.state in ("running", "pending") and p.reason != "not submitted" for p in points)
    if done:
        notes.append(f"{done} done (skipped)")
    if active:
        notes.append(f"{active} queued or running (left alone)")
    if failed and retry_failed:
        notes.append(f"{len(failed)} failed (rerun: {', '.join(map(str, failed))})")
        run += failed
    elif failed:
        notes.append(f"{len(failed)} failed ({', '.join(map(str, failed))}; rerun them with --retry-failed)")
    return sorted(run), notes


def _submit(script: Path) -> str:
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UserError("sbatch did not answer within 60 s: is slurmctld up?") from None
    if out.returncode != 0:
        raise UserError(f"sbatch refused the array: {out.stderr.strip() or out.stdout.strip()} (script: {script})")
    return out.stdout.strip().split(";")[0]


def run_sweep(
    path: Path,
    *,
    dry_run: bool,
    follow: bool,
    retry_failed: bool = False,
    throttle: int | None = None,
    gpus: str = "auto",
    starter: str = "auto",
) -> int:
    from launchers.cli import _gpus, _starter
    from launchers.cluster import require

    sweep = load_sweep(path)
    throttle = throttle or sweep.throttle
    specs = _specs(sweep, check=not dry_run)
    texts = {i: dump_spec(s) for i, s in specs.items()}
    root = Path(specs[0].output.dir) / sweep.name
    chosen = _starter(starter)
    for i, s in specs.items():
        if engine_kind(s.engine.kind).needs_fabric and chosen != "fabric":
            raise UserError(f"point {i}: engine.kind {s.engine.kind} is started by llmd.fabric; use --starter fabric")
    if not dry_run:
        require("sbatch")
    rows = [{"index": v.index, **v.overrides} for v in sweep.variants]
    check_unchanged(root, sweep.name, rows, texts)
    points = sweep_status(root, rows, slurm=not dry_run)
    indices, notes = _to_run(points, retry_failed)
    print(f"llmd sweep {sweep.name}: {len(sweep.variants)} points -> {root}/<index>/metrics.h5")
    by_index = {v.index: v for v in sweep.variants}
    for v in sweep.variants:
        mark = "" if v.index in indices else f"  [{points[v.index].state}]"
        print(f"  {v.index:3d}  {v.label()}{mark}")
    for note in notes:
        print(f"  {note}")
    use_gpus = _gpus(gpus, specs[0].slurm.partition, dry_run)
    arrays = group_points([(i, specs[i]) for i in indices], use_gpus)
    scripts = [render(a, sweep.name, root, Path.cwd(), throttle=throttle, starter=chosen) for a in arrays]
    if dry_run:
        for a, text in zip(arrays, scripts, strict=True):
            print(f"\n# array of {len(a.indices)} point(s), {a.nodes} node(s) each:\n{text}", end="")
        return 0
    if not indices:
        print("llmd sweep: nothing to submit")
        return _finish(root, rows, follow=follow, indices=[])
    root.mkdir(parents=True, exist_ok=True)
    write_rows(root, rows)
    for a, text in zip(arrays, scripts, strict=True):
        _submit_array(root, sweep.name, a, text, by_index, texts)
    return _finish(root, rows, follow=follow, indices=indices)


def _submit_array(
    root: Path, name: str, array: ArrayPlan, text: str, by_index: dict[int, Variant], texts: dict[int, str]
) -> str:
    for i in array.indices:
        set_aside(root, i)  # a failed attempt's folder, kept under retried/
        v = by_index[i]
        prepare(root, i, texts[i], point_meta(name, i, v.overrides, v.seed), state="SUBMITTED", phase="submitting")
    scripts = root / "scripts"
    scripts.mkdir(exist_ok=True)
    script = scripts / f"array-{len(list(scripts.glob('array-*.sbatch')))}.sbatch"
    script.write_text(text)
    try:
        job_id = _submit(script)
    except UserError as exc:
        for i in array.indices:
            update_state(point_dir(root, i), state="FAILED", phase="not submitted", cause=str(exc))
        raise
    with open(root / ARRAYS_FILE, "a") as fh:
        line = {"job_id": job_id, "indices": list(array.indices), "nodes": array.nodes, "script": str(script)}
        fh.write(json.dumps({**line, "submitted_at": time.time()}) + "\n")
    for i in array.indices:
        update_state(point_dir(root, i), array_task=f"{job_id}_{i}", phase="queued")
    print(
        f"llmd sweep: submitted array {job_id}: points {array_range(array.indices, None)}, {array.nodes} node(s) "
        f"each; logs in {root}/<index>/logs/"
    )
    return job_id


def _finish(root: Path, rows: list[dict], *, follow: bool, indices: list[int]) -> int:
    """Follow the sweep's queued and running points (those just submitted, or an earlier call's), then print the
    table; 0 when every point is done."""
    from sweeps.status import follow_sweep, render_table

    print(f"  status: llmd sweep status {root}")
    points = sweep_status(root, rows)
    active = any(p.state == "running" or (p.state == "pending" and p.reason != "not submitted") for p in points)
    if follow and (indices or active):
        try:
            points = follow_sweep(root, rows, POLL_S)
        except KeyboardInterrupt:
            print(f"llmd sweep: stopped following; the arrays go on (llmd sweep status {root})")
            return 130
    if follow or not indices:
        print(render_table(points))
    return 1 if any(p.state == "failed" for p in points) else 0
