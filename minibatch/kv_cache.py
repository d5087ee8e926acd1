"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block tables.

The tensors themselves live in the executor (``[num_blocks, block_size, num_kv_heads,
head_dim]`` per layer for K and for V). This module only decides which block ids each
request owns, as vLLM's block manager does (Kwon et al., *PagedAttention*, SOSP'23):

* a request's block table maps its token ``t`` to block ``table[t // block_size]``;
* blocks are allocated on demand, one at a time, so at most ``block_size - 1`` slots
  per request are ever empty ("last-block waste");
* with prefix caching, every *full* block is identified by a hash chained over all the
  tokens before it, ``h_i = hash(h_{i-1}, tokens of block i)``, so two requests with the
  same first ``k * block_size`` tokens share their first ``k`` blocks (reference
  counted); unreferenced cached blocks stay reusable until evicted in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict

from minibatch.request import Request


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


class BlockPool:
    """All blocks, a free queue in eviction (LRU) order, and the prefix-cache index.

    A free block may still hold a cached prefix (``block_hash`` set): it is reused as is
    by a later hit, or evicted (its hash dropped) when the queue hands it out.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:          # evict the cached prefix it held
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} released twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """``h_i = hash((h_{i-1}, tokens_i))``: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, tokens))


class KVCacheManager:
    """Which blocks each request owns; allocation, freeing and prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}   # hashes of the request's full, computed blocks
        # Counters for the metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- sizes ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # -- prefix cache ------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``req``: (block ids, number of tokens).

        At least one token is always left to compute, since the step that computes
        it is the one that produces the next token's logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        tokens = req.all_token_ids
        for i in range(max_blocks):
            parent = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.req_hashes.setdefault(req.request_id, [])
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = req.num_computed_tokens // bs
        tokens = None
        while len(hashes) < num_full:
            i = len(hashes)
            if tokens is None:
                tokens = req.all_token_ids
            parent = hashes[-1] if hashes else None
            h = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            hashes.append(h)
            self.pool.register(blocks[i], h)

    # -- allocation --------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0,
                     reserve_tokens: int = 0) -> bool:
        have = len(self.req_blocks.get(req.request_id, ())) or num_computed_blocks
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens + reserve_tokens) - have
        return need <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; False if the pool is short.

        ``computed_blocks`` (a prefix hit, on a request's first allocation) are shared,
        not copied: they only gain a reference.
        """
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            computed_blocks = computed_blocks or []
            # Cached blocks with no owner sit in the free queue; taking them shrinks it.
            free_hits = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
            need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(computed_blocks)
            if need + free_hits > self.pool.num_free_blocks:
                return False
            self.pool.touch(computed_blocks)
            blocks = self.req_blocks[req.request_id] = list(computed_blocks)
            if computed_blocks and self.enable_prefix_caching:
                hashes = []
                parent = None
                tokens = req.all_token_ids
                for i in range(len(computed_blocks)):
                    parent = hash_block(parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
                    hashes.append(parent)
                self.req_hashes[req.request_id] = hashes
        else:
            need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(blocks)
            if need > self.pool.num_free_blocks:
                return False
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def free(self, req: Request) -> None:
        """Release all of ``req``'s blocks (tail first, so a prefix outlives its tail in the LRU)."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self.req_hashes.pop(req.request_id, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))

    def check_invariants(self) -> None:
        """free + used = total; every reference is held by exactly one table entry."""
        counts = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] += 1
        for block, n in zip(self.pool.blocks, counts):
            assert block.ref_cnt == n, f"block {block.block_id}: ref_cnt {block.ref_cnt} but {n} owners"
            assert (block.ref_cnt == 0) == (block.block_id in self.pool.free_queue), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with the free queue"
        for blocks in self.req_blocks.values():
            assert len(set(blocks)) == len(blocks), "a request holds the same block twice"
        used = sum(1 for c in counts if c > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks
