"""One small, hand-made case per rule of each scheduling policy (``minibatch.policies``).

Each case builds ``SchedulerState``s and ``Request``s by hand, calls the policy the way
the scheduler does (``schedule_order``, ``on_step``, ``next_wakeup``) and compares with
orders, counters and levels worked out by hand in the comments. No engine runs.
Times and weights are binary fractions wherever a sum is compared exactly.
"""

from __future__ import annotations

import math
import re

import pytest

from minibatch.kv_cache import KVCacheManager
from minibatch.policies import Policy, SchedulerState, available, base, make_policy, register
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.policies.dynamic import _EPS, DynamicPolicy
from minibatch.policies.fair import FairPolicy, tenant_of
from minibatch.policies.lpm import LPMPolicy
from minibatch.policies.mlfq import MLFQPolicy
from minibatch.policies.priority import PriorityPolicy
from minibatch.policies.registry import Registry
from minibatch.policies.serial import SerialPolicy
from minibatch.policies.sjf import SJFPolicy
from minibatch.policies.static import StaticPolicy
from minibatch.request import Request, RequestStatus
from minibatch.sampling_params import SamplingParams

ALL = ["continuous", "dynamic", "fair", "lpm", "mlfq", "priority", "serial", "sglang", "sjf", "static", "tgi",
       "trtllm"]


def rq(rid, prompt=8, max_tokens=8, arrival=0.0, out=0, computed=0, **kw) -> Request:
    """A request with ``prompt`` prompt tokens, ``out`` generated tokens, ``computed`` computed."""
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), arrival, **kw)
    r.output_token_ids = [5] * out
    r.num_computed_tokens = computed
    return r


def state(now=0.0, running=(), waiting=(), max_num_seqs=8, max_wait_s=0.0, kv=None) -> SchedulerState:
    return SchedulerState(now, list(running), list(waiting), max_num_seqs, 2048, max_wait_s, kv)


def ids(order) -> list[str]:
    return [r.request_id for r in order]


# -- base: waited, repr, the registry ------------------------------------------------------------
def test_waited_is_the_age_since_arrival_never_negative():
    assert Policy.waited(rq("r", arrival=1.25), 4.0) == 2.75
    assert Policy.waited(rq("r", arrival=4.0), 1.0) == 0.0        # arrives "later" than now: age 0


def test_repr_names_the_class():
    assert repr(SerialPolicy()) == "SerialPolicy()"
    assert repr(DynamicPolicy(max_wait_ms=3)) == "DynamicPolicy()"


def test_base_policy_has_no_order_and_no_deadline():
    with pytest.raises(NotImplementedError):
        Policy().schedule_order(state())
    assert Policy().next_wakeup(state(waiting=[rq("a")])) is None


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry, so that test registrations do not leak."""
    monkeypatch.setattr(base.POLICIES, "classes", dict(base.POLICIES.classes))
    return base.POLICIES.classes


def test_available_lists_the_registered_names_sorted(registry):
    assert available() == ALL
    registry.clear()
    registry.update({"zeta": SerialPolicy, "alpha": SerialPolicy})
    assert available() == ["alpha", "zeta"]


def test_register_adds_a_policy_under_its_name(registry):
    @register
    class Mine(ContinuousPolicy):
        name = "mine"

    assert registry["mine"] is Mine and Mine.name == "mine"
    assert "mine" in available()
    p = make_policy("mine")
    assert type(p) is Mine


def test_register_with_a_name_overrides_the_class_name(registry):
    class Orig(ContinuousPolicy):
        name = "orig"

    assert register(name="alias")(Orig) is Orig
    assert Orig.name == "alias"
    assert registry["alias"] is Orig and "orig" not in registry
    assert register()(type("Plain", (SerialPolicy,), {"name": "plain"})).name == "plain"
    assert registry["plain"].__name__ == "Plain"


def test_register_refuses_a_class_without_a_name(registry):
    class Nameless(Policy):
        pass

    with pytest.raises(ValueError, match="^scheduling policy class Nameless has no name$"):
        register(Nameless)
    assert "" not in registry


def test_a_new_registry_starts_empty_and_words_its_errors_with_its_own_kind():
    """``POLICIES`` and ``ROUTERS`` are built at import time; a registry built here must
    start with no classes, make instances of its own base, and name its kind in errors."""
    class Widget:
        name = ""

    reg = Registry(Widget, "widget", "widgets")
    assert (reg.base, reg.kind, reg.plural) == (Widget, "widget", "widgets")
    assert reg.classes == {} and reg.available() == []

    @reg.register
    class Knob(Widget):
        name = "knob"

    assert reg.available() == ["knob"] and type(reg.make("knob")) is Knob
    k = Knob()
    assert reg.make(k) is k                                   # an instance of the base, as is
    with pytest.raises(ValueError, match=r"^widget class Blank has no name$"):
        reg.register(type("Blank", (Widget,), {}))
    expected = "unknown widget 'dial'; available widgets: ['knob']"
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        reg.make("dial")
    assert "knob" not in available(), "a private registry leaked into POLICIES"


def test_make_policy_from_a_name_an_instance_or_a_class():
    p = make_policy("sjf", aging_tokens_per_s=7.0)
    assert type(p) is SJFPolicy and p.aging_tokens_per_s == 7.0
    q = LPMPolicy()
    assert make_policy(q) is q
    r = make_policy(PriorityPolicy, aging_s=3.0)
    assert type(r) is PriorityPolicy and r.aging_s == 3.0


def test_make_policy_names_the_unknown_policy_and_the_available_ones():
    expected = f"unknown scheduling policy 'nope'; available policies: {ALL}"
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        make_policy("nope")


# -- continuous, serial --------------------------------------------------------------------------
def test_continuous_is_running_then_waiting_in_queue_order():
    r1, r2, w1, w2 = rq("r1", arrival=2.0), rq("r2", arrival=1.0), rq("w1"), rq("w2")
    assert ids(ContinuousPolicy().schedule_order(state(running=[r1, r2], waiting=[w1, w2]))) == \
        ["r1", "r2", "w1", "w2"]


def test_serial_runs_one_request_the_running_one_first():
    a, b, c = rq("a"), rq("b"), rq("c")
    assert ids(SerialPolicy().schedule_order(state(waiting=[a, b]))) == ["a"]
    assert ids(SerialPolicy().schedule_order(state(running=[c], waiting=[a, b]))) == ["c"]
    assert SerialPolicy().schedule_order(state()) == []


# -- static ------------------------------------------------------------------------------------------
def test_static_batches_run_until_their_last_member_ends():
    p = StaticPolicy()
    assert (p.batch, p.batch_size, p.num_batches, p.num_padded_slots) == ([], 0, 0, 0)   # no batch yet
    r = [rq(f"r{i}") for i in range(5)]
    # No batch in flight: the first max_num_seqs = 3 waiting form one.
    assert p.schedule_order(state(waiting=r, max_num_seqs=3)) == r[:3]
    assert (p.batch_size, p.num_batches, p.num_padded_slots) == (3, 1, 0)
    # r0 finished (gone from both lists): r3 may not join; r0's slot pads the batch.
    assert p.schedule_order(state(running=r[1:3], waiting=r[3:], max_num_seqs=3)) == r[1:3]
    assert (p.batch_size, p.num_batches, p.num_padded_slots) == (3, 1, 1)
    # r2 was preempted (back in the waiting queue, ahead of r3): still a member of the batch.
    assert p.schedule_order(state(running=[r[1]], waiting=[r[2], r[3], r[4]], max_num_seqs=3)) == r[1:3]
    assert (p.batch_size, p.num_batches, p.num_padded_slots) == (3, 1, 1)
    # Only r2 left: two padded slots.
    assert p.schedule_order(state(running=[r[2]], waiting=r[3:], max_num_seqs=3)) == [r[2]]
    assert p.num_padded_slots == 2
    # The batch ended: the next one is r3, r4 (two members, no padding).
    assert p.schedule_order(state(waiting=r[3:], max_num_seqs=3)) == r[3:]
    assert (p.batch_size, p.num_batches, p.num_padded_slots) == (2, 2, 0)
    # Nothing queued: an empty order, no batch counted.
    assert p.schedule_order(state(max_num_seqs=3)) == []
    assert (p.batch_size, p.num_batches, p.num_padded_slots) == (0, 2, 0)


def test_static_adopts_running_requests_first_then_fills_from_the_queue():
    x, y, z, w = rq("x"), rq("y"), rq("z"), rq("w")
    p = StaticPolicy()
    assert ids(p.schedule_order(state(running=[x, y], waiting=[z, w], max_num_seqs=3))) == ["x", "y", "z"]
    assert (p.batch_size, p.num_batches) == (3, 1)
    # Running requests fill (or overfill) max_num_seqs: nobody is taken from the queue.
    q = StaticPolicy()
    assert ids(q.schedule_order(state(running=[x, y, z], waiting=[w], max_num_seqs=3))) == ["x", "y", "z"]
    v = rq("v")
    q2 = StaticPolicy()
    assert ids(q2.schedule_order(state(running=[x, y, z, v], waiting=[w, rq("u")], max_num_seqs=3))) == \
        ["x", "y", "z", "v"]
    assert q2.batch_size == 4
    # Adopted running requests with nothing waiting: a batch of them alone.
    q3 = StaticPolicy()
    assert ids(q3.schedule_order(state(running=[x], max_num_seqs=3))) == ["x"]
    assert (q3.batch_size, q3.num_batches) == (1, 1)


def test_static_dispatch_ready_is_whether_anyone_waits():
    assert StaticPolicy().dispatch_ready(state(waiting=[rq("a")])) is True
    assert StaticPolicy().dispatch_ready(state(running=[rq("a")])) is False


# -- dynamic -------------------------------------------------------------------------------------
def test_dynamic_window_is_its_own_or_the_engines():
    assert DynamicPolicy(max_wait_ms=250).window(state(max_wait_s=4.0)) == 0.25
    assert DynamicPolicy().window(state(max_wait_s=0.375)) == 0.375
    assert DynamicPolicy(max_wait_ms=0).window(state(max_wait_s=4.0)) == 0.0


def test_dynamic_window_closes_max_wait_after_the_oldest_arrival():
    p = DynamicPolicy(max_wait_ms=500)
    late, early = rq("late", arrival=0.375), rq("early", arrival=0.125)
    s = state(now=0.25, waiting=[late, early], max_num_seqs=4)
    assert p.window_closes(s) == 0.625            # 0.125 + 0.5
    assert p.next_wakeup(s) == 0.625
    assert p.schedule_order(s) == [] and p.num_batches == 0


def test_dynamic_dispatches_when_the_window_closes():
    a, b = rq("a", arrival=0.25), rq("b", arrival=0.5)
    closes = 0.75                                  # 0.25 + 500 ms
    for now, ready in [(0.5, False), (closes - 2 * _EPS, False), (closes - _EPS, True), (closes, True)]:
        assert DynamicPolicy(max_wait_ms=500).dispatch_ready(state(now, waiting=[a, b], max_num_seqs=4)) is ready, now
    p = DynamicPolicy(max_wait_ms=500)
    assert p.schedule_order(state(closes, waiting=[a, b], max_num_seqs=4)) == [a, b]
    assert (p.batch_size, p.num_batches) == (2, 1)
    # The engine's max_wait_s when the policy has no window of its own.
    assert DynamicPolicy().dispatch_ready(state(0.5, waiting=[a], max_wait_s=0.25)) is True
    assert DynamicPolicy().dispatch_ready(state(0.375, waiting=[a], max_wait_s=0.25)) is False


def test_dynamic_dispatches_a_full_batch_at_once():
    reqs = [rq(f"r{i}", arrival=0.0) for i in range(3)]
    p = DynamicPolicy(max_wait_ms=1000)
    assert p.dispatch_ready(state(0.0, waiting=reqs[:2], max_num_seqs=3)) is False
    assert p.dispatch_ready(state(0.0, waiting=reqs, max_num_seqs=3)) is True       # exactly max_num_seqs
    assert p.schedule_order(state(0.0, waiting=reqs, max_num_seqs=3)) == reqs
    assert p.dispatch_ready(state(5.0)) is False                                     # nobody waits


def test_dynamic_adopts_running_requests_with_the_window_open():
    x, w = rq("x", arrival=0.0), rq("w", arrival=0.0)
    p = DynamicPolicy(max_wait_ms=1000)
    assert ids(p.schedule_order(state(0.0, running=[x], waiting=[w], max_num_seqs=4))) == ["x", "w"]


def test_dynamic_next_wakeup_only_while_requests_wait_for_the_window():
    a, b = rq("a", arrival=0.25), rq("b", arrival=0.5)
    p = DynamicPolicy(max_wait_ms=500)
    assert p.next_wakeup(state(0.5)) is None                                   # nothing waits
    assert p.next_wakeup(state(0.5, waiting=[a, b], max_num_seqs=4)) == 0.75
    assert p.next_wakeup(state(0.5, running=[a], waiting=[b], max_num_seqs=4)) is None   # a batch runs
    # A batch whose only member left was preempted back to the queue: it continues, no window.
    p.schedule_order(state(0.75, waiting=[a, b], max_num_seqs=4))
    assert p.next_wakeup(state(1.0, waiting=[b, rq("c", arrival=0.875)], max_num_seqs=4)) is None
    # The batch is over (a, b gone): c waits for its own window.
    assert p.next_wakeup(state(1.0, waiting=[rq("c", arrival=0.875)], max_num_seqs=4)) == 1.375


# -- priority ------------------------------------------------------------------------------------
def test_priority_key_is_class_minus_levels_gained_then_arrival():
    p = PriorityPolicy(aging_s=4.0)
    assert p.key(rq("r", arrival=1.0, priority=2), 9.0) == (0.0, 1.0)        # 2 - 8 / 4
    assert p.key(rq("r", arrival=9.5, priority=1), 9.0) == (1.0, 9.5)        # not arrived yet: no boost
    assert PriorityPolicy().key(rq("r", arrival=0.0, priority=1), 30.0) == (0.5, 0.0)   # 60 s a level
    assert PriorityPolicy(aging_s=None).key(rq("r", arrival=0.0, priority=3), 100.0) == (3, 0.0)
    assert PriorityPolicy(aging_s=0).key(rq("r", arrival=0.0, priority=3), 100.0) == (3, 0.0)


def test_priority_order_ages_waiting_requests():
    # aging 4 s a level, now 9: low (class 2, arrived at 0) 2 - 9/4 = -0.25 is ahead of
    # high (class 0, arrived at 8.5) 0 - 0.5/4 = -0.125, even though high is running.
    low, high = rq("low", arrival=0.0, priority=2), rq("high", arrival=8.5, priority=0)
    assert ids(PriorityPolicy(aging_s=4.0).schedule_order(state(9.0, running=[high], waiting=[low]))) == \
        ["low", "high"]
    assert ids(PriorityPolicy(aging_s=None).schedule_order(state(9.0, running=[high], waiting=[low]))) == \
        ["high", "low"]


def test_priority_ranks_running_and_waiting_together_ties_to_the_earlier():
    p = PriorityPolicy(aging_s=None)
    assert p.preemptive is True
    run1 = rq("run1", arrival=0.0, priority=1)
    late0, early0 = rq("late0", arrival=2.0, priority=0), rq("early0", arrival=1.0, priority=0)
    assert ids(p.schedule_order(state(3.0, running=[run1], waiting=[late0, early0]))) == \
        ["early0", "late0", "run1"]


# -- sjf -------------------------------------------------------------------------------------------
def test_sjf_remaining_is_tokens_to_compute_plus_tokens_to_generate():
    p = SJFPolicy()
    assert p.remaining(rq("fresh", prompt=8, max_tokens=5)) == 13
    # 8 + 3 tokens, 10 computed: 1 to compute; 5 - 3 = 2 still to generate.
    assert p.remaining(rq("mid", prompt=8, max_tokens=5, out=3, computed=10)) == 3
    # More generated than predicted: nothing more to generate is counted.
    over = SJFPolicy(predictor=lambda r: 2)
    assert over.remaining(rq("over", prompt=8, max_tokens=50, out=3, computed=10)) == 1


def test_sjf_key_ages_by_tokens_per_second_waited():
    assert SJFPolicy().key(rq("r", prompt=8, max_tokens=100, arrival=1.0), 3.0) == (8.0, 1.0)   # 108 - 50 * 2
    assert SJFPolicy(aging_tokens_per_s=4.0).key(rq("r", prompt=8, max_tokens=8, arrival=1.0), 3.0) == (8.0, 1.0)
    assert SJFPolicy(aging_tokens_per_s=0).key(rq("r", prompt=8, max_tokens=8, arrival=1.0), 3.0) == (16, 1.0)


def test_sjf_aging_bound_newcomers_do_not_overtake_after_s_minus_1_over_rate():
    # x: remaining 1 + 100 = 101, so (101 - 1) / 50 = 2 s. Keys at now t: x 101 - 50 t,
    # z (arrived at 1.0, 2 left) 52 - 50 t, y (arrived at 2.0, 2 left) 102 - 50 t: z stays
    # ahead of x however long they wait, y never gets ahead.
    x = rq("x", prompt=1, max_tokens=100, arrival=0.0)
    z, y = rq("z", prompt=1, max_tokens=1, arrival=1.0), rq("y", prompt=1, max_tokens=1, arrival=2.0)
    for now in (2.0, 10.0):
        assert ids(SJFPolicy().schedule_order(state(now, waiting=[y, x, z]))) == ["z", "x", "y"], now


def test_sjf_predicts_once_per_request_as_an_int():
    calls = []

    def predictor(r):
        calls.append(r.request_id)
        return 2.75

    p = SJFPolicy(predictor=predictor)
    a = rq("a", prompt=8, max_tokens=100)
    assert p.predicted_output(a) == 2 and p.remaining(a) == 10
    assert p.remaining(a) == 10
    assert calls == ["a"]


def test_sjf_orders_running_then_waiting_shortest_first():
    p = SJFPolicy(aging_tokens_per_s=0)
    assert p.preemptive is False
    long_, short = rq("long", prompt=8, max_tokens=92), rq("short", prompt=8, max_tokens=2)
    tiny, tie = rq("tiny", prompt=1, max_tokens=1, arrival=0.5), rq("tie", prompt=1, max_tokens=1, arrival=0.25)
    s = state(1.0, running=[long_, short], waiting=[tiny, tie])
    assert ids(p.schedule_order(s)) == ["short", "long", "tie", "tiny"]
    assert ids(SJFPolicy(aging_tokens_per_s=0, preemptive=True).schedule_order(s)) == \
        ["tie", "tiny", "short", "long"]
    # Aging: at 50 tok/s, 'long' (100 left) who waited 2 s (key 0) passes 'short' (10 left, key 10).
    s = state(2.0, waiting=[rq("short", prompt=8, max_tokens=2, arrival=2.0), rq("long", max_tokens=92)])
    assert ids(SJFPolicy().schedule_order(s)) == ["long", "short"]


# -- mlfq ------------------------------------------------------------------------------------------
def test_mlfq_quanta_double_per_level_the_last_unbounded():
    assert [MLFQPolicy().quantum(i) for i in range(6)] == [4, 8, 16, 32, 64, math.inf]
    assert [MLFQPolicy(num_levels=3, base_quantum=3).quantum(i) for i in range(3)] == [3, 6, math.inf]


def test_mlfq_skip_join_enters_the_first_level_whose_quantum_covers_the_prefill():
    p = MLFQPolicy()          # 128 prompt tokens per iteration; quanta 4, 8, 16, 32, 64, inf
    level = {n: p.skip_join_level(rq("r", prompt=n)) for n in (1, 512, 513, 1024, 1025, 8192, 8193)}
    # ceil(n / 128) = 1, 4, 5, 8, 9, 64, 65 iterations
    assert level == {1: 0, 512: 0, 513: 1, 1024: 1, 1025: 2, 8192: 4, 8193: 5}
    assert MLFQPolicy(prompt_tokens_per_iteration=64).skip_join_level(rq("r", prompt=257)) == 1   # 5 > 4
    by_hundreds = MLFQPolicy(prefill_cost=lambda r: r.num_prompt_tokens / 100)
    assert by_hundreds.skip_join_level(rq("r", prompt=900)) == 2          # 8 < 9 <= 16
    assert by_hundreds.skip_join_level(rq("r", prompt=400)) == 0          # 4 <= 4


def test_mlfq_orders_by_level_then_entry_time_then_arrival():
    p = MLFQPolicy(num_levels=3, base_quantum=2)    # quanta 2, 4, inf; prompts over 256 tokens: level 1+
    late, early = rq("late", arrival=0.75), rq("early", arrival=0.25)
    deep = rq("deep", prompt=300, arrival=0.0)      # ceil(300 / 128) = 3 > 2: level 1
    order = p.schedule_order(state(1.0, running=[deep, late], waiting=[early]))
    assert ids(order) == ["early", "late", "deep"]
    st = early.policy_state
    assert (st["mlfq_level"], st["mlfq_used"], st["mlfq_since"], st["mlfq_served"], st["mlfq_out"]) == \
        (0, 0, 0.25, 0.25, 0)                       # skip-joined as of its arrival
    assert deep.policy_state["mlfq_level"] == 1
    assert p.num_promotions == 0 and p.num_demotions == 0


def test_mlfq_demotes_after_the_levels_quantum_of_generated_tokens():
    p = MLFQPolicy(num_levels=3, base_quantum=2)    # quanta 2, 4, inf
    a = rq("a", arrival=0.0)
    p.schedule_order(state(0.0, waiting=[a]))
    st = a.policy_state
    levels = []
    for t in range(1, 10):                          # one token a step
        a.output_token_ids.append(5)
        p.on_step([(a, 1)], float(t))
        levels.append((st["mlfq_level"], st["mlfq_used"], st["mlfq_since"]))
    assert levels == [(0, 1, 0.0), (1, 0, 2.0),                       # 2 tokens at level 0
                      (1, 1, 2.0), (1, 2, 2.0), (1, 3, 2.0), (2, 0, 6.0),   # 4 at level 1
                      (2, 1, 6.0), (2, 2, 6.0), (2, 3, 6.0)]          # the last level keeps it
    assert p.num_demotions == 2
    assert st["mlfq_served"] == 9.0 and st["mlfq_out"] == 9


def test_mlfq_counts_only_tokens_generated_since_first_sight():
    p = MLFQPolicy(num_levels=3, base_quantum=2)
    a = rq("a", out=3, computed=10)                 # switched in mid-run with 3 tokens generated
    p.schedule_order(state(5.0, running=[a]))
    assert a.policy_state["mlfq_out"] == 3
    a.output_token_ids += [5, 5, 5]                 # a step that produced 3 tokens at once
    p.on_step([(a, 3)], 6.0)
    assert (a.policy_state["mlfq_level"], a.policy_state["mlfq_used"]) == (1, 0) and p.num_demotions == 1


def test_mlfq_on_step_ignores_finished_and_unseen_requests():
    p = MLFQPolicy(num_levels=3, base_quantum=2)
    a, b, c = rq("a", arrival=0.0), rq("b", arrival=0.0), rq("c", arrival=0.0)
    p.schedule_order(state(0.0, waiting=[a, c]))
    a.output_token_ids += [5, 5]
    a.status = RequestStatus.FINISHED_LENGTH
    c.output_token_ids += [5]
    p.on_step([(b, 1), (a, 1), (c, 1)], 1.0)
    assert b.policy_state == {}
    assert (c.policy_state["mlfq_used"], c.policy_state["mlfq_served"]) == (1, 1.0)   # c still counted
    assert (a.policy_state["mlfq_level"], a.policy_state["mlfq_used"], a.policy_state["mlfq_served"]) == (0, 0, 0.0)
    assert p.num_demotions == 0


def test_mlfq_promotes_a_request_unserved_for_starve_limit():
    p = MLFQPolicy(num_levels=3, base_quantum=2, starve_limit_s=4.0)
    a, b = rq("a", arrival=0.0), rq("b", prompt=300, arrival=1.0)   # b skip-joins level 1 as of 1.0
    p.schedule_order(state(1.0, waiting=[a, b]))
    a.output_token_ids += [5, 5]
    p.on_step([(a, 1)], 2.0)                        # a: demoted to level 1 at 2.0
    a.output_token_ids.append(5)
    p.on_step([(a, 1)], 3.0)                        # a: served at 3.0, still level 1
    assert (a.policy_state["mlfq_level"], a.policy_state["mlfq_since"]) == (1, 2.0)
    # b unserved since its arrival at 1.0: exactly 4 s is not more than the limit ...
    assert ids(p.schedule_order(state(5.0, running=[a], waiting=[b]))) == ["b", "a"]
    assert p.num_promotions == 0 and b.policy_state["mlfq_level"] == 1
    # ... 4.5 s is: b goes back to level 0, entering it now.
    assert ids(p.schedule_order(state(5.5, running=[a], waiting=[b]))) == ["b", "a"]
    assert p.num_promotions == 1
    assert (b.policy_state["mlfq_level"], b.policy_state["mlfq_used"], b.policy_state["mlfq_since"],
            b.policy_state["mlfq_served"]) == (0, 0, 5.5, 5.5)
    # a is measured from its last service (3.0), not from entering level 1 (2.0).
    p.schedule_order(state(7.0, running=[a], waiting=[b]))
    assert a.policy_state["mlfq_level"] == 1 and p.num_promotions == 1
    assert ids(p.schedule_order(state(7.5, running=[a], waiting=[b]))) == ["b", "a"]   # level 0: 5.5 < 7.5
    assert p.num_promotions == 2
    assert (a.policy_state["mlfq_level"], a.policy_state["mlfq_used"], a.policy_state["mlfq_since"],
            a.policy_state["mlfq_out"]) == (0, 0, 7.5, 3)


def test_mlfq_default_starve_limit_is_ten_seconds():
    p = MLFQPolicy()                                 # quanta 4, 8, ...: 600 prompt tokens is 5 iterations
    a = rq("a", prompt=600, arrival=0.0)
    p.schedule_order(state(0.0, waiting=[a]))
    assert a.policy_state["mlfq_level"] == 1
    p.schedule_order(state(10.0, waiting=[a]))
    assert a.policy_state["mlfq_level"] == 1
    p.schedule_order(state(10.5, waiting=[a]))
    assert a.policy_state["mlfq_level"] == 0 and p.num_promotions == 1


def test_mlfq_never_promotes_level_zero_and_breaks_ties_by_arrival():
    p = MLFQPolicy(num_levels=3, base_quantum=2, starve_limit_s=4.0)
    a, b = rq("a", prompt=300, arrival=0.5), rq("b", prompt=300, arrival=0.25)   # both level 1
    c = rq("c", arrival=0.0)                                                        # level 0
    p.schedule_order(state(0.5, waiting=[c, a, b]))
    # At 20 s all starve; a and b are promoted at the same time: the earlier arrival first.
    order = p.schedule_order(state(20.0, waiting=[c, a, b]))
    assert ids(order) == ["c", "b", "a"]
    assert p.num_promotions == 2 and c.policy_state["mlfq_since"] == 0.0


# -- fair ------------------------------------------------------------------------------------------
def test_fair_tenant_none_is_default():
    assert tenant_of(rq("r")) == "default"
    assert tenant_of(rq("r", tenant="t")) == "t"


def test_fair_charges_input_once_and_output_double_per_token():
    p = FairPolicy()
    r = rq("r", prompt=8, tenant="a")
    steps = [(4, 0, 4.0),      # a chunk of 4 prompt tokens: 4
             (5, 0, 5.0),      # a chunk of 1: 1
             (8, 1, 10.0),     # the last 3 prompt tokens and the first token: 3 + 2
             (9, 2, 12.0),     # a decode: 2
             (5, 2, 12.0),     # preempted, recomputing: nothing new to charge
             (10, 3, 14.0)]    # the recompute ends and samples one new token: 2
    for computed, out, counter in steps:
        r.num_computed_tokens, r.output_token_ids = computed, [5] * out
        p.on_step([(r, 1)], 0.0)
        assert p.counters == {"a": counter}, (computed, out)
        assert dict(p.served) == {"a": counter}


def test_fair_charges_each_token_once_when_it_sees_only_some_steps():
    """A policy switched in, out and back in meets a request in the middle of its life."""
    r = rq("r", prompt=8, tenant="a")
    first = FairPolicy()
    r.num_computed_tokens, r.output_token_ids = 4, [5] * 3      # recomputing, 3 tokens generated
    first.on_step([(r, 4)], 0.0)
    assert first.counters == {"a": 10.0}                          # 4 prompt tokens + 2 * 3
    # Switched out: r recomputed, generated 2 more tokens and was preempted again. Back in:
    p = FairPolicy()
    charges = []
    for computed, out in [(2, 5),     # recomputing: only the 2 new tokens, 2 * 2
                          (8, 5),     # prompt tokens 4..8, never charged before: 4
                          (13, 6)]:   # recompute done, one new token: 2
        r.num_computed_tokens, r.output_token_ids = computed, [5] * out
        p.on_step([(r, 1)], 1.0)
        charges.append(p.counters["a"])
    assert charges == [4.0, 8.0, 10.0]


def test_fair_weights_the_tokens_and_the_tenants():
    p = FairPolicy(input_weight=0.5, output_weight=3.0, tenant_weights={"a": 4.0})
    ra, rb = rq("ra", prompt=8, tenant="a"), rq("rb", prompt=8)
    ra.num_computed_tokens, ra.output_token_ids = 8, [5]
    rb.num_computed_tokens, rb.output_token_ids = 8, [5]
    p.on_step([(ra, 8), (rb, 8)], 0.0)
    # cost = 0.5 * 8 + 3 * 1 = 7 each; a's counter advances by 7 / 4.
    assert p.counters == {"a": 1.75, "default": 7.0}
    assert dict(p.served) == {"a": 7.0, "default": 7.0}


def test_fair_step_with_nothing_new_charges_nothing_and_skips_only_that_request():
    old = FairPolicy()
    r, s = rq("r", prompt=8, tenant="a"), rq("s", prompt=4, tenant="b")
    r.num_computed_tokens, r.output_token_ids = 8, [5]
    old.on_step([(r, 8)], 0.0)
    # A new policy object (a mid-run switch) sees r recomputing nothing new, then s's prefill.
    p = FairPolicy()
    r.num_computed_tokens = 8
    s.num_computed_tokens = 2
    p.on_step([(r, 0), (s, 2)], 1.0)
    assert p.counters == {"b": 2.0} and dict(p.served) == {"b": 2.0}


def test_fair_lone_new_tenant_starts_at_zero():
    p = FairPolicy()
    a = rq("a1", tenant="a")
    assert p.schedule_order(state(waiting=[a])) == [a]
    assert p.counters == {"a": 0.0}


def test_fair_lifts_a_newly_backlogged_tenant_to_the_smallest_active_counter():
    p = FairPolicy()
    p.counters = {"a": 40.0, "b": 25.0, "z": 1.0}       # z is idle: not active, not counted
    rb = rq("b1", tenant="b", arrival=2.0)
    rx = rq("x1", tenant="x", arrival=1.0)                # running, never charged: no counter
    ra, rc = rq("a1", tenant="a", arrival=0.0), rq("c1", tenant="c", arrival=0.0)
    order = p.schedule_order(state(running=[rb, rx], waiting=[ra, rc]))
    # c (new) is lifted to min(a 40, b 25) = 25; a keeps its 40 (above b's 25).
    assert p.counters == {"a": 40.0, "b": 25.0, "c": 25.0, "z": 1.0}
    assert ids(order) == ["x1", "b1", "c1", "a1"]       # running by arrival; then the smaller counter


def test_fair_admissions_alternate_by_tentative_counters_and_lift_only_on_becoming_backlogged():
    p = FairPolicy()
    a1, a2 = rq("a1", prompt=10, tenant="a", arrival=0.0), rq("a2", prompt=10, tenant="a", arrival=1.0)
    b1, b2 = rq("b1", prompt=10, tenant="b", arrival=0.0), rq("b2", prompt=10, tenant="b", arrival=1.0)
    assert ids(p.schedule_order(state(waiting=[a2, b2, a1, b1]))) == ["a1", "b1", "a2", "b2"]
    assert p.counters == {"a": 0.0, "b": 0.0}
    b1.num_computed_tokens = 5                        # b1 ran a chunk of 5 tokens: b's counter is 5
    p.on_step([(b1, 5)], 1.0)
    a3 = rq("a3", prompt=10, tenant="a", arrival=2.0)
    # Both still backlogged: no lift (a stays 0). a1 first (0), a tentatively at 0 + 10 = 10,
    # so b2 (5) next, then a2, then a3 (tentatively 20).
    order = p.schedule_order(state(running=[b1], waiting=[a2, b2, a1, a3]))
    assert ids(order) == ["b1", "a1", "b2", "a2", "a3"]
    assert p.counters == {"a": 0.0, "b": 5.0}
    # a stops waiting (its requests run), then comes back: lifted to b's counter again.
    p.schedule_order(state(running=[a1, a2, a3], waiting=[b2]))
    p.schedule_order(state(running=[a1, a2, a3], waiting=[rq("a4", tenant="a"), b2]))
    assert p.counters == {"a": 5.0, "b": 5.0}


def test_fair_tentative_advance_counts_tokens_left_and_the_tenant_weight():
    p = FairPolicy(tenant_weights={"a": 2.0})
    a1, a2 = rq("a1", prompt=10, tenant="a", arrival=0.0), rq("a2", prompt=10, tenant="a", arrival=1.0)
    b1, b2 = rq("b1", prompt=10, tenant="b", arrival=0.0), rq("b2", prompt=10, tenant="b", arrival=1.0)
    p.schedule_order(state(waiting=[a1, b1]))
    b1.num_computed_tokens = 4
    p.on_step([(b1, 4)], 1.0)                       # b: 4
    a1.num_computed_tokens = 4                      # swapped out with 4 tokens computed
    # a1 first (0); a's tentative counter: (10 - 4) / 2 = 3 < 4, so a2 before b2. (Unweighted,
    # 6, or counting a1's computed tokens too, 10 / 2 = 5, b2 would come first.)
    assert ids(p.schedule_order(state(running=[b1], waiting=[a1, a2, b2]))) == ["b1", "a1", "a2", "b2"]


# -- lpm -------------------------------------------------------------------------------------------
class FakeKV:
    """A KV manager that reports given cached-prefix lengths (and has a radix tree)."""

    radix = object()

    def __init__(self, cached):
        self.cached = cached

    def cached_prefix_len(self, req):
        return self.cached.get(req.request_id, 0)


def test_lpm_orders_waiting_by_cached_prefix_plus_aging():
    a, b, c = rq("a", arrival=0.0), rq("b", arrival=0.5), rq("c", arrival=0.875)
    d, x = rq("d", arrival=0.5), rq("x", arrival=0.75)
    kv = FakeKV({"b": 64, "c": 16, "d": 50})
    # now 1.0, 100 tokens/s: a 0 + 100, b 64 + 50, c 16 + 12.5, d 50 + 50 (ties a: a arrived first).
    order = LPMPolicy().schedule_order(state(1.0, running=[x], waiting=[c, d, b, a], kv=kv))
    assert ids(order) == ["x", "b", "a", "d", "c"]
    # Without aging: the cached prefix alone.
    order = LPMPolicy(aging_tokens_per_s=0).schedule_order(state(1.0, running=[x], waiting=[c, d, b, a], kv=kv))
    assert ids(order) == ["x", "b", "d", "c", "a"]


def test_lpm_default_aging_is_100_tokens_per_second():
    # A cold request that arrived 2 s earlier scores 200 more for its age: it ranks ahead of
    # a cached prefix of 199 or 200 tokens (a tie: the earlier arrival), not of 201.
    cold, hot = rq("cold", arrival=0.0), rq("hot", arrival=2.0)
    for cached, first in [(201, "hot"), (200, "cold"), (199, "cold")]:
        order = LPMPolicy().schedule_order(state(2.0, waiting=[cold, hot], kv=FakeKV({"hot": cached})))
        assert ids(order)[0] == first, cached


def test_lpm_falls_back_to_fcfs_above_max_queue():
    # now 0.25: hot scores 64 + 0, the cold ones 0 + 25 each (lpm: hot first; fcfs: hot last).
    kv = FakeKV({"hot": 64})
    hot = rq("hot", arrival=0.25)
    cold = [rq(f"c{i}", arrival=0.0) for i in range(2)]
    lpm3 = LPMPolicy(max_queue=3)
    assert ids(lpm3.schedule_order(state(0.25, waiting=[*cold, hot], kv=kv))) == ["hot", "c0", "c1"]
    more = [*cold, hot, rq("late", arrival=0.125)]
    assert ids(lpm3.schedule_order(state(0.25, waiting=more, kv=kv))) == ["c0", "c1", "late", "hot"]
    many = [rq(f"c{i}", arrival=0.0) for i in range(127)]
    assert LPMPolicy().schedule_order(state(0.25, waiting=[*many, hot], kv=kv))[0] is hot       # 128: lpm
    many.append(rq("c127", arrival=0.0))
    assert LPMPolicy().schedule_order(state(0.25, waiting=[*many, hot], kv=kv))[-1] is hot      # 129: fcfs


def test_lpm_is_fcfs_without_a_radix_tree():
    a, b = rq("a", arrival=0.5), rq("b", arrival=0.25)
    assert ids(LPMPolicy().schedule_order(state(1.0, waiting=[a, b], kv=None))) == ["b", "a"]
    no_cache = KVCacheManager(8, 4, enable_prefix_caching=False)
    assert ids(LPMPolicy().schedule_order(state(1.0, waiting=[a, b], kv=no_cache))) == ["b", "a"]


def test_lpm_reads_the_prefix_cache():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    system = list(range(10, 18))                            # two full blocks
    first = Request("first", system, SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    kv.free(first)
    cold = Request("cold", list(range(50, 59)), SamplingParams(max_tokens=4), 0.0)
    warm = Request("warm", system + [99], SamplingParams(max_tokens=4), 0.5)
    assert kv.cached_prefix_len(warm) == 8
    # now 0.5, 100 tokens/s: cold scores 0 + 50, warm 8 + 0; at 10 tokens/s cold scores 5.
    assert ids(LPMPolicy().schedule_order(state(0.5, waiting=[cold, warm], kv=kv))) == ["cold", "warm"]
    assert ids(LPMPolicy(aging_tokens_per_s=10).schedule_order(state(0.5, waiting=[cold, warm], kv=kv))) == \
        ["warm", "cold"]
