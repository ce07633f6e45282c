"""`llmd launch SPEC`, `llmd status RUN`, `llmd cancel RUN`: the Slurm side of llmd (`llmd sweep` is sweeps.cli).

`llmd launch SPEC` makes a run folder under the spec's output.dir (spec.yaml, run.json, logs/, discovery.json,
metrics.h5), submits one heterogeneous job through submitit (launchers.executor) and follows it until it ends.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from llmd.errors import UserError

GPU_MODES = ("auto", "yes", "no")
STARTERS = ("auto", "fabric", "basic")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a spec on Slurm as one heterogeneous job and follow it")
    p.add_argument("spec", help="deployment spec YAML")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the batch script submitit would submit; no job")
    what.add_argument(
        "--render-sbatch",
        action="store_true",
        help="make the run folder and print a plain sbatch script (no submitit) to submit by hand",
    )
    p.add_argument("--no-follow", action="store_true", help="return once submitted")
    p.add_argument("--requeue", action="store_true", help="let Slurm requeue on preemption or node failure")
    p.add_argument(
        "--gpus",
        choices=GPU_MODES,
        default="auto",
        help="ask for --gpus-per-node: yes, no (CPU clusters, the local test cluster), or auto: yes when the "
        "partition has GPU GRES (sinfo), and yes in a dry run without Slurm",
    )
    p.add_argument(
        "--starter",
        choices=STARTERS,
        default="auto",
        help="engine tasks: fabric (python -m llmd.fabric under srun --mpi=pmi2, NIXL preflight), basic "
        "(launchers.engine_task, sim engines, no MPI), auto: fabric when installed",
    )
    p.set_defaults(func=cmd_launch)

    s = sub.add_parser("status", help="show where a run stands (state, cause, nodes, logs, result)")
    s.add_argument("run", help="run folder or Slurm job id")
    s.add_argument("--json", action="store_true", help="print run.json merged with Slurm's view, as JSON")
    s.set_defaults(func=cmd_status)

    c = sub.add_parser("cancel", help="cancel a run's Slurm job")
    c.add_argument("run", help="run folder or Slurm job id")
    c.set_defaults(func=cmd_cancel)


def _starter(choice: str) -> str:
    if choice == "auto":
        return "fabric" if importlib.util.find_spec("llmd.fabric") is not None else "basic"
    if choice == "fabric" and importlib.util.find_spec("llmd.fabric") is None:
        raise UserError("--starter fabric: llmd.fabric is not installed here; use --starter basic")
    return choice


def _gpus(mode: str, partition: str | None, dry_run: bool) -> bool:
    from launchers.cluster import has_gpu_gres

    if mode != "auto":
        return mode == "yes"
    if dry_run and not _have("sinfo"):
        return True
    try:
        found = has_gpu_gres(partition)
    except UserError as exc:
        if not dry_run:
            raise
        # A dry run only shows what would be submitted: a controller that cannot be asked is no reason to fail it.
        print(f"llmd: {exc}; the dry run assumes GPU GRES (--gpus yes/no decides)", file=sys.stderr)
        return True
    if not found:
        print(
            "llmd launch: the cluster has no GPU GRES: leaving out --gpus-per-node (--gpus yes forces it)",
            file=sys.stderr,
        )
    return found


def _have(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


def cmd_launch(args: argparse.Namespace) -> int:
    from launchers.cluster import job_state, require
    from launchers.follow import describe, follow, remember
    from launchers.plan import plan_job
    from launchers.prepare import absolute_spec, check_launchable, create_run_dir, new_run_dir
    from launchers.runstate import update_state
    from launchers.script import render_plain, render_submitit
    from llmd.spec import load_spec

    if not args.dry_run and not args.render_sbatch:
        require("sbatch")  # before anything is written
    spec = absolute_spec(load_spec(args.spec), Path.cwd())
    if args.requeue:
        spec = spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"requeue": True})})
    check_launchable(spec)
    run_dir = new_run_dir(spec).resolve()
    gpus = _gpus(args.gpus, spec.slurm.partition, args.dry_run or args.render_sbatch)
    plan = plan_job(spec, run_dir, Path.cwd(), gpus=gpus, starter=_starter(args.starter))
    if args.dry_run:
        print(render_submitit(plan), end="")
        return 0
    create_run_dir(run_dir, spec)
    base = {
        "run_dir": str(run_dir),
        "name": spec.name,
        "spec": str(plan.spec_path),
        "created_at": time.time(),
        "run_id": plan.run_id,  # what every component of the run answers /health with (llmd.runid)
    }
    if args.render_sbatch:
        script = render_plain(plan)
        (run_dir / "job.sbatch").write_text(script)
        update_state(run_dir, **base, state="RENDERED", phase=f"submit with: sbatch {run_dir / 'job.sbatch'}")
        print(script, end="")
        return 0
    update_state(run_dir, **base, state="SUBMITTED", phase="submitting")
    (run_dir / "job.sbatch").write_text(render_submitit(plan))
    try:
        from launchers.executor import HetSlurmExecutor
        from launchers.main_job import MainJob

        job_id = HetSlurmExecutor(plan).submit_main(MainJob(plan.spec_path, run_dir))
    except Exception as exc:  # sbatch's own words are the useful part
        update_state(run_dir, state="FAILED", cause=f"sbatch refused the job: {exc}")
        raise UserError(f"sbatch refused the job: {str(exc).strip()}\n(script: {run_dir / 'job.sbatch'})") from None
    remember(job_id, run_dir)
    update_state(
        run_dir, job_id=job_id, phase="submitted", logs={"batch": str(run_dir / "logs" / f"batch-{job_id}.out")}
    )
    print(f"llmd launch: submitted job {job_id} ({len(plan.components)} components); run folder {run_dir}")
    print(f"  logs: {run_dir / 'logs'}/ (batch-{job_id}.out, main.log, router.log, bench-N.log, <role>-<node>.log)")
    print(f"  status: llmd status {run_dir}    cancel: llmd cancel {run_dir}")
    if args.no_follow:
        return 0
    try:
        final = follow(run_dir, job_state, limit_s=_limit_s(spec.slurm.time) + 600)
    except KeyboardInterrupt:
        print(f"llmd launch: stopped following; the job goes on (llmd status {run_dir}, llmd cancel {run_dir})")
        return 130
    print(describe(final))
    return 0 if final.get("state") == "COMPLETED" else 1


def _limit_s(time_limit: str) -> float:
    if time_limit.lower() in ("infinite", "unlimited"):
        return 7 * 86400.0
    days, _, rest = time_limit.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        h, m, s = parts
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60.0
    if len(parts) == 2:
        return parts[0] * 60.0 + parts[1]
    return parts[0] * 3600.0 + parts[1] * 60 + parts[2]


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from launchers.cluster import job_state
    from launchers.follow import current, describe, find_run

    run_dir = find_run(args.run)
    state = current(run_dir, job_state if _have("squeue") else None)
    print(json.dumps(state, indent=2, sort_keys=True) if args.json else describe(state))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from launchers.cluster import cancel
    from launchers.follow import find_run
    from launchers.runstate import is_final, read_state, update_state

    run_dir = find_run(args.run)
    state = read_state(run_dir)
    job_id = state.get("job_id")
    if not job_id:
        raise UserError(f"{run_dir} has no job id: it was never submitted (or was rendered for sbatch by hand)")
    if is_final(state.get("state", "")):
        print(f"llmd cancel: job {job_id} already ended ({state['state']}); nothing to cancel")
        return 0
    cancel(str(job_id))
    cause = f"cancelled by `llmd cancel` (uid {os.getuid()})"
    update_state(run_dir, state="CANCELLED", phase="cancelled", cause=cause)
    print(f"llmd cancel: cancelled job {job_id} ({run_dir})")
    return 0
