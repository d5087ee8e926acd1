"""``minibatch.tune.capacities``: per configuration and seed, the capacity equals a bisection written
out here with ``run`` and ``results.capacity``; every run lasts ``duration_s`` whatever the rate; a
policy instance runs as a fresh copy; the verdict compares the seeds' ranges."""

from __future__ import annotations

import math

import pytest

from minibatch import EngineConfig, LLMEngine, tune
from minibatch.policies.sjf import SJFPolicy
from minibatch.results import CapacityEstimate, capacity
from minibatch.runner import run
from minibatch.workload import load_workload

SLO = {"ttft": 0.5, "tpot": 0.05}
SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}
SEARCH = dict(target=0.9, lo=1.0, hi=12.0, tol=0.2, trim=0.1)


@pytest.fixture(scope="module")
def workloads():
    return {seed: load_workload("chat", n=200, seed=seed) for seed in (1001, 1002)}


def test_workload_at_gives_the_same_seconds_of_traffic_at_every_rate(workloads):
    wl = workloads[1001]
    for rate in (1.0, 2.5, 7.0):
        at = tune.workload_at(wl, rate, duration_s=20.0)
        assert len(at) == math.ceil(rate * 20.0) + 1
        assert at.stats()["duration"] == pytest.approx(20.0) and at.stats()["rate"] == pytest.approx(rate)
        assert [r.prompt_len for r in at] == [r.prompt_len for r in wl][:len(at)]     # a prefix, same lengths
    assert len(tune.workload_at(wl, 3.0)) == len(wl)                  # no duration: the whole workload
    with pytest.raises(ValueError, match="needs 241 requests"):
        tune.workload_at(wl, 12.0, duration_s=20.0)


def test_capacities_equal_a_bisection_per_seed_written_out(workloads):
    configs = [{"max_num_seqs": 8}, {"max_num_seqs": 32, "max_num_batched_tokens": 2048}]
    found = tune.capacities(workloads, configs, SLO, duration_s=15.0, processes=1, **SEARCH, **SIM)
    for c, f in zip(configs, found):
        expected = []
        for seed, wl in workloads.items():
            def attainment(rate, wl=wl):
                n = math.ceil(rate * 15.0) + 1
                return run(wl.slice(0, n).with_rate(rate), **SIM, **c).summary(SLO, trim=0.1)["slo_attainment"]
            expected.append(capacity(attainment, target=0.9, lo=1.0, hi=12.0, tol=0.2))
        assert f.config == c and f.estimate.per_seed == tuple(expected) and f.estimate.seeds == (1001, 1002)
        assert f.runs == sum(len(p) for p in f.probes.values()) >= 2 * 3
    assert found[0].estimate.median < found[1].estimate.median      # 8 sequences serve less than 32
    in_two = tune.capacities(workloads, configs, SLO, duration_s=15.0, processes=2, **SEARCH, **SIM)
    assert [f.estimate for f in in_two] == [f.estimate for f in found]


def test_a_policy_instance_runs_as_a_fresh_copy_on_every_run(workloads):
    policy = SJFPolicy(aging_tokens_per_s=0, prefill_weight=0)
    seeds = {1001: workloads[1001]}
    found = tune.capacities(seeds, [{"policy": policy, "max_num_seqs": 16}], SLO, duration_s=15.0, processes=1,
                            **SEARCH, **SIM)[0]
    for rate, att in found.probes[1001].items():
        engine = LLMEngine(EngineConfig.from_kwargs(**SIM, max_num_seqs=16), clock="virtual")
        engine.scheduler.policy = SJFPolicy(aging_tokens_per_s=0, prefill_weight=0)
        wl = tune.workload_at(workloads[1001], rate, 15.0)
        assert run(wl, engine=engine).summary(SLO, trim=0.1)["slo_attainment"] == att
    assert vars(policy) == vars(SJFPolicy(aging_tokens_per_s=0, prefill_weight=0)), "the caller's policy is untouched"


def test_bad_arguments_are_named_before_any_run(workloads):
    with pytest.raises(ValueError, match="needs an SLO"):
        tune.capacities(workloads, [{}], {}, **SIM)
    with pytest.raises(ValueError, match="lo < hi"):
        tune.capacities(workloads, [{}], SLO, lo=4.0, hi=2.0, **SIM)
    with pytest.raises(ValueError, match="needs 1201 requests"):
        tune.capacities(workloads, [{}], SLO, hi=12.0, duration_s=100.0, **SIM)


def test_verdict_compares_the_seeds_ranges():
    a, b, c = (CapacityEstimate(p, (1, 2, 3)) for p in ((5.0, 5.5, 6.0), (3.0, 4.0, 4.5), (4.2, 4.8, 5.2)))
    assert tune.verdict(a, b) == "higher" and tune.verdict(b, a) == "lower"
    assert tune.verdict(a, c) == "overlap" and tune.verdict(c, b) == "overlap"


def test_a_capacity_sweep_with_duration_s_runs_the_same_seconds_at_every_rate(workloads):
    wl = workloads[1001]
    rates = [2.0, 4.0, 8.0]
    res = tune.sweep(wl, grid={"max_num_seqs": [32]}, slo=SLO, rates=rates, method="grid", duration_s=10.0,
                     processes=1, model=SIM["model"], hardware=SIM["hardware"])
    for rate in rates:
        direct = run(tune.workload_at(wl, rate, 10.0), **SIM, max_num_seqs=32).summary(SLO, trim=0.1)
        assert res.trials[0].probes[rate] == direct["slo_attainment"]
    whole = tune.sweep(wl, grid={"max_num_seqs": [32]}, slo=SLO, rates=[8.0], method="grid", processes=1,
                       model=SIM["model"], hardware=SIM["hardware"])
    assert whole.trials[0].probes[8.0] == run(wl.with_rate(8.0), **SIM, max_num_seqs=32).summary(SLO, trim=0.1)["slo_attainment"]
    with pytest.raises(ValueError, match="needs 801 requests"):
        tune.sweep(wl, grid={"max_num_seqs": [32]}, slo=SLO, rates=[8.0], duration_s=100.0, processes=1)
