"""A DP replica's `--data-parallel-rpc-port` without MPI: chosen on the replica's head node (kept if free, else or with
`port: auto` a free one), shared through the no-MPI channels (FileComm threads, a world of one) and written into every
process of the replica. The side channel, settled in the same step: tests/test_fabric_side_channel.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fabricutil import agree

from llmd.engines.vllm import dp_rpc_port_of
from llmd.engines.vllm_server import port_free
from llmd.fabric.comm import LocalComm
from llmd.fabric.dp_rpc import dp_rpc_ports, with_dp_rpc_ports
from llmd.fabric.plan import NodePlan, plan_nodes
from llmd.fabric.settle import agree_ports, choose_ports
from llmd.spec import parse_spec
from llmd.spec.model import DeploymentSpec

LOCAL = "127.0.0.1"


def vllm_spec(port: int | str, *, nodes: int = 4, replicas: int = 2, gpus: int = 1, prefill: int = 0) -> DeploymentSpec:
    """Decode replicas of dp_size 2, at one GPU per node (the default) each over two nodes: head and one headless."""
    pools: dict[str, Any] = {"decode": {"nodes": nodes, "replicas": replicas, "dp_size": 2, "gpus_per_node": gpus}}
    pools["prefill"] = {"nodes": prefill, "dp_size": 2, "gpus_per_node": 2} if prefill else {"nodes": 0}
    for pool in pools.values():
        pool["port"] = port
    # parse_spec runs every spec check, the engine kind's among them.
    return parse_spec({"model": {"path": "models/tiny", "max_model_len": 512}, "engine": {"kind": "vllm"}, **pools})


def rpc_ports_by_process(plans: list[NodePlan]) -> list[tuple[int, int | None]]:
    return [(p.replica, dp_rpc_port_of(proc.argv)) for p in plans for proc in p.processes]


@contextmanager
def squatted_layout() -> Iterator[tuple[int, socket.socket]]:
    """A base port whose replica 0 DP RPC port (base + 5000) another program holds and replica 1's is free."""
    for _ in range(50):
        squat = socket.socket()
        squat.bind((LOCAL, 0))
        squat.listen()
        taken = squat.getsockname()[1]
        if port_free(LOCAL, taken + 1) and taken - 5000 >= 1024:
            with squat:
                yield taken - 5000, squat
            return
        squat.close()
    raise RuntimeError("no squattable layout")


def test_a_taken_rpc_port_moves_for_every_process_of_its_replica_only() -> None:
    with squatted_layout() as (base, squat):
        taken = squat.getsockname()[1]
        plans = plan_nodes(vllm_spec(base), "decode", ["a", "b", "c", "d"], [LOCAL] * 4)
        assert rpc_ports_by_process(plans) == [(0, taken), (0, taken), (1, taken + 1), (1, taken + 1)]
        assert dp_rpc_ports(plans) == {("decode", 0): taken, ("decode", 1): taken + 1}
        # The first node at an address chooses for every node there (here all four share one); it keeps a free
        # layout port and moves a taken one.
        assert [choose_ports(plans, k) for k in (1, 2, 3)] == [({}, {})] * 3
        rpc, side = choose_ports(plans, 0)
        assert rpc.keys() == {("decode", 0), ("decode", 1)} and rpc[("decode", 1)] == taken + 1 and side == {}
        moved = rpc[("decode", 0)]
    assert moved not in (0, taken)
    agreed = with_dp_rpc_ports(plans, {("decode", 0): moved, ("decode", 1): taken + 1})
    assert rpc_ports_by_process(agreed) == [(0, moved), (0, moved), (1, taken + 1), (1, taken + 1)]
    assert agreed[2:] == plans[2:], "the other replica is left as it was"
    # Nothing but the port changed.
    for before, after in zip(plans[0].processes, agreed[0].processes, strict=True):
        changed = [i for i, (x, y) in enumerate(zip(before.argv, after.argv, strict=True)) if x != y]
        assert [before.argv[i - 1] for i in changed] == ["--data-parallel-rpc-port"]
        assert after.env == before.env and after.discovery == before.discovery


def test_auto_with_dp_2_passes_the_check_and_every_node_agrees_on_a_port(tmp_path: Any) -> None:
    spec = vllm_spec("auto")  # once refused: "auto" was for dp_size 1 only
    plans = plan_nodes(spec, "decode", ["a", "b", "c", "d"], [LOCAL] * 4)
    assert {port for _, port in rpc_ports_by_process(plans)} == {0}, "the layout leaves it to the launcher"
    agreed = agree(tmp_path, plans)
    ports = dict(rpc_ports_by_process(agreed))  # one port per replica: the same on its head and its headless node
    assert len(rpc_ports_by_process(agreed)) == 4 and len(set(rpc_ports_by_process(agreed))) == 2
    assert all(0 < port < 65536 for port in ports.values())


def test_a_world_of_one_agrees_with_itself_and_plans_without_dp_skip_the_exchange() -> None:
    spec = vllm_spec("auto", nodes=1, replicas=1, gpus=2)
    (plan,) = agree_ports(LocalComm(), plan_nodes(spec, "decode", ["a"], [LOCAL], mode="per-rank"), 0)
    (port,) = {dp_rpc_port_of(p.argv) for p in plan.processes}
    assert len(plan.processes) == 2 and port

    class NoExchange(LocalComm):
        def allgather(self, obj: Any, timeout_s: float = 600.0) -> list[Any]:
            raise AssertionError("no collective step without DP or a side channel")

    dp1 = {"nodes": 2, "replicas": 2, "port": "auto"}
    plain = parse_spec({"model": {"path": "m"}, "engine": {"kind": "vllm"}, "prefill": {"nodes": 0}, "decode": dp1})
    plans = plan_nodes(plain, "decode", ["a", "b"], [LOCAL] * 2)
    assert agree_ports(NoExchange(), plans, 0) == plans
