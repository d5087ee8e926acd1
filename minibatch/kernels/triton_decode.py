r"""Triton kernels: paged decode attention (one new token per sequence).

For sequence ``s`` and query head ``h`` reading KV head ``kvh = h // G`` (GQA with
``G = num_heads / num_kv_heads`` query heads per KV head; MQA when there is one KV head)::

    out[s, h] = sum_t softmax_t(scale * q[s, h] . K[s, t, kvh]) * V[s, t, kvh],   t < context_lens[s]

where token ``t`` of the sequence lives in physical block ``block_tables[s, t // block_size]``
at offset ``t % block_size`` of the cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.

**Online softmax** (flash-attention / flash-decoding). The context is read once, in
tiles of ``BLOCK_N`` tokens, never materialising all scores. Per query row we keep a
running maximum ``m``, a running softmax denominator ``l`` and an unnormalised output
``acc``. For a new tile of scores ``s_j`` (and values ``v_j``)::

    m_new = max(m, max_j s_j)
    alpha = exp(m - m_new)                       # rescales what was summed under the old max
    l     = l * alpha + sum_j exp(s_j - m_new)
    acc   = acc * alpha + sum_j exp(s_j - m_new) * v_j
    m     = m_new

and at the end ``out = acc / l``. Subtracting the running max keeps every ``exp`` <= 1
(no overflow); the ``alpha`` factors make the result exactly the softmax over all tiles.

**Split-KV** (flash-decoding proper). With few sequences and long contexts, one
program per (sequence, KV head) leaves most of the GPU idle while each program walks a
long context alone. The split variant also cuts the context into partitions of
``PARTITION_SIZE`` tokens, one program each, which write their partial ``(m_p, l_p, acc_p)``;
a second, small kernel merges them with the same rescaling::

    M   = max_p m_p
    L   = sum_p l_p   * exp(m_p - M)
    out = sum_p acc_p * exp(m_p - M) / L
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minibatch.kernels._triton_utils import (
    block_dim,
    check_cache,
    check_device,
    check_heads,
    check_interpretable,
    default_scale,
    dot_precision,
    interpreting,
    num_sms,
)

# Tokens per split-KV partition, and the most partitions the reduce kernel merges in one
# tile (longer contexts get proportionally larger partitions).
DEFAULT_PARTITION_SIZE = 512
MAX_PARTITIONS = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr,                    # [num_seqs, num_heads, head_dim]            (not SPLIT)
    part_m_ptr, part_l_ptr,     # [num_seqs, num_heads, num_partitions] fp32 (SPLIT)
    part_acc_ptr,               # [num_seqs, num_heads, num_partitions, head_dim] fp32 (SPLIT)
    scale,
    stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_v_b, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_b,
    stride_o_s, stride_o_h, stride_o_d,
    stride_pm_s, stride_pm_h, stride_pm_p,
    stride_pa_s, stride_pa_h, stride_pa_p, stride_pa_d,
    GROUP: tl.constexpr,        # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block (page)
    BLOCK_G: tl.constexpr,      # GROUP padded to a power of two >= 16 (tl.dot minimum)
    BLOCK_D: tl.constexpr,      # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,      # context tokens per loop iteration
    SPLIT: tl.constexpr,        # write partial (m, l, acc) per partition instead of `out`
    PARTITION_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads, num_partitions)``; ``num_partitions == 1`` unless SPLIT.

    One program serves *all* ``GROUP`` query heads that share a KV head, so each K/V
    tile is loaded from memory once per group, not once per query head: decode is
    memory-bound and GQA's point is to read less KV.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)

    # The slice of the context this program covers.
    if SPLIT:
        lo = tl.program_id(2) * PARTITION_SIZE
        if lo >= ctx_len:
            return          # partition past this sequence's end: the reduce never reads it
        hi = tl.minimum(lo + PARTITION_SIZE, ctx_len)
    else:
        lo = 0
        hi = ctx_len

    # Query rows: the GROUP heads kv_head * GROUP .. kv_head * GROUP + GROUP - 1, padded
    # to BLOCK_G rows (padding rows read zeros and are never stored).
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)   # tl.dot needs both operands in one dtype

    # Online-softmax state, in fp32 whatever the input dtype.
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    table_row = block_tables_ptr + seq * stride_bt_s
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)          # token positions in the sequence
        mask_n = offs_n < hi
        # Paging: look up each token's physical block. Entries past the context are
        # never read (masked), so padding in block_tables (-1, 0, garbage) is harmless.
        # int64 so that block * stride cannot overflow in a large cache.
        block = tl.load(table_row + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0).to(tl.int64)
        slot_in_block = offs_n % BLOCK_SIZE
        kv_offs = block[:, None] * stride_k_b + slot_in_block[:, None] * stride_k_t + kv_head * stride_k_h
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs + offs_d[None, :] * stride_k_d, mask=kv_mask, other=0.0)

        # Scores [BLOCK_G, BLOCK_N] in fp32; tokens past the slice get -inf (weight 0).
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(mask_n[None, :], s, float("-inf"))

        # The online-softmax update (see the module docstring). Every tile holds at
        # least one valid token, so m_new is finite and no exp(-inf - -inf) NaN arises.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)

        v_offs = block[:, None] * stride_v_b + slot_in_block[:, None] * stride_v_t + kv_head * stride_v_h
        v = tl.load(v_cache_ptr + v_offs + offs_d[None, :] * stride_v_d, mask=kv_mask, other=0.0)
        # p is cast to V's dtype so that the second product also runs on tensor cores
        # (bf16/fp16 x bf16/fp16 -> fp32 accumulate).
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    store_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        part = tl.program_id(2)
        ml_offs = seq * stride_pm_s + heads * stride_pm_h + part * stride_pm_p
        tl.store(part_m_ptr + ml_offs, m, mask=mask_g)
        tl.store(part_l_ptr + ml_offs, l, mask=mask_g)
        tl.store(part_acc_ptr + seq * stride_pa_s + heads[:, None] * stride_pa_h + part * stride_pa_p
                 + offs_d[None, :] * stride_pa_d, acc, mask=store_mask)
    else:
        # An empty context (l == 0) yields zeros rather than 0/0 = NaN.
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _split_kv_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, context_lens_ptr, out_ptr,
    stride_pm_s, stride_pm_h, stride_pm_p,
    stride_pa_s, stride_pa_h, stride_pa_p, stride_pa_d,
    stride_o_s, stride_o_h, stride_o_d,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,      # number of partitions padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_seqs, num_heads)``: merge one query head's partial results."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    # Only this sequence's own partitions were written (the others returned early).
    num_parts = tl.cdiv(ctx_len, PARTITION_SIZE)

    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < num_parts
    mask_d = offs_d < HEAD_DIM
    ml_offs = seq * stride_pm_s + head * stride_pm_h + offs_p * stride_pm_p
    m_p = tl.load(part_m_ptr + ml_offs, mask=mask_p, other=float("-inf"))
    l_p = tl.load(part_l_ptr + ml_offs, mask=mask_p, other=0.0)
    acc_p = tl.load(part_acc_ptr + seq * stride_pa_s + head * stride_pa_h + offs_p[:, None] * stride_pa_p
                    + offs_d[None, :] * stride_pa_d, mask=mask_p[:, None] & mask_d[None, :], other=0.0)

    # Rescale every partition to the global max M, exactly like one online-softmax step.
    m_max = tl.max(m_p, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # empty context: avoid -inf - -inf
    w = tl.exp(m_p - m_max)                                 # 0 for the padding partitions
    l_total = tl.sum(l_p * w, axis=0)
    out = tl.sum(acc_p * w[:, None], axis=0) / tl.where(l_total > 0, l_total, 1.0)
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + offs_d * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_split(num_seqs: int, num_kv_heads: int, max_context_tokens: int, device: torch.device,
                 partition_size: int = DEFAULT_PARTITION_SIZE) -> bool:
    """The split-KV heuristic: split when the context spans more than one partition
    *and* one program per (sequence, KV head) would not even give every SM one program.

    ``max_context_tokens`` is an upper bound (``block_tables.shape[1] * block_size``),
    which needs no device-to-host sync; partitions past a sequence's end exit at once.
    """
    return max_context_tokens > partition_size and num_seqs * num_kv_heads < num_sms(device)


def split_partitions(max_context_tokens: int, partition_size: int = DEFAULT_PARTITION_SIZE) -> tuple[int, int]:
    """``(partition_size, num_partitions)`` of a split-KV launch over ``max_context_tokens``.

    Partitions of ``partition_size`` tokens, doubled until at most :data:`MAX_PARTITIONS`
    cover the context, so that the reduce kernel merges one head's partials in a single
    tile of ``next_power_of_2(num_partitions)`` rows::

        P = partition_size * 2**k,   k = min{k >= 0 : ceil(T / (partition_size * 2**k)) <= MAX_PARTITIONS}
        num_partitions = ceil(T / P)
    """
    if partition_size < 1:
        raise ValueError(f"partition_size must be >= 1, got {partition_size}")
    while triton.cdiv(max_context_tokens, partition_size) > MAX_PARTITIONS:
        partition_size *= 2
    return partition_size, triton.cdiv(max_context_tokens, partition_size)


def _decode_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile size and launch parameters (untuned defaults; see benchmarks/kernels.py --sweep)."""
    if interpreting():
        return dict(block_n=32, num_warps=4, num_stages=1)
    if dtype == torch.float32 or head_dim > 128:
        # fp32 "ieee" dots run on CUDA cores and need far more registers than bf16 MMAs;
        # smaller tiles avoid register spills (fp32 on GPU is for testing anyway).
        return dict(block_n=32, num_warps=4, num_stages=3)
    return dict(block_n=64, num_warps=4, num_stages=3)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, *, split_kv: bool | None = None,
                           partition_size: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Decode attention over the paged cache; returns ``[num_seqs, num_heads, head_dim]`` in q's dtype.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``, one query token per sequence.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int32; entries past a context are ignored.
        context_lens: ``[num_seqs]`` int32, tokens in the cache for each sequence (the new
            token included). A zero-length context yields a zero output row.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        split_kv: force (True) or forbid (False) the split-KV variant; None = heuristic.
        partition_size: tokens per split-KV partition (a multiple of ``block_n``).
        block_n, num_warps, num_stages: tuning knobs, defaults from ``_decode_config``.
    """
    check_device(q, k_cache, v_cache, block_tables, context_lens)
    check_cache(k_cache, v_cache)
    check_interpretable(q, k_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    group = check_heads(num_heads, num_kv_heads)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"expected block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}], got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out

    cfg = _decode_config(head_dim, k_cache.dtype)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    max_tokens = block_tables.shape[1] * block_size
    partition_size = partition_size or DEFAULT_PARTITION_SIZE
    if split_kv is None:
        split_kv = choose_split(num_seqs, num_kv_heads, max_tokens, q.device, partition_size)
    num_parts = 1
    if split_kv:
        # Keep the reduce kernel's tile small: longer contexts get larger partitions.
        partition_size, num_parts = split_partitions(max_tokens, partition_size)
    if partition_size % block_n:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of block_n ({block_n})")

    block_g = max(16, triton.next_power_of_2(group))
    block_d = block_dim(head_dim)
    scale = default_scale(scale, head_dim)
    if split_kv:
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    else:   # unused by the kernel; any tensors do
        part_m = part_l = part_acc = out
    pm_strides = part_m.stride() if split_kv else (0, 0, 0)
    pa_strides = part_acc.stride() if split_kv else (0, 0, 0, 0)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, scale,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        *pm_strides, *pa_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=bool(split_kv), PARTITION_SIZE=partition_size,
        DOT_PRECISION=dot_precision(k_cache.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    if split_kv:
        _split_kv_reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, context_lens, out,
            *part_m.stride(), *part_acc.stride(), *out.stride(),
            HEAD_DIM=head_dim, PARTITION_SIZE=partition_size,
            BLOCK_P=triton.next_power_of_2(num_parts), BLOCK_D=block_d, num_warps=4,
        )
    return out
