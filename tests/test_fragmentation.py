"""The vLLM paper's taxonomy of KV waste (Kwon et al., SOSP'23, §3), measured by the KV
manager and the engine: reserved slots, internal and external fragmentation, for the
paged allocator and for contiguous reservations of equal and of different sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.config import EngineConfig
from minibatch.kv_cache import BlockPool, KVCacheManager
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.workload import synthetic, uniform


def _req(rid, prompt_len, max_tokens):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


def test_longest_free_run():
    pool = BlockPool(10)
    assert pool.longest_free_run() == 10
    a, b, c = pool.allocate_contiguous(3), pool.allocate_contiguous(2), pool.allocate_contiguous(4)
    pool.release(b)                                   # free: 3-4 and 9
    assert pool.num_free_blocks == 3 and pool.longest_free_run() == 2
    pool.release(a)                                   # free: 0-4 and 9
    assert pool.longest_free_run() == 5
    pool.release(c)
    assert pool.longest_free_run() == 10


def test_request_sized_reservations_fragment_externally():
    """Reservations of different sizes leave holes: 5 blocks are free, the request needs 4,
    yet no run of 4 exists. The refusal is counted, with the free blocks it stranded."""
    kv = KVCacheManager(16, 4, allocator="contiguous", max_model_len=64, contiguous_reserve="request")
    sizes = {"a": 3, "b": 2, "c": 5, "d": 3, "e": 3}        # blocks: prompt + max_tokens = 4 * blocks
    reqs = {rid: _req(rid, 4 * n - 2, 2) for rid, n in sizes.items()}
    for rid in "abcde":
        assert kv.allocate_slots(reqs[rid], reqs[rid].num_tokens)
        assert len(kv.block_table(rid)) == sizes[rid]
    kv.free(reqs["b"])                                       # free: blocks 3-4
    kv.free(reqs["d"])                                       # free: blocks 10-12
    assert kv.num_free_blocks == 5 and kv.pool.longest_free_run() == 3
    x = _req("x", 14, 2)                                     # 16 tokens: 4 blocks
    assert kv.blocks_for(kv.reserve_tokens(x)) == 4 <= kv.num_free_blocks
    assert not kv.allocate_slots(x, x.num_tokens)            # external fragmentation
    assert kv.num_fragmentation_refusals == 1
    assert kv.take_stranded_blocks() == 5 and kv.take_stranded_blocks() == 0
    y = _req("y", 10, 2)                                     # 12 tokens: 3 blocks fit at 10-12
    assert kv.allocate_slots(y, y.num_tokens) and kv.block_table("y") == [10, 11, 12]
    # the paged allocator has no runs to find: any 4 free blocks serve x
    paged = KVCacheManager(5, 4)
    assert paged.allocate_slots(x, x.num_tokens)
    kv.check_invariants()


def test_equal_reservations_never_refuse_with_enough_free_blocks():
    kv = KVCacheManager(23, 4, allocator="contiguous", max_model_len=20)   # runs of 5, remainder 3
    reqs = [_req(f"r{i}", 3, 2) for i in range(4)]
    for r in reqs:
        assert kv.allocate_slots(r, 3)
    for i in (2, 0, 3):
        kv.free(reqs[i])
        for j in range(2):
            r = _req(f"n{i}{j}", 3, 2)
            kv.allocate_slots(r, 3)
    assert kv.num_fragmentation_refusals == 0


def test_over_reservation_is_internal_fragmentation_as_the_paper_defines_it():
    """A 5-token prompt with max_tokens=4 writes 8 slots (the last generated token's K/V is
    never computed). Reserving max_model_len=24 tokens (6 blocks of 4) holds 24 slots: 8 - c
    reserved (still to be written), 16 never written: internal fragmentation. The
    last-block statistic (waste_slots) sees only the partly filled last block."""
    kv = KVCacheManager(20, 4, allocator="contiguous", max_model_len=24)
    a = _req("a", 5, 4)
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    assert kv.fragmentation_slots([a]) == (8 - 5, 24 - 8)
    assert kv.waste_slots([a]) == ((6 - 2) * 4, 3)
    a.num_computed_tokens = 8                                  # at its end
    assert kv.fragmentation_slots([a]) == (0, 16)
    # a request-sized reservation over-reserves only the block rounding and the last slot
    kv2 = KVCacheManager(20, 4, allocator="contiguous", max_model_len=24, contiguous_reserve="request")
    b = _req("b", 5, 4)                                        # 9 tokens: 3 blocks, 12 slots
    assert kv2.allocate_slots(b, 5)
    b.num_computed_tokens = 5
    assert kv2.fragmentation_slots([b]) == (3, 12 - 8)
    # paged: while it runs, the last block's empty slots are reserved (they will be written)
    kv3 = KVCacheManager(20, 4)
    c = _req("c", 5, 4)
    assert kv3.allocate_slots(c, 5)
    c.num_computed_tokens = 5
    assert kv3.fragmentation_slots([c]) == (3, 0)


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 60), max_tokens=st.integers(1, 40), block_size=st.sampled_from([1, 4, 16]),
       reserve=st.sampled_from(["max_model_len", "request"]), allocator=st.sampled_from(["paged", "contiguous"]))
def test_held_slots_split_into_tokens_reserved_and_internal(prompt, max_tokens, block_size, reserve, allocator):
    kv = KVCacheManager(128, block_size, allocator=allocator, max_model_len=128, contiguous_reserve=reserve)
    r = _req("r", prompt, max_tokens)
    new = prompt                                              # the prefill, then one token a step
    while True:
        assert kv.allocate_slots(r, new)
        r.num_computed_tokens += new
        r.output_token_ids.append(3)                          # the token this step sampled
        held = len(kv.block_table("r")) * block_size
        reserved, internal = kv.fragmentation_slots([r])
        assert r.num_computed_tokens + reserved + internal == held
        assert internal >= 0 and reserved >= 0
        if allocator == "paged":
            assert internal < block_size
        if len(r.output_token_ids) == max_tokens:
            break
        new = 1
    assert r.num_computed_tokens == prompt + max_tokens - 1
    assert kv.fragmentation_slots([r])[0] == 0                # at its end nothing is still to come


def test_engine_records_the_taxonomy():
    wl = synthetic(60, rate=200, input_len=uniform(20, 400), output_len=uniform(5, 300), seed=2)
    kw = dict(executor="sim", model="llama-2-7b", hardware="a10", max_model_len=1024, num_kv_blocks=200)
    paged = run(wl, **kw).summary()
    equal = run(wl, **kw, kv_allocator="contiguous").summary()
    sized_run = run(wl, **kw, kv_allocator="contiguous", contiguous_reserve="request")
    sized = sized_run.summary()
    # each step's external fragmentation is whole stranded blocks of free slots, as a fraction of the pool
    slots, bs = 200 * 16, 16
    fragmented = [s for s in sized_run.steps if s.kv_external_frag > 0]
    assert fragmented
    for s in fragmented:
        stranded = s.kv_external_frag * slots / bs
        assert stranded == pytest.approx(round(stranded)) and s.kv_external_frag <= 1 - s.kv_usage + 1e-9
    assert paged["kv_external_frag_mean"] == 0 == equal["kv_external_frag_mean"]
    assert sized["kv_external_frag_mean"] > 0
    assert paged["kv_internal_frag_mean"] < 0.01 < sized["kv_internal_frag_mean"] < equal["kv_internal_frag_mean"]
    for s in (paged, equal, sized):                           # the old keys still there, and consistent
        total = s["kv_reserved_mean"] + s["kv_internal_frag_mean"]
        assert total == pytest.approx(s["kv_reserved_unused_mean"] + s["kv_internal_waste_mean"])
        assert s["kv_util_mean"] >= total


def test_contiguous_reserve_option():
    with pytest.raises(ValueError, match="contiguous_reserve"):
        EngineConfig.from_kwargs(kv_allocator="contiguous", contiguous_reserve="oracle")
    with pytest.raises(ValueError, match="contiguous_reserve"):
        KVCacheManager(8, 4, allocator="contiguous", max_model_len=16, contiguous_reserve="pow2")
    assert EngineConfig().contiguous_reserve == "max_model_len"
