"""The simulated engine server's settings: one server's config (from a deployment spec or by hand) and what it
reports of them as vLLM's cache config."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llmd import runid
from llmd.perf.latency import LatencyModel

from .core import SimEngineConfig
from .runner import FaultConfig

Role = Literal["prefill", "decode", "both"]
# Block counts derived from a GPU profile can reach millions for small models; the core keeps per-block state, so a
# derived count is capped here (an explicit num_gpu_blocks is taken as given).
MAX_DERIVED_GPU_BLOCKS = 262_144


@dataclass(slots=True)
class SimServerConfig:
    """One simulated engine server. `engine` holds the core settings shared by all ranks; per-rank fields
    (dp_rank, engine_id, side channel, vocabulary) are filled in by the server."""

    model_dir: str
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see SimServer.port)
    dp_size: int = 1
    role: Role = "both"
    time_scale: float = 1.0
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    latency: LatencyModel | None = None  # default: the tiny model on the default spec's GPU
    engine_id: str | None = None  # default: a random one; ranks > 0 get "_dp<rank>" appended, as vLLM does
    kv_events_endpoint: str | None = None  # e.g. "tcp://*:5557"; None: no KV events
    kv_events_replay_endpoint: str | None = None  # e.g. "tcp://*:5567"
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    side_channel_host: str = "127.0.0.1"  # VLLM_NIXL_SIDE_CHANNEL_HOST
    side_channel_port: int | None = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT (+ rank); 0: any free port; None: no P/D
    node: str = field(default_factory=socket.gethostname)  # same node -> NVLink transfer times, else the NIC
    faults: FaultConfig = field(default_factory=FaultConfig)
    enable_prompt_tokens_details: bool = True  # vLLM: --enable-prompt-tokens-details (off by default there)
    enable_force_include_usage: bool = False  # vLLM: --enable-force-include-usage
    trust_request_chat_template: bool = False  # vLLM: --trust-request-chat-template
    max_model_len: int | None = None  # default: engine.max_model_len
    name: str | None = None  # for logs
    pull_timeout_s: float = 10.0
    gpu_memory_utilization: float = 0.92  # vLLM's --gpu-memory-utilization, as vllm:cache_config_info reports it
    # Client limits: uvicorn's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) also bounds a fresh connection's wait
    # for its request head; a body may pause at most body_timeout_s between bytes (uvicorn has no such bound).
    header_timeout_s: float = 5.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 256 << 20
    # Where the KV event PUB and replay sockets listen when their endpoint says `tcp://*:P` (vLLM's "bind" form):
    # None is this server's HTTP host, so they listen where the API does (127.0.0.1 by default, the node's address
    # under a launcher), never on every interface unless the host is 0.0.0.0 or this says "*".
    kv_events_host: str | None = None
    # The run this server belongs to (llmd.runid): /health says it in `x-llmd-run`, so clients know they reached it.
    run_id: str | None = field(default_factory=runid.from_env)
    # True: a port that is taken (HTTP, KV events, replay, side channel) is replaced by any free one, and the caller
    # learns what was bound from `ports_file` (or the server's attributes). Off by default: a caller that named a port
    # and does not read back what was bound would otherwise talk to whatever holds the one it named.
    port_fallback: bool = False
    ports_file: str | None = None  # JSON written once every socket is bound (llmd.engines.sim.server.bound_ports)

    @classmethod
    def from_spec(cls, spec: Any, role: Role = "both", **overrides: Any) -> SimServerConfig:
        """A server for one replica of `role`'s pool of a DeploymentSpec (llmd.spec)."""
        pool = spec.prefill if role == "prefill" else spec.decode
        latency = LatencyModel.from_spec(spec, "prefill" if role == "prefill" else "decode")
        m = spec.model
        bs = m.block_size
        if spec.kv.gpu_blocks is not None:
            gpu_blocks = spec.kv.gpu_blocks
        else:
            gpu_blocks = min(latency.max_kv_tokens(spec.kv.gpu_memory_fraction) // bs, MAX_DERIVED_GPU_BLOCKS)
            gpu_blocks = max(gpu_blocks, math.ceil(m.max_model_len / bs) + 1)
        cpu_blocks = int(spec.kv.cpu_bytes // (latency.kv_bytes_per_token_gpu * bs)) if spec.kv.cpu_bytes else 0
        engine = SimEngineConfig(
            block_size=bs,
            hash_algo=m.hash_algo,
            hash_seed=m.hash_seed,
            num_gpu_blocks=gpu_blocks,
            num_cpu_blocks=cpu_blocks,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_model_len=m.max_model_len,
            seed=spec.workload.seed,
            role=role,
            num_speculative_tokens=spec.mtp.draft_tokens if role != "prefill" else 0,
            tp_size=pool.tp_size,
            kv_cache_spec_kind="mla_attention" if latency.model.attention == "mla" else "full_attention",
        )
        fields: dict[str, Any] = {
            "model_dir": m.tokenizer or m.path,
            "served_name": m.served_name,
            "port": 0 if pool.port == "auto" else pool.port,
            "dp_size": pool.dp_size,
            "role": role,
            "time_scale": spec.engine.time_scale,
            "engine": engine,
            "latency": latency,
            "gpu_memory_utilization": spec.kv.gpu_memory_fraction,
        }
        # A name both configs have (side_channel_port, role) is the server's: it fills the engine's per rank itself.
        engine_only = SimEngineConfig.__dataclass_fields__.keys() - cls.__dataclass_fields__.keys()
        engine_overrides = {k: overrides.pop(k) for k in list(overrides) if k in engine_only}
        if engine_overrides:
            fields["engine"] = replace(engine, **engine_overrides)
        fields.update(overrides)
        return cls(**fields)


def default_latency() -> LatencyModel:
    from llmd.spec import DeploymentSpec

    return LatencyModel.from_spec(DeploymentSpec(), "decode")


def cache_config_info(c: SimServerConfig, latency: LatencyModel, max_model_len: int) -> dict[str, str]:
    """vLLM's CacheConfig.metrics_info() (vllm:cache_config_info's labels) for this engine, on a GPU."""
    e = c.engine
    size_tokens = e.num_gpu_blocks * e.block_size
    offload = None
    if e.num_cpu_blocks:
        kv_bytes = latency.kv_bytes_per_token_gpu * max(e.tp_size, 1)
        offload = e.num_cpu_blocks * e.block_size * kv_bytes / 2**30  # --kv-offloading-size, GiB
    info: dict[str, Any] = {
        "_block_size_resolved": True,
        "block_size": e.block_size,
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": None,
        "effective_attention_block_size": e.block_size,
        "enable_mamba_shared_prefix_checkpoint": False,
        "enable_prefix_caching": True,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "hash_block_size": None,
        "is_attention_free": False,
        "kv_cache_dtype_skip_layers": [],
        "kv_cache_layout": None,
        "kv_cache_max_concurrency": size_tokens / max_model_len,
        "kv_cache_memory_bytes": None,
        "kv_cache_size_tokens": size_tokens,
        "kv_offloading_backend": "native",
        "kv_offloading_size": offload,
        "kv_sharing_fast_prefill": False,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": None,
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": None,
        "num_gpu_blocks": e.num_gpu_blocks,
        "num_gpu_blocks_override": None,
        "prefix_cache_retention_interval": 0,
        "prefix_caching_hash_algo": e.hash_algo,
        "prefix_match_unit": None,
        "replayssm_buffer_len": 16,
        "skip_page_size_padded": None,
        "sliding_window": None,
        "swa_bounded_replay": True,
        "use_kda_recoverssm": False,
        "use_replayssm": False,
        "user_specified_block_size": True,
    }
    return {k: str(v) for k, v in info.items()}
