"""Simulated engine benchmark: HTTP throughput on one core, and TTFT fidelity to the latency model. One run.

Prints `name: value  # target ... (ratio R)`, R >= 1 meaning the target is met.
- req_per_s: non-streaming /v1/completions with 16-token prompts and 4-token outputs, 64 in flight, against one
  simulated engine process pinned to core 0 at time scale 0 (steps cost no simulated time, so the figure is the
  server's own overhead: HTTP, tokenization, scheduling, KV bookkeeping, events). The client runs pinned to core 1.
- ttft_model_error_pct: the engine times itself with the latency model of llama-3.1-8b on an H100 at time scale 1;
  fresh (uncached) prompts of 2K-32K tokens are sent one at a time with streaming, and the TTFT the client measures is
  compared with the latency model's prefill time for that prompt (chunked at max_num_batched_tokens). Mean absolute
  percentage error over the sizes.
`python benchmarks/sim_engine.py` (~1 minute).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import free_port, report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

from llmd.engines.vllm_server import wait_healthy  # noqa: E402
from llmd.models.tiny import make_tiny  # noqa: E402
from llmd.perf import LatencyModel, Parallelism, get_gpu, get_model  # noqa: E402

TTFT_SIZES = (2048, 4096, 8192, 16384, 32768)
CHUNK = 8192


def start_engine(spec: Path, port: int, extra: list[str], cpu: int | None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "llmd.cli",
        "engine",
        "sim",
        "--spec",
        str(spec),
        "--port",
        str(port),
        "--no-side-channel",
        "--log-level",
        "WARNING",
        *extra,
    ]
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 60, name="llmd engine sim")
    except BaseException:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


async def throughput(url: str, n: int, concurrency: int) -> float:
    body = {"model": "tiny", "prompt": list(range(100, 116)), "max_tokens": 4, "ignore_eos": True}
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def one() -> None:
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")

        for _ in range(200):  # warm-up
            await one()
        sem = asyncio.Semaphore(concurrency)

        async def bounded() -> None:
            async with sem:
                await one()

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded() for _ in range(n)))
        return n / (time.perf_counter() - t0)


async def ttft(url: str, tokens: list[int]) -> float:
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        t0 = time.perf_counter()
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: ") and b'"text"' in line:
                    return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def main() -> int:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory(prefix="llmd-bench-") as tmp:
        model = make_tiny(Path(tmp) / "tiny", weights=False)
        spec = Path(tmp) / "spec.yaml"
        spec.write_text(
            "model:\n  path: llama-3.1-8b\n  served_name: tiny\n"
            f"  tokenizer: {model}\n  max_model_len: 40000\n"
            "prefill:\n  nodes: 0\n"
            f"decode:\n  max_num_batched_tokens: {CHUNK}\n"
            "kv:\n  gpu_blocks: 20000\n"
            "engine:\n  gpu: H100-80GB\n"
        )
        port = free_port()
        proc = start_engine(spec, port, ["--time-scale", "0"], cpu=0)
        try:
            rps = asyncio.run(throughput(f"http://127.0.0.1:{port}", n=6000, concurrency=64))
        finally:
            stop(proc)
        report("req_per_s", rps, 1000, True)

        port = free_port()
        proc = start_engine(spec, port, ["--time-scale", "1"], cpu=0)
        lat = LatencyModel(get_gpu("H100-80GB"), get_model("llama-3.1-8b"), Parallelism(), max_num_batched_tokens=CHUNK)
        rng = random.Random(0)
        errors = []
        try:
            for n in TTFT_SIZES:
                measured = []
                for _ in range(3):
                    tokens = [rng.randrange(10, 1000) for _ in range(n)]  # fresh: no prefix hit
                    measured.append(asyncio.run(ttft(f"http://127.0.0.1:{port}", tokens)))
                m = statistics.median(measured)
                predicted = lat.prefill_time(n, 0, chunk=CHUNK)
                errors.append(abs(m - predicted) / predicted * 100)
                print(f"# ttft {n} tokens: measured {m * 1e3:.1f} ms, model {predicted * 1e3:.1f} ms", flush=True)
        finally:
            stop(proc)
        report("ttft_model_error_pct", statistics.mean(errors), 5, False, "{:.2f}")
    print(json.dumps({"note": "req_per_s: server on core 0, client on core 1"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
