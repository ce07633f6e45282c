"""What analysis needs from a run's deployment spec, read as the plain YAML the run stored (its HDF5 /meta/spec, or
spec.yaml beside it): parameters as dotted keys, GPUs per pool, and an optional `cost:` block.

Read as a mapping, not through llmd.spec's model: a spec stored by an older or newer llmd (a field added or dropped,
a `cost:` section the model does not know yet) must still be analysed.
"""

from __future__ import annotations

from typing import Any

import yaml


def spec_dict(text: str) -> dict[str, Any]:
    """The stored spec as a mapping ({} when there is none or it is not YAML)."""
    if not text:
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def flatten(spec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"router.policy": "precise", ...}: the dotted keys a sweep's grid names."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def pool_gpus(spec: dict[str, Any]) -> dict[str, int]:
    """GPUs per pool that runs engines: {"prefill": n, "decode": m} (no prefill key when not disaggregated).

    The defaults are llmd.spec's (one node of one GPU per pool); a spec stored by llmd has every field written out.
    """
    out: dict[str, int] = {}
    for role in ("prefill", "decode"):
        pool = spec.get(role) or {}
        nodes = int(pool.get("nodes", 1))
        if role == "prefill" and nodes <= 0:
            continue
        out[role] = nodes * int(pool.get("gpus_per_node", 1))
    return out


def cost_block(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's `cost:` section when a run stored one ({} otherwise); see cost.prices_from."""
    block = spec.get("cost")
    return block if isinstance(block, dict) else {}
