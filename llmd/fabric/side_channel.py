"""The NIXL side channel of vLLM processes, as the nodes settle it before the engines start and the head publishes it.

vLLM 0.32 listens for NIXL handshakes on VLLM_NIXL_SIDE_CHANNEL_PORT + the DP rank (the replica-wide one, also on a
headless node) at VLLM_NIXL_SIDE_CHANNEL_HOST, and advertises that port to its peers as configured, so the launcher
gives each process a base that is free on its own node (llmd.fabric.settle). A replica over several nodes is one pod
whose head publishes every rank's port (llmd.discovery `side_channel_ports`), the ranks its headless nodes run too:
those come from the bases agreed here. Pure: the bases the plans carry, the plans with chosen ones, and the per-rank
list the head publishes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from llmd.discovery import PodInfo
from llmd.engines.vllm import SIDE_CHANNEL_ENV as ENV
from llmd.engines.vllm_server import rank_side_channel_ports
from llmd.fabric.plan import EngineProcess, NodePlan


def side_channel_base(proc: EngineProcess) -> int | None:
    """The rank-0 side-channel port `proc` is given now (0: to be picked); None for a process without one."""
    base = proc.env.get(ENV)
    return int(base) if base is not None else None


def side_channel_bases(plans: Sequence[NodePlan]) -> dict[str, int]:
    """The base each process of `plans` that has a side channel carries now, by process name."""
    out: dict[str, int] = {}
    for plan in plans:
        for proc in plan.processes:
            base = side_channel_base(proc)
            if base is not None:
                out[proc.name] = base
    return out


def with_side_channel_bases(plans: Sequence[NodePlan], bases: Mapping[str, int]) -> list[NodePlan]:
    """`plans` with each process named in `bases` given that base, and each replica head's discovery entry listing
    every rank's port (`side_channel_ports`), those its other nodes run too; other processes unchanged."""
    plans = [
        replace(plan, processes=[_with_base(proc, bases.get(proc.name)) for proc in plan.processes]) for plan in plans
    ]
    replicas = {(q.role, q.replica) for q in plans}
    ports_of = {
        r: rank_side_channel_ports(
            (p.env, p.ranks or [0]) for q in plans if (q.role, q.replica) == r for p in q.processes
        )
        for r in replicas
    }
    out = []
    for plan in plans:
        ports = ports_of[(plan.role, plan.replica)]
        procs = [replace(p, discovery=[_with_rank_ports(e, ports) for e in p.discovery]) for p in plan.processes]
        out.append(replace(plan, processes=procs))
    return out


def _with_base(proc: EngineProcess, base: int | None) -> EngineProcess:
    return proc if base is None or ENV not in proc.env else replace(proc, env={**proc.env, ENV: str(base)})


def _with_rank_ports(entry: PodInfo, ports: Mapping[int, int]) -> PodInfo:
    # Only a server that fronts several ranks (a head-headless replica) publishes for ranks it does not run.
    if entry.side_channel_port is None or entry.dp_rank is not None or entry.dp_size < 2:
        return entry
    if not all(r in ports for r in range(entry.dp_size)):
        return entry
    return replace(entry, side_channel_ports=tuple(ports[r] for r in range(entry.dp_size)))


def published_ports(entry: PodInfo, env: Mapping[str, str], ranks: Sequence[int]) -> list[int]:
    """The side-channel port of each rank `entry` announces, as published once its server is up: the ranks the
    server runs itself (`ranks`) on its own base from `env` (moved if it was taken by then), the others as agreed
    (the entry's list), and any rank the entry does not list on the server's base."""
    if ENV not in env:
        return []
    base = int(env[ENV])
    announced = [entry.dp_rank] if entry.dp_rank is not None else list(range(entry.dp_size))
    agreed = entry.side_channel_ports
    return [base + r if r in ranks or r >= len(agreed) else agreed[r] for r in announced]
