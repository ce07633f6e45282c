"""Soak: thousands of simulated agents through the router for minutes, then the same load under injected faults.

The fleet: simulated engines (Llama-3.1-8B latency profile on H100, KV block 64), each its own `llmd engine sim`
process on the spec's layout ports so one can be killed, stopped or restarted alone: a P/D spec with PREFILL prefill
and DECODE decode replicas (the quick mode: two decode engines, no prefill pool), behind one `llmd router` process,
driven by one `llmd bench` process: AGENTS closed-loop agents with sub-agent bursts (groups of 4 forking a parent's
context), every producer writing its HDF5 (client, router, each engine incarnation).

Time is scaled: engines and the agents' tool gaps run TIME_SCALE times slower than real time, so the fleet's
throughput fits what this machine's 2 cores can proxy and tokenize beside the agents; times are printed in wall
seconds unless named `_sim`.

The operating point (what "zero preemptions" holds at): agents spend most of their time in tool calls (gap p50 30 s
simulated, 4 minutes wall), so 3000 agents send ~12 requests a second (wall) and keep ~100 in flight; sessions are
short (contexts up to 3K tokens over a 500-token shared system prompt) so that the decode pool's KV (KV_BLOCKS blocks
of 64 tokens per engine) holds ~1.4x the agents' working set and turns hit their prefix; the router's KV admission
never lets an engine take more KV than it has, so engines do not preempt by construction; and the fleet runs well
below its token throughput, so requests wait briefly, if at all, in the router's queue (queue p90 is printed).
Each agent's first turn comes within the ramp (RAMP_S, before the measured window), so all 3000 are in session
during it.

Run 1 (no faults, --duration wall seconds after the ramp): client errors (target 0), preemptions (target 0), router
RSS sampled from /proc every few seconds (max, and growth over the last half), router queue p90.
Run 2 (the same load, on the same fleet, faults one after another, each followed by a settle window):
  1 sigkill_decode    SIGKILL of a decode engine mid-stream, restarted after RESTART_AFTER_S
  2 sigstop_engine    SIGSTOP of a decode engine for STOP_S (20 s; quick: 4 s), then SIGCONT
  3 kv_publisher      a KV event batch dropped (SIGUSR1: a sequence gap the router replays), then the engine
                      process restarted (its publisher restarts with seq 0)
  4 router_restart    SIGKILL of the router, started again on the same port (clients back off and go on)
  5 prefill_death     SIGKILL of a prefill engine during P/D, restarted after RESTART_AFTER_S
  6 kv_transfer_fail  failed KV transfers (SIGUSR2 to every decode engine, FAILED_TRANSFERS times: each fails its next
                      pull as a failed NIXL READ; the router retries the request without a transfer)
Per fault: client errors in its window (and which are expected by design), requests retried (router /metrics
llmd_router_retries_total), seconds until the pod left routing (llmd_router_pod_healthy 0) and came back, and
survived: the pod came back, the stack served again after it (the window waits, up to SERVE_AGAIN_S, until the
router has answered SERVED_AGAIN more requests, then settles), nothing hung. After both runs every HDF5 written
(client, router, engines; a SIGKILLed writer's too) must read with llmd.metrics.read_requests.

Errors expected by design: a stream already answering when its engine is SIGKILLed, or frozen by SIGSTOP until the
router takes the pod out (then its silent streams are cut after down_grace_s), ends with an error event: the router
cannot resend what the client has seen. When the router itself is killed, its streams drop and requests sent while it
is down are refused (the client backs off and goes on). Requests not yet streaming are retried on another pod, never
seen by the client. Nothing else is expected.

`python benchmarks/soak.py` (~11 minutes on 2 cores); `--quick` (200 agents, 10 s, two faults, ~1 minute);
`--agents N`, `--duration S`, `--skip-faults`, `--keep DIR` (keep specs, logs and HDF5 files).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import free_port, info, report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

BLOCK = 64
MAX_MODEL_LEN = 8192
TIME_SCALE = 8.0
AGENTS = 3000
DURATION_S = 150.0  # wall seconds of the no-fault run after the ramp
RAMP_S = 150.0  # wall seconds over which the agents' first turns start (stagger), before the measured window
PREFILL, DECODE = 2, 4
KV_BLOCKS = 24_576  # per engine: 1.57M tokens, the decode pool holds ~1.4x the agents' working set
STOP_S = 20.0
RESTART_AFTER_S = 3.0
SETTLE_S = 20.0  # after a fault's pod is back and the stack served again, before the next fault
SERVED_AGAIN = 5  # answers (router's count) that show the stack serves again after a fault
SERVE_AGAIN_S = 60.0  # the bound on waiting for them
FAILED_TRANSFERS = 3
# Agents: mostly in tool calls, short contexts (the machine tokenizes every prompt twice: router and engine).
WORKLOAD_PARAMS: dict[str, Any] = {
    "system_tokens": 500,
    "initial_p50": 600,
    "initial_p90": 1200,
    "initial_p99": 2000,
    "growth_p50": 100,
    "growth_p90": 300,
    "growth_p99": 800,
    "output_p50": 20,
    "output_p90": 60,
    "output_p99": 150,
    "gap_s_p50": 30.0,
    "gap_s_p90": 90.0,
    "gap_s_p99": 180.0,
    "turns_p50": 12,
    "turns_p90": 30,
    "turns_p99": 60,
    "group_size": 4,
    "subagent_turns": 2,
    "subagent_task_p50": 150,
    "subagent_task_p90": 400,
    "subagent_share": 0.3,
    "reset_p": 0.02,
    "compaction_p": 0.0,
    "max_context": 3000,
}
# --quick: 200 agents with short tool gaps, so a few seconds of load hold streams in flight for the faults to cut.
QUICK_PARAMS = {"gap_s_p50": 2.0, "gap_s_p90": 5.0, "gap_s_p99": 10.0}
PD_THRESHOLD = 1024  # session starts and big turns are disaggregated, a turn's small growth stays on its decode pod


# --- the fleet -------------------------------------------------------------------------------------------------------
def spec_text(
    model: Path, prefill: int, decode: int, base: int, router_port: int, agents: int, ramp_s: float, quick: bool
) -> str:
    params = dict(WORKLOAD_PARAMS, **(QUICK_PARAMS if quick else {}), agents=agents, stagger_s=ramp_s / TIME_SCALE)
    pool_p = f"prefill:\n  nodes: {prefill}\n" + (f"  replicas: {prefill}\n  port: {base}\n" if prefill else "")
    return f"""name: soak
model:
  path: llama-3.1-8b
  tokenizer: {model}
  served_name: tiny
  block_size: {BLOCK}
  max_model_len: {MAX_MODEL_LEN}
{pool_p}decode:
  nodes: {decode}
  replicas: {decode}
  port: {base + 100}
router:
  port: {router_port}
  pd_threshold: {PD_THRESHOLD}
kv:
  gpu_blocks: {KV_BLOCKS}
engine:
  gpu: H100-80GB
  time_scale: {TIME_SCALE}
workload:
  profile: trace-stats
  time_scale: {TIME_SCALE}
  seed: 11
  concurrency: {agents}
  params: {params!r}
"""


class Fleet:
    """The engine processes (one per replica), the router process and their HDF5 files; restartable one by one."""

    def __init__(self, spec: Path, run_dir: Path, logs: Path) -> None:
        from llmd.spec import load_spec
        from llmd.spec.layout import engine_endpoints

        self.spec = spec
        self.loaded = load_spec(spec)
        self.endpoints = {ep.name: ep for ep in engine_endpoints(self.loaded)}
        self.router_port = self.loaded.router.port
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.run_dir = run_dir
        self.logs = logs
        self.engines: dict[str, subprocess.Popen] = {}
        self.router: subprocess.Popen | None = None
        self.h5: list[Path] = []  # every HDF5 a producer was told to write
        self._incarnation: dict[str, int] = {}
        self._logs: list[Any] = []

    def names(self, role: str) -> list[str]:
        return [n for n, ep in self.endpoints.items() if ep.role == role]

    def _out(self, name: str) -> tuple[Path, Any]:
        k = self._incarnation[name] = self._incarnation.get(name, -1) + 1
        h5 = self.run_dir / f"{name}-{k}.h5"
        self.h5.append(h5)
        log = open(self.logs / f"{name}-{k}.log", "wb")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        return h5, log

    def start_engine(self, name: str) -> subprocess.Popen:
        ep = self.endpoints[name]
        h5, log = self._out(name)
        cmd = [sys.executable, "-m", "llmd.cli", "engine", "sim", "--spec", str(self.spec), "--role", ep.role,
               "--name", name, "--engine-id", ep.engine_id, "--port", str(ep.http_port),
               "--kv-events-endpoint", ep.kv_events_endpoint(), "--kv-events-replay-endpoint", ep.replay_endpoint(),
               "--side-channel-port", str(ep.side_channel_port), "--metrics-out", str(h5),
               "--log-level", "WARNING"]  # fmt: skip
        self.engines[name] = p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return p

    def start_router(self) -> subprocess.Popen:
        h5, log = self._out("router")
        cmd = [sys.executable, "-m", "llmd.cli", "router", "--spec", str(self.spec), "--metrics-out", str(h5),
               "--log-level", "WARNING"]  # fmt: skip
        self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self.router

    def start(self, timeout_s: float = 120.0) -> None:
        from llmd.engines.vllm_server import wait_healthy

        for name in self.endpoints:
            self.start_engine(name)
        for name, ep in self.endpoints.items():
            wait_healthy(ep.url + "/health", self.engines[name], timeout_s, name=f"engine {name}")
        self.start_router()
        assert self.router is not None
        wait_healthy(self.url + "/health", self.router, timeout_s, name="router")

    def signal_engine(self, name: str, sig: int) -> None:
        p = self.engines[name]
        if p.poll() is None:
            p.send_signal(sig)

    def stop_engine(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.engines[name]
        if p.poll() is None:
            p.send_signal(sig)
        _reap(p)

    def stop(self) -> None:
        procs = [self.router, *self.engines.values()]
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                    p.terminate()
        for p in procs:
            if p is not None:
                _reap(p)
        for log in self._logs:
            log.close()


def _reap(p: subprocess.Popen, timeout_s: float = 20.0) -> None:
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# --- watching the router ---------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


@dataclass
class Sample:
    t: float
    up: bool  # the router answered /metrics
    healthy: dict[str, bool] = field(default_factory=dict)
    retries: dict[str, float] = field(default_factory=dict)  # by reason, this router incarnation's counter
    kv: dict[str, float] = field(default_factory=dict)  # KV event counters
    answered: float = 0.0  # chat requests answered 200, this router incarnation's counter


class Banked:
    """Counters summed over router incarnations: one that went down belongs to a new one, so bank the old total."""

    def __init__(self) -> None:
        self.base: dict[str, float] = {}  # totals of routers that are gone
        self.last: dict[str, float] = {}

    def update(self, now: dict[str, float]) -> None:
        for k, v in now.items():
            if v < self.last.get(k, 0.0):
                self.base[k] = self.base.get(k, 0.0) + self.last[k]
            self.last[k] = v

    def totals(self) -> dict[str, float]:
        return {k: self.base.get(k, 0.0) + self.last.get(k, 0.0) for k in set(self.base) | set(self.last)}


class Monitor(threading.Thread):
    """Polls the router's /metrics (pod health, retries, KV event counters) and its process's RSS, until stopped."""

    def __init__(self, fleet: Fleet, every_s: float = 0.5, rss_every_s: float = 3.0) -> None:
        super().__init__(daemon=True, name="soak-monitor")
        self.fleet = fleet
        self.every_s = every_s
        self.rss_every_s = rss_every_s
        self.t0 = time.monotonic()
        self.samples: list[Sample] = []
        self.rss: list[tuple[float, int, float]] = []  # (t, router pid, MB)
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._retries = Banked()
        self._answered = Banked()
        self.first_answer: float | None = None  # when the router had first answered a chat request

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        next_rss = 0.0
        while not self._halt.is_set():
            t = self.now()
            s = self._poll(t)
            with self._lock:
                self.samples.append(s)
            router = self.fleet.router
            if t >= next_rss and router is not None and router.poll() is None:
                mb = vm_rss_mb(router.pid)
                if mb is not None:
                    self.rss.append((t, router.pid, mb))
                next_rss = t + self.rss_every_s
            self._halt.wait(self.every_s)

    def _poll(self, t: float) -> Sample:
        try:
            with urllib.request.urlopen(self.fleet.url + "/metrics", timeout=3) as r:
                m = parse_metrics(r.read().decode())
        except (OSError, urllib.error.URLError, ValueError):
            return Sample(t, False)
        s = Sample(t, True)
        for (name, labels), v in m.items():
            lab = dict(labels)
            if name == "llmd_router_pod_healthy":
                s.healthy[lab["pod"]] = v > 0
            elif name == "llmd_router_requests_total" and lab.get("route") == "/v1/chat/completions":
                if lab.get("status") == "200":
                    s.answered += v
                if self.first_answer is None and v > 0:
                    self.first_answer = t
            elif name == "llmd_router_retries_total":
                s.retries[lab["reason"]] = v
            elif name.startswith("llmd_router_kv_event_") and name.endswith("_total"):
                s.kv[name[len("llmd_router_kv_event_") : -len("_total")]] = v
        with self._lock:
            self._retries.update(s.retries)
            self._answered.update({"ok": s.answered})
        return s

    def retries_total(self) -> dict[str, float]:
        with self._lock:
            return self._retries.totals()

    def answered_total(self) -> float:
        """Chat requests the routers answered 200, over every incarnation."""
        with self._lock:
            return self._answered.totals().get("ok", 0.0)

    def latest(self) -> Sample | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def wait_for(self, pred: Callable[[Sample], bool], timeout_s: float) -> float | None:
        """Seconds until a fresh sample satisfies `pred`, or None after `timeout_s`."""
        t0 = self.now()
        seen = len(self.samples)
        while self.now() - t0 < timeout_s:
            with self._lock:
                fresh = self.samples[seen:]
                seen = len(self.samples)
            for s in fresh:
                if s.t >= t0 and pred(s):
                    return s.t - t0
            time.sleep(0.1)
        return None

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def vm_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- faults ----------------------------------------------------------------------------------------------------------
@dataclass
class Fault:
    name: str
    what: str
    t0: float = math.nan  # monitor time the fault was injected
    t1: float = math.nan  # monitor time its window ended (recovered + settle)
    pod: str = ""
    left_s: float | None = None  # injection -> pod out of routing
    back_s: float | None = None  # pod restarted / resumed -> back in routing
    retries: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recovered: bool = False
    client_errors: int = 0
    expected_errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    served_after: int = 0  # requests served OK in its window after it recovered
    served_again_s: float | None = None  # pod back -> the router had answered SERVED_AGAIN more requests


def healthy(pod: str, want: bool) -> Callable[[Sample], bool]:
    return lambda s: s.up and s.healthy.get(pod) is want


def _leave_and_back(f: Fault, mon: Monitor, fleet: Fleet, revive: Callable[[], None], wait_s: float) -> None:
    """Wait for f.pod to leave routing, revive it after `wait_s` (from the injection), wait for it to come back."""
    f.left_s = mon.wait_for(healthy(f.pod, False), 30.0)
    time.sleep(max(0.0, wait_s - (mon.now() - f.t0)))
    t_revive = mon.now()
    revive()
    back = mon.wait_for(healthy(f.pod, True), 90.0)
    f.back_s = back
    f.recovered = back is not None
    if f.left_s is None:
        f.notes.append("never left routing")
    f.notes.append(f"revived {t_revive - f.t0:.1f} s after the fault")


def fault_sigkill_decode(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    f.pod = fleet.names("decode")[0]
    f.t0 = mon.now()
    fleet.stop_engine(f.pod, signal.SIGKILL)
    _leave_and_back(f, mon, fleet, lambda: fleet.start_engine(f.pod), RESTART_AFTER_S)


def fault_sigstop(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    names = fleet.names("decode")
    f.pod = names[1 % len(names)]
    stop_s = 4.0 if quick else STOP_S
    f.t0 = mon.now()
    fleet.signal_engine(f.pod, signal.SIGSTOP)
    _leave_and_back(f, mon, fleet, lambda: fleet.signal_engine(f.pod, signal.SIGCONT), stop_s)
    f.notes.append(f"stopped {stop_s:g} s")


def fault_kv_publisher(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    names = fleet.names("decode")
    f.pod = names[2 % len(names)]
    before = (mon.latest() or Sample(0, False)).kv
    f.t0 = mon.now()
    fleet.signal_engine(f.pod, signal.SIGUSR1)  # its next batch per rank is not sent: a gap
    time.sleep(5.0)
    mid = (mon.latest() or Sample(0, False)).kv
    f.notes.append(
        f"gap: replays {mid.get('replays_ok', 0) - before.get('replays_ok', 0):.0f} ok / "
        f"{mid.get('replays_failed', 0) - before.get('replays_failed', 0):.0f} failed, "
        f"replayed batches {mid.get('replayed_batches', 0) - before.get('replayed_batches', 0):.0f}, "
        f"gaps accepted {mid.get('gaps', 0) - before.get('gaps', 0):.0f}"
    )
    fleet.stop_engine(f.pod, signal.SIGTERM)  # a clean restart: the publisher comes back at seq 0
    _leave_and_back(f, mon, fleet, lambda: fleet.start_engine(f.pod), 5.0 + RESTART_AFTER_S)
    end = (mon.latest() or Sample(0, False)).kv
    f.notes.append(
        f"restarted publisher resubscribed from seq 0 (the pod's index entries went when it left routing; "
        f"restarts seen on a live subscription {end.get('restarts', 0) - mid.get('restarts', 0):.0f})"
    )


def fault_router_restart(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    f.pod = "router"
    f.t0 = mon.now()
    assert fleet.router is not None
    fleet.router.kill()
    fleet.router.wait()
    f.left_s = mon.wait_for(lambda s: not s.up, 10.0)
    time.sleep(1.0)
    t = mon.now()
    fleet.start_router()
    f.back_s = mon.wait_for(lambda s: s.up and all(s.healthy.values()) and len(s.healthy) > 0, 120.0)
    f.recovered = f.back_s is not None
    f.notes.append(f"restarted {t - f.t0:.1f} s after the kill")


def fault_prefill_death(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    f.pod = fleet.names("prefill")[0]
    f.t0 = mon.now()
    fleet.stop_engine(f.pod, signal.SIGKILL)
    _leave_and_back(f, mon, fleet, lambda: fleet.start_engine(f.pod), RESTART_AFTER_S + 5.0)


def fault_kv_transfer(fleet: Fleet, mon: Monitor, f: Fault, quick: bool) -> None:
    f.pod = "decode pool"
    f.t0 = mon.now()
    for _ in range(FAILED_TRANSFERS):
        for name in fleet.names("decode"):
            fleet.signal_engine(name, signal.SIGUSR2)
        time.sleep(2.0)
    f.recovered = True  # no pod is expected to leave routing: the request is retried elsewhere
    f.notes.append(f"{FAILED_TRANSFERS} failed pulls armed per decode engine")


FAULTS: dict[str, tuple[str, Callable[[Fleet, Monitor, Fault, bool], None]]] = {
    "sigkill_decode": ("SIGKILL of a decode engine mid-stream, restarted", fault_sigkill_decode),
    "sigstop_engine": ("SIGSTOP of a decode engine, then SIGCONT", fault_sigstop),
    "kv_publisher": ("KV event gap (dropped batch) + publisher restart (engine restarted)", fault_kv_publisher),
    "router_restart": ("SIGKILL of the router, started again on the same port", fault_router_restart),
    "prefill_death": ("SIGKILL of a prefill engine during P/D, restarted", fault_prefill_death),
    "kv_transfer_fail": ("failed KV transfers (NIXL READ errors)", fault_kv_transfer),
}
QUICK_FAULTS = ("sigkill_decode", "sigstop_engine")


# --- reading the results ---------------------------------------------------------------------------------------------
def classify(err: str) -> str:
    """A short kind for a client error text."""
    e = err.lower()
    if "failed mid-stream" in e or "mid-stream" in e:
        return "stream cut (engine died mid-stream)"
    if "connect" in e or "refused" in e:
        return "router unreachable"
    if "disconnect" in e or "payload" in e or "reset" in e or "closed" in e:
        return "connection dropped"
    if "timeout" in e:
        return "timeout"
    if "internal server error" in e:
        return "engine error event after the stream's opening chunk"
    return err[:80]


def expected_by_design(kind: str, fault: str) -> bool:
    # A frozen engine's streams already under way are ended by the router once the pod fails its health checks.
    if fault in ("sigkill_decode", "sigstop_engine", "prefill_death", "kv_publisher"):
        return kind == "stream cut (engine died mid-stream)"
    if fault == "router_restart":
        return kind in ("router unreachable", "connection dropped")
    return False


def read_all(paths: list[Path]) -> tuple[int, list[str]]:
    """How many HDF5 files read (each with read_requests and read_timeseries), and what failed."""
    from llmd.metrics import read_requests
    from llmd.metrics.reader import read_timeseries

    ok, bad = 0, []
    for p in paths:
        t = time.monotonic()
        try:
            read_requests(p)
            read_timeseries(p)
            ok += 1
        except Exception as exc:
            bad.append(f"{p.name}: {type(exc).__name__}: {exc}")
        if time.monotonic() - t > 5:
            bad.append(f"{p.name}: took {time.monotonic() - t:.1f} s to read")
    return ok, bad


def engine_preemptions(paths: list[Path]) -> int:
    from llmd.metrics.reader import read_timeseries

    total = 0
    for p in paths:
        with contextlib.suppress(Exception):
            ts = read_timeseries(p)
            pre = ts["preemptions"]
            total += int(pre[pre > 0].sum())
    return total


def engine_counter(urls: list[str], name: str) -> float:
    total = 0.0
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name) and not line.startswith("#"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


# --- the run ---------------------------------------------------------------------------------------------------------
def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from llmd.models.tiny import make_tiny

    quick = args.quick
    agents = args.agents or (200 if quick else AGENTS)
    duration = args.duration or (10.0 if quick else DURATION_S)
    ramp = 8.0 if quick else RAMP_S
    faults = [] if args.skip_faults else list(QUICK_FAULTS if quick else FAULTS)
    prefill, decode = (0, 2) if quick else (PREFILL, DECODE)
    if not prefill:
        faults = [f for f in faults if f not in ("prefill_death", "kv_transfer_fail")]
    model = make_tiny(tmp / "tiny", weights=False)
    base = 10000 + (free_port() % 1500) * 10  # layout ports up to base + 3100 stay below the ephemeral range
    spec = tmp / "soak.yaml"
    spec.write_text(spec_text(model, prefill, decode, base, free_port(), agents, ramp, quick))
    out = tmp / "runs"
    run_dir = out / "soak"
    run_dir.mkdir(parents=True)
    logs = tmp / "logs"
    logs.mkdir()
    info("fleet", f"{prefill} prefill + {decode} decode simulated engines (one process each, Llama-3.1-8B on H100, "
         f"{KV_BLOCKS} KV blocks of {BLOCK} each), 1 router, P/D threshold {PD_THRESHOLD} uncached tokens")  # fmt: skip
    info("load", f"{agents} closed-loop agents with sub-agent bursts (groups of 4), ramp {ramp:g} s, "
         f"{duration:g} s without faults" + (f", then {len(faults)} faults" if faults else ""))  # fmt: skip
    info("time_scale", f"{TIME_SCALE:g} wall s per simulated s (engines and tool gaps); times below are wall seconds")
    fleet = Fleet(spec, run_dir, logs)
    mon = Monitor(fleet)
    res: dict[str, Any] = {"faults": []}
    bench: subprocess.Popen | None = None
    blog = open(logs / "bench.log", "wb")  # noqa: SIM115 (closed below)
    try:
        fleet.start()
        mon.start()
        time.sleep(2.0)  # KV event subscriptions
        clean_end = ramp + duration
        # The bench runs until the faults are done; its duration is a bound, the stop is a signal (SIGINT: clean).
        bound = clean_end + (len(faults) * (STOP_S + 60.0 + SERVE_AGAIN_S + SETTLE_S) + 60.0 if faults else 0.0)
        t_bench = mon.now()
        res["unix_bench"] = time.time()
        bench = subprocess.Popen(
            [sys.executable, "-m", "llmd.cli", "bench", "--spec", str(spec), "--url", fleet.url,
             "--duration", f"{bound:.0f}", "--output", str(out), "--run", "soak", "--no-progress",
             "--request-timeout", "300", "--max-error-rate", "100"],
            cwd=ROOT, stdout=blog, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _sleep_until(mon, t_bench + clean_end, bench)
        decode_urls = [fleet.endpoints[n].url for n in fleet.names("decode")]
        prefill_urls = [fleet.endpoints[n].url for n in fleet.names("prefill")]
        res["preemptions"] = int(engine_counter(decode_urls + prefill_urls, "vllm:num_preemptions_total"))
        res["t_bench"] = t_bench
        res["clean_end"] = mon.now()
        res["rss"] = list(mon.rss)
        for name in faults:
            what, fn = FAULTS[name]
            f = Fault(name, what)
            r0 = mon.retries_total()
            if bench.poll() is not None:
                f.notes.append("the load generator had exited")
                res["faults"].append(f)
                break
            fn(fleet, mon, f, quick)
            # Survival asks that the stack serve again after the pod is back: wait (bounded) until it has, then
            # settle. A frozen engine's agents come back from their cut turns one tool gap later, so a fixed
            # settle alone could end the window before any of them asked again.
            want = mon.answered_total() + SERVED_AGAIN
            f.served_again_s = mon.wait_for(lambda _s, n=want: mon.answered_total() >= n, SERVE_AGAIN_S)
            if f.served_again_s is None:
                f.notes.append(f"fewer than {SERVED_AGAIN} answers within {SERVE_AGAIN_S:g} s after it was back")
            else:
                f.notes.append(f"{SERVED_AGAIN} answers {f.served_again_s:.1f} s after it was back")
            time.sleep(SETTLE_S if not quick else 3.0)
            f.t1 = mon.now()
            r1 = mon.retries_total()
            f.retries = {k: v - r0.get(k, 0.0) for k, v in r1.items() if v - r0.get(k, 0.0) > 0}
            res["faults"].append(f)
            print(f"#   fault {name}: injected at {f.t0 - t_bench:.0f} s, left routing after {_s(f.left_s)}, "
                  f"back after {_s(f.back_s)}; retries {f.retries or 0}; {'; '.join(f.notes)}", flush=True)  # fmt: skip
        res["end"] = mon.now()
        if bench.poll() is None:
            bench.send_signal(signal.SIGINT)  # stop starting turns; in-flight ones are recorded as aborted
        try:
            bench.wait(120)
        except subprocess.TimeoutExpired:
            res["hang"] = "llmd bench did not stop within 120 s of SIGINT"
            bench.kill()
            bench.wait()
        res["bench_rc"] = bench.returncode
        res["rss_all"] = list(mon.rss)
    finally:
        try:
            if bench is not None and bench.poll() is None:
                bench.kill()
                bench.wait()
        finally:
            fleet.stop()
            mon.stop()
            blog.close()
    res["h5"] = [run_dir / "metrics.h5", *fleet.h5]
    res["engine_h5"] = [p for p in fleet.h5 if not p.name.startswith("router")]
    res["logs"] = logs
    res["mon"] = mon
    res["first_answer"] = mon.first_answer
    res["agents"] = agents
    res["duration"] = duration
    res["ramp"] = ramp
    return res


def _sleep_until(mon: Monitor, t: float, proc: subprocess.Popen) -> None:
    while mon.now() < t and proc.poll() is None:
        time.sleep(0.5)


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Prints the report lines; returns the figures (for the test)."""
    import numpy as np

    from llmd.metrics import read_requests
    from llmd.metrics.reader import read_meta
    from llmd.workload.run_stats import ABORTED

    out: dict[str, Any] = {}
    h5_ok, h5_bad = read_all(res["h5"])
    client = res["h5"][0]
    df = read_requests(client)
    t_bench = res["t_bench"]
    # Client times count from its load loop's start, seconds after its process started (and after the start_time
    # its file holds): put them on our clock by the first answer, which both saw (to within a poll).
    first_end = (df["send_time"] + df["e2e_s"])[df["status"] == 200].min()
    if res.get("first_answer") is not None and not math.isnan(first_end):
        df["send_time"] += res["first_answer"] - t_bench - first_end - res["mon"].every_s / 2
    else:
        df["send_time"] += float(read_meta(client)["start_time"]) - res["unix_bench"]
    clean_end = res["clean_end"] - t_bench
    err = df["error"].astype(str)
    failed = (err != "") & (err != ABORTED)
    ok = ~failed & (err == "") & (df["status"] == 200)
    end_t = df["send_time"] + df["e2e_s"].fillna(0.0)
    faults: list[Fault] = res["faults"]
    # The run without faults: requests that ended before the first fault (one streaming across it belongs to it).
    first_fault = min((f.t0 - t_bench for f in faults if not math.isnan(f.t0)), default=clean_end + 1.0)
    clean = (df["send_time"] < clean_end) & (end_t < first_fault - 1.0)
    steady = clean & (df["send_time"] >= res["ramp"])
    n_clean = int(clean.sum())
    clean_errors = int((failed & clean).sum())
    wall = clean_end
    rate = int((ok & steady).sum()) / max(res["duration"], 1)
    info("requests_no_fault_run", f"{n_clean} in {wall:.0f} s ({rate:.1f} "
         f"req/s wall after the ramp; {int((ok & clean & df['is_subagent']).sum())} by sub-agents)")  # fmt: skip
    sessions = df.loc[clean, "session"].astype(str)
    info("agents_seen", f"{sessions.str.split('-').str[0].nunique()} agents sent requests "
         f"({sessions.nunique()} sessions)")  # fmt: skip
    q = df.loc[ok & steady, "router_queue_s"].dropna()
    queue_p90 = float(q.quantile(0.9)) if len(q) else math.nan
    ttft = df.loc[ok & steady, "ttft_s"].dropna()
    info("router_queue_p90_s", f"{queue_p90:.3f} (wall; {queue_p90 / TIME_SCALE:.3f} simulated)")
    if len(ttft):
        info("ttft_p50_p90_s", f"{ttft.quantile(0.5):.2f} / {ttft.quantile(0.9):.2f} (wall)")
    if clean_errors:
        first = err[failed & clean].iloc[0]
        info("first_error", first[:200])
    report("client_errors", clean_errors, 0, False, "{:d}")
    report("preemptions", res["preemptions"], 0, False, "{:d}")
    rss = [(t - t_bench, mb) for t, pid, mb in res["rss"]]
    out.update(client_errors=clean_errors, preemptions=res["preemptions"], requests=n_clean, queue_p90=queue_p90)
    if rss:
        mbs = [mb for _, mb in rss]
        half = [mb for t, mb in rss if t >= rss[-1][0] / 2]
        growth = half[-1] - half[0] if half else 0.0
        info("router_rss_samples", f"{len(rss)} over {rss[-1][0]:.0f} s (every {res['mon'].rss_every_s:g} s): "
             f"start {mbs[0]:.0f} MB, mid {half[0]:.0f} MB, end {mbs[-1]:.0f} MB")  # fmt: skip
        info("router_rss_growth_last_half_mb", f"{growth:+.1f}")
        report("router_rss_mb_max", max(mbs), 1024, False, "{:.0f}")
        out.update(rss_max=max(mbs), rss_growth=growth)
    survived = 0
    for f in faults:
        t0, t1 = f.t0 - t_bench, (f.t1 if not math.isnan(f.t1) else res["end"]) - t_bench
        win = (end_t >= t0 - 1.0) & (end_t < t1 - 1.0)  # errors end after their fault (our clock: +-0.5 s)
        kinds: dict[str, int] = {}
        for e in err[failed & win]:
            k = classify(e)
            kinds[k] = kinds.get(k, 0) + 1
        f.error_kinds = kinds
        f.client_errors = sum(kinds.values())
        f.expected_errors = sum(n for k, n in kinds.items() if expected_by_design(k, f.name))
        back_t = t0 + (f.left_s or 0) + (f.back_s or 0)
        f.served_after = int((ok & (end_t >= back_t) & (end_t < t1)).sum())
        unexpected = f.client_errors - f.expected_errors
        ok_f = f.recovered and f.served_after > 0 and not res.get("hang")
        survived += ok_f
        print(f"# fault_{f.name}: {f.what}: pod {f.pod} left routing after {_s(f.left_s)}, back after "
              f"{_s(f.back_s)}; client errors {f.client_errors} ({f.expected_errors} expected by design"
              f"{', ' + str(unexpected) + ' NOT expected' if unexpected else ''}: {kinds or 'none'}); "
              f"retried {int(sum(f.retries.values()))} {f.retries or ''}; served after {f.served_after}; "
              f"{'survived' if ok_f else 'NOT survived'}", flush=True)  # fmt: skip
        out.setdefault("faults", {})[f.name] = {"survived": ok_f, "errors": f.client_errors,
                                                "unexpected": unexpected, "retries": f.retries}  # fmt: skip
    if faults:
        fault_rows = ~clean
        info("fault_run_requests", f"{int(fault_rows.sum())}, client errors {int((failed & fault_rows).sum())}")
        allpre = engine_preemptions(res["engine_h5"])
        info("preemptions_fault_run", max(0, allpre - res["preemptions"]))
        rss_all = [mb for _, _, mb in res.get("rss_all", [])]
        if rss_all:
            info("router_rss_mb_max_fault_run", f"{max(rss_all):.0f} (every router incarnation)")
        report("faults_survived", survived, len(faults), True, "{:d}")
    info("hdf5_files_read", f"{h5_ok} of {len(res['h5'])} (client, router and engine incarnations)")
    for b in h5_bad:
        info("hdf5_unreadable", b)
    if res.get("hang"):
        info("hang", res["hang"])
    out.update(h5_ok=h5_ok, h5_total=len(res["h5"]), h5_bad=h5_bad, survived=survived, n_faults=len(faults),
               hang=res.get("hang"), bench_rc=res.get("bench_rc"))  # fmt: skip
    del np
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="200 agents, 10 s, two decode engines, two faults")
    p.add_argument("--agents", type=int, help=f"closed-loop agents (default {AGENTS}; quick 200)")
    p.add_argument(
        "--duration", type=float, help=f"wall seconds without faults after the ramp (default {DURATION_S:g})"
    )
    p.add_argument("--skip-faults", action="store_true", help="only the run without faults")
    p.add_argument("--keep", metavar="DIR", help="keep specs, logs and HDF5 files in DIR")
    a = p.parse_args(argv)
    if a.keep:
        Path(a.keep).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(prefix="llmd-soak-") as td:
        tmp = Path(td)
        res = soak(a, tmp)
        try:
            return summarize(res)
        except Exception:
            for log in sorted(res["logs"].glob("*.log")):
                print(f"#   {log.name}: {log.read_text(errors='replace')[-800:]!r}", flush=True)
            raise


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
