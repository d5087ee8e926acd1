"""paged_decode_attention (Triton) against the torch reference, in the interpreter on CPU.

Each case is a ragged batch whose contexts hit the paging edge cases (1 token, a block
minus one, exactly a block, a block plus one, several blocks), in shuffled blocks, with
the tables padded past each context; the cache is NaN everywhere outside the contexts,
so a kernel that reads one slot too many fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.kernels.reference import paged_decode_attention_ref

from .paged import make_case, sanitized

ATOL = RTOL = 2e-5   # float32


def _decode(*args, **kwargs):
    from minibatch.kernels import triton_kernels
    return triton_kernels.paged_decode_attention(*args, **kwargs)


def _edge_lens(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


def check_decode(device, context_lens, block_size, num_heads, num_kv_heads, head_dim, *, pad=-1,
                 seed=0, dtype=torch.float32, atol=ATOL, rtol=RTOL, **kernel_kwargs):
    case = make_case(context_lens, block_size, num_kv_heads, head_dim, dtype=dtype, device=device,
                     pad=pad, seed=seed)
    q = torch.randn(len(context_lens), num_heads, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    tables = sanitized(case.block_tables, case.k_cache.shape[0])
    expected = paged_decode_attention_ref(q.float(), case.k_cache.float(), case.v_cache.float(), tables,
                                          case.context_lens)
    k_poisoned, v_poisoned = case.poisoned()
    out = _decode(q, k_poisoned, v_poisoned, case.block_tables, case.context_lens, None, **kernel_kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    return out


# A representative slice of block size x head_dim x (query heads, KV heads) x table
# padding x loop tile, rather than the full cross-product: every value appears, GQA
# ratios 1/3/4/8, MQA, and tiles smaller than, equal to and larger than a block.
CASES = [
    # block, head_dim, heads, kv_heads, pad, block_n
    (8, 32, 4, 4, -1, None),        # MHA (ratio 1); tile (32) spans 4 blocks
    (16, 64, 8, 2, 0, None),        # GQA 4, tables padded with 0
    (32, 128, 16, 2, -1, 16),       # GQA 8; tile (16) is half a block
    (16, 32, 8, 1, 10 ** 6, None),  # MQA (ratio 8); padding is garbage far out of range
    (32, 64, 4, 1, -1, 32),         # MQA (ratio 4); tile == block
    (8, 128, 6, 2, 0, 16),          # GQA 3: group padded to the tl.dot minimum of 16 rows
    (16, 80, 4, 2, -1, None),       # head_dim 80: not a power of two, masked columns
]


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,pad,block_n", CASES)
def test_decode_matches_reference(device, block_size, head_dim, num_heads, num_kv_heads, pad, block_n, split):
    # partition_size 32 makes the split variant cut even these short contexts into
    # several partitions, some of them past the end of the shorter sequences.
    kwargs = dict(split_kv=split, block_n=block_n, partition_size=32 if split else None)
    check_decode(device, _edge_lens(block_size), block_size, num_heads, num_kv_heads, head_dim,
                 pad=pad, seed=block_size + head_dim, **kwargs)


def test_split_kv_long_context(device):
    """Few sequences, long contexts: many partitions, ragged partition counts."""
    out_split = check_decode(device, [300, 37, 1], 16, 8, 2, 32, split_kv=True, partition_size=64, block_n=32)
    out_plain = check_decode(device, [300, 37, 1], 16, 8, 2, 32, split_kv=False)
    torch.testing.assert_close(out_split, out_plain, atol=ATOL, rtol=RTOL)


def test_split_kv_partition_cap(device, monkeypatch):
    """Contexts longer than MAX_PARTITIONS partitions get larger partitions, same result."""
    from minibatch.kernels import triton_decode
    monkeypatch.setattr(triton_decode, "MAX_PARTITIONS", 2)
    check_decode(device, [150, 9], 8, 4, 2, 32, split_kv=True, partition_size=32, block_n=32)


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 10 ** 6), size=st.integers(1, 4096))
def test_split_partitions_cover_the_context_in_at_most_max_partitions(tokens, size):
    """The partition is the smallest power-of-two multiple of the requested size whose
    partitions cover the context in at most MAX_PARTITIONS (one reduce tile)."""
    from minibatch.kernels.triton_decode import MAX_PARTITIONS, split_partitions

    psize, parts = split_partitions(tokens, size)
    ratio = psize // size
    assert psize % size == 0 and ratio & (ratio - 1) == 0
    assert parts == -(-tokens // psize) <= MAX_PARTITIONS and parts * psize >= tokens
    if ratio > 1:                                 # half the partition would need too many
        assert -(-tokens // (psize // 2)) > MAX_PARTITIONS


def test_heuristic_picks_split_for_few_long_sequences(device, monkeypatch):
    from minibatch.kernels import triton_decode

    cpu = torch.device("cpu")
    sms = triton_decode.num_sms(cpu)
    assert triton_decode.choose_split(1, 8, 8192, cpu)                  # few programs, long context
    assert not triton_decode.choose_split(1, 8, 512, cpu)               # fits one partition
    assert not triton_decode.choose_split(sms, 1, 8192, cpu)            # already >= one program per SM

    # split_kv=None follows the heuristic: spy on the reduce kernel's launches.
    launches = []
    reduce_kernel = triton_decode._split_kv_reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(triton_decode, "_split_kv_reduce_kernel", Spy())
    monkeypatch.setattr(triton_decode, "choose_split", lambda *a, **k: True)
    check_decode(device, [70, 5], 16, 4, 2, 32, partition_size=32)
    assert launches == [(2, 4)]
    monkeypatch.setattr(triton_decode, "choose_split", lambda *a, **k: False)
    check_decode(device, [70, 5], 16, 4, 2, 32, partition_size=32)
    assert launches == [(2, 4)]


def test_decode_fp16_accumulates_in_fp32(device):
    """float16 inputs (which the interpreter supports; bfloat16 is GPU-only, see test_gpu)."""
    check_decode(device, _edge_lens(16), 16, 8, 2, 64, dtype=torch.float16, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("split", [False, True])
def test_empty_context_gives_zeros(device, split):
    case = make_case([0, 5], 8, 1, 32, device=device)
    q = torch.randn(2, 2, 32, device=device)
    out = _decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, None,
                  split_kv=split, partition_size=32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = paged_decode_attention_ref(q[1:], case.k_cache, case.v_cache, case.block_tables[1:],
                                          case.context_lens[1:])
    torch.testing.assert_close(out[1:], expected, atol=ATOL, rtol=RTOL)


def test_custom_scale_and_strided_q(device):
    case = make_case([20, 3], 8, 2, 32, device=device)
    qkv = torch.randn(2, 3, 4, 32, device=device)
    q = qkv[:, 0]                                     # non-contiguous view
    expected = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3)
    out = _decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_rejects_bad_head_counts(device):
    case = make_case([4], 8, 2, 32, device=device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _decode(torch.randn(1, 3, 32, device=device), case.k_cache, case.v_cache, case.block_tables,
                case.context_lens)


def test_rejects_head_dim_over_256_and_handles_empty_batch(device):
    case = make_case([4], 8, 1, 288, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        _decode(torch.randn(1, 1, 288, device=device), case.k_cache, case.v_cache, case.block_tables,
                case.context_lens)
    case = make_case([4], 8, 1, 32, device=device)
    out = _decode(torch.empty(0, 2, 32, device=device), case.k_cache, case.v_cache, case.block_tables[:0],
                  case.context_lens[:0])
    assert out.shape == (0, 2, 32)
