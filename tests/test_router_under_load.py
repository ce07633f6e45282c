"""Defects the soak benchmark (benchmarks/soak.py, 3000 agents) found in the router: under uvloop, as `llmd router`
runs where it is installed, a queue wakeup already due is a Handle without when(); and a burst of new connections
overflowed the listening socket's accept queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from routerutil import rconfig

from llmd.router.proxy import Router


def test_queue_wakeups_already_due_are_armed_and_rearmed_under_uvloop(model_dir: Path) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def body() -> int:
        router = Router(rconfig(model_dir), [])
        loop = asyncio.get_running_loop()
        pumped = 0

        def pump() -> None:
            nonlocal pumped
            pumped += 1

        router._pump = pump  # type: ignore[method-assign]
        due = [loop.time() - 1.0, loop.time() - 0.5, loop.time() + 0.05]
        router.core.next_wakeup = lambda: due[0]  # type: ignore[method-assign]
        router._arm()
        for at in due[1:]:
            router.core.next_wakeup = lambda at=at: at  # type: ignore[method-assign]
            router._arm()  # raised AttributeError: 'uvloop.loop.Handle' object has no attribute 'when'
        await asyncio.sleep(0.2)
        return pumped

    assert uvloop.run(body()) >= 1


def test_router_listens_with_a_deep_accept_queue(model_dir: Path) -> None:
    """The soak's 3000 agents overflowed aiohttp's default backlog of 128 while the router's loop was busy; the kernel
    then reset the connections it had dropped (Connection reset by peer, 40-75 s later)."""
    import shutil
    import subprocess

    from llmd.router.proxy import LISTEN_BACKLOG

    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read a listening socket's backlog")

    async def body() -> str:
        async with Router(rconfig(model_dir), []) as router:
            return subprocess.run(
                ["ss", "-ltnH", f"sport = :{router.port}"], capture_output=True, text=True, check=True
            ).stdout

    out = asyncio.run(body())
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    backlog = int(out.split()[2])  # State Recv-Q Send-Q: a listener's Send-Q is its backlog
    assert backlog == min(LISTEN_BACKLOG, somaxconn) and backlog > 128, out
