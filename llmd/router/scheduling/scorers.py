"""Scorers: each gives every candidate a score in [0, 1] (higher is better); the pipeline weights and sums them.

Each scorer is small and testable alone: `score(ctx, cands) -> list[float]`, aligned with `cands`. The two prefix
scorers also expose `hits(ctx)`, memoised in the context, which the pipeline reuses for the decision's hit counts,
cold detection, P2P and P/D, so the KV index is queried once per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from llmd.router.scheduling.approximate import ApproxPrefixCache
from llmd.router.scheduling.speculative import SpeculativeIndex
from llmd.router.scheduling.state import Candidate, Holder, RouteRequest

if TYPE_CHECKING:
    from llmd.kv.index import KVIndex

# llm-d's constants.
LOAD_AWARE_THRESHOLD = 128  # waiting requests at which the load-aware score reaches 0
TOKEN_LOAD_LIMIT = 4 * 2**20  # in-flight uncached tokens at which the token-load score reaches 0


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

    hits: the primary prefix source's hits (set by the pipeline; None: no prefix source). cold: no candidate holds
    any prefix (set by the pipeline; None: unknown, treated as cold). memo: per-call caches keyed by scorer name.
    """

    req: RouteRequest
    now: float = 0.0
    index: KVIndex | None = None
    hits: PrefixHits | None = None
    cold: bool | None = None
    memo: dict[str, Any] = field(default_factory=dict)


class Scorer(Protocol):
    name: str

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]: ...


def _tier_norm(gpu_w: float, cpu_w: float) -> float:
    # Weights above 1 would push scores past 1; dividing by the largest keeps [0, 1] and the ranking.
    return max(1.0, gpu_w, cpu_w)


def prefix_scores(hits: PrefixHits, cands: Sequence[Candidate], gpu_w: float, cpu_w: float) -> list[float]:
    """Each candidate's tier-weighted cached share of the request, in [0, 1]."""
    n = hits.units
    by = hits.by_holder
    if not n or not by:
        return [0.0] * len(cands)
    scale = 1.0 / (n * _tier_norm(gpu_w, cpu_w))
    out = []
    for c in cands:
        h = by.get(c.endpoint.holder)
        out.append(min(1.0, (h.gpu * gpu_w + h.cpu * cpu_w) * scale) if h is not None else 0.0)
    return out


class PrecisePrefixScorer:
    """llm-d's precise prefix scorer: the KV index's longest consecutive cached prefix per holder, GPU blocks
    weighted `gpu_w` and CPU-only blocks `cpu_w`, over the request's block count.

    Speculative entries count as GPU blocks: a holder's GPU prefix is the longer of its real and speculative ones
    (blocks the real index has past a speculative prefix keep their tiers).
    """

    name = "prefix"

    def __init__(self, speculative: SpeculativeIndex | None = None, gpu_w: float = 1.0, cpu_w: float = 0.8) -> None:
        self.speculative = speculative
        self.gpu_w = gpu_w
        self.cpu_w = cpu_w

    def hits(self, ctx: ScoringContext) -> PrefixHits:
        memo = ctx.memo.get(self.name)
        if memo is not None:
            return memo  # type: ignore[no-any-return]
        req = ctx.req
        hashes = req.block_hashes
        n = len(hashes)
        by: dict[Holder, PrefixHit] = {}
        if n:
            bs = req.block_size
            cap = req.num_tokens if req.num_tokens > 0 else n * bs
            matches = ctx.index.query(hashes) if ctx.index is not None else []
            spec: dict[Holder, int] = {}
            if self.speculative is not None:
                spec = self.speculative.match(hashes, ctx.now, {m.holder: m.blocks_gpu for m in matches})
            for m in matches:
                held, gpu = m.blocks_any, m.blocks_gpu
                s = spec.pop(m.holder, 0)  # 0, or a speculative GPU prefix longer than the real GPU blocks
                if s >= held:
                    held = gpu = s
                elif s:
                    # Which real GPU blocks lie past the speculative prefix is unknown: count the speculative ones
                    # only (a lower bound on the GPU share).
                    gpu = s
                gpu_t = min(cap, gpu * bs)
                by[m.holder] = PrefixHit(gpu, held - gpu, gpu_t, min(cap, held * bs) - gpu_t)
            for holder, s in spec.items():
                by[holder] = PrefixHit(s, 0, min(cap, s * bs), 0)
        out = PrefixHits(by, n)
        ctx.memo[self.name] = out
        return out

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        return prefix_scores(self.hits(ctx), cands, self.gpu_w, self.cpu_w)


class ApproximatePrefixScorer:
    """llm-d's approximate prefix scorer, CPU tier included: the longest run of the request's text chunks the router
    remembers sending to each endpoint, over the request's chunk count; chunks only in the CPU part weigh `cpu_w`."""

    name = "approximate-prefix"

    def __init__(self, cache: ApproxPrefixCache, gpu_w: float = 1.0, cpu_w: float = 0.8) -> None:
        self.cache = cache
        self.gpu_w = gpu_w
        self.cpu_w = cpu_w

    def hits(self, ctx: ScoringContext) -> PrefixHits:
        memo = ctx.memo.get(self.name)
        if memo is not None:
            return memo  # type: ignore[no-any-return]
        req = ctx.req
        chain = req.text_chunk_hashes
        per_chunk = self.cache.tokens_per_chunk()
        cap = req.num_tokens if req.num_tokens > 0 else int(len(chain) * per_chunk)
        by: dict[Holder, PrefixHit] = {}
        for holder, (held, gpu) in self.cache.matches(chain).items():
            if held:
                gpu_t = min(cap, int(gpu * per_chunk))
                by[holder] = PrefixHit(gpu, held - gpu, gpu_t, min(cap, int(held * per_chunk)) - gpu_t)
        out = PrefixHits(by, len(chain))
        ctx.memo[self.name] = out
        return out

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        return prefix_scores(self.hits(ctx), cands, self.gpu_w, self.cpu_w)


class QueueScorer:
    """(maxQ - q) / (maxQ - minQ) over the candidates' engine queues; 1.0 for all when they are equal."""

    name = "queue"

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        qs = [c.state.waiting for c in cands]
        if not qs:
            return []
        lo, hi = min(qs), max(qs)
        if hi == lo:
            return [1.0] * len(qs)
        span = hi - lo
        return [(hi - q) / span for q in qs]


class KVUtilScorer:
    """1 - KV cache usage."""

    name = "kv-util"

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - c.state.kv_usage)) for c in cands]


class LoadAwareScorer:
    """llm-d's load-aware scorer: 0.5 at an empty queue falling linearly to 0 at `threshold` waiting requests.
    (Its 0.5 ceiling is llm-d's: a loaded-but-under-threshold endpoint never beats an idle one by much.)"""

    name = "load-aware"

    def __init__(self, threshold: int = LOAD_AWARE_THRESHOLD) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        self.threshold = threshold

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        t = self.threshold
        return [0.5 * max(0.0, 1.0 - max(0, c.state.waiting) / t) for c in cands]


class TokenLoadScorer:
    """1 - min(1, (in-flight uncached prompt tokens + this request's uncached tokens there) / `limit`): the prefill
    work an endpoint would have with this request, as llm-d's token-load scorer counts it. Cache warmth lowers a
    request's cost on a warm endpoint in the same units as the load it is weighed against."""

    name = "token-load"

    def __init__(self, limit: int = TOKEN_LOAD_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        lim = self.limit
        n = max(0, ctx.req.num_tokens)
        by = ctx.hits.by_holder if ctx.hits is not None else {}
        out = []
        for c in cands:
            h = by.get(c.endpoint.holder)
            own = n - h.tokens if h is not None else n
            out.append(1.0 - min(1.0, (max(0, c.state.inflight_tokens) + max(0, own)) / lim))
        return out


class NoHitLRUScorer:
    """Spreads cold requests (no candidate holds any prefix): endpoints never given a cold request score 1, the
    others by how long ago they got one, least recent highest. Warm requests: 0.5 for all (neutral).

    Stateful: `record_cold` is called by `Scheduler.observe_routed` for cold decisions.
    """

    name = "no-hit-lru"

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[Holder, int] = {}

    def record_cold(self, holder: Holder) -> None:
        self._clock += 1
        self._last[holder] = self._clock

    def forget_pod(self, pod: str) -> None:
        for holder in [h for h in self._last if h[0] == pod]:
            del self._last[holder]

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        n = len(cands)
        if ctx.cold is False:
            return [0.5] * n
        last = self._last
        stamps = [last.get(c.endpoint.holder, 0) for c in cands]
        used = sorted({s for s in stamps if s})
        if not used:
            return [1.0] * n
        # the least recently used of m used endpoints scores m/(m+1), the most recent 1/(m+1); never used: 1
        m = len(used)
        rank = {s: i for i, s in enumerate(used)}
        return [1.0 if not s else (m - rank[s]) / (m + 1) for s in stamps]
