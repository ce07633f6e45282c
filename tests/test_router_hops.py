"""The router's KV-transfer hops against simulated engines: P/D's two hops as vLLM's NixlConnector expects them, the
decode-only fallback, P2P pulls from an overloaded prefix holder (by hash, or two-hop) and their failures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from netutil import DroppingSimServer
from routerutil import (
    Recording,
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

from llmd.engines.sim.runner import FaultConfig
from llmd.router import pd as hops
from llmd.router.proxy import Router

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
                await until(lambda: router.core.ledger.inflight((holder, 0)) == 2, what="holder full")
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
                await until(lambda: router.core.ledger.inflight((holder, 0)) == 1, what="holder full")
                st, r, h = await post(
                    http, router.url + "/v1/completions", {"prompt": prefix + " x", "max_tokens": 2, "stream": True}
                )
                assert st == 200 and 'data: {"error"' not in r and r.rstrip().endswith("[DONE]")
                assert int(h["x-llmd-attempts"]) == 2 and "x-llmd-p2p-source" not in h
                assert (await busy)[0] == 200

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
