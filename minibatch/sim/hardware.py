"""Accelerators the simulator knows: peak compute, memory bandwidth, memory, links.

Each :class:`HardwareSpec` holds the vendor's published peak numbers (``source`` says
where they come from) and *achievable-efficiency* factors, the fraction of a peak that
well-tuned kernels reach in practice. The roofline cost model uses both:

    t = max(F / (peak_flops * flop_efficiency), B / (memory_bandwidth * bandwidth_efficiency))

Conventions
-----------
* ``peak_flops``: dense bf16/fp16 tensor-core FLOP/s with fp32 accumulation (what
  LLM inference kernels use), *without* the 2:4 structured-sparsity doubling that
  datasheets print next to it.
* ``memory_bytes``: the datasheet capacity read as GiB (HBM and GDDR parts are
  binary-sized), less the 1/16 that default-on ECC takes on GDDR6 data-centre parts
  (A10, L4): that is what ``nvidia-smi`` reports as total memory.
* ``interconnect_bandwidth``: per-GPU, per-direction link bandwidth (datasheets print
  the bidirectional sum: NVLink3 600 GB/s -> 300 GB/s, PCIe Gen4 x16 64 GB/s -> 32 GB/s).
  A ring all-reduce of B bytes over p GPUs takes
  ``2 (p-1)/p * B / (interconnect_bandwidth * link_efficiency) + allreduce_latency_s``.
* Efficiency factors and latencies are engineering estimates, not datasheet numbers:
  cuBLAS reaches ~70-80 % of peak on large bf16 GEMMs on A100, less on H100 (harder to
  feed) and on power-capped parts (L4, 72 W); streaming kernels reach ~80-90 % of HBM
  bandwidth. Change them per experiment with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
TERA = 1e12
GIGA = 1e9
_GDDR6_ECC = 15 / 16  # ECC on A10/L4 takes one 16th of the memory


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (one chip; tensor parallelism multiplies it in the cost model)."""

    name: str
    peak_flops: float               # dense bf16/fp16 tensor FLOP/s, fp32 accumulate
    memory_bandwidth: float         # bytes/s
    memory_bytes: int               # usable device memory, bytes
    interconnect: str               # "nvlink" | "pcie" | "none"
    interconnect_bandwidth: float   # bytes/s per direction per GPU
    flop_efficiency: float = 0.7    # achievable fraction of peak_flops on large GEMMs
    bandwidth_efficiency: float = 0.85  # achievable fraction of memory_bandwidth
    link_efficiency: float = 0.8    # achievable fraction of interconnect_bandwidth (NCCL bus bw)
    allreduce_latency_s: float = 10e-6  # fixed cost of one small all-reduce
    step_overhead_s: float = 2e-3   # default per-step CPU scheduling + launch overhead
    source: str = ""

    @property
    def effective_flops(self) -> float:
        """Achievable FLOP/s: ``peak_flops * flop_efficiency``."""
        return self.peak_flops * self.flop_efficiency

    @property
    def effective_bandwidth(self) -> float:
        """Achievable bytes/s: ``memory_bandwidth * bandwidth_efficiency``."""
        return self.memory_bandwidth * self.bandwidth_efficiency

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where a kernel turns compute-bound:
        ``effective_flops / effective_bandwidth``."""
        return self.effective_flops / self.effective_bandwidth

    def describe(self) -> str:
        return (f"{self.name}: {self.peak_flops / TERA:.0f} TFLOP/s bf16 dense "
                f"(x{self.flop_efficiency:.2f}), {self.memory_bandwidth / GIGA:.0f} GB/s "
                f"(x{self.bandwidth_efficiency:.2f}), {self.memory_bytes / GiB:.1f} GiB, "
                f"{self.interconnect} {self.interconnect_bandwidth / GIGA:.0f} GB/s/dir")


_NVLINK3 = dict(interconnect="nvlink", interconnect_bandwidth=300 * GIGA, link_efficiency=0.8,
                allreduce_latency_s=10e-6)
_NVLINK4 = dict(interconnect="nvlink", interconnect_bandwidth=450 * GIGA, link_efficiency=0.8,
                allreduce_latency_s=10e-6)
# PCIe all-reduce goes through the PCIe switch / host bridge: lower bus bandwidth, higher latency.
_PCIE4 = dict(interconnect="pcie", interconnect_bandwidth=32 * GIGA, link_efficiency=0.6,
              allreduce_latency_s=25e-6)

_REGISTRY: dict[str, HardwareSpec] = {h.name: h for h in [
    HardwareSpec(
        "a10", peak_flops=125 * TERA, memory_bandwidth=600 * GIGA, memory_bytes=int(24 * GiB * _GDDR6_ECC),
        flop_efficiency=0.6, bandwidth_efficiency=0.8, **_PCIE4,
        source="NVIDIA A10 datasheet: 125 TFLOP/s bf16/fp16 tensor dense (250 sparse), "
               "600 GB/s GDDR6, 24 GB (22.5 GiB usable with ECC), PCIe Gen4 64 GB/s"),
    HardwareSpec(
        "l4", peak_flops=121 * TERA, memory_bandwidth=300 * GIGA, memory_bytes=int(24 * GiB * _GDDR6_ECC),
        flop_efficiency=0.5, bandwidth_efficiency=0.8, **_PCIE4,
        source="NVIDIA L4 datasheet: 242 TFLOP/s fp16/bf16 tensor with sparsity = 121 dense, "
               "300 GB/s GDDR6, 24 GB (22.5 GiB usable with ECC), PCIe Gen4 64 GB/s; 72 W cap"),
    HardwareSpec(
        "rtx4090", peak_flops=165.2 * TERA, memory_bandwidth=1008 * GIGA, memory_bytes=24 * GiB,
        flop_efficiency=0.7, bandwidth_efficiency=0.8,
        interconnect="pcie", interconnect_bandwidth=32 * GIGA, link_efficiency=0.4,
        allreduce_latency_s=40e-6,  # no NVLink and no GPU peer-to-peer: via host memory
        source="NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): bf16/fp16 tensor with "
               "fp32 accumulate 165.2 TFLOP/s dense (330.3 with fp16 accumulate; x2 sparse), "
               "1008 GB/s GDDR6X, 24 GB, PCIe Gen4"),
    HardwareSpec(
        "a100-40g", peak_flops=312 * TERA, memory_bandwidth=1555 * GIGA, memory_bytes=40 * GiB,
        flop_efficiency=0.7, bandwidth_efficiency=0.85, **_NVLINK3,
        source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 1555 GB/s HBM2 (40GB SXM), "
               "NVLink 600 GB/s"),
    HardwareSpec(
        "a100-80g", peak_flops=312 * TERA, memory_bandwidth=2039 * GIGA, memory_bytes=80 * GiB,
        flop_efficiency=0.7, bandwidth_efficiency=0.85, **_NVLINK3,
        source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e (80GB SXM), "
               "NVLink 600 GB/s"),
    HardwareSpec(
        "h100", peak_flops=989 * TERA, memory_bandwidth=3350 * GIGA, memory_bytes=80 * GiB,
        flop_efficiency=0.65, bandwidth_efficiency=0.85, **_NVLINK4,
        source="NVIDIA H100 datasheet (SXM): 1979 TFLOP/s bf16 with sparsity = 989 dense, "
               "3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s"),
    HardwareSpec(
        "h200", peak_flops=989 * TERA, memory_bandwidth=4800 * GIGA, memory_bytes=141 * GiB,
        flop_efficiency=0.65, bandwidth_efficiency=0.85, **_NVLINK4,
        source="NVIDIA H200 datasheet (SXM): 1979 TFLOP/s bf16 with sparsity = 989 dense, "
               "4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s"),
    HardwareSpec(
        "cpu", peak_flops=1 * TERA, memory_bandwidth=50 * GIGA, memory_bytes=32 * GiB,
        flop_efficiency=0.3, bandwidth_efficiency=0.6,
        interconnect="none", interconnect_bandwidth=10 * GIGA, link_efficiency=0.5,
        allreduce_latency_s=50e-6, step_overhead_s=1e-3,
        source="rough generic server/laptop CPU, not a datasheet: ~1 TFLOP/s bf16/fp32 SIMD, "
               "~50 GB/s DRAM, 32 GiB. For a real CPU fit measured steps (FittedCostModel)"),
]}

_ALIASES = {"a100": "a100-80g", "a100-80gb": "a100-80g", "a100-40gb": "a100-40g",
            "h100-sxm": "h100", "h200-sxm": "h200", "4090": "rtx4090"}


def available_hardware() -> list[str]:
    """Names accepted by :func:`get_hardware`."""
    return sorted(_REGISTRY)


def get_hardware(name: str | HardwareSpec) -> HardwareSpec:
    """The :class:`HardwareSpec` called ``name`` (case-insensitive; a spec passes through)."""
    if isinstance(name, HardwareSpec):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(f"unknown hardware {name!r}; available: {', '.join(available_hardware())} "
                         f"(prefix 'Nx' for N-way tensor parallelism, e.g. '4xa10')")
    return _REGISTRY[key]


def parse_hardware(spec: str | HardwareSpec) -> tuple[HardwareSpec, int]:
    """Split ``"4xa10"`` into ``(get_hardware("a10"), 4)``; a plain name gives tp = 1."""
    if isinstance(spec, HardwareSpec):
        return spec, 1
    text = str(spec).strip().lower()
    count, sep, rest = text.partition("x")
    if sep and count.isdigit() and rest:
        if int(count) < 1:
            raise ValueError(f"bad hardware spec {spec!r}: GPU count must be >= 1")
        return get_hardware(rest), int(count)
    return get_hardware(text), 1
