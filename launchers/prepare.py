"""A run folder for a spec: where it goes, the spec copy the job reads (paths made absolute, since the job's nodes
start elsewhere), and the checks that would otherwise fail only once the job runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from llmd.engines.kinds import engine_kind
from llmd.errors import UserError
from llmd.spec import DeploymentSpec, dump_spec
from llmd.spec.redact import redact_spec_text


def absolute_spec(spec: DeploymentSpec, base: Path) -> DeploymentSpec:
    """`spec` with the model, tokenizer, trace and output paths that exist relative to `base` made absolute."""

    def fix(value: str | None) -> str | None:
        if value is None or Path(value).is_absolute():
            return value
        p = base / value
        return str(p.resolve()) if p.exists() else value

    model = spec.model.model_copy(update={"path": fix(spec.model.path), "tokenizer": fix(spec.model.tokenizer)})
    workload = spec.workload.model_copy(update={"trace_path": fix(spec.workload.trace_path)})
    output = spec.output.model_copy(update={"dir": str((base / spec.output.dir).resolve())})
    return spec.model_copy(update={"model": model, "workload": workload, "output": output})


def check_launchable(spec: DeploymentSpec) -> None:
    if engine_kind(spec.engine.kind).needs_tokenizer_file:
        tok = Path(spec.model.tokenizer or spec.model.path)
        if not (tok / "tokenizer.json").exists():
            raise UserError(
                f"model.tokenizer {str(tok)!r} has no tokenizer.json (the simulated engines and the benchmark client "
                f"need it); make one with `llmd model make-tiny {tok}` or point model.path at a model folder"
            )
    if spec.workload.profile == "trace":
        raise UserError('workload.profile "trace" is not supported in Slurm runs yet; pick a named profile')


def new_run_dir(spec: DeploymentSpec, stamp: str | None = None) -> Path:
    """A fresh folder name under the spec's output dir: <name>-<time>, -2, -3... if taken; not created."""
    base = Path(spec.output.dir) / f"{spec.name}-{stamp or time.strftime('%Y%m%d-%H%M%S')}"
    run, n = base, 1
    while run.exists():
        n += 1
        run = base.with_name(f"{base.name}-{n}")
    return run


def create_run_dir(run: Path, spec: DeploymentSpec) -> Path:
    for sub in ("logs", "exit", "parts"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    return write_spec_copy(run / "spec.yaml", dump_spec(spec))


def write_spec_copy(spec_path: Path, text: str) -> Path:
    """The run's own copy of its spec. The job reads its engines' env from it, so a token stays in it; the file is
    then the owner's alone (created so, not chmod-ed after: no moment when others could read it)."""
    private = redact_spec_text(text) != text
    fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    if private:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return spec_path
