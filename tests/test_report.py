"""Reports from a synthetic metrics HDF5: summary numbers and the llm-d Benchmark Report export (the figures are
analysis/'s: tests/test_analysis*.py)."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import yaml

from llmd.metrics import MetricsWriter, read_requests
from llmd.report import hit_share_per_turn, summarize
from llmd.report.export import report_for_file, stats, validate
from llmd.report.summary import summary_rows
from llmd.spec import DeploymentSpec


def _rows() -> list[dict]:
    rows = []
    for i in range(10):
        rows.append(
            {
                "request_id": f"r{i}",
                "session": f"s{i % 2}",
                "turn": i // 2,
                "send_time": float(i),
                "ttft_s": 0.1 * (i + 1),  # 0.1 .. 1.0
                "e2e_s": 2.0,
                "itl_mean_s": 0.01,
                "router_queue_s": 0.01 * i,
                "input_tokens": 1000,
                "output_tokens": 100,
                "cached_tokens": 100 * (i // 2),  # turn t: t/10 of the prompt
                "pod": "decode-0",
                "status": 200,
            }
        )
    rows.append({"request_id": "bad", "session": "s0", "turn": 5, "send_time": 3.0, "status": 500, "error": "boom"})
    return rows


@pytest.fixture
def h5(tmp_path):
    path = tmp_path / "run" / "metrics.h5"
    path.parent.mkdir()
    meta = {"spec": DeploymentSpec(), "policy": "precise", "run_id": "demo-x", "start_time": 1_700_000_000.0}
    w = MetricsWriter(path, "client", meta)
    w.append_requests(_rows())
    w.append_timeseries({"t": 0.0, "tokens_in_per_s": 100.0, "hit_share_gpu": 0.5, "hit_share_cpu": 0.1})
    w.append_timeseries({"t": 1.0, "tokens_in_per_s": 300.0, "hit_share_gpu": 0.7, "hit_share_cpu": 0.0})
    w.close()
    return path


def test_summary_numbers(h5) -> None:
    s = summarize(h5, label="precise", preemptions=3)
    assert s.requests == 11 and s.errors == 1
    assert s.input_tokens == 10_000 and s.output_tokens == 1000
    assert s.duration_s == pytest.approx(11.0)  # first send at 0, last completion at 9 + 2
    assert s.input_tokens_per_min == pytest.approx(10_000 * 60 / 11)
    assert s.output_tokens_per_min == pytest.approx(1000 * 60 / 11)
    assert s.ttft_p50_s == pytest.approx(np.percentile(np.arange(1, 11) / 10, 50))
    assert s.ttft_p90_s == pytest.approx(np.percentile(np.arange(1, 11) / 10, 90))
    assert s.router_queue_p90_s == pytest.approx(np.percentile(np.arange(10) / 100, 90))
    assert s.hit_share == pytest.approx(2000 / 10_000)
    # Tier split: prompt-token weighted means of the time series' shares.
    assert s.hit_share_gpu == pytest.approx((0.5 * 100 + 0.7 * 300) / 400)
    assert s.hit_share_cpu == pytest.approx(0.1 * 100 / 400)
    assert s.preemptions == 3
    table = {row[0]: row[1] for row in summary_rows([s])}
    assert table["requests"] == "11" and table["errors"] == "1" and table["preemptions"] == "3"
    assert table["cache-hit share"].startswith("20.0% (GPU 65.0%, CPU 2.5%)")


def test_hit_share_per_turn(h5) -> None:
    share = hit_share_per_turn(read_requests(h5))
    assert list(share.index) == [0, 1, 2, 3, 4]
    assert share.to_numpy() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_summary_of_an_empty_file(tmp_path) -> None:
    path = tmp_path / "empty.h5"
    MetricsWriter(path, "client").close()
    s = summarize(path)
    assert s.requests == 0 and s.ttft_p50_s is None and s.hit_share is None
    assert summary_rows([s])[3][1] == "-"


def test_export_validates_with_llmd_benchmark_report(h5) -> None:
    report = report_for_file(h5)
    br = validate(report)
    assert br.version == "0.2"
    agg = report["results"]["request_performance"]["aggregate"]
    assert agg["requests"]["total"] == 11 and agg["requests"]["failures"] == 1
    ttft = agg["latency"]["time_to_first_token"]
    assert ttft["units"] == "s" and ttft["p50"] == pytest.approx(0.55)
    assert agg["latency"]["time_per_output_token"]["units"] == "s/token"
    assert agg["throughput"]["output_token_rate"] == {"units": "tokens/s", "mean": pytest.approx(1000 / 11)}
    assert agg["throughput"]["request_rate"]["units"] == "queries/s"
    stack = report["scenario"]["stack"]
    roles = [c["standardized"].get("role") for c in stack if c["standardized"]["kind"] == "inference_engine"]
    assert roles == ["prefill", "decode"]
    assert stack[0]["standardized"]["model"]["name"] == "tiny"
    assert report["scenario"]["load"]["standardized"]["multi_turn"]["max_turns"]["value"] == 5  # turns 0-4 succeeded
    assert report["scenario"]["load"]["native"]["config"]["profile"] == "smoke"
    assert report["run"]["time"]["start"].startswith("2023-11-14T22:13:20")
    assert report["results"]["session_performance"]["sessions"]["total"] == 2
    json.dumps(report, allow_nan=False)  # no NaN anywhere


def test_export_cli_writes_yaml_and_json(h5, tmp_path, capsys) -> None:
    from llmd.report.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["export", str(h5.parent)])
    assert args.func(args) == 0
    data = yaml.safe_load((h5.parent / "benchmark_report.yaml").read_text())
    validate(data)
    out = tmp_path / "br.json"
    args = parser.parse_args(["export", str(h5), "--out", str(out)])
    assert args.func(args) == 0
    validate(json.loads(out.read_text()))
    assert "wrote" in capsys.readouterr().out


def test_export_cli_names_a_missing_run(tmp_path) -> None:
    from llmd.errors import UserError
    from llmd.report.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["export", str(tmp_path / "nothing")])
    with pytest.raises(UserError, match=r"no metrics\.h5"):
        args.func(args)


def test_stats_skip_non_finite() -> None:
    s = stats([1.0, math.nan, 3.0], "s")
    assert s is not None and s["mean"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0
    assert stats([math.nan], "s") is None
