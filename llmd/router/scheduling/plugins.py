"""The scheduling plugins' interfaces (Filter, Scorer, Picker, the learning hooks) and the registry they join.

A plugin is a module that registers itself in one line, `register_scorer(ScorerPlugin(name, factory, consumes))`,
declaring the request and cluster data it reads; the spec's valid `weights` keys, the scheduler's columns and learning
calls, and whether the proxy tokenizes or keeps prompt text all follow from the registry.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from llmd.router.scheduling.state import Candidate, Decision, Holder, RouteRequest

if TYPE_CHECKING:
    import numpy as np

    from llmd.router.scheduling.columns import Columns, HitColumns, IndexReader
    from llmd.router.scheduling.pipeline import RouterSettings, Tuning

# What a plugin may read besides the candidates, so the router gathers only what its plugins use:
# tokens: the request's KV block hashes (the router tokenizes); text: its text chunk hashes (the router keeps the prompt
# text); engine_state: the engines' load and KV usage (scraped metrics); kv_index: the engines' KV events.
Input = Literal["tokens", "text", "engine_state", "kv_index"]
INPUTS: tuple[Input, ...] = ("tokens", "text", "engine_state", "kv_index")


class PrefixHit(NamedTuple):
    """One holder's cached prefix of the request: `gpu` leading units (blocks or chunks) in GPU, then `cpu` more held
    only in the CPU tier; the same in prompt tokens (capped at the prompt's length)."""

    gpu: int
    cpu: int
    gpu_tokens: int
    cpu_tokens: int

    @property
    def tokens(self) -> int:
        return self.gpu_tokens + self.cpu_tokens


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """Every holder's hit for one request; `units` is the request's length in the same units (0: nothing to match)."""

    by_holder: Mapping[Holder, PrefixHit]
    units: int


NO_HITS = PrefixHits({}, 0)


@dataclass(slots=True)
class ScoringContext:
    """One scheduling call's inputs shared by the scorers.

    hits: the primary prefix source's hits (set by the pipeline when a scorer without `score_columns` reads them;
    None: not made). cold: no candidate holds any prefix (set by the pipeline; None: unknown, treated as cold).
    memo: per-call caches keyed by scorer name. columns: the snapshot's columns and hit_cols the primary source's
    hits aligned with them (set by the pipeline), for `score_columns`.
    """

    req: RouteRequest
    now: float = 0.0
    index: IndexReader | None = None
    hits: PrefixHits | None = None
    cold: bool | None = None
    memo: dict[str, Any] = field(default_factory=dict)
    columns: Columns | None = None
    hit_cols: HitColumns | None = None


class Scorer(Protocol):
    """Gives every candidate a score in [0, 1], higher is better, aligned with `cands`; the pipeline weights and sums
    the scorers' columns in registration order."""

    name: str

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]: ...


@runtime_checkable
class ColumnScorer(Protocol):
    """A scorer that can also score the snapshot's columns at positions `idx` (ctx.columns, ctx.hit_cols set): the
    same floats `score` gives those candidates, as an array, without building them. `score` is the reference."""

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray: ...


class PrefixSource(Scorer, Protocol):
    """A scorer that can also say which holders cache a prefix of the request (memoised in `ctx.memo`): the pipeline
    reuses the policy's source for hit counts, cold detection, P2P and P/D."""

    def hits(self, ctx: ScoringContext) -> PrefixHits: ...

    def hit_columns(self, ctx: ScoringContext) -> HitColumns:
        """`hits` aligned with ctx.columns (memoised in `ctx.memo` too)."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A stateful scorer's hooks, called by `Scheduler.observe_routed` / `forget_pod` for the scorers in use.
    `capacity`: each holder's (GPU, CPU) KV blocks as last seen when routed to."""

    def observe_routed(
        self, req: RouteRequest, decision: Decision, now: float, capacity: Mapping[Holder, tuple[int, int]]
    ) -> None: ...

    def forget_pod(self, pod: str) -> None: ...


# A filter keeps a (possibly empty) subset of the candidates, order kept; its further arguments depend on the filter.
Filter = Callable[..., list[Candidate]]
# A picker turns per-candidate values into the chosen index; ties are broken by the seeded RNG.
Picker = Callable[[Sequence[float], random.Random], int]


@dataclass(frozen=True, slots=True)
class ScorerSetup:
    """What a scorer factory may read when a Scheduler is built: the router settings, the tuning, the tier weights."""

    config: RouterSettings
    tuning: Tuning
    gpu_w: float
    cpu_w: float


@dataclass(frozen=True, slots=True)
class ScorerPlugin:
    """A scorer as the registry knows it. `name`: its key in RouterSpec.weights. `factory`: builds one instance per
    Scheduler. `consumes`: the inputs it reads. `prefix`: its score is prefix affinity, left out for a cold request
    while a `spreads_cold` scorer is in use (which places cold requests by spreading them, with the load scorers)."""

    name: str
    factory: Callable[[ScorerSetup], Scorer]
    consumes: frozenset[Input] = frozenset()
    prefix: bool = False
    spreads_cold: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.consumes) - set(INPUTS))
        if unknown:
            raise ValueError(f"scorer {self.name!r} consumes unknown input(s) {unknown}; known: {', '.join(INPUTS)}")


@dataclass(frozen=True, slots=True)
class FilterPlugin:
    name: str
    fn: Filter
    consumes: frozenset[Input] = frozenset()


@dataclass(frozen=True, slots=True)
class PickerPlugin:
    name: str
    fn: Picker


# Insertion order is the scorers' column order: the weighted parts of a total are summed in it.
SCORERS: dict[str, ScorerPlugin] = {}
FILTERS: dict[str, FilterPlugin] = {}
PICKERS: dict[str, PickerPlugin] = {}


def register_scorer(plugin: ScorerPlugin) -> ScorerPlugin:
    if plugin.name in SCORERS:
        raise ValueError(f"scorer {plugin.name!r} is already registered")
    SCORERS[plugin.name] = plugin
    return plugin


def unregister_scorer(name: str) -> None:
    """For tests that register a scorer of their own: leave the registry as they found it."""
    del SCORERS[name]


def register_filter(plugin: FilterPlugin) -> FilterPlugin:
    FILTERS[plugin.name] = plugin
    return plugin


def register_picker(plugin: PickerPlugin) -> PickerPlugin:
    PICKERS[plugin.name] = plugin
    return plugin


def scorer_names() -> tuple[str, ...]:
    """The valid RouterSpec.weights keys, in column order."""
    return tuple(SCORERS)


def scorer_plugin(name: str) -> ScorerPlugin:
    try:
        return SCORERS[name]
    except KeyError:
        raise KeyError(f"unknown scorer {name!r}; known: {', '.join(SCORERS)}") from None
