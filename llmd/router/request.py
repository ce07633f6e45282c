"""One client request at the router's edge: its OpenAI-style errors, its body's checks, and what it carries along.

The body is parsed once (msgspec); a prompt no engine could take is answered 400 here, before any routing.
"""

from __future__ import annotations

import hmac
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from aiohttp import web

from llmd.metrics.schema import pd_path_of
from llmd.net.limits import MAX_JSON_DEPTH, JSONTooDeep, check_depth
from llmd.router.core import Job
from llmd.router.scheduling import Decision

Kind = Literal["completion", "chat"]
SESSION_HEADER = "X-Session-Id"
json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


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
            body=json_encode(self.body()), status=self.status, content_type="application/json", headers=self.headers
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


@dataclass(slots=True)
class Prompt:
    """What routing needs from a request body."""

    block_hashes: Sequence[int] = ()
    num_tokens: int = 0
    text_hashes: Sequence[int] = ()
    fingerprint: str | None = None
    chars: int = 0  # prompt characters when num_tokens is an estimate from them (approximate)
    token_ids: Sequence[int] | None = None  # a text completion prompt's ids, as the engine would tokenize it


@dataclass(slots=True)
class RequestCtx:
    """A request on its way through the proxy: its body, its core `Job`, and what the recorder writes."""

    kind: Kind
    route: str  # the request path: the engine's path too
    raw: bytes
    body: dict[str, Any]
    request_id: str
    headers: dict[str, str]
    job: Job
    queue_s: float = 0.0
    # What the recorder writes: the last attempt's decision and response headers, first byte, a mid-stream error.
    decision: Decision | None = None
    out: dict[str, str] | None = None
    first_byte: float = 0.0
    error: str = ""
    text_chars: int = 0  # approximate: the prompt's characters, until the engine's prompt_tokens calibrate with them
    # The last attempt's KV transfer: tokens the serving pod was sent to pull (0: none), and its leg's seconds from
    # being sent to its first output (streamed responses only: an unstreamed body's first byte is its last).
    transfer_tokens: int = 0
    serving_first_s: float = math.nan


def check_content_type(content_type: str | None) -> None:
    """vLLM's validate_json_request: any media type but application/json is a 400 with this very message."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed")


def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    try:
        body = _json_decode(raw)
        check_depth(raw, body, max_depth)
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except (RecursionError, JSONTooDeep):
        # msgspec stops at the interpreter's recursion limit; check_depth at ours, far below it.
        raise bad_request(f"the request body nests JSON arrays and objects deeper than {max_depth} levels") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("'stream' must be a boolean", "stream")
    return body


def prompt_source(kind: Kind, body: dict[str, Any]) -> Any:
    """The messages or the prompt routing reads (a batch: its first prompt); 400 for a shape no engine could take."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("'messages' must be a non-empty list of message objects", "messages")
        for i, m in enumerate(messages):
            check_message(m, i)
        return messages
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise bad_request("'prompt' must be a string, a list of strings or a list of token ids", "prompt")


def with_token_ids(kind: Kind, body: dict[str, Any], ids: Sequence[int] | None) -> dict[str, Any] | None:
    """The body to send the engine in place of the client's: its text prompt replaced by the token ids the router
    computed for routing (exactly the engine's own tokenization, llmd.tokens), so the engine does not tokenize the
    prompt again (~0.4 s of an API server's CPU for a fresh 195K-token context). None where the ids cannot stand in:
    a chat (vLLM's chat API takes messages only), a batch of prompts (the router tokenizes the first), echo (the
    engine would answer with the ids decoded, which need not be the client's text) and truncate_prompt_tokens
    (vLLM versions cut text and token prompts from different ends)."""
    if kind != "completion" or ids is None or not isinstance(body.get("prompt"), str):
        return None
    if body.get("echo") or body.get("truncate_prompt_tokens") is not None:
        return None
    return {**body, "prompt": ids.tolist() if isinstance(ids, array) else list(ids)}


def check_message(m: dict[str, Any], i: int) -> None:
    """400 naming the field for a message no engine takes: every member of vLLM's ChatCompletionMessageParam needs a
    string role, and content that is a string, a list of content-part objects, or null (assistant). Checked here
    because the tokenizer and the chat template behind the router would fail on these with TypeErrors."""
    if not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}].role must be a string", f"messages.{i}.role")
    content = m.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(
            f"messages[{i}].content must be a string or a list of content parts, got {_json_type(content)}",
            f"messages.{i}.content",
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(
                f"messages[{i}].content[{j}] must be a content part object, got {_json_type(part)}",
                f"messages.{i}.content.{j}",
            )
        if part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}].content[{j}].text must be a string", f"messages.{i}.content.{j}.text")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(v), type(v).__name__)


def max_tokens(body: dict[str, Any]) -> int:
    """The output the request asks for at most (OpenAI's max_completion_tokens or max_tokens; 0 when not given)."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def text_of(source: Any) -> str:
    """The text the approximate scorer chunks: the prompt, or the messages' roles and contents in order."""
    if isinstance(source, str):
        return source
    if source and isinstance(source[0], int):
        return " ".join(map(str, source))
    parts = []
    for m in source:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
        parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def check_key(request: web.Request, key: str) -> None:
    """401 unless the request carries `Authorization: Bearer <key>`."""
    got = request.headers.get("Authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        err = APIError(
            401,
            "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
            "AuthenticationError",
            code="invalid_api_key",
        )
        err.headers["WWW-Authenticate"] = "Bearer"
        raise err


def recorder_row(
    ctx: RequestCtx | None,
    session: str | None,
    send_time: float,
    t0: float,
    now: float,
    status: int,
    error: str,
    kv_bytes: Callable[[int], float] | None = None,
) -> tuple[dict[str, Any], int, int]:
    """The router recorder's row for a finished request (any status), and the chosen pod's predicted GPU and CPU hit
    tokens; `session`: the request's session header; `kv_bytes`: the serving pool's KV bytes of so many tokens
    (LatencyModel.kv_transfer_bytes; None: the model's geometry is unknown)."""
    row: dict[str, Any] = {"send_time": send_time, "e2e_s": now - t0, "status": status}
    gpu = cpu = 0
    if ctx is not None:
        user = ctx.body.get("user")
        row["request_id"] = ctx.request_id
        row["session"] = session or (user if isinstance(user, str) else "")
        row["router_queue_s"] = ctx.queue_s
        if ctx.job.req.num_tokens:
            row["input_tokens"] = ctx.job.req.num_tokens
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
            tokens = ctx.transfer_tokens
            row["kv_transfer_tokens"] = tokens
            if not tokens:
                row["kv_transfer_bytes"], row["kv_transfer_s"] = 0, 0.0
            else:
                if kv_bytes is not None:
                    row["kv_transfer_bytes"] = round(kv_bytes(tokens))
                # What the router can see of the handoff: the serving leg until its first output, the pull within.
                row["kv_transfer_s"] = ctx.serving_first_s
    if error:
        row["error"] = error
    return row, gpu, cpu
