"""Where each engine of a deployment listens: one port convention shared by launchers, engines and the router.

Per pool, replica r of a pool whose base port is P serves HTTP on P + r; its DP ranks publish KV events on
P + 1000 + r * dp_size + rank (vLLM adds the rank to the configured endpoint's port itself) and answer KV pulls on the
side channel P + 2000 + r * dp_size + rank, and serve KV-event replays on P + 3000 + r * dp_size + rank. Each replica's
NixlConnector engine id is its name (`decode-0`; vLLM appends `_dp<rank>` for ranks > 0), so a router can address a
peer for a P2P pull without asking it first. On a real cluster each replica sits on its own node(s), so the same numbers
never collide; on one machine they don't either, because pools keep 100 ports apart (see the spec's defaults).
`port: auto` makes every port of a pool 0 here: each engine binds free ones and publishes them (llmd.discovery), and so
does an engine launched by llmd whose layout port turns out to be taken on a shared node.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.spec.model import DeploymentSpec, PoolSpec

KV_EVENTS_OFFSET = 1000
SIDE_CHANNEL_OFFSET = 2000
REPLAY_OFFSET = 3000
RANK_HTTP_OFFSET = 4000  # a per-rank API server's HTTP port (launch mode "per-rank", llmd.engines.vllm)
DP_RPC_OFFSET = 5000  # a DP replica's --data-parallel-rpc-port, + replica (llmd.engines.vllm)
MAX_POOL_RANKS = 1000  # the rank bands are 1000 apart
MAX_PORT = 65535


def highest_port(pool: PoolSpec) -> int:
    """The last port of a numbered pool's layout: its replicas' HTTP ports, each rank's KV-event, side-channel, replay
    and per-rank HTTP ports, and (DP replicas) the DP RPC ports. The spec refuses a base whose layout passes
    MAX_PORT."""
    assert pool.port != "auto"
    top = max(pool.replicas - 1, RANK_HTTP_OFFSET + pool.ranks - 1)
    if pool.dp_size > 1:
        top = max(top, DP_RPC_OFFSET + pool.replicas - 1)
    return pool.port + top


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine server (a replica: all its DP ranks) and the ports it uses."""

    role: str
    replica: int
    host: str
    http_port: int
    dp_size: int
    kv_events_port: int  # rank 0's; rank k publishes on kv_events_port + k
    side_channel_port: int  # rank 0's; rank k answers on side_channel_port + k
    replay_port: int  # rank 0's KV-event replay ROUTER; rank k's is replay_port + k

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica}"

    @property
    def engine_id(self) -> str:
        return self.name

    def kv_events_endpoint(self, bind: bool = True) -> str:
        """The PUB endpoint: `tcp://*:P` makes the engine bind (the subscriber connects), as vLLM reads it."""
        return f"tcp://{'*' if bind else self.host}:{self.kv_events_port}"

    def replay_endpoint(self, bind: bool = True) -> str:
        return f"tcp://{'*' if bind else self.host}:{self.replay_port}"


def engine_endpoints(spec: DeploymentSpec, host: str = "127.0.0.1") -> list[EngineEndpoint]:
    """Every replica's layout ports; a pool with `port: auto` gets 0 everywhere (any free port, published by the
    engine once bound)."""
    out = []
    for role, pool in spec.pools.items():
        for r in range(pool.replicas):
            at = (lambda offset: 0) if pool.port == "auto" else (lambda offset, base=pool.port: base + offset)
            out.append(
                EngineEndpoint(
                    role=role,
                    replica=r,
                    host=host,
                    http_port=at(r),
                    dp_size=pool.dp_size,
                    kv_events_port=at(KV_EVENTS_OFFSET + r * pool.dp_size),
                    side_channel_port=at(SIDE_CHANNEL_OFFSET + r * pool.dp_size),
                    replay_port=at(REPLAY_OFFSET + r * pool.dp_size),
                )
            )
    return out
