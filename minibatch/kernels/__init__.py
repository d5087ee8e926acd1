"""Paged-KV kernels: a plain torch reference for each, and Triton versions.

``backend=None`` picks Triton on CUDA and torch on CPU; the environment variable
``MINIBATCH_KERNELS=triton|torch`` overrides the default (Triton on CPU needs
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from minibatch.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from minibatch.kernels.torch_paged import paged_decode_attention_torch, paged_prefill_attention_torch


def resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        backend = os.environ.get("MINIBATCH_KERNELS") or ("triton" if device.type == "cuda" else "torch")
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
    return backend


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend=None):
    if resolve_backend(backend, key.device) == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    return store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, backend=None):
    if resolve_backend(backend, q.device) == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale=None, backend=None):
    if resolve_backend(backend, q.device) == "triton":
        from minibatch.kernels import triton_kernels
        return triton_kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                      query_start_loc, scale)
    return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)


__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "resolve_backend",
           "store_kv_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref",
           "paged_decode_attention_torch", "paged_prefill_attention_torch"]
