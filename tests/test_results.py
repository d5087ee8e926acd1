"""Steady-state summaries and capacity (minibatch.results)."""

from __future__ import annotations

import pytest

from minibatch.results import RequestRecord, capacity, percentiles, steady_state, steady_window, summarize


def _rec(i: float, ttft: float) -> RequestRecord:
    """A request arriving at ``i`` with two tokens, the first ``ttft`` after arrival."""
    return RequestRecord(f"r{i}", arrival_time=float(i), prompt_len=8, output_len=2, first_scheduled_time=i,
                         first_token_time=i + ttft, finish_time=i + ttft + 0.1,
                         token_times=[i + ttft, i + ttft + 0.1], finish_reason="length")


def test_steady_state_keeps_the_middle_of_the_arrival_span():
    recs = [_rec(i, 0.5) for i in range(11)]            # arrivals 0, 1, ..., 10
    assert steady_window(recs, 0.1) == pytest.approx((1.0, 9.0))
    assert [r.arrival_time for r in steady_state(recs)] == [float(i) for i in range(1, 10)]
    assert steady_state(recs, 0.0) == recs
    assert steady_state([]) == []
    with pytest.raises(ValueError):
        steady_state(recs, 0.5)


def test_trimmed_summary_counts_goodput_per_second_of_the_window():
    # The warm-up request (t=0) is fast, the drain (t=10) too; the middle ones are slow except two.
    recs = [_rec(i, 0.2 if i in (0, 10, 4, 6) else 3.0) for i in range(11)]
    slo = {"ttft": 1.0}
    full = summarize(recs, slo=slo)
    steady = summarize(recs, slo=slo, trim=0.1)
    assert full["num_requests"] == 11 and steady["num_requests"] == 9
    assert full["slo_attainment"] == pytest.approx(4 / 11)
    assert steady["slo_attainment"] == pytest.approx(2 / 9)    # the fast ends no longer count
    assert steady["goodput"] == pytest.approx(2 / 8.0)          # 2 good requests over the window [1, 9]
    assert summarize(recs, slo=slo, trim=0.0) == full


def test_capacity_is_the_highest_rate_meeting_the_target():
    def knee(at):
        return lambda rate: 1.0 if rate <= at else 0.5

    c = capacity(knee(3.3), target=0.9, lo=0.5, hi=16.0, tol=0.01)
    assert 3.3 * 0.99 <= c <= 3.3
    assert capacity(knee(0.1), lo=0.5) == 0.0                   # even the lowest rate fails
    assert capacity(knee(100.0), hi=16.0) == 16.0               # the highest rate still meets it
    with pytest.raises(ValueError):
        capacity(knee(1.0), lo=2.0, hi=1.0)


def test_run_summary_trim_on_a_simulated_run():
    from minibatch.runner import run
    from minibatch.workload import fixed, synthetic

    res = run(synthetic(50, 10.0, input_len=fixed(64), output_len=fixed(8), seed=0),
              executor="sim", model="llama-2-7b", hardware="a100-80g")
    lo, hi = steady_window(res.requests)
    s = res.summary(slo={"ttft": 1.0}, trim=0.1)
    assert s["num_requests"] == sum(1 for r in res.requests if lo <= r.arrival_time <= hi) < 50
    assert s["slo_attainment"] == 1.0
    assert s["num_steps"] == sum(1 for st in res.steps if lo <= st.start_time <= hi)


def _run_rec(i, arrival, ttft=0.1, n=5, gap=0.01):
    first = arrival + ttft
    times = [first + k * gap for k in range(n)]
    return RequestRecord(str(i), arrival, 10, n, first_scheduled_time=arrival, first_token_time=first,
                         finish_time=times[-1], token_times=times, finish_reason="length")


def test_trimmed_summary_counts_throughput_inside_the_window():
    # arrivals 0..9, window [1.8, 7.2] at trim=0.2; the two first are slow (warm-up).
    recs = [_run_rec(i, float(i), ttft=9.0 if i < 2 else 0.1) for i in range(10)]
    s = summarize(recs, slo={"ttft": 1.0}, trim=0.2)
    assert s["num_requests"] == 6 and s["slo_attainment"] == 1.0        # arrivals 2..7
    assert s["window_s"] == pytest.approx(5.4)
    # tokens inside [1.8, 7.2]: requests 2..7, 5 each (i + 0.1 .. i + 0.14); requests 0 and 1
    # (slow: tokens from 9.0 and 10.0) and 8, 9 (after the window) have none inside.
    assert s["throughput_tok_s"] == pytest.approx(30 / 5.4)
    # finished inside: requests 2..7 (finish i + 0.14); all meet the TTFT bound
    assert s["request_throughput"] == pytest.approx(6 / 5.4)
    assert s["goodput"] == pytest.approx(6 / 5.4)
    # a slow request 3 still finishes inside the window but misses the bound: goodput drops, throughput does not
    recs[3] = _run_rec(3, 3.0, ttft=2.0)
    s = summarize(recs, slo={"ttft": 1.0}, trim=0.2)
    assert s["request_throughput"] == pytest.approx(6 / 5.4) and s["goodput"] == pytest.approx(5 / 5.4)


def test_capacity_over_a_sweep_is_the_last_rate_before_the_first_miss():
    assert capacity({1: 1.0, 2: 0.95, 4: 0.85, 8: 0.99}, target=0.9) == 2
    assert capacity({2: 1.0, 1: 0.5}) == 0.0                            # ordered by rate: the lowest misses
    assert capacity({1: 1.0, 2: 1.0, 3: 0.9}, target=0.9) == 3


def test_steady_throughput_follows_the_offered_rate_below_saturation():
    from minibatch.runner import run
    from minibatch.workload import synthetic, uniform

    wl = synthetic(600, 8.0, input_len=uniform(100, 300), output_len=uniform(50, 150), seed=0)
    r = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
    whole, steady = r.summary(), r.summary(trim=0.2)
    assert steady["request_throughput"] == pytest.approx(8.0, rel=0.1)
    assert whole["request_throughput"] < steady["request_throughput"] * 1.05


def test_steady_goodput_never_exceeds_steady_throughput():
    from minibatch.runner import run
    from minibatch.workload import synthetic, uniform

    wl = synthetic(300, 6.0, input_len=uniform(100, 800), output_len=uniform(50, 300), seed=1)
    s = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g").summary(slo={"ttft": 0.5, "tpot": 0.05},
                                                                                  trim=0.2)
    assert s["goodput"] <= s["request_throughput"]


def test_capacity_defaults_and_edges_of_the_bisection():
    def knee(at, good=1.0):
        return lambda rate: good if rate <= at else 0.0

    # defaults lo=0.5, hi=16, tol=0.05: a knee at 1.0 is found within 5% below it
    c = capacity(knee(1.0))
    assert 1.0 / 1.05 <= c <= 1.0
    assert capacity(knee(0.49)) == 0.0 and capacity(knee(16.0)) == 16.0
    # an attainment equal to the target meets it, at lo, at hi and in the middle
    assert capacity(lambda r: 0.9, target=0.9) == 16.0
    c = capacity(knee(3.0, good=0.9), target=0.9, tol=0.01)
    assert 3.0 * 0.99 <= c <= 3.0
    # the bracket [4, 16]: mid 8 meets a knee at 10 (lo = 8), mid sqrt(128) = 11.3 misses (hi = 11.3);
    # 11.3 - 8 <= tol * lo = 4, so the search stops and answers 8 exactly
    assert capacity(knee(10.0), lo=4.0, hi=16.0, tol=0.5) == 8.0
    # a bracket already as narrow as tol * lo (0.75 - 0.5 == 0.5 * 0.5) is not bisected further
    assert capacity(knee(0.7), lo=0.5, hi=0.75, tol=0.5) == 0.5
    for lo, hi in ((0.0, 1.0), (1.0, 1.0), (-1.0, 2.0)):
        with pytest.raises(ValueError, match=r"need 0 < lo < hi, got lo="):
            capacity(knee(1.0), lo=lo, hi=hi)


def test_steady_window_trims_a_share_of_the_span_away_from_zero():
    # arrivals 10, 15, 20: span 10, trim 0.1 cuts 1.0 at each end -> (11.0, 19.0). With the
    # first arrival away from 0, (t1 - t0) = 10 and (t1 + t0) = 30 give different windows.
    recs = [_rec(t, 0.5) for t in (10.0, 15.0, 20.0)]
    assert steady_window(recs, 0.1) == pytest.approx((11.0, 19.0))
    assert steady_window(recs, 0.25) == pytest.approx((12.5, 17.5))
    assert steady_window(recs, 0.0) == (10.0, 20.0)


def test_steady_window_of_no_records_is_empty_at_zero():
    assert steady_window([], 0.1) == (0.0, 0.0)
    s = summarize([], trim=0.1)
    assert s["window_s"] == 0.0 and s["num_requests"] == 0


@pytest.mark.parametrize("trim", [-0.1, 0.5, 0.7])
def test_steady_window_refuses_a_trim_outside_its_range_by_name(trim):
    with pytest.raises(ValueError, match=r"^trim must be in \[0, 0\.5\), got "):
        steady_window([_rec(0.0, 0.5)], trim)


def _at(rid, arrival, prompt_len, token_times):
    """A completed request whose tokens came at ``token_times``; it finished with its last token."""
    return RequestRecord(rid, arrival, prompt_len, len(token_times), first_scheduled_time=arrival,
                         first_token_time=token_times[0], finish_time=token_times[-1],
                         token_times=list(token_times), finish_reason="length")


def test_the_steady_window_includes_both_its_ends():
    from minibatch.timeline import StepRecord

    # arrivals 0..8, trim 0.25: the window is [2.0, 6.0] exactly (0.25 * 8 = 2 in binary floats)
    recs = [_at("a", 0.0, 10, [2.0, 3.0]),     # first token at t0, finishes inside
            _at("b", 8.0, 20, [8.5, 9.0]),     # everything after the window
            _at("c", 4.0, 30, [6.0]),          # first and only token, and its finish, at t1
            _at("d", 1.0, 40, [1.5, 2.0])]     # first token before t0, its last token and finish at t0
    steps = [StepRecord(i, t, 0.5, 0.5, 1, 0, 1, 0, 1, 0, 1, 0, 1, 8)
             for i, t in enumerate((1.0, 2.0, 6.0, 7.0))]
    s = summarize(recs, steps, trim=0.25)
    assert s["window_s"] == 4.0
    assert s["num_steps"] == 2                                  # the steps starting at 2.0 and at 6.0
    # finished in [2, 6]: a (3.0), c (6.0), d (2.0)
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    # tokens in [2, 6]: a's 2.0 and 3.0, c's 6.0, d's 2.0
    assert s["throughput_tok_s"] == pytest.approx(4 / 4.0)
    # prompts counted with their first token in [2, 6]: a (10 tokens, at 2.0) and c (30, at 6.0)
    assert s["total_throughput_tok_s"] == pytest.approx((4 + 10 + 30) / 4.0)


def test_a_steady_window_of_no_width_has_no_throughput():
    recs = [_at("a", 1.0, 10, [1.5, 2.0]), _at("b", 1.0, 10, [1.6])]    # one arrival time: window [1, 1]
    s = summarize(recs, slo={"ttft": 1.0}, trim=0.1)
    assert s["window_s"] == 0.0 and s["num_requests"] == 2
    assert (s["request_throughput"], s["throughput_tok_s"], s["total_throughput_tok_s"]) == (0.0, 0.0, 0.0)
    assert s["goodput"] == 0.0 and s["slo_attainment"] == 1.0


def test_a_steady_window_shorter_than_a_second_still_counts_per_second():
    # arrivals 0, 0.5, 1, trim 0.25: the window is [0.25, 0.75], 0.5 s wide
    recs = [_at("a", 0.0, 10, [0.5]), _at("c", 0.5, 20, [0.6]), _at("b", 1.0, 40, [1.5])]
    s = summarize(recs, slo={"ttft": 1.0}, trim=0.25)
    assert s["window_s"] == 0.5
    assert s["request_throughput"] == pytest.approx(2 / 0.5)          # a and c finished inside
    assert s["throughput_tok_s"] == pytest.approx(2 / 0.5)            # their one token each
    assert s["total_throughput_tok_s"] == pytest.approx((2 + 10 + 20) / 0.5)
    assert s["goodput"] == pytest.approx(2 / 0.5)                     # both met ttft <= 1 s


def test_a_summary_with_nothing_completed_is_nan_without_numpy_warnings():
    import math
    import warnings

    aborted = RequestRecord("x", 0.0, 8, 0, finish_time=1.0, finish_reason="abort")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # numpy's "Mean of empty slice" would raise
        s = summarize([aborted])
    assert s["completed"] == 0 and s["failed"] == 1
    assert math.isnan(s["ttft_mean"]) and math.isnan(s["e2e_p50"])


def test_kv_means_are_weighted_by_step_duration_even_under_a_second():
    from minibatch.timeline import StepRecord

    # a 0.25 s step with the pool empty, a 0.75 s step with it full: time-weighted 0.75 (unweighted 0.5)
    steps = [StepRecord(0, 0.0, 0.25, 0.25, 1, 0, 1, 0, 1, 0, 1, 0, 0, 8),
             StepRecord(1, 0.25, 0.75, 0.75, 1, 0, 1, 0, 1, 0, 1, 0, 8, 8)]
    s = summarize([], steps)
    assert s["kv_util_mean"] == pytest.approx(0.75) and s["kv_util_max"] == 1.0


def test_percentiles_read_their_values_as_floats():
    # booleans as 0/1, sorted [0, 0, 1, 1]: the median (index 1.5) is halfway between 0 and 1; p90 (index
    # 0.9 * 3 = 2.7) lies between two 1s. Numeric strings are read as their numbers, None is left out.
    assert percentiles([True, False, True, False], ps=(50, 90)) == pytest.approx({50: 0.5, 90: 1.0})
    assert percentiles(["0.1", "0.3", None], ps=(50,)) == pytest.approx({50: 0.2})


def test_capacity_over_seeds_bisects_each_seed_and_reports_median_and_spread():
    from minibatch.results import capacity_over_seeds

    knees = {1: 2.0, 2: 4.0, 3: 3.0}
    calls = []

    def attainment(rate, seed):
        calls.append(seed)
        return 1.0 if rate <= knees[seed] else 0.0

    est = capacity_over_seeds(attainment, seeds=[1, 2, 3], target=0.9, lo=0.5, hi=16.0, tol=0.01)
    assert set(calls) == {1, 2, 3}
    assert [round(c, 1) for c in est.per_seed] == [2.0, 4.0, 3.0]
    assert abs(est.median - 3.0) < 0.05 and abs(est.lo - 2.0) < 0.05 and abs(est.hi - 4.0) < 0.05
    assert abs(est.spread - 2.0 / 3.0) < 0.03
    assert f"{est:.1f}" == "3.0 (2.0–4.0)"
    with pytest.raises(ValueError):
        capacity_over_seeds(attainment, seeds=[])
