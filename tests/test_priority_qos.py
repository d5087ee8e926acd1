"""PriorityPolicy's QoS knobs: non-preemptive ranking (vLLM V1), the preemption margin, and
per-class admission limits (a concurrency cap and a KV quota). Hand-made states for the rules,
then small simulator runs for what they are for: priority inversion through held KV and its fixes."""

from __future__ import annotations

import re

import pytest

from minibatch import EngineConfig, LLMEngine
from minibatch.kv_cache import KVCacheManager
from minibatch.policies import SchedulerState
from minibatch.policies.priority import PriorityPolicy
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.workload import RequestSpec, Workload

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


def rq(rid, prio, arrival=0.0, prompt=8, max_tokens=8) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), arrival, priority=prio)


def state(running=(), waiting=(), now=10.0, kv=None) -> SchedulerState:
    return SchedulerState(now, list(running), list(waiting), 64, 2048, 0.0, kv)


def ids(order) -> list[str]:
    return [r.request_id for r in order]


def test_non_preemptive_keeps_running_requests_ahead_of_any_waiting_one():
    run1, run0 = rq("run1", 1, arrival=0.0), rq("run0", 0, arrival=1.0)
    w0, w1 = rq("w0", 0, arrival=2.0), rq("w1", 1, arrival=0.5)
    p = PriorityPolicy(aging_s=None, preemptive=False)
    assert p.preemptive is False
    # Running ones first, each group in (priority, arrival) order: the class-0 arrival waits.
    assert ids(p.schedule_order(state([run1, run0], [w1, w0]))) == ["run0", "run1", "w0", "w1"]


def test_preemptive_puts_a_waiting_request_ahead_only_of_less_urgent_running_ones():
    run1, run0 = rq("run1", 1, arrival=0.0), rq("run0", 0, arrival=1.0)
    w0, w1 = rq("w0", 0, arrival=0.5), rq("w1", 1, arrival=0.25)
    p = PriorityPolicy(aging_s=None)
    # w0 outranks run1 (class 0 < 1) but not run0 (same class, running stays ahead although
    # w0 arrived earlier); w1 never goes ahead of run1 (its own class).
    assert ids(p.schedule_order(state([run1, run0], [w1, w0]))) == ["run0", "w0", "run1", "w1"]


def test_margin_is_how_many_levels_more_urgent_a_waiting_request_must_be():
    run1, run2 = rq("run1", 1), rq("run2", 2)
    w0 = rq("w0", 0, arrival=5.0)
    assert ids(PriorityPolicy(aging_s=None, margin=0.0).schedule_order(state([run1, run2], [w0]))) == \
        ["w0", "run1", "run2"]
    # Two levels above run2 but only one above run1: with margin 1 it passes run2 only.
    assert ids(PriorityPolicy(aging_s=None, margin=1.0).schedule_order(state([run1, run2], [w0]))) == \
        ["run1", "w0", "run2"]
    assert ids(PriorityPolicy(aging_s=None, margin=2.0).schedule_order(state([run1, run2], [w0]))) == \
        ["run1", "run2", "w0"]


def test_max_running_caps_the_admissions_of_one_class():
    running = [rq("r1a", 1), rq("r1b", 1)]
    waiting = [rq("w1a", 1, arrival=1.0), rq("w0", 0, arrival=2.0), rq("w1b", 1, arrival=3.0)]
    p = PriorityPolicy(aging_s=None, preemptive=False, max_running={1: 3})
    # Two class-1 requests run, so one more (the earlier) may start; class 0 has no cap.
    assert ids(p.schedule_order(state(running, waiting))) == ["r1a", "r1b", "w0", "w1a"]
    full = PriorityPolicy(aging_s=None, preemptive=False, max_running={1: 2})
    assert ids(full.schedule_order(state(running, waiting))) == ["r1a", "r1b", "w0"]
    # Each waiting request kept counts one: 1 running + a + b = the cap of 3, so c waits.
    p3 = PriorityPolicy(aging_s=None, preemptive=False, max_running={1: 3})
    three = [rq("a", 1, arrival=1.0), rq("b", 1, arrival=2.0), rq("c", 1, arrival=3.0)]
    assert ids(p3.schedule_order(state([rq("r1", 1)], three))) == ["r1", "a", "b"]
    # A class at its cap is skipped, not a stop: order r0, w0 (class 0, (0, 1.0)), w1 ((1, 0.5));
    # class 0 has 1 running = its cap of 1, so w0 waits and w1 (no cap) still comes.
    capped = PriorityPolicy(aging_s=None, preemptive=False, max_running={0: 1})
    w = [rq("w0", 0, arrival=1.0), rq("w1", 1, arrival=0.5)]
    assert ids(capped.schedule_order(state([rq("r0", 0)], w))) == ["r0", "w1"]


def test_kv_quota_counts_each_request_at_its_final_length():
    kv = KVCacheManager(100, 16)
    # Each class-1 request holds at most ceil((64 + 64) / 16) = 8 blocks over its life.
    running = [rq("r1", 1, prompt=64, max_tokens=64)]
    waiting = [rq(f"w{i}", 1, arrival=float(i), prompt=64, max_tokens=64) for i in range(1, 4)]
    assert PriorityPolicy.committed_blocks(running[0], kv) == 8
    p = PriorityPolicy(aging_s=None, preemptive=False, kv_quota={1: 24})
    assert ids(p.schedule_order(state(running, waiting, kv=kv))) == ["r1", "w1", "w2"]     # 3 x 8 = 24
    big = rq("big", 1, prompt=400, max_tokens=100)                                       # 32 blocks > 24
    assert ids(p.schedule_order(state(running, [big], kv=kv))) == ["r1"]
    # Over the quota is skipped, not a stop: big (arrival 0) comes first, 8 + 32 > 24, and small
    # behind it (ceil((8 + 8) / 16) = 1 block) still fits: 8 + 1 <= 24.
    small = rq("small", 1, arrival=9.0, prompt=8, max_tokens=8)
    assert ids(p.schedule_order(state(running, [big, small], kv=kv))) == ["r1", "small"]
    # Larger than the whole quota: it may start when its class holds nothing, never waiting forever.
    assert ids(p.schedule_order(state([], [big, waiting[0]], kv=kv))) == ["big"]


@pytest.mark.parametrize("bad", [{1: 0}, {1: -3}, {1: 2.5}, {1: True}])
def test_limits_must_be_positive_integers(bad):
    # The error names the knob and the class: e.g. "kv_quota[1] must be an integer >= 1, got 0".
    for knob in ("kv_quota", "max_running"):
        expected = f"{knob}[1] must be an integer >= 1, got {bad[1]!r}"
        with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
            PriorityPolicy(**{knob: bad})


def test_a_limit_of_one_is_allowed():
    p = PriorityPolicy(max_running={0: 1}, kv_quota={0: 1})
    assert (p.max_running, p.kv_quota) == ({0: 1}, {0: 1})


# -- in the engine (simulator): inversion through held KV and its fixes ---------------------------
POOL = 400


def burst() -> Workload:
    """A batch job (30 class-1 requests at t=0) fills a 400-block pool; an urgent request with a
    2048-token prompt (128 blocks) arrives at t=4 s."""
    specs = [RequestSpec(0.0, 512, 256 + 16 * i, priority=1, request_id=f"lo{i}") for i in range(30)]
    return Workload(specs + [RequestSpec(4.0, 2048, 32, priority=0, request_id="hi")], name="burst")


def run_policy(policy):
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=POOL), clock="virtual")
    engine.scheduler.policy = policy
    held = []

    def on_step(eng, st):
        held.append(sum(len(eng.kv.block_table(r.request_id)) for r in eng.scheduler.running if r.priority == 1))

    result = run(burst(), engine=engine, on_step=on_step)
    assert all(q.completed for q in result.requests), "no request is lost"
    return {q.request_id: q for q in result.requests}, held


def test_inversion_non_preemptive_urgent_request_waits_for_held_kv_and_the_fixes_remove_it():
    np_reqs, np_held = run_policy(PriorityPolicy(aging_s=None, preemptive=False))
    p_reqs, _ = run_policy(PriorityPolicy(aging_s=None))
    q_reqs, q_held = run_policy(PriorityPolicy(aging_s=None, preemptive=False, kv_quota={1: POOL - 130}))
    # Non-preemptive: the batch job holds the pool when hi arrives; hi waits for blocks to free.
    assert np_reqs["hi"].queue_delay > 5 * p_reqs["hi"].queue_delay
    assert max(np_held) > POOL - 128, "the low class held more than the urgent request could use"
    # Preemptive: hi evicts class-1 requests; they are recomputed, all still finish.
    assert sum(q.num_preemptions for q in p_reqs.values() if q.priority == 1) > 0
    # KV quota: class 1 never holds more than its quota, so hi starts at once, without preemption.
    assert max(q_held) <= POOL - 130
    assert q_reqs["hi"].queue_delay < np_reqs["hi"].queue_delay / 5
    assert sum(q.num_preemptions for q in q_reqs.values()) == 0
