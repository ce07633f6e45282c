"""`llmd demo` end to end in CI mode (--short): simulated prefill and decode engines, the router and the load generator
in this process over real HTTP and ZMQ on 127.0.0.1; results on disk, a summary, figures, nothing left running."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from llmd.cli import main
from llmd.metrics import read_meta, read_requests, read_timeseries

pytestmark = pytest.mark.integration


def _ports_of(endpoint: str | None) -> list[int]:
    if not endpoint or ":" not in endpoint:
        return []
    return [int(endpoint.rsplit(":", 1)[1])]


@pytest.fixture
def used_ports(monkeypatch) -> list[int]:
    """Every TCP port the demo's engines and router listen on, recorded as they start."""
    from llmd.engines.sim.server import SimServer
    from llmd.router.proxy import Router

    ports: list[int] = []
    sim_start, router_start = SimServer.start, Router.start

    async def sim(self):
        out = await sim_start(self)
        ports.append(self.port)
        for p in self.publishers:
            ports.extend(_ports_of(p.endpoint))
            ports.extend(_ports_of(getattr(p, "replay_endpoint", None)))
        ports.extend(s.port for s in self.side_channels)
        return out

    async def router(self):
        out = await router_start(self)
        ports.append(self.port)
        return out

    monkeypatch.setattr(SimServer, "start", sim)
    monkeypatch.setattr(Router, "start", router)
    return ports


def _children() -> list[str]:
    me = str(os.getpid())
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    kids.append(d.name)
            except (OSError, IndexError):
                pass
    return kids


def test_demo_short_runs_end_to_end_and_cleans_up(tmp_path, monkeypatch, capsys, used_ports) -> None:
    monkeypatch.chdir(tmp_path)  # the embedded default makes its tokenizer under ./models/tiny
    threads_before = {t.ident for t in threading.enumerate()}
    children_before = set(_children())  # earlier tests may have left their own
    t0 = time.monotonic()
    rc = main(["demo", "--short", "--output", str(tmp_path / "results")])
    assert rc == 0
    assert time.monotonic() - t0 < 60
    assert (tmp_path / "models" / "tiny" / "tokenizer.json").exists()
    (run,) = (tmp_path / "results").iterdir()
    h5 = run / "metrics.h5"
    every = read_requests(h5)
    # One run file from three producers' own files: the client's rows, the router's, the engines' series.
    assert set(read_meta(h5)["sources"]) == {"client", "router", "engines"}
    df = every[every.source == "client"]
    router = every[every.source == "router"]
    # The smoke profile: 4 agents x 1 session x 3 turns, plus agent 0's fixed burst of 3 sub-agents x 2 turns.
    assert len(df) == 18
    # The router saw the same requests (ids and sessions as the client sent them) and chose the pods the client saw.
    assert len(router) == 18 and set(router["request_id"]) == set(df["request_id"])
    both = df.merge(router, on="request_id", suffixes=("", "_r"))
    assert (both["pod"] == both["pod_r"]).all() and (both["session"] == both["session_r"]).all()
    assert (both["pd_path"] == both["pd_path_r"]).all()
    ts = read_timeseries(h5)
    engines = ts[ts.source.str.match(r"^(prefill|decode)-\d+$")]
    assert set(engines.source) == {"prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1"}
    assert engines["tokens_in_per_s"].sum() > 0 and (engines["preemptions"] >= 0).all()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preemptions"] == int(engines["preemptions"].sum())
    assert (df["status"] == 200).all() and (df["error"] == "").all()
    assert set(df["pd_path"]) <= {"pd", "decode-only", "p2p", "pd-fallback"} and "pd" in set(df["pd_path"])
    assert df["cached_tokens"].sum() > 0
    meta = read_meta(h5)
    assert meta["policy"] == "precise" and "prefill" in meta["spec"]
    for name in ("ttft_cdf.png", "throughput.png", "cache_hit_per_turn.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "(3 prefill + 2 decode)" in out  # the embedded deployment's title
    for label in ("requests", "TTFT p90", "router queue p90", "cache-hit share", "preemptions", "errors"):
        assert label in out
    assert " 18 " in out  # the requests row
    # Nothing left behind: every port free again, no child processes, no new non-daemon threads.
    assert len(used_ports) >= 5 * 2 + 1  # five engines (HTTP + ZMQ) and the router
    for port in used_ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    assert set(_children()) <= children_before
    leftover = [t for t in threading.enumerate() if t.ident not in threads_before and not t.daemon]
    assert leftover == []


def test_demo_export_of_its_run_validates(tmp_path, monkeypatch) -> None:
    from llmd.report.export import report_for_file

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--short", "--duration", "3", "--output", "results"]) == 0
    (run,) = (tmp_path / "results").iterdir()
    report = report_for_file(run / "metrics.h5")
    assert report["results"]["request_performance"]["aggregate"]["requests"]["total"] > 0
    assert report["results"]["observability"]["vllm_num_preemptions_total"]["aggregated"]["units"] == "count"


def test_demo_with_a_spec_whose_model_has_no_tokenizer_names_the_fix(tmp_path, capsys) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model:\n  path: {tmp_path / 'nowhere'}\n")
    assert main(["demo", "--spec", str(spec), "--output", str(tmp_path / "results")]) == 2
    assert "llmd model make-tiny" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_demo_rejects_a_bad_duration(value, tmp_path, capsys) -> None:
    assert main(["demo", "--short", f"--duration={value}", "--output", str(tmp_path / "r")]) == 2
    assert "--duration must be a positive number of seconds" in capsys.readouterr().err


def test_demo_rejects_a_duration_that_is_no_number(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--duration", "soon"])
    assert exc.value.code == 2
    assert "--duration" in capsys.readouterr().err


def test_demo_embedded_deployment_has_a_constrained_kv_cache(tmp_path) -> None:
    """Routing must matter in the default demo: several engines per role, each too small to cache every session."""
    import argparse

    from llmd.demo import _load_spec

    args = argparse.Namespace(spec=None, short=False, compare=True, duration=None)
    spec = _load_spec(args)
    assert spec.prefill.replicas >= 2 and spec.decode.replicas >= 2
    assert spec.kv.gpu_blocks is not None and spec.kv.gpu_blocks <= 2048
    assert spec.kv.cpu_bytes == 0
    assert spec.workload.concurrency > spec.decode.replicas


def test_demo_embedded_deployment_is_under_kv_pressure_with_prefill_that_costs() -> None:
    """--compare can only show what routing is for if the agents' live sessions fill what the prefill pool caches (the
    main sessions' mean contexts alone about fill it; sub-agents and requests in flight add to that) and a recomputed
    prefix costs time (the tiny model's own step times would make every prefill free)."""
    import argparse

    from llmd.demo import _load_spec
    from llmd.perf.latency import LatencyModel
    from llmd.workload.profiles import profile_from_spec

    spec = _load_spec(argparse.Namespace(spec=None, short=False, compare=True, duration=None))
    w = profile_from_spec(spec.workload)
    live = []
    for agent in range(spec.workload.concurrency):
        plans = w.agent_sessions(agent)
        first = next(plans)
        live.append(sum(t.input_tokens for t in first.turns) / len(first.turns))
    working_set = sum(live)
    assert spec.kv.gpu_blocks is not None
    pool_kv = spec.prefill.replicas * (spec.kv.gpu_blocks - 1) * spec.model.block_size
    assert working_set > 0.9 * pool_kv, (working_set, pool_kv)
    assert LatencyModel.from_spec(spec, "prefill").prefill_time(2048) > 0.02
    assert spec.model.tokenizer is not None and Path(spec.model.tokenizer).name == "tiny"


def test_demo_from_a_spec_file_keeps_its_model(tmp_path) -> None:
    import argparse

    from llmd.demo import _load_spec
    from llmd.spec import DeploymentSpec, dump_spec

    path = tmp_path / "spec.yaml"
    path.write_text(dump_spec(DeploymentSpec()))
    spec = _load_spec(argparse.Namespace(spec=path, short=False, compare=False, duration=None))
    assert spec.model.path == DeploymentSpec().model.path
