"""The router's scheduling pipeline, llm-d style: filters -> scorers in [0, 1] -> picker, plus the P/D and P2P hops.

Pure and deterministic: time comes in as `now`, randomness from a seeded RNG, state as a `Snapshot`; the live proxy
and the offline cluster simulator run this same code. The plugins (filters, scorers, pickers) register themselves
with `plugins` on import; see llmd/router/scheduling/plugins.py.
"""

# The plugins llmd ships, imported first and in this order on purpose (not sorted): every import of this package runs
# this line before anything else, so registration order, which is the scorers' column order and so fixes how totals
# are summed, never depends on which module happens to be imported first (tests/test_router_scheduling.py pins it).
from llmd.router.scheduling import prefix, load, no_hit_lru, filters, picker  # noqa: I001
from llmd.router.scheduling.approximate import text_chunk_hashes
from llmd.router.scheduling.pipeline import POLICIES, RouterSettings, Scheduler, Tuning
from llmd.router.scheduling.plugins import ScorerPlugin, ScorerSetup, register_scorer, scorer_names, unregister_scorer
from llmd.router.scheduling.state import (
    Candidate,
    Decision,
    Endpoint,
    EndpointScore,
    EndpointState,
    NoEndpointError,
    PDDecision,
    RouteRequest,
    Snapshot,
    holder_patience_s,
)

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "Endpoint",
    "EndpointScore",
    "EndpointState",
    "NoEndpointError",
    "PDDecision",
    "RouteRequest",
    "RouterSettings",
    "Scheduler",
    "ScorerPlugin",
    "ScorerSetup",
    "Snapshot",
    "Tuning",
    "filters",
    "holder_patience_s",
    "load",
    "no_hit_lru",
    "picker",
    "prefix",
    "register_scorer",
    "scorer_names",
    "text_chunk_hashes",
    "unregister_scorer",
]
