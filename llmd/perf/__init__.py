"""The latency model: GPU and model profiles and a roofline step-time model, shared by the simulated engine (how long
each engine step takes) and the cluster simulator. Pure and deterministic; the only I/O is reading a config.json."""

from llmd.perf.gpus import GPUS, GPUProfile, UnknownProfileError, get_gpu
from llmd.perf.latency import LatencyModel, Parallelism, StepBreakdown
from llmd.perf.models import MODELS, SUPPORTED_MODEL_TYPES, ModelProfile, get_model, lookup_model, model_for_spec

__all__ = [
    "GPUS",
    "MODELS",
    "SUPPORTED_MODEL_TYPES",
    "GPUProfile",
    "LatencyModel",
    "ModelProfile",
    "Parallelism",
    "StepBreakdown",
    "UnknownProfileError",
    "get_gpu",
    "get_model",
    "lookup_model",
    "model_for_spec",
]
