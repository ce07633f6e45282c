"""A hung engine does not hang its clients: the router against simulated engines frozen the way SIGSTOP freezes a
process (no byte on any connection, /health included), and against engines whose steps stall while /health still
answers. Real HTTP on 127.0.0.1; every test body runs under a time bound."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from routerutil import Servers, engine, metric, metric_text, pod_of, rconfig, run, until, words

from llmd.engines.sim.server import SimServer
from llmd.router.proxy import Router

# Health probes every 0.2 s with 0.2 s to answer: three silent probes (~1.2 s) take a hung pod down.
FAST_HEALTH = {"health_interval_s": 0.2, "health_timeout_s": 0.2, "down_grace_s": 0.2}


class Freezable(SimServer):
    """`freeze()`: the engine stops stepping and every HTTP request that arrives waits forever, /health included,
    while open connections stay open: what a SIGSTOPped vLLM looks like from the outside."""

    frozen = False

    def freeze(self) -> None:
        assert self.engine is not None
        self.engine.stall()
        self.frozen = True

    def _build_app(self) -> Any:
        from aiohttp import web

        app = super()._build_app()

        async def hang(request: Any, handler: Any) -> Any:
            if self.frozen:
                await asyncio.Event().wait()
            return await handler(request)

        app.middlewares.insert(0, web.middleware(hang))
        return app


def busy(s: SimServer) -> bool:
    return any(r.core.requests for r in s.ranks)


def sse_events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


def test_request_on_a_frozen_pod_is_retried_on_another_before_any_byte(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            a = await sv.start(engine(model_dir, "e0", time_scale=5.0), Freezable)
            b = await sv.start(engine(model_dir, "e1", time_scale=5.0), Freezable)
            async with Router(rconfig(model_dir, **FAST_HEALTH), [pod_of(a), pod_of(b)]) as router:
                req = {"prompt": words(3, 60), "max_tokens": 300, "ignore_eos": True}
                task = asyncio.create_task(http.post(router.url + "/v1/completions", json=req))
                await until(lambda: busy(a) or busy(b), what="the request to reach an engine")
                victim, other = (a, b) if busy(a) else (b, a)
                assert isinstance(victim, Freezable)
                victim.freeze()
                t0 = time.monotonic()
                resp = await task
                waited = time.monotonic() - t0
                data = await resp.json()
                assert resp.status == 200, data
                assert resp.headers["x-llmd-pod"] == other.config.name and resp.headers["x-llmd-attempts"] == "2"
                assert data["usage"]["completion_tokens"] == 300
                assert waited < 6.0, waited  # detection (~1.2 s) + grace, then the whole request again elsewhere
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_errors_total", kind="upstream_timeout") == 1
                assert metric(text, "llmd_router_pod_healthy", pod=victim.config.name) == 0

    run(body, 30)


def test_stream_from_a_frozen_pod_ends_with_an_error_event_then_done(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=5.0), Freezable)
            assert isinstance(s, Freezable)
            async with Router(rconfig(model_dir, **FAST_HEALTH), [pod_of(s)]) as router:
                req = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                async with http.post(router.url + "/v1/completions", json=req) as resp:
                    assert resp.status == 200
                    got = await resp.content.readany()
                    assert got.startswith(b"data: {")
                    s.freeze()
                    t0 = time.monotonic()
                    got += await resp.content.read()
                    waited = time.monotonic() - t0
                events = sse_events(got)
                assert events[-1] == "data: [DONE]"
                err = json.loads(events[-2][len("data: ") :])["error"]
                assert err["code"] == 500 and "e0 was marked down" in err["message"], err
                assert waited < 4.0, waited

    run(body, 30)


def test_stalled_stream_with_a_live_health_check_ends_after_the_idle_bound(model_dir: Path) -> None:
    """The engine stops producing tokens but still answers /health: the idle bound alone ends the stream."""

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=5.0))
            async with Router(rconfig(model_dir, idle_timeout_s=0.5), [pod_of(s)]) as router:
                req = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                async with http.post(router.url + "/v1/completions", json=req) as resp:
                    got = await resp.content.readany()
                    assert s.engine is not None
                    s.engine.stall()
                    got += await resp.content.read()
                events = sse_events(got)
                assert events[-1] == "data: [DONE]"
                err = json.loads(events[-2][len("data: ") :])["error"]
                assert "sent nothing for 0.5 s mid-stream" in err["message"], err
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_errors_total", kind="stream_timeout") == 1
                assert metric(text, "llmd_router_pod_healthy", pod="e0") == 1  # alive: only this request was cut

    run(body, 30)


def test_stalled_prefill_pod_falls_back_to_decode_only_after_the_first_byte_bound(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            pre = await sv.start(engine(model_dir, "p0", role="prefill"))
            dec = await sv.start(engine(model_dir, "d0", role="decode"))
            assert pre.engine is not None
            pre.engine.stall()
            cfg = rconfig(model_dir, pd_threshold=16, first_byte_timeout_s=0.5)
            async with Router(cfg, [pod_of(pre), pod_of(dec)]) as router:
                req = {"messages": [{"role": "user", "content": words(5, 200)}], "max_tokens": 4}
                t0 = time.monotonic()
                async with http.post(router.url + "/v1/chat/completions", json=req) as resp:
                    data = await resp.json()
                assert resp.status == 200, data
                assert resp.headers["x-llmd-pd"] == "fallback" and resp.headers["x-llmd-pod"] == "d0"
                assert 0.5 <= time.monotonic() - t0 < 3.0

    run(body, 30)


class HealthStarved(SimServer):
    """`starved`: /health hangs while the engine keeps serving, as a CPU-bound vLLM's API server on a loaded node
    answers its probes late (a CI failure: the only decode pod marked down mid-prefill, its request cut into a 503)."""

    starved = False

    def _build_app(self) -> Any:
        from aiohttp import web

        app = super()._build_app()

        async def hang(request: Any, handler: Any) -> Any:
            if self.starved and request.path == "/health":
                await asyncio.Event().wait()
            return await handler(request)

        app.middlewares.insert(0, web.middleware(hang))
        return app


def test_the_only_pod_marked_down_while_busy_still_answers_its_request(model_dir: Path) -> None:
    """With nowhere else to go, a request not yet answered is not cut when its pod is marked down: the answer the pod
    may still give beats an error now (a hung pod is still bounded by the first-byte timeout)."""

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", time_scale=5.0), HealthStarved)
            assert isinstance(s, HealthStarved)
            async with Router(rconfig(model_dir, **FAST_HEALTH), [pod_of(s)]) as router:
                req = {"prompt": words(3, 60), "max_tokens": 1500, "ignore_eos": True}
                task = asyncio.create_task(http.post(router.url + "/v1/completions", json=req))
                await until(lambda: busy(s), what="the request to reach the engine")
                s.starved = True
                pod = router.registry.get("e0")
                assert pod is not None
                await until(lambda: not pod.healthy, what="the router to mark the starved pod down")
                assert not task.done()  # marked down while its request was still being computed
                resp = await task
                data = await resp.json()
                assert resp.status == 200, data
                assert resp.headers["x-llmd-attempts"] == "1"
                assert data["usage"]["completion_tokens"] == 1500
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_errors_total", kind="upstream_timeout") == 0

    run(body, 30)
