"""A session's context as the engines and the router see it: its tokens (as runs), the engine's chained block hashes,
their 64-bit form the router's index keys on, and the text-chunk hashes the approximate policy routes on.

Extending a context hashes only the blocks the new tokens complete, as a real agent's growing prompt costs the
router's incremental tokenizer and hasher only its new part.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.engines.sim.block_pool import h64_tuple
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
    simulator's prompt text is `chars_per_token` characters a token, so a chunk of text is a fixed run of tokens).
    `chunks=False` when no router reads them (the precise policy): contexts then carry none."""

    def __init__(self, hasher: BlockHasher, chunk_tokens: int, vocab: int, chunks: bool = True) -> None:
        self.hasher = hasher
        self.bs = hasher.block_size
        self.chunk_tokens = max(1, chunk_tokens)
        self.vocab = vocab
        self.chunks = chunks
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
        bs, ct, n = self.bs, self.chunk_tokens, len(tokens)
        done, full = len(ctx.hashes), n // bs
        cstart, cfull = len(ctx.chunks), n // ct if self.chunks else 0
        # The new tokens both kinds of hash read, computed once.
        lo = min(done * bs if full > done else n, cstart * ct if cfull > cstart else n)
        hi = max(full * bs, cfull * ct)
        # Only chunk hashes read the tokens as ints; block hashes take them packed (no int object a token).
        toks = tokens.tokens(lo, hi) if cfull > cstart else tokens.packed(lo, hi)
        hashes, h64 = ctx.hashes, ctx.h64
        if full > done:
            new = self.hasher.chain(hashes[-1] if hashes else None, toks, done * bs - lo, full - done)
            self.blocks_hashed += full - done
            hashes, h64 = hashes + tuple(new), h64 + h64_tuple(new)
        chunks = ctx.chunks
        if cfull > cstart:
            cs = list(chunks)
            h = cs[-1] if cs else 0
            off = cstart * ct - lo
            for i in range(cfull - cstart):
                # Python's hash of a tuple of ints is not salted per process: chunk hashes are reproducible.
                h = hash((h, tuple(toks[off + i * ct : off + (i + 1) * ct])))
                cs.append(h)
            chunks = tuple(cs)
        return Context(tokens, hashes, h64, chunks)
