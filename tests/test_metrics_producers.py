"""The router and the simulated engines write their own HDF5 through llmd.metrics' one schema: rows per routed request,
per-second series, readable while they run, merged with the client's into one run file."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from netutil import run
from routerutil import Servers, engine, pod_of, rconfig

from llmd.cli import main
from llmd.engines.sim.core import EngineStats
from llmd.engines.sim.series import EngineSeries, engine_row
from llmd.metrics import merge_runs, read_meta, read_requests, read_timeseries
from llmd.router.proxy import Router

REPO = Path(__file__).resolve().parent.parent


def _stats(**kw: Any) -> EngineStats:
    base: dict[str, Any] = dict.fromkeys(EngineStats.__dataclass_fields__, 0)
    base.update(kv_cache_usage_perc=0.0, cpu_cache_usage_perc=0.0, request_success={})
    base.update(kw)
    return EngineStats(**base)


def test_engine_row_turns_cumulative_counters_into_one_bin() -> None:
    prev = _stats(prompt_tokens_total=100, prefix_cache_queries=100, prefix_cache_hits=40, request_success={"stop": 1})
    cur = _stats(
        prompt_tokens_total=300,
        generation_tokens_total=50,
        prefix_cache_queries=300,
        prefix_cache_hits=190,
        cpu_prefix_cache_hits=20,
        num_preemptions=2,
        num_pulls_ok=3,
        num_pulls_failed=1,
        request_success={"stop": 3, "error": 1},
        num_requests_running=4,
        num_requests_waiting=5,
        kv_cache_usage_perc=0.5,
    )
    row = engine_row("decode-0", 7.0, 2.0, prev, cur)
    assert row["t"] == 7.0 and row["source"] == "decode-0"
    assert row["tokens_in_per_s"] == 100.0 and row["tokens_out_per_s"] == 25.0 and row["requests_per_s"] == 1.5
    assert row["hit_share_gpu"] == 0.75 and row["hit_share_cpu"] == 0.1
    assert row["preemptions"] == 2 and row["kv_transfers"] == 3 and row["errors"] == 2
    assert (row["running"], row["queue_len"], row["kv_usage"]) == (4, 5, 0.5)
    assert math.isnan(engine_row("d", 0.0, 1.0, cur, cur)["hit_share_gpu"])  # no queries: unknown, not 0


def test_router_and_engine_files_are_readable_mid_run_and_merge_with_the_client(model_dir: Path, tmp_path) -> None:
    router_h5, engines_h5, client_h5 = tmp_path / "router.h5", tmp_path / "engines.h5", tmp_path / "client.h5"
    from llmd.metrics import MetricsWriter

    async def body() -> None:
        async with Servers() as ss:
            servers = [await ss.start(engine(model_dir, f"d{i}", "decode")) for i in range(2)]
            series = EngineSeries(servers, engines_h5)
            try:
                cfg = rconfig(model_dir, metrics_out=str(router_h5), metrics_meta={"run_id": "t"})
                client = MetricsWriter(client_h5, "client")
                async with Router(cfg, [pod_of(s) for s in servers]) as router:
                    t0 = time.monotonic()
                    while len(router.registry.healthy()) < 2 and time.monotonic() - t0 < 10:
                        await asyncio.sleep(0.05)
                    async with aiohttp.ClientSession() as http:
                        for i in range(6):
                            sid = f"s{i % 3}"
                            rid = f"{sid}#{i}"
                            body = {"model": "tiny", "prompt": f"session {sid} says hello " * 20, "max_tokens": 4}
                            headers = {"X-Request-Id": rid, "X-Session-Id": sid}
                            async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
                                assert r.status == 200
                                await r.read()
                                client.append_request({"request_id": rid, "session": sid, "status": r.status})
                        # A request the router refuses (400) is a row too, with its status.
                        async with http.post(router.url + "/v1/completions", json={"model": "tiny"}) as r:
                            assert r.status == 400
                    # Rows and series reach the disk while running, within a sampler tick or two (more on a busy
                    # machine): read until they are there, as a notebook watching a run would.
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        await asyncio.sleep(0.5)
                        sources = set(read_timeseries(engines_h5)["source"]) | set(read_timeseries(router_h5)["source"])
                        if len(read_requests(router_h5)) == 7 and {"d0", "d1", "router/d0", "router/d1"} <= sources:
                            break
                    live = read_requests(router_h5)
                    assert len(live) == 7 and set(live["status"]) == {200, 400}
                    ok = live[live.status == 200]
                    assert set(ok["pod"]) <= {"d0", "d1"} and (ok["pd_path"] == "decode-only").all()
                    assert (ok["input_tokens"] > 0).all() and (ok["expected_hit_tokens"] >= 0).all()
                    assert set(ok["route_reason"]) and (ok["route_reason"] != "").all()
                    assert sorted(ok["session"]) == sorted(f"s{i % 3}" for i in range(6))
                    ts = read_timeseries(router_h5)
                    assert {"router", "router/d0", "router/d1"} <= set(ts["source"])
                    assert ts[ts.source == "router"]["requests_per_s"].sum() > 0
                    eng = read_timeseries(engines_h5)
                    assert {"d0", "d1"} <= set(eng["source"])
                    assert eng["tokens_in_per_s"].sum() > 0 and (eng["preemptions"] >= 0).all()
                    # Merging while every producer still writes (SWMR readers).
                    merge_runs([client_h5, router_h5, engines_h5], tmp_path / "live.h5")
                client.close()
            finally:
                await series.close()

    run(body, 40.0)
    out = merge_runs([client_h5, router_h5, engines_h5], tmp_path / "metrics.h5")
    df = read_requests(out)
    client, router = df[df.source == "client"], df[df.source == "router"]
    assert len(client) == 6 and len(router) == 7
    # Router and client agree on which requests were made.
    assert set(client["request_id"]) == set(router[router.status == 200]["request_id"])
    assert set(read_meta(out)["sources"]) == {"client", "router", "engines"}
    assert len(read_requests(tmp_path / "live.h5")) >= 7


def test_metrics_out_refuses_an_existing_file(tmp_path, capsys) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\n")
    taken = tmp_path / "taken.h5"
    taken.write_bytes(b"keep me")
    assert main(["router", "--spec", str(spec), "--metrics-out", str(taken)]) == 2
    assert "--metrics-out" in capsys.readouterr().err
    assert main(["engine", "sim", "--metrics-out", str(taken)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert taken.read_bytes() == b"keep me"


def test_engine_sim_cli_writes_its_series_until_sigterm(model_dir: Path, tmp_path) -> None:
    out = tmp_path / "engine.h5"
    cmd = [sys.executable, "-m", "llmd.cli", "engine", "sim", "--model", str(model_dir), "--port", "0",
           "--no-side-channel", "--name", "solo", "--metrics-out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            if out.exists():
                try:
                    if len(read_timeseries(out)) >= 2:
                        break
                except OSError:
                    pass  # the file is being created
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ts = read_timeseries(out)
    assert len(ts) >= 2 and set(ts["source"]) == {"solo"}
    assert read_meta(out)["producer"] == "solo"


def test_llmd_merge_turns_a_run_folder_into_one_run_file(tmp_path, capsys) -> None:
    from llmd.metrics import MetricsWriter

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with MetricsWriter(run_dir / "metrics.h5", "client", {"seed": 3}) as w:  # what `llmd bench` leaves
        w.append_requests([{"request_id": f"r{i}", "status": 200} for i in range(3)])
    with MetricsWriter(run_dir / "router.h5", "router") as w:
        w.append_requests([{"request_id": f"r{i}", "status": 200} for i in range(3)])
    with MetricsWriter(run_dir / "engines.h5", "engines") as w:
        w.append_timeseries([{"t": 0.0, "source": "decode-0", "preemptions": 0}])
    assert main(["merge", str(run_dir)]) == 0
    assert "merged 3 files" in capsys.readouterr().out
    df = read_requests(run_dir / "metrics.h5")
    assert sorted(df.source) == ["client"] * 3 + ["router"] * 3
    meta = read_meta(run_dir / "metrics.h5")
    assert meta["producer"] == "merge" and meta["seed"] == 3 and set(meta["sources"]) == {"client", "router", "engines"}
    assert len(read_requests(run_dir / "client.h5")) == 3  # the client's own file, kept
    assert main(["merge", str(run_dir)]) == 2  # merged already: refused, nothing touched
    assert "already a merged run file" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "nowhere")]) == 2
