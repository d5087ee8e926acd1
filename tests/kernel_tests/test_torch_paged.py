"""The fast torch path (the CPU engine's) equals the plain references."""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from minibatch.kernels.torch_paged import _groups, paged_decode_attention_torch, paged_prefill_attention_torch


def _paged(lens, block_size, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks) + 3
    perm = torch.randperm(total, generator=g)          # shuffled, non-contiguous tables
    tables = torch.full((len(lens), max(nblocks)), -1, dtype=torch.int32)
    o = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[o:o + n]
        o += n
    k = torch.randn(total, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(total, block_size, kv_heads, head_dim, generator=g)
    return k, v, tables


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_reference(heads, kv_heads, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 200, 17, 90, 91, 300] * 3
    k, v, tables = _paged(lens, block_size, kv_heads, 32)
    q = torch.randn(len(lens), heads, 32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx)
    out = paged_decode_attention_torch(q, k, v, tables, ctx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_prefill_matches_reference(heads, kv_heads):
    block_size = 8
    ctx_lens = [1, 8, 9, 30, 47]
    q_lens = [1, 8, 3, 30, 12]          # whole prompts, chunks after a cached prefix, a decode
    k, v, tables = _paged(ctx_lens, block_size, kv_heads, 16, seed=1)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, 16)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    ref = paged_prefill_attention_ref(q, k, v, tables, ctx, starts)
    out = paged_prefill_attention_torch(q, k, v, tables, ctx, starts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_groups_cover_every_sequence_once_with_bounded_padding():
    lens = [5, 500, 7, 6, 480, 100, 101, 99, 1] * 5
    groups = _groups(lens)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lens)))
    for g in groups:
        real = sum(lens[i] for i in g)
        assert max(lens[i] for i in g) * len(g) <= 1.25 * real or len(g) == 1
