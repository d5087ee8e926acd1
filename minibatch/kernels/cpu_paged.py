"""The CPU's C kernels, built on first use and called via ctypes.

``cpu_paged.c`` is paged decode attention, ``cpu_prefill.c`` paged causal prefill
attention tiled over query tokens; ``cpu_ops.c`` holds fused element-wise ops
(RMSNorm, RoPE, the SwiGLU gate) for the float32 forward. No torch headers, no build
step at install: the first call compiles the C files
with the machine's ``cc`` (about a second) into ``~/.cache/minibatch/`` (or
``$MINIBATCH_CACHE``), named by a hash of the source, the flags and the CPU, so
``-march=native`` is always right for the machine that runs it. Where there is no C
compiler, :func:`available` is False and the engine keeps the plain torch path.
``MINIBATCH_CPU_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from minibatch.config import env

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_paged.c", "cpu_prefill.c", "cpu_ops.c", "cpu_decode.c")]
HEADERS = [Path(__file__).with_name("cpu_common.h")]       # part of the build's hash
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None   # why the kernel is unavailable, when it is


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = env("MINIBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minibatch")
    return Path(root)


def library_path() -> Path:
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(CFLAGS).encode() + _cpu_signature().encode())
    return _cache_dir() / f"cpu_paged_{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name, then rename: parallel test workers may race here.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it if needed; None (with ``build_error``) if impossible."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    _tried = True
    if env("MINIBATCH_CPU_KERNEL", "1") == "0":
        build_error = "disabled by MINIBATCH_CPU_KERNEL=0"
        return None
    try:
        path = library_path()
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
        for fn in (lib.paged_decode_attention_f32, lib.paged_decode_attention_f32_portable):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
        lib.paged_prefill_attention_f32.restype = ctypes.c_int
        lib.paged_prefill_attention_f32.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float,
                                                                                                 ctypes.c_int]
        lib.avx512_path_for.restype = ctypes.c_int
        lib.avx512_path_for.argtypes = [ctypes.c_int] * 3
        P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
        lib.rms_norm_f32.restype = None
        lib.rms_norm_f32.argtypes = [P, L, P, P, L, L, I, F, I]
        lib.silu_mul_f32.restype = None
        lib.silu_mul_f32.argtypes = [P, P, L, I, I]
        lib.store_kv_f32.restype = L
        lib.store_kv_f32.argtypes = [P, L, P, L, P, P, P, L, I, L, I]
        lib.rope_f32.restype = None
        lib.rope_f32.argtypes = [P, L, L, I, I, P, P, P, I]
        lib.linear_small_m_f32.restype = None
        lib.linear_small_m_f32.argtypes = [P, L, P, P, P, L, I, I, I, I]
        lib.pack_panels_f32.restype = None
        lib.pack_panels_f32.argtypes = [P, P, I, I]
        lib.linear_panels_f32.restype = None
        lib.linear_panels_f32.argtypes = [P, L, P, P, P, L, I, I, I, I]
        lib.decode_model_f32.restype = I
        lib.decode_model_f32.argtypes = ([P, P, I, P, P, P, I, I, I, P, P, P, P, P, P, P, L, P, I, P] + [I] * 5
                                         + [F, F, I])
        lib.argmax_rows_f32.restype = None
        lib.argmax_rows_f32.argtypes = [P, L, L, I, P, I]
        _lib = lib
    except Exception as e:  # no compiler, read-only cache, ...: keep the torch path
        build_error = f"{type(e).__name__}: {e}"
        warnings.warn(f"minibatch: C kernels unavailable ({build_error}); "
                      "using the torch path", RuntimeWarning, stacklevel=2)
    return _lib


def decode_helper_counters() -> dict[str, int]:
    """The fused decode's helper-thread counters over this process (``cpu_decode.c``): work
    items the helper ran, steps run with it, long waits that sent the next steps to the
    caller alone, and one- or two-row steps the caller ran alone because that had been
    faster lately; all 0 where the kernel is not built."""
    lib = load()
    names = ("decode_helper_items", "decode_helper_steps", "decode_backoffs", "decode_alone_steps")
    return {n: ctypes.c_long.in_dll(lib, n).value if lib is not None else 0 for n in names}


def available() -> bool:
    return load() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def uses_avx512(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's AVX-512 path serves these sizes on this machine."""
    lib = load()
    return bool(lib is not None and lib.avx512_path_for(num_heads, num_kv_heads, head_dim))


def _attention_args(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Checks and converts what both attention kernels take: (library, q, int32 tables,
    int32 lengths, (num_heads, num_kv_heads, head_dim, block_size, table_width), scale)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"C kernels unavailable: {build_error}")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    tables = block_tables.to(torch.int32).contiguous()
    sizes = (num_heads, num_kv_heads, head_dim, block_size, tables.shape[1] if tables.dim() == 2 else 0)
    scale = float(scale if scale is not None else 1.0 / math.sqrt(head_dim))
    return lib, q.contiguous(), tables, context_lens.to(torch.int32).contiguous(), sizes, scale


def paged_decode_attention_c(q, k_cache, v_cache, block_tables, context_lens, scale=None, portable=False,
                             num_threads=None):
    """Same contract as :func:`minibatch.kernels.reference.paged_decode_attention_ref`.

    ``portable=True`` forces the plain-C path even where the AVX-512 one would run.
    With fewer sequences than threads (``num_threads``, default torch's), long contexts
    are cut into parts that run on the idle threads and are merged by log-sum-exp.
    """
    lib, q, tables, lens, sizes, scale = _attention_args(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    fn = lib.paged_decode_attention_f32_portable if portable else lib.paged_decode_attention_f32
    failed = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                out.data_ptr(), lens.numel(), *sizes, scale, num_threads or torch.get_num_threads())
    if failed:
        raise MemoryError("C paged-attention kernel could not allocate its score buffer")
    return out


# ---- fused element-wise ops (cpu_ops.c) -------------------------------------------------
# Callers check :func:`ops_supported` first; these assume float32 CPU tensors.

def ops_supported(x: torch.Tensor) -> bool:
    """Whether the fused C ops can serve ``x`` (CPU float32, kernel built, not disabled)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load() is not None


def rms_norm_c(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in one pass over ``x``'s rows."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)                  # a view where the strides allow, else a copy
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype)
    w = weight.contiguous()
    _lib.rms_norm_f32(x2.data_ptr(), x2.stride(0), w.data_ptr(), out.data_ptr(), dim, x2.shape[0], dim,
                      float(eps), torch.get_num_threads())
    return out.view(x.shape)


def silu_mul_c(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a ``[..., 2 * inter]`` gate|up projection output."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    _lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def rope_c_(x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place on ``x`` of shape ``[n, heads, head_dim]``.

    ``x`` may be a view into a wider row (the fused QKV output): its heads must be
    contiguous within a token, tokens any stride apart. ``cos_cache``/``sin_cache`` are
    ``[max_positions, head_dim]``; ``positions`` is int64 ``[n]``.
    """
    n, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError("rope_c_ needs each token's heads contiguous")
    pos = positions.to(torch.int64).contiguous()
    _lib.rope_f32(x.data_ptr(), x.stride(0), n, heads, head_dim, cos_cache.data_ptr(), sin_cache.data_ptr(),
                  pos.data_ptr(), torch.get_num_threads())
    return x


def linear_small_m_c(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D float32 ``x`` of a few rows (decode batch
    sizes): one pass over ``weight`` (``[N, K]``, contiguous) serves every row of ``x``."""
    return _few_rows_linear(_lib.linear_small_m_f32, x, weight, weight.shape[0], bias)


def _few_rows_linear(fn, x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Call a C few-rows linear (``linear_small_m_f32`` or ``linear_panels_f32``: the same
    arguments, the weight in its own layout) into a fresh ``[m, n]`` output."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       n, m, n, k, torch.get_num_threads())
    return out


#: Output features per panel of :func:`pack_panels` (``PANEL`` in cpu_ops.c).
PANEL = 32


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[N, K]`` float32) re-laid for :func:`linear_panels_c`: panels of
    :data:`PANEL` output features, k-major, zero-padded to a whole panel
    (``[ceil(N / PANEL), K, PANEL]``)."""
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=w.dtype)
    _lib.pack_panels_f32(w.data_ptr(), out.data_ptr(), n, k)
    return out


def linear_panels_c(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D float32 ``x`` of a few rows, from
    ``panels = pack_panels(weight)`` (``n``: the weight's rows). Each panel is one
    sequential read that serves every row of ``x``."""
    m, k = x.shape
    if panels.dim() != 3 or panels.shape[1] != k or panels.shape[2] != PANEL or panels.shape[0] * PANEL < n:
        raise ValueError(f"panels of shape {tuple(panels.shape)} do not fit x {tuple(x.shape)} and n={n}")
    return _few_rows_linear(_lib.linear_panels_f32, x, panels, n, bias)


def argmax_rows_c(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D float32 CPU tensor whose rows are contiguous
    (the first index of each row's maximum; a NaN counts as the maximum)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError("argmax_rows_c needs a 2-D tensor with contiguous, non-empty rows")
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _lib.argmax_rows_f32(logits.data_ptr(), logits.stride(0), rows, cols, out.data_ptr(),
                             torch.get_num_threads())
    return out


def store_kv_c(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """Write key/value rows into their flat slots (``-1`` skips), as
    :func:`minibatch.kernels.reference.store_kv_ref` does; False (nothing written) where
    the C store cannot serve these tensors."""
    lib = load()
    n = key.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]
    ok = (lib is not None and k_cache.dtype == v_cache.dtype == key.dtype == value.dtype == torch.float32
          and key.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
          and tuple(key.shape[1:]) == tuple(value.shape[1:]) == tuple(k_cache.shape[2:])
          and _rows_contiguous(key) and _rows_contiguous(value))
    if not ok:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.numel() != n:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {n} rows")
    if n:
        bad = lib.store_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                               k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), n, row,
                               k_cache.shape[0] * k_cache.shape[1], torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} slot(s) in slot_mapping are outside the KV cache "
                             f"({k_cache.shape[0] * k_cache.shape[1]} slots)")
    return True


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each row x[t] (all trailing dims) is one contiguous run of floats."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def paged_prefill_attention_c(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=None):
    """Same contract as :func:`minibatch.kernels.reference.paged_prefill_attention_ref`.

    By the tiled kernel of ``cpu_prefill.c``: a work item is (sequence, KV head, 64
    query tokens), so each cached key and value row is read once for all of the tile's
    query heads rather than once per query token.
    """
    lib, q, tables, lens, sizes, scale = _attention_args(q, k_cache, v_cache, block_tables, context_lens, scale)
    starts = query_start_loc.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    failed = lib.paged_prefill_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        starts.data_ptr(), out.data_ptr(), lens.numel(), *sizes, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("C prefill-attention kernel could not allocate its scratch")
    return out
