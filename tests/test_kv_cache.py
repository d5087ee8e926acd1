"""Block conservation and scheduler invariants, as property tests over random workloads."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.executor import StepOutput
from minibatch.kv_cache import BlockPool, KVCacheManager, hash_block
from minibatch.request import Request
from minibatch.sampling_params import SamplingParams


class CountingExecutor:
    """No model: every sampling request gets token ``position % 97 + 3``; 1 ms a step."""

    model_config = None
    max_model_len = 4096

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks

    def execute(self, batch, kv):
        sampled = [(r, (r.num_tokens % 97) + 3) for r, n in batch.items
                   if r.num_computed_tokens + n == r.num_tokens]
        return StepOutput(sampled, 0.001, 0.001)


workloads = st.lists(
    st.tuples(st.integers(1, 80), st.integers(1, 40), st.integers(0, 5)),  # prompt, max_tokens, arrival step
    min_size=1, max_size=24)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, num_blocks=st.integers(8, 64), block_size=st.sampled_from([4, 8, 16]),
       max_num_seqs=st.integers(1, 8), budget=st.integers(8, 96), chunked=st.booleans(),
       prefix=st.booleans())
def test_blocks_conserved_and_no_request_lost(workload, num_blocks, block_size, max_num_seqs, budget,
                                             chunked, prefix):
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
                          num_kv_blocks=num_blocks, enable_chunked_prefill=chunked,
                          enable_prefix_caching=prefix)
    engine = LLMEngine(config, clock="virtual", executor=CountingExecutor(num_blocks))
    submitted = []
    pending = sorted(enumerate(workload), key=lambda x: x[1][2])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (plen, max_tokens, _) = pending.pop(0)
            prompt = [(i * 7 + j) % 50 + 3 for j in range(plen)]  # shared prefixes across requests
            # Worked out here, not taken from the engine: it can never hold the request, or
            # (without chunking) the prompt is longer than a step's budget.
            never_fits = -(-(plen + max_tokens) // block_size) > num_blocks
            too_long = not chunked and plen > budget
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            if never_fits or too_long:
                due = [w for w, d in (("KV blocks", never_fits), ("max_num_batched_tokens", too_long)) if d]
                with pytest.raises(ValueError, match="|".join(due)):
                    engine.add_request(prompt, params)
            else:
                submitted.append(engine.add_request(prompt, params))
        engine.step()
        engine.kv.check_invariants()
        assert engine.kv.num_used_blocks + engine.kv.num_free_blocks == num_blocks
        step += 1
        assert step < 5000, "the engine stopped making progress"
    for rid in submitted:
        req = engine.requests[rid]
        assert req.status.value == "length"
        assert req.num_output_tokens == req.sampling_params.max_tokens
    assert engine.kv.num_free_blocks == num_blocks, "blocks left allocated after the run"


def _req(rid, tokens, max_tokens=4):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), 0.0)


def test_allocation_is_on_demand_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", list(range(5)))
    assert kv.allocate_slots(r, 5)
    assert len(kv.block_table("a")) == 2          # 5 tokens -> 2 blocks of 4
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3)                # up to 8 tokens: still 2 blocks
    assert len(kv.block_table("a")) == 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1)
    assert len(kv.block_table("a")) == 3
    assert not kv.allocate_slots(_req("b", list(range(40))), 40)   # needs 10 blocks, 7 free
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_prefix_cache_shares_full_blocks_and_evicts_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)                       # blocks 0..1 are full and cached
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.block_table("a")[:2]
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_table("b")[:2] == hits
    assert kv.pool.blocks[hits[0]].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 6                # cached blocks are free but still hit
    assert kv.get_computed_blocks(_req("c", list(range(9))))[1] == 8
    big = _req("d", [50 + i for i in range(24)])
    assert kv.allocate_slots(big, 24)             # takes every block: the cache is evicted
    assert kv.get_computed_blocks(_req("e", list(range(9))))[1] == 0


def test_full_prompt_hit_still_computes_one_token():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    hits, n = kv.get_computed_blocks(_req("b", list(range(8))))
    assert n == 4 and len(hits) == 1               # the last block is recomputed for its logits


# -- the pool's own answers, on hand-made pools ------------------------------------------------------
def test_first_fit_starts_a_run_at_the_lowest_free_block_not_at_zero():
    pool = BlockPool(4)
    assert pool.allocate_contiguous(1) == [0]             # free: 1, 2, 3
    assert pool.find_contiguous(2) == 1 and pool.find_contiguous(3) == 1
    assert pool.find_contiguous(4) is None


def test_a_full_pool_has_no_free_run():
    pool = BlockPool(3)
    pool.allocate(3)
    assert pool.longest_free_run() == 0 and pool.find_contiguous(1) is None


def test_register_says_whether_the_block_was_cached():
    pool = BlockPool(4)
    assert pool.register(0, 111) is True and pool.cached == {111: 0}
    assert pool.register(0, 222) is False                 # block 0 already holds a cached prefix
    assert pool.register(1, 111) is False                 # that prefix is cached, under block 0
    assert pool.register(2, 333, parent_hash=999) is False   # its parent prefix is not cached
    assert pool.register(1, 444, parent_hash=111) is True
    assert pool.cached == {111: 0, 444: 1}
    assert [pool.blocks[b].block_hash for b in range(4)] == [111, 444, None, None]


def test_cached_prefix_len_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)                               # blocks of [0..3] and [4..7] cached
    # the same 8 tokens: (8 - 1) // 4 = 1 block may be served, the second is recomputed
    assert kv.cached_prefix_len(_req("b", list(range(8)))) == 4
    assert kv.cached_prefix_len(_req("c", list(range(9)))) == 8      # (9 - 1) // 4 = 2 blocks
    assert kv.cached_prefix_len(_req("d", [0, 1, 2, 9, 4])) == 0     # the first block differs


def test_cached_prefix_len_without_prefix_caching_is_zero():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.cached_prefix_len(_req("b", list(range(9)))) == 0


def test_check_invariants_catches_a_block_held_twice_by_one_request():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(4)))
    kv.allocate_slots(a, 4)
    b = kv.block_table("a")[0]
    kv.req_blocks["a"].append(b)                          # the table lists b twice...
    kv.pool.blocks[b].ref_cnt = 2                         # ...and its count agrees, so only this check sees it
    with pytest.raises(AssertionError, match=r"^a request holds the same block twice$"):
        kv.check_invariants()


def test_check_invariants_catches_the_radix_tree_and_the_hash_index_disagreeing():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.check_invariants()
    last = kv.block_table("a")[1]
    del kv.pool.cached[kv.pool.blocks[last].block_hash]   # the hash index forgets the second block,
    kv.pool.blocks[last].block_hash = None                # consistently; the tree still holds it
    with pytest.raises(AssertionError, match=r"^the radix tree and the hash index disagree on the cached blocks$"):
        kv.check_invariants()


def test_evictions_are_counted_from_zero():
    pool = BlockPool(2)
    assert pool.num_evictions == 0
    pool.allocate(1)                                      # block 0
    assert pool.register(0, 111) is True
    pool.release([0])                                     # free, still cached
    pool.allocate(2)                                      # takes block 1, then block 0: its prefix is evicted
    assert pool.num_evictions == 1 and pool.cached == {}


def test_each_eviction_adds_one():
    pool = BlockPool(2)
    pool.allocate(2)                                      # blocks 0 and 1
    assert pool.register(0, 111) is True and pool.register(1, 222) is True
    pool.release([0, 1])                                  # both free, both still cached
    pool.allocate(2)                                      # both handed out again: two prefixes evicted
    assert pool.num_evictions == 2 and pool.cached == {}


def test_allocating_more_blocks_than_are_free_names_both_counts():
    pool = BlockPool(3)
    pool.allocate(1)                                      # 2 of 3 left
    with pytest.raises(RuntimeError, match=r"^asked for 3 KV blocks, only 2 free$"):
        pool.allocate(3)


def test_bad_kv_manager_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^unknown kv_allocator 'bogus'; expected one of "):
        KVCacheManager(num_blocks=4, block_size=4, allocator="bogus")
    with pytest.raises(ValueError, match=r"^prefix caching needs the paged allocator \(kv_allocator='paged'\)$"):
        KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True, allocator="contiguous",
                       max_model_len=16)
    with pytest.raises(ValueError, match=r"^the contiguous allocator needs max_model_len$"):
        KVCacheManager(num_blocks=4, block_size=4, allocator="contiguous")


def test_waste_slots_skips_a_request_without_blocks_and_counts_the_ones_after_it():
    kv = KVCacheManager(8, 4)
    empty = Request("e", [3, 4, 5], SamplingParams(), 0.0)             # waiting: no blocks yet
    held = Request("h", list(range(3, 9)), SamplingParams(), 0.0)     # 6 tokens, 2 blocks of 4
    assert kv.allocate_slots(held, 6)
    held.num_computed_tokens = 5                                      # 5 computed: 2 blocks filled partly
    # reserved-but-unused: 2 blocks - ceil(5 / 4) = 0 blocks; internal: 2 * 4 - 5 = 3 slots
    assert kv.waste_slots([held]) == (0, 3)
    assert kv.waste_slots([empty, held]) == (0, 3)
    # fragmentation_slots too: held's final length is 6 + 16 (max_tokens) - 1 = 21 slots written, so
    # of its 8 slots 8 - 5 = 3 are reserved (still to write) and none is internal fragmentation.
    assert kv.fragmentation_slots([held]) == (3, 0)
    assert kv.fragmentation_slots([empty, held]) == (3, 0)


def test_planned_len_is_capped_by_max_model_len():
    req = Request("r", list(range(3, 9)), SamplingParams(max_tokens=16), 0.0)      # 6 + 16 = 22 tokens
    assert KVCacheManager(8, 4).planned_len(req) == 22
    assert KVCacheManager(8, 4, max_model_len=10).planned_len(req) == 10


# -- the contiguous allocator, by hand ------------------------------------------------------------
def test_contiguous_request_reserve_holds_the_requests_own_length_capped_by_max_model_len():
    own = KVCacheManager(8, 4, allocator="contiguous", max_model_len=16, contiguous_reserve="request")
    assert own.blocks_for_request(5) == 2                 # ceil(min(5, 16) / 4)
    assert own.blocks_for_request(40) == 4                # ceil(min(40, 16) / 4)
    same = KVCacheManager(8, 4, allocator="contiguous", max_model_len=16)
    assert same.blocks_for_request(5) == 4                # ceil(16 / 4): every request the same
    assert KVCacheManager(8, 4).blocks_for_request(5) == 2     # paged: ceil(5 / 4)


def test_contiguous_refusals_with_enough_free_blocks_but_no_run_are_each_counted():
    kv = KVCacheManager(4, 4, allocator="contiguous", max_model_len=16, contiguous_reserve="request")
    # prompt 1 + max_tokens 3 = 4 tokens: 1 block each, first fit -> blocks 0, 1, 2, 3
    one = [Request(f"r{i}", [3], SamplingParams(max_tokens=3), 0.0) for i in range(4)]
    for i, r in enumerate(one):
        assert kv.allocate_slots(r, 1) and kv.block_table(r.request_id) == [i]
    kv.free(one[0])
    kv.free(one[2])                                       # free: 0 and 2, no run of 2
    two = Request("two", [3], SamplingParams(max_tokens=7), 0.0)       # 8 tokens: 2 blocks
    # 2 blocks needed, exactly 2 free (need == free still counts), none adjacent: refused, counted
    assert not kv.allocate_slots(two, 1)
    assert kv.num_fragmentation_refusals == 1 and kv.take_stranded_blocks() == 2
    assert not kv.allocate_slots(two, 1)                  # asked again, refused again: 2, not 1
    assert kv.num_fragmentation_refusals == 2 and kv.take_stranded_blocks() == 2
    three = Request("three", [3], SamplingParams(max_tokens=11), 0.0)  # 12 tokens: 3 blocks > 2 free
    assert not kv.allocate_slots(three, 1)                # short of blocks: not fragmentation
    assert kv.num_fragmentation_refusals == 2 and kv.take_stranded_blocks() == 0


# -- prefix hits: the hash chain a hit starts from ------------------------------------------------
def test_a_prefix_hit_records_the_chain_hashes_so_the_next_full_block_is_cached_after_it():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    a = _req("a", list(range(3, 11)))                     # 8 tokens: 2 full blocks
    assert kv.allocate_slots(a, 8)
    assert "a" not in kv.req_hashes                       # no hit, nothing computed: no hashes yet
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = _req("b", list(range(3, 15)) + [50])              # a's 8 tokens, 4 more, 1 more: 13 tokens
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.block_table("a")         # (13 - 1) // 4 = 3 blocks asked, 2 cached
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 5, hits)                  # ceil(13 / 4) - 2 = 2 new blocks
    # The hit's hashes, chained from None over each block's own 4 tokens:
    h0 = hash_block(None, (3, 4, 5, 6))
    h1 = hash_block(h0, (7, 8, 9, 10))
    assert kv.req_hashes["b"] == [h0, h1]
    b.num_computed_tokens = 13
    kv.cache_full_blocks(b)                               # b's third block (11..14) chains off h1
    h2 = hash_block(h1, (11, 12, 13, 14))
    assert kv.req_hashes["b"] == [h0, h1, h2] and kv.pool.lookup(h2) == kv.block_table("b")[2]
    # so a request sharing b's first 12 tokens hits all three blocks
    hits, n = kv.get_computed_blocks(_req("c", list(range(3, 15)) + [60]))
    assert n == 12 and hits == kv.block_table("b")[:3]
