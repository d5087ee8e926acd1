"""Admission modes (max_utilization, guaranteed_no_evict, conservative) and the
contiguous KV allocator, as units; their behaviour on workloads is in
test_policy_behaviour.py and their invariants in test_policies.py."""

from __future__ import annotations

import pytest

from minibatch.admission import Conservative, GuaranteedNoEvict, make_admission
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.kv_cache import KVCacheManager
from minibatch.request import Request, RequestStatus
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler


def _req(rid, prompt_len, max_tokens):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)


@pytest.mark.parametrize("make", [
    lambda: EngineConfig.from_kwargs(admission="optimistic"),
    lambda: LLMEngine(EngineConfig(admission="optimistic", executor="sim", model="llama-2-7b")),
    lambda: make_admission("optimistic"),
])
def test_unknown_admission_mode_is_named(make):
    with pytest.raises(ValueError, match="optimistic"):
        make()


def _scheduler(admission, num_blocks=10, block_size=4):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(EngineConfig(admission=admission, block_size=block_size), kv, max_model_len=1000)


def test_guaranteed_no_evict_reserves_running_requests_futures():
    s = _scheduler("guaranteed_no_evict")
    running = _req("r", 8, 16)                   # holds 2 blocks now, will need 6
    s.kv.allocate_slots(running, 8)
    running.num_computed_tokens = 8
    running.status = RequestStatus.RUNNING
    s.running.append(running)
    g = s.admission
    assert isinstance(g, GuaranteedNoEvict)
    # 8 free blocks, 4 of them promised to the running request: 4 left.
    assert g.can_admit(s, _req("a", 8, 8), [])          # needs 4
    assert not g.can_admit(s, _req("b", 8, 9), [])      # needs 5
    assert make_admission("max_utilization").can_admit(s, _req("b", 8, 9), [])


def test_conservative_ratio_decays_and_resets_after_a_preemption():
    c = Conservative()
    s = _scheduler("conservative")
    assert c.new_token_ratio == 0.7
    for _ in range(600):
        c.on_step(s, 0)
    assert c.new_token_ratio == pytest.approx(0.7 * 0.14)       # SGLang's floor, ~0.1
    c.on_step(s, 0)
    assert c.new_token_ratio == pytest.approx(0.098)
    c.on_step(s, 1)                                             # a preemption: back up
    assert c.new_token_ratio >= 0.7


def test_conservative_admits_on_an_estimate_of_future_tokens():
    s = _scheduler("conservative", num_blocks=10, block_size=4)  # 40 slots
    c = s.admission
    big = _req("a", 8, 40)
    c.new_token_ratio = 0.7                                      # 8 + 28 tokens: 9 blocks
    assert c.can_admit(s, big, [])
    running = _req("r", 8, 20)
    s.kv.allocate_slots(running, 8)
    running.num_computed_tokens = 8
    running.status = RequestStatus.RUNNING
    s.running.append(running)                                    # 2 held + 14 estimated tokens (4 more blocks)
    assert not c.can_admit(s, big, [])
    c.new_token_ratio = 0.1                                      # 8 + 4 tokens: 3 blocks; running needs 1 more
    assert c.can_admit(s, big, [])


# -- the contiguous allocator --------------------------------------------------------------
def test_contiguous_reserves_max_model_len_as_one_run():
    kv = KVCacheManager(20, 4, allocator="contiguous", max_model_len=24)   # 6 blocks per request
    a, b = _req("a", 5, 4), _req("b", 2, 4)
    assert kv.allocate_slots(a, 5) and kv.block_table("a") == [0, 1, 2, 3, 4, 5]
    assert kv.allocate_slots(b, 2) and kv.block_table("b") == [6, 7, 8, 9, 10, 11]
    a.num_computed_tokens, b.num_computed_tokens = 5, 2
    assert kv.allocate_slots(a, 10) and len(kv.block_table("a")) == 6      # never grows
    reserved, internal = kv.waste_slots([a, b])
    assert (reserved, internal) == ((6 - 2) * 4 + (6 - 1) * 4, 3 + 2)
    kv.free(a)
    c = _req("c", 3, 4)
    assert kv.allocate_slots(c, 3) and kv.block_table("c") == [0, 1, 2, 3, 4, 5]   # first fit


def test_contiguous_equal_reservations_leave_a_rounding_remainder():
    # Equal-size reservations cannot fragment externally (vLLM §3): a refusal here is a full
    # pool, and the block left over is the remainder of 16 blocks carved into runs of 5.
    kv = KVCacheManager(16, 4, allocator="contiguous", max_model_len=20)   # 5 blocks per request
    reqs = [_req(f"r{i}", 4, 4) for i in range(3)]
    for r in reqs:
        assert kv.allocate_slots(r, 4)                                     # blocks 0-14
    kv.free(reqs[1])                                                       # free: 5-9 and 15
    assert kv.allocate_slots(_req("x", 4, 4), 4)                           # 5-9
    assert kv.num_free_blocks == 1
    kv.free(reqs[0])                                                       # free: 0-4, 15: 6 blocks
    y = _req("y", 4, 4)
    assert kv.allocate_slots(y, 4) and kv.block_table("y") == [0, 1, 2, 3, 4]
    assert not kv.allocate_slots(_req("w", 4, 4), 4)                       # 1 block free, not 5
    assert kv.num_fragmentation_refusals == 0 and kv.take_stranded_blocks() == 0


def test_contiguous_paged_fragmentation_in_the_step_timeline():
    from minibatch.runner import run
    from minibatch.workload import synthetic

    wl = synthetic(20, rate=50, input_len=100, output_len=20, seed=1)
    kw = dict(executor="sim", model="llama-2-7b", hardware="a10", max_model_len=2048)
    paged = run(wl, **kw).steps
    contiguous = run(wl, **kw, kv_allocator="contiguous").steps
    assert all(s.kv_reserved_unused == 0 for s in paged)
    assert max(s.kv_reserved_unused for s in contiguous) > 0.5
    slots = paged[0].kv_blocks_total * 16
    assert all(0 <= s.kv_internal_waste * slots < 20 * 16 for s in paged + contiguous)   # < a block each


def test_contiguous_config_errors():
    with pytest.raises(ValueError, match="paged"):
        EngineConfig.from_kwargs(kv_allocator="contiguous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(8, 4, allocator="contiguous")
    engine = LLMEngine(EngineConfig(executor="sim", model="llama-2-7b", num_kv_blocks=100, block_size=16,
                                    kv_allocator="contiguous", max_model_len=4096), clock="virtual")
    with pytest.raises(ValueError, match="KV blocks"):          # 256 blocks reserved > 100 in the pool
        engine.add_request([1] * 10, SamplingParams(max_tokens=5))


def _running(s, req, held_tokens, generated=0):
    """Put ``req`` in ``s.running`` with blocks for ``held_tokens`` and ``generated`` outputs."""
    req.output_token_ids.extend([5] * generated)
    assert s.kv.allocate_slots(req, held_tokens)
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    s.running.append(req)
    return req


def test_guaranteed_no_evict_promises_nothing_for_a_request_that_holds_its_whole_future():
    s = _scheduler("guaranteed_no_evict")                 # 10 blocks of 4
    _running(s, _req("r", 8, 8), 16)                      # final 16 tokens: all 4 blocks held
    g = s.admission
    assert g.can_admit(s, _req("a", 8, 16), []), "6 free, none promised: 24 tokens (6 blocks) fit"
    assert not g.can_admit(s, _req("b", 8, 17), [])       # 25 tokens: 7 blocks


def test_conservative_ratio_decays_linearly_from_the_initial_to_the_floor():
    s = _scheduler("conservative")
    c = Conservative()
    step = (0.7 - 0.7 * 0.14) / 600                       # 600 steps from 0.7 down to 0.098
    c.on_step(s, 0)
    assert c.new_token_ratio == pytest.approx(0.7 - step)
    for _ in range(299):
        c.on_step(s, 0)
    assert c.new_token_ratio == pytest.approx((0.7 + 0.098) / 2), "halfway after 300 of the 600 steps"


def test_conservative_estimate_counts_the_tokens_left_and_stops_at_max_model_len():
    kv = KVCacheManager(300, 4)
    s = Scheduler(EngineConfig(admission="conservative", block_size=4), kv, max_model_len=100)
    c = s.admission
    c.new_token_ratio = 0.7
    half = _req("h", 10, 20)
    half.output_token_ids.extend([5] * 10)                # 10 of 20 left
    assert c.estimate(s, half) == 7                       # ceil(0.7 * 10)
    assert c.estimate(s, _req("c", 90, 20)) == 10         # ceil(0.7 * 20) = 14, but 100 - 90 = 10 remain
    full = _req("f", 90, 20)
    full.output_token_ids.extend([5] * 10)                # 100 tokens: max_model_len reached
    assert c.estimate(s, full) == 0, "10 tokens left by max_tokens, none by max_model_len"


def test_conservative_reserves_nothing_for_a_request_whose_estimate_it_holds():
    s = _scheduler("conservative")                        # 10 blocks of 4
    c = s.admission
    c.new_token_ratio = 0.5
    _running(s, _req("r", 8, 8), 12)                      # 8 + ceil(0.5 * 8) = 12 tokens: its 3 blocks
    assert c.can_admit(s, _req("a", 8, 40), []), "7 free, none reserved: 8 + 20 tokens (7 blocks) fit"
    assert not c.can_admit(s, _req("b", 8, 42), [])       # 8 + 21 tokens: 8 blocks


@pytest.mark.parametrize("lens,generated,expected", [
    ([100, 100], [60, 80], 0.9),              # (60 + 80 + 20 * 2) / 200
    ([100, 100], [10, 30], 0.7),              # (10 + 30 + 40) / 200 = 0.4: never below the initial 0.7
    ([10, 10], [5, 5], 1.0),                  # (5 + 5 + 40) / 20 = 2.5: capped at 1
    ([], [], 1.0),                            # nobody left running: 1
])
def test_conservative_ratio_after_a_preemption_is_the_retract_estimate(lens, generated, expected):
    s = _scheduler("conservative", num_blocks=100)
    c = s.admission
    for i, (max_tokens, gen) in enumerate(zip(lens, generated)):
        _running(s, _req(f"r{i}", 4, max_tokens), 4 + gen, gen)
    c.on_step(s, 1)
    assert c.new_token_ratio == pytest.approx(expected)


def test_static_batch_before_any_step_counts_every_running_request_as_from_an_earlier_batch():
    # A scheduler that has not built a step yet has admitted nobody "this step": a request
    # already running (placed by hand here) belongs to an earlier batch, so static_batch refuses.
    s = _scheduler("static_batch")
    r = _req("r", 4, 4)
    assert s.kv.allocate_slots(r, 4)
    r.num_computed_tokens, r.status = 4, RequestStatus.RUNNING
    s.running.append(r)
    assert s.admitted_this_step == set()
    assert s.admission.can_admit(s, _req("new", 4, 4), []) is False
