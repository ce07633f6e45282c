"""Routing under KV pressure: every policy over one fleet of simulated engines, the same agentic load, in one run.

The regime precise routing is for: a fleet of 8 simulated engines (Llama-3.1-8B latency profile on H100, KV block 64,
`llmd engine sim --all` in one process) whose KV caches are smaller than the agents' working set, long agentic
sessions from llmd's workload generator (contexts growing to ~13K tokens over a shared system prompt, bursts of 4
sub-agents forking a parent's context, rare resets), closed loop. Agentic turns read far more than they write (the
trace: median 195K tokens in, 317 out, ~600:1), so prefill, which a cache hit saves, dominates an engine's time; the
agents here keep that shape at contexts this machine can tokenize at fleet rates (~7K in, 30 out at the median,
~230:1). With outputs of hundreds of tokens on 7K contexts (35:1) decode would dominate instead, and even a router
that hit every prefix could not add more than ~15% req/s: such a workload cannot tell routers apart.
Pressure = working set / fleet GPU KV, where the working set is the agents' mean live context (the KV that would
keep every session's prefix cached); it is swept by
sizing the engines' GPU KV (`kv.gpu_blocks`) for the same load, with and without a CPU tier (sized so the GPU and CPU
tiers together hold 1.5x the working set).

Policies, each behind the same fleet (engines restarted per run, so no run profits from another's cache; each run
also has its own run salt): llmd precise (the spec's default weights), llmd precise-affinity (llm-d's newer decode
profile: prefix-cache affinity filter at 0.80 + token-load scorer), llmd approximate, llmd round-robin, and the public
peers sglang-router (cache_aware) and vllm-router (cache_aware, round_robin), installed from PyPI into a side venv
(.venv-peers) by this script; a peer that cannot install is skipped, saying so.

The peers run with their default settings (cache_aware balances load only past 64 requests of imbalance between
workers), as a user would first run them.

Per policy and level: hit share from the engines' own counters ((prefix cache hits + external hits) / queries over
the run), req/s and TTFT p50/p90 from the client's rows, router queue p90 (llmd's rows; the peers do not say),
preemptions from the engines' counter. req/s counts the requests that finished within the load's duration, over it
(not over the client process's wall time, whose start-up and drain vary with the machine's load). Then the targets,
each `name: value  # target ... (ratio R)`:
- hit_vs_best_peer_at_pressure / req_per_s_vs_best_peer_at_pressure: precise over the best public peer
  (sglang-router, vllm-router) at the highest level >= 1.3x (>= 1.15 and >= 1.2), without and with the CPU tier;
  the same against every other router (llmd's approximate and round-robin too, which share llmd's KV admission) is
  printed beside them as `*_vs_best_other_*`;
- ttft_p90_vs_best_peer: the worst over levels of the best peer's TTFT p90 / precise's (>= 1);
- precise_ge_all_levels: levels where precise's hit share and req/s are >= every other router's (llmd's approximate
  and round-robin and the peers; the affinity profile is precise routing too and is shown, not counted), a
  difference within two standard errors of it counting as a tie (paired batch means: the two runs replay the same
  seeded agents, compared slice by slice over 8 slices of the load; `tie_within_noise_*` lines name every such
  tie, `precise_strictly_ge_levels` counts without ties). Where every session fits its holder (0.5x) precise and
  approximate route alike, and their single runs differ either way by more than they do (the cluster simulator,
  same seeds: 2,812 / 2,800, 2,785 / 2,772, 2,792 / 2,798, 2,894 / 2,900 requests a minute, hit share within
  0.003);
- preemptions_total: over every llmd run (0; the peers' count is printed beside it).
A figure (hit share and TTFT p90 against pressure, a line per policy, one row per CPU-tier setting) goes to
results/bench-routing-fleet/routing_fleet.png with the table as CSV beside it.

Then the second prompt shape (SHORT_SYSTEM: a 200-token shared system prompt) at the highest level, GPU only:
precise against llmd's approximate and round-robin and the cache-aware peers, `short_system_*` lines.

`python benchmarks/routing_fleet.py` (about 45 minutes on 2 cores); `--quick`: two levels, no CPU tier, llmd's
policies and sglang-router; `--policies a,b` / `--levels 1,2` / `--cpu-tier off|on|both` / `--duration S` /
`--no-shape-check` narrow it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import free_port, info, report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)
from peers import PEER_PACKAGES, peers_python, router_cmd  # noqa: E402

ENGINES = 8
BLOCK = 64
MAX_MODEL_LEN = 16_384
LEVELS = (0.5, 1.0, 1.5, 2.0)
# Wall seconds per simulated second, engines and agents' tool gaps alike; times are reported in simulated seconds.
# Slower than real time: the fleet serves ~40 req/s of 7K-token prompts, which the simulated engines tokenize whole;
# in real time that saturated this machine's 2 cores on the lightly loaded levels (`cpu` in each row: busy cores over
# the run; 1.8 under precise at 0.5x, whose router also tokenizes), and the CPU, not the fleet, set the req/s.
TIME_SCALE = 1.6
# Named policies: (router, argument). "llmd" runs `llmd router --policy ARG`; "llmd-affinity" the same with llm-d's
# affinity decode profile; "sglang" / "vllm-router" the peer binaries with `--policy ARG`.
POLICIES: dict[str, tuple[str, str]] = {
    "precise": ("llmd", "precise"),
    "precise-affinity": ("llmd-affinity", "precise"),
    "approximate": ("llmd", "approximate"),
    "round-robin": ("llmd", "round-robin"),
    "sglang-cache_aware": ("sglang", "cache_aware"),
    "vllm-router-cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router-round_robin": ("vllm-router", "round_robin"),
}
# The agents: long sessions over a shared system prompt, sub-agent bursts of 4, a few resets. Unscaled tokens.
AGENTS = 40
WORKLOAD_PARAMS: dict[str, Any] = {
    "system_tokens": 2000,
    "initial_p50": 4000,
    "initial_p90": 6000,
    "initial_p99": 8000,
    "growth_p50": 700,
    "growth_p90": 1400,
    "growth_p99": 2500,
    "output_p50": 30,
    "output_p90": 80,
    "output_p99": 200,
    "gap_s_p50": 0.5,
    "gap_s_p90": 2.0,
    "gap_s_p99": 4.0,
    "turns": 8,
    "group_size": 4,
    "subagent_turns": 3,
    "subagent_task_p50": 300,
    "subagent_task_p90": 600,
    "subagent_share": 0.35,
    "reset_p": 0.02,
    "compaction_p": 0.0,
    "max_context": 13_000,
    "stagger_s": 2.0,
}
# A second prompt shape, so the comparison with the peers is not decided by one: the same agents over a short shared
# system prompt. (With the long one, the peers' cache_aware policies send every new session to whichever worker
# matched the system prompt first, until their load-balance thresholds trip.) Run at the highest pressure level,
# GPU only, precise against the others; printed beside the sweep, not part of its targets.
SHORT_SYSTEM = {**WORKLOAD_PARAMS, "system_tokens": 200}
# Paired batch means: two runs' completions in this many equal slices of the load, slice by slice, give the standard
# error of their difference in req/s and hit share; a difference within NOISE_SE of it is a tie (not_worse).
WINDOWS = 8
NOISE_SE = 2.0
SHAPE_POLICIES = ("precise", "approximate", "round-robin", "sglang-cache_aware", "vllm-router-cache_aware")


@dataclass
class Result:
    policy: str
    level: float
    cpu_tier: bool
    hit_share: float = math.nan
    req_per_s: float = math.nan
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    queue_p90_s: float = math.nan
    preemptions: int = 0
    requests: int = 0
    errors: int = 0
    first_error: str = ""
    cpu_busy: float = math.nan  # busy cores over the run (of os.cpu_count())
    shape: str = ""  # "": the sweep's workload; "short_system": the second prompt shape
    rate_slices: list[float] = field(default_factory=list)  # window_stats: req/s (wall) per slice of the load
    hit_slices: list[float] = field(default_factory=list)  # and hit share per slice


# --- the fleet -------------------------------------------------------------------------------------------------------
def working_set_tokens(params: dict[str, Any]) -> float:
    """The agents' mean live context in tokens: per agent, the mean prompt of its first sessions' main turns."""
    from llmd.workload.profiles import Workload, build_profile

    prof = build_profile("trace-stats", concurrency=AGENTS, duration_s=60, params={**params, "agents": AGENTS})
    w = Workload(prof, seed=0, salt="x")
    sizes = []
    for agent in range(AGENTS):
        for k, plan in enumerate(w.agent_sessions(agent)):
            sizes += [t.input_tokens for t in plan.turns]
            if k >= 2:
                break
    return AGENTS * sum(sizes) / len(sizes)


def spec_text(
    model: Path, port: int, router_port: int, gpu_blocks: int, cpu_bytes: int, seed: int, params: dict[str, Any]
) -> str:
    return f"""name: routing-fleet
model:
  path: llama-3.1-8b
  tokenizer: {model}
  served_name: tiny
  block_size: {BLOCK}
  max_model_len: {MAX_MODEL_LEN}
prefill:
  nodes: 0
decode:
  nodes: {ENGINES}
  replicas: {ENGINES}
  port: {port}
router:
  port: {router_port}
kv:
  gpu_blocks: {gpu_blocks}
  cpu_bytes: {cpu_bytes}
engine:
  gpu: H100-80GB
  time_scale: {TIME_SCALE}
workload:
  profile: trace-stats
  time_scale: {TIME_SCALE}
  seed: {seed}
  concurrency: {AGENTS}
  params: {dict(params, agents=AGENTS)!r}
"""


def affinity_overlay(text: str) -> str:
    """llm-d's newer decode profile: affinity filter at 0.80, then the token-load scorer alone."""
    return text.replace("router:\n", "router:\n  affinity_threshold: 0.8\n  weights:\n    token-load: 1.0\n", 1)


async def engine_counters(urls: list[str]) -> dict[str, float]:
    from llmd.demo import _engine_counters

    got = await _engine_counters(urls)
    if not got:
        raise RuntimeError("could not read the engines' /metrics")
    return got


def stop(*procs: subprocess.Popen | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
    for p in procs:
        if p is not None:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_retrying(*args: Any, **kw: Any) -> Result | None:
    """run_one, again on fresh ports when its engines could not bind theirs: the layout's ports are picked free but
    only bound later, and on a shared machine another process can take one in between (a run then measures nothing)."""
    for attempt in range(3):
        try:
            return run_one(*args, **kw)
        except Exception:
            logs = sorted((args[5] / "logs").glob("*-engines.log"), key=lambda f: f.stat().st_mtime)
            if attempt == 2 or not logs or "address already in use" not in logs[-1].read_text(errors="replace"):
                raise
            info("port_taken", f"{logs[-1].name}: a layout port was taken meanwhile; again on other ports")
    return None


def run_one(
    name: str,
    level: float,
    cpu_tier: bool,
    ws: float,
    model: Path,
    tmp: Path,
    duration: float,
    peers: Path | None,
    params: dict[str, Any] = WORKLOAD_PARAMS,
    shape: str = "",
) -> Result | None:
    from llmd.engines.vllm_server import wait_healthy
    from llmd.metrics import read_requests
    from llmd.perf.latency import LatencyModel
    from llmd.spec import load_spec

    kind, arg = POLICIES[name]
    res = Result(name, level, cpu_tier, shape=shape)
    gpu_blocks = max(math.ceil(ws / (level * ENGINES * BLOCK)), MAX_MODEL_LEN // BLOCK + 8)
    base = 10000 + (free_port() % 1500) * 10  # layout ports up to base + 3000 stay below the ephemeral range
    router_port = free_port()
    urls = [f"http://127.0.0.1:{base + i}" for i in range(ENGINES)]
    spec = tmp / f"{name}-{level}-{int(cpu_tier)}{'-' + shape if shape else ''}.yaml"
    text = spec_text(model, base, router_port, gpu_blocks, 0, seed=7, params=params)
    if cpu_tier:
        # GPU + CPU tiers together hold 1.5x the working set.
        kvb = LatencyModel.from_spec(load_spec(_write(spec, text)), "decode").kv_bytes_per_token_gpu
        cpu_tokens = max(0.0, 1.5 * ws / ENGINES - gpu_blocks * BLOCK)
        text = text.replace("cpu_bytes: 0", f"cpu_bytes: {int(cpu_tokens * kvb)}")
    if kind == "llmd-affinity":
        text = affinity_overlay(text)
    _write(spec, text)
    cmd = router_cmd(kind, arg, spec, router_port, urls, peers)
    if cmd is None:
        return None
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    elog = open(logs / f"{spec.stem}-engines.log", "wb")  # noqa: SIM115 (closed below)
    rlog = open(logs / f"{spec.stem}-router.log", "wb")  # noqa: SIM115
    engines = router = None
    try:
        engines = subprocess.Popen(
            [sys.executable, "-m", "llmd.cli", "engine", "sim", "--all", "--spec", str(spec), "--log-level", "WARNING"],
            stdout=elog, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        for u in urls:
            wait_healthy(u + "/health", engines, 60, name="llmd engine sim --all")
        router = subprocess.Popen(cmd, stdout=rlog, stderr=subprocess.STDOUT, cwd=ROOT)
        url = f"http://127.0.0.1:{router_port}"
        wait_healthy(url + "/health", [engines, router], 60, name=f"router {name}")
        time.sleep(2.0)  # health rounds and KV-event subscriptions
        before = asyncio.run(engine_counters(urls))
        out = tmp / "runs"
        run = spec.stem
        t0 = time.monotonic()
        cpu0 = _cpu_seconds()
        bench = subprocess.run(
            [sys.executable, "-m", "llmd.cli", "bench", "--spec", str(spec), "--url", url, "--duration", str(duration),
             "--output", str(out), "--run", run, "--no-progress", "--request-timeout", "120"],
            cwd=ROOT, capture_output=True, timeout=duration + 300,
        )  # fmt: skip
        wall = time.monotonic() - t0
        cpu_busy = _cpu_seconds() - cpu0
        if bench.returncode != 0:
            raise RuntimeError(f"llmd bench exited {bench.returncode}: {bench.stderr.decode()[-800:]}")
        after = asyncio.run(engine_counters(urls))
    finally:
        stop(router, engines)
        elog.close()
        rlog.close()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    q = d["vllm:prefix_cache_queries_total"]
    res.hit_share = (d["vllm:prefix_cache_hits_total"] + d["vllm:external_prefix_cache_hits_total"]) / q if q else 0.0
    res.preemptions = int(d["vllm:num_preemptions_total"])
    df = read_requests(out / run / "metrics.h5")
    df = df[df["source"] == "client"] if "source" in df else df
    ok = df[(df["status"] == 200) & (df["error"].astype(str) == "")]
    res.requests = len(df)
    res.errors = len(df) - len(ok)
    bad = df[~df.index.isin(ok.index)]
    if len(bad):
        res.first_error = f"{bad['status'].iloc[0]} {str(bad['error'].iloc[0])[:160]}"
    # Throughput over the load window itself (requests that finished within the duration), not over the client
    # process's wall time: that adds its start-up and the drain of the last turns, a few seconds that vary with the
    # machine's load and would make two routers that serve alike differ by several per cent.
    rate, res.rate_slices, res.hit_slices = window_stats(ok, duration)
    res.req_per_s = rate * TIME_SCALE
    res.ttft_p50_s = float(ok["ttft_s"].quantile(0.5)) / TIME_SCALE if len(ok) else math.nan
    res.ttft_p90_s = float(ok["ttft_s"].quantile(0.9)) / TIME_SCALE if len(ok) else math.nan
    qs = ok["router_queue_s"].dropna() if "router_queue_s" in ok else []
    res.queue_p90_s = float(qs.quantile(0.9)) / TIME_SCALE if len(qs) else math.nan
    res.cpu_busy = cpu_busy / wall
    return res


def window_stats(ok: Any, duration: float, windows: int = WINDOWS) -> tuple[float, list[float], list[float]]:
    """(req/s, req/s in each slice, hit share in each slice) of one run from its client rows: requests that ended
    within the load's `duration` (wall seconds since the load began), over the duration; then the same over
    `windows` equal slices of it (a slice's completions, and its requests' cached / prompt tokens: the engines' own
    usage.cached_tokens; nan where a slice saw none), for `not_worse`'s paired comparison."""
    end = (ok["send_time"] + ok["e2e_s"]).to_numpy(dtype=float)
    inside = end <= duration
    slot = np.minimum((end[inside] / duration * windows).astype(int), windows - 1)
    rate = np.bincount(slot, minlength=windows) / (duration / windows)
    inp = np.bincount(slot, ok["input_tokens"].to_numpy(dtype=float)[inside], minlength=windows)
    cached = np.bincount(slot, ok["cached_tokens"].to_numpy(dtype=float)[inside].clip(min=0), minlength=windows)
    with np.errstate(invalid="ignore", divide="ignore"):
        hits = np.where(inp > 0, cached / inp, np.nan)
    return float(inside.sum() / duration), rate.tolist(), hits.tolist()


def paired_se(a: list[float], b: list[float]) -> float:
    """Standard error of the mean difference between two runs' slices, slice by slice (batch means). The runs replay
    the same seeded agents, so what both share (the ramp-up of the first turns, the bursts the plan puts at the same
    times) cancels in the pairs and only the routers' difference and the noise remain; nan without two pairs."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    d = d[~np.isnan(d)]
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan


def paired_ses(p: Result, o: Result) -> tuple[float, float]:
    """(hit share, req/s) standard errors of the difference between two runs (req/s in simulated seconds)."""
    return paired_se(p.hit_slices, o.hit_slices), paired_se(p.rate_slices, o.rate_slices) * TIME_SCALE


def not_worse(p: Result, o: Result) -> bool:
    """Precise is >= `o` on hit share and req/s, a difference smaller than NOISE_SE paired standard errors counting
    as a tie: where two routers route alike (low pressure, every session fits its holder) their single runs differ
    both ways by more than the routers do. Without slices to pair (a run too short), only >= counts."""

    def ge(a: float, b: float, se: float) -> bool:
        return a >= b - (0.0 if math.isnan(se) else NOISE_SE * se)

    hit_se, rps_se = paired_ses(p, o)
    return ge(p.hit_share, o.hit_share, hit_se) and ge(p.req_per_s, o.req_per_s, rps_se)


def _cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (/proc/stat), to tell a CPU-bound run from a fleet-bound one."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return math.nan
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the report ------------------------------------------------------------------------------------------------------
def _fmt(v: float, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_row(r: Result) -> None:
    tier = "cpu" if r.cpu_tier else "gpu"
    key = f"{r.shape + '_' if r.shape else ''}{r.policy.replace('-', '_')}_{tier}_x{r.level:g}".replace(".", "_")
    print(
        f"# {key}: hit {_fmt(r.hit_share, '.3f')}  req/s {_fmt(r.req_per_s, '.1f')}  "
        f"ttft p50 {_fmt(r.ttft_p50_s, '.2f')} s p90 {_fmt(r.ttft_p90_s, '.2f')} s  "
        f"queue p90 {_fmt(r.queue_p90_s, '.2f')} s  preemptions {r.preemptions}  "
        f"requests {r.requests} errors {r.errors} cpu {_fmt(r.cpu_busy, '.1f')}"
        + (f" (first: {r.first_error})" if r.first_error else ""),
        flush=True,
    )


def targets(results: list[Result], shape_results: list[Result]) -> None:
    shape = {r.policy: r for r in shape_results}
    if "precise" in shape and _peers(shape):
        p = shape["precise"]
        best_hit = max(o.hit_share for o in _peers(shape))
        best_rps = max(o.req_per_s for o in _peers(shape))
        info("short_system_hit_vs_best_peer", f"{p.hit_share / max(best_hit, 1e-9):.2f}")
        info("short_system_req_per_s_vs_best_peer", f"{p.req_per_s / max(best_rps, 1e-9):.2f}")
    by: dict[tuple[bool, float], dict[str, Result]] = {}
    for r in results:
        by.setdefault((r.cpu_tier, r.level), {})[r.policy] = r
    worst_ttft = math.inf
    levels_ok = levels = strict_levels = 0
    for tier in sorted({r.cpu_tier for r in results}):
        suffix = "_cpu_tier" if tier else ""
        for (t, _lv), group in sorted(by.items()):
            if t != tier or "precise" not in group:
                continue
            p = group["precise"]
            if _rivals(group):
                levels += 1
                levels_ok += all(not_worse(p, o) for o in _rivals(group))
                strict_levels += all(p.hit_share >= o.hit_share and p.req_per_s >= o.req_per_s for o in _rivals(group))
                for o in _rivals(group):
                    if not_worse(p, o) and (p.hit_share < o.hit_share or p.req_per_s < o.req_per_s):
                        hit_se, rps_se = paired_ses(p, o)
                        info(f"tie_within_noise{suffix}_x{_lv:g}",
                             f"precise - {o.policy}: hit {p.hit_share - o.hit_share:+.3f} (paired SE {hit_se:.3f}), "
                             f"req/s {p.req_per_s - o.req_per_s:+.1f} (paired SE {rps_se:.1f})")  # fmt: skip
            if _peers(group):
                best_ttft = min(o.ttft_p90_s for o in _peers(group))
                worst_ttft = min(worst_ttft, best_ttft / max(p.ttft_p90_s, 1e-9))
        pressured = sorted(lv for (t, lv) in by if t == tier and lv >= 1.3)
        if pressured:
            lv = pressured[-1]
            group = by[(tier, lv)]
            if "precise" not in group:
                continue
            p = group["precise"]
            info(f"pressure_level{suffix}", f"{lv:g}x working set / fleet KV")
            for what, others in (("peer", _peers(group)), ("other", _rivals(group))):
                if not others:
                    info(f"hit_vs_best_{what}_at_pressure{suffix}", "n/a (none ran)")
                    continue
                best_hit = max(o.hit_share for o in others)
                best_rps = max(o.req_per_s for o in others)
                if what == "peer":
                    report(f"hit_vs_best_peer_at_pressure{suffix}", p.hit_share / max(best_hit, 1e-9), 1.15, True)
                    report(f"req_per_s_vs_best_peer_at_pressure{suffix}", p.req_per_s / max(best_rps, 1e-9), 1.2, True)
                else:  # llmd's own approximate and round-robin too (they share its KV admission): context
                    info(f"hit_vs_best_other_at_pressure{suffix}", f"{p.hit_share / max(best_hit, 1e-9):.2f}")
                    info(f"req_per_s_vs_best_other_at_pressure{suffix}", f"{p.req_per_s / max(best_rps, 1e-9):.2f}")
    if worst_ttft < math.inf:
        report("ttft_p90_vs_best_peer", worst_ttft, 1.0, True)
    if levels:
        report("precise_ge_all_levels", levels_ok / levels, 1.0, True)
        info("precise_strictly_ge_levels", f"{strict_levels} of {levels} (no tie allowed within noise)")
    # llmd's own runs: the peers forward everything and leave KV admission to the engines (their count is context).
    every = results + shape_results
    total = sum(r.preemptions for r in every if POLICIES[r.policy][0].startswith("llmd"))
    peers = sum(r.preemptions for r in every if not POLICIES[r.policy][0].startswith("llmd"))
    info("peer_preemptions_total", peers)
    print(f"preemptions_total: {total}  # target <= 0 ({'met' if total == 0 else 'missed'})", flush=True)


def _rivals(group: dict[str, Result]) -> list[Result]:
    """Every other router: llmd's approximate and round-robin and the public peers. Not the affinity profile: it is
    precise routing too, from the same KV index, compared with precise in the table and the README."""
    return [r for k, r in group.items() if k != "precise" and POLICIES[k][0] != "llmd-affinity"]


def _peers(group: dict[str, Result]) -> list[Result]:
    """The public peers (sglang-router, vllm-router): what the issue's "best peer" targets are held against."""
    return [r for k, r in group.items() if POLICIES[k][0] in PEER_PACKAGES]


def figure(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = sorted({r.cpu_tier for r in results})
    fig, axes = plt.subplots(len(tiers), 2, figsize=(11, 4 * len(tiers)), squeeze=False)
    for row, tier in enumerate(tiers):
        rs = [r for r in results if r.cpu_tier == tier]
        for policy in POLICIES:
            pts = sorted((r.level, r) for r in rs if r.policy == policy)
            if not pts:
                continue
            xs = [lv for lv, _ in pts]
            style = "-o" if policy.startswith(("precise", "approximate", "round")) else "--s"
            axes[row][0].plot(xs, [r.hit_share for _, r in pts], style, label=policy)
            axes[row][1].plot(xs, [r.ttft_p90_s for _, r in pts], style, label=policy)
        tier_name = "GPU + CPU tier" if tier else "GPU only"
        axes[row][0].set(xlabel="working set / fleet GPU KV", ylabel="hit share (engines' counters)",
                         title=f"Prefix-cache hit share, {tier_name}", ylim=(0, 1))  # fmt: skip
        axes[row][1].set(xlabel="working set / fleet GPU KV", ylabel="TTFT p90 (s)", yscale="log",
                         title=f"TTFT p90, {tier_name}")  # fmt: skip
        for ax in axes[row]:
            ax.grid(True, alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.suptitle(f"{ENGINES} simulated engines, {AGENTS} agents with sub-agent bursts, Llama-3.1-8B on H100")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="levels 0.5 and 2, no CPU tier, llmd's policies and sglang")
    p.add_argument("--policies", help=f"comma-separated subset of {', '.join(POLICIES)}")
    p.add_argument("--levels", help="comma-separated pressure levels (working set / fleet GPU KV)")
    p.add_argument("--cpu-tier", choices=("off", "on", "both"), default="both")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load per run")
    p.add_argument("--out", default=str(ROOT / "results" / "bench-routing-fleet"))
    p.add_argument("--keep", action="store_true", help="keep the runs' specs, logs and HDF5 files (in --out/work)")
    p.add_argument("--no-shape-check", action="store_true", help="skip the second prompt shape (short system prompt)")
    a = p.parse_args(argv)
    policies = list(POLICIES)
    levels = list(LEVELS)
    tiers = {"off": [False], "on": [True], "both": [False, True]}[a.cpu_tier]
    if a.quick:
        policies = ["precise", "approximate", "round-robin", "sglang-cache_aware"]
        levels = [0.5, 2.0]
        tiers = [False]
    if a.policies:
        policies = [s.strip() for s in a.policies.split(",")]
        bad = [s for s in policies if s not in POLICIES]
        if bad:
            p.error(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    if a.levels:
        levels = [float(s) for s in a.levels.split(",")]
    peers = peers_python() if any(POLICIES[s][0] in PEER_PACKAGES for s in policies) else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from llmd.models.tiny import make_tiny

    ws = working_set_tokens(WORKLOAD_PARAMS)
    info("working_set_tokens", f"{ws:,.0f} ({AGENTS} agents, {ENGINES} engines, block {BLOCK})")
    results: list[Result] = []
    keep = out / "work" if a.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory(prefix="llmd-fleet-") as td:
        tmp = Path(td)
        model = tmp / "tiny"
        make_tiny(model)
        for tier in tiers:
            for level in levels:
                for name in policies:
                    try:
                        r = run_retrying(name, level, tier, ws, model, tmp, a.duration, peers)
                    except Exception as exc:  # one broken run is reported; the others still measure
                        info(f"{name}_x{level:g}", f"failed: {exc}")
                        with contextlib.suppress(OSError):
                            for log in sorted((tmp / "logs").glob("*.log"))[-2:]:
                                print(f"#   {log.name}: {log.read_text()[-600:]!r}", flush=True)
                        continue
                    if r is None:
                        info(name, "skipped: its router is not installed")
                        continue
                    results.append(r)
                    print_row(r)
        shape_results: list[Result] = []
        if not (a.quick or a.no_shape_check):
            ws_short = working_set_tokens(SHORT_SYSTEM)
            info("short_system_working_set_tokens", f"{ws_short:,.0f} (system prompt 200 tokens)")
            for name in [s for s in SHAPE_POLICIES if s in policies]:
                try:
                    r = run_retrying(name, max(levels), False, ws_short, model, tmp, a.duration, peers, SHORT_SYSTEM,
                                "short_system")  # fmt: skip
                except Exception as exc:
                    info(f"short_system_{name}", f"failed: {exc}")
                    continue
                if r is not None:
                    shape_results.append(r)
                    print_row(r)
    with open(out / "routing_fleet.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "shape", "cpu_tier", "pressure", "hit_share", "req_per_s", "ttft_p50_s", "ttft_p90_s",
                    "router_queue_p90_s", "preemptions", "requests", "errors"])  # fmt: skip
        for r in results + shape_results:
            w.writerow([r.policy, r.shape or "long_system", int(r.cpu_tier), r.level, r.hit_share, r.req_per_s,
                        r.ttft_p50_s, r.ttft_p90_s, r.queue_p90_s, r.preemptions, r.requests, r.errors])  # fmt: skip
    if results:
        figure(results, out / "routing_fleet.png")
        info("figure", out / "routing_fleet.png")
        targets(results, shape_results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
