"""The router's in-flight ledger: what it has sent to each endpoint and not yet seen finish. Pure bookkeeping, no I/O.

Per endpoint: requests in flight (admission's slots), their uncached prompt tokens (prefill work sent there) and the
KV they may occupy (kv_demand.InflightKV, for KV admission). A `Flight` is one admitted attempt: the slots it holds at
its target and, with P/D, at its prefill endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmd.router.pods import Pod
from llmd.router.scheduling import Decision
from llmd.router.scheduling.kv_demand import InflightKV
from llmd.router.scheduling.state import Holder

# InflightKV.add's arguments for one request at one endpoint: (prompt unit hashes, tokens per unit, extra tokens).
KVKey = tuple[Sequence[int], int, int]
NO_KV: KVKey = ((), 0, 0)


@dataclass(slots=True)
class Load:
    """What the router has in flight at one endpoint: always fresh, unlike the engine's scraped gauges."""

    inflight: int = 0
    inflight_tokens: int = 0
    kv: InflightKV = field(default_factory=InflightKV)
    version: int = 0  # bumped by every take and give: the router core rebuilds an endpoint's state only then


@dataclass(slots=True, eq=False)
class Flight:
    """One admitted attempt: the slots it holds and what the response headers report."""

    decision: Decision
    target: Pod
    rank: int
    uncached: int
    load: Load
    kv: KVKey = NO_KV
    prefill: Pod | None = None
    prefill_rank: int = 0
    prefill_kv: KVKey = NO_KV  # the prompt (and one token) the prefill endpoint holds until the decode pod pulls it
    prefill_load: Load | None = None
    released: bool = False
    routed_at: float = 0.0  # when the decision was taken (the speculative entries it made are settled from it)


class Ledger:
    """Every endpoint's `Load`, by KVIndex holder id (pod, DP rank). Entries outlive a pod's downtime: requests sent
    before it went down still end, and give back what they took."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.max_inflight = max_inflight
        self._loads: dict[Holder, Load] = {}
        # Loads changed since the router core last read them: it keeps its columns current from these alone.
        self.touched: list[Load] = []

    def load(self, holder: Holder) -> Load:
        got = self._loads.get(holder)
        if got is None:
            got = self._loads[holder] = Load()
        return got

    def inflight(self, holder: Holder) -> int:
        got = self._loads.get(holder)
        return got.inflight if got is not None else 0

    def has_room(self, holder: Holder) -> bool:
        return self.inflight(holder) < self.max_inflight

    def total(self) -> int:
        return sum(ld.inflight for ld in self._loads.values())

    def take(self, holder: Holder, tokens: int, kv: KVKey) -> Load:
        ld = self.load(holder)
        self.touched.append(ld)
        ld.version += 1
        ld.inflight += 1
        ld.inflight_tokens += tokens
        ld.kv.add(*kv)
        return ld

    def give(self, ld: Load, tokens: int, kv: KVKey) -> None:
        self.touched.append(ld)
        ld.version += 1
        ld.inflight = max(0, ld.inflight - 1)
        ld.inflight_tokens = max(0, ld.inflight_tokens - tokens)
        ld.kv.remove(*kv)
