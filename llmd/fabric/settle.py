"""The ports a component's vLLM processes are given by a probe, settled before any engine starts and agreed by every
node with one allgather: each DP replica's `--data-parallel-rpc-port` (llmd.fabric.dp_rpc), which the head binds and
its other nodes dial, and every process's NIXL side-channel base (llmd.fabric.side_channel), which a replica's head
publishes for the ranks its headless nodes run too. Every other port vLLM binds as 0 and reports (`port: auto`, or a
taken layout port: llmd.engines.vllm_server.move_taken_ports), so it needs no agreement: a headless node's KV-event
ports too, which its head's /kv_event_sources reports with every rank's.

A layout port is kept where it is free on the node that binds it, else (and with `port: auto`, whose layout ports are
0) a free one is probed there. One node per address probes for every node at that address, all of their ports
together (llmd.engines.vllm_server.choose_bases), so two replicas on one host never get the same free port: on a
cluster each node is its own (one task per node), in a local run (mpiexec on one machine: every address 127.0.0.1)
the first rank chooses for all. `choose_ports` probes; `agree_ports` talks to the other ranks.

A port probed free can still be taken before vLLM binds it (vLLM's start-up takes tens of seconds). The process then
exits with EADDRINUSE and its task fails the component with that in the log's tail (llmd.fabric.bootstrap.serve), as a
lost race on any probed port does on a cluster: there is no restart there, since the other nodes already use the
agreed ports and MPI is finalised by then, so no new port could be agreed. A rerun (a sweep's --retry-failed, a new
launch) probes again. The single-machine deployment does restart (llmd.engines.vllm_deploy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmd.fabric.dp_rpc import Replica, dp_rpc_ports, with_dp_rpc_ports
from llmd.fabric.plan import NodePlan
from llmd.fabric.side_channel import side_channel_bases, with_side_channel_bases

if TYPE_CHECKING:
    from llmd.fabric.comm import Comm

Choice = tuple[dict[Replica, int], dict[str, int]]  # (DP RPC port by replica, side-channel base by process name)


def choose_ports(plans: Sequence[NodePlan], index: int) -> Choice:
    """On node `index`: the DP RPC port of each replica headed at its address and the side-channel base of each
    process there, if it is the first node at that address (else nothing: that one chooses for it)."""
    from llmd.engines.vllm_server import choose_probed_ports

    host = plans[index].address
    if any(plan.address == host for plan in plans[:index]):
        return {}, {}
    # The head binds a replica's RPC port, its other nodes dial it.
    here = [(plan, proc) for plan in plans if plan.address == host for proc in plan.processes]
    rpc, bases = choose_probed_ports(
        host, [((plan.role, plan.replica), p.argv, p.env, p.ranks, plan.node_in_replica == 0) for plan, p in here]
    )
    return rpc, {p.name: base for (_, p), base in zip(here, bases, strict=True) if base is not None}


def agree_ports(comm: Comm, plans: Sequence[NodePlan], index: int) -> list[NodePlan]:
    """Every node's plans with the DP RPC ports and side-channel bases the nodes chose; `index` is this rank's node.
    A collective step, so every rank calls it; with neither in the plans (the same on every rank) it skips the
    exchange."""
    if not dp_rpc_ports(plans) and not side_channel_bases(plans):
        return list(plans)
    rpc: dict[Replica, int] = {}
    side: dict[str, int] = {}
    for their_rpc, their_side in comm.allgather(choose_ports(plans, index)):
        rpc.update(their_rpc)
        side.update(their_side)
    return with_side_channel_bases(with_dp_rpc_ports(plans, rpc), side)
