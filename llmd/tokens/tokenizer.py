"""A model folder's tokenizer as vLLM uses it: tokenizer.json for tokens, tokenizer_config.json for the chat template
and special tokens. No transformers needed; the token ids equal transformers' (and so vLLM's) for the same folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from llmd.tokens.chat import render_template

# The keys of HF's `special_tokens_map`, which transformers passes to every chat template as variables.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as plain strings or as serialized AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """tokenizer.json + tokenizer_config.json of a model folder: encode, decode, chat template, special tokens."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; tokenizing needs the model's tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        # transformers turns off any truncation or padding a tokenizer.json carries unless a call asks for it.
        self._tok.no_truncation()
        self._tok.no_padding()
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

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read it, do not reconfigure it)."""
        return self._tok

    # -- tokens -----------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in `text`, as HF's `return_offsets_mapping` gives
        them (tokens the post-processor adds span (0, 0))."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets

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
        """The prompt text of a normalized conversation (llmd.tokens.chat.normalize_messages), rendered exactly as
        transformers' `apply_chat_template(tokenize=False)` renders it."""
        return render_template(
            chat_template or self.chat_template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **template_kwargs,
        )

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

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
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
