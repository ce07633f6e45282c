"""The router's HTTP side: an OpenAI-compatible proxy that tokenizes, schedules, admits and forwards each request.

Request flow: read (size-limited) -> parse once (msgspec) -> tokenize with the per-session prompt cache (block
hashes for the precise scorer) -> admission (wait for a slot, fair across sessions; the scheduler decides at admission
time) -> hops (P/D prefill hop, P2P parameters; llmd.router.pd) -> forward, streaming chunk by chunk -> release.

A request that has sent nothing to its client yet is retried on another pod when its pod fails (connection refused or
reset, a 5xx, a body cut short), with any KV-transfer parameters dropped; once bytes have reached the client a failure
ends the stream with an error event, as vLLM ends its own streams. A pod whose connection is refused leaves routing
and the KV index at once; the health loop brings it back.

Response headers name what the router did: x-llmd-pod (and x-llmd-dp-rank), x-llmd-prefill-pod, x-llmd-p2p-source,
x-llmd-queue-ms, x-llmd-prefill-ms (the prefill hop), x-llmd-upstream-ms (the serving pod's time to its first bytes;
the whole body when not streaming), x-llmd-route-reason, x-llmd-expected-hit-tokens, x-llmd-attempts, x-llmd-pd ("ok"
or "fallback" when disaggregation was decided), x-llmd-pd-reason (why the request was or was not disaggregated, when
a prefill pool exists).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec
from aiohttp import web

from llmd.discovery import PodInfo
from llmd.engines.kinds import engine_kind
from llmd.errors import UserError
from llmd.kv.index import KVIndex
from llmd.metrics.schema import pd_path_of
from llmd.net import http_client
from llmd.router import pd as hops
from llmd.router.admission import Admission, QueueFull
from llmd.router.endpoints import EndpointRegistry, Pod
from llmd.router.events import KVEventHub
from llmd.router.metrics import CONTENT_TYPE, RouterMetrics, state_families
from llmd.router.recorder import RouterRecorder
from llmd.router.scheduling import (
    Decision,
    Endpoint,
    EndpointState,
    NoEndpointError,
    RouteRequest,
    Scheduler,
    Snapshot,
    Tuning,
    text_chunk_hashes,
)
from llmd.router.scheduling.filters import kv_fits
from llmd.router.scheduling.kv_demand import request_kv

log = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]
DP_RANK_HEADER = "X-data-parallel-rank"
SESSION_HEADER = "X-Session-Id"
DEFAULT_MAX_BODY = 32 << 20
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
# Hop-by-hop and framing headers are the server's to set, not copied from the engine.
_SKIP_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server", "content-encoding"}
)
_FORWARD_REQUEST_HEADERS = ("X-Request-Id", "traceparent", "tracestate")
_SSE_ERROR = b'data: {"error"'
_CTX_KEY = web.RequestKey("llmd_ctx", object)
_PROMPT_TOKENS = b'"prompt_tokens":'


@dataclass
class RouterConfig:
    """Everything the router needs besides the pods. `from_spec` fills it from a DeploymentSpec."""

    policy: str = "precise"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_inflight_per_pod: int = 64
    queue_limit: int = 4096
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0  # a 500K-token prefill takes long; a hung prefill pod must not hang the request
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    metrics_interval_s: float = 1.0
    replay_timeout_s: float = 2.0
    p2p_mode: hops.P2PMode = "hash"
    served_name: str | None = None
    block_size: int = 16
    tokenizer: str | None = None  # model folder with the tokenizer; None: no router-side tokenization
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    index_max_entries: int = 50_000_000
    prompt_cache_tokens: int = 16_000_000  # tokens of recent prompts kept for incremental tokenization
    offload_tokenize_bytes: int = 64 << 10  # bodies this large are tokenized off the event loop
    router_spec: Any = None  # the RouterSpec (or any RouterSettings) the scheduler reads
    seed: int = 0
    metrics_out: str | None = None  # the router's own HDF5 (llmd.router.recorder); None: none
    metrics_meta: dict[str, Any] | None = None  # run metadata for that file (spec, run id, ...)
    # The engines' cost model (llmd.perf.latency.LatencyModel of the decode / prefill pool; None: fixed token rates)
    # and wall seconds per model second (simulated engines at engine.time_scale), for the scheduler's time estimates.
    latency: Any = None
    prefill_latency: Any = None
    time_scale: float = 1.0

    @classmethod
    def from_router_spec(cls, r: Any, **overrides: Any) -> RouterConfig:
        """The scheduling and admission settings of a RouterSpec; the rest from `overrides` or defaults."""
        api_key = os.environ.get(r.api_key_env) if r.api_key_env else None
        kw: dict[str, Any] = {
            "policy": r.policy,
            "host": r.host,
            "port": r.port,
            "api_key": api_key or None,
            "max_inflight_per_pod": r.max_inflight_per_pod,
            "queue_limit": r.queue_limit,
            "router_spec": r,
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> RouterConfig:
        m = spec.model
        kw: dict[str, Any] = {
            # Stock vLLM pulls only leased blocks: P2P goes through the holder as a prefill pod there.
            "p2p_mode": engine_kind(spec.engine.kind).p2p_mode,
            "served_name": m.served_name,
            "block_size": m.block_size,
            "tokenizer": m.tokenizer,
            "hash_algo": m.hash_algo,
            "hash_seed": m.hash_seed,
            "seed": spec.workload.seed,
            "time_scale": spec.engine.time_scale if engine_kind(spec.engine.kind).simulated else 1.0,
        }
        kw.update(_cost_models(spec))
        kw.update(overrides)
        return cls.from_router_spec(spec.router, **kw)


class APIError(Exception):
    """An OpenAI-style error the router answers itself."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = status if code is None else code
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(
            body=_json_encode(self.body()), status=self.status, content_type="application/json", headers=self.headers
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


class _Retry(Exception):
    """This attempt failed before anything reached the client; another pod may serve it."""

    def __init__(self, reason: str, pod: str, *, pod_down: bool, last: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pod = pod
        self.pod_down = pod_down
        self.last = last  # the engine's own error response, answered if no attempt is left


@dataclass(slots=True)
class _Flight:
    """One admitted attempt: the slots it holds and what the headers report."""

    decision: Decision
    target: Pod
    rank: int
    uncached: int
    kv: tuple[Sequence[int], int, int] = ((), 0, 0)  # InflightKV.add's (hashes, unit, extra) at the target
    prefill: Pod | None = None
    prefill_rank: int = 0
    prefill_kv: tuple[Sequence[int], int, int] = ((), 0, 0)  # the same at the prefill pod (prompt only)
    released: bool = False


@dataclass(slots=True)
class _Prompt:
    """What routing needs from a request body."""

    block_hashes: Sequence[int] = ()
    num_tokens: int = 0
    text_hashes: Sequence[int] = ()
    fingerprint: str | None = None
    chars: int = 0  # prompt characters when num_tokens is an estimate from them (approximate)


@dataclass(slots=True)
class _Ctx:
    kind: Kind
    route: str  # the request path: the engine's path too
    raw: bytes
    body: dict[str, Any]
    session: str
    request_id: str
    headers: dict[str, str]
    route_req: RouteRequest
    excluded: set[str] = field(default_factory=set)
    no_kv_transfer: bool = False
    queue_s: float = 0.0
    queued_at: float = 0.0  # when the current attempt started waiting for admission (monotonic)
    attempts: int = 0
    # What the recorder writes: the last attempt's decision and response headers, first byte, a mid-stream error.
    decision: Decision | None = None
    out: dict[str, str] | None = None
    first_byte: float = 0.0
    error: str = ""
    text_chars: int = 0  # approximate: the prompt's characters, until the engine's prompt_tokens calibrate with them


class Router:
    """The router process: pods, KV events, index, scheduler, admission, metrics and the aiohttp app."""

    def __init__(
        self,
        config: RouterConfig,
        pods: Iterable[PodInfo] = (),
        *,
        discovery: str | os.PathLike[str] | None = None,
        encoder: Any = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.config = c = config
        self.registry = EndpointRegistry(
            pods,
            discovery=discovery,
            health_interval_s=c.health_interval_s,
            health_timeout_s=c.health_timeout_s,
            metrics_interval_s=c.metrics_interval_s,
        )
        self.index = KVIndex(max_entries=c.index_max_entries)
        self.hub = KVEventHub(self.index, replay_timeout_s=c.replay_timeout_s)
        settings = c.router_spec if c.router_spec is not None else _default_settings(c)
        self.scheduler = scheduler or Scheduler(
            settings,
            c.seed,
            latency=c.latency,
            prefill_latency=c.prefill_latency,
            tuning=Tuning(time_scale=c.time_scale),
        )
        self.admission = Admission(c.max_inflight_per_pod, c.queue_limit)
        self.metrics = RouterMetrics()
        self.metrics.add_collector(lambda: state_families(self.registry, self.admission, self.hub, self.index))
        self._needs_tokens = c.policy != "approximate"
        if encoder is None and c.tokenizer is not None and self._needs_tokens:
            encoder = _load_encoder(c)
        self.encoder = encoder
        # The scheduler knows from its plugins' declarations whether any of them reads the prompt's text chunks.
        self._needs_text = "text" in self.scheduler.inputs
        self.http: aiohttp.ClientSession | None = None
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self.port = c.port
        self._endpoints: list[tuple[Endpoint, Pod, int]] = []
        self._endpoints_version = -1
        self._prefill_pool = False  # any prefill pod registered, healthy or not; kept with _endpoints
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._models_cache: tuple[float, bytes] | None = None
        self._tok_pool: ThreadPoolExecutor | None = None
        self._encodes_pending = 0
        self._pump_timer: asyncio.TimerHandle | None = None
        # Approximate routing's characters per token: the tuning's guess, then learned from the engines' usage.
        self._chars_per_token = float(self.scheduler.tuning.chars_per_token)
        self.recorder: RouterRecorder | None = None
        self.registry.on_up.append(self._pod_up)
        self.registry.on_down.append(self._pod_down)
        self.registry.on_change.append(self.admission.pump)

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    async def start(self) -> Router:
        c = self.config
        self.http = http_client.engine_session(c.connect_timeout_s)
        try:
            await self.registry.start(self.http)
            self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, c.host, c.port, reuse_address=True)
            await site.start()
            self.port = self._runner.addresses[0][1]
            if c.metrics_out is not None:
                meta = {"policy": c.policy, "url": self.url, **(c.metrics_meta or {})}
                self.recorder = RouterRecorder(c.metrics_out, self.registry, self.admission, meta=meta).start()
        except BaseException:
            await self.stop()
            raise
        log.info("router (%s) on %s, %d pods", c.policy, self.url, len(self.registry.pods))
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.recorder is not None:
            await self.recorder.close()  # after the app: requests cut by the shutdown still get their rows
            self.recorder = None
        await self.registry.stop()
        await self.hub.close()
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self._tok_pool is not None:
            self._tok_pool.shutdown(wait=False, cancel_futures=True)
            self._tok_pool = None

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- pods ------------------------------------------------------------------------------------------------------
    def _pod_up(self, pod: Pod) -> None:
        self.hub.subscribe(pod)

    def _pod_down(self, pod: Pod) -> None:
        # Events first, then the index: nothing of the dead pod can come back in between.
        self.hub.unsubscribe_now(pod.name)
        self.index.drop_pod(pod.name)
        self.scheduler.forget_pod(pod.name)

    def _routable(self) -> list[tuple[Endpoint, Pod, int]]:
        """Every rank of every healthy pod as a scheduler Endpoint; rebuilt only when the pod set changes."""
        reg = self.registry
        if self._endpoints_version != reg.version:
            out = []
            for pod in reg.pods.values():
                if not pod.healthy:
                    continue
                info = pod.info
                for r in range(info.dp_size):
                    ep = Endpoint(info.name, r, info.role, info.url, info.dp_size, info.host)  # type: ignore[arg-type]
                    out.append((ep, pod, r))
            self._endpoints = out
            self._prefill_pool = any(pod.info.role == "prefill" for pod in reg.pods.values())
            self._endpoints_version = reg.version
        return self._endpoints

    def _snapshot(self, excluded: set[str], kv: tuple[Sequence[int], int, int] = ((), 0, 0)) -> Snapshot:
        """Every routable endpoint's state; with `kv` (the request's InflightKV key), inflight_kv_tokens counts only
        the KV in flight there that this request does not share (its prefix held once, however many requests hold
        it), so kv_fits(state, request's whole need) is exact."""
        hashes, unit, _ = kv
        # What the request shares with requests in flight counts once only as far as the engine has it cached
        # (kv_demand.InflightKV.shared_tokens): with block hashes, the index says how far that is per rank.
        # Text chunks (approximate): its memory of what it sent is no proof of what the engine holds (that guess let
        # bursts through that preempted), so nothing counts as shared.
        cached: dict[tuple[str, int], int] | None = None
        if unit and hashes:
            cached = {m.holder: m.blocks_gpu for m in self.index.query(hashes)} if self._needs_tokens else {}
        states = {}
        for ep, pod, r in self._routable():
            if ep.pod in excluded:
                continue
            st = pod.ranks[r]
            shared = 0
            if unit:
                upto = len(hashes) if cached is None else cached.get(ep.holder, 0)
                shared = st.kv.shared_tokens(hashes[:upto], unit) if upto else 0
            states[ep] = EndpointState(
                healthy=True,
                waiting=st.waiting,
                running=st.running,
                kv_usage=st.kv_usage,
                inflight=st.inflight,
                inflight_tokens=st.inflight_tokens,
                inflight_kv_tokens=st.kv.tokens - shared,
                kv_capacity_blocks=st.kv_capacity_blocks,
                cpu_capacity_blocks=st.cpu_capacity_blocks,
            )
        return Snapshot(states, time.monotonic())

    # ---- app -------------------------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        # client_max_size is the body limit: aiohttp refuses the rest with 413 (turned into an OpenAI error here).
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_body_bytes)
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.path
        try:
            if self.config.api_key is not None and route != "/health":
                self._check_key(request)
            return await handler(request)
        except APIError as exc:
            self.metrics.request(route, exc.status)
            self.metrics.error(route, exc.err_type)
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            err = APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", "RequestTooLargeError")
            self.metrics.request(route, 413)
            self.metrics.error(route, err.err_type)
            return err.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = APIError(exc.status, exc.reason, exc.reason.replace(" ", "") + "Error")
            self.metrics.request(route, exc.status)
            return err.response()

    def _check_key(self, request: web.Request) -> None:
        got = request.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        key = self.config.api_key
        assert key is not None
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            err = APIError(
                401,
                "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                "AuthenticationError",
                code="invalid_api_key",
            )
            err.headers["WWW-Authenticate"] = "Bearer"
            raise err

    async def _health(self, request: web.Request) -> web.Response:
        # Healthy as long as some pod can serve a whole request: what a load balancer in front needs to know.
        ok = any(p.healthy and p.info.serves_decode for p in self.registry.pods.values())
        return web.Response(status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        # The engines' own answer (they know max_model_len, root, ...), cached briefly; served name as a fallback.
        now = time.monotonic()
        if self._models_cache is not None and now - self._models_cache[0] < 5.0:
            return web.Response(body=self._models_cache[1], content_type="application/json")
        assert self.http is not None
        for pod in self.registry.healthy():
            try:
                async with self.http.get(pod.info.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        body = await r.read()
                        self._models_cache = (now, body)
                        self.metrics.request("/v1/models", 200)
                        return web.Response(body=body, content_type="application/json")
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        name = self.config.served_name
        if name is None:
            raise APIError(503, "no healthy engine to list models from", "ServiceUnavailableError")
        data = {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": name, "parent": None}]}  # fmt: skip
        self.metrics.request("/v1/models", 200)
        return web.Response(body=_json_encode(data), content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    # ---- the request path ------------------------------------------------------------------------------------------
    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        if self.recorder is None:
            return await self._generate_one(request, kind, time.monotonic())
        t0 = time.monotonic()
        status, error = 0, ""
        try:
            resp = await self._generate_one(request, kind, t0)
            status = resp.status
            return resp
        except APIError as exc:
            status, error = exc.status, exc.message
            raise
        except asyncio.CancelledError:
            error = "cancelled (client gone)"
            raise
        except Exception as exc:
            status, error = 500, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._record(request, t0, status, error)

    def _record(self, request: web.Request, t0: float, status: int, error: str) -> None:
        rec = self.recorder
        if rec is None:
            return
        ctx: _Ctx | None = request.get(_CTX_KEY)
        now = time.monotonic()
        row: dict[str, Any] = {"send_time": rec.since_start(t0), "e2e_s": now - t0, "status": status}
        gpu = cpu = 0
        if ctx is not None:
            user = ctx.body.get("user")
            row["request_id"] = ctx.request_id
            row["session"] = request.headers.get(SESSION_HEADER) or (user if isinstance(user, str) else "")
            row["router_queue_s"] = ctx.queue_s
            if ctx.route_req.num_tokens:
                row["input_tokens"] = ctx.route_req.num_tokens
            if ctx.first_byte:
                row["ttft_s"] = ctx.first_byte - t0
            error = error or ctx.error
            d = ctx.decision
            if d is not None and ctx.out is not None:
                h = ctx.out
                row["pod"] = h.get("x-llmd-pod", "")
                row["prefill_pod"] = h.get("x-llmd-prefill-pod", "")
                row["pd_path"] = pd_path_of(h)
                row["expected_hit_tokens"] = d.expected_hit_tokens
                row["route_reason"] = d.reason
                gpu, cpu = d.gpu_hit_tokens, d.cpu_hit_tokens
        if error:
            row["error"] = error
        rec.request(row, gpu, cpu)

    async def _generate_one(self, request: web.Request, kind: Kind, t0: float) -> web.StreamResponse:
        ctx = await self._parse(request, kind)
        request[_CTX_KEY] = ctx
        self.metrics.routing_time.observe(time.monotonic() - t0)
        last: web.Response | None = None
        while True:
            ctx.attempts += 1
            try:
                flight = await self._admit(ctx)
            except NoEndpointError:
                if last is not None:
                    return self._finish_error(ctx, last)
                raise APIError(503, "no healthy engine can serve this request", "ServiceUnavailableError") from None
            except QueueFull as exc:
                err = APIError(429, str(exc), "RateLimitError")
                err.headers["Retry-After"] = str(exc.retry_after_s)
                raise err from None
            try:
                resp = await self._serve(request, ctx, flight)
            except _Retry as exc:
                self._release(flight)
                self.metrics.retries.labels(exc.reason).inc()
                log.info("request %s: pod %s failed before streaming (%s); retrying", ctx.request_id, exc.pod, exc)
                if exc.pod_down:
                    self.registry.mark_down(exc.pod, exc.reason)
                ctx.excluded.add(exc.pod)
                ctx.no_kv_transfer = True  # whatever a hop set up went with the failed attempt
                last = exc.last or last
                if ctx.attempts >= self.config.max_attempts:
                    if last is not None:
                        return self._finish_error(ctx, last)
                    raise APIError(
                        502, f"engines failed {ctx.attempts} times: {exc.reason}", "BadGatewayError"
                    ) from None
                continue
            except BaseException:
                self._release(flight)
                raise
            self._release(flight)
            self.metrics.request(ctx.route, resp.status)
            return resp

    def _finish_error(self, ctx: _Ctx, resp: web.Response) -> web.Response:
        self.metrics.request(ctx.route, resp.status)
        self.metrics.error(ctx.route, "upstream")
        return resp

    async def _parse(self, request: web.Request, kind: Kind) -> _Ctx:
        raw = await request.read()
        try:
            body = _json_decode(raw)
        except msgspec.DecodeError as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        if not isinstance(body.get("stream", False), bool):
            raise bad_request("'stream' must be a boolean", "stream")
        user = body.get("user")
        session = request.headers.get(SESSION_HEADER) or (user if isinstance(user, str) and user else None)
        prompt = await self._prompt(kind, body, session, len(raw))
        session = session or prompt.fingerprint or "-"
        request_id = request.headers.get("X-Request-Id") or f"{self._id_prefix}-{next(self._ids)}"
        headers = {"Content-Type": "application/json"}
        for h in _FORWARD_REQUEST_HEADERS:
            v = request.headers.get(h)
            if v is not None:
                headers[h] = v
        rr = RouteRequest(
            request_id=request_id,
            block_hashes=prompt.block_hashes,
            num_tokens=prompt.num_tokens,
            block_size=self.config.block_size,
            session_id=session,
            text_chunk_hashes=prompt.text_hashes,
            max_tokens=_max_tokens(body),
        )
        self.metrics.prompt_tokens.inc(prompt.num_tokens)
        ctx = _Ctx(kind, request.path, raw, body, session, request_id, headers, rr)
        ctx.text_chars = prompt.chars
        return ctx

    async def _prompt(self, kind: Kind, body: dict[str, Any], session: str | None, size: int) -> _Prompt:
        """Validate the prompt's shape (400 for what no engine could take) and compute the routing inputs."""
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise bad_request("'messages' must be a non-empty list of message objects", "messages")
            source: Any = messages
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch: route by its first prompt
            if isinstance(prompt, str) or (
                isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                source = prompt
            else:
                raise bad_request("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
        out = _Prompt()
        if self._needs_text:
            text = _text_of(source)
            out.text_hashes = text_chunk_hashes(text)
            if not self._needs_tokens:
                # Approximate routing never tokenizes, but P/D (uncached tokens vs the threshold) and placement need
                # a prompt length: token ids count themselves, text is estimated from its characters, as llm-d does.
                if isinstance(source, list) and source and isinstance(source[0], int):
                    out.num_tokens = len(source)
                else:
                    out.num_tokens = math.ceil(len(text) / self._chars_per_token)
                    out.chars = len(text)
        if self.encoder is not None and self._needs_tokens:
            try:
                enc = await self._encode(session, kind, source, body, size)
            except ValueError as exc:
                raise bad_request(str(exc), getattr(exc, "param", None)) from None
            out.block_hashes = enc.block_hashes
            out.num_tokens = enc.num_tokens
            out.fingerprint = enc.fingerprint
        return out

    async def _encode(self, session: str | None, kind: Kind, source: Any, body: dict[str, Any], size: int) -> Any:
        """Small prompts are tokenized right here; big ones (a fresh 195K-token context takes ~0.4 s) on the
        tokenizer thread, so the event loop keeps routing meanwhile (the tokenizer releases the GIL). The prompt
        cache is not thread-safe: while a job is on the thread, every encode goes there, in order."""
        enc = self.encoder
        if size < self.config.offload_tokenize_bytes and not self._encodes_pending:
            return enc.encode_route(session, kind, source, body)
        if self._tok_pool is None:
            self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-tokenize")
        loop = asyncio.get_running_loop()
        self._encodes_pending += 1
        job = self._tok_pool.submit(enc.encode_route, session, kind, source, body)

        def finished(_: Any) -> None:
            # Counted down when the thread is really done, even if our request was cancelled meanwhile.
            loop.call_soon_threadsafe(self._encode_done)

        job.add_done_callback(finished)
        return await asyncio.wrap_future(job)

    def _encode_done(self) -> None:
        self._encodes_pending -= 1

    # -- admission
    async def _admit(self, ctx: _Ctx) -> _Flight:
        t0 = time.monotonic()
        ctx.queued_at = t0
        flight = await self.admission.admit(ctx.session, lambda: self._choose(ctx), self._release)
        waited = time.monotonic() - t0
        ctx.queue_s += waited
        self.metrics.queue_time.observe(waited)
        return flight

    def _choose(self, ctx: _Ctx) -> _Flight | None:
        """The scheduling decision, taken only when its target has room (else None: wait)."""
        req = ctx.route_req
        hashes = req.block_hashes or req.text_chunk_hashes
        if req.block_hashes:
            unit = req.block_size
        else:  # text chunks: the tokens a chunk of characters holds, as far as the router knows
            unit = max(1, round(self.scheduler.tuning.chunk_chars / self._chars_per_token))
        unit, extra = request_kv(hashes, req.num_tokens, req.max_tokens, unit, req.block_size)
        kv = (hashes, unit, extra)
        snap = self._snapshot(ctx.excluded, kv)
        if ctx.excluded and not any(ep.role != "prefill" for ep in snap.states):
            # Every other pod failed this request too; a pod that is still healthy may serve it plainly (the retry
            # carries no KV-transfer parameters), which beats answering with its error.
            snap = self._snapshot(set(), kv)
        room = self.admission.has_room
        need, bs = req.kv_tokens, req.block_size
        if not any(room(ep.holder) and kv_fits(st, need, bs) for ep, st in snap.states.items() if ep.role != "prefill"):
            if not any(ep.role != "prefill" for ep in snap.states):
                raise NoEndpointError("no healthy decode endpoint")
            return None  # every one full (slots or KV): wait without paying for a scoring pass
        now = time.monotonic()
        d = self.scheduler.schedule(req, snap, self.index, now, waited_s=now - ctx.queued_at)
        target = self.registry.get(d.target.pod)
        if target is None:
            return None
        if not room(d.target.holder) or not kv_fits(snap.states[d.target], need, bs):
            if d.wait_s > 0:  # waiting for the prefix holder: ask again when that stops paying, if nothing frees first
                self._pump_in(d.wait_s)
            return None
        self.scheduler.observe_routed(req, d, now)
        uncached = max(0, req.num_tokens - d.expected_hit_tokens)
        flight = _Flight(d, target, d.target.dp_rank, uncached, kv)
        self._take(target, flight.rank, uncached, kv)
        if d.pd is not None and not ctx.no_kv_transfer:
            pre = self.registry.get(d.pd.prefill.pod)
            if pre is not None:
                flight.prefill = pre
                flight.prefill_rank = d.pd.prefill.dp_rank
                # The prefill pod holds the prompt (and one token) until the decode pod pulls it.
                flight.prefill_kv = (hashes, unit, extra - req.max_tokens + 1)
                # Counted, not gated: a prefill hop is short and its pod's queue is what the decider weighed.
                self._take(pre, flight.prefill_rank, d.pd.uncached_tokens, flight.prefill_kv)
        self.metrics.decision(self.config.policy, d.reason, d.expected_hit_tokens)
        return flight

    def _pump_in(self, delay_s: float) -> None:
        """Run the admission queue again in `delay_s` (the earliest such time wins; releases pump it anyway)."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_s + 0.001
        h = self._pump_timer
        if h is not None and not h.cancelled() and h.when() <= at:
            return
        if h is not None:
            h.cancel()
        self._pump_timer = loop.call_at(at, self._timed_pump)

    def _timed_pump(self) -> None:
        self._pump_timer = None
        self.admission.pump()

    def _take(self, pod: Pod, rank: int, tokens: int, kv: tuple[Sequence[int], int, int]) -> None:
        st = pod.ranks[rank]
        st.inflight += 1
        st.inflight_tokens += tokens
        st.kv.add(*kv)
        self.admission.take((pod.name, rank))

    def _give(self, pod: Pod, rank: int, tokens: int, kv: tuple[Sequence[int], int, int]) -> None:
        st = pod.ranks[rank]
        st.inflight = max(0, st.inflight - 1)
        st.inflight_tokens = max(0, st.inflight_tokens - tokens)
        st.kv.remove(*kv)
        self.admission.release((pod.name, rank))

    def _release(self, flight: _Flight) -> None:
        if flight.released:
            return
        flight.released = True
        self._release_prefill(flight)
        self._give(flight.target, flight.rank, flight.uncached, flight.kv)

    def _release_prefill(self, flight: _Flight) -> None:
        pre = flight.prefill
        if pre is not None:
            flight.prefill = None
            assert flight.decision.pd is not None
            self._give(pre, flight.prefill_rank, flight.decision.pd.uncached_tokens, flight.prefill_kv)

    # -- hops
    def _upstream_headers(self, ctx: _Ctx, pod: Pod, rank: int) -> dict[str, str]:
        if pod.info.dp_size == 1:
            return ctx.headers
        h = dict(ctx.headers)
        h[DP_RANK_HEADER] = str(rank)
        return h

    async def _serve(self, request: web.Request, ctx: _Ctx, flight: _Flight) -> web.StreamResponse:
        d = flight.decision
        target = flight.target
        rank = flight.rank
        out_headers = {
            "x-llmd-pod": target.name,
            "x-llmd-route-reason": d.reason,
            "x-llmd-queue-ms": f"{ctx.queue_s * 1000:.1f}",
            "x-llmd-expected-hit-tokens": str(d.expected_hit_tokens),
            "x-llmd-attempts": str(ctx.attempts),
        }
        ctx.decision, ctx.out = d, out_headers
        if target.info.dp_size > 1:
            out_headers["x-llmd-dp-rank"] = str(rank)
        # The snapshot holds healthy pods only, so "" also means a prefill pool with none of it healthy.
        pd_reason = d.pd_reason or ("prefill-unhealthy" if self._prefill_pool else "")
        if pd_reason:
            out_headers["x-llmd-pd-reason"] = pd_reason
        payload = ctx.raw  # forwarded untouched unless a hop adds kv_transfer_params
        if not ctx.no_kv_transfer:
            if d.pd is not None and flight.prefill is not None:
                payload = await self._prefill(ctx, flight, flight.prefill, flight.prefill_rank, out_headers, "pd")
            elif d.p2p_source is not None:
                payload = await self._p2p(ctx, flight, out_headers)
        return await self._forward(request, ctx, flight, payload, out_headers)

    async def _prefill(
        self, ctx: _Ctx, flight: _Flight, pre: Pod, pre_rank: int, out_headers: dict[str, str], why: str
    ) -> bytes:
        """The prefill hop; the payload for the serving pod: with the returned kv_transfer_params, or the original
        body (decode-only fallback) if the hop failed."""
        assert self.http is not None
        body = hops.prefill_body(ctx.body, ctx.kind == "chat")
        res = await hops.prefill_hop(
            self.http,
            pre.info.url + ctx.route,
            _json_encode(body),
            self._upstream_headers(ctx, pre, pre_rank),
            aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s),
            on_resend=self._resent,
        )
        self._release_prefill(flight)
        self.metrics.prefill_time.observe(res.seconds)
        out_headers["x-llmd-prefill-ms"] = f"{res.seconds * 1000:.1f}"
        counter = self.metrics.pd if why == "pd" else self.metrics.p2p
        if res.kv_params is None:
            log.info("request %s: prefill hop to %s failed (%s); decode-only", ctx.request_id, pre.name, res.error)
            counter.labels("fallback").inc()
            if why == "pd":
                out_headers["x-llmd-pd"] = "fallback"
            if res.unreachable:
                self.registry.mark_down(pre.name, res.error or "unreachable")
            return ctx.raw
        counter.labels("ok").inc()
        self._learn(pre, pre_rank, res.kv_params)
        if why == "pd":
            out_headers["x-llmd-prefill-pod"] = pre.name
            out_headers["x-llmd-pd"] = "ok"
        else:
            out_headers["x-llmd-p2p-source"] = pre.name
        return _json_encode(hops.with_kv_params(ctx.body, res.kv_params))

    @staticmethod
    def _learn(pod: Pod, rank: int, kv: dict[str, Any]) -> None:
        """A prefill response names the pod's engine id and side channel: what a later P2P pull from it needs."""
        st = pod.ranks[rank]
        eid = kv.get("remote_engine_id")
        if isinstance(eid, str):
            st.engine_id = eid
        host, port = kv.get("remote_host"), kv.get("remote_port")
        if isinstance(host, str) and isinstance(port, int):
            st.side_channel = (host, port)

    async def _p2p(self, ctx: _Ctx, flight: _Flight, out_headers: dict[str, str]) -> bytes:
        d = flight.decision
        src_ep = d.p2p_source
        assert src_ep is not None
        src = self.registry.get(src_ep.pod)
        if src is None or not src.healthy:
            self.metrics.p2p.labels("source_gone").inc()
            return ctx.raw
        if self.config.p2p_mode == "two-hop":
            return await self._prefill(ctx, flight, src, src_ep.dp_rank, out_headers, "p2p")
        eid = src.engine_id_of(src_ep.dp_rank)
        side = src.side_channel_of(src_ep.dp_rank)
        if eid is None or side is None:
            # Without the holder's engine id the pull would be refused; recomputing is the safe choice.
            self.metrics.p2p.labels("unknown_engine_id" if eid is None else "no_side_channel").inc()
            return ctx.raw
        tokens = d.gpu_hit_tokens + d.cpu_hit_tokens + d.p2p_tokens
        params = hops.p2p_params(eid, side[0], side[1], tokens)
        self.metrics.p2p.labels("sent").inc()
        out_headers["x-llmd-p2p-source"] = src.name
        return _json_encode(hops.with_kv_params(ctx.body, params))

    async def _forward(
        self, request: web.Request, ctx: _Ctx, flight: _Flight, payload: bytes, out_headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self.http is not None
        pod = flight.target
        t0 = time.monotonic()
        try:
            up = await http_client.post(
                self.http,
                pod.info.url + ctx.route,
                data=payload,
                headers=self._upstream_headers(ctx, pod, flight.rank),
                on_resend=self._resent,
            )
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            raise _Retry("connect", pod.name, pod_down=True) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _Retry("disconnect", pod.name, pod_down=isinstance(exc, aiohttp.ServerDisconnectedError)) from exc
        done = False
        try:
            status = up.status
            if status != 200 or not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                try:
                    data = await up.read()
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    raise _Retry("body", pod.name, pod_down=False) from exc
                done = True
                dt = time.monotonic() - t0
                self.metrics.first_byte_time.observe(dt)
                out_headers["x-llmd-upstream-ms"] = f"{dt * 1000:.1f}"
                if ctx.text_chars and status == 200:
                    self._calibrate(ctx, data)
                resp = web.Response(body=data, status=status, headers=self._response_headers(up, out_headers))
                if status >= 500:
                    raise _Retry(f"status_{status}", pod.name, pod_down=False, last=resp)
                return resp
            # Streaming: hold the client's headers until the engine's first bytes, so a pod failing before then is
            # still retried elsewhere; after that, pass every chunk on as it arrives.
            try:
                first = await up.content.readany()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise _Retry("stream_start", pod.name, pod_down=False) from exc
            if not first:
                raise _Retry("empty_stream", pod.name, pod_down=False)
            if first.startswith(_SSE_ERROR):
                # The engine failed the request before its first token (a failed KV pull): nothing reached the
                # client, so another attempt (without KV transfer) can still serve it.
                raise _Retry("stream_error", pod.name, pod_down=False)
            ctx.first_byte = time.monotonic()
            dt = ctx.first_byte - t0
            self.metrics.first_byte_time.observe(dt)
            out_headers["x-llmd-upstream-ms"] = f"{dt * 1000:.1f}"
            resp = web.StreamResponse(status=200, headers=self._response_headers(up, out_headers))
            try:
                await resp.prepare(request)
                await resp.write(first)
                if ctx.text_chars:
                    self._calibrate(ctx, first)
                try:
                    while True:
                        chunk = await up.content.readany()
                        if not chunk:
                            break
                        await resp.write(chunk)
                        if ctx.text_chars:
                            self._calibrate(ctx, chunk)
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    # Bytes are out: end the stream the way vLLM ends a failed one, so the client sees why.
                    log.warning("request %s: stream from %s broke: %s", ctx.request_id, pod.name, exc)
                    self.metrics.error(ctx.route, "stream_broken")
                    ctx.error = f"engine {pod.name} failed mid-stream: {exc}"
                    err = {"error": {"message": f"engine {pod.name} failed mid-stream", "type": "InternalServerError",
                                     "param": None, "code": 500}}  # fmt: skip
                    await resp.write(b"data: " + _json_encode(err) + b"\n\ndata: [DONE]\n\n")
                else:
                    done = True
                await resp.write_eof()
            except ConnectionResetError:
                # The client hung up (a client may close as soon as it has read `data: [DONE]`, before the chunked
                # stream's last frame): nothing is left to send it. Unless the engine had finished, closing the
                # upstream connection below aborts the request there and frees its KV.
                if not done:
                    ctx.error = ctx.error or "client closed the connection before the stream ended"
                log.debug("request %s: client closed the stream", ctx.request_id)
            return resp
        finally:
            # A finished response gives its connection back to the pool; anything else closes it, which is also
            # how the engine learns that the request was abandoned (it aborts it and frees its KV).
            if done:
                up.release()
            else:
                up.close()

    def _resent(self, exc: BaseException) -> None:
        self.metrics.retries.labels("resent").inc()
        log.info("an engine closed a pooled connection under a request (%s); sent again", exc)

    def _calibrate(self, ctx: _Ctx, data: bytes) -> None:
        """Approximate routing estimates prompt tokens from characters (P/D threshold, KV admission); the engine's
        usage.prompt_tokens in the response says how many there were: a moving average of the ratio keeps the
        estimate near the model's tokenizer without tokenizing anything."""
        i = data.rfind(_PROMPT_TOKENS)
        if i < 0:
            return
        j = i + len(_PROMPT_TOKENS)
        while j < len(data) and data[j] == 0x20:
            j += 1
        k = j
        while k < len(data) and 0x30 <= data[k] <= 0x39:
            k += 1
        if k == j:
            return
        n = int(data[j:k])
        if n > 0:
            self._chars_per_token += 0.2 * (ctx.text_chars / n - self._chars_per_token)
            self._chars_per_token = min(16.0, max(0.5, self._chars_per_token))
        ctx.text_chars = 0  # once per request

    @staticmethod
    def _response_headers(up: aiohttp.ClientResponse, extra: dict[str, str]) -> dict[str, str]:
        h = {k: v for k, v in up.headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
        h.update(extra)
        return h


def _cost_models(spec: Any) -> dict[str, Any]:
    """The spec's latency models for the decode and prefill pools; none (fixed rates) when the spec's model has no
    profile the latency model knows."""
    from llmd.perf.latency import LatencyModel

    try:
        out = {"latency": LatencyModel.from_spec(spec, "decode")}
        if spec.disaggregated:
            out["prefill_latency"] = LatencyModel.from_spec(spec, "prefill")
    except (ValueError, KeyError, OSError) as exc:
        log.info("router: no latency model for %s (%s); fixed token rates", spec.model.path, exc)
        return {}
    return out


def _max_tokens(body: dict[str, Any]) -> int:
    """The output the request asks for at most (OpenAI's max_completion_tokens or max_tokens; 0 when not given)."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _text_of(source: Any) -> str:
    """The text the approximate scorer chunks: the prompt, or the messages' roles and contents in order."""
    if isinstance(source, str):
        return source
    if source and isinstance(source[0], int):
        return " ".join(map(str, source))
    parts = []
    for m in source:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}\n{content or ''}\n")
    return "".join(parts)


def _default_settings(c: RouterConfig) -> Any:
    from llmd.spec.model import RouterSpec

    return RouterSpec(policy=c.policy, max_inflight_per_pod=c.max_inflight_per_pod, queue_limit=c.queue_limit)  # type: ignore[arg-type]


@dataclass(slots=True)
class RouteTokens:
    """What an encoder gives routing: the prompt's full-block hashes (engine form), its length, and a session
    fingerprint for requests that name no session."""

    block_hashes: Sequence[int]
    num_tokens: int
    fingerprint: str | None = None


class PromptEncoder:
    """Routing inputs from request bodies through llmd.tokens: the model's tokenizer, chat templates rendered as vLLM
    renders them, and the incremental PromptCache, so a 195K-token agent turn costs only its new part."""

    def __init__(self, tokenizer_dir: str, block_size: int, hash_algo: str, hash_seed: str | None,
                 max_tokens: int = 16_000_000) -> None:  # fmt: skip
        from llmd.kv.hashing import BlockHasher
        from llmd.tokens import PromptCache, Tokenizer

        self.tokenizer = Tokenizer(tokenizer_dir)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.cache = PromptCache(self.tokenizer, self.hasher, max_tokens=max_tokens)

    def encode_route(self, session: str | None, kind: Kind, source: Any, body: dict[str, Any]) -> RouteTokens:
        """Raises ValueError for a prompt the engine would refuse (bad messages, a template error)."""
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        special = body.get("add_special_tokens")
        special = special if isinstance(special, bool) else None
        if isinstance(source, list) and (not source or isinstance(source[0], int)):
            # Token ids: nothing to tokenize or remember; hash them as the engine will.
            return RouteTokens(self.hasher.event_hashes(source, cache_salt=salt), len(source), None)
        if kind == "chat":
            kw: dict[str, Any] = {}
            extra = body.get("chat_template_kwargs")
            if isinstance(extra, dict):
                kw.update(extra)
            for key in ("add_generation_prompt", "continue_final_message"):
                if isinstance(body.get(key), bool):
                    kw[key] = body[key]
            for key in ("tools", "documents"):
                if isinstance(body.get(key), list):
                    kw[key] = body[key]
            if isinstance(body.get("chat_template"), str):
                kw["chat_template"] = body["chat_template"]
            enc = self.cache.encode(source, add_special_tokens=special, cache_salt=salt, **kw)
        else:
            enc = self.cache.encode(source, add_special_tokens=special, cache_salt=salt)
        return RouteTokens(enc.block_hashes, enc.num_tokens, enc.session)


def _load_encoder(c: RouterConfig) -> Any:
    assert c.tokenizer is not None
    try:
        return PromptEncoder(c.tokenizer, c.block_size, c.hash_algo, c.hash_seed, c.prompt_cache_tokens)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load the tokenizer the router needs for prefix-aware routing from {c.tokenizer!r}: {exc}; "
            "point model.tokenizer (or model.path) at the model folder, or use policy approximate"
        ) from exc
