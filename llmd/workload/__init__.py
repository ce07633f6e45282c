"""The agentic workload model, pure and deterministic under a seed: sessions of growing-context turns with resets,
compactions and sub-agent bursts (`sessions`), the named profiles (`profiles`), trace replay (`trace`) and real text
with exact token counts (`prompts`). A load generator drives HTTP on top of it."""

from llmd.workload.distributions import Quantiles, fixed, percentile
from llmd.workload.profiles import (
    ALLOWED_PARAMS,
    PROFILES,
    Profile,
    Workload,
    build_profile,
    profile_from_spec,
    run_salt,
)
from llmd.workload.sessions import SessionModel, SessionPlan, Turn, plan_session

__all__ = [
    "ALLOWED_PARAMS",
    "PROFILES",
    "Profile",
    "Quantiles",
    "SessionModel",
    "SessionPlan",
    "Turn",
    "Workload",
    "build_profile",
    "fixed",
    "percentile",
    "plan_session",
    "profile_from_spec",
    "run_salt",
]
