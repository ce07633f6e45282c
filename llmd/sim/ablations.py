"""The six capabilities of the llm-d way, each switched off alone: pure spec transforms, so an ablation is the same
simulation of a different deployment on the same GPUs.

What "off" means for each is what a site would run instead:
- precise routing: llm-d's approximate (text-prefix) routing, no KV events;
- CPU tier: no CPU DRAM KV offload (kv.cpu_bytes 0);
- P2P pulls: a prefix cached on another engine is recomputed, not pulled;
- wide EP + DP attention: each replica two nodes of plain tensor parallelism (TP 16, the smallest group whose GPUs
  hold the model's weights), so attention is tensor-sliced and its MLA latent KV replicated on every rank;
- P/D over NIXL: no prefill pool; its nodes join the decode pool (same GPU count), which prefills for itself;
- MTP: one token per decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmd.errors import UserError


def _update(spec: Any, section: str, **values: Any) -> Any:
    return spec.model_copy(update={section: getattr(spec, section).model_copy(update=values)})


def _no_precise(spec: Any) -> Any:
    return _update(spec, "router", policy="approximate")


def _no_cpu_tier(spec: Any) -> Any:
    return _update(spec, "kv", cpu_bytes=0)


def _no_p2p(spec: Any) -> Any:
    return _update(spec, "router", p2p=False)


def _tensor_parallel(pool: Any, tp: int) -> Any:
    gpus = pool.nodes * pool.gpus_per_node
    if gpus % tp:
        raise UserError(f"ablation wide EP: {gpus} GPUs of the pool do not split into TP {tp} replicas")
    return pool.model_copy(update={"replicas": gpus // tp, "tp_size": tp, "dp_size": 1, "ep": False})


def _no_wide_ep(spec: Any, tp: int = 16) -> Any:
    out = spec.model_copy(update={"decode": _tensor_parallel(spec.decode, tp)})
    if spec.disaggregated:
        out = out.model_copy(update={"prefill": _tensor_parallel(spec.prefill, tp)})
    return out


def _no_pd(spec: Any) -> Any:
    if not spec.disaggregated:
        return spec
    d, p = spec.decode, spec.prefill
    nodes = d.nodes + p.nodes
    per_replica = d.nodes // d.replicas
    replicas = max(1, round(nodes / per_replica))
    if nodes % replicas:
        raise UserError(f"ablation P/D: {nodes} nodes do not split into {replicas} equal decode replicas")
    ranks = nodes // replicas * d.gpus_per_node // d.tp_size
    decode = d.model_copy(update={"nodes": nodes, "replicas": replicas, "dp_size": ranks})
    return spec.model_copy(update={"decode": decode, "prefill": p.model_copy(update={"nodes": 0})})


def _no_mtp(spec: Any) -> Any:
    return _update(spec, "mtp", draft_tokens=0)


ABLATIONS: dict[str, Callable[[Any], Any]] = {
    "precise routing": _no_precise,
    "CPU tier": _no_cpu_tier,
    "P2P pulls": _no_p2p,
    "wide EP + DP attention": _no_wide_ep,
    "P/D over NIXL": _no_pd,
    "MTP": _no_mtp,
}


def ablated(spec: Any, capability: str) -> Any:
    """`spec` without `capability` (a key of ABLATIONS), validated as a whole spec."""
    from llmd.spec import SpecError, parse_spec_text
    from llmd.spec.load import dump_spec

    fn = ABLATIONS.get(capability)
    if fn is None:
        raise UserError(f"unknown capability {capability!r}; ablations: {', '.join(ABLATIONS)}")
    try:
        return parse_spec_text(dump_spec(fn(spec)), f"{spec.name} without {capability}")
    except SpecError as exc:
        raise UserError(f"ablation {capability!r} of {spec.name} is not a valid deployment: {exc}") from exc
