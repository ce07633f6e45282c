"""`llmd sweep SWEEP --simulate`: every variant through the cluster simulator on this machine, in parallel on its
cores, instead of a Slurm job array: <output.dir>/<sweep>/<index>/metrics.h5 as a launched sweep writes them, plus
summary.json per variant and one table of them all.

Any engine kind simulates (vLLM variants too: the simulator models the GPUs either way), so a sweep over the real
deployment's spec can be explored before it spends an allocation.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmd.errors import UserError
from llmd.spec import dump_spec
from sweeps.grid import Sweep, load_sweep


def simulate_variant(spec_yaml: str, out_dir: str, run_id: str) -> dict[str, Any]:
    """One variant, in a worker process: its run's figures (SimStats) as a dict."""
    from llmd.sim.run import Simulation
    from llmd.spec import parse_spec_text

    spec = parse_spec_text(spec_yaml, f"{out_dir}/spec.yaml")
    stats = Simulation(spec, out_dir=Path(out_dir), run_id=run_id).run()
    out = asdict(stats)
    out.update(requests_per_min=stats.requests_per_min, sim_speedup=stats.sim_speedup)
    (Path(out_dir) / "summary.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def run_simulated_sweep(path: Path, *, workers: int | None = None) -> int:
    sweep: Sweep = load_sweep(path)
    root = Path(sweep.variants[0].spec.output.dir) / sweep.name
    if root.exists() and any(root.glob("*/metrics.h5")):
        raise UserError(f"{root} already holds results; results are never overwritten: rename the sweep")
    n = workers or max(1, min(len(sweep.variants), os.cpu_count() or 1))
    print(f"llmd sweep {sweep.name} --simulate: {len(sweep.variants)} variants on {n} cores -> {root}/<index>/")
    jobs = {}
    failed = 0
    with ProcessPoolExecutor(max_workers=n) as pool:
        for v in sweep.variants:
            out = root / str(v.index)
            out.mkdir(parents=True, exist_ok=True)
            text = dump_spec(v.spec)
            (out / "spec.yaml").write_text(text)
            jobs[pool.submit(simulate_variant, text, str(out), f"{sweep.name}-{v.index}")] = v
        results: dict[int, dict[str, Any]] = {}
        for fut in as_completed(jobs):
            v = jobs[fut]
            try:
                results[v.index] = r = fut.result()
            except Exception as exc:  # one variant's failure is reported with its overrides, the rest go on
                failed += 1
                print(f"  {v.index:3d}  {v.label()}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            print(
                f"  {v.index:3d}  {v.label()}: {r['requests_per_min']:,.0f} req/min, hit {r['hit_share']:.1%}, "
                f"TTFT p90 {r['ttft_p90_s'] * 1000:,.0f} ms, preemptions {r['preemptions']}"
            )
    by_index = {v.index: v for v in sweep.variants}
    table = [{"index": i, **by_index[i].overrides, **results[i]} for i in sorted(results)]
    (root / "sweep.json").write_text(json.dumps(table, indent=1, default=str) + "\n")
    print(f"results: {root}/<index>/metrics.h5, one row per variant in {root / 'sweep.json'}")
    return 1 if failed else 0
