"""Small helpers shared by the Triton kernel wrappers (not kernels themselves)."""

from __future__ import annotations

import functools
import math

import torch
import triton


# ``triton.jit`` reads TRITON_INTERPRET when a kernel is *defined*, i.e. when our kernel
# modules are imported (they import this module first), so we record it at that moment:
# setting the variable later has no effect on kernels that already exist.
_INTERPRET = bool(triton.knobs.runtime.interpret)


def interpreting() -> bool:
    """True when our kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

    The variable must be set before ``minibatch.kernels.triton_kernels`` is first
    imported (tests do it in ``tests/kernel_tests/conftest.py``).
    """
    return _INTERPRET


def check_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's when a kernel cannot run on these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 "
            "before minibatch.kernels.triton_kernels is imported (or use backend='torch')")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"Triton kernels support CUDA (and the CPU interpreter), not {device}")


def block_dim(head_dim: int) -> int:
    """Tile width covering ``head_dim``: the next power of two, at least 16.

    Triton tiles must have power-of-two sizes and ``tl.dot`` needs every dimension
    to be at least 16, so a head_dim of e.g. 80 is computed in a 128-wide tile whose
    extra columns are masked off on load (read as 0) and on store.
    """
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 inputs (no silent TF32 rounding),
    the (ignored) default for fp16/bf16, whose products are exact in fp32 anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_scale(scale: float | None, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; a fixed stand-in for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16


def check_interpretable(*tensors: torch.Tensor) -> None:
    """Refuse bfloat16 attention in the CPU interpreter, which computes ``tl.dot`` on
    bf16 blocks wrongly (Triton 3.9: results off by orders of magnitude); float32 and
    float16 are fine there, and bf16 is fine compiled on a GPU."""
    if interpreting() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise RuntimeError("the Triton CPU interpreter gives wrong results for bfloat16 attention; "
                           "use float32/float16 on CPU, or backend='torch'")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Return the GQA group size (query heads per KV head)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads
