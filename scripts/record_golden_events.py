"""Record golden KV events from a real vLLM CPU server, for every prefix-caching hash algorithm.

For each configuration (hash algorithm x PYTHONHASHSEED x int/bytes hashes) this starts vLLM's CPU build on the tiny
random-weight model, sends a fixed set of prompts (plain text, a prompt that extends another, raw token ids, a
cache_salt, a chat request, a long generation whose output fills blocks), then fetches every published batch through
the publisher's replay socket and writes the raw frames and the requests' token ids to a JSON fixture.
tests/test_golden_events.py checks llmd's hasher and codec against it bit for bit.

Usage: python scripts/record_golden_events.py --out tests/fixtures/golden_kv_events.json   (~4 minutes)
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import zmq

from llmd.engines.vllm_server import vllm_server
from llmd.models.tiny import make_tiny

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
CONFIGS = [
    {"name": "sha256", "algo": "sha256", "seed": None, "int_hashes": True},
    {"name": "sha256-seed", "algo": "sha256", "seed": "42", "int_hashes": True},
    {"name": "sha256-bytes", "algo": "sha256", "seed": None, "int_hashes": False},
    {"name": "sha256_cbor", "algo": "sha256_cbor", "seed": None, "int_hashes": True},
    {"name": "sha256_cbor-seed", "algo": "sha256_cbor", "seed": "7", "int_hashes": True},
    {"name": "xxhash-seed", "algo": "xxhash", "seed": "42", "int_hashes": True},
    {"name": "xxhash_cbor-seed", "algo": "xxhash_cbor", "seed": "42", "int_hashes": True},
    # A KV cache of 12 blocks forces LRU eviction, so BlockRemoved events are recorded too.
    {
        "name": "sha256-evict",
        "algo": "sha256",
        "seed": None,
        "int_hashes": True,
        "extra_args": ["--num-gpu-blocks-override", "12", "--max-model-len", "320"],
    },
]
BASE_TEXT = (
    "You are a coding agent. The repository holds a router, a simulated engine and a KV index. "
    "Read the failing test, find the cause, and propose the smallest change that fixes it. "
)
REQUESTS = [
    {"kind": "text", "prompt": BASE_TEXT * 2, "max_tokens": 2},
    {
        "kind": "text-extends",
        "prompt": BASE_TEXT * 2 + "Now also explain why the fix is safe under load.",
        "max_tokens": 2,
    },
    {"kind": "token-ids", "prompt": list(range(10, 10 + 5 * BLOCK_SIZE + 7)), "max_tokens": 2},
    {"kind": "salted", "prompt": BASE_TEXT * 2, "max_tokens": 2, "cache_salt": "tenant-a"},
    {"kind": "long-output", "prompt": BASE_TEXT, "max_tokens": 3 * BLOCK_SIZE, "ignore_eos": True},
    {
        "kind": "chat",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": BASE_TEXT * 2}],
        "max_tokens": 2,
    },
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def replay_all(endpoint: str, timeout_s: float = 10.0) -> list[list[str]]:
    """Every buffered batch from seq 0 on, through the publisher's ROUTER replay socket."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    frames: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            msg = sock.recv_multipart()
            parts = msg[1:] if msg and msg[0] == b"" else msg  # DEALER may keep the empty delimiter
            if len(parts) == 3 and parts[1] == (-1).to_bytes(8, "big", signed=True):
                return frames
            frames.append([p.hex() for p in parts])
        raise TimeoutError(f"replay from {endpoint} did not finish in {timeout_s} s")
    finally:
        sock.close()


def record_config(cfg: dict, model: Path, workdir: Path) -> dict:
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv",
        "buffer_steps": 100000,
    }
    args = [
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        cfg["algo"],
        "--kv-events-config",
        json.dumps(events_cfg),
        "--served-model-name",
        "tiny",
        *cfg.get("extra_args", []),
    ]
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if cfg["int_hashes"] else "0"}
    if cfg["seed"] is not None:
        env["PYTHONHASHSEED"] = cfg["seed"]
    base = f"http://127.0.0.1:{port}"
    records = []
    with vllm_server(str(model), port, args, env=env, log=workdir / f"vllm-{cfg['name']}.log"):
        for r in REQUESTS:
            body = {
                "model": "tiny",
                "max_tokens": r["max_tokens"],
                "temperature": 0,
                "return_token_ids": True,
                "ignore_eos": r.get("ignore_eos", False),
            }
            if r.get("cache_salt"):
                body["cache_salt"] = r["cache_salt"]
            if "messages" in r:
                resp = post(f"{base}/v1/chat/completions", {**body, "messages": r["messages"]})
            else:
                resp = post(f"{base}/v1/completions", {**body, "prompt": r["prompt"]})
            prompt_ids = resp.get("prompt_token_ids") or resp["choices"][0].get("prompt_token_ids")
            out_ids = resp["choices"][0].get("token_ids")
            if prompt_ids is None or out_ids is None:
                raise RuntimeError(f"vLLM did not return token ids for {r['kind']}: {resp}")
            records.append(
                {
                    "kind": r["kind"],
                    "cache_salt": r.get("cache_salt"),
                    "prompt_token_ids": prompt_ids,
                    "output_token_ids": out_ids,
                }
            )
        time.sleep(1.0)  # let the publisher thread drain its queue
        frames = replay_all(f"tcp://127.0.0.1:{replay_port}")
    if not frames:
        raise RuntimeError(f"{cfg['name']}: the server published no KV events")
    print(f"{cfg['name']}: {len(records)} requests, {len(frames)} event batches", file=sys.stderr)
    return {**cfg, "requests": records, "frames": frames}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="record only these configuration names")
    args = ap.parse_args()
    import vllm

    with tempfile.TemporaryDirectory(prefix="llmd-golden-") as tmp:
        workdir = Path(tmp)
        model = make_tiny(workdir / "tiny")
        configs = [c for c in CONFIGS if not args.only or c["name"] in args.only]
        recorded = [record_config(c, model, workdir) for c in configs]
    if args.only and args.out.exists():
        # Re-record some configurations and keep the others as they were.
        old = json.loads(args.out.read_text())["configs"]
        fresh = {c["name"] for c in recorded}
        recorded = [c for c in old if c["name"] not in fresh] + recorded
        recorded.sort(key=lambda c: [x["name"] for x in CONFIGS].index(c["name"]))
    fixture = {"vllm_version": vllm.__version__, "block_size": BLOCK_SIZE, "configs": recorded}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
