"""The router core's routable endpoints as columns (scheduling.columns), kept current between decisions.

The ledger's columns change only where a request is taken or given back, so they are updated from the loads the
ledger touched since the last decision, not re-read for every endpoint. The engines' gauges are re-read in bulk when
any was written since the last decision (RankState.written). What the request being routed shares with the KV in
flight at an endpoint (inflight_kv_tokens) is worked out only where it can decide a fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from llmd.router.ledger import Ledger, Load
from llmd.router.pods import RankState
from llmd.router.scheduling import fused
from llmd.router.scheduling.columns import I64, Columns, HolderIds, kv_need, role_masks
from llmd.router.scheduling.state import Endpoint, EndpointState, Holder

# The gauges the pipeline reads for every endpoint of a hop, read per decision; `running` and `cpu_capacity_blocks`
# are read only for the endpoints whose states a decision builds (its target, its prefill endpoint).
_WAITING = attrgetter("waiting")
_KV_USAGE = attrgetter("kv_usage")
_KV_CAPACITY = attrgetter("kv_capacity_blocks")


class Fleet:
    """Every rank of every routable pod, in Snapshot's order, with the ledger's columns for them."""

    def __init__(self, slots: Sequence[tuple[Endpoint, RankState]], ledger: Ledger) -> None:
        self.endpoints = [ep for ep, _ in slots]
        self.ranks = [rs for _, rs in slots]
        self.loads: list[Load] = [ledger.load(ep.holder) for ep in self.endpoints]
        self._at = {id(ld): i for i, ld in enumerate(self.loads)}
        self.roles = role_masks(self.endpoints)
        self.slot = {ep.holder: i for i, ep in enumerate(self.endpoints)}
        n = len(self.endpoints)
        # Every routable pod is healthy, so `healthy` and each hop's routable positions are fixed for the fleet's
        # life: built once here, not per decision (read-only, as every decision's columns share them).
        self.healthy = _frozen(np.ones(n, dtype=bool))
        self.routable = {hop: _frozen(np.flatnonzero(m)) for hop, m in self.roles.items()}
        self.inflight = np.zeros(n, I64)
        self.inflight_tokens = np.zeros(n, I64)
        self.kv_tokens = np.zeros(n, I64)
        for i in range(n):
            self._read(i)
        self._ledger = ledger
        ledger.touched.clear()
        self._gauges: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.no_blocks = np.zeros(n, I64)  # `cached` of a request the index holds nothing of
        self._ids: dict[int, np.ndarray] = {}  # ids_version -> the endpoints' holder ids

    def gauges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """waiting, kv_usage and kv_capacity_blocks of every endpoint, as the engines report them now: re-read only
        when some rank's gauges were written since (RankState.written)."""
        written = RankState.written
        got = self._gauges
        if got is None or got[0] != written:
            ranks, n = self.ranks, len(self.ranks)
            # Read-only: every decision's columns share them until the gauges move (nothing writes a column).
            got = self._gauges = (
                written,
                _frozen(np.fromiter(map(_WAITING, ranks), I64, n)),
                _frozen(np.fromiter(map(_KV_USAGE, ranks), np.float64, n)),
                _frozen(np.fromiter(map(_KV_CAPACITY, ranks), I64, n)),
            )
        return got[1], got[2], got[3]

    def holder_ids(self, index: HolderIds) -> np.ndarray:
        """An index's id of each endpoint's holder (-1: none), kept until its ids change (the KV index's and the
        speculative index's ids are both read per decision; versions are unique across indexes)."""
        version = index.ids_version
        got = self._ids.get(version)
        if got is None:
            if len(self._ids) >= 8:  # older versions of the indexes' ids: never asked for again
                self._ids.clear()
            got = self._ids[version] = index.holder_ids(ep.holder for ep in self.endpoints)
        return got

    def _read(self, i: int) -> None:
        ld = self.loads[i]
        self.inflight[i] = ld.inflight
        self.inflight_tokens[i] = ld.inflight_tokens
        self.kv_tokens[i] = ld.kv.tokens

    def columns(
        self,
        excluded: set[str],
        hashes: Sequence[int],
        unit: int,
        cached: dict[Holder, int] | np.ndarray | None,
    ) -> RequestColumns:
        """This moment's columns for one request (`hashes`, `unit`: its InflightKV key; `cached`: as
        RouterCore.snapshot's, or those GPU blocks as a column aligned with the fleet), without the endpoints of the
        `excluded` pods."""
        touched = self._ledger.touched
        if touched:
            at = self._at
            for i in {at.get(id(ld)) for ld in touched}:
                if i is not None:
                    self._read(i)
            touched.clear()
        sel = None
        if excluded:
            sel = np.array([i for i, ep in enumerate(self.endpoints) if ep.pod not in excluded], dtype=np.intp)
        if isinstance(cached, dict):
            cached = np.fromiter((cached.get(ep.holder, 0) for ep in self.endpoints), I64, len(self.endpoints))
        return RequestColumns(self, sel, hashes, unit, cached)


class RequestColumns(Columns):
    """The fleet's columns at one moment, for one request: the gauges as read now, the ledger's columns as they are
    now, and inflight_kv_tokens less what the request shares with the KV in flight there (RouterCore.snapshot)."""

    def __init__(
        self, fleet: Fleet, sel: np.ndarray | None, hashes: Sequence[int], unit: int, cached: np.ndarray | None
    ) -> None:
        waiting, kv_usage, kv_capacity = fleet.gauges()
        if sel is None:
            endpoints, ranks, loads = fleet.endpoints, fleet.ranks, fleet.loads
            roles, slot, healthy = fleet.roles, fleet.slot, fleet.healthy
            # The ledger's columns are the fleet's to update in place: this moment's are a copy. The gauges are
            # replaced, never updated, when they move: shared.
            inflight, inflight_tokens, kv = fleet.inflight.copy(), fleet.inflight_tokens.copy(), fleet.kv_tokens.copy()
        else:
            take = sel.tolist()
            endpoints = [fleet.endpoints[i] for i in take]
            ranks = [fleet.ranks[i] for i in take]
            loads = [fleet.loads[i] for i in take]
            roles, slot = {hop: m[sel] for hop, m in fleet.roles.items()}, None
            inflight, inflight_tokens, kv = fleet.inflight[sel], fleet.inflight_tokens[sel], fleet.kv_tokens[sel]
            waiting, kv_usage, kv_capacity = waiting[sel], kv_usage[sel], kv_capacity[sel]
            healthy = np.ones(len(endpoints), dtype=bool)
        super().__init__(
            endpoints,
            healthy=healthy,
            waiting=waiting,
            kv_usage=kv_usage,
            inflight=inflight,
            inflight_tokens=inflight_tokens,
            kv_capacity_blocks=kv_capacity,
            roles=roles,
            slot=slot,
        )
        if sel is None:
            self._routable.update(fleet.routable)
        self._ranks = ranks
        self.kv_tokens = kv  # KV in flight, before what this request shares
        self._loads = loads
        self._hashes = hashes
        self._unit = unit
        self._cached = cached if cached is None or sel is None else cached[sel]  # GPU blocks cached, per endpoint
        self._fleet = fleet
        self._sel = sel
        self._exact: dict[int, int] = {}
        self._states: dict[int, EndpointState] = {}

    def inflight_kv(self, i: int) -> int:
        """inflight_kv_tokens at position i: the KV in flight there less this request's units held there, as far
        as the engine has them cached (InflightKV.shared_tokens)."""
        got = self._exact.get(i)
        if got is None:
            got = int(self.kv_tokens[i])
            unit = self._unit
            if unit and got:
                cached = self._cached
                n = len(self._hashes)
                upto = n if cached is None else int(cached[i])
                if upto:
                    got -= self._loads[i].kv.held_prefix(self._hashes, 0, min(upto, n)) * unit
            self._exact[i] = got
        return got

    def _inflight_kv(self, idx: np.ndarray) -> np.ndarray:
        return np.array([self.inflight_kv(i) for i in idx.tolist()], dtype=I64)

    def holder_ids(self, index: HolderIds) -> np.ndarray:
        """Columns.holder_ids from the fleet's, which it keeps across decisions."""
        ids = self._fleet.holder_ids(index)
        return ids if self._sel is None else ids[self._sel]

    def room(
        self, idx: np.ndarray, max_inflight: int | None, need_tokens: int, block_size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Columns.room in one pass over `idx` (fused.room), working out what the request shares only where the KV
        in flight without it does not fit and sharing could make it (the same answer as through `kv_fits`, which
        works it out wherever the KV does not fit unshared)."""
        slots, fit, doubt = fused.room(
            idx, self.inflight, max_inflight, self.kv_capacity_blocks, self.kv_tokens, self._cached,
            len(self._hashes), self._unit, need_tokens, block_size,
        )  # fmt: skip
        if len(doubt):
            need, cap, at = kv_need(need_tokens, block_size), self.kv_capacity_blocks, fit.tolist()
            out = [j for j in doubt.tolist() if self.inflight_kv(at[j]) > (int(cap[at[j]]) - 1) * block_size - need]
            if out:
                fit = np.delete(fit, out)
        return slots, fit

    def state(self, i: int) -> EndpointState:
        """Endpoint i's state; `running` and `cpu_capacity_blocks` as its engine reports them now (within a decision
        nothing changes them)."""
        got = self._states.get(i)
        if got is None:
            rank = self._ranks[i]
            got = self._states[i] = EndpointState(
                healthy=True,
                waiting=int(self.waiting[i]),
                running=rank.running,
                kv_usage=float(self.kv_usage[i]),
                inflight=int(self.inflight[i]),
                inflight_tokens=int(self.inflight_tokens[i]),
                inflight_kv_tokens=self.inflight_kv(i),
                kv_capacity_blocks=int(self.kv_capacity_blocks[i]),
                cpu_capacity_blocks=rank.cpu_capacity_blocks,
            )
        return got


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
