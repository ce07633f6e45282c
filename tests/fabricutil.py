"""Helpers for the fabric's port-settling tests: the nodes' one exchange, each node a thread."""

from __future__ import annotations

import threading
from pathlib import Path

from llmd.fabric.comm import FileComm
from llmd.fabric.plan import NodePlan
from llmd.fabric.settle import agree_ports


def agree(tmp_path: Path, plans: list[NodePlan]) -> list[NodePlan]:
    """The nodes' one allgather, each node a thread (FileComm stands in for MPI); every node must end up holding the
    same plans, which are returned."""
    got: dict[int, list[NodePlan]] = {}

    def node(rank: int) -> None:
        got[rank] = agree_ports(FileComm(tmp_path, rank, len(plans)), plans, rank)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(len(plans))), "a node did not finish the exchange"
    assert all(got[r] == got[0] for r in got), "every node holds the same plans"
    return got[0]
