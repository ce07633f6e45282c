"""Filters: which endpoints may take a hop at all. Each maps candidates to a (possibly empty) subset, order kept.

The policy fixes which filters run (the spec names none); each is registered with the inputs it reads so the
scheduler's `inputs` cover its whole pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from llmd.router.scheduling.plugins import FilterPlugin, Input, register_filter
from llmd.router.scheduling.state import HOP_ROLES, Candidate, EndpointState, Hop

_T = TypeVar("_T")  # prefix_affinity keeps whatever it is given: candidates, or their positions


def healthy(cands: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in cands if c.state.healthy]


def role(cands: Sequence[Candidate], hop: Hop) -> list[Candidate]:
    """decode hop: decode and both-role endpoints; prefill hop: the prefill pool."""
    roles = HOP_ROLES[hop]
    return [c for c in cands if c.endpoint.role in roles]


def has_capacity(cands: Sequence[Candidate], max_inflight: int) -> list[Candidate]:
    """Endpoints below `max_inflight` router-side requests. If every one is full, all of them: refusing here would
    drop the request, while the proxy's admission control queues it and the scorers still pick the least bad."""
    free = [c for c in cands if c.state.inflight < max_inflight]
    return free or list(cands)


def kv_fits(state: EndpointState, need_tokens: int, block_size: int) -> bool:
    """Whether `need_tokens` more of KV fit beside what the router already sent there: an engine given more than its
    KV cache holds preempts running requests (vLLM recomputes them), which costs far more than waiting in the router.
    Unknown capacity fits; so does any request on an idle endpoint (one bigger than the whole cache must go somewhere,
    and the engine refuses what exceeds its max_model_len)."""
    cap = state.kv_capacity_blocks
    if cap <= 0 or state.inflight <= 0:
        return True
    # vLLM's num_gpu_blocks counts the null block (block 0), which never holds KV; blocks are allocated whole.
    need = -(-need_tokens // block_size) * block_size if block_size > 0 else need_tokens
    return state.inflight_kv_tokens + need <= (cap - 1) * block_size


def kv_room(cands: Sequence[Candidate], need_tokens: int, block_size: int) -> list[Candidate]:
    """Endpoints where the request's KV fits (kv_fits). If none, all of them: the proxy's admission holds the request
    until one has room, and the scorers still rank them."""
    # kv_fits, inlined: it runs for every candidate of every decision.
    need = -(-need_tokens // block_size) * block_size if block_size > 0 else need_tokens
    free = [
        c
        for c in cands
        if (cap := c.state.kv_capacity_blocks) <= 0
        or c.state.inflight <= 0
        or c.state.inflight_kv_tokens + need <= (cap - 1) * block_size
    ]
    return free or list(cands)


def routable(cands: Sequence[Candidate], hop: Hop) -> list[Candidate]:
    """healthy + role, in one pass (the hot path)."""
    roles = HOP_ROLES[hop]
    return [c for c in cands if c.state.healthy and c.endpoint.role in roles]


def prefix_affinity(
    cands: Sequence[_T], scores: Sequence[float], threshold: float, ttft_s: Sequence[float], max_penalty_s: float
) -> list[_T]:
    """llm-d's prefix-cache affinity filter: only the endpoints whose prefix score is >= `threshold` ("sticky"), if
    any; all of them when none is, or when the best sticky endpoint's estimated TTFT (`ttft_s`, from its queued
    prefill work) exceeds the best other one's by more than `max_penalty_s` (sticky until saturated)."""
    sticky = [i for i, s in enumerate(scores) if s >= threshold]
    if not sticky or len(sticky) == len(cands):
        return list(cands)
    rest = [i for i in range(len(cands)) if scores[i] < threshold]
    if min(ttft_s[i] for i in sticky) - min(ttft_s[i] for i in rest) > max_penalty_s:
        return list(cands)
    return [cands[i] for i in sticky]


_ENGINE: frozenset[Input] = frozenset({"engine_state"})
register_filter(FilterPlugin("routable", routable, _ENGINE))  # health comes from the engines' health checks
register_filter(FilterPlugin("has-capacity", has_capacity))  # the router's own in-flight count
register_filter(FilterPlugin("kv-room", kv_room, _ENGINE))  # the engines' KV capacity
register_filter(FilterPlugin("prefix-affinity", prefix_affinity))  # the prefix source's scores
