"""minibatch.viz.cluster on small simulated cluster runs: each figure draws what the run holds."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from minibatch import cluster
from minibatch.cluster import Autoscaler
from minibatch.viz import cluster as cviz
from minibatch.workload import RequestSpec, Workload, multi_tenant

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


@pytest.fixture(scope="module")
def tenants():
    wl = multi_tenant(60, 20.0, num_tenants=3, system_prompt_len=256, question_len=32, seed=0)
    return cluster.run(wl, replicas=3, router="prefix_aware", **SIM)


def test_replica_load_draws_one_step_line_per_replica_with_its_steps(tenants):
    fig = cviz.replica_load(tenants, "num_running")
    assert isinstance(fig, Figure)
    lines = fig.axes[0].get_lines()
    busy = [r for r in tenants.replicas if r.steps]
    assert len(lines) == len(busy) >= 2
    for line, rep in zip(lines, busy):
        assert list(line.get_xdata()) == [s.start_time for s in rep.steps]
        assert list(line.get_ydata()) == [s.num_running for s in rep.steps]
    with pytest.raises(ValueError, match="metric must be one of"):
        cviz.replica_load(tenants, "tokens")


def test_routing_plots_every_routed_request_and_counts_per_replica(tenants):
    fig = cviz.routing(tenants)
    points = fig.axes[0].collections[0].get_offsets()
    assert len(points) == len(tenants.requests)
    assert sorted(map(tuple, np.asarray(points))) == sorted((r.arrival_time, r.replica) for r in tenants.requests)
    widths = [p.get_width() for p in fig.axes[1].patches]
    assert widths == tenants.summary()["routed"]
    assert "3 tenants" in fig.axes[0].get_title()


def test_replica_count_follows_the_autoscaler():
    specs = [RequestSpec(0.0, 32, 1500, request_id=f"h{i}") for i in range(8)]
    specs += [RequestSpec(k + 0.5, 8, 1, request_id=f"t{k}") for k in range(40)]
    scaler = Autoscaler(min_replicas=1, max_replicas=4, target_ongoing_requests=2, upscale_delay_s=3,
                        downscale_delay_s=5, look_back_period_s=1, cold_start_s=2, interval_s=1)
    res = cluster.run(Workload(specs), router="least_requests", autoscaler=scaler, **SIM)
    fig = cviz.replica_count(res)
    twin = fig.axes[1].get_lines()[0]
    grid, counts = np.asarray(twin.get_xdata()), np.asarray(twin.get_ydata())
    lifetimes = res.extra["lifetimes"]
    assert max(counts) == 4 and counts[0] == 1                 # scaled from min_replicas up to max_replicas
    for t, n in zip(grid[::40], counts[::40]):                 # provisioned = replicas started and not removed
        assert n == sum(1 for a, b in lifetimes if a <= t and (b is None or t < b))


def test_replica_count_without_an_autoscaler_is_flat(tenants):
    counts = cviz.replica_count(tenants).axes[1].get_lines()[0].get_ydata()
    assert set(counts) == {3}


def test_goodput_curve_draws_each_setup_in_rate_order():
    fig = cviz.goodput_curve({"colocated": {2.0: 1.0, 1.0: 0.5}, "1P+3D": {1.0: 0.4, 2.0: 1.2}})
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["colocated", "1P+3D"]
    assert list(lines[0].get_xdata()) == [1.0, 2.0] and list(lines[0].get_ydata()) == [0.5, 1.0]
