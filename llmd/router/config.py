"""The router's settings: `RouterConfig`, filled from a DeploymentSpec (or its RouterSpec) and overrides."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from llmd.engines.kinds import engine_kind
from llmd.net.limits import MAX_JSON_DEPTH
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
    max_json_depth: int = MAX_JSON_DEPTH
    # Clients: a connection gets this long to send a complete request head (and an idle keep-alive one to send its
    # next); a body may pause at most body_timeout_s between bytes. Beyond either the connection is closed (408).
    header_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    max_inflight_per_pod: int = 64
    queue_limit: int = 4096
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    # Engine legs (the prefill hop and the serving pod). The first byte of a leg comes after its prompt's prefill and
    # its wait in the engine's queue; a non-streaming response comes whole, so its first byte is its last. Neither is
    # predictable enough to bound tightly (the latency model may be missing or off, the engine's queue is its own), and
    # a bound too tight would cut healthy long prefills and send them again elsewhere, doubling the load just when the
    # fleet is busiest. So the first byte gets a generous fixed bound (a 500K-token prefill fits), and a hung engine is
    # found by the health loop instead: once a pod is marked down, its legs that are silent for `down_grace_s` are cut
    # (a request not yet streamed is retried on another pod, a streaming one ends with an error event). Once a stream
    # has begun, tokens come every few tens of milliseconds: a silence of idle_timeout_s is a hang.
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    down_grace_s: float = 1.0
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
    # A text completion prompt the router tokenized goes to the engine as its token ids (RouterSpec.forward_tokens).
    forward_tokens: bool = True
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
            "forward_tokens": r.forward_tokens,
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
