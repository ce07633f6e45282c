"""The router against simulated vLLM engines in this process, over real HTTP and ZMQ on 127.0.0.1: prefix affinity,
sub-agent co-location, failover, admission, security limits, streaming and metrics. Every test body runs under a time
bound."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from netutil import free_ports
from routerutil import (
    Servers,
    engine,
    metric,
    metric_text,
    pod_of,
    post,
    rconfig,
    run,
    until,
    words,
)

from llmd.router.proxy import Router, RouterConfig
from llmd.spec.model import RouterSpec

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
                await until(lambda: router.core.stats()["inflight"] == 1, what="one in flight")
                queued = [
                    asyncio.create_task(post(http, url, req, headers={"X-Session-Id": f"q{i}"})) for i in range(2)
                ]
                await until(lambda: router.core.queue.waiting == 2, what="two queued")
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


def test_waiting_for_a_holder_reruns_the_queue_when_the_patience_runs_out() -> None:
    """The proxy's pump timer: the earliest time the core asked for wins, and the queue runs once then even if
    nothing frees."""

    async def body() -> None:
        router = Router(RouterConfig())
        pumps: list[float] = []
        core_pump = router.core.pump

        def pump(now: float) -> list[Any]:
            pumps.append(time.monotonic())
            return core_pump(now)

        router.core.pump = pump  # type: ignore[method-assign]
        t0 = time.monotonic()
        for delay in (0.3, 0.05, 0.2):  # 0.05 replaces the 0.3 s timer; 0.2, later than the pending one, is ignored
            router.core._ask_at(t0 + delay)
            router._arm()
        await asyncio.sleep(0.4)
        assert len(pumps) == 1 and 0.04 <= pumps[0] - t0 < 0.25
        assert router.core.next_wakeup() is None
        await router.stop()

    run(body)
