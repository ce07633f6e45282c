"""Routing inputs from request bodies: the model's tokenizer behind an incremental prompt cache, text chunks for
approximate scoring, and the thread that keeps big prompts' tokenization off the event loop."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from llmd.errors import UserError
from llmd.router.config import RouterConfig
from llmd.router.request import Kind, Prompt, bad_request, prompt_source, text_of
from llmd.router.scheduling import text_chunk_hashes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouteTokens:
    """What an encoder gives routing: the prompt's full-block hashes (engine form), its length, and a session
    fingerprint for requests that name no session."""

    block_hashes: Sequence[int]
    num_tokens: int
    fingerprint: str | None = None
    # The token ids of a text prompt the router tokenized (what the engine would compute), to forward in its place.
    token_ids: Sequence[int] | None = None


class PromptEncoder:
    """Routing inputs from request bodies through llmd.tokens: the model's tokenizer, chat templates rendered as vLLM
    renders them, and the incremental PromptCache, so a 195K-token agent turn costs only its new part."""

    def __init__(self, tokenizer_dir: str, block_size: int, hash_algo: str, hash_seed: str | None,
                 max_tokens: int = 16_000_000) -> None:  # fmt: skip
        from llmd.kv.hashing import BlockHasher
        from llmd.tokens import PromptCache, Tokenizer

        self.tokenizer = Tokenizer(tokenizer_dir)
        self.hasher = BlockHasher(block_size, hash_algo, hash_seed)
        self.cache = PromptCache(self.tokenizer, self.hasher, max_tokens=max_tokens)

    def encode_route(self, session: str | None, kind: Kind, source: Any, body: dict[str, Any]) -> RouteTokens:
        """Raises ValueError for a prompt the engine would refuse (bad messages, a template error)."""
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        special = body.get("add_special_tokens")
        special = special if isinstance(special, bool) else None
        if isinstance(source, list) and (not source or isinstance(source[0], int)):
            # Token ids: nothing to tokenize or remember; hash them as the engine will.
            return RouteTokens(self.hasher.event_hashes(source, cache_salt=salt), len(source), None)
        if kind == "chat":
            kw: dict[str, Any] = {}
            extra = body.get("chat_template_kwargs")
            if isinstance(extra, dict):
                kw.update(extra)
            for key in ("add_generation_prompt", "continue_final_message"):
                if isinstance(body.get(key), bool):
                    kw[key] = body[key]
            for key in ("tools", "documents"):
                if isinstance(body.get(key), list):
                    kw[key] = body[key]
            if isinstance(body.get("chat_template"), str):
                kw["chat_template"] = body["chat_template"]
            enc = self.cache.encode(source, add_special_tokens=special, cache_salt=salt, **kw)
            # vLLM's chat API takes messages only: a conversation's ids have nowhere to go.
            return RouteTokens(enc.block_hashes, enc.num_tokens, enc.session)
        enc = self.cache.encode(source, add_special_tokens=special, cache_salt=salt)
        return RouteTokens(enc.block_hashes, enc.num_tokens, enc.session, enc.token_ids)


def load_encoder(c: RouterConfig) -> PromptEncoder:
    assert c.tokenizer is not None
    try:
        return PromptEncoder(c.tokenizer, c.block_size, c.hash_algo, c.hash_seed, c.prompt_cache_tokens)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load the tokenizer the router needs for prefix-aware routing from {c.tokenizer!r}: {exc}; "
            "point model.tokenizer (or model.path) at the model folder, or use policy approximate"
        ) from exc


class PromptReader:
    """The routing inputs of a request body: text chunks (approximate scoring), block hashes and the token count (the
    encoder). Small prompts are tokenized right on the event loop; big ones (a fresh 195K-token context takes ~0.4 s)
    on a tokenizer thread, so the event loop keeps routing meanwhile (the tokenizer releases the GIL). The prompt
    cache is not thread-safe: while a job is on the thread, every encode goes there, in order."""

    def __init__(self, encoder: Any, needs_text: bool, needs_tokens: bool, offload_bytes: int) -> None:
        self.encoder = encoder
        self.needs_text = needs_text
        self.needs_tokens = needs_tokens
        self.offload_bytes = offload_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pending = 0

    async def read(
        self, kind: Kind, body: dict[str, Any], session: str | None, size: int, chars_per_token: float
    ) -> Prompt:
        """Validate the prompt's shape (400 for what no engine could take) and compute the routing inputs."""
        source = prompt_source(kind, body)
        out = Prompt()
        if self.needs_text:
            text = text_of(source)
            out.text_hashes = text_chunk_hashes(text)
            if not self.needs_tokens:
                # Approximate routing never tokenizes, but P/D (uncached tokens vs the threshold) and placement need
                # a prompt length: token ids count themselves, text is estimated from its characters, as llm-d does.
                if isinstance(source, list) and source and isinstance(source[0], int):
                    out.num_tokens = len(source)
                else:
                    out.num_tokens = math.ceil(len(text) / chars_per_token)
                    out.chars = len(text)
        if self.encoder is not None and self.needs_tokens:
            try:
                enc = await self.encode(session, kind, source, body, size)
            except ValueError as exc:
                raise bad_request(str(exc), getattr(exc, "param", None)) from None
            except Exception as exc:
                # A chat template is code run on the client's data, and can fail in any way on odd input (a
                # TypeError adding a number to a string); vLLM answers every such failure 400, so does the router.
                log.warning("prompt of a request could not be rendered", exc_info=True)
                raise bad_request(f"the prompt cannot be rendered: {type(exc).__name__}: {exc}") from None
            out.block_hashes = enc.block_hashes
            out.num_tokens = enc.num_tokens
            out.fingerprint = enc.fingerprint
            out.token_ids = enc.token_ids
        return out

    async def encode(self, session: str | None, kind: Kind, source: Any, body: dict[str, Any], size: int) -> Any:
        enc = self.encoder
        if size < self.offload_bytes and not self._pending:
            return enc.encode_route(session, kind, source, body)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmd-tokenize")
        loop = asyncio.get_running_loop()
        self._pending += 1
        job = self._pool.submit(enc.encode_route, session, kind, source, body)

        def finished(_: Any) -> None:
            # Counted down when the thread is really done, even if our request was cancelled meanwhile.
            loop.call_soon_threadsafe(self._done)

        job.add_done_callback(finished)
        return await asyncio.wrap_future(job)

    def _done(self) -> None:
        self._pending -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
