"""Helpers the network tests share: bounded event loops, free port ranges on 127.0.0.1, a sim server that drops
connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from llmd.engines.sim.server import SimServer


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    """Each test body runs in its own event loop, bounded in time."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(bounded())


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports (per-rank endpoints are port + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


class DroppingSimServer(SimServer):
    """A sim server that closes the connection of its next `drops` generate requests without a byte of answer: what
    vLLM's uvicorn does when a pooled keep-alive connection reaches its idle timeout just as a request goes out. Each
    distinct body is dropped once unless `again` (the race does not strike the same request twice in a row)."""

    drops = 0
    again = False

    def _build_app(self) -> Any:
        app = super()._build_app()
        seen: set[bytes] = set()

        async def drop(request: Any, handler: Any) -> Any:
            if request.path.startswith("/v1/") and request.method == "POST" and self.drops > 0:
                body = await request.read()
                if body in seen and not self.again:
                    return await handler(request)
                seen.add(body)
                self.drops -= 1
                request.transport.close()
                raise asyncio.CancelledError  # nothing more to send: the connection is gone
            return await handler(request)

        from aiohttp import web

        app.middlewares.insert(0, web.middleware(drop))
        return app


def listening(port: int) -> set[str]:
    """The local addresses listening on `port` (from /proc/net/tcp, IPv4)."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hexip, hexport = local.split(":")
            if int(hexport, 16) == port and state == "0A":
                out.add(socket.inet_ntoa(bytes.fromhex(hexip)[::-1]))
    return out
