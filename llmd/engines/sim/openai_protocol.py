"""vLLM 0.32's OpenAI wire format for the simulated engine: request parsing and validation, response and chunk
building, error bodies. Pure: no sockets, no clocks except `created`.

Shapes follow vllm/entrypoints/openai/{completion,chat_completion}/protocol.py and serving.py, errors
vllm/entrypoints/serve/exception_handling/ (error_response.py, handlers/validation.py). vLLM builds its bodies with
pydantic: non-streaming responses are `model_dump()` (every field, None included), streamed chunks are
`model_dump_json(exclude_unset=True)` (only the fields the server set) and the final usage chunk drops None fields.
The builders below reproduce those field sets and orders as plain dicts.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

VLLM_VERSION = "0.32.0"
# Parameters of vLLM's SamplingParams/completion defaults that the sim honours; anything else is accepted and ignored
# (OpenAIBaseModel has extra="allow"), as vLLM ignores fields it does not know.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_MAX_CACHE_SALT_LEN = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"

JsonDict = dict[str, Any]


def random_uuid() -> str:
    """vLLM's request-id suffix: 16 hex characters (vllm/utils/__init__.py)."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def dumps(obj: Any) -> str:
    """JSON as vLLM sends it: starlette's JSONResponse and pydantic's model_dump_json are compact and keep UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---- errors --------------------------------------------------------------------------------------------------------

_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize_message(message: str) -> str:
    """vLLM strips addresses, tracebacks and file paths from every error message it returns."""
    for pattern, repl in _SANITIZE:
        message = pattern.sub(repl, message)
    return message.strip()


class APIError(Exception):
    """An error answered as vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param

    def body(self) -> JsonDict:
        return error_body(self.message, self.err_type, self.code, self.param)


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None) -> JsonDict:
    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": code}}


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> APIError:
    """vLLM's VLLMValidationError: 400 BadRequestError whose message carries `(parameter=..., value=...)`."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return APIError(text, "BadRequestError", 400, parameter)


def model_not_found(model: str, served_names: Sequence[str]) -> APIError:
    # vllm/entrypoints/serve/engine/serving.py BaseServing._check_model
    return APIError(
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served_names)}.", "NotFoundError", 404, "model"
    )


def internal_error(message: str = "Internal server error") -> APIError:
    """vLLM's GenerationError (finish_reason "error", e.g. a failed KV load): 500 InternalServerError."""
    return APIError(message, "InternalServerError", 500)


def service_unavailable(message: str) -> APIError:
    """vLLM's GracefulHTTPError with 503 (QueueOverflowError and friends): type is the HTTP phrase."""
    return APIError(message, "Service Unavailable", 503)


def _summarize_input(value: Any) -> Any:
    # vllm handlers/validation.py _summarize_error_input: containers are described, long text truncated.
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def request_validation_error(errors: Sequence[JsonDict | str]) -> APIError:
    """FastAPI's RequestValidationError as vLLM renders it: type "Bad Request", param the first error's location."""
    param = None
    lines = []
    for err in errors[:10]:
        if isinstance(err, dict):
            shown = dict(err)
            loc = shown.get("loc")
            if isinstance(loc, tuple | list):
                shown["loc"] = ".".join(str(p) for p in loc)
            if "input" in shown:
                shown["input"] = _summarize_input(shown["input"])
            text = str(shown)
            lines.append(text if len(text) <= 1000 else text[:1000] + "...[truncated]")
        else:
            lines.append(str(err))
    first = errors[0] if errors else None
    if isinstance(first, dict) and first.get("loc"):
        param = ".".join(str(p) for p in first["loc"])
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    return APIError(message.rstrip(), "Bad Request", 400, param)


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """The request body as FastAPI + vLLM's validate_json_request see it; APIError(400) when it is not JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    parses = not media or media == "application/json" or media.endswith("+json")
    if parses:
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "Invalid UTF-8"
            raise request_validation_error(
                [
                    {
                        "type": "json_invalid",
                        "loc": ("body", pos),
                        "msg": "JSON decode error",
                        "input": {},
                        "ctx": {"error": msg},
                    }
                ]
            ) from None
    if media != "application/json":
        raise request_validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    if body is None:
        raise request_validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    return body


# ---- field validation with pydantic's lax rules and messages -------------------------------------------------------

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class _Fields:
    """Reads typed fields out of a JSON object, collecting pydantic-style errors instead of stopping at the first."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.errors: list[JsonDict] = []

    def _err(self, kind: str, loc: tuple, msg: str, value: Any, ctx: JsonDict | None = None) -> None:
        err = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
        if ctx:
            err["ctx"] = ctx
        self.errors.append(err)

    def _int(self, value: Any, loc: tuple) -> int | None:
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if value.is_integer():
                return int(value)
            self._err(
                "int_from_float", loc, "Input should be a valid integer, got a number with a fractional part", value
            )
            return None
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                self._err(
                    "int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", value
                )
                return None
        self._err("int_type", loc, "Input should be a valid integer", value)
        return None

    def _float(self, value: Any, loc: tuple) -> float | None:
        if isinstance(value, bool | int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                self._err(
                    "float_parsing", loc, "Input should be a valid number, unable to parse string as a number", value
                )
                return None
        self._err("float_type", loc, "Input should be a valid number", value)
        return None

    def _bool(self, value: Any, loc: tuple) -> bool | None:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            self._err("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value)
            return None
        self._err("bool_type", loc, "Input should be a valid boolean", value)
        return None

    def get(self, name: str, kind: str, default: Any = None, *, nullable: bool = True, ge: int | None = None) -> Any:
        if name not in self.data:
            return default
        value = self.data[name]
        loc = (name,)
        if value is None:
            if nullable:
                return default if kind == "list" else None
            self._err(f"{kind}_type", loc, _TYPE_MSG[kind], value)
            return default
        out: Any
        if kind == "int":
            out = self._int(value, loc)
        elif kind == "float":
            out = self._float(value, loc)
        elif kind == "bool":
            out = self._bool(value, loc)
        elif kind == "string":
            out = value if isinstance(value, str) else None
            if out is None:
                self._err("string_type", loc, "Input should be a valid string", value)
        elif kind == "dict":
            out = value if isinstance(value, dict) else None
            if out is None:
                self._err("dict_type", loc, "Input should be a valid dictionary", value)
        elif kind == "list":
            out = value if isinstance(value, list) else None
            if out is None:
                self._err("list_type", loc, "Input should be a valid list", value)
        else:  # pragma: no cover - programming error
            raise ValueError(kind)
        if out is None:
            return default
        if ge is not None and out < ge:
            self._err("greater_than_equal", loc, f"Input should be greater than or equal to {ge}", value, {"ge": ge})
            return default
        return out

    def int_list(self, name: str) -> list[int] | None:
        values = self.get(name, "list")
        if values is None:
            return None
        out = []
        for i, v in enumerate(values):
            n = self._int(v, (name, i))
            if n is not None:
                out.append(n)
        return out

    def raise_if_any(self) -> None:
        if self.errors:
            raise request_validation_error(self.errors)


_TYPE_MSG = {
    "int": "Input should be a valid integer",
    "float": "Input should be a valid number",
    "bool": "Input should be a valid boolean",
    "string": "Input should be a valid string",
    "dict": "Input should be a valid dictionary",
    "list": "Input should be a valid list",
}


# ---- parsed requests -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SamplingOptions:
    """What the simulated sampler honours. `max_tokens` None means "up to max_model_len"."""

    max_tokens: int | None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    max_tokens_param: str = "max_tokens"


@dataclass(slots=True)
class GenerateRequest:
    """A parsed /v1/completions or /v1/chat/completions request."""

    kind: Literal["completion", "chat"]
    model: str | None
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    kv_transfer_params: JsonDict | None = None
    request_id: str | None = None
    priority: int = 0
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    # completions: each entry a text or a token-id list; chat: empty
    prompts: list[str | list[int]] = field(default_factory=list)
    # chat only
    messages: list[JsonDict] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: JsonDict = field(default_factory=dict)
    tools: list[JsonDict] | None = None
    documents: list[JsonDict] | None = None
    return_prompt_text: bool = False


def _validate_cache_salt(value: Any) -> None:
    # vllm/entrypoints/generate/base/protocol.py validate_cache_salt
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise validation_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(value) > _MAX_CACHE_SALT_LEN or any(c in _CACHE_SALT_FORBIDDEN for c in value):
        raise validation_error(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise request_validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    return body


def _common(f: _Fields, body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> GenerateRequest:
    # Before-validators of both request models (they raise before any field is type-checked).
    _validate_cache_salt(body.get("cache_salt"))
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error("Stream options can only be defined when `stream=True`.", "stream_options")
    model = f.get("model", "string")
    stream = bool(f.get("stream", "bool", False))
    stream_options = f.get("stream_options", "dict")
    include_usage = continuous = False
    if stream_options is not None:
        so = _Fields(stream_options)
        include_usage = bool(so.get("include_usage", "bool", False))
        continuous = include_usage and bool(so.get("continuous_usage_stats", "bool", False))
        f.errors.extend({**e, "loc": ("body", "stream_options", *e["loc"][1:])} for e in so.errors)
    temperature = f.get("temperature", "float")
    top_p = f.get("top_p", "float")
    n = f.get("n", "int", 1, nullable=kind == "chat")
    seed = f.get("seed", "int")
    ignore_eos = f.get("ignore_eos", "bool", False, nullable=False)
    min_tokens = f.get("min_tokens", "int", 0, nullable=False)
    stop_token_ids = f.int_list("stop_token_ids") or []
    req = GenerateRequest(
        kind=kind,
        model=model,
        sampling=SamplingOptions(
            max_tokens=None,
            min_tokens=min_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            n=1 if n is None else n,
        ),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=bool(f.get("return_token_ids", "bool", False)),
        cache_salt=f.get("cache_salt", "string"),
        kv_transfer_params=f.get("kv_transfer_params", "dict"),
        request_id=f.get("request_id", "string"),
        priority=f.get("priority", "int", 0, nullable=False),
        skip_special_tokens=f.get("skip_special_tokens", "bool", True, nullable=False),
        truncate_prompt_tokens=f.get("truncate_prompt_tokens", "int", ge=-1),
    )
    return req


def parse_completion_request(body: Any) -> GenerateRequest:
    data = _require_object(body)
    prompt = data.get("prompt")
    if prompt is None or prompt == "":
        raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    f = _Fields(data)
    req = _common(f, data, "completion")
    max_tokens = f.get("max_tokens", "int")
    req.sampling.max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    req.echo = bool(f.get("echo", "bool", False))
    req.add_special_tokens = f.get("add_special_tokens", "bool", True, nullable=False)
    req.prompts = _parse_prompt(prompt, f)
    f.raise_if_any()
    return req


def _parse_prompt(prompt: Any, f: _Fields) -> list[str | list[int]]:
    # prompt: list[int] | list[list[int]] | str | list[str]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            bad = [i for i, p in enumerate(prompt) if p < 0]
            for i in bad:
                f._err(
                    "greater_than_equal",
                    ("prompt", i),
                    "Input should be greater than or equal to 0",
                    prompt[i],
                    {"ge": 0},
                )
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    if not isinstance(prompt, list):
        # pydantic reports every branch of the union, in the order of vLLM's annotation.
        for kind in ("list", "list", "string", "list"):
            f._err(f"{kind}_type", ("prompt",), _TYPE_MSG[kind], prompt)
    else:
        # Mixed lists: pydantic's per-branch, per-item errors are not reproduced; one error names the field.
        f._err("string_type", ("prompt",), "Input should be a valid string", prompt)
    return []


def parse_chat_request(body: Any, *, trust_request_chat_template: bool = False) -> GenerateRequest:
    data = _require_object(body)
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if data.get("tools") == []:
        raise validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    f = _Fields(data)
    req = _common(f, data, "chat")
    if "messages" not in data:
        f._err("missing", ("messages",), "Field required", data)
    messages = f.get("messages", "list", nullable=False) or []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            f._err("missing", ("messages", i, "role"), "Field required", m)
    max_completion = f.get("max_completion_tokens", "int")
    max_tokens = f.get("max_tokens", "int")
    if max_completion is not None:
        req.sampling.max_tokens, req.sampling.max_tokens_param = max_completion, "max_completion_tokens"
    else:
        req.sampling.max_tokens = max_tokens
    req.echo = bool(f.get("echo", "bool", False, nullable=False))
    req.add_generation_prompt = f.get("add_generation_prompt", "bool", True, nullable=False)
    req.continue_final_message = f.get("continue_final_message", "bool", False, nullable=False)
    req.add_special_tokens = f.get("add_special_tokens", "bool", False, nullable=False)
    req.chat_template = f.get("chat_template", "string")
    req.chat_template_kwargs = f.get("chat_template_kwargs", "dict") or {}
    req.tools = f.get("tools", "list")
    req.documents = f.get("documents", "list")
    req.return_prompt_text = bool(f.get("return_prompt_text", "bool", False))
    f.raise_if_any()
    if not trust_request_chat_template and (
        req.chat_template is not None or req.chat_template_kwargs.get("chat_template") is not None
    ):
        raise APIError(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template."
        )
    req.messages = conversation(messages)
    return req


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            return part["text"]
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            return part["refusal"]
    return None


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[JsonDict]:
    """OpenAI messages -> the conversation vLLM hands the chat template (vllm/renderers/chat_utils.py).

    Text parts are joined with "\\n" (the "string" content format of text-only templates), `name` is dropped, Claude
    Code's per-request billing header line is cut from system text (it would break the prefix cache), assistant
    tool-call arguments become dicts, tool messages keep their tool_call_id.
    """
    out: list[JsonDict] = []
    for m in messages:
        role = m["role"]
        content = m.get("content")
        parts: list[Any] = [] if content is None else [content] if isinstance(content, str) else list(content)
        texts = []
        for part in parts:
            text = _part_text(part)
            if text is None:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise validation_error(f"Unsupported content part type {kind!r}: the simulated model is text-only.")
            if role == "system" and text.startswith(_CLAUDE_CODE_BILLING_HEADER):
                text = text.partition("\n")[2]
                if not text:
                    continue
            texts.append(text)
        msg: JsonDict = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            tool_calls = m.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                msg["tool_calls"] = [_tool_call(tc) for tc in tool_calls]
            reasoning = m.get("reasoning", m.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_call(item: Any) -> JsonDict:
    if not isinstance(item, dict):
        raise validation_error("assistant tool_calls entries must be objects.", "tool_calls")
    function = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise validation_error("chat completions only support assistant tool_calls of type 'function'.", "tool_calls")
    function = dict(function)
    args = function.get("arguments")
    if args and not isinstance(args, dict):
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args = None
    function["arguments"] = args if isinstance(args, dict) else {}
    return {**item, "function": function}


def check_max_tokens(req: GenerateRequest, max_model_len: int) -> None:
    """vLLM's TokenizeParams check, done before tokenizing: no output budget beyond the context length."""
    s = req.sampling
    if s.max_tokens is not None and s.max_tokens > max_model_len:
        raise validation_error(
            f"{s.max_tokens_param}={s.max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            s.max_tokens_param,
            s.max_tokens,
        )


def check_prompt(prompt_ids: Sequence[int], max_model_len: int, vocab_size: int, *, from_text: bool) -> None:
    """vLLM's prompt checks, in its order: length (renderer), vocabulary (renderer), emptiness and room for one
    output token (input processor)."""
    n = len(prompt_ids)
    if n > max_model_len:
        # vLLM tokenizes text with truncation at max_model_len + 1, so for text it only knows "at least" that many.
        shown = f"at least {max_model_len + 1}" if from_text else str(n)
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{shown} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            max_model_len + 1 if from_text else n,
        )
    if prompt_ids:
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0:
            raise validation_error(f"Token id {lo} is out of vocabulary")
        if hi > vocab_size - 1:
            raise validation_error(f"Token id {hi} is out of vocabulary")
    if n == 0:
        raise validation_error("The decoder prompt cannot be empty")
    if n == max_model_len:
        raise validation_error(
            f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer than "
            f"the maximum model length of {max_model_len}. Make sure that `max_model_len` is no smaller than the "
            "number of text tokens (prompt + requested output tokens)."
        )


def effective_max_tokens(req: GenerateRequest, prompt_len: int, max_model_len: int) -> int:
    """vLLM's get_max_tokens + SamplingParams checks: the request's budget clamped to the room left in the context."""
    s = req.sampling
    budget = max_model_len - prompt_len
    if s.max_tokens is not None:
        budget = min(budget, s.max_tokens)
    if budget < 1:
        raise validation_error(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
    if s.min_tokens > budget:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={budget}, got {s.min_tokens}.")
    return budget


def check_sampling(req: GenerateRequest) -> None:
    """SamplingParams._verify_args for the parameters the sim honours."""
    s = req.sampling
    if not 1 <= s.n <= 1024:
        raise validation_error(
            f"n must be at least 1, got {s.n}." if s.n < 1 else f"n must be at most 1024, got {s.n}."
        )
    t = s.temperature
    if t != t or t in (float("inf"), float("-inf")):
        raise validation_error(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise validation_error(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise validation_error(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < s.top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {s.top_p}.", "top_p", s.top_p)
    if s.min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.")


def parse_tokenize_request(body: Any) -> tuple[str | None, str | None, list[JsonDict] | None, JsonDict]:
    """/tokenize: (model, prompt, messages, options); prompt or messages, as vLLM's TokenizeRequest union."""
    data = _require_object(body)
    f = _Fields(data)
    model = f.get("model", "string")
    opts: JsonDict = {"return_token_strs": bool(f.get("return_token_strs", "bool", False))}
    if "messages" in data:
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        messages = f.get("messages", "list", nullable=False) or []
        opts["add_generation_prompt"] = f.get("add_generation_prompt", "bool", True, nullable=False)
        opts["continue_final_message"] = f.get("continue_final_message", "bool", False, nullable=False)
        opts["add_special_tokens"] = f.get("add_special_tokens", "bool", False, nullable=False)
        opts["chat_template_kwargs"] = f.get("chat_template_kwargs", "dict") or {}
        opts["tools"] = f.get("tools", "list")
        f.raise_if_any()
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise request_validation_error(
                    [{"type": "missing", "loc": ("body", "messages", i, "role"), "msg": "Field required", "input": m}]
                )
        return model, None, conversation(messages), opts
    if "prompt" not in data:
        raise request_validation_error(
            [{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required", "input": data}]
        )
    prompt = f.get("prompt", "string", nullable=False)
    opts["add_special_tokens"] = f.get("add_special_tokens", "bool", True, nullable=False)
    f.raise_if_any()
    return model, prompt, None, opts


def parse_detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    data = _require_object(body)
    f = _Fields(data)
    model = f.get("model", "string")
    if "tokens" not in data:
        f._err("missing", ("tokens",), "Field required", data)
    tokens = f.int_list("tokens") or []
    for i, t in enumerate(tokens):
        if t < 0:
            f._err("greater_than_equal", ("tokens", i), "Input should be greater than or equal to 0", t, {"ge": 0})
    f.raise_if_any()
    return model, tokens


# ---- responses -----------------------------------------------------------------------------------------------------


def system_fingerprint(config_hash: str, dp_size: int = 1) -> str:
    """vLLM's default ("full") fingerprint: vllm-<version>[-dpN]-<hash8> (vllm/entrypoints/serve/utils/
    fingerprint.py)."""
    parts = [f"vllm-{VLLM_VERSION}"]
    if dp_size > 1:
        parts.append(f"dp{dp_size}")
    parts.append(config_hash[:8])
    return "-".join(parts)


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None,
    *,
    details: bool,
    drop_none: bool = False,
) -> JsonDict:
    """UsageInfo. `details` mirrors --enable-prompt-tokens-details (prompt_tokens_details.cached_tokens);
    `drop_none` is the final streamed usage chunk (exclude_none=True)."""
    out: JsonDict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    if details and cached_tokens is not None:
        out["prompt_tokens_details"] = {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    if drop_none:
        out = {k: v for k, v in out.items() if v is not None}
        if "prompt_tokens_details" in out:
            out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def continuous_usage(prompt_tokens: int, completion_tokens: int, *, chat: bool = False) -> JsonDict:
    """Per-chunk usage (continuous_usage_stats): the three counts; chat also sets completion_tokens_details (None
    without a reasoning parser), which exclude_unset keeps."""
    out: JsonDict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if chat:
        out["completion_tokens_details"] = None
    return out


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    stop_reason: int | str | None = None,
) -> JsonDict:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def completion_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[JsonDict],
    usage_info: JsonDict,
    fingerprint: str | None,
    kv_transfer_params: JsonDict | None,
) -> JsonDict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_info,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    stop_reason: int | str | None = None,
    fingerprint: str | None = None,
    usage_info: JsonDict | None = None,
) -> JsonDict:
    chunk: JsonDict = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "prompt_token_ids": prompt_token_ids,
                "token_ids": token_ids,
            }
        ],
    }
    if usage_info is not None:
        chunk["usage"] = usage_info
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def completion_usage_chunk(
    request_id: str, created: int, model: str, usage_info: JsonDict, fingerprint: str | None
) -> JsonDict:
    # exclude_unset=False, exclude_none=True: the defaulted "object" is present, None fields are not.
    chunk: JsonDict = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": []}
    chunk["usage"] = usage_info
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def chat_message(role: str, content: str) -> JsonDict:
    # ChatMessage drops tool_calls when empty (its model_serializer).
    return {
        "role": role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


def chat_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[JsonDict],
    usage_info: JsonDict,
    fingerprint: str | None,
    kv_transfer_params: JsonDict | None,
    *,
    prompt_token_ids: list[int] | None = None,
    prompt_text: str | None = None,
) -> JsonDict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_info,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": prompt_text,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_choice(
    index: int, role: str, content: str, finish_reason: str | None, token_ids: list[int] | None
) -> JsonDict:
    return {
        "index": index,
        "message": chat_message(role, content),
        "logprobs": None,
        "finish_reason": finish_reason or "stop",
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": None,
    }


def chat_role_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    role: str,
    *,
    prompt_token_ids: list[int] | None,
    prompt_text: str | None,
    usage_info: JsonDict | None = None,
) -> JsonDict:
    chunk: JsonDict = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}],
    }
    if usage_info is not None:
        chunk["usage"] = usage_info
    chunk["prompt_token_ids"] = prompt_token_ids
    chunk["prompt_text"] = prompt_text
    return chunk


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    content: str,
    finish_reason: str | None,
    *,
    token_ids: list[int] | None = None,
    fingerprint: str | None = None,
    usage_info: JsonDict | None = None,
    token_ids_field: bool = True,
) -> JsonDict:
    choice: JsonDict = {"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    if token_ids_field:  # the echo chunk is built without it
        choice["token_ids"] = token_ids
    chunk: JsonDict = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage_info is not None:
        chunk["usage"] = usage_info
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def chat_usage_chunk(
    request_id: str, created: int, model: str, usage_info: JsonDict, fingerprint: str | None
) -> JsonDict:
    chunk: JsonDict = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    chunk["usage"] = usage_info
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


def sse(obj: JsonDict | str) -> bytes:
    """One server-sent event as vLLM frames it."""
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(err: APIError) -> bytes:
    """An error inside a started stream: vLLM json.dumps()es it with the default (spaced) separators."""
    return f"data: {json.dumps(err.body())}\n\n".encode()


def models_response(served_name: str, root: str, max_model_len: int, created: int | None = None) -> JsonDict:
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {
                "id": served_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{random_uuid()}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None = None) -> JsonDict:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def detokenize_response(prompt: str) -> JsonDict:
    return {"prompt": prompt}
