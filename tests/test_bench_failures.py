"""`llmd bench` when things go wrong: a server that is gone makes the run back off instead of firing failing requests
as fast as it can, a run that failed exits 1 and says why, and the API key (from the environment) reaches the server
but never a file or the terminal. Real HTTP on 127.0.0.1; every load loop is bounded by a duration or a request count.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from netutil import run
from routerutil import engine, pod_of, rconfig

from llmd.engines.sim.runner import FaultConfig
from llmd.engines.sim.server import SimServer
from llmd.metrics import read_requests
from llmd.net.backoff import Backoff
from llmd.router.proxy import Router
from llmd.spec.model import WorkloadSpec
from llmd.tokens import Tokenizer
from llmd.workload import profile_from_spec
from llmd.workload.bench_cli import failed_run
from llmd.workload.loadgen import LoadConfig, run_load
from llmd.workload.run_stats import LoadSummary

KEY = "sk-test-SENTINEL-7f3a"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backoff_doubles_with_full_jitter_up_to_the_cap_and_resets() -> None:
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(0))
    delays = [b.failed(0.0) for _ in range(12)]
    ceilings = [min(1.0, 0.1 * 2**k) for k in range(12)]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert b.wait_s(0.0) == max(delays) and b.wait_s(5.0) == 0.0
    b.succeeded()
    assert b.failures == 0 and b.failed(10.0) <= 0.1


def test_a_server_that_is_gone_is_backed_off_not_hammered(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without backoff this run sent ~57 failing requests a second per agent; now a few, with one warning."""
    out = tmp_path / "gone" / "metrics.h5"
    spec = WorkloadSpec(profile="smoke", time_scale=0.02, params={"sessions_per_agent": 100_000})
    cfg = LoadConfig(
        f"http://127.0.0.1:{closed_port()}",
        "tiny",
        str(model_dir),
        profile_from_spec(spec, "gone"),
        out,
        duration_s=2.0,
        progress=False,
        tokenizer=Tokenizer(model_dir),
    )
    with caplog.at_level(logging.WARNING, logger="llmd.workload.loadgen"):
        summary: LoadSummary = run(lambda: run_load(cfg), 20)
    assert summary.requests == summary.errors > 0
    # 0.1 s doubling with full jitter: a couple of dozen attempts at most in 2 s, not ~100 per agent.
    assert summary.requests < 40, summary.requests
    warnings = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(warnings) == 1 and "backing off" in warnings[0]
    assert failed_run(summary, 10.0) == f"every one of the {summary.requests:,} requests sent failed"


def test_failed_run_rule() -> None:
    def s(requests: int, errors: int, aborted: int = 0) -> LoadSummary:
        return LoadSummary(requests=requests, errors=errors, aborted=aborted)

    assert failed_run(s(0, 0), 10) is None
    assert failed_run(s(10, 1), 10) is None  # 10% is not more than 10%
    assert "2 of 10" in (failed_run(s(10, 2), 10) or "")
    assert failed_run(s(10, 10, aborted=10), 10) is None  # stopped before anything was answered
    assert "every one" in (failed_run(s(5, 5), 100) or "")


@contextmanager
def threaded(make: Any) -> Iterator[Any]:
    """Servers started by `make()` (a coroutine) on an event loop in a thread: the CLI runs asyncio.run itself."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    servers = asyncio.run_coroutine_threadsafe(make(), loop).result(30)
    try:
        yield servers
    finally:
        for s in reversed(servers):
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(20)
        loop.close()


def bench(tmp_path: Path, model_dir: Path, url: str, run_name: str) -> int:
    from llmd.workload import bench_cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: m\nmodel:\n  path: {model_dir}\n  served_name: tiny\nworkload:\n  time_scale: 0.02\n")
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    argv = ["bench", "--spec", str(spec), "--url", url, "--output", str(tmp_path / "res"), "--run", run_name,
            "--no-progress", "--max-requests", "6", "--duration", "10"]  # fmt: skip
    args = parser.parse_args(argv)
    return args.func(args)


def test_bench_exits_1_when_every_request_failed(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def start() -> list[Any]:
        return [await SimServer(engine(model_dir, "e0", faults=FaultConfig(failure_rate=1.0))).start()]

    with threaded(start) as (s,):
        assert bench(tmp_path, model_dir, s.url, "bad") == 1
    err = capsys.readouterr().err
    assert "the run failed: every one of the" in err and "requests sent failed" in err


def test_api_key_from_the_environment_is_sent_and_never_recorded(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def start() -> list[Any]:
        s = await SimServer(engine(model_dir, "e0", time_scale=0.0)).start()
        r = await Router(rconfig(model_dir, api_key=KEY), [pod_of(s)]).start()
        return [s, r]

    monkeypatch.delenv("LLMD_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with threaded(start) as (_, router):
        assert bench(tmp_path, model_dir, router.url, "keyed") == 0
        monkeypatch.setenv("LLMD_API_KEY", "wrong")  # the first of the two names wins
        assert bench(tmp_path, model_dir, router.url, "wrong") == 1
    df = read_requests(tmp_path / "res" / "keyed" / "metrics.h5")
    assert len(df) == 6 and (df.status == 200).all()
    assert (read_requests(tmp_path / "res" / "wrong" / "metrics.h5").status == 401).all()
    captured = capsys.readouterr()
    assert KEY not in captured.out and KEY not in captured.err
    for f in (tmp_path / "res").rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f
