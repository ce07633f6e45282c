"""The NIXL side channel of a vLLM replica over several nodes with P/D: each node's processes are given a base free on
their own address (the layout's where it is, else or with `port: auto` a free band), settled with the DP RPC port in
one allgather (FileComm threads stand in for MPI), and the replica's head publishes every rank's port, those its
headless node runs too."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fabricutil import agree

from llmd.discovery import with_bound_ports
from llmd.engines.vllm import dp_rpc_port_of
from llmd.engines.vllm_server import port_free
from llmd.fabric.bootstrap import _dp_ranks
from llmd.fabric.plan import NodePlan, plan_nodes
from llmd.fabric.settle import choose_ports
from llmd.fabric.side_channel import ENV, published_ports, side_channel_bases, with_side_channel_bases
from llmd.spec import parse_spec
from llmd.spec.model import DeploymentSpec

HEAD, OTHER = "127.0.0.1", "127.0.0.2"  # two nodes' addresses: both loopback on Linux, each its own ports


def pd_spec(port: int | str, *, nodes: int = 2, replicas: int = 1, gpus: int = 1) -> DeploymentSpec:
    """P/D; decode replicas of dp_size 2, at one GPU per node (the default) each over two nodes: a head (rank 0) and a
    headless node (rank 1)."""
    decode = {"nodes": nodes, "replicas": replicas, "dp_size": 2, "gpus_per_node": gpus, "port": port}
    prefill = {"nodes": 1, "port": port if port == "auto" else port + 100}
    # parse_spec runs every spec check, the engine kind's among them.
    return parse_spec(
        {"model": {"path": "models/tiny", "max_model_len": 512}, "engine": {"kind": "vllm"}, "prefill": prefill}
        | {"decode": decode}
    )


def bases(plans: list[NodePlan]) -> dict[str, tuple[int, list[int]]]:
    return {p.name: (int(p.env[ENV]), p.ranks) for plan in plans for p in plan.processes}


def head_entry(plans: list[NodePlan], replica: int = 0) -> Any:
    (entry,) = next(p for p in plans if p.replica == replica and p.node_in_replica == 0).processes[0].discovery
    return entry


@contextmanager
def squatted_headless_port() -> Iterator[int]:
    """A decode base port P whose headless rank 1's side channel (P + 2000 + 1) another program holds on OTHER, while
    the head's P + 2000 and the RPC port P + 5000 are free on HEAD."""
    for _ in range(50):
        squat = socket.socket()
        squat.bind((OTHER, 0))
        squat.listen()
        base = squat.getsockname()[1] - 2001
        if base >= 1024 and base + 5000 < 65536 and port_free(HEAD, base + 2000) and port_free(HEAD, base + 5000):
            with squat:
                yield base
            return
        squat.close()
    raise RuntimeError("no squattable layout")


def test_a_taken_headless_side_channel_moves_on_its_node_and_the_head_publishes_it() -> None:
    with squatted_headless_port() as base:
        plans = plan_nodes(pd_spec(base), "decode", ["a", "b"], [HEAD, OTHER])
        assert bases(plans) == {"decode-0": (base + 2000, [0]), "decode-0-node1": (base + 2000, [1])}
        assert [p.processes[0].env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for p in plans] == [HEAD, OTHER]
        # Each address has its own chooser: the head keeps its free layout ports, the headless node moves its own.
        assert choose_ports(plans, 0) == ({("decode", 0): base + 5000}, {"decode-0": base + 2000})
        rpc, side = choose_ports(plans, 1)
        assert rpc == {} and side.keys() == {"decode-0-node1"}
        moved = side["decode-0-node1"]
        assert moved != base + 2000 and port_free(OTHER, moved + 1), "a band free on the headless node's address"
    agreed = with_side_channel_bases(plans, {"decode-0": base + 2000, "decode-0-node1": moved})
    assert bases(agreed) == {"decode-0": (base + 2000, [0]), "decode-0-node1": (moved, [1])}
    entry = head_entry(agreed)
    assert entry.side_channel_ports == (base + 2000, moved + 1), "rank 1 listens on its own node's base + 1"
    # What the head publishes once up: its own rank on its own base (moved there if taken since), rank 1 as agreed.
    head = agreed[0].processes[0]
    assert _dp_ranks(head) == [0]
    assert published_ports(entry, head.env, _dp_ranks(head)) == [base + 2000, moved + 1]
    assert published_ports(entry, {**head.env, ENV: "40000"}, [0]) == [40000, moved + 1]
    pod = with_bound_ports(entry, {"http_port": 8000, "side_channel_ports": [base + 2000, moved + 1]})
    assert (pod.side_channel_port, pod.side_channel_ports) == (base + 2000, (base + 2000, moved + 1))
    # Nothing else changed: the headless node's argv and the head's other fields are the layout's.
    assert [p.processes[0].argv for p in agreed] == [p.processes[0].argv for p in plans]


def test_auto_with_pd_and_dp_2_over_two_nodes_passes_the_check_and_the_nodes_agree(tmp_path: Any) -> None:
    spec = pd_spec("auto", nodes=4, replicas=2)  # once refused: headless nodes were left on side-channel port 0
    addresses = [HEAD, OTHER, HEAD, OTHER]  # the two replicas' heads share HEAD, their headless nodes OTHER
    plans = plan_nodes(spec, "decode", ["a", "b", "c", "d"], addresses)
    assert set(side_channel_bases(plans).values()) == {0}, "the layout leaves them to the launcher"
    agreed = agree(tmp_path, plans)
    listens = {p.name: [int(p.env[ENV]) + r for r in p.ranks] for plan in agreed for p in plan.processes}
    assert all(0 < port < 65536 for ports in listens.values() for port in ports)
    for replica in (0, 1):
        name = f"decode-{replica}"
        assert head_entry(agreed, replica).side_channel_ports == (*listens[name], *listens[f"{name}-node1"])
    # One host's ports are chosen together: no two processes there share one, nor one with a replica's RPC port.
    rpc = {dp_rpc_port_of(p.argv) for plan in agreed[::2] for p in plan.processes}
    on_head = listens["decode-0"] + listens["decode-1"]
    on_other = listens["decode-0-node1"] + listens["decode-1-node1"]
    assert len(set(on_head) | rpc) == 4 and len(set(on_other)) == 2 and 0 not in rpc


def test_a_replica_on_one_node_publishes_its_own_base_for_every_rank() -> None:
    plans = plan_nodes(pd_spec(31200, nodes=1, gpus=2), "decode", ["a"], [HEAD])
    plans = with_side_channel_bases(plans, {"decode-0": 40000})
    entry = head_entry(plans)
    head = plans[0].processes[0]
    assert entry.side_channel_ports == (40000, 40001) and published_ports(entry, head.env, head.ranks) == [40000, 40001]
