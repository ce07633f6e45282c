"""The router's settings: `RouterConfig`, filled from a DeploymentSpec (or its RouterSpec) and overrides."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from llmd.engines.kinds import engine_kind
from llmd.router import pd as hops

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY = 32 << 20


@dataclass
class RouterConfig:
    """Everything the router needs besides the pods. `from_spec` fills it from a DeploymentSpec."""

    policy: str = "precise"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_inflight_per_pod: int = 64
    queue_limit: int = 4096
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0  # a 500K-token prefill takes long; a hung prefill pod must not hang the request
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    metrics_interval_s: float = 1.0
    replay_timeout_s: float = 2.0
    p2p_mode: hops.P2PMode = "hash"
    served_name: str | None = None
    block_size: int = 16
    tokenizer: str | None = None  # model folder with the tokenizer; None: no router-side tokenization
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    index_max_entries: int = 50_000_000
    prompt_cache_tokens: int = 16_000_000  # tokens of recent prompts kept for incremental tokenization
    offload_tokenize_bytes: int = 64 << 10  # bodies this large are tokenized off the event loop
    router_spec: Any = None  # the RouterSpec (or any RouterSettings) the scheduler reads
    seed: int = 0
    metrics_out: str | None = None  # the router's own HDF5 (llmd.router.recorder); None: none
    metrics_meta: dict[str, Any] | None = None  # run metadata for that file (spec, run id, ...)
    # The engines' cost model (llmd.perf.latency.LatencyModel of the decode / prefill pool; None: fixed token rates)
    # and wall seconds per model second (simulated engines at engine.time_scale), for the scheduler's time estimates.
    latency: Any = None
    prefill_latency: Any = None
    time_scale: float = 1.0

    @classmethod
    def from_router_spec(cls, r: Any, **overrides: Any) -> RouterConfig:
        """The scheduling and admission settings of a RouterSpec; the rest from `overrides` or defaults."""
        api_key = os.environ.get(r.api_key_env) if r.api_key_env else None
        kw: dict[str, Any] = {
            "policy": r.policy,
            "host": r.host,
            "port": r.port,
            "api_key": api_key or None,
            "max_inflight_per_pod": r.max_inflight_per_pod,
            "queue_limit": r.queue_limit,
            "router_spec": r,
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> RouterConfig:
        m = spec.model
        kw: dict[str, Any] = {
            # Stock vLLM pulls only leased blocks: P2P goes through the holder as a prefill pod there.
            "p2p_mode": engine_kind(spec.engine.kind).p2p_mode,
            "served_name": m.served_name,
            "block_size": m.block_size,
            "tokenizer": m.tokenizer,
            "hash_algo": m.hash_algo,
            "hash_seed": m.hash_seed,
            "seed": spec.workload.seed,
            "time_scale": spec.engine.time_scale if engine_kind(spec.engine.kind).simulated else 1.0,
        }
        kw.update(cost_models(spec))
        kw.update(overrides)
        return cls.from_router_spec(spec.router, **kw)


def cost_models(spec: Any) -> dict[str, Any]:
    """The spec's latency models for the decode and prefill pools; none (fixed rates) when the spec's model has no
    profile the latency model knows."""
    from llmd.perf.latency import LatencyModel

    try:
        out = {"latency": LatencyModel.from_spec(spec, "decode")}
        if spec.disaggregated:
            out["prefill_latency"] = LatencyModel.from_spec(spec, "prefill")
    except (ValueError, KeyError, OSError) as exc:
        log.info("router: no latency model for %s (%s); fixed token rates", spec.model.path, exc)
        return {}
    return out


def default_settings(c: RouterConfig) -> Any:
    from llmd.spec.model import RouterSpec

    return RouterSpec(policy=c.policy, max_inflight_per_pod=c.max_inflight_per_pod, queue_limit=c.queue_limit)  # type: ignore[arg-type]
