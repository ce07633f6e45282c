"""KV held by the requests the router has in flight at one endpoint, for KV admission (filters.kv_fits).

Prompt blocks are counted once however many in-flight requests share them: prefix hashes are chained, so sub-agents
forking one context, or every session's shared system prompt, hold the same leading blocks, and the engine holds them
once. Each request adds its partial last block and its whole requested output. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import _count_elements, deque  # type: ignore[attr-defined]  # Counter.update's C loop
from collections.abc import Sequence
from itertools import compress, repeat


class InflightKV:
    """`add` when a request is sent to the endpoint, `remove` with the same arguments when it ends; `tokens` is the
    KV those requests can occupy at most.

    Counting is done a whole request at a time in C (a request holds thousands of units): while every unit was
    added with the same tokens per unit (block hashes always are), a unit's tokens are that one number; the first
    add with another (approximate routing's chunks, as chars_per_token is learned) keeps each unit's own from then on.
    """

    __slots__ = ("_extra_tokens", "_refs", "_shared_tokens", "_tokens_of", "_unit", "tokens", "version")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # hash -> requests holding it
        self._unit = 0  # the tokens of every unit in `_refs`, while `_tokens_of` is None
        self._tokens_of: dict[int, int] | None = None  # hash -> its tokens when first added, once units differ
        self._shared_tokens = 0  # distinct prompt units in flight, in tokens
        self._extra_tokens = 0  # partial blocks and outputs
        self.version = 0  # bumped by every add and remove: what a caller remembers of `held_prefix` holds till then
        self.tokens = 0  # the KV those requests can occupy at most (kept, not computed: read per endpoint per decision)

    def add(self, hashes: Sequence[int], unit_tokens: int, extra_tokens: int) -> None:
        self.version += 1
        refs = self._refs
        if self._tokens_of is None and (unit_tokens == self._unit or not refs):
            self._unit = unit_tokens
            before = len(refs)
            _count_elements(refs, hashes)  # refs[h] += 1 for each, in C
            self._shared_tokens += (len(refs) - before) * unit_tokens
        else:
            tokens_of = self._own_tokens()
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

    def _own_tokens(self) -> dict[int, int]:
        if self._tokens_of is None:
            self._tokens_of = dict.fromkeys(self._refs, self._unit)
        return self._tokens_of

    def shared_tokens(self, hashes: Sequence[int], unit_tokens: int, upto: int | None = None) -> int:
        """Tokens of `hashes`' leading units (of the first `upto`, default all) already held by requests in flight
        here. The caller passes only the units the engine already has cached: requests admitted together compute a
        prefix that is not yet cached each in blocks of its own (vLLM shares a block only once it is computed and
        cached), so a burst of sub-agents forking a context the engine does not hold needs the context once per
        sub-agent."""
        n = len(hashes) if upto is None else min(upto, len(hashes))
        return self.held_prefix(hashes, 0, n) * unit_tokens

    def held_prefix(self, hashes: Sequence[int], start: int = 0, n: int | None = None) -> int:
        """How many leading units of `hashes[:n]` are held here, given that the first `start` are. Chained hashes
        make holding prefix-closed (a request holding unit k holds units 0..k-1), so a binary search finds it."""
        refs = self._refs
        hi = len(hashes) if n is None else n
        if start >= hi:
            return hi
        if not refs or hashes[start] not in refs:
            return start
        lo = start + 1  # hashes[:lo] are held; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in refs:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def remove(self, hashes: Sequence[int], unit_tokens: int, extra_tokens: int) -> None:
        """Undo one `add` with the same arguments (a unit's tokens are the ones it was first added with)."""
        self.version += 1
        refs = self._refs
        counts = list(map(refs.get, hashes))
        if self._tokens_of is None and None not in counts and len(set(hashes)) == len(counts):
            # Each unit once and held: new counts in C, the units no request holds any more dropped in C.
            refs.update(zip(hashes, map(int.__sub__, counts, repeat(1)), strict=True))
            gone = list(compress(hashes, map((1).__eq__, counts)))
            deque(map(refs.pop, gone), maxlen=0)
            self._shared_tokens = max(0, self._shared_tokens - len(gone) * self._unit)
        else:
            tokens_of = self._own_tokens()
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
