"""One small, hand-made case per rule of ``minibatch.scheduler`` (and of admission control).

Each case builds a scheduler over a tiny KV pool, puts requests in exact states and
checks one ``schedule()`` call against values worked out by hand in the test. No model
runs: a step's tokens are applied by :func:`apply`, as the engine would apply them.
"""

from __future__ import annotations

import pytest

from minibatch.admission import Conservative, GuaranteedNoEvict
from minibatch.config import EngineConfig
from minibatch.kv_cache import KVCacheManager
from minibatch.policies import Policy
from minibatch.request import Request, RequestStatus
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler, is_decode

BS = 4            # tokens per block in every case here


def make(num_blocks=32, policy="continuous", max_model_len=64, **cfg) -> Scheduler:
    config = EngineConfig.from_kwargs(num_kv_blocks=num_blocks, block_size=BS, policy=policy,
                                      max_model_len=max_model_len, **cfg)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching, allocator=config.kv_allocator,
                        max_model_len=max_model_len)
    return Scheduler(config, kv, max_model_len=max_model_len)


def req(rid, n, max_tokens=8, priority=0, arrival=0.0, tokens=None) -> Request:
    tokens = tokens if tokens is not None else [100 + 10 * len(rid) + i for i in range(n)]
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   arrival, priority=priority)


def apply(sched: Scheduler, batch) -> None:
    """What the engine does after a step: count the computed tokens, cache full blocks,
    and give every request whose tokens are all computed one new token."""
    for r, n in batch.items:
        r.num_computed_tokens += n
        sched.kv.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)


def step(sched: Scheduler, now: float = 0.0):
    batch = sched.schedule(now)
    apply(sched, batch)
    return batch


def items(batch) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in batch.items]


def running(sched, *reqs) -> None:
    """Add requests and run their prefill in one step, so that they are running and decoding."""
    for r in reqs:
        sched.add(r)
    batch = step(sched)
    assert [r.request_id for r, _ in batch.items] == [r.request_id for r in reqs]
    assert all(r.status is RequestStatus.RUNNING and r.num_output_tokens == 1 for r in reqs)


class Fixed(Policy):
    """A policy whose order is given by request ids (to test the scheduler, not a policy)."""

    name = "fixed-order"

    def __init__(self, ids, preemptive=False):
        self.ids, self.preemptive = ids, preemptive

    def schedule_order(self, state):
        by_id = {r.request_id: r for r in state.running + state.waiting}
        return [by_id[i] for i in self.ids if i in by_id]


# -- budgets ------------------------------------------------------------------------------------
def test_token_budget_caps_the_new_tokens_of_a_step():
    s = make(max_num_batched_tokens=16)
    for rid in "abc":
        s.add(req(rid, 10))
    batch = step(s)
    # a takes 10, b the remaining 6 (a chunk), c nothing: 16 tokens, never 30.
    assert items(batch) == [("a", 10), ("b", 6)]
    assert batch.num_tokens == 16
    c = s.waiting[-1]
    assert c.request_id == "c" and c.status is RequestStatus.WAITING and c.num_computed_tokens == 0


def test_max_num_seqs_caps_the_requests_of_a_step():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(req(rid, 4))
    assert items(step(s)) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_chunked_prefill_continues_the_prompt_next_step_then_decodes():
    s = make(max_num_batched_tokens=16)
    r = req("r", 40)
    s.add(r)
    shapes = []
    for _ in range(4):
        batch = step(s)
        shapes.append((items(batch), batch.token_counts(), r.num_output_tokens))
    assert shapes == [([("r", 16)], (0, 16), 0), ([("r", 16)], (0, 16), 0),
                      ([("r", 8)], (0, 8), 1),            # the last chunk samples the first token
                      ([("r", 1)], (1, 0), 2)]            # then one token a step: a decode


def test_a_decode_is_one_new_token_whatever_the_phase():
    assert is_decode(1) and not is_decode(2) and not is_decode(0)
    s = make(max_num_batched_tokens=9)
    r = req("r", 10)
    s.add(r)
    assert step(s).token_counts() == (0, 9)
    # The prompt's last token alone is computed as a decode row: one definition for all.
    assert step(s).token_counts() == (1, 0) and r.num_output_tokens == 1


def test_without_chunking_a_prompt_waits_for_room_and_later_waiting_ones_wait_too():
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    running(s, req("a", 4))
    s.add(req("b", 16))
    s.add(req("c", 2))
    batch = step(s)
    # a decodes (1 token); b needs 16 > 15 left: it waits, and so does c behind it.
    assert items(batch) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert all(r.status is RequestStatus.WAITING for r in s.waiting)


def test_without_chunking_a_recomputed_request_longer_than_the_budget_runs_whole_at_the_head():
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    r = req("r", 14)
    r.output_token_ids = [7, 7, 7, 7]            # preempted (recompute) after 4 tokens: 18 to compute
    s.add(r)
    assert items(step(s)) == [("r", 18)]
    assert r.num_output_tokens == 5


# -- preemption -----------------------------------------------------------------------------------
def _four_running(policy="continuous", **cfg):
    """a (4-token prompt) must grow into a second block; b, c, d (2-token prompts) need no new
    block; the pool's 4 blocks are all held."""
    s = make(num_blocks=4, policy=policy, **cfg)
    reqs = [req("a", 4), req("b", 2), req("c", 2), req("d", 2)]
    running(s, *reqs)
    assert s.kv.num_free_blocks == 0
    return s, reqs


def test_a_short_pool_preempts_the_last_running_request_in_the_order():
    s, (a, b, c, d) = _four_running()
    batch = step(s)
    assert batch.preempted == [d]                        # the end of the order, not b or c
    assert items(batch) == [("a", 1), ("b", 1), ("c", 1)]
    assert len(s.kv.block_table("a")) == 2


def test_recompute_preemption_frees_the_blocks_and_requeues_at_the_front():
    s, (a, b, c, d) = _four_running()
    s.add(req("late", 2))
    step(s)
    assert d.status is RequestStatus.WAITING and d.num_computed_tokens == 0 and d.num_preemptions == 1
    assert s.kv.block_table("d") == [] and d.num_output_tokens == 1      # its token stays; its KV goes
    assert [r.request_id for r in s.waiting] == ["d", "late"]           # ahead of later arrivals
    assert s.num_preemptions == 1


def test_running_requests_left_out_of_the_order_are_evicted_first():
    s, (a, b, c, d) = _four_running()
    s.policy = Fixed(["a", "b", "d"])                    # c paused by the policy
    batch = step(s)
    assert batch.preempted == [c]
    assert items(batch) == [("a", 1), ("b", 1), ("d", 1)]


def test_a_running_request_that_cannot_grow_and_has_no_victim_preempts_itself():
    s = make(num_blocks=1)
    a = req("a", 4)
    running(s, a)
    batch = step(s)                                      # position 4 needs a second block
    assert batch.items == [] and batch.preempted == [a]
    assert a.status is RequestStatus.WAITING and s.kv.num_free_blocks == 1


def test_a_waiting_request_never_evicts_under_a_non_preemptive_policy():
    s = make(num_blocks=4)
    running(s, req("a", 8), req("b", 3))                 # 2 + 1 blocks held, 1 free
    s.add(req("w", 8))                                   # needs 2 blocks
    batch = step(s)
    assert batch.preempted == []
    assert items(batch) == [("a", 1), ("b", 1)]          # a's position 8 takes the free block
    assert s.waiting[0].request_id == "w"


def test_a_preemptive_policy_evicts_the_lowest_ranked_running_request_for_a_waiting_one():
    s = make(num_blocks=4, policy="priority")
    a, b = req("a", 8, priority=1), req("b", 8, priority=2)
    running(s, a, b)                                     # 4 blocks held
    u = req("u", 3, priority=0)
    s.add(u)
    batch = step(s)
    assert batch.preempted == [b]                        # rank u < a < b: b goes
    assert items(batch) == [("u", 3), ("a", 1)]
    assert u.status is RequestStatus.RUNNING


@pytest.mark.parametrize("admission, admitted", [("max_utilization", [("a", 1), ("small", 3)]),
                                                  ("guaranteed_no_evict", [("a", 1)]),
                                                  ("conservative", [("a", 1)])])
def test_under_an_evicting_policy_a_refused_waiting_request_does_not_hold_back_later_ones(admission, admitted):
    """priority + max_utilization may evict, so one refusal does not end admission: a request
    that cannot fit even by evicting everything below it waits, and smaller ones behind it
    start. Admission modes that never evict keep the order: nobody after a refusal starts."""
    s = make(num_blocks=4, policy="priority", admission=admission)
    running(s, req("a", 3, priority=0))                  # 1 block, 3 free
    s.add(req("big", 16, priority=1))                    # 4 blocks: cannot fit
    s.add(req("small", 3, priority=2))                   # 1 block
    batch = step(s)
    assert batch.preempted == []
    assert items(batch) == admitted


def test_a_refused_waiting_request_stops_later_waiting_ones_but_not_running_ones():
    s = make(num_blocks=3)
    running(s, req("r", 4))                              # 1 block; 2 free
    s.add(req("big", 12))                                # needs 3 blocks: refused
    s.add(req("small", 2))                               # would fit, but comes after big
    s.policy = Fixed(["big", "small", "r"])
    batch = step(s)
    assert items(batch) == [("r", 1)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]


# -- prefix cache at admission ----------------------------------------------------------------------
def _cached_prefix(s, prefix):
    """Run and finish a request whose 8-token prompt leaves two full cached blocks."""
    x = req("x", 8, max_tokens=1, tokens=list(prefix))
    s.add(x)
    step(s)
    s.remove(x)
    assert s.kv.num_free_blocks == s.kv.num_blocks and len(s.kv.pool.cached) == 2


def test_a_prefix_hit_is_counted_once_per_request_even_after_a_preemption():
    s = make(num_blocks=8, enable_prefix_caching=True)
    prefix = list(range(50, 58))
    _cached_prefix(s, prefix)
    queries0, hits0 = s.kv.prefix_queries, s.kv.prefix_hits
    y = req("y", 9, tokens=prefix + [99])
    s.add(y)
    assert items(step(s)) == [("y", 1)]                  # 8 of 9 prompt tokens served by the cache
    assert y.num_cached_tokens == 8
    s._preempt(y, 0.0)
    assert items(step(s)) == [("y", 2)]                  # the hit again, plus y's first output token
    assert (s.kv.prefix_queries - queries0, s.kv.prefix_hits - hits0) == (9, 8)
    assert y.num_cached_tokens == 8


def test_a_refused_request_forgets_its_prefix_hit():
    s = make(num_blocks=4, enable_prefix_caching=True, admission="guaranteed_no_evict")
    prefix = list(range(50, 58))
    _cached_prefix(s, prefix)
    y = req("y", 9, max_tokens=12, tokens=prefix + [99])  # final 21 tokens: 6 blocks > 4
    s.add(y)
    assert step(s).items == []
    assert y.status is RequestStatus.WAITING and y.num_computed_tokens == 0


# -- admission control, counted in blocks --------------------------------------------------------------
def _state_for_admission(admission_cls):
    """6 blocks. Two free cached blocks hold the prefix of y; r runs and holds one block
    with 2 more reserved for its future (final length 12 = 3 blocks)."""
    s = make(num_blocks=6, enable_prefix_caching=True)
    prefix = list(range(50, 58))
    _cached_prefix(s, prefix)
    running(s, req("r", 4, max_tokens=8))
    y = req("y", 12, max_tokens=4, tokens=prefix + [90, 91, 92, 93])    # final 16 tokens = 4 blocks
    hit, _ = s.kv.get_computed_blocks(y)
    assert len(hit) == 2 and s.kv.num_free_hits(hit) == 2 and s.kv.num_free_blocks == 5
    return s, y, hit


def test_guaranteed_no_evict_counts_the_free_cached_blocks_a_hit_takes():
    s, y, hit = _state_for_admission(GuaranteedNoEvict)
    # need = 4 blocks - 2 shared + 2 that the hit takes out of the free queue = 4;
    # reserved future of r = 3 - 1 = 2; 4 + 2 = 6 > 5 free: refuse.
    assert GuaranteedNoEvict().can_admit(s, y, hit) is False
    s.remove(s.running[0])                               # r gone: 4 <= 6 free
    assert GuaranteedNoEvict().can_admit(s, y, hit) is True


def test_conservative_counts_the_free_cached_blocks_a_hit_takes():
    s, y, hit = _state_for_admission(Conservative)
    adm = Conservative()
    adm.new_token_ratio = 1.0                            # estimate = the whole max_tokens
    # y: blocks(12 + 4) - 2 + 2 = 4; r: blocks(5 + 7) - 1 held = 2; 6 > 5: refuse.
    assert adm.estimate(s, y) == 4 and adm.estimate(s, s.running[0]) == 7
    assert adm.can_admit(s, y, hit) is False
    adm.new_token_ratio = 0.25                           # y: ceil(1) -> blocks(13) = 4 - 2 + 2 = 4;
    assert adm.estimate(s, y) == 1                       # r: ceil(1.75) = 2 -> blocks(7) - 1 = 1
    assert adm.can_admit(s, y, hit) is True              # 4 + 1 = 5 <= 5


def test_guaranteed_no_evict_never_preempts_with_prefix_hits_in_a_run():
    """The case behind the unit test above, end to end: with the free-hit term missing, y is
    admitted and the pool runs short two steps later."""
    s, y, _ = _state_for_admission(GuaranteedNoEvict)
    s.admission = GuaranteedNoEvict()
    s.config.admission = "guaranteed_no_evict"
    s.add(y)
    for i in range(40):
        batch = step(s)
        assert batch.preempted == [], f"step {i} preempted {batch.preempted}"
        for r in [r for r in s.running if r.num_output_tokens >= r.sampling_params.max_tokens]:
            s.remove(r)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished()


@pytest.mark.parametrize("mode", ["max_utilization", "guaranteed_no_evict", "conservative"])
def test_admission_modes_other_than_max_utilization_never_evict(mode):
    s = make(admission=mode)
    assert s.admission.evicts == (mode == "max_utilization")


def test_the_victim_can_be_the_very_next_request_in_the_order():
    s = make(num_blocks=2)
    a, b = req("a", 4), req("b", 3)
    running(s, a, b)                                     # a: 1 block, must grow; b: 1 block; none free
    batch = step(s)
    assert batch.preempted == [b] and items(batch) == [("a", 1)]


def test_preemptions_are_counted_per_request():
    s = make(num_blocks=8)
    x = req("x", 2)
    running(s, x)
    s._preempt(x, 0.0)
    assert x.num_preemptions == 1 and s.waiting[0] is x
    step(s)                                              # x is admitted again, recomputes
    assert x.status is RequestStatus.RUNNING
    s._preempt(x, 0.0)
    assert x.num_preemptions == 2                        # counted, not just flagged


def test_final_len_is_capped_by_max_model_len():
    s = make(max_model_len=64)
    assert s.final_len(req("a", 60, max_tokens=10)) == 64       # 70 tokens asked, 64 allowed
    assert s.final_len(req("b", 10, max_tokens=10)) == 20
    uncapped = Scheduler(s.config, s.kv, max_model_len=None)
    assert uncapped.final_len(req("c", 60, max_tokens=10)) == 70


def test_a_batch_prices_decodes_and_prefill_chunks_for_the_cost_model():
    s = make(max_num_batched_tokens=8)
    running(s, req("a", 4))                              # a decodes next: context 5
    s.add(req("b", 12))                                  # b: a chunk of 7 of its 12 tokens
    batch = s.schedule(0.0)
    assert batch.shape() == ([(7, 7)], [5])
    assert batch.token_counts() == (1, 7) and batch.num_tokens == 8


def test_a_policy_sees_the_configured_limits_and_the_queues_in_its_state():
    # The state is a policy's whole view (a learner's own policy reads any field of it).
    sched = make(max_num_seqs=3, max_num_batched_tokens=40, max_wait_ms=250)
    a, b = req("a", 8), req("b", 8)
    sched.add(a)
    sched.add(b)
    st = sched.state(1.5)
    assert (st.now, st.max_num_seqs, st.max_num_batched_tokens, st.max_wait_s) == (1.5, 3, 40, 0.25)
    assert st.waiting == [a, b] and st.running == [] and st.kv is sched.kv and st.config is sched.config
    st.waiting.pop()                                  # a copy: the policy cannot edit the queue
    assert list(sched.waiting) == [a, b]


class Fallback(Fixed):
    """Orders ``ids``; when none of them can run, falls back to ``fallback`` and records the state."""

    name = "fixed-fallback"

    def __init__(self, ids, fallback):
        super().__init__(ids)
        self.fallback, self.seen = fallback, []

    def fallback_order(self, state):
        self.seen.append((state.now, [r.request_id for r in state.running], [r.request_id for r in state.waiting]))
        return Fixed(self.fallback).schedule_order(state)


def test_the_fallback_order_sees_the_same_step_and_runs_when_the_order_cannot():
    s = make(num_blocks=3)
    running(s, req("r", 4))                              # 1 block; 2 free
    s.add(req("big", 12))                                # needs 3 blocks: refused
    s.policy = Fallback(["big"], ["r"])
    batch = step(s, now=2.5)
    # big cannot start, so nothing of the order runs; the fallback is asked once, at the same
    # time (2.5) with the same queues, and r decodes.
    assert s.policy.seen == [(2.5, ["r"], ["big"])]
    assert items(batch) == [("r", 1)] and batch.preempted == []
    # When the order runs, the fallback is not asked.
    s.policy = Fallback(["r"], ["r"])
    assert items(step(s, now=3.0)) == [("r", 1)] and s.policy.seen == []


def test_preemptions_of_the_first_pass_are_kept_when_the_fallback_runs():
    s = make(num_blocks=1)
    a = req("a", 4)
    running(s, a)                                        # holds the only block; position 4 needs another
    s.add(req("w", 2))
    s.policy = Fallback(["a"], ["w"])
    batch = step(s, now=1.5)
    # First pass: a cannot grow and has no victim, so it preempts itself (nothing runs); its block
    # is free again, and the fallback's w (2 tokens, 1 block) starts. The step reports both.
    assert batch.preempted == [a] and items(batch) == [("w", 2)]
    assert s.num_preemptions == 1 and a.status is RequestStatus.WAITING
    assert s.running[0].first_scheduled_time == 1.5      # admitted by the fallback, at this step's time


def test_the_preemption_counter_adds_up_over_steps():
    s, (a, b, c, d) = _four_running()
    assert step(s).preempted == [d]                      # a's position 4 needs a second block
    # a: 6 tokens in 2 blocks; b, c: position 3, the last slot of their block; d waits (no block).
    assert step(s).preempted == []
    # b's position 4 needs a second block: the last running request in the order, c, goes.
    assert step(s).preempted == [c]
    assert s.num_preemptions == 2


def test_a_step_that_preempts_tells_admission_how_many_it_preempted():
    s, (a, b, c, d) = _four_running()
    s.admission = adm = Conservative()
    assert step(s).preempted == [d]
    # SGLang's retract estimate after a preemption: (generated + 20 x running) / sum(max_tokens)
    # over a, b, c with one token each: (3 + 60) / 24 > 1, capped at 1 (a decay would give < 0.7).
    assert adm.new_token_ratio == 1.0


def test_without_decode_budget_first_a_prompt_ahead_in_the_order_takes_the_whole_budget():
    s = make(max_num_batched_tokens=8)
    running(s, req("d", 4))
    s.add(req("p", 10))
    s.policy = Fixed(["p", "d"])
    # vLLM's rule: the order is walked as it is; p's chunk takes all 8 tokens and d waits a step
    # (decode_budget_first, TensorRT-LLM's rule, would keep 1 token for d and give p 7).
    assert items(s.schedule(0.0)) == [("p", 8)]


def test_a_victim_met_later_in_the_order_is_skipped_and_the_requests_after_it_still_run():
    # 5 blocks: a (4 tokens) 1 block and must grow, b and c 1 block each, d (6 tokens) 2 blocks.
    s = make(num_blocks=5)
    a, b, c, d = req("a", 4), req("b", 2), req("c", 2), req("d", 6)
    running(s, a, b, c, d)
    w = req("w", 2)
    s.add(w)
    batch = step(s)
    # a evicts d, the last running request of the order [a, b, c, d, w], and takes one of its two
    # blocks; the loop passes over d and still admits w into the other.
    assert batch.preempted == [d]
    assert items(batch) == [("a", 1), ("b", 1), ("c", 1), ("w", 2)]


def test_a_swapped_out_request_is_asked_about_as_one_with_no_prefix_hit():
    from kv_checking import KVCheckingExecutor
    from minibatch.swap import Swapper

    s, (a, b, c, d) = _four_running(preemption_mode="swap")
    s.swapper = Swapper(s.kv, KVCheckingExecutor(4, BS), capacity_blocks=4)
    assert step(s).preempted == [d] and d.status is RequestStatus.SWAPPED
    s.admission = GuaranteedNoEvict()
    # d would need blocks(min(2 + 8, 64)) = 3 blocks and none is free (a, b, c also reserve their
    # futures): refused, it stays on the host; a, b, c decode within the blocks they hold.
    batch = step(s)
    assert items(batch) == [("a", 1), ("b", 1), ("c", 1)] and batch.preempted == []
    assert d.status is RequestStatus.SWAPPED and s.swapper.num_used == 1


def test_a_one_token_chunk_is_still_a_chunk():
    s = make(max_num_batched_tokens=2)
    running(s, req("a", 2))
    s.add(req("p", 10))
    # a's decode takes 1 of the 2 tokens; the 1 left is p's first chunk.
    assert items(step(s)) == [("a", 1), ("p", 1)]


class BlockChunks(Fixed):
    """A preemptive order that cuts chunks to whole blocks and keeps admitting after a refusal."""

    name = "fixed-block-chunks"
    chunk_to_block = True

    def __init__(self, ids):
        super().__init__(ids, preemptive=True)


def test_under_an_evicting_policy_a_prompt_that_gets_no_chunk_does_not_hold_back_later_ones():
    s = make(max_num_batched_tokens=4)
    running(s, req("d", 2))
    p, w = req("p", 10), req("w", 1)
    s.add(p)
    s.add(w)
    s.policy = BlockChunks(["d", "p", "w"])
    # d decodes: 3 tokens left, less than a block of 4, so p gets no chunk and waits; the policy may
    # evict (max_utilization) and does not stop at a refusal, so w (1 token) is still admitted.
    assert items(step(s)) == [("d", 1), ("w", 1)]
    assert p.status is RequestStatus.WAITING and p.num_computed_tokens == 0


def test_without_chunking_under_an_evicting_policy_a_prompt_over_the_budget_left_holds_back_nobody():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False, policy="priority")
    running(s, req("a", 3, priority=0))
    s.add(req("big", 10, priority=1))
    s.add(req("small", 3, priority=2))
    # Order a, big, small. a decodes (9 left); big's 10 tokens wait for a step with room; priority
    # under max_utilization may evict, so a refusal does not end admission: small (3) starts.
    assert items(step(s)) == [("a", 1), ("small", 3)]


def test_without_chunking_running_requests_after_a_prompt_that_waits_still_run():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    running(s, req("a", 3), req("r", 3))
    s.add(req("big", 10))
    s.policy = Fixed(["a", "big", "r"])
    # a decodes (9 left); big (10) waits for a step with room; r, later in the order, still decodes.
    assert items(step(s)) == [("a", 1), ("r", 1)]


def test_a_request_admission_control_refuses_does_not_stop_running_ones_after_it():
    s = make(num_blocks=8, admission="guaranteed_no_evict")
    running(s, req("r", 4))                              # final 12 tokens: 3 blocks, holds 1
    s.add(req("big", 16))                                # final 24 tokens: 6 blocks
    s.policy = Fixed(["big", "r"])
    # 6 + r's 2 reserved > 7 free: big is refused; r, after it in the order, still decodes.
    assert items(step(s)) == [("r", 1)]
    assert [q.request_id for q in s.waiting] == ["big"]


def test_a_request_that_preempts_itself_frees_its_blocks_for_the_requests_after_it():
    s = make(num_blocks=1)
    a = req("a", 4)
    running(s, a)                                        # the only block; position 4 needs another
    w = req("w", 2)
    s.add(w)
    s.policy = Fixed(["a", "w"])
    batch = step(s)
    # a cannot grow and nobody after it runs: it preempts itself; w, next in the order, takes the block.
    assert batch.preempted == [a] and items(batch) == [("w", 2)]


class Listed(Policy):
    """A policy that returns a fixed list of request objects (duplicates and strangers included)."""

    name = "listed"

    def __init__(self, order):
        self.order = order

    def schedule_order(self, state):
        return list(self.order)


def test_the_order_keeps_queued_requests_once():
    s = make()
    a = req("a", 4)
    running(s, a)
    ghost = req("ghost", 4)                              # never added: not in any queue
    s.policy = Listed([a, a, ghost, a])
    assert items(step(s)) == [("a", 1)]
    assert ghost.status is RequestStatus.WAITING and s.kv.block_table("ghost") == []


def test_a_waiting_request_that_evicts_keeps_its_prefix_hit():
    s = make(num_blocks=6, enable_prefix_caching=True, policy="priority")
    prefix = list(range(50, 58))
    b = req("b", 11, priority=2)
    running(s, b)                                        # 3 blocks
    x = req("x", 8, max_tokens=1, tokens=prefix, priority=1)
    s.add(x)
    step(s)
    s.remove(x)                                          # 2 cached free blocks + 1 free block
    y = req("y", 13, tokens=prefix + [99, 98, 97, 96, 95], priority=0)
    s.add(y)
    hit, _ = s.kv.get_computed_blocks(y)
    assert len(hit) == 2 and s.kv.num_free_blocks == 3
    batch = step(s)
    # y takes the 2 cached blocks out of the free queue and needs 2 more for tokens 8..12: 1 is
    # free, so it evicts b; its table starts with the shared cached blocks, then 2 new ones.
    assert batch.preempted == [b] and items(batch) == [("y", 5)]
    assert s.kv.block_table("y")[:2] == hit and len(s.kv.block_table("y")) == 4
