"""Helpers for the router's tests against simulated vLLM engines in this process: engine and router configs,
started servers, a recording server, requests, metrics, waiting for a condition."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from netutil import run as run_bounded

from llmd.discovery import PodInfo
from llmd.engines.sim.core import SimEngineConfig
from llmd.engines.sim.server import SimServer
from llmd.engines.sim.server_config import SimServerConfig
from llmd.router.proxy import RouterConfig
from llmd.spec.model import RouterSpec

BS = 16
MAX_LEN = 4096
REPO = Path(__file__).resolve().parent.parent


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """Router tests run longer flows (P/D, retries): a wider bound than the shared default."""
    return run_bounded(coro_fn, timeout)


def engine(model_dir: Path, name: str, role: str = "both", **kw: Any) -> SimServerConfig:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in SimEngineConfig.__dataclass_fields__}
    engine_kw.setdefault("num_gpu_blocks", 1024)
    eng = SimEngineConfig(block_size=BS, max_model_len=MAX_LEN, **engine_kw)
    kw.setdefault("side_channel_port", 0)
    kw.setdefault("kv_events_endpoint", "tcp://*:0")
    kw.setdefault("kv_events_replay_endpoint", "tcp://*:0")
    kw.setdefault("time_scale", 1.0)
    return SimServerConfig(str(model_dir), served_name="tiny", role=role, name=name, engine=eng, **kw)  # type: ignore[arg-type]


def pod_of(server: SimServer, name: str | None = None, **kw: Any) -> PodInfo:
    """The discovery entry a launcher would write for a started sim server."""
    c = server.config
    kv = server.publishers[0].endpoint if server.publishers else None
    side = server.side_channels[0].port if server.side_channels else None
    fields: dict[str, Any] = {
        "name": name or c.name,
        "role": c.role,
        "url": server.url,
        "dp_size": c.dp_size,
        "kv_events_endpoint": kv,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": side,
        "engine_id": server.engine_id,
    }
    fields.update(kw)
    return PodInfo(**fields)


def rconfig(model_dir: Path, **kw: Any) -> RouterConfig:
    spec_kw = {k: kw.pop(k) for k in list(kw) if k in RouterSpec.model_fields and k not in ("host", "port")}
    spec = RouterSpec(**spec_kw)
    kw.setdefault("port", 0)
    kw.setdefault("tokenizer", str(model_dir))
    kw.setdefault("block_size", BS)
    kw.setdefault("served_name", "tiny")
    kw.setdefault("health_interval_s", 0.2)
    kw.setdefault("metrics_interval_s", 0.2)
    return RouterConfig.from_router_spec(spec, **kw)


class Servers:
    """Started sim servers, stopped at the end whatever happens."""

    def __init__(self) -> None:
        self.servers: list[SimServer] = []

    async def start(self, cfg: SimServerConfig, cls: type[SimServer] = SimServer) -> SimServer:
        s = await cls(cfg).start()
        self.servers.append(s)
        return s

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)


class Recording(SimServer):
    """A sim server that keeps every generate request's body and headers (what the router sent)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    def _build_app(self) -> Any:
        app = super()._build_app()

        async def record(request: Any, handler: Any) -> Any:
            if request.path.startswith("/v1/") and request.method == "POST":
                self.seen.append((json.loads(await request.read()), dict(request.headers)))
            return await handler(request)

        from aiohttp import web

        app.middlewares.insert(0, web.middleware(record))
        return app


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, **kw: Any
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with http.post(url, json=body, **kw) as r:
        text = await r.text()
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            data = text
        return r.status, data, r.headers


async def metric_text(http: aiohttp.ClientSession, url: str, **kw: Any) -> str:
    async with http.get(url + "/metrics", **kw) as r:
        assert r.status == 200
        return await r.text()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        sname, _, lab = series.partition("{")
        if sname == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
    return total


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def words(seed: int, n: int) -> str:
    """Distinct text per seed: each session's prefix is its own."""
    return " ".join(f"w{seed}x{i}" for i in range(n))
