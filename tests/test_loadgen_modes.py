"""Open-loop arrivals and trace replay in the load generator and `llmd bench`, against a real simulated engine over
HTTP on 127.0.0.1: row counts, send-time spacing against the seeded Poisson process and the trace's offsets,
sub-agents forking from their parent's context, and bad traces refused with the line named."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from netutil import run
from test_loadgen import load, sim

from llmd.engines.sim.server import SimServer
from llmd.errors import UserError
from llmd.metrics import read_meta, read_requests
from llmd.tokens import Tokenizer
from llmd.workload.loadgen import LoadConfig, LoadSummary, run_load
from llmd.workload.trace import TraceError, read_trace, trace_sessions


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def test_open_loop_sessions_arrive_as_the_seeded_poisson_process(model_dir: Path, tok: Tokenizer, tmp_path) -> None:
    out = tmp_path / "open" / "metrics.h5"
    rate, duration = 25.0, 3.0

    async def body() -> tuple[LoadConfig, LoadSummary]:
        async with SimServer(sim(model_dir)) as s:
            cfg = load(s.url, model_dir, tok, out, arrival_rate=rate, duration_s=duration)
            return cfg, await run_load(cfg)

    cfg, summary = run(body, 40)
    df = read_requests(out)
    assert summary.errors == 0 and summary.requests == len(df)
    firsts = df[(df.turn == 0) & ~df.is_subagent].sort_values("send_time")
    # The arrival times the seed fixes: session k ("a<k>-s0") at the k-th cumulative exponential gap.
    gaps = np.random.default_rng([cfg.workload.seed, 0x0A11]).exponential(1 / rate, 1000)
    planned = np.cumsum(gaps)
    planned = planned[planned < duration]
    assert summary.sessions == len(planned)
    # A session arriving in the run's last moments may find the duration over before its first turn is sent.
    assert len(planned) - 2 <= len(firsts) <= len(planned)
    assert 0.6 * rate * duration < len(planned) < 1.4 * rate * duration
    sent = firsts.set_index("session").send_time
    want = {f"a{k}-s0": t for k, t in enumerate(planned)}
    assert set(sent.index) <= set(want)
    late = np.array([sent[s] - want[s] for s in sent.index])
    # Never early; late only by the event loop's scheduling (generous: CI machines are shared).
    assert (late > -0.01).all() and np.median(late) < 0.1 and np.percentile(late, 90) < 0.5, late
    # The seeded process itself has the rate and the spread of a Poisson process (exponential gaps: CV ~1) ...
    gaps_planned = np.diff(planned)
    assert abs(gaps_planned.mean() - 1 / rate) < 0.35 / rate
    assert 0.6 < gaps_planned.std() / gaps_planned.mean() < 1.5
    # ... and the sends follow it.
    spacing = np.diff(firsts.send_time.to_numpy())
    assert abs(spacing.mean() - gaps_planned.mean()) < 0.25 / rate
    # Each session still runs its turns in order after its arrival (closed loop within the session).
    for _, g in df[~df.is_subagent].groupby("session"):
        assert list(g.sort_values("send_time").turn) == list(range(len(g)))


def test_open_loop_needs_a_bound_and_a_rate(model_dir: Path, tok: Tokenizer, tmp_path) -> None:
    async def body(**kw: Any) -> None:
        await run_load(load("http://127.0.0.1:9", model_dir, tok, tmp_path / "x" / "m.h5", **kw))

    with pytest.raises(ValueError, match="positive number"):
        run(lambda: body(arrival_rate=0.0, duration_s=1.0))
    with pytest.raises(ValueError, match="until a duration ends"):
        run(lambda: body(arrival_rate=5.0))


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRACE = [
    {"session": "main", "t": 0.0, "input_tokens": 300, "output_tokens": 20},
    {"session": "other", "t": 0.25, "input_text": "a recorded prompt, " * 30, "output_tokens": 8},
    {"session": "main", "t": 0.5, "input_tokens": 420, "output_tokens": 20},
    {"session": "sub", "parent": "main", "t": 0.6, "input_tokens": 500, "output_tokens": 10},
    {"session": "main", "t": 1.0, "input_tokens": 520, "output_tokens": 5},
    {"session": "sub", "parent": "main", "t": 0.9, "input_tokens": 560, "output_tokens": 10},
    {"session": "other", "t": 1.2, "input_text": "a recorded prompt, " * 30 + "and its follow-up", "output_tokens": 4},
]


def test_trace_replay_honours_offsets_and_forks_from_the_parent(model_dir: Path, tok: Tokenizer, tmp_path) -> None:
    path = _write(tmp_path / "t.jsonl", TRACE)
    sessions = trace_sessions(list(read_trace(path, tokenizer=tok)), str(path))
    assert [s.session_id for s in sessions] == ["main", "other", "sub"] and sessions[2].parent == "main"
    out = tmp_path / "trace" / "metrics.h5"

    async def body() -> LoadSummary:
        async with SimServer(sim(model_dir)) as s:
            return await run_load(load(s.url, model_dir, tok, out, trace=sessions))

    summary = run(body, 40)
    df = read_requests(out).sort_values("send_time")
    assert len(df) == len(TRACE) == summary.requests and summary.errors == 0
    assert summary.sessions == 2 and summary.subagent_sessions == 1
    for rec, (_, row) in zip(sorted(TRACE, key=lambda r: r["t"]), df.iterrows(), strict=True):
        assert row.session == rec["session"]
        # Sent at the record's offset (the engine answers in milliseconds here, so no turn waits for a response).
        assert rec["t"] - 0.01 <= row.send_time <= rec["t"] + 0.25, (rec, row.send_time)
        assert row.output_tokens == rec["output_tokens"]
        if "input_tokens" in rec:
            assert row.input_tokens == rec["input_tokens"]  # the prompt writer's exact sizes
    sub = df[df.session == "sub"]
    assert sub.is_subagent.all() and list(sub.turn) == [0, 1]
    # The sub-agent's first prompt extends its parent's context as of its start: it hits the parent's cached prefix.
    main_first = df[(df.session == "main") & (df.turn == 0)].iloc[0]
    assert sub.iloc[0].cached_tokens >= main_first.input_tokens - 16
    other = df[df.session == "other"]
    assert other.iloc[1].cached_tokens > 0 and other.iloc[1].input_tokens > other.iloc[0].input_tokens


@pytest.mark.parametrize(
    ("records", "line", "what"),
    [
        ([TRACE[0], {"session": "x", "t": -1, "input_tokens": 5, "output_tokens": 1}], 2, "'t'"),
        ([TRACE[0], TRACE[2], "not json"], 3, "not JSON"),
        ([{"session": "s", "t": 0, "output_tokens": 3}], 1, "input_text"),
    ],
)
def test_bench_refuses_a_bad_trace_line_naming_it(model_dir: Path, tmp_path, records, line, what) -> None:
    from llmd.workload import bench_cli

    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model:\n  path: {model_dir}\n")
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--spec", str(spec), "--url", "http://127.0.0.1:9", "--trace", str(path),
                              "--output", str(tmp_path / "res")])  # fmt: skip
    with pytest.raises(UserError) as e:
        args.func(args)
    assert f"line {line}" in str(e.value) and what in str(e.value) and str(path) in str(e.value)
    assert not (tmp_path / "res").exists()


def test_trace_parent_must_exist_and_start_first(tok: Tokenizer, tmp_path) -> None:
    orphan = _write(tmp_path / "o.jsonl", [{"session": "c", "parent": "p", "t": 0, "input_tokens": 9,
                                           "output_tokens": 1}])  # fmt: skip
    with pytest.raises(TraceError, match="not in the trace"):
        trace_sessions(list(read_trace(orphan)), "o")
    early = _write(tmp_path / "e.jsonl", [{"session": "p", "t": 1, "input_tokens": 9, "output_tokens": 1},
                                          {"session": "c", "parent": "p", "t": 0.5, "input_tokens": 9,
                                           "output_tokens": 1}])  # fmt: skip
    with pytest.raises(TraceError, match="before its parent"):
        trace_sessions(list(read_trace(early)), "e")


@contextmanager
def threaded_sim(model_dir: Path) -> Iterator[str]:
    """A sim engine on its own event loop in a thread, for CLI code that runs asyncio.run itself."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        started["server"] = loop.run_until_complete(SimServer(sim(model_dir)).start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    assert ready.wait(20)
    try:
        yield started["server"].url
    finally:
        asyncio.run_coroutine_threadsafe(started["server"].stop(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        t.join(20)
        loop.close()


def test_bench_cli_open_loop_and_trace(model_dir: Path, tmp_path) -> None:
    from llmd.workload import bench_cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: m\nmodel:\n  path: {model_dir}\n  served_name: tiny\nworkload:\n  time_scale: 0.02\n")
    trace = _write(tmp_path / "t.jsonl", TRACE)
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    with threaded_sim(model_dir) as url:
        common = ["bench", "--spec", str(spec), "--url", url, "--output", str(tmp_path / "res"), "--no-progress"]
        args = parser.parse_args([*common, "--run", "open", "--arrival-rate", "10", "--duration", "1.5"])
        assert args.func(args) == 0
        args = parser.parse_args([*common, "--run", "trace", "--trace", str(trace)])
        assert args.func(args) == 0
    open_h5, trace_h5 = tmp_path / "res" / "open" / "metrics.h5", tmp_path / "res" / "trace" / "metrics.h5"
    assert read_meta(open_h5)["mode"] == "open-loop" and read_meta(open_h5)["arrival_rate"] == 10.0
    df = read_requests(open_h5)
    assert len(df) > 0 and (df.error == "").all()
    assert read_meta(trace_h5)["mode"] == "trace"
    assert len(read_requests(trace_h5)) == len(TRACE)
    with pytest.raises(UserError, match="exclude each other"):
        args = parser.parse_args([*common, "--run", "x", "--trace", str(trace), "--arrival-rate", "1"])
        args.func(args)
