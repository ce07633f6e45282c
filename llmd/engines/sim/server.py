"""The simulated engine's HTTP server: vLLM 0.32's OpenAI API in front of simulated engine cores (one per DP rank).

Endpoints as vLLM serves them: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /metrics, /version, /ping, /load, /kv_event_sources; POST /reset_prefix_cache (vLLM dev mode). The rank of a
request is the `X-data-parallel-rank` header's (vLLM's name), else the least loaded rank. Each rank publishes KV
events on its own endpoint (port + rank) and serves KV pulls on its own side-channel port (port + rank).

Around the API, as vLLM's FastAPI app: an unknown route or method is Starlette's `{"detail": ...}` 404/405 (with
`Allow`), CORS is Starlette's middleware with vLLM's defaults (`Vary: Origin`, every preflight refused), and /metrics
carries prometheus-fastapi-instrumentator's `http_*` families and the process/platform/GC collectors. Logprobs are
synthetic (llmd/engines/sim/logprobs.py) in vLLM's exact shapes.

This module is the app around the engine: lifecycle, routes, middleware and the small endpoints. Generation is
serving.py (with serving_chat.py and serving_completion.py), the wire format openai/, the settings server_config.py.
`SimServer` is one engine server; `SimEngineGroup` starts several in this event loop (tests, demos). Usage details
follow vLLM's `--enable-prompt-tokens-details`, which is off in vLLM but on here by default: routers and benchmarks of
this project read `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq
from aiohttp import web

from llmd import runid
from llmd.net.limits import BodyTimeout, ServerLimits, read_body

from .core import EngineCore
from .logprobs import LogprobSynth
from .metrics import CONTENT_TYPE, EngineMetrics
from .openai.errors import APIError, error_body
from .openai.responses import VLLM_VERSION, models_response, random_uuid, system_fingerprint
from .publisher import KVEventPublisher
from .runner import EngineRunner, RankRunner, SimClock
from .server_config import SimServerConfig, cache_config_info, default_latency
from .serving import json_response
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_tokenization import OpenAIServingTokenization
from .tokenizer import SimTokenizer
from .transfer import SideChannelServer

log = logging.getLogger(__name__)

# Starlette's CORSMiddleware as vLLM configures it (no allowed origins, every method and header).
CORS_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
CORS_PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"
)


# Pending connections the listening socket queues: uvicorn's default, which vLLM's API server runs with (aiohttp's own
# 128 overflowed when a few hundred clients connected at once on a busy machine, and the kernel reset the rest).
LISTEN_BACKLOG = 2048


class SimServer:
    """A simulated vLLM server: start() binds its port, stop() releases everything."""

    def __init__(self, config: SimServerConfig, *, on_crash: Callable[[], None] | None = None) -> None:
        self.config = config
        self.on_crash = on_crash
        self.tokenizer = SimTokenizer(config.model_dir)
        self.served_name = config.served_name or Path(config.model_dir).name
        self.max_model_len = config.max_model_len or config.engine.max_model_len
        self.latency = config.latency or default_latency()
        self.metrics = EngineMetrics(
            self.served_name,
            range(config.dp_size),
            self.max_model_len,
            kv_connector=config.side_channel_port is not None and config.engine.kv_transfer,
            cache_config=cache_config_info(config, self.latency, self.max_model_len),
        )
        self.logprobs = LogprobSynth(self.tokenizer, self.tokenizer.special_token_ids)
        self._allow: dict[str, str] = {}  # path -> the method of its first route (Starlette's Allow on a 405)
        self.engine_id = config.engine_id or f"sim-{random_uuid()}"
        self.clock = SimClock(config.time_scale)
        self.ranks: list[RankRunner] = []
        self.publishers: list[KVEventPublisher] = []
        self.side_channels: list[SideChannelServer] = []
        self.engine: EngineRunner | None = None
        self.port: int = config.port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._crash_task: asyncio.Task[None] | None = None
        self.crashed = asyncio.Event()
        cfg = json.dumps([config.model_dir, self.served_name, repr(config.engine)], default=str)
        self.fingerprint = system_fingerprint(hashlib.sha256(cfg.encode()).hexdigest(), config.dp_size)
        self.serving_chat = OpenAIServingChat(self)
        self.serving_completion = OpenAIServingCompletion(self)
        self.serving_tokenization = OpenAIServingTokenization(self)

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    async def start(self) -> SimServer:
        c = self.config
        tok = self.tokenizer
        try:
            for rank in range(c.dp_size):
                engine_id = self.engine_id if c.dp_size == 1 else f"{self.engine_id}_dp{rank}"
                side: SideChannelServer | None = None
                port = 0
                if c.side_channel_port is not None:
                    # Bound before the core exists so the core can advertise the port really bound (0 = any).
                    want = c.side_channel_port and c.side_channel_port + rank
                    side = SideChannelServer(None, c.side_channel_host, want)
                    try:
                        port = await side.start()
                    except OSError as exc:
                        if not self._may_move(exc, want):
                            raise
                        side = SideChannelServer(None, c.side_channel_host, 0)
                        port = await side.start()
                    self.side_channels.append(side)
                engine_cfg = replace(
                    c.engine,
                    engine_id=engine_id,
                    dp_rank=rank,
                    role=c.role,
                    vocab_size=tok.vocab_size,
                    special_token_ids=tuple(tok.special_token_ids),
                    max_model_len=self.max_model_len,
                    side_channel_host=c.side_channel_host,
                    # The core advertises side_channel_port + dp_rank: make that the port really bound.
                    side_channel_port=port - rank if side is not None else 0,
                    kv_transfer=side is not None and c.engine.kv_transfer,
                )
                core = EngineCore(engine_cfg, self.latency)
                publisher = None
                if c.kv_events_endpoint:
                    publisher = self._publisher(rank)
                    self.publishers.append(publisher)
                runner = RankRunner(
                    core,
                    self.latency,
                    self.clock,
                    self.metrics.rank(rank),
                    publisher=publisher,
                    node=c.node,
                    pull_timeout_s=c.pull_timeout_s,
                )
                if side is not None:
                    side.owner = runner
                self.ranks.append(runner)
            self.engine = EngineRunner(self.ranks, c.faults)
            self.engine.start()
            app = self._build_app()
            # handler_cancellation: a client that disconnects cancels its handler, which aborts its engine requests
            # (vLLM's with_cancellation).
            limits = ServerLimits(header_timeout_s=c.header_timeout_s, body_idle_timeout_s=c.body_timeout_s)
            self._runner = web.AppRunner(
                app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0, **limits.runner_kwargs()
            )
            await self._runner.setup()
            self._site = web.TCPSite(self._runner, c.host, c.port, reuse_address=True, backlog=LISTEN_BACKLOG)
            try:
                await self._site.start()
            except OSError as exc:
                if not self._may_move(exc, c.port):
                    raise
                self._site = web.TCPSite(self._runner, c.host, 0, reuse_address=True, backlog=LISTEN_BACKLOG)
                await self._site.start()
            self.port = self._runner.addresses[0][1]
            if c.ports_file:
                write_ports_file(Path(c.ports_file), self.bound_ports())
        except BaseException:
            await self.stop()
            raise
        log.info(
            "simulated engine %s (%s) serving %s on %s",
            self.config.name or self.engine_id,
            c.role,
            self.served_name,
            self.url,
        )
        return self

    def _may_move(self, exc: OSError, port: int) -> bool:
        # Bind first, then tell what was bound: a taken port moves to a free one only for callers that read back
        # the ports (config.port_fallback); port 0 was any port already.
        if self.config.port_fallback and port and exc.errno == errno.EADDRINUSE:
            log.warning("port %d is taken; %s takes a free one", port, self.config.name or self.engine_id)
            return True
        return False

    def _publisher(self, rank: int) -> KVEventPublisher:
        c = self.config
        assert c.kv_events_endpoint is not None

        def make(endpoint: str, replay: str | None) -> KVEventPublisher:
            return KVEventPublisher(
                endpoint,
                rank,
                replay_endpoint=replay,
                topic=c.kv_events_topic,
                buffer_steps=c.kv_events_buffer_steps,
                bind_host=c.kv_events_host or c.host or "*",
            )

        try:
            return make(c.kv_events_endpoint, c.kv_events_replay_endpoint)
        except zmq.ZMQError as exc:
            taken = OSError(exc.errno, str(exc))
            if not self._may_move(taken, _tcp_port(c.kv_events_endpoint)):
                raise
            # Either socket may be the taken one: both move (a rank's ports are published one by one anyway).
            return make(_any_port(c.kv_events_endpoint), _any_port(c.kv_events_replay_endpoint))

    def bound_ports(self) -> dict[str, Any]:
        """What this server really listens on: HTTP port, and per DP rank its KV event, replay and side-channel
        endpoints (a `*` host: bound at the server's host)."""
        return {
            "http_port": self.port,
            "kv_events_endpoints": [p.endpoint for p in self.publishers],
            "kv_events_replay_endpoints": [p.replay_endpoint for p in self.publishers if p.replay_endpoint],
            "side_channel_ports": [s.port for s in self.side_channels],
        }

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None
        if self.engine is not None:
            await self.engine.stop()
        for s in self.side_channels:
            await s.close()
        self.side_channels.clear()
        for p in self.publishers:
            await p.aclose()
        self.publishers.clear()

    async def __aenter__(self) -> SimServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def crash(self) -> None:
        """Fault injection: the server dies, as a crashed vLLM process would (listener gone, engines gone)."""
        if self._crash_task is None:
            log.warning("simulated engine %s: injected crash", self.config.name or self.engine_id)
            if self.engine is not None:
                self.engine.stall()
            self._crash_task = asyncio.get_running_loop().create_task(self._do_crash())

    async def _do_crash(self) -> None:
        if self._site is not None:
            await self._site.stop()
        await self.stop()
        self.crashed.set()
        if self.on_crash is not None:
            self.on_crash()

    # ---- app -------------------------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware()], client_max_size=self.config.max_body_bytes)
        app.on_response_prepare.append(_response_headers)
        r = app.router
        routes: list[tuple[str, str, Callable[[web.Request], Any]]] = [
            ("POST", "/v1/completions", self.serving_completion.generate),
            ("POST", "/v1/chat/completions", self.serving_chat.generate),
            ("POST", "/tokenize", self.serving_tokenization.tokenize),
            ("POST", "/detokenize", self.serving_tokenization.detokenize),
            ("GET", "/v1/models", self._models),
            ("GET", "/health", self._health),
            ("GET", "/ping", self._health),
            ("POST", "/ping", self._health),
            ("GET", "/metrics", self._metrics),
            ("GET", "/version", self._version),
            ("GET", "/load", self._load),
            ("GET", "/kv_event_sources", self._kv_event_sources),
            ("POST", "/reset_prefix_cache", self._reset_prefix_cache),
        ]
        for method, path, handler in routes:
            # FastAPI routes answer only their own method: no implicit HEAD for GET.
            if method == "GET":
                r.add_get(path, handler, allow_head=False)
            else:
                r.add_route(method, path, handler)
            self._allow.setdefault(path, method)
        return app

    def _middleware(self) -> Any:
        """vLLM's middleware stack in one: CORS (preflight refusal, `Vary: Origin`), prometheus-fastapi-
        instrumentator's HTTP metrics, FastAPI's routing errors ({"detail": ...}) and vLLM's error handlers."""
        http = self.metrics.http
        allow = self._allow
        templates: dict[Any, tuple[str, bool]] = {}  # route -> (its path template, excluded from the HTTP metrics)

        @web.middleware
        async def middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
            start = time.perf_counter()
            headers = request.headers
            if request.method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers:
                return _cors_preflight(request)
            match = request.match_info
            routing_error = match.http_exception
            if routing_error is None:
                route = match.route
                known = templates.get(route)
                if known is None:
                    canonical = route.resource.canonical
                    known = templates[route] = (canonical, http.excluded(canonical))
                template, excluded = known
            else:
                template, excluded = "none", http.excluded(request.path)
            resp: web.StreamResponse | None = None
            try:
                if routing_error is not None:
                    # Starlette's own 404/405, answered by FastAPI's default handler (not vLLM's error body).
                    extra = {}
                    if routing_error.status == 405:
                        extra["Allow"] = allow.get(request.path) or ", ".join(sorted(routing_error.allowed_methods))
                    resp = json_response({"detail": routing_error.reason}, routing_error.status, headers=extra)
                else:
                    resp = await _handle(request, handler)
                return resp
            finally:
                if not excluded:
                    out = resp.content_length if resp is not None else None
                    http.observe(
                        request.method,
                        resp.status if resp is not None else 500,
                        template,
                        int(headers.get("Content-Length") or 0),
                        out or 0,
                        time.perf_counter() - start,
                    )

        return middleware

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, with the server's size and stall limits (BodyTimeout answers 408)."""
        c = self.config
        return await read_body(request, c.max_body_bytes, c.body_timeout_s)

    async def _health(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        # vLLM's /health is an empty 200; the run id rides in a header so the body stays vLLM's.
        headers = {runid.HEADER: self.config.run_id} if self.config.run_id else None
        return web.Response(status=200 if self.engine.faults.ready() else 503, headers=headers)

    async def _version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def _load(self, request: web.Request) -> web.Response:
        return json_response({"server_load": sum(r.load for r in self.ranks)})

    async def _metrics(self, request: web.Request) -> web.Response:
        for r in self.ranks:
            r._refresh_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        return json_response(models_response(self.served_name, self.config.model_dir, self.max_model_len))

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        c = self.config
        out = {}
        for p in self.publishers:
            out[str(p.dp_rank)] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": p.endpoint,
                "replay_endpoint": p.replay_endpoint,
                "buffer_steps": c.kv_events_buffer_steps,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": c.kv_events_topic,
            }
        return json_response(out)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        for r in self.ranks:
            r.core.reset_prefix_cache()
            r._publish(r.core.take_events())
        return web.Response(status=200)


def _tcp_port(endpoint: str | None) -> int:
    if not endpoint or not endpoint.startswith("tcp://"):
        return 0
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _any_port(endpoint: str | None) -> str | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    return f"{endpoint.rpartition(':')[0]}:0"


def write_ports_file(path: Path, ports: dict[str, Any]) -> None:
    """Written whole (temp file + rename): a launcher polling for it never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(ports) + "\n")
    os.replace(tmp, path)


async def _response_headers(request: web.Request, response: web.StreamResponse) -> None:
    # vLLM runs under uvicorn; a client that looks at the Server header sees the same. Starlette's CORSMiddleware
    # (no allowed origins) adds `Vary: Origin` to every response but a preflight's.
    headers = response.headers
    headers["Server"] = "uvicorn"
    headers.setdefault("Vary", "Origin")


def _cors_preflight(request: web.Request) -> web.Response:
    """Starlette's CORSMiddleware preflight answer with vLLM's defaults: no origin is allowed."""
    h = request.headers
    failures = ["origin"]
    if h["Access-Control-Request-Method"] not in CORS_ALL_METHODS:
        failures.append("method")
    headers = {
        "Vary": CORS_PREFLIGHT_VARY,
        "Access-Control-Allow-Methods": ", ".join(CORS_ALL_METHODS),
        "Access-Control-Max-Age": "600",
    }
    requested = h.get("Access-Control-Request-Headers")
    if requested is not None:
        headers["Access-Control-Allow-Headers"] = requested
    if h.get("Access-Control-Request-Private-Network") is not None:
        failures.append("private-network")
    return web.Response(
        status=400, text="Disallowed CORS " + ", ".join(failures), content_type="text/plain", headers=headers
    )


async def _handle(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """A route's handler with vLLM's exception handlers around it."""
    try:
        return await handler(request)
    except APIError as exc:
        return json_response(exc.body(), exc.code)
    except BodyTimeout as exc:
        resp = json_response(error_body(str(exc), "Request Timeout", 408), 408)
        resp.force_close()  # the rest of a stalled body is not worth waiting for
        return resp
    except web.HTTPException as exc:
        if exc.status >= 400:
            # Starlette's HTTPException through vLLM's handler: the phrase is both message and type.
            return json_response(error_body(exc.reason, exc.reason, exc.status), exc.status)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return json_response(error_body(str(exc), "InternalServerError", 500), 500)


class SimEngineGroup:
    """Several simulated engines in this event loop: `async with SimEngineGroup([cfg, ...]) as g: g.urls`."""

    def __init__(self, configs: Sequence[SimServerConfig]) -> None:
        self.configs = list(configs)
        self.servers: list[SimServer] = []

    async def __aenter__(self) -> SimEngineGroup:
        try:
            for c in self.configs:
                self.servers.append(await SimServer(c).start())
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)

    def __getitem__(self, i: int) -> SimServer:
        return self.servers[i]

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]
