"""submitit's SlurmExecutor, extended to submit one heterogeneous job: submitit pickles the main job's callable,
submits, parses the job id and handles checkpoint/requeue; the batch script is the het-job template, whose component
0 runs submitit's own `python -m submitit.core._submit FOLDER` (submitit 1.5.4 knows nothing of `#SBATCH hetjob`)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import SlurmExecutor

from launchers.plan import JobPlan
from launchers.script import render_submitit


class HetSlurmExecutor(SlurmExecutor):
    """Submits `plan` as one het job; the submitted callable runs in component 0."""

    def __init__(self, plan: JobPlan, max_num_timeout: int = 3) -> None:
        self.plan = plan
        python = shlex.quote(plan.python)
        super().__init__(folder=plan.run_dir / "submitit", max_num_timeout=max_num_timeout, python=python)

    @classmethod
    def affinity(cls) -> int:
        # submitit refuses to build an executor without srun on PATH; a dry run must work anywhere, and submitting
        # checks for sbatch itself (launchers.cluster) with a message that says what to do.
        return 2

    def _num_tasks(self) -> int:
        return 1  # submitit's callable runs once, in component 0

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_submitit(self.plan, shlex.split(command))

    def submit_main(self, fn: Any) -> str:
        """Submit the callable; return the Slurm job id."""
        job = self.submit(fn)
        return str(job.job_id)


def submitit_folder(run_dir: Path) -> Path:
    return run_dir / "submitit"
