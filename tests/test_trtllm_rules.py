"""TensorRT-LLM's in-flight batching rules (``minibatch.policies.trtllm``, the ``static_batch``,
``guaranteed_no_evict`` and ``max_utilization`` admission modes), each on a small hand-made
scheduler state with the expected batch worked out by hand in the comments."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch.config import EngineConfig
from minibatch.kv_cache import KVCacheManager
from minibatch.policies.trtllm import TRTLLMPolicy
from minibatch.request import Request, RequestStatus
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler
from minibatch.workload import RequestSpec

BS = 4    # tokens per block in every hand-made case


def sched(num_blocks, admission="guaranteed_no_evict", **kw) -> Scheduler:
    cfg = EngineConfig(policy="trtllm", admission=admission, block_size=BS, **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), max_model_len=1000)


def waiting(s, rid, prompt, max_tokens=4, arrival=0.0) -> Request:
    r = Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), arrival)
    s.add(r)
    return r


def running(s, rid, prompt, out=1, max_tokens=4, arrival=0.0, computed=None) -> Request:
    """A request already admitted: ``computed`` tokens in KV (default: all but the last sampled one)."""
    r = Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), arrival)
    r.output_token_ids = [9] * out
    n = r.num_tokens - 1 if computed is None else computed
    assert s.kv.allocate_slots(r, n)
    r.num_computed_tokens = n
    r.status = RequestStatus.RUNNING
    r.first_scheduled_time = arrival
    s.running.append(r)
    return r


def items(batch) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in batch.items]


def test_the_order_is_arrival_order_whatever_the_queue():
    s = sched(64)
    late = running(s, "late", 4, arrival=2.0)
    early = waiting(s, "early", 4, arrival=1.0)       # e.g. paused earlier: it keeps its place
    order = TRTLLMPolicy().schedule_order(s.state(3.0))
    assert [r.request_id for r in order] == ["early", "late"]
    assert early.status is RequestStatus.WAITING and late.status is RequestStatus.RUNNING


def test_capacity_scheduler_policy_names_map_to_admission_modes():
    for name, mode in [("GUARANTEED_NO_EVICT", "guaranteed_no_evict"), ("MAX_UTILIZATION", "max_utilization"),
                       ("static_batch", "static_batch")]:
        assert EngineConfig.from_kwargs(capacity_scheduler_policy=name).admission == mode
    with pytest.raises(ValueError, match="GUARANTEED_NO_EVICT.*STATIC_BATCH"):
        EngineConfig.from_kwargs(capacity_scheduler_policy="FIFO")
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig.from_kwargs(capacity_scheduler_policy="STATIC_BATCH", admission="max_utilization")


# -- STATIC_BATCH ------------------------------------------------------------------------------------
def test_static_batch_admits_nothing_while_a_batch_runs():
    s = sched(64, admission="static_batch")
    r = running(s, "r", 4)
    waiting(s, "a", 4, arrival=1.0)
    # r (running before this step) is unfinished: "a" may not join, although KV and budget are free.
    assert items(s.schedule(2.0)) == [("r", 1)]
    assert [w.request_id for w in s.waiting] == ["a"]
    s.remove(r)                          # the batch is done
    waiting(s, "b", 4, arrival=1.5)
    # Now a whole new batch is admitted in one step: a and b (4 prompt tokens each).
    assert items(s.schedule(3.0)) == [("a", 4), ("b", 4)]


def test_static_batch_still_reserves_whole_futures():
    s = sched(5, admission="static_batch")
    # Each request's future is 4 prompt + 4 output = 8 tokens = 2 blocks: two fit in 5 blocks, the
    # third (2 more) does not, and admission stops there (the batch is a and b).
    for i, rid in enumerate("abc"):
        waiting(s, rid, 4, arrival=float(i))
    assert items(s.schedule(3.0)) == [("a", 4), ("b", 4)]


# -- GUARANTEED_NO_EVICT -------------------------------------------------------------------------------
def test_guaranteed_no_evict_stops_at_the_first_request_that_does_not_fit():
    s = sched(6)
    running(s, "r", 4, out=1, max_tokens=4)      # holds 1 block (4 tokens), will need 2 (8 tokens)
    waiting(s, "big", 12, max_tokens=4, arrival=1.0)     # 16 tokens = 4 blocks
    waiting(s, "small", 2, max_tokens=2, arrival=2.0)    # 4 tokens = 1 block
    # Free 5 blocks, 1 promised to r: 4 left. big needs 4: admitted, 0 left; small needs 1: refused.
    assert items(s.schedule(3.0)) == [("r", 1), ("big", 12)]
    s2 = sched(5)
    running(s2, "r", 4, out=1, max_tokens=4)
    waiting(s2, "big", 12, max_tokens=4, arrival=1.0)
    waiting(s2, "small", 2, max_tokens=2, arrival=2.0)
    # Free 4, promised 1: 3 left. big (4) does not fit, and TensorRT-LLM stops there: small waits too.
    assert items(s2.schedule(3.0)) == [("r", 1)]


EXAMPLES = int(os.environ.get("MINIBATCH_PROPERTY_EXAMPLES", "25"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 120), st.floats(0, 2)),
                        min_size=1, max_size=24),
       chunked=st.booleans(), num_blocks=st.integers(24, 60))
def test_guaranteed_no_evict_never_preempts(lengths, chunked, num_blocks):
    """Whatever arrives, with a pool far smaller than the load: no preemption, every request done."""
    specs = [RequestSpec(arrival_time=t, prompt_len=p, max_tokens=o, request_id=f"r{i}")
             for i, (p, o, t) in enumerate(lengths)]
    res = run(specs, executor="sim", model="llama-2-7b", hardware="a100-80g", policy="trtllm",
              admission="guaranteed_no_evict", num_kv_blocks=num_blocks, block_size=16,
              max_num_batched_tokens=256, enable_chunked_prefill=chunked)
    s = res.summary()
    # 24 blocks x 16 tokens hold 384 tokens >= the largest request (320): every one can be served.
    assert s["completed"] == len(specs) and s["num_preemptions"] == 0


# -- MAX_UTILIZATION ------------------------------------------------------------------------------------
def test_max_utilization_evicts_the_latest_started():
    s = sched(4, admission="max_utilization")
    # 4 blocks. b and c each hold 1 block (4 tokens computed) and need a 2nd for their next token.
    b = running(s, "b", 4, arrival=1.0)
    c = running(s, "c", 4, arrival=2.0)
    # w arrived first (it was paused before) and needs 2 blocks for its 8-token prompt.
    waiting(s, "w", 8, arrival=0.0)
    batch = s.schedule(3.0)
    # Arrival order w, b, c: w takes the 2 free blocks; b needs 1, none is free, so the last started
    # request after it in the order, c, is paused (its block freed) and b gets that block.
    assert items(batch) == [("w", 8), ("b", 1)]
    assert [r.request_id for r in batch.preempted] == ["c"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0 and b.status is RequestStatus.RUNNING
    assert s.waiting[0] is c             # back at the front, recomputed later (its place in the order kept)


def test_max_utilization_a_paused_request_evicts_later_started_ones():
    s = sched(4, admission="max_utilization")
    # b and c: 7 prompt tokens + 1 output, 7 computed: 2 blocks each, their next token fits; 0 free.
    b = running(s, "b", 7, arrival=1.0)
    c = running(s, "c", 7, arrival=2.0)
    waiting(s, "w", 4, arrival=0.0)           # paused before, first in arrival order: needs 1 block
    batch = s.schedule(3.0)
    # w cannot get a block, so the last started request after it (c) is paused; w takes one of its
    # 2 blocks, and b (whose next token fits) runs.
    assert items(batch) == [("w", 4), ("b", 1)]
    assert [r.request_id for r in batch.preempted] == ["c"] and b.status is RequestStatus.RUNNING
    assert c.status is RequestStatus.WAITING


def test_max_utilization_stops_admitting_at_the_first_refusal():
    s = sched(3, admission="max_utilization")
    r = running(s, "r", 3, arrival=5.0)      # 4 tokens, 3 computed: 1 block, next token fits; 2 free
    waiting(s, "huge", 16, arrival=0.0)       # 4 blocks: even with r paused (3 free) it does not fit
    waiting(s, "tiny", 4, arrival=1.0)        # 1 block would fit, but TensorRT-LLM breaks at "huge"
    batch = s.schedule(6.0)
    # huge fails, r (started after it) is paused and huge retried, fails again: no one left, break.
    assert items(batch) == [] and batch.preempted == [r]
    assert [w.request_id for w in s.waiting] == ["r", "huge", "tiny"]


# -- micro-batch scheduler ------------------------------------------------------------------------------
def test_decodes_get_their_tokens_before_context_chunks():
    # Budget 10. p (arrived first) is mid-prompt: 8 of 20 tokens computed; d1, d2 decode.
    s = sched(64, max_num_batched_tokens=10, enable_chunked_prefill=True)
    running(s, "p", 20, out=0, arrival=0.0, computed=8)
    running(s, "d1", 4, arrival=1.0)
    running(s, "d2", 4, arrival=2.0)
    # 2 tokens set aside for d1, d2; p's chunk gets 10 - 2 = 8 (two whole blocks).
    assert items(s.schedule(3.0)) == [("p", 8), ("d1", 1), ("d2", 1)]


def test_only_running_decodes_are_set_aside_not_other_prompts_mid_chunk():
    # Budget 13. p and q are both mid-prompt (8 of 20 computed), d1 decodes. Only d1's token is set
    # aside: p gets 13 - 1 = 12 (three whole blocks), d1 its 1, and nothing is left for q.
    s = sched(64, max_num_batched_tokens=13, enable_chunked_prefill=True)
    running(s, "p", 20, out=0, arrival=0.0, computed=8)
    running(s, "d1", 4, arrival=1.0)
    running(s, "q", 20, out=0, arrival=2.0, computed=8)
    assert items(s.schedule(3.0)) == [("p", 12), ("d1", 1)]


def test_a_decode_already_scheduled_is_no_longer_set_aside():
    # Budget 13. d1 (arrived first) decodes: 1 token, 12 left. p, mid-prompt, gets all 12 (three
    # whole blocks): d1's token is not set aside a second time (that would leave 11 -> 8).
    s = sched(64, max_num_batched_tokens=13, enable_chunked_prefill=True)
    running(s, "d1", 4, arrival=0.0)
    running(s, "p", 20, out=0, arrival=1.0, computed=8)
    assert items(s.schedule(2.0)) == [("d1", 1), ("p", 12)]


def test_a_decode_takes_its_token_from_what_is_left_not_minus_the_decodes_behind_it():
    # Budget 2, three decodes in arrival order: d1 and d2 take one token each, d3 waits. (Setting
    # aside the decodes behind it would leave d1 2 - 2 = 0 and skip it.)
    s = sched(64, max_num_batched_tokens=2, enable_chunked_prefill=True)
    for i in range(3):
        running(s, f"d{i + 1}", 4, arrival=float(i))
    assert items(s.schedule(3.0)) == [("d1", 1), ("d2", 1)]


def test_a_decode_evicted_this_step_is_no_longer_set_aside():
    # 7 blocks, all held: a (5 tokens, 1 block) must grow; q is mid-prompt (8 of 20, 2 blocks); d, the
    # last started, decodes in 4 blocks. a evicts d and takes 1 of its 4 blocks (3 free). Budget 13:
    # a takes 1, and q's room is 12 (d's token is no longer set aside): 3 whole blocks, 3 free.
    s = sched(7, admission="max_utilization", max_num_batched_tokens=13, enable_chunked_prefill=True)
    running(s, "a", 4, arrival=0.0)
    running(s, "q", 20, out=0, arrival=1.0, computed=8)
    d = running(s, "d", 15, arrival=2.0)
    assert s.kv.num_free_blocks == 0
    batch = s.schedule(3.0)
    assert batch.preempted == [d] and items(batch) == [("a", 1), ("q", 12)]


def test_a_chunk_cut_short_is_rounded_down_to_whole_blocks():
    s = sched(64, max_num_batched_tokens=11, enable_chunked_prefill=True)
    running(s, "p", 20, out=0, arrival=0.0, computed=8)
    running(s, "d1", 4, arrival=1.0)
    # Room for p: 11 - 1 = 10 tokens, rounded down to 8 (2 blocks of 4); 1 token of the budget unused.
    assert items(s.schedule(2.0)) == [("p", 8), ("d1", 1)]
    # A chunk that is the whole rest of the prompt is not rounded: p has 4 left next step.
    s.running[0].num_computed_tokens = 16
    assert items(s.schedule(3.0)) == [("p", 4), ("d1", 1)]


def test_a_budget_smaller_than_a_block_still_starts_a_long_prompt():
    # Budget 3 < a block of 4: rounding 3 down to whole blocks would give 0 tokens every step and
    # the 6-token prompt would never start. Such a budget chunks by the room left, unrounded: 3, then 3.
    s = sched(64, max_num_batched_tokens=3, enable_chunked_prefill=True)
    p = waiting(s, "p", 6)
    assert items(s.schedule(0.0)) == [("p", 3)]
    p.num_computed_tokens = 3
    assert items(s.schedule(1.0)) == [("p", 3)]
    # With a decode set aside the room is 3 - 1 = 2: the prompt mid-chunk takes those 2 (not 0).
    s2 = sched(64, max_num_batched_tokens=3, enable_chunked_prefill=True)
    running(s2, "q", 10, out=0, arrival=0.0, computed=4)
    running(s2, "d", 4, arrival=1.0)
    assert items(s2.schedule(2.0)) == [("q", 2), ("d", 1)]


def test_without_chunking_a_context_runs_whole_or_waits():
    s = sched(64, max_num_batched_tokens=10, enable_chunked_prefill=False)
    running(s, "d1", 4, arrival=0.0)
    waiting(s, "p", 12, arrival=1.0)          # 12 > 10 - 1: it waits (no chunk)
    assert items(s.schedule(2.0)) == [("d1", 1)]


def test_max_utilization_schedules_nothing_after_a_paused_request():
    s = sched(5, admission="max_utilization")
    # 5 blocks, all held. a: 4 tokens computed in 1 block, its next token needs a 2nd block. b and c:
    # 7 prompt tokens + 1 output, 7 computed, 2 blocks each, next token fits.
    a = running(s, "a", 4, arrival=0.0)
    b = running(s, "b", 7, arrival=1.0)
    c = running(s, "c", 7, arrival=2.0)
    waiting(s, "w", 2, arrival=3.0)           # a 2-token prompt: 1 block
    batch = s.schedule(4.0)
    # a needs a block: c, the last started request, is paused (2 blocks freed), a takes one, b runs.
    # One block is left, enough for w; but MaxUtilizationScheduler moves the end of its walk to the
    # paused request (reqItEnd = c), so w, after c in arrival order, is not scheduled this iteration.
    assert items(batch) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in batch.preempted] == ["c"]
    assert a.status is b.status is RequestStatus.RUNNING
    assert [r.request_id for r in s.waiting] == ["c", "w"] and s.kv.num_free_blocks == 1


def test_a_request_that_pauses_itself_ends_the_walk():
    s = sched(3, admission="max_utilization")
    # a holds 2 blocks and its next token fits; b (started last) holds 1 block and needs a 2nd: none is
    # free and nothing started after it, so it pauses itself; the walk ends there: w is not admitted
    # into the freed block in the same iteration.
    running(s, "a", 7, arrival=0.0)
    b = running(s, "b", 4, arrival=1.0)
    waiting(s, "w", 2, arrival=2.0)
    batch = s.schedule(3.0)
    assert items(batch) == [("a", 1)] and batch.preempted == [b]
    assert [r.request_id for r in s.waiting] == ["b", "w"]


def test_a_budget_under_one_block_still_makes_progress():
    # Budget 3 < 4 tokens per block: a rounded chunk would always be 0 and the prompt would never start
    # (the engine would stop with "no progress"). Chunks are then left unrounded: 3 tokens, then the last 2.
    s = sched(64, max_num_batched_tokens=3, enable_chunked_prefill=True)
    waiting(s, "p", 5)
    assert items(s.schedule(1.0)) == [("p", 3)]
    s.running[0].num_computed_tokens = 3
    assert items(s.schedule(2.0)) == [("p", 2)]
