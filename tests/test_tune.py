"""``minibatch.tune``: the sweep's optimum equals a brute force computed here, the Pareto front
holds no dominated point, and the capacity search finds the grid's optimum in fewer runs."""

from __future__ import annotations

import builtins

import pytest

from minibatch import tune
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.workload import load_workload

SLO = {"ttft": 0.5, "tpot": 0.05}
SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}
GRID = {"max_num_seqs": [4, 32], "max_num_batched_tokens": [512, 2048]}
RATES = [1.0, 2.0, 4.0, 8.0]


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", n=40)


def brute_force(workload, rate=None) -> list[tuple[dict, dict]]:
    """Every grid point, run and summarized directly (no minibatch.tune code involved)."""
    out = []
    for seqs in GRID["max_num_seqs"]:
        for tokens in GRID["max_num_batched_tokens"]:
            config = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}
            wl = workload if rate is None else workload.with_rate(rate)
            out.append((config, run(wl, **SIM, **config).summary(SLO, trim=0.1)))
    return out


def test_the_sweep_returns_the_grids_best_and_a_pareto_front(workload):
    res = tune.sweep(workload, grid=GRID, slo=SLO, processes=1)
    brute = brute_force(workload)
    best_config, best = max(brute, key=lambda cs: cs[1]["goodput"])
    assert res.best == best_config and res.best_trial.goodput == best["goodput"]
    assert res.num_runs == res.full_grid_runs == 4 and [t.config for t in res.trials] == [c for c, _ in brute]
    assert [t.latency for t in res.trials] == [s["e2e_p90"] for _, s in brute]
    # The front: no point on it is dominated (>= on goodput and <= on latency, better on one) by
    # any trial, and every trial off it is dominated by a point on it.
    def dominates(a, b):
        return a.goodput >= b.goodput and a.latency <= b.latency and (a.goodput > b.goodput or a.latency < b.latency)

    assert res.pareto and res.best_trial in res.pareto
    for p in res.pareto:
        assert not any(dominates(t, p) for t in res.trials)
    for t in res.trials:
        if t not in res.pareto:
            assert any(dominates(p, t) for p in res.pareto)
    assert "best" in res.table() and "4 simulated runs" in res.table()


def test_the_capacity_search_finds_the_grids_optimum_in_fewer_runs(workload):
    # Brute force: each configuration at each rate; capacity = the highest rate up to which all pass.
    caps = []
    for rate in RATES:
        for i, (config, s) in enumerate(brute_force(workload, rate)):
            if len(caps) <= i:
                caps.append((config, {}))
            caps[i][1][rate] = s["slo_attainment"]
    caps = [(c, capacity(att, target=0.9)) for c, att in caps]
    best_config, best_cap = max(caps, key=lambda cc: cc[1])

    full = tune.sweep(workload, grid=GRID, slo=SLO, processes=1, rates=RATES)
    smart = tune.sweep(workload, grid=GRID, slo=SLO, processes=1, rates=RATES, method="bisect")
    assert [t.capacity for t in full.trials] == [c for _, c in caps]
    assert full.best == smart.best == best_config
    assert full.best_trial.capacity == smart.best_trial.capacity == best_cap > 0
    assert full.num_runs == full.full_grid_runs == smart.full_grid_runs == len(RATES) * 4
    assert smart.num_runs < full.num_runs
    assert sum(t.runs for t in smart.trials) == smart.num_runs
    assert all(t.capacity <= best_cap for t in smart.trials if not t.pruned)


def test_local_processes_give_the_same_result_as_one_process(workload):
    grid = {"max_num_seqs": [4, 32]}
    one = tune.sweep(workload, grid=grid, slo=SLO, processes=1)
    two = tune.sweep(workload, grid=grid, slo=SLO, processes=2)
    assert [(t.config, t.goodput, t.latency) for t in one.trials] == \
        [(t.config, t.goodput, t.latency) for t in two.trials]


def test_bad_sweeps_are_refused_before_any_run(workload):
    with pytest.raises(ValueError, match="SLO"):
        tune.sweep(workload, grid=GRID)
    with pytest.raises(ValueError, match="rates"):
        tune.sweep(workload, grid=GRID, slo=SLO, method="bisect")
    with pytest.raises(ValueError, match="max_num_sqs"):
        tune.sweep(workload, grid={"max_num_sqs": [1]}, slo=SLO)
    with pytest.raises(ValueError, match="policy"):
        tune.sweep(workload, grid={"policy": ["no-such-policy"]}, slo=SLO)


def test_a_ray_address_without_ray_is_a_clear_error(workload, monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(RuntimeError, match="Ray is not installed"):
        tune.sweep(workload, grid={"max_num_seqs": [4]}, slo=SLO, ray_address="auto")


def test_the_capacity_search_in_parallel_batches_finds_the_same_optimum(workload):
    # Configurations searched 2 at a time, each batch pruned against the batches before it.
    grid = {"max_num_seqs": [4, 32, 64]}
    full = tune.sweep(workload, grid=grid, slo=SLO, processes=1, rates=RATES)
    smart = tune.sweep(workload, grid=grid, slo=SLO, processes=2, rates=RATES, method="bisect")
    assert smart.best == full.best and smart.best_trial.capacity == full.best_trial.capacity
    assert smart.num_runs < full.num_runs == 3 * len(RATES)


def test_a_list_of_grids_is_the_union_of_their_products_in_order(workload):
    # max_wait_ms means something only to the dynamic policy: its own grid, not a factor of every other.
    grids = [{"max_num_seqs": [4, 32]}, {"policy": ["dynamic"], "max_wait_ms": [0.0, 50.0]}]
    assert tune.grid_configs(grids) == [{"max_num_seqs": 4}, {"max_num_seqs": 32},
                                        {"policy": "dynamic", "max_wait_ms": 0.0},
                                        {"policy": "dynamic", "max_wait_ms": 50.0}]
    res = tune.sweep(workload, grid=grids, slo=SLO, processes=1)
    brute = [run(workload, **SIM, **c).summary(SLO, trim=0.1)["goodput"] for c in tune.grid_configs(grids)]
    assert [t.goodput for t in res.trials] == brute and res.num_runs == 4
    assert res.best_trial.goodput == max(brute)
    lines = res.table().splitlines()
    assert lines[0].split()[:3] == ["max_num_seqs", "policy", "max_wait_ms"]   # every knob of every grid
    assert lines[1].split()[:3] == ["4", "-", "-"] and lines[3].split()[:3] == ["-", "dynamic", "0.0"]
    for bad in ([], [{"max_num_seqs": [4]}, "max_wait_ms"]):
        with pytest.raises(ValueError, match="list of dicts"):
            tune.grid_configs(bad)


def test_summaries_are_the_runs_summaries_in_order_in_processes_too(workload):
    jobs = [(workload, {**SIM, "max_num_seqs": 4}), (workload.with_rate(2.0), {**SIM, "preset": "tgi"}),
            (workload, {**SIM, "max_num_batched_tokens": 512})]
    direct = [run(wl, **kw).summary(SLO, trim=0.1) for wl, kw in jobs]
    assert tune.summaries(jobs, slo=SLO, processes=1) == direct
    assert tune.summaries(jobs, slo=SLO, processes=2) == direct
    assert tune.summaries(jobs[:1], processes=1)[0] == run(workload, **jobs[0][1]).summary(trim=0.1)
