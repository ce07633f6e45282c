"""Calibrate once, then predict: fit the GPU's efficiency factors so the simulated deployment reproduces one measured
point, and freeze them in an efficiency file (llmd.perf.efficiency) that later runs load without retuning.

The measured point is a closed-loop run: N agents, requests per minute at steady state. One number fixes one degree
of freedom, so the fit scales the datasheet efficiencies together (mfu, bw_efficiency and link_efficiency times one
factor s, each capped at 1): what the kernels reach of the roofline, not the roofline's shape. requests/min rises with s
(faster steps, shorter turns, agents come back sooner), so s is found by bracketing it: regula falsi in log s with the
Illinois step (an interpolated guess, the stale end's weight halved when one end keeps moving), which needs a few
trials where bisection needs ~7 for 1% — each trial is a whole simulation at 544 GPUs.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.errors import UserError

SCALED = ("mfu", "bw_efficiency", "link_efficiency")
# The frozen calibration the simulator's predictions load (scripts/sim_predictions.py writes it, the cluster_sim
# benchmark times the deployment with it): AutomationBench's 7,612 requests/min at 2,500 agents.
AUTOMATIONBENCH_DIR = Path(__file__).resolve().parent / "data" / "calibration-automationbench"


@dataclass(frozen=True)
class Trial:
    scale: float
    factors: dict[str, float]
    requests_per_min: float
    preemptions: int
    stats: Any = None


def scaled_factors(gpu: Any, s: float) -> dict[str, float]:
    return {f: min(1.0, getattr(gpu, f) * s) for f in SCALED}


def steady_rate(calls: list[Any], start_s: float, end_s: float) -> float:
    """Requests per minute that completed in [start_s, end_s): the measured point's steady state, not the warm-up
    of cold caches and agents starting."""
    if end_s <= start_s:
        raise ValueError("the measurement window is empty")
    done = sum(1 for c in calls if c.status == 200 and c.done_time is not None and start_s <= c.done_time < end_s)
    return done * 60.0 / (end_s - start_s)


def run_with_factors(spec: Any, factors: dict[str, float], warmup_s: float, **sim_kw: Any) -> Trial:
    """One simulation with the spec's GPU at `factors`: its steady requests/min (after `warmup_s`)."""
    from llmd.perf import add_profile_dir, dump_efficiency, reset_profiles
    from llmd.sim.run import Simulation

    with tempfile.TemporaryDirectory() as tmp:
        dump_efficiency(Path(tmp) / "efficiency.yaml", spec.engine.gpu, factors)
        reset_profiles()
        add_profile_dir(tmp)
        try:
            sim = Simulation(spec, **sim_kw)
        finally:
            reset_profiles()  # the fleet's latency models are built; nothing else should see the trial's factors
        stats = sim.run()
    rate = steady_rate(sim.calls, warmup_s, float(spec.workload.duration_s))
    return Trial(math.nan, factors, rate, stats.preemptions, stats)


def calibrate(
    spec: Any,
    target_rpm: float,
    *,
    warmup_s: float,
    lo: float = 0.2,
    hi: float | None = None,
    tolerance: float = 0.01,
    max_trials: int = 10,
    on_trial: Callable[[Trial], None] | None = None,
    **sim_kw: Any,
) -> tuple[Trial, list[Trial]]:
    """The factor s whose simulated steady requests/min is within `tolerance` of `target_rpm` (searched between
    `lo` and `hi`, default: where the first efficiency reaches 1). Returns the best trial and all of them; UserError
    when the target lies outside what [lo, hi] can give (the model, not its efficiencies, is off then)."""
    from llmd.perf import get_gpu

    gpu = get_gpu(spec.engine.gpu)
    if hi is None:
        hi = 1.0 / max(getattr(gpu, f) for f in SCALED)
    trials: list[Trial] = []

    def trial(s: float) -> Trial:
        t = dataclasses.replace(run_with_factors(spec, scaled_factors(gpu, s), warmup_s, **sim_kw), scale=s)
        trials.append(t)
        if on_trial is not None:
            on_trial(t)
        return t

    t_lo, t_hi = trial(lo), trial(hi)
    if not t_lo.requests_per_min <= target_rpm <= t_hi.requests_per_min:
        raise UserError(
            f"calibration: {target_rpm:,.0f} requests/min is outside what efficiency scale {lo:g}..{hi:g} gives "
            f"({t_lo.requests_per_min:,.0f}..{t_hi.requests_per_min:,.0f}); the workload or the deployment differs "
            "from the measured one more than efficiencies can explain"
        )
    best = min((t_lo, t_hi), key=lambda t: abs(t.requests_per_min - target_rpm))
    a, b = t_lo, t_hi
    # Residuals of the bracket's ends (rate - target: a below, b above), in log s: the rate's response to s flattens
    # as think time dominates, so log s is the straighter axis.
    fa, fb = a.requests_per_min - target_rpm, b.requests_per_min - target_rpm
    side = 0  # which end moved last: -1 a, +1 b
    while len(trials) < max_trials and abs(best.requests_per_min - target_rpm) > tolerance * target_rpm:
        la, lb = math.log(a.scale), math.log(b.scale)
        x = lb - fb * (lb - la) / (fb - fa) if fb != fa else (la + lb) / 2
        # Keep the guess inside the bracket's middle 90%: an end that barely moves would otherwise pin it there.
        x = min(max(x, la + 0.05 * (lb - la)), lb - 0.05 * (lb - la))
        t = trial(math.exp(x))
        f = t.requests_per_min - target_rpm
        if f < 0:
            a, fa = t, f
            if side == -1:
                fb /= 2  # Illinois: b has not moved for two trials
            side = -1
        else:
            b, fb = t, f
            if side == 1:
                fa /= 2
            side = 1
        if abs(f) < abs(best.requests_per_min - target_rpm):
            best = t
    return best, trials
