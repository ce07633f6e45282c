"""KV held by the requests the router has in flight at one endpoint, for KV admission (filters.kv_fits).

Prompt blocks are counted once however many in-flight requests share them: prefix hashes are chained, so sub-agents
forking one context, or every session's shared system prompt, hold the same leading blocks, and the engine holds them
once. Each request adds its partial last block and its whole requested output. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmd.router.scheduling.chains import ChainSet, held_prefix


class InflightKV:
    """`add` when a request is sent to the endpoint, `remove` with the same arguments when it ends; `tokens` is the
    KV those requests can occupy at most.

    A request's units are a chain (a unit's hash names every unit before it, as block hashes and approximate
    routing's chunk hashes do), so the units in flight are the nodes of the trie of the requests' chains
    (chains.ChainSet): a request adds the units past the longest prefix it shares with one already in flight and,
    when it ends, takes away those past the longest it shares with one still in flight. A 3,000-block request costs
    its few long neighbours' searches, not a count of 3,000 units (a quarter of a decision at 544 endpoints).

    That holds while every request's units carry the same tokens (block hashes always do). The first add with another
    (approximate routing's chunks, as chars_per_token is learned) switches to a count per unit, each keeping the
    tokens it was first added with: from then on a unit's tokens are its own, which chains alone cannot say.
    """

    __slots__ = ("_chains", "_extra_tokens", "_refs", "_shared_tokens", "_tokens_of", "_unit", "tokens", "version")

    def __init__(self) -> None:
        self._chains: ChainSet | None = ChainSet()  # the requests' units, while their tokens agree
        self._unit = 0  # the tokens of every unit in flight, while they agree
        self._refs: dict[int, int] = {}  # hash -> requests holding it, once units differ
        self._tokens_of: dict[int, int] = {}  # hash -> its tokens when first added, once units differ
        self._shared_tokens = 0  # distinct prompt units in flight, in tokens
        self._extra_tokens = 0  # partial blocks and outputs
        self.version = 0  # bumped by every add and remove: what a caller remembers of `held_prefix` holds till then
        self.tokens = 0  # the KV those requests can occupy at most (kept, not computed: read per endpoint per decision)

    def add(self, hashes: Sequence[int], unit_tokens: int, extra_tokens: int) -> None:
        self.version += 1
        chains = self._chains
        if chains is not None and hashes and chains and unit_tokens != self._unit:
            self._count_units(chains)
            chains = None
        if chains is not None:
            if hashes:
                if not chains:
                    self._unit = unit_tokens
                self._shared_tokens += (len(hashes) - chains.longest(hashes)) * unit_tokens
                chains.add(hashes)
        else:
            refs, tokens_of = self._refs, self._tokens_of
            for h in hashes:
                held = refs.get(h)
                if held is None:
                    self._shared_tokens += unit_tokens
                    refs[h] = 1
                    tokens_of[h] = unit_tokens
                else:
                    refs[h] = held + 1
        self._extra_tokens += extra_tokens
        self.tokens = self._shared_tokens + self._extra_tokens

    def _count_units(self, chains: ChainSet) -> None:
        self._refs = refs = chains.unit_counts()
        self._tokens_of = dict.fromkeys(refs, self._unit)
        self._chains = None

    def shared_tokens(self, hashes: Sequence[int], unit_tokens: int, upto: int | None = None) -> int:
        """Tokens of `hashes`' leading units (of the first `upto`, default all) already held by requests in flight
        here. The caller passes only the units the engine already has cached: requests admitted together compute a
        prefix that is not yet cached each in blocks of its own (vLLM shares a block only once it is computed and
        cached), so a burst of sub-agents forking a context the engine does not hold needs the context once per
        sub-agent."""
        n = len(hashes) if upto is None else min(upto, len(hashes))
        return self.held_prefix(hashes, 0, n) * unit_tokens

    def held_prefix(self, hashes: Sequence[int], start: int = 0, n: int | None = None) -> int:
        """How many leading units of `hashes[:n]` are held here, given that the first `start` are (a chain's units
        are held prefix-closed: a request holding unit k holds units 0..k-1)."""
        hi = len(hashes) if n is None else min(n, len(hashes))
        if start >= hi:
            return hi
        if self._chains is not None:
            return self._chains.longest(hashes, hi, start)
        return held_prefix(hashes, self._refs, start, hi)

    def remove(self, hashes: Sequence[int], unit_tokens: int, extra_tokens: int) -> None:
        """Undo one `add` with the same arguments (a unit's tokens are the ones it was first added with)."""
        self.version += 1
        chains = self._chains
        if chains is not None:
            if hashes and chains.remove(hashes):
                lost = len(hashes) - chains.longest(hashes)
                self._shared_tokens = max(0, self._shared_tokens - lost * self._unit)
        else:
            refs, tokens_of = self._refs, self._tokens_of
            for h in hashes:
                held = refs.get(h)
                if held is None:
                    continue
                if held <= 1:
                    del refs[h]
                    self._shared_tokens = max(0, self._shared_tokens - tokens_of.pop(h))
                else:
                    refs[h] = held - 1
        self._extra_tokens = max(0, self._extra_tokens - extra_tokens)
        self.tokens = self._shared_tokens + self._extra_tokens


def request_kv(
    hashes: Sequence[int], num_tokens: int, max_tokens: int, unit: int = 0, block_size: int = 0
) -> tuple[int, int]:
    """(tokens per hashed unit, tokens beyond the hashed units) of one request: its prompt's full blocks (`unit` =
    the block size) or text chunks (`unit` 0: the prompt's tokens spread over them) are `hashes`; the rest of the
    prompt and its whole output are extra. With `block_size`, the extra is rounded up to whole blocks: the engine
    allocates the prompt's partial last block and the output's blocks whole, and a few requests' partial blocks
    are enough to preempt on a cache that holds only a few long requests."""
    if not hashes or num_tokens <= 0:
        return 0, _whole(max(0, num_tokens) + max_tokens, block_size)
    unit = unit or max(1, num_tokens // len(hashes))
    return unit, _whole(max(0, num_tokens - unit * len(hashes)) + max_tokens, block_size)


def _whole(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size if block_size > 0 else tokens
