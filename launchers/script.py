"""The batch script text of a JobPlan, from slurm/templates: the same template for submitit and for users who submit
by hand (`llmd launch SPEC --render-sbatch`); only component 0's command differs."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from launchers.plan import JobPlan

TEMPLATES = Path(__file__).resolve().parent.parent / "slurm" / "templates"
HET_JOB_TEMPLATE = "het-job.sbatch.j2"


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # a shell script, not HTML
    )


def render_script(
    plan: JobPlan,
    main_command: list[str],
    *,
    origin: str,
    main_env: list[str] | None = None,
    extra_global: list[str] | None = None,
) -> str:
    return (
        _env()
        .get_template(HET_JOB_TEMPLATE)
        .render(
            plan=plan,
            origin=origin,
            main_env=main_env or [],
            extra_global=extra_global or [],
            main_command=shlex.join(plan.main_srun() + main_command),
        )
    )


# submitit's checkpoint signal (submitit.slurm.slurm.SlurmJobEnvironment.USR_SIG), named here so a dry run needs no
# submitit; a test checks the two agree.
SUBMITIT_SIGNAL = "USR2"


def submitit_command(plan: JobPlan) -> list[str]:
    """What submitit runs in component 0: its own loader of the pickled callable, from the run's submitit folder."""
    return [plan.python, "-u", "-m", "submitit.core._submit", str(plan.run_dir / "submitit")]


def render_submitit(plan: JobPlan, command: list[str] | None = None) -> str:
    """The script `llmd launch` submits through submitit (and prints with --dry-run)."""
    return render_script(
        plan,
        command or submitit_command(plan),
        origin="Written by `llmd launch` (submitit); `llmd status RUN` follows it.",
        main_env=["export SUBMITIT_EXECUTOR=slurm"],
        # submitit checkpoints and requeues on this signal (preemption, time limit): only when requeue is wanted,
        # or a run that hits its time limit would come back on its own.
        extra_global=[f"#SBATCH --signal={SUBMITIT_SIGNAL}@90"] if plan.spec.slurm.requeue else [],
    )


def render_plain(plan: JobPlan) -> str:
    """The script without submitit: component 0 runs `python -m launchers.main_job` itself."""
    return render_script(
        plan, plan.plain_main_command(), origin="Plain sbatch script (no submitit): submit it with `sbatch FILE`."
    )
