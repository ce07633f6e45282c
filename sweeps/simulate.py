"""`llmd sweep SWEEP --simulate`: every point through the cluster simulator on this machine, in parallel on its cores,
instead of Slurm job arrays: <output.dir>/<sweep>/<index>/ as a Slurm sweep leaves it (metrics.h5 with the point's
parameters, run.json), plus summary.json per point and sweep.json, one row of parameters and figures per point.
Resumable as a Slurm sweep is: done points are skipped, failed ones rerun with --retry-failed.

Any engine kind simulates (vLLM points too: the simulator models the GPUs either way), so a sweep over the real
deployment's spec can be explored before it spends an allocation.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launchers.runstate import update_state
from llmd.spec import dump_spec
from sweeps.grid import Sweep, load_sweep
from sweeps.point import point_meta, prepare, record, set_aside
from sweeps.state import check_unchanged, point_dir, sweep_status, write_rows
from sweeps.status import render_table


def simulate_variant(spec_yaml: str, out_dir: str, run_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One point, in a worker process: its run's figures (SimStats) as a dict; with `meta` (a sweep point's), its
    run.json follows it and its parameters go into metrics.h5."""
    from llmd.sim.run import Simulation
    from llmd.spec import parse_spec_text

    folder = Path(out_dir)
    if meta is not None:
        update_state(folder, state="RUNNING", phase="simulating")
    try:
        spec = parse_spec_text(spec_yaml, f"{out_dir}/spec.yaml")
        stats = Simulation(spec, out_dir=folder, run_id=run_id).run()
    except Exception as exc:
        if meta is not None:
            cause = f"{type(exc).__name__}: {exc}"
            update_state(folder, state="FAILED", phase="failed", cause=cause, trace=traceback.format_exc())
        raise
    out = asdict(stats)
    out.update(requests_per_min=stats.requests_per_min, sim_speedup=stats.sim_speedup)
    (folder / "summary.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    if meta is not None:
        update_state(folder, state="COMPLETED", phase="done", result=str(folder / "metrics.h5"))
        record(folder, meta)
    return out


def _figures(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def run_simulated_sweep(path: Path, *, workers: int | None = None, retry_failed: bool = False) -> int:
    sweep: Sweep = load_sweep(path)
    root = Path(sweep.variants[0].spec.output.dir) / sweep.name
    texts = {v.index: dump_spec(v.spec) for v in sweep.variants}
    rows = [{"index": v.index, **v.overrides} for v in sweep.variants]
    check_unchanged(root, sweep.name, rows, texts)
    points = sweep_status(root, rows, slurm=False)
    # No Slurm here: a point still marked running was cut short by an earlier `--simulate` that was stopped.
    todo = [p.index for p in points if p.state != "done" and (p.state != "failed" or retry_failed)]
    skipped_failed = [p.index for p in points if p.state == "failed" and not retry_failed]
    n = workers or max(1, min(len(todo) or 1, os.cpu_count() or 1))
    head = f"llmd sweep {sweep.name} --simulate: {len(sweep.variants)} points, {len(todo)} to run on {n} cores"
    print(f"{head} -> {root}/")
    done_before = sum(p.state == "done" for p in points)
    if done_before:
        print(f"  {done_before} done (skipped)")
    if skipped_failed:
        print(f"  {len(skipped_failed)} failed ({', '.join(map(str, skipped_failed))}; rerun with --retry-failed)")
    root.mkdir(parents=True, exist_ok=True)
    write_rows(root, rows)
    by_index = {v.index: v for v in sweep.variants}
    failed = 0
    with ProcessPoolExecutor(max_workers=n) as pool:
        jobs = {}
        for i in todo:
            v = by_index[i]
            set_aside(root, i)
            meta = point_meta(sweep.name, i, v.overrides, v.seed)
            out = prepare(root, i, texts[i], meta, state="SUBMITTED", phase="queued here")
            jobs[pool.submit(simulate_variant, texts[i], str(out), f"{sweep.name}-{i}", meta)] = v
        for fut in as_completed(jobs):
            v = jobs[fut]
            try:
                r = fut.result()
            except Exception as exc:  # one point's failure is reported with its overrides, the rest go on
                failed += 1
                print(f"  {v.index:3d}  {v.label()}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            print(
                f"  {v.index:3d}  {v.label()}: {r['requests_per_min']:,.0f} req/min, hit {r['hit_share']:.1%}, "
                f"TTFT p90 {r['ttft_p90_s'] * 1000:,.0f} ms, preemptions {r['preemptions']}"
            )
    write_rows(root, [{**row, **_figures(point_dir(root, row["index"]))} for row in rows])
    final = sweep_status(root, rows, slurm=False)
    print(render_table(final))
    print(f"results: {root}/<index>/metrics.h5, one row per point in {root / 'sweep.json'}")
    return 1 if failed or any(p.state != "done" for p in final) else 0
