"""The router's scheduling pipeline, llm-d style: filters -> scorers in [0, 1] -> picker, plus the P/D and P2P hops.

Pure and deterministic: time comes in as `now`, randomness from a seeded RNG, state as a `Snapshot`; the live proxy
and the offline cluster simulator run this same code.
"""

from llmd.router.scheduling.approximate import text_chunk_hashes
from llmd.router.scheduling.pipeline import POLICIES, RouterSettings, Scheduler, Tuning
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
    "Snapshot",
    "Tuning",
    "text_chunk_hashes",
]
