"""engine.kind "vllm": real vLLM servers (command lines in llmd/engines/vllm.py) as the rest of llmd starts, routes to
and reports them; registered in llmd.engines.kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmd.engines.kinds import EngineBackend, register_engine_kind
from llmd.engines.vllm import head_placeholder, vllm_launches
from llmd.errors import UserError

if TYPE_CHECKING:
    from llmd.fabric.plan import Placement
    from llmd.spec.checks import SpecIssue
    from llmd.spec.model import DeploymentSpec


def place(p: Placement) -> None:
    """`vllm_launches` with the placeholders resolved: a replica's head address is the address of its first node,
    NODE_ADDRESS the node's own."""
    from llmd.fabric.plan import EngineProcess, rank_entry, resolve

    heads = {head_placeholder(p.role, ep.replica): p.addresses[ep.replica * p.per_replica] for ep in p.eps}
    by_ep = {ep.replica: ep for ep in p.eps}
    for launch in vllm_launches(p.spec, python=p.python, mode=p.mode, run_id=p.run_id):
        if launch.role != p.role:
            continue
        if launch.node_index >= p.per_replica:
            raise UserError(
                f"{p.role}: replica {launch.replica} needs more than {p.per_replica} nodes for dp_size "
                f"{p.pool.dp_size} at {p.local} DP ranks per node; fix {p.role}.dp_size, gpus_per_node or tp_size"
            )
        k = launch.replica * p.per_replica + launch.node_index
        address = p.addresses[k]
        argv = [resolve(a, heads, address) for a in launch.argv]
        env = {key: resolve(v, heads, address) for key, v in launch.env.items()}
        ep = by_ep[launch.replica]
        p.ranks[k].extend(launch.ranks)
        if launch.http_port is None:
            name = f"{ep.name}-node{launch.node_index}"
            p.procs[k].append(EngineProcess(name, argv, env, None, None, ranks=launch.ranks))
            continue
        if p.mode == "per-rank" and ep.dp_size > 1:
            rank = launch.ranks[0]
            entries = [rank_entry(ep, rank, launch.http_port, address, p.nodes[k])]
            name = f"{ep.name}-dp{rank}"
        else:
            entries = [p.entry(ep, k)]
            name = ep.name
        url = f"http://{address}:{launch.http_port}"
        p.procs[k].append(EngineProcess(name, argv, env, launch.http_port, f"{url}/health", entries, launch.ranks))


def spec_issues(spec: DeploymentSpec) -> list[SpecIssue]:
    """vLLM loads real weights, and its CPU build runs only some block sizes."""
    from llmd.spec.checks import SpecIssue, multiples

    issues = []
    if not spec.model.path.strip():
        issues.append(
            SpecIssue(
                "model.path",
                'is empty, but engine.kind "vllm" loads real weights; set model.path to a local folder or a hub name '
                '(e.g. "zai-org/GLM-5.2")',
            )
        )
    block = spec.model.block_size
    # vLLM's CPU attention kernels refuse other block sizes; engine.gpu "cpu" is how a spec says it runs on CPUs.
    if spec.engine.gpu == "cpu" and block % 32 != 0:
        issues.append(
            SpecIssue(
                "model.block_size",
                f'{block} does not run on vLLM\'s CPU build (engine.gpu "cpu"): its attention needs a multiple of 32; '
                f"use {multiples(block, 32)}",
            )
        )
    return issues


def demo_spec(spec: DeploymentSpec, embedded: bool) -> DeploymentSpec:
    from llmd.engines.vllm_deploy import demo_spec as vllm_demo_spec  # real vLLM CPU servers

    return vllm_demo_spec(spec, embedded=embedded)


VLLM = register_engine_kind(
    EngineBackend(
        name="vllm",
        simulated=False,
        report_tool="vllm",
        p2p_mode="two-hop",  # stock vLLM pulls only leased blocks: P2P goes through the holder as a prefill pod
        needs_fabric=True,
        needs_tokenizer_file=False,
        streams_metrics=False,
        place=place,
        spec_issues=spec_issues,
        demo_spec=demo_spec,
    )
)
