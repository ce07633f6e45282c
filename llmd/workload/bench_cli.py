"""`llmd bench`: drive a deployment spec's workload profile against a running router (or engine) and record every
request to DIR/<run>/metrics.h5 (llmd.metrics schema, producer "client"); prints a summary table.

Closed loop by default (the profile's agents, each running sessions back to back). `--arrival-rate R` is an open
loop: new main sessions arrive as a Poisson process of R sessions per second (seeded by workload.seed), each running
its turns in order, however many are already running, until --duration / --max-requests. `--trace FILE` (or
workload.profile "trace" with workload.trace_path) replays a JSONL trace: each session starts at its first record's
offset `t`, each turn is sent at its `t` or when the previous response is back if later, and a record's `parent`
forks that session from its parent's context.

The run folder may already hold the run's other producers' files (`llmd router --metrics-out DIR/<run>/router.h5`,
`llmd engine sim --metrics-out DIR/<run>/engines.h5`); `llmd merge DIR/<run>` then makes them one metrics.h5.

Ctrl-C stops cleanly: no new requests, in-flight ones recorded as aborted, the file closed with every row so far.

Exit status: 0 when the run went well; 1 when more than --max-error-rate percent (default 10) of the requests sent
failed, or none succeeded (requests aborted by the end of the run or by Ctrl-C are not counted as sent); 2 for a
usage error. A server that cannot be reached makes the run back off (exponential, jittered, up to 10 s between
attempts) instead of firing failing requests as fast as it can.

The API key is --api-key, else $LLMD_API_KEY, else $OPENAI_API_KEY; it is sent as a bearer token and never written
to the results or printed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
import os
import re
import sys
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
    p.add_argument(
        "--api-key",
        help="bearer token for the server (default: $LLMD_API_KEY, else $OPENAI_API_KEY; prefer those: a flag shows "
        "in the process list); never written to the results",
    )
    p.add_argument(
        "--max-error-rate",
        type=float,
        default=DEFAULT_MAX_ERROR_PCT,
        metavar="PCT",
        help=f"exit with status 1 when more than PCT%% of the requests sent failed, or none succeeded "
        f"(default {DEFAULT_MAX_ERROR_PCT:g}; requests aborted at the end or by Ctrl-C do not count)",
    )
    p.add_argument(
        "--run-id",
        metavar="ID",
        help="the run id of the router at --url (llmd.runid; a launch's run.json has it): the load starts only if "
        "the server there answers /health with it, never against something else listening on that port",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per-request limit (600 s)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = E2E)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--arrival-rate",
        type=float,
        metavar="R",
        help="open loop: R new sessions per second (Poisson, seeded) instead of the profile's closed-loop agents",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="replay this JSONL trace (session, parent, t, input_text | input_tokens, output_tokens) instead of "
        "the profile; times and token counts scaled by workload.time_scale and context_scale",
    )
    p.set_defaults(func=run_bench)


_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
DEFAULT_MAX_ERROR_PCT = 10.0
API_KEY_ENV = ("LLMD_API_KEY", "OPENAI_API_KEY")


def api_key(flag: str | None) -> str | None:
    """The key to send: the flag's, else the first of API_KEY_ENV that is set and not empty."""
    if flag:
        return flag
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


def failed_run(summary: Any, max_error_pct: float) -> str | None:
    """Why the run counts as failed (exit status 1), or None. Aborted requests (the run's end, Ctrl-C) are neither
    sent nor failed."""
    sent = summary.requests - summary.aborted
    failed = summary.errors - summary.aborted
    if sent <= 0 or failed <= 0:
        return None
    if failed == sent:
        return f"every one of the {sent:,} requests sent failed"
    if 100.0 * failed / sent > max_error_pct:
        share = f"{failed / sent:.1%}, more than --max-error-rate {max_error_pct:g}%"
        return f"{failed:,} of {sent:,} requests failed ({share})"
    return None


def _check_args(args: argparse.Namespace) -> None:
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.max_requests is not None and args.max_requests < 1:
        raise UserError(f"--max-requests must be at least 1, got {args.max_requests}")
    if args.request_timeout <= 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not re.match(r"^https?://[^/\s]+", args.url):
        raise UserError(f"--url {args.url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")
    rate = getattr(args, "arrival_rate", None)
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise UserError(f"--arrival-rate must be a positive number of sessions per second, got {rate}")
    if rate is not None and getattr(args, "trace", None):
        raise UserError("--arrival-rate and --trace exclude each other: a trace brings its own arrival times")
    max_err = getattr(args, "max_error_rate", DEFAULT_MAX_ERROR_PCT)
    if not (math.isfinite(max_err) and 0 <= max_err <= 100):
        raise UserError(f"--max-error-rate must be a percentage from 0 to 100, got {max_err}")
    if args.run is not None and not _RUN_NAME.match(args.run):
        raise UserError(f"--run {args.run!r}: use letters, digits, '.', '_' and '-' only")


def check_run(url: str, run_id: str) -> None:
    """UserError naming the port and what answered when the server at `url` is not run `run_id`'s."""
    from llmd.runid import identify

    answer = identify(url, run_id, name="router")
    if answer.foreign:
        raise UserError(answer.reason)
    if not answer.ok:
        raise UserError(f"the router at {url.rstrip('/')} is not healthy ({answer.reason}); no load was sent")


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
    trace_path = getattr(args, "trace", None)
    if trace_path is None and spec.workload.profile == "trace":
        trace_path = spec.workload.trace_path
    if spec.workload.profile == "trace" and trace_path is None:
        raise UserError('workload.profile "trace" needs workload.trace_path (or pass --trace FILE)')
    tok_dir = Path(spec.model.tokenizer or spec.model.path)
    if not (tok_dir / "tokenizer.json").exists():
        raise UserError(f"model.tokenizer {str(tok_dir)!r} has no tokenizer.json; point it at a model folder")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_name = args.run or f"{spec.name}-bench-{stamp}"
    out_dir = Path(args.output or spec.output.dir) / run_name
    output = out_dir / "metrics.h5"
    # The run folder may exist already (the router and engines of the run write their --metrics-out files there);
    # the client's own file never is overwritten.
    for taken in (output, out_dir / "client.h5"):
        if taken.exists():
            raise UserError(f"{taken} exists; results are never overwritten: pass another --run or --output")
    wspec = spec.workload
    if trace_path is not None:
        # The replay's salt and seed come from a profile; its sessions from the trace.
        wspec = wspec.model_copy(update={"profile": "trace-stats"})
    try:
        workload = profile_from_spec(wspec, run_name, spec.model.max_model_len)
    except ValueError as e:
        raise UserError(f"workload: {e}") from None
    trace = None
    if trace_path is not None:
        trace = load_trace(trace_path, tok_dir, spec.workload.context_scale, spec.workload.time_scale)
    duration = args.duration
    if duration is None and trace is None and workload.profile.sessions_per_agent is None:
        duration = workload.profile.duration_s
    asyncio.run(check_reachable(args.url))
    if getattr(args, "run_id", None):
        check_run(args.url, args.run_id)
    meta: dict[str, Any] = {"spec": dump_spec(spec), "run": run_name, "seed": spec.workload.seed}
    if trace_path is not None:
        meta.update(mode="trace", trace=str(trace_path))
    elif getattr(args, "arrival_rate", None) is not None:
        meta.update(mode="open-loop", arrival_rate=args.arrival_rate)
    else:
        meta.update(mode="closed-loop")
    cfg = LoadConfig(
        url=args.url,
        model=spec.model.served_name or "model",
        tokenizer_dir=str(tok_dir),
        workload=workload,
        output=output,
        duration_s=duration,
        max_requests=args.max_requests,
        api_key=api_key(args.api_key),
        progress=not args.no_progress,
        meta=meta,
        request_timeout_s=args.request_timeout,
        stream=not args.no_stream,
        arrival_rate=getattr(args, "arrival_rate", None),
        trace=trace,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run_load(cfg))
    print_summary(summary, title=f"llmd bench {run_name} ({workload.profile.name} -> {args.url})")
    why = failed_run(summary, getattr(args, "max_error_rate", DEFAULT_MAX_ERROR_PCT))
    if why is not None:
        print(f"llmd bench: the run failed: {why}; see the error column of {output}", file=sys.stderr)
        return 1
    return 0


def load_trace(path: str | Path, tokenizer_dir: Path, context_scale: float, time_scale: float) -> list[Any]:
    """The trace's sessions, every line checked before the run starts; a bad line is a UserError naming it."""
    from llmd.tokens import Tokenizer
    from llmd.workload.trace import TraceError, read_trace, trace_sessions

    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace {path} does not exist; give a JSONL file with --trace or workload.trace_path")
    try:
        tok = Tokenizer(tokenizer_dir)
        turns = read_trace(path, tokenizer=tok, context_scale=context_scale, time_scale=time_scale)
        sessions = trace_sessions(list(turns), str(path))
    except TraceError as e:
        raise UserError(f"bad trace: {e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"trace {path} is not UTF-8 text ({e})") from None
    if not sessions:
        raise UserError(f"trace {path} has no records")
    return sessions


def print_summary(summary: Any, title: str = "llmd bench") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title + (" [stopped]" if summary.stopped else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in summary.rows():
        table.add_row(label, value)
    Console().print(table)
