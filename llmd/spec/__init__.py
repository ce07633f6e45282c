"""The deployment spec: one typed description of a deployment, shared by every launcher, engine, benchmark and
simulator. Load it with `load_spec(path)`; every problem comes back at once as a `SpecError`."""

from llmd.spec.checks import SpecError, SpecIssue, run_checks
from llmd.spec.load import check_spec, dump_spec, load_spec, parse_spec, parse_spec_text
from llmd.spec.model import (
    DeploymentSpec,
    EngineSpec,
    KVSpec,
    ModelSpec,
    MTPSpec,
    OutputSpec,
    PoolSpec,
    RouterSpec,
    SlurmSpec,
    WorkloadSpec,
    parse_size,
)

__all__ = [
    "DeploymentSpec",
    "EngineSpec",
    "KVSpec",
    "MTPSpec",
    "ModelSpec",
    "OutputSpec",
    "PoolSpec",
    "RouterSpec",
    "SlurmSpec",
    "SpecError",
    "SpecIssue",
    "WorkloadSpec",
    "check_spec",
    "dump_spec",
    "load_spec",
    "parse_size",
    "parse_spec",
    "parse_spec_text",
    "run_checks",
]
