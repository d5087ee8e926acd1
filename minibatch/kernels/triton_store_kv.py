"""Triton kernel: write the new tokens' keys and values into the paged KV cache.

Every forward pass computes K and V for its new tokens (a whole prompt chunk, or one
token per sequence in decode). Before attention runs they are scattered into the
cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V, at the
flat slots the scheduler chose::

    slot = slot_mapping[t] = block * block_size + offset
    k_cache[block, offset] = key[t]        # all heads, the whole head_dim
    v_cache[block, offset] = value[t]

``slot_mapping[t] == -1`` means "do not store token t" (e.g. padding tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minibatch.kernels._triton_utils import block_dim, check_cache, check_device


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_t, stride_vc_h, stride_vc_d,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V rows.

    The copy is a single 2-D tile ``[BLOCK_H, BLOCK_D]`` (powers of two covering the
    heads and head_dim; the extra lanes are masked off).
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return      # a token that must not be stored (e.g. padding): nothing to do
    # Split the flat slot into (physical block, offset inside the block). int64 because
    # block * stride can exceed 2**31 elements in a large cache.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h
                + offs_d[None, :] * stride_key_d, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h
                + offs_d[None, :] * stride_value_d, mask=mask)

    k_dst = (k_cache_ptr + block * stride_kc_b + offset * stride_kc_t
             + offs_h[:, None] * stride_kc_h + offs_d[None, :] * stride_kc_d)
    v_dst = (v_cache_ptr + block * stride_vc_b + offset * stride_vc_t
             + offs_h[:, None] * stride_vc_h + offs_d[None, :] * stride_vc_d)
    # Cast to the cache's element type (e.g. fp32 activations into a bf16 cache).
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches
    at ``slot_mapping`` (``[num_tokens]``, int32/int64, ``-1`` = skip). In place."""
    check_device(key, value, k_cache, v_cache, slot_mapping)
    check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key rows [{num_kv_heads}, {head_dim}] do not match the cache's "
                         f"[num_kv_heads, head_dim] = {list(k_cache.shape[2:])}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have shape [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_dim(head_dim),
    )
