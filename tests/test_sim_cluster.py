"""The cluster simulator (llmd/sim): llmd's router core and engine core in virtual time."""

from __future__ import annotations

import array
import gc
import os
from pathlib import Path

import numpy as np
import pytest
from benchutil import load_benchmark

from llmd.cli import main
from llmd.demo import embedded_spec
from llmd.errors import UserError
from llmd.kv.hashing import BlockHasher
from llmd.metrics import read_requests, read_timeseries
from llmd.report.summary import summarize_frames
from llmd.sim import tokens as sim_tokens
from llmd.sim.context import ContextBuilder
from llmd.sim.params import SimParams
from llmd.sim.run import ABORTED, Simulation
from llmd.sim.tokens import TokenRuns

ROOT = Path(__file__).resolve().parents[1]


def test_token_runs_slice_like_the_tokens_they_stand_for() -> None:
    t = TokenRuns(vocab=50_000).extend(7, 300).extend(9, 100)
    whole = list(t)
    assert len(whole) == len(t) == 400
    assert t[250:330] == whole[250:330] and t[399] == whole[-1] and t[-1] == whole[-1]
    assert list(t.prefix(320)) == whole[:320]
    assert t.extend(11, 5)[:400] == whole  # extending shares, never changes, what was there
    assert all(0 <= x < 50_000 for x in whole) and len(set(whole)) > 350  # random-looking text
    # The packed form, across runs too, and of runs that start inside their stream (an offset) or are cut short.
    cut = TokenRuns(((5, 10, 30), (6, 0, 40), (8, 3, 0), (9, 7, 25)), vocab=1000)
    for seq in (t, t.prefix(333).extend(13, 20), cut):
        items = list(seq)
        for a, b in ((0, 400), (250, 330), (299, 301), (350, 900), (7, 7), (29, 71), (70, 95), (0, 1)):
            packed = seq.packed(a, b)
            assert (packed if isinstance(packed, list) else array.array("q", packed).tolist()) == items[a:b]
    if sim_tokens.span_packed is not None:
        with pytest.raises(TypeError, match="seed, offset, length"):
            sim_tokens.span_packed(((1, 2),), [0], 0, 5, 100)
        with pytest.raises(ValueError, match="one position per run"):
            sim_tokens.span_packed(((1, 0, 5),), [], 0, 5, 100)


# Without a compiler the C token runs are not built and numpy serves; `make test` sets LLMD_REQUIRE_NATIVE=1 so a build
# that silently failed there cannot pass as "skipped".
if sim_tokens.native_run_tokens is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError("llmd.sim._tokens is not built (pip install -e . compiles llmd/sim/_tokens.c): see its output")


@pytest.mark.skipif(sim_tokens.native_run_tokens is None, reason="llmd.sim._tokens is not built")
@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1, 2**70 + 3, -5])
def test_c_token_runs_are_the_python_ones(seed: int) -> None:
    native, py = sim_tokens.native_run_tokens, sim_tokens.py_run_tokens
    # Vocabularies growing and shrinking (the C side shares one int object per id), and one past what it shares.
    runs = [(0, 0, 10), (0, 5, 32_000), (3, 16, 7), (0, 17, 32_000), (10**9, 10**9 + 300, 151_552), (0, 40, 2**21)]
    for start, stop, vocab in runs:
        assert native(seed, start, stop, vocab) == py(seed, start, stop, vocab)  # numpy's path and the int one
    assert native(seed, 9, 3, 50) == []
    a, b = native(seed, 0, 300, 32_000), native(seed, 0, 300, 32_000)
    assert all(x is y for x, y in zip(a, b, strict=True))  # the same objects: an output's tokens cost no allocation
    for start, stop, vocab in [(0, 5, 32_000), (10**9, 10**9 + 300, 151_552), (9, 3, 50)]:
        n = max(0, stop - start)  # one run of the seed's stream from `start`
        packed = sim_tokens.span_packed(((seed, start, n),), [0], 0, n, vocab)
        assert array.array("q", packed).tolist() == native(seed, start, stop, vocab)
    with pytest.raises(ValueError, match="vocab must be >= 1"):
        native(seed, 0, 3, 0)


def test_context_hashes_are_the_engines_block_hashes() -> None:
    """The router's and the engines' view of a prompt must name the same blocks as the engine's own hasher does for
    the same tokens, however the context was built up (turn by turn, or cut back by a compaction)."""
    hasher = BlockHasher(16, "xxhash", "0")
    b = ContextBuilder(hasher, chunk_tokens=64, vocab=32_000)
    runs = TokenRuns(vocab=32_000)
    ctx = b.empty
    for seed, n in ((1, 40), (2, 7), (3, 100), (4, 1)):
        piece = TokenRuns(vocab=32_000).extend(seed, n)
        ctx = b.extend(ctx, piece)
        runs = runs.concat(piece)
        assert list(ctx.hashes) == hasher.hash_tokens(list(runs))
    cut = b.prefix(ctx, 50)
    assert list(cut.hashes) == hasher.hash_tokens(list(runs)[:50]) and len(cut) == 50
    assert len(ctx.chunks) == len(ctx) // 64
    # Without chunks (no router reads them), the same block hashes.
    bare = ContextBuilder(hasher, chunk_tokens=64, vocab=32_000, chunks=False)
    other = bare.empty
    for seed, n in ((1, 40), (2, 7), (3, 100), (4, 1)):
        other = bare.extend(other, TokenRuns(vocab=32_000).extend(seed, n))
    assert other.hashes == ctx.hashes and other.h64 == ctx.h64 and other.chunks == ()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Simulation, object, Path]:
    out = tmp_path_factory.mktemp("sim") / "run"
    sim = Simulation(embedded_spec(8.0), out_dir=out, run_id="t")
    return sim, sim.run(), out


def test_simulated_demo_serves_the_workload_through_the_router_core(demo_run) -> None:
    sim, stats, _out = demo_run
    assert stats.requests > 100 and stats.errors == 0 and stats.preemptions == 0
    ok = [c for c in sim.calls if c.status == 200]
    # The embedded deployment is disaggregated: requests took the P/D path, and the decode side pulled the KV.
    assert {c.pd_path for c in ok} >= {"pd"} and stats.kv_transfers > 0
    # Agents' later turns reuse their context: the engines' own counters show prefix hits, the router predicted them.
    assert 0.2 < stats.hit_share < 1 and any(c.route_reason == "prefix-hit" for c in ok)
    assert 0 < stats.ttft_p50_s < stats.ttft_p90_s < 5
    assert sum(r.steps for r in sim.fleet.ranks) > 0 and len(sim.router.index) > 0


def test_simulated_run_writes_the_live_schema(demo_run) -> None:
    """client, router and engine rows, merged into metrics.h5: the summary table and figures read it unchanged."""
    _sim, stats, out = demo_run
    path = out / "metrics.h5"
    df = read_requests(path)
    client = df[df.source == "client"]
    assert len(client) == stats.requests and (df.source == "router").sum() == stats.requests
    ts = read_timeseries(path)
    assert {"client", "router"} <= set(ts.source) and any(s.startswith("prefill-0") for s in ts.source)
    s = summarize_frames(df, ts, label="sim")
    assert s.requests == stats.requests and s.preemptions == 0
    assert s.ttft_p90_s == pytest.approx(stats.ttft_p90_s, rel=0.05)


def test_router_rows_carry_the_kv_transfers_the_simulator_modelled(tmp_path: Path) -> None:
    """Each P/D request's row holds the pull its decode engine made, as the fleet modelled it: tokens, their bytes
    (tokens x the decode pool's KV bytes per token), the link time plus NIXL's overhead; a decode-only one zeros."""
    spec = embedded_spec(8.0)
    spec = spec.model_copy(update={"router": spec.router.model_copy(update={"pd_threshold": 600})})
    sim = Simulation(spec, out_dir=tmp_path / "run", run_id="x")
    sim.run()
    df = read_requests(tmp_path / "run" / "metrics.h5")
    router = df[df.source == "router"]
    pd_rows, local = router[router.pd_path == "pd"], router[router.pd_path == "decode-only"]
    assert len(pd_rows) > 10 and len(local) > 10
    tokens = pd_rows["kv_transfer_tokens"]
    # What the pull moved, not what the router expected: the decode engine may have cached more of the prompt by
    # the time it pulls (another request brought it), so a row can fall below the threshold the decider used.
    assert (tokens > 0).all() and (tokens <= pd_rows["input_tokens"]).all()
    assert (tokens >= spec.router.pd_threshold).mean() > 0.8
    assert tokens.sum() == sim.fleet.transfers.tokens  # every pull the fleet made is one request's
    lat = next(r.latency for r in sim.fleet.ranks if r.pod.info.role == "decode")
    assert (pd_rows["kv_transfer_bytes"] == tokens * lat.kv_bytes_per_token_gpu * lat.par.tp).all()
    link = [lat.kv_transfer_time(t, same_node=False) for t in tokens]  # prefill and decode pods share no node
    expected = sim.params.transfer_overhead_s + sim.fleet.time_scale * np.array(link)
    assert pd_rows["kv_transfer_s"].to_numpy() == pytest.approx(expected, rel=1e-9)
    assert (local["kv_transfer_tokens"] == 0).all() and (local["kv_transfer_bytes"] == 0).all()
    assert (local["kv_transfer_s"] == 0).all()
    assert not sim.router._pulling  # no call is kept waiting for a pull after its end


def test_same_seed_same_run_and_policies_differ_only_by_their_decisions() -> None:
    spec = embedded_spec(5.0)
    a = Simulation(spec, run_id="x").run()
    b = Simulation(spec, run_id="x").run()
    assert (a.requests, a.ttft_p90_s, a.hit_share, a.events) == (b.requests, b.ttft_p90_s, b.hit_share, b.events)
    rr = Simulation(spec, policy="round-robin", run_id="x").run()
    # Under the demo's KV pressure, spraying sessions over the engines loses their prefixes; routing on the engines'
    # own KV events keeps them.
    assert a.hit_share > rr.hit_share + 0.05


def test_requests_cut_at_the_end_are_written_in_sending_order() -> None:
    """The run's last rows (requests still in flight at its end) follow the order they were sent in, not the
    addresses of their objects (a set of them gave an order that changed from one process to the next)."""
    spec = embedded_spec(30.0)
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"concurrency": 64})})
    sim = Simulation(spec, run_id="x")

    def progress(t: float, _stats: object) -> None:
        if t >= 4:
            raise KeyboardInterrupt  # the run stops with its requests in flight

    sim.run(progress)
    cut = [c for c in sim.calls if c.error == ABORTED]
    assert len(cut) > 20
    assert [c.request_id for c in cut] == [c.request_id for c in sorted(cut, key=lambda c: c.send_time)]


def test_ctrl_c_keeps_what_was_simulated(tmp_path: Path) -> None:
    sim = Simulation(embedded_spec(30.0), out_dir=tmp_path / "run", run_id="c")

    def progress(t: float, _stats: object) -> None:
        if t >= 4:
            raise KeyboardInterrupt

    stats = sim.run(progress)
    assert stats.interrupted and 3.5 <= stats.sim_s <= 5
    df = read_requests(tmp_path / "run" / "metrics.h5")
    assert (df.source == "client").sum() == stats.requests > 0


def test_collector_is_off_while_a_run_runs_and_back_as_it_was_after(tmp_path: Path) -> None:
    """A run makes no cyclic garbage, so it runs without the collector's walks: the caller's setting comes back, after
    a Ctrl-C too, and a whole run (HDF5 written) leaves nothing for the collector to find."""
    seen: list[bool] = []

    def progress(t: float, _stats: object) -> None:
        seen.append(gc.isenabled())
        if t >= 3:
            raise KeyboardInterrupt

    assert gc.isenabled()
    Simulation(embedded_spec(8.0), out_dir=tmp_path / "cut", run_id="g").run(progress)
    assert seen and not any(seen)
    assert gc.isenabled()
    sim = Simulation(embedded_spec(4.0), out_dir=tmp_path / "whole", run_id="g")
    sim.run()
    assert sim.calls and gc.collect() == 0  # (run() collects what was made before it starts)
    gc.disable()
    try:
        Simulation(embedded_spec(2.0), run_id="g").run()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_params_file_errors_name_what_is_wrong(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("hop_s: 0.001\nkv_event_delay: 1\n")
    with pytest.raises(UserError, match=r"unknown parameter.*kv_event_delay.*known:.*kv_event_delay_s"):
        SimParams.load(f)
    f.write_text("hop_s: -1\n")
    with pytest.raises(UserError, match="hop_s must be a number >= 0"):
        SimParams.load(f)
    f.write_text("[1, 2\n")
    with pytest.raises(UserError, match="not valid YAML"):
        SimParams.load(f)
    f.write_text("hop_s: 0.005\n")
    assert SimParams.load(f).hop_s == 0.005
    with pytest.raises(UserError, match="cannot read"):
        SimParams.load(tmp_path / "missing.yaml")


def test_llmd_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = ROOT / "examples" / "tiny-local.yaml"
    assert main(["simulate", str(spec), "--duration", "5", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "llmd simulate: tiny-local" in out and "events (" in out and "requests/min" in out
    files = list(tmp_path.glob("sim-*/metrics.h5"))
    assert len(files) == 1 and (read_requests(files[0]).source == "client").sum() > 0
    assert main(["simulate", str(spec), "--agents", "0"]) != 0
    err = capsys.readouterr().err
    assert "--agents must be at least 1" in err and "Traceback" not in err
    assert main(["simulate", str(spec), "--policy", "best"]) != 0
    assert "unknown --policy 'best'" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "none.yaml")]) != 0
    assert "none.yaml" in capsys.readouterr().err


def test_sweep_simulate_runs_every_variant_locally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import yaml

    base = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    base["output"] = {"dir": str(tmp_path / "results")}
    base["workload"] = {"profile": "smoke", "duration_s": 4}
    sweep = tmp_path / "sweep.yaml"
    grid = {"router.policy": ["precise", "round-robin"]}
    sweep.write_text(yaml.safe_dump({"name": "pol", "base": base, "grid": grid}))
    assert main(["sweep", str(sweep), "--simulate", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 points" in out and "req/min" in out
    rows = json.loads((tmp_path / "results" / "pol" / "sweep.json").read_text())
    assert [r["router.policy"] for r in rows] == ["precise", "round-robin"] and all(r["requests"] > 0 for r in rows)
    assert all((tmp_path / "results" / "pol" / str(i) / "metrics.h5").exists() for i in (0, 1))
    # Results are never overwritten: a second run skips the points that are done.
    assert main(["sweep", str(sweep), "--simulate"]) == 0
    assert "0 to run" in capsys.readouterr().out


def test_trace_replay_keeps_times_order_and_forks(tmp_path: Path) -> None:
    """A replayed trace: turns at their recorded times but never before the previous response, a sub-agent forking
    from its parent's latest prompt (so the engines hit its prefix), sessions in the trace's order."""
    import json

    lines = []
    for k, t in enumerate((0.0, 1.0, 2.0)):
        lines.append({"session": "main", "t": t, "input_tokens": 2000 + 300 * k, "output_tokens": 20})
    lines.append({"session": "sub", "parent": "main", "t": 1.5, "input_tokens": 2700, "output_tokens": 10})
    lines.append({"session": "other", "t": 0.5, "input_tokens": 900, "output_tokens": 5})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = embedded_spec(10.0)
    spec = spec.model_copy(
        update={
            "workload": spec.workload.model_copy(
                update={"profile": "trace", "trace_path": str(trace), "context_scale": 1.0}
            )
        }
    )
    sim = Simulation(spec, run_id="tr", keep_contexts=True)
    stats = sim.run()
    calls = {c.request_id: c for c in sim.calls}
    assert set(calls) == {"main#0", "main#1", "main#2", "sub#0", "other#0"} and stats.errors == 0
    assert [round(calls[f"main#{k}"].send_time, 3) for k in range(3)] == [0.0, 1.0, 2.0]
    assert calls["sub#0"].send_time == pytest.approx(1.5) and len(calls["sub#0"].ctx) == 2700
    # The sub-agent's prompt extends main's latest prompt (turn 1, 2,300 tokens) with its task.
    assert calls["sub#0"].ctx.hashes[:10] == calls["main#1"].ctx.hashes[:10]
    assert calls["sub#0"].cached_tokens >= 2000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "x", "t": -1, "input_tokens": 5, "output_tokens": 1}\n')
    spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"trace_path": str(bad)})})
    with pytest.raises(ValueError, match="line 1: field 't'"):
        Simulation(spec, run_id="tr")


def test_calibration_recovers_the_efficiency_that_produced_a_measurement() -> None:
    """Fit once, then predict: a rate measured with the GPU at 0.3x its datasheet efficiencies is fitted back to a
    factor near 0.3, and a target no efficiency can reach is refused, naming the range it could."""
    from llmd.perf import get_gpu
    from llmd.sim.calibrate import calibrate, run_with_factors, scaled_factors

    spec = embedded_spec(12.0)
    gpu = get_gpu(spec.engine.gpu)
    measured = run_with_factors(spec, scaled_factors(gpu, 0.3), 4.0, run_id="m").requests_per_min
    best, trials = calibrate(spec, measured, warmup_s=4.0, lo=0.1, hi=1.0, tolerance=0.03, run_id="m")
    assert abs(best.requests_per_min - measured) <= 0.03 * measured and 0.2 < best.scale < 0.45
    # Two bracket ends and a few interpolated steps: fewer than plain bisection to 3% over [0.1, 1] needs (~9).
    assert best.factors["mfu"] == pytest.approx(gpu.mfu * best.scale) and len(trials) <= 8
    assert get_gpu(spec.engine.gpu) == gpu  # the trials' factors do not leak into later runs
    with pytest.raises(UserError, match="outside what efficiency scale"):
        calibrate(spec, measured * 10, warmup_s=4.0, lo=0.5, hi=1.0, run_id="m")


def test_ablations_switch_off_one_capability_on_the_same_gpus() -> None:
    from llmd.sim.ablations import ABLATIONS, ablated
    from llmd.spec import load_spec

    spec = load_spec(ROOT / "examples" / "glm52-544gpu.yaml")

    def gpus(s: object) -> int:
        return sum(p.nodes * p.gpus_per_node for p in s.pools.values())  # type: ignore[attr-defined]

    off = {name: ablated(spec, name) for name in ABLATIONS}
    assert all(gpus(s) == gpus(spec) == 544 for s in off.values())
    assert off["precise routing"].router.policy == "approximate" and off["CPU tier"].kv.cpu_bytes == 0
    assert off["P2P pulls"].router.p2p is False and off["MTP"].mtp.draft_tokens == 0
    assert not off["P/D over NIXL"].disaggregated and off["P/D over NIXL"].decode.nodes == 68
    tp = off["wide EP + DP attention"]
    assert (tp.decode.tp_size, tp.decode.dp_size, tp.decode.ep) == (16, 1, False)
    # Each differs from the full deployment in its own section only.
    for name, s in off.items():
        changed = {k for k in ("router", "kv", "mtp", "prefill", "decode") if getattr(s, k) != getattr(spec, k)}
        assert changed and changed <= {"router", "kv", "mtp", "prefill", "decode"}
        assert len(changed) == (2 if name in ("wide EP + DP attention", "P/D over NIXL") else 1), name
    with pytest.raises(UserError, match="unknown capability 'FP4'"):
        ablated(spec, "FP4")


def test_simulation_agrees_with_the_live_demo() -> None:
    """Fidelity against llmd's own live stack: the default demo's deployment and workload at 3x time for 60 s, run
    live (simulated engines, the router and the load generator in this process, real HTTP on 127.0.0.1) and simulated
    with that process's CPU costs (llmd/sim/data/llmd-demo.yaml), for workload seeds 0 and 1. Requests and the
    engines' hit share agree within the issue's 5%, compared as the two seeds' means, as benchmarks/cluster_sim.py
    compares six: one live run is one draw of a noisy process (seed 0 alone gave 591-620 requests over nine live runs
    against a simulated 586, so a single pair's error crossed 5% on a busy CI machine while the seed's mean error
    was ~2.5%); over two seeds the draws' spread halves against the same 5%.
    The live TTFT comes from a shared 2-core machine whose one event loop carries everything: five live runs of seed
    0 gave p50 0.50-0.55 s and p90 1.74-2.12 s, a spread the sim's fixed CPU costs cannot follow (scaling them by the
    loop thread's measured CPU time overshoots: most of that time is off the requests' critical path). So p50 is held
    within 30%, p90 within 40%, and benchmarks/cluster_sim.py reports the error of six seeds' means against the 10%
    target on a quiet machine."""
    import asyncio
    import tempfile

    from llmd import demo

    params = SimParams.load(ROOT / "llmd" / "sim" / "data" / "llmd-demo.yaml")
    base = embedded_spec(60.0)
    sims, lives = [], []
    for seed in (0, 1):
        spec = base.model_copy(
            update={
                "engine": base.engine.model_copy(update={"time_scale": 3.0}),
                "workload": base.workload.model_copy(update={"time_scale": 3.0, "seed": seed}),
            }
        )
        sims.append(Simulation(spec, params=params, run_id="fidelity").run())
        out = Path(tempfile.mkdtemp())
        run = demo.PolicyRun("precise", out / "live", out / "live" / "metrics.h5")
        asyncio.run(demo._run_all(spec, [run], demo._model_dir(spec, False), "fidelity"))
        lives.append(summarize_frames(read_requests(run.metrics), read_timeseries(run.metrics), label="live"))

    def mean(runs: list, key: str) -> float:
        return sum(getattr(r, key) for r in runs) / len(runs)

    def err(key: str) -> float:
        return abs(mean(sims, key) - mean(lives, key)) / mean(lives, key)

    pairs = {k: [(getattr(s, k), getattr(v, k)) for s, v in zip(sims, lives, strict=True)] for k in (
        "requests", "hit_share_gpu", "ttft_p50_s", "ttft_p90_s")}  # fmt: skip
    assert all(r.errors == 0 for r in sims + lives), pairs
    assert err("requests") <= 0.05, pairs["requests"]
    assert err("hit_share_gpu") <= 0.05, pairs["hit_share_gpu"]
    assert err("ttft_p50_s") <= 0.3, pairs["ttft_p50_s"]
    assert err("ttft_p90_s") <= 0.4, pairs["ttft_p90_s"]


def test_cluster_sim_benchmark_refuses_fewer_than_one_fidelity_seed_before_running(monkeypatch, capsys) -> None:
    bench = load_benchmark("cluster_sim")
    ran: list[str] = []
    monkeypatch.setattr(bench, "scale_run", lambda *a: ran.append("scale"))
    monkeypatch.setattr(bench, "fidelity", lambda *a: ran.append("fidelity"))
    monkeypatch.setattr("sys.argv", ["cluster_sim.py", "--fidelity-seeds", "0"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--fidelity-seeds must be at least 1, got 0" in capsys.readouterr().err
    assert ran == []
