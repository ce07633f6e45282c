"""`llmd bench`: drive a deployment spec's workload profile against a running router (or engine) and record every
request to DIR/<run>/metrics.h5 (llmd.metrics schema, producer "client"); prints a summary table.

Ctrl-C stops cleanly: no new requests, in-flight ones recorded as aborted, the file closed with every row so far.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import re
from pathlib import Path
from typing import Any

from llmd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run the spec's workload against a running router or engine and record metrics.h5",
        description=__doc__,
    )
    p.add_argument("--spec", required=True, help="deployment spec YAML (model, workload profile, output dir)")
    p.add_argument("--url", required=True, help="base URL of the router or engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, metavar="S", help="stop starting turns after S seconds")
    p.add_argument("--max-requests", type=int, metavar="N", help="stop after N requests")
    p.add_argument("--output", metavar="DIR", help="results folder (default: the spec's output.dir)")
    p.add_argument("--run", metavar="NAME", help="run folder name under DIR (default: <spec name>-bench-<time>)")
    p.add_argument("--api-key", help="bearer token for the server")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per-request limit (600 s)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = E2E)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench)


_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _check_args(args: argparse.Namespace) -> None:
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.max_requests is not None and args.max_requests < 1:
        raise UserError(f"--max-requests must be at least 1, got {args.max_requests}")
    if args.request_timeout <= 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not re.match(r"^https?://[^/\s]+", args.url):
        raise UserError(f"--url {args.url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")
    if args.run is not None and not _RUN_NAME.match(args.run):
        raise UserError(f"--run {args.run!r}: use letters, digits, '.', '_' and '-' only")


async def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """UserError naming `url` when nothing answers there."""
    import aiohttp

    base = url.rstrip("/")
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(base + "/v1/models") as r,
        ):
            await r.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise UserError(
            f"cannot reach {base} ({type(e).__name__}: {e}); start the router first "
            f"(`llmd router --spec SPEC`, or `llmd engine sim` for a single engine) and pass its URL with --url"
        ) from None


def run_bench(args: argparse.Namespace) -> int:
    from llmd.spec import load_spec
    from llmd.spec.load import dump_spec
    from llmd.workload.loadgen import LoadConfig, run_load
    from llmd.workload.profiles import profile_from_spec

    _check_args(args)
    spec = load_spec(args.spec)
    if spec.workload.profile == "trace":
        raise UserError('workload.profile "trace" is not supported by `llmd bench` yet; pick a named profile')
    tok_dir = Path(spec.model.tokenizer or spec.model.path)
    if not (tok_dir / "tokenizer.json").exists():
        raise UserError(f"model.tokenizer {str(tok_dir)!r} has no tokenizer.json; point it at a model folder")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_name = args.run or f"{spec.name}-bench-{stamp}"
    out_dir = Path(args.output or spec.output.dir) / run_name
    output = out_dir / "metrics.h5"
    if out_dir.exists():
        raise UserError(f"{out_dir} exists; results are never overwritten: pass another --run or --output")
    try:
        workload = profile_from_spec(spec.workload, run_name)
    except ValueError as e:
        raise UserError(f"workload: {e}") from None
    duration = args.duration
    if duration is None and workload.profile.sessions_per_agent is None:
        duration = workload.profile.duration_s
    asyncio.run(check_reachable(args.url))
    meta: dict[str, Any] = {"spec": dump_spec(spec), "run": run_name, "seed": spec.workload.seed}
    cfg = LoadConfig(
        url=args.url,
        model=spec.model.served_name or "model",
        tokenizer_dir=str(tok_dir),
        workload=workload,
        output=output,
        duration_s=duration,
        max_requests=args.max_requests,
        api_key=args.api_key,
        progress=not args.no_progress,
        meta=meta,
        request_timeout_s=args.request_timeout,
        stream=not args.no_stream,
    )
    out_dir.mkdir(parents=True)
    summary = asyncio.run(run_load(cfg))
    print_summary(summary, title=f"llmd bench {run_name} ({workload.profile.name} -> {args.url})")
    return 0


def print_summary(summary: Any, title: str = "llmd bench") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title + (" [stopped]" if summary.stopped else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in summary.rows():
        table.add_row(label, value)
    Console().print(table)
