"""The serving path under hostile clients, over real HTTP on 127.0.0.1: bodies no engine can take get a 400 naming
the field (router and simulated engine), every answer is counted under a bounded route label, stalled and idle
connections are closed, and every listener binds loopback unless told otherwise. Every test body runs under a time
bound."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
from netutil import listening
from routerutil import Servers, engine, metric, metric_text, pod_of, rconfig, run

from llmd.engines.sim.server import SimServer
from llmd.router.proxy import Router

JSON = {"Content-Type": "application/json"}
DEEP = b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


async def send(http: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
    headers = JSON if headers is None else headers
    async with http.post(url, data=data, headers=headers, skip_auto_headers=("Content-Type",)) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text.startswith("{") else text)


def error_shape(body: Any) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_bad_bodies_are_400s_naming_the_field_and_counted(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0"))
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                chat = router.url + "/v1/chat/completions"
                st, r = await send(http, chat, b'{"messages":[{"role":"user","content":5}],"max_tokens":2}')
                err = error_shape(r)
                assert st == 400 and err["type"] == "BadRequestError" and err["code"] == 400
                assert err["param"] == "messages.0.content" and "content" in err["message"]
                st, r = await send(http, chat, b'{"messages":[{"content":"hi"}]}')
                assert st == 400 and error_shape(r)["param"] == "messages.0.role"
                st, r = await send(http, chat, DEEP)
                assert st == 400 and "deeper than 128" in error_shape(r)["message"]
                st, r = await send(http, chat, b'{"messages":[{"role":"user","content":"\xff"}]}')
                assert st == 400 and error_shape(r)["code"] == 400
                ok = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
                for ctype in ({"Content-Type": "text/plain"}, {}):
                    st, r = await send(http, chat, ok, ctype)
                    assert st == 400 and "Only 'application/json'" in error_shape(r)["message"], r
                assert (await send(http, chat, ok))[0] == 200
                text = await metric_text(http, router.url)
                assert metric(text, "llmd_router_requests_total", route="/v1/chat/completions", status="400") == 6
                assert metric(text, "llmd_router_requests_total", route="/v1/chat/completions", status="200") == 1
                # The engine answers the same bodies alike (its message: vLLM's pydantic errors, naming the field).
                eng = s.url + "/v1/chat/completions"
                st, r = await send(http, eng, b'{"messages":[{"role":"user","content":5}],"max_tokens":2}')
                assert st == 400 and "body.messages.0" in error_shape(r)["param"]
                st, r = await send(http, eng, DEEP)
                assert st == 400 and "deeper than 128" in error_shape(r)["message"]
                st, r = await send(http, eng, b'{"messages":[{"role":"user","content":"\\ud800"}]}')
                assert st == 400 and "surrogate" in error_shape(r)["message"]
                st, r = await send(http, s.url + "/v1/completions", b'{"prompt":"\\udfff x","max_tokens":1}')
                assert st == 400

    run(body)


def test_route_labels_are_bounded_and_every_status_is_counted(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0"))
            async with Router(rconfig(model_dir, api_key="k"), [pod_of(s)]) as router:
                auth = {"Authorization": "Bearer k"}
                for path in ("/etc/passwd", "/v2/../x", "/%2e%2e"):
                    async with http.get(router.url + path, headers=auth) as r:
                        assert r.status == 404
                        assert error_shape(await r.json())["code"] == 404
                async with http.get(router.url + "/v1/completions", headers=auth) as r:
                    assert r.status == 405
                async with http.get(router.url + "/v1/models") as r:
                    assert r.status == 401
                # An unhandled error in a handler: an OpenAI-style 500, counted.
                router._prompts.read = _boom  # type: ignore[method-assign]
                st, r = await send(http, router.url + "/v1/completions", b'{"prompt":"x"}', {**JSON, **auth})
                assert st == 500 and error_shape(r)["type"] == "InternalServerError"
                text = await metric_text(http, router.url, headers=auth)
                assert "/etc/passwd" not in text and "%2e" not in text
                assert metric(text, "llmd_router_requests_total", route="other", status="404") == 3
                assert metric(text, "llmd_router_requests_total", route="/v1/completions", status="405") == 1
                assert metric(text, "llmd_router_requests_total", route="/v1/models", status="401") == 1
                assert metric(text, "llmd_router_requests_total", route="/v1/completions", status="500") == 1
                routes = {
                    line.split('route="')[1].split('"')[0]
                    for line in text.splitlines()
                    if line.startswith("llmd_router_requests_total{")
                }
                assert routes <= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                  "other"}  # fmt: skip

    run(body)


async def _boom(*a: Any, **kw: Any) -> Any:
    raise RuntimeError("injected")


async def _half_sent(port: int, n: int, head_only: bool) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if head_only:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        else:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
            )
        conns.append((reader, writer))
    return conns


async def _closed_by_server(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], timeout: float) -> bytes | None:
    """What the server sent before closing the connection; None if it was still open after `timeout`."""
    reader, writer = conn
    try:
        async with asyncio.timeout(timeout):
            return await reader.read()  # to EOF: the server closed it
    except TimeoutError:
        return None
    except ConnectionError:
        return b""
    finally:
        writer.close()


@pytest.mark.parametrize("head_only", [True, False], ids=["half-sent-head", "half-sent-body"])
def test_half_sent_requests_do_not_hold_connections(model_dir: Path, head_only: bool) -> None:
    """500 connections that send half a request and go quiet are all closed by the router and by the engine (a
    stalled body is answered 408 first); both still serve afterwards."""

    # A stalled body is the body timeout's to answer: a header timeout as short would race it for a connection whose
    # complete head the busy loop (250 connections at once, on a loaded CI machine) has not parsed yet, and close it
    # silently instead of answering 408.
    head_s = 0.5 if head_only else 5.0

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            s = await sv.start(engine(model_dir, "e0", header_timeout_s=head_s, body_timeout_s=0.5))
            cfg = rconfig(model_dir, header_timeout_s=head_s, body_timeout_s=0.5)
            async with Router(cfg, [pod_of(s)]) as router:
                for port, base in ((router.port, router.url), (s.port, s.url)):
                    conns = await _half_sent(port, 250, head_only)
                    got = await asyncio.gather(*(_closed_by_server(c, 8.0) for c in conns))
                    assert all(g is not None for g in got), (base, sum(g is None for g in got))
                    if not head_only:
                        odd = sorted({(g or b"")[:60] for g in got if not (g and g.startswith(b"HTTP/1.1 408"))})
                        assert not odd, (base, sum(not (g and g.startswith(b"HTTP/1.1 408")) for g in got), odd[:3])
                    st, _ = await send(http, base + "/v1/completions", b'{"prompt":"still here","max_tokens":1}')
                    assert st == 200
                if not head_only:
                    text = await metric_text(http, router.url)
                    assert metric(text, "llmd_router_requests_total", route="/v1/completions", status="408") == 250

    run(body, 40)


def test_every_listener_binds_loopback_by_default(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv:
            s = await sv.start(engine(model_dir, "e0"))
            async with Router(rconfig(model_dir), [pod_of(s)]) as router:
                ports = [router.port, s.port]
                for p in s.publishers:
                    assert p.endpoint.startswith("tcp://*:")  # reported as vLLM's "bound" form
                    ports.append(int(p.endpoint.rpartition(":")[2]))
                    assert p.replay_endpoint is not None
                    ports.append(int(p.replay_endpoint.rpartition(":")[2]))
                ports += [c.port for c in s.side_channels]
                for port in ports:
                    assert listening(port) == {"127.0.0.1"}, port
                # The router still hears the events (it connects to the pod's host).
                st = router.hub.stats
                async with aiohttp.ClientSession() as http:
                    prompt = json.dumps({"prompt": "events please " * 40, "max_tokens": 1}).encode()
                    assert (await send(http, router.url + "/v1/completions", prompt))[0] == 200
                t0 = time.monotonic()
                while st.batches == 0 and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.05)
                assert st.batches > 0

    run(body)


def test_a_node_address_binds_there_and_star_binds_everywhere(model_dir: Path) -> None:
    """Under a launcher the server's host is the node's address: its KV sockets listen there. `kv_events_host="*"`
    is vLLM's bind-everything, only when asked for."""

    async def body() -> None:
        async with SimServer(engine(model_dir, "e0", host="127.0.0.2")) as s:
            port = int(s.publishers[0].endpoint.rpartition(":")[2])
            assert listening(port) == {"127.0.0.2"}
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.2:{port}")
            sub.close(linger=0)
        async with SimServer(engine(model_dir, "e1", kv_events_host="*")) as s:
            port = int(s.publishers[0].endpoint.rpartition(":")[2])
            assert listening(port) == {"0.0.0.0"}

    run(body)


def test_an_engine_rejecting_a_stream_in_its_first_event_reaches_the_client_once(model_dir: Path) -> None:
    """vLLM streams some 400s as an error event after a 200 (an empty decoder prompt): any engine would answer the
    same, so the router passes it on as sent instead of retrying it elsewhere and answering 502."""

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            engines = [await sv.start(engine(model_dir, f"e{i}")) for i in range(2)]
            async with Router(rconfig(model_dir), [pod_of(s) for s in engines]) as router:
                url = router.url + "/v1/completions"
                for prompt in ([""], [[]]):
                    data = json.dumps({"model": "tiny", "prompt": prompt, "stream": True}).encode()
                    st, text = await send(http, url, data)
                    assert st == 200, text
                    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
                    assert events[-1] == "[DONE]" and len(events) == 2, text
                    err = error_shape(json.loads(events[0]))
                    assert err["code"] == 400 and "prompt cannot be empty" in err["message"]
                m = await metric_text(http, router.url)
                assert metric(m, "llmd_router_retries_total") == 0  # before: stream_error, 3 attempts, then a 502

    run(body, timeout=60)
