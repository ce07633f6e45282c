"""The simulator's own parameters beyond the latency model (llmd.perf): delays between the parts of the stack.

Defaults describe llmd's live stack on a cluster; `SimParams.load(path)` reads a YAML file of any subset (a user's
site: a slower network, a router that scrapes less often). Every value is in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from llmd.errors import UserError


@dataclass(frozen=True, slots=True)
class SimParams:
    # KV events: engine publish -> ZMQ -> router index. vLLM publishes a step's events after the step; the router's
    # SUB applies them on its event loop: about a millisecond on one host, a few across a network.
    kv_event_delay_s: float = 0.002
    # How often the router reads each engine's /metrics (waiting, running, KV usage): RouterConfig.metrics_interval_s.
    scrape_interval_s: float = 1.0
    # One HTTP hop router <-> engine (request out, first response bytes back), each way.
    hop_s: float = 0.0003
    # NIXL per transfer, beyond bytes over the link: handshake with the remote agent, descriptor lists, completion
    # notification (the link's own latency is in the latency model).
    transfer_overhead_s: float = 0.002
    # After the workload's duration, requests in flight get this long to finish (the live demo's STOP_GRACE_S).
    stop_grace_s: float = 20.0
    # CPU time of the processes around the GPUs (llmd.sim.host), per request, per prompt token, per streamed output
    # chunk, per /metrics scrape. The defaults are llmd's router process on a cluster (benchmarks/router.py: ~1,000
    # requests/s on one core, tokenization incremental); engine API servers and the agents are not modeled (0).
    client_cpu_s: float = 0.0
    client_cpu_per_token_s: float = 0.0  # per token the client writes: a session's whole first prompt, then new text
    router_cpu_s: float = 0.001
    router_cpu_per_token_s: float = 0.0  # per token a turn adds (incremental tokenization)
    engine_cpu_s: float = 0.0
    engine_cpu_per_token_s: float = 0.0  # per prompt token (an engine tokenizes the whole prompt of every request)
    stream_cpu_s: float = 0.0
    scrape_cpu_s: float = 0.0
    # One process for everything (`llmd demo`: engines, router and client on one event loop); else the router is one
    # process and each engine pod's API server another.
    colocated: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "colocated":
                if not isinstance(v, bool):
                    raise UserError(f"simulator parameter colocated must be true or false, got {v!r}")
                continue
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise UserError(f"simulator parameter {f.name} must be a number >= 0 (seconds), got {v!r}")
        if self.scrape_interval_s <= 0:
            raise UserError("simulator parameter scrape_interval_s must be > 0")

    @classmethod
    def load(cls, path: str | Path) -> SimParams:
        from llmd.spec.yaml_input import InputFileError, load_file

        p = Path(path)
        try:
            data: Any = load_file(p, "simulator parameter file")
        except InputFileError as e:
            raise UserError(f"cannot read simulator parameters {p}: {e.problem}") from None
        return cls().with_values(data or {}, str(p))

    def with_values(self, data: Any, where: str = "simulator parameters") -> SimParams:
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected a mapping of parameter: seconds, got {type(data).__name__}")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(
                f"{where}: unknown parameter(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}"
            )
        return replace(self, **data)
