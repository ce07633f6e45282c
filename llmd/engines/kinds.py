"""The engine kinds a spec's `engine.kind` names, one registry entry each: what the rest of llmd needs to know about
a kind (how its processes are placed on a pool's nodes, its P2P mode, its spec checks, how reports name it).

Each kind lives in its own module (llmd/engines/sim_kind.py, llmd/engines/vllm_kind.py) and registers itself with
one `register_engine_kind(...)` line; code that used to branch on the kind's name looks it up here instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from llmd.fabric.plan import Placement
    from llmd.spec.checks import SpecIssue
    from llmd.spec.model import DeploymentSpec


@dataclass(frozen=True)
class EngineBackend:
    """One engine kind: the decisions llmd makes differently for it."""

    name: str
    simulated: bool  # GPUs modeled, not run: engine.time_scale applies, reports say "(simulated)", sweeps run it
    report_tool: str  # the Benchmark Report's standardized.tool
    # How the router pulls KV peer to peer: "hash" (the engine pulls blocks by hash from the holder) or "two-hop"
    # (stock vLLM pulls only leased blocks, so the holder serves as the prefill pod).
    p2p_mode: Literal["hash", "two-hop"]
    needs_fabric: bool  # started only by llmd.fabric (MPI ranks, NIXL preflight); else the basic starter runs it too
    needs_tokenizer_file: bool  # launch checks that model.tokenizer has a tokenizer.json on the shared file system
    streams_metrics: bool  # its processes write their own per-second series (`--metrics-out`)
    place: Callable[[Placement], None]  # fills a pool's per-node processes and DP ranks (llmd.fabric.plan)
    spec_issues: Callable[[DeploymentSpec], list[SpecIssue]]  # checks only this kind needs
    demo_spec: Callable[[DeploymentSpec, bool], DeploymentSpec]  # the spec `llmd demo` runs (spec, embedded)


ENGINE_KINDS: dict[str, EngineBackend] = {}


def register_engine_kind(backend: EngineBackend) -> EngineBackend:
    ENGINE_KINDS[backend.name] = backend
    return backend


def engine_kind(name: str) -> EngineBackend:
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown engine kind {name!r}; known: {', '.join(sorted(ENGINE_KINDS))}") from None


# The kinds llmd ships; each module registers itself on import.
from llmd.engines import sim_kind, vllm_kind  # noqa: E402, F401
