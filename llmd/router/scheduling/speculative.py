"""Speculative prefix entries: blocks the router just sent somewhere, counted as cached there before the engine says so.

The engine's BlockStored events arrive only after it has prefilled, so a burst of sub-agents forking one fresh prefix
would otherwise scatter: every member looks cold. Routing inserts the request's block hashes for the chosen endpoint
with a short TTL; the precise scorer treats them as GPU hits until they expire, or until the endpoint has computed the
request (`settle`): its KV events are then on their way, and from a moment later (`settle_s`) the index alone says
what the endpoint holds. Without that, an entry outlived the blocks it stood for: under KV pressure an engine evicts a
prefix within a second of computing it, and the router, counting the entry over the index's eviction, sent the
session's next turn back there to recompute it (llmd's cluster simulator showed it on the default demo: the prefill
pool held 55% of main sessions' prompts where the router expected 90%).

Pure: time is passed in. Bounded: at most `max_blocks` entries, oldest dropped first. Pruned lazily on insert.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from llmd.kv.index import KVIndex
from llmd.router.scheduling.chains import ChainSet
from llmd.router.scheduling.state import Holder

# The mirror index never evicts: entries leave it exactly as they leave the holders' dicts.
_NO_CAP = 1 << 26


class SpeculativeIndex:
    """Per holder, the requests sent there whose entries are alive: each a record of its chain and its expiry. A
    holder holds a block speculatively while an unexpired record's chain has it.

    Chains share prefixes (a session's turns, a burst's parent, the system prompt) and a block's hash names every
    block before it, so what a holder holds is the trie of its records' chains (chains.ChainSet), and its held prefix
    of a request is the longest prefix the request shares with one of them. Inserting a 3,000-block turn costs a
    search per long record alive at that holder, not an expiry written for each block (which, with dropping them
    again, was a third of a routing decision at 544 endpoints).

    `settle` brings a record's expiry forward; the blocks it shares with requests sent there before it and not
    computed yet stay held by those requests' own records (theirs to settle), and those a later request refreshed by
    that one's.

    The blocks are mirrored, per holder, in a KV index (`match_ids`): one walk of the request answers for every
    holder at once, where `match` looks holder by holder. A record's blocks enter it past the prefix the holder's
    other records share with it, and leave it likewise when the record is dropped. Inserts come in time order (as
    `prune` assumes), so the only expired records not pruned yet are at the logs' fronts; a query takes those out of
    their holders' sets for its answer.
    """

    def __init__(self, ttl_s: float = 2.0, max_blocks: int = 1_000_000, settle_s: float = 0.1) -> None:
        if ttl_s < 0 or max_blocks < 1 or settle_s < 0:
            raise ValueError("ttl_s and settle_s must be >= 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.max_blocks = max_blocks
        self._by_holder: dict[Holder, _Holding] = {}  # alive records, per holder
        self._held = KVIndex(max_entries=_NO_CAP)  # which holder holds which block: the records' chains, as an index
        self._log: deque[tuple[float, _Record]] = deque()  # inserts, oldest first (their expiries never decrease)
        self._logged = 0  # blocks of alive records (an upper bound on entries: shared blocks count once per record)
        self._entries = 0  # (holder, block) pairs held
        self._last_expiry = -math.inf
        self._open: dict[_Key, _Record] = {}  # inserts not settled yet, by what `settle` is told of them
        # Settled records, by their new expiry: `settle_s` after a time that only grows, so in expiry order too.
        self._settled: deque[tuple[float, _Record]] = deque()

    def __len__(self) -> int:
        return self._entries

    def insert(self, holder: Holder, block_hashes: Sequence[int], now: float) -> None:
        """`holder` was just sent a request with these blocks; they count as its GPU blocks until now + ttl."""
        if not block_hashes or self.ttl_s <= 0:
            return
        self.prune(now)
        hashes = tuple(block_hashes)  # a copy: callers may keep growing their per-session list
        n = len(hashes)
        expiry = max(now + self.ttl_s, self._last_expiry)  # the log stays in expiry order
        self._last_expiry = expiry
        hold = self._by_holder.get(holder)
        if hold is None:
            hold = self._by_holder[holder] = _Holding()
        held = hold.chains.longest(hashes)
        if held < n:
            # The mirror needs only the blocks new to this holder (a tuple: the index reads it without a copy, and the
            # whole of it, [0:], is the tuple itself).
            self._held.store(holder, hashes[held:])
            self._entries += n - held
        rec = _Record(holder, hashes, expiry, (holder, now, n, hashes[-1]))
        hold.records[rec] = None
        hold.chains.add(hashes)
        self._open[rec.key] = rec
        self._log.append((expiry, rec))
        self._logged += n
        while self._logged > self.max_blocks and len(self._log) > 1:
            self._drop_oldest()

    def settle(self, holder: Holder, block_hashes: Sequence[int], routed_at: float, now: float) -> None:
        """`holder` has computed the request routed to it at `routed_at` (its prefill ended, or the request did): its
        record expires `settle_s` from now, in time for the KV events to arrive. The blocks it shares with requests
        sent there and not computed yet stay held by those."""
        if not block_hashes:
            return
        rec = self._open.pop((holder, routed_at, len(block_hashes), block_hashes[-1]), None)
        if rec is None or not rec.alive:
            return  # not inserted (no TTL), or dropped already
        expiry = now + self.settle_s
        if expiry < rec.expiry:
            rec.expiry = expiry
            self._settled.append((expiry, rec))

    def prune(self, now: float) -> None:
        """Forget every entry that expired at or before `now`."""
        due: dict[Holder, dict[_Record, None]] = {}
        for log in (self._log, self._settled):
            while log and log[0][0] <= now:
                _, rec = log.popleft()
                if rec.alive:
                    due.setdefault(rec.holder, {})[rec] = None
        for holder, recs in due.items():
            hold = self._by_holder[holder]
            if len(recs) < len(hold.records):
                for rec in recs:
                    self._drop(rec)
                continue
            # Every record there goes (a burst routed together expires together): its blocks all leave the mirror
            # at once, without the set kept up to date record by record.
            blocks = _distinct_blocks(recs)
            self._held.remove(holder, blocks)
            self._entries -= len(blocks)
            for rec in recs:
                self._retire(rec)
            del self._by_holder[holder]

    def _drop_oldest(self) -> None:
        _, rec = self._log.popleft()
        if rec.alive:
            self._drop(rec)

    def _retire(self, rec: _Record) -> None:
        """A record leaves the bookkeeping (its holder's set and the mirror are the caller's)."""
        rec.alive = False
        self._logged -= len(rec.hashes)
        self._open.pop(rec.key, None)

    def _drop(self, rec: _Record) -> None:
        """Forget a record, and the blocks of its chain none of its holder's other records hold."""
        self._retire(rec)
        n = len(rec.hashes)
        hold = self._by_holder[rec.holder]
        del hold.records[rec]
        hold.chains.remove(rec.hashes)
        kept = hold.chains.longest(rec.hashes)
        if kept < n:
            self._held.remove(rec.holder, rec.hashes[kept:])
            self._entries -= n - kept
        if not hold.records:
            del self._by_holder[rec.holder]

    def match(
        self, block_hashes: Sequence[int], now: float, floor: Mapping[Holder, int] | None = None
    ) -> dict[Holder, int]:
        """Per holder, the leading blocks of the request it holds speculatively and unexpired, reported only where
        that beats `floor[holder]` (default 0; pass the real GPU prefix, so holders whose speculative entries add
        nothing cost a probe a record instead of a binary search). Read-only: expired entries are pruned on insert."""
        n = len(block_hashes)
        if not n or not self._by_holder:
            return {}
        floor = floor or {}
        stale = self._stale(now)
        out: dict[Holder, int] = {}
        for holder, hold in self._by_holder.items():
            lo = floor.get(holder, 0)
            expired = stale.get(holder)
            got = hold.longest(block_hashes, lo) if expired is None else hold.longest_without(expired, block_hashes, lo)
            if got > lo:
                out[holder] = got
        return out

    def _stale(self, now: float) -> dict[Holder, list[_Record]]:
        """Records expired by `now` but not pruned yet, by holder: they are at the logs' fronts."""
        stale: dict[Holder, dict[_Record, None]] = {}
        for log in (self._log, self._settled):
            for expiry, rec in log:
                if expiry > now:
                    break
                if rec.alive and rec.expiry <= now:
                    stale.setdefault(rec.holder, {})[rec] = None
        return {holder: list(recs) for holder, recs in stale.items()}

    def match_ids(self, block_hashes: Sequence[int], now: float) -> np.ndarray:
        """`match` for every holder at once, by holder id (`holder_ids`; a 0 at -1 for holders without entries):
        each holder's leading blocks of the request held speculatively and unexpired, 0 for none. No floor: the
        caller compares with its own (`match` reports a holder only where it beats the floor)."""
        got = self._held.query_columns(block_hashes).blocks_any
        if not np.count_nonzero(got):  # (ndarray.any() is a Python-level reduction, three times the cost)
            return got
        stale = self._stale(now)  # expired but not pruned yet: their holders' records say what is left
        if stale:
            ids = self._held.holder_ids(stale).tolist()
            for (holder, expired), hid in zip(stale.items(), ids, strict=True):
                got[hid] = self._by_holder[holder].longest_without(expired, block_hashes, 0)
        return got

    @property
    def ids_version(self) -> int:
        return self._held.ids_version

    def holder_ids(self, holders: Iterable[Holder]) -> np.ndarray:
        """Each holder's id in `match_ids`' answer, -1 for one without entries; valid while `ids_version` holds."""
        return self._held.holder_ids(holders)

    def forget_pod(self, pod: str) -> None:
        for holder in [h for h in self._by_holder if h[0] == pod]:
            recs = self._by_holder.pop(holder).records
            for rec in recs:
                self._retire(rec)
            self._entries -= len(_distinct_blocks(recs))
        self._held.drop_pod(pod)


def _distinct_blocks(recs: Iterable[_Record]) -> list[int]:
    """The blocks of the records' chains, each once. A block names every block before it, so a chain's blocks
    that an earlier chain has are the prefix they share: the rest of it is new (a search a chain, where hashing
    every block of a burst's 3,000-block chains into a dict was half of dropping them)."""
    seen = ChainSet()
    out: list[int] = []
    for rec in recs:
        out += rec.hashes[seen.longest(rec.hashes) :]
        seen.add(rec.hashes)
    return out


_Key = tuple[Holder, float, int, int]  # an insert: holder, time, chain length, last block


class _Holding:
    """A holder's alive records, and their chains as a set (what it holds while none has expired)."""

    __slots__ = ("chains", "records")

    def __init__(self) -> None:
        self.records: dict[_Record, None] = {}  # insertion order, removal by key
        self.chains = ChainSet()

    def longest(self, block_hashes: Sequence[int], lo: int) -> int:
        """The leading blocks of the request its records hold, or `lo` if that is more."""
        return self.chains.longest(block_hashes, None, lo)

    def longest_without(self, expired: list[_Record], block_hashes: Sequence[int], lo: int) -> int:
        """`longest` over the records but `expired` (alive, not pruned yet): taken out of the set for the question
        and put back, a few records' worth of work rather than a look at every record."""
        if len(expired) == len(self.records):
            return lo  # all of them expired
        chains = self.chains
        for rec in expired:
            chains.remove(rec.hashes)
        try:
            return chains.longest(block_hashes, None, lo)
        finally:
            for rec in expired:
                chains.add(rec.hashes)


class _Record:
    """One request's speculative entries at one holder."""

    __slots__ = ("alive", "expiry", "hashes", "holder", "key")

    def __init__(self, holder: Holder, hashes: tuple[int, ...], expiry: float, key: _Key) -> None:
        self.holder = holder
        self.hashes = hashes
        self.expiry = expiry
        self.key = key
        self.alive = True
