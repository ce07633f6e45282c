"""The latency model: GPU and model profiles and a roofline step-time model, shared by the simulated engine (how long
each engine step takes) and the cluster simulator. Pure and deterministic; the only I/O is reading the profile files
(llmd/perf/data, LLMD_PERF_PATH, add_profile_dir) once, and a config.json."""

from llmd.perf.efficiency import EFFICIENCY_FIELDS, dump_efficiency, load_efficiency
from llmd.perf.gpus import GPUS, GPUProfile, UnknownProfileError, get_gpu
from llmd.perf.latency import LatencyModel, Parallelism, StepBreakdown
from llmd.perf.models import MODELS, SUPPORTED_MODEL_TYPES, ModelProfile, get_model, lookup_model, model_for_spec
from llmd.perf.profile_table import add_profile_dir, profile_dirs, reset_profiles

__all__ = [
    "EFFICIENCY_FIELDS",
    "GPUS",
    "MODELS",
    "SUPPORTED_MODEL_TYPES",
    "GPUProfile",
    "LatencyModel",
    "ModelProfile",
    "Parallelism",
    "StepBreakdown",
    "UnknownProfileError",
    "add_profile_dir",
    "dump_efficiency",
    "get_gpu",
    "get_model",
    "load_efficiency",
    "lookup_model",
    "model_for_spec",
    "profile_dirs",
    "reset_profiles",
]
