"""A session's context as the engines and the router see it: its tokens (as runs), the engine's chained block hashes,
their 64-bit form the router's index keys on, and the text-chunk hashes the approximate policy routes on.

Extending a context hashes only the blocks the new tokens complete, as a real agent's growing prompt costs the
router's incremental tokenizer and hasher only its new part.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.kv.events import hash64
from llmd.kv.hashing import BlockHasher
from llmd.sim.tokens import TokenRuns


@dataclass(frozen=True, slots=True)
class Context:
    tokens: TokenRuns
    hashes: tuple[bytes, ...]  # engine-form full-block hashes
    h64: tuple[int, ...]  # the router's form of the same
    chunks: tuple[int, ...]  # approximate routing's chained chunk hashes (chunk_tokens tokens each)

    def __len__(self) -> int:
        return len(self.tokens)


class ContextBuilder:
    """Makes and extends contexts for one engine hasher and the approximate policy's chunk size (in tokens: the
    simulator's prompt text is `chars_per_token` characters a token, so a chunk of text is a fixed run of tokens)."""

    def __init__(self, hasher: BlockHasher, chunk_tokens: int, vocab: int) -> None:
        self.hasher = hasher
        self.bs = hasher.block_size
        self.chunk_tokens = max(1, chunk_tokens)
        self.vocab = vocab
        self.empty = Context(TokenRuns((), vocab), (), (), ())
        self.blocks_hashed = 0

    def extend(self, ctx: Context, runs: TokenRuns) -> Context:
        """`ctx` followed by `runs`' tokens."""
        tokens = ctx.tokens.concat(runs) if len(ctx.tokens) else runs
        return self._complete(ctx, tokens)

    def prefix(self, ctx: Context, n: int) -> Context:
        """The first `n` tokens of `ctx` (its hashes are a prefix too: chained hashes depend only on what precedes)."""
        if n >= len(ctx.tokens):
            return ctx
        bs, ct = self.bs, self.chunk_tokens
        return Context(ctx.tokens.prefix(n), ctx.hashes[: n // bs], ctx.h64[: n // bs], ctx.chunks[: n // ct])

    def _complete(self, ctx: Context, tokens: TokenRuns) -> Context:
        bs, n = self.bs, len(tokens)
        hashes, h64 = list(ctx.hashes), list(ctx.h64)
        done = len(hashes)
        full = n // bs
        if full > done:
            toks = tokens.tokens(done * bs, full * bs)
            hash_block = self.hasher.hash_block
            parent = hashes[-1] if hashes else None
            for i in range(full - done):
                parent = hash_block(parent, toks[i * bs : (i + 1) * bs])
                hashes.append(parent)
                h64.append(hash64(parent))
            self.blocks_hashed += full - done
        chunks = list(ctx.chunks)
        ct = self.chunk_tokens
        cfull = n // ct
        if cfull > len(chunks):
            start = len(chunks)
            toks = tokens.tokens(start * ct, cfull * ct)
            h = chunks[-1] if chunks else 0
            for i in range(cfull - start):
                # Python's hash of a tuple of ints is not salted per process: chunk hashes are reproducible.
                h = hash((h, tuple(toks[i * ct : (i + 1) * ct])))
                chunks.append(h)
        return Context(tokens, tuple(hashes), tuple(h64), tuple(chunks))
