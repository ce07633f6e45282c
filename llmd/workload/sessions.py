"""The agentic session model: turns whose input is the whole context, growing by appending, with prefix resets,
compactions and bursts of sub-agents that fork from the main agent's context. Pure and deterministic under a seed.

Each session draws from its own numpy Generator seeded by (seed, agent, session index), and each sub-agent from one
seeded by its fork position, so a session's plan does not depend on any other session's draws or on concurrency.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from llmd.workload.distributions import Quantiles

# Floors of the plan, in tokens, so that every planned prompt can be rendered at its exact size: a prompt has fixed
# chat framing (role markers, the template's own text) that the prompt writer subtracts before writing at least one
# token of content. The planner has no tokenizer, so the floors are sized for common chat templates (the tiny
# model's: 19 tokens of framing for system + user, 16 for an assistant + tool step, 6 for a sub-agent's task
# message); `PromptWriter` clamps any shortfall for a template with larger framing (see its docstring).
# Fewest tokens a turn may add: a tool message needs room for its chat framing (role markers) plus some content.
MIN_NEW_TOKENS = 24
# Fewest tokens of a whole context beyond the shared system prompt: the first user message with the framing of the
# system and user messages and the generation prompt.
MIN_TASK_TOKENS = 64
# Fewest tokens of the shared system prompt: the run salt (16 letters), a newline and some text.
MIN_SYSTEM_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session. `input_tokens` is the whole prompt; `new_tokens` what it adds over the previous
    turn's input + output (the whole input at a session's first turn, a reset or a compaction; the task text at a
    sub-agent's first turn, unless that is a reset because the parent's context plus the task would exceed the
    cap); `gap_before_s` the tool time between the previous turn's response and this request (for a session's first
    turn: its start offset; for a sub-agent's first turn: 0, it starts with its parent's response); `forks` how many
    sub-agents start when this turn's response completes."""

    session_id: str
    turn_index: int
    parent_session_id: str | None
    is_subagent: bool
    input_tokens: int
    new_tokens: int
    output_tokens: int
    gap_before_s: float
    reset: bool = False
    compaction: bool = False
    forks: int = 0
    overflow: bool = False  # the reset or compaction was forced by the model's window (max_model_len)


@dataclass(slots=True)
class SessionPlan:
    """A session's turns and the sub-agent sessions it forks (children), in fork order."""

    session_id: str
    agent: int
    index: int
    turns: list[Turn]
    parent_session_id: str | None = None
    parent_turn_index: int | None = None
    children: list[SessionPlan] = field(default_factory=list)

    def walk(self) -> Iterator[SessionPlan]:
        """This plan and every sub-agent plan under it, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()

    def all_turns(self) -> Iterator[Turn]:
        for plan in self.walk():
            yield from plan.turns


@dataclass(frozen=True, slots=True)
class SessionModel:
    """The distributions a session is drawn from, in unscaled tokens and seconds (scales apply at sampling)."""

    initial: Quantiles  # context at a session's start and after a prefix reset
    growth: Quantiles  # tokens a turn adds beyond the previous output (tool results, user text)
    output: Quantiles
    gap_s: Quantiles
    turns: Quantiles
    reset_p: float = 0.025  # random resets; with the forced ones at max_context the share is ~2.8%
    compaction_p: float = 0.0003
    compaction_ratio: float = 0.1  # a compaction's summary is this share of the context
    max_context: float = 850_000.0  # a turn that would exceed it starts a new context (a reset)
    # The deployment's window: vLLM refuses (400) a prompt whose tokens plus max_tokens exceed it, so an agent
    # harness compacts (or resets, per `overflow`) before sending one. None: no window (contexts capped by
    # max_context only). In tokens as sent, after context_scale.
    max_model_len: int | None = None
    overflow: str = "compact"  # what a session does at the window: "compact" (summarise) or "reset" (start anew)
    system_tokens: int = 3000  # shared system prompt (salted per run) at the head of every context
    fork_p: float = 0.0  # chance that a main-agent turn forks a group of sub-agents
    group_size: Quantiles = field(default_factory=lambda: Quantiles(7, 51, None, 1, 256))
    subagent_turns: Quantiles = field(default_factory=lambda: Quantiles(3, 8, None, 1, 50))
    subagent_task: Quantiles = field(default_factory=lambda: Quantiles(400, 1500, None, 50, 20_000))
    fixed_fork: tuple[int, int] | None = None  # (turn, size): the first session of agent 0 forks there (smoke)
    context_scale: float = 1.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("reset_p", "compaction_p", "fork_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.compaction_ratio < 1:
            raise ValueError(f"compaction_ratio must be in (0, 1), got {self.compaction_ratio}")
        if self.overflow not in ("compact", "reset"):
            raise ValueError(f'overflow must be "compact" or "reset", got {self.overflow!r}')
        room = _context_floor(self) + MIN_NEW_TOKENS + 1
        if self.max_model_len is not None and self.max_model_len < room:
            raise ValueError(
                f"max_model_len {self.max_model_len} cannot hold this profile's smallest turn ({room} tokens: the "
                "system prompt, a task, one turn's growth and one output token); raise it or lower context_scale"
            )

    @property
    def system(self) -> int:
        return max(MIN_SYSTEM_TOKENS, round(self.system_tokens * self.context_scale))

    def tokens(self, values: np.ndarray, minimum: int) -> np.ndarray:
        return np.maximum(np.rint(values * self.context_scale).astype(np.int64), minimum)

    def subagent_requests_per_fork(self) -> float:
        return self.group_size.mean() * self.subagent_turns.mean()


def _context_floor(model: SessionModel) -> int:
    """The smallest whole context: the system prompt plus the first user message with its framing."""
    return model.system + MIN_TASK_TOKENS


def _max_context(model: SessionModel) -> int:
    """The scaled context cap; never below the floor plus one turn's growth, so a fresh context can always grow."""
    return max(_context_floor(model) + MIN_NEW_TOKENS, round(model.max_context * model.context_scale))


def _fit_window(model: SessionModel, output: np.ndarray, max_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """Each turn's output and its largest prompt: a prompt plus its max_tokens (the planned output) must fit the
    window, so an output never leaves less than the smallest context room, and the prompt gets what it leaves."""
    if model.max_model_len is None:
        return output, np.full(len(output), max_ctx, dtype=np.int64)
    room = model.max_model_len - _context_floor(model) - MIN_NEW_TOKENS
    output = np.minimum(output, room)
    return output, np.minimum(max_ctx, model.max_model_len - output)


def _compacted(model: SessionModel, ctx: int, cap: int) -> int:
    """The context after a compaction: a summary of `ctx`, never below the floor nor over this turn's cap."""
    return min(cap, max(_context_floor(model), round(ctx * model.compaction_ratio)))


def plan_session(
    model: SessionModel, seed: int, agent: int, index: int, start_s: float = 0.0, subagents: bool = True
) -> SessionPlan:
    """The main-agent session `index` of `agent`: its turns and its sub-agents, drawn from its own generator.
    `subagents=False` leaves `children` empty for a caller that plans each fork when it happens (plan_subagents):
    every sub-agent draws from a generator of its own, so planning it later changes nothing."""
    rng = np.random.default_rng([seed, 0, agent, index])
    sid = f"a{agent}-s{index}"
    n = int(model.turns.sample_int(rng, 1)[0])
    max_ctx = _max_context(model)
    floor = _context_floor(model)
    growth = model.tokens(model.growth.sample(rng, n), MIN_NEW_TOKENS)
    output = model.tokens(model.output.sample(rng, n), 1)
    gaps = model.gap_s.sample(rng, n) * model.time_scale
    output, caps = _fit_window(model, output, max_ctx)
    starts = np.minimum(model.tokens(model.initial.sample(rng, n), floor), caps)
    resets = rng.random(n) < model.reset_p
    compactions = rng.random(n) < model.compaction_p
    forks = rng.random(n) < model.fork_p
    groups = model.group_size.sample_int(rng, n)
    if model.fixed_fork is not None and agent == 0 and index == 0:
        forks[:] = False
        turn, size = model.fixed_fork
        if turn < n:
            forks[turn], groups[turn] = True, size
    # Plain Python values for the per-turn loop: numpy scalars cost several times more there, and the load
    # generator plans on its event loop.
    fk_n = np.where(forks, groups, 0).tolist()
    growth_l, output_l, gaps_l, starts_l = growth.tolist(), output.tolist(), gaps.tolist(), starts.tolist()
    resets_l, compactions_l, caps_l = resets.tolist(), compactions.tolist(), caps.tolist()
    compact_at_window = model.overflow == "compact"
    turns: list[Turn] = []
    children: list[SessionPlan] = []
    ctx = starts_l[0]
    turns.append(Turn(sid, 0, None, False, ctx, ctx, output_l[0], float(start_s), forks=fk_n[0]))
    for t in range(1, n):
        reset = compaction = False
        nxt = ctx + output_l[t - 1] + growth_l[t]
        # The window binds where the profile's own cap does not: max_context keeps its reset.
        overflow = nxt > caps_l[t] and nxt <= max_ctx
        if compactions_l[t] or (overflow and compact_at_window):
            compaction = True
            nxt = _compacted(model, ctx, caps_l[t])
        elif resets_l[t] or overflow or nxt > max_ctx:
            reset = True
            nxt = starts_l[t]
        new = nxt if (reset or compaction) else growth_l[t]
        ctx = nxt
        turns.append(Turn(sid, t, None, False, ctx, new, output_l[t], gaps_l[t], reset, compaction, fk_n[t], overflow))
    if subagents:
        for turn in turns:
            children += plan_subagents(model, seed, agent, index, turn)
    return SessionPlan(sid, agent, index, turns, children=children)


def plan_subagents(model: SessionModel, seed: int, agent: int, index: int, turn: Turn) -> list[SessionPlan]:
    """The sub-agent sessions main-agent session `index` of `agent` forks at `turn`: its `children` of that turn."""
    return [_plan_subagent(model, seed, agent, index, turn, k) for k in range(turn.forks)]


def _forks(forks: np.ndarray, groups: np.ndarray, t: int) -> int:
    return int(groups[t]) if forks[t] else 0


def _plan_subagent(model: SessionModel, seed: int, agent: int, index: int, parent: Turn, k: int) -> SessionPlan:
    # A sub-agent starts from its parent's context at the fork turn (sharing its prefix) plus its own task text,
    # then appends like any agent; it never forks. It obeys the main sessions' cap: a turn that would exceed
    # max_context starts a new context (a reset), its first turn included (it then does not share its parent's
    # prefix); one that would exceed the window compacts or resets as the main agent's would. Random resets and
    # compactions are the main agent's only.
    rng = np.random.default_rng([seed, 1, agent, index, parent.turn_index, k])
    sid = f"{parent.session_id}/t{parent.turn_index}.{k}"
    n = int(model.subagent_turns.sample_int(rng, 1)[0])
    task = int(model.tokens(model.subagent_task.sample(rng, 1), MIN_NEW_TOKENS)[0])
    growth = model.tokens(model.growth.sample(rng, n), MIN_NEW_TOKENS)
    output = model.tokens(model.output.sample(rng, n), 1)
    gaps = model.gap_s.sample(rng, n) * model.time_scale
    # Drawn last, so the draws above (and the plans of sub-agents that never hit the cap) are as before.
    max_ctx = _max_context(model)
    output, caps = _fit_window(model, output, max_ctx)
    starts = np.minimum(model.tokens(model.initial.sample(rng, n), _context_floor(model)), caps)
    compact_at_window = model.overflow == "compact"
    turns: list[Turn] = []
    ctx = 0
    for t in range(n):
        # `base` is what a compaction summarises: the parent's context and the task at the first turn.
        base = parent.input_tokens + task if t == 0 else ctx
        grown = base if t == 0 else ctx + int(output[t - 1]) + int(growth[t])
        cap = int(caps[t])
        overflow = cap < grown <= max_ctx
        reset = grown > max_ctx or (overflow and not compact_at_window)
        compaction = overflow and compact_at_window
        ctx = int(starts[t]) if reset else _compacted(model, base, cap) if compaction else grown
        new = ctx if (reset or compaction) else task if t == 0 else int(growth[t])
        gap = 0.0 if t == 0 else float(gaps[t])
        turns.append(
            Turn(sid, t, parent.session_id, True, ctx, new, int(output[t]), gap, reset, compaction, 0, overflow)
        )
    return SessionPlan(sid, agent, index, turns, parent.session_id, parent.turn_index)


def fork_p_for_share(model: SessionModel, subagent_share: float) -> float:
    """The per-turn fork chance that makes sub-agent requests `subagent_share` of all requests (40,367 of 78,099 in
    the reference traffic)."""
    if not 0 <= subagent_share < 1:
        raise ValueError(f"subagent_share must be in [0, 1), got {subagent_share}")
    ratio = subagent_share / (1 - subagent_share)  # sub-agent requests per main-agent request
    return min(1.0, ratio / model.subagent_requests_per_fork())


def session_start_offset(seed: int, agent: int, stagger_s: float) -> float:
    """Where an agent's first session starts within [0, stagger_s), so N agents do not all fire at t=0."""
    if stagger_s <= 0:
        return 0.0
    return float(np.random.default_rng([seed, 2, agent]).random() * stagger_s)
