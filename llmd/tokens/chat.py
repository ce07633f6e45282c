"""Chat requests to prompt text, as vLLM 0.32 does it: the messages normalized, then the chat template rendered.

vLLM renders chat requests with `tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
return_dict=False)` (vllm/renderers/hf.py `safe_apply_chat_template`) after normalizing the OpenAI messages
(vllm/renderers/chat_utils.py); transformers renders the template in a sandboxed jinja2 environment. The engine and the
router both go through here, so the text (and so the tokens) a router computes for a chat request equal the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

JsonDict = dict[str, Any]
# Claude Code puts a per-request billing line at the top of its system prompt; it would break every prefix cache.
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"
# transformers' marker for continue_final_message.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render; vLLM answers 400."""


class ChatMessageError(ValueError):
    """A message vLLM refuses before rendering (400); `param` names the offending field, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- messages -------------------------------------------------------------------------------------------------------


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


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[JsonDict]:
    """OpenAI messages -> the conversation vLLM hands the chat template (vllm/renderers/chat_utils.py).

    Text parts are joined with "\\n" (the "string" content format of text-only templates), `name` is dropped, Claude
    Code's per-request billing header line is cut from system text (it would break the prefix cache), assistant
    tool-call arguments become dicts, tool messages keep their tool_call_id. Idempotent.
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
                raise ChatMessageError(f"Unsupported content part type {kind!r}: the simulated model is text-only.")
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
        raise ChatMessageError("assistant tool_calls entries must be objects.", "tool_calls")
    function = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise ChatMessageError("chat completions only support assistant tool_calls of type 'function'.", "tool_calls")
    function = dict(function)
    args = function.get("arguments")
    if args and not isinstance(args, dict):
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args = None
    function["arguments"] = args if isinstance(args, dict) else {}
    return {**item, "function": function}


# ---- templates ------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        # transformers replaces jinja's tojson: the built-in one HTML-escapes, which changes the rendered tokens.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        # transformers registers a `{% generation %}` block (assistant-mask tracking); it renders its body unchanged.
        tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_template(
    source: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text, rendered exactly as transformers' `apply_chat_template(tokenize=False)` renders it.

    `messages` is the normalized conversation; `special_tokens` the tokenizer's special_tokens_map (bos_token, ...),
    which transformers passes to every template.
    """
    if source is None:
        raise ChatTemplateError(
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
            "template if the tokenizer does not define one."
        )
    import jinja2

    conversation = [dict(m) for m in messages]
    final = None
    if continue_final_message:
        # transformers marks the final message, renders, and cuts the text right after its content.
        final = conversation[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message is set but the final message has no text content")
        conversation[-1]["content"] = final + _CONTINUE_TAG
    kwargs = {**special_tokens, **template_kwargs}
    try:
        text = _compile_template(source).render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
    if final is not None:
        # transformers' cut: right before the tag; if the template trimmed the space after it, trim before it too.
        tag = _CONTINUE_TAG
        if final.strip() not in text or tag.strip() not in text:
            raise ChatTemplateError("continue_final_message is set but the template dropped the final message")
        loc = text.rindex(tag.strip())
        text = text[:loc] if text[loc : loc + len(tag)] == tag else text[:loc].rstrip()
    return text
