"""The simulated vLLM engine: a pure, deterministic engine core (this package's request, kv_cache, scheduler and core
modules) behind a server that speaks vLLM's HTTP API, KV events and metrics."""

from .core import EngineCore, EngineStats, PullTask, RequestOutput, SimEngineConfig, StepCostModel, StepResult
from .kv_cache import KVCacheManager
from .request import FinishReason, RequestStatus, SimRequest
from .scheduler import EngineScheduler, SchedulerOutput

__all__ = [
    "EngineCore",
    "EngineScheduler",
    "EngineStats",
    "FinishReason",
    "KVCacheManager",
    "PullTask",
    "RequestOutput",
    "RequestStatus",
    "SchedulerOutput",
    "SimEngineConfig",
    "SimRequest",
    "StepCostModel",
    "StepResult",
]
