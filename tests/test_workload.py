"""Tests for minibatch.workload: arrivals, lengths, specs, reshaping, token ids,
named workloads. Trace loaders are in test_trace_loaders.py."""
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minibatch.workload import (RequestSpec, Workload, empirical, fixed, format_stats_table,
                                from_arrivals, gamma_arrivals, load_workload, lognormal,
                                onoff_arrivals, presets, shared_prefix, synthetic, uniform)


def _cv(t):
    g = np.diff(np.sort(t))
    return g.std() / g.mean()


# --- arrival processes ------------------------------------------------------------

def _mean_tol(burstiness, n):
    """3%, or 4 standard errors of the mean gap when that is wider (CV 2 at 0.25)."""
    return max(0.03, 4 / math.sqrt(burstiness * n))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_mean_and_cv(burstiness):
    n, rate = 20000, 5.0
    t = gamma_arrivals(n, rate, burstiness, seed=7)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and t.size == n
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=_mean_tol(burstiness, n))
    assert _cv(t) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_synthetic_rate_and_cv_via_stats(burstiness):
    s = synthetic(20000, rate=10.0, burstiness=burstiness, seed=3).stats()
    assert s["rate"] == pytest.approx(10.0, rel=_mean_tol(burstiness, 20000))
    assert s["cv"] == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_rate_inf_sends_everything_at_zero():
    w = synthetic(50, rate=float("inf"))
    assert len(w) == 50 and all(r.arrival_time == 0.0 for r in w)
    assert w.stats()["duration"] == 0.0


def test_onoff_arrivals_are_bursty():
    t = onoff_arrivals(5000, rate_on=10.0, mean_on=10.0, mean_off=40.0, seed=1)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert _cv(t) > 3  # Poisson would be 1
    # Long-run rate about rate_on * on-fraction = 2 req/s (loose: few cycles).
    assert 1.0 < (t.size - 1) / t[-1] < 4.0


def test_invalid_arrival_parameters():
    with pytest.raises(ValueError):
        gamma_arrivals(10, 0.0)
    with pytest.raises(ValueError):
        gamma_arrivals(10, 1.0, burstiness=0)
    with pytest.raises(ValueError):
        gamma_arrivals(-1, 1.0)


# --- classes -----------------------------------------------------------------------

def test_priorities_and_tenants_uniform_and_seeded():
    w = synthetic(4000, rate=100, priorities=[0, 1], tenants=["a", "b"], seed=5)
    prios = np.array([r.priority for r in w])
    tenants = [r.tenant for r in w]
    assert set(prios) == {0, 1} and set(tenants) == {"a", "b"}
    assert abs(prios.mean() - 0.5) < 0.04
    assert abs(tenants.count("a") / len(w) - 0.5) < 0.04
    w2 = synthetic(4000, rate=100, priorities=[0, 1], tenants=["a", "b"], seed=5)
    assert [r.priority for r in w2] == list(prios) and [r.tenant for r in w2] == tenants
    assert all(r.priority == 0 and r.tenant is None for r in synthetic(10, 1.0))


def test_weighted_classes():
    w = synthetic(5000, rate=100, tenants={"big": 9, "small": 1}, seed=2)
    share = sum(r.tenant == "big" for r in w) / len(w)
    assert 0.87 < share < 0.93


def test_from_arrivals_uses_the_given_times():
    w = from_arrivals([0.0, 1.0, 1.5], input_len=5, output_len=uniform(1, 3), name="x")
    assert list(w.arrival_times) == [0.0, 1.0, 1.5]
    assert [r.request_id for r in w] == ["x-0", "x-1", "x-2"]
    assert all(r.prompt_len == 5 and 1 <= r.max_tokens <= 3 for r in w)


def test_streams_are_independent():
    # Changing the length distribution must not move the arrivals.
    a = synthetic(100, 2.0, input_len=10, seed=9)
    b = synthetic(100, 2.0, input_len=uniform(5, 500), seed=9)
    assert np.array_equal(a.arrival_times, b.arrival_times)


# --- length distributions ---------------------------------------------------------

def test_fixed_and_uniform():
    rng = np.random.default_rng(0)
    assert np.all(fixed(7).sample(100, rng) == 7)
    x = uniform(3, 9).sample(20000, rng)
    assert x.min() == 3 and x.max() == 9  # both ends included
    assert np.median(x) == 6
    with pytest.raises(ValueError):
        uniform(5, 4)
    with pytest.raises(ValueError):
        fixed(0)


def test_lognormal_median_sigma_and_cap():
    x = lognormal(median=37, sigma=1.0, max=512).sample(50000, np.random.default_rng(1))
    assert x.min() >= 1 and x.max() == 512
    assert np.median(x) == pytest.approx(37, rel=0.03)
    # sigma: p84 / p50 = e^1 before clipping
    assert np.percentile(x, 84.13) / np.median(x) == pytest.approx(math.e, rel=0.05)


def test_lognormal_mean_is_the_mean_of_what_you_get():
    d = lognormal(median=129, mean=211.1, min=7, max=1000)   # Azure conv outputs
    x = d.sample(100000, np.random.default_rng(2))
    assert x.mean() == pytest.approx(211.1, rel=0.02)
    assert np.median(x) == pytest.approx(129, rel=0.02)
    assert x.min() >= 7 and x.max() <= 1000
    # positional (mean, sigma, max): solve for the median
    d2 = lognormal(200, 0.8, 2048)
    assert d2.sample(100000, np.random.default_rng(3)).mean() == pytest.approx(200, rel=0.02)
    assert "lognormal(median=" in repr(d2)


def test_lognormal_needs_two_parameters():
    with pytest.raises(ValueError, match="exactly two"):
        lognormal(median=10)
    with pytest.raises(ValueError, match="exactly two"):
        lognormal(mean=10, median=10, sigma=1)
    with pytest.raises(ValueError):
        lognormal(mean=2000, sigma=1, max=1000)


def test_empirical_resamples_observed_values():
    d = empirical([5, 5, 10, 400])
    x = d.sample(10000, np.random.default_rng(0))
    assert set(np.unique(x)) == {5, 10, 400}
    assert np.median(x) in (5, 7.5, 10)
    with pytest.raises(ValueError):
        empirical([0, 3])


@settings(max_examples=40, deadline=None)
@given(lo=st.integers(1, 5000), width=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1))
def test_lengths_always_in_range(lo, width, seed):
    rng = np.random.default_rng(seed)
    hi = lo + width
    for d in (uniform(lo, hi), lognormal(median=lo + width / 2, sigma=1.2, min=lo, max=hi)):
        x = d.sample(200, rng)
        assert x.dtype == np.int64 and x.min() >= lo and x.max() <= hi


# --- RequestSpec and Workload ---------------------------------------------------------

def _wl(times, name="w"):
    return Workload([RequestSpec(t, 10 + i, 5, request_id=f"r{i}") for i, t in enumerate(times)], name)


def test_request_spec_validation():
    with pytest.raises(ValueError):
        RequestSpec(-1.0, 10, 5)
    with pytest.raises(ValueError):
        RequestSpec(0.0, 0, 5)
    with pytest.raises(ValueError):
        RequestSpec(0.0, 3, 5, prompt_token_ids=[1, 2])
    with pytest.raises(TypeError):
        RequestSpec(0.0, 3.5, 5)


def test_workload_sorts_and_indexes():
    w = _wl([3.0, 1.0, 2.0])
    assert [r.arrival_time for r in w] == [1.0, 2.0, 3.0]
    assert len(w) == 3 and w[0].request_id == "r1" and w[-1].request_id == "r0"
    sub = w[1:]
    assert isinstance(sub, Workload) and sub.name == "w" and sub[0].arrival_time == 2.0


def test_slice_rebases_time():
    w = _wl([0.0, 1.0, 2.5, 4.0])
    s = w.slice(1, 3)
    assert [r.arrival_time for r in s] == [0.0, 1.5]
    assert [r.request_id for r in s] == ["r1", "r2"]
    assert len(w.slice(2)) == 2


def test_time_window():
    w = _wl([0.0, 1.0, 2.5, 4.0, 6.0])
    win = w.time_window(1.0, 4.0)
    assert [r.request_id for r in win] == ["r1", "r2"]
    assert [r.arrival_time for r in win] == [0.0, 1.5]


def test_scale_time_and_with_rate():
    w = synthetic(500, rate=4.0, burstiness=0.5, seed=1)
    slow = w.scale_time(2.0)
    assert slow.stats()["rate"] == pytest.approx(w.stats()["rate"] / 2)
    assert slow.stats()["cv"] == pytest.approx(w.stats()["cv"])
    fast = w.with_rate(10.0)
    assert fast.stats()["rate"] == pytest.approx(10.0)
    assert fast.stats()["cv"] == pytest.approx(w.stats()["cv"])
    assert all(r.arrival_time == 0 for r in w.with_rate(float("inf")))
    with pytest.raises(ValueError):
        _wl([1.0]).with_rate(2.0)


@settings(max_examples=30, deadline=None)
@given(times=st.lists(st.floats(0, 1e4, allow_nan=False), min_size=2, max_size=50),
       rate=st.floats(0.01, 1e3))
def test_with_rate_property(times, rate):
    w = _wl(times)
    if w.stats()["duration"] <= 1e-6:
        return
    assert w.with_rate(rate).stats()["rate"] == pytest.approx(rate, rel=1e-6)
    assert [r.request_id for r in w.with_rate(rate)] == [r.request_id for r in w]


def test_merge_interleaves():
    a, b = _wl([0.0, 2.0], "a"), _wl([1.0, 3.0], "b")
    m = a.merge(b, name="ab")
    assert m.name == "ab" and list(m.arrival_times) == [0.0, 1.0, 2.0, 3.0]


def test_stats_keys_and_table():
    s = synthetic(200, 2.0, input_len=uniform(1, 100), seed=0).stats()
    for k in ("n", "duration", "rate", "cv", "iod_1s", "input_mean", "input_p50", "input_p90",
              "input_p99", "input_max", "output_mean", "output_p50", "output_p99", "output_max"):
        assert k in s
    assert s["n"] == 200 and s["output_p50"] == 128
    assert "| x | 200 |" in format_stats_table({"x": s})
    assert Workload([]).stats()["n"] == 0


# --- token ids -----------------------------------------------------------------------

def test_materialize_deterministic_in_range_and_avoiding_reserved():
    w = synthetic(30, 1.0, input_len=uniform(1, 700), seed=4)
    reserved = [0, 1, 2, 50, 99]
    a = w.materialize(100, seed=3, reserved_ids=reserved)
    b = w.materialize(100, seed=3, reserved_ids=reserved)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    ids = np.concatenate([r.prompt_token_ids for r in a])
    assert ids.min() >= 0 and ids.max() < 100 and not set(reserved) & set(ids.tolist())
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in a)
    c = w.materialize(100, seed=4, reserved_ids=reserved)
    assert [r.prompt_token_ids for r in c] != [r.prompt_token_ids for r in a]
    # Existing ids are kept unless overwrite=True.
    assert a.materialize(50) == a
    assert max(max(r.prompt_token_ids) for r in a.materialize(50, overwrite=True)) < 50


def test_materialize_does_not_depend_on_slicing():
    w = synthetic(20, 1.0, input_len=50, seed=4)
    whole = w.materialize(1000)
    part = w.slice(10).materialize(1000)
    assert [r.prompt_token_ids for r in part] == [r.prompt_token_ids for r in whole[10:]]


def test_shared_prefix_groups_share_first_tokens():
    w = shared_prefix(200, rate=5.0, num_prefixes=3, prefix_len=64, suffix_len=uniform(5, 40),
                      output_len=10, seed=1, vocab_size=5000)
    assert {r.prefix_id for r in w} == {0, 1, 2}
    by_group = {}
    for r in w:
        assert r.prefix_len == 64 and r.prompt_len == 64 + len(r.prompt_token_ids[64:])
        by_group.setdefault(r.prefix_id, []).append(r.prompt_token_ids)
    heads = {g: {tuple(ids[:64]) for ids in v} for g, v in by_group.items()}
    assert all(len(h) == 1 for h in heads.values())          # one prefix per group
    assert len({next(iter(h)) for h in heads.values()}) == 3  # groups differ
    g0 = by_group[0]
    assert g0[0][64:] != g0[1][64:]                          # suffixes are the requests' own


def test_fit_lengths_keeps_sharing_and_fits():
    w = shared_prefix(100, 5.0, num_prefixes=2, prefix_len=900, suffix_len=300, output_len=400)
    f = w.fit_lengths(512)
    assert all(r.prompt_len + r.max_tokens <= 512 for r in f)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in f)
    g = [r for r in f if r.prefix_id == 0]
    k = g[0].prefix_len
    assert k > 0 and len({tuple(r.prompt_token_ids[:k]) for r in g}) == 1
    assert g[0].prompt_token_ids[:k] == [r for r in w if r.prefix_id == 0][0].prompt_token_ids[:k]


# --- named workloads ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(presets))
def test_named_workloads_load_and_are_deterministic(name):
    a, b = load_workload(name, n=300), load_workload(name, n=300)
    assert a == b and len(a) == 300 and a.name == name
    small = load_workload(name, n=100, rate=1.5, max_len=1024)
    assert len(small) == 100 and small.stats()["rate"] == pytest.approx(1.5)
    assert all(r.prompt_len + r.max_tokens <= 1024 for r in small)


def test_named_workload_shapes_follow_their_sources():
    chat = load_workload("chat").stats()
    assert chat["rate"] == pytest.approx(5.53) and 0.95 < chat["cv"] < 1.25
    assert 900 < chat["input_p50"] < 1150 and 110 < chat["output_p50"] < 150
    code = load_workload("code_bursty").stats()
    assert code["rate"] == pytest.approx(2.57) and code["cv"] > 5
    assert 10 <= code["output_p50"] <= 16 and code["input_max"] <= 7437
    rag = load_workload("rag").stats()
    assert rag["input_p50"] > 1500 and rag["output_p50"] < 100


def test_load_workload_errors_and_vocab():
    with pytest.raises(KeyError, match="chat"):
        load_workload("nope")
    w = load_workload("shared_prefix", n=20, max_len=256, vocab_size=300, reserved_ids=[0, 1])
    ids = np.concatenate([r.prompt_token_ids for r in w])
    assert ids.max() < 300 and ids.min() >= 2


DATASETS = Path(__file__).resolve().parents[1] / "datasets" / "workloads"


@pytest.mark.parametrize("name", sorted(presets))
def test_dataset_files_are_what_the_code_generates(name):
    path = DATASETS / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not generated (python datasets/make_workloads.py)")
    assert path.stat().st_size <= 200 * 1024
    from_file = Workload.from_jsonl(path)
    generated = load_workload(name)
    token_seed = generated.meta.get("token_seed")
    if token_seed is not None:  # files leave token ids out; materialize gives them back
        from_file = from_file.materialize(generated.meta["vocab_size"], seed=token_seed)
    assert from_file == generated
