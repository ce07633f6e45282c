"""Limits an HTTP server facing untrusted clients puts on what it reads: how long a connection may take to send its
headers and its body, how big a body may be, how deeply its JSON may nest. Shared by the router and the simulated
engine's server (both aiohttp).

aiohttp bounds a fresh connection's wait for its first request line by the keep-alive timeout (so a client that opens
a connection and sends nothing, or half a header, is closed after it), but it has no limit at all on reading a body:
a client that sends `Content-Length: 1000` and ten bytes holds its connection and its handler forever. `read_body`
bounds every silence while a body arrives; `runner_kwargs` sets the keep-alive (header) timeout and how long a
server lingers over an unread body after answering.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# Well above what any real request nests (OpenAI tool schemas nest a few dozen levels at most) and far below the
# interpreter's recursion limit (1000), which is what bounds the C parsers (json, msgspec) themselves.
MAX_JSON_DEPTH = 128


class BodyTimeout(Exception):
    """The client stopped sending its request body for longer than the limit."""

    def __init__(self, idle_s: float, received: int) -> None:
        super().__init__(f"the request body stalled: no bytes for {idle_s:g} s after {received} bytes")
        self.idle_s = idle_s
        self.received = received


class JSONTooDeep(ValueError):
    def __init__(self, max_depth: int) -> None:
        super().__init__(f"the request body nests JSON arrays and objects deeper than {max_depth} levels")
        self.max_depth = max_depth


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one server allows its clients. `header_timeout_s` is aiohttp's keep-alive timeout: it bounds both a
    fresh connection's wait for a complete request head and an idle keep-alive connection."""

    header_timeout_s: float = 15.0
    body_idle_timeout_s: float = 30.0
    lingering_s: float = 2.0  # after answering a request whose body was not read to the end

    def runner_kwargs(self) -> dict[str, Any]:
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": self.lingering_s}


async def read_body(request: web.BaseRequest, max_bytes: int, idle_s: float) -> bytes:
    """The whole request body; raises BodyTimeout when the client sends nothing for `idle_s` (a slow client that
    keeps sending is never cut), HTTPRequestEntityTooLarge past `max_bytes` (as aiohttp's own `read()` does)."""
    if not request.can_read_body:
        return await request.read()  # read already (aiohttp keeps it), or none
    length = request.content_length
    if length is not None and length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=length)
    content = request.content
    if content.is_eof():
        # The whole body came with the headers (any small request): nothing left to wait for, so no deadline to arm.
        body = content.read_nowait()
        if len(body) > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(body))
        return body
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(idle_s) as cm:
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)
                chunks.append(chunk)
                cm.reschedule(loop.time() + idle_s)
    except TimeoutError:
        raise BodyTimeout(idle_s, size) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_depth(raw: bytes | bytearray, value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """JSONTooDeep when `value` (parsed from `raw`) nests containers deeper than `max_depth`.

    The parsers themselves refuse absurd depths (RecursionError at the interpreter's limit); this bounds what the rest
    of the server walks (templates, validators, re-encoding). A body with no more brackets than the limit cannot nest
    deeper, which is every ordinary request: then nothing is walked. A byte-level pre-scan would have to skip string
    contents, and the regexes that do that go quadratic on hostile input (runs of escaped quotes); walking the parsed
    containers costs one step per container."""
    if not isinstance(value, dict | list) or raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            raise JSONTooDeep(max_depth)
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, dict | list):
                stack.append((c, depth + 1))
