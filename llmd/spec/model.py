"""The typed deployment spec: one description of a deployment shared by launchers, engines, benchmarks and simulators.

The defaults alone describe a valid tiny local deployment of simulated engines, so `DeploymentSpec()` always works.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from llmd.spec import values

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
RouterPolicy = Literal["precise", "approximate", "round-robin", "least-loaded", "random"]
KVTier = Literal["gpu", "cpu"]
PDDecider = Literal["threshold", "queue-aware"]
EngineKind = Literal["sim", "vllm"]
WorkloadProfile = Literal["smoke", "automationbench", "cybergym", "agentx", "trace-stats", "trace"]

# The loader validates with this context key set so it can run the semantic checks itself and collect their issues
# alongside the field errors; anyone else constructing a spec gets the checks from the model validator.
SKIP_CHECKS = "llmd_skip_checks"
PREFILL_PORT = 8100
DECODE_PORT = 8200

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_SLURM_MEM_RE = re.compile(r"^[0-9]+[KMGTkmgt]?$")
_SLURM_TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 04:00:00, 1-12:00)"
_SLURM_TIME_RE = re.compile(
    r"^(?:(?P<m>\d+)"
    r"|(?P<m2>\d+):(?P<s2>\d+)"
    r"|(?P<h3>\d+):(?P<m3>\d+):(?P<s3>\d+)"
    r"|(?P<d>\d+)-(?P<h>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?)$"
)

# Decimal and binary units as people write them; bare K/M/G/T is refused because half the world reads it as 2^30.
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
SIZE_EXAMPLES = '"100GiB", "512MiB", "1.5TB" or a plain number of bytes'


def parse_size(text: str) -> int:
    """Parse a human byte size ("100GiB", "512MiB", "1.5TB", "1024") into bytes; ValueError says what is allowed."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"is not a size; write it like {SIZE_EXAMPLES}")
    number, unit = match.groups()
    unit_key = unit.lower()
    if unit_key in ("k", "m", "g", "t", "p"):
        raise ValueError(
            f"has an ambiguous unit {unit!r}; write {number}{unit.upper()}iB (powers of 2) or {number}{unit.upper()}B "
            "(powers of 10)"
        )
    if unit_key not in _SIZE_UNITS:
        raise ValueError(f"has an unknown unit {unit!r}; write it like {SIZE_EXAMPLES}")
    size = float(number.replace("_", "")) * _SIZE_UNITS[unit_key]
    if not math.isfinite(size):
        raise ValueError("is too large to be a size")
    return round(size)


def _scalar_to_str(value: Any) -> Any:
    # Env values and engine flags are strings to the OS, but YAML turns `CUDA_VISIBLE_DEVICES: 0` or `[--max-loras, 4]`
    # into numbers; converting those is unambiguous. Booleans are left to fail: "true", "True" and "1" all differ.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _scorer_name(name: str) -> str:
    # The scorers register themselves with the router's plugin registry, so a scorer added there is a valid key here
    # with no second list to keep. Imported on use: the spec module itself imports nothing else of llmd's. Raised as a
    # Literal's error so pydantic and llmd.spec.load report it as before ("unknown scorer ...; use one of: ...").
    from llmd.router.scheduling.plugins import scorer_names

    names = scorer_names()
    if name not in names:
        expected = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}" if len(names) > 1 else repr(names[0])
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


ScorerName = Annotated[str, AfterValidator(_scorer_name)]
Weight = Annotated[float, Field(ge=0)]
SbatchOption = Annotated[str, AfterValidator(values.sbatch_option)]
EnvName = Annotated[str, AfterValidator(values.env_name)]
Partition = Annotated[str, AfterValidator(values.partition)]
Account = Annotated[str, AfterValidator(values.account)]
Constraint = Annotated[str, AfterValidator(values.constraint)]
ContainerImage = Annotated[str, AfterValidator(values.container_image)]
Host = Annotated[str, AfterValidator(values.host)]
# A listening port: a number, or "auto" for any free port on the node (the component publishes the one it bound:
# engines in the discovery file, the router in run.json). A numbered port that is taken on a shared node is also
# replaced by a free one when llmd launches the component, and published the same way.
Port = Annotated[int | Literal["auto"], BeforeValidator(values.port)]


class _Section(BaseModel):
    # strict: a quoted "16" is not an integer and "yes" is not a boolean; ints are still fine for float fields.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _one_line(cls, value: Any) -> Any:
        # Every string of a spec may reach a batch script, a command line, a log line or an HDF5 attribute; a newline
        # or an escape sequence in any of them is never meant and can turn a value into a script line of its own.
        return values.no_control_anywhere(value)


class ModelSpec(_Section):
    """The model the engines serve and the KV-block hashing every component must agree on."""

    path: str = Field(default="models/tiny", description="Local folder or hub name of the model weights.")
    served_name: str | None = Field(default=None, description="Name clients ask for; default: basename of path.")
    tokenizer: str | None = Field(default=None, description="Tokenizer folder or hub name; default: path.")
    block_size: int = Field(default=16, description="KV block size in tokens: 1 or a multiple of 8 up to 1024.")
    hash_algo: HashAlgo = Field(default="sha256", description="vLLM --prefix-caching-hash-algo.")
    hash_seed: str | None = Field(default=None, description="PYTHONHASHSEED the engines run with.")
    max_model_len: int = Field(default=4096, ge=1)
    active_params_b: float | None = Field(default=None, gt=0, description="Active parameters, billions (MoE).")
    total_params_b: float | None = Field(default=None, gt=0, description="Total parameters, billions.")

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if value == 1 or (value > 0 and value % 8 == 0 and value <= 1024):
            return value
        raise ValueError("is not a valid block size; use 1 or a multiple of 8 up to 1024 (16 and 64 are common)")

    @field_validator("hash_seed", mode="before")
    @classmethod
    def _hash_seed(cls, value: Any) -> Any:
        value = value if isinstance(value, bool) else _scalar_to_str(value)
        if isinstance(value, str) and not (value.isdigit() and int(value) <= 4294967295):
            raise ValueError("is not a valid PYTHONHASHSEED; use an integer from 0 to 4294967295, e.g. 0")
        return value

    @model_validator(mode="after")
    def _derive_names(self) -> ModelSpec:
        # Resolved here rather than at each use so every component serves and asks for the same name.
        if self.served_name is None:
            self.served_name = os.path.basename(self.path.rstrip("/")) or "model"
        if self.tokenizer is None:
            self.tokenizer = self.path
        return self


class PoolSpec(_Section):
    """One pool of engine replicas (prefill or decode); each replica spans nodes/replicas whole nodes."""

    nodes: int = Field(default=1, ge=0, description="Nodes for the whole pool; prefill 0 means no disaggregation.")
    replicas: int = Field(default=1, ge=1, description="Engine instances in the pool.")
    gpus_per_node: int = Field(default=1, ge=1)
    tp_size: int = Field(default=1, ge=1, description="Tensor parallel size per DP rank.")
    dp_size: int = Field(default=1, ge=1, description="Data parallel ranks per replica.")
    ep: bool = Field(default=False, description="Expert parallelism across the replica's DP ranks.")
    extra_args: list[str] = Field(default_factory=list, description="Passed verbatim to the engine.")
    env: dict[EnvName, str] = Field(default_factory=dict)
    port: Port = Field(
        default=PREFILL_PORT,
        description="Base port (1-65535; decode defaults to 8200) of the pool's HTTP, KV-event, replay and "
        'side-channel ports (llmd.spec.layout), or "auto": any free ports on each node. Launched engines take a free '
        "port when theirs is taken and publish what they bound in the discovery file; the router follows that.",
    )
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)

    @field_validator("extra_args", mode="before")
    @classmethod
    def _args_to_str(cls, value: Any) -> Any:
        return [_scalar_to_str(v) for v in value] if isinstance(value, list) else value

    @field_validator("env", mode="before")
    @classmethod
    def _env_to_str(cls, value: Any) -> Any:
        return {k: _scalar_to_str(v) for k, v in value.items()} if isinstance(value, dict) else value

    @property
    def enabled(self) -> bool:
        return self.nodes > 0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nodes_per_replica(self) -> int:
        return self.nodes // self.replicas

    @property
    def gpus_per_replica(self) -> int:
        return self.nodes_per_replica * self.gpus_per_node

    @property
    def ranks(self) -> int:
        """DP ranks in the whole pool: each is one engine core the router can address."""
        return self.dp_size * self.replicas


class RouterSpec(_Section):
    """The prefix-aware router: which scorers, how they are weighted, and when to disaggregate."""

    policy: RouterPolicy = "precise"
    # llm-d's sample weights, plus the no-hit-LRU scorer, neutral (0.5 everywhere) unless a request is cold.
    weights: dict[ScorerName, Weight] = Field(
        default_factory=lambda: {"prefix": 2.0, "kv-util": 1.0, "queue": 1.0, "no-hit-lru": 1.0}
    )
    tier_weights: dict[KVTier, Weight] = Field(default_factory=lambda: {"gpu": 1.0, "cpu": 0.8})
    pd_decider: PDDecider = "threshold"
    pd_threshold: int = Field(default=16, ge=0, description="Uncached prompt tokens at which to disaggregate.")
    p2p: bool = Field(default=True, description="Pull cached prefixes from peer engines instead of recomputing.")
    forward_tokens: bool = Field(
        default=True,
        description="Send a completion's text prompt to the engine as the token ids the router computed for prefix "
        "routing (vLLM takes token-id prompts), so the engine does not tokenize it again; false: forward the "
        "client's body untouched.",
    )
    host: Host = "127.0.0.1"
    port: Port = Field(
        default=8000,
        description='Listening port (1-65535) or "auto": any free port. A launched router takes a free port when this '
        "one is taken and publishes the one it bound in run.json (router.url), where the benchmark client reads it.",
    )
    api_key_env: str | None = Field(default=None, description="NAME of the environment variable holding the key.")
    max_inflight_per_pod: int = Field(default=64, ge=1)
    queue_limit: int = Field(default=4096, ge=1)
    speculative_ttl_s: float = Field(default=2.0, ge=0)
    affinity_threshold: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Prefix-cache affinity filter: route only among pods whose prefix score reaches this (llm-d's "
        "decode profile: 0.8 with weights {token-load: 1}); 0: off.",
    )
    max_ttft_penalty_s: float = Field(
        default=18.0, ge=0, description="Affinity filter's load gate: stop sticking when it costs this much TTFT."
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not values.ENV_NAME_RE.match(value):
            raise ValueError(
                "is not an environment variable name; give the NAME of a variable holding the key (like "
                "LLMD_API_KEY), never the key itself"
            )
        return value


class KVSpec(_Section):
    """KV cache capacity: GPU blocks and the CPU DRAM tier."""

    gpu_blocks: int | None = Field(default=None, ge=1, description="Override the GPU block count; None: derived.")
    gpu_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    cpu_bytes: int = Field(default=0, ge=0, description="CPU DRAM KV tier per DP rank; YAML may say 128GiB.")

    @field_validator("cpu_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_size(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @property
    def cpu_gib(self) -> float:
        return self.cpu_bytes / 2**30


class MTPSpec(_Section):
    """Multi-token prediction (speculative decoding with the model's own MTP head)."""

    draft_tokens: int = Field(default=0, ge=0, le=16, description="Speculative tokens per step; 0 turns MTP off.")
    acceptance_rate: float = Field(default=0.68, ge=0, le=1)

    @property
    def enabled(self) -> bool:
        return self.draft_tokens > 0


class CostSpec(_Section):
    """What the GPUs cost, for `llmd analyze`'s cost per million tokens (set beside API prices). Only read by analysis:
    nothing that runs uses it. A pool's own price overrides the fleet's."""

    gpu_hour_usd: float | None = Field(default=None, gt=0, description="USD per GPU-hour, every pool.")
    prefill_gpu_hour_usd: float | None = Field(default=None, gt=0, description="USD per prefill GPU-hour.")
    decode_gpu_hour_usd: float | None = Field(default=None, gt=0, description="USD per decode GPU-hour.")


class EngineSpec(_Section):
    """Which engine runs the pools: the simulated engine or vLLM."""

    kind: EngineKind = "sim"
    gpu: str = Field(default="H100-80GB", description="GPU profile for the simulated engine and latency model.")
    time_scale: float = Field(default=1.0, ge=0)  # wall s per simulated s; 0: as fast as possible
    startup_timeout_s: float = Field(default=600.0, gt=0)
    env: dict[EnvName, str] = Field(default_factory=dict)

    @field_validator("env", mode="before")
    @classmethod
    def _env_to_str(cls, value: Any) -> Any:
        return {k: _scalar_to_str(v) for k, v in value.items()} if isinstance(value, dict) else value


class WorkloadSpec(_Section):
    """The traffic a benchmark drives through the router."""

    profile: WorkloadProfile = "smoke"
    seed: int = 0
    duration_s: float = Field(default=60.0, gt=0)
    concurrency: int = Field(default=8, ge=1)
    context_scale: float = Field(default=1.0, gt=0)
    time_scale: float = Field(default=1.0, gt=0)
    trace_path: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class OutputSpec(_Section):
    dir: str = "results"


class SlurmSpec(_Section):
    """sbatch options for running the deployment on a Slurm cluster."""

    partition: Partition | None = None
    account: Account | None = None
    qos: Account | None = None
    time: str = "01:00:00"
    constraints: list[Constraint] = Field(default_factory=list)
    cpus_per_task: int = Field(default=8, ge=1)
    mem: str | None = Field(default=None, description='Memory per node as sbatch --mem takes it ("64G", "0" = all).')
    container_image: ContainerImage | None = None
    extra_sbatch: list[SbatchOption] = Field(
        default_factory=list, description="Extra sbatch options as --name or --name=value, e.g. --exclusive."
    )
    requeue: bool = False

    @field_validator("time", "mem", mode="before")
    @classmethod
    def _minutes_to_str(cls, value: Any) -> Any:
        # `time: 90` (minutes) and `mem: 0` (all memory) are natural to write unquoted.
        return value if isinstance(value, bool) else _scalar_to_str(value)

    @field_validator("time")
    @classmethod
    def _time(cls, value: str) -> str:
        if value.lower() in ("infinite", "unlimited"):
            return value
        match = _SLURM_TIME_RE.match(value)
        sixties = [match.group(g) for g in ("m2", "s2", "m3", "s3", "dm", "ds")] if match else []
        if not match or any(v is not None and int(v) >= 60 for v in sixties):
            raise ValueError(f"is not a Slurm time limit; use {_SLURM_TIME_FORMATS}")
        return value

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_MEM_RE.match(value):
            raise ValueError(
                'is not a Slurm memory size; use a number with an optional K, M, G or T suffix ("64G", '
                '"500M", "0" for all of the node\'s memory)'
            )
        return value


class DeploymentSpec(_Section):
    """A whole deployment: model, pools, router, KV tiers, engine, workload, output and Slurm options."""

    name: str = Field(default="tiny-local", description="Names Slurm jobs and result folders: [a-z0-9_-].")
    model: ModelSpec = Field(default_factory=ModelSpec)
    prefill: PoolSpec = Field(default_factory=lambda: PoolSpec(port=PREFILL_PORT))
    decode: PoolSpec = Field(default_factory=lambda: PoolSpec(port=DECODE_PORT))
    router: RouterSpec = Field(default_factory=RouterSpec)
    kv: KVSpec = Field(default_factory=KVSpec)
    mtp: MTPSpec = Field(default_factory=MTPSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    cost: CostSpec = Field(default_factory=CostSpec)

    SECTIONS: ClassVar[tuple[str, ...]] = (
        "model",
        "prefill",
        "decode",
        "router",
        "kv",
        "mtp",
        "engine",
        "workload",
        "output",
        "slurm",
        "cost",
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `slurm:` followed only by commented-out keys parses as null; it means "all defaults", not an error.
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.SECTIONS else v) for k, v in data.items()}
        return data

    @field_validator("decode")
    @classmethod
    def _decode_port(cls, pool: PoolSpec) -> PoolSpec:
        # One PoolSpec type serves both roles; only the default port differs, so the two pools never collide.
        return pool if "port" in pool.model_fields_set else pool.model_copy(update={"port": DECODE_PORT})

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.match(value) or len(value) > 64:
            raise ValueError(
                "is not a valid name; it names Slurm jobs and result folders, so use lowercase letters, digits, "
                "'-' and '_' (at most 64, starting with a letter or digit), e.g. glm52-544gpu"
            )
        return values.not_a_component_break(value)  # it goes into #SBATCH --job-name

    @model_validator(mode="after")
    def _semantic_checks(self, info: ValidationInfo) -> DeploymentSpec:
        if info.context and info.context.get(SKIP_CHECKS):
            return self
        from llmd.spec.checks import SpecError, run_checks

        issues = run_checks(self)
        if issues:
            # Not a ValueError on purpose: pydantic passes other exceptions through, so code that builds a spec in
            # Python gets the same SpecError, with the same messages, as a user loading a YAML file.
            raise SpecError("<DeploymentSpec>", issues)
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill.nodes > 0

    @property
    def total_gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def pools(self) -> dict[str, PoolSpec]:
        """The pools that run engines, by role."""
        pools: dict[str, PoolSpec] = {"prefill": self.prefill} if self.disaggregated else {}
        pools["decode"] = self.decode
        return pools

    def summary(self) -> str:
        return (
            f"{self.name}: prefill {self.prefill.gpus} GPUs, decode {self.decode.gpus} GPUs, "
            f"engine {self.engine.kind}, policy {self.router.policy}"
        )
