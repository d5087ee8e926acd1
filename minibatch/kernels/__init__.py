"""Paged-KV kernels: a plain torch reference for each, Triton versions, and a C decode kernel.

Backends:

* ``"triton"``: the Triton kernels (the default on CUDA; on CPU only under ``TRITON_INTERPRET=1``);
* ``"cpu"``: attention by C kernels that read K/V from the pages in place (float32):
  decode by ``cpu_paged.c``, prefill chunks by the query-tiled ``cpu_prefill.c``; the
  K/V store is one C call (``cpu_ops.c``). The
  model also runs its RMSNorm, RoPE and SwiGLU gate as fused C ops (``cpu_ops.c``).
  The default on CPU whenever the kernels build;
* ``"torch"``: plain torch (``torch_paged.py``), gathering pages before attention.

``backend=None`` picks the default; the environment variable
``MINIBATCH_KERNELS=triton|cpu|torch`` overrides it.
"""

from __future__ import annotations

import torch

from minibatch.config import env

from minibatch.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from minibatch.kernels.torch_paged import paged_decode_attention_torch, paged_prefill_attention_torch
from minibatch.kernels import cpu_paged

from minibatch.config import ATTENTION_BACKENDS as BACKENDS  # noqa: E402


def resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        backend = env("MINIBATCH_KERNELS")
    if backend is None:
        if device.type == "cuda":
            backend = "triton"
        else:
            backend = "cpu" if cpu_paged.available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return backend


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend=None):
    backend = resolve_backend(backend, key.device)
    if backend == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    if backend == "cpu" and cpu_paged.store_kv_c(key, value, k_cache, v_cache, slot_mapping):
        return None
    return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, backend=None):
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if backend == "cpu" and cpu_paged.supports(q, k_cache) and cpu_paged.available():
        return cpu_paged.paged_decode_attention_c(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale=None, backend=None):
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                      query_start_loc, scale)
    if backend == "cpu" and cpu_paged.supports(q, k_cache) and cpu_paged.available():
        return cpu_paged.paged_prefill_attention_c(q, k_cache, v_cache, block_tables, context_lens,
                                                   query_start_loc, scale)
    return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)


__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "resolve_backend",
           "store_kv_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref",
           "paged_decode_attention_torch", "paged_prefill_attention_torch", "BACKENDS"]
