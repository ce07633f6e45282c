"""Slurm's command-line tools, at the edge: is Slurm here, does it have GPUs, what state is a job in, cancel it.

submitit's sacct parser does not know het-job ids (`45+1`), so job state is read here from squeue (live jobs) and
sacct (finished ones).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from llmd.errors import UserError

NO_SLURM = (
    "{cmd} is not on PATH: run this on a Slurm login node, or start the local test cluster with "
    "`slurm/local-cluster.sh start` (root, Debian)"
)


def require(cmd: str) -> str:
    path = shutil.which(cmd)
    if path is None:
        raise UserError(NO_SLURM.format(cmd=cmd))
    return path


def _run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    require(args[0])
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"`{' '.join(args)}` did not answer within {timeout:.0f} s: is slurmctld up?") from None


def has_gpu_gres(partition: str | None) -> bool:
    """Whether any node (of the partition) offers GPU GRES; False on clusters without GRES like the test one."""
    args = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    out = _run(args)
    if out.returncode != 0:
        raise UserError(f"sinfo failed: {out.stderr.strip() or out.stdout.strip()}")
    return any(line.startswith("gpu") or ",gpu" in line for line in out.stdout.split())


@dataclass(frozen=True)
class JobState:
    """Slurm's view of one job (all het components together)."""

    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ... or UNKNOWN
    reason: str = ""
    exit_code: str = ""
    components: tuple[tuple[str, str], ...] = ()  # (JobID, State) per het component


def job_state(job_id: str) -> JobState:
    live = _run(["squeue", "-h", "-j", job_id, "-o", "%i|%T|%r"])
    rows = [ln.split("|") for ln in live.stdout.splitlines() if ln.count("|") == 2] if live.returncode == 0 else []
    if rows:
        states = {r[1] for r in rows}
        state = "RUNNING" if "RUNNING" in states else sorted(states)[0]
        reason = next((r[2] for r in rows if r[2] not in ("None", "")), "")
        return JobState(state, reason, "", tuple((r[0], r[1]) for r in rows))
    acct = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Reason"])
    rows = [ln.split("|") for ln in acct.stdout.splitlines() if ln.count("|") == 3] if acct.returncode == 0 else []
    if not rows:
        return JobState("UNKNOWN", "neither squeue nor sacct knows the job")
    comps = tuple((r[0], r[1].split()[0]) for r in rows)
    # The leader (component 0, the main job) decides; a component that failed before it explains why.
    leader = rows[0]
    worst = next((r for r in rows if r[1].split()[0] not in ("COMPLETED", leader[1].split()[0])), None)
    reason = leader[3] if leader[3] not in ("None", "") else ""
    if worst is not None:
        reason = (reason + "; " if reason else "") + f"component {worst[0]} {worst[1]} (exit {worst[2]})"
    return JobState(leader[1].split()[0], reason, leader[2], comps)


def cancel(job_id: str) -> None:
    out = _run(["scancel", job_id])
    if out.returncode != 0:
        raise UserError(f"scancel {job_id} failed: {out.stderr.strip() or out.stdout.strip()}")
