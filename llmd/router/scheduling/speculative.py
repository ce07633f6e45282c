"""Speculative prefix entries: blocks the router just sent somewhere, counted as cached there before the engine says so.

The engine's BlockStored events arrive only after it has prefilled, so a burst of sub-agents forking one fresh prefix
would otherwise scatter: every member looks cold. Routing inserts the request's block hashes for the chosen endpoint
with a short TTL; the precise scorer treats them as GPU hits until they expire (real events take over by then).

Pure: time is passed in. Bounded: at most `max_blocks` entries, oldest dropped first. Pruned lazily on insert.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from itertools import repeat

from llmd.router.scheduling.state import Holder


class SpeculativeIndex:
    """holder -> {block hash -> expiry}. One dict per holder so an insert is a single C-speed `dict.update`.

    Queries binary-search each holder's chain: a request's blocks are inserted together from its first block, and a
    later insert refreshes every block it shares (a shared block is always a prefix of the later chain), so along a
    chain the expiry never increases and "held and unexpired" is prefix-closed.
    """

    def __init__(self, ttl_s: float = 2.0, max_blocks: int = 1_000_000) -> None:
        if ttl_s < 0 or max_blocks < 1:
            raise ValueError("ttl_s must be >= 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._by_holder: dict[Holder, dict[int, float]] = {}
        self._latest: dict[Holder, float] = {}  # newest expiry per holder: lets a drop clear a whole holder at once
        self._log: deque[tuple[float, Holder, tuple[int, ...]]] = deque()  # inserts, oldest first
        self._logged = 0  # blocks in `_log` (an upper bound on entries: refreshed blocks count twice)

    def __len__(self) -> int:
        return sum(map(len, self._by_holder.values()))

    def insert(self, holder: Holder, block_hashes: Sequence[int], now: float) -> None:
        """`holder` was just sent a request with these blocks; they count as its GPU blocks until now + ttl."""
        if not block_hashes or self.ttl_s <= 0:
            return
        self.prune(now)
        expiry = now + self.ttl_s
        hashes = tuple(block_hashes)  # a copy: callers may keep growing their per-session list
        d = self._by_holder.get(holder)
        if d is None:
            d = self._by_holder[holder] = {}
        d.update(zip(hashes, repeat(expiry)))
        self._latest[holder] = max(expiry, self._latest.get(holder, expiry))
        self._log.append((expiry, holder, hashes))
        self._logged += len(hashes)
        while self._logged > self.max_blocks and len(self._log) > 1:
            self._drop_oldest()

    def prune(self, now: float) -> None:
        """Forget every entry that expired at or before `now`."""
        log = self._log
        while log and log[0][0] <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        expiry, holder, hashes = self._log.popleft()
        self._logged -= len(hashes)
        d = self._by_holder.get(holder)
        if d is None:
            return
        if self._latest[holder] <= expiry:  # nothing newer for this holder: drop it whole
            del self._by_holder[holder]
            del self._latest[holder]
            return
        get = d.get
        for h in hashes:
            if get(h) == expiry:  # not refreshed by a later insert
                del d[h]

    def match(
        self, block_hashes: Sequence[int], now: float, floor: Mapping[Holder, int] | None = None
    ) -> dict[Holder, int]:
        """Per holder, the leading blocks of the request it holds speculatively and unexpired, reported only where
        that beats `floor[holder]` (default 0; pass the real GPU prefix, so holders whose speculative entries add
        nothing cost one probe instead of a binary search). Read-only: expired entries are pruned on insert."""
        n = len(block_hashes)
        if not n or not self._by_holder:
            return {}
        floor = floor or {}
        last = block_hashes[n - 1]
        out: dict[Holder, int] = {}
        for holder, d in self._by_holder.items():
            get = d.get
            lo = floor.get(holder, 0)  # block_hashes[:lo] needs no look: the caller has it already
            if lo >= n:
                continue
            e = get(block_hashes[lo])
            if e is None or e <= now:
                continue
            e = get(last)
            if e is not None and e > now:
                out[holder] = n
                continue
            lo, hi = lo + 1, n - 1  # block_hashes[:lo] held; the held prefix is at most hi long
            while lo < hi:
                mid = (lo + hi + 1) // 2
                e = get(block_hashes[mid - 1])
                if e is not None and e > now:
                    lo = mid
                else:
                    hi = mid - 1
            out[holder] = lo
        return out

    def forget_pod(self, pod: str) -> None:
        for holder in [h for h in self._by_holder if h[0] == pod]:
            del self._by_holder[holder]
            del self._latest[holder]
