"""GPU profiles: the datasheet numbers the latency model turns into step times.

Every number is a published peak (dense, i.e. without 2:4 sparsity) unless it says "achievable"; the efficiencies turn
peaks into what serving kernels reach. Bandwidths are bytes per second, one direction, per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmd.errors import UserError

MiB = 2**20
GB = 10**9


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


GPUS: dict[str, GPUProfile] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 and 1,979 TFLOP/s FP8 dense (1,979/3,958 "with sparsity"), 3.35 TB/s
    # HBM3, NVLink 4 at 900 GB/s total = 450 GB/s per direction. DGX H100: one ConnectX-7 NDR 400 Gb/s (50 GB/s) NIC
    # per GPU. PCIe Gen5 x16: 64 GB/s per direction, ~55 GB/s achievable with pinned memory. nvidia-smi reports
    # 81,559 MiB for the "80GB" part.
    "H100-80GB": GPUProfile(
        name="H100-80GB",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes=81559 * MiB,
        hbm_bw=3.35e12,
        nvlink_bw=450 * GB,
        ib_bw=50 * GB,
        pcie_bw=55 * GB,
    ),
    # NVIDIA H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s (nvidia-smi: 143,771 MiB); same NVLink 4,
    # ConnectX-7 and PCIe Gen5 as the H100 in HGX H200.
    "H200": GPUProfile(
        name="H200",
        bf16_flops=989e12,
        fp8_flops=1979e12,
        hbm_bytes=143771 * MiB,
        hbm_bw=4.8e12,
        nvlink_bw=450 * GB,
        ib_bw=50 * GB,
        pcie_bw=55 * GB,
    ),
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s BF16 dense, no FP8 tensor cores (FP8 checkpoints run weight-only, e.g. Marlin,
    # at the BF16 rate), 2,039 GB/s HBM2e, NVLink 3 at 600 GB/s total = 300 per direction, HDR 200 Gb/s (25 GB/s)
    # NICs in DGX A100, PCIe Gen4 x16 (32 GB/s peak, ~25 achievable). Older software stack: a little more overhead.
    "A100-80GB": GPUProfile(
        name="A100-80GB",
        bf16_flops=312e12,
        fp8_flops=312e12,
        hbm_bytes=81920 * MiB,
        hbm_bw=2.039e12,
        nvlink_bw=300 * GB,
        ib_bw=25 * GB,
        pcie_bw=25 * GB,
        step_overhead_s=0.6e-3,
        layer_overhead_s=25e-6,
    ),
    # NVIDIA HGX/DGX B200: 2.25 PFLOP/s BF16 and 4.5 PFLOP/s FP8 dense per GPU (half the "sparse" figures), 1,440 GB
    # HBM3e per 8 GPUs (180 GB each) at 62 TB/s per 8 GPUs (~7.7 TB/s each), NVLink 5 at 1.8 TB/s total = 900 GB/s per
    # direction, ConnectX-7 400 Gb/s NICs in DGX B200, PCIe Gen5 host link.
    "B200": GPUProfile(
        name="B200",
        bf16_flops=2250e12,
        fp8_flops=4500e12,
        hbm_bytes=180 * GB,
        hbm_bw=7.7e12,
        nvlink_bw=900 * GB,
        ib_bw=50 * GB,
        pcie_bw=55 * GB,
        step_overhead_s=0.4e-3,
        layer_overhead_s=15e-6,
    ),
    # This 2-core machine running the tiny model in the simulated engine. Not a datasheet: effective rates (so the
    # efficiencies are 1) chosen so that a time-scale-1 simulated run takes realistic-looking but short times: a
    # ~0.5 ms step floor, ~12 ms to prefill 1,000 tiny-model tokens. "Links" are memory copies and loopback TCP.
    "cpu": GPUProfile(
        name="cpu",
        bf16_flops=1e11,
        fp8_flops=1e11,
        hbm_bytes=8 * GB,
        hbm_bw=2e10,
        nvlink_bw=1e10,
        ib_bw=1.25e9,
        pcie_bw=1e10,
        mfu=1.0,
        bw_efficiency=1.0,
        link_efficiency=1.0,
        step_overhead_s=0.5e-3,
        layer_overhead_s=0.0,
        nvlink_latency_s=2e-6,
        net_latency_s=50e-6,
    ),
}


def get_gpu(name: str) -> GPUProfile:
    """The profile registered as `name` (exact, then case-insensitive); UnknownProfileError lists the known names."""
    if name in GPUS:
        return GPUS[name]
    folded = {key.lower(): profile for key, profile in GPUS.items()}
    if name.lower() in folded:
        return folded[name.lower()]
    raise UnknownProfileError(f"unknown GPU profile {name!r}; known GPU profiles: {', '.join(GPUS)}")
