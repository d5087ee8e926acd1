"""minibatch.workload.predict: the bucketed output-length predictor, the noisy oracle, the
rank statistics, and SJF's prefill weight that chapter 21 ranks with."""

from __future__ import annotations

import numpy as np
import pytest

from minibatch.policies.base import SchedulerState
from minibatch.policies.sjf import SJFPolicy
from minibatch.request import Request
from minibatch.sampling_params import SamplingParams
from minibatch.workload import RequestSpec, Workload
from minibatch.workload.predict import (
    BucketedLengthPredictor,
    NoisyOracle,
    prediction_errors,
    spearman,
)


def rq(rid, prompt=8, max_tokens=8, arrival=0.0) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), arrival)


def test_fit_learns_a_non_monotone_relation_by_bucket():
    # short prompts -> 10 tokens, middle prompts -> 400, long prompts -> 50
    p = np.array([10] * 30 + [500] * 30 + [2000] * 30)
    o = np.array([9, 10, 11] * 10 + [390, 400, 410] * 10 + [49, 50, 51] * 10)
    pred = BucketedLengthPredictor.fit(p, o, num_buckets=3)
    assert len(pred.values) == 3
    assert list(pred.predict([10, 500, 2000])) == [10, 400, 50]
    assert list(pred.predict([1, 100000])) == [10, 50], "outside the training range: the end buckets"


def test_fit_uses_the_quantile_asked_for_and_merges_repeated_cuts():
    p = np.array([100] * 10)          # every cut point equal: one bucket
    o = np.arange(1, 11)
    assert len(BucketedLengthPredictor.fit(p, o, num_buckets=8).values) == 1
    assert BucketedLengthPredictor.fit(p, o, quantile=0.9).values[0] == round(np.quantile(o, 0.9))
    assert BucketedLengthPredictor.fit(p, o, quantile=0.0).values[0] == 1


def test_fit_workload_and_call_on_a_request():
    specs = [RequestSpec(arrival_time=i * 0.1, prompt_len=20 if i % 2 else 900, max_tokens=7 if i % 2 else 300)
             for i in range(40)]
    pred = BucketedLengthPredictor.fit_workload(Workload(specs), num_buckets=2)
    assert pred(rq("a", prompt=20)) == 7 and pred(rq("b", prompt=900)) == 300
    assert isinstance(pred(rq("c", prompt=5)), int)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        BucketedLengthPredictor([10, 5], [1, 2, 3])
    with pytest.raises(ValueError):
        BucketedLengthPredictor([10], [1])
    with pytest.raises(ValueError):
        BucketedLengthPredictor.fit([1, 2], [1])
    with pytest.raises(ValueError):
        BucketedLengthPredictor.fit([1, 2], [1, 2], quantile=2)
    with pytest.raises(ValueError):
        NoisyOracle(-1)
    with pytest.raises(ValueError, match=r"^prefill_weight must be >= 0, got -1$"):
        SJFPolicy(prefill_weight=-1)


def test_noisy_oracle_is_exact_at_zero_and_stable_per_request():
    assert NoisyOracle(0.0)(rq("x", max_tokens=123)) == 123
    noisy = NoisyOracle(1.0, seed=3)
    a = noisy(rq("x", max_tokens=100))
    assert a == noisy(rq("x", max_tokens=100)) == NoisyOracle(1.0, seed=3)(rq("x", max_tokens=100))
    others = {noisy(rq(f"r{i}", max_tokens=100)) for i in range(50)}
    assert len(others) > 10, "different requests get different errors"
    factors = np.log([NoisyOracle(0.5).factor(f"r{i}") for i in range(2000)])
    assert abs(factors.std() - 0.5) < 0.05 and abs(factors.mean()) < 0.05


def test_spearman_handles_ties_and_constants():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([5, 5, 5], [1, 2, 3]) == 0.0
    # ties: ranks (0.5, 0.5, 2) vs (0, 1, 2): Pearson of those
    x, y = np.array([0.5, 0.5, 2]), np.array([0, 1, 2.0])
    expect = np.corrcoef(x, y)[0, 1]
    assert spearman([1, 1, 3], [1, 2, 3]) == pytest.approx(expect)


def test_prediction_errors():
    e = prediction_errors([10, 20, 40], [10, 10, 10])
    assert e["mae"] == pytest.approx(40 / 3)
    assert e["median_factor"] == pytest.approx(2.0)
    assert e["spearman"] == 0.0
    assert prediction_errors([1, 2, 3], [1, 2, 3])["median_factor"] == 1.0


def test_sjf_prefill_weight_zero_ranks_by_output_alone():
    long_prompt_short_out = rq("lp", prompt=1000, max_tokens=5)
    short_prompt_long_out = rq("lo", prompt=10, max_tokens=200)
    st = SchedulerState(0.0, [], [long_prompt_short_out, short_prompt_long_out], 8, 2048, 0.0, None)
    by_tokens = SJFPolicy(aging_tokens_per_s=0)
    by_output = SJFPolicy(aging_tokens_per_s=0, prefill_weight=0.0)
    assert [r.request_id for r in by_tokens.schedule_order(st)] == ["lo", "lp"]
    assert [r.request_id for r in by_output.schedule_order(st)] == ["lp", "lo"]
    assert by_output.remaining(long_prompt_short_out) == 5
    assert SJFPolicy(prefill_weight=0.5).remaining(long_prompt_short_out) == 505


def test_sjf_takes_the_bucketed_predictor():
    pred = BucketedLengthPredictor([100], [300, 20])        # prompts >= 100 predicted short
    p = SJFPolicy(predictor=pred, aging_tokens_per_s=0, prefill_weight=0.0)
    short_prompt, long_prompt = rq("s", prompt=10, max_tokens=5), rq("l", prompt=500, max_tokens=900)
    st = SchedulerState(0.0, [], [short_prompt, long_prompt], 8, 2048, 0.0, None)
    assert [r.request_id for r in p.schedule_order(st)] == ["l", "s"], "it ranks by the prediction, not the truth"
