"""Each DP replica's `--data-parallel-rpc-port`: the one port all nodes of a replica share.

The replica's head binds it (vLLM's engine handshake) and its other nodes dial it, so unlike every other port it cannot
be moved by the node that finds it taken (llmd.engines.vllm_server.move_taken_ports): the head's node chooses it before
any engine starts and every node learns it (llmd.fabric.settle). Pure: the port each replica's processes carry, and the
plans with chosen ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from llmd.engines.vllm import dp_rpc_port_of, with_dp_rpc_port
from llmd.fabric.plan import NodePlan

Replica = tuple[str, int]  # (role, replica)


def dp_rpc_ports(plans: Sequence[NodePlan]) -> dict[Replica, int]:
    """The DP RPC port each replica's processes in `plans` carry now (0: to be picked), by (role, replica)."""
    out: dict[Replica, int] = {}
    for plan in plans:
        for proc in plan.processes:
            port = dp_rpc_port_of(proc.argv)
            if port is not None:
                out[(plan.role, plan.replica)] = port
    return out


def with_dp_rpc_ports(plans: Sequence[NodePlan], ports: Mapping[Replica, int]) -> list[NodePlan]:
    """`plans` with every process of each replica in `ports` given that replica's DP RPC port; others unchanged."""
    out = []
    for plan in plans:
        port = ports.get((plan.role, plan.replica))
        if port is None:
            out.append(plan)
            continue
        procs = [replace(p, argv=with_dp_rpc_port(p.argv, port)) for p in plan.processes]
        out.append(replace(plan, processes=procs))
    return out
