"""/tokenize and /detokenize for the simulated engine, as vLLM's serving_tokenization.py."""

from __future__ import annotations

from aiohttp import web

from .openai.requests import parse_detokenize_request, parse_json_body, parse_tokenize_request
from .openai.responses import detokenize_response, tokenize_response
from .serving import OpenAIServing, json_response


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse_json_body(await self.server.read_body(request), request.headers.get("Content-Type"))
        model, prompt, messages, opts = parse_tokenize_request(body)
        self.check_model(model)
        tok = self.tokenizer
        if messages is not None:
            ids = tok.encode(
                self.render_chat(
                    messages,
                    add_generation_prompt=opts["add_generation_prompt"],
                    continue_final_message=opts["continue_final_message"],
                    tools=opts["tools"],
                    documents=None,
                    kwargs=opts["chat_template_kwargs"],
                ),
                add_special_tokens=opts["add_special_tokens"],
            )
        else:
            assert prompt is not None
            ids = tok.encode(prompt, add_special_tokens=opts["add_special_tokens"])
        strs = [tok.id_to_token(i) or "" for i in ids] if opts["return_token_strs"] else None
        return json_response(tokenize_response(ids, self.max_model_len, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse_json_body(await self.server.read_body(request), request.headers.get("Content-Type"))
        model, tokens = parse_detokenize_request(body)
        self.check_model(model)
        # Ids past the vocabulary decode to nothing (the tokenizer skips them), as in vLLM.
        return json_response(detokenize_response(self.tokenizer.decode(tokens)))
