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
  counted); unreferenced cached blocks stay reusable until evicted in LRU order. A
  radix tree (``minibatch.radix``) mirrors the same cached blocks for the ``lpm``
  policy, which asks how much of a waiting request is cached. A LoRA request's chain
  starts from its adapter (``chain_root``): its blocks are hits for that adapter only,
  and the radix tree (tokens only) leaves them out.

Two allocators, for chapter 6's measurements of waste:

* ``paged`` (default): blocks on demand, anywhere in the pool;
* ``contiguous``: at admission a request reserves one run of consecutive blocks, as
  pre-paging systems (FasterTransformer, Orca) reserved a contiguous KV buffer. What it
  reserves is ``contiguous_reserve``: ``"max_model_len"`` (default) for every request
  (equal sizes), or ``"request"``, each request's own ``min(prompt + max_tokens,
  max_model_len)`` (sizes differ, as in the chunk-reserving systems of the vLLM paper).

Two ways to count the waste:

* :meth:`KVCacheManager.fragmentation_slots`, the vLLM paper's taxonomy (Kwon et al.,
  SOSP'23, §3 and Figure 3): *reserved* slots are held for tokens the request will
  still write; *internal fragmentation* are held slots it will never write (a
  reservation beyond its final length, the tail of its last block); *external
  fragmentation* is free memory that cannot serve a request because no run of free
  blocks is long enough, although the free blocks together would be
  (:meth:`KVCacheManager.take_stranded_blocks`, :meth:`BlockPool.longest_free_run`).
  Equal-size reservations never fragment externally: what is left over when the pool
  is not a multiple of the reservation is a rounding remainder, free but too small.
  The final length is the request's planned one, ``min(prompt + max_tokens,
  max_model_len)``; a request that stops early (EOS, a stop string) leaves the slots
  between its actual and planned end counted as reserved while it ran.
* :meth:`KVCacheManager.waste_slots`, by position in the table: *reserved-but-unused*
  (whole blocks held beyond a request's last computed token) and *last-block waste*
  (empty slots in its last, partly filled block: at most ``block_size - 1``). These are
  ``StepRecord.kv_reserved_unused`` and ``kv_internal_waste``; the latter is not the
  paper's internal fragmentation.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from minibatch.config import CONTIGUOUS_RESERVES, KV_ALLOCATORS
from minibatch.radix import RadixTree
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
    by a later hit, or evicted (its hash dropped) when the queue hands it out. With a
    ``radix`` tree, every cached base-model block is also a node of the tree, and evicting a
    block drops it and the blocks cached below it from both indexes.
    """

    def __init__(self, num_blocks: int, radix: RadixTree | None = None):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # block hash -> block id
        self.radix = radix
        self.num_evictions = 0
        # Called with [(block hash, block id)] of cached blocks about to lose their prefix (a parent
        # before its children), while their KV is still intact: the host tier's write-back store.
        self.on_evict = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _take(self, block_id: int) -> None:
        """Hand out a free block: it leaves the free queue, its cached prefix is evicted."""
        del self.free_queue[block_id]
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.num_evictions += 1
            dropped = (self.radix.remove(block_id) if self.radix is not None else []) or [block_id]
            if self.on_evict is not None:
                self.on_evict([(self.blocks[b].block_hash, b) for b in dropped])
            for b in dropped:
                self._uncache(b)
        block.ref_cnt = 1

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue (least recently used first)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_queue)} free")
        out = list(itertools.islice(self.free_queue, n))
        for block_id in out:
            self._take(block_id)
        return out

    def find_contiguous(self, n: int) -> int | None:
        """First block id of the lowest run of ``n`` consecutive free blocks (first fit)."""
        run_start, run_len = 0, 0
        for block_id in sorted(self.free_queue):
            if run_len and block_id == run_start + run_len:
                run_len += 1
            else:
                run_start, run_len = block_id, 1
            if run_len == n:
                return run_start
        return None

    def longest_free_run(self) -> int:
        """Length of the longest run of consecutive free blocks."""
        best = run_len = 0
        prev = None
        for block_id in sorted(self.free_queue):
            run_len = run_len + 1 if prev is not None and block_id == prev + 1 else 1
            best = max(best, run_len)
            prev = block_id
        return best

    def allocate_contiguous(self, n: int) -> list[int] | None:
        """``n`` consecutive blocks (first fit), or None if no free run is long enough."""
        start = self.find_contiguous(n)
        if start is None:
            return None
        out = list(range(start, start + n))
        for block_id in out:
            self._take(block_id)
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

    def register(self, block_id: int, block_hash: int, parent_hash: int | None = None,
                 tokens: tuple | None = None, index: bool = True) -> bool:
        """Cache ``block_id`` under ``block_hash``; False if that prefix is cached already
        (by another block), or its parent prefix is not cached (it could never be hit).
        ``index=False`` keeps it out of the radix tree (a LoRA adapter's block)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return False
        if parent_hash is not None and parent_hash not in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block_id
        if self.radix is not None and index:
            parent = None if parent_hash is None else self.cached[parent_hash]
            self.radix.add(parent, tokens, block_id)
        return True


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """``h_i = hash((h_{i-1}, tokens_i))``: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, tokens))


def chain_root(req: Request) -> int | None:
    """The ``h_{-1}`` a request's hash chain starts from: None for the base model; a LoRA
    request's adapter id otherwise, so that a block computed with one adapter (or none) is
    never a hit for another (vLLM puts ``lora_int_id`` in the block hash's extra keys:
    ``vllm/v1/core/kv_cache_utils.py`` ``_gen_lora_extra_hash_keys``, v0.11.0)."""
    lr = getattr(req, "lora_request", None)
    return None if lr is None else hash(("lora", lr.lora_int_id))


class KVCacheManager:
    """Which blocks each request owns; allocation, freeing and prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 allocator: str = "paged", max_model_len: int | None = None,
                 contiguous_reserve: str = "max_model_len"):
        if allocator not in KV_ALLOCATORS:
            raise ValueError(f"unknown kv_allocator {allocator!r}; expected one of {KV_ALLOCATORS}")
        if contiguous_reserve not in CONTIGUOUS_RESERVES:
            raise ValueError(f"unknown contiguous_reserve {contiguous_reserve!r}; expected one of "
                             f"{CONTIGUOUS_RESERVES}")
        if allocator == "contiguous":
            if enable_prefix_caching:
                raise ValueError("prefix caching needs the paged allocator (kv_allocator='paged')")
            if max_model_len is None:
                raise ValueError("the contiguous allocator needs max_model_len")
        self.block_size = block_size
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.contiguous_reserve = contiguous_reserve
        self.radix = RadixTree(block_size) if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.radix)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}   # hashes of the request's full, computed blocks
        # Counters for the metrics (counted once per request, at its first admission).
        self.prefix_queries = 0
        self.prefix_hits = 0           # tokens served from the cache, either tier
        self.prefix_host_hits = 0      # of those, tokens loaded from the host tier
        # The host tier below the pool (minibatch.kv_offload; None: off), and each waiting
        # request's planned load: request id -> (device hit blocks, host block hashes).
        self.host = None
        self._host_plans: dict[str, tuple[list[int], list[int]]] = {}
        self.host_hit_tokens: dict[str, int] = {}     # request id -> tokens its first admission loaded
        # External fragmentation: contiguous reservations refused although the free blocks
        # would have sufficed, and the free blocks at the last such refusal since the engine
        # last asked (take_stranded_blocks).
        self.num_fragmentation_refusals = 0
        self._stranded_blocks = 0

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

    def blocks_for_request(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most: ``ceil(n / block_size)``
        paged, its whole reservation contiguous (``ceil(max_model_len / block_size)``, or
        ``ceil(min(n, max_model_len) / block_size)`` with ``contiguous_reserve="request"``)."""
        if self.allocator == "contiguous":
            if self.contiguous_reserve == "request":
                return self.blocks_for(min(num_tokens, self.max_model_len))
            return self.blocks_for(self.max_model_len)
        return self.blocks_for(num_tokens)

    def planned_len(self, req: Request) -> int:
        """The most tokens ``req`` can reach: ``min(prompt + max_tokens, max_model_len)``."""
        n = req.num_prompt_tokens + req.sampling_params.max_tokens
        return n if self.max_model_len is None else min(n, self.max_model_len)

    def reserve_tokens(self, req: Request) -> int:
        """Tokens the contiguous allocator reserves for ``req`` at admission."""
        return self.planned_len(req) if self.contiguous_reserve == "request" else self.max_model_len

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # -- host tier -----------------------------------------------------------------
    def attach_host_tier(self, host) -> None:
        """Put a host tier (``minibatch.kv_offload.HostKVTier``) below the pool; None: none."""
        if host is not None and not self.enable_prefix_caching:
            raise ValueError("a host tier extends the prefix cache: it needs enable_prefix_caching=True")
        self.host = host
        self.pool.on_evict = host.store if host is not None and host.policy == "write_back" else None

    def take_offload_time(self) -> float:
        """Host-tier copy seconds since the last call (the engine adds them to the step)."""
        return self.host.take_time() if self.host is not None else 0.0

    def _drop_host_plan(self, request_id: str) -> tuple[list[int], list[int]] | None:
        plan = self._host_plans.pop(request_id, None)
        if plan is not None:
            self.host.unpin(plan[1])
        return plan

    # -- prefix cache ------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``req``: (block ids, number of tokens).

        At least one token is always left to compute, since the step that computes
        it is the one that produces the next token's logits. With a host tier the walk
        goes on in host memory where the device misses: those tokens count too, the
        block ids do not (they get new device blocks, filled by :meth:`allocate_slots`),
        and the host blocks stay pinned until then.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent = chain_root(req)
        tokens = req.all_token_ids
        for i in range(max_blocks):
            parent = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        if self.host is None:
            return hits, len(hits) * bs
        self._drop_host_plan(req.request_id)
        host_hits: list[int] = []
        for i in range(len(hits), max_blocks):
            if i > len(hits):
                parent = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if parent not in self.host:
                break
            host_hits.append(parent)
        if host_hits:
            self.host.pin(host_hits)
            self._host_plans[req.request_id] = (list(hits), host_hits)
        return hits, (len(hits) + len(host_hits)) * bs

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of ``req`` a prefix hit would serve now, from the radix tree (for ``lpm``)."""
        if self.radix is None:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        return len(self.radix.match_prefix(req.all_token_ids, max_blocks)) * self.block_size

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed blocks in the prefix cache (and, with a
        ``write_through`` host tier, copy them to the host)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self.req_hashes.setdefault(req.request_id, [])
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = req.num_computed_tokens // bs
        first = len(hashes)
        tokens = None
        root = chain_root(req)
        while len(hashes) < num_full:
            i = len(hashes)
            if tokens is None:
                tokens = req.all_token_ids
            parent = hashes[-1] if hashes else None
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(root if parent is None else parent, chunk)
            hashes.append(h)
            # The radix tree (the lpm policy's estimate) indexes base-model blocks only.
            self.pool.register(blocks[i], h, parent, chunk, index=root is None)
        if self.host is not None and self.host.policy == "write_through" and len(hashes) > first:
            self.host.store(zip(hashes[first:], blocks[first:len(hashes)]), on_critical_path=False)

    # -- allocation --------------------------------------------------------------
    def num_free_hits(self, computed_blocks: list[int]) -> int:
        """Cached blocks of a hit that no request holds: taking them shrinks the free queue."""
        return sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; False if the pool is short.

        ``computed_blocks`` (a prefix hit, on a request's first allocation) are shared,
        not copied: they only gain a reference. The contiguous allocator reserves the
        request's whole reservation (:meth:`reserve_tokens`) on its first allocation, so
        it never grows; a refusal although enough blocks are free is external
        fragmentation, and is counted.
        """
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            if self.allocator == "contiguous":
                need = self.blocks_for(self.reserve_tokens(req))
                run = self.pool.allocate_contiguous(need)
                if run is None:
                    if need <= self.pool.num_free_blocks:     # enough free blocks, no run that long
                        self.num_fragmentation_refusals += 1
                        self._stranded_blocks = self.pool.num_free_blocks
                    return False
                self.req_blocks[req.request_id] = run
                return True
            computed_blocks = computed_blocks or []
            need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(computed_blocks)
            if need + self.num_free_hits(computed_blocks) > self.pool.num_free_blocks:
                return False
            self.pool.touch(computed_blocks)
            blocks = self.req_blocks[req.request_id] = list(computed_blocks)
            if computed_blocks and self.enable_prefix_caching:
                hashes = []
                parent = chain_root(req)
                tokens = req.all_token_ids
                for i in range(len(computed_blocks)):
                    parent = hash_block(parent, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
                    hashes.append(parent)
                self.req_hashes[req.request_id] = hashes
            if self.host is not None:
                self._load_host_hits(req, computed_blocks, need)
                return True
        else:
            need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(blocks)
            if need > self.pool.num_free_blocks:
                return False
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def _load_host_hits(self, req: Request, computed_blocks: list[int], need: int) -> None:
        """First allocation with a host tier: allocate ``need`` blocks and copy the host hits that
        :meth:`get_computed_blocks` planned into the first of them, registering them in the
        device cache again."""
        plan = self._drop_host_plan(req.request_id)
        host_hashes = plan[1] if plan is not None and plan[0] == computed_blocks else []
        bs = self.block_size
        if (len(computed_blocks) + len(host_hashes)) * bs != req.num_computed_tokens and host_hashes:
            host_hashes = []          # a stale plan: the scheduler did not count these tokens
        if host_hashes:
            self.host.pin(host_hashes)            # allocating may evict (and store) device blocks
        blocks = self.req_blocks[req.request_id]
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if not host_hashes:
            return
        self.host.unpin(host_hashes)
        n0 = len(computed_blocks)
        targets = blocks[n0:n0 + len(host_hashes)]
        self.host.load(host_hashes, targets)
        hashes = self.req_hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        for i, (h, b) in enumerate(zip(host_hashes, targets), start=n0):
            parent = hashes[-1] if hashes else None
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            self.pool.register(b, h, parent, chunk)
        if req.first_scheduled_time is None:      # counted once per request, like prefix_hits
            self.prefix_host_hits += len(host_hashes) * bs
            self.host_hit_tokens[req.request_id] = len(host_hashes) * bs

    def free(self, req: Request) -> None:
        """Release all of ``req``'s blocks (tail first, so a prefix outlives its tail in the LRU)."""
        if self.host is not None:
            self._drop_host_plan(req.request_id)
        blocks = self.req_blocks.pop(req.request_id, None)
        self.req_hashes.pop(req.request_id, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))

    # -- statistics ----------------------------------------------------------------
    def waste_slots(self, requests) -> tuple[int, int]:
        """``(reserved_unused, internal)`` empty slots over ``requests`` (those holding blocks).

        For a request with ``c`` computed tokens holding ``k`` blocks of size ``B``:
        reserved-but-unused = ``(k - ceil(c / B)) * B``; internal (last-block) waste =
        ``ceil(c / B) * B - c``. Shared prefix blocks are full, so nothing counts twice.
        """
        return self.slot_stats(requests)[:2]

    def fragmentation_slots(self, requests) -> tuple[int, int]:
        """``(reserved, internal_fragmentation)`` slots over ``requests``, as the vLLM paper
        defines them (§3): of the ``k * B`` slots a request holds, those it will still write
        are reserved, ``min(k * B, w) - c``, and those it will never write are internal
        fragmentation, ``max(0, k * B - w)``; ``c`` its computed tokens, ``w`` the slots it
        writes by its end, ``planned_len - 1`` (the last generated token's K/V is never
        computed). Shared prefix blocks are full and written, so nothing counts twice."""
        return self.slot_stats(requests)[2:]

    def slot_stats(self, requests) -> tuple[int, int, int, int]:
        """``(reserved_unused, internal, reserved, internal_fragmentation)``: the slot counts of
        :meth:`waste_slots` and :meth:`fragmentation_slots` (their docstrings define them) in one
        pass over ``requests``, as the engine records all four every step."""
        bs, tables = self.block_size, self.req_blocks
        unused = waste = reserved = frag = 0
        for req in requests:
            k = len(tables.get(req.request_id, ()))
            if not k:
                continue
            c, held = req.num_computed_tokens, k * bs
            filled = min(k, -(-c // bs))
            unused += (k - filled) * bs
            waste += filled * bs - min(c, filled * bs)
            final = max(self.planned_len(req) - 1, c)
            reserved += max(0, min(held, final) - c)
            frag += max(0, held - final)
        return unused, waste, reserved, frag

    def take_stranded_blocks(self) -> int:
        """Free blocks at the last external-fragmentation refusal since the previous call
        (0 if none): memory that sat free while a request that would fit in it waited."""
        n, self._stranded_blocks = self._stranded_blocks, 0
        return n

    def check_invariants(self) -> None:
        """free + used = total; every reference is held by exactly one table entry;
        the radix tree indexes exactly the cached blocks."""
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
        for h, b in self.pool.cached.items():
            assert self.pool.blocks[b].block_hash == h
        if self.radix is not None:
            self.radix.check()
            assert set(self.radix._where) == set(self.pool.cached.values()), \
                "the radix tree and the hash index disagree on the cached blocks"
        if self.host is not None:
            self.host.check()
            planned: dict[int, int] = {}
            for _, host_hashes in self._host_plans.values():
                for h in host_hashes:
                    planned[h] = planned.get(h, 0) + 1
            assert planned == self.host.pins, "host pins disagree with the waiting requests' planned loads"
