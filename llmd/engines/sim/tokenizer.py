"""The simulated engine's tokenizer: a model folder's tokenizer.json plus its chat template, rendered as HF does.

vLLM 0.32 renders chat requests with `tokenizer.apply_chat_template(conversation, tokenize=True,
add_generation_prompt=True, return_dict=False)` (vllm/renderers/hf.py `safe_apply_chat_template`); transformers renders
the template in a sandboxed jinja2 environment and tokenizes the text with `add_special_tokens=False`. This module does
the same without transformers, so the token ids a router computes for a chat request equal the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# The keys of HF's `special_tokens_map`, which transformers passes to every chat template as variables.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render; vLLM answers 400."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as plain strings or as serialized AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


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


class SimTokenizer:
    """tokenizer.json + tokenizer_config.json of a model folder: encode, decode, chat template, special tokens."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; the simulated engine needs the model's tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self.config = _read_json(self.model_dir / "tokenizer_config.json")
        model_config = _read_json(self.model_dir / "config.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(self.config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        # Also special_tokens_map.json: older folders keep the special tokens only there.
        for key, value in _read_json(self.model_dir / "special_tokens_map.json").items():
            text = _token_text(value)
            if key in _SPECIAL_TOKEN_KEYS and text is not None:
                self.special_tokens.setdefault(key, text)
        self.chat_template = self._pick_template(self.config.get("chat_template"))
        if self.chat_template is None and (self.model_dir / "chat_template.jinja").is_file():
            self.chat_template = (self.model_dir / "chat_template.jinja").read_text()
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos else None
        if self.eos_token_id is None:
            cfg_eos = model_config.get("eos_token_id")
            self.eos_token_id = cfg_eos[0] if isinstance(cfg_eos, list) and cfg_eos else cfg_eos
        self.vocab_size: int = max(int(model_config.get("vocab_size") or 0), self._tok.get_vocab_size(True))
        # Every added token marked special: the simulated sampler never draws them (so output text stays text).
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        special |= {i for t in self.special_tokens.values() if (i := self._tok.token_to_id(t)) is not None}
        self.special_token_ids: list[int] = sorted(special)
        self.max_model_len: int | None = model_config.get("max_position_embeddings") or self.config.get(
            "model_max_length"
        )

    @staticmethod
    def _pick_template(value: Any) -> str | None:
        # tokenizer_config.json holds one template, or a list of named ones of which "default" is the chat template.
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return None

    # -- tokens -----------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -- chat -------------------------------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, rendered exactly as transformers' `apply_chat_template(tokenize=False)` renders it."""
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError(
                "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
                "template if the tokenizer does not define one."
            )
        import jinja2

        conversation = [dict(m) for m in messages]
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = None
        if continue_final_message:
            # transformers marks the final message, renders, and cuts the text right after its content.
            final = conversation[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message is set but the final message has no text content")
            conversation[-1]["content"] = final + tag
        kwargs = {**self.special_tokens, **template_kwargs}
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
            if final.strip() not in text or tag.strip() not in text:
                raise ChatTemplateError("continue_final_message is set but the template dropped the final message")
            loc = text.rindex(tag.strip())
            text = text[:loc] if text[loc : loc + len(tag)] == tag else text[:loc].rstrip()
        return text

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Chat prompt token ids as vLLM computes them: the rendered text tokenized without special tokens."""
        add_special_tokens = kwargs.pop("add_special_tokens", False)
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=add_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, as vLLM's incremental detokenizer does.

    Decoding a small window around the new tokens (instead of the whole output each time) keeps streaming O(n); a
    trailing U+FFFD means a multi-byte character is not complete yet, so that text is held back until it is.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tok")

    def __init__(self, tokenizer: SimTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, new_ids: Iterable[int]) -> str:
        self._ids.extend(new_ids)
        ids = self._ids
        prefix_text = self._tok.decode(ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(ids[self._prefix :], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(ids)
            return delta
        return ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
