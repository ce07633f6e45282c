"""How the router learns its engines: the discovery file, health checks, engine gauges, KV event streams (gaps,
replay, restarts) and the `llmd router` command line."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from netutil import free_ports
from routerutil import (
    BS,
    REPO,
    Servers,
    engine,
    pod_of,
    post,
    rconfig,
    run,
    until,
    words,
)

from llmd.discovery import PodInfo, parse_discovery
from llmd.engines.sim.publisher import KVEventPublisher
from llmd.errors import UserError
from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from llmd.kv.index import KVIndex
from llmd.router.endpoints import parse_engine_gauges
from llmd.router.events import READ_BURST, RankSubscription
from llmd.router.proxy import Router

# ---- discovery -------------------------------------------------------------------------------------------------------


def test_discovery_file_reload_adds_and_removes_pods(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engines.json"

    def write(pods: list[PodInfo]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([p.__dict__ for p in pods]))
        os.replace(tmp, path)  # launchers write atomically; the router reloads on the new mtime

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            a = await sv.start(engine(model_dir, "a"))
            b = await sv.start(engine(model_dir, "b"))
            write([pod_of(a)])
            async with Router(rconfig(model_dir), discovery=path) as router:
                router.registry.discovery_interval_s = 0.05
                assert set(router.registry.pods) == {"a"} and router.registry.pods["a"].healthy
                st, _, h = await post(http, router.url + "/v1/completions", {"prompt": words(1, 100), "max_tokens": 1})
                assert st == 200 and h["x-llmd-pod"] == "a"
                await until(lambda: len(router.index) > 0, what="a's events")
                write([pod_of(a), pod_of(b)])
                await until(lambda: "b" in router.registry.pods and router.registry.pods["b"].healthy, what="b added")
                write([pod_of(b)])
                await until(lambda: "a" not in router.registry.pods, what="a removed")
                assert all(x[0] != "a" for x in router.index.holders())
                for i in range(3):
                    st, _, h = await post(
                        http, router.url + "/v1/completions", {"prompt": words(i, 50), "max_tokens": 1}
                    )
                    assert st == 200 and h["x-llmd-pod"] == "b"
                path.write_text("[{")  # a torn write keeps the current set
                await asyncio.sleep(0.2)
                assert set(router.registry.pods) == {"b"} and router.registry.discovery_errors >= 1

    run(body)


def test_discovery_entries_are_validated() -> None:
    good = parse_discovery([{"name": "d0", "url": "http://h:1", "dp_size": 2, "kv_events_endpoint": "tcp://*:9"}])
    assert good[0].role == "both" and good[0].events_address(1) == ("tcp://h:10", False)
    assert good[0].engine_id_of(1) is None
    with_id = parse_discovery(
        [{"name": "d", "url": "http://h:1", "dp_size": 2, "engine_id": "x", "side_channel_port": 5}]
    )
    assert with_id[0].engine_id_of(1) == "x_dp1" and with_id[0].side_channel_of(1) == ("h", 6)
    bind = parse_discovery([{"name": "d", "url": "http://h:1", "kv_events_endpoint": "tcp://10.1.1.1:7",
                             "kv_events_bind": True}])  # fmt: skip
    assert bind[0].events_address(0) == ("tcp://10.1.1.1:7", True)
    for bad, msg in (
        ({"name": "x"}, "missing 'url'"),
        ([{"name": "x", "url": "ftp://h"}], "not an http"),
        ([{"name": "x", "url": "http://h", "role": "boss"}], "role"),
        ([{"name": "x", "url": "http://h", "dp_size": True}], "wrong type"),
        ([{"name": "x", "url": "http://h"}, {"name": "x", "url": "http://g"}], "twice"),
    ):
        with pytest.raises(UserError, match=msg):
            parse_discovery(bad if isinstance(bad, list) else [bad])
    gauges = parse_engine_gauges(
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        "vllm:kv_cache_usage_perc 0.5\n# HELP x\nvllm:other 1\n"
    )
    assert gauges == [(1, "running", 3.0), (0, "kv_usage", 0.5)]


def test_health_refusal_is_down_at_once_slowness_only_after_strikes() -> None:
    from aiohttp import web

    from llmd.router.endpoints import EndpointRegistry

    async def body() -> None:
        mode = {"slow": False}

        async def health(request: web.Request) -> web.Response:
            if mode["slow"]:
                await asyncio.sleep(1.0)
            return web.Response()

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        reg = EndpointRegistry(
            [PodInfo("p", "both", f"http://127.0.0.1:{port}")],
            health_interval_s=100,
            health_timeout_s=0.1,
            metrics_interval_s=0,
        )
        downs: list[str] = []
        reg.on_down.append(lambda pod: downs.append(pod.name))
        async with aiohttp.ClientSession() as http:
            try:
                await reg.start(http)
                pod = reg.pods["p"]
                assert pod.healthy
                mode["slow"] = True
                for strike in range(3):
                    await reg.check(pod)
                    assert pod.healthy == (strike < 2)  # busy is not dead: three slow answers in a row are
                mode["slow"] = False
                await reg.check(pod)
                assert pod.healthy
                await runner.cleanup()
                await reg.check(pod)
                assert not pod.healthy and downs == ["p", "p"]  # refused: down at the first probe
            finally:
                await reg.stop()
                await runner.cleanup()

    run(body)


# ---- KV events -------------------------------------------------------------------------------------------------------


def test_sequence_gap_is_replayed_in_order_and_restart_resets(tmp_path: Path) -> None:
    pub_port = free_ports(2)
    rep_port = pub_port + 1

    async def body() -> None:
        index = KVIndex()
        ctx = zmq.asyncio.Context()
        pub = KVEventPublisher(f"tcp://*:{pub_port}", 0, replay_endpoint=f"tcp://*:{rep_port}")
        sub = RankSubscription(
            ctx, index, "p", 0, 1, f"tcp://127.0.0.1:{pub_port}", replay_address=f"tcp://127.0.0.1:{rep_port}"
        )
        try:
            sub.start()
            await until(lambda: sub.last is None and sub._buffer is None, what="initial replay")
            x, y = [101], [202]

            def stored(h: list[int], parent: int | None = None) -> BlockStored:
                return BlockStored(h, parent, [1] * BS, BS, None, "GPU", None)

            # Slow joiner: publish until the SUB is connected, then start from a clean holder.
            for _ in range(100):
                if sub.stats.batches:
                    break
                pub.publish([stored([999])])
                await asyncio.sleep(0.05)
            pub.publish([AllBlocksCleared()])
            pub.publish([stored(x)])
            await until(lambda: 101 in index, what="x stored")
            # Drop the next frame on the wire: the batch is only in the publisher's replay buffer.
            real = pub._pub

            class Drop:
                def send_multipart(self, *a: Any, **k: Any) -> None:
                    pass

            pub._pub = Drop()  # type: ignore[assignment]
            pub.publish([BlockRemoved(x, "GPU")])
            pub._pub = real
            pub.publish([stored(x), stored(y, 101)])  # x again, then y after it
            await until(lambda: 202 in index, what="y stored")
            # In order (stored, removed, stored again) x is held; applying the removal late would have lost it.
            assert 101 in index
            assert sub.stats.replays_ok >= 2 and sub.stats.gaps == 0
            assert index.stats()["gaps"] == 0

            # The publisher restarts (seq from 0): what it said before is forgotten. Seen as a seq going backwards,
            # so the old publisher first gets well ahead of what the new one sends before the SUB reconnects.
            for i in range(60):
                pub.publish([stored([1000 + i])])
            await until(lambda: 1059 in index, what="filler")
            pub.close()
            for _ in range(50):  # the old sockets release their ports asynchronously
                try:
                    pub = KVEventPublisher(f"tcp://*:{pub_port}", 0, replay_endpoint=f"tcp://*:{rep_port}")
                    break
                except zmq.ZMQError:
                    await asyncio.sleep(0.05)
            for _ in range(40):
                if sub.stats.restarts:
                    break
                pub.publish([stored([303])])
                await asyncio.sleep(0.05)
            await until(lambda: 303 in index, what="new publisher's block")
            assert 101 not in index and 202 not in index
        finally:
            await sub.stop()
            await pub.aclose()
            ctx.term()

    run(body)


def test_unsubscribing_gives_up_the_socket_descriptor_before_closing_it() -> None:
    """A pod going down closes its subscriptions at once while their reading tasks end later. The descriptor must be
    unwatched before the socket closes: its number is soon a connection to an engine, and a reader left under it took
    that connection's wakeups (every pod went down with 'connect' once an engine was killed)."""
    port = free_ports(1)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context()
        hub_sub = RankSubscription(ctx, KVIndex(), "p", 0, 1, f"tcp://127.0.0.1:{port}")
        try:
            hub_sub.start()
            await until(lambda: hub_sub.connected.is_set(), what="reading")
            await asyncio.sleep(0)
            assert hub_sub._sub is not None
            fd = hub_sub._sub.getsockopt(zmq.FD)
            task = hub_sub._task
            assert task is not None
            task.cancel()  # as the hub's unsubscribe_now does: the task ends later, the socket goes now
            hub_sub.close_socket()
            assert hub_sub._sub is None
            assert not loop.remove_reader(fd), "the closed socket's descriptor is still watched"
            # The task's own ending must not remove a reader under the number: by then it may be someone else's.
            # (Recorded rather than registered for real: zmq may close the descriptor later, from its own thread, and
            # registering a closed one fails.)
            removed: list[int] = []
            remove_reader = loop.remove_reader

            def recording(f: Any) -> bool:
                removed.append(f)
                return remove_reader(f)

            loop.remove_reader = recording  # type: ignore[method-assign]
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            finally:
                del loop.remove_reader  # type: ignore[misc]
            assert fd not in removed, "the ended task removed a reader under the closed socket's number"
        finally:
            await hub_sub.stop()
            ctx.term()

    run(body)


def test_a_flood_of_kv_events_is_read_in_bounded_bursts() -> None:
    """Batches that queued up while the loop was busy are read READ_BURST at a time with the loop's turn between
    bursts, so requests are not held up until a flood ends, and every batch is still applied, in order."""
    port = free_ports(1)
    flood = 3 * READ_BURST + 10  # below the publisher's send high-water mark (1,000): none dropped

    async def body() -> None:
        index = KVIndex()
        ctx = zmq.asyncio.Context()
        pub = KVEventPublisher(f"tcp://*:{port}", 0)
        sub = RankSubscription(ctx, index, "p", 0, 1, f"tcp://127.0.0.1:{port}")
        try:
            sub.start()
            for _ in range(100):  # slow joiner: publish until the SUB receives
                if sub.stats.batches:
                    break
                pub.publish([AllBlocksCleared()])
                await asyncio.sleep(0.05)
            assert sub.stats.batches
            start = sub.stats.batches
            seen: list[int] = []

            async def probe() -> None:  # another task: what it sees between the subscription's turns
                while sub.stats.batches < start + flood:
                    seen.append(sub.stats.batches - start)
                    await asyncio.sleep(0)

            task = asyncio.create_task(probe())
            await asyncio.sleep(0)
            for i in range(flood):
                pub.publish([BlockStored([5000 + i], 4999 + i if i else None, [1] * BS, BS, None, "GPU", None)])
            time.sleep(0.5)  # the loop is busy: every batch reaches the SUB socket before it reads any
            await asyncio.wait_for(task, 10)
            assert any(0 < k < flood for k in seen), f"read in one go: the probe saw {sorted(set(seen))}"
            assert all(b - a <= READ_BURST for a, b in itertools.pairwise(seen))
            assert all(5000 + i in index for i in range(flood))
            assert sub.stats.gaps == 0
        finally:
            await sub.stop()
            await pub.aclose()
            ctx.term()

    run(body)


def test_router_replays_what_was_published_before_it_subscribed(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0"))
            prompt = words(9, 200)
            st, _, _ = await post(http, s.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert st == 200
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                # Nothing was published since: only the replay from seq 0 can have told the index.
                await until(lambda: len(router.index) >= 200 * 2 // BS - 1, what="replayed blocks")
                assert router.hub.stats.replay_batches >= 1

    run(body)


# ---- CLI -------------------------------------------------------------------------------------------------------------


def _parser() -> Any:
    import argparse

    from llmd.router.cli import register

    p = argparse.ArgumentParser(prog="llmd")
    register(p.add_subparsers(dest="command"))
    return p


def test_cli_refuses_bad_input_clearly(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmd.router.cli import build

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model:\n  path: {model_dir}\nrouter:\n  api_key_env: LLMD_ROUTER_TEST_KEY\n")
    monkeypatch.delenv("LLMD_ROUTER_TEST_KEY", raising=False)
    with pytest.raises(UserError, match="LLMD_ROUTER_TEST_KEY"):
        build(_parser().parse_args(["router", "--spec", str(spec)]))
    monkeypatch.setenv("LLMD_ROUTER_TEST_KEY", "k")
    router = build(_parser().parse_args(["router", "--spec", str(spec), "--port", "9123", "--policy", "round-robin"]))
    assert router.config.api_key == "k" and router.config.port == 9123 and router.config.policy == "round-robin"
    assert sorted(router.registry.pods) == ["decode-0", "prefill-0"]  # the default spec disaggregates
    nomodel = tmp_path / "nomodel.yaml"
    nomodel.write_text(f"model:\n  path: {tmp_path / 'none'}\n")
    with pytest.raises(UserError, match="tokenizer"):
        build(_parser().parse_args(["router", "--spec", str(nomodel)]))
    with pytest.raises(UserError, match="does not exist"):
        build(_parser().parse_args(["router", "--spec", str(spec), "--discovery", str(tmp_path / "no" / "x.json")]))
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": 1}')
    with pytest.raises(UserError, match="JSON list"):
        build(_parser().parse_args(["router", "--spec", str(spec), "--discovery", str(bad)]))
    with pytest.raises(UserError):
        build(_parser().parse_args(["router", "--spec", str(tmp_path / "missing.yaml")]))


def test_cli_serves_until_sigterm(model_dir: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    port = free_ports(1)
    spec.write_text(f"model:\n  path: {model_dir}\nrouter:\n  port: {port}\n")
    disc = tmp_path / "engines.json"
    disc.write_text("[]")
    code = (
        "import argparse, sys\n"
        "from llmd.router.cli import register\n"
        "p = argparse.ArgumentParser(); register(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "router", "--spec", str(spec), "--discovery", str(disc)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in line, line

        async def health() -> int:
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health") as r:
                return r.status

        assert run(health) == 503  # no engines in the discovery file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_gauges_include_kv_capacity_from_cache_config_info() -> None:
    """The approximate scorer sizes its memory of a pod from the capacity vLLM reports in cache_config_info."""
    from llmd.router.endpoints import parse_engine_gauges

    text = (
        'vllm:cache_config_info{block_size="16",engine="1",num_cpu_blocks="None",num_gpu_blocks="2400"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
        "vllm:unrelated_total 5.0\n"
    )
    assert parse_engine_gauges(text) == [(1, "kv_capacity_blocks", 2400.0), (1, "waiting", 2.0), (0, "kv_usage", 0.25)]


def _gauges_by_every_line(text: str) -> list[tuple[int, str, float]]:
    """parse_engine_gauges by its definition: every line read in turn by the same reader of one line."""
    from llmd.router.endpoints import _gauge_line

    out: list[tuple[int, str, float]] = []
    for line in text.splitlines():
        _gauge_line(line, out)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_engine_gauges_are_every_line_read_in_turn(seed: int) -> None:
    """The gauges found by searching for their series are those a reading of every line finds, in line order: on a
    simulated DP pod's whole /metrics and on lines made to mislead (longer names, timestamps, bad values, comments,
    the first or last line, CRLF endings)."""
    from llmd.engines.sim.metrics import EngineMetrics
    from llmd.router.endpoints import parse_engine_gauges

    rng = random.Random(seed)
    ranks = rng.randrange(1, 9)
    m = EngineMetrics("tiny", list(range(ranks)), 32768, cache_config={"num_gpu_blocks": "100", "block_size": "16"})
    for r in range(ranks):
        m.rank(r).running.set(rng.randrange(50))
        m.rank(r).waiting.set(rng.randrange(50))
    real = m.render().decode().splitlines()
    odd = [
        f'vllm:num_requests_waiting{{engine="{rng.randrange(9)}",model_name="m"}} {rng.randrange(99)}.0',
        f"vllm:kv_cache_usage_perc {rng.random()}",
        f'vllm:num_requests_running{{engine="{rng.randrange(9)}"}} 4.0 1700000000000',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0',
        "vllm:num_requests_running_total 3.0",
        'vllm:cache_config_info{engine="2",num_cpu_blocks="64",num_gpu_blocks="None"} 1.0',
        "vllm:kv_cache_usage_perc not-a-number",
        "# HELP vllm:num_requests_running running",
        "vllm:num_requests_running",
        "",
    ]
    lines = real + [rng.choice(odd) for _ in range(40)]
    rng.shuffle(lines)
    text = ("\r\n" if seed % 3 == 0 else "\n").join(lines) + ("\n" if seed % 2 else "")
    got = parse_engine_gauges(text)
    assert got == _gauges_by_every_line(text)
    assert sum(1 for _, attr, _ in got if attr == "running") >= ranks
