"""GPU profiles: the datasheet numbers the latency model turns into step times.

Every number is a published peak (dense, i.e. without 2:4 sparsity) unless it says "achievable"; the efficiencies turn
peaks into what serving kernels reach. Bandwidths are bytes per second, one direction, per GPU. The profiles themselves
are data: llmd/perf/data/gpus.yaml, extended by the user's profile folders (see profile_table.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from llmd.errors import UserError
from llmd.perf.efficiency import EFFICIENCY_UNITS, FRACTIONS, load_efficiency
from llmd.perf.profile_file import check_fields, field_types, pop_base
from llmd.perf.profile_table import ProfileTable


class UnknownProfileError(UserError, ValueError):
    """A GPU or model name the registry does not know; the message lists the names it does know."""


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator as the roofline latency model sees it."""

    name: str
    bf16_flops: float  # dense BF16 tensor-core FLOP/s
    fp8_flops: float  # dense FP8 tensor-core FLOP/s (= bf16_flops where there is no FP8 unit: weight-only FP8)
    hbm_bytes: float  # device memory as the driver reports it (nvidia-smi "Total")
    hbm_bw: float  # device memory bandwidth, B/s
    nvlink_bw: float  # intra-node GPU-GPU bandwidth per GPU per direction, B/s
    ib_bw: float  # inter-node bandwidth per GPU (its own NIC), B/s
    pcie_bw: float  # achievable host<->device bandwidth (pinned memory), B/s: the CPU KV tier's link
    mfu: float = 0.55  # fraction of peak FLOP/s large GEMMs and flash attention reach in serving
    bw_efficiency: float = 0.8  # fraction of peak HBM bandwidth streaming kernels reach
    link_efficiency: float = 0.8  # fraction of NVLink/IB peak that NCCL collectives and DeepEP all-to-all reach
    step_overhead_s: float = 0.5e-3  # per engine step: scheduler, input preparation, sampling, launch of the graph
    layer_overhead_s: float = 20e-6  # per layer and step: kernel launches and small-kernel tails that never saturate
    nvlink_latency_s: float = 5e-6  # fixed cost of one intra-node collective (one-shot all-reduce, NVLink all-to-all)
    net_latency_s: float = 20e-6  # fixed cost of one inter-node hop (RDMA write + completion + kernel sync)

    def __post_init__(self) -> None:
        for field_name in ("bf16_flops", "fp8_flops", "hbm_bytes", "hbm_bw", "nvlink_bw", "ib_bw", "pcie_bw"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"GPU profile {self.name!r}: {field_name} must be positive")
        for field_name in ("mfu", "bw_efficiency", "link_efficiency"):
            if not 0 < getattr(self, field_name) <= 1:
                raise ValueError(f"GPU profile {self.name!r}: {field_name} must be in (0, 1]")

    def step_overhead(self, num_layers: int) -> float:
        """Fixed time of one engine step of a `num_layers`-layer model, whatever the batch.

        Launch and scheduling costs scale with the number of kernels, i.e. with depth: on H100 this gives ~1.1 ms for
        a 32-layer 8B model and ~2 ms for 61-80-layer models, in line with the ~1-2 ms floor vLLM shows with CUDA
        graphs at batch 1.
        """
        return self.step_overhead_s + self.layer_overhead_s * num_layers


_DATASHEET_UNITS = {
    "bf16_flops": "FLOP/s",
    "fp8_flops": "FLOP/s",
    "hbm_bytes": "B",
    "hbm_bw": "B/s",
    "nvlink_bw": "B/s",
    "ib_bw": "B/s",
    "pcie_bw": "B/s",
}
_UNITS = {**_DATASHEET_UNITS, **{name: unit for name, unit in EFFICIENCY_UNITS.items() if unit is not None}}
_TYPES = field_types(GPUProfile)
_REQUIRED = [f.name for f in fields(GPUProfile) if f.default is MISSING and f.name != "name"]


def _read_entry(path: Path, name: str, raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    rest, base = pop_base(path, "GPU", name, raw)
    checked = check_fields(
        path, "GPU", name, rest, _TYPES, _UNITS, positive=_DATASHEET_UNITS, fractions=FRACTIONS, also=("base",)
    )
    return checked, base


def _make(name: str, values: dict[str, Any]) -> GPUProfile:
    missing = [field for field in _REQUIRED if field not in values]
    if missing:
        raise ValueError(f"a new GPU needs {', '.join(missing)}; give them, or `base: <a known GPU>` to start from one")
    return GPUProfile(name=name, **values)


# The built-in profiles live in llmd/perf/data/gpus.yaml, with their datasheet sources; the user's profile folders
# (LLMD_PERF_PATH, add_profile_dir) add GPUs or override fields, and their efficiency.yaml files apply last.
GPUS: Mapping[str, GPUProfile] = ProfileTable(
    "GPU", "gpus.yaml", _read_entry, _make, overlay=("efficiency.yaml", load_efficiency)
)


def get_gpu(name: str) -> GPUProfile:
    """The profile registered as `name` (exact, then case-insensitive); UnknownProfileError lists the known names."""
    if name in GPUS:
        return GPUS[name]
    folded = {key.lower(): profile for key, profile in GPUS.items()}
    if name.lower() in folded:
        return folded[name.lower()]
    raise UnknownProfileError(f"unknown GPU profile {name!r}; known GPU profiles: {', '.join(GPUS)}")
