"""The router's KV-transfer hops against simulated engines: P/D's two hops as vLLM's NixlConnector expects them, the
decode-only fallback, P2P pulls from an overloaded prefix holder (by hash, or two-hop) and their failures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np
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
from llmd.engines.sim.server_config import default_latency
from llmd.metrics import read_requests
from llmd.router import pd as hops
from llmd.router.proxy import Router
from llmd.tokens import Tokenizer

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
                # A text completion's prompt reaches both hops as the router's token ids (RouterSpec.forward_tokens).
                prompt = words(7, 200)
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 3})
                assert st == 200, r
                assert h["x-llmd-pd"] == "ok"
                ids = Tokenizer(model_dir).encode(prompt)
                assert pre.seen[-1][0]["prompt"] == ids and pre.seen[-1][0]["max_tokens"] == 1
                assert dec.seen[-1][0]["prompt"] == ids and "kv_transfer_params" in dec.seen[-1][0]
                # A short prompt stays on the decode pod alone.
                st, r, h = await post(http, router.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
                assert st == 200 and "x-llmd-prefill-pod" not in h and h["x-llmd-pd-reason"] == "below-threshold"

    run(body)


def test_pd_requests_record_the_kv_their_decode_pod_pulled(model_dir: Path, tmp_path: Path) -> None:
    """The router's rows hold each request's KV transfer: under P/D the prompt less what the decode pod held (the
    engine pulls exactly that), its bytes from the model's geometry, and the decode leg's time to its first output,
    which holds the pull; a decode-only request zeros; an unstreamed one the size but no time."""
    lat = default_latency()
    rows_h5 = tmp_path / "router.h5"

    async def body() -> dict[str, float]:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            pre = await sv.start(engine(model_dir, "p0", role="prefill", latency=lat))
            dec = await sv.start(engine(model_dir, "d0", role="decode", latency=lat))
            cfg = rconfig(model_dir, pd_threshold=16, latency=lat, metrics_out=str(rows_h5))
            async with Router(cfg, [pod_of(pre), pod_of(dec)]) as router:
                url = router.url + "/v1/completions"
                prompt = words(21, 200)
                reqs = [
                    {"prompt": prompt, "max_tokens": 4, "stream": True},  # the decode pod holds none of it
                    {"prompt": prompt + " " + words(22, 100), "max_tokens": 4, "stream": True},  # its first part
                    {"prompt": "hi", "max_tokens": 2, "stream": True},  # below the threshold: decode-only
                    {"prompt": words(23, 200), "max_tokens": 4},  # not streamed
                ]
                for i, req in enumerate(reqs):
                    st, r, _ = await post(http, url, req, headers={"X-Request-Id": f"r{i}"})
                    assert st == 200, r
                    if i == 0:  # the pulled blocks are cached on the decode pod: the router learns it from events
                        await until(lambda: any(x[0] == "d0" for x in router.index.holders()), what="d0's events")
                text = await metric_text(http, dec.url)
                return {
                    "pulled": metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
                    "bytes": metric(text, "vllm:nixl_bytes_transferred_sum"),
                    "seconds": metric(text, "vllm:nixl_xfer_time_seconds_sum"),
                }

    engine_saw = run(body)
    rows = read_requests(rows_h5).set_index("request_id").loc[["r0", "r1", "r2", "r3"]]
    assert list(rows["pd_path"]) == ["pd", "pd", "decode-only", "pd"]
    pd_rows = rows[rows["pd_path"] == "pd"]
    tokens = pd_rows["kv_transfer_tokens"]
    # r0: the whole prompt; r1: all but the decode pod's hit (r0's blocks); exactly what the engine pulled.
    assert tokens["r0"] == pd_rows["input_tokens"]["r0"] and pd_rows["expected_hit_tokens"]["r0"] == 0
    assert pd_rows["expected_hit_tokens"]["r1"] >= 16 * (tokens["r0"] // 16) > 0
    assert tokens["r1"] == pd_rows["input_tokens"]["r1"] - pd_rows["expected_hit_tokens"]["r1"]
    assert tokens.sum() == engine_saw["pulled"]
    assert (pd_rows["kv_transfer_bytes"] == tokens * lat.kv_transfer_bytes(1)).all()
    assert pd_rows["kv_transfer_bytes"].sum() == engine_saw["bytes"]
    streamed = pd_rows.loc[["r0", "r1"]]
    assert (streamed["kv_transfer_s"] > 0).all() and (streamed["kv_transfer_s"] < streamed["ttft_s"]).all()
    # The engine slept the latency model's pull time (both pods on this host: NVLink) inside each measured handoff.
    pull_s = tokens.map(lambda n: lat.kv_transfer_time(n, same_node=True))
    assert pull_s.sum() == pytest.approx(engine_saw["seconds"])
    assert (streamed["kv_transfer_s"] >= pull_s[["r0", "r1"]]).all()
    assert np.isnan(pd_rows["kv_transfer_s"]["r3"]) and tokens["r3"] > 0
    local = rows.loc["r2"]
    assert (local["kv_transfer_tokens"], local["kv_transfer_bytes"], local["kv_transfer_s"]) == (0, 0, 0.0)


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
def test_p2p_overloaded_holder_is_pulled_from(model_dir: Path, tmp_path: Path, mode: str) -> None:
    rows_h5 = tmp_path / "router.h5"

    async def body() -> float:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=30.0), Recording) for i in range(2)]
            cfg = rconfig(
                model_dir, max_inflight_per_pod=2, speculative_ttl_s=0.0, p2p_mode=mode, metrics_out=str(rows_h5)
            )
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
                    http,
                    router.url + "/v1/completions",
                    {"prompt": prefix + " and more", "max_tokens": 2},
                    headers={"X-Request-Id": "pulled"},
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
                pulled = metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
                assert pulled >= 300
                for t in long:
                    assert (await t)[0] == 200
                outcome = "sent" if mode == "hash" else "ok"
                assert metric(await metric_text(http, router.url), "llmd_router_p2p_total", outcome=outcome) == 1
                return pulled

    pulled = run(body)
    rows = read_requests(rows_h5)
    row = rows[rows["request_id"] == "pulled"].iloc[0]
    # The target held none of the prompt: by hash it pulled the holder's prefix, two-hop the whole prompt (what its
    # engine counted); no latency model, so no bytes; not streamed, so no time.
    assert row["pd_path"] == "p2p" and row["kv_transfer_tokens"] == pulled
    whole = row["expected_hit_tokens"] if mode == "hash" else row["input_tokens"]
    assert row["kv_transfer_tokens"] == whole and row["kv_transfer_bytes"] == -1 and np.isnan(row["kv_transfer_s"])
    rest = rows[rows["request_id"] != "pulled"]
    assert len(rest) == 3 and (rest["kv_transfer_tokens"] == 0).all() and (rest["kv_transfer_s"] == 0).all()


def test_p2p_pull_failure_is_retried_without_transfer(model_dir: Path, tmp_path: Path) -> None:
    rows_h5 = tmp_path / "router.h5"

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            servers = [await sv.start(engine(model_dir, f"e{i}", time_scale=30.0)) for i in range(2)]
            # A wrong engine id: the holder refuses the pull, the puller fails the request (kv_load_failure_policy).
            pods = [pod_of(s, engine_id="wrong") for s in servers]
            cfg = rconfig(model_dir, max_inflight_per_pod=1, speculative_ttl_s=0.0, metrics_out=str(rows_h5))
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
                    http,
                    router.url + "/v1/completions",
                    {"prompt": prefix + " x", "max_tokens": 2, "stream": True},
                    headers={"X-Request-Id": "retried"},
                )
                assert st == 200 and 'data: {"error"' not in r and r.rstrip().endswith("[DONE]")
                assert int(h["x-llmd-attempts"]) == 2 and "x-llmd-p2p-source" not in h
                assert (await busy)[0] == 200

    run(body)
    # The row is the attempt that served: it computed the prompt, nothing was transferred.
    rows = read_requests(rows_h5)
    row = rows[rows["request_id"] == "retried"].iloc[0]
    assert (row["pd_path"], row["kv_transfer_tokens"], row["kv_transfer_s"]) == ("decode-only", 0, 0.0)


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
