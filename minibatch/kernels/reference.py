"""Plain torch reference implementations of the paged-KV kernels.

These are the ground truth that every Triton kernel is tested against, and the
path the engine takes on CPU. The cache layout is
``[num_blocks, block_size, num_kv_heads, head_dim]`` for both K and V; token ``t``
of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``, i.e. at flat slot ``block * block_size + offset``.
"""

from __future__ import annotations

import math

import torch


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key[t]``/``value[t]`` into flat slot ``slot_mapping[t]``; ``-1`` skips."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of one sequence as ``[num_tokens, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]           # [n, block_size, kvh, d]
    return pages.reshape(-1, *cache.shape[2:])[:num_tokens]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float | None = None) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    ``out[s, h] = softmax(q[s, h] · K_s^T * scale) V_s`` over the ``context_lens[s]``
    cached tokens of sequence ``s``; query head ``h`` reads KV head ``h // (H / H_kv)``
    (GQA; MQA when ``H_kv = 1``). All sequences are handled in one batched op by
    gathering their pages into a padded ``[S, T_max, H_kv, D]`` tensor and masking.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    if num_seqs == 0:
        return q.new_empty(q.shape)
    max_len = int(context_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long().clamp_min(0)
    k = k_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("skgd,stkd->skgt", qg, k.float()) * scale
    pos = torch.arange(num_blocks * block_size, device=q.device)
    mask = pos[None, :] >= context_lens.long()[:, None]        # [S, T]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgt,stkd->skgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                query_start_loc: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention for a ragged batch of query chunks over paged context.

    Sequence ``s`` contributes queries ``q[query_start_loc[s]:query_start_loc[s+1]]``;
    they are the *last* ``L_s`` tokens of its ``context_lens[s]`` tokens, so query ``j``
    sits at position ``p = context_lens[s] - L_s + j`` and attends to keys ``0..p``
    (a cached prefix, earlier chunks, and itself). This covers a plain prefill
    (``L_s = context_len``), a chunked prefill, a prefix-cache hit and a decode (``L_s = 1``).
    """
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        lo, hi, ctx = starts[s], starts[s + 1], lens[s]
        n_q = hi - lo
        if n_q == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], ctx)          # [ctx, kvh, d]
        v = gather_kv(v_cache, block_tables[s], ctx)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qs = q[lo:hi].transpose(0, 1)                          # [h, n_q, d]
        if n_q == ctx:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale)
        out[lo:hi] = o.transpose(0, 1)
    return out
