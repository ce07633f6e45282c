"""The no-hit-LRU scorer: spreads cold requests (nothing of theirs cached anywhere) over the endpoints least recently
given one, from the router's own routing history."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from llmd.kv.indexbase import new_ids_version
from llmd.router.scheduling.fused import K_CONST, K_LRU, Term, column
from llmd.router.scheduling.plugins import ScorerPlugin, ScoringContext, register_scorer
from llmd.router.scheduling.state import Candidate, Decision, Holder, RouteRequest


class NoHitLRUScorer:
    """Spreads cold requests (no candidate holds any prefix): endpoints never given a cold request score 1, the
    others by how long ago they got one, least recent highest. Warm requests: 0.5 for all (neutral).

    Stateful: `observe_routed` records the cold hops of each routed decision.
    """

    name = "no-hit-lru"

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[Holder, int] = {}
        # The stamps again by holder id, for the columns: a gather through ids the fleet keeps across decisions
        # (`holder_ids`), not a dict lookup per endpoint (at 544 endpoints most of this scorer's time). The last
        # element is the 0 that id -1 (a holder never given a cold request) reads.
        self._ids: dict[Holder, int] = {}
        self._stamps = np.zeros(1, np.int64)
        self.ids_version = new_ids_version()

    def holder_ids(self, holders: Iterable[Holder]) -> np.ndarray:
        """HolderIds for Columns.holder_ids: each holder's id here, -1 for one never given a cold request."""
        get = self._ids.get
        return np.fromiter((get(h, -1) for h in holders), np.intp)

    def record_cold(self, holder: Holder) -> None:
        self._clock += 1
        self._last[holder] = self._clock
        hid = self._ids.get(holder)
        if hid is None:
            hid = self._ids[holder] = len(self._ids)
            self.ids_version = new_ids_version()
            if hid + 1 >= len(self._stamps):  # room for it and the trailing 0
                grown = np.zeros(2 * len(self._stamps) + 1, np.int64)
                grown[:hid] = self._stamps[:hid]
                self._stamps = grown
        self._stamps[hid] = self._clock

    def observe_routed(
        self, req: RouteRequest, decision: Decision, now: float, capacity: Mapping[Holder, tuple[int, int]]
    ) -> None:
        if decision.cold:
            self.record_cold(decision.target.holder)
        if decision.pd is not None and decision.pd.cold:
            self.record_cold(decision.pd.prefill.holder)

    def forget_pod(self, pod: str) -> None:
        for holder in [h for h in self._last if h[0] == pod]:
            del self._last[holder]
            self._stamps[self._ids[holder]] = 0  # its id stays, stamped never

    def score(self, ctx: ScoringContext, cands: Sequence[Candidate]) -> list[float]:
        n = len(cands)
        if ctx.cold is False:
            return [0.5] * n
        last = self._last
        stamps = [last.get(c.endpoint.holder, 0) for c in cands]
        used = sorted({s for s in stamps if s})
        if not used:
            return [1.0] * n
        # the least recently used of m used endpoints scores m/(m+1), the most recent 1/(m+1); never used: 1
        m = len(used)
        rank = {s: i for i, s in enumerate(used)}
        return [1.0 if not s else (m - rank[s]) / (m + 1) for s in stamps]

    def term(self, ctx: ScoringContext) -> Term:
        assert ctx.columns is not None
        if ctx.cold is False:
            return (K_CONST, 0.5)
        if not self._last:
            return (K_CONST, 1.0)
        return (K_LRU, self._stamps, ctx.columns.holder_ids(self))

    def score_columns(self, ctx: ScoringContext, idx: np.ndarray) -> np.ndarray:
        return column(self.term(ctx), idx)


register_scorer(ScorerPlugin("no-hit-lru", lambda s: NoHitLRUScorer(), spreads_cold=True))
