"""The simulated vLLM engine: a pure, deterministic engine core (this package's request, kv_cache, scheduler and core
modules) behind a server that speaks vLLM's HTTP API, KV events and metrics."""

from .core import EngineCore, EngineStats, LatencyModel, PullTask, RequestOutput, SimEngineConfig, StepResult
from .kv_cache import KVCacheManager
from .request import FinishReason, RequestStatus, SimRequest
from .scheduler import Scheduler, SchedulerOutput

__all__ = [
    "EngineCore",
    "EngineStats",
    "FinishReason",
    "KVCacheManager",
    "LatencyModel",
    "PullTask",
    "RequestOutput",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SimEngineConfig",
    "SimRequest",
    "StepResult",
]
