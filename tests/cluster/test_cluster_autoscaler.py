"""The autoscaler (Ray Serve's rule): exact up/down delays, cold start, draining loses nothing,
replica-seconds by hand, min/max respected (simulator, virtual time)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch import cluster
from minibatch.cluster.autoscaler import Autoscaler
from minibatch.workload import RequestSpec, Workload

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


def test_decide_counts_consecutive_periods_as_ray_serve():
    a = Autoscaler(min_replicas=1, max_replicas=10, target_ongoing_requests=2, upscale_delay_s=3,
                   downscale_delay_s=5, interval_s=1)
    assert a.desired(7) == 4 and a.desired(0) == 1 and a.desired(100) == 10
    # up: the 4th consecutive high decision (counter 4 > int(3 / 1)) moves the target
    assert [a.decide(1, 8) for _ in range(4)] == [1, 1, 1, 4]
    # a flip of direction resets the counter
    a.reset()
    assert [a.decide(1, 8), a.decide(1, 8), a.decide(1, 2), a.decide(1, 8)] == [1, 1, 1, 1]
    a.reset()
    assert [a.decide(4, 0) for _ in range(6)] == [4] * 5 + [1]


def test_slo_rule_adds_one_below_target_and_removes_one_only_when_load_agrees():
    a = Autoscaler(min_replicas=1, max_replicas=5, target_ongoing_requests=4, metric="slo_attainment",
                   slo={"ttft": 1.0}, target_attainment=0.9, look_back_period_s=10)
    assert a.desired_slo(2, 0.5, 100) == 3          # missing the SLO: one more, whatever the load
    assert a.desired_slo(5, 0.5, 100) == 5          # ... up to max_replicas
    assert a.desired_slo(3, 0.95, 8) == 2           # holds, and ceil(8 / 4) = 2 < 3: one fewer
    assert a.desired_slo(3, 0.95, 9) == 3           # holds, but ceil(9 / 4) = 3: stay
    assert a.desired_slo(1, 1.0, 0) == 1            # never below min_replicas
    # attainment: first tokens in the look-back window (10 s), late waiting requests count as misses
    a.reset()
    for when, ttft in [(0.0, 0.5), (5.0, 2.0), (8.0, 0.9), (9.0, 1.0)]:
        a.record_first_token(when, ttft)
    assert a.attainment(9.5) == 3 / 4
    assert a.attainment(9.5, overdue=2) == 3 / 6
    assert a.attainment(12.0) == 2 / 3              # t=0.0 left the window (12 - 10 = 2 > 0)
    assert a.attainment(30.0) == 1.0                # nothing to judge
    with pytest.raises(ValueError, match="slo"):
        Autoscaler(metric="slo_attainment")


def test_slo_metric_scales_up_on_a_backlog_and_back_down_after_it():
    # 24 long requests at t=0 on one replica of max_num_seqs 4: most wait, so they are late for a
    # 0.5 s TTFT SLO before any first token shows; the rule adds replicas, then removes them
    # once the backlog is gone (ongoing 0 wants 1) and attainment holds.
    specs = [RequestSpec(0.0, 32, 400, request_id=f"h{i}") for i in range(24)]
    specs += [RequestSpec(k + 0.5, 8, 1, request_id=f"t{k}") for k in range(60)]
    a = Autoscaler(min_replicas=1, max_replicas=4, target_ongoing_requests=2, upscale_delay_s=1,
                   downscale_delay_s=3, look_back_period_s=2, cold_start_s=0.5, interval_s=0.5,
                   metric="slo_attainment", slo={"ttft": 0.5})
    res = cluster.run(Workload(specs), router="least_requests", autoscaler=a, max_num_seqs=4, **SIM)
    s = res.summary()
    counts = [n for _, n in s["scale_events"]]
    assert max(counts) > 1, s["scale_events"]
    assert counts[-1] == 1, s["scale_events"]
    ups = [n2 - n1 for n1, n2 in zip([1] + counts, counts) if n2 > n1]
    assert ups and all(d == 1 for d in ups)         # one replica at a time
    assert s["completed"] == len(specs)


def heavy_then_trickle(n_heavy=8, out=1500, until=40):
    """``n_heavy`` long requests at t=0, then one one-token request at every k + 0.5 s (so that
    something stays due and the autoscaler keeps deciding after the heavy ones end)."""
    specs = [RequestSpec(0.0, 32, out, request_id=f"h{i}") for i in range(n_heavy)]
    specs += [RequestSpec(k + 0.5, 8, 1, request_id=f"t{k}") for k in range(until)]
    return Workload(specs)


def scaler(**kw):
    base = dict(min_replicas=1, max_replicas=4, target_ongoing_requests=2, upscale_delay_s=3,
                downscale_delay_s=5, look_back_period_s=1, cold_start_s=2, interval_s=1)
    base.update(kw)
    return Autoscaler(**base)


@pytest.fixture(scope="module")
def scaled():
    res = cluster.run(heavy_then_trickle(), router="least_requests", autoscaler=scaler(), **SIM)
    return res, res.summary()


def test_scales_up_after_exactly_the_delay_and_down_after_the_down_delay(scaled):
    res, s = scaled
    # ticks at 1, 2, 3, ...: the first sees 8 ongoing (desired 4) at t=1, so up at 1 + 3
    assert s["scale_events"][0] == (4.0, 4)
    heavy_end = max(r.finish_time for r in res.requests if r.request_id.startswith("h"))
    assert heavy_end < 35
    # the first tick that sees no heavy request left wants 1 replica; 5 s later it scales down
    first_low = math.ceil(heavy_end)
    assert s["scale_events"][1] == (first_low + 5.0, 1)
    assert len(s["scale_events"]) == 2


def test_cold_start_is_respected_and_nothing_is_lost(scaled):
    res, s = scaled
    ready = res.extra["ready_at"]
    assert ready[1:] == [6.0, 6.0, 6.0]            # started at 4, 2 s cold start
    for r in res.requests:
        assert r.arrival_time >= ready[r.replica] - 1e-12, r
    assert sum(s["routed"][1:]) > 0                 # the new replicas did serve
    assert s["completed"] == s["num_requests"] == len(heavy_then_trickle())


def test_replica_seconds_by_hand(scaled):
    res, s = scaled
    end = max(r.finish_time for r in res.requests)
    down = s["scale_events"][1][0]
    lifetimes = res.extra["lifetimes"]
    # replica 0 from t=0 to the end; three replicas from 4 (cold start counted) until drained at
    # the down decision (idle then: the trickle's requests take milliseconds)
    assert lifetimes[0] == (0.0, None)
    assert lifetimes[1:] == [(4.0, down)] * 3
    assert s["replica_seconds"] == pytest.approx(end + 3 * (down - 4.0))
    assert s["replicas"] == 4


def test_a_starting_replica_is_stopped_before_a_running_one_drains():
    # a burst that ends before the new replicas are ready: scale up at 2, down at 4 (cold start 10)
    specs = [RequestSpec(0.0, 32, 300, request_id=f"h{i}") for i in range(6)]
    specs += [RequestSpec(k + 0.5, 8, 1, request_id=f"t{k}") for k in range(12)]
    a = scaler(upscale_delay_s=1, downscale_delay_s=1, cold_start_s=10)
    res = cluster.run(Workload(specs), router="round_robin", autoscaler=a, **SIM)
    s = res.summary()
    ups = [e for e in s["scale_events"] if e[1] > 1]
    assert ups and ups[0] == (2.0, 3)
    assert all(n == 0 for n in s["routed"][1:])                  # never ready, never routed
    for start, removed in res.extra["lifetimes"][1:]:
        assert removed is not None and removed < start + 10       # stopped during its cold start
    assert s["completed"] == len(specs)


request = st.tuples(st.floats(0, 6.0, allow_nan=False), st.integers(1, 100), st.integers(1, 60))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=30), lo=st.integers(1, 2), extra=st.integers(0, 3),
       target=st.sampled_from([0.5, 1, 3]), up=st.sampled_from([0, 0.2, 1]), down=st.sampled_from([0, 0.2, 1]),
       cold=st.sampled_from([0, 0.3, 2]), metric=st.sampled_from(["ongoing_requests", "queue", "kv_usage", "slo_attainment"]),
       router=st.sampled_from(["round_robin", "least_requests", "power_of_two"]), blocks=st.integers(16, 64))
def test_nothing_is_lost_while_scaling_and_bounds_hold(reqs, lo, extra, target, up, down, cold, metric, router,
                                                       blocks):
    specs = [RequestSpec(t, p, o, request_id=f"q{i}") for i, (t, p, o) in enumerate(reqs)]
    if metric == "kv_usage":
        target = min(target, 1) * 0.5
    a = Autoscaler(min_replicas=lo, max_replicas=lo + extra, target_ongoing_requests=target, upscale_delay_s=up,
                   downscale_delay_s=down, look_back_period_s=0.5, cold_start_s=cold, metric=metric,
                   interval_s=0.1, slo={"ttft": 0.05} if metric == "slo_attainment" else None)
    engines = []

    def after_step(index, engine, step):
        engine.kv.check_invariants()
        engines.append(engine)

    res = cluster.run(Workload(specs), router=router, autoscaler=a, on_step=after_step, block_size=8,
                      num_kv_blocks=blocks, max_num_seqs=4, max_model_len=256, **SIM)
    s = res.summary()
    assert sorted(r.request_id for r in res.requests) == sorted(x.request_id for x in specs)
    for r in res.requests:
        assert r.finish_reason == "length", r
        assert r.output_len == next(x.max_tokens for x in specs if x.request_id == r.request_id)
        assert r.arrival_time >= res.extra["ready_at"][r.replica] - 1e-12
        drained = res.extra["drain_at"][r.replica]
        assert drained is None or r.arrival_time < drained + 1e-12
    for _, n in s["scale_events"]:
        assert lo <= n <= lo + extra
    live = [i for i, (_, removed) in enumerate(res.extra["lifetimes"]) if removed is None]
    assert len(live) >= lo
    for (start, removed), ready in zip(res.extra["lifetimes"], res.extra["ready_at"]):
        assert removed is None or removed >= start
        assert ready >= start
    assert s["replica_seconds"] >= 0
