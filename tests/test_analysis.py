"""analysis/ on a small real sweep (tests/analysisutil.py): loading keyed by the sweep's parameters, live runs, the
per-run numbers, costs, the figures and `llmd analyze`'s report folder."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysisutil import GRID, make_sweep

from analysis import Run, Sweep, load, load_sweep, summarize
from analysis import run_figures as rf
from analysis.cost import APIPrice, GPUPrices, load_api_prices, run_cost
from analysis.report import points
from analysis.style import NoData
from analysis.sweep_figures import pareto_frontier
from llmd.metrics import MetricsWriter
from llmd.report.summary import summarize_frames

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sweep(tmp_path_factory.getbasetemp())


def test_a_sweep_is_keyed_by_its_grid(sweep_dir: Path) -> None:
    sweep = load(sweep_dir)
    assert isinstance(sweep, Sweep) and len(sweep) == 4
    assert sweep.parameters == list(GRID)
    assert [r.params for r in sweep] == [
        {"router.policy": p, "workload.concurrency": c} for p in GRID["router.policy"] for c in [4, 16]
    ]
    frames = sweep.frames(lambda r: r.client)
    assert set(frames["router.policy"]) == {"precise", "round-robin"} and len(frames) == sum(
        len(r.client) for r in sweep
    )


def test_without_sweep_json_the_differing_spec_keys_are_the_parameters(sweep_dir: Path, tmp_path: Path) -> None:
    # A Slurm array sweep leaves no sweep.json: the stored specs still tell the points apart.
    copy = tmp_path / "array"
    shutil.copytree(sweep_dir, copy)
    (copy / "sweep.json").unlink()
    assert sorted(load_sweep(copy).parameters) == sorted(GRID)


def test_a_run_being_written_reads_as_far_as_it_got(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    rows = [{"request_id": f"r{i}", "send_time": float(i), "ttft_s": 0.01, "e2e_s": 0.1, "status": 200,
             "input_tokens": 100, "output_tokens": 10, "cached_tokens": 50} for i in range(5)]  # fmt: skip
    with MetricsWriter(run_dir / "client.h5", "client") as w:
        w.append_requests(rows)
        w.flush()
        run = Run(run_dir)
        assert run.live and len(run.requests) == 5  # read under SWMR while the writer is open
        w.append_requests([{**r, "request_id": f"s{i}"} for i, r in enumerate(rows)])
        w.flush()
        assert len(run.reload().requests) == 10
    assert summarize(run).requests == 10


def test_a_runs_numbers(sweep_dir: Path) -> None:
    run = load_sweep(sweep_dir).points[1]
    s = summarize(run)
    base = summarize_frames(run.requests, run.timeseries)
    assert s.requests == base.requests > 50 and s.errors == 0
    assert s.gpus == 4 and s.input_tokens_per_min == pytest.approx(base.input_tokens_per_min)
    for name in ("ttft", "tpot", "e2e"):
        assert 0 < s.latency[f"{name}_p50_s"] <= s.latency[f"{name}_p90_s"] <= s.latency[f"{name}_p99_s"]
    parts = [s.hits[k] for k in ("gpu", "cpu", "p2p", "computed")]
    assert all(0 <= p <= 1 for p in parts) and sum(parts) == pytest.approx(1.0)
    assert s.kv_transfers and s.pd_paths.get("pd", 0) > 0
    assert s.tokens_per_s_per_user > 0 and s.output_tokens_per_s_per_gpu > 0
    # Each transfer from the router's rows: one per request that took the P/D path, with its modelled size and time.
    router = run.router
    pulled = router[router["kv_transfer_tokens"] > 0]
    assert s.kv_transfer_requests == len(pulled) == (router["pd_path"] == "pd").sum() > 0
    assert s.kv_transfer_bytes_mean == pytest.approx(pulled["kv_transfer_bytes"].mean())
    assert 0 < s.kv_transfer_bytes_mean <= s.kv_transfer_bytes_p90 * 2
    assert s.kv_transfer_s_p90 == pytest.approx(np.percentile(pulled["kv_transfer_s"], 90)) and s.kv_transfer_s_mean > 0


def test_the_transfers_figure_shows_each_transfers_size_and_time(sweep_dir: Path) -> None:
    run = load_sweep(sweep_dir).points[1]
    fig = rf.transfers(run.client, run.series("engines"), run.router)
    _per_s, size, vs = fig.axes
    pulled = run.router[run.router["kv_transfer_tokens"] > 0]
    assert size.get_xlabel().startswith("KV per transfer (MiB")
    assert sum(p.get_height() for p in size.patches) == len(pulled)  # one histogram count per transfer
    points = np.concatenate([c.get_offsets() for c in vs.collections])
    assert len(points) == len(pulled)
    got = sorted(map(tuple, points.tolist()))
    want = sorted(zip(pulled["kv_transfer_bytes"] / 2**20, pulled["kv_transfer_s"], strict=True))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-9)
    # Without the router's rows, today's view: the prompt size of each P/D request.
    assert rf.transfers(run.client, run.series("engines")).axes[1].get_xlabel().startswith("prompt tokens")


def test_a_run_from_before_the_transfer_columns_still_analyses(tmp_path: Path) -> None:
    """Metrics files of schema 2 (no per-request KV transfer) load, summarize and draw today's transfers view."""
    from metricsutil import schema2_file

    run_dir = tmp_path / "old-run"
    run_dir.mkdir()
    rows = [{"request_id": f"r{i}", "send_time": float(i), "ttft_s": 0.05, "e2e_s": 0.5, "status": 200,
             "input_tokens": 1000 + i, "output_tokens": 10, "cached_tokens": 0, "pod": "decode-0",
             "prefill_pod": "prefill-0", "pd_path": "pd"} for i in range(6)]  # fmt: skip
    schema2_file(run_dir / "client.h5", "client", rows)
    schema2_file(run_dir / "router.h5", "router", [{**r, "expected_hit_tokens": 0} for r in rows])
    merged = run_dir / "metrics.h5"
    from llmd.metrics import merge_runs

    merge_runs([run_dir / "client.h5", run_dir / "router.h5"], merged)
    for run in (Run(run_dir), Run(merged)):
        assert len(run.router) == 6 and (run.router["kv_transfer_tokens"] == -1).all()
        s = summarize(run)
        assert s.requests == 6 and s.kv_transfer_requests is None and math.isnan(s.kv_transfer_bytes_mean)
        fig = rf.transfers(run.client, run.series("engines"), run.router)
        assert len(fig.axes) == 2 and fig.axes[1].get_xlabel().startswith("prompt tokens")


def test_cost_per_million_tokens() -> None:
    gpus = {"prefill": 2, "decode": 2}
    c = run_cost(gpus, 3600.0, 2_000_000, 500_000, GPUPrices(2.0, 3.0))
    assert c["gpu_hours"] == 4 and c["gpu_cost_usd"] == 10.0
    assert c["usd_per_m_input"] == pytest.approx(4.0 / 2) and c["usd_per_m_output"] == pytest.approx(6.0 / 0.5)
    assert c["usd_per_m_tokens"] == pytest.approx(10.0 / 2.5)
    agg = run_cost({"decode": 4}, 3600.0, 2_000_000, 500_000, GPUPrices(2.0, 2.0))
    assert agg["usd_per_m_input"] == pytest.approx(8.0 / 2) and agg["usd_per_m_output"] == pytest.approx(8.0 / 0.5)
    api = APIPrice("x", input=2.0, output=10.0, cached_input=0.5)
    assert api.bill(1_000_000, 400_000, 100_000) == pytest.approx(0.6 * 2 + 0.4 * 0.5 + 0.1 * 10)
    assert GPUPrices.of(None, {}) is None and GPUPrices.of(None, {"gpu_hour_usd": 1.5}) == GPUPrices(1.5, 1.5)


def test_the_specs_cost_section_prices_a_stored_run() -> None:
    """A spec's `cost:` loads, is stored whole (unset prices as null) and prices the run: a pool's own price, else the
    fleet's."""
    import yaml

    from analysis.spec import cost_block
    from llmd.spec import dump_spec, parse_spec

    spec = parse_spec({"cost": {"gpu_hour_usd": 2.5, "decode_gpu_hour_usd": 3.0}})
    stored = yaml.safe_load(dump_spec(spec))
    assert stored["cost"]["prefill_gpu_hour_usd"] is None
    assert GPUPrices.of(None, cost_block(stored)) == GPUPrices(2.5, 3.0)
    assert GPUPrices.of(4.0, cost_block(stored)) == GPUPrices(4.0, 4.0)  # the command line wins
    assert GPUPrices.of(None, cost_block(yaml.safe_load(dump_spec(parse_spec({}))))) is None


def test_api_prices_name_their_source(tmp_path: Path) -> None:
    builtin = load_api_prices()
    assert builtin and all(p.source and p.date and p.cached_input <= p.input for p in builtin)
    bad = tmp_path / "p.yaml"
    bad.write_text("prices:\n  - {name: mine, input: 1, output: cheap}\n")
    with pytest.raises(ValueError, match=r"prices\[0\] \(mine\): output"):
        load_api_prices(bad)


def test_the_pareto_frontier_keeps_the_undominated() -> None:
    x = np.array([1.0, 2.0, 3.0, 2.5, 0.5])
    y = np.array([9.0, 5.0, 1.0, 4.0, 8.0])
    assert pareto_frontier(x, y).tolist() == [0, 1, 3, 2]


def test_the_demo_figures_and_a_log_ttft_axis(sweep_dir: Path, tmp_path: Path) -> None:
    frames = {r.label: r.requests for r in load_sweep(sweep_dir)}
    paths = rf.write_demo_figures(frames, tmp_path)
    assert [p.name for p in paths] == list(rf.DEMO_FIGURES)
    assert all(p.read_bytes()[:8] == PNG for p in paths)
    assert rf.ttft_cdf(frames).axes[0].get_xscale() == "log"
    with pytest.raises(NoData):
        rf.ttft_cdf({"empty": pd.DataFrame()})


def test_llmd_analyze_writes_the_report_folder(sweep_dir: Path, tmp_path: Path, capsys) -> None:
    from llmd.cli import main

    out = tmp_path / "report"
    assert main(["analyze", str(sweep_dir), "--out", str(out), "--gpu-hour-usd", "2.5"]) == 0
    md = (out / "report.md").read_text()
    expected = ["ttft_cdf.png", "throughput.png", "cache_hit_per_turn.png", "throughput_vs_concurrency.png",
                "pareto.png", "hit_decomposition.png", "cost_vs_api.png", "runs/0/timeseries.png",
                "runs/0/transfers.png", "runs/0/fabric.png", "runs/3/timeseries.png"]  # fmt: skip
    for name in expected:
        assert (out / name).read_bytes()[:8] == PNG, name
        assert f"]({name})" in md, name
    table = pd.read_csv(out / "points.csv")
    assert len(table) == 4 and list(table.columns[1:3]) == list(GRID)
    cost = pd.read_csv(out / "cost.csv")
    assert (cost["usd_per_m_tokens"] > 0).all()
    assert "GPT-4o" in md and "openai.com/api/pricing" in md
    assert "wrote" in capsys.readouterr().out
    single = tmp_path / "one"
    assert main(["analyze", str(sweep_dir / "0" / "metrics.h5"), "--out", str(single)]) == 0
    assert "No GPU-hour price" in (single / "report.md").read_text()
    assert (single / "ttft_cdf.png").exists() and not (single / "pareto.png").exists()


def test_points_table_for_a_single_run(sweep_dir: Path) -> None:
    table = points(Run(sweep_dir / "2"))
    assert len(table) == 1 and table["policy"][0] == "round-robin" and table["concurrency"][0] == 4
    assert math.isfinite(table["ttft_p90_s"][0])
