"""What each node of an engine component runs: a pure function of the spec, the role and the component's node list.

Node k of the `role` pool belongs to replica k // nodes_per_replica (its node k % nodes_per_replica). Which processes
run where is the engine kind's (its `place`, llmd.engines.kinds): for vllm, llmd/engines/vllm_kind.py; for the
simulated engine, llmd/engines/sim_kind.py. Ports come from llmd.spec.layout.
Each process that serves HTTP carries the discovery entries (llmd.discovery) to publish once healthy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.discovery import PodInfo, entry_for
from llmd.engines.kinds import engine_kind
from llmd.engines.vllm import NODE_ADDRESS, LaunchMode, dp_local
from llmd.errors import UserError
from llmd.spec.layout import EngineEndpoint, engine_endpoints
from llmd.spec.model import DeploymentSpec, PoolSpec

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class EngineProcess:
    """One process to start on a node, and what to announce once it is healthy."""

    name: str  # for logs: "decode-0", "decode-0-node1", "decode-0-dp3"
    argv: list[str]
    env: dict[str, str]
    http_port: int | None  # None: headless, no /health to wait for
    health_url: str | None
    discovery: list[PodInfo] = field(default_factory=list)
    # The DP ranks (within its replica) it runs; vLLM adds each to the rank-0 side-channel and KV-event ports it gets.
    ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class NodePlan:
    """Node `index` of the component: its replica, DP ranks (within the replica) and processes."""

    index: int
    node: str
    address: str
    role: str
    replica: int
    node_in_replica: int
    dp_ranks: list[int]
    processes: list[EngineProcess]

    @property
    def ports(self) -> list[int]:
        return [p.http_port for p in self.processes if p.http_port is not None]


@dataclass
class Placement:
    """One pool's nodes as plan_nodes lays them out; an engine kind's `place` fills `procs` and `ranks` per node."""

    spec: DeploymentSpec
    role: str
    pool: PoolSpec
    eps: list[EngineEndpoint]
    nodes: list[str]
    addresses: list[str]
    per_replica: int  # nodes per replica: node k is replica k // per_replica
    local: int  # DP ranks per node
    spec_path: str
    python: str
    mode: LaunchMode
    run_id: str | None = None  # llmd.runid: vLLM serves it as a second model name, so /v1/models vouches for the run
    procs: dict[int, list[EngineProcess]] = field(default_factory=dict)
    ranks: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.procs = {k: [] for k in range(len(self.nodes))}
        self.ranks = {k: [] for k in range(len(self.nodes))}

    def rank_hosts(self, replica: int) -> list[str]:
        """The address each DP rank of a replica runs on, as vLLM lays ranks out over the replica's nodes."""
        first = replica * self.per_replica
        last = first + self.per_replica - 1
        return [self.addresses[min(first + r // self.local, last)] for r in range(self.pool.dp_size)]

    def entry(self, ep: EngineEndpoint, k: int) -> PodInfo:
        """The discovery entry of a replica's server on node k."""
        return entry_for(ep, self.addresses[k], node=self.nodes[k], rank_hosts=self.rank_hosts(ep.replica))


def resolve(text: str, heads: dict[str, str], node_address: str) -> str:
    for placeholder, address in heads.items():
        text = text.replace(placeholder, address)
    return text.replace(NODE_ADDRESS, node_address)


def rank_entry(ep: EngineEndpoint, rank: int, port: int, address: str, node: str) -> PodInfo:
    # Mode "per-rank": each DP rank is its own API server and pod; vLLM names rank r's NIXL engine `<id>_dp<r>`.
    return PodInfo(
        name=f"{ep.name}-dp{rank}",
        role=ep.role,
        url=f"http://{address}:{port}",
        dp_size=1,
        kv_events_endpoint=f"tcp://*:{ep.kv_events_port + rank}",
        kv_events_replay_endpoint=f"tcp://*:{ep.replay_port + rank}",
        side_channel_host=address,
        side_channel_port=ep.side_channel_port + rank,
        engine_id=ep.engine_id if rank == 0 else f"{ep.engine_id}_dp{rank}",
        node=node,
        replica=ep.replica,
        dp_rank=rank,
    )


def plan_nodes(
    spec: DeploymentSpec,
    role: str,
    nodes: Sequence[str],
    addresses: Sequence[str] | None = None,
    *,
    spec_path: str = "spec.yaml",
    python: str = "python",
    mode: LaunchMode = "head-headless",
    run_id: str | None = None,
) -> list[NodePlan]:
    """One NodePlan per node of the `role` pool; `nodes[k]` is node k's name, `addresses[k]` its address (default:
    the name). UserError when the node count does not match the spec."""
    if role not in ROLES:
        raise UserError(f"role {role!r} is not one of {', '.join(ROLES)}")
    pool = spec.prefill if role == "prefill" else spec.decode
    if not pool.enabled:
        raise UserError(f"the spec has no {role} pool ({role}.nodes is 0); start the fabric with --role decode")
    addresses = list(addresses) if addresses is not None else list(nodes)
    if len(addresses) != len(nodes):
        raise ValueError("nodes and addresses differ in length")
    if len(nodes) != pool.nodes:
        raise UserError(
            f"the {role} pool needs {pool.nodes} nodes ({role}.nodes in the spec) but this component has "
            f"{len(nodes)} tasks; start exactly one task per node (srun --ntasks-per-node=1, or mpiexec -n "
            f"{pool.nodes} locally)"
        )
    per_replica = pool.nodes_per_replica
    if per_replica < 1 or per_replica * pool.replicas != pool.nodes:
        raise UserError(f"{role}.nodes ({pool.nodes}) must be a multiple of {role}.replicas ({pool.replicas})")
    eps = [ep for ep in engine_endpoints(spec) if ep.role == role]
    p = Placement(
        spec, role, pool, eps, list(nodes), addresses, per_replica, dp_local(pool), spec_path, python, mode, run_id
    )
    engine_kind(spec.engine.kind).place(p)
    procs, ranks = p.procs, p.ranks
    return [
        NodePlan(
            index=k,
            node=nodes[k],
            address=addresses[k],
            role=role,
            replica=k // per_replica,
            node_in_replica=k % per_replica,
            dp_ranks=sorted(ranks[k]),
            processes=procs[k],
        )
        for k in range(len(nodes))
    ]
