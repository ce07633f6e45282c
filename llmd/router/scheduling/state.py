"""What the scheduler decides over and what it answers: endpoints, their state snapshot, the request, the decision.

Plain frozen values built by the proxy (live) or the cluster simulator (offline); nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from llmd.router.scheduling.columns import Columns

Role = Literal["prefill", "decode", "both"]
Hop = Literal["decode", "prefill"]
Holder = tuple[str, int]

# Which endpoint roles may serve each hop: "both" engines prefill for themselves and so serve the decode hop; the
# prefill hop of a disaggregated request goes to the dedicated prefill pool only.
HOP_ROLES: Mapping[Hop, frozenset[Role]] = MappingProxyType(
    {"decode": frozenset({"decode", "both"}), "prefill": frozenset({"prefill"})}
)


class NoEndpointError(LookupError):
    """No healthy endpoint can serve the hop; the proxy answers 503."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One routable engine DP rank. A pod serving several DP ranks appears once per rank, all with the same url
    (the proxy adds `X-data-parallel-rank: <rank>` when `ranks > 1`). `node` names the host, so KV transfers between
    endpoints on one node can be costed as NVLink rather than NIC (None: unknown, assume different nodes)."""

    pod: str
    dp_rank: int = 0
    role: Role = "both"
    url: str = ""
    ranks: int = 1
    node: str | None = None
    # The KVIndex holder id `(pod, dp_rank)`, and the hash, computed once: scorers read them per endpoint per request.
    holder: Holder = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "holder", (self.pod, self.dp_rank))
        object.__setattr__(self, "_hash", hash((self.pod, self.dp_rank, self.role, self.url, self.ranks, self.node)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def name(self) -> str:
        return f"{self.pod}/{self.dp_rank}" if self.ranks > 1 or self.dp_rank else self.pod


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint's load as last seen. Engine-side fields (waiting, running, kv_usage) come from scraped metrics;
    router-side ones (inflight, inflight_tokens) from the proxy's own bookkeeping, so they are never stale.

    inflight_tokens: uncached prompt tokens of the requests in flight (prefill work sent there).
    inflight_kv_tokens: KV the requests in flight there may occupy at most (prompt blocks once however many share
    them, plus requested outputs), less what the request being scheduled shares with them (kv_demand.InflightKV).
    kv_capacity_blocks / cpu_capacity_blocks: KV blocks in GPU / in the CPU tier (0: unknown / no CPU tier).
    """

    healthy: bool = True
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    inflight_tokens: int = 0
    inflight_kv_tokens: int = 0
    kv_capacity_blocks: int = 0
    cpu_capacity_blocks: int = 0
    last_updated: float = 0.0


KV_TOKENS_CAP = 2**53  # RouteRequest.max_tokens' bound: more than any KV cache, far from int64's limit


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the scheduler needs to know about one request; hashes were computed upstream (llmd.tokens).

    block_hashes: 64-bit engine-form hashes of the prompt's full blocks, in order (KVIndex keys).
    text_chunk_hashes: chained hashes of fixed-size character chunks of the prompt text (approximate.text_chunk_hashes),
    for the approximate scorer, which does not tokenize. Empty when the approximate scorer is not in use.
    """

    request_id: str
    block_hashes: Sequence[int] = ()
    num_tokens: int = 0
    block_size: int = 64
    session_id: str | None = None
    text_chunk_hashes: Sequence[int] = ()
    is_subagent: bool = False
    parent_session_id: str | None = None
    max_tokens: int = 0  # output tokens the request asks for at most (0: not given; capped at KV_TOKENS_CAP)

    def __post_init__(self) -> None:
        # Clamped once here, for every reader of the KV need: a client's max_tokens near 2**63 (the engine refuses it
        # with a 400) would otherwise overflow the router's int64 columns and fail the router with a 500 instead.
        if self.max_tokens > KV_TOKENS_CAP:
            object.__setattr__(self, "max_tokens", KV_TOKENS_CAP)

    @property
    def kv_tokens(self) -> int:
        """KV the request needs at most on the endpoint that decodes it: its prompt and its whole output."""
        return self.num_tokens + self.max_tokens


class Candidate(NamedTuple):
    """An endpoint with its state, as filters and scorers see it: pairs avoid a dict lookup per endpoint per scorer."""

    endpoint: Endpoint
    state: EndpointState


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Every endpoint and its state at one moment, built by the proxy per scheduling call (or by the simulator).

    Endpoints are kept sorted by (pod, dp_rank, role) so round-robin and tie-breaks don't depend on the order the
    caller happened to list them in.
    """

    states: Mapping[Endpoint, EndpointState]
    taken_at: float = 0.0
    candidates: tuple[Candidate, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        items = sorted(self.states.items(), key=lambda kv: (kv[0].pod, kv[0].dp_rank, kv[0].role, kv[0].url))
        object.__setattr__(self, "states", MappingProxyType(dict(items)))
        object.__setattr__(self, "candidates", tuple(Candidate(ep, st) for ep, st in items))

    @classmethod
    def of(cls, pairs: Iterable[tuple[Endpoint, EndpointState]], taken_at: float = 0.0) -> Snapshot:
        return cls(dict(pairs), taken_at)

    @classmethod
    def of_ordered(cls, candidates: Sequence[Candidate], taken_at: float = 0.0) -> Snapshot:
        """A snapshot of candidates already in Snapshot's order (distinct endpoints, sorted as `__post_init__` sorts):
        the router core keeps its endpoints so, and a sort per decision over hundreds of them is not free."""
        snap = object.__new__(cls)
        object.__setattr__(snap, "states", MappingProxyType(dict(candidates)))
        object.__setattr__(snap, "taken_at", taken_at)
        object.__setattr__(snap, "candidates", tuple(candidates))
        return snap

    @classmethod
    def of_columns(cls, columns: Columns, taken_at: float = 0.0) -> Snapshot:
        """A snapshot kept as columns (the router core's): `states` and `candidates` are built when first read, the
        scheduler reads the columns."""
        snap = object.__new__(cls)
        object.__setattr__(snap, "taken_at", taken_at)
        snap.__dict__["_columns"] = columns
        return snap

    def __getattr__(self, name: str) -> Any:
        # Only for a snapshot made `of_columns`, whose states and candidates are not built until asked for.
        cols = self.__dict__.get("_columns")
        if cols is None or name not in ("states", "candidates"):
            raise AttributeError(name)
        cands = tuple(cols.candidate(i) for i in range(cols.n))
        object.__setattr__(self, "candidates", cands)
        object.__setattr__(self, "states", MappingProxyType(dict(cands)))
        return self.__dict__[name]

    @property
    def columns(self) -> Columns:
        """The candidates' fields as arrays, aligned with `candidates` (what the scheduler's pipeline reads)."""
        cols = self.__dict__.get("_columns")
        if cols is None:
            from llmd.router.scheduling.columns import Columns

            cols = self.__dict__["_columns"] = Columns.of(self.candidates)
        return cols

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(c.endpoint for c in self.candidates)

    def routable(self, hop: Hop) -> list[Candidate]:
        """The healthy candidates that may take `hop` (filters.routable), computed once per snapshot: the decode
        pipeline and the P/D decider's prefill pipeline both start from it."""
        memo: dict[Hop, list[Candidate]] = self.__dict__.setdefault("_routable", {})
        got = memo.get(hop)
        if got is None:
            roles = HOP_ROLES[hop]
            got = memo[hop] = [c for c in self.candidates if c.state.healthy and c.endpoint.role in roles]
        return got

    def state(self, endpoint: Endpoint) -> EndpointState:
        return self.states[endpoint]


@dataclass(frozen=True, slots=True)
class EndpointScore:
    """An endpoint's total score and its parts: weight x raw score per scorer, so `sum(parts.values()) == total`."""

    total: float
    parts: Mapping[str, float]


class ScoreTable(Mapping["Endpoint", EndpointScore]):
    """A decision's `scores`, built when first read: the candidates' endpoints, their totals and the weighted columns
    they were summed from. Routing reads only the totals; a dict of parts per candidate per request would cost more
    than the choice itself on a large fleet."""

    __slots__ = ("_columns", "_endpoints", "_idx", "_table", "_totals")

    def __init__(self, endpoints: Sequence[Endpoint], idx: Any, totals: Any, columns: Iterable[tuple[str, float, Any]]):
        """`endpoints[idx[k]]` is the k-th candidate; `totals` and each column's scores are aligned with `idx`
        (sequences or arrays of floats)."""
        self._endpoints = endpoints
        self._idx = idx
        self._totals = totals
        self._columns = columns
        self._table: dict[Endpoint, EndpointScore] | None = None

    def _built(self) -> dict[Endpoint, EndpointScore]:
        table = self._table
        if table is None:
            eps = [self._endpoints[i] for i in _floats_or_list(self._idx)]
            parts: list[dict[str, float]] = [{} for _ in eps]
            for name, weight, scores in self._columns:
                for p, sc in zip(parts, _floats_or_list(scores), strict=True):
                    p[name] = weight * sc
            totals = _floats_or_list(self._totals)
            table = self._table = {ep: EndpointScore(t, p) for ep, t, p in zip(eps, totals, parts, strict=True)}
        return table

    def __getitem__(self, endpoint: Endpoint) -> EndpointScore:
        return self._built()[endpoint]

    def __iter__(self) -> Iterator[Endpoint]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._idx)

    def __repr__(self) -> str:
        return repr(self._built())


def _floats_or_list(xs: Any) -> list[Any]:
    """An array's values as Python numbers (the same floats), a list as it is."""
    return xs.tolist() if hasattr(xs, "tolist") else list(xs)


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Disaggregate: prefill on `prefill`, then decode on the decision's target, which pulls the KV over NIXL.

    uncached_tokens: prompt tokens the decode endpoint would otherwise compute itself. The estimates are seconds to
    the first token's KV being ready on the decode endpoint (None under the threshold decider, which doesn't estimate).
    """

    prefill: Endpoint
    reason: str
    uncached_tokens: int
    est_disagg_s: float | None = None
    est_local_s: float | None = None
    cold: bool = False  # the prefill pod was placed as for a new session (no-hit LRU), not by its prefix


def holder_patience_s(each_s: float, queued: int) -> float:
    """How long, from when it began to wait, a request may wait for its prefix holder: the prefill it saves there
    (`each_s`, Decision.wait_each_s) once for itself and once for each of the `queued` others waiting, whom a
    recompute elsewhere would delay too (Scheduler._patient; the router core keeps a wait decided on it)."""
    return each_s * (1 + queued)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    target: the decode (or both-role) endpoint that serves the response.
    reason: "prefix-hit" (target holds the longest weighted prefix), "load" (a longer prefix elsewhere lost to load),
    "cold" (nobody holds any prefix), "p2p" (moved off an overloaded holder; pull from `p2p_source`),
    "only-healthy" (one candidate), or the policy name for round-robin / least-loaded / random.
    gpu_hit_tokens / cpu_hit_tokens: prompt tokens the target holds itself, per tier.
    p2p_tokens: prompt tokens the target pulls from `p2p_source` beyond its own hit.
    expected_hit_tokens: tokens the target will not compute: its own hits plus the P2P pull.
    pd: the prefill hop, or None for decode-only; pd_reason says why either way: the decider's name ("threshold",
        "queue-aware") when taken; "below-threshold", "local-faster", "p2p", "prefill-unhealthy" (a prefill pool, none
        of it healthy) when not; "" when no prefill pool exists.
    cold: no candidate held any prefix (feeds the no-hit-LRU scorer through `Scheduler.observe_routed`).
    wait_s: > 0 when the target has no room now (slots or KV) but holds enough of the prompt that waiting for it up
        to this many more seconds beats computing the prompt elsewhere; the caller holds the request and asks again.
    wait_each_s: with wait_s, the patience per request waiting: waiting for the target pays for wait_each_s x (1 +
        the other requests waiting) from when the request began to wait (wait_s is what is left of that now).
    """

    target: Endpoint
    reason: str
    scores: Mapping[Endpoint, EndpointScore]
    expected_hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    p2p_tokens: int = 0
    p2p_source: Endpoint | None = None
    pd: PDDecision | None = None
    pd_reason: str = ""
    cold: bool = False
    wait_s: float = 0.0
    wait_each_s: float = 0.0
