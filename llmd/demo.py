"""`llmd demo`: the smallest end-to-end run of what exists, on one machine, in well under two minutes.

Simulated vLLM engines (the embedded default deployment's engine settings) publish their KV events over ZMQ on
127.0.0.1; llmd's codec decodes them into the KV index; multi-turn agent sessions are sent to the engines, each turn
to the engine the index says holds the longest prefix of its blocks (precise), then the same sessions again round-robin.
The engines' own `cached_tokens` show what precise routing buys, and how exactly the index predicted it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from llmd.errors import UserError
from llmd.kv.events import KVEventDecoder
from llmd.kv.hashing import BlockHasher, event_hash
from llmd.kv.index import KVIndex

WORDS = [
    "agent",
    "repository",
    "function",
    "test",
    "failing",
    "router",
    "cache",
    "block",
    "prefix",
    "engine",
    "decode",
    "prefill",
    "token",
    "session",
    "context",
    "tool",
    "call",
    "result",
    "patch",
    "diff",
    "review",
    "module",
    "import",
    "error",
    "trace",
    "line",
    "file",
    "build",
    "lint",
    "format",
    "commit",
]


@dataclass
class TurnRecord:
    policy: str
    session: int
    turn: int
    pod: int
    prompt_tokens: int
    cached_tokens: int
    predicted_hit_tokens: int
    ttft_s: float
    e2e_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n"


async def _follow_events(endpoints: list[str], index: KVIndex, decoder: KVEventDecoder, stop: asyncio.Event) -> None:
    ctx = zmq.asyncio.Context.instance()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        socks.append(s)
    poller = zmq.asyncio.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    try:
        while not stop.is_set():
            for sock, _ in await poller.poll(timeout=100):
                frames = await sock.recv_multipart()
                decoded = decoder.decode_frames(frames)
                if decoded is not None:
                    index.ingest(str(socks.index(sock)), decoded.seq, decoded.batch)
    finally:
        for s in socks:
            s.close()


async def _session(
    sid: int,
    policy: str,
    args: argparse.Namespace,
    urls: list[str],
    tokenizer,
    hasher: BlockHasher,
    index: KVIndex,
    records: list[TurnRecord],
    http: aiohttp.ClientSession,
    salt: str,
) -> None:
    rng = random.Random(args.seed * 1000 + sid)
    system = random.Random(args.seed).choice(WORDS)  # every session shares the system prompt
    context = f"{salt} system: {system} " + _text(random.Random(args.seed), args.system_words)
    context += _text(rng, args.first_turn_words)
    for turn in range(args.turns):
        ids = tokenizer.encode(context, add_special_tokens=False).ids
        hashes = [event_hash(h) for h in hasher.hash_tokens(ids)]
        if policy == "precise":
            matches = index.query(hashes)
            best = max(matches, key=lambda m: (m.blocks_gpu, -int(m.holder[0])), default=None)
            pod = int(best.holder[0]) if best and best.blocks_gpu else (sid + turn) % len(urls)
            predicted = best.blocks_gpu * hasher.block_size if best and int(best.holder[0]) == pod else 0
        else:
            pod, predicted = (sid + turn) % len(urls), 0
        # vLLM never serves the whole prompt from cache: the last token is always recomputed.
        predicted = min(predicted, (len(ids) - 1) // hasher.block_size * hasher.block_size)
        body = {
            "model": args.served_name,
            "prompt": ids,
            "max_tokens": args.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        ttft, usage = None, {}
        async with http.post(f"{urls[pod]}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"engine {pod} answered {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        records.append(
            TurnRecord(
                policy,
                sid,
                turn,
                pod,
                usage.get("prompt_tokens", len(ids)),
                cached,
                predicted,
                ttft or 0.0,
                time.perf_counter() - t0,
            )
        )
        context += _text(rng, args.output_tokens) + _text(rng, args.growth_words)
        await asyncio.sleep(rng.uniform(0, args.think_s))


async def _run(args: argparse.Namespace) -> list[TurnRecord]:
    from tokenizers import Tokenizer

    from llmd.engines.sim.server import SimEngineGroup, SimServerConfig
    from llmd.spec import DeploymentSpec, load_spec

    spec = load_spec(args.spec) if args.spec else DeploymentSpec()
    model_dir = Path(spec.model.tokenizer or spec.model.path)
    if not (model_dir / "tokenizer.json").exists():
        if args.spec:
            raise UserError(f"{model_dir} has no tokenizer.json; make one with `llmd model make-tiny {model_dir}`")
        from llmd.models.tiny import make_tiny

        print(f"making the tiny model's tokenizer in {model_dir} (first run only)")
        make_tiny(model_dir, weights=False)
    args.served_name = spec.model.served_name
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    hasher = BlockHasher(spec.model.block_size, spec.model.hash_algo, spec.model.hash_seed)
    event_ports = [_free_port() for _ in range(args.engines)]
    configs = [
        SimServerConfig.from_spec(
            spec,
            "both",
            port=0,
            model_dir=str(model_dir),
            dp_size=1,
            kv_events_endpoint=f"tcp://*:{p}",
            side_channel_port=None,
            name=f"engine-{i}",
            time_scale=args.time_scale,
        )
        for i, p in enumerate(event_ports)
    ]
    records: list[TurnRecord] = []
    async with SimEngineGroup(configs) as group, aiohttp.ClientSession() as http:
        for policy in ("precise", "round-robin"):
            index, decoder, stop = KVIndex(), KVEventDecoder(), asyncio.Event()
            follower = asyncio.create_task(
                _follow_events([f"tcp://127.0.0.1:{p}" for p in event_ports], index, decoder, stop)
            )
            await asyncio.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publishers
            salt = f"run-{policy}-{random.Random(args.seed).random()}"  # fresh prefixes: no run profits from another
            await asyncio.gather(
                *(
                    _session(s, policy, args, group.urls, tokenizer, hasher, index, records, http, salt)
                    for s in range(args.sessions)
                )
            )
            stop.set()
            await follower
            if decoder.garbage_frames:
                print(f"warning: {decoder.garbage_frames} undecodable KV event frames")
    return records


def _summary(records: list[TurnRecord]) -> list[dict]:
    rows = []
    for policy in ("precise", "round-robin"):
        rs = [r for r in records if r.policy == policy]
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_tokens for r in rs)
        ttfts = sorted(r.ttft_s for r in rs)
        exact = sum(r.predicted_hit_tokens == r.cached_tokens for r in rs)
        rows.append(
            {
                "policy": policy,
                "requests": len(rs),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "cache_hit_share": cached / prompt if prompt else 0.0,
                "ttft_p50_ms": 1e3 * statistics.median(ttfts),
                "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
                "index_exact_share": exact / len(rs) if policy == "precise" else None,
            }
        )
    return rows


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    records = asyncio.run(_run(args))
    rows = _summary(records)
    out = Path(args.output) / time.strftime("demo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.json").write_text(json.dumps([asdict(r) for r in records], indent=1))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"llmd demo: {args.sessions} agent sessions x {args.turns} turns over {args.engines} simulated engines"
    )
    for col in (
        "policy",
        "requests",
        "prompt tokens",
        "cached tokens",
        "cache-hit share",
        "TTFT p50",
        "TTFT p90",
        "index predicted hits exactly",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        exact = "-" if r["index_exact_share"] is None else f"{r['index_exact_share']:.0%}"
        table.add_row(
            r["policy"],
            str(r["requests"]),
            f"{r['prompt_tokens']:,}",
            f"{r['cached_tokens']:,}",
            f"{r['cache_hit_share']:.1%}",
            f"{r['ttft_p50_ms']:.1f} ms",
            f"{r['ttft_p90_ms']:.1f} ms",
            exact,
        )
    Console(width=None if sys.stdout.isatty() else 150).print(table)
    print(f"wrote {out}/requests.json and summary.json in {time.perf_counter() - t0:.1f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on one machine with simulated engines")
    p.add_argument("--spec", type=Path, help="deployment spec (default: the embedded tiny local deployment)")
    p.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--sessions", type=int, default=16, help="concurrent agent sessions (default 16)")
    p.add_argument("--turns", type=int, default=8, help="turns per session (default 8)")
    p.add_argument("--system-words", type=int, default=400, help="shared system prompt length in words")
    p.add_argument("--first-turn-words", type=int, default=300)
    p.add_argument("--growth-words", type=int, default=60, help="context growth per turn in words")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=0.2, help="max pause between turns (tool time)")
    p.add_argument("--time-scale", type=float, default=1.0, help="engine time scale (1 = real time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results", help="results folder (default results/)")
    p.set_defaults(func=_checked)


def _checked(args: argparse.Namespace) -> int:
    for name in ("engines", "sessions", "turns"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    return run_demo(args)
