"""What each node of an engine component runs: a pure function of the spec, the role and the component's node list.

Node k of the `role` pool belongs to replica k // nodes_per_replica (its node k % nodes_per_replica). For
engine.kind vllm the processes are `llmd.engines.vllm.vllm_launches` with the placeholders resolved (a replica's head
address is the address of its first node; NODE_ADDRESS is the node's own); for engine.kind sim one `llmd engine sim`
server per replica, on the replica's first node, runs all the replica's DP ranks. Ports come from llmd.spec.layout.
Each process that serves HTTP carries the discovery entries (llmd.discovery) to publish once healthy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.discovery import PodInfo, entry_for
from llmd.engines.vllm import NODE_ADDRESS, LaunchMode, dp_local, head_placeholder, vllm_launches
from llmd.errors import UserError
from llmd.spec.layout import EngineEndpoint, engine_endpoints
from llmd.spec.model import DeploymentSpec

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


def _resolve(text: str, heads: dict[str, str], node_address: str) -> str:
    for placeholder, address in heads.items():
        text = text.replace(placeholder, address)
    return text.replace(NODE_ADDRESS, node_address)


def _rank_entry(ep: EngineEndpoint, rank: int, port: int, address: str, node: str) -> PodInfo:
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


def sim_argv(spec_path: str, ep: EngineEndpoint, address: str, node: str, side_channel: bool, python: str) -> list[str]:
    """`llmd engine sim` for one replica with the layout's ports, bound to the node's address."""
    argv = [
        python,
        "-m",
        "llmd.cli",
        "engine",
        "sim",
        "--spec",
        spec_path,
        "--role",
        ep.role,
        "--name",
        ep.name,
        "--host",
        address,
        "--port",
        str(ep.http_port),
        "--dp-ranks",
        str(ep.dp_size),
        "--kv-events-endpoint",
        ep.kv_events_endpoint(bind=True),
        "--kv-events-replay-endpoint",
        ep.replay_endpoint(bind=True),
        "--engine-id",
        ep.engine_id,
        "--node",
        node,
    ]
    if side_channel:
        argv += ["--side-channel-host", address, "--side-channel-port", str(ep.side_channel_port)]
    return argv


def plan_nodes(
    spec: DeploymentSpec,
    role: str,
    nodes: Sequence[str],
    addresses: Sequence[str] | None = None,
    *,
    spec_path: str = "spec.yaml",
    python: str = "python",
    mode: LaunchMode = "head-headless",
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
    heads = {head_placeholder(role, ep.replica): addresses[ep.replica * per_replica] for ep in eps}
    local = dp_local(pool)

    def rank_hosts(replica: int) -> list[str]:
        first = replica * per_replica
        return [addresses[min(first + r // local, first + per_replica - 1)] for r in range(pool.dp_size)]

    procs: dict[int, list[EngineProcess]] = {k: [] for k in range(len(nodes))}
    ranks: dict[int, list[int]] = {k: [] for k in range(len(nodes))}
    if spec.engine.kind == "sim":
        for ep in eps:
            k = ep.replica * per_replica
            address = addresses[k]
            argv = sim_argv(spec_path, ep, address, nodes[k], True, python)
            env = {**spec.engine.env, **pool.env}
            entry = entry_for(ep, address, node=nodes[k], rank_hosts=rank_hosts(ep.replica))
            procs[k].append(EngineProcess(ep.name, argv, env, ep.http_port, f"{entry.url}/health", [entry]))
        for k in range(len(nodes)):
            # The sim runs every rank in one server, but the layout (and the plan shown to people) is vLLM's.
            ranks[k] = [r for r in range(pool.dp_size) if min(r // local, per_replica - 1) == k % per_replica]
    else:
        by_ep = {ep.replica: ep for ep in eps}
        for launch in vllm_launches(spec, python=python, mode=mode):
            if launch.role != role:
                continue
            if launch.node_index >= per_replica:
                raise UserError(
                    f"{role}: replica {launch.replica} needs more than {per_replica} nodes for dp_size "
                    f"{pool.dp_size} at {local} DP ranks per node; fix {role}.dp_size, gpus_per_node or tp_size"
                )
            k = launch.replica * per_replica + launch.node_index
            address = addresses[k]
            argv = [_resolve(a, heads, address) for a in launch.argv]
            env = {key: _resolve(v, heads, address) for key, v in launch.env.items()}
            ep = by_ep[launch.replica]
            ranks[k].extend(launch.ranks)
            if launch.http_port is None:
                procs[k].append(EngineProcess(f"{ep.name}-node{launch.node_index}", argv, env, None, None))
                continue
            if mode == "per-rank" and ep.dp_size > 1:
                rank = launch.ranks[0]
                entries = [_rank_entry(ep, rank, launch.http_port, address, nodes[k])]
                name = f"{ep.name}-dp{rank}"
            else:
                entries = [entry_for(ep, address, node=nodes[k], rank_hosts=rank_hosts(ep.replica))]
                name = ep.name
            url = f"http://{address}:{launch.http_port}"
            procs[k].append(EngineProcess(name, argv, env, launch.http_port, f"{url}/health", entries))
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
