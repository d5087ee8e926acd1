"""Builders for random paged-KV test cases (shared by the kernel tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedCase:
    k_cache: torch.Tensor           # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, padded past each context
    context_lens: torch.Tensor      # [num_seqs] int32

    def poisoned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches with NaN in every slot outside every context.

        A kernel reading even one such slot (the tail of a last block, an unused block)
        turns its output NaN, even if it then masks the score: 0 * NaN = NaN.
        """
        num_blocks, block_size = self.k_cache.shape[:2]
        used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        tables = self.block_tables.cpu().long()
        for s, n in enumerate(self.context_lens.tolist()):
            t = torch.arange(n)
            used[tables[s, t // block_size] * block_size + t % block_size] = True
        unused = ~used.view(num_blocks, block_size).to(self.k_cache.device)
        k, v = self.k_cache.clone(), self.v_cache.clone()
        k[unused] = float("nan")
        v[unused] = float("nan")
        return k, v


def make_case(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, *,
              dtype=torch.float32, device="cpu", pad: int = -1, extra_cols: int = 1,
              spare_blocks: int = 3, seed: int = 0) -> PagedCase:
    """A random cache and shuffled block tables for sequences of ``context_lens`` tokens.

    Blocks are handed out in a random permutation (tables are non-contiguous and not
    sorted), ``spare_blocks`` blocks belong to no sequence, and every table row is padded
    with ``pad`` past its own blocks (plus ``extra_cols`` columns for everyone).
    """
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need, default=0) + extra_cols
    tables = torch.full((len(context_lens), width), pad, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return PagedCase(k_cache, v_cache, tables.to(device),
                     torch.tensor(context_lens, dtype=torch.int32, device=device))


def sanitized(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The tables with out-of-range padding replaced by 0, for the torch reference
    (which indexes whole rows of the table)."""
    return torch.where((block_tables >= 0) & (block_tables < num_blocks), block_tables,
                       torch.zeros_like(block_tables))
