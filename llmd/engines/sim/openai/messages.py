"""Chat messages as vLLM validates them: pydantic's errors for a message that fits no member of
ChatCompletionMessageParam, and the conversation handed to the chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmd.tokens.chat import ChatMessageError, normalize_messages

from .errors import JsonDict, validation_error
from .fields import TYPE_MSG, Fields


def messages_field(f: Fields, data: Mapping[str, Any]) -> list[Any]:
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
                err("string_type", ("role",), TYPE_MSG["string"], v)
        elif name == "content":
            if member == "Message":
                if not isinstance(v, list):
                    err("list_type", ("content",), TYPE_MSG["list"], v)
            elif isinstance(v, str):
                continue
            elif member == "ChatCompletionFunctionMessageParam":
                if v is not None:
                    err("string_type", ("content",), TYPE_MSG["string"], v)
            elif member == "CustomChatCompletionMessageParam":
                if not isinstance(v, list):
                    err("string_type", ("content",), TYPE_MSG["string"], v)
                    err("list_type", ("content",), TYPE_MSG["list"], v)
            elif not isinstance(v, list | dict) and not (v is None and member == "ChatCompletionAssistantMessageParam"):
                err("string_type", ("content",), TYPE_MSG["string"], v)
                err("iterable_type", ("content",), "Input should be iterable", v)
        elif name in ("name", "tool_call_id"):
            nullable = name == "tool_call_id" and member == "CustomChatCompletionMessageParam"
            if not isinstance(v, str) and not (nullable and v is None):
                err("string_type", (name,), TYPE_MSG["string"], v)
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
