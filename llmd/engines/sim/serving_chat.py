"""/v1/chat/completions for the simulated engine, as vLLM's serving_chat.py: the conversation rendered into one
prompt, the response role and echo, and chat's bodies and chunks."""

from __future__ import annotations

from typing import Any

from .logprobs import chat_logprobs, prompt_logprobs_json
from .openai.errors import JsonDict
from .openai.requests import GenerateRequest, parse_chat_request
from .openai.responses import (
    chat_choice,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    chat_usage_chunk,
    continuous_usage,
    usage,
)
from .serving import Delta, Generation, GenerationServing, PromptItem, SubRequest


def chat_role(req: GenerateRequest) -> str:
    # vLLM's response role is "assistant" unless the request continues the last message's role.
    if req.add_generation_prompt or not req.messages:
        return "assistant"
    return req.messages[-1]["role"]


def echo_prefix(req: GenerateRequest, role: str) -> str:
    """With echo, the last message's content when it has the response's role (the response continues it)."""
    if req.echo and req.messages and req.messages[-1].get("role") == role:
        return req.messages[-1].get("content") or ""
    return ""


class OpenAIServingChat(GenerationServing):
    kind = "chat"
    id_prefix = "chatcmpl"
    reports_created_cache = True

    def parse(self, body: Any) -> GenerateRequest:
        return parse_chat_request(body, trust_request_chat_template=self.config.trust_request_chat_template)

    def prompt_items(self, req: GenerateRequest) -> list[PromptItem]:
        text = self.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
            documents=req.documents,
            kwargs=req.chat_template_kwargs,
            chat_template=req.chat_template,
        )
        return [(text, text)]

    def engine_request_id(self, request_id: str, sub: SubRequest, num_subs: int) -> str:
        # vLLM's chat keeps the request id for its one engine request.
        return request_id if num_subs == 1 else f"{request_id}-{sub.index}"

    def opening_chunks(self, g: Generation, continuous: bool) -> list[JsonDict]:
        """A role chunk per choice, then (with echo) the continued message's content per choice."""
        req = g.req
        role = chat_role(req)
        chunks = []
        for s in g.subs:
            chunks.append(
                chat_role_chunk(
                    g.request_id,
                    g.created,
                    self.served_name,
                    s.index,
                    role,
                    prompt_token_ids=s.prompt_ids if req.return_token_ids else None,
                    prompt_text=s.prompt_text if req.return_prompt_text else None,
                    usage_info=continuous_usage(g.num_prompt_tokens, 0, chat=True) if continuous else None,
                )
            )
        prefix = echo_prefix(req, role)
        if prefix:
            for s in g.subs:
                use = continuous_usage(g.num_prompt_tokens, 0, chat=True) if continuous else None
                chunk = chat_chunk(
                    g.request_id,
                    g.created,
                    self.served_name,
                    s.index,
                    prefix,
                    None,
                    usage_info=use,
                    token_ids_field=False,
                )
                chunks.append(chunk)
        return chunks

    def chunk(self, g: Generation, d: Delta, continuous: bool) -> JsonDict:
        req = g.req
        lp = None
        if req.sampling.logprobs is not None:
            lp = chat_logprobs(d.token_ids, d.positions, req.top_logprobs, as_token_id=req.return_tokens_as_token_ids)
        return chat_chunk(
            g.request_id,
            g.created,
            self.served_name,
            d.sub.index,
            d.text,
            d.finish_reason,
            token_ids=d.token_ids if req.return_token_ids else None,
            fingerprint=d.fingerprint,
            usage_info=continuous_usage(g.num_prompt_tokens, len(d.sub.token_ids), chat=True) if continuous else None,
            logprobs=lp,
        )

    def usage_chunk(self, g: Generation, usage_info: JsonDict) -> JsonDict:
        return chat_usage_chunk(g.request_id, g.created, self.served_name, usage_info, self.fingerprint)

    def response(self, g: Generation) -> JsonDict:
        req, subs = g.req, g.subs
        role = chat_role(req)
        prefix = echo_prefix(req, role)
        as_ids = req.return_tokens_as_token_ids
        choices = [
            chat_choice(
                s.index,
                role,
                prefix + s.text,
                s.finish_reason,
                s.token_ids if req.return_token_ids else None,
                logprobs=(
                    chat_logprobs(s.token_ids, s.positions, req.top_logprobs, as_token_id=as_ids)
                    if req.sampling.logprobs is not None
                    else None
                ),
            )
            for s in subs
        ]
        use = usage(
            g.num_prompt_tokens,
            sum(len(s.token_ids) for s in subs),
            subs[0].num_cached_tokens,
            details=self.config.enable_prompt_tokens_details,
            created_cache_tokens=subs[0].created_cache_tokens,
        )
        want_prompt_lp = req.sampling.prompt_logprobs is not None
        return chat_response(
            g.request_id,
            g.created,
            self.served_name,
            choices,
            use,
            self.fingerprint,
            subs[0].kv_transfer_params,
            prompt_token_ids=subs[0].prompt_ids if req.return_token_ids else None,
            prompt_text=subs[0].prompt_text if req.return_prompt_text else None,
            prompt_logprobs=prompt_logprobs_json(self.prompt_positions(g, subs[0])) if want_prompt_lp else None,
        )
