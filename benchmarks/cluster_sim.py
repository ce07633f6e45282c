"""Cluster simulator benchmark: speed and memory at the 544-GPU deployment, and fidelity to llmd's live stack.

Prints `name: value  # target ... (ratio R)`, R >= 1 meaning the target is met.
- wall_s, sim_speedup, events_per_s, peak_rss_mb: examples/glm52-544gpu.yaml (10 prefill pods x DP16 + 3 decode pods
  x DP128: 544 engine ranks) as the simulator predicts it, with the frozen AutomationBench calibration
  (llmd/sim/data/calibration-automationbench: the H100's datasheet efficiencies x 0.396, fitted once to the measured
  7,612 requests/min at 2,500 agents), driven by 3,000 agents of the automationbench profile for 900 simulated
  seconds, in a child process pinned to one core; wall_s <= 120, peak RSS <= 8 GiB. sim_speedup (simulated / wall
  seconds) carries the same target for any length (>= 7.5); a run with other --agents or --duration prints wall_s
  without it. `--datasheet` also times the same run on the raw datasheet efficiencies (info only: a fleet ~2x faster
  than the one measured, so ~2.7x the requests and about as many times the wall time).
- live_vs_sim_*: the default demo's deployment and workload (`llmd demo`: 3 prefill + 2 decode simulated engines
  under KV pressure, 12 agents) at engine and workload time scale 3 for 60 s, run live (engines, router and load
  generator in this process, real HTTP on 127.0.0.1) and simulated (llmd/sim/data/llmd-demo.yaml: that process's CPU
  costs), for each of --fidelity-seeds workload seeds (6): errors of the simulation's mean over the seeds against the
  live runs' mean in hit share (engines' own counters), requests/min and TTFT p50/p90 (targets 5% and 10%; ttft_err
  is the worse of p50 and p90). Each seed's pair is printed too.
`python benchmarks/cluster_sim.py [--agents N] [--duration S] [--skip-live] [--datasheet]`: the 900 s run takes ~2-3
minutes on this 2-core machine today (the datasheet one ~7.5), the live-vs-simulated runs ~6.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import info, report  # noqa: E402  (benchmarks/ is on sys.path: scripts run from there)

WALL_TARGET_S = 120.0
TARGET_AGENTS, TARGET_SIM_S = 3000, 900.0  # the run wall_s's target is for
RSS_TARGET_MB = 8192.0
FIDELITY_SCALE = 3.0
FIDELITY_DURATION_S = 60.0

_CHILD = """
import json, sys, time
from pathlib import Path
from llmd.sim.cli import load_sim_spec
from llmd.sim.run import Simulation
from llmd import compiled
from llmd.perf import add_profile_dir
import argparse
if sys.argv[4]:
    add_profile_dir(sys.argv[4])  # the frozen calibration, as predictions load it
spec = load_sim_spec(Path(sys.argv[1]), argparse.Namespace(agents=int(sys.argv[2]), duration=float(sys.argv[3]),
                     seed=None, policy=None))
t0 = time.perf_counter()
sim = Simulation(spec, run_id="bench")
build_s = time.perf_counter() - t0
st = sim.run()
print(json.dumps({"wall_s": st.wall_s + build_s, "sim_s": st.sim_s, "events": st.events, "requests": st.requests,
                  "requests_per_min": st.requests_per_min, "hit_share": st.hit_share, "ttft_p90_s": st.ttft_p90_s,
                  "preemptions": st.preemptions, "errors": st.errors, "build_s": build_s,
                  "engine_core": "compiled (mypyc)" if compiled.ACTIVE else f"Python source ({compiled.WHY_NOT})"}))
"""


def scale_run(agents: int, duration_s: float, calibrated: bool = True) -> dict:
    """One 544-GPU run in a child pinned to one core: its figures. `calibrated`: with the frozen calibration (what
    the simulator predicts with), else the H100's raw datasheet efficiencies."""
    import yaml

    spec = yaml.safe_load((ROOT / "examples" / "glm52-544gpu.yaml").read_text())
    spec["workload"] = {"profile": "automationbench", "seed": 1, "concurrency": agents, "duration_s": duration_s}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        from llmd.sim.calibrate import AUTOMATIONBENCH_DIR

        cal = str(AUTOMATIONBENCH_DIR) if calibrated else ""
        cmd = [sys.executable, "-c", _CHILD, str(path), str(agents), str(duration_s), cal]
        if sys.platform == "linux":
            cmd = ["taskset", "-c", "0", *cmd]  # one core, as the target says
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"simulation failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def fidelity(duration_s: float, seed: int) -> dict[str, dict]:
    """One workload seed of the default demo, run simulated and live: each run's summary."""
    from llmd import demo
    from llmd.metrics import read_requests, read_timeseries
    from llmd.report.summary import summarize_frames
    from llmd.sim.params import SimParams
    from llmd.sim.run import Simulation

    spec = demo.embedded_spec(duration_s)
    spec = spec.model_copy(
        update={
            "engine": spec.engine.model_copy(update={"time_scale": FIDELITY_SCALE}),
            "workload": spec.workload.model_copy(update={"time_scale": FIDELITY_SCALE, "seed": seed}),
        }
    )
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        params = SimParams.load(ROOT / "llmd" / "sim" / "data" / "llmd-demo.yaml")
        Simulation(spec, out_dir=root / "sim", params=params, run_id="fidelity").run()
        run = demo.PolicyRun("precise", root / "live", root / "live" / "metrics.h5")
        asyncio.run(demo._run_all(spec, [run], demo._model_dir(spec, False), "fidelity"))
        for name, path in (("sim", root / "sim" / "metrics.h5"), ("live", run.metrics)):
            s = summarize_frames(read_requests(path), read_timeseries(path), label=name).as_dict()
            s["requests_per_min"] = s["requests"] * 60 / duration_s
            out[name] = s
    return out


# What the fidelity figures compare: each is the mean over the seeds' runs, simulated against live.
_FIDELITY_KEYS = ("hit_share_gpu", "requests_per_min", "ttft_p50_s", "ttft_p90_s")


def _err(sim: float, live: float) -> float:
    return abs(sim - live) / live * 100 if live else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=TARGET_AGENTS)
    ap.add_argument("--duration", type=float, default=TARGET_SIM_S, help="simulated seconds at 544 GPUs")
    ap.add_argument("--skip-live", action="store_true", help="only the 544-GPU run")
    ap.add_argument("--skip-scale", action="store_true", help="only the live-vs-simulated run")
    ap.add_argument(
        "--datasheet", action="store_true", help="also time the 544-GPU run on uncalibrated datasheet efficiencies"
    )
    ap.add_argument("--fidelity-seeds", type=int, default=6, help="workload seeds run live and simulated (>= 1)")
    ap.add_argument("--fidelity-seed0", type=int, default=0, help="the first of those seeds (0: the demo's own)")
    args = ap.parse_args()
    if args.fidelity_seeds < 1:
        ap.error(f"--fidelity-seeds must be at least 1, got {args.fidelity_seeds}")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if not args.skip_scale:
        r = scale_run(args.agents, args.duration)
        info("deployment", f"glm52-544gpu with the frozen AutomationBench calibration, {args.agents} agents "
             f"(automationbench), {args.duration:g} simulated s")  # fmt: skip
        info("engine_core", r["engine_core"])  # llmd/compiled.py: the numbers differ by ~15% between the two
        info("simulated", f"{r['requests']:,} requests ({r['requests_per_min']:,.0f}/min), hit share "
             f"{r['hit_share']:.3f}, TTFT p90 {r['ttft_p90_s']:.2f} s, {r['preemptions']} preemptions, "
             f"{r['errors']} errors; build {r['build_s']:.1f} s")  # fmt: skip
        if args.agents == TARGET_AGENTS and args.duration == TARGET_SIM_S:
            report("wall_s", r["wall_s"], WALL_TARGET_S, higher_is_better=False, fmt="{:.1f}")
        else:  # the target is for the run: against a shorter one, 120 s would read as nearly met
            info("wall_s", f"{r['wall_s']:.1f} (the {WALL_TARGET_S:g} s target is for {TARGET_AGENTS:,} agents x "
                 f"{TARGET_SIM_S:g} simulated s: see sim_speedup)")  # fmt: skip
        # The same target per simulated second, whatever the run's length (a short run is mostly the cold start,
        # the slowest part: it understates the speed-up).
        report("sim_speedup", r["sim_s"] / r["wall_s"], TARGET_SIM_S / WALL_TARGET_S, higher_is_better=True)
        info("events_per_s", f"{r['events'] / r['wall_s']:,.0f}")
        report("peak_rss_mb", r["peak_rss_mb"], RSS_TARGET_MB, higher_is_better=False, fmt="{:.0f}")
        if args.datasheet:
            d = scale_run(args.agents, args.duration, calibrated=False)
            info(
                "datasheet",
                f"{d['requests']:,} requests ({d['requests_per_min']:,.0f}/min), hit share "
                f"{d['hit_share']:.3f}, TTFT p90 {d['ttft_p90_s']:.2f} s, {d['preemptions']} preemptions, "
                f"{d['errors']} errors; wall_s {d['wall_s']:.1f}, events_per_s {d['events'] / d['wall_s']:,.0f}",
            )
    if not args.skip_live:
        t0 = time.perf_counter()
        # One live run is one draw of a noisy process (the live loop shares a core with the engines, the router and
        # the agents): its TTFT p90 alone moved 1,621-2,105 ms over four runs of the same seed, wider than the 10%
        # target; seed 2's moved 841-1,364 ms over seven. So the simulation and the live stack each run every seed,
        # and their means are compared: over three seeds the TTFT error still read 1.8-13.5% for the same simulation.
        runs = [fidelity(FIDELITY_DURATION_S, args.fidelity_seed0 + k) for k in range(args.fidelity_seeds)]
        for k, f in enumerate(runs):
            for name in ("sim", "live"):
                s = f[name]
                info(f"{name}_seed{args.fidelity_seed0 + k}", f"{s['requests']} requests, hit share "
                     f"{s['hit_share']:.3f} (engines' GPU {s['hit_share_gpu']:.3f}), TTFT p50 "
                     f"{s['ttft_p50_s'] * 1000:.0f} ms / p90 {s['ttft_p90_s'] * 1000:.0f} ms")  # fmt: skip
        sim = {key: statistics.fmean(f["sim"][key] for f in runs) for key in _FIDELITY_KEYS}
        live = {key: statistics.fmean(f["live"][key] for f in runs) for key in _FIDELITY_KEYS}
        for name, m in (("sim_mean", sim), ("live_mean", live)):
            info(name, f"{m['requests_per_min']:.1f} requests/min, engines' GPU hit share {m['hit_share_gpu']:.3f}, "
                 f"TTFT p50 {m['ttft_p50_s'] * 1000:.0f} ms / p90 {m['ttft_p90_s'] * 1000:.0f} ms")  # fmt: skip
        report("live_vs_sim_hit_err_pct", _err(sim["hit_share_gpu"], live["hit_share_gpu"]), 5.0, False, "{:.1f}")
        report("live_vs_sim_rpm_err_pct", _err(sim["requests_per_min"], live["requests_per_min"]), 5.0, False, "{:.1f}")
        ttft = max(_err(sim["ttft_p50_s"], live["ttft_p50_s"]), _err(sim["ttft_p90_s"], live["ttft_p90_s"]))
        report("live_vs_sim_ttft_err_pct", ttft, 10.0, higher_is_better=False, fmt="{:.1f}")
        info("fidelity_wall_s", f"{time.perf_counter() - t0:.0f}")


if __name__ == "__main__":
    main()
