"""`llmd router --spec FILE [--discovery FILE] [--host H] [--port P] [--policy NAME] [--metrics-out FILE]
[--port-file FILE] [--run-id ID]`: run the router until a signal.

SIGTERM or SIGINT stops it.

Engines come from the spec's layout (llmd.spec.layout) or, with --discovery, from the discovery file the engines add
themselves to (llmd.discovery; reloaded when it changes). The API key, if the spec's router.api_key_env names a
variable, is read from it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import typing
from pathlib import Path
from typing import Any

from llmd import runid
from llmd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmd.spec.model import RouterPolicy

    p = subparsers.add_parser(
        "router",
        help="run the prefix-aware router (OpenAI API in front of the spec's engines)",
        description=__doc__,
    )
    p.add_argument("--spec", required=True, help="deployment spec YAML (model, router settings, engine layout)")
    p.add_argument("--discovery", help="JSON file the engines add themselves to once healthy; replaces the layout")
    p.add_argument("--host", help="listen address (default: the spec's router.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: the spec's router.port)")
    p.add_argument("--policy", choices=typing.get_args(RouterPolicy), help="routing policy (default: the spec's)")
    p.add_argument("--engine-host", default="127.0.0.1", help="host of the spec's engines (without --discovery)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument(
        "--metrics-out",
        metavar="FILE",
        help="write a row per routed request and per-second router series to this HDF5 file (llmd.metrics schema; "
        "never overwritten)",
    )
    p.add_argument(
        "--port-file",
        metavar="FILE",
        help='once listening, write {"url": ..., "port": ...} to this JSON file; with it, a port that is taken '
        "is replaced by a free one (launchers read the file, never the spec's port)",
    )
    p.add_argument(
        "--run-id",
        default=None,
        help="this run's id (llmd.runid; default: $LLMD_RUN_ID): /health answers with it, and engines are routed "
        "to only once they prove the same id",
    )
    p.set_defaults(func=run_router)


def build(args: argparse.Namespace) -> Any:
    """The Router the flags describe (not started)."""
    from llmd.discovery import read_discovery
    from llmd.router.endpoints import pods_from_spec
    from llmd.router.proxy import Router, RouterConfig
    from llmd.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        raise UserError(str(exc)) from exc
    updates: dict[str, Any] = {}
    if args.host is not None:
        updates["host"] = args.host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise UserError(f"--port {args.port} is not a port number (0-65535)")
        updates["port"] = args.port
    if args.policy is not None:
        updates["policy"] = args.policy
    if updates:
        spec = spec.model_copy(update={"router": spec.router.model_copy(update=updates)})
    if args.discovery is not None:
        path = Path(args.discovery)
        if path.exists():
            read_discovery(path)  # a bad file is the user's to fix now, not a warning in a log
        elif not path.parent.is_dir():
            raise UserError(f"--discovery {path}: folder {path.parent} does not exist")
        pods: list[Any] = []
    else:
        pods = pods_from_spec(spec, args.engine_host)
    metrics_out = getattr(args, "metrics_out", None)
    if metrics_out is not None:
        out = Path(metrics_out)
        if out.exists():
            raise UserError(f"--metrics-out {out} exists; metrics files are never overwritten, choose another path")
        if not out.parent.is_dir():
            raise UserError(f"--metrics-out {out}: folder {out.parent} does not exist")
    config = RouterConfig.from_spec(spec, metrics_out=metrics_out, metrics_meta={"spec": spec})
    if spec.router.api_key_env is not None and not os.environ.get(spec.router.api_key_env):
        raise UserError(
            f"router.api_key_env names {spec.router.api_key_env}, which is not set (or empty); export the key in it "
            "or remove api_key_env from the spec"
        )
    run_id = getattr(args, "run_id", None) or runid.from_env()
    port_file = getattr(args, "port_file", None)
    if port_file is not None and not Path(port_file).parent.is_dir():
        raise UserError(f"--port-file {port_file}: folder {Path(port_file).parent} does not exist")
    return Router(config, pods, discovery=args.discovery, run_id=run_id, port_fallback=port_file is not None)


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = build(args)
    try:
        import uvloop  # optional: a faster event loop where installed (~15% more requests per core)
    except ImportError:
        return asyncio.run(_serve(router, args.port_file))
    return uvloop.run(_serve(router, args.port_file))


def write_port_file(path: Path, url: str, port: int) -> None:
    """Whole or not at all (temp file + rename): the main job polls for it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"url": url, "port": port}) + "\n")
    os.replace(tmp, path)


# Young objects the collector lets pile up before it scans them (CPython's default: 700).
GC_YOUNG_THRESHOLD = 50_000


def settle_gc() -> None:
    """Set the router process's garbage collection up for serving, once it has started. A request allocates a few
    hundred objects that nearly all die young, freed by their reference counts; with the default threshold the young
    generation was collected every few requests, each time scanning the objects of every request in flight and
    promoting them, so that older collections grew too: ~0.1 ms of CPU per request, ~5% of the router's, under
    benchmarks/router.py --throughput. What startup built (modules, the tokenizer, the pods) is frozen out of
    collection, and young collections come every 50,000 allocations (cycles still get collected, later)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def _serve(router: Any, port_file: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await router.start()
        except OSError as exc:
            raise UserError(
                f"cannot listen on {router.config.host}:{router.config.port}: {exc.strerror or exc}"
            ) from exc
        settle_gc()
        print(f"router listening on {router.url}", flush=True)
        if port_file is not None:
            write_port_file(Path(port_file), router.url, router.port)
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await router.stop()
    return 0
