"""TGI's router rules (``minibatch.policies.tgi``) and the engine's backpressure
(``max_inflight_requests``), each on a small hand-made state with the expected decision
worked out by hand in the comments (TGI v3.3.7 ``backends/v3/src/backend.rs``,
``queue.rs``)."""

from __future__ import annotations

import pytest

from minibatch.admission import Overloaded
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.kv_cache import KVCacheManager
from minibatch.policies import SchedulerState
from minibatch.policies.tgi import TGIPolicy
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.workload import RequestSpec


def rq(rid, prompt=6, max_tokens=4, out=0) -> Request:
    r = Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), 0.0)
    r.output_token_ids = [9] * out
    return r


def cfg(**kw) -> EngineConfig:
    return EngineConfig(policy="tgi", enable_chunked_prefill=False, **kw)


def st(running=(), waiting=(), config=None, kv=None, max_num_seqs=64, budget=4096) -> SchedulerState:
    return SchedulerState(0.0, list(running), list(waiting), max_num_seqs, budget, 0.0, kv,
                          config if config is not None else cfg())


def ids(order) -> list[str]:
    return [r.request_id for r in order]


def step(policy, state):
    """One scheduler step as the engine drives it: the order, then on_step with what ran."""
    order = policy.schedule_order(state)
    policy.on_step([(r, 1) for r in order], 0.0)
    return ids(order)


def started(policy, n=10, config=None):
    """A policy whose first prefill (an empty server) took n requests; returns them as running."""
    batch = [rq(f"b{i}", out=1) for i in range(n)]
    assert step(policy, st(waiting=batch, config=config)) == [r.request_id for r in batch]
    return batch


def test_an_empty_server_prefills_what_fits_at_once():
    p = TGIPolicy()
    assert step(p, st(waiting=[rq("a"), rq("b")])) == ["a", "b"]
    assert p.waiting_tokens == 1 and p.num_prefills == 1


def test_few_waiting_requests_wait_max_waiting_tokens_steps():
    p = TGIPolicy()
    config = cfg(max_waiting_tokens=5)
    batch = started(p, 10, config)
    new = rq("new")
    # 10 running x 0.3 = 3 must be waiting for an early prefill; 1 is. TGI's counter is 1 after the
    # prefill and +1 per decode; the prefill comes at the check where it reaches 5: after 4 decodes.
    for k in range(4):
        assert step(p, st(running=batch, waiting=[new], config=config)) == ids(batch), f"decode {k + 1}"
    assert p.waiting_tokens == 5
    assert step(p, st(running=batch, waiting=[new], config=config)) == ["new"]     # prefill alone
    # A prefill that joins a running batch is followed by a decode of the whole batch.
    assert step(p, st(running=batch + [new], waiting=[rq("x")], config=config)) == ids(batch) + ["new"]


def test_enough_waiting_requests_are_prefilled_at_once():
    p = TGIPolicy()
    batch = started(p, 10)
    two, three = [rq("w1"), rq("w2")], [rq("w1"), rq("w2"), rq("w3")]
    # floor(10 x 0.3) = 3: two waiting requests are not enough, three are.
    assert step(p, st(running=batch, waiting=two)) == ids(batch)
    assert step(p, st(running=batch, waiting=three)) == ["w1", "w2", "w3"]


def test_joins_are_counted_by_reason_as_tgi_batch_concat():
    """backend.rs counts a prefill that joins a running batch as tgi_batch_concat{reason}: "backpressure"
    when min_size was set (enough requests waited), "wait_exceeded" when max_waiting_tokens ran out."""
    p = TGIPolicy()
    config = cfg(max_waiting_tokens=3)
    batch = started(p, 10, config)                   # the first prefill of an empty server is no join
    three = [rq("w1"), rq("w2"), rq("w3")]
    assert step(p, st(running=batch, waiting=three, config=config)) == ["w1", "w2", "w3"]     # 3 >= floor(10 x 0.3)
    assert p.concat_reasons == {"backpressure": 1}, "min_size was set (counter 1 < 3): backpressure"
    assert step(p, st(running=batch, waiting=[rq("x")], config=config)) == ids(batch)         # decode after a join
    assert step(p, st(running=batch, waiting=[rq("x")], config=config)) == ids(batch)         # counter 2 < 3
    assert step(p, st(running=batch, waiting=[rq("x")], config=config)) == ["x"]              # counter 3: join
    assert p.concat_reasons == {"backpressure": 1, "wait_exceeded": 1} and p.num_prefills == 3


def test_a_small_batch_takes_any_waiting_request():
    p = TGIPolicy()
    batch = started(p, 3)
    # floor(3 x 0.3) = 0: nothing to wait for, one waiting request is prefilled at the next check.
    assert step(p, st(running=batch, waiting=[rq("w")])) == ["w"]


def test_max_batch_prefill_tokens_bounds_a_prefill_step():
    p = TGIPolicy()
    config = cfg(max_batch_prefill_tokens=12)
    w = [rq("a", 6), rq("b", 6), rq("c", 6)]
    # 6 + 6 = 12 tokens fit; c would make 18 > 12 and waits (no chunking).
    assert step(p, st(waiting=w, config=config)) == ["a", "b"]
    # With 8-token blocks TGI pads the budget up to a whole block: 10 -> 16 still holds a and b.
    p2 = TGIPolicy()
    kv = KVCacheManager(64, 8)
    assert step(p2, st(waiting=w, config=cfg(max_batch_prefill_tokens=10), kv=kv)) == ["a", "b"]
    # ... and never beyond the engine's token budget: 10 -> 16, capped at max_num_batched_tokens 8.
    p3 = TGIPolicy()
    assert step(p3, st(waiting=w, config=cfg(max_batch_prefill_tokens=10), kv=kv, budget=8)) == ["a"]


def test_max_batch_total_tokens_bounds_the_running_batch():
    p = TGIPolicy()
    config = cfg(max_batch_total_tokens=25)
    w = [rq("a", 6, 4), rq("b", 6, 4), rq("c", 6, 4)]
    # Each reserves prompt + max_tokens = 10 tokens: two make 20 <= 25, a third would make 30.
    assert step(p, st(waiting=w, config=config)) == ["a", "b"]


def test_the_queue_stops_at_the_first_request_whose_kv_does_not_fit():
    p = TGIPolicy()
    kv = KVCacheManager(4, 4)           # 16 tokens of KV
    w = [rq("a", 4, 4), rq("big", 8, 8), rq("c", 2, 2)]
    # a reserves 8 tokens = 2 blocks (2 left); big needs 4: the queue stops, c waits behind it.
    assert step(p, st(waiting=w, kv=kv)) == ["a"]


def test_with_prefill_chunking_new_requests_join_the_running_batch():
    p = TGIPolicy()
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=20)
    batch = [rq(f"b{i}", out=1) for i in range(10)]
    w = [rq("a", 6), rq("b", 30), rq("c", 6)]
    # No waiting rule: running first, then the queue within 20 - 10 (current tokens) = 10 prompt
    # tokens: a (6), then b (30) is cut to the 4 left by the scheduler; c waits.
    assert ids(p.schedule_order(st(running=batch, waiting=w, config=config))) == ids(batch) + ["a", "b"]


def test_with_prefill_chunking_a_join_is_followed_by_a_decode():
    """backend.rs: every turn of the loop is next_batch (a join: one forward of the running batch and
    the new requests' prefill) and then one decode of the whole batch; only the first prefill of an
    empty server may be followed by a join at once."""
    p = TGIPolicy()
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=64)
    first = [rq("a"), rq("b")]
    assert step(p, st(waiting=first, config=config)) == ["a", "b"]          # empty server: prefill
    batch = [rq("a", out=1), rq("b", out=1)]
    # Right after the first prefill the loop asks next_batch at once: c joins the running batch.
    assert step(p, st(running=batch, waiting=[rq("c")], config=config)) == ["a", "b", "c"]
    assert p.num_prefills == 2
    # The join is followed by a decode of the whole batch, however many wait ...
    batch.append(rq("c", out=1))
    assert step(p, st(running=batch, waiting=[rq("d"), rq("e")], config=config)) == ["a", "b", "c"]
    # ... and then the next turn of the loop may join again.
    assert step(p, st(running=batch, waiting=[rq("d"), rq("e")], config=config)) == ["a", "b", "c", "d", "e"]
    # tgi_batch_concat: the two joins (c; d and e), not the first prefill of the empty server.
    assert p.concat_reasons == {"chunking": 2} and p.num_prefills == 3


def test_with_prefill_chunking_a_step_that_nobody_joins_is_a_decode():
    """Nothing waits: the running batch alone is the order, planned as a decode, and TGI's
    counter (0 for a fresh policy) counts it: 1."""
    p = TGIPolicy()
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=64)
    batch = [rq("a", out=1), rq("b", out=1)]
    assert step(p, st(running=batch, config=config)) == ["a", "b"]
    assert p.plan == "decode" and p.waiting_tokens == 1 and p.num_prefills == 0


def test_with_prefill_chunking_a_join_that_did_not_run_is_no_join():
    """If none of the listed newcomers ran (KV or admission refused them: next_batch returned
    nothing), the step was a decode and the next one may join."""
    p = TGIPolicy()
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=64)
    batch = [rq("a", out=1), rq("b", out=1)]
    order = p.schedule_order(st(running=batch, waiting=[rq("c")], config=config))
    assert ids(order) == ["a", "b", "c"]
    p.on_step([(r, 1) for r in batch], 0.0)                # c did not run
    # A decode for TGI's counter too: 0 (a fresh policy) + 1; no prefill, no join counted.
    assert p.plan == "decode" and p.waiting_tokens == 1 and p.num_prefills == 0 and not p.concat_reasons
    assert ids(p.schedule_order(st(running=batch, waiting=[rq("c")], config=config))) == ["a", "b", "c"]


def test_unchunked_steps_never_mix_prefill_and_decode():
    """Through the engine: TGI pauses decoding for a prefill-only step (prompts > 1 token)."""
    specs = [RequestSpec(arrival_time=0.01 * i, prompt_len=20 + i, max_tokens=30, request_id=f"r{i}")
             for i in range(12)]
    res = run(specs, executor="sim", model="llama-2-7b", hardware="a100-80g", policy="tgi",
              enable_chunked_prefill=False, max_waiting_tokens=4, num_kv_blocks=400)
    s = res.summary()
    assert s["completed"] == 12 and s["num_preemptions"] == 0
    assert all(not (st_.num_prefill_tokens and st_.num_decode_tokens) for st_ in res.steps)
    assert sum(1 for st_ in res.steps if st_.num_prefill_tokens) >= 2      # later arrivals joined


# -- backpressure: max_inflight_requests (TGI's max_concurrent_requests) ---------------------------------
def test_max_inflight_requests_rejects_with_a_reason():
    engine = LLMEngine(EngineConfig(executor="sim", model="llama-2-7b", hardware="a100-80g",
                                    max_inflight_requests=2), clock="virtual")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([1] * 8, params)
    engine.add_request([1] * 8, params)
    with pytest.raises(Overloaded, match="max_inflight_requests=2"):
        engine.add_request([1] * 8, params)
    assert engine.num_waiting == 2                    # the refused one was not queued


def test_rejected_requests_are_counted_never_lost():
    # 5 requests at once, at most 2 in flight: 3 rejected on arrival, 2 served.
    specs = [RequestSpec(arrival_time=0.0, prompt_len=16, max_tokens=8, request_id=f"r{i}") for i in range(5)]
    s = run(specs, executor="sim", model="llama-2-7b", hardware="a100-80g", max_inflight_requests=2).summary()
    assert (s["num_requests"], s["completed"], s["rejected"]) == (5, 2, 3)
    assert s["rejected_reasons"] == {"over max_inflight_requests": 3}


def test_requests_that_can_never_fit_the_budgets_are_rejected_up_front():
    # TGI's validation refuses what its budgets can never hold, instead of queueing it forever.
    specs = [RequestSpec(arrival_time=0.0, prompt_len=40, max_tokens=8, request_id="long-prompt"),
             RequestSpec(arrival_time=0.0, prompt_len=10, max_tokens=80, request_id="long-future"),
             RequestSpec(arrival_time=0.0, prompt_len=10, max_tokens=8, request_id="fits")]
    s = run(specs, executor="sim", model="llama-2-7b", hardware="a100-80g", policy="tgi",
            enable_chunked_prefill=False, max_batch_prefill_tokens=32, max_batch_total_tokens=64).summary()
    # 40 > 32 prompt tokens; 10 + 80 = 90 > 64 tokens; 10 + 8 = 18 fits both.
    assert (s["num_requests"], s["completed"]) == (3, 1)
    assert s["rejected_reasons"] == {"prompt over max_batch_prefill_tokens": 1,
                                     "request over max_batch_total_tokens": 1}


def test_a_refused_prefill_becomes_a_decode_step():
    from minibatch.scheduler import Scheduler

    # static_batch admission refuses any newcomer while r runs; the tgi policy plans a prefill of w
    # (floor(1 x 0.3) = 0: no need to wait), admission refuses it, and the step decodes r instead.
    s = Scheduler(cfg(admission="static_batch", block_size=4), KVCacheManager(16, 4), max_model_len=100)
    r = rq("r", 4, out=1)
    assert s.kv.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    r.status = r.status.RUNNING
    s.running.append(r)
    s.policy.plan, s.policy.waiting_tokens = "decode", 2
    s.add(rq("w", 4))
    batch = s.schedule(1.0)
    assert [(q.request_id, n) for q, n in batch.items] == [("r", 1)]
    assert s.policy.plan == "decode" and [q.request_id for q in s.waiting] == ["w"]


def test_reservations_are_capped_by_max_model_len():
    # KV of 6 blocks of 4 tokens, max_model_len 12. r runs: 8 prompt + 4 generated tokens in 3 blocks;
    # its final length min(8 + 8, 12) = 12 = 3 blocks, all held, so it reserves nothing more: 3 free.
    kv = KVCacheManager(6, 4, max_model_len=12)
    r = rq("r", 8, max_tokens=8, out=4)
    assert kv.allocate_slots(r, 12)
    r.num_computed_tokens = 12
    a = rq("a", 4, max_tokens=10)
    # a needs min(4 + 10, 12) = 12 tokens = 3 blocks <= 3 free (uncapped: 14 tokens, 4 blocks);
    # under max_batch_total_tokens 24: 12 (r) + 12 (a) = 24 fits (uncapped: 16 + 14 = 30 does not).
    state = st(running=[r], waiting=[a], kv=kv, config=cfg(max_batch_total_tokens=24))
    assert TGIPolicy.final_len(r, kv) == 12 and TGIPolicy.final_len(a, kv) == 12
    assert TGIPolicy.final_len(a, None) == 14
    assert ids(TGIPolicy().select(state, 64, 4096, False)) == ["a"]
    # One token less of total budget and a waits.
    state = st(running=[r], waiting=[a], kv=kv, config=cfg(max_batch_total_tokens=23))
    assert ids(TGIPolicy().select(state, 64, 4096, False)) == []


def test_a_prefill_that_joined_the_batch_is_followed_by_a_decode_even_with_requests_waiting():
    p = TGIPolicy()
    batch = started(p, 3)
    # floor(3 x 0.3) = 0: w joins at once; floor(4 x 0.3) = 1 would let x join next too, but a
    # prefill that joined a running batch is always followed by one decode of the whole batch.
    assert step(p, st(running=batch, waiting=[rq("w")])) == ["w"]
    assert p.num_prefills == 2 and p.decode_next is True
    w = rq("w", out=1)
    assert step(p, st(running=batch + [w], waiting=[rq("x")])) == ids(batch) + ["w"]
    assert step(p, st(running=batch + [w], waiting=[rq("x")])) == ["x"]
    assert p.num_prefills == 3


def test_only_a_refused_prefill_has_a_fallback():
    p = TGIPolicy()
    r = rq("r", out=1)
    p.plan = "decode"                     # a decode that could not run: nothing else to try
    assert p.fallback_order(st(running=[r])) is None
    p.plan = "prefill"                    # a refused prefill decodes the running batch instead
    assert ids(p.fallback_order(st(running=[r]))) == ["r"] and p.plan == "decode"
    p.plan = "prefill"                    # ... and with nothing running there is nothing to decode
    assert p.fallback_order(st()) is None


def test_next_batch_takes_at_most_max_size_requests():
    w = [rq("a", 2), rq("b", 2), rq("c", 2)]
    assert ids(TGIPolicy().select(st(waiting=w), 2, 4096, False)) == ["a", "b"]


def test_a_full_batch_decodes_instead_of_prefilling():
    # max_batch_size (max_num_seqs) 2, both running: no room, even though floor(2 x 0.3) = 0
    # lets any waiting request join; chunked, the running ones run and nobody joins either.
    p = TGIPolicy()
    batch = started(p, 2)
    assert step(p, st(running=batch, waiting=[rq("w")], max_num_seqs=2)) == ids(batch)
    chunked = EngineConfig(policy="tgi", enable_chunked_prefill=True)
    assert ids(TGIPolicy().schedule_order(st(running=batch, waiting=[rq("w")], config=chunked,
                                              max_num_seqs=2))) == ids(batch)


def test_chunked_prefill_budget_is_what_the_running_batch_leaves():
    batch = [rq(f"b{i}", out=1) for i in range(10)]
    p = TGIPolicy()
    # 20 - 10 running tokens = 10: a (6) and b (4) fill it exactly; c (6) has no token left.
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=20)
    w = [rq("a", 6), rq("b", 4), rq("c", 6)]
    assert ids(p.schedule_order(st(running=batch, waiting=w, config=config))) == ids(batch) + ["a", "b"]
    # 11 - 10 = 1 token left: a starts with a 1-token chunk.
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=11)
    assert ids(p.schedule_order(st(running=batch, waiting=w, config=config))) == ids(batch) + ["a"]
    # 10 - 10 = 0: nobody joins.
    config = EngineConfig(policy="tgi", enable_chunked_prefill=True, max_batch_prefill_tokens=10)
    assert ids(p.schedule_order(st(running=batch, waiting=w, config=config))) == ids(batch)


def test_next_batch_counts_the_tokens_still_to_compute_and_the_blocks_still_needed():
    # s was swapped out with 4 of its 6 prompt tokens computed and 1 block held: it needs 2 more
    # tokens and blocks(6 + 4) - 1 = 2 more blocks. With a prefill budget of 4 and 5 free blocks,
    # s (2 tokens, 2 blocks) and a (2 tokens, blocks(2 + 4) = 2) both fit; b fits neither the budget
    # (4 tokens taken) nor the 1 block left.
    kv = KVCacheManager(6, 4)
    s = rq("s", 6, max_tokens=4)
    assert kv.allocate_slots(s, 4)
    s.num_computed_tokens = 4
    w = [s, rq("a", 2, max_tokens=4), rq("b", 2, max_tokens=4)]
    assert ids(TGIPolicy().select(st(waiting=w, kv=kv), 64, 4, False)) == ["s", "a"]
    # The free blocks go down by what each chosen request takes: 6 free, a takes 2 (4 left),
    # then c (blocks(6 + 6) = 3) fits; d (3) no longer does.
    kv = KVCacheManager(6, 4)
    w = [rq("a", 4, max_tokens=4), rq("c", 6, max_tokens=6), rq("d", 6, max_tokens=6)]
    assert ids(TGIPolicy().select(st(waiting=w, kv=kv), 64, 4096, False)) == ["a", "c"]


def test_a_policy_switched_to_mid_run_starts_from_a_fresh_counter():
    # A new TGIPolicy meets a running batch (policy switched mid-run): its counter is 0, not due.
    batch = [rq(f"b{i}", out=1) for i in range(10)]
    # max_waiting_tokens 1: 0 < 1 so the ratio rule holds; floor(10 x 0.3) = 3 > 1 waiting: decode.
    p = TGIPolicy()
    assert step(p, st(running=batch, waiting=[rq("w")], config=cfg(max_waiting_tokens=1))) == ids(batch)
    assert p.waiting_tokens == 1                          # one decode counted
    # With 3 running, floor(0.9) = 0: nothing owed to a decode, w is prefilled at the first step.
    p = TGIPolicy()
    assert step(p, st(running=batch[:3], waiting=[rq("w")])) == ["w"]


def test_unchunked_a_joining_prefill_needs_min_size_requests_that_fit_and_cuts_none():
    p = TGIPolicy()
    batch = started(p, 10)
    config = cfg(max_batch_prefill_tokens=12)
    # floor(10 x 0.3) = 3 are waiting, but only w1 and w2 fit 12 prompt tokens: 2 < 3, decode.
    w = [rq("w1", 6), rq("w2", 6), rq("w3", 6)]
    assert step(p, st(running=batch, waiting=w, config=config)) == ids(batch)
    # A small batch (floor(3 x 0.3) = 0): a (6) fits; b (30) is not cut to the 6 left, it waits.
    p = TGIPolicy()
    batch = started(p, 3)
    assert step(p, st(running=batch, waiting=[rq("a", 6), rq("b", 30)], config=config)) == ["a"]
