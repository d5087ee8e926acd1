"""Swap preemption: a victim's KV blocks go to a bounded CPU pool and come back on resume.

With ``preemption_mode="swap"`` (vLLM V0's ``PreemptionMode.SWAP``), a preempted
request keeps its computed KV: :meth:`Swapper.swap_out` copies its data-bearing blocks
(``ceil(num_computed_tokens / block_size)`` of them) from the executor's KV tensors to
host memory and frees the device blocks; :meth:`Swapper.swap_in` allocates fresh
blocks and copies the data back, so the request resumes where it stopped instead of
recomputing its prompt and output. The host pool holds at most ``swap_space_blocks``
blocks (default: as many as the device pool); when a victim does not fit, the
scheduler falls back to recompute.

Copy cost: with a real model (``ModelExecutor``, reachable through ``.kv_caches``,
one ``(K, V)`` pair per layer of shape ``[num_blocks, block_size, kv_heads,
head_dim]``) the copies are real ``index_select``/``index_copy_`` and their measured
time is added to the step; with the simulator the copy is bookkeeping and its time is
modelled as ``blocks * block_bytes / HOST_LINK_BYTES_PER_S`` (PCIe Gen4 x16: 32 GB/s
per direction, ~25 GB/s achieved).
"""

from __future__ import annotations

import time

import torch

HOST_LINK_BYTES_PER_S = 25e9


class Swapper:
    def __init__(self, kv, executor, capacity_blocks: int):
        self.kv = kv
        self.capacity = capacity_blocks
        self.caches = getattr(executor, "kv_caches", None)
        block_bytes = getattr(executor, "block_bytes", None)
        if block_bytes is None:
            per_token = getattr(getattr(executor, "cost_model", None), "kv_bytes_per_token_per_gpu", 0)
            block_bytes = per_token * kv.block_size
        self.block_bytes = block_bytes
        self.saved: dict[str, tuple[int, list | None]] = {}   # request id -> (blocks, host copies)
        self.num_used = 0                 # host blocks in use
        self.num_swapped_out = 0          # cumulative blocks copied device -> host
        self.num_swapped_in = 0           # cumulative blocks copied host -> device
        self.pending_time = 0.0           # copy seconds not yet charged to a step

    def take_time(self) -> float:
        """Copy time since the last call (the engine adds it to the step's duration)."""
        t, self.pending_time = self.pending_time, 0.0
        return t

    def _charge(self, num_blocks: int, t0: float) -> None:
        if self.caches is not None:
            self.pending_time += time.perf_counter() - t0
        else:
            self.pending_time += num_blocks * self.block_bytes / HOST_LINK_BYTES_PER_S

    def swap_out(self, req) -> bool:
        """Copy ``req``'s KV to host and free its device blocks; False if the host pool is full."""
        n = self.kv.blocks_for(req.num_computed_tokens)
        if n == 0 or self.num_used + n > self.capacity:
            return False
        t0 = time.perf_counter()
        data = None
        if self.caches is not None:
            ids = self.kv.block_table(req.request_id)[:n]
            idx = torch.tensor(ids, dtype=torch.long, device=self.caches[0][0].device)
            data = [(k.index_select(0, idx).to("cpu"), v.index_select(0, idx).to("cpu"))
                    for k, v in self.caches]
        self.saved[req.request_id] = (n, data)
        self.num_used += n
        self.num_swapped_out += n
        self.kv.free(req)
        self._charge(n, t0)
        return True

    def swap_in(self, req, num_new_tokens: int) -> bool:
        """Allocate blocks for ``req``'s computed tokens plus ``num_new_tokens`` and copy
        its KV back; False (nothing changed) if the device pool is short."""
        n, data = self.saved[req.request_id]
        if not self.kv.allocate_slots(req, num_new_tokens):
            return False
        t0 = time.perf_counter()
        if data is not None:
            ids = self.kv.block_table(req.request_id)[:n]
            idx = torch.tensor(ids, dtype=torch.long, device=self.caches[0][0].device)
            for (k, v), (hk, hv) in zip(self.caches, data):
                k.index_copy_(0, idx, hk.to(k.device))
                v.index_copy_(0, idx, hv.to(v.device))
        del self.saved[req.request_id]
        self.num_used -= n
        self.num_swapped_in += n
        self._charge(n, t0)
        return True

    def discard(self, req) -> None:
        """Forget a request's host copy (it finished or was aborted while swapped out)."""
        saved = self.saved.pop(req.request_id, None)
        if saved is not None:
            self.num_used -= saved[0]
