r"""Triton kernel: causal prefill attention of ragged query chunks over the paged cache.

Sequence ``s`` brings ``L_s = query_start_loc[s+1] - query_start_loc[s]`` new query
tokens, stored one after another in ``q [total_query_tokens, num_heads, head_dim]``.
They are the *last* ``L_s`` of the ``C_s = context_lens[s]`` tokens already written to
the cache (their own K/V included), so query ``j`` sits at position ``p_j = C_s - L_s + j``
and attends causally to keys ``0..p_j``::

    out[q_start + j, h] = sum_{t <= p_j} softmax_t(scale * q[q_start + j, h] . K[s, t, h // G]) V[s, t, h // G]

One kernel therefore covers a plain prefill (``L_s = C_s``), a later chunk of a chunked
prefill and a prefix-cache hit (a cached prefix of ``C_s - L_s`` tokens), and a decode
step (``L_s = 1``).

Each program owns ``BLOCK_M`` query rows of one head and walks the keys in tiles of
``BLOCK_N`` with the same online softmax as the decode kernel (see ``triton_decode``)::

    m_new = max(m, rowmax(S));  alpha = exp(m - m_new);  P = exp(S - m_new)
    l = l * alpha + rowsum(P);  acc = acc * alpha + P V;  m = m_new;   out = acc / l
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
)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr, out_ptr,
    scale,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_t, stride_k_h, stride_k_d,
    stride_v_b, stride_v_t, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_b,
    stride_o_t, stride_o_h, stride_o_d,
    GROUP: tl.constexpr,        # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # tokens per cache block (page)
    BLOCK_M: tl.constexpr,      # query rows per program
    BLOCK_N: tl.constexpr,      # keys per loop iteration
    BLOCK_D: tl.constexpr,      # HEAD_DIM padded to a power of two >= 16
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(num_seqs, cdiv(max_query_len, BLOCK_M), num_heads)``."""
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query chunk; shorter ones have nothing here.
    if m_block * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix_len = ctx_len - q_len          # tokens before the first query (cached or earlier chunks)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)   # query index within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m                            # absolute position of each query
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h
                + offs_d[None, :] * stride_q_d, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)   # tl.dot needs both operands in one dtype

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causality bounds the keys: none after the last query of this tile is visible.
    hi = prefix_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    table_row = block_tables_ptr + seq * stride_bt_s
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)            # key positions
        mask_n = offs_n < hi
        # Paging, as in the decode kernel: each key's physical block and offset. Table
        # entries past the context are masked off, so their padding value is irrelevant.
        block = tl.load(table_row + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=mask_n, other=0).to(tl.int64)
        slot_in_block = offs_n % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_k_b + slot_in_block[:, None] * stride_k_t
                    + kv_head * stride_k_h + offs_d[None, :] * stride_k_d, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale   # [BLOCK_M, BLOCK_N] fp32
        # Causal mask: key t is visible to the query at position p iff t <= p. (A faster
        # kernel would skip this for tiles wholly below the diagonal.) Key 0 is visible
        # to every row and sits in the first tile, so each row's m is finite from then
        # on; padding rows (offs_m >= q_len) see every key < hi and stay finite too.
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_v_b + slot_in_block[:, None] * stride_v_t
                    + kv_head * stride_v_h + offs_d[None, :] * stride_v_d, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_t + head * stride_o_h
             + offs_d[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch parameters (untuned defaults)."""
    if interpreting():
        return dict(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if head_dim <= 128 and dtype != torch.float32:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return dict(block_m=32, block_n=32, num_warps=4, num_stages=2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float | None = None, *,
                            max_query_len: int | None = None, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Causal attention for ragged query chunks; returns ``[total_query_tokens, num_heads, head_dim]``.

    Args:
        q: ``[total_query_tokens, num_heads, head_dim]``, sequences one after another.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already
            holding every sequence's ``context_lens[s]`` tokens (the new ones included).
        block_tables: ``[num_seqs, max_blocks]`` int32; entries past a context are ignored.
        context_lens: ``[num_seqs]`` int32; must be >= that sequence's query count.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query counts starting at 0.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        max_query_len: the longest chunk, if the caller knows it; otherwise it is computed
            here, which costs one device-to-host sync.
        block_m, block_n, num_warps, num_stages: tuning knobs, defaults from ``_prefill_config``.
    """
    check_device(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    check_cache(k_cache, v_cache)
    check_interpretable(q, k_cache)
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    group = check_heads(num_heads, num_kv_heads)
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"expected query_start_loc [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], "
                         f"got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    out = torch.empty_like(q)
    if total == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out

    cfg = _prefill_config(head_dim, k_cache.dtype)
    block_m = block_m or cfg["block_m"]
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        default_scale(scale, head_dim),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n or cfg["block_n"], BLOCK_D=block_dim(head_dim),
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return out
