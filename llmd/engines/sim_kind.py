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


# The latency profile the embedded demo's simulated engines run. The tiny model's own step times are microseconds, so a
# prefill would cost nothing and caching would not matter. The demo's contexts are 4% of agentic traffic's (a session
# grows to ~2.6K tokens, not 195K); on an 8B model a miss at that size costs ~60 ms, less than the one process's CPU
# time per request, and no routing decision showed in TTFT (cluster simulator, six seeds: precise / approximate /
# round-robin TTFT p90 0.81 / 0.78 / 0.82 s, all set by CPU queueing). A 70B model at TP 2 on the spec's GPU makes a
# miss cost ~0.25 s, as a long context does on a smaller model: what a cache hit saves is then what TTFT shows.
DEMO_LATENCY_MODEL = "llama-3.1-70b"
DEMO_TP = 2


def demo_spec(spec: DeploymentSpec, embedded: bool) -> DeploymentSpec:
    if not embedded:
        return spec
    tokenizer = spec.model.tokenizer or spec.model.path  # the tiny model's tokenizer still writes the prompts
    tp = {"tp_size": DEMO_TP, "gpus_per_node": DEMO_TP}
    return spec.model_copy(
        update={
            "model": spec.model.model_copy(update={"path": DEMO_LATENCY_MODEL, "tokenizer": tokenizer}),
            "prefill": spec.prefill.model_copy(update=tp),
            "decode": spec.decode.model_copy(update=tp),
        }
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
