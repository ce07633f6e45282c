"""The router under uvloop, as `llmd router` runs it where uvloop is installed: a queue wakeup already due is armed
with a Handle that has no when() (the soak benchmark's requests failed on it, their connections reset)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from routerutil import rconfig

from llmd.router.proxy import Router

uvloop = pytest.importorskip("uvloop")


def test_queue_wakeups_already_due_are_armed_and_rearmed_under_uvloop(model_dir: Path) -> None:
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
