"""Load generator benchmark: how many closed-loop agent sessions one client core sustains. One run, ~2 minutes.

Prints `name: value  # target ... (ratio R)`, R >= 1 meaning the target is met.
- concurrent_sessions: the llmd.workload.loadgen client runs pinned to core 0 and one simulated engine process
  (time scale 0: no simulated GPU time) to the other cores. Agent sessions have tiny contexts (~64-token system
  prompt, ~200-token task, +30 tokens a turn), 4-token outputs and a fixed 2 s tool gap between turns; the
  concurrency ramps up and each level runs LEVEL_S seconds. Client-side delay is how late each turn is sent relative
  to its planned time (previous response + gap), as a share of the planned gaps; the figure is the highest level
  whose delay stays under 5%. With few cores the engine shares the machine, so at high levels its own latency
  lowers the request rate (reported per level as req/s).
- h5_rows_per_s: the HDF5 writer's rate from benchmarks/metrics_h5.py (dict rows, lzf), measured again briefly.
`python benchmarks/client.py` (add --quick for a short run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import free_port, report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

from llmd.engines.vllm_server import wait_healthy  # noqa: E402
from llmd.models.tiny import make_tiny  # noqa: E402
from llmd.spec.model import WorkloadSpec  # noqa: E402
from llmd.tokens import Tokenizer  # noqa: E402
from llmd.workload import profile_from_spec  # noqa: E402
from llmd.workload.loadgen import LoadConfig, run_load  # noqa: E402

TARGET_SESSIONS = 3000
MAX_DELAY_SHARE = 0.05
GAP_S = 2.0
LEVEL_S = 12.0
LEVELS = (250, 500, 1000, 2000, 3000, 4000, 6000, 8000)


def start_engine(model_dir: Path, port: int, cores: set[int]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "llmd.cli",
        "engine",
        "sim",
        "--model",
        str(model_dir),
        "--served-name",
        "tiny",
        "--port",
        str(port),
        "--time-scale",
        "0",
        "--no-side-channel",
        "--num-gpu-blocks",
        "200000",
        "--max-num-seqs",
        "4096",
        "--max-num-batched-tokens",
        "1000000",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=lambda: os.sched_setaffinity(0, cores), stdout=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 60, name="llmd engine sim")
    except BaseException:
        proc.kill()
        raise
    return proc


def level(url: str, model_dir: Path, tok: Tokenizer, out: Path, agents: int, seconds: float) -> tuple[float, float]:
    params = {
        "agents": agents,
        "sessions_per_agent": 1,
        "turns": 20,  # plan_session costs ~4 us a turn, on the loop: keep plans short
        "gap_s": GAP_S,
        "output": 4,
        "initial": 200,
        "growth": 30,
        "system_tokens": 64,
        "max_context": 3000,
        "stagger_s": GAP_S,
    }
    workload = profile_from_spec(WorkloadSpec(profile="smoke", params=params), f"bench-{agents}")
    cfg = LoadConfig(url, "tiny", str(model_dir), workload, out, duration_s=seconds, progress=False, tokenizer=tok)
    s = asyncio.run(run_load(cfg))
    if s.errors:
        print(f"#   {s.errors} errors at {agents} sessions", file=sys.stderr)
    return s.client_delay_share, s.requests_per_s


def h5_rate(tmp: Path) -> float:
    import metrics_h5

    batches = metrics_h5.make_batches(200_000, 1000)
    metrics_h5.run(tmp / "warm.h5", batches[:20], "lzf")
    t = metrics_h5.run(tmp / "rate.h5", batches, "lzf")
    return 200_000 / t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short levels (for a smoke check)")
    args = ap.parse_args()
    seconds = 4.0 if args.quick else LEVEL_S
    cores = sorted(os.sched_getaffinity(0))
    client_core = {cores[0]}
    engine_cores = set(cores[1:]) or client_core
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_tiny(tmp / "tiny", weights=False)
        tok = Tokenizer(model_dir)
        port = free_port()
        engine = start_engine(model_dir, port, engine_cores)
        os.sched_setaffinity(0, client_core)
        best = 0
        try:
            url = f"http://127.0.0.1:{port}"
            for n in LEVELS:
                share, rps = level(url, model_dir, tok, tmp / f"c{n}.h5", n, seconds)
                print(f"# {n:>6} sessions: client delay {share:6.2%} of gaps, {rps:8,.0f} req/s", flush=True)
                if share >= MAX_DELAY_SHARE:
                    break
                best = n
        finally:
            engine.terminate()
            try:
                engine.wait(10)
            except subprocess.TimeoutExpired:
                engine.kill()
        rate = h5_rate(tmp)
    report("concurrent_sessions", best, TARGET_SESSIONS, higher_is_better=True, fmt="{:,.0f}")
    report("h5_rows_per_s", rate, 200_000, higher_is_better=True, fmt="{:,.0f}")
    where = f"client on core {cores[0]}, engine on cores {sorted(engine_cores)}"
    print(f"# {where}; gap {GAP_S:g} s, {seconds:g} s a level")


if __name__ == "__main__":
    main()
