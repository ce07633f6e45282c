"""Cross-field semantic checks on a deployment spec, and the issue/error types every spec problem is reported as.

Each check is a small function returning a list of `SpecIssue`; `@check(...)` names the sections it reads so the loader
can still run it when some other section failed to parse.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from llmd.errors import UserError
from llmd.spec.layout import MAX_POOL_RANKS, MAX_PORT, highest_port
from llmd.spec.model import DeploymentSpec, PoolSpec


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec: the dotted path of the field (`decode.dp_size`), what is wrong and what is allowed."""

    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line is not None and self.path else ""
        return f"{self.path}: {self.message}{where}" if self.path else self.message


class SpecError(UserError):
    """A spec with problems; `errors` lists all of them, so the user can fix everything in one go."""

    def __init__(self, source: str, errors: list[SpecIssue]) -> None:
        self.source = source
        self.errors = list(errors)
        super().__init__("\n".join(f"{source}: {issue}" for issue in self.errors))


Check = Callable[[DeploymentSpec], list[SpecIssue]]
_CHECKS: list[tuple[frozenset[str], Check]] = []


def check(*sections: str) -> Callable[[Check], Check]:
    """Register a check that reads only `sections` of the spec."""

    def register(fn: Check) -> Check:
        _CHECKS.append((frozenset(sections), fn))
        return fn

    return register


def run_checks(spec: DeploymentSpec, parsed: Collection[str] | None = None) -> list[SpecIssue]:
    """Run every check whose sections are all in `parsed` (default: all); return their issues in order."""
    issues: list[SpecIssue] = []
    for sections, fn in _CHECKS:
        if parsed is None or sections <= set(parsed):
            issues.extend(fn(spec))
    return issues


def multiples(value: int, step: int) -> str:
    below = value - value % step
    return f"{below} or {below + step}" if below > 0 else str(below + step)


def _divisors(value: int, limit: int = 6) -> str:
    found = [d for d in range(1, value + 1) if value % d == 0]
    shown = ", ".join(str(d) for d in found[:limit])
    return shown + (", ..." if len(found) > limit else "")


def pool_layout_issues(role: str, pool: PoolSpec) -> list[SpecIssue]:
    """How a pool's nodes split into replicas and each replica's GPUs into DP x TP ranks."""
    if pool.nodes == 0:
        return []
    issues: list[SpecIssue] = []
    ranks = pool.dp_size * pool.tp_size
    if pool.ep and ranks == 1:
        issues.append(
            SpecIssue(
                f"{role}.ep",
                f"true needs more than one rank per replica to spread experts over, but dp_size ({pool.dp_size}) x "
                f"tp_size ({pool.tp_size}) = 1; raise dp_size or set ep: false",
            )
        )
    if pool.nodes % pool.replicas:
        issues.append(
            SpecIssue(
                f"{role}.nodes",
                f"{pool.nodes} is not a multiple of {role}.replicas ({pool.replicas}); every replica needs the same "
                f"whole number of nodes: use nodes {multiples(pool.nodes, pool.replicas)}, or replicas that divide "
                f"{pool.nodes} ({_divisors(pool.nodes)})",
            )
        )
        # GPUs per replica is undefined until this is fixed, so the rank checks below would only add noise.
        return issues
    per_replica = pool.gpus_per_replica
    if pool.nodes_per_replica > 1 and ranks % pool.gpus_per_node:
        given = (
            str(pool.dp_size) if pool.tp_size == 1 else f"dp_size ({pool.dp_size}) x tp_size ({pool.tp_size}) = {ranks}"
        )
        issues.append(
            SpecIssue(
                f"{role}.dp_size",
                f"{given} is not a multiple of {role}.gpus_per_node ({pool.gpus_per_node}); a replica spanning "
                f"{pool.nodes_per_replica} nodes must fill each of them with ranks",
            )
        )
    if ranks != per_replica:
        if per_replica % pool.tp_size == 0:
            fix = f"set dp_size to {per_replica // pool.tp_size}"
        else:
            fix = f"make dp_size x tp_size equal {per_replica}"
        issues.append(
            SpecIssue(
                role,
                f"dp_size ({pool.dp_size}) x tp_size ({pool.tp_size}) = {ranks} GPUs per replica, but nodes/replicas x "
                f"gpus_per_node = {pool.nodes_per_replica} x {pool.gpus_per_node} = {per_replica}; {fix}, or change "
                "nodes, replicas or gpus_per_node",
            )
        )
    return issues + pool_port_issues(role, pool)


def pool_port_issues(role: str, pool: PoolSpec) -> list[SpecIssue]:
    """Whether a pool's port layout (llmd.spec.layout) fits: its rank bands are 1000 ports apart, and its last port
    (the base + up to 5000 + replicas) must be a port. Said here, before a job is queued: past it, a launcher's probe
    of the layout's ports would fail on every node, and vLLM would refuse its DP RPC port."""
    if pool.ranks > MAX_POOL_RANKS:
        return [
            SpecIssue(
                role,
                f"dp_size ({pool.dp_size}) x replicas ({pool.replicas}) = {pool.ranks} DP ranks, but the port layout "
                f"has room for {MAX_POOL_RANKS} per pool (its bands are {MAX_POOL_RANKS} ports apart); use fewer "
                "replicas or a smaller dp_size, or split the pool into two deployments",
            )
        ]
    if pool.port == "auto" or highest_port(pool) <= MAX_PORT:
        return []
    span = highest_port(pool) - pool.port
    last = ", per-rank HTTP and DP RPC" if pool.dp_size > 1 else " and per-rank HTTP"
    bands = f"HTTP, KV-event, side-channel, replay{last}"
    return [
        SpecIssue(
            f"{role}.port",
            f"{pool.port} puts the pool's last port at {pool.port + span} (its {bands} ports are the base + 0 to "
            f'{span}), past {MAX_PORT}; give a base port of at most {MAX_PORT - span}, or "auto" for free ports on '
            "each node",
        )
    ]


@check("prefill")
def check_prefill_layout(spec: DeploymentSpec) -> list[SpecIssue]:
    return pool_layout_issues("prefill", spec.prefill)


@check("decode")
def check_decode_layout(spec: DeploymentSpec) -> list[SpecIssue]:
    if spec.decode.nodes < 1:
        return [
            SpecIssue(
                "decode.nodes",
                "0 leaves no engine to generate tokens; decode needs at least 1 node (set prefill.nodes to 0 to run "
                "without disaggregation instead)",
            )
        ]
    return pool_layout_issues("decode", spec.decode)


def _batching_issues(role: str, pool: PoolSpec) -> list[SpecIssue]:
    # vLLM refuses to start with a token budget smaller than its sequence budget; say so before a job is queued.
    if pool.nodes == 0 or pool.max_num_batched_tokens >= pool.max_num_seqs:
        return []
    return [
        SpecIssue(
            f"{role}.max_num_batched_tokens",
            f"{pool.max_num_batched_tokens} is smaller than {role}.max_num_seqs ({pool.max_num_seqs}); each step must "
            "fit at least one token per running sequence",
        )
    ]


@check("prefill", "decode")
def check_batching(spec: DeploymentSpec) -> list[SpecIssue]:
    return _batching_issues("prefill", spec.prefill) + _batching_issues("decode", spec.decode)


@check("model")
def check_hash_seed(spec: DeploymentSpec) -> list[SpecIssue]:
    model = spec.model
    if model.hash_algo.startswith("xxhash") and model.hash_seed is None:
        return [
            SpecIssue(
                "model.hash_seed",
                f'is not set, but hash_algo "{model.hash_algo}" then makes vLLM use a random per-process hash seed, '
                'so no two engines (and no router) could match block hashes; set model.hash_seed (e.g. "0") or use '
                "hash_algo sha256",
            )
        ]
    return []


@check("model")
def check_context_fits_a_block(spec: DeploymentSpec) -> list[SpecIssue]:
    model = spec.model
    if model.max_model_len >= model.block_size:
        return []
    return [
        SpecIssue(
            "model.max_model_len",
            f"{model.max_model_len} is shorter than one KV block (model.block_size {model.block_size}); raise it",
        )
    ]


@check("model", "kv")
def check_kv_holds_one_request(spec: DeploymentSpec) -> list[SpecIssue]:
    """An engine refuses to start when its KV cannot hold one max_model_len request (vLLM: "To serve at least one
    request with the models's max seq len ... blocks are needed"); say so at spec check, not as a traceback at start.
    Block 0 is vLLM's null block and holds no KV."""
    blocks = spec.kv.gpu_blocks
    model = spec.model
    if blocks is None or model.block_size < 1:
        return []
    need = -(-model.max_model_len // model.block_size) + 1
    if blocks >= need:
        return []
    return [
        SpecIssue(
            "kv.gpu_blocks",
            f"{blocks} blocks of {model.block_size} tokens cannot hold one request of model.max_model_len "
            f"{model.max_model_len} (needs {need}, one of them vLLM's null block); raise kv.gpu_blocks to at least "
            f"{need} or lower model.max_model_len",
        )
    ]


@check("engine", "model")
def check_engine_kind(spec: DeploymentSpec) -> list[SpecIssue]:
    """What only the spec's engine kind needs (e.g. vLLM's model weights), from its entry in llmd.engines.kinds."""
    from llmd.engines.kinds import engine_kind

    return engine_kind(spec.engine.kind).spec_issues(spec)


@check("workload")
def check_trace_path(spec: DeploymentSpec) -> list[SpecIssue]:
    workload = spec.workload
    if workload.profile == "trace" and not workload.trace_path:
        return [
            SpecIssue(
                "workload.trace_path",
                'is not set, but profile "trace" replays a recorded trace; set workload.trace_path to the trace file',
            )
        ]
    if workload.profile != "trace" and workload.trace_path:
        return [
            SpecIssue(
                "workload.trace_path",
                f'is only read by profile "trace", but profile is "{workload.profile}"; set profile: trace or remove '
                "trace_path",
            )
        ]
    return []


@check("router")
def check_router_weights(spec: DeploymentSpec) -> list[SpecIssue]:
    router = spec.router
    if router.policy in ("precise", "approximate") and not any(w > 0 for w in router.weights.values()):
        return [
            SpecIssue(
                "router.weights",
                f'has no positive weight, so policy "{router.policy}" would score every pod the same; give at least '
                "one scorer a weight above 0 (e.g. prefix: 2.0)",
            )
        ]
    return []
