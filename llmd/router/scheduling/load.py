"""The load scorers: stateless scores of each candidate's engine load (queue, KV usage, waiting, uncached tokens).
Grouped in one module because each is a dozen lines over the same engine-state fields; a bigger scorer gets its own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmd.router.scheduling.fused import K_KVUTIL, K_LOAD, K_QUEUE, K_TOKENLOAD, Term, column
from llmd.router.scheduling.plugins import Input, ScorerPlugin, ScoringContext, register_scorer
from llmd.router.scheduling.state import Candidate

# llm-d's constants.
LOAD_AWARE_THRESHOLD = 128  # waiting requests at which the load-aware score reaches 0
TOKEN_LOAD_LIMIT = 4 * 2**20  # in-flight uncached tokens at which the token-load score reaches 0


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

    def term(self, ctx: ScoringContext) -> Term:
        assert ctx.columns is not None
        return (K_QUEUE, ctx.columns.waiting)

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


class KVUtilScorer:
    """1 - KV cache usage."""

    name = "kv-util"

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        # min(1.0, max(0.0, x)) without two calls per candidate (NaN -> 0.0, -0.0 -> 0.0, as there).
        free = [1.0 - c.state.kv_usage for c in cands]
        return [(x if x < 1.0 else 1.0) if x > 0.0 else 0.0 for x in free]

    def term(self, ctx: ScoringContext) -> Term:
        assert ctx.columns is not None
        return (K_KVUTIL, ctx.columns.kv_usage)

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


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

    def term(self, ctx: ScoringContext) -> Term:
        assert ctx.columns is not None
        return (K_LOAD, ctx.columns.waiting, self.threshold)

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


class TokenLoadScorer:
    """1 - min(1, (in-flight uncached prompt tokens + this request's uncached tokens there) / `limit`): the prefill
    work an endpoint would have with this request, as llm-d's token-load scorer counts it. Cache warmth lowers a
    request's cost on a warm endpoint in the same units as the load it is weighed against (the policy's prefix
    source's hits, `ctx.hits`, whichever inputs that one reads)."""

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

    def term(self, ctx: ScoringContext) -> Term:
        assert ctx.columns is not None
        hits = ctx.hit_cols.tokens if ctx.hit_cols is not None else None
        return (K_TOKENLOAD, ctx.columns.inflight_tokens, hits, max(0, ctx.req.num_tokens), self.limit)

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


_ENGINE: frozenset[Input] = frozenset({"engine_state"})
register_scorer(ScorerPlugin("kv-util", lambda s: KVUtilScorer(), _ENGINE))
register_scorer(ScorerPlugin("queue", lambda s: QueueScorer(), _ENGINE))
register_scorer(ScorerPlugin("load-aware", lambda s: LoadAwareScorer(s.tuning.load_aware_threshold), _ENGINE))
register_scorer(ScorerPlugin("token-load", lambda s: TokenLoadScorer(s.tuning.token_load_limit), _ENGINE))
