"""llmd.net.h1, the router's HTTP/1.1 client to the engines, against real servers on 127.0.0.1: aiohttp's (what the
simulated engine serves with) and raw asyncio ones that misbehave the ways engines and networks do."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from llmd.net import h1

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


class RawServer:
    """An asyncio server on 127.0.0.1 calling `handler` per connection, counting connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(r, w)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await r.readexactly(int(headers.get("content-length", "0")))
    return lines[0].encode(), headers, body


def answering(raw: bytes, linger_s: float = 0.0) -> Handler:
    """A handler that reads one request, writes `raw` back and keeps the connection `linger_s` longer."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(raw)
        await w.drain()
        await asyncio.sleep(linger_s)

    return handler


def ok(body: bytes, extra: str = "") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def test_posts_and_reuses_connections_against_aiohttp() -> None:
    async def body() -> None:
        async def echo(request: web.Request) -> web.Response:
            data = await request.read()
            return web.json_response(
                {"len": len(data), "rid": request.headers.get("X-Request-Id"), "host": request.headers.get("Host")},
                headers={"X-Engine": "e0"},
            )

        app = web.Application()
        app.router.add_post("/v1/completions", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        pool = h1.EnginePool(5.0)
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            for i in range(3):
                headers = {"Content-Type": "application/json", "X-Request-Id": f"r{i}"}
                r = await pool.post(url, b"x" * (1000 * i), headers)
                assert r.status == 200 and r.header("x-engine") == "e0"
                assert (r.header("content-type") or "").startswith("application/json")
                got = json.loads(await r.read())
                assert got == {"len": 1000 * i, "rid": f"r{i}", "host": f"127.0.0.1:{port}"}
                r.release()
            host = pool._hosts[("http", "127.0.0.1", port)]
            assert len(host.idle) == 1  # one connection, reused
            r = await pool.post(url, b"{}", {"Content-Type": "application/json"})
            await pool.close()  # a leg still open as the router stops
            assert await r.read()
            r.release()
            assert not host.idle and r._conn.closed  # closed, not pooled again
        finally:
            await pool.close()
            await runner.cleanup()

    run(body())


def test_streams_chunk_by_chunk_and_reuses_after_a_chunked_body() -> None:
    async def body() -> None:
        go = asyncio.Event()

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                await read_request(r)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                w.write(b"7\r\ndata: 1\r\n")
                await w.drain()
                await go.wait()  # the second chunk only after the client has read the first
                w.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
                await w.drain()
                go.clear()

        async with RawServer(handler) as srv:
            pool = h1.EnginePool(5.0)
            for _ in range(2):
                r = await pool.post(srv.url, b"{}")
                assert r.status == 200 and not r.complete
                assert await r.readany() == b"data: 1"
                go.set()
                assert await r.readany() == b"data: 2"
                assert await r.readany() == b"" and r.complete
                r.release()
            assert srv.connections == 1
            # Released before its end: the connection closes (the engine aborts the request), the next gets a new one.
            r = await pool.post(srv.url, b"{}")
            assert await r.readany() == b"data: 1"
            r.release()
            go.set()
            await asyncio.sleep(0.1)  # the server writes on into the closed connection and gives up
            go.clear()
            r = await pool.post(srv.url, b"{}")
            assert await r.readany() == b"data: 1" and srv.connections == 2
            r.close()
            await pool.close()

    run(body())


def test_a_body_that_ends_with_the_connection_is_read_whole_and_not_pooled() -> None:
    async def body() -> None:
        async with RawServer(answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")) as srv:
            pool = h1.EnginePool(5.0)
            for _ in range(2):
                r = await pool.post(srv.url, b"{}")
                assert await r.read() == b"all of it"
                r.release()
            assert srv.connections == 2
            await pool.close()

    run(body())


def test_a_pooled_connection_closed_under_a_request_is_resent_once() -> None:
    """vLLM's uvicorn closes an idle keep-alive connection after 5 s; a request sent on it as it closes gets no byte
    back. It goes once more on a fresh connection; a server that drops every request is not resent to forever."""
    served = 0
    drop_every = False

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            await read_request(r)
            if drop_every or served == 1:
                served += 1
                return  # closes the connection, not a byte of an answer
            served += 1
            w.write(ok(b'{"ok": true}'))
            await w.drain()

    async def body() -> None:
        nonlocal drop_every
        async with RawServer(handler) as srv:
            pool = h1.EnginePool(5.0)
            resent: list[BaseException] = []
            for _ in range(2):
                r = await pool.post(srv.url, b"{}", on_resend=resent.append)
                assert await r.read() == b'{"ok": true}'
                r.release()
            assert served == 3 and len(resent) == 1 and srv.connections == 2
            assert isinstance(resent[0], h1.Disconnected) and resent[0].before_response
            drop_every = True
            with pytest.raises(h1.Disconnected) as err:
                await pool.post(srv.url, b"{}", on_resend=resent.append)
            assert err.value.before_response and err.value.os_error is None and len(resent) == 2
            await pool.close()

    run(body())


def test_a_body_cut_short_raises_and_nothing_is_pooled() -> None:
    async def body() -> None:
        async with RawServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")) as srv:
            pool = h1.EnginePool(5.0)
            r = await pool.post(srv.url, b"{}")
            assert r.status == 200
            assert await r.readany() == b"only this"
            with pytest.raises(h1.Disconnected) as err:
                await r.readany()
            assert not err.value.before_response
            r.release()  # not read to its end: closed, not pooled
            assert not pool._hosts[("http", "127.0.0.1", srv.server.sockets[0].getsockname()[1])].idle  # type: ignore[union-attr]
            await pool.close()

    run(body())


def test_garbage_refused_and_bad_input() -> None:
    async def body() -> None:
        async with RawServer(answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", linger_s=1.0)) as srv:
            pool = h1.EnginePool(5.0)
            with pytest.raises(h1.BadResponse):
                await pool.post(srv.url, b"{}")
            with pytest.raises(ValueError, match="line break"):
                await pool.post(srv.url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})
            with pytest.raises(ValueError, match="http"):
                await pool.post("ftp://127.0.0.1/x", b"{}")
            port = srv.server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        with pytest.raises(h1.ConnectFailed):  # the server is gone: refused
            await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}")
        await pool.close()

    run(body())


def test_a_cancelled_request_closes_its_connection_and_idle_ones_expire() -> None:
    closed = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        _, _, body = await read_request(r)
        if body == b"slow":
            if not await r.read(1):  # the client's close is how an engine learns the request was abandoned
                closed.set()
            return
        w.write(ok(b"fast"))
        await w.drain()
        await r.read(1)

    async def body() -> None:
        async with RawServer(handler) as srv:
            pool = h1.EnginePool(5.0, keepalive_s=0.2)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await pool.post(srv.url, b"slow")
            await asyncio.wait_for(closed.wait(), 5)
            r = await pool.post(srv.url, b"fast")
            assert await r.read() == b"fast"
            r.release()
            await asyncio.sleep(0.3)  # past keepalive_s: the idle connection is not used again
            r = await pool.post(srv.url, b"fast")
            r.release()
            assert srv.connections == 3
            await pool.close()

    run(body())


def test_a_big_body_read_slowly_pauses_the_engine_and_arrives_whole() -> None:
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB, past the pause threshold

    async def body() -> None:
        async with RawServer(answering(ok(big))) as srv:
            pool = h1.EnginePool(5.0)
            r = await pool.post(srv.url, b"{}")
            await asyncio.sleep(0.3)  # the engine sends; nobody reads
            assert r._conn.paused  # reading stopped at the threshold instead of buffering all
            assert await r.read() == big
            r.release()
            await pool.close()

    run(body())
