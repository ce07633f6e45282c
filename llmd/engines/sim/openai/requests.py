"""Parsing of vLLM's OpenAI requests (/v1/completions, /v1/chat/completions, /tokenize, /detokenize) into the
simulated engine's GenerateRequest, with the request models' before-validators and pydantic's error order."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmd.net.limits import MAX_JSON_DEPTH, JSONTooDeep, check_depth

from .errors import APIError, JsonDict, request_validation_error, validation_error
from .fields import TYPE_MSG, Fields
from .messages import conversation, messages_field

# Parameters of vLLM's SamplingParams/completion defaults that the sim honours; anything else is accepted and ignored
# (OpenAIBaseModel has extra="allow"), as vLLM ignores fields it does not know.
DEFAULT_COMPLETION_MAX_TOKENS = 16
_MAX_CACHE_SALT_LEN = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """The request body as FastAPI + vLLM's validate_json_request see it; APIError(400) when it is not JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    parses = not media or media == "application/json" or media.endswith("+json")
    if parses:
        try:
            body = json.loads(raw) if raw else None
            check_depth(raw, body)
            _check_unicode(raw, body)
        except (RecursionError, JSONTooDeep, UnicodeEncodeError) as exc:
            # Not vLLM's answers (it fails these with 500s deep inside): a body no model can take is a 400 here.
            if isinstance(exc, UnicodeEncodeError):
                msg = "Invalid Unicode: a string holds an unpaired surrogate"
            else:
                msg = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
            err = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {}}
            err["ctx"] = {"error": msg}
            raise request_validation_error([err]) from None
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


def _check_unicode(raw: bytes, body: Any) -> None:
    """UnicodeEncodeError when a string of the body holds an unpaired UTF-16 surrogate, which json accepts (from a
    `\\ud800` escape, or raw surrogate bytes it decodes with surrogatepass) and the tokenizer refuses with a TypeError.
    Only bodies with such an escape or byte sequence pay for the check."""
    if b"\\ud" not in raw and b"\\uD" not in raw and b"\xed" not in raw:
        return
    json.dumps(body, ensure_ascii=False).encode("utf-8")


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


def _common(f: Fields, body: Mapping[str, Any], kind: Literal["completion", "chat"]) -> GenerateRequest:
    model = f.get("model", "string")
    stream = bool(f.get("stream", "bool", False))
    stream_options = f.get("stream_options", "dict")
    include_usage = continuous = False
    if stream_options is not None:
        so = Fields(stream_options)
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
    f = Fields(data)
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
    f = Fields({})
    out = []
    for i, t in enumerate(items):
        n = f._int(t, (*loc, i))
        if n is not None:
            if n < 0:
                f._err("greater_than_equal", (*loc, i), "Input should be greater than or equal to 0", t, {"ge": 0})
            else:
                out.append(n)
    errs.extend({**e, "loc": e["loc"][1:]} for e in f.errors)  # Fields puts "body" first; the caller does too
    return out


def _parse_prompt(prompt: Any, f: Fields) -> list[str | list[int]]:
    """`prompt: list[int >= 0] | list[list[int >= 0]] | str | list[str] | None` as pydantic's smart union takes it:
    the first member the value fits exactly, else the first it fits after coercion, else every member's errors."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        for kind in ("list", "list", "string", "list"):
            f._err(f"{kind}_type", ("prompt",), TYPE_MSG[kind], prompt)
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
            nested_errs.append({"type": "list_type", "loc": ("prompt", i), "msg": TYPE_MSG["list"], "input": p})
    if not nested_errs:
        return list(nested)
    for e in ids_errs + nested_errs:
        f._err(e["type"], e["loc"], e["msg"], e["input"], e.get("ctx"))
    f._err("string_type", ("prompt",), TYPE_MSG["string"], prompt)
    for i, p in enumerate(prompt):
        if not isinstance(p, str):
            f._err("string_type", ("prompt", i), TYPE_MSG["string"], p)
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
    f = Fields(data)
    # `messages` is the model's first field: its errors come first.
    messages = messages_field(f, data)
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


def parse_tokenize_request(body: Any) -> tuple[str | None, str | None, list[JsonDict] | None, JsonDict]:
    """/tokenize: (model, prompt, messages, options), as vLLM's TokenizeRequest union: the chat request when its
    messages are valid, else the completion request; when neither fits, the errors of both (completion's first)."""
    data = _require_object(body)
    if "messages" in data and data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    # TokenizeChatRequest: model, messages, add_generation_prompt, return_token_strs, continue_final_message,
    # add_special_tokens, chat_template_kwargs, tools.
    fc = Fields(data)
    chat_model = fc.get("model", "string")
    messages = messages_field(fc, data)
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
    fp = Fields(data)
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
    f = Fields(data)
    model = f.get("model", "string")
    if "tokens" not in data:
        f._err("missing", ("tokens",), "Field required", data)
    tokens = f.int_list("tokens") or []
    for i, t in enumerate(tokens):
        if t < 0:
            f._err("greater_than_equal", ("tokens", i), "Input should be greater than or equal to 0", t, {"ge": 0})
    f.raise_if_any()
    return model, tokens
