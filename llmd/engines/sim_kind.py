"""engine.kind "sim": the simulated vLLM engine (llmd/engines/sim/) as the rest of llmd starts, routes to and reports
it; registered in llmd.engines.kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmd.engines.kinds import EngineBackend, register_engine_kind

if TYPE_CHECKING:
    from llmd.fabric.plan import Placement
    from llmd.spec.checks import SpecIssue
    from llmd.spec.layout import EngineEndpoint
    from llmd.spec.model import DeploymentSpec


def sim_argv(spec_path: str, ep: EngineEndpoint, address: str, node: str, side_channel: bool, python: str) -> list[str]:
    """`llmd engine sim` for one replica with the layout's ports, bound to the node's address."""
    argv = [
        python, "-m", "llmd.cli", "engine", "sim",
        "--spec", spec_path,
        "--role", ep.role,
        "--name", ep.name,
        "--host", address,
        "--port", str(ep.http_port),
        "--dp-ranks", str(ep.dp_size),
        "--kv-events-endpoint", ep.kv_events_endpoint(bind=True),
        "--kv-events-replay-endpoint", ep.replay_endpoint(bind=True),
        "--engine-id", ep.engine_id,
        "--node", node,
    ]  # fmt: skip
    if side_channel:
        argv += ["--side-channel-host", address, "--side-channel-port", str(ep.side_channel_port)]
    return argv


def place(p: Placement) -> None:
    """One `llmd engine sim` server per replica, on the replica's first node, runs all the replica's DP ranks."""
    from llmd.fabric.plan import EngineProcess

    for ep in p.eps:
        k = ep.replica * p.per_replica
        argv = sim_argv(p.spec_path, ep, p.addresses[k], p.nodes[k], True, p.python)
        env = {**p.spec.engine.env, **p.pool.env}
        entry = p.entry(ep, k)
        p.procs[k].append(EngineProcess(ep.name, argv, env, ep.http_port, f"{entry.url}/health", [entry]))
    for k in range(len(p.nodes)):
        # The sim runs every rank in one server, but the layout (and the plan shown to people) is vLLM's.
        p.ranks[k] = [r for r in range(p.pool.dp_size) if min(r // p.local, p.per_replica - 1) == k % p.per_replica]


def spec_issues(spec: DeploymentSpec) -> list[SpecIssue]:
    return []


# The latency profile the embedded demo's simulated engines run: the tiny model's own step times are microseconds, so
# a prefill would cost nothing and caching would not matter; an 8B model on the spec's GPU makes it cost what it does.
DEMO_LATENCY_MODEL = "llama-3.1-8b"


def demo_spec(spec: DeploymentSpec, embedded: bool) -> DeploymentSpec:
    if not embedded:
        return spec
    tokenizer = spec.model.tokenizer or spec.model.path  # the tiny model's tokenizer still writes the prompts
    return spec.model_copy(
        update={"model": spec.model.model_copy(update={"path": DEMO_LATENCY_MODEL, "tokenizer": tokenizer})}
    )


SIM = register_engine_kind(
    EngineBackend(
        name="sim",
        simulated=True,
        report_tool="llmd-sim",
        p2p_mode="hash",
        needs_fabric=False,
        needs_tokenizer_file=True,  # the simulated engines tokenize with the model's tokenizer.json
        streams_metrics=True,
        place=place,
        spec_issues=spec_issues,
        demo_spec=demo_spec,
    )
)
