"""A replica that dies mid-run loses no request: what it held is re-dispatched through the router,
recomputed elsewhere, and (real model, greedy) gets the tokens an undisturbed run gives it."""

from __future__ import annotations

import dataclasses

import pytest

from minibatch import cluster
from minibatch.cluster.failures import ReplicaFailure
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.workload import synthetic, uniform
from tests.cluster.helpers import tiny_engine

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=16)


def sim_engines(n, **kw):
    cfg = EngineConfig.from_kwargs(**{**SIM, **kw})
    return [LLMEngine(cfg, clock="virtual") for _ in range(n)]


@pytest.fixture(scope="module")
def workload():
    return synthetic(120, rate=20.0, input_len=uniform(64, 256), output_len=uniform(16, 64), seed=4)


def test_a_dead_replica_loses_no_request_and_gets_none_after_it_died(workload):
    held_at_death = {}

    def watch(index, engine, step):
        if index == 1 and step.start_time + step.duration <= 2.0:
            held_at_death["n"] = len(engine.scheduler.running) + len(engine.scheduler.waiting)

    engines = sim_engines(2)
    res = cluster.run(workload, engines=engines, router="round_robin", failures=[ReplicaFailure(1, 2.0)],
                      on_step=watch)
    assert len({r.request_id for r in res.requests}) == len(res.requests) == len(workload)
    assert all(r.finish_reason == "length" for r in res.requests), "no request is lost"
    assert sorted(r.output_len for r in res.requests) == sorted(s.max_tokens for s in workload)
    log = res.extra["failures"]
    assert len(log) == 1 and log[0]["replica"] == 1 and log[0]["t"] >= 2.0
    assert res.extra["redispatched"] == log[0]["redispatched"] > 0
    assert log[0]["redispatched"] == held_at_death["n"], "everything the dead replica held moved"
    t_dead = log[0]["t"]
    # After its death replica 1 finishes nothing and runs no step; its requests finished on 0.
    assert all(r.finish_time <= t_dead + 1e-9 for r in res.requests if r.replica == 1)
    assert all(s.start_time < t_dead for s in res.replicas[1].steps)
    routed_late = [s for s in workload if s.arrival_time > 2.0]
    assert routed_late and all(r.replica == 0 for r in res.requests if r.arrival_time > 2.0)
    for e in engines:                            # nothing left held anywhere
        e.kv.check_invariants()
        assert e.kv.num_used_blocks == 0


def test_a_failure_costs_the_moved_requests_latency(workload):
    kw = dict(router="least_requests")
    calm = cluster.run(workload, engines=sim_engines(2), **kw)
    hurt = cluster.run(workload, engines=sim_engines(2), failures=[ReplicaFailure(1, 2.0)], **kw)
    by_id = {r.request_id: r for r in calm.requests}
    t_dead = hurt.extra["failures"][0]["t"]
    moved = [r for r in hurt.requests if r.replica == 0 and by_id[r.request_id].replica == 1
             and r.arrival_time < 2.0 and by_id[r.request_id].finish_time > t_dead]
    assert moved
    assert all(r.e2e > by_id[r.request_id].e2e for r in moved)


def test_with_no_live_replica_left_the_held_requests_are_aborted_with_a_reason():
    wl = synthetic(20, rate=50.0, input_len=64, output_len=64, seed=1)
    res = cluster.run(wl, engines=sim_engines(1), failures=[ReplicaFailure(0, 0.1)])
    reasons = {r.finish_reason for r in res.requests}
    assert "abort" in reasons
    assert all(r.error for r in res.requests if r.finish_reason in ("abort", "rejected"))
    assert len(res.requests) == len(wl)


def test_a_failure_after_the_last_step_changes_nothing(workload):
    calm = cluster.run(workload, engines=sim_engines(2))
    late = cluster.run(workload, engines=sim_engines(2), failures=[ReplicaFailure(1, 1e6)])
    assert [dataclasses.astuple(r) for r in late.requests] == [dataclasses.astuple(r) for r in calm.requests]


def test_the_failures_argument_is_checked(workload):
    with pytest.raises(ValueError, match="replica 5"):
        cluster.run(workload, engines=sim_engines(2), failures=[ReplicaFailure(5, 1.0)])
    with pytest.raises(ValueError, match="migration"):
        cluster.run(workload, engines=sim_engines(2), failures=[ReplicaFailure(1, 1.0)], migration=True)
    with pytest.raises(ValueError):
        ReplicaFailure(-1, 1.0)
    with pytest.raises(TypeError):
        cluster.run(workload, engines=sim_engines(2), failures=[(1, 1.0)])


def test_re_dispatched_requests_get_an_undisturbed_runs_greedy_tokens():
    wl = synthetic(8, rate=100.0, input_len=uniform(8, 24), output_len=uniform(8, 16), seed=2)
    engine_kw = dict(max_num_seqs=4, block_size=8, num_kv_blocks=64)
    calm = cluster.run(wl, engines=[tiny_engine(**engine_kw) for _ in range(2)])
    hurt = cluster.run(wl, engines=[tiny_engine(**engine_kw) for _ in range(2)], failures=[ReplicaFailure(1, 0.05)])
    assert hurt.extra["redispatched"] > 0
    assert {r.request_id: r.output_token_ids for r in hurt.requests} == \
        {r.request_id: r.output_token_ids for r in calm.requests}
