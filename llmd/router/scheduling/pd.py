"""The two hops besides plain routing: prefill/decode disaggregation (P/D) and peer-to-peer prefix pulls (P2P).

P/D deciders: `threshold` (llm-d's: disaggregate when the decode endpoint would compute at least `pd_threshold`
uncached tokens) and `queue-aware` (also compares estimated times to the KV being ready: via the prefill pool,
counting its queue and the NIXL transfer, against prefilling locally behind the decode endpoint's own queue and
running batch). A fixed threshold is queue-blind; weighing the prefill queue is what cut TTFT 2-3x in simulation work.

P2P: when the endpoint holding the longest prefix is overloaded and a much less loaded one exists, route to the
latter and have it pull the prefix from the holder rather than recompute it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from llmd.router.scheduling.state import Candidate, Endpoint, EndpointState, PDDecision

if TYPE_CHECKING:
    from llmd.router.scheduling.columns import Columns


class CostModel(Protocol):
    """What the queue-aware decider needs from a latency model; `llmd.perf.latency.LatencyModel` fits."""

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def kv_transfer_time(self, num_tokens: int, same_node: bool) -> float: ...


@dataclass(frozen=True, slots=True)
class ConstantRateModel:
    """The fallback when no LatencyModel is given: fixed token rates. The defaults are rough figures for one DP
    rank of a large MoE on H100s (prefill ~20K tokens/s; MLA KV of ~70 KB/token over a ~20 GB/s effective NIC share
    ~250K tokens/s, NVLink ~10x). Only the comparison between the two paths matters, and both use the same rates."""

    prefill_tokens_per_s: float = 20_000.0
    transfer_tokens_per_s: float = 250_000.0
    nvlink_speedup: float = 10.0
    transfer_latency_s: float = 0.001

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return max(0, new_tokens) / self.prefill_tokens_per_s

    def kv_transfer_time(self, num_tokens: int, same_node: bool) -> float:
        if num_tokens <= 0:
            return 0.0
        rate = self.transfer_tokens_per_s * (self.nvlink_speedup if same_node else 1.0)
        return num_tokens / rate + self.transfer_latency_s


def same_node(a: Endpoint, b: Endpoint) -> bool:
    return a.node is not None and a.node == b.node


def prefill_backlog_tokens(state: EndpointState) -> int:
    """Prefill work queued ahead on a prefill-pool endpoint: everything in flight there is prefill (it returns after
    one token), so all its in-flight uncached tokens."""
    return max(0, state.inflight_tokens)


def decode_backlog_tokens(state: EndpointState) -> int:
    """Prefill work queued ahead on a decode endpoint: its waiting requests times the mean uncached tokens of what
    is in flight there (most of its in-flight requests are already decoding and owe no more prefill)."""
    if state.waiting <= 0 or state.inflight <= 0:
        return 0
    return int(state.waiting * state.inflight_tokens / state.inflight)


def estimate_local_s(model: CostModel, state: EndpointState, uncached: int, cached: int, token_budget: int) -> float:
    """Seconds until a decode endpoint has prefilled `uncached` tokens itself: its queued prefill work first, then
    ours, each chunked-prefill step sharing its token budget with one token per running sequence."""
    work = model.prefill_time(decode_backlog_tokens(state)) + model.prefill_time(uncached, cached)
    running = max(0, state.running)
    share = max(1, token_budget - running)
    return work * token_budget / share


def estimate_disagg_s(
    model: CostModel,
    prefill_state: EndpointState,
    uncached_on_prefill: int,
    cached_on_prefill: int,
    transfer_tokens: int,
    same_node_: bool,
) -> float:
    """Seconds until the KV is on the decode endpoint via the prefill pool: the prefill endpoint's backlog, our
    prefill there, then the NIXL pull of what the decode endpoint lacks."""
    return (
        model.prefill_time(prefill_backlog_tokens(prefill_state))
        + model.prefill_time(uncached_on_prefill, cached_on_prefill)
        + model.kv_transfer_time(transfer_tokens, same_node_)
    )


@dataclass(frozen=True, slots=True)
class PDInputs:
    """What a P/D decision is made over. `prefill` is the prefill endpoint the prefill pipeline chose."""

    decode: Candidate
    prefill: Candidate
    num_tokens: int
    decode_hit_tokens: int
    prefill_hit_tokens: int


def decide_threshold(inp: PDInputs, threshold: int) -> tuple[PDDecision | None, str]:
    uncached = max(0, inp.num_tokens - inp.decode_hit_tokens)
    if uncached < threshold:
        return None, "below-threshold"
    return PDDecision(inp.prefill.endpoint, "threshold", uncached), "threshold"


def decide_queue_aware(
    inp: PDInputs,
    threshold: int,
    decode_model: CostModel,
    prefill_model: CostModel,
    token_budget: int = 8192,
) -> tuple[PDDecision | None, str]:
    """Disaggregate iff past the threshold and the prefill path is estimated to be ready sooner than local prefill."""
    uncached = max(0, inp.num_tokens - inp.decode_hit_tokens)
    if uncached < threshold:
        return None, "below-threshold"
    local = estimate_local_s(decode_model, inp.decode.state, uncached, inp.decode_hit_tokens, token_budget)
    p_hit = min(inp.prefill_hit_tokens, inp.num_tokens)
    disagg = estimate_disagg_s(
        prefill_model,
        inp.prefill.state,
        inp.num_tokens - p_hit,
        p_hit,
        uncached,
        same_node(inp.prefill.endpoint, inp.decode.endpoint),
    )
    if disagg < local:
        return PDDecision(inp.prefill.endpoint, "queue-aware", uncached, disagg, local), "queue-aware"
    return None, "local-faster"


# --- P2P ------------------------------------------------------------------------------------------------------------


def endpoint_load(state: EndpointState) -> int:
    return max(0, state.inflight) + max(0, state.waiting)


def overloaded(state: EndpointState, max_inflight: int, max_waiting: int) -> bool:
    """Full by the router's count, or backed up in the engine's own queue (`max_waiting` waiting requests: the
    load-aware score would be down to 1 - max_waiting/128 of its best)."""
    return state.inflight >= max_inflight or state.waiting >= max_waiting


@dataclass(frozen=True, slots=True)
class P2PChoice:
    target: int  # index into the candidates the caller passed
    source: Endpoint
    pulled_tokens: int


def decide_p2p(
    target: int,
    cands: Sequence[Candidate],
    totals: Sequence[float],
    hit_tokens: Sequence[int],
    holder: Candidate,
    holder_tokens: int,
    *,
    min_tokens: int,
    max_inflight: int,
    max_waiting: int,
    load_ratio: float,
) -> P2PChoice | None:
    """Should the request go to a less loaded endpoint that pulls the prefix from `holder`?

    `cands`/`totals`/`hit_tokens`: the capacity-filtered candidates with their picker totals and own hit tokens;
    `target`: the picker's choice; `holder`: the endpoint with the longest prefix (it may have been filtered out for
    being full). Only when the holder is overloaded, the new target's load is at most `load_ratio` of the holder's,
    and the pull saves at least `min_tokens`. Keeps the picker's choice when it already qualifies, else takes the
    best-scored qualifying candidate.
    """
    hs = holder.state
    if not overloaded(hs, max_inflight, max_waiting):
        return None
    limit = load_ratio * endpoint_load(hs)

    def ok(i: int) -> bool:
        c = cands[i]
        return (
            c.endpoint != holder.endpoint
            and not overloaded(c.state, max_inflight, max_waiting)
            and endpoint_load(c.state) <= limit
            and holder_tokens - hit_tokens[i] >= min_tokens
        )

    if ok(target):
        best = target
    else:
        eligible = [i for i in range(len(cands)) if ok(i)]
        if not eligible:
            return None
        best = max(eligible, key=lambda i: (totals[i], -endpoint_load(cands[i].state), -i))
    return P2PChoice(best, holder.endpoint, holder_tokens - hit_tokens[best])


def decide_p2p_columns(
    target: int,
    cols: Columns,
    cands: np.ndarray,
    totals: np.ndarray,
    hit_tokens: np.ndarray,
    holder: int,
    holder_tokens: int,
    *,
    min_tokens: int,
    max_inflight: int,
    max_waiting: int,
    load_ratio: float,
) -> P2PChoice | None:
    """`decide_p2p` over a snapshot's columns: `cands` are the candidates' positions in `cols`, `holder` the
    holder's, `totals` and `hit_tokens` aligned with `cands`; `target` indexes `cands`. The same choice."""
    inflight, waiting = cols.inflight, cols.waiting
    if not (inflight[holder] >= max_inflight or waiting[holder] >= max_waiting):
        return None
    limit = load_ratio * (max(0, int(inflight[holder])) + max(0, int(waiting[holder])))
    fl, wt = inflight[cands], waiting[cands]
    load = np.maximum(0, fl) + np.maximum(0, wt)
    ok = (cands != holder) & (fl < max_inflight) & (wt < max_waiting) & (load <= limit)
    ok &= holder_tokens - hit_tokens >= min_tokens
    if ok[target]:
        best = target
    else:
        eligible = np.flatnonzero(ok)
        if not len(eligible):
            return None
        # max by (total, -load, -i): the highest total, then the least loaded, then the first
        top = eligible[totals[eligible] == totals[eligible].max()]
        best = int(top[load[top] == load[top].min()][0])
    return P2PChoice(best, cols.endpoints[holder], holder_tokens - int(hit_tokens[best]))
