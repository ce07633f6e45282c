"""Policies -> pipelines, and the `Scheduler` the proxy and the simulator both call.

A decode hop runs: filters (healthy, role, has-capacity, kv-room) -> scorers (weighted, from the policy and
RouterSpec.weights) -> picker; then P2P (move off an overloaded prefix holder) and the P/D decider (which runs the same
pipeline over the prefill pool to choose the prefill endpoint). Policies:
- precise: the precise prefix scorer under the "prefix" weight (KV index + speculative entries), plus the load
  scorers as weighted; an "approximate-prefix" weight, if given, adds that scorer too.
- approximate: the approximate prefix scorer under the "approximate-prefix" weight, or the "prefix" weight when that
  is absent (so the default weights work for both policies); no engine state, no speculative entries, no P2P.
- round-robin, least-loaded (fewest in-flight + waiting), random: no scorers; the KV index (when given) still
  informs hit counts and the P/D decision.
With RouterSpec.affinity_threshold > 0 the scoring policies first keep only the endpoints whose prefix score reaches
it (llm-d's prefix-cache affinity filter, load-gated by max_ttft_penalty_s); llm-d's newer decode profile is that
filter at 0.80 with the token-load scorer alone (`weights: {token-load: 1}`).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from llmd.router.scheduling import filters, fused
from llmd.router.scheduling.columns import Columns, HitColumns
from llmd.router.scheduling.load import LOAD_AWARE_THRESHOLD, TOKEN_LOAD_LIMIT
from llmd.router.scheduling.pd import (
    ConstantRateModel,
    CostModel,
    P2PChoice,
    PDInputs,
    decide_p2p_columns,
    decide_queue_aware,
    decide_threshold,
)
from llmd.router.scheduling.picker import choose, column_totals_array, pick_max_array, pick_min
from llmd.router.scheduling.plugins import (
    FILTERS,
    SCORERS,
    Input,
    Learner,
    Scorer,
    ScorerSetup,
    ScoringContext,
    scorer_names,
)
from llmd.router.scheduling.prefix import ApproximatePrefixScorer, PrecisePrefixScorer
from llmd.router.scheduling.state import (
    Candidate,
    Decision,
    Endpoint,
    EndpointScore,
    Holder,
    Hop,
    NoEndpointError,
    PDDecision,
    RouteRequest,
    ScoreTable,
    Snapshot,
    holder_patience_s,
)

if TYPE_CHECKING:
    from llmd.router.scheduling.columns import IndexReader

POLICIES = ("precise", "approximate", "round-robin", "least-loaded", "random")
_SCORING = frozenset({"precise", "approximate"})


class RouterSettings(Protocol):
    """The RouterSpec fields the scheduler reads (llmd.spec.model.RouterSpec fits)."""

    policy: str
    weights: Mapping[str, float]
    tier_weights: Mapping[str, float]
    pd_decider: str
    pd_threshold: int
    p2p: bool
    max_inflight_per_pod: int
    speculative_ttl_s: float


@dataclass(frozen=True, slots=True)
class Tuning:
    """Knobs not in RouterSpec, with defaults that follow llm-d where it has one.

    chunk_chars / chars_per_token: the approximate scorer's text chunks and how they map to KV blocks.
    approx_default_gpu_blocks: its per-endpoint GPU capacity when the snapshot doesn't know it.
    approx_cpu_tier: False sizes its LRU to the GPU tier only, as llm-d does (for comparisons).
    p2p_max_waiting: engine queue length at which a prefix holder counts as overloaded (besides being full).
    p2p_load_ratio: a P2P target's in-flight + waiting must be at most this share of the holder's.
    token_budget: tokens per chunked-prefill step (vLLM's max_num_batched_tokens), for the queue-aware estimates.
    holder_patience: a prefix holder without room (slots or KV) stays a candidate while the request has waited less
    than the prefill time its hit saves over the best endpoint with room, times (1 + the requests queued besides it)
    (delay scheduling: waiting for the holder beats recomputing the prefix elsewhere, and evicting other sessions'
    prefixes there to make room for it; in a saturated fleet that recompute delays everyone queued).
    time_scale: wall seconds per model second (simulated engines may run faster or slower than real time), for
    comparing model times with the wall-clock time a request has waited.
    """

    chunk_chars: int = 256
    chars_per_token: float = 4.0
    approx_default_gpu_blocks: int = 100_000
    approx_cpu_tier: bool = True
    speculative_max_blocks: int = 1_000_000
    load_aware_threshold: int = LOAD_AWARE_THRESHOLD
    token_load_limit: int = TOKEN_LOAD_LIMIT
    capacity_filter: bool = True
    p2p_max_waiting: int = 16
    p2p_load_ratio: float = 0.5
    token_budget: int = 8192
    holder_patience: bool = True
    time_scale: float = 1.0


class Scheduler:
    """The routing decision for each request, deterministic for a given seed and sequence of calls.

    `latency`: the decode pool's cost model for the queue-aware P/D decider (a LatencyModel, or anything with
    `prefill_time` and `kv_transfer_time`); `prefill_latency`: the prefill pool's (default: `latency`). Without
    either the decider uses `ConstantRateModel`'s fixed token rates.
    """

    def __init__(
        self,
        config: RouterSettings,
        seed: int = 0,
        *,
        latency: CostModel | None = None,
        prefill_latency: CostModel | None = None,
        tuning: Tuning | None = None,
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown router policy {config.policy!r}; expected one of {', '.join(POLICIES)}")
        # Resolved once here: the per-request path reads only the instances and columns built below.
        known = scorer_names()
        unknown = sorted(set(config.weights) - set(known))
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
        if config.pd_decider not in ("threshold", "queue-aware"):
            raise ValueError(f"unknown pd_decider {config.pd_decider!r}; expected threshold or queue-aware")
        self.config = config
        self.tuning = t = tuning or Tuning()
        self.policy = config.policy
        # llm-d's prefix-cache affinity filter (0: off) and its load gate.
        self.affinity = float(getattr(config, "affinity_threshold", 0.0))
        self.max_ttft_penalty_s = float(getattr(config, "max_ttft_penalty_s", 18.0))
        self.gpu_w = float(config.tier_weights.get("gpu", 1.0))
        self.cpu_w = float(config.tier_weights.get("cpu", 0.8))
        self._setup = ScorerSetup(config, t, self.gpu_w, self.cpu_w)
        self._scorers: dict[str, Scorer] = {}  # one instance per registered name in use, shared by its roles
        # The two prefix sources are always built: the policy's one backs hit counts, cold detection, P2P and P/D.
        self.precise: PrecisePrefixScorer = self._scorer("prefix")  # type: ignore[assignment]
        self.approximate: ApproximatePrefixScorer = self._scorer("approximate-prefix")  # type: ignore[assignment]
        self.speculative = self.precise.speculative
        self.approx_cache = self.approximate.cache
        self.decode_model: CostModel = latency or ConstantRateModel()
        self.prefill_model: CostModel = prefill_latency or self.decode_model
        self.columns: tuple[tuple[str, float, Scorer], ...] = self._columns(config.weights, known)
        self._primary: PrecisePrefixScorer | ApproximatePrefixScorer = (
            self.approximate if self.policy == "approximate" else self.precise
        )
        plugins = [SCORERS[name] for name, _, _ in self.columns]
        # A cold request is placed by the cold spreader (the no-hit LRU) and load alone when one is in use: where a
        # shared prefix happens to sit says nothing about where its session should live.
        spread = any(p.spreads_cold for p in plugins)
        self._cold_columns = tuple(c for c, p in zip(self.columns, plugins, strict=True) if not (spread and p.prefix))
        # Per pass (warm, cold): names, weights and each scorer's `term` (None where a scorer has none: then each
        # scores its own column in numpy).
        self._passes = {cold: _pass(c) for cold, c in ((False, self.columns), (True, self._cold_columns))}
        # Learning: the scorers in use, and the precise policy's prefix source even without a weight (its speculative
        # entries back the hit counts the load scorers, P2P and P/D read). Without a weight the approximate source does
        # not learn, as before the registry.
        in_use = [scorer for _, _, scorer in self.columns]
        if self._primary is self.precise:
            in_use.append(self.precise)
        self._learners: tuple[Learner, ...] = tuple({id(s): s for s in in_use if isinstance(s, Learner)}.values())
        # The learners that also guess what an endpoint holds until its KV events say so (called per hop end).
        self._on_computed = tuple(
            hook for hook in (getattr(x, "observe_computed", None) for x in self._learners) if hook is not None
        )
        run = ["routable", *(("has-capacity", "kv-room") if t.capacity_filter else ())]
        if self.affinity > 0 and self.policy in _SCORING:
            run.append("prefix-affinity")
        primary = "approximate-prefix" if self._primary is self.approximate else "prefix"
        consumed = [SCORERS[primary].consumes, *(p.consumes for p in plugins), *(FILTERS[f].consumes for f in run)]
        self.inputs: frozenset[Input] = frozenset().union(*consumed)
        self._rng = random.Random(seed)
        self._rr: dict[Hop, int] = {"decode": 0, "prefill": 0}
        self._capacity: dict[Holder, tuple[int, int]] = {}  # (GPU, CPU) blocks, as last seen when routed to
        # Sessions routed before (bounded, oldest forgotten first): a new session is placed, an old one followed.
        self._sessions: OrderedDict[str, None] = OrderedDict()
        self._max_sessions = 1_000_000

    def _scorer(self, name: str) -> Scorer:
        scorer = self._scorers.get(name)
        if scorer is None:
            scorer = self._scorers[name] = SCORERS[name].factory(self._setup)
        return scorer

    def _columns(self, weights: Mapping[str, float], order: Sequence[str]) -> tuple[tuple[str, float, Scorer], ...]:
        if self.policy not in _SCORING:
            return ()
        w = dict(weights)
        if self.policy == "approximate":
            w["approximate-prefix"] = w.get("approximate-prefix", w.pop("prefix", 0.0))
            w.pop("prefix", None)
        # Registry order, not the caller's dict order: the parts of a total are summed in one fixed order.
        return tuple((name, float(w[name]), self._scorer(name)) for name in order if w.get(name, 0.0) > 0)

    @property
    def weights(self) -> dict[str, float]:
        """The scorers in effect and their weights (empty for the non-scoring policies)."""
        return {name: weight for name, weight, _ in self.columns}

    # --- scheduling ---------------------------------------------------------------------------------------------

    def schedule(
        self,
        req: RouteRequest,
        snapshot: Snapshot,
        index: IndexReader | None = None,
        now: float = 0.0,
        waited_s: float = 0.0,
        queued: int = 0,
    ) -> Decision:
        """Choose the decode endpoint, and the prefill endpoint or P2P source if any. Raises NoEndpointError when no
        healthy decode-capable endpoint exists. Reads `index`; advances the scheduler's RNG and round-robin position
        and notes the chosen endpoints' KV capacity (learning from the decision is `observe_routed`'s job).
        `waited_s`: how long the request has waited for room so far; a target without room comes with `wait_s`, how
        much longer it is worth waiting for (the caller holds the request meanwhile and asks again). `queued`: other
        requests waiting for room in the caller's queue (the fleet is saturated while there are any).

        Runs over the snapshot's columns: candidates are positions in it, filters are masks, scorers with
        `score_columns` vector ops; an EndpointState is read only for the endpoints the decision names."""
        cfg = self.config
        cols = snapshot.columns
        role_ok = cols.routable("decode")
        if not len(role_ok):
            raise NoEndpointError("no healthy decode endpoint")
        ctx = ScoringContext(req, now, index, columns=cols)
        ctx.hit_cols = hc = self._primary.hit_columns(ctx)  # without an index: speculative entries alone
        hop = self._hop(hc, role_ok)
        ctx.cold = self._cold(req, hc, hop)
        cands = role_ok
        patience: dict[Holder, tuple[float, float]] = {}
        if self.tuning.capacity_filter:
            cands = self._with_room(cols, cands, req.kv_tokens, req.block_size)
            if len(cands) < len(role_ok) and self.tuning.holder_patience and self.policy in _SCORING:
                cands, patience = self._patient(cols, hc, role_ok, cands, waited_s, queued)
        if self.affinity > 0 and self.policy in _SCORING and len(cands) > 1:
            scale = self.tuning.time_scale
            ttft = [self.decode_model.prefill_time(t) * scale for t in cols.inflight_tokens[cands].tolist()]
            prefix_scores = fused.column(self._primary.term(ctx), cands).tolist()
            keep = filters.prefix_affinity(
                range(len(cands)), prefix_scores, self.affinity, ttft, self.max_ttft_penalty_s
            )
            cands = cands[np.array(keep, dtype=np.intp)]

        i, totals, columns = self._pick("decode", ctx, cands)
        t = int(cands[i])
        reason = self._reason(hc, hop, len(role_ok), t, ctx.cold)

        p2p = None
        if cfg.p2p and self.policy == "precise" and not ctx.cold and len(role_ok) > 1 and totals is not None:
            p2p = self._p2p(cols, hc, hop, i, cands, totals, role_ok)
            if p2p is not None:
                i = p2p.target
                t = int(cands[i])
                reason = "p2p"
        target = cols.candidate(t)
        gpu_t = int(hc.gpu_tokens[t])
        cpu_t = int(hc.cpu_tokens[t])
        pulled = p2p.pulled_tokens if p2p is not None else 0
        expected = gpu_t + cpu_t + pulled
        if req.num_tokens > 0:
            expected = min(expected, req.num_tokens)

        wait_s, wait_each_s = patience.get(target.endpoint.holder, (0.0, 0.0))
        pd, pd_reason = (None, "p2p") if p2p else self._pd(req, cols, ctx, target, expected)
        self._capacity[target.endpoint.holder] = (target.state.kv_capacity_blocks, target.state.cpu_capacity_blocks)
        scores: Mapping[Endpoint, EndpointScore] = {}
        if columns is not None and totals is not None:
            scores = ScoreTable(cols.endpoints, cands, totals, columns)
        return Decision(
            target=target.endpoint,
            reason=reason,
            scores=scores,
            expected_hit_tokens=expected,
            gpu_hit_tokens=gpu_t,
            cpu_hit_tokens=cpu_t,
            p2p_tokens=pulled,
            p2p_source=p2p.source if p2p else None,
            pd=pd,
            pd_reason=pd_reason,
            cold=bool(ctx.cold),
            wait_s=wait_s,
            wait_each_s=wait_each_s,
        )

    def _with_room(self, cols: Columns, idx: np.ndarray, need_tokens: int, block_size: int) -> np.ndarray:
        """filters.has_capacity then filters.kv_room: each keeps all when it would keep none."""
        slots, fit = cols.room(idx, self.config.max_inflight_per_pod, need_tokens, block_size)
        if not len(slots):
            slots, fit = cols.room(idx, None, need_tokens, block_size)
        return fit if len(fit) else slots

    def _patient(
        self,
        cols: Columns,
        hc: HitColumns,
        role_ok: np.ndarray,
        room: np.ndarray,
        waited_s: float,
        queued: int = 0,
    ) -> tuple[np.ndarray, dict[Holder, tuple[float, float]]]:
        """`room` (a strict subset of `role_ok`: called only when some endpoint lacks room and another has it) plus
        the endpoints without room whose cached prefix of this request still pays to wait for, less what the request
        has waited already. Sending it elsewhere recomputes that prefix there (and evicts other sessions' prefixes to
        hold it), while the holder frees room as its requests finish.

        What the recompute costs is the prefill time the extra hit saves over the best endpoint with room, paid once
        by this request when the fleet has room to spare. When `queued` other requests wait for room too, the fleet
        is saturated: GPU time is what everyone waits for, and a redundant prefill delays each of them by as much, so
        it costs (1 + queued) times that. (Measured with llmd's cluster simulator on benchmarks/routing_fleet.py's
        fleet, three seeds: at 2x KV pressure hit share 0.43 -> 0.50, req/s +4%; with a CPU tier 0.53 -> 0.73,
        req/s +11%; at 1x unchanged.) Returns the candidates (positions, ascending as `role_ok`) and each waiting
        one's remaining patience and its patience per request waiting (Decision.wait_each_s)."""
        tokens = hc.tokens
        best_room = self._hop(hc, room).best_tokens if len(room) else 0  # tokens are 0 where no hit
        longer = role_ok[tokens[role_ok] > best_room]  # none of `room`: theirs are at most best_room
        if not len(longer):
            return room, {}
        scale = self.tuning.time_scale
        holders = cols.holders
        keep: list[int] = []
        patience: dict[Holder, tuple[float, float]] = {}
        for i in longer.tolist():
            saved = int(tokens[i]) - best_room
            each = self.decode_model.prefill_time(saved, best_room) * scale
            left = holder_patience_s(each, queued) - waited_s
            if left > 0:
                keep.append(i)
                patience[holders[i]] = (left, each)
        if not keep:
            return room, patience
        return np.sort(np.concatenate([room, np.array(keep, dtype=room.dtype)])), patience

    def _hop(self, hc: HitColumns, idx: np.ndarray) -> fused.HopHits:
        """The hits over one hop's endpoints (positions `idx`), as _cold, _reason and _p2p read them."""
        return fused.summary(hc.has, hc.gpu, hc.cpu, hc.tokens, idx, self.gpu_w, self.cpu_w)

    def _cold(self, req: RouteRequest, hc: HitColumns, hop: fused.HopHits) -> bool:
        """Nothing to stick to on this hop (`hop`: the hits over its endpoints). Not only when no endpoint holds a
        prefix, but also when every endpoint holds the same one (the system prompt all agents share): the prefix
        scorer cannot tell them apart, and choosing by load alone piles new sessions onto whichever pods happen to
        look idle, overflowing their caches later. The no-hit-LRU scorer spreads such requests instead. Likewise a
        NEW session whose best hit is a minority of its prompt (a shared system prompt one pod happens to hold):
        following that hit would send every new agent to the same pod. A sub-agent forking its parent's context has
        a majority hit and still follows it. Compared in the prefix source's own units (blocks, or text chunks for
        the approximate scorer, which counts no tokens)."""
        if (hop.first and hop.all and hop.same_tokens) or not hop.any:
            return True
        if req.session_id is not None and req.session_id not in self._sessions:
            return 2 * hop.best_units < hc.units
        return False

    def _score(self, scorer: Scorer, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        by_columns = getattr(scorer, "score_columns", None)  # ColumnScorer (isinstance on a Protocol costs more)
        if by_columns is not None:
            return by_columns(ctx, idx)  # type: ignore[no-any-return]
        # A scorer with the list interface only: its candidates, and the hits it may read, built for it.
        if ctx.hits is None:
            ctx.hits = self._primary.hits(ctx)
        assert ctx.columns is not None
        return np.array(scorer.score(ctx, ctx.columns.candidates(idx)), dtype=np.float64)

    def _pick(
        self, hop: Hop, ctx: ScoringContext, idx: np.ndarray
    ) -> tuple[int, np.ndarray | None, Iterable[tuple[str, float, np.ndarray]] | None]:
        """Index into `idx` of the chosen candidate, with the totals and the weighted columns when the policy
        scores."""
        policy = self.policy
        if policy in _SCORING:
            cold = bool(ctx.cold)
            names, weights, terms = self._passes[cold]
            if terms is not None:  # every scorer describes its score as a term: one fused pass
                totals, scores, ties = fused.pick(idx, [term(ctx) for term in terms], weights)
                assert scores is not None
                return choose(ties, self._rng), totals, fused.WeightedRows(names, weights, scores)
            cols = self._cold_columns if cold else self.columns
            columns = [(name, weight, self._score(scorer, ctx, idx)) for name, weight, scorer in cols]
            totals = column_totals_array(len(idx), columns)
            return pick_max_array(totals, self._rng), totals, columns
        if policy == "round-robin":
            n = self._rr[hop]
            self._rr[hop] = n + 1
            return n % len(idx), None, None
        if policy == "least-loaded":
            assert ctx.columns is not None
            return pick_min(_loads(ctx.columns, idx).tolist(), self._rng), None, None
        return self._rng.randrange(len(idx)), None, None

    def _reason(self, hc: HitColumns, hop: fused.HopHits, n: int, target: int, cold: bool) -> str:
        if n == 1:
            return "only-healthy"
        if self.policy not in _SCORING:
            return self.policy
        if cold:
            return "cold"
        # Tier-weighted hit units; 0 * w + 0 * w = 0.0 where there is no hit, as `_weighted` of None.
        mine = float(hc.gpu[target]) * self.gpu_w + float(hc.cpu[target]) * self.cpu_w
        return "prefix-hit" if mine > 0 and mine >= hop.best_weighted else "load"

    def _p2p(
        self,
        cols: Columns,
        hc: HitColumns,
        hop: fused.HopHits,
        i: int,
        cands: np.ndarray,
        totals: np.ndarray,
        role_ok: np.ndarray,
    ) -> P2PChoice | None:
        cfg = self.config
        min_tokens = max(1, cfg.pd_threshold)
        best = hop.best_tokens
        if best < min_tokens:
            return None
        # The longest holder among every healthy decode endpoint, full ones included (they are the point); on a tie
        # the picker's choice, then the least loaded.
        holder = target = int(cands[i])
        if int(hc.tokens[target]) != best:
            ties = role_ok[hc.tokens[role_ok] == best]
            holder = int(ties[int(np.argmin(_loads(cols, ties)))])  # (argmin: the first least loaded, as min() takes)
        return decide_p2p_columns(
            i,
            cols,
            cands,
            totals,
            hc.tokens[cands],
            holder,
            best,
            min_tokens=min_tokens,
            max_inflight=cfg.max_inflight_per_pod,
            max_waiting=self.tuning.p2p_max_waiting,
            load_ratio=self.tuning.p2p_load_ratio,
        )

    def _pd(
        self, req: RouteRequest, cols: Columns, ctx: ScoringContext, target: Candidate, expected: int
    ) -> tuple[PDDecision | None, str]:
        cfg = self.config
        pre_ok = cols.routable("prefill")
        if not len(pre_ok):
            return None, "prefill-unhealthy" if cols.in_role("prefill") else ""
        if max(0, req.num_tokens - expected) < cfg.pd_threshold:
            return None, "below-threshold"  # decided before choosing a prefill endpoint: that costs a scoring pass
        pre = pre_ok
        if self.tuning.capacity_filter:
            pre = self._with_room(cols, pre, req.num_tokens, req.block_size)  # it holds the prompt until the pull
        hc = ctx.hit_cols
        assert hc is not None
        # The prefill pool is placed by the same rule as the decode pool: a new session is spread (no-hit LRU and
        # load), not sent to whichever prefill pod holds the shared system prompt; a known session follows its prefix.
        cold = self._cold(req, hc, self._hop(hc, pre_ok))
        pctx = ScoringContext(req, ctx.now, ctx.index, ctx.hits, cold, ctx.memo, cols, hc)
        j, _, _ = self._pick("prefill", pctx, pre)
        c = int(pre[j])
        chosen = cols.candidate(c)
        inp = PDInputs(target, chosen, req.num_tokens, expected, int(hc.tokens[c]))
        if cfg.pd_decider == "queue-aware":
            out = decide_queue_aware(
                inp, cfg.pd_threshold, self.decode_model, self.prefill_model, self.tuning.token_budget
            )
        else:
            out = decide_threshold(inp, cfg.pd_threshold)
        if out[0] is not None:
            p = out[0]
            out = (PDDecision(p.prefill, p.reason, p.uncached_tokens, p.est_disagg_s, p.est_local_s, cold), out[1])
            self._capacity[chosen.endpoint.holder] = (
                chosen.state.kv_capacity_blocks,
                chosen.state.cpu_capacity_blocks,
            )
        return out

    # --- learning -----------------------------------------------------------------------------------------------

    def observe_routed(self, req: RouteRequest, decision: Decision, now: float) -> None:
        """The request was sent as decided: the learning scorers in use remember it (speculative entries, the
        approximate LRU, the no-hit LRU: each plugin's `observe_routed`), and its session counts as known."""
        capacity = self._capacity
        for learner in self._learners:
            learner.observe_routed(req, decision, now, capacity)
        if req.session_id is not None:
            self._sessions[req.session_id] = None
            self._sessions.move_to_end(req.session_id)
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)

    def observe_computed(self, holder: Holder, block_hashes: Sequence[int], routed_at: float, now: float) -> None:
        """`holder` is done computing the prompt of a request routed to it at `routed_at` (the prefill hop ended, or
        the request did): learners that guess what it holds until its KV events say so stop guessing soon."""
        for computed in self._on_computed:
            computed(holder, block_hashes, routed_at, now)

    def advance(self, now: float) -> None:
        """Time has come to `now` for good (a caller whose clock only moves on: the router core): speculative entries
        expired by then are dropped. A decision otherwise sets expired entries aside for its answer (`match_ids` is
        read-only, so a query may come at any time) and the next insert drops them: an eighth of a short request's
        decision over a few endpoints, where one expires per request."""
        if self.speculative is not None:
            self.speculative.prune(now)

    def forget_pod(self, pod: str) -> None:
        """A pod left the fleet (or restarted empty): drop what the router remembered about it."""
        for scorer in self._scorers.values():
            if isinstance(scorer, Learner):
                scorer.forget_pod(pod)
        for holder in [h for h in self._capacity if h[0] == pod]:
            del self._capacity[holder]


def _pass(
    columns: Sequence[tuple[str, float, Scorer]],
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[Callable[[ScoringContext], fused.Term], ...] | None]:
    terms = tuple(getattr(scorer, "term", None) for _, _, scorer in columns)
    names = tuple(name for name, _, _ in columns)
    weights = tuple(weight for _, weight, _ in columns)
    return names, weights, None if None in terms else terms  # type: ignore[return-value]


def _loads(cols: Columns, idx: np.ndarray) -> np.ndarray:
    """pd.endpoint_load of the endpoints at `idx`: in flight plus waiting."""
    return np.maximum(0, cols.inflight[idx]) + np.maximum(0, cols.waiting[idx])


__all__ = ["POLICIES", "RouterSettings", "Scheduler", "Tuning"]
