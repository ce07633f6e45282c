"""The prefix scorers: precise (the engines' KV events plus speculative entries) and approximate (the text the router
sent where). Grouped in one module because they share `prefix_scores` and are the pipeline's prefix sources (`hits`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from llmd.router.scheduling import fused
from llmd.router.scheduling.approximate import ApproxPrefixCache
from llmd.router.scheduling.columns import I64, HitColumns
from llmd.router.scheduling.fused import K_CONST, K_PREFIX, Term, column
from llmd.router.scheduling.plugins import (
    PrefixHit,
    PrefixHits,
    ScorerPlugin,
    ScorerSetup,
    ScoringContext,
    register_scorer,
)
from llmd.router.scheduling.speculative import SpeculativeIndex
from llmd.router.scheduling.state import Candidate, Decision, Holder, RouteRequest

_NONE = np.zeros(1, I64)  # an index's answer where there is no index: nothing held by anyone (id -1 reads it)
_NONE.flags.writeable = False


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


def routed_holders(decision: Decision) -> list[Holder]:
    """The holders a routed request leaves its prompt's KV on: the decode target, and with P/D the prefill pod too."""
    if decision.pd is None:
        return [decision.target.holder]
    return [decision.target.holder, decision.pd.prefill.holder]


class _PrefixScorer:
    """What the two prefix scorers share: tier weights, hits memoised per request (the pipeline and the scorer column
    ask for them; the source is queried once), and the score from the hits."""

    name: str

    def __init__(self, gpu_w: float, cpu_w: float) -> None:
        self.gpu_w = gpu_w
        self.cpu_w = cpu_w

    def hits(self, ctx: ScoringContext) -> PrefixHits:
        memo: PrefixHits | None = ctx.memo.get(self.name)
        if memo is None:
            memo = ctx.memo[self.name] = self._hits(ctx)
        return memo

    def _hits(self, ctx: ScoringContext) -> PrefixHits:
        raise NotImplementedError

    def hit_columns(self, ctx: ScoringContext) -> HitColumns:
        """`hits` aligned with ctx.columns, memoised likewise."""
        key = self.name + "/columns"
        memo: HitColumns | None = ctx.memo.get(key)
        if memo is None:
            memo = ctx.memo[key] = self._hit_columns(ctx)
        return memo

    def _hit_columns(self, ctx: ScoringContext) -> HitColumns:
        assert ctx.columns is not None
        hits = self.hits(ctx)
        return HitColumns.of(hits.by_holder, ctx.columns.holders, hits.units)

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        return prefix_scores(self.hits(ctx), cands, self.gpu_w, self.cpu_w)

    def term(self, ctx: ScoringContext) -> Term:
        """prefix_scores over the columns (a holder without a hit scores (0 * gpu_w + 0 * cpu_w) * scale = 0.0)."""
        hc = self.hit_columns(ctx)
        if not hc.units:
            return (K_CONST, 0.0)
        scale = 1.0 / (hc.units * _tier_norm(self.gpu_w, self.cpu_w))
        return (K_PREFIX, hc.gpu, hc.cpu, self.gpu_w, self.cpu_w, scale)

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


class PrecisePrefixScorer(_PrefixScorer):
    """llm-d's precise prefix scorer: the KV index's longest consecutive cached prefix per holder, GPU blocks
    weighted `gpu_w` and CPU-only blocks `cpu_w`, over the request's block count.

    Speculative entries count as GPU blocks: a holder's GPU prefix is the longer of its real and speculative ones
    (blocks the real index has past a speculative prefix keep their tiers).
    """

    name = "prefix"

    def __init__(self, speculative: SpeculativeIndex | None = None, gpu_w: float = 1.0, cpu_w: float = 0.8) -> None:
        super().__init__(gpu_w, cpu_w)
        self.speculative = speculative

    def _hits(self, ctx: ScoringContext) -> PrefixHits:
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
                floor = {holder: gpu for holder, _, gpu, _ in matches}
                spec = self.speculative.match(hashes, ctx.now, floor)
            pop = spec.pop if spec else None
            made: dict[int, PrefixHit] = {}  # most holders hold the same prefix (a shared system prompt): one hit each
            for holder, held, gpu, _ in matches:
                if pop is not None:
                    s = pop(holder, 0)  # 0, or a speculative GPU prefix longer than the real GPU blocks
                    if s >= held:
                        held = gpu = s
                    elif s:
                        # Which real GPU blocks lie past the speculative prefix is unknown: count the speculative
                        # ones only (a lower bound on the GPU share).
                        gpu = s
                key = held << 32 | gpu
                hit = made.get(key)
                if hit is None:
                    gpu_t = min(cap, gpu * bs)
                    hit = made[key] = PrefixHit(gpu, held - gpu, gpu_t, min(cap, held * bs) - gpu_t)
                by[holder] = hit
            for holder, s in spec.items():
                by[holder] = PrefixHit(s, 0, min(cap, s * bs), 0)
        return PrefixHits(by, n)

    def _hit_columns(self, ctx: ScoringContext) -> HitColumns:
        """`_hits` as columns: the index's and the speculative entries' answers by holder id gathered into them (no
        PrefixHit, and no Python step, per holder)."""
        cols = ctx.columns
        assert cols is not None
        req = ctx.req
        hashes = req.block_hashes
        n = len(hashes)
        m = cols.n
        if not n:
            held = np.zeros(m, I64)
            return HitColumns(0, np.zeros(m, bool), held, held, held, held)
        bs = req.block_size
        cap = req.num_tokens if req.num_tokens > 0 else n * bs
        if ctx.index is not None:
            got = ctx.index.query_columns(hashes)
            blocks_any, blocks_gpu, ids = got.blocks_any, got.blocks_gpu, cols.holder_ids(ctx.index)
        else:
            blocks_any = blocks_gpu = _NONE
            ids = np.full(m, -1, np.intp)
        spec = self.speculative
        s = spec_ids = None
        if spec is not None:
            s, spec_ids = spec.match_ids(hashes, ctx.now), cols.holder_ids(spec)
        return HitColumns(n, *fused.hits(blocks_any, blocks_gpu, ids, s, spec_ids, cap, bs))

    def observe_routed(
        self, req: RouteRequest, decision: Decision, now: float, capacity: Mapping[Holder, tuple[int, int]]
    ) -> None:
        """Speculative entries for where the request went, until the engines' KV events take over."""
        spec = self.speculative
        if spec is None or spec.ttl_s <= 0:
            return
        for holder in routed_holders(decision):
            spec.insert(holder, req.block_hashes, now)

    def observe_computed(self, holder: Holder, block_hashes: Sequence[int], routed_at: float, now: float) -> None:
        """The holder computed the request: its speculative entries give way to its KV events (`settle`)."""
        if self.speculative is not None:
            self.speculative.settle(holder, block_hashes, routed_at, now)

    def forget_pod(self, pod: str) -> None:
        if self.speculative is not None:
            self.speculative.forget_pod(pod)


class ApproximatePrefixScorer(_PrefixScorer):
    """llm-d's approximate prefix scorer, CPU tier included: the longest run of the request's text chunks the router
    remembers sending to each endpoint, over the request's chunk count; chunks only in the CPU part weigh `cpu_w`."""

    name = "approximate-prefix"

    def __init__(self, cache: ApproxPrefixCache, gpu_w: float = 1.0, cpu_w: float = 0.8) -> None:
        super().__init__(gpu_w, cpu_w)
        self.cache = cache

    def _hits(self, ctx: ScoringContext) -> PrefixHits:
        req = ctx.req
        chain = req.text_chunk_hashes
        per_chunk = self.cache.tokens_per_chunk()
        cap = req.num_tokens if req.num_tokens > 0 else int(len(chain) * per_chunk)
        by: dict[Holder, PrefixHit] = {}
        for holder, (held, gpu) in self.cache.matches(chain).items():
            if held:
                gpu_t = min(cap, int(gpu * per_chunk))
                by[holder] = PrefixHit(gpu, held - gpu, gpu_t, min(cap, int(held * per_chunk)) - gpu_t)
        return PrefixHits(by, len(chain))

    def observe_routed(
        self, req: RouteRequest, decision: Decision, now: float, capacity: Mapping[Holder, tuple[int, int]]
    ) -> None:
        """Remember the text sent to each holder, its LRU sized to the KV capacity last seen there."""
        for holder in routed_holders(decision):
            gpu, cpu = capacity.get(holder, (0, 0))
            self.cache.record(holder, req.text_chunk_hashes, gpu, cpu, req.block_size)

    def forget_pod(self, pod: str) -> None:
        self.cache.forget_pod(pod)


def _precise(s: ScorerSetup) -> PrecisePrefixScorer:
    spec = SpeculativeIndex(s.config.speculative_ttl_s, s.tuning.speculative_max_blocks)
    return PrecisePrefixScorer(spec, s.gpu_w, s.cpu_w)


def _approximate(s: ScorerSetup) -> ApproximatePrefixScorer:
    t = s.tuning
    cache = ApproxPrefixCache(t.chunk_chars, t.chars_per_token, t.approx_default_gpu_blocks, t.approx_cpu_tier)
    return ApproximatePrefixScorer(cache, s.gpu_w, s.cpu_w)


register_scorer(ScorerPlugin("prefix", _precise, frozenset({"tokens", "kv_index"}), prefix=True))
register_scorer(ScorerPlugin("approximate-prefix", _approximate, frozenset({"text"}), prefix=True))
