"""vLLM's OpenAI response bodies and stream chunks for the simulated engine, as plain dicts with vLLM's field sets
and order.

vLLM builds its bodies with pydantic: non-streaming responses are `model_dump()` (every field, None included), streamed
chunks are `model_dump_json(exclude_unset=True)` (only the fields the server set) and the final usage chunk drops None
fields. Shapes follow vllm/entrypoints/openai/{completion,chat_completion}/protocol.py and serving.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .errors import APIError, JsonDict

VLLM_VERSION = "0.32.0"


def dumps(obj: Any) -> str:
    """JSON as vLLM sends it: starlette's JSONResponse and pydantic's model_dump_json are compact and keep UTF-8."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def random_uuid() -> str:
    """vLLM's request-id suffix: 16 hex characters (vllm/utils/__init__.py)."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


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


def _response(
    obj: str, request_id: str, created: int, model: str, choices: list[JsonDict], usage_info: JsonDict, fp: str | None
) -> JsonDict:
    """The fields every non-streaming response starts with, in vLLM's order."""
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": usage_info,
    }


def _chunk(
    obj: str, request_id: str, created: int, model: str, choices: list[JsonDict], usage_info: JsonDict | None
) -> JsonDict:
    """A streamed chunk's fields (exclude_unset: usage only when set); the caller adds system_fingerprint last."""
    chunk: JsonDict = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_info is not None:
        chunk["usage"] = usage_info
    return chunk


def _with_fingerprint(chunk: JsonDict, fingerprint: str | None) -> JsonDict:
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return chunk


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
    body = _response("text_completion", request_id, created, model, choices, usage_info, fingerprint)
    body.update(kv_transfer_params=kv_transfer_params, ec_transfer_params=None, metrics=None)
    return body


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
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
    }
    return _with_fingerprint(_chunk("text_completion", request_id, created, model, [choice], usage_info), fingerprint)


def completion_usage_chunk(
    request_id: str, created: int, model: str, usage_info: JsonDict, fingerprint: str | None
) -> JsonDict:
    # exclude_unset=False, exclude_none=True: the defaulted "object" is present, None fields are not.
    return _with_fingerprint(_chunk("text_completion", request_id, created, model, [], usage_info), fingerprint)


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
    body = _response("chat.completion", request_id, created, model, choices, usage_info, fingerprint)
    body.update(
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=prompt_token_ids,
        prompt_text=prompt_text,
        kv_transfer_params=kv_transfer_params,
        ec_transfer_params=None,
        metrics=None,
    )
    return body


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
    choice = {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
    chunk = _chunk("chat.completion.chunk", request_id, created, model, [choice], usage_info)
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
    return _with_fingerprint(
        _chunk("chat.completion.chunk", request_id, created, model, [choice], usage_info), fingerprint
    )


def chat_usage_chunk(
    request_id: str, created: int, model: str, usage_info: JsonDict, fingerprint: str | None
) -> JsonDict:
    return _with_fingerprint(_chunk("chat.completion.chunk", request_id, created, model, [], usage_info), fingerprint)


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
