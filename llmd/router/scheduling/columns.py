"""A snapshot as columns: one numpy array per endpoint field, aligned with `Snapshot.candidates`, so a filter is a mask
and a scorer a vector op over a hop's endpoints (hundreds of them per decision on a large fleet).

`Columns.of` builds them from candidates (any snapshot); the router core keeps its own up to date as the ledger and
the engines' gauges change (llmd.router.core), and builds an `EndpointState` only for the few endpoints a decision
names. Every value is the one the candidate's state holds, so the array pipeline decides as the list one would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from llmd.router.scheduling.state import HOP_ROLES, Candidate, Endpoint, EndpointState, Holder, Hop

if TYPE_CHECKING:
    from llmd.kv.indexbase import PrefixColumns, PrefixMatch

I64 = np.int64


def kv_need(need_tokens: int, block_size: int) -> int:
    """filters.kv_fits' need: blocks are allocated whole."""
    return -(-need_tokens // block_size) * block_size if block_size > 0 else need_tokens


class HolderIds(Protocol):
    """What maps holders to a KV index's holder ids (KVIndex, or the speculative index's own)."""

    @property
    def ids_version(self) -> int: ...

    def holder_ids(self, holders: Iterable[Holder]) -> np.ndarray: ...


class IndexReader(HolderIds, Protocol):
    """What a scorer reads of a KV index: either index, or the router core's wrapper of one with this decision's
    query already answered (llmd.router.core._QueriedIndex)."""

    def query(self, block_hashes: Sequence[int]) -> list[PrefixMatch]: ...

    def query_columns(self, block_hashes: Sequence[int]) -> PrefixColumns: ...


class Columns:
    """Per-endpoint fields as arrays, position i being the snapshot's i-th candidate: the ones the pipeline reads for
    every endpoint of a hop (the rest, running and cpu_capacity_blocks, only in the `state` of the few a decision
    names). `inflight_kv_tokens` is read only through `kv_fits` and `room` (the router core computes it per request,
    and only where it can decide a fit)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        healthy: np.ndarray,
        waiting: np.ndarray,
        kv_usage: np.ndarray,
        inflight: np.ndarray,
        inflight_tokens: np.ndarray,
        kv_capacity_blocks: np.ndarray,
        roles: dict[str, np.ndarray] | None = None,
        slot: dict[Holder, int] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.n = len(endpoints)
        self.healthy = healthy
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.inflight = inflight
        self.inflight_tokens = inflight_tokens
        self.kv_capacity_blocks = kv_capacity_blocks
        self._roles = roles if roles is not None else role_masks(endpoints)
        self._routable: dict[Hop, np.ndarray] = {}
        self._slot = slot  # holder -> position, when given (the router core keeps its own)
        self._holders: list[Holder] | None = None
        self._ids: dict[int, np.ndarray] = {}

    @classmethod
    def of(cls, cands: Sequence[Candidate]) -> Columns:
        """The columns of any candidates (a snapshot built by hand, or by a driver other than the router core)."""
        sts = [c.state for c in cands]

        def col(name: str, dtype: type = I64) -> np.ndarray:
            return np.array([getattr(s, name) for s in sts], dtype=dtype)

        got = _Given(
            [c.endpoint for c in cands],
            healthy=np.array([s.healthy for s in sts], dtype=bool),
            waiting=col("waiting"),
            kv_usage=col("kv_usage", np.float64),
            inflight=col("inflight"),
            inflight_tokens=col("inflight_tokens"),
            kv_capacity_blocks=col("kv_capacity_blocks"),
        )
        got.states = sts
        got.inflight_kv_tokens = col("inflight_kv_tokens")
        return got

    # --- what the pipeline reads ----------------------------------------------------------------------------------
    @property
    def holders(self) -> list[Holder]:
        if self._holders is None:
            self._holders = [ep.holder for ep in self.endpoints]
        return self._holders

    def slot_of(self) -> dict[Holder, int] | None:
        """holder -> position, or None when two endpoints share a holder (then callers go holder by holder)."""
        if self._slot is None:
            hs = self.holders
            slot = {h: i for i, h in enumerate(hs)}
            self._slot = slot if len(slot) == len(hs) else {}
        return self._slot or None

    def holder_ids(self, index: HolderIds) -> np.ndarray:
        """Each endpoint's holder id in `index` (-1: none there), so a by-id answer gathers into a column."""
        version = index.ids_version
        got = self._ids.get(version)
        if got is None:
            got = self._ids[version] = index.holder_ids(self.holders)
        return got

    def routable(self, hop: Hop) -> np.ndarray:
        """Positions of the healthy endpoints that may take `hop` (filters.routable), ascending."""
        got = self._routable.get(hop)
        if got is None:
            got = self._routable[hop] = np.flatnonzero(self._roles[hop] & self.healthy)
        return got

    def in_role(self, hop: Hop) -> bool:
        """Whether any endpoint, healthy or not, has a role that may take `hop`."""
        return bool(self._roles[hop].any())

    def kv_fits(self, idx: np.ndarray, need_tokens: int, block_size: int) -> np.ndarray:
        """filters.kv_fits of the endpoints at `idx`, as a mask aligned with it."""
        cap = self.kv_capacity_blocks[idx]
        loose = (cap <= 0) | (self.inflight[idx] <= 0)
        limit = (cap - 1) * block_size - kv_need(need_tokens, block_size)
        return loose | (self._inflight_kv(idx) <= limit)

    def room(
        self, idx: np.ndarray, max_inflight: int | None, need_tokens: int, block_size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(slots, fit): the positions of `idx` with a slot (in flight below `max_inflight`; all of them when None)
        and those of them `kv_fits` keeps, in `idx`'s order."""
        slots = idx if max_inflight is None else idx[self.inflight[idx] < max_inflight]
        return slots, slots[self.kv_fits(slots, need_tokens, block_size)]

    def _inflight_kv(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def state(self, i: int) -> EndpointState:
        raise NotImplementedError

    def candidate(self, i: int) -> Candidate:
        return Candidate(self.endpoints[i], self.state(i))

    def candidates(self, idx: np.ndarray) -> list[Candidate]:
        return [self.candidate(i) for i in idx.tolist()]


class _Given(Columns):
    """Columns of candidates given whole: their states are at hand."""

    states: list[EndpointState]
    inflight_kv_tokens: np.ndarray

    def _inflight_kv(self, idx: np.ndarray) -> np.ndarray:
        return self.inflight_kv_tokens[idx]

    def state(self, i: int) -> EndpointState:
        return self.states[i]


def role_masks(endpoints: Sequence[Endpoint]) -> dict[str, np.ndarray]:
    """Per hop, which endpoints' roles may take it."""
    return {hop: np.array([ep.role in roles for ep in endpoints], dtype=bool) for hop, roles in HOP_ROLES.items()}


class HitColumns:
    """A prefix source's hits aligned with a snapshot's columns: units (blocks or chunks) and tokens per tier, and
    whether the endpoint has a hit at all (PrefixHit present)."""

    __slots__ = ("cpu", "cpu_tokens", "gpu", "gpu_tokens", "has", "tokens", "units")

    def __init__(
        self,
        units: int,
        has: np.ndarray,
        gpu: np.ndarray,
        cpu: np.ndarray,
        gpu_t: np.ndarray,
        cpu_t: np.ndarray,
        tokens: np.ndarray | None = None,
    ) -> None:
        """`tokens`: gpu_t + cpu_t, when the caller has it already."""
        self.units = units  # the request's length in the source's units (PrefixHits.units)
        self.has = has
        self.gpu = gpu
        self.cpu = cpu
        self.gpu_tokens = gpu_t
        self.cpu_tokens = cpu_t
        self.tokens = gpu_t + cpu_t if tokens is None else tokens

    @classmethod
    def of(
        cls, by_holder: Mapping[Holder, tuple[int, int, int, int]], holders: Sequence[Holder], units: int
    ) -> HitColumns:
        """From a PrefixHits.by_holder mapping (PrefixHit: gpu, cpu, gpu_tokens, cpu_tokens), holder by holder."""
        get = by_holder.get
        got = [get(h) for h in holders]
        n = len(holders)
        rows = np.array([h if h is not None else (0, 0, 0, 0) for h in got], dtype=I64).reshape(n, 4)
        has = np.array([h is not None for h in got], dtype=bool)
        return cls(units, has, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3])
