"""The load generator against a real simulated engine over HTTP on 127.0.0.1: every planned request becomes a row with
sane values, engine failures become error rows, a stop ends the run with a readable file, and `llmd bench` explains
an unreachable URL."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import h5py
import pytest
from netutil import DroppingSimServer, run

from llmd.engines.sim.core import SimEngineConfig
from llmd.engines.sim.runner import FaultConfig
from llmd.engines.sim.server import SimServer
from llmd.engines.sim.server_config import SimServerConfig
from llmd.metrics import read_requests, read_timeseries
from llmd.metrics.schema import pd_path_of as pd_path
from llmd.spec.model import WorkloadSpec
from llmd.tokens import Tokenizer
from llmd.workload import profile_from_spec
from llmd.workload.loadgen import LoadConfig, LoadSummary, run_load


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def sim(model_dir: Path, **kw: Any) -> SimServerConfig:
    engine = SimEngineConfig(block_size=16, num_gpu_blocks=4096, max_model_len=8192)
    kw.setdefault("time_scale", 0.0)
    return SimServerConfig(str(model_dir), engine=engine, side_channel_port=None, served_name="tiny", **kw)


def load(url: str, model_dir: Path, tok: Tokenizer, out: Path, time_scale: float = 0.02, **kw: Any) -> LoadConfig:
    workload = profile_from_spec(WorkloadSpec(profile="smoke", time_scale=time_scale), out.parent.name)
    kw.setdefault("progress", False)
    return LoadConfig(url, "tiny", str(model_dir), workload, out, tokenizer=tok, **kw)


def test_smoke_profile_every_request_recorded(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "run" / "metrics.h5"

    async def body() -> tuple[LoadConfig, LoadSummary]:
        async with SimServer(sim(model_dir)) as s:
            cfg = load(s.url, model_dir, tok, out, meta={"spec": "name: x\n", "seed": 0})
            return cfg, await run_load(cfg)

    cfg, summary = run(body, 30)
    planned = {(t.session_id, t.turn_index): t for plan in cfg.workload.sessions() for t in plan.all_turns()}
    assert summary.requests == len(planned) and summary.errors == 0 and not summary.stopped
    assert summary.sessions == 4 and summary.subagent_sessions == 3
    df = read_requests(out)
    assert len(df) == len(planned)
    assert set(zip(df.session, df.turn, strict=True)) == set(planned)
    for r in df.itertuples():
        t = planned[(r.session, r.turn)]
        # Exact prompt sizes and planned output lengths (ignore_eos).
        assert r.input_tokens == t.input_tokens and r.output_tokens == t.output_tokens
        assert r.is_subagent == t.is_subagent
        assert r.status == 200 and r.error == "" and r.source == "client"
        assert 0 < r.ttft_s <= r.e2e_s and r.send_time >= 0
        assert r.pd_path == "decode-only"
        if t.output_tokens > 1:
            assert r.itl_max_s >= r.itl_p50_s >= 0
    later = df[(df.turn > 0) | df.is_subagent]
    assert (later.cached_tokens > 0).all()
    assert df.is_subagent.sum() == 6  # 3 sub-agents x 2 turns
    assert summary.input_tokens == df.input_tokens.sum() and summary.cached_tokens == df.cached_tokens.sum()
    ts = read_timeseries(out)
    assert ts.requests_per_s.sum() == len(df) and (ts.source == "client").all()
    with h5py.File(out, "r") as f:
        assert f.attrs["producer"] == "client" and f.attrs["profile"] == "smoke"
        assert f["meta/spec"][()].decode() == "name: x\n"


def test_engine_failures_become_error_rows(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "fail" / "metrics.h5"

    async def body() -> LoadSummary:
        async with SimServer(sim(model_dir, faults=FaultConfig(failure_rate=1.0))) as s:
            return await run_load(load(s.url, model_dir, tok, out))

    summary = run(body, 30)
    df = read_requests(out)
    # A failed turn ends its session: one error row per main session, no crash.
    assert summary.requests == summary.errors == len(df) == 4
    assert (df.status == 500).all() and df.error.str.startswith("HTTP 500").all()
    assert (df.turn == 0).all()


def test_connection_dropped_before_an_answer_is_resent(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    """`llmd bench` pointed straight at a vLLM server: one whose keep-alive closes a pooled connection as a turn goes
    out costs that turn nothing (the POST is sent again), while a server that keeps dropping is an error row."""
    out = tmp_path / "dropped" / "metrics.h5"

    async def body() -> LoadSummary:
        async with DroppingSimServer(sim(model_dir)) as s:
            assert isinstance(s, DroppingSimServer)
            s.drops = 3  # three requests each lose their first connection
            summary = await run_load(load(s.url, model_dir, tok, out))
            assert s.drops == 0
            return summary

    summary = run(body, 30)
    df = read_requests(out)
    assert summary.errors == 0 and (df.status == 200).all() and (df.output_tokens > 0).all()

    async def always() -> LoadSummary:
        async with DroppingSimServer(sim(model_dir)) as s:
            assert isinstance(s, DroppingSimServer)
            s.drops, s.again = 10**6, True
            return await run_load(load(s.url, model_dir, tok, tmp_path / "always" / "metrics.h5", max_requests=2))

    summary = run(always, 30)
    df = read_requests(tmp_path / "always" / "metrics.h5")
    assert summary.errors == len(df) >= 1 and df.error.str.contains("Disconnected").all(), df.error.tolist()


def test_connection_errors_become_rows(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "refused" / "metrics.h5"
    url = f"http://127.0.0.1:{closed_port()}"
    summary = run(lambda: run_load(load(url, model_dir, tok, out, max_requests=2)), 30)
    df = read_requests(out)
    assert summary.errors == len(df) >= 1 and (df.status == 0).all()
    assert df.error.str.contains("Connect").all()


def test_stop_event_ends_run_cleanly(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "stop" / "metrics.h5"

    async def body() -> LoadSummary:
        # After the 3rd request the engine answers nothing more and running streams stall: only the stop ends them.
        async with SimServer(sim(model_dir, faults=FaultConfig(hang_after=3))) as s:
            stop = asyncio.Event()
            cfg = load(s.url, model_dir, tok, out, time_scale=0.01, progress=True)
            task = asyncio.create_task(run_load(cfg, stop))
            await asyncio.sleep(1.0)
            assert not task.done()
            stop.set()
            return await asyncio.wait_for(task, 5)

    summary = run(body, 30)
    assert summary.stopped and summary.aborted >= 1
    df = read_requests(out)
    assert len(df) == summary.requests
    assert (df.error == "aborted").sum() == summary.aborted
    assert ((df.error == "") & (df.status == 200) | (df.error == "aborted")).all()


def test_existing_output_never_overwritten(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    out = tmp_path / "metrics.h5"
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        run(lambda: run_load(load("http://127.0.0.1:1", model_dir, tok, out)))
    assert out.read_bytes() == b"keep"


def test_pd_path_from_headers() -> None:
    assert pd_path({"x-llmd-pd": "ok"}) == "pd"
    assert pd_path({"x-llmd-pd": "fallback"}) == "pd-fallback"
    assert pd_path({"x-llmd-p2p-source": "pod-1"}) == "p2p"
    assert pd_path({}) == "decode-only"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_cli_unreachable_url(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from llmd.errors import UserError
    from llmd.workload import bench_cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model:\n  path: {model_dir}\n")
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    url = f"http://127.0.0.1:{closed_port()}"
    args = parser.parse_args(["bench", "--spec", str(spec), "--url", url, "--output", str(tmp_path / "res")])
    with pytest.raises(UserError) as e:
        args.func(args)
    assert url in str(e.value) and "start the router" in str(e.value)
    assert not (tmp_path / "res").exists()

    args = parser.parse_args(["bench", "--spec", str(spec), "--url", "localhost:8000"])
    with pytest.raises(UserError, match="not an http"):
        args.func(args)
    (tmp_path / "res" / "r1").mkdir(parents=True)
    (tmp_path / "res" / "r1" / "metrics.h5").write_bytes(b"an earlier run")
    args = parser.parse_args(["bench", "--spec", str(spec), "--url", url, "--output", str(tmp_path / "res")])
    args.run = "r1"
    with pytest.raises(UserError, match="never overwritten"):
        args.func(args)


def test_prompt_error_is_a_row_and_the_run_continues(
    model_dir: Path, tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmd.workload import loadgen
    from llmd.workload.prompts import PromptWriter

    class Failing(PromptWriter):
        """Cannot build the second turn of session a1-s0."""

        def session(self, plan, system_tokens, parent=None):  # type: ignore[no-untyped-def]
            for pt in super().session(plan, system_tokens, parent):
                if pt.turn.session_id == "a1-s0" and pt.turn.turn_index == 1:
                    raise ValueError("need at least one token of text, got -3")
                yield pt

    monkeypatch.setattr(loadgen, "PromptWriter", Failing)
    out = tmp_path / "prompt" / "metrics.h5"

    async def body() -> tuple[LoadConfig, LoadSummary]:
        async with SimServer(sim(model_dir)) as s:
            cfg = load(s.url, model_dir, tok, out)
            return cfg, await run_load(cfg)

    cfg, summary = run(body, 30)
    planned = {(t.session_id, t.turn_index) for plan in cfg.workload.sessions() for t in plan.all_turns()}
    df = read_requests(out)
    bad = df[df.error != ""]
    # One error row for the failed turn; that session ends there (its turn 2 is never sent), every other turn runs.
    assert len(bad) == summary.errors == 1 and not summary.stopped
    row = bad.iloc[0]
    assert (row.session, row.turn, row.status) == ("a1-s0", 1, 0) and row.error.startswith("prompt: ValueError")
    assert set(zip(df.session, df.turn, strict=True)) == planned - {("a1-s0", 2)}
    assert summary.requests == len(df) == len(planned) - 1 and summary.sessions == 4


def test_send_times_count_from_the_files_start_time(model_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    """A caller that started the run earlier (main_job passes the run's start) gets rows on that clock: send_time is
    seconds since the file's start_time, so the client's rows line up with the router's and engines' by wall clock."""
    out = tmp_path / "run" / "metrics.h5"
    started = time.time() - 30.0

    async def body() -> LoadSummary:
        async with SimServer(sim(model_dir)) as s:
            return await run_load(load(s.url, model_dir, tok, out, meta={"start_time": started}, max_requests=3))

    before = time.time()
    assert run(body, 30).requests == 3
    df = read_requests(out)
    with h5py.File(out, "r") as f:
        assert f.attrs["start_time"] == pytest.approx(started)
    lo, hi = before - started, time.time() - started
    assert ((df.send_time >= lo - 0.5) & (df.send_time <= hi + 0.5)).all(), (lo, hi, list(df.send_time))
