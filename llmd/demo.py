"""`llmd demo`: the main job on one machine, in-process, in under two minutes on two cores.

From a deployment spec (default: the embedded one, disaggregated: 3 prefill + 2 decode engines on models/tiny with small
KV caches, so that routing decides what stays cached), the spec's simulated engines start in this process (SimServer,
on free ports), the router in front of them (llmd.router, the spec's policy), and the load generator drives the
workload through the router into results/<run>/metrics.h5.
Then: a summary table (throughput, TTFT, router queue, cache hits, preemptions from the engines' own series, errors),
PNG figures next to the HDF5, and every server, socket and task stopped, on success, error or Ctrl-C alike.

`--compare` runs the same workload (same seed, a fresh salt per run so no run profits from another's cache) under the
precise, approximate and round-robin policies and prints them side by side; `--short` is a few seconds of smoke (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmd import runid
from llmd.engines.kinds import ENGINE_KINDS, engine_kind
from llmd.errors import UserError
from llmd.workload.profiles import SUBAGENT_SHARE

COMPARE_POLICIES = ("precise", "approximate", "round-robin")
DEFAULT_DURATION_S = 60.0
COMPARE_DURATION_S = 30.0  # per policy: three runs still finish in under two minutes
SHORT_DURATION_S = 5.0
# The default demo's agentic profile, scaled for a 2-core machine and the tiny model's 4096-token window:
# AutomationBench's closed-loop coding agents, 12 of them, with contexts at 4% (sessions start at 480 tokens and grow
# to ~2.6K), 0.3 s tool gaps, two-turn sub-agents. Outputs keep agentic traffic's shape (a turn reads far more than it
# writes: the trace's median is 195K in, 317 out), so prefill, which a cache hit saves, is what the engines spend their
# time on. No compactions: at this scale a compaction can shrink a context below the prompt writer's floor
# (llmd.workload.prompts raises "need at least one token of text"). Sub-agent bursts scaled to the fleet: the trace's
# fan-out (7 sub-agents at the median, 51 at p90) comes from fleets of thousands of agents; here one burst of 51
# would be four times the demo's whole population on five engines, and the run's TTFT tail would be whichever burst
# the run happened to reach. Bursts of 3 (p50) to 10 (p99) keep the trace's share of sub-agent requests.
DEMO_WORKLOAD: dict[str, Any] = {
    "profile": "automationbench",
    "concurrency": 12,
    "context_scale": 0.04,
    "params": {
        "initial": 12_000,
        "growth_p99": 12_000,
        "output_p50": 60,
        "output_p90": 150,
        "output_p99": 400,
        "gap_s": 0.3,
        "subagent_turns": 2,
        "compaction_p": 0.0,
        "stagger_s": 0.2,
        "group_size_p50": 3,
        "group_size_p90": 6,
        "group_size_p99": 10,
        "subagent_share": SUBAGENT_SHARE,
    },
}
STOP_GRACE_S = 20.0  # after the duration, requests still running get this long before they are cut (aborted)
# vLLM's CPU build decodes at ~100-150 ms a token on a shared core (slower under NIXL's polling thread): a request
# sent just before the end needs far longer than a simulated one to finish.
VLLM_STOP_GRACE_S = 150.0


@dataclass
class PolicyRun:
    policy: str
    out_dir: Path
    metrics: Path  # the run file: client, router and engine rows merged
    engine_hits: dict[str, float] = field(default_factory=dict)
    preemptions: int | None = None  # from the engines' counters when they have no per-second series (vLLM)
    load: Any = None


# ---- setup -----------------------------------------------------------------------------------------------------------


# The embedded deployment: 3 prefill + 2 decode engines under KV pressure: each holds 264 blocks of 16 tokens (the
# least that fits one 4096-token request), so the agents' main sessions alone (~12.6K tokens at their mean context)
# fill what the prefill pool holds, and sub-agents and requests in flight push past it, as in a fleet serving more
# agents than its KV keeps. With the tiny model's derived capacity
# (hundreds of thousands of blocks on the H100 profile) nothing is ever evicted and every policy hits the cache alike.
# Several prefill engines matter too: on the P/D path the hits reported are the prefill side's, and a single prefill
# engine would see every session whatever the policy. Routing that knows what each engine holds keeps each session's
# prefix where it is cached; routing from memory (approximate) follows prefixes the engines have already evicted;
# spraying (round-robin) makes every engine hold every session, and they evict. The simulated engines take their step
# times from the sim kind's demo model (llmd.engines.sim_kind): with the tiny model's own, every prefill would be free.
DEMO_PREFILL = {"nodes": 3, "replicas": 3}
DEMO_DECODE = {"nodes": 2, "replicas": 2}
DEMO_KV = {"gpu_blocks": 264}


def embedded_spec(duration_s: float = DEFAULT_DURATION_S, engine: str = "sim") -> Any:
    """The default demo's deployment and workload (`llmd demo` without --spec): what the cluster simulator's fidelity
    test and benchmark run live and simulated."""
    args = argparse.Namespace(spec=None, short=False, compare=False, duration=duration_s, engine=engine)
    return _load_spec(args)


def _load_spec(args: argparse.Namespace) -> Any:
    from llmd.spec import DeploymentSpec, SpecError, load_spec

    try:
        spec = load_spec(args.spec) if args.spec else DeploymentSpec()
    except SpecError as exc:
        raise UserError(str(exc)) from exc
    if not args.spec:
        # The embedded deployment with two decode engines: with one there is nothing to route, and --compare would
        # show three identical columns.
        spec = spec.model_copy(
            update={
                "prefill": spec.prefill.model_copy(update=DEMO_PREFILL),
                "decode": spec.decode.model_copy(update=DEMO_DECODE),
                "kv": spec.kv.model_copy(update=DEMO_KV),
            }
        )
    # vllm: real vLLM CPU servers, 1 prefill + 1 decode when embedded; sim: the spec as it is.
    spec = engine_kind(getattr(args, "engine", None) or spec.engine.kind).demo_spec(spec, not args.spec)
    workload = spec.workload.model_dump()
    if args.short:
        workload.update(profile="smoke", duration_s=args.duration or SHORT_DURATION_S)
    elif not args.spec:
        default = COMPARE_DURATION_S if args.compare else DEFAULT_DURATION_S
        workload.update(DEMO_WORKLOAD, duration_s=args.duration or default)
    elif args.duration:
        workload["duration_s"] = args.duration
    if workload["profile"] == "trace":
        raise UserError("`llmd demo` drives a workload profile; profile trace is not supported here")
    try:
        return spec.model_copy(update={"workload": type(spec.workload).model_validate(workload)})
    except ValueError as exc:
        raise UserError(f"bad workload settings: {exc}") from exc


def _model_dir(spec: Any, from_file: bool) -> Path:
    model_dir = Path(spec.model.tokenizer or spec.model.path)
    if (model_dir / "tokenizer.json").exists():
        return model_dir
    if from_file:
        raise UserError(f"{model_dir} has no tokenizer.json; make one with `llmd model make-tiny {model_dir}`")
    from llmd.models.tiny import make_tiny

    print(f"making the tiny model's tokenizer in {model_dir} (first run only)")
    make_tiny(model_dir, weights=False)
    return model_dir


def _engine_configs(spec: Any, model_dir: Path, run: str | None = None) -> list[Any]:
    """One SimServerConfig per replica of every pool, on free ports (the layout's names and roles), answering /health
    with the run id `run` (llmd.runid)."""
    from llmd.engines.sim.server_config import SimServerConfig
    from llmd.spec.layout import engine_endpoints

    configs = []
    for ep in engine_endpoints(spec):
        configs.append(
            SimServerConfig.from_spec(
                spec,
                ep.role,
                port=0,
                name=ep.name,
                engine_id=ep.engine_id,
                model_dir=str(model_dir),
                kv_events_endpoint="tcp://*:0",
                kv_events_replay_endpoint="tcp://*:0",
                side_channel_port=0,
                run_id=run,
            )
        )
    return configs


def _pod_of(server: Any) -> Any:
    """The discovery entry for a started sim server: every DP rank's ports as bound (each rank's are free ports of
    their own, not rank 0's + rank)."""
    from llmd.discovery import PodInfo, with_bound_ports

    c = server.config
    entry = PodInfo(
        name=c.name,
        role=c.role,
        url=server.url,
        dp_size=c.dp_size,
        side_channel_host="127.0.0.1",
        engine_id=server.engine_id,
    )
    return with_bound_ports(entry, server.bound_ports())


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] == name:
            with contextlib.suppress(ValueError):
                total += float(value)
    return total


_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)


async def _engine_counters(urls: list[str]) -> dict[str, float]:
    """The engines' own counters summed over `urls` ({} if one cannot be read: the figures they feed are then left
    out, not guessed)."""
    import aiohttp

    totals = dict.fromkeys(_COUNTERS, 0.0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for url in urls:
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                for n in _COUNTERS:
                    totals[n] += _metric_sum(text, n)
    except (aiohttp.ClientError, TimeoutError):
        return {}
    return totals


# ---- one run ---------------------------------------------------------------------------------------------------------


async def _run_policy(spec: Any, policy: str, run: PolicyRun, model_dir: Path, tokenizer: Any, run_id: str) -> None:
    from llmd.engines.sim.server import SimEngineGroup
    from llmd.metrics import merge_runs
    from llmd.router.proxy import Router, RouterConfig
    from llmd.workload import profile_from_spec
    from llmd.workload.loadgen import LoadConfig, run_load

    spec = spec.model_copy(update={"router": spec.router.model_copy(update={"policy": policy})})
    workload = profile_from_spec(
        spec.workload, f"{run_id}-{policy}", spec.model.max_model_len
    )  # same seed, fresh salt per run
    meta = {"spec": spec, "policy": policy, "run_id": run_id, "concurrency": spec.workload.concurrency}
    # Each producer writes its own file, as it would in its own process on a cluster; merged into run.metrics below.
    parts = {name: run.out_dir / f"{name}.h5" for name in ("client", "router", "engines")}
    rcfg = RouterConfig.from_spec(
        spec,
        port=0,
        host="127.0.0.1",
        tokenizer=str(model_dir),
        health_interval_s=0.5,
        metrics_interval_s=0.5,
        metrics_out=str(parts["router"]),
        metrics_meta=meta,
    )
    stop = asyncio.Event()
    run.out_dir.mkdir(parents=True, exist_ok=True)
    vllm = not engine_kind(spec.engine.kind).simulated
    # Every component of this policy's run answers with this id; the router routes only to engines that prove it,
    # and the load starts only once the router at router.url has proven it too.
    ident = runid.new_run_id()
    if vllm:  # real vLLM CPU servers (llmd.engines.vllm_deploy); their own series are their /metrics
        from llmd.engines.vllm_deploy import VllmDeployment

        engines: Any = VllmDeployment(spec, run.out_dir / "engines", run_id=ident)
    else:
        engines = SimEngineGroup(_engine_configs(spec, model_dir, ident))
    async with engines as group, contextlib.nullcontext() if vllm else _engine_series(group, parts, meta):
        pods = group.pods if vllm else [_pod_of(s) for s in group.servers]
        async with Router(rcfg, pods, run_id=ident) as router:
            await _until_ready(router, len(group))
            answer = await asyncio.to_thread(runid.identify, router.url, ident)
            if not answer.ok:
                raise UserError(answer.reason or f"the demo's router at {router.url} is not healthy")
            before = await _engine_counters(group.urls)  # the run's counts exclude start-up's warm-up requests
            cfg = LoadConfig(
                url=router.url,
                model=spec.model.served_name,
                tokenizer_dir=str(model_dir),
                workload=workload,
                output=parts["client"],
                duration_s=spec.workload.duration_s,
                progress=sys.stdout.isatty(),
                meta=meta,
                request_timeout_s=120.0,
                tokenizer=tokenizer,
            )
            loop = asyncio.get_running_loop()
            grace = VLLM_STOP_GRACE_S if vllm else STOP_GRACE_S
            cutoff = loop.call_later(spec.workload.duration_s + grace, stop.set)
            try:
                run.load = await run_load(cfg, stop)
            finally:
                cutoff.cancel()
        after = await _engine_counters(group.urls)
    merge_runs([p for p in parts.values() if p.exists()], run.metrics)
    counters = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if counters and vllm:  # vLLM's own count; simulated engines report theirs in their per-second series
        run.preemptions = int(counters["vllm:num_preemptions_total"])
    if counters:
        queries = counters["vllm:prefix_cache_queries_total"]
        if queries > 0 and spec.kv.cpu_bytes > 0:  # a CPU tier: split the engines' hits by tier
            run.engine_hits = {
                "gpu": counters["vllm:prefix_cache_hits_total"] / queries,
                "cpu": counters["vllm:external_prefix_cache_hits_total"] / queries,
            }


@contextlib.asynccontextmanager
async def _engine_series(group: Any, parts: dict[str, Path], meta: dict[str, Any]) -> Any:
    """The engines' per-second series (llmd.engines.sim.series) for as long as the run lasts."""
    from llmd.engines.sim.series import EngineSeries

    series = EngineSeries(group.servers, parts["engines"], meta=meta)
    try:
        yield series
    finally:
        await series.close()


async def _until_ready(router: Any, n: int, timeout_s: float = 15.0) -> None:
    """Wait until the router sees every engine healthy (its first health round)."""
    t0 = time.monotonic()
    while len(router.registry.healthy()) < n:
        if time.monotonic() - t0 > timeout_s:
            raise UserError(f"the router saw {len(router.registry.healthy())} of {n} engines healthy in {timeout_s} s")
        await asyncio.sleep(0.05)


async def _run_all(spec: Any, runs: list[PolicyRun], model_dir: Path, run_id: str) -> None:
    from llmd.tokens import Tokenizer

    tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
    for run in runs:
        print(f"running {spec.workload.profile} for up to {spec.workload.duration_s:g} s under policy {run.policy}")
        await _run_policy(spec, run.policy, run, model_dir, tokenizer, run_id)


# ---- the command -----------------------------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.duration is not None and not args.duration > 0:
        raise UserError(f"--duration must be a positive number of seconds, got {args.duration:g}")
    spec = _load_spec(args)
    model_dir = _model_dir(spec, from_file=bool(args.spec))
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    out = Path(args.output) / run_id
    n = 1
    while out.exists():
        n += 1
        out = Path(args.output) / f"{run_id}-{n}"
    policies = COMPARE_POLICIES if args.compare else (spec.router.policy,)
    runs = []
    for p in policies:
        d = out / p if args.compare else out
        runs.append(PolicyRun(p, d, d / "metrics.h5"))
    out.mkdir(parents=True)
    try:
        asyncio.run(_run_all(spec, runs, model_dir, out.name))
    except KeyboardInterrupt:
        print(f"llmd demo: interrupted; partial results in {out}", file=sys.stderr)
        raise
    _report(spec, runs, out, time.perf_counter() - t0)
    return 0


def _report(spec: Any, runs: list[PolicyRun], out: Path, wall_s: float) -> None:
    from rich.console import Console

    # The figures come from analysis/, the one plotting path (imported here, at the edge, once the run is on disk).
    from analysis.run_figures import write_demo_figures
    from llmd.metrics import read_requests, read_timeseries
    from llmd.report.summary import summarize_frames, summary_table

    frames = {}
    summaries = []
    for r in runs:
        if not r.metrics.exists():
            continue
        df = read_requests(r.metrics)
        frames[r.policy] = df
        # preemptions: the engines' per-second series (simulated), else their counters (vLLM)
        s = summarize_frames(df, read_timeseries(r.metrics), label=r.policy, preemptions=r.preemptions)
        if r.engine_hits:
            s.hit_share_gpu, s.hit_share_cpu = r.engine_hits["gpu"], r.engine_hits["cpu"]
        summaries.append(s)
        (r.out_dir / "summary.json").write_text(json.dumps(s.as_dict(), indent=1) + "\n")
    figures = write_demo_figures(frames, out)
    if len(runs) > 1:  # each policy's own figures next to its HDF5 as well
        for r in runs:
            if r.policy in frames:
                write_demo_figures({r.policy: frames[r.policy]}, r.out_dir)
    w = spec.workload
    agents = "" if w.profile == "smoke" else f", {w.concurrency} agents"
    pools = " + ".join(f"{pool.replicas} {role}" for role, pool in spec.pools.items())
    title = f"llmd demo: {spec.name} ({pools}), {w.profile}{agents}, {w.duration_s:g} s"
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(title)
    console.print(summary_table(summaries))
    print(f"metrics: {', '.join(str(r.metrics) for r in runs)}")
    print(f"figures: {', '.join(p.name for p in figures)} in {out} (all of them: llmd analyze {out})")
    print(f"done in {wall_s:.1f} s")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the main job on one machine: simulated engines, the router, the workload, a summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--spec", type=Path, help="deployment spec (default: the embedded disaggregated tiny deployment)")
    p.add_argument(
        "--duration",
        type=float,
        help=f"seconds of load (default {DEFAULT_DURATION_S:g}, {COMPARE_DURATION_S:g} per policy with --compare, "
        f"{SHORT_DURATION_S:g} with --short; with --spec: the spec's workload.duration_s)",
    )
    p.add_argument("--compare", action="store_true", help="run under precise, approximate and round-robin")
    p.add_argument("--output", default="results", help="results folder (default results/)")
    p.add_argument("--short", action="store_true", help="a few seconds of the smoke profile (CI)")
    p.add_argument(
        "--engine",
        choices=sorted(ENGINE_KINDS),
        help="simulated engines, or real vLLM CPU servers (the embedded deployment: 1 prefill + 1 decode over NIXL, "
        "~2 min of start-up); default: the spec's engine.kind",
    )
    p.set_defaults(func=run_demo)
