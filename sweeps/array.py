"""A sweep as one Slurm job array (submitit's map_array). Slurm has no arrays of het jobs, so each array task runs a
whole simulated deployment on its own allocation (`llmd demo --spec VARIANT`: sim engines, router and load in one
process) and leaves results/<sweep>/<index>/metrics.h5."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launchers.plan import pythonpath_line
from launchers.prepare import absolute_spec, check_launchable
from llmd.engines.kinds import engine_kind
from llmd.errors import UserError
from llmd.spec import dump_spec
from llmd.spec.values import constraint_expression, split_sbatch_option
from sweeps.grid import Sweep, load_sweep

POLL_S = 3.0


def run_variant(spec_path: str, out_dir: str) -> str:
    """One array task: the variant's deployment, in this allocation; returns its metrics.h5."""
    out = Path(out_dir)
    demo_out = out / "demo"
    cmd = [sys.executable, "-u", "-m", "llmd.cli", "demo", "--spec", spec_path, "--output", str(demo_out)]
    subprocess.run(cmd, check=True)
    found = sorted(demo_out.glob("*/metrics.h5"))
    if not found:
        raise RuntimeError(f"llmd demo left no metrics.h5 under {demo_out}")
    target = out / "metrics.h5"
    if not target.exists():
        os.link(found[-1], target)  # same bytes, one more name: the sweep's layout
    return str(target)


def _executor(sweep: Sweep, folder: Path) -> Any:
    from submitit.slurm.slurm import SlurmExecutor

    class _Executor(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 2  # a dry run works without Slurm; submitting checks for sbatch itself

    s = sweep.variants[0].spec.slurm
    extra = {"time": s.time}
    for key, value in (("account", s.account), ("qos", s.qos), ("mem", s.mem), ("partition", s.partition)):
        if value is not None:
            extra[key] = value
    if s.constraints:
        extra["constraint"] = constraint_expression(s.constraints)
    for opt in s.extra_sbatch:
        # submitit writes each as `#SBATCH --key=<shlex-quoted value>`, or a bare flag for True.
        key, value = split_sbatch_option(opt)
        extra[key] = True if value is None else value
    ex = _Executor(folder=folder)
    ex.update_parameters(
        job_name=f"llmd-sweep-{sweep.name}",
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=s.cpus_per_task,
        setup=[pythonpath_line()],  # the array tasks run this tree's code, as llmd launch's jobs do
        additional_parameters=extra,
    )
    return ex


def _prepare(sweep: Sweep, root: Path) -> tuple[list[str], list[str]]:
    specs, outs = [], []
    for v in sweep.variants:
        spec = absolute_spec(v.spec, Path.cwd())
        check_launchable(spec)
        if not engine_kind(spec.engine.kind).simulated:
            raise UserError(
                f"variant {v.index}: sweeps run simulated deployments (engine.kind sim); it says {spec.engine.kind}"
            )
        out = root / str(v.index)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.yaml").write_text(dump_spec(spec))
        specs.append(str(out / "spec.yaml"))
        outs.append(str(out))
    return specs, outs


def _array_states(array_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
    )
    rows = [ln.split("|") for ln in out.stdout.splitlines() if "|" in ln]
    return {r[0]: r[1].split()[0] for r in rows}


def run_sweep(path: Path, *, dry_run: bool, follow: bool) -> int:
    from launchers.cluster import require

    sweep = load_sweep(path)
    first = absolute_spec(sweep.variants[0].spec, Path.cwd())
    root = Path(first.output.dir) / sweep.name
    print(f"llmd sweep {sweep.name}: {len(sweep.variants)} variants -> {root}/<index>/metrics.h5")
    for v in sweep.variants:
        print(f"  {v.index:3d}  {v.label()}")
    if dry_run:
        from submitit.slurm.slurm import _make_sbatch_string

        ex = _executor(sweep, root / "submitit")
        cmd = ex._submitit_command_str
        print(_make_sbatch_string(command=cmd, folder=ex.folder, map_count=len(sweep.variants), **ex.parameters))
        return 0
    require("sbatch")
    if root.exists() and any(root.glob("*/metrics.h5")):
        raise UserError(f"{root} already holds results; results are never overwritten: rename the sweep")
    specs, outs = _prepare(sweep, root)
    ex = _executor(sweep, root / "submitit")
    jobs = ex.map_array(run_variant, specs, outs)
    array_id = str(jobs[0].job_id).split("_")[0]
    (root / "array_job_id").write_text(array_id + "\n")
    print(f"llmd sweep: submitted job array {array_id} ({len(jobs)} tasks); logs in {root / 'submitit'}")
    if not follow:
        return 0
    deadline = time.monotonic() + 7 * 86400
    last: dict[str, int] = {}
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    while time.monotonic() < deadline:
        states = _array_states(array_id)
        counts: dict[str, int] = {}
        for st in states.values():
            counts[st] = counts.get(st, 0) + 1
        if counts != last:
            last = counts
            print(f"[{time.strftime('%H:%M:%S')}] " + ", ".join(f"{n} {st}" for st, n in sorted(counts.items())))
        done = [k for k, st in states.items() if st in final and "[" not in k]
        if len(done) >= len(jobs):
            break
        time.sleep(POLL_S)
    missing = [o for o in outs if not (Path(o) / "metrics.h5").exists()]
    for o in missing:
        print(f"  no metrics.h5 in {o}", file=sys.stderr)
    return 1 if missing else 0
