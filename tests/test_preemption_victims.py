"""Preemption victim choice (``EngineConfig.preemption_victim``), the engine's count of recomputed
tokens (wasted compute, vllm#54644) and priority preemption of running requests (vllm#40004)."""

from __future__ import annotations

import random

import pytest

from conftest import drive, hf_greedy, make_checkpoint
from minibatch import EngineConfig, LLMEngine
from minibatch.kv_cache import KVCacheManager
from minibatch.policies.priority import PriorityPolicy
from minibatch.request import Request, RequestStatus
from minibatch.results import RequestRecord
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler
from minibatch.workload import RequestSpec, Workload
from minibatch.workload.lengths import Uniform
from minibatch.workload.synthetic import synthetic

RULES = ("last", "least_computed", "lowest_priority")
SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


def sched(num_blocks, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig.from_kwargs(num_kv_blocks=num_blocks, block_size=block_size, max_model_len=64, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len=64)


def req(rid, n, priority=0, arrival=0.0, max_tokens=8) -> Request:
    return Request(rid, [100 + i for i in range(n)], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                   ignore_eos=True), arrival, priority=priority)


def apply_step(s: Scheduler, batch) -> None:
    """What the engine does after a step: count computed tokens; a request that caught up gets a token."""
    for r, n in batch.items:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)


def ids(rs) -> list[str]:
    return [r.request_id for r in rs]


def full_pool(rule, lens, priorities=None, block_size=4):
    """A scheduler whose pool the prompts ``lens`` ({id: tokens}) fill exactly after one step;
    each request then holds one output token."""
    blocks = sum(-(-n // block_size) for n in lens.values())
    s = sched(blocks, block_size, preemption_victim=rule)
    for i, (rid, n) in enumerate(lens.items()):
        s.add(req(rid, n, (priorities or {}).get(rid, 0), arrival=float(i)))
    apply_step(s, s.schedule(0.0))
    assert s.kv.num_free_blocks == 0 and not s.waiting
    return s


# -- the rules on hand-made states ------------------------------------------------------------
def running_state(computed, priorities):
    """Four running requests a..d (admission order) with the given computed tokens and classes."""
    s = sched(64)
    rs = []
    for i, rid in enumerate("abcd"):
        r = req(rid, 4, priorities[rid], arrival=float(i))
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, computed[rid]
        s.running.append(r)
        rs.append(r)
    return s, rs


@pytest.mark.parametrize("rule, want", [("last", "d"), ("least_computed", "c"), ("lowest_priority", "b")])
def test_each_rule_picks_its_victim_among_the_requests_ranked_below(rule, want):
    s, (a, b, c, d) = running_state({"a": 30, "b": 20, "c": 5, "d": 12}, {"a": 0, "b": 2, "c": 1, "d": 1})
    s.config = s.config.replace(preemption_victim=rule)
    assert s._pick_victim([a, b, c, d], 0, set(), set(), a).request_id == want
    # Already preempted or scheduled this step: never again.
    left = {"last": "c", "least_computed": "d", "lowest_priority": "d"}[rule]
    assert s._pick_victim([a, b, c, d], 0, {want}, set(), a).request_id == left
    # Only requests ranked below the one that needs blocks (the policy's order decides who may go).
    assert s._pick_victim([a, b, c, d], 2, set(), {"a", "b"}, c).request_id in ("d", "c")


def test_ties_go_to_the_lowest_ranked_and_a_requester_goes_only_if_strictly_cheapest():
    s, (a, b, c, d) = running_state({"a": 5, "b": 5, "c": 5, "d": 9}, {"a": 1, "b": 1, "c": 1, "d": 1})
    s.config = s.config.replace(preemption_victim="least_computed")
    assert s._pick_victim([a, b, c, d], 0, set(), set(), a) is c, "equal computed: the lowest ranked of them"
    a.num_computed_tokens = 4
    assert s._pick_victim([a, b, c, d], 0, set(), set(), a) is a, "the requester has the least work"
    s.config = s.config.replace(preemption_victim="lowest_priority")
    assert s._pick_victim([a, b, c, d], 0, set(), set(), a) is d, "same class: the latest arrival"
    # The default rule never returns the requester (nobody below: None, it then preempts itself).
    s.config = s.config.replace(preemption_victim="last")
    assert s._pick_victim([a, b, c, d], 3, set(), set(), d) is None


def test_policy_left_out_running_requests_are_candidates_first_for_last_and_by_rule_otherwise():
    s, (a, b, c, d) = running_state({"a": 30, "b": 3, "c": 5, "d": 12}, {"a": 0, "b": 0, "c": 0, "d": 0})
    order = [a, c, d]                                  # b paused by the policy
    assert s._pick_victim(order, 0, set(), set(), a) is b
    s.config = s.config.replace(preemption_victim="least_computed")
    assert s._pick_victim(order, 0, set(), set(), a) is b
    b.num_computed_tokens = 40
    assert s._pick_victim(order, 0, set(), set(), a) is c


def test_bad_rule_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="preemption_victim"):
        EngineConfig.from_kwargs(preemption_victim="random")


# -- the rules inside Scheduler.schedule --------------------------------------------------------
@pytest.mark.parametrize("rule, victim", [("last", "d"), ("least_computed", "c"), ("lowest_priority", "b")])
def test_schedule_preempts_the_rules_victim_when_the_first_request_needs_a_block(rule, victim):
    # a (4 tokens) fills its block and needs a second one; the pool is full.
    s = full_pool(rule, {"a": 4, "b": 6, "c": 2, "d": 7}, {"b": 2, "c": 1, "d": 1})
    batch = s.schedule(0.0)
    assert ids(batch.preempted) == [victim]
    assert victim not in ids(r for r, _ in batch.items) and "a" in ids(r for r, _ in batch.items)
    assert ids(s.waiting) == [victim] and s.kv.num_free_blocks + sum(
        len(s.kv.block_table(r.request_id)) for r in s.running) == s.kv.num_blocks
    s.kv.check_invariants()


def test_least_computed_preempts_the_requester_itself_when_it_has_the_least_work():
    s = full_pool("least_computed", {"a": 4, "b": 6, "c": 5, "d": 7})
    batch = s.schedule(0.0)
    assert ids(batch.preempted) == ["a"]
    assert ids(r for r, _ in batch.items) == ["b", "c", "d"], "the others run as if nothing happened"
    assert s.kv.block_table("a") == [] and s.waiting[0].request_id == "a"


# -- the wasted-compute counter -----------------------------------------------------------------
def test_recomputed_tokens_are_exactly_what_the_preemption_threw_away():
    s = full_pool("last", {"a": 4, "b": 6, "c": 2, "d": 7})
    d = next(r for r in s.running if r.request_id == "d")
    assert (d.num_computed_total, d.num_recomputed_tokens) == (7, 0)
    batch = s.schedule(0.0)                     # a needs a block: d (7 computed tokens) goes
    assert ids(batch.preempted) == ["d"] and d.recompute_until == 7
    apply_step(s, batch)
    for r in list(s.running):                   # make room: everyone else finishes
        s.remove(r)
    batch = s.schedule(1.0)                     # d comes back: prompt 7 + 1 output token again
    assert [(r.request_id, n) for r, n in batch.items] == [("d", 8)]
    assert (d.num_computed_total, d.num_recomputed_tokens) == (15, 7)
    rec = RequestRecord.of(d)
    assert (rec.computed_tokens, rec.recomputed_tokens) == (15, 7)


@pytest.mark.parametrize("caching, recomputed", [(False, 8), (True, 0)])
def test_prefix_cache_hits_on_resume_are_not_counted_as_recomputed(caching, recomputed):
    """d (8 prompt tokens, two full blocks of 4) is preempted by recompute after computing them; on
    resume the prefix cache serves both blocks, so only the pending token is computed again."""
    s = Scheduler(EngineConfig.from_kwargs(num_kv_blocks=8, block_size=4, max_model_len=64,
                                           enable_prefix_caching=caching), KVCacheManager(8, 4, caching), max_model_len=64)
    d = req("d", 8)
    s.add(d)
    apply_step(s, s.schedule(0.0))
    s.kv.cache_full_blocks(d)
    s._preempt(d, 0.0)
    batch = s.schedule(1.0)
    assert batch.items == [(d, 1 if caching else 9)]
    assert (d.num_recomputed_tokens, d.num_computed_total) == (recomputed, 8 + (1 if caching else 9))
    assert s.num_recomputed_tokens == recomputed


def workload(n=40, seed=0) -> Workload:
    rng = random.Random(seed)
    return Workload([RequestSpec(0.05 * i, rng.randint(64, 600), rng.randint(32, 300), priority=rng.randint(0, 2),
                                 request_id=f"r{i}") for i in range(n)], name="pressure")


@pytest.mark.parametrize("rule", RULES)
def test_counters_add_up_to_the_steps_tokens_and_kv_is_conserved_under_heavy_preemption(rule):
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=120, preemption_victim=rule), clock="virtual")

    def check(eng, st):
        eng.kv.check_invariants()

    result = run(workload(), engine=engine, on_step=check)
    s = result.summary()
    assert s["completed"] == 40 and s["num_preemptions"] >= 10, "a pool of 120 blocks preempts heavily"
    assert s["num_computed_tokens"] == sum(st.num_prefill_tokens + st.num_decode_tokens for st in result.steps)
    assert 0 < s["num_recomputed_tokens"] < s["num_computed_tokens"]
    assert s["recompute_waste"] == pytest.approx(s["num_recomputed_tokens"] / s["num_computed_tokens"])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_swap_preemption_recomputes_nothing():
    swapped = run(workload(), **SIM, num_kv_blocks=120, preemption_mode="swap").summary()
    assert swapped["num_preemptions"] > 0 and swapped["num_recomputed_tokens"] == 0


def test_least_computed_wastes_less_recompute_than_last_over_seeds():
    """vllm#54644's direction on the simulator: 80 requests, prompts 128-1024 and outputs 64-512
    tokens (uniform, its heterogeneous case), 4 req/s into a 200-block pool (3 seeds)."""
    wasted = {}
    for rule in ("last", "least_computed"):
        wasted[rule] = sum(run(synthetic(80, rate=4.0, input_len=Uniform(128, 1024), output_len=Uniform(64, 512),
                                         seed=seed), **SIM, num_kv_blocks=200, preemption_victim=rule)
                           .summary()["num_recomputed_tokens"] for seed in range(3))
    assert wasted["least_computed"] < 0.9 * wasted["last"]


# -- greedy outputs under heavy preemption, for every rule --------------------------------------
@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-victims")
    model = make_checkpoint(path, "llama-gqa", seed=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 30, 9, 41, 24)]
    return path, prompts, [hf_greedy(model, p, 14) for p in prompts]


@pytest.mark.parametrize("rule", RULES)
def test_greedy_outputs_equal_transformers_under_heavy_preemption(hf_case, rule):
    path, prompts, expected = hf_case
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, num_kv_blocks=10, block_size=8,
                                                preemption_victim=rule, seed=0))
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i), priority=i % 3)
    drive(engine, after_step=lambda e: e.kv.check_invariants())
    for i, ref in enumerate(expected):
        assert engine.requests[str(i)].output_token_ids == ref, f"prompt {i} diverged under {rule}"
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    assert sum(r.num_recomputed_tokens for r in engine.requests.values()) > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("rule", RULES[1:])
def test_tiny_model_outputs_do_not_depend_on_the_victim_rule(rule):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((6, 19, 33, 12, 27))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def outputs(**kw):
        engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", max_num_seqs=8, block_size=8, **kw))
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i), priority=i % 2)
        drive(engine)
        return [engine.requests[str(i)].output_token_ids for i in range(len(prompts))], engine

    ref, _ = outputs(num_kv_blocks=64)
    got, engine = outputs(num_kv_blocks=9, preemption_victim=rule)
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    assert got == ref


def test_metrics_page_counts_the_recomputed_tokens():
    from minibatch.serving.metrics import ServingMetrics, engine_gauges
    from minibatch.serving.scrape import parse_page

    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", max_num_seqs=8, block_size=8, num_kv_blocks=9))
    for i, n in enumerate((6, 19, 33, 12, 27)):
        engine.add_request([3 + (5 * i + j) % 200 for j in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), request_id=str(i))
    drive(engine)
    page = parse_page(ServingMetrics("tiny").render(engine_gauges(engine), 0))
    wasted = sum(r.num_recomputed_tokens for r in engine.requests.values())
    assert wasted > 0
    assert page[("minibatch:recomputed_tokens_total", (("engine", "0"), ("model_name", "tiny")))] == wasted


# -- priority preemption of running requests (vllm#40004) --------------------------------------
def test_at_max_num_seqs_a_waiting_urgent_request_displaces_a_running_one_only_when_preemptive():
    """vllm#40004: with every sequence slot taken by less urgent running requests, vLLM V1's
    priority scheduling (non-preemptive here) makes the urgent request wait; the preemptive
    priority policy runs it at the next step, and the displaced request pauses holding its KV."""
    for preemptive in (False, True):
        s = sched(64, max_num_seqs=2)
        s.policy = PriorityPolicy(aging_s=None, preemptive=preemptive)
        for rid in ("lo1", "lo2"):
            s.add(req(rid, 6, priority=1, arrival=0.0))
        apply_step(s, s.schedule(0.0))
        s.add(req("hi", 6, priority=0, arrival=1.0))
        batch = s.schedule(1.0)
        ran = ids(r for r, _ in batch.items)
        if preemptive:
            assert ran == ["hi", "lo1"] and not batch.preempted
            lo2 = next(r for r in s.running if r.request_id == "lo2")
            assert lo2.status is RequestStatus.RUNNING and s.kv.block_table("lo2"), "paused, KV kept"
        else:
            assert ran == ["lo1", "lo2"] and ids(s.waiting) == ["hi"], "priority inversion at max_num_seqs"


@pytest.mark.parametrize("rule, victims", [("last", ["c2"]), ("lowest_priority", ["c2"]), ("least_computed", ["b1"])])
def test_an_urgent_arrival_evicts_less_urgent_running_requests_in_the_rules_order(rule, victims):
    """KV pressure: the urgent prompt needs one block more than is free, held by less urgent running
    requests. Under the preemptive priority policy both rank below it; the rule picks which goes
    (least_computed: b1, 3 computed tokens and one block, rather than c2's 7 tokens)."""
    s = sched(6, block_size=4, preemption_victim=rule)
    s.policy = PriorityPolicy(aging_s=None)
    for rid, n, prio in (("a0", 7, 0), ("b1", 3, 1), ("c2", 7, 2)):     # 2 + 1 + 2 blocks (+1 free)
        s.add(req(rid, n, prio, arrival=0.0))
    apply_step(s, s.schedule(0.0))
    s.add(req("hi", 8, 0, arrival=1.0))                                 # 2 blocks
    batch = s.schedule(1.0)
    assert ids(batch.preempted) == victims
    assert "hi" in ids(r for r, _ in batch.items) and "a0" in ids(r for r, _ in batch.items)
    s.kv.check_invariants()


def test_urgent_ttft_with_priority_preemption_is_far_below_vllm_v1s_non_preemptive_rule():
    """The engine-level effect (vllm#40004's direction), simulated: 8 slots taken by long class-1
    requests; class-0 requests arriving meanwhile wait for a slot unless they may displace one."""
    specs = [RequestSpec(0.0, 256, 400, priority=1, request_id=f"lo{i}") for i in range(8)]
    specs += [RequestSpec(0.5 + 0.3 * i, 256, 16, priority=0, request_id=f"hi{i}") for i in range(4)]
    ttft = {}
    for preemptive in (False, True):
        engine = LLMEngine(EngineConfig.from_kwargs(**SIM, max_num_seqs=8), clock="virtual")
        engine.scheduler.policy = PriorityPolicy(aging_s=None, preemptive=preemptive)
        res = run(Workload(specs, name="slots"), engine=engine)
        assert all(r.completed for r in res.requests)
        ttft[preemptive] = max(r.ttft for r in res.requests if r.priority == 0)
    assert ttft[True] * 10 < ttft[False]
