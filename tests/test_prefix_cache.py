"""Prefix caching: the radix-tree index, its agreement with the hash chain, the hit rate
the summary reports, and the ``lpm`` policy's aging guard."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.radix import RadixTree
from minibatch.runner import run
from minibatch.workload import RequestSpec, Workload, shared_prefix

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kv_checking import KVCheckingExecutor  # noqa: E402


def test_radix_insert_match_split_remove():
    t = RadixTree(block_size=2)
    assert t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == [10, 11, 12]
    assert len(t.root.children) == 1 and next(iter(t.root.children.values())).blocks == [10, 11, 12]
    assert t.match_prefix([1, 2, 3, 4, 9, 9]) == [10, 11]
    assert t.match_prefix([1, 2, 3]) == [10]                      # whole blocks only
    assert t.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == [22]     # shares two blocks: the edge splits
    t.check()
    top = t.root.children[(1, 2)]
    assert top.blocks == [10, 11] and sorted(c.blocks[0] for c in top.children.values()) == [12, 22]
    assert t.match_prefix([1, 2, 3, 4, 7, 8, 0, 0]) == [10, 11, 22]
    t.insert([1, 2, 3, 4, 7, 8, 9, 9], [30, 31, 32, 33])          # a leaf edge grows in place
    assert t._where[33] is t._where[22]
    assert sorted(t.remove(11)) == [11, 12, 22, 33]               # a block and all below it
    t.check()
    assert t.match_prefix([1, 2, 3, 4, 7, 8]) == [10]
    assert t.remove(10) == [10] and len(t) == 0 and not t.root.children


ops = st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=0, max_size=10), st.integers(0, 50)),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_radix_tree_agrees_with_a_dict_of_prefixes(ops):
    """Against a naive index {prefix tokens: block} over random inserts and evictions."""
    bs = 2
    tree, naive, next_id = RadixTree(bs), {}, 0
    for is_insert, tokens, pick in ops:
        nblocks = len(tokens) // bs
        if is_insert:
            blocks = list(range(next_id, next_id + nblocks))
            next_id += nblocks
            tree.insert(tokens, blocks)
            for i in range(nblocks):
                naive.setdefault(tuple(tokens[:(i + 1) * bs]), blocks[i])
        elif naive:
            key, block = sorted(naive.items())[pick % len(naive)]
            assert sorted(tree.remove(block)) == sorted(b for k, b in naive.items() if k[:len(key)] == key)
            naive = {k: b for k, b in naive.items() if k[:len(key)] != key}
        tree.check()
        expect = []
        for i in range(nblocks):
            b = naive.get(tuple(tokens[:(i + 1) * bs]))
            if b is None:
                break
            expect.append(b)
        assert tree.match_prefix(tokens) == expect


def test_radix_and_hash_chain_agree_during_a_run():
    """At every step, for every waiting request, the radix tree finds the same cached
    prefix as the hash-chain lookup that admission uses."""
    wl = shared_prefix(60, rate=400, num_prefixes=5, prefix_len=40, suffix_len=12, output_len=10,
                       seed=1, vocab_size=60)
    engine = LLMEngine(EngineConfig(num_kv_blocks=40, block_size=4, enable_prefix_caching=True, max_num_seqs=6,
                                    policy="lpm"), clock="virtual", executor=KVCheckingExecutor(40, 4))
    checked = 0

    def on_step(e, step):
        nonlocal checked
        e.kv.check_invariants()
        for r in e.scheduler.waiting:
            if r.status.value == "waiting":
                assert e.kv.cached_prefix_len(r) == e.kv.get_computed_blocks(r)[1]
                checked += 1

    result = run(wl, engine=engine, on_step=on_step)
    assert result.summary()["completed"] == 60 and checked > 100
    assert engine.kv.pool.num_evictions > 0


def test_hit_rate_in_summary_is_prompt_tokens_served_from_cache():
    """Two prompts share 48 tokens (3 blocks of 16); the second arrives after the first
    finished: it reuses 48 of its 64 prompt tokens, so the hit rate is 48 / (64 + 64)."""
    shared = list(range(3, 51))
    specs = [RequestSpec(0.0, 64, 4, prompt_token_ids=shared + list(range(100, 116)), request_id="a"),
             RequestSpec(5.0, 64, 4, prompt_token_ids=shared + list(range(200, 216)), request_id="b")]
    engine = LLMEngine(EngineConfig(executor="sim", model="llama-2-7b", enable_prefix_caching=True, block_size=16),
                       clock="virtual")
    result = run(Workload(specs), engine=engine)
    s = result.summary()
    assert s["prefix_cache_hit_rate"] == 48 / 128
    assert [r.num_cached_tokens for r in result.requests] == [0, 48]
    assert engine.kv.prefix_hits / engine.kv.prefix_queries == 48 / 128
    off = run(Workload(specs), executor="sim", model="llama-2-7b", block_size=16).summary()
    assert off["prefix_cache_hit_rate"] == 0.0


def test_hit_rate_counts_each_request_once_despite_waiting():
    """A request that waits many steps (looked up each step) is counted once."""
    prompt = list(range(3, 35))
    specs = [RequestSpec(0.0, 32, 40, prompt_token_ids=prompt, request_id=f"r{i}") for i in range(6)]
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=8, enable_prefix_caching=True, max_num_seqs=1),
                       clock="virtual", executor=KVCheckingExecutor(64, 8))
    s = run(Workload(specs), engine=engine).summary()
    # r0 computes the prompt; r1..r5 each reuse 3 of its 4 blocks (the last token is recomputed).
    assert s["prefix_cache_hit_rate"] == 5 * 24 / (6 * 32)
    assert engine.kv.prefix_queries == 6 * 32
    assert engine.kv.prefix_hits == 5 * 24           # the engine's counter sums every admission's hit


def _cold_ttft(aging):
    """One cache-cold request in a stream of requests sharing a hot 512-token prefix."""
    from minibatch.policies.lpm import LPMPolicy

    hot = list(range(1000, 1512))
    specs = [RequestSpec(0.0, 528, 16, prompt_token_ids=hot + list(range(16)), request_id="hot0"),
             RequestSpec(0.01, 528, 16, prompt_token_ids=list(range(5000, 5528)), request_id="cold")]
    specs += [RequestSpec(0.15 * i, 528, 16, prompt_token_ids=hot + list(range(16 * i, 16 * i + 16)),
                          request_id=f"hot{i}") for i in range(1, 150)]
    r = run(Workload(specs), executor="sim", model="llama-2-7b", hardware="a100-80g", enable_prefix_caching=True,
            max_num_seqs=1, policy=LPMPolicy(aging_tokens_per_s=aging))
    return next(x.ttft for x in r.requests if x.request_id == "cold")


def test_lpm_aging_keeps_cache_cold_requests_from_starving():
    starved = _cold_ttft(0.0)        # pure LPM: the cold request waits for the whole hot stream
    aged = _cold_ttft(100.0)         # beats hot requests arriving > 512 / 100 s after it
    assert starved > 20.0
    assert aged < starved / 3
