"""Swap preemption: KV goes to a bounded host pool and comes back intact; recompute when full."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.kv_cache import KVCacheManager
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.swap import HOST_LINK_BYTES_PER_S, Swapper
from minibatch.workload import lognormal, synthetic

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conftest import drive  # noqa: E402
from kv_checking import KVCheckingExecutor  # noqa: E402


def test_swap_out_and_in_restores_the_kv_into_new_blocks():
    ex = KVCheckingExecutor(num_kv_blocks=8, block_size=4)
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, ex, capacity_blocks=4)
    req = Request("a", list(range(10, 20)), SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(req, 10)
    k = ex.kv_caches[0][0].view(-1)
    for p, t in enumerate(req.all_token_ids):
        table = kv.block_table("a")
        k[table[p // 4] * 4 + p % 4] = t
    req.num_computed_tokens = 10
    old = list(kv.block_table("a"))
    assert swapper.swap_out(req)
    assert kv.num_free_blocks == 8 and swapper.num_used == 3 and swapper.num_swapped_out == 3
    other = Request("b", [1] * 20, SamplingParams(), 0.0)         # takes the blocks freed earlier
    assert kv.allocate_slots(other, 20)
    k[:] = -1.0
    assert swapper.swap_in(req, 1)
    table = kv.block_table("a")
    assert table != old and len(table) == 3 and swapper.num_used == 0 and swapper.num_swapped_in == 3
    assert [int(k[table[p // 4] * 4 + p % 4]) for p in range(10)] == list(range(10, 20))


def test_swap_out_refused_when_the_host_pool_is_full():
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, KVCheckingExecutor(8, 4), capacity_blocks=2)
    req = Request("a", list(range(12)), SamplingParams(), 0.0)
    kv.allocate_slots(req, 12)
    req.num_computed_tokens = 12
    assert not swapper.swap_out(req)                 # 3 blocks > 2: the scheduler recomputes instead
    assert kv.block_table("a") and swapper.num_used == 0


def _overloaded(**kw):
    wl = synthetic(60, rate=50, seed=4, input_len=lognormal(median=200, sigma=0.6, max=1024),
                   output_len=lognormal(median=200, sigma=0.8, max=1000))
    return run(wl, executor="sim", model="llama-2-7b", hardware="a10", max_num_seqs=64, num_kv_blocks=300, **kw)


def test_swap_counts_blocks_and_models_the_copy_time():
    recompute = _overloaded(preemption_mode="recompute").summary()
    swap = _overloaded(preemption_mode="swap")
    s = swap.summary()
    assert s["num_preemptions"] > 0 and recompute["num_preemptions"] > 0
    assert s["num_swapped_blocks"] > 0 and recompute["num_swapped_blocks"] == 0
    assert sum(st.num_swapped_in_blocks for st in swap.steps) == s["num_swapped_blocks"]
    assert s["completed"] == 60


def test_sim_swap_time_is_blocks_times_bytes_over_the_link():
    engine = LLMEngine(EngineConfig(executor="sim", model="llama-2-7b", hardware="a10", num_kv_blocks=20,
                                    preemption_mode="swap"), clock="virtual")
    swapper = engine.scheduler.swapper
    req = Request("a", list(range(40)), SamplingParams(), 0.0)
    engine.kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    assert swapper.swap_out(req)
    assert swapper.take_time() == pytest.approx(3 * 16 * 524288 / HOST_LINK_BYTES_PER_S)
    assert swapper.take_time() == 0.0


def test_full_host_pool_falls_back_to_recompute():
    none = _overloaded(preemption_mode="swap", swap_space_blocks=0).summary()
    assert none["num_preemptions"] > 0 and none["num_swapped_blocks"] == 0
    small = _overloaded(preemption_mode="swap", swap_space_blocks=30)
    assert 0 < small.summary()["num_swapped_blocks"]
    # Bounded: never more than 30 blocks out at once.
    out = 0
    for st in small.steps:
        out += st.num_swapped_out_blocks - st.num_swapped_in_blocks
        assert out <= 30


def test_abort_while_swapped_out_frees_the_host_copy():
    engine = LLMEngine(EngineConfig(num_kv_blocks=6, block_size=4, preemption_mode="swap", max_num_seqs=4,
                                    policy="priority"), clock="virtual", executor=KVCheckingExecutor(6, 4))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    low = engine.add_request(list(range(3, 15)), params, priority=1)
    engine.step()
    engine.add_request(list(range(20, 32)), params, priority=0)     # needs low's blocks: low is swapped
    engine.step()
    assert engine.requests[low].status.value == "swapped" and engine.scheduler.swapper.num_used == 3
    engine.abort_request(low)
    assert engine.scheduler.swapper.num_used == 0 and not engine.scheduler.swapper.saved
    drive(engine, limit=1000)
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == 6


def test_swap_with_the_real_model_copies_tensors(checkpoints):
    """Real ``ModelExecutor`` tensors: swapped requests resume with identical greedy output."""
    from conftest import hf_greedy

    path, hf_model = checkpoints["qwen2-mqa"]
    prompts = [[(i * 11 + j) % 250 + 3 for j in range(20 + 5 * i)] for i in range(4)]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), num_kv_blocks=10, block_size=8,
                                                preemption_mode="swap", policy="priority"), clock="virtual")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, params, priority=len(prompts) - i))   # later = more urgent
        engine.step()
    drive(engine, limit=1000)
    assert engine.scheduler.swapper.num_swapped_in > 0
    assert [engine.output(i).outputs[0].token_ids for i in ids] == expected


def _computed(kv, rid, n):
    """A request whose first ``n`` tokens are computed (their blocks allocated)."""
    req = Request(rid, list(range(3, 3 + n)), SamplingParams(), 0.0)
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens = n
    return req


def test_swap_out_takes_one_block_and_a_pool_that_fits_exactly_but_not_nothing():
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, KVCheckingExecutor(8, 4), capacity_blocks=3)
    fresh = Request("f", [3, 4, 5], SamplingParams(), 0.0)
    assert kv.allocate_slots(fresh, 3)                      # blocks, but nothing computed yet
    assert not swapper.swap_out(fresh), "no computed KV: nothing to keep, the scheduler recomputes"
    assert kv.block_table("f") and swapper.num_used == 0 and not swapper.saved
    one = _computed(kv, "one", 3)                           # 3 tokens: 1 block
    assert swapper.swap_out(one) and swapper.num_used == 1 and not kv.block_table("one")
    two = _computed(kv, "two", 8)                           # 2 blocks: 1 + 2 == capacity 3, fits
    assert swapper.swap_out(two) and swapper.num_used == 3


def test_measured_copy_times_add_up_until_taken(monkeypatch):
    import minibatch.swap as swap_module

    ticks = iter(range(100, 200))                           # perf_counter: 100, 101, 102, ...
    monkeypatch.setattr(swap_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, KVCheckingExecutor(8, 4), capacity_blocks=8)
    req = _computed(kv, "a", 8)
    assert swapper.swap_out(req)                            # starts at 100, charged at 101: 1 s
    assert swapper.swap_in(req, 1)                          # starts at 102, charged at 103: 1 s
    assert swapper.take_time() == 2.0
    assert swapper.take_time() == 0.0


def test_modelled_copy_time_uses_the_executors_block_bytes_and_adds_up():
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, SimpleNamespace(block_bytes=1000), capacity_blocks=8)   # no kv_caches: modelled
    assert swapper.block_bytes == 1000
    assert swapper.swap_out(_computed(kv, "a", 5))          # 2 blocks
    assert swapper.swap_out(_computed(kv, "b", 4))          # 1 block
    assert swapper.take_time() == pytest.approx(3 * 1000 / HOST_LINK_BYTES_PER_S)


def test_an_executor_without_sizes_models_a_free_copy():
    kv = KVCacheManager(8, 4)
    swapper = Swapper(kv, SimpleNamespace(), capacity_blocks=8)     # neither block_bytes nor cost_model
    assert swapper.block_bytes == 0
    assert swapper.swap_out(_computed(kv, "a", 5))
    assert swapper.take_time() == 0.0
    with_model = Swapper(kv, SimpleNamespace(cost_model=SimpleNamespace(kv_bytes_per_token_per_gpu=100)), 8)
    assert with_model.block_bytes == 100 * 4
