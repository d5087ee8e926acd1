"""A fake executor that stores token ids as its "KV" and checks them on every read.

``kv_caches`` holds one ``(K, V)`` pair of float tensors ``[num_blocks, block_size, 1, 1]``
like ``ModelExecutor``'s, so swap preemption copies real data. Each step writes the new
tokens' ids into their slots, then reads back every position the request has computed
through its block table and asserts it finds exactly the request's tokens: a prefix hit
on a wrong block, a block owned twice, or a swap that restores the wrong data fails at
once. The sampled token is a function of the tokens read back.
"""

from __future__ import annotations

import numpy as np
import torch

from minibatch.executor import StepOutput


class KVCheckingExecutor:
    model_config = None
    max_model_len = 4096

    def __init__(self, num_kv_blocks: int, block_size: int, step_s: float = 0.001):
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.step_s = step_s
        shape = (num_kv_blocks, block_size, 1, 1)
        self.kv_caches = [(torch.full(shape, -1.0), torch.full(shape, -1.0))]

    def execute(self, batch, kv):
        bs = self.block_size
        k, v = (t.view(-1).numpy() for t in self.kv_caches[0])   # views: writes reach the tensors
        sampled = []
        for req, n in batch.items:
            table = np.asarray(kv.block_table(req.request_id), dtype=np.int64)
            tokens = np.asarray(req.all_token_ids, dtype=np.float32)
            p0 = req.num_computed_tokens
            assert len(table) * bs >= p0 + n, "step writes beyond the request's blocks"
            pos = np.arange(p0 + n)
            slots = table[pos // bs] * bs + pos % bs
            k[slots[p0:]] = tokens[p0:p0 + n]
            v[slots[p0:]] = -tokens[p0:p0 + n]
            assert np.array_equal(k[slots], tokens[:p0 + n]) and np.array_equal(v[slots], -tokens[:p0 + n]), \
                f"request {req.request_id} reads corrupted KV"
            if p0 + n == req.num_tokens:
                sampled.append((req, int(tokens[:p0 + n].sum() * 31 + p0 + n) % 97 + 3))
        return StepOutput(sampled, self.step_s, self.step_s)
