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

from llmd.tokens.chat import ChatMessageError, normalize_messages

VLLM_VERSION = "0.32.0"
# Parameters of vLLM's SamplingParams/completion defaults that the sim honours; anything else is accepted and ignored
# (OpenAIBaseModel has extra="allow"), as vLLM ignores fields it does not know.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_MAX_CACHE_SALT_LEN = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")

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
    logprobs: int | None = None  # SamplingParams.logprobs: top-k per sampled token (None: no logprobs)
    prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs (None: none)


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
    top_logprobs: int = 0  # chat: how many alternatives each logprobs entry lists
    return_tokens_as_token_ids: bool = False


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


def _check_stream_options(body: Mapping[str, Any]) -> None:
    if body.get("stream_options") and not body.get("stream"):
        raise validation_error("Stream options can only be defined when `stream=True`.", "stream_options")


def _check_logprobs(body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> None:
    """The request models' check_logprobs before-validators (on the raw JSON, before any field is typed)."""
    top_name = "logprobs" if kind == "completion" else "top_logprobs"
    if "prompt_logprobs" not in body and top_name not in body:
        return
    for name in ("prompt_logprobs", top_name):
        value = body.get(name)
        if value is not None and not isinstance(value, int | float):
            raise validation_error(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise validation_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise validation_error(
                "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt_logprobs
            )
    top = body.get(top_name)
    if top is not None and top < 0 and top != -1:
        raise validation_error(f"`{top_name}` must be a positive value or -1.", top_name, top)
    if kind == "chat" and top is not None and (top == -1 or top > 0) and not body.get("logprobs"):
        raise validation_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def _before_validators(body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> None:
    """The request models' before-validators, in the order pydantic runs them (the last defined first)."""
    if kind == "completion":
        _check_stream_options(body)
        _check_logprobs(body, kind)
    else:
        _check_logprobs(body, kind)
        _check_stream_options(body)
    _validate_cache_salt(body.get("cache_salt"))


def _common(f: _Fields, body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> GenerateRequest:
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
        return_tokens_as_token_ids=bool(f.get("return_tokens_as_token_ids", "bool", False)),
    )
    req.sampling.prompt_logprobs = f.get("prompt_logprobs", "int")
    return req


def parse_completion_request(body: Any) -> GenerateRequest:
    data = _require_object(body)
    prompt = data.get("prompt")
    if prompt is None or prompt == "":
        raise validation_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    _before_validators(data, "completion")
    f = _Fields(data)
    req = _common(f, data, "completion")
    max_tokens = f.get("max_tokens", "int")
    req.sampling.max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    req.echo = bool(f.get("echo", "bool", False))
    s = req.sampling
    s.logprobs = f.get("logprobs", "int")
    if s.prompt_logprobs is None and req.echo:
        s.prompt_logprobs = s.logprobs
    req.add_special_tokens = f.get("add_special_tokens", "bool", True, nullable=False)
    req.prompts = _parse_prompt(prompt, f)
    f.raise_if_any()
    return req


def _strict_token_ids(items: Any) -> bool:
    return isinstance(items, list) and set(map(type, items)) <= {int} and (not items or min(items) >= 0)


def _lax_token_ids(items: list[Any], loc: tuple, errs: list[JsonDict]) -> list[int]:
    """`list[Annotated[int, Field(ge=0)]]` in pydantic's lax mode: each id coerced or reported."""
    f = _Fields({})
    out = []
    for i, t in enumerate(items):
        n = f._int(t, (*loc, i))
        if n is not None:
            if n < 0:
                f._err("greater_than_equal", (*loc, i), "Input should be greater than or equal to 0", t, {"ge": 0})
            else:
                out.append(n)
    errs.extend({**e, "loc": e["loc"][1:]} for e in f.errors)  # _Fields puts "body" first; the caller does too
    return out


def _parse_prompt(prompt: Any, f: _Fields) -> list[str | list[int]]:
    """`prompt: list[int >= 0] | list[list[int >= 0]] | str | list[str] | None` as pydantic's smart union takes it:
    the first member the value fits exactly, else the first it fits after coercion, else every member's errors."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        for kind in ("list", "list", "string", "list"):
            f._err(f"{kind}_type", ("prompt",), _TYPE_MSG[kind], prompt)
        return []
    if not prompt:
        return []  # vLLM: a list of no prompts ("You must pass at least one prompt")
    if _strict_token_ids(prompt):
        return [list(prompt)]
    if all(_strict_token_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    # Lax: ids may come as integral floats, numeric strings or booleans.
    ids_errs: list[JsonDict] = []
    ids = _lax_token_ids(prompt, ("prompt",), ids_errs)
    if not ids_errs:
        return [ids]
    nested_errs: list[JsonDict] = []
    nested = []
    for i, p in enumerate(prompt):
        if isinstance(p, list):
            nested.append(_lax_token_ids(p, ("prompt", i), nested_errs))
        else:
            nested_errs.append({"type": "list_type", "loc": ("prompt", i), "msg": _TYPE_MSG["list"], "input": p})
    if not nested_errs:
        return list(nested)
    for e in ids_errs + nested_errs:
        f._err(e["type"], e["loc"], e["msg"], e["input"], e.get("ctx"))
    f._err("string_type", ("prompt",), _TYPE_MSG["string"], prompt)
    for i, p in enumerate(prompt):
        if not isinstance(p, str):
            f._err("string_type", ("prompt", i), _TYPE_MSG["string"], p)
    return []


def parse_chat_request(body: Any, *, trust_request_chat_template: bool = False) -> GenerateRequest:
    data = _require_object(body)
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if data.get("tools") == []:
        raise validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    _before_validators(data, "chat")
    f = _Fields(data)
    # `messages` is the model's first field: its errors come first.
    messages = _messages_field(f, data)
    req = _common(f, data, "chat")
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
    logprobs = bool(f.get("logprobs", "bool", False))
    req.top_logprobs = f.get("top_logprobs", "int", 0) or 0
    s = req.sampling
    s.logprobs = req.top_logprobs if logprobs else None
    if s.prompt_logprobs is None and req.echo:
        s.prompt_logprobs = req.top_logprobs
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


def _messages_field(f: _Fields, data: Mapping[str, Any]) -> list[Any]:
    """`messages: list[ChatCompletionMessageParam]`: missing, not a list, or each message against the union."""
    if "messages" not in data:
        f._err("missing", ("messages",), "Field required", data)
    messages = f.get("messages", "list", nullable=False) or []
    for i, m in enumerate(messages):
        f.errors.extend(message_union_errors(m, ("body", "messages", i)))
    return messages


# vLLM's ChatCompletionMessageParam (vllm/renderers/chat_utils.py): openai's six message TypedDicts, vLLM's custom one
# and openai_harmony's Message. pydantic tries each and, when none fits, reports every member's errors under its
# name, fields in declaration order; vLLM drops the inner union branches ("str", "generator[...]") from each loc.
# Iterable[...] contents are validated lazily (any list or object passes).
# (member name, role literal, field order); a field name ending in "!" is required.
_MESSAGE_MEMBERS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("ChatCompletionDeveloperMessageParam", "developer", ("content!", "role!", "name")),
    ("ChatCompletionSystemMessageParam", "system", ("content!", "role!", "name")),
    ("ChatCompletionUserMessageParam", "user", ("content!", "role!", "name")),
    ("ChatCompletionAssistantMessageParam", "assistant", ("role!", "content", "name")),
    ("ChatCompletionToolMessageParam", "tool", ("content!", "role!", "tool_call_id!")),
    ("ChatCompletionFunctionMessageParam", "function", ("content!", "name!", "role!")),
    ("CustomChatCompletionMessageParam", None, ("role!", "content", "name", "tool_call_id")),
    ("Message", None, ("author!", "content")),
)


def _member_errors(member: str, literal: str | None, fields: tuple[str, ...], m: Mapping[str, Any], loc: tuple) -> list:
    errs: list[JsonDict] = []
    base = (*loc, member)

    def err(kind: str, where: tuple, msg: str, value: Any, ctx: JsonDict | None = None) -> None:
        e: JsonDict = {"type": kind, "loc": (*base, *where), "msg": msg, "input": value}
        if ctx:
            e["ctx"] = ctx
        errs.append(e)

    for spec in fields:
        name = spec.rstrip("!")
        if name not in m:
            if spec.endswith("!"):
                err("missing", (name,), "Field required", m)
            continue
        v = m[name]
        if name == "role":
            if literal is not None and v != literal:
                err("literal_error", ("role",), f"Input should be '{literal}'", v, {"expected": f"'{literal}'"})
            elif literal is None and not isinstance(v, str):
                err("string_type", ("role",), _TYPE_MSG["string"], v)
        elif name == "content":
            if member == "Message":
                if not isinstance(v, list):
                    err("list_type", ("content",), _TYPE_MSG["list"], v)
            elif isinstance(v, str):
                continue
            elif member == "ChatCompletionFunctionMessageParam":
                if v is not None:
                    err("string_type", ("content",), _TYPE_MSG["string"], v)
            elif member == "CustomChatCompletionMessageParam":
                if not isinstance(v, list):
                    err("string_type", ("content",), _TYPE_MSG["string"], v)
                    err("list_type", ("content",), _TYPE_MSG["list"], v)
            elif not isinstance(v, list | dict) and not (v is None and member == "ChatCompletionAssistantMessageParam"):
                err("string_type", ("content",), _TYPE_MSG["string"], v)
                err("iterable_type", ("content",), "Input should be iterable", v)
        elif name in ("name", "tool_call_id"):
            nullable = name == "tool_call_id" and member == "CustomChatCompletionMessageParam"
            if not isinstance(v, str) and not (nullable and v is None):
                err("string_type", (name,), _TYPE_MSG["string"], v)
    return errs


def message_union_errors(m: Any, loc: tuple) -> list[JsonDict]:
    """Why one chat message fits none of ChatCompletionMessageParam's members, as pydantic words it; [] if it fits.

    Covers what a message can get wrong about role, content, name and tool_call_id; other fields pass unchecked.
    """
    if not isinstance(m, dict):
        errs: list[JsonDict] = [
            {"type": "dict_type", "loc": (*loc, member), "msg": "Input should be a valid dictionary", "input": m}
            for member, _, _ in _MESSAGE_MEMBERS[:-1]
        ]
        errs.append(
            {
                "type": "model_attributes_type",
                "loc": (*loc, "Message"),
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": m,
            }
        )
        return errs
    out: list[JsonDict] = []
    for member, literal, fields in _MESSAGE_MEMBERS:
        errs = _member_errors(member, literal, fields, m, loc)
        if not errs:
            return []
        out.extend(errs)
    return out


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[JsonDict]:
    """OpenAI messages -> the conversation vLLM hands the chat template (llmd.tokens.chat.normalize_messages)."""
    try:
        return normalize_messages(messages)
    except ChatMessageError as exc:
        raise validation_error(str(exc), exc.param) from exc


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


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES default
_SAMPLING_EPS = 1e-5


def check_text_length(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """vLLM's renderer check on a text prompt before tokenizing (TokenizeParams._text_len_check): a text longer than
    max_model_len tokens of the longest vocabulary piece cannot fit."""
    limit = max_model_len * max_chars_per_token
    if len(text) > limit:
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(text)} characters (more than {limit} characters, which is the upper bound for {max_model_len} "
            "input tokens). Please reduce the length of the input prompt.",
            "input_text",
            len(text),
        )


def check_prompt_length(prompt_ids: Sequence[int], max_model_len: int, *, from_text: bool) -> None:
    """vLLM's renderer check after tokenizing (TokenizeParams._token_len_check). vLLM tokenizes text with truncation
    at max_model_len + 1, so a long text always counts max_model_len + 1 tokens, "at least" that many."""
    n = len(prompt_ids)
    if n > max_model_len:
        count = max_model_len + 1 if from_text else n
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def effective_max_tokens(req: GenerateRequest, prompt_len: int, max_model_len: int) -> int:
    """vLLM's get_max_tokens: the request's budget clamped to the room left in the context (may be < 1: the sampling
    checks refuse that)."""
    s = req.sampling
    budget = max_model_len - prompt_len
    if s.max_tokens is not None:
        budget = min(budget, s.max_tokens)
    return budget


def check_sampling(req: GenerateRequest, max_tokens: int) -> None:
    """SamplingParams.__post_init__ (_verify_args, then the greedy check) for the parameters the sim honours, in
    vLLM's order; `max_tokens` is the effective budget of one prompt."""
    s = req.sampling
    if s.n < 1:
        raise validation_error(f"n must be at least 1, got {s.n}.")
    if s.n > MAX_N_SEQUENCES:
        raise validation_error(
            f"n must be at most {MAX_N_SEQUENCES}, got {s.n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
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
    if max_tokens < 1:
        raise validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if s.min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.")
    if s.min_tokens > max_tokens:
        raise validation_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {s.min_tokens}.")
    if s.logprobs is not None and s.logprobs != -1 and s.logprobs < 0:
        raise validation_error(f"logprobs must be non-negative or -1, got {s.logprobs}.", "logprobs", s.logprobs)
    if s.prompt_logprobs is not None and s.prompt_logprobs != -1 and s.prompt_logprobs < 0:
        num = s.prompt_logprobs
        raise validation_error(f"prompt_logprobs must be non-negative or -1, got {num}.", "prompt_logprobs", num)
    if t < _SAMPLING_EPS and s.n > 1:
        raise validation_error(f"n must be 1 when using greedy sampling, got {s.n}.")


def check_engine_input(req: GenerateRequest, prompt_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """The input processor's checks when the request reaches the engine: parameters against the model
    (SamplingParams.verify), then the prompt (length, then vocabulary)."""
    s = req.sampling
    for name, num in (("sample", s.logprobs), ("prompt", s.prompt_logprobs)):
        if num:
            wanted = vocab_size if num == -1 else num
            if wanted > MAX_LOGPROBS:
                param = "logprobs" if name == "sample" else "prompt_logprobs"
                raise validation_error(
                    f"Requested {name} logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                    param,
                    wanted,
                )
    n = len(prompt_ids)
    if n == 0:
        raise validation_error("The decoder prompt cannot be empty")
    if n > max_model_len:
        raise validation_error(
            f"The decoder prompt (length {n}) is longer than the maximum model length of {max_model_len}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens."
        )
    if n == max_model_len:
        raise validation_error(
            f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer than "
            f"the maximum model length of {max_model_len}. Make sure that `max_model_len` is no smaller than the "
            "number of text tokens (prompt + requested output tokens)."
        )
    lo, hi = min(prompt_ids), max(prompt_ids)
    if lo < 0:
        raise validation_error(f"Token id {lo} is out of vocabulary")
    if hi > vocab_size - 1:
        raise validation_error(f"Token id {hi} is out of vocabulary")


def parse_tokenize_request(body: Any) -> tuple[str | None, str | None, list[JsonDict] | None, JsonDict]:
    """/tokenize: (model, prompt, messages, options), as vLLM's TokenizeRequest union: the chat request when its
    messages are valid, else the completion request; when neither fits, the errors of both (completion's first)."""
    data = _require_object(body)
    if "messages" in data and data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    # TokenizeChatRequest: model, messages, add_generation_prompt, return_token_strs, continue_final_message,
    # add_special_tokens, chat_template_kwargs, tools.
    fc = _Fields(data)
    chat_model = fc.get("model", "string")
    messages = _messages_field(fc, data)
    chat_opts: JsonDict = {
        "add_generation_prompt": fc.get("add_generation_prompt", "bool", True, nullable=False),
        "return_token_strs": bool(fc.get("return_token_strs", "bool", False)),
        "continue_final_message": fc.get("continue_final_message", "bool", False, nullable=False),
        "add_special_tokens": fc.get("add_special_tokens", "bool", False, nullable=False),
        "chat_template_kwargs": fc.get("chat_template_kwargs", "dict") or {},
        "tools": fc.get("tools", "list"),
    }
    if "messages" in data and not fc.errors:
        return chat_model, None, conversation(messages), chat_opts
    # TokenizeCompletionRequest: model, prompt, add_special_tokens, return_token_strs.
    fp = _Fields(data)
    model = fp.get("model", "string")
    if "prompt" not in data:
        fp._err("missing", ("prompt",), "Field required", data)
    prompt = fp.get("prompt", "string", nullable=False)
    opts: JsonDict = {
        "add_special_tokens": fp.get("add_special_tokens", "bool", True, nullable=False),
        "return_token_strs": bool(fp.get("return_token_strs", "bool", False)),
    }
    if not fp.errors:
        return model, prompt, None, opts
    raise request_validation_error([*fp.errors, *fc.errors])


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
    created_cache_tokens: int | None = None,
) -> JsonDict:
    """UsageInfo. `details` mirrors --enable-prompt-tokens-details (prompt_tokens_details.cached_tokens, and for chat
    created_cache_tokens: prompt tokens this request newly wrote to the prefix cache); `drop_none` is the final
    streamed usage chunk (exclude_none=True)."""
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
            "created_cache_tokens": created_cache_tokens,
            "multimodal_tokens": None,
        }
    if drop_none:
        out = {k: v for k, v in out.items() if v is not None}
        if "prompt_tokens_details" in out:
            out["prompt_tokens_details"] = {k: v for k, v in out["prompt_tokens_details"].items() if v is not None}
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
    logprobs: JsonDict | None = None,
    prompt_logprobs: list[JsonDict | None] | None = None,
) -> JsonDict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": prompt_logprobs,
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
    logprobs: JsonDict | None = None,
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
                "logprobs": logprobs,
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
    prompt_logprobs: list[JsonDict | None] | None = None,
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
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": prompt_text,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_choice(
    index: int,
    role: str,
    content: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    logprobs: JsonDict | None = None,
) -> JsonDict:
    return {
        "index": index,
        "message": chat_message(role, content),
        "logprobs": logprobs,
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
    logprobs: JsonDict | None = None,
) -> JsonDict:
    choice: JsonDict = {
        "index": index,
        "delta": {"content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
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
