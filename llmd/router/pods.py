"""What the router knows about each engine pod: where it is, whether it is up, its engine's reported load.

Plain state, no I/O: the endpoint registry (llmd.router.endpoints) fills it from /health and /metrics, the cluster
simulator from its engines; the router core reads it. What the router itself has in flight there is the core's
ledger (llmd.router.ledger), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from llmd.discovery import PodInfo

_GAUGES = frozenset({"running", "waiting", "kv_usage", "kv_capacity_blocks", "cpu_capacity_blocks"})


@dataclass
class RankState:
    """One DP rank's load as its engine reports it (/metrics, at most one poll interval old).

    `RankState.written` counts writes of the gauges, of every rank: a reader that saw the same count last time reads
    the same gauges (the router core keeps its gauge columns from one decision to the next until it moves). Counted in
    `__setattr__`, so no writer (scrape, simulator, test) can forget to."""

    written: ClassVar[int] = 0

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # KV capacity in blocks, from vllm:cache_config_info: KV admission and the approximate scorer's memory size.
    kv_capacity_blocks: int = 0
    cpu_capacity_blocks: int = 0
    engine_id: str | None = None  # learned from a prefill response's kv_transfer_params
    side_channel: tuple[str, int] | None = None  # likewise

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _GAUGES:
            RankState.written += 1


@dataclass
class Pod:
    info: PodInfo
    healthy: bool = False
    ranks: list[RankState] = field(default_factory=list)
    failures: int = 0
    last_change: float = 0.0
    replay_endpoints: dict[int, str] = field(default_factory=dict)  # learned from /kv_event_sources

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [RankState() for _ in range(self.info.dp_size)]

    @property
    def name(self) -> str:
        return self.info.name

    def engine_id_of(self, rank: int) -> str | None:
        return self.info.engine_id_of(rank) or self.ranks[rank].engine_id

    def side_channel_of(self, rank: int) -> tuple[str, int] | None:
        return self.info.side_channel_of(rank) or self.ranks[rank].side_channel

    def replay_address(self, rank: int) -> str | None:
        return self.info.replay_address(rank) or self.replay_endpoints.get(rank)

    def clear_load(self) -> None:
        """A pod that went down reports nothing: forget what it last reported."""
        for r in self.ranks:
            r.running = r.waiting = 0
            r.kv_usage = 0.0
