"""The router's HTTP/1.1 client for its legs to the engines: pooled keep-alive connections, a POST, and the response
read whole or chunk by chunk as it streams.

Why not aiohttp's client, which the router used before: a leg is one POST of a body already in memory to a URL the
router built, with headers the router chose, and its response passed on as it comes. aiohttp's ClientSession builds a
request object, merges headers, parses the URL, looks up cookies and proxies, and times phases for each of them: about
250 us of CPU per request on this project's 2-core CI box, against ~50 us here (httptools' parser, the one uvicorn
and so vLLM's API server use). On the router's one event loop that was a sixth of its CPU per request at the
throughput benchmark's load (benchmarks/router.py, router_vs_sglang).

What a leg needs, and this keeps: connections reused while idle for less than `keepalive_s` (below vLLM's 5 s, see
llmd.net.http_client) and closed whenever a response was not read to its end (the engine learns that way that the
request was abandoned, and aborts it); reading paused while a streamed body waits for a slow client; failures told
apart: refused or unreachable (ConnectFailed: the pod is gone), a connect that timed out (ConnectTimeout, a
TimeoutError), the server closing before or during a response (Disconnected), a response that is not HTTP/1.1
(BadResponse). A POST whose connection drops before any byte of a response is sent once more (`post`'s on_resend).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

from llmd.net.http_client import KEEPALIVE_S

_PAUSE_AT = 1 << 20  # bytes of a body buffered, unread, before reading from the engine pauses
_URLS_CACHED = 4096  # parsed URLs remembered (pods x routes); the cache is emptied when full
_DROP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})  # ours to set


class EngineHTTPError(Exception):
    """A leg to an engine failed below HTTP (connection, framing)."""


class ConnectFailed(EngineHTTPError):
    """The connection was refused or the host is unreachable: the pod is gone, sending again cannot help."""


class ConnectTimeout(EngineHTTPError, TimeoutError):
    """The connection was not made within the connect timeout."""


class Disconnected(EngineHTTPError):
    """The server closed the connection before the response ended. `before_response`: not a byte of a response had
    come (the request may not have been seen at all); `os_error`: the reset, where it was one (None: a clean close)."""

    def __init__(self, message: str, *, before_response: bool, os_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.before_response = before_response
        self.os_error = os_error


class BadResponse(EngineHTTPError):
    """The bytes the server sent are not an HTTP/1.1 response."""


class Response:
    """One response: `status` and `headers` (name, value pairs as sent) once its head has come; the body through
    `read()` (whole) or `readany()` (what has come, b"" at its end). `release()` gives the connection back to the
    pool if the body was read to its end, `close()` closes it; one of the two must be called."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Conn, status: int, headers: list[tuple[str, str]]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers

    def header(self, name: str) -> str | None:
        """The first header of that name (any case), or None."""
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def complete(self) -> bool:
        """The whole body has come (read() will not wait)."""
        return self._conn.complete

    async def readany(self) -> bytes:
        return await self._conn.readany()

    async def read(self) -> bytes:
        parts = []
        while chunk := await self._conn.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        self._conn.finish()

    def close(self) -> None:
        self._conn.abort()


class _Conn(asyncio.Protocol):
    """One keep-alive connection and the response in progress on it (httptools' callbacks)."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.got_bytes = False  # any byte of the current response
        self.complete = False  # the current response's body has ended
        self.keep_alive = False
        self.paused = False
        self.error: BaseException | None = None
        self._head: asyncio.Future[Response] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0

    # -- the request
    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.got_bytes = self.complete = False
        self.error = None
        self._headers = []
        self._body.clear()
        self._buffered = 0
        self._head = loop.create_future()
        self.transport.write(data)
        return self._head

    async def readany(self) -> bytes:
        while True:
            if self._body:
                data = b"".join(self._body) if len(self._body) > 1 else self._body[0]
                self._body.clear()
                self._buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None

    def finish(self) -> None:
        """The caller is done with the response: pooled again if it was read to its end and may be kept."""
        if self.complete and self.keep_alive and not self.closed and not self._body:
            self.idle_since = time.monotonic()
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"not an HTTP/1.1 response: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.complete:
            return
        if self._head is not None and not self.got_bytes:
            why = f"reset the connection before answering: {exc}" if exc else "closed the connection before answering"
            self._fail(Disconnected(f"the server {why}", before_response=True, os_error=exc))
            return
        # The head came and the body is open: a body that ends with the connection (no length, not chunked) ends
        # here; any other is cut short.
        if self._head is None and self._close_delimited():
            self._message_done(keep=False)
            return
        why = f"reset the connection in the middle of a response: {exc}" if exc else "closed it mid-response"
        self._fail(Disconnected(f"the server {why}", before_response=False, os_error=exc))

    # -- httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        head, self._head = self._head, None
        if head is None:
            self._fail(BadResponse("a response came with no request out"))
            return
        if not head.done():
            head.set_result(Response(self, self.parser.get_status_code(), self._headers))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._notify()

    def on_message_complete(self) -> None:
        self._message_done(keep=self.parser.should_keep_alive())

    # -- helpers
    def _close_delimited(self) -> bool:
        return all(k.lower() not in ("content-length", "transfer-encoding") for k, _ in self._headers)

    def _message_done(self, keep: bool) -> None:
        self.complete = True
        self.keep_alive = keep
        self._notify()

    def _notify(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(exc)
        self._notify()


class _HostPool:
    """Idle connections to one (scheme, host, port), most recently used first out."""

    def __init__(self, scheme: str, host: str, port: int) -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self.idle: list[_Conn] = []
        self.closed = False

    def put(self, conn: _Conn) -> None:
        if self.closed:
            conn.abort()  # a leg that ended after the pool closed: nothing will take its connection again
        else:
            self.idle.append(conn)

    def forget(self, conn: _Conn) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def take(self, keepalive_s: float) -> _Conn | None:
        idle = self.idle
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if not c.closed and now - c.idle_since < keepalive_s:
                return c
            c.abort()
        return None

    def close(self) -> None:
        self.closed = True
        for c in self.idle:
            c.abort()
        self.idle.clear()


class EnginePool:
    """Connections to the engines, pooled per host: `post` sends a request and returns its response's head."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._hosts: dict[tuple[str, str, int], _HostPool] = {}
        self._urls: dict[str, tuple[_HostPool, bytes, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        on_resend: Callable[[BaseException], None] | None = None,
    ) -> Response:
        """POST `body` to `url`. If the connection drops before any byte of a response (the engine closed the pooled
        connection as the request went out), the request goes once more on a new connection: the body is in memory,
        so resending is exact; an engine that never saw it loses nothing, one that did only did work nobody reads.
        Raises ValueError for a URL that is not http(s) or a header with a line break in it."""
        pool, path, host = self._target(url)
        data = _request(path, host, headers or {}, body)
        try:
            return await self._exchange(pool, data, reuse=True)
        except Disconnected as exc:
            if not exc.before_response:
                raise
            if on_resend is not None:
                on_resend(exc)
        return await self._exchange(pool, data, reuse=False)

    async def close(self) -> None:
        self.closed = True
        for p in self._hosts.values():
            p.close()
        self._hosts.clear()

    async def _exchange(self, pool: _HostPool, data: bytes, reuse: bool) -> Response:
        if self.closed:
            raise ConnectFailed("the router is shutting down")
        conn = pool.take(self.keepalive_s) if reuse else None
        if conn is None:
            conn = await self._connect(pool)
        head = conn.send(data, asyncio.get_running_loop())
        try:
            return await head
        except BaseException:
            conn.abort()  # cancelled (a deadline, the client left) or failed: the connection is not reusable
            raise

    async def _connect(self, pool: _HostPool) -> _Conn:
        loop = asyncio.get_running_loop()
        ctx = None
        if pool.scheme == "https":
            ctx = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(pool), pool.host, pool.port, ssl=ctx)
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"cannot connect to {pool.host}:{pool.port} within {self.connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {pool.host}:{pool.port}: {exc}") from exc
        return conn

    def _target(self, url: str) -> tuple[_HostPool, bytes, bytes]:
        got = self._urls.get(url)
        if got is not None:
            return got
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        key = (u.scheme, u.hostname, port)
        pool = self._hosts.get(key)
        if pool is None:
            pool = self._hosts[key] = _HostPool(*key)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        host = u.netloc.rpartition("@")[2]
        if len(self._urls) >= _URLS_CACHED:
            self._urls.clear()
        got = self._urls[url] = (pool, _ascii(path, "path"), _ascii(host, "host"))
        return got


def _ascii(s: str, what: str) -> bytes:
    if any(c in s for c in "\r\n\0 "):
        raise ValueError(f"the URL's {what} has a space or line break in it: {s!r}")
    return s.encode("ascii")


def _request(path: bytes, host: bytes, headers: Mapping[str, str], body: bytes) -> bytes:
    parts = [b"POST ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for k, v in headers.items():
        if k.lower() in _DROP_HEADERS:
            continue
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v or ":" in k:
            raise ValueError(f"header {k!r} has a line break or colon in its name or value")
        parts += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
    parts += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
    return b"".join(parts)
