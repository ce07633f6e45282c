"""Helpers the network tests share: bounded event loops and free port ranges on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any


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
