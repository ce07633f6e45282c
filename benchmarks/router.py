"""Router benchmark: routing cost of a long agent turn, HTTP throughput, and prefix-cache hit rates by policy.

Prints `name: value  # target ... (ratio R)` lines, R >= 1 meaning the target is met, and `# ...` context lines.
- route_ms_p50: router CPU time (thread CPU clock) to route a ~195K-token completion turn that extends its session
  by ~632 tokens: incremental tokenization and block hashing (llmd.tokens.PromptCache), then Scheduler.schedule over
  64 endpoints against a KV index holding the session's blocks plus 1M other blocks. Median over 30 turns.
- route_speedup_vs_full: the same turn tokenized, hashed and scored from scratch / incrementally.
- router_req_per_s: non-streaming completions with short text prompts through `llmd router` (pinned to core 0) in
  front of 4 simulated engines at time scale 0 (pinned with the client to core 1).
- hit_rate_*: one fixed agentic workload (32 sessions of 10 turns over a shared system prompt, 4 of them forking a
  burst of 6 sub-agents) through the router over 8 simulated engines whose KV caches cannot hold every session
  everywhere; the share of prompt tokens the engines served from cache (their own usage.cached_tokens). The oracle is
  the share an unbounded cache that had seen every earlier prompt would serve. Target: precise >= 0.9 x oracle and
  precise > approximate.
`python benchmarks/router.py` (~3 minutes); `--quick`: the hit rates only.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

from llmd.engines.vllm_server import wait_healthy  # noqa: E402
from llmd.kv.hashing import BlockHasher, event_hash  # noqa: E402
from llmd.kv.index import KVIndex  # noqa: E402
from llmd.models.tiny import make_tiny  # noqa: E402
from llmd.router.scheduling import Endpoint, EndpointState, RouteRequest, Scheduler, Snapshot  # noqa: E402
from llmd.spec import RouterSpec  # noqa: E402
from llmd.tokens import PromptCache, Tokenizer  # noqa: E402

WORDS = [
    *[
        "def",
        "class",
        "return",
        "import",
        "self",
        "value",
        "result",
        "error",
        "test",
        "file",
        "path",
        "line",
        "module",
        "function",
        "router",
        "cache",
    ],
    *[
        "block",
        "prefix",
        "engine",
        "token",
        "session",
        "agent",
        "tool",
        "call",
        "patch",
        "diff",
        "review",
        "build",
        "the",
        "a",
        "of",
        "to",
        "in",
        "is",
        "for",
    ],
    *["with", "on", "that", "this"],
]
BLOCK = 64
HIT_BLOCK = 16
GPU_BLOCKS = int(os.environ.get("LLMD_BENCH_GPU_BLOCKS", "2400"))
POLICIES = ("precise", "approximate", "round-robin")


def words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        out.append(rng.choice(WORDS))
        if i % 12 == 11:
            out.append("\n")
    return " ".join(out) + "\n"


def text_of_tokens(tok: Tokenizer, rng: random.Random, n_tokens: int) -> str:
    """Text of about n_tokens tokens under `tok` (measured, then trimmed by whole lines)."""
    text = ""
    while len(tok.encode(text, add_special_tokens=False)) < n_tokens:
        text += words(rng, max(64, (n_tokens - len(tok.encode(text, add_special_tokens=False))) // 2))
    return text


# --- 1. routing cost ------------------------------------------------------------------------------------------------
def route_cost(model: Path) -> None:
    tok = Tokenizer(model)
    hasher = BlockHasher(BLOCK)
    rng = random.Random(0)
    base = text_of_tokens(tok, rng, 195_000)
    growths = [text_of_tokens(tok, rng, 632) for _ in range(31)]
    endpoints = [Endpoint(pod=f"pod-{i}", role="decode", url=f"http://127.0.0.1:{9000 + i}") for i in range(64)]
    index = KVIndex()
    for ep in endpoints:  # 1M unrelated blocks spread over the fleet
        hashes = [rng.getrandbits(64) for _ in range(1_000_000 // len(endpoints))]
        for j in range(0, len(hashes), 3000):
            index.store(ep.holder, hashes[j : j + 3000], "GPU", None)
    snap = Snapshot.of((ep, EndpointState(waiting=i % 5, running=8, kv_usage=0.5)) for i, ep in enumerate(endpoints))
    sched = Scheduler(RouterSpec(), seed=0)

    def route(cache: PromptCache, text: str, i: int) -> tuple[float, object]:
        t0 = time.thread_time()
        enc = cache.encode(text)
        req = RouteRequest(f"r{i}", enc.block_hashes, enc.num_tokens, BLOCK, session_id="s")
        decision = sched.schedule(req, snap, index, now=float(i))
        return time.thread_time() - t0, (enc, decision)

    cache = PromptCache(tok, hasher)
    text = base
    _, (enc, _) = route(cache, text, 0)
    index.store(endpoints[7].holder, enc.block_hashes, "GPU", None)  # the session's holder
    incremental, modes = [], []
    for i, g in enumerate(growths[:30], start=1):
        text += g
        dt, (enc, decision) = route(cache, text, i)
        incremental.append(dt)
        modes.append(enc.mode)
        assert decision.target == endpoints[7], decision.target
    full = []
    for i in range(3):
        dt, (enc_full, _) = route(PromptCache(tok, hasher), text, 100 + i)  # a cold cache: everything from scratch
        full.append(dt)
    assert enc_full.block_hashes == enc.block_hashes  # incremental must equal full
    inc_ms = statistics.median(incremental) * 1e3
    print(f"# route turn: {enc.num_tokens:,} tokens, modes {set(modes)}, full {statistics.median(full) * 1e3:.1f} ms")
    report("route_ms_p50", inc_ms, 2.0, False, "{:.3f}")
    report("route_speedup_vs_full", statistics.median(full) / statistics.median(incremental), 50, True, "{:.1f}")


# --- processes -------------------------------------------------------------------------------------------------------
def free_base() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        # Below the ephemeral range (32768+), where client connections could take a layout port.
        return 10000 + (s.getsockname()[1] % 1500) * 10


def pinned(cmd: list[str], cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if hasattr(os, "sched_setaffinity") else cmd


class Stack:
    """`llmd engine sim --all` and `llmd router` for one spec, as separate pinned processes."""

    def __init__(self, spec: Path, policy: str, router_port: int, engine_urls: list[str]) -> None:
        llmd = [sys.executable, "-m", "llmd.cli"]
        self.engines = subprocess.Popen(
            pinned([*llmd, "engine", "sim", "--all", "--spec", str(spec), "--log-level", "WARNING"], 1),
            stdout=subprocess.DEVNULL, cwd=ROOT,
        )  # fmt: skip
        self.router = None
        try:
            for u in engine_urls:
                wait_healthy(u + "/health", self.engines, 60, name="llmd engine sim --all")
            self.router = subprocess.Popen(
                pinned([*llmd, "router", "--spec", str(spec), "--policy", policy, "--port", str(router_port),
                        "--log-level", "WARNING"], 0),
                stdout=subprocess.DEVNULL, cwd=ROOT,
            )  # fmt: skip
            self.url = f"http://127.0.0.1:{router_port}"
            wait_healthy(self.url + "/health", [self.engines, self.router], 60, name="llmd router")
            time.sleep(1.5)  # the router's first health round and event subscriptions
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in (self.router, self.engines):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def write_spec(path: Path, model: Path, base: int, replicas: int, block: int, gpu_blocks: int | None) -> list[str]:
    kv = f"kv:\n  gpu_blocks: {gpu_blocks}\n  cpu_bytes: 0\n" if gpu_blocks else ""
    path.write_text(
        f"model:\n  path: {model}\n  served_name: tiny\n  block_size: {block}\n"
        f"  max_model_len: {8192 if gpu_blocks else 32768}\n"
        f"prefill:\n  nodes: 0\n"
        f"decode:\n  nodes: {replicas}\n  replicas: {replicas}\n  port: {base}\n"
        f"router:\n  max_inflight_per_pod: 64\n{kv}engine:\n  time_scale: 0\n"
    )
    return [f"http://127.0.0.1:{base + r}" for r in range(replicas)]


# --- 2. throughput ---------------------------------------------------------------------------------------------------
async def drive(url: str, n: int, concurrency: int) -> float:
    rng = random.Random(1)
    system = words(random.Random(2), 40)
    prompts = [system + words(rng, 20) for _ in range(256)]
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def one(i: int) -> None:
            body = {"model": "tiny", "prompt": prompts[i % len(prompts)], "max_tokens": 4, "ignore_eos": True}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}: {await resp.text()}")

        for i in range(300):
            await one(i)
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> None:
            async with sem:
                await one(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


def throughput(model: Path, tmp: Path) -> None:
    base = free_base()
    spec = tmp / "rps.yaml"
    urls = write_spec(spec, model, base, 4, 16, None)
    stack = Stack(spec, "precise", base - 100, urls)
    try:
        rps = asyncio.run(drive(stack.url, 5000, 64))
    finally:
        stack.stop()
    report("router_req_per_s", rps, 1000, True, "{:.0f}")


# --- 3. hit rates ----------------------------------------------------------------------------------------------------
def workload(seed: int) -> list[list[tuple[str, str]]]:
    """Per closed-loop client, its (session, prompt-growth) steps; sub-agents are clients of their own."""
    rng = random.Random(seed)
    system = words(random.Random(seed + 1), 300)
    clients: list[list[tuple[str, str]]] = []
    for s in range(32):
        context = system + words(rng, 400)
        steps = []
        for _ in range(10):
            context += words(rng, 60)
            steps.append((f"s{s}", context))
        clients.append(steps)
        if s % 8 == 0:  # a burst of sub-agents forking this session's context after turn 5
            fork = steps[4][1]
            for k in range(6):
                sub = fork + words(rng, 30)
                clients.append([(f"s{s}-sub{k}", sub + words(rng, 40 * (t + 1))) for t in range(3)])
    return clients


async def run_workload(url: str, clients: list[list[tuple[str, str]]], salt: str) -> tuple[int, int, list[str]]:
    prompt_tokens = cached = 0
    order: list[str] = []
    async with aiohttp.ClientSession() as http:

        async def client(steps: list[tuple[str, str]], delay: float) -> None:
            nonlocal prompt_tokens, cached
            await asyncio.sleep(delay)
            for session, prompt in steps:
                body = {"model": "tiny", "prompt": salt + prompt, "max_tokens": 8, "ignore_eos": True}
                order.append(salt + prompt)
                async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}: {data}")
                usage = data["usage"]
                prompt_tokens += usage["prompt_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                await asyncio.sleep(0.02)

        # Sub-agents start together when their parent reaches its fork point, roughly.
        await asyncio.gather(*(client(c, 0.0 if "sub" not in c[0][0] else 0.3) for c in clients))
    return prompt_tokens, cached, order


def oracle(tok: Tokenizer, prompts: list[str]) -> float:
    hasher = BlockHasher(HIT_BLOCK)
    seen: set[int] = set()
    total = hit = 0
    for p in prompts:
        ids = tok.encode(p)
        hashes = [event_hash(h) for h in hasher.hash_tokens(ids)]
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hit += min(n * HIT_BLOCK, (len(ids) - 1) // HIT_BLOCK * HIT_BLOCK)
        total += len(ids)
        seen.update(hashes)
    return hit / total


def hit_rates(model: Path, tmp: Path) -> None:
    clients = workload(7)
    rates: dict[str, float] = {}
    orders = {}
    for policy in POLICIES:
        base = free_base()
        spec = tmp / f"hit-{policy}.yaml"
        # ~1,400 blocks of 16 tokens per engine: sticky routing keeps each engine's sessions; spraying cannot.
        urls = write_spec(spec, model, base, 8, HIT_BLOCK, GPU_BLOCKS)
        stack = Stack(spec, policy, base - 100, urls)
        try:
            prompt_tokens, cached, order = asyncio.run(run_workload(stack.url, clients, f"[{policy}] "))
        finally:
            stack.stop()
        rates[policy] = cached / prompt_tokens
        orders[policy] = order
        print(f"# {policy}: {prompt_tokens:,} prompt tokens, {cached:,} cached", flush=True)
    orc = oracle(Tokenizer(model), orders["precise"])
    for policy in POLICIES:
        print(f"hit_rate_{policy.replace('-', '_')}: {rates[policy]:.3f}", flush=True)
    print(f"hit_rate_oracle: {orc:.3f}", flush=True)
    report("precise_vs_oracle", rates["precise"] / orc, 0.9, True, "{:.3f}")
    report("precise_vs_approximate", rates["precise"] / max(rates["approximate"], 1e-9), 1.0, True, "{:.3f}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="hit rates by policy only (~1 minute)")
    args = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory(prefix="llmd-router-bench-") as d:
        tmp = Path(d)
        model = make_tiny(tmp / "tiny", weights=False)
        if not args.quick:
            route_cost(model)
            throughput(model, tmp)
        hit_rates(model, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
