"""Each DP replica's `--data-parallel-rpc-port`, settled before any engine starts and agreed by every node.

The replica's head binds it (vLLM's engine handshake) and its other nodes dial it, so unlike every other port it cannot
be moved by the node that finds it taken (llmd.engines.vllm_server.move_taken_ports): the head's node probes it on the
head's address and keeps the layout's port if it is free, else (or with `port: auto`, whose layout port is 0) takes a
free one; one allgather tells every node, and each rewrites its processes' argv. `dp_rpc_ports` and
`with_dp_rpc_ports` are pure; `choose_dp_rpc_ports` probes and `agree_dp_rpc_ports` talks to the other ranks.

A port probed free can still be taken before vLLM binds it (vLLM's start-up takes tens of seconds). The head then exits
with EADDRINUSE and its task fails the component with that in the log's tail (llmd.fabric.bootstrap.serve), as a lost
race on any probed port does on a cluster: there is no restart there, since the other nodes' engines already dial the
agreed port and MPI is finalised by then, so no new port could be agreed. A rerun (a sweep's --retry-failed, a new
launch) probes again. The single-machine deployment does restart (llmd.engines.vllm_deploy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from llmd.engines.vllm import dp_rpc_port_of, with_dp_rpc_port
from llmd.fabric.plan import NodePlan

if TYPE_CHECKING:
    from llmd.fabric.comm import Comm

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


def choose_dp_rpc_ports(plan: NodePlan) -> dict[Replica, int]:
    """On the node of `plan`: the DP RPC port of the replica it heads (none if it heads none, or runs no DP), kept if
    free on the head's address (`--data-parallel-address`, where vLLM binds it), else a free one found there."""
    from llmd.engines.vllm_server import free_run, port_free

    if plan.node_in_replica != 0:
        return {}
    out: dict[Replica, int] = {}
    for key, port in dp_rpc_ports([plan]).items():
        argv = next(p.argv for p in plan.processes if dp_rpc_port_of(p.argv) is not None)
        host = argv[argv.index("--data-parallel-address") + 1]
        out[key] = port if port and port_free(host, port) else free_run(host, 1)
    return out


def agree_dp_rpc_ports(comm: Comm, plans: Sequence[NodePlan], index: int) -> list[NodePlan]:
    """Every node's plans with the DP RPC ports the replicas' head nodes chose; `index` is this rank's node. A
    collective step, so every rank calls it; with no DP in the plans (the same on every rank) it skips the exchange."""
    if not dp_rpc_ports(plans):
        return list(plans)
    chosen: dict[Replica, int] = {}
    for theirs in comm.allgather(choose_dp_rpc_ports(plans[index])):
        chosen.update(theirs)
    return with_dp_rpc_ports(plans, chosen)
