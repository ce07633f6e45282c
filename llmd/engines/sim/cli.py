"""`llmd engine sim ...`: run one simulated vLLM engine server (all its DP ranks) until SIGTERM or SIGINT.

Defaults come from the deployment spec (`--spec`, else the built-in tiny local spec): the pool of `--role` gives the
port, DP size, batch limits and latency model; every flag given on the command line overrides it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    engine = subparsers.add_parser("engine", help="run inference engines", description="Run inference engines.")
    esub = engine.add_subparsers(dest="engine_command", metavar="ACTION")
    esub.required = True
    p = esub.add_parser(
        "sim",
        help="run a simulated vLLM engine (vLLM's HTTP API, KV events, metrics; latency from the model)",
        description=__doc__,
    )
    p.add_argument("--spec", help="deployment spec YAML (default: the built-in tiny local spec)")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both", help="pool to take defaults from")
    p.add_argument("--model", help="model folder with tokenizer.json (default: the spec's model.tokenizer)")
    p.add_argument("--served-name", help="model name clients ask for (default: the spec's model.served_name)")
    p.add_argument("--name", help="a name for logs")
    p.add_argument("--host", default=None, help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default: the pool's port; 0 = any free port)")
    p.add_argument("--dp-ranks", type=int, help="DP ranks served by this server (default: the pool's dp_size)")
    p.add_argument("--time-scale", type=float, help="wall seconds per simulated second (0 = as fast as possible)")
    p.add_argument("--kv-events-endpoint", help='ZMQ PUB endpoint, e.g. "tcp://*:5557" (port + rank per DP rank)')
    p.add_argument("--kv-events-replay-endpoint", help='ZMQ ROUTER replay endpoint, e.g. "tcp://*:5567"')
    p.add_argument("--kv-events-topic", help='KV events topic (default "")')
    p.add_argument("--side-channel-host", help="P/D side channel host (VLLM_NIXL_SIDE_CHANNEL_HOST, default 127.0.0.1)")
    p.add_argument("--side-channel-port", type=int, help="P/D side channel port (+ rank; default 5600; 0 = any)")
    p.add_argument(
        "--no-side-channel", action="store_true", help="no KV transfer connector (kv_transfer_params ignored)"
    )
    p.add_argument("--node", help="node name deciding NVLink vs NIC transfer times (default: this hostname)")
    p.add_argument("--engine-id", help="KV transfer engine id (default: random; ranks > 0 get _dp<rank>)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-gpu-blocks", type=int)
    p.add_argument("--num-cpu-blocks", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--kv-lease-s", type=float, help="how long a prefill holds blocks for a pull (default 30)")
    p.add_argument("--pull-failure-policy", choices=("fail", "recompute"), help="vLLM's kv_load_failure_policy")
    p.add_argument("--fail-rate", type=float, default=0.0, help="fraction of requests answered 500")
    p.add_argument("--slow-start", type=float, default=0.0, metavar="S", help="/health answers 503 for S seconds")
    p.add_argument("--hang-after", type=int, metavar="N", help="stop answering after N requests")
    p.add_argument("--crash-after", type=int, metavar="N", help="exit (code 1) on request N+1")
    p.add_argument(
        "--fail-kv-transfers",
        type=float,
        default=0.0,
        metavar="RATE",
        help="fraction of KV pulls that fail as a failed NIXL transfer does (the pull failure policy decides the "
        "request's fate). At run time SIGUSR2 fails each server's next pull and SIGUSR1 drops each rank's next KV "
        "event batch (a sequence gap, replayable)",
    )
    p.add_argument(
        "--disable-prompt-tokens-details",
        action="store_true",
        help="omit usage.prompt_tokens_details, as vLLM does by default (the sim behaves as with vLLM's "
        "--enable-prompt-tokens-details unless this is given)",
    )
    p.add_argument("--trust-request-chat-template", action="store_true")
    p.add_argument(
        "--enable-mfu-metrics",
        action="store_true",
        help="count vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu from the latency model (vLLM's flag)",
    )
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument(
        "--metrics-out",
        metavar="FILE",
        help="write per-second engine series (tokens, queue, KV usage, hits, preemptions, transfers) to this HDF5 "
        "file (llmd.metrics schema; never overwritten)",
    )
    p.add_argument(
        "--ports-file",
        metavar="FILE",
        help="once listening, write the ports really bound (HTTP, and per DP rank KV events, replay, side channel) "
        "to this JSON file; with it, a port that is taken is replaced by a free one (launchers read it back)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="run every replica of every pool of the spec in this process (ports from llmd.spec.layout)",
    )
    p.set_defaults(func=run_sim)


_ENGINE_FLAGS = (
    "block_size",
    "max_model_len",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "kv_lease_s",
    "pull_failure_policy",
)


def _load(args: argparse.Namespace) -> Any:
    from llmd.spec import DeploymentSpec, SpecError, load_spec

    try:
        return load_spec(args.spec) if args.spec else DeploymentSpec()
    except SpecError as exc:
        raise UserError(str(exc)) from exc


def build_config(args: argparse.Namespace) -> Any:
    """The SimServerConfig the flags describe (spec defaults, then flags)."""
    from .runner import FaultConfig
    from .server_config import SimServerConfig

    spec = _load(args)
    role = args.role
    if role == "prefill" and not spec.disaggregated:
        raise UserError("--role prefill needs a spec with a prefill pool (prefill.nodes > 0); use --role decode/both")
    try:
        config = SimServerConfig.from_spec(spec, role)
    except ValueError as exc:
        raise UserError(f"cannot build the engine from the spec: {exc}") from exc
    engine_kw = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    if getattr(args, "enable_mfu_metrics", False):
        engine_kw["enable_mfu_metrics"] = True
    try:
        engine = replace(config.engine, **engine_kw) if engine_kw else config.engine
        faults = FaultConfig(
            failure_rate=args.fail_rate,
            slow_start_s=args.slow_start,
            hang_after=args.hang_after,
            crash_after=args.crash_after,
            kv_transfer_failure_rate=getattr(args, "fail_kv_transfers", 0.0),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    server_kw: dict[str, Any] = {"engine": engine, "faults": faults}
    for flag, field in (
        ("model", "model_dir"),
        ("served_name", "served_name"),
        ("name", "name"),
        ("host", "host"),
        ("port", "port"),
        ("dp_ranks", "dp_size"),
        ("time_scale", "time_scale"),
        ("kv_events_endpoint", "kv_events_endpoint"),
        ("kv_events_replay_endpoint", "kv_events_replay_endpoint"),
        ("kv_events_topic", "kv_events_topic"),
        ("side_channel_host", "side_channel_host"),
        ("side_channel_port", "side_channel_port"),
        ("node", "node"),
        ("engine_id", "engine_id"),
    ):
        value = getattr(args, flag)
        if value is not None:
            server_kw[field] = value
    if args.model is not None and args.served_name is None and not args.spec:
        # A folder given on its own names the model, as `vllm serve DIR` does; a spec's served_name wins.
        server_kw["served_name"] = Path(args.model.rstrip("/")).name
    if getattr(args, "ports_file", None):
        server_kw["ports_file"] = args.ports_file
        server_kw["port_fallback"] = True
    if args.no_side_channel:
        server_kw["side_channel_port"] = None
    server_kw["enable_prompt_tokens_details"] = not args.disable_prompt_tokens_details
    server_kw["trust_request_chat_template"] = args.trust_request_chat_template
    if server_kw.get("dp_size", 1) < 1:
        raise UserError("--dp-ranks must be >= 1")
    if server_kw.get("time_scale", 1.0) < 0:
        raise UserError("--time-scale must be >= 0")
    return replace(config, **server_kw)


def build_all_configs(args: argparse.Namespace) -> list[Any]:
    """One SimServerConfig per replica of every pool, each with the layout's ports and KV event endpoints."""
    from llmd.spec.layout import engine_endpoints

    configs = []
    for ep in engine_endpoints(_load(args)):
        one = argparse.Namespace(**vars(args))
        one.role = ep.role
        one.port = ep.http_port
        one.name = ep.name
        one.kv_events_endpoint = args.kv_events_endpoint or ep.kv_events_endpoint()
        one.side_channel_port = ep.side_channel_port
        one.kv_events_replay_endpoint = ep.replay_endpoint()
        one.engine_id = ep.engine_id
        configs.append(build_config(one))
    return configs


def run_sim(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.all:
        if any(
            v is not None
            for v in (
                args.port,
                args.kv_events_endpoint,
                args.kv_events_replay_endpoint,
                args.side_channel_port,
                args.engine_id,
                args.ports_file,
            )
        ):
            raise UserError(
                "--all takes every port and engine id from the spec's layout; drop --port, --kv-events-endpoint, "
                "--kv-events-replay-endpoint, --side-channel-port, --engine-id and --ports-file"
            )
        return asyncio.run(serve_many(build_all_configs(args), metrics_out=_metrics_out(args)))
    config = build_config(args)
    return asyncio.run(serve(config, metrics_out=_metrics_out(args)))


def _metrics_out(args: argparse.Namespace) -> Path | None:
    if getattr(args, "metrics_out", None) is None:
        return None
    path = Path(args.metrics_out)
    if path.exists():
        raise UserError(f"--metrics-out {path} exists; metrics files are never overwritten, choose another path")
    if not path.parent.is_dir():
        raise UserError(f"--metrics-out {path}: folder {path.parent} does not exist")
    return path


async def serve(config: Any, metrics_out: Path | None = None) -> int:
    """Runs the server until SIGTERM/SIGINT (exit 0) or an injected crash (exit 1)."""
    return await serve_many([config], metrics_out=metrics_out)


async def serve_many(configs: list[Any], metrics_out: Path | None = None) -> int:
    """Runs the servers in this event loop until SIGTERM/SIGINT (exit 0) or an injected crash of any (exit 1);
    with `metrics_out`, their per-second series go to that HDF5 file while they run."""
    from .series import EngineSeries
    from .server import SimServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    code = 0

    def crashed() -> None:
        nonlocal code
        code = 1
        stop.set()

    try:
        servers = [SimServer(config, on_crash=crashed) for config in configs]
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot start the simulated engine: {exc}") from exc
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Fault hooks for soak tests (benchmarks/soak.py), at a time of the caller's choosing.
    loop.add_signal_handler(signal.SIGUSR1, _drop_next_event_batch, servers)
    loop.add_signal_handler(signal.SIGUSR2, _fail_next_transfer, servers)
    started: list[Any] = []
    series = None
    try:
        for server in servers:
            try:
                await server.start()
            except OSError as exc:
                raise UserError(f"cannot start the simulated engine {server.config.name or ''}: {exc}") from exc
            started.append(server)
            print(f"simulated engine serving {server.served_name} on {server.url}", flush=True)
        if metrics_out is not None:
            series = EngineSeries(started, metrics_out)
        await stop.wait()
    finally:
        if series is not None:
            await series.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        await asyncio.gather(*(s.stop() for s in started), return_exceptions=True)
    return code


def _drop_next_event_batch(servers: list[Any]) -> None:
    for server in servers:
        for p in server.publishers:
            p.skip_next += 1
    logging.getLogger(__name__).warning("SIGUSR1: dropping the next KV event batch of every rank (a sequence gap)")


def _fail_next_transfer(servers: list[Any]) -> None:
    for server in servers:
        if server.engine is not None:
            server.engine.faults.fail_next_transfers += 1
    logging.getLogger(__name__).warning("SIGUSR2: failing the next KV transfer of every server")
