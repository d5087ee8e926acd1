"""KVCacheManager.slot_stats (one pass, what the engine records every step, and what waste_slots and
fragmentation_slots return parts of) equals the two definitions written out request by request here,
at every step of runs that preempt, share prefixes and use the contiguous allocator."""

import math

import pytest

from minibatch.runner import run
from minibatch.workload import multi_tenant, synthetic


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=40, block_size=16),
                                dict(num_kv_blocks=64, block_size=8, enable_prefix_caching=True),
                                dict(kv_allocator="contiguous", max_model_len=512)])
def test_slot_stats_equals_the_two_definitions_at_every_step(kw):
    seen = []

    def by_definition(kv, running):
        """waste_slots' and fragmentation_slots' docstrings, one request at a time."""
        bs, out = kv.block_size, [0, 0, 0, 0]
        for r in running:
            k, c = len(kv.req_blocks.get(r.request_id, ())), r.num_computed_tokens
            if k:
                filled = min(k, math.ceil(c / bs))
                w = max(kv.planned_len(r) - 1, c)
                for i, v in enumerate(((k - filled) * bs, filled * bs - min(c, filled * bs),
                                       max(0, min(k * bs, w) - c), max(0, k * bs - w))):
                    out[i] += v
        return tuple(out)

    def check(engine, step):
        running = engine.scheduler.running
        merged = engine.kv.slot_stats(running)
        assert merged == by_definition(engine.kv, running)
        assert merged == (*engine.kv.waste_slots(running), *engine.kv.fragmentation_slots(running))
        seen.append(merged)

    wl = (multi_tenant(40, 40.0, num_tenants=2, system_prompt_len=64, question_len=24, output_len=20, seed=1)
          if kw.get("enable_prefix_caching") else synthetic(40, 40.0, input_len=96, output_len=48, seed=1))
    run(wl, executor="sim", model="llama-2-7b", hardware="a10", on_step=check, **kw)
    assert len(seen) > 20 and any(any(v) for v in seen), "the runs must hold blocks with empty slots"
