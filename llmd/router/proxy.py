"""The router's HTTP side: an OpenAI-compatible aiohttp proxy around the router core (llmd.router.core).

Request flow: read (size-limited) -> parse once (llmd.router.request) -> tokenize with the per-session prompt cache
(llmd.router.encoder; block hashes for the precise scorer; a text completion's prompt is then forwarded as those
token ids, RouterSpec.forward_tokens, so the engine does not tokenize it again) -> admission: the core admits the
request or queues it, and the proxy awaits a future the core's answer resolves -> the core's hops (P/D prefill hop,
P2P parameters; llmd.router.pd) -> forward, streaming chunk by chunk (llmd.router.upstream) -> the outcome back to
the core.

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
import errno
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from llmd import runid
from llmd.discovery import PodInfo
from llmd.kv.index import KVIndex
from llmd.net import h1, http_client
from llmd.net.limits import BodyTimeout, ServerLimits, read_body
from llmd.router import pd as hops
from llmd.router.config import RouterConfig, default_settings
from llmd.router.core import HopPlan, Job, Outcome, QueueFull, RouterCore
from llmd.router.encoder import PromptEncoder, PromptReader, RouteTokens, load_encoder
from llmd.router.endpoints import EndpointRegistry
from llmd.router.events import KVEventHub
from llmd.router.ledger import Flight
from llmd.router.metrics import CLIENT_CLOSED, CONTENT_TYPE, RouterMetrics, state_families
from llmd.router.pods import Pod
from llmd.router.recorder import RouterRecorder
from llmd.router.request import (
    SESSION_HEADER,
    APIError,
    Kind,
    RequestCtx,
    check_content_type,
    check_key,
    json_encode,
    max_tokens,
    parse_body,
    recorder_row,
    with_token_ids,
)
from llmd.router.scheduling import NoEndpointError, RouteRequest, Scheduler, Tuning
from llmd.router.upstream import Retry, Upstream

log = logging.getLogger(__name__)

DP_RANK_HEADER = "X-data-parallel-rank"
_FORWARD_REQUEST_HEADERS = ("X-Request-Id", "traceparent", "tracestate")
_CTX_KEY = web.RequestKey("llmd_ctx", object)
LISTEN_BACKLOG = 4096  # pending connections the listening socket queues (aiohttp: 128)
__all__ = ["APIError", "PromptEncoder", "RouteTokens", "Router", "RouterConfig"]


class Router:
    """The router process: pods, KV events, the router core (index, scheduler, admission, ledger), metrics and the
    aiohttp app."""

    def __init__(
        self,
        config: RouterConfig,
        pods: Iterable[PodInfo] = (),
        *,
        discovery: str | os.PathLike[str] | None = None,
        encoder: Any = None,
        scheduler: Scheduler | None = None,
        run_id: str | None = None,
        port_fallback: bool = False,
    ) -> None:
        """`run_id` (llmd.runid): /health says it, and only engines that prove the same id are routed to.
        `port_fallback`: a taken config.port is replaced by a free one (the caller publishes `url`)."""
        self.config = c = config
        self.run_id = run_id
        self.port_fallback = port_fallback
        self.registry = EndpointRegistry(
            pods,
            run_id=run_id,
            discovery=discovery,
            health_interval_s=c.health_interval_s,
            health_timeout_s=c.health_timeout_s,
            metrics_interval_s=c.metrics_interval_s,
        )
        self.index = KVIndex(max_entries=c.index_max_entries)
        self.hub = KVEventHub(self.index, replay_timeout_s=c.replay_timeout_s)
        settings = c.router_spec if c.router_spec is not None else default_settings(c)
        self.scheduler = scheduler or Scheduler(
            settings,
            c.seed,
            latency=c.latency,
            prefill_latency=c.prefill_latency,
            tuning=Tuning(time_scale=c.time_scale),
        )
        self.core = RouterCore(
            self.scheduler,
            self.index,
            max_inflight=c.max_inflight_per_pod,
            queue_limit=c.queue_limit,
            max_attempts=c.max_attempts,
            p2p_mode=c.p2p_mode,
            alive=_waiting,
            now=time.monotonic(),
        )
        self.metrics = RouterMetrics()
        self.metrics.add_collector(lambda: state_families(self.registry, self.core, self.hub, self.index))
        # The scheduler knows from its plugins' declarations whether it reads block hashes (so the router tokenizes)
        # or the prompt's text chunks.
        self._needs_tokens = "tokens" in self.scheduler.inputs
        if encoder is None and c.tokenizer is not None and self._needs_tokens:
            encoder = load_encoder(c)
        self.encoder = encoder
        self._needs_text = "text" in self.scheduler.inputs
        self._prompts = PromptReader(encoder, self._needs_text, self._needs_tokens, c.offload_tokenize_bytes)
        self.upstream = Upstream(
            self.metrics,
            self.core.calibrate,
            first_byte_s=c.first_byte_timeout_s,
            idle_s=c.idle_timeout_s,
            down_grace_s=c.down_grace_s,
        )
        self.limits = ServerLimits(header_timeout_s=c.header_timeout_s, body_idle_timeout_s=c.body_timeout_s)
        self.http: aiohttp.ClientSession | None = None
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self.port = 0 if c.port == "auto" else c.port
        self._prefill_pool = (-1, False)  # (registry version, any prefill pod registered, healthy or not)
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._models_cache: tuple[float, bytes] | None = None
        self._pump_timer: asyncio.Handle | None = None
        self._pump_at = 0.0  # when _pump_timer fires
        self.recorder: RouterRecorder | None = None
        # The bytes of a KV transfer, from the decode pool's model geometry when the router has its latency model.
        self._kv_bytes: Callable[[int], float] | None = getattr(c.latency, "kv_transfer_bytes", None)
        self.registry.on_up.append(self._pod_up)
        self.registry.on_down.append(self._pod_down)
        self.registry.on_change.append(self._pump)

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    async def start(self) -> Router:
        c = self.config
        self.http = http_client.engine_session(c.connect_timeout_s)  # health, metrics and model lists
        self.upstream.http = h1.EnginePool(c.connect_timeout_s)  # the requests' legs
        try:
            await self.registry.start(self.http)
            self._runner = web.AppRunner(
                self.app,
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=2.0,
                **self.limits.runner_kwargs(),
            )
            await self._runner.setup()
            # Thousands of agents connect at once (the client pool keeps idle connections 4 s; tool gaps are longer):
            # with aiohttp's backlog of 128 a busy loop let the accept queue overflow, and the kernel reset those
            # connections ~40-75 s later (Connection reset by peer, no row at the router). The kernel caps it at
            # net.core.somaxconn.
            site = web.TCPSite(self._runner, c.host, self.port, reuse_address=True, backlog=LISTEN_BACKLOG)
            try:
                await site.start()
            except OSError as exc:
                # Bind first, then publish what was bound: the caller reads `url` afterwards, never the spec's port.
                if not (self.port_fallback and self.port and exc.errno == errno.EADDRINUSE):
                    raise
                log.warning("router: port %d is taken on %s; taking a free one", self.port, c.host)
                site = web.TCPSite(self._runner, c.host, 0, reuse_address=True, backlog=LISTEN_BACKLOG)
                await site.start()
            self.port = self._runner.addresses[0][1]
            if c.metrics_out is not None:
                meta = {"policy": c.policy, "url": self.url, **(c.metrics_meta or {})}
                self.recorder = RouterRecorder(c.metrics_out, self.registry, self.core, meta=meta).start()
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
        if self.upstream.http is not None:
            await self.upstream.http.close()
            self.upstream.http = None
        self._prompts.close()

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- pods and the core's answers -------------------------------------------------------------------------------
    def _pod_up(self, pod: Pod) -> None:
        self.hub.subscribe(pod)
        self.core.pod_up(pod)

    def _pod_down(self, pod: Pod) -> None:
        # Events first, then the index (the core drops the pod's entries): nothing of the dead pod can come back.
        self.hub.unsubscribe_now(pod.name)
        self.core.pod_down(pod.name)
        # A pod that stopped answering /health may be hung: its requests in flight that have gone silent are cut, so
        # that a hung engine does not hang its clients (those not yet answered only where another pod can take them).
        # One taken out for another reason (removed from discovery to drain it) keeps serving what it has.
        if pod.failures:
            self.upstream.pod_down(pod.name, elsewhere=self._elsewhere(pod))

    def _elsewhere(self, pod: Pod) -> bool:
        """Could another healthy pod take over `pod`'s requests? A prefill pod's by any (decode serves alone), a
        serving pod's by another serving pod (the prefill pool serves none)."""
        return any(
            p is not pod and (pod.info.role == "prefill" or p.info.role != "prefill") for p in self.registry.healthy()
        )

    def _pump(self) -> None:
        self._settle(self.core.pump(time.monotonic()))

    def _settle(self, jobs: list[Job]) -> None:
        """Hand the requests the core decided to their waiting handlers, and keep its asked-for wakeup armed."""
        for job in jobs:
            if job.flight is not None:
                d = job.flight.decision
                self.metrics.decision(self.config.policy, d.reason, d.expected_hit_tokens)
            fut: asyncio.Future[None] | None = job.handle
            if fut is None:  # decided within the caller's own submit
                continue
            job.handle = None
            if job.error is not None:
                fut.set_exception(job.error)
            else:
                fut.set_result(None)
        self._arm()

    def _arm(self) -> None:
        """Run the queue again when the core asks to (the earliest such time wins; releases pump it anyway)."""
        at = self.core.next_wakeup()
        if at is None:
            return
        h = self._pump_timer
        if h is not None and not h.cancelled() and self._pump_at <= at:
            return
        if h is not None:
            h.cancel()
        # The time is kept here, not read back with h.when(): uvloop's call_at returns a plain Handle, which has no
        # when(), for a time already due (under load, requests failed on it with their connections reset).
        self._pump_at = at
        self._pump_timer = asyncio.get_running_loop().call_at(at, self._timed_pump)

    def _timed_pump(self) -> None:
        self._pump_timer = None
        self._pump()

    def _down(self, out: Outcome, reason: str) -> list[Job]:
        """The core took a pod out of routing: the registry hears it too (its health loop brings the pod back)."""
        if out.down is not None:
            self.registry.mark_down(out.down, reason)
        return out.admitted

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
        """Every answer is counted here, once, whatever produced it; every error is an OpenAI-style JSON body."""
        route = request.path
        status: int | None = None
        err: APIError | None = None
        close = False
        try:
            if self.config.api_key is not None and route != "/health":
                check_key(request, self.config.api_key)
            resp = await handler(request)
            status = resp.status
            return resp
        except APIError as exc:
            err = exc
        except BodyTimeout as exc:
            err = APIError(408, str(exc), "RequestTimeoutError")
            close = True  # the rest of a stalled body is not worth waiting for
        except web.HTTPRequestEntityTooLarge:
            err = APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", "RequestTooLargeError")
        except web.HTTPException as exc:
            if exc.status < 400:
                status = exc.status
                raise
            err = APIError(exc.status, exc.reason, exc.reason.replace(" ", "") + "Error")
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except Exception:
            ctx: RequestCtx | None = request.get(_CTX_KEY)
            if ctx is not None and ctx.first_byte:
                status = 200  # what the client was sent before the failure; aiohttp closes the connection
                raise
            log.exception("request %s %s failed in the router", request.method, route)
            err = APIError(500, "the router failed on this request", "InternalServerError")
        finally:
            if err is not None:
                status = err.status
                self.metrics.error(route, err.err_type)
            if status is not None:
                self.metrics.request(route, status)
        resp = err.response()
        if close:
            resp.force_close()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        # Healthy as long as some pod can serve a whole request: what a load balancer in front needs to know.
        ok = any(p.healthy and p.info.serves_decode for p in self.registry.pods.values())
        headers = {runid.HEADER: self.run_id} if self.run_id else None
        return web.Response(status=200 if ok else 503, headers=headers)

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
                        body = _without_run_names(await r.read())
                        self._models_cache = (now, body)
                        return web.Response(body=body, content_type="application/json")
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        name = self.config.served_name
        if name is None:
            raise APIError(503, "no healthy engine to list models from", "ServiceUnavailableError")
        data = {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": name, "parent": None}]}  # fmt: skip
        return web.Response(body=json_encode(data), content_type="application/json")

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
        if rec is not None:
            ctx: RequestCtx | None = request.get(_CTX_KEY)
            session = request.headers.get(SESSION_HEADER)
            now = time.monotonic()
            row, gpu, cpu = recorder_row(ctx, session, rec.since_start(t0), t0, now, status, error, self._kv_bytes)
            rec.request(row, gpu, cpu)

    async def _generate_one(self, request: web.Request, kind: Kind, t0: float) -> web.StreamResponse:
        ctx = await self._parse(request, kind)
        request[_CTX_KEY] = ctx
        self.metrics.routing_time.observe(time.monotonic() - t0)
        last: web.Response | None = None
        while True:
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
            except Retry as exc:
                out = self.core.fail(ctx.job, exc.reason, exc.pod_down, time.monotonic())
                self.metrics.retries.labels(exc.reason).inc()
                log.info("request %s: pod %s failed before streaming (%s); retrying", ctx.request_id, exc.pod, exc)
                self._settle(self._down(out, exc.reason))
                last = exc.last or last
                if not out.retry:
                    if last is not None:
                        return self._finish_error(ctx, last)
                    raise APIError(502, out.error, "BadGatewayError") from None
                continue
            except BaseException:
                self._settle(self.core.complete(flight, time.monotonic()))
                raise
            self._settle(self.core.complete(flight, time.monotonic()))
            return resp

    def _finish_error(self, ctx: RequestCtx, resp: web.Response) -> web.Response:
        self.metrics.error(ctx.route, "upstream")
        return resp

    async def _parse(self, request: web.Request, kind: Kind) -> RequestCtx:
        c = self.config
        check_content_type(request.headers.get("Content-Type"))
        raw = await read_body(request, c.max_body_bytes, c.body_timeout_s)
        body = parse_body(raw, c.max_json_depth)
        user = body.get("user")
        session = request.headers.get(SESSION_HEADER) or (user if isinstance(user, str) and user else None)
        prompt = await self._prompts.read(kind, body, session, len(raw), self.core.chars_per_token)
        if c.forward_tokens:
            forward = with_token_ids(kind, body, prompt.token_ids)
            if forward is not None:
                body, raw = forward, json_encode(forward)
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
            max_tokens=max_tokens(body),
        )
        self.metrics.prompt_tokens.inc(prompt.num_tokens)
        ctx = RequestCtx(kind, request.path, raw, body, request_id, headers, Job(rr, session))
        ctx.text_chars = prompt.chars
        return ctx

    # -- admission
    async def _admit(self, ctx: RequestCtx) -> Flight:
        """The core admits the request now or queues it; a queued one waits on a future that `_settle` resolves."""
        job = ctx.job
        t0 = time.monotonic()
        decided = self.core.submit(job, t0)
        if job.flight is None:
            fut = asyncio.get_running_loop().create_future()
            job.handle = fut
            self._settle(decided)
            try:
                await fut
            except asyncio.CancelledError:
                # Admitted just as the client left, or still waiting: give back the slots, or leave the queue.
                job.handle = None
                self._settle(self.core.withdraw(job, time.monotonic()))
                raise
        else:
            self._settle(decided)
        assert job.flight is not None
        waited = time.monotonic() - t0
        ctx.queue_s += waited
        self.metrics.queue_time.observe(waited)
        return job.flight

    # -- hops
    def _upstream_headers(self, ctx: RequestCtx, pod: Pod, rank: int) -> dict[str, str]:
        if pod.info.dp_size == 1:
            return ctx.headers
        h = dict(ctx.headers)
        h[DP_RANK_HEADER] = str(rank)
        return h

    def _has_prefill_pool(self) -> bool:
        """Any prefill pod registered, healthy or not; recomputed only when the pod set changes."""
        reg = self.registry
        if self._prefill_pool[0] != reg.version:
            self._prefill_pool = (reg.version, any(p.info.role == "prefill" for p in reg.pods.values()))
        return self._prefill_pool[1]

    async def _serve(self, request: web.Request, ctx: RequestCtx, flight: Flight) -> web.StreamResponse:
        d = flight.decision
        target = flight.target
        out_headers = {
            "x-llmd-pod": target.name,
            "x-llmd-route-reason": d.reason,
            "x-llmd-queue-ms": f"{ctx.queue_s * 1000:.1f}",
            "x-llmd-expected-hit-tokens": str(d.expected_hit_tokens),
            "x-llmd-attempts": str(ctx.job.attempts),
        }
        ctx.decision, ctx.out = d, out_headers
        if target.info.dp_size > 1:
            out_headers["x-llmd-dp-rank"] = str(flight.rank)
        # The snapshot holds healthy pods only, so "" also means a prefill pool with none of it healthy.
        pd_reason = d.pd_reason or ("prefill-unhealthy" if self._has_prefill_pool() else "")
        if pd_reason:
            out_headers["x-llmd-pd-reason"] = pd_reason
        payload = ctx.raw  # forwarded untouched unless a hop adds kv_transfer_params
        plan = self.core.hop_plan(ctx.job)
        ctx.transfer_tokens = 0
        if plan.prefill is not None:
            payload = await self._prefill(ctx, flight, plan, out_headers)
        elif plan.p2p_outcome:
            self.metrics.p2p.labels(plan.p2p_outcome).inc()
            if plan.kv_params is not None:
                out_headers["x-llmd-p2p-source"] = plan.source
                payload = json_encode(hops.with_kv_params(ctx.body, plan.kv_params))
                ctx.transfer_tokens = plan.transfer_tokens
        headers = self._upstream_headers(ctx, target, flight.rank)
        return await self.upstream.forward(request, ctx, target, payload, headers, out_headers)

    async def _prefill(self, ctx: RequestCtx, flight: Flight, plan: HopPlan, out_headers: dict[str, str]) -> bytes:
        """The prefill hop; the payload for the serving pod: with the returned kv_transfer_params, or the original
        body (decode-only fallback) if the hop failed."""
        pre, why = plan.prefill, plan.why
        assert pre is not None
        body = hops.prefill_body(ctx.body, ctx.kind == "chat")
        headers = self._upstream_headers(ctx, pre, plan.prefill_rank)
        res = await self.upstream.prefill(pre.name, pre.info.url + ctx.route, json_encode(body), headers)
        out = self.core.prefill_done(flight, plan, res.kv_params, res.unreachable, time.monotonic())
        self.metrics.prefill_time.observe(res.seconds)
        out_headers["x-llmd-prefill-ms"] = f"{res.seconds * 1000:.1f}"
        counter = self.metrics.pd if why == "pd" else self.metrics.p2p
        if res.kv_params is None:
            log.info("request %s: prefill hop to %s failed (%s); decode-only", ctx.request_id, pre.name, res.error)
            counter.labels("fallback").inc()
            if why == "pd":
                out_headers["x-llmd-pd"] = "fallback"
            self._settle(self._down(out, res.error or "unreachable"))
            return ctx.raw
        self._settle(out.admitted)
        counter.labels("ok").inc()
        ctx.transfer_tokens = plan.transfer_tokens
        if why == "pd":
            out_headers["x-llmd-prefill-pod"] = pre.name
            out_headers["x-llmd-pd"] = "ok"
        else:
            out_headers["x-llmd-p2p-source"] = pre.name
        return json_encode(hops.with_kv_params(ctx.body, res.kv_params))


def _without_run_names(body: bytes) -> bytes:
    """vLLM's /v1/models less the served name that only vouches for the run (llmd.runid): clients ask for the model."""
    if runid.MODEL_PREFIX.encode() not in body:
        return body
    try:
        data = json.loads(body)
        data["data"] = [m for m in data["data"] if not str(m.get("id", "")).startswith(runid.MODEL_PREFIX)]
    except (ValueError, KeyError, TypeError, AttributeError):
        return body
    return json_encode(data)


def _waiting(job: Job) -> bool:
    """A queued request is still wanted while its handler awaits it (a cancelled one may not have left yet)."""
    fut = job.handle
    return fut is None or not fut.done()
