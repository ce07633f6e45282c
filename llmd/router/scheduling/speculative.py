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
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from llmd.kv.index import KVIndex
from llmd.router.scheduling.state import Holder

# The mirror index never evicts: entries leave it exactly as they leave the holders' dicts.
_NO_CAP = 1 << 26


class SpeculativeIndex:
    """holder -> {block hash -> expiry}. One dict per holder so an insert is a single C-speed `dict.update`.

    Queries binary-search each holder's chain: a request's blocks are inserted together from its first block, and a
    later insert refreshes every block it shares (a shared block is always a prefix of the later chain), so along a
    chain the expiry never increases and "held and unexpired" is prefix-closed. Inserts get strictly increasing
    expiries (a tick's share a `now`: one apart by an ulp), so the blocks an insert was the last to refresh are exactly
    those holding its expiry: a contiguous run of each chain, found by binary search when the insert expires or
    settles.

    `settle` keeps that order: it lowers only the blocks the settled request brought itself, not the leading ones it
    shares with requests sent there before it and not computed yet (theirs to settle), so no chain ever has an
    earlier block expire before a later one.

    The same blocks are mirrored, per holder, in a KV index (`match_ids`): one walk of the request answers for every
    holder at once, where `match` looks holder by holder. Inserts come in time order (as `prune` assumes), so only
    the holders of inserts at the log's front can hold expired entries that are not pruned yet; those alone are
    looked at one by one.
    """

    def __init__(self, ttl_s: float = 2.0, max_blocks: int = 1_000_000, settle_s: float = 0.1) -> None:
        if ttl_s < 0 or max_blocks < 1 or settle_s < 0:
            raise ValueError("ttl_s and settle_s must be >= 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.max_blocks = max_blocks
        self._by_holder: dict[Holder, dict[int, float]] = {}
        self._held = KVIndex(max_entries=_NO_CAP)  # which holder holds which block: the dicts' keys, as an index
        self._latest: dict[Holder, float] = {}  # newest expiry per holder: lets a drop clear a whole holder at once
        self._log: deque[tuple[float, Holder, tuple[int, ...], _Key]] = deque()  # inserts, oldest first
        self._logged = 0  # blocks in `_log` (an upper bound on entries: refreshed blocks count twice)
        self._last_expiry = -math.inf
        # Each insert not settled yet: its expiry, and how many leading blocks it shares with earlier requests to the
        # same holder that were not settled when it was inserted.
        self._open: dict[_Key, tuple[float, int]] = {}
        # Settled runs, by their new expiry: `settle_s` after a time that only grows, so in expiry order too.
        self._settled: deque[tuple[float, Holder, tuple[int, ...]]] = deque()

    def __len__(self) -> int:
        return sum(map(len, self._by_holder.values()))

    def insert(self, holder: Holder, block_hashes: Sequence[int], now: float) -> None:
        """`holder` was just sent a request with these blocks; they count as its GPU blocks until now + ttl."""
        if not block_hashes or self.ttl_s <= 0:
            return
        self.prune(now)
        hashes = tuple(block_hashes)  # a copy: callers may keep growing their per-session list
        expiry = now + self.ttl_s
        if expiry <= self._last_expiry:  # strictly later than every earlier insert (a tick's inserts share a `now`)
            expiry = math.nextafter(self._last_expiry, math.inf)
        self._last_expiry = expiry
        d = self._by_holder.get(holder)
        if d is None:
            d = self._by_holder[holder] = {}
        get = d.get
        # Blocks held are a prefix of the chain (prefix-closed), unsettled ones a prefix of those (expiries never
        # increase along a chain; a settled block expires within settle_s).
        shared = _leading(get, hashes, now + self.settle_s)
        held = _leading(get, hashes, -math.inf, shared)
        if held < len(hashes):
            self._held.store(holder, list(hashes[held:]))  # the mirror needs only the blocks new to this holder
        d.update(zip(hashes, repeat(expiry)))
        self._latest[holder] = expiry
        key = (holder, now, len(hashes), hashes[-1])
        self._open[key] = (expiry, shared)
        self._log.append((expiry, holder, hashes, key))
        self._logged += len(hashes)
        while self._logged > self.max_blocks and len(self._log) > 1:
            self._drop_oldest()

    def settle(self, holder: Holder, block_hashes: Sequence[int], routed_at: float, now: float) -> None:
        """`holder` has computed the request routed to it at `routed_at` (its prefill ended, or the request did): the
        blocks it brought there expire `settle_s` from now, in time for the KV events to arrive, unless a later insert
        (a request still on its way there) refreshed them. Blocks it shares with requests sent there before it and
        not computed yet stay as they are."""
        if not block_hashes:
            return
        opened = self._open.pop((holder, routed_at, len(block_hashes), block_hashes[-1]), None)
        d = self._by_holder.get(holder)
        if opened is None or d is None:
            return  # not inserted (no TTL), or dropped already
        mine, shared = opened
        expiry = now + self.settle_s
        if expiry >= mine:
            return
        run = _run(d.get, block_hashes, mine, shared)
        if run:
            d.update(zip(run, repeat(expiry)))
            self._settled.append((expiry, holder, run))

    def prune(self, now: float) -> None:
        """Forget every entry that expired at or before `now`."""
        log = self._log
        while log and log[0][0] <= now:
            self._drop_oldest()
        settled = self._settled
        while settled and settled[0][0] <= now:
            expiry, holder, hashes = settled.popleft()
            d = self._by_holder.get(holder)
            if d is not None:
                self._drop(d, holder, expiry, hashes)

    def _drop_oldest(self) -> None:
        expiry, holder, hashes, key = self._log.popleft()
        self._logged -= len(hashes)
        self._open.pop(key, None)
        d = self._by_holder.get(holder)
        if d is None:
            return
        if self._latest[holder] <= expiry:  # nothing newer for this holder: drop it whole
            self._held.remove(holder, list(d))
            del self._by_holder[holder]
            del self._latest[holder]
            return
        self._drop(d, holder, expiry, hashes)

    def _drop(self, d: dict[int, float], holder: Holder, expiry: float, hashes: tuple[int, ...]) -> None:
        """Forget the entries of `hashes` that still hold `expiry` (not refreshed by a later insert)."""
        gone = _run(d.get, hashes, expiry)
        if gone:
            deque(map(d.pop, gone, repeat(None)), maxlen=0)
            self._held.remove(holder, list(gone))

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
        out: dict[Holder, int] = {}
        for holder, d in self._by_holder.items():
            got = _held_prefix(d, block_hashes, floor.get(holder, 0), now)
            if got:
                out[holder] = got
        return out

    def match_ids(self, block_hashes: Sequence[int], now: float) -> np.ndarray:
        """`match` for every holder at once, by holder id (`holder_ids`; a 0 at -1 for holders without entries):
        each holder's leading blocks of the request held speculatively and unexpired, 0 for none. No floor: the
        caller compares with its own (`match` reports a holder only where it beats the floor)."""
        got = self._held.query_columns(block_hashes).blocks_any
        if not got.any():
            return got
        stale: set[Holder] = set()
        logs: tuple[Iterable[tuple[Any, ...]], ...] = (self._log, self._settled)
        for log in logs:
            for entry in log:  # expired but not pruned yet: their holders' dicts say what is left
                if entry[0] > now:
                    break
                stale.add(entry[1])
        if stale:
            ids = self._held.holder_ids(stale).tolist()
            for holder, hid in zip(stale, ids, strict=True):
                d = self._by_holder.get(holder)
                got[hid] = _held_prefix(d, block_hashes, 0, now) if d is not None else 0
        return got

    @property
    def ids_version(self) -> int:
        return self._held.ids_version

    def holder_ids(self, holders: Iterable[Holder]) -> np.ndarray:
        """Each holder's id in `match_ids`' answer, -1 for one without entries; valid while `ids_version` holds."""
        return self._held.holder_ids(holders)

    def forget_pod(self, pod: str) -> None:
        # `_latest` stays: the pod's next inserts must still expire after its old ones still in the log.
        for holder in [h for h in self._by_holder if h[0] == pod]:
            del self._by_holder[holder]
        self._held.drop_pod(pod)


_Key = tuple[Holder, float, int, int]  # an insert: holder, time, chain length, last block


def _leading(get: Callable[[int], float | None], hashes: Sequence[int], above: float, lo: int = 0) -> int:
    """The end of the blocks of the chain `hashes` from `lo` on that expire after `above` (a missing one never does).
    Expiries never increase along a chain, so one binary search answers."""
    hi = len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        e = get(hashes[mid])
        if e is not None and e > above:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _run(get: Callable[[int], float | None], hashes: Sequence[int], expiry: float, start: int = 0) -> tuple[int, ...]:
    """The blocks of the chain `hashes` (from `start` on) whose expiry is `expiry`: a contiguous run (expiries never
    increase along a chain), after those a later insert refreshed and before those settled or gone."""
    lo = _leading(get, hashes, expiry, start)
    return tuple(hashes[lo : _leading(get, hashes, math.nextafter(expiry, -math.inf), lo)])


def _held_prefix(d: dict[int, float], block_hashes: Sequence[int], lo: int, now: float) -> int:
    """The leading blocks of the request that `d` holds unexpired, if more than `lo` (the caller has
    block_hashes[:lo] already, so they need no look), else 0: one probe for a holder whose entries add nothing."""
    n = len(block_hashes)
    if lo >= n:
        return 0
    get = d.get
    e = get(block_hashes[lo])
    if e is None or e <= now:
        return 0
    e = get(block_hashes[n - 1])
    if e is not None and e > now:
        return n
    lo, hi = lo + 1, n - 1  # block_hashes[:lo] held; the held prefix is at most hi long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        e = get(block_hashes[mid - 1])
        if e is not None and e > now:
            lo = mid
        else:
            hi = mid - 1
    return lo
