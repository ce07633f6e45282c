"""A deployment spec as one heterogeneous Slurm job, pure: which components, what each asks for, what each runs.

Component 0 runs the router and the benchmark client (the main job), then one component per engine pool: prefill
(skipped when prefill.nodes is 0) and decode. The same JobPlan renders the submitit batch script and the plain sbatch
template, so both submit the very same job.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmd import runid
from llmd.errors import UserError
from llmd.spec import DeploymentSpec
from llmd.spec.values import constraint_expression, control_character, printable, split_sbatch_option

# Engine components start one task per node; whatever runs there (llmd.fabric or launchers.engine_task) decides from
# its node index which replica and rank it serves.
ENGINE_STARTERS = ("fabric", "basic")
# The tree holding launchers/, llmd/ and sweeps/ (a checkout, or site-packages once installed). A job runs the code
# that planned it: with only the python given, `-m launchers.main_job` would find whichever llmd that python has
# installed (another checkout's editable install, say), and the job would run code the launcher never saw.
SOURCE = Path(__file__).resolve().parent.parent


def pythonpath_line(source: Path = SOURCE) -> str:
    """The batch script line that puts `source` first on the job's PYTHONPATH (srun steps inherit it)."""
    return f"export PYTHONPATH={shlex.quote(str(source))}${{PYTHONPATH:+:$PYTHONPATH}}"


@dataclass(frozen=True)
class Component:
    """One het-job component: its sbatch resources and the role it plays."""

    index: int
    role: str  # "main", "prefill" or "decode"
    nodes: int
    cpus_per_task: int
    gpus_per_node: int  # 0: no --gpus-per-node line (CPU cluster or --gpus no)

    def sbatch_options(self, spec: DeploymentSpec) -> list[tuple[str, str | None]]:
        """(option, value) pairs as sbatch takes them; value None is a bare flag."""
        s = spec.slurm
        opts: list[tuple[str, str | None]] = [
            ("nodes", str(self.nodes)),
            ("ntasks-per-node", "1"),
            ("cpus-per-task", str(self.cpus_per_task)),
            ("time", s.time),
        ]
        if self.gpus_per_node:
            opts.append(("gpus-per-node", str(self.gpus_per_node)))
        for key, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos), ("mem", s.mem)):
            if value is not None:
                opts.append((key, value))
        if s.constraints:
            opts.append(("constraint", constraint_expression(s.constraints)))
        return opts


@dataclass(frozen=True)
class JobPlan:
    """Everything the batch script of one run says, independent of who writes it (submitit or the template)."""

    spec: DeploymentSpec
    run_dir: Path
    workdir: Path
    components: list[Component]
    starter: str = "basic"
    python: str = sys.executable
    source: Path = SOURCE
    extra: list[str] = field(default_factory=list)  # the spec's extra_sbatch, on every component
    # This run's id (llmd.runid), exported to every component: /health answers with it, clients check it.
    run_id: str = field(default_factory=runid.new_run_id)

    @property
    def engines(self) -> list[Component]:
        return [c for c in self.components if c.role != "main"]

    @property
    def spec_path(self) -> Path:
        return self.run_dir / "spec.yaml"

    def header_lines(self, component: Component) -> list[str]:
        lines = [_flag(k, v) for k, v in component.sbatch_options(self.spec)]
        lines += [_flag(*split_sbatch_option(opt)) for opt in self.extra]
        return lines

    def global_lines(self) -> list[str]:
        """Options that belong to the whole job, given once in component 0's block."""
        lines = [
            _flag("job-name", f"llmd-{self.spec.name}"),
            _flag("chdir", str(self.workdir)),
            _flag("output", str(self.run_dir / "logs" / "batch-%j.out")),
            _flag("open-mode", "append"),
        ]
        if self.spec.slurm.requeue:
            lines.append(_flag("requeue", None))
        return lines

    def hetjob_blocks(self) -> list[str]:
        """`#SBATCH hetjob` and each engine component's options, appended after component 0's options."""
        out: list[str] = []
        for comp in self.engines:
            out.append(f"#SBATCH hetjob  # component {comp.index}: {comp.role}")
            out += self.header_lines(comp)
        return out

    def container_args(self) -> list[str]:
        image = self.spec.slurm.container_image
        if not image:
            return []
        mounts = sorted({str(self.workdir), str(self.run_dir)})
        return [
            f"--container-image={image}",
            f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={self.workdir}",
        ]

    def engine_command(self, comp: Component) -> list[str]:
        spec, run = str(self.spec_path), str(self.run_dir)
        if self.starter == "fabric":
            return [self.python, "-u", "-m", "llmd.fabric", "--spec", spec, "--run-dir", run, "--role", comp.role]
        return [self.python, "-u", "-m", "launchers.engine_task", "--spec", spec, "--run-dir", run, "--role", comp.role]

    def srun_prefix(self, comp: Component, log_name: str, nodelist: list[str] | None = None) -> list[str]:
        """`nodelist`: the component's nodes in one homogeneous allocation (a sweep's array task) instead of its het
        group."""
        # A step in a homogeneous allocation would inherit the whole job's task count: name the step's own.
        where = (
            [f"--nodelist={','.join(nodelist)}", f"--ntasks={comp.nodes}"]
            if nodelist is not None
            else [f"--het-group={comp.index}"]
        )
        args = [
            "srun",
            *where,
            f"--nodes={comp.nodes}",
            "--ntasks-per-node=1",
            # One task dying ends the whole step; the main job then sees the step's exit and tears the job down.
            "--kill-on-bad-exit=1",
            "--unbuffered",
            f"--output={self.run_dir / 'logs' / log_name}",
        ]
        if comp.role != "main" and self.starter == "fabric":
            args.append("--mpi=pmi2")  # MPICH from PyPI wires up through Slurm's PMI2 (checked on 22.05)
        return args + self.container_args()

    def setup_lines(self) -> list[str]:
        """Shell run by the batch script before component 0's main command: this source tree on PYTHONPATH, node
        lists, a clean discovery file, and each engine component started in the background; its exit code lands in
        exit/<role>.rc for the main job."""
        run = shlex.quote(str(self.run_dir))
        lines = [
            f"export LLMD_RUN_DIR={run}",
            f"export {runid.ENV}={shlex.quote(self.run_id)}",
            pythonpath_line(self.source),
            f"mkdir -p {run}/logs {run}/exit",
            # A requeued attempt starts from fresh engines: forget the last attempt's endpoints and exits.
            f"rm -f {run}/discovery.json {run}/exit/*.rc",
        ]
        for comp in self.components:
            lines.append(
                f'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{comp.index}" > {run}/nodes-{comp.role}.txt'
            )
        for comp in self.engines:
            cmd = self.srun_prefix(comp, f"{comp.role}-%t.log") + self.engine_command(comp)
            lines.append(f"( {shlex.join(cmd)}; echo $? > {run}/exit/{comp.role}.rc ) &")
        return lines

    def main_srun(self) -> list[str]:
        return self.srun_prefix(self.components[0], "main.log")

    def plain_main_command(self) -> list[str]:
        run = str(self.run_dir)
        return [self.python, "-u", "-m", "launchers.main_job", "--spec", str(self.spec_path), "--run-dir", run]

    def teardown_lines(self) -> list[str]:
        # The main job is done (or failed): engines have no one to serve. Ending the batch script ends the job and
        # Slurm kills every step left, so nothing keeps holding the nodes.
        return ["rc=$?", 'echo "llmd: main job exited with code $rc; ending the job"', "exit $rc"]


def _flag(key: str, value: str | None) -> str:
    # shlex.quote's single quotes read the same to sbatch's #SBATCH tokenizer as to a shell, as long as the value
    # holds no backslash (sbatch reads one as an escape even inside quotes): the spec and _script_path refuse those.
    return f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={shlex.quote(value)}"


def _script_path(what: str, path: Path, *, output: bool = False) -> Path:
    # Paths go into #SBATCH lines and comments of the script: one line, and nothing sbatch would read as syntax.
    text = str(path)
    found = control_character(text)
    if found:
        raise UserError(f"the {what} {printable(text)!r} holds {found}; a batch script cannot name it: rename it")
    if "\\" in text:
        raise UserError(f"the {what} {text!r} holds a backslash, which sbatch reads as an escape: rename it")
    if "hetjob" in text.lower() or "packjob" in text.lower():
        raise UserError(
            f"the {what} {text!r} holds 'hetjob' or 'packjob', which sbatch reads anywhere in an #SBATCH line as the "
            "start of another het-job component: rename it"
        )
    if output and "%" in text:
        raise UserError(f"the {what} {text!r} holds '%', which Slurm reads as a file name pattern (%j): rename it")
    return path


def plan_job(
    spec: DeploymentSpec,
    run_dir: Path,
    workdir: Path,
    *,
    gpus: bool,
    starter: str = "basic",
    python: str = sys.executable,
) -> JobPlan:
    """The het job for `spec`. `gpus` False leaves out --gpus-per-node (clusters without GPU GRES, like the local
    test cluster); the spec's gpus_per_node still shapes the engines' layout."""
    if starter not in ENGINE_STARTERS:
        raise ValueError(f"unknown engine starter {starter!r}")
    cpus = spec.slurm.cpus_per_task
    comps = [Component(0, "main", 1, cpus, 0)]
    for role, pool in spec.pools.items():
        comps.append(Component(len(comps), role, pool.nodes, cpus, pool.gpus_per_node if gpus else 0))
    return JobPlan(
        spec=spec,
        run_dir=_script_path("run folder", run_dir, output=True),
        workdir=_script_path("working directory", workdir),
        components=comps,
        starter=starter,
        python=python,
        extra=list(spec.slurm.extra_sbatch),
    )
