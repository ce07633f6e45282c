"""/v1/completions for the simulated engine, as vLLM's serving_completion.py: a batch of text or token-id prompts,
echo, completion logprobs with text offsets, and the completion bodies and chunks."""

from __future__ import annotations

from typing import Any

from .logprobs import Position, completion_logprobs, prompt_logprobs_json
from .openai.errors import JsonDict, validation_error
from .openai.requests import GenerateRequest, parse_completion_request
from .openai.responses import (
    completion_choice,
    completion_chunk,
    completion_response,
    completion_usage_chunk,
    continuous_usage,
    usage,
)
from .openai.validation import check_text_length
from .serving import Delta, Generation, GenerationServing, PromptItem, SubRequest


class OpenAIServingCompletion(GenerationServing):
    kind = "completion"
    id_prefix = "cmpl"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_chars_per_token: int | None = None

    def parse(self, body: Any) -> GenerateRequest:
        return parse_completion_request(body)

    def prompt_items(self, req: GenerateRequest) -> list[PromptItem]:
        if not req.prompts:
            raise validation_error("You must pass at least one prompt")
        return [(p, p if isinstance(p, str) else None) for p in req.prompts]

    @property
    def max_chars_per_token(self) -> int | None:
        """vLLM's tokenizer.max_chars_per_token: the longest vocabulary piece (None: unknown, no text check)."""
        if self._max_chars_per_token is None:
            backend = getattr(self.tokenizer, "backend", None)
            vocab = backend.get_vocab(True) if backend is not None else None
            self._max_chars_per_token = max((len(t) for t in vocab), default=0) if vocab else 0
        return self._max_chars_per_token or None

    def check_text(self, req: GenerateRequest, text: str) -> None:
        chars = self.max_chars_per_token
        if req.truncate_prompt_tokens is None and chars:
            check_text_length(text, self.max_model_len, chars)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_text(self, sub: SubRequest) -> str:
        return sub.prompt_text if sub.prompt_text is not None else self.tokenizer.decode(sub.prompt_ids)

    def _logprobs(
        self, g: Generation, sub: SubRequest, token_ids: list[int], positions: list[Position], echo_prompt: bool
    ) -> dict[str, Any] | None:
        """A completion choice's (or chunk's) logprobs object, the echoed prompt's positions first; advances the
        sub-request's text offset as vLLM's stream does."""
        num = g.req.sampling.logprobs
        if num is None:
            return None
        ids: list[int] = token_ids
        pos: list[Position | None] = list(positions)
        if echo_prompt:
            ids = [*sub.prompt_ids, *token_ids]
            pos = [*self.prompt_positions(g, sub), *positions]
        as_ids = g.req.return_tokens_as_token_ids
        lp = completion_logprobs(ids, pos, num, self._decode_one, initial_offset=sub.text_offset, as_token_id=as_ids)
        if lp["tokens"]:
            sub.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def chunk(self, g: Generation, d: Delta, continuous: bool) -> JsonDict:
        req, sub, ids = g.req, d.sub, d.token_ids
        text = d.text
        prompt_ids = None
        echo_now = False
        if sub.index not in g.prompt_sent and (req.echo or req.return_token_ids):
            # The first chunk of a choice carries its prompt's ids when echoing or returning token ids.
            g.prompt_sent.add(sub.index)
            prompt_ids = sub.prompt_ids
            if req.echo:
                echo_now = True
                if not req.return_token_ids:
                    text = self._prompt_text(sub) + d.text
        return completion_chunk(
            g.request_id,
            g.created,
            self.served_name,
            sub.index,
            text,
            d.finish_reason,
            token_ids=ids if req.return_token_ids else None,
            prompt_token_ids=prompt_ids,
            fingerprint=d.fingerprint,
            usage_info=continuous_usage(len(sub.prompt_ids), len(sub.token_ids)) if continuous else None,
            logprobs=self._logprobs(g, sub, ids, d.positions, echo_now),
        )

    def usage_chunk(self, g: Generation, usage_info: JsonDict) -> JsonDict:
        return completion_usage_chunk(g.request_id, g.created, self.served_name, usage_info, self.fingerprint)

    def response(self, g: Generation) -> JsonDict:
        req, subs = g.req, g.subs
        want_prompt_lp = req.sampling.prompt_logprobs is not None
        choices = []
        for s in subs:
            text = s.text
            if req.echo:
                text = ("" if req.return_token_ids else self._prompt_text(s)) + text
            s.text_offset = 0
            choices.append(
                completion_choice(
                    s.index,
                    text,
                    s.finish_reason,
                    token_ids=s.token_ids if req.return_token_ids else None,
                    prompt_token_ids=s.prompt_ids if req.return_token_ids else None,
                    logprobs=self._logprobs(g, s, s.token_ids, s.positions, req.echo),
                    prompt_logprobs=prompt_logprobs_json(self.prompt_positions(g, s)) if want_prompt_lp else None,
                )
            )
        completion_tokens = sum(len(s.token_ids) for s in subs)
        details = self.config.enable_prompt_tokens_details
        use = usage(g.num_prompt_tokens, completion_tokens, subs[-1].num_cached_tokens, details=details)
        return completion_response(
            g.request_id, g.created, self.served_name, choices, use, self.fingerprint, subs[0].kv_transfer_params
        )
