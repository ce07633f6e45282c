"""The simulated engine's HTTP server: vLLM 0.32's OpenAI API in front of simulated engine cores (one per DP rank).

Endpoints as vLLM serves them: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /metrics, /version, /ping, /load, /kv_event_sources; POST /reset_prefix_cache (vLLM dev mode). The rank of a
request is the `X-data-parallel-rank` header's (vLLM's name), else the least loaded rank. Each rank publishes KV
events on its own endpoint (port + rank) and serves KV pulls on its own side-channel port (port + rank).

Around the API, as vLLM's FastAPI app: an unknown route or method is Starlette's `{"detail": ...}` 404/405 (with
`Allow`), CORS is Starlette's middleware with vLLM's defaults (`Vary: Origin`, every preflight refused), and /metrics
carries prometheus-fastapi-instrumentator's `http_*` families and the process/platform/GC collectors. Logprobs are
synthetic (llmd/engines/sim/logprobs.py) in vLLM's exact shapes.

`SimServer` is one engine server; `SimEngineGroup` starts several in this event loop (tests, demos). Usage details
follow vLLM's `--enable-prompt-tokens-details`, which is off in vLLM but on here by default: routers and benchmarks of
this project read `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from llmd.perf.latency import LatencyModel

from . import openai_protocol as P
from .core import EngineCore, RequestOutput, SimEngineConfig
from .logprobs import LogprobSynth, Position, chat_logprobs, completion_logprobs, prompt_logprobs_json
from .metrics import CONTENT_TYPE, EngineMetrics
from .publisher import KVEventPublisher
from .request import SimRequest
from .runner import EngineRunner, FaultConfig, RankRunner, RequestHandle, SimClock
from .tokenizer import ChatTemplateError, IncrementalDetokenizer, SimTokenizer
from .transfer import SideChannelServer

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both"]
DP_RANK_HEADER = "X-data-parallel-rank"
# Block counts derived from a GPU profile can reach millions for small models; the core keeps per-block state, so a
# derived count is capped here (an explicit num_gpu_blocks is taken as given).
MAX_DERIVED_GPU_BLOCKS = 262_144
# Starlette's CORSMiddleware as vLLM configures it (no allowed origins, every method and header).
CORS_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
CORS_PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"
)


@dataclass(slots=True)
class SimServerConfig:
    """One simulated engine server. `engine` holds the core settings shared by all ranks; per-rank fields
    (dp_rank, engine_id, side channel, vocabulary) are filled in by the server."""

    model_dir: str
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see SimServer.port)
    dp_size: int = 1
    role: Role = "both"
    time_scale: float = 1.0
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    latency: LatencyModel | None = None  # default: the tiny model on the default spec's GPU
    engine_id: str | None = None  # default: a random one; ranks > 0 get "_dp<rank>" appended, as vLLM does
    kv_events_endpoint: str | None = None  # e.g. "tcp://*:5557"; None: no KV events
    kv_events_replay_endpoint: str | None = None  # e.g. "tcp://*:5567"
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    side_channel_host: str = "127.0.0.1"  # VLLM_NIXL_SIDE_CHANNEL_HOST
    side_channel_port: int | None = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT (+ rank); 0: any free port; None: no P/D
    node: str = field(default_factory=socket.gethostname)  # same node -> NVLink transfer times, else the NIC
    faults: FaultConfig = field(default_factory=FaultConfig)
    enable_prompt_tokens_details: bool = True  # vLLM: --enable-prompt-tokens-details (off by default there)
    enable_force_include_usage: bool = False  # vLLM: --enable-force-include-usage
    trust_request_chat_template: bool = False  # vLLM: --trust-request-chat-template
    max_model_len: int | None = None  # default: engine.max_model_len
    name: str | None = None  # for logs
    pull_timeout_s: float = 10.0
    gpu_memory_utilization: float = 0.92  # vLLM's --gpu-memory-utilization, as vllm:cache_config_info reports it

    @classmethod
    def from_spec(cls, spec: Any, role: Role = "both", **overrides: Any) -> SimServerConfig:
        """A server for one replica of `role`'s pool of a DeploymentSpec (llmd.spec)."""
        pool = spec.prefill if role == "prefill" else spec.decode
        latency = LatencyModel.from_spec(spec, "prefill" if role == "prefill" else "decode")
        m = spec.model
        bs = m.block_size
        if spec.kv.gpu_blocks is not None:
            gpu_blocks = spec.kv.gpu_blocks
        else:
            gpu_blocks = min(latency.max_kv_tokens(spec.kv.gpu_memory_fraction) // bs, MAX_DERIVED_GPU_BLOCKS)
            gpu_blocks = max(gpu_blocks, math.ceil(m.max_model_len / bs) + 1)
        cpu_blocks = int(spec.kv.cpu_bytes // (latency.kv_bytes_per_token_gpu * bs)) if spec.kv.cpu_bytes else 0
        engine = SimEngineConfig(
            block_size=bs,
            hash_algo=m.hash_algo,
            hash_seed=m.hash_seed,
            num_gpu_blocks=gpu_blocks,
            num_cpu_blocks=cpu_blocks,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_model_len=m.max_model_len,
            seed=spec.workload.seed,
            role=role,
            num_speculative_tokens=spec.mtp.draft_tokens if role != "prefill" else 0,
            tp_size=pool.tp_size,
            kv_cache_spec_kind="mla_attention" if latency.model.attention == "mla" else "full_attention",
        )
        fields: dict[str, Any] = {
            "model_dir": m.tokenizer or m.path,
            "served_name": m.served_name,
            "port": pool.port,
            "dp_size": pool.dp_size,
            "role": role,
            "time_scale": spec.engine.time_scale,
            "engine": engine,
            "latency": latency,
            "gpu_memory_utilization": spec.kv.gpu_memory_fraction,
        }
        # A name both configs have (side_channel_port, role) is the server's: it fills the engine's per rank itself.
        engine_only = SimEngineConfig.__dataclass_fields__.keys() - cls.__dataclass_fields__.keys()
        engine_overrides = {k: overrides.pop(k) for k in list(overrides) if k in engine_only}
        if engine_overrides:
            fields["engine"] = replace(engine, **engine_overrides)
        fields.update(overrides)
        return cls(**fields)


def default_latency() -> LatencyModel:
    from llmd.spec import DeploymentSpec

    return LatencyModel.from_spec(DeploymentSpec(), "decode")


@dataclass(slots=True)
class _Sub:
    """One engine request of an HTTP request: a prompt (of a batch) times one of n choices."""

    index: int
    prompt_idx: int
    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int
    rank: RankRunner
    handle: RequestHandle | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    done: bool = False
    # logprobs (when asked for): one position per output token, the sampled ids so far, the next text offset
    positions: list[Position] = field(default_factory=list)
    lp_context: list[int] = field(default_factory=list)
    text_offset: int = 0


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
            cache_config=self._cache_config_info(),
        )
        self.logprobs = LogprobSynth(self.tokenizer, self.tokenizer.special_token_ids)
        self._max_chars_per_token: int | None = None
        self._allow: dict[str, str] = {}  # path -> the method of its first route (Starlette's Allow on a 405)
        self.engine_id = config.engine_id or f"sim-{P.random_uuid()}"
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
        self.fingerprint = P.system_fingerprint(hashlib.sha256(cfg.encode()).hexdigest(), config.dp_size)

    def _cache_config_info(self) -> dict[str, str]:
        """vLLM's CacheConfig.metrics_info() (vllm:cache_config_info's labels) for this engine, on a GPU."""
        c = self.config
        e = c.engine
        size_tokens = e.num_gpu_blocks * e.block_size
        offload = None
        if e.num_cpu_blocks:
            kv_bytes = self.latency.kv_bytes_per_token_gpu * max(e.tp_size, 1)
            offload = e.num_cpu_blocks * e.block_size * kv_bytes / 2**30  # --kv-offloading-size, GiB
        info: dict[str, Any] = {
            "_block_size_resolved": True,
            "block_size": e.block_size,
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": None,
            "effective_attention_block_size": e.block_size,
            "enable_mamba_shared_prefix_checkpoint": False,
            "enable_prefix_caching": True,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "hash_block_size": None,
            "is_attention_free": False,
            "kv_cache_dtype_skip_layers": [],
            "kv_cache_layout": None,
            "kv_cache_max_concurrency": size_tokens / self.max_model_len,
            "kv_cache_memory_bytes": None,
            "kv_cache_size_tokens": size_tokens,
            "kv_offloading_backend": "native",
            "kv_offloading_size": offload,
            "kv_sharing_fast_prefill": False,
            "mamba_block_size": None,
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": None,
            "mamba_ssm_cache_dtype": "auto",
            "num_cpu_blocks": None,
            "num_gpu_blocks": e.num_gpu_blocks,
            "num_gpu_blocks_override": None,
            "prefix_cache_retention_interval": 0,
            "prefix_caching_hash_algo": e.hash_algo,
            "prefix_match_unit": None,
            "replayssm_buffer_len": 16,
            "skip_page_size_padded": None,
            "sliding_window": None,
            "swa_bounded_replay": True,
            "use_kda_recoverssm": False,
            "use_replayssm": False,
            "user_specified_block_size": True,
        }
        return {k: str(v) for k, v in info.items()}

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    async def start(self) -> SimServer:
        c = self.config
        tok = self.tokenizer
        kv_bytes = self.latency.kv_bytes_per_token_gpu * max(c.engine.tp_size, 1)
        try:
            for rank in range(c.dp_size):
                engine_id = self.engine_id if c.dp_size == 1 else f"{self.engine_id}_dp{rank}"
                side: SideChannelServer | None = None
                port = 0
                if c.side_channel_port is not None:
                    # Bound before the core exists so the core can advertise the port really bound (0 = any).
                    side = SideChannelServer(
                        None, c.side_channel_host, c.side_channel_port and c.side_channel_port + rank
                    )
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
                    publisher = KVEventPublisher(
                        c.kv_events_endpoint,
                        rank,
                        replay_endpoint=c.kv_events_replay_endpoint,
                        topic=c.kv_events_topic,
                        buffer_steps=c.kv_events_buffer_steps,
                    )
                    self.publishers.append(publisher)
                runner = RankRunner(
                    core,
                    self.latency,
                    self.clock,
                    self.metrics.rank(rank),
                    publisher=publisher,
                    node=c.node,
                    kv_bytes_per_token=kv_bytes,
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
            self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
            await self._runner.setup()
            self._site = web.TCPSite(self._runner, c.host, c.port, reuse_address=True)
            await self._site.start()
            self.port = self._runner.addresses[0][1]
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

    def _crash(self) -> None:
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
        app = web.Application(middlewares=[self._middleware()], client_max_size=256 << 20)
        app.on_response_prepare.append(_response_headers)
        r = app.router
        routes: list[tuple[str, str, Callable[[web.Request], Any]]] = [
            ("POST", "/v1/completions", self._completions),
            ("POST", "/v1/chat/completions", self._chat),
            ("POST", "/tokenize", self._tokenize),
            ("POST", "/detokenize", self._detokenize),
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
                    resp = _json({"detail": routing_error.reason}, routing_error.status, headers=extra)
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

    async def _health(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        return web.Response(status=200 if self.engine.faults.ready() else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": P.VLLM_VERSION})

    async def _load(self, request: web.Request) -> web.Response:
        return _json({"server_load": sum(r.load for r in self.ranks)})

    async def _metrics(self, request: web.Request) -> web.Response:
        for r in self.ranks:
            r._refresh_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        return _json(P.models_response(self.served_name, self.config.model_dir, self.max_model_len))

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
        return _json(out)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        for r in self.ranks:
            r.core.reset_prefix_cache()
            r._publish(r.core.take_events())
        return web.Response(status=200)

    def _check_model(self, model: str | None) -> None:
        if model and model != self.served_name:
            raise P.model_not_found(model, [self.served_name])

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = P.parse_json_body(await request.read(), request.headers.get("Content-Type"))
        model, prompt, messages, opts = P.parse_tokenize_request(body)
        self._check_model(model)
        tok = self.tokenizer
        if messages is not None:
            ids = tok.encode(
                self._render_chat(
                    messages,
                    add_generation_prompt=opts["add_generation_prompt"],
                    continue_final_message=opts["continue_final_message"],
                    tools=opts["tools"],
                    documents=None,
                    kwargs=opts["chat_template_kwargs"],
                ),
                add_special_tokens=opts["add_special_tokens"],
            )
        else:
            assert prompt is not None
            ids = tok.encode(prompt, add_special_tokens=opts["add_special_tokens"])
        strs = [tok.id_to_token(i) or "" for i in ids] if opts["return_token_strs"] else None
        return _json(P.tokenize_response(ids, self.max_model_len, strs))

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = P.parse_json_body(await request.read(), request.headers.get("Content-Type"))
        model, tokens = P.parse_detokenize_request(body)
        self._check_model(model)
        # Ids past the vocabulary decode to nothing (the tokenizer skips them), as in vLLM.
        return _json(P.detokenize_response(self.tokenizer.decode(tokens)))

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None,
        documents: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        chat_template: str | None = None,
    ) -> str:
        if not messages and (chat_template or self.tokenizer.chat_template) is not None:
            # transformers' apply_chat_template, once it has a template.
            raise P.validation_error(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        try:
            return self.tokenizer.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                **{k: v for k, v in kwargs.items() if k not in ("add_generation_prompt", "continue_final_message")},
            )
        except ChatTemplateError as exc:
            # vLLM surfaces template refusals as 400 with the template's own message.
            raise P.validation_error(str(exc)) from exc

    # ---- generation ------------------------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: Literal["completion", "chat"]) -> web.StreamResponse:
        engine = self.engine
        assert engine is not None
        verdict = engine.faults.admit()
        if verdict == "crash":
            self._crash()
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        if verdict == "hang":
            engine.stall()
            await asyncio.Event().wait()
        if not engine.faults.ready():
            raise P.service_unavailable("The server is starting up; please try again later.")
        raw = await request.read()
        body = P.parse_json_body(raw, request.headers.get("Content-Type"))
        if kind == "completion":
            req = P.parse_completion_request(body)
        else:
            req = P.parse_chat_request(body, trust_request_chat_template=self.config.trust_request_chat_template)
        self._check_model(req.model)
        # vLLM's order: the renderer (output budget, then each prompt rendered and length-checked), the sampling
        # parameters of each prompt (its max_tokens clamped to the context), then the engine's input checks.
        P.check_max_tokens(req, self.max_model_len)
        prompts = self._prompts(req)
        rank = self._pick_rank(request)
        budgets = []
        for ids, _ in prompts:
            budget = P.effective_max_tokens(req, len(ids), self.max_model_len)
            P.check_sampling(req, budget)
            budgets.append(budget)
        if verdict == "fail":
            raise P.internal_error()
        engine_error: P.APIError | None = None
        try:
            for ids, _ in prompts:
                P.check_engine_input(req, ids, self.max_model_len, self.tokenizer.vocab_size)
        except P.APIError as exc:
            if not req.stream:
                raise
            engine_error = exc  # vLLM meets it in the engine, after the stream started: an error event
        base = request.headers.get("X-Request-Id") or req.request_id or P.random_uuid()
        request_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{base}"
        if engine_error is not None:
            return await self._stream_error(request, engine_error)
        subs: list[_Sub] = []
        n = req.sampling.n
        for p_idx, ((ids, text), max_tokens) in enumerate(zip(prompts, budgets, strict=True)):
            for j in range(n):
                subs.append(_Sub(p_idx * n + j, p_idx, ids, text, max_tokens, rank))
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        by_id: dict[str, _Sub] = {}
        try:
            for sub in subs:
                engine_rid = request_id if len(subs) == 1 and kind == "chat" else f"{request_id}-{sub.index}"
                while engine_rid in rank.handles or engine_rid in rank.core.requests or engine_rid in rank.core.leases:
                    engine_rid = f"{engine_rid}-{P.random_uuid()[:8]}"
                sim_req = SimRequest(
                    engine_rid,
                    sub.prompt_ids,
                    sub.max_tokens,
                    cache_salt=req.cache_salt,
                    eos_token_id=None if req.sampling.ignore_eos else self.tokenizer.eos_token_id,
                    kv_transfer_params=dict(req.kv_transfer_params) if req.kv_transfer_params else None,
                    # vLLM computes every prompt token of a request that wants prompt logprobs.
                    skip_reading_prefix_cache=req.sampling.prompt_logprobs is not None,
                )
                try:
                    sub.handle = rank.submit(sim_req, queue)
                except ValueError as exc:
                    raise P.validation_error(str(exc)) from exc
                sub.detok = IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens)
                by_id[engine_rid] = sub
            created = int(time.time())
            if req.stream:
                return await self._stream(request, req, request_id, created, subs, by_id, queue)
            return await self._collect(req, request_id, created, subs, by_id, queue)
        finally:
            for sub in subs:
                if sub.handle is not None and not sub.handle.finished:
                    rank.abort(sub.handle.req.request_id)

    @property
    def max_chars_per_token(self) -> int | None:
        """vLLM's tokenizer.max_chars_per_token: the longest vocabulary piece (None: unknown, no text check)."""
        if self._max_chars_per_token is None:
            backend = getattr(self.tokenizer, "backend", None)
            vocab = backend.get_vocab(True) if backend is not None else None
            self._max_chars_per_token = max((len(t) for t in vocab), default=0) if vocab else 0
        return self._max_chars_per_token or None

    def _prompts(self, req: P.GenerateRequest) -> list[tuple[list[int], str | None]]:
        """The request's prompts as the renderer makes them: (token ids, text) each, length-checked."""
        tok = self.tokenizer
        max_len = self.max_model_len
        if req.kind == "chat":
            text = self._render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                documents=req.documents,
                kwargs=req.chat_template_kwargs,
                chat_template=req.chat_template,
            )
            items: list[tuple[str | list[int], str | None]] = [(text, text)]
        else:
            if not req.prompts:
                raise P.validation_error("You must pass at least one prompt")
            items = [(p, p if isinstance(p, str) else None) for p in req.prompts]
        out = []
        for prompt, text in items:
            from_text = isinstance(prompt, str)
            if isinstance(prompt, str):
                chars = self.max_chars_per_token
                if req.kind == "completion" and req.truncate_prompt_tokens is None and chars:
                    P.check_text_length(prompt, max_len, chars)
                ids = tok.encode(prompt, add_special_tokens=req.add_special_tokens)
            else:
                ids = prompt
            if req.truncate_prompt_tokens is not None:
                keep = max_len - 1 if req.truncate_prompt_tokens < 0 else req.truncate_prompt_tokens
                ids = ids[:keep]
            P.check_prompt_length(ids, max_len, from_text=from_text)
            out.append((ids, text))
        return out

    def _pick_rank(self, request: web.Request) -> RankRunner:
        assert self.engine is not None
        header = request.headers.get(DP_RANK_HEADER)
        rank: int | None = None
        if header is not None:
            with contextlib.suppress(ValueError):
                rank = int(header)  # vLLM ignores a header that is not an int
        n = len(self.ranks)
        if rank is not None and not 0 <= rank < n:
            raise P.validation_error(f"data_parallel_rank {rank} is out of range [0, {n}).")
        return self.engine.pick(rank)

    def _apply(self, sub: _Sub, out: RequestOutput, req: P.GenerateRequest) -> tuple[str, list[int], list[Position]]:
        """Folds one engine output into its sub-request; returns the new text, token ids and logprob positions."""
        assert sub.detok is not None
        new_ids = out.new_token_ids
        delta = sub.detok.push(new_ids)
        sub.text += delta
        positions: list[Position] = []
        num = req.sampling.logprobs
        if num is not None and new_ids:
            ids = sub.token_ids
            prev = ids[-1] if ids else (sub.prompt_ids[-1] if sub.prompt_ids else 0)
            greedy = req.sampling.temperature < P._SAMPLING_EPS
            positions = self.logprobs.sample_positions(new_ids, len(ids), prev, num, sub.lp_context, greedy=greedy)
            sub.positions.extend(positions)
        sub.token_ids.extend(new_ids)
        if sub.num_cached_tokens is None:
            sub.num_cached_tokens = max(out.num_cached_tokens, 0)
        if sub.created_cache_tokens is None:
            sub.created_cache_tokens = out.num_cache_creation_tokens
        if out.finished:
            sub.done = True
            sub.finish_reason = out.finish_reason.value if out.finish_reason is not None else "error"
            sub.kv_transfer_params = out.kv_transfer_params
            sub.num_cached_tokens = max(out.num_cached_tokens, 0)
        return delta, list(new_ids), positions

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_positions(self, req: P.GenerateRequest, sub: _Sub, cache: dict[int, list[Position | None]]) -> Any:
        """The synthetic prompt logprobs of a sub-request's prompt (once per prompt)."""
        got = cache.get(sub.prompt_idx)
        if got is None:
            num = req.sampling.prompt_logprobs
            got = cache[sub.prompt_idx] = self.logprobs.prompt_positions(sub.prompt_ids, 0 if num is None else num)
        return got

    def _completion_logprobs(
        self,
        req: P.GenerateRequest,
        sub: _Sub,
        token_ids: list[int],
        positions: list[Position],
        prompt_cache: dict[int, list[Position | None]],
        echo_prompt: bool,
    ) -> dict[str, Any] | None:
        """A completion choice's (or chunk's) logprobs object, the echoed prompt's positions first; advances the
        sub-request's text offset as vLLM's stream does."""
        num = req.sampling.logprobs
        if num is None:
            return None
        ids: list[int] = token_ids
        pos: list[Position | None] = list(positions)
        if echo_prompt:
            ids = [*sub.prompt_ids, *token_ids]
            pos = [*self._prompt_positions(req, sub, prompt_cache), *positions]
        lp = completion_logprobs(
            ids, pos, num, self._decode_one, initial_offset=sub.text_offset, as_token_id=req.return_tokens_as_token_ids
        )
        if lp["tokens"]:
            sub.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    async def _collect(
        self,
        req: P.GenerateRequest,
        request_id: str,
        created: int,
        subs: list[_Sub],
        by_id: dict[str, _Sub],
        queue: asyncio.Queue[RequestOutput],
    ) -> web.Response:
        pending = len(subs)
        while pending:
            out = await queue.get()
            sub = by_id.get(out.request_id)
            if sub is None or sub.done:
                continue
            self._apply(sub, out, req)
            if sub.done:
                pending -= 1
        if any(s.finish_reason == "error" for s in subs):
            raise P.internal_error()
        details = self.config.enable_prompt_tokens_details
        prompt_tokens = sum(len(ids) for ids in {s.prompt_idx: s.prompt_ids for s in subs}.values())
        completion_tokens = sum(len(s.token_ids) for s in subs)
        kv_params = subs[0].kv_transfer_params
        want_prompt_lp = req.sampling.prompt_logprobs is not None
        prompt_cache: dict[int, list[Position | None]] = {}
        if req.kind == "completion":
            choices = []
            for s in subs:
                text = s.text
                if req.echo:
                    ptext = (
                        ""
                        if req.return_token_ids
                        else (s.prompt_text if s.prompt_text is not None else self.tokenizer.decode(s.prompt_ids))
                    )
                    text = ptext + text
                s.text_offset = 0
                choices.append(
                    P.completion_choice(
                        s.index,
                        text,
                        s.finish_reason,
                        token_ids=s.token_ids if req.return_token_ids else None,
                        prompt_token_ids=s.prompt_ids if req.return_token_ids else None,
                        logprobs=self._completion_logprobs(req, s, s.token_ids, s.positions, prompt_cache, req.echo),
                        prompt_logprobs=(
                            prompt_logprobs_json(self._prompt_positions(req, s, prompt_cache))
                            if want_prompt_lp
                            else None
                        ),
                    )
                )
            use = P.usage(prompt_tokens, completion_tokens, subs[-1].num_cached_tokens, details=details)
            body = P.completion_response(
                request_id, created, self.served_name, choices, use, self.fingerprint, kv_params
            )
        else:
            role = self._chat_role(req)
            prefix = self._echo_prefix(req, role)
            as_ids = req.return_tokens_as_token_ids
            choices = [
                P.chat_choice(
                    s.index,
                    role,
                    prefix + s.text,
                    s.finish_reason,
                    s.token_ids if req.return_token_ids else None,
                    logprobs=(
                        chat_logprobs(s.token_ids, s.positions, req.top_logprobs, as_token_id=as_ids)
                        if req.sampling.logprobs is not None
                        else None
                    ),
                )
                for s in subs
            ]
            use = P.usage(
                prompt_tokens,
                completion_tokens,
                subs[0].num_cached_tokens,
                details=details,
                created_cache_tokens=subs[0].created_cache_tokens,
            )
            body = P.chat_response(
                request_id,
                created,
                self.served_name,
                choices,
                use,
                self.fingerprint,
                kv_params,
                prompt_token_ids=subs[0].prompt_ids if req.return_token_ids else None,
                prompt_text=subs[0].prompt_text if req.return_prompt_text else None,
                prompt_logprobs=(
                    prompt_logprobs_json(self._prompt_positions(req, subs[0], prompt_cache)) if want_prompt_lp else None
                ),
            )
        return _json(body)

    @staticmethod
    def _chat_role(req: P.GenerateRequest) -> str:
        # vLLM's response role is "assistant" unless the request continues the last message's role.
        if req.add_generation_prompt or not req.messages:
            return "assistant"
        return req.messages[-1]["role"]

    @staticmethod
    def _echo_prefix(req: P.GenerateRequest, role: str) -> str:
        if req.echo and req.messages and req.messages[-1].get("role") == role:
            return req.messages[-1].get("content") or ""
        return ""

    async def _stream_error(self, request: web.Request, error: P.APIError) -> web.StreamResponse:
        """A stream whose request the engine refused: 200, one error event, [DONE] (vLLM's stream generators)."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            await resp.write(P.sse_error(error))
            await resp.write(P.SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        return resp

    async def _stream(
        self,
        request: web.Request,
        req: P.GenerateRequest,
        request_id: str,
        created: int,
        subs: list[_Sub],
        by_id: dict[str, _Sub],
        queue: asyncio.Queue[RequestOutput],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        include_usage = req.include_usage or self.config.enable_force_include_usage
        continuous = req.continuous_usage or self.config.enable_force_include_usage
        model = self.served_name
        chat = req.kind == "chat"
        role = self._chat_role(req) if chat else ""
        first = True
        cached: int | None = None
        created_cache: int | None = None
        prompt_lens = {s.prompt_idx: len(s.prompt_ids) for s in subs}
        num_prompt = sum(prompt_lens.values())
        sent_prompt_ids: set[int] = set()
        prompt_cache: dict[int, list[Position | None]] = {}
        want_logprobs = req.sampling.logprobs is not None
        pending = len(subs)
        try:
            while pending:
                out = await queue.get()
                sub = by_id.get(out.request_id)
                if sub is None or sub.done:
                    continue
                if first:
                    cached = max(out.num_cached_tokens, 0)
                    created_cache = out.num_cache_creation_tokens
                    first = False
                    if chat:
                        for s in subs:
                            use = P.continuous_usage(num_prompt, 0, chat=True) if continuous else None
                            await resp.write(
                                P.sse(
                                    P.chat_role_chunk(
                                        request_id,
                                        created,
                                        model,
                                        s.index,
                                        role,
                                        prompt_token_ids=s.prompt_ids if req.return_token_ids else None,
                                        prompt_text=s.prompt_text if req.return_prompt_text else None,
                                        usage_info=use,
                                    )
                                )
                            )
                        prefix = self._echo_prefix(req, role)
                        if prefix:
                            for s in subs:
                                use = P.continuous_usage(num_prompt, 0, chat=True) if continuous else None
                                await resp.write(
                                    P.sse(
                                        P.chat_chunk(
                                            request_id,
                                            created,
                                            model,
                                            s.index,
                                            prefix,
                                            None,
                                            usage_info=use,
                                            token_ids_field=False,
                                        )
                                    )
                                )
                delta, ids, positions = self._apply(sub, out, req)
                if sub.done:
                    pending -= 1
                if sub.finish_reason == "error":
                    await resp.write(P.sse_error(P.internal_error()))
                    break
                finish = sub.finish_reason if sub.done else None
                fp = self.fingerprint if finish is not None and not include_usage else None
                if chat:
                    use = P.continuous_usage(num_prompt, len(sub.token_ids), chat=True) if continuous else None
                    lp = (
                        chat_logprobs(ids, positions, req.top_logprobs, as_token_id=req.return_tokens_as_token_ids)
                        if want_logprobs
                        else None
                    )
                    chunk = P.chat_chunk(
                        request_id,
                        created,
                        model,
                        sub.index,
                        delta,
                        finish,
                        token_ids=ids if req.return_token_ids else None,
                        fingerprint=fp,
                        usage_info=use,
                        logprobs=lp,
                    )
                else:
                    text = delta
                    prompt_ids = None
                    echo_now = False
                    if sub.index not in sent_prompt_ids and (req.echo or req.return_token_ids):
                        # The first chunk of a choice carries its prompt's ids when echoing or returning token ids.
                        sent_prompt_ids.add(sub.index)
                        prompt_ids = sub.prompt_ids
                        if req.echo:
                            echo_now = True
                            if not req.return_token_ids:
                                text = (
                                    sub.prompt_text
                                    if sub.prompt_text is not None
                                    else self.tokenizer.decode(sub.prompt_ids)
                                ) + delta
                    use = P.continuous_usage(prompt_lens[sub.prompt_idx], len(sub.token_ids)) if continuous else None
                    chunk = P.completion_chunk(
                        request_id,
                        created,
                        model,
                        sub.index,
                        text,
                        finish,
                        token_ids=ids if req.return_token_ids else None,
                        prompt_token_ids=prompt_ids,
                        fingerprint=fp,
                        usage_info=use,
                        logprobs=self._completion_logprobs(req, sub, ids, positions, prompt_cache, echo_now),
                    )
                await resp.write(P.sse(chunk))
            else:
                if include_usage:
                    completion_tokens = sum(len(s.token_ids) for s in subs)
                    use = P.usage(
                        num_prompt,
                        completion_tokens,
                        cached,
                        details=self.config.enable_prompt_tokens_details,
                        drop_none=True,
                        created_cache_tokens=created_cache if chat else None,
                    )
                    final = (P.chat_usage_chunk if chat else P.completion_usage_chunk)(
                        request_id, created, model, use, self.fingerprint
                    )
                    await resp.write(P.sse(final))
            await resp.write(P.SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.debug("client of %s went away mid-stream", request_id)
        return resp


async def _response_headers(request: web.Request, response: web.StreamResponse) -> None:
    # vLLM runs under uvicorn; a client that looks at the Server header sees the same. Starlette's CORSMiddleware
    # (no allowed origins) adds `Vary: Origin` to every response but a preflight's.
    headers = response.headers
    headers["Server"] = "uvicorn"
    headers.setdefault("Vary", "Origin")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=P.dumps(body).encode(), status=status, content_type="application/json", headers=headers)


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
    except P.APIError as exc:
        return _json(exc.body(), exc.code)
    except web.HTTPException as exc:
        if exc.status >= 400:
            # Starlette's HTTPException through vLLM's handler: the phrase is both message and type.
            return _json(P.error_body(exc.reason, exc.reason, exc.status), exc.status)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _json(P.error_body(str(exc), "InternalServerError", 500), 500)


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
