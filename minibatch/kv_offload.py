"""A host tier below the device KV pool that keeps prefix blocks the pool evicted (KV offloading).

The prefix cache (:mod:`minibatch.kv_cache`) keeps a computed block only while the device
pool has no better use for it: once the free queue hands it out, its prefix is gone and a
later request with that prefix recomputes it. A host tier gives such blocks a second life
in host memory, which is larger and cheaper than device memory, as vLLM's
``OffloadingConnector`` (``--kv-offloading-size``) and SGLang's HiCache
(``--enable-hierarchical-cache``) do::

    device pool (fast, small)      block hash -> device block      ── hit: shared, no copy
        │ store: device -> host    (write_through: when computed; write_back: when evicted)
        ▼ load: host -> device     (a device miss that the host holds: copy into new blocks)
    host tier (slower, larger)     block hash -> host slot, LRU    ── full: drop the LRU entry

* Entries are keyed by the same chained block hash as the device cache, so a host entry
  stands for a whole prefix. A request's lookup walks its blocks on the device first and
  continues on the host where the device misses; the host blocks are copied into freshly
  allocated device blocks, registered in the device cache again, and count as prefix-cache
  hits (of the host tier).
* ``write_through`` (the default of both frameworks): every newly computed full block is
  copied to the host at once, so an eviction from the device drops nothing the host does not
  hold. ``write_back``: a block is copied only when the device pool evicts it, so the host
  receives only what would otherwise be lost, but the copy sits on the eviction's path.
* The host keeps its copy after a load (the tiers are inclusive), so a block loaded back and
  evicted again needs no second copy. The host evicts in LRU order; blocks are touched tail
  first so a prefix is more recent than its extensions and outlives them (vLLM's LRU policy
  orders a request's blocks the same way). Blocks that a waiting request is about to load are
  pinned: the LRU skips them.

This is not swap preemption (:mod:`minibatch.swap`): swapping moves a *running* request's
private KV out and back to resume it; the host tier keeps *finished* prefixes for reuse by
other requests. Both may be on; each has its own host pool.

Copy cost: with a real model the copies are real ``index_select`` / ``index_copy_`` between
the executor's KV tensors and host tensors, timed and added to the step. With the simulator
a load and a write-back store take ``blocks * block_bytes / kv_offload_bandwidth``
(:func:`minibatch.sim.offload.transfer_time`) on the step's critical path; write-through
stores overlap the computation (asynchronous copies, as vLLM's and SGLang's are) and add
no time, only bytes.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from minibatch.sim.offload import HOST_LINK_BYTES_PER_S, block_bytes as sim_block_bytes, transfer_time

GiB = 1 << 30


class HostKVTier:
    """A bounded LRU pool of KV blocks in host memory, keyed by chained block hash."""

    def __init__(self, capacity_blocks: int, executor=None, block_size: int = 16,
                 policy: str = "write_through", bandwidth: float = HOST_LINK_BYTES_PER_S):
        if not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {capacity_blocks!r}")
        self.capacity = capacity_blocks
        self.policy = policy
        self.bandwidth = bandwidth
        self.caches = getattr(executor, "kv_caches", None)
        self.block_bytes = executor_block_bytes(executor, block_size)
        self.host_caches = None
        if self.caches is not None:       # one host (K, V) pair per layer, allocated once
            import torch   # only with real KV tensors: the simulator runs without torch

            self.host_caches = [tuple(torch.empty((capacity_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu")
                                      for t in pair) for pair in self.caches]
        self.entries: OrderedDict[int, int] = OrderedDict()   # block hash -> host slot, LRU first
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.pins: dict[int, int] = {}                         # block hash -> pin count
        self.num_stored = 0          # blocks copied device -> host
        self.num_loaded = 0          # blocks copied host -> device
        self.num_dropped = 0         # host entries evicted (LRU)
        self.pending_time = 0.0      # copy seconds on the critical path, not yet charged to a step
        self.store_seconds = 0.0     # cumulative copy seconds charged, device -> host
        self.load_seconds = 0.0      # cumulative copy seconds charged, host -> device

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    @property
    def store_bytes(self) -> int:
        return self.num_stored * self.block_bytes

    @property
    def load_bytes(self) -> int:
        return self.num_loaded * self.block_bytes

    def take_time(self) -> float:
        """Copy time since the last call (the engine adds it to the step's duration)."""
        t, self.pending_time = self.pending_time, 0.0
        return t

    # -- recency and pins ----------------------------------------------------------------
    def touch(self, hashes) -> None:
        """Mark a prefix's blocks used, tail first, so the prefix ends most recent."""
        for h in reversed(list(hashes)):
            if h in self.entries:
                self.entries.move_to_end(h)

    def pin(self, hashes) -> None:
        for h in hashes:
            self.pins[h] = self.pins.get(h, 0) + 1

    def unpin(self, hashes) -> None:
        for h in hashes:
            n = self.pins[h] - 1
            if n:
                self.pins[h] = n
            else:
                del self.pins[h]

    def _free_slot(self) -> int | None:
        """A free host slot, evicting the least recently used unpinned entry if none is free."""
        if self.free_slots:
            return self.free_slots.pop()
        for h in self.entries:
            if h not in self.pins:
                self.num_dropped += 1
                return self.entries.pop(h)
        return None

    # -- copies ----------------------------------------------------------------------
    def store(self, items, on_critical_path: bool = True) -> int:
        """Copy device blocks ``[(block_hash, device_block_id), ...]`` (a parent before its
        children) to the host; blocks whose hash the host already holds are only touched.
        Returns the number of blocks copied."""
        items = list(items)
        pairs = []
        for h, b in items:
            if h in self.entries:
                continue
            slot = self._free_slot()
            if slot is None:         # every entry pinned: this block is not kept
                break
            self.entries[h] = slot
            pairs.append((slot, b))
        self.touch(h for h, _ in items)
        if not pairs:
            return 0
        t0 = time.perf_counter()
        if self.caches is not None:
            import torch

            dev = self.caches[0][0].device
            src = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
            dst = torch.tensor([s for s, _ in pairs], dtype=torch.long)
            for pair, host_pair in zip(self.caches, self.host_caches):
                for t, host in zip(pair, host_pair):
                    host.index_copy_(0, dst, t.index_select(0, src).to("cpu"))
            spent = time.perf_counter() - t0
        else:
            spent = transfer_time(len(pairs), self.block_bytes, self.bandwidth) if on_critical_path else 0.0
        self.pending_time += spent
        self.store_seconds += spent
        self.num_stored += len(pairs)
        return len(pairs)

    def load(self, hashes, block_ids) -> None:
        """Copy the host blocks of ``hashes`` into device blocks ``block_ids`` (same order);
        the host keeps its copies, now most recently used."""
        slots = [self.entries[h] for h in hashes]
        if not slots:
            return
        t0 = time.perf_counter()
        if self.caches is not None:
            import torch

            dev = self.caches[0][0].device
            src = torch.tensor(slots, dtype=torch.long)
            dst = torch.tensor(list(block_ids), dtype=torch.long, device=dev)
            for pair, host_pair in zip(self.caches, self.host_caches):
                for t, host in zip(pair, host_pair):
                    t.index_copy_(0, dst, host.index_select(0, src).to(dev))
            spent = time.perf_counter() - t0
        else:
            spent = transfer_time(len(slots), self.block_bytes, self.bandwidth)
        self.pending_time += spent
        self.load_seconds += spent
        self.num_loaded += len(slots)
        self.touch(hashes)

    def check(self) -> None:
        """Every slot is free or held by exactly one entry; pins are positive."""
        used = list(self.entries.values())
        assert len(set(used)) == len(used), "a host slot holds two blocks"
        assert not set(used) & set(self.free_slots), "a host slot is both used and free"
        assert len(used) + len(self.free_slots) == self.capacity, "host slots lost or duplicated"
        assert all(n > 0 for n in self.pins.values())


def executor_block_bytes(executor, block_size: int) -> int:
    """Bytes of one KV block: the executor's ``block_bytes``, else its KV tensors' shapes, else the
    simulator's cost model (one GPU's share); 0 when none says."""
    if executor is None:
        return 0
    if getattr(executor, "block_bytes", None):
        return int(executor.block_bytes)
    caches = getattr(executor, "kv_caches", None)
    if caches:
        return sum(t[0].numel() * t.element_size() for pair in caches for t in pair)
    return sim_block_bytes(getattr(executor, "cost_model", None), block_size)


def host_tier_blocks(config, executor) -> int:
    """Blocks of the host tier a config asks for: ``kv_offload_blocks``, or ``kv_offloading_size``
    GiB (vLLM's option: summed over tensor-parallel GPUs) over the bytes of one block."""
    if config.kv_offload_blocks:
        return config.kv_offload_blocks
    if config.kv_offloading_size is None:
        return 0
    per_block = executor_block_bytes(executor, config.block_size)
    tp = getattr(getattr(executor, "cost_model", None), "tp", 1)
    if not per_block:
        raise ValueError("kv_offloading_size needs the bytes of a KV block, which this executor does not "
                         "give; pass kv_offload_blocks instead")
    blocks = int(config.kv_offloading_size * GiB // (per_block * tp))
    if blocks < 1:
        raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB holds no KV block of "
                         f"{per_block * tp} bytes")
    return blocks


def make_host_tier(config, executor) -> HostKVTier | None:
    """The host tier of an engine's config, or None when offloading is off."""
    blocks = host_tier_blocks(config, executor)
    if not blocks:
        return None
    return HostKVTier(blocks, executor, config.block_size, config.kv_offload_policy, config.kv_offload_bandwidth)
