"""minibatch.sim.fitted: NNLS recovers known step-time coefficients and round-trips."""

import json
import random

import numpy as np
import pytest

from minibatch.sim import FittedCostModel, load_cost_model, make_cost_model, nnls
from minibatch.sim.fitted import feature_vector

TRUE = {"const": 2e-3, "prefill_tokens": 5e-5, "prefill_attn": 2e-9, "decode_seqs": 3e-4,
        "decode_ctx": 1e-7, "num_seqs": 1e-4}


def synthetic_samples(n=200, noise=0.0, seed=0):
    rng = random.Random(seed)
    coef = np.array(list(TRUE.values()))
    out = []
    for _ in range(n):
        prefill = [(new, new + rng.choice([0, 0, rng.randint(0, 1024)]))
                   for new in (rng.randint(1, 512) for _ in range(rng.randint(0, 3)))]
        decode = [rng.randint(1, 2048) for _ in range(rng.randint(0 if prefill else 1, 32))]
        t = float(feature_vector(prefill, decode) @ coef) * (1 + rng.gauss(0, noise))
        out.append({"prefill": prefill, "decode": decode, "time_s": t})
    return out


def test_recovers_known_coefficients():
    fit = FittedCostModel.fit(synthetic_samples())
    for name, value in TRUE.items():
        assert fit.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.mean_rel_error < 1e-9


def test_noisy_fit_is_close_and_nonnegative():
    fit = FittedCostModel.fit(synthetic_samples(n=400, noise=0.02, seed=1))
    assert all(c >= 0 for c in fit.coefficients.values())
    assert fit.coefficients["prefill_tokens"] == pytest.approx(TRUE["prefill_tokens"], rel=0.05)
    assert fit.coefficients["decode_seqs"] == pytest.approx(TRUE["decode_seqs"], rel=0.1)
    assert fit.r2 > 0.99 and fit.mean_rel_error < 0.03


def test_nnls_matches_unconstrained_when_feasible_and_clips_otherwise():
    rng = np.random.default_rng(0)
    A = rng.random((50, 4))
    x_true = np.array([1.0, 0.5, 2.0, 0.1])
    assert np.allclose(nnls(A, A @ x_true), x_true)
    b = A @ np.array([1.0, -3.0, 2.0, 0.5])  # the best unconstrained fit has a negative entry
    x = nnls(A, b)
    assert (x >= 0).all() and x[1] == 0
    # KKT: gradient is ~0 on the positive entries and points outward on the zero ones
    grad = A.T @ (A @ x - b)
    assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] >= -1e-8).all()


def test_save_load_round_trip(tmp_path):
    fit = FittedCostModel.fit(synthetic_samples(), metadata={"model": "tiny", "device": "cpu"})
    path = tmp_path / "profile.json"
    fit.save(path)
    data = json.loads(path.read_text())
    assert data["features"] == list(TRUE) and {"r2", "mean_rel_error", "coefficients"} <= set(data)
    assert data["metadata"]["model"] == "tiny" and "torch" in data["metadata"] and "machine" in data["metadata"]
    for spec in (f"profile:{path}", str(path)):
        again = load_cost_model(spec)
        assert again.coefficients == fit.coefficients and again.r2 == fit.r2
        assert again.step_time([(100, 300)], [50, 60]) == fit.step_time([(100, 300)], [50, 60])
    assert make_cost_model("tiny", f"profile:{path}").coefficients == fit.coefficients
    assert "R^2" in fit.describe() and fit.step_time([], []) == 0.0


def test_fit_of_a_roofline_decode_sweep_is_good():
    # In the memory-bound decode regime the roofline is linear in batch and context: the fit must find it.
    roof = make_cost_model("llama-2-7b", "a100-80g")
    samples = [{"prefill": [], "decode": [c] * b, "time_s": roof.step_time([], [c] * b)}
               for b in (1, 2, 4, 8, 16, 32) for c in (64, 256, 1024)]
    fit = FittedCostModel.fit(samples, features=("const", "decode_seqs", "decode_ctx"))
    assert fit.mean_rel_error < 0.01 and fit.evaluate(samples)["r2"] > 0.999


def test_bad_inputs():
    with pytest.raises(ValueError, match="time_s"):
        FittedCostModel.fit([{"prefill": [], "decode": [1], "time_s": 0}] * 10)
    with pytest.raises(ValueError, match="at least"):
        FittedCostModel.fit(synthetic_samples(n=3))
    with pytest.raises(ValueError, match="unknown feature"):
        FittedCostModel.fit(synthetic_samples(), features=("const", "flops"))
    with pytest.raises(ValueError, match="FittedCostModel"):
        FittedCostModel.from_dict({"kind": "something else"})
