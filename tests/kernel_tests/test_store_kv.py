"""store_kv (Triton) against the torch reference: written slots, skipped slots, untouched slots."""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.reference import store_kv_ref


def _triton_store_kv(*args):
    from minibatch.kernels import triton_kernels
    return triton_kernels.store_kv(*args)


def _caches(num_blocks, block_size, num_kv_heads, head_dim, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(device=device, dtype=dtype),
            torch.randn(shape, generator=g).to(device=device, dtype=dtype))


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [
    (8, 1, 32), (16, 2, 64), (32, 4, 128), (16, 3, 80),   # 3 KV heads, head_dim 80: masked tiles
])
def test_store_kv_matches_reference(device, block_size, num_kv_heads, head_dim):
    num_blocks = 6
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, device)
    g = torch.Generator().manual_seed(1)
    num_tokens = 2 * block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]   # scattered, distinct
    slots[::4] = -1                                                             # some tokens skipped
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device)
    slot_mapping = slots.to(device=device, dtype=torch.int32)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    k_before = k_cache.clone()
    _triton_store_kv(key, value, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # Every slot not in slot_mapping is bit-for-bit untouched (stronger than the above
    # only if the reference itself were wrong; it documents the contract).
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_new = k_cache.view(num_blocks * block_size, -1).cpu()
    flat_old = k_before.view(num_blocks * block_size, -1).cpu()
    assert torch.equal(flat_new[~written], flat_old[~written])
    assert not torch.equal(flat_new[written], flat_old[written])


def test_store_kv_all_skipped_and_empty(device):
    k_cache, v_cache = _caches(3, 8, 2, 32, device)
    k0, v0 = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, 2, 32, device=device)
    _triton_store_kv(key, key + 1, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int32, device=device))
    empty = torch.empty(0, 2, 32, device=device)
    _triton_store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=device))
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_store_kv_strided_inputs_and_int64_slots(device):
    """key/value as column slices of one fused qkv projection (non-contiguous rows)."""
    num_kv_heads, head_dim, n = 2, 32, 7
    k_cache, v_cache = _caches(4, 16, num_kv_heads, head_dim, device)
    qkv = torch.randn(n, 3 * num_kv_heads * head_dim, device=device)
    _, key, value = qkv.split(num_kv_heads * head_dim, dim=-1)
    key = key.view(n, num_kv_heads, head_dim)
    value = value.view(n, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.tensor([63, 0, 17, -1, 5, 40, 16], dtype=torch.int64, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    _triton_store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_casts_to_cache_dtype(device):
    k_cache, v_cache = _caches(2, 8, 1, 32, device, dtype=torch.float16)
    key = torch.randn(3, 1, 32, device=device)
    slots = torch.tensor([2, 9, 15], dtype=torch.int32, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, -key, k_ref, v_ref, slots)
    _triton_store_kv(key, -key, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_mismatched_shapes(device):
    k_cache, v_cache = _caches(2, 8, 2, 32, device)
    key = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        _triton_store_kv(key, key, k_cache, v_cache, torch.zeros(3, dtype=torch.int32, device=device))
