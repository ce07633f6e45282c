"""The router against simulated vLLM engines in this process, over real HTTP and ZMQ on 127.0.0.1: prefix affinity,
sub-agent co-location, failover, P/D and P2P hops, admission, security limits, streaming, metrics, discovery reload
and KV event replay. Every test body runs under a time bound."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from netutil import DroppingSimServer, free_ports
from netutil import run as run_bounded

from llmd.discovery import PodInfo, parse_discovery
from llmd.engines.sim.core import SimEngineConfig
from llmd.engines.sim.publisher import KVEventPublisher
from llmd.engines.sim.runner import FaultConfig
from llmd.engines.sim.server import SimServer
from llmd.engines.sim.server_config import SimServerConfig
from llmd.errors import UserError
from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from llmd.kv.index import KVIndex
from llmd.router import pd as hops
from llmd.router.admission import Admission, QueueFull
from llmd.router.endpoints import parse_engine_gauges
from llmd.router.events import RankSubscription
from llmd.router.proxy import Router, RouterConfig
from llmd.spec.model import RouterSpec

BS = 16
MAX_LEN = 4096
REPO = Path(__file__).resolve().parent.parent


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """Router tests run longer flows (P/D, retries): a wider bound than the shared default."""
    return run_bounded(coro_fn, timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmd.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"), weights=False)


def engine(model_dir: Path, name: str, role: str = "both", **kw: Any) -> SimServerConfig:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in SimEngineConfig.__dataclass_fields__}
    engine_kw.setdefault("num_gpu_blocks", 1024)
    eng = SimEngineConfig(block_size=BS, max_model_len=MAX_LEN, **engine_kw)
    kw.setdefault("side_channel_port", 0)
    kw.setdefault("kv_events_endpoint", "tcp://*:0")
    kw.setdefault("kv_events_replay_endpoint", "tcp://*:0")
    kw.setdefault("time_scale", 1.0)
    return SimServerConfig(str(model_dir), served_name="tiny", role=role, name=name, engine=eng, **kw)  # type: ignore[arg-type]


def pod_of(server: SimServer, name: str | None = None, **kw: Any) -> PodInfo:
    """The discovery entry a launcher would write for a started sim server."""
    c = server.config
    kv = server.publishers[0].endpoint if server.publishers else None
    side = server.side_channels[0].port if server.side_channels else None
    fields: dict[str, Any] = {
        "name": name or c.name,
        "role": c.role,
        "url": server.url,
        "dp_size": c.dp_size,
        "kv_events_endpoint": kv,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": side,
        "engine_id": server.engine_id,
    }
    fields.update(kw)
    return PodInfo(**fields)


def rconfig(model_dir: Path, **kw: Any) -> RouterConfig:
    spec_kw = {k: kw.pop(k) for k in list(kw) if k in RouterSpec.model_fields and k not in ("host", "port")}
    spec = RouterSpec(**spec_kw)
    kw.setdefault("port", 0)
    kw.setdefault("tokenizer", str(model_dir))
    kw.setdefault("block_size", BS)
    kw.setdefault("served_name", "tiny")
    kw.setdefault("health_interval_s", 0.2)
    kw.setdefault("metrics_interval_s", 0.2)
    return RouterConfig.from_router_spec(spec, **kw)


class Servers:
    """Started sim servers, stopped at the end whatever happens."""

    def __init__(self) -> None:
        self.servers: list[SimServer] = []

    async def start(self, cfg: SimServerConfig, cls: type[SimServer] = SimServer) -> SimServer:
        s = await cls(cfg).start()
        self.servers.append(s)
        return s

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)


class Recording(SimServer):
    """A sim server that keeps every generate request's body and headers (what the router sent)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    def _build_app(self) -> Any:
        app = super()._build_app()

        async def record(request: Any, handler: Any) -> Any:
            if request.path.startswith("/v1/") and request.method == "POST":
                self.seen.append((json.loads(await request.read()), dict(request.headers)))
            return await handler(request)

        from aiohttp import web

        app.middlewares.insert(0, web.middleware(record))
        return app


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, **kw: Any
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with http.post(url, json=body, **kw) as r:
        text = await r.text()
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            data = text
        return r.status, data, r.headers


async def metric_text(http: aiohttp.ClientSession, url: str, **kw: Any) -> str:
    async with http.get(url + "/metrics", **kw) as r:
        assert r.status == 200
        return await r.text()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        sname, _, lab = series.partition("{")
        if sname == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
    return total


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def words(seed: int, n: int) -> str:
    """Distinct text per seed: each session's prefix is its own."""
    return " ".join(f"w{seed}x{i}" for i in range(n))


# ---- routing ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["inline", "tokenizer-thread"])
def test_sessions_stick_to_their_prefix_holders(model_dir: Path, offload: bool) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}")) for i in range(3)]
            cfg = rconfig(model_dir, offload_tokenize_bytes=0 if offload else 1 << 20)
            async with Router(cfg, [pod_of(s) for s in servers]) as router:
                url = router.url + "/v1/chat/completions"
                sessions = {f"s{k}": [{"role": "system", "content": words(k, 120)}] for k in range(6)}
                pods: dict[str, list[str]] = {k: [] for k in sessions}
                cached: list[float] = []
                for turn in range(4):
                    for sid, msgs in sessions.items():
                        msgs.append({"role": "user", "content": f"turn {turn} " + words(100 + turn, 10)})
                        st, r, h = await post(
                            http, url, {"messages": msgs, "max_tokens": 8}, headers={"X-Session-Id": sid}
                        )
                        assert st == 200, r
                        pods[sid].append(h["x-llmd-pod"])
                        msgs.append(r["choices"][0]["message"])
                        if turn:
                            details = r["usage"]["prompt_tokens_details"]
                            cached.append(details["cached_tokens"] / r["usage"]["prompt_tokens"])
                            assert h["x-llmd-route-reason"] == "prefix-hit"
                            assert int(h["x-llmd-expected-hit-tokens"]) > 0
                    await asyncio.sleep(0.1)  # let the engines' KV events land
                for sid, seq in pods.items():
                    assert len(set(seq)) == 1, f"session {sid} moved: {seq}"
                assert min(cached) > 0.8, cached
                # The cold first turns spread over the pods (sessions are not all piled on one).
                assert len({seq[0] for seq in pods.values()}) > 1

    run(body)


def test_subagent_burst_forking_a_fresh_prefix_colocates(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=5.0)) for i in range(3)]
            async with Router(rconfig(model_dir), [pod_of(s) for s in servers]) as router:
                shared = words(7, 300)  # a fresh prefix: no engine has seen it, no event can help yet

                async def sub(i: int) -> str:
                    st, r, h = await post(
                        http,
                        router.url + "/v1/completions",
                        {"prompt": f"{shared} task {i}", "max_tokens": 4, "user": f"agent-{i}"},
                    )
                    assert st == 200, r
                    return h["x-llmd-pod"]

                got = await asyncio.gather(*(sub(i) for i in range(8)))
                # Routed within the speculative TTL, before any BlockStored: all but the first see it as a hit.
                assert len(set(got)) == 1, got

    run(body)


def test_dp_rank_aware_routing(model_dir: Path) -> None:
    base = free_ports(2)

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "dp", dp_size=2, kv_events_endpoint=f"tcp://*:{base}"))
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                await until(lambda: len(router.hub.subs.get("dp", [])) == 2, what="both ranks subscribed")
                ranks: dict[str, set[str]] = {"a": set(), "b": set()}
                for turn in range(3):
                    for sid in ranks:
                        prompt = words(ord(sid), 200) + f" turn {turn}"
                        st, r, h = await post(
                            http, router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "user": sid}
                        )
                        assert st == 200 and h["x-llmd-pod"] == "dp"
                        ranks[sid].add(h["x-llmd-dp-rank"])
                        if turn:
                            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
                    await asyncio.sleep(0.1)
                assert all(len(v) == 1 for v in ranks.values()), ranks
                assert {h for holders in [router.index.holders()] for h in holders} <= {("dp", 0), ("dp", 1)}

    run(body)


# ---- failures --------------------------------------------------------------------------------------------------------


def test_killed_pod_is_routed_around_without_client_errors(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=20.0)) for i in range(3)]
            cfg = rconfig(model_dir, health_interval_s=5.0)  # failover must not wait for the health loop
            async with Router(cfg, [pod_of(s) for s in servers]) as router:
                statuses: list[int] = []
                served: list[str] = []

                async def client(i: int) -> None:
                    for turn in range(3):
                        body = {
                            "prompt": words(i, 50) + f" turn {turn}",
                            "max_tokens": 40,
                            "ignore_eos": True,
                            "stream": i % 2 == 0,
                        }
                        st, r, h = await post(
                            http, router.url + "/v1/completions", body, headers={"X-Session-Id": str(i)}
                        )
                        statuses.append(st)
                        served.append(h.get("x-llmd-pod", "?"))
                        if st == 200 and body["stream"]:
                            assert "[DONE]" in r and 'data: {"error"' not in r

                tasks = [asyncio.create_task(client(i)) for i in range(12)]
                await until(lambda: servers[1].ranks[0].core.requests != {}, what="e1 busy")
                victim = servers[1]
                await victim.stop()  # in-flight requests there die before streaming anything
                await asyncio.gather(*tasks)
                assert statuses and all(st == 200 for st in statuses), statuses
                # It left routing and the index at once.
                assert not router.registry.pods["e1"].healthy
                assert all(h[0] != "e1" for h in router.index.holders())
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_retries_total") >= 1
                assert metric(text, "llmd_router_pod_healthy", pod="e1") == 0

                # Relaunched (new ports, as a relaunch writes them): healthy again, events resubscribed.
                again = await sv.start(engine(model_dir, "e1"))
                router.registry.set_pods([pod_of(servers[0]), pod_of(again), pod_of(servers[2])])
                await router.registry.check_all()
                assert router.registry.pods["e1"].healthy
                assert "e1" in router.hub.subs

    run(body, timeout=60)


def test_restarted_pod_on_same_port_comes_back(model_dir: Path) -> None:
    port = free_ports(2)
    ev = port + 1

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            cfg = engine(model_dir, "e0", port=port, kv_events_endpoint=f"tcp://*:{ev}")
            s = await sv.start(cfg)
            other = await sv.start(engine(model_dir, "e1"))
            async with Router(rconfig(model_dir), [pod_of(s), pod_of(other)]) as router:
                prompt = words(3, 200)
                st, _, h = await post(http, router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
                first = h["x-llmd-pod"]
                await until(lambda: any(x[0] == first for x in router.index.holders()), what="events")
                dead = s if first == "e0" else other
                await dead.stop()
                await until(lambda: not router.registry.pods[first].healthy, what="health notices")
                assert all(x[0] != first for x in router.index.holders())
                st, _, h = await post(http, router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
                assert st == 200 and h["x-llmd-pod"] != first
                if first == "e0":
                    await sv.start(cfg)  # same ports: the router's entry is still right
                    await until(lambda: router.registry.pods["e0"].healthy, what="back up")
                    assert "e0" in router.hub.subs

    run(body)


# ---- P/D and P2P -----------------------------------------------------------------------------------------------------


def test_pd_two_hops_as_nixl_connector_expects(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            pre = await sv.start(engine(model_dir, "p0", role="prefill"), Recording)
            dec = await sv.start(engine(model_dir, "d0", role="decode"), Recording)
            assert isinstance(pre, Recording) and isinstance(dec, Recording)
            async with Router(rconfig(model_dir, pd_threshold=16), [pod_of(pre), pod_of(dec)]) as router:
                prompt = words(11, 200)
                for stream in (False, True):
                    req = {
                        "messages": [{"role": "user", "content": prompt + f" {stream}"}],
                        "max_tokens": 6,
                        "max_completion_tokens": 6,
                        "stream": stream,
                        "stream_options": {"include_usage": True} if stream else None,
                    }
                    st, r, h = await post(http, router.url + "/v1/chat/completions", req)
                    assert st == 200, r
                    assert h["x-llmd-pod"] == "d0" and h["x-llmd-prefill-pod"] == "p0" and h["x-llmd-pd"] == "ok"
                    assert h["x-llmd-pd-reason"] == "threshold"
                    assert float(h["x-llmd-prefill-ms"]) > 0
                    pbody, _ = pre.seen[-1]
                    assert pbody["max_tokens"] == 1 and pbody["stream"] is False
                    assert "stream_options" not in pbody and "max_completion_tokens" not in pbody
                    assert pbody["kv_transfer_params"] == hops.PREFILL_KV_PARAMS
                    dbody, _ = dec.seen[-1]
                    assert dbody["max_tokens"] == 6 and dbody["stream"] is stream
                    assert dbody["max_completion_tokens"] == 6
                    kv = dbody["kv_transfer_params"]
                    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == pre.engine_id
                    assert kv["remote_request_id"] and kv["remote_block_ids"]
                    if stream:
                        assert '"finish_reason":"length"' in r.replace(" ", "") and r.rstrip().endswith("[DONE]")
                # The decode pod pulled the prompt over the side channel instead of computing it.
                text = await metric_text(http, dec.url)
                assert metric(text, "vllm:nixl_xfer_time_seconds_count") == 2
                assert metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 300
                assert metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute") <= 2
                assert pre.ranks[0].core.leases == {}
                rtext = await metric_text(http, router.url)
                assert metric(rtext, "llmd_router_pd_total", outcome="ok") == 2
                assert metric(rtext, "llmd_router_prefill_hop_seconds_count") == 2
                # A short prompt stays on the decode pod alone.
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
                assert st == 200 and "x-llmd-prefill-pod" not in h and h["x-llmd-pd-reason"] == "below-threshold"

    run(body)


def test_pd_falls_back_to_decode_only_when_prefill_fails(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            pre = await sv.start(engine(model_dir, "p0", role="prefill", faults=FaultConfig(failure_rate=1.0)))
            pre2 = await sv.start(engine(model_dir, "p1", role="prefill"))
            dec = await sv.start(engine(model_dir, "d0", role="decode"), Recording)
            assert isinstance(dec, Recording)
            cfg = rconfig(model_dir, pd_threshold=16, health_interval_s=30.0)
            async with Router(cfg, [pod_of(pre), pod_of(dec)]) as router:
                # A prefill pod answering 500.
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": words(1, 200), "max_tokens": 3})
                assert st == 200 and h["x-llmd-pd"] == "fallback" and "x-llmd-prefill-pod" not in h
                assert "kv_transfer_params" not in dec.seen[-1][0]
                assert r["usage"]["completion_tokens"] == 3
            async with Router(cfg, [pod_of(pre2), pod_of(dec)]) as router:
                # A prefill pod that died since the last health check: connection refused.
                await pre2.stop()
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": words(2, 200), "max_tokens": 3})
                assert st == 200 and h["x-llmd-pd"] == "fallback"
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_pd_total", outcome="fallback") == 1
                assert not router.registry.pods["p1"].healthy  # and it left routing at once
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": words(3, 200), "max_tokens": 3})
                assert st == 200 and "x-llmd-pd" not in h and h["x-llmd-pd-reason"] == "prefill-unhealthy"

    run(body)


def test_connection_closed_under_a_request_is_resent_and_the_pod_kept(model_dir: Path) -> None:
    """Seen on real vLLM under load: the router took a decode pod whose idle pooled connection closed under a request
    for dead, and with one decode pod every request failed 503 until the health loop brought it back."""

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            pre = await sv.start(engine(model_dir, "p0", role="prefill"), DroppingSimServer)
            dec = await sv.start(engine(model_dir, "d0", role="decode"), DroppingSimServer)
            assert isinstance(pre, DroppingSimServer) and isinstance(dec, DroppingSimServer)
            cfg = rconfig(model_dir, pd_threshold=16, health_interval_s=30.0)
            async with Router(cfg, [pod_of(pre), pod_of(dec)]) as router:
                for i, stream in enumerate((False, True)):
                    pre.drops = dec.drops = 1  # both hops of this request lose their first connection
                    req = {"prompt": words(40 + i, 200), "max_tokens": 3, "stream": stream}
                    st, r, h = await post(http, router.url + "/v1/completions", req)
                    assert st == 200, r
                    assert h["x-llmd-pd"] == "ok" and h["x-llmd-pod"] == "d0" and h["x-llmd-attempts"] == "1"
                    assert pre.drops == dec.drops == 0
                    assert all(p.healthy for p in router.registry.pods.values())
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_retries_total", reason="resent") == 4
                # A pod that drops every request is not resent to forever: the request fails over (none left: 502).
                dec.drops, dec.again = 10, True
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
                assert st in (502, 503) and dec.drops == 8, (st, r, dec.drops)

    run(body)


@pytest.mark.parametrize("mode", ["hash", "two-hop"])
def test_p2p_overloaded_holder_is_pulled_from(model_dir: Path, mode: str) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=30.0), Recording) for i in range(2)]
            cfg = rconfig(model_dir, max_inflight_per_pod=2, speculative_ttl_s=0.0, p2p_mode=mode)
            async with Router(cfg, [pod_of(s) for s in servers]) as router:
                prefix = words(5, 300)
                st, _, h = await post(http, router.url + "/v1/completions", {"prompt": prefix, "max_tokens": 1})
                holder = h["x-llmd-pod"]
                other = "e1" if holder == "e0" else "e0"
                await until(lambda: any(x[0] == holder for x in router.index.holders()), what="holder's events")
                # Fill the holder with two long requests on the same prefix.
                long = [
                    asyncio.create_task(
                        post(
                            http,
                            router.url + "/v1/completions",
                            {"prompt": prefix + f" long {i}", "max_tokens": 60, "ignore_eos": True},
                        )
                    )
                    for i in range(2)
                ]
                await until(lambda: router.registry.pods[holder].ranks[0].inflight == 2, what="holder full")
                st, r, h = await post(
                    http, router.url + "/v1/completions", {"prompt": prefix + " and more", "max_tokens": 2}
                )
                assert st == 200, r
                assert h["x-llmd-pod"] == other and h["x-llmd-p2p-source"] == holder
                assert h["x-llmd-route-reason"] == "p2p"
                src = servers[int(holder[1])]
                dst = servers[int(other[1])]
                assert isinstance(src, Recording) and isinstance(dst, Recording)
                kv = dst.seen[-1][0]["kv_transfer_params"]
                if mode == "hash":
                    # One hop: the target pulls the holder's cached blocks by hash (no remote request).
                    assert kv == {
                        "do_remote_prefill": True,
                        "remote_engine_id": src.engine_id,
                        "remote_host": "127.0.0.1",
                        "remote_port": src.side_channels[0].port,
                        "remote_num_tokens": int(h["x-llmd-expected-hit-tokens"]),
                    }
                else:
                    # vLLM's NixlConnector form: the holder serves as the prefill pod, the target pulls its lease.
                    assert src.seen[-1][0]["kv_transfer_params"] == hops.PREFILL_KV_PARAMS
                    assert src.seen[-1][0]["max_tokens"] == 1
                    assert kv["remote_request_id"] and kv["remote_engine_id"] == src.engine_id
                # It pulled the prefix instead of computing it.
                assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300
                text = await metric_text(http, servers[int(other[1])].url)
                assert metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 300
                for t in long:
                    assert (await t)[0] == 200
                outcome = "sent" if mode == "hash" else "ok"
                assert metric(await metric_text(http, router.url), "llmd_router_p2p_total", outcome=outcome) == 1

    run(body)


def test_p2p_pull_failure_is_retried_without_transfer(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=30.0)) for i in range(2)]
            # A wrong engine id: the holder refuses the pull, the puller fails the request (kv_load_failure_policy).
            pods = [pod_of(s, engine_id="wrong") for s in servers]
            cfg = rconfig(model_dir, max_inflight_per_pod=1, speculative_ttl_s=0.0)
            async with Router(cfg, pods) as router:
                prefix = words(6, 300)
                st, _, h = await post(http, router.url + "/v1/completions", {"prompt": prefix, "max_tokens": 1})
                holder = h["x-llmd-pod"]
                await until(lambda: any(x[0] == holder for x in router.index.holders()), what="holder's events")
                busy = asyncio.create_task(
                    post(http, router.url + "/v1/completions", {"prompt": prefix, "max_tokens": 60, "ignore_eos": True})
                )
                await until(lambda: router.registry.pods[holder].ranks[0].inflight == 1, what="holder full")
                st, r, h = await post(
                    http, router.url + "/v1/completions", {"prompt": prefix + " x", "max_tokens": 2, "stream": True}
                )
                assert st == 200 and 'data: {"error"' not in r and r.rstrip().endswith("[DONE]")
                assert int(h["x-llmd-attempts"]) == 2 and "x-llmd-p2p-source" not in h
                assert (await busy)[0] == 200

    run(body)


# ---- admission and limits ------------------------------------------------------------------------------------------


def test_queue_full_answers_429_with_retry_after(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=20.0))
            cfg = rconfig(model_dir, max_inflight_per_pod=1, queue_limit=2)
            async with Router(cfg, [pod_of(s)]) as router:
                url = router.url + "/v1/completions"
                req = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
                running = asyncio.create_task(post(http, url, req))
                await until(lambda: router.admission.stats()["inflight"] == 1, what="one in flight")
                queued = [
                    asyncio.create_task(post(http, url, req, headers={"X-Session-Id": f"q{i}"})) for i in range(2)
                ]
                await until(lambda: router.admission.waiting == 2, what="two queued")
                st, r, h = await post(http, url, req)
                assert st == 429 and int(h["Retry-After"]) >= 1
                assert r["error"]["type"] == "RateLimitError" and r["error"]["code"] == 429
                results = await asyncio.gather(running, *queued)
                assert [x[0] for x in results] == [200, 200, 200]
                assert float(results[2][2]["x-llmd-queue-ms"]) > 50  # it waited for a slot
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_queue_rejected_total") == 1
                assert metric(text, "llmd_router_requests_total", route="/v1/completions", status="429") == 1

    run(body)


def test_a_scorer_reading_text_makes_the_router_keep_the_prompt_text() -> None:
    # Whether the router hashes prompt text follows the scorers' declared inputs, not a list of scorer names.
    from llmd.router.scheduling import ScorerPlugin, register_scorer, unregister_scorer
    from llmd.router.scheduling.load import QueueScorer

    def needs_text(spec: RouterSpec) -> bool:
        return Router(RouterConfig.from_router_spec(spec, port=0), [])._needs_text

    register_scorer(ScorerPlugin("text-reader", lambda setup: QueueScorer(), frozenset({"text"})))
    try:
        assert not needs_text(RouterSpec())
        assert needs_text(RouterSpec(weights={"prefix": 1.0, "text-reader": 1.0}))
        assert needs_text(RouterSpec(policy="approximate"))
    finally:
        unregister_scorer("text-reader")


def test_fair_queueing_round_robins_sessions() -> None:
    async def body() -> None:
        adm = Admission(max_inflight=1, queue_limit=100)
        room = {"free": True}
        order: list[str] = []

        def choose_for(tag: str) -> Callable[[], str | None]:
            def choose() -> str | None:
                if not room["free"]:
                    return None
                room["free"] = False
                return tag

            return choose

        async def req(session: str, i: int) -> None:
            await adm.admit(session, choose_for(f"{session}{i}"), lambda _: None)
            order.append(f"{session}{i}")

        room["free"] = False
        tasks = [asyncio.create_task(req("a", i)) for i in range(4)]  # a burst from one session first
        tasks += [asyncio.create_task(req(s, 0)) for s in "bc"]
        await asyncio.sleep(0.01)
        for _ in range(6):
            room["free"] = True
            adm.pump()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["a0", "b0", "c0", "a1", "a2", "a3"]
        adm2 = Admission(max_inflight=1, queue_limit=0)
        with pytest.raises(QueueFull):
            await adm2.admit("s", lambda: None, lambda _: None)

    run(body)


def test_a_request_whose_endpoint_has_room_passes_requests_waiting_for_full_ones() -> None:
    """A waiter held for the engine that holds its prefix (full now) does not hold back a newcomer whose choice has
    room: the newcomer is admitted when it arrives, not at the next release."""

    async def body() -> None:
        adm = Admission(max_inflight=4, queue_limit=100)
        full = {"holder"}
        got: list[str] = []

        def choose_for(target: str) -> Callable[[], str | None]:
            return lambda: None if target in full else target

        async def req(session: str, target: str) -> None:
            got.append(await adm.admit(session, choose_for(target), lambda _: None))

        waiting = asyncio.create_task(req("a", "holder"))
        await asyncio.sleep(0.01)
        assert adm.waiting == 1 and not got
        newcomer = asyncio.create_task(req("b", "other"))
        await asyncio.sleep(0.01)
        assert got == ["other"] and adm.waiting == 1  # admitted at once, past the waiter
        full.clear()
        adm.pump()  # the holder freed (a release, or the proxy's timer when patience runs out)
        await asyncio.gather(waiting, newcomer)
        assert got == ["other", "holder"] and adm.waiting == 0

    run(body)


def test_api_key_body_limit_and_malformed_requests(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0"))
            cfg = rconfig(model_dir, api_key="sekret", max_body_bytes=4096)
            async with Router(cfg, [pod_of(s)]) as router:
                url = router.url + "/v1/completions"
                ok = {"prompt": "hello", "max_tokens": 2}
                auth = {"Authorization": "Bearer sekret"}
                st, r, h = await post(http, url, ok)
                assert st == 401 and set(r["error"]) == {"message", "type", "param", "code"}
                assert (await post(http, url, ok, headers={"Authorization": "Bearer nope"}))[0] == 401
                st, r, h = await post(http, url, ok, headers=auth)
                assert st == 200 and r["usage"]["completion_tokens"] == 2
                async with http.get(router.url + "/health") as resp:
                    assert resp.status == 200  # open without the key
                async with http.get(router.url + "/v1/models") as resp:
                    assert resp.status == 401
                async with http.get(router.url + "/v1/models", headers=auth) as resp:
                    assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "tiny"
                st, r, _ = await post(http, url, {"prompt": "x" * 5000, "max_tokens": 1}, headers=auth)
                assert st == 413 and r["error"]["code"] == 413
                for bad in (b"{not json", b"[1, 2]", b'{"max_tokens": 2}', b'{"prompt": {"a": 1}}',
                            b'{"prompt": "x", "stream": "yes"}'):  # fmt: skip
                    async with http.post(url, data=bad, headers={**auth, "Content-Type": "application/json"}) as resp:
                        err = await resp.json()
                        assert resp.status == 400, bad
                        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == 400
                st, r, _ = await post(http, router.url + "/v1/chat/completions", {"messages": "hi"}, headers=auth)
                assert st == 400 and r["error"]["param"] == "messages"
                # The engine's own 4xx passes through untouched (not retried elsewhere).
                st, r, h = await post(http, url, {"prompt": "x", "max_tokens": -1}, headers=auth)
                assert st == 400 and h["x-llmd-attempts"] == "1"

    run(body)


# ---- streaming, headers, metrics ---------------------------------------------------------------------------------


def test_streaming_passes_chunks_through_as_they_come(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=40.0))
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                t0 = time.monotonic()
                stamps: list[float] = []
                chunks: list[bytes] = []
                req = {"prompt": "stream me", "max_tokens": 40, "ignore_eos": True, "stream": True}
                async with http.post(router.url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                    for name in ("x-llmd-pod", "x-llmd-queue-ms", "x-llmd-route-reason"):
                        assert name in resp.headers
                    async for chunk in resp.content.iter_any():
                        stamps.append(time.monotonic() - t0)
                        chunks.append(chunk)
                total = stamps[-1]
                assert len(chunks) > 5
                assert stamps[0] < total / 2, (stamps[0], total)  # the first chunk did not wait for the last
                data = b"".join(chunks).decode()
                assert data.endswith("data: [DONE]\n\n") and data.count("data: ") >= 41
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_requests_total", route="/v1/completions", status="200") == 1
                assert metric(text, "llmd_router_routing_decisions_total", policy="precise") == 1
                assert metric(text, "llmd_router_queue_time_seconds_count") == 1
                assert metric(text, "llmd_router_kv_event_batches_total") >= 0
                assert metric(text, "llmd_router_pod_inflight", pod="e0") == 0

    run(body)


def test_failure_after_streaming_began_ends_the_stream_with_an_error_event(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=40.0))
            async with Router(rconfig(model_dir, health_interval_s=30.0), [pod_of(s)]) as router:
                req = {"prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with http.post(router.url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    first = await resp.content.readany()
                    assert first.startswith(b"data: {")
                    await s.stop()  # the engine dies mid-stream
                    rest = (await resp.content.read()).decode()
                events = [e for e in rest.split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                err = json.loads(events[-2][len("data: ") :])
                assert err["error"]["code"] == 500 and "e0" in err["error"]["message"]
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_errors_total", kind="stream_broken") == 1

    run(body)


def test_client_hanging_up_mid_stream_aborts_the_engine_request_quietly(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client may close as soon as it has what it wants: the router logs no server error for it, aborts the
    engine's request (its KV is freed) and serves the next request as usual."""

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=40.0))
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                req = {"prompt": "hang up on me", "max_tokens": 400, "ignore_eos": True, "stream": True}
                resp = await http.post(router.url + "/v1/completions", json=req)
                assert resp.status == 200
                assert (await resp.content.readany()).startswith(b"data: {")
                resp.close()  # the client goes away mid-stream

                async def engine_running() -> float:
                    return metric(await metric_text(http, s.url), "vllm:num_requests_running")

                t0 = time.monotonic()
                while await engine_running() > 0:
                    assert time.monotonic() - t0 < 5.0, "the engine kept decoding for a client that left"
                    await asyncio.sleep(0.05)
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_pod_inflight", pod="e0") == 0
                st, data, _ = await post(http, router.url + "/v1/completions", {"prompt": "next", "max_tokens": 2})
                assert st == 200 and data["choices"][0]["text"] is not None

    with caplog.at_level("ERROR", logger="aiohttp.server"):
        run(body)
    assert not [r for r in caplog.records if r.name == "aiohttp.server"], caplog.text


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


def test_prefill_body_keeps_the_request_but_asks_for_one_token_and_a_lease() -> None:
    body = {"prompt": "x", "max_tokens": 50, "min_tokens": 5, "n": 2, "stream": True, "stream_options": {}, "seed": 1}
    out = hops.prefill_body(body, chat=False)
    assert out == {"prompt": "x", "max_tokens": 1, "n": 1, "stream": False, "seed": 1,
                   "kv_transfer_params": hops.PREFILL_KV_PARAMS}  # fmt: skip
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # the original is left as it was
    chat = hops.prefill_body({"messages": [], "max_completion_tokens": 9}, chat=True)
    assert "max_completion_tokens" not in chat and chat["max_tokens"] == 1
    assert hops.p2p_params("e", "h", 5, 64) == {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 5,
        "remote_num_tokens": 64,
    }


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


def test_waiting_for_a_holder_reruns_the_queue_when_the_patience_runs_out() -> None:
    """The proxy's pump timer: the earliest asked-for time wins, and the queue runs once then even if nothing frees."""

    async def body() -> None:
        router = Router(RouterConfig())
        pumps: list[float] = []
        router.admission.pump = lambda: pumps.append(time.monotonic()) or 0  # type: ignore[method-assign]
        t0 = time.monotonic()
        router._pump_in(0.3)
        router._pump_in(0.05)  # earlier: replaces the 0.3 s timer
        router._pump_in(0.2)  # later than the pending one: ignored
        await asyncio.sleep(0.4)
        assert len(pumps) == 1 and 0.04 <= pumps[0] - t0 < 0.25
        await router.stop()

    run(body)
