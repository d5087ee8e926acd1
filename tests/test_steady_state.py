"""Steady-state measurement: warm-up and drain dropped, throughput inside the window,
and capacity as the highest rate at which enough requests meet the SLO."""

from __future__ import annotations

import pytest

from minibatch.results import RequestRecord, capacity, steady_state, steady_summary
from minibatch.runner import run
from minibatch.workload import synthetic, uniform


def _rec(i, arrival, ttft=0.1, n=5, gap=0.01):
    first = arrival + ttft
    times = [first + k * gap for k in range(n)]
    return RequestRecord(str(i), arrival, 10, n, first_scheduled_time=arrival, first_token_time=first,
                         finish_time=times[-1], token_times=times, finish_reason="length")


def test_steady_state_drops_both_ends_by_arrival():
    recs = [_rec(i, float(i)) for i in range(10)][::-1]
    kept, t0, t1 = steady_state(recs, drop=0.2)
    assert [r.request_id for r in kept] == [str(i) for i in range(2, 8)]
    assert (t0, t1) == (2.0, 7.0)
    with pytest.raises(ValueError):
        steady_state(recs, drop=0.5)


def test_steady_summary_counts_throughput_inside_the_window():
    recs = [_rec(i, float(i), ttft=9.0 if i < 2 else 0.1) for i in range(10)]   # slow warm-up
    s = steady_summary(recs, slo={"ttft": 1.0}, drop=0.2)
    assert s["num_requests"] == 6 and s["slo_attainment"] == 1.0
    assert s["window_s"] == 5.0
    inside = sum(1 for r in recs for t in r.token_times if 2.0 <= t <= 7.0)
    assert s["throughput_tok_s"] == pytest.approx(inside / 5.0)


def test_capacity_is_the_last_rate_before_the_first_miss():
    assert capacity([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.99], target=0.9) == 2
    assert capacity([1, 2], [0.5, 1.0]) is None
    assert capacity([1, 2, 3], [1.0, 1.0, 0.9], target=0.9) == 3


def test_steady_throughput_follows_the_offered_rate_below_saturation():
    wl = synthetic(600, 8.0, input_len=uniform(100, 300), output_len=uniform(50, 150), seed=0)
    r = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
    whole, steady = r.summary(), r.steady_summary()
    assert steady["request_throughput"] == pytest.approx(8.0, rel=0.1)
    assert whole["request_throughput"] < steady["request_throughput"] * 1.05


def test_steady_goodput_never_exceeds_steady_throughput():
    wl = synthetic(300, 6.0, input_len=uniform(100, 800), output_len=uniform(50, 300), seed=1)
    s = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g").steady_summary(slo={"ttft": 0.5, "tpot": 0.05})
    assert s["goodput"] <= s["request_throughput"]
