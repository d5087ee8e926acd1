"""minibatch.cluster.run: one replica is minibatch.run; N replicas keep their own time; nothing is lost."""

from __future__ import annotations

import pytest

from minibatch import cluster, run
from minibatch.workload import RequestSpec, Workload, synthetic, uniform
from tests.cluster.helpers import record_dicts, tiny_engine

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


def _workload(n=30, seed=0, rate=8.0):
    return synthetic(n, rate=rate, input_len=uniform(8, 40), output_len=uniform(2, 12), seed=seed)


@pytest.mark.parametrize("kw", [{}, {"enable_prefix_caching": True, "num_kv_blocks": 40},
                                {"policy": "dynamic", "max_wait_ms": 30.0, "max_num_seqs": 4}])
def test_one_replica_equals_minibatch_run_in_the_simulator(kw):
    wl = _workload(40)
    single = run(wl, **SIM, **kw)
    one = cluster.run(wl, replicas=1, **SIM, **kw)
    assert record_dicts(one.requests) == record_dicts(single.requests)
    assert one.replicas[0].steps == single.steps
    assert all(r.replica == 0 for r in one.requests)
    s, c = single.summary(), one.summary()
    assert {k: v for k, v in c.items() if k in s} == s
    assert c["replicas"] == 1 and c["routed"] == [40]


def test_one_replica_equals_minibatch_run_with_the_tiny_model():
    wl = _workload(10, seed=3)
    single = run(wl, engine=tiny_engine(max_num_seqs=4, num_kv_blocks=128))
    one = cluster.run(wl, engines=[tiny_engine(max_num_seqs=4, num_kv_blocks=128)])
    assert record_dicts(one.requests) == record_dicts(single.requests)    # token ids and times
    assert all(r.output_token_ids for r in one.requests)
    assert one.replicas[0].steps == single.steps


def test_replicas_do_not_share_time():
    """Two replicas, serial engines, 2k identical requests at t=0, round robin: each replica
    serves k of them in exactly the time one engine takes for k, half what one takes for 2k."""
    k = 6
    wl = Workload([RequestSpec(0.0, 32, 8, request_id=f"q{i}") for i in range(2 * k)])
    kw = dict(SIM, policy="serial")
    two = cluster.run(wl, replicas=2, router="round_robin", **kw)
    half = run(Workload(list(wl)[:k]), **kw)
    whole = run(wl, **kw)
    assert two.summary()["routed"] == [k, k]
    d_two, d_half, d_whole = (x.summary()["duration_s"] for x in (two, half, whole))
    assert d_two == pytest.approx(d_half, rel=1e-12)
    assert d_whole == pytest.approx(2 * d_half, rel=1e-9)
    for rep in two.replicas:                  # each replica is a copy of the single engine on k requests
        assert [r.finish_time for r in rep.requests] == pytest.approx([r.finish_time for r in half.requests])
    # Each replica's steps start when its own last step ended, whatever the other did.
    for rep in two.replicas:
        for a, b in zip(rep.steps, rep.steps[1:]):
            assert b.start_time == pytest.approx(a.start_time + a.duration)


def test_arrivals_are_routed_in_time_order_and_never_served_before_they_arrive():
    wl = _workload(60, rate=40.0)
    res = cluster.run(wl, replicas=3, router="round_robin", **SIM)
    assert [r.arrival_time for r in res.requests] == sorted(r.arrival_time for r in res.requests)
    assert [r.replica for r in res.requests] == [i % 3 for i in range(60)]
    for r in res.requests:
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time


def test_no_request_is_lost():
    """Finished, or rejected with a reason: too long for the engine, or a model nobody serves."""
    reqs = [RequestSpec(0.01 * i, 20, 4, request_id=f"ok{i}") for i in range(8)]
    reqs += [RequestSpec(0.02, 5000, 4, request_id="too-long"),
             RequestSpec(0.03, 20, 4, request_id="nobody", model="no-such-model")]
    res = cluster.run(Workload(reqs), replicas=2, max_model_len=256, **SIM)
    by_id = {r.request_id: r for r in res.requests}
    assert len(by_id) == len(reqs) == len(res.requests)
    for r in res.requests:
        assert r.finish_reason in ("length", "stop", "rejected")
        if r.finish_reason == "rejected":
            assert r.error
    assert by_id["too-long"].finish_reason == "rejected" and "max_model_len" in by_id["too-long"].error
    assert by_id["too-long"].replica is not None
    assert by_id["nobody"].replica is None and "no-such-model" in by_id["nobody"].error
    s = res.summary()
    assert s["num_requests"] == 10 and s["completed"] == 8 and s["rejected"] == 2
    assert sum(s["routed"]) == 9
    assert s["migrations"] == 0 and s["kv_transfer_bytes"] == 0 and s["scale_events"] == []


def test_summary_counts_replica_seconds():
    wl = _workload(20)
    res = cluster.run(wl, replicas=2, **SIM)
    s = res.summary()
    last = max(st.start_time + st.duration for st in res.steps)
    assert s["replica_seconds"] == pytest.approx(2 * (last - wl[0].arrival_time))
    assert 0 < s["busy_replica_seconds"] <= s["replica_seconds"]


def test_a_router_sees_a_busy_replica_as_its_step_started_plus_what_it_routed_since():
    from minibatch.cluster.routers import Router

    class Spy(Router):
        name = "spy"

        def __init__(self):
            self.seen = []

        def choose(self, request, replicas, now):
            self.seen.append((now, replicas[0]))
            return 0

    spy = Spy()
    # a at 0 (a long prompt: its first step takes a while); b and c arrive during that step
    wl = Workload([RequestSpec(0.0, 2000, 4, request_id="a"), RequestSpec(0.001, 100, 4, request_id="b"),
                   RequestSpec(0.002, 50, 4, request_id="c")])
    res = cluster.run(wl, replicas=1, router=spy, **SIM)
    first = res.replicas[0].steps[0]
    assert first.start_time == 0.0 and first.duration > 0.002       # b and c arrive while it runs
    (_, va), (_, vb), (_, vc) = spy.seen
    assert (va.num_running, va.num_waiting, va.in_flight_tokens) == (0, 0, 0)
    # When the step started, a was waiting and nothing was running or held in KV.
    assert (vb.num_running, vb.num_waiting, vb.kv_blocks_used, vb.in_flight_tokens) == (0, 1, 0, 2000)
    assert (vc.num_running, vc.num_waiting, vc.in_flight_tokens) == (0, 2, 2100)
    assert vc.active_blocks == -(-2000 // vc.block_size) + -(-100 // vc.block_size)
    assert [v.num_routed for _, v in spy.seen] == [0, 1, 2]
