"""The named workload profiles (smoke, automationbench, cybergym, agentx, trace-stats) and the `Workload` that yields
their sessions lazily, one agent's sessions after another's, each drawn from its own seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from llmd.workload.distributions import Quantiles, fixed
from llmd.workload.sessions import (
    SessionModel,
    SessionPlan,
    Turn,
    fork_p_for_share,
    plan_session,
    plan_subagents,
    session_start_offset,
)

# The reference traffic (219 coding-agent sessions, 78,099 requests): main-agent p50/p90/p99.
TRACE_OUTPUT = Quantiles(317, 1705, 7551, 1, 32_768)
TRACE_GROWTH = Quantiles(632, 3735, 148_000, 1, 400_000)
TRACE_GAP_S = Quantiles(2.0, 24.0, 684.0, 0.0, 3600.0)
TRACE_TURNS = Quantiles(107, 354, 992, 1, 5000)
# Not in the table: the context a session starts (or restarts) with, tuned so that start + appended growth gives the
# table's input p50 195K / p90 521K / p99 849K.
TRACE_INITIAL = Quantiles(90_000, 220_000, 500_000, 0, 700_000)
SUBAGENT_SHARE = 40_367 / 78_099


@dataclass(frozen=True, slots=True)
class Profile:
    """A profile: how many agents, how many sessions each (None: sessions back to back until the duration ends),
    the session model, and the spread of the agents' first start times."""

    name: str
    agents: int
    sessions_per_agent: int | None
    duration_s: float | None
    model: SessionModel
    stagger_s: float = 0.0


def run_salt(seed: int, run_id: str) -> str:
    """A salt of letters from the seed and a run id: distinct runs get distinct system prompts, so no run profits
    from another's prefix cache, while a rerun with the same (seed, run_id) is reproducible."""
    digest = hashlib.sha256(f"{seed}:{run_id}".encode()).hexdigest()[:16]
    return "".join(chr(ord("a") + int(c, 16)) for c in digest)


@dataclass(slots=True)
class Workload:
    """A profile under a seed and run salt. `agent_sessions(i)` yields agent i's sessions lazily (forever when the
    profile runs until a duration: the caller stops it); `sessions()` interleaves agents round-robin."""

    profile: Profile
    seed: int
    salt: str

    def agent_sessions(self, agent: int, subagents: bool = True) -> Iterator[SessionPlan]:
        """`subagents=False`: plans without their children, planned when their fork comes (`subagents`)."""
        if not 0 <= agent < self.profile.agents:
            raise ValueError(f"agent {agent} out of range [0, {self.profile.agents})")
        start = session_start_offset(self.seed, agent, self.profile.stagger_s)
        index = 0
        while self.profile.sessions_per_agent is None or index < self.profile.sessions_per_agent:
            yield plan_session(self.profile.model, self.seed, agent, index, start if index == 0 else 0.0, subagents)
            index += 1

    def subagents(self, plan: SessionPlan, turn: Turn) -> list[SessionPlan]:
        """The sub-agent sessions main-agent session `plan` forks at `turn` (its `children` of that turn)."""
        return plan_subagents(self.profile.model, self.seed, plan.agent, plan.index, turn)

    def sessions(self) -> Iterator[SessionPlan]:
        iters = [self.agent_sessions(a) for a in range(self.profile.agents)]
        while iters:
            alive = []
            for it in iters:
                plan = next(it, None)
                if plan is not None:
                    yield plan
                    alive.append(it)
            iters = alive


def _trace_model(**kw: Any) -> SessionModel:
    model = dataclasses.replace(SessionModel(TRACE_INITIAL, TRACE_GROWTH, TRACE_OUTPUT, TRACE_GAP_S, TRACE_TURNS), **kw)
    return dataclasses.replace(model, fork_p=fork_p_for_share(model, SUBAGENT_SHARE))


# A named profile from the run's concurrency and duration (each profile decides whether it uses them).
ProfileBuilder = Callable[[str, int, float], Profile]
PROFILE_BUILDERS: dict[str, ProfileBuilder] = {}
# The spec's profile that replays workload.trace_path (llmd.workload.trace) instead of drawing sessions from a model.
REPLAY_PROFILE = "trace"


def register_profile(name: str) -> Callable[[ProfileBuilder], ProfileBuilder]:
    def register(fn: ProfileBuilder) -> ProfileBuilder:
        PROFILE_BUILDERS[name] = fn
        return fn

    return register


@register_profile("smoke")
def _smoke(name: str, concurrency: int, duration_s: float) -> Profile:
    model = SessionModel(
        initial=Quantiles(300, 450, None, 200, 600),
        growth=Quantiles(40, 80, None, 24, 120),
        output=Quantiles(16, 40, None, 4, 64),
        gap_s=Quantiles(0.2, 0.5, None, 0.0, 1.0),
        turns=fixed(3),
        reset_p=0.0,
        compaction_p=0.0,
        max_context=4000,
        system_tokens=64,
        group_size=fixed(3),
        subagent_turns=fixed(2),
        subagent_task=Quantiles(40, 80, None, 24, 120),
        fixed_fork=(1, 3),
    )
    return Profile(name, 4, 1, None, model, stagger_s=0.5)


@register_profile("automationbench")
def _automationbench(name: str, concurrency: int, duration_s: float) -> Profile:
    # Raw concurrency of coding agents, closed loop; AutomationBench's rates give ~17.7K input and ~800 output
    # tokens per request, so contexts are far smaller than in the long-session traffic.
    model = _trace_model(initial=Quantiles(8_000, 20_000, 40_000, 0, 60_000), turns=Quantiles(20, 60, 150, 1))
    return Profile(name, concurrency, None, duration_s, dataclasses.replace(model, max_context=64_000), 10.0)


@register_profile("cybergym")
def _cybergym(name: str, concurrency: int, duration_s: float) -> Profile:
    model = _trace_model(initial=fixed(94_000), turns=fixed(10), reset_p=0.0, max_context=200_000)
    return Profile(name, 400, 1, None, model, stagger_s=10.0)


@register_profile("agentx")
def _agentx(name: str, concurrency: int, duration_s: float) -> Profile:
    model = _trace_model(initial=Quantiles(195_000, 210_000, None, 150_000, 250_000), reset_p=0.0)
    return Profile(name, 128, None, 15 * 60.0 if duration_s is None else duration_s, model, 10.0)


@register_profile("trace-stats")
def _trace_stats(name: str, concurrency: int, duration_s: float) -> Profile:
    return Profile(name, concurrency, None, duration_s, _trace_model(), 10.0)


def _base(name: str, concurrency: int, duration_s: float) -> Profile:
    builder = PROFILE_BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
    return builder(name, concurrency, duration_s)


PROFILES = tuple(PROFILE_BUILDERS)
_DIMS = ("initial", "growth", "output", "gap_s", "turns", "group_size", "subagent_turns", "subagent_task")
_SCALARS = ("reset_p", "compaction_p", "compaction_ratio", "max_context", "system_tokens", "fork_p", "overflow")
_PROFILE_FIELDS = ("agents", "sessions_per_agent", "stagger_s")
ALLOWED_PARAMS = tuple(
    sorted(
        [*_PROFILE_FIELDS, *_SCALARS, *_DIMS]
        + [f"{d}_{q}" for d in _DIMS for q in ("p50", "p90", "p99")]
        + ["subagent_share"]
    )
)


def build_profile(
    name: str,
    *,
    concurrency: int = 8,
    duration_s: float = 60.0,
    context_scale: float = 1.0,
    time_scale: float = 1.0,
    params: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
) -> Profile:
    """A named profile with `params` overriding its numbers (a dimension `d` as `d` for a fixed value or `d_p50`,
    `d_p90`, `d_p99`); unknown names raise ValueError naming the allowed ones. `max_model_len`: the deployment's
    window, which no prompt plus its max_tokens may exceed (sessions compact or reset before it)."""
    params = dict(params or {})
    unknown = sorted(set(params) - set(ALLOWED_PARAMS))
    if unknown:
        raise ValueError(f"unknown workload params {unknown}; allowed: {', '.join(ALLOWED_PARAMS)}")
    prof = _base(name, concurrency, duration_s)
    model = prof.model
    changes: dict[str, Any] = {}
    for d in _DIMS:
        q: Quantiles = getattr(model, d)
        if d in params:
            q = fixed(float(params[d]))
        keys = {k: params[f"{d}_{k}"] for k in ("p50", "p90", "p99") if f"{d}_{k}" in params}
        if keys:
            q = Quantiles(
                float(keys.get("p50", q.p50)),
                float(keys.get("p90", q.p90)),
                keys.get("p99", q.p99),
                q.lo,
                max(q.hi, *(float(v) for v in keys.values())),
            )
        changes[d] = q
    for s in _SCALARS:
        if s in params:
            changes[s] = type(getattr(model, s))(params[s])
    model = dataclasses.replace(
        model, **changes, context_scale=context_scale, time_scale=time_scale, max_model_len=max_model_len
    )
    if "subagent_share" in params:
        model = dataclasses.replace(model, fork_p=fork_p_for_share(model, float(params["subagent_share"])))
    agents = int(params.get("agents", prof.agents))
    spa = params.get("sessions_per_agent", prof.sessions_per_agent)
    if agents < 1:
        raise ValueError(f"agents must be >= 1, got {agents}")
    stagger = float(params.get("stagger_s", prof.stagger_s)) * time_scale
    return Profile(name, agents, None if spa is None else int(spa), prof.duration_s, model, stagger)


def profile_from_spec(workload: Any, run_id: str = "", max_model_len: int | None = None) -> Workload:
    """The `Workload` a spec's `workload:` section describes (a llmd.spec.model.WorkloadSpec); `max_model_len` is the
    spec's model.max_model_len, the window its sessions must fit. Profile "trace" is replayed by llmd.workload.trace
    instead."""
    if workload.profile == "trace":
        raise ValueError('profile "trace" replays workload.trace_path; use llmd.workload.trace.read_trace')
    prof = build_profile(
        workload.profile,
        concurrency=workload.concurrency,
        duration_s=workload.duration_s,
        context_scale=workload.context_scale,
        time_scale=workload.time_scale,
        params=workload.params,
        max_model_len=max_model_len,
    )
    return Workload(prof, workload.seed, run_salt(workload.seed, run_id))


def expected_requests_per_session(model: SessionModel) -> float:
    """Mean requests per main session, sub-agents included (for sizing runs)."""
    mean_turns = model.turns.mean()
    return mean_turns * (1 + model.fork_p * model.subagent_requests_per_fork()) if math.isfinite(mean_turns) else 0
