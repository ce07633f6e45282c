"""Filters: which endpoints may take a hop at all. Each maps candidates to a (possibly empty) subset, order kept."""

from __future__ import annotations

from collections.abc import Sequence

from llmd.router.scheduling.state import HOP_ROLES, Candidate, Hop


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


def routable(cands: Sequence[Candidate], hop: Hop) -> list[Candidate]:
    """healthy + role, in one pass (the hot path)."""
    roles = HOP_ROLES[hop]
    return [c for c in cands if c.state.healthy and c.endpoint.role in roles]
