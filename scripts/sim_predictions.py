"""Calibrate once, then predict: the cluster simulator on the published 544-GPU GLM-5.2 deployment.

1. calibrate: examples/glm52-544gpu.yaml with 2,500 automationbench agents for 15 simulated minutes; the H100's
   efficiency factors fitted so the steady requests/min (after the warm-up) is AutomationBench's 7,612; frozen in
   llmd/sim/data/calibration-automationbench/efficiency.yaml.
2. predict, without retuning (that file loaded): AutomationBench at 3,000 agents; CyberGym (400 agents, 376K-character
   ~94K-token contexts, 10 turns) under precise and under approximate routing; AgentX (128 agents, ~195K-token
   contexts, 15 minutes).
3. ablate: the six capabilities switched off one at a time at the 2,500-agent point (llmd/sim/ablations.py).
Writes results/sim-predictions/{calibration,predictions,ablations}.json, ablations.png, and prints the tables
docs/simulator.md holds (the figure also as docs/simulator-ablations.png). Runs go in parallel on `--workers` cores.
`python scripts/sim_predictions.py [--only STEP] [--duration S] [--warmup S] [--agentx-warmup S] [--workers N]`;
`--report` prints the tables and draws the figure again from the rows already written; `--resume` runs only the rows
a cut-short run did not write.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmd.sim.calibrate import AUTOMATIONBENCH_DIR as CALIBRATION_DIR  # noqa: E402

AB_TARGET_RPM = 7612.0  # AutomationBench at 2,500 agents: 7,612 requests/min (134.89M input, 6.05M output tokens/min)
AB_INPUT_TPM = 134.89e6
AB_OUTPUT_TPM = 6.05e6
OUT = ROOT / "results" / "sim-predictions"
FIGURE = ROOT / "docs" / "simulator-ablations.png"


def base_spec(profile: str, agents: int, duration_s: float, policy: str | None = None) -> Any:
    from llmd.spec import load_spec

    spec = load_spec(ROOT / "examples" / "glm52-544gpu.yaml")
    params = {"agents": agents}
    w = spec.workload.model_copy(
        update={"profile": profile, "concurrency": agents, "duration_s": duration_s, "seed": 1, "params": params}
    )
    spec = spec.model_copy(update={"workload": w})
    if policy is not None:
        spec = spec.model_copy(update={"router": spec.router.model_copy(update={"policy": policy})})
    return spec


def run(name: str, spec: Any, warmup_s: float, calibrated: bool) -> dict[str, Any]:
    """One simulation in a worker: its figures as a dict (steady rates measured after `warmup_s`)."""
    from llmd.perf import add_profile_dir
    from llmd.sim.calibrate import steady_rate
    from llmd.sim.run import Simulation

    if calibrated:
        add_profile_dir(CALIBRATION_DIR)
    t0 = time.perf_counter()
    sim = Simulation(spec, run_id=name)
    st = sim.run(warmup_s=warmup_s)
    end = min(st.sim_s, float(spec.workload.duration_s))
    ok = [c for c in sim.calls if c.status == 200 and c.done_time is not None and warmup_s <= c.done_time < end]
    span = max(end - warmup_s, 1e-9)
    # The whole run's figures at the top level; the steady state's (requests sent after the warm-up) under
    # "steady"; the warm-up's own TTFT p90 beside them, so the cold start is reported, not hidden.
    cold = [c.first_token - c.send_time for c in sim.calls if c.first_token is not None and c.send_time < warmup_s]
    out = asdict(st)
    out.update(
        name=name,
        warmup_s=warmup_s,
        steady=asdict(sim.steady if sim.steady is not None else st),
        cold_ttft_p90_s=_p90(cold),
        ttft_p90_by_window=_ttft_by_window(sim.calls, end),
        wall_s=time.perf_counter() - t0,
        steady_rpm=steady_rate(sim.calls, warmup_s, end) if end > warmup_s else math.nan,
        input_tpm=sum(c.input_tokens for c in ok) * 60 / span,
        output_tpm=sum(c.output_tokens for c in ok) * 60 / span,
        requests_per_min=st.requests_per_min,
    )
    return out


def _ttft_by_window(calls: list[Any], end: float, windows: int = 6) -> list[tuple[float, float]]:
    """(window start, TTFT p90 of the requests sent in it) over `windows` equal spans of the run: whether a steady
    state exists, or latency keeps growing as contexts do."""
    span = end / windows
    sent: list[list[float]] = [[] for _ in range(windows)]
    for c in calls:
        if c.first_token is not None and c.send_time < end:
            sent[int(c.send_time // span)].append(c.first_token - c.send_time)
    return [(i * span, _p90(v)) for i, v in enumerate(sent)]


def _p90(values: list[float]) -> float:
    import numpy as np

    return float(np.percentile(values, 90)) if values else math.nan


def calibrate(duration_s: float, warmup_s: float) -> dict[str, Any]:
    from llmd.perf import dump_efficiency, reset_profiles
    from llmd.sim.calibrate import calibrate as fit

    spec = base_spec("automationbench", 2500, duration_s)

    def show(t: Any) -> None:
        print(f"  scale {t.scale:.3f}: {t.requests_per_min:,.0f} requests/min [{t.stats.wall_s:.0f} s]", flush=True)

    reset_profiles()
    best, trials = fit(spec, AB_TARGET_RPM, warmup_s=warmup_s, on_trial=show, run_id="calibration")
    CALIBRATION_DIR.mkdir(parents=True, exist_ok=True)
    dump_efficiency(CALIBRATION_DIR / "efficiency.yaml", spec.engine.gpu, best.factors)
    return {
        "target_rpm": AB_TARGET_RPM,
        "scale": best.scale,
        "factors": best.factors,
        "fitted_rpm": best.requests_per_min,
        "preemptions": best.preemptions,
        "trials": [{"scale": t.scale, "rpm": t.requests_per_min, "preemptions": t.preemptions} for t in trials],
    }


def predictions(
    duration_s: float, warmup_s: float, agentx_warmup_s: float, workers: int, resume: bool
) -> list[dict[str, Any]]:
    # CyberGym is a fixed batch of sessions measured whole (its makespan), cold start included: no warm-up.
    jobs = [
        # Shortest first, so a run cut short still has what finished.
        ("AgentX, 128 agents", base_spec("agentx", 128, 900.0), agentx_warmup_s),
        ("AutomationBench, 3,000 agents", base_spec("automationbench", 3000, duration_s), warmup_s),
        ("CyberGym, 400 agents, precise", base_spec("cybergym", 400, 7200.0, "precise"), 0.0),
        ("CyberGym, 400 agents, approximate", base_spec("cybergym", 400, 7200.0, "approximate"), 0.0),
    ]
    if duration_s != 900.0:
        # The 15 minutes as well, when the row above keeps a shorter window (the calibration's): contexts keep
        # growing past it, and the rate with them.
        jobs.insert(2, ("AutomationBench, 3,000 agents, 15 min", base_spec("automationbench", 3000, 900.0), warmup_s))
    return _run_all(jobs, OUT / "predictions.partial.jsonl", workers, resume)


def _run_all(jobs: list[tuple[str, Any, float]], partial: Path, workers: int, resume: bool) -> list[dict[str, Any]]:
    """Each job's row, appended to `partial` as it finishes (hours of runs: what finished is kept if the rest is cut
    short); with `resume`, jobs whose row `partial` holds already are not run again. Rows in the jobs' order."""
    from concurrent.futures import as_completed

    partial.parent.mkdir(parents=True, exist_ok=True)
    if not resume:
        partial.unlink(missing_ok=True)
    done = {r["name"]: r for r in _read_jsonl(partial)}
    todo = [job for job in jobs if job[0] not in done]
    with ProcessPoolExecutor(max(1, min(workers, len(todo)))) as pool:
        futs = [pool.submit(run, name, spec, warmup, True) for name, spec, warmup in todo]
        for f in as_completed(futs):
            row = f.result()
            print(f"  done: {row['name']} [{row['wall_s']:.0f} s]", flush=True)
            with partial.open("a") as fh:
                fh.write(json.dumps(row, default=str) + "\n")
            done[row["name"]] = row
    return [done[name] for name, _, _ in jobs]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ablations(duration_s: float, warmup_s: float, workers: int, resume: bool) -> list[dict[str, Any]]:
    from llmd.sim.ablations import ABLATIONS, ablated

    full = base_spec("automationbench", 2500, duration_s)
    # Approximate routing's run is the slowest (several times the others'): last, so a run cut short has the rest.
    names = sorted(ABLATIONS, key=lambda name: name == "precise routing")
    jobs = [("full deployment", full, warmup_s)] + [(f"without {n}", ablated(full, n), warmup_s) for n in names]
    return _run_all(jobs, OUT / "ablations.partial.jsonl", workers, resume)


def _ms(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.1f} s" if v >= 10 else f"{v * 1000:,.0f} ms"


def _warmup(r: dict[str, Any]) -> str:
    return f"{r['warmup_s']:,.0f} s" if r["warmup_s"] > 0 else "none (whole batch)"


def prediction_table(rows: list[dict[str, Any]]) -> str:
    """Steady-state figures (requests sent after the warm-up); the cold start's TTFT p90 in brackets."""
    head = (
        "| scenario | warm-up | requests/min (or makespan) | TTFT p90 (warm-up's) | queue p90 | local prefix-hit share "
        "| input served from cache | NIXL transfers (MiB each) | CPU-tier restores (mean) | P2P lookups | preemptions "
        "| errors (cut off at the end) | compactions at the window |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        s = r["steady"]
        rate = f"{r['steady_rpm']:,.0f}" if not math.isnan(r["steady_rpm"]) else "-"
        if "CyberGym" in r["name"]:
            rate = f"{r['requests']:,} requests, the last done at {r['makespan_s'] / 60:,.1f} min "
            rate += f"({r['requests'] * 60 / r['makespan_s']:,.0f}/min)"
        ttft = _ms(s["ttft_p90_s"]) + (f" ({_ms(r['cold_ttft_p90_s'])})" if r["warmup_s"] > 0 else "")
        restores = f"{s['cpu_restores']:,} ({_ms(s['cpu_restore_mean_s'])})"
        mib = s["kv_transfer_bytes_mean"] / 2**20 if s["kv_transfers"] else 0
        lines.append(
            f"| {r['name']} | {_warmup(r)} | {rate} | {ttft} | {_ms(s['queue_p90_s'])} | {s['hit_share_gpu']:.3f} | "
            f"{s['cached_input_share']:.3f} | {s['kv_transfers']:,} ({mib:,.0f}) | {restores} | "
            f"{s['p2p_lookups']:,} | {s['preemptions']:,} | {r['errors']:,} ({r['aborted']:,}) | "
            f"{r.get('overflows', 0):,} |"
        )
    return head + "\n".join(lines)


def ablation_table(rows: list[dict[str, Any]]) -> str:
    full = rows[0]
    head = (
        "| deployment | requests/min | vs full | TTFT p90 | queue p90 | local prefix-hit share "
        "| input served from cache | preemptions |\n|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(
        f"| {r['name']} | {r['steady_rpm']:,.0f} | {r['steady_rpm'] / full['steady_rpm'] - 1:+.1%} | "
        f"{_ms(s['ttft_p90_s'])} | {_ms(s['queue_p90_s'])} | {s['hit_share_gpu']:.3f} | "
        f"{s['cached_input_share']:.3f} | {s['preemptions']:,} |"
        for r in rows
        for s in [r["steady"]]
    )


def ablation_figure(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = rows[0]
    names = [r["name"].removeprefix("without ") for r in rows[1:]]
    rpm = [1 - r["steady_rpm"] / full["steady_rpm"] for r in rows[1:]]
    ttft = [r["steady"]["ttft_p90_s"] / full["steady"]["ttft_p90_s"] for r in rows[1:]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.barh(names, [100 * x for x in rpm])
    a.set_xlabel("requests/min lost without it (%)")
    b.barh(names, ttft)
    for i, v in enumerate(ttft):
        if math.isnan(v):  # nothing sent after the warm-up got its first token before the run ended
            b.text(0.02, i, "no first token after the warm-up", va="center", fontsize=8)
    b.axvline(1.0, color="k", lw=0.8)
    b.set_xlabel("TTFT p90 without it / with it")
    window = f"{full['sim_s']:,.0f} s, {full['warmup_s']:,.0f} s warm-up"
    fig.suptitle(f"What each capability buys: glm52-544gpu, 2,500 AutomationBench agents (simulated, {window})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _rows(step: str) -> list[dict[str, Any]] | None:
    """A step's rows: its .json when the step finished, else what its .partial.jsonl kept."""
    whole, partial = OUT / f"{step}.json", OUT / f"{step}.partial.jsonl"
    if whole.exists():
        return json.loads(whole.read_text())
    return _read_jsonl(partial) or None


def report() -> None:
    from llmd.sim.ablations import ABLATIONS

    preds = _rows("predictions")
    if preds:
        print(prediction_table(preds))
    abl = _rows("ablations")
    if abl:
        order = ["full deployment"] + [f"without {name}" for name in ABLATIONS]
        abl = sorted(abl, key=lambda r: order.index(r["name"]))
        print(ablation_table(abl))
        if abl[0]["name"] == "full deployment" and len(abl) > 1:
            ablation_figure(abl, FIGURE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("calibrate", "predict", "ablate"))
    ap.add_argument("--duration", type=float, default=900.0, help="simulated seconds of the closed-loop runs")
    ap.add_argument("--warmup", type=float, help="seconds before steady rates are measured (default: a quarter)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--agentx-warmup",
        type=float,
        default=180.0,
        help="AgentX's warm-up, seconds of its 15 minutes: 128 first prompts of ~195K tokens arrive within 10 s",
    )
    ap.add_argument("--report", action="store_true", help="only the tables and figure, from the rows written")
    ap.add_argument("--resume", action="store_true", help="keep the rows a cut-short run wrote; run only the rest")
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else a.duration / 4
    if a.report:
        report()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "calibrate"):
        cal = calibrate(a.duration, warmup)
        (OUT / "calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
        print(f"calibrated: scale {cal['scale']:.3f} {cal['factors']} -> {cal['fitted_rpm']:,.0f} requests/min")
    if a.only in (None, "predict"):
        rows = predictions(a.duration, warmup, a.agentx_warmup, a.workers, a.resume)
        (OUT / "predictions.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
        print(prediction_table(rows))
    if a.only in (None, "ablate"):
        rows = ablations(a.duration, warmup, a.workers, a.resume)
        (OUT / "ablations.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
        ablation_figure(rows, OUT / "ablations.png")
        ablation_figure(rows, FIGURE)
        print(ablation_table(rows))


if __name__ == "__main__":
    main()
