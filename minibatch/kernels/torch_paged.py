"""Fast plain-torch paged attention: the CPU engine's path (``backend="torch"``).

Same semantics as the references in :mod:`minibatch.kernels.reference`, written for
speed on CPU, where there is no custom kernel and every tensor op has a fixed cost:

* decode: sort the sequences by context length and cut them into small groups whose
  padded length wastes little; per group, gather the pages once into
  ``[seqs, T, H_kv, D]`` and run one masked ``scaled_dot_product_attention`` with
  ``enable_gqa`` (no copy of K/V per query head);
* prefill: one SDPA per sequence over its gathered context (causal when the chunk is
  the whole context, else an explicit "query position >= key position" mask).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minibatch.kernels.reference import gather_kv

MAX_GROUP = 64
MAX_PADDING = 1.25    # a group's padded tokens may exceed its real tokens by at most 25%


def _groups(lens: list[int]) -> list[list[int]]:
    """Indices grouped by similar length (ascending), each group padded to its own max."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in order:
        n = lens[i]
        if cur and (len(cur) >= MAX_GROUP or n * (len(cur) + 1) > MAX_PADDING * (total + n)):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        groups.append(cur)
    return groups


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    lens = context_lens.tolist()
    for idx in _groups(lens):
        n = len(idx)
        longest = max(lens[i] for i in idx)
        nblocks = -(-longest // block_size)
        rows = torch.tensor(idx, device=q.device)
        table = block_tables[rows, :nblocks].long()
        k = k_cache[table].view(n, nblocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache[table].view(n, nblocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        qg = q[rows].view(n, num_heads, 1, head_dim)
        mask = None
        if any(lens[i] != nblocks * block_size for i in idx):
            pos = torch.arange(nblocks * block_size, device=q.device)
            mask = (pos[None, :] < context_lens[rows].long()[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[rows] = o.view(n, num_heads, head_dim)
    return out


def paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                  scale=None):
    total, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n_q = hi - lo
        if n_q == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], ctx).transpose(0, 1)[None]    # [1, kvh, ctx, d]
        v = gather_kv(v_cache, block_tables[s], ctx).transpose(0, 1)[None]
        qs = q[lo:hi].transpose(0, 1)[None]                                      # [1, h, n_q, d]
        if n_q == ctx:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - n_q, ctx, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
