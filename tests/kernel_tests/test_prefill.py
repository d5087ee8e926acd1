"""paged_prefill_attention (Triton) against the torch reference, in the interpreter on CPU.

A sequence's queries are the *last* ``q_len`` of its ``ctx`` cached tokens: ``q_len == ctx``
is a plain prefill, ``q_len < ctx`` a later chunk or a prefix-cache hit, ``q_len == 1`` a
decode step and ``q_len == 0`` a sequence with nothing to compute this step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

from .paged import make_case, sanitized

ATOL = RTOL = 2e-5   # float32


def _prefill(*args, **kwargs):
    from minibatch.kernels import triton_kernels
    return triton_kernels.paged_prefill_attention(*args, **kwargs)


def check_prefill(device, seqs, block_size, num_heads, num_kv_heads, head_dim, *, pad=-1, seed=0,
                  dtype=torch.float32, atol=ATOL, rtol=RTOL, **kernel_kwargs):
    """``seqs``: ``[(context_len, query_len), ...]``."""
    case = make_case([c for c, _ in seqs], block_size, num_kv_heads, head_dim, dtype=dtype, device=device,
                     pad=pad, seed=seed)
    q_lens = [n for _, n in seqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(device=device, dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    tables = sanitized(case.block_tables, case.k_cache.shape[0])
    expected = paged_prefill_attention_ref(q.float(), case.k_cache.float(), case.v_cache.float(), tables,
                                           case.context_lens, qsl)
    k_poisoned, v_poisoned = case.poisoned()
    out = _prefill(q, k_poisoned, v_poisoned, case.block_tables, case.context_lens, qsl, None, **kernel_kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    return case, q, qsl, out


def _seqs(b: int) -> list[tuple[int, int]]:
    """Query lengths from 1 to several blocks, with and without a cached prefix."""
    return [
        (1, 1),                   # a one-token prompt
        (b - 1, b - 1),           # full prefills of the edge lengths
        (b + 1, b + 1),
        (3 * b + 5, 2 * b + 3),   # a chunk after a prefix that ends mid-block
        (2 * b, b),               # a chunk after a prefix of exactly one block
        (b + 3, 1),               # a decode step
        (b, 0),                   # nothing to do this step
    ]


CASES = [
    # block, head_dim, heads, kv_heads, pad, block_m, block_n
    (8, 32, 4, 4, -1, None, None),         # MHA
    (16, 64, 8, 2, 0, 16, 16),             # GQA 4, tables padded with 0, small tiles
    (8, 32, 16, 2, -1, None, 16),          # GQA 8
    (32, 128, 4, 1, -1, None, 16),         # MQA (ratio 4), key tile half a block
    (16, 32, 8, 1, 10 ** 6, 32, 64),       # MQA (ratio 8), garbage padding, big tiles
    (8, 80, 6, 2, -1, None, None),         # GQA 3, head_dim 80
]


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,pad,block_m,block_n", CASES)
def test_prefill_matches_reference(device, block_size, head_dim, num_heads, num_kv_heads, pad, block_m, block_n):
    check_prefill(device, _seqs(block_size), block_size, num_heads, num_kv_heads, head_dim, pad=pad,
                  seed=block_size + head_dim, block_m=block_m, block_n=block_n)


def test_prefill_single_long_prompt_and_max_query_len(device):
    case, q, qsl, out = check_prefill(device, [(100, 100)], 16, 4, 2, 64, block_m=16, block_n=32)
    again = _prefill(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, qsl, None,
                     max_query_len=100, block_m=16, block_n=32)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


def test_prefill_one_query_equals_decode(device):
    """A batch of one-query chunks is a decode step: both kernels agree."""
    from minibatch.kernels import triton_kernels

    case, q, _, out = check_prefill(device, [(9, 1), (1, 1), (40, 1)], 8, 8, 2, 32)
    decoded = triton_kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                                    case.context_lens)
    torch.testing.assert_close(decoded, out, atol=ATOL, rtol=RTOL)


def test_prefill_fp16(device):
    check_prefill(device, _seqs(16), 16, 8, 2, 64, dtype=torch.float16, atol=2e-3, rtol=2e-3)


def test_prefill_empty_batch(device):
    case = make_case([4], 8, 1, 32, device=device)
    q = torch.empty(0, 2, 32, device=device)
    qsl = torch.zeros(2, dtype=torch.int32, device=device)
    out = _prefill(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, qsl)
    assert out.shape == (0, 2, 32)


@st.composite
def _batches(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    head_dim = draw(st.sampled_from([32, 64]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 4, 8]))
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        ctx = draw(st.integers(1, 2 * block_size + 2))
        seqs.append((ctx, draw(st.integers(1, ctx))))
    return block_size, head_dim, num_kv_heads * group, num_kv_heads, seqs, draw(st.integers(0, 2 ** 16))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch=_batches())
def test_random_batches_prefill_and_decode(device, batch):
    """Randomised shapes (a fixed, derandomised handful): prefill, and decode on the same cache."""
    block_size, head_dim, num_heads, num_kv_heads, seqs, seed = batch
    case, _, _, _ = check_prefill(device, seqs, block_size, num_heads, num_kv_heads, head_dim, seed=seed)
    q = torch.randn(len(seqs), num_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(device)
    expected = paged_decode_attention_ref(q, case.k_cache, case.v_cache,
                                          sanitized(case.block_tables, case.k_cache.shape[0]), case.context_lens)
    from minibatch.kernels import triton_kernels
    for split in (False, True):
        out = triton_kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                                    case.context_lens, split_kv=split, partition_size=32)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
