"""The simulated engine's generation path, as vLLM's serving.py: a request parsed, rendered and checked in vLLM's
order, submitted to a rank, its engine outputs folded per choice and written as one body or a stream. What differs
between chat and completions (parsing, prompts, the shapes written) is in serving_chat.py and serving_completion.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from aiohttp import web

from .core import RequestOutput
from .logprobs import Position
from .openai.errors import APIError, JsonDict, internal_error, model_not_found, service_unavailable, validation_error
from .openai.requests import GenerateRequest, parse_json_body
from .openai.responses import SSE_DONE, dumps, random_uuid, sse, sse_error, usage
from .openai.validation import (
    SAMPLING_EPS,
    check_engine_input,
    check_max_tokens,
    check_prompt_length,
    check_sampling,
    effective_max_tokens,
)
from .request import SimRequest
from .runner import RankRunner, RequestHandle
from .tokenizer import ChatTemplateError, IncrementalDetokenizer

if TYPE_CHECKING:
    from .server import SimServer

log = logging.getLogger(__name__)

DP_RANK_HEADER = "X-data-parallel-rank"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# One prompt as the renderer hands it over: a text or token ids, with its text when it has one.
PromptItem = tuple[str | list[int], str | None]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(body).encode(), status=status, content_type="application/json", headers=headers)


@dataclass(slots=True)
class SubRequest:
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


@dataclass(slots=True)
class Generation:
    """One HTTP generation request in flight: its sub-requests and the queue their engine outputs arrive on."""

    req: GenerateRequest
    request_id: str
    created: int
    subs: list[SubRequest]
    by_id: dict[str, SubRequest]
    queue: asyncio.Queue[RequestOutput]
    num_prompt_tokens: int = 0  # each prompt of the batch once, whatever n is
    prompt_sent: set[int] = field(default_factory=set)  # streamed choices whose first chunk carried the prompt
    prompt_cache: dict[int, list[Position | None]] = field(default_factory=dict)  # prompt logprobs per prompt


@dataclass(slots=True)
class Delta:
    """What one engine output added to a sub-request, for the chunk that carries it."""

    sub: SubRequest
    text: str
    token_ids: list[int]
    positions: list[Position]  # logprob positions of the new tokens (empty without logprobs)
    finish_reason: str | None  # set on the sub-request's last chunk
    fingerprint: str | None  # the last chunk's system_fingerprint, unless a usage chunk follows


class OpenAIServing:
    """What vLLM's OpenAIServing gives its endpoints over one server: the model check and chat rendering."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.config = server.config
        self.tokenizer = server.tokenizer
        self.served_name = server.served_name
        self.max_model_len = server.max_model_len

    def check_model(self, model: str | None) -> None:
        if model and model != self.served_name:
            raise model_not_found(model, [self.served_name])

    def render_chat(
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
            raise validation_error("Cannot apply chat template to an empty conversation. Provide at least one message.")
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
            raise validation_error(str(exc)) from exc
        except Exception as exc:
            # So does it any other failure of the template on the request's data (safe_apply_chat_template).
            log.warning("Chat template rejected the request: %s", exc)
            raise validation_error(str(exc)) from exc


class GenerationServing(OpenAIServing):
    """The path shared by /v1/chat/completions and /v1/completions. Subclasses say how a request parses and renders
    and which bodies and chunks it answers with."""

    kind: ClassVar[Literal["completion", "chat"]]
    id_prefix: ClassVar[str]  # vLLM's request-id prefix ("chatcmpl", "cmpl")
    reports_created_cache: ClassVar[bool] = False  # the final streamed usage has created_cache_tokens

    def __init__(self, server: SimServer) -> None:
        super().__init__(server)
        self.logprobs = server.logprobs
        self.fingerprint = server.fingerprint

    # ---- what a kind decides -----------------------------------------------------------------------------------------
    def parse(self, body: Any) -> GenerateRequest:
        raise NotImplementedError

    def prompt_items(self, req: GenerateRequest) -> list[PromptItem]:
        """The request's prompts before tokenizing."""
        raise NotImplementedError

    def check_text(self, req: GenerateRequest, text: str) -> None:
        """A text prompt's check before tokenizing (none by default)."""

    def engine_request_id(self, request_id: str, sub: SubRequest, num_subs: int) -> str:
        return f"{request_id}-{sub.index}"

    def opening_chunks(self, g: Generation, continuous: bool) -> list[JsonDict]:
        """Chunks a stream starts with once the engine has answered (none by default)."""
        return []

    def chunk(self, g: Generation, d: Delta, continuous: bool) -> JsonDict:
        raise NotImplementedError

    def usage_chunk(self, g: Generation, usage_info: JsonDict) -> JsonDict:
        raise NotImplementedError

    def response(self, g: Generation) -> JsonDict:
        """The non-streaming body once every sub-request has finished."""
        raise NotImplementedError

    # ---- the shared path -------------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        engine = server.engine
        assert engine is not None
        verdict = engine.faults.admit()
        if verdict == "crash":
            server.crash()
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        if verdict == "hang":
            engine.stall()
            await asyncio.Event().wait()
        if not engine.faults.ready():
            raise service_unavailable("The server is starting up; please try again later.")
        raw = await server.read_body(request)
        req = self.parse(parse_json_body(raw, request.headers.get("Content-Type")))
        self.check_model(req.model)
        # vLLM's order: the renderer (output budget, then each prompt rendered and length-checked), the sampling
        # parameters of each prompt (its max_tokens clamped to the context), then the engine's input checks.
        check_max_tokens(req, self.max_model_len)
        prompts = self.prompts(req)
        rank = self.pick_rank(request)
        budgets = []
        for ids, _ in prompts:
            budget = effective_max_tokens(req, len(ids), self.max_model_len)
            check_sampling(req, budget)
            budgets.append(budget)
        if verdict == "fail":
            raise internal_error()
        engine_error: APIError | None = None
        try:
            for ids, _ in prompts:
                check_engine_input(req, ids, self.max_model_len, self.tokenizer.vocab_size)
        except APIError as exc:
            if not req.stream:
                raise
            engine_error = exc  # vLLM meets it in the engine, after the stream started: an error event
        base = request.headers.get("X-Request-Id") or req.request_id or random_uuid()
        request_id = f"{self.id_prefix}-{base}"
        if engine_error is not None:
            return await stream_error(request, engine_error)
        subs: list[SubRequest] = []
        n = req.sampling.n
        for p_idx, ((ids, text), max_tokens) in enumerate(zip(prompts, budgets, strict=True)):
            for j in range(n):
                subs.append(SubRequest(p_idx * n + j, p_idx, ids, text, max_tokens, rank))
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        by_id: dict[str, SubRequest] = {}
        try:
            for sub in subs:
                self._submit(req, request_id, sub, len(subs), rank, queue, by_id)
            num_prompt = sum(len(ids) for ids in {s.prompt_idx: s.prompt_ids for s in subs}.values())
            g = Generation(req, request_id, int(time.time()), subs, by_id, queue, num_prompt)
            if req.stream:
                return await self.stream(request, g)
            return json_response(await self.collect(g))
        finally:
            for sub in subs:
                if sub.handle is not None and not sub.handle.finished:
                    rank.abort(sub.handle.req.request_id)

    def _submit(
        self,
        req: GenerateRequest,
        request_id: str,
        sub: SubRequest,
        num_subs: int,
        rank: RankRunner,
        queue: asyncio.Queue[RequestOutput],
        by_id: dict[str, SubRequest],
    ) -> None:
        engine_rid = self.engine_request_id(request_id, sub, num_subs)
        while engine_rid in rank.handles or engine_rid in rank.core.requests or engine_rid in rank.core.leases:
            engine_rid = f"{engine_rid}-{random_uuid()[:8]}"
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
            raise validation_error(str(exc)) from exc
        sub.detok = IncrementalDetokenizer(self.tokenizer, req.skip_special_tokens)
        by_id[engine_rid] = sub

    def prompts(self, req: GenerateRequest) -> list[tuple[list[int], str | None]]:
        """The request's prompts as the renderer makes them: (token ids, text) each, length-checked."""
        max_len = self.max_model_len
        out = []
        for prompt, text in self.prompt_items(req):
            from_text = isinstance(prompt, str)
            if isinstance(prompt, str):
                self.check_text(req, prompt)
                ids = self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
            else:
                ids = prompt
            if req.truncate_prompt_tokens is not None:
                # vLLM truncates a generation prompt from the left (its tokenizers' truncation_side): the last
                # `keep` tokens stay, the context nearest the answer; -1 keeps what max_model_len leaves one token.
                keep = max_len - 1 if req.truncate_prompt_tokens < 0 else req.truncate_prompt_tokens
                if keep < len(ids):
                    ids = ids[len(ids) - keep :]
            check_prompt_length(ids, max_len, from_text=from_text)
            out.append((ids, text))
        return out

    def pick_rank(self, request: web.Request) -> RankRunner:
        engine = self.server.engine
        assert engine is not None
        header = request.headers.get(DP_RANK_HEADER)
        rank: int | None = None
        if header is not None:
            with contextlib.suppress(ValueError):
                rank = int(header)  # vLLM ignores a header that is not an int
        n = len(self.server.ranks)
        if rank is not None and not 0 <= rank < n:
            raise validation_error(f"data_parallel_rank {rank} is out of range [0, {n}).")
        return engine.pick(rank)

    def apply(self, sub: SubRequest, out: RequestOutput, req: GenerateRequest) -> tuple[str, list[int], list[Position]]:
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
            greedy = req.sampling.temperature < SAMPLING_EPS
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

    def prompt_positions(self, g: Generation, sub: SubRequest) -> list[Position | None]:
        """The synthetic prompt logprobs of a sub-request's prompt (once per prompt)."""
        got = g.prompt_cache.get(sub.prompt_idx)
        if got is None:
            num = g.req.sampling.prompt_logprobs
            got = g.prompt_cache[sub.prompt_idx] = self.logprobs.prompt_positions(
                sub.prompt_ids, 0 if num is None else num
            )
        return got

    async def collect(self, g: Generation) -> JsonDict:
        pending = len(g.subs)
        while pending:
            out = await g.queue.get()
            sub = g.by_id.get(out.request_id)
            if sub is None or sub.done:
                continue
            self.apply(sub, out, g.req)
            if sub.done:
                pending -= 1
        if any(s.finish_reason == "error" for s in g.subs):
            raise internal_error()
        return self.response(g)

    async def stream(self, request: web.Request, g: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CONTENT_TYPE})
        await resp.prepare(request)
        req = g.req
        include_usage = req.include_usage or self.config.enable_force_include_usage
        continuous = req.continuous_usage or self.config.enable_force_include_usage
        first = True
        cached: int | None = None
        created_cache: int | None = None
        pending = len(g.subs)
        try:
            while pending:
                out = await g.queue.get()
                sub = g.by_id.get(out.request_id)
                if sub is None or sub.done:
                    continue
                if first:
                    cached = max(out.num_cached_tokens, 0)
                    created_cache = out.num_cache_creation_tokens
                    first = False
                    for opening in self.opening_chunks(g, continuous):
                        await resp.write(sse(opening))
                delta, ids, positions = self.apply(sub, out, req)
                if sub.done:
                    pending -= 1
                if sub.finish_reason == "error":
                    await resp.write(sse_error(internal_error()))
                    break
                finish = sub.finish_reason if sub.done else None
                fp = self.fingerprint if finish is not None and not include_usage else None
                await resp.write(sse(self.chunk(g, Delta(sub, delta, ids, positions, finish, fp), continuous)))
            else:
                if include_usage:
                    use = usage(
                        g.num_prompt_tokens,
                        sum(len(s.token_ids) for s in g.subs),
                        cached,
                        details=self.config.enable_prompt_tokens_details,
                        drop_none=True,
                        created_cache_tokens=created_cache if self.reports_created_cache else None,
                    )
                    await resp.write(sse(self.usage_chunk(g, use)))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.debug("client of %s went away mid-stream", g.request_id)
        return resp


async def stream_error(request: web.Request, error: APIError) -> web.StreamResponse:
    """A stream whose request the engine refused: 200, one error event, [DONE] (vLLM's stream generators)."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CONTENT_TYPE})
    await resp.prepare(request)
    try:
        await resp.write(sse_error(error))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    return resp
