"""minibatch.sim.fitted: NNLS recovers known step-time coefficients and round-trips."""

import json
import random

import numpy as np
import pytest

from minibatch.sim import FittedCostModel, load_cost_model, make_cost_model, nnls
from minibatch.sim.fitted import LINEAR_FEATURES, auto_knots, feature_vector, tent_values

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
    fit = FittedCostModel.fit(synthetic_samples(), features=LINEAR_FEATURES)
    for name, value in TRUE.items():
        assert fit.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.mean_rel_error < 1e-9


def test_noisy_fit_is_close_and_nonnegative():
    fit = FittedCostModel.fit(synthetic_samples(n=400, noise=0.02, seed=1), features=LINEAR_FEATURES)
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
    fit = FittedCostModel.fit(synthetic_samples(), features=LINEAR_FEATURES,
                              metadata={"model": "tiny", "device": "cpu"})
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
        FittedCostModel.fit(synthetic_samples(n=3), features=LINEAR_FEATURES)
    with pytest.raises(ValueError, match="unknown feature"):
        FittedCostModel.fit(synthetic_samples(), features=("const", "flops"))
    with pytest.raises(ValueError, match="unknown feature"):
        FittedCostModel.fit(synthetic_samples(), features=("tokens@0", "num_seqs"))
    with pytest.raises(ValueError, match="no samples"):
        FittedCostModel.fit([])
    with pytest.raises(ValueError, match="FittedCostModel"):
        FittedCostModel.from_dict({"kind": "something else"})


def gemm_like(m):
    """A CPU GEMM's shape: one token streams the weights (1.0 ms), up to ~16 tokens cost
    about the same, beyond that time grows with the tokens (0.06 ms each)."""
    return 1.0e-3 + 0.4e-3 * min(m - 1, 1) + 0.06e-3 * max(m - 16, 0)


def bent_samples(n=300, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prefill = [(new, new) for new in (rng.choice([8, 40, 200, 900]) for _ in range(rng.choice([0, 0, 1])))]
        decode = [rng.randint(1, 512) for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 8, 20, 64]) or (0 if prefill else 1))]
        m = sum(n for n, _ in prefill) + len(decode)
        t = gemm_like(m) + 1e-7 * sum(decode) + 2e-9 * sum(n * (n + 1) / 2 for n, _ in prefill)
        out.append({"prefill": prefill, "decode": decode, "time_s": t})
    return out


def test_tent_values_interpolate_between_knots():
    knots = [1, 2, 4, 16]
    assert tent_values(1, knots) == [1.0, 0, 0, 0]
    assert tent_values(3, knots) == [0, 0.5, 0.5, 0]
    assert tent_values(10, knots) == pytest.approx([0, 0, 0.5, 0.5])
    assert tent_values(32, knots) == [0, 0, 0, 2.0]           # past the last knot: proportional
    g = np.array([1.0, 1.4, 1.5, 3.0])
    assert float(np.dot(tent_values(8, knots), g)) == pytest.approx(1.5 + (8 - 4) / 12 * 1.5)


def test_auto_knots_skip_token_counts_never_seen():
    counts = [1] * 10 + [2] * 5 + [3] * 4 + [60] * 5 + [2048] * 3
    knots = auto_knots(counts)
    assert knots[0] == 1 and knots[-1] == 2048
    assert 2 in knots and 64 in knots and 1024 not in knots and 256 not in knots


def test_default_model_follows_a_bent_gemm_curve_the_line_cannot():
    train, test = bent_samples(seed=0), bent_samples(seed=1)
    bent = FittedCostModel.fit(train)
    line = FittedCostModel.fit(train, features=LINEAR_FEATURES)
    assert any(n.startswith("tokens@") for n in bent.feature_names)
    assert bent.evaluate(test)["mean_rel_error"] < 0.02
    assert line.evaluate(test)["mean_rel_error"] > 2 * bent.evaluate(test)["mean_rel_error"]
    # g at the knots reads off the curve
    assert bent.coefficients["tokens@1"] == pytest.approx(gemm_like(1), rel=0.05)
    assert bent.step_time([], [1] * 4) < 1.6 * bent.step_time([], [1])


def test_knot_model_round_trips(tmp_path):
    fit = FittedCostModel.fit(bent_samples())
    path = tmp_path / "p.json"
    fit.save(path)
    again = FittedCostModel.load(path)
    assert again.feature_names == fit.feature_names
    for step in (([], [10] * 3), ([(500, 500)], [30] * 7), ([(3000, 3000)], [])):
        assert again.step_time(*step) == fit.step_time(*step)
        assert fit.step_time(*step) == pytest.approx(float(feature_vector(*step, fit.feature_names) @ fit.coef))
    assert "g(M)" in fit.describe()


def test_relative_fit_estimates_the_mean_step_time_not_a_low_one():
    """Noisy steps of one composition: the fit must return their mean (what a simulated
    clock adds up), not the low value that weighting each row by its own 1/t gives."""
    rng = random.Random(5)
    times = [4e-3 * (1 + rng.uniform(-0.4, 0.4)) for _ in range(400)]
    samples = [{"prefill": [], "decode": [100], "time_s": t} for t in times]
    fit = FittedCostModel.fit(samples, features=("const",))
    mean = sum(times) / len(times)
    assert fit.coefficients["const"] == pytest.approx(mean, rel=0.01)
    naive = sum(1 / t for t in times) / sum(1 / t ** 2 for t in times)    # argmin sum((c - t) / t)^2
    assert naive < 0.97 * mean


def test_fitted_g_never_falls_as_tokens_grow():
    """Noisy, flat small-batch steps: an unconstrained fit zigzags, ours is monotone."""
    rng = random.Random(7)
    samples = [{"prefill": [], "decode": [50] * b, "time_s": 3e-3 * (1 + rng.gauss(0, 0.15))}
               for b in (1, 2, 3, 4, 6, 8) for _ in range(12)]
    samples += [{"prefill": [], "decode": [50] * 64, "time_s": 9e-3 * (1 + rng.gauss(0, 0.05))} for _ in range(12)]
    fit = FittedCostModel.fit(samples, features=("tokens@1", "tokens@2", "tokens@4", "tokens@8", "tokens@64"))
    g = [fit.coefficients[f"tokens@{k}"] for k in (1, 2, 4, 8, 64)]
    assert all(a <= b + 1e-12 for a, b in zip(g, g[1:])), g
    assert g[0] == pytest.approx(3e-3, rel=0.15) and g[-1] == pytest.approx(9e-3, rel=0.05)


def test_segment_speed_factors_keep_a_slow_spell_out_of_the_coefficients():
    """One workload (segment) ran while the machine was 1.4x slower. Its batch shapes are
    shared with other segments only in part; with segment factors the fit still recovers
    the machine's costs, without them the shapes it ran come out too expensive."""
    rng = random.Random(3)
    true = {"tokens@1": 2e-3, "tokens@4": 2.5e-3, "tokens@16": 4e-3, "decode_ctx": 1e-7}
    feats = tuple(true)
    coef = np.array(list(true.values()))
    samples = []
    for seg, (sizes, slow) in enumerate([((1, 2, 4), 1.0), ((4, 8, 16), 1.4), ((1, 16), 1.0), ((2, 8), 1.0)]):
        for _ in range(60):
            decode = [rng.randint(10, 300) for _ in range(rng.choice(sizes))]
            t = float(feature_vector([], decode, feats) @ coef) * slow * (1 + rng.gauss(0, 0.03))
            samples.append({"prefill": [], "decode": decode, "time_s": t, "segment": f"w{seg}"})
    plain = FittedCostModel.fit([{k: v for k, v in s_.items() if k != "segment"} for s_ in samples], features=feats)
    split = FittedCostModel.fit(samples, features=feats)
    slow_time = sum(s_["time_s"] for s_ in samples if s_["segment"] == "w1")
    slow_share = slow_time / sum(s_["time_s"] for s_ in samples)
    mean_speed = 1 / (1 - slow_share + slow_share / 1.4)     # time-weighted mean slowdown

    def worst_error(model):
        shapes = [([], [c] * b) for b in (1, 3, 4, 8, 16) for c in (30, 280)]
        return max(abs(model.step_time(*sh) / (float(feature_vector(*sh, feats) @ coef) * mean_speed) - 1)
                   for sh in shapes)

    assert worst_error(split) < 0.03
    assert worst_error(plain) > 2 * worst_error(split)
    slowdown = split.metadata["segment_slowdown"]
    assert slowdown["w1"] == pytest.approx(1.4 * slowdown["w0"], rel=0.05)



def test_recency_decays_after_big_steps_and_the_fit_recovers_its_cost():
    from minibatch.sim.fitted import next_recency

    r = next_recency(0.0, [(64, 64)], [])             # a big step: the next one has recency 1
    assert r == 1.0
    r = next_recency(r, [], [10, 20])                  # a small step halves it
    assert r == 0.5 and next_recency(r, [], [5]) == 0.25
    # Samples whose true time has 0.4 ms per unit of recency: the fit finds it.
    rng = random.Random(3)
    samples, rec = [], 0.0
    for _ in range(400):
        step = ([(rng.randint(33, 400), 400)], []) if rng.random() < 0.2 else ([], [rng.randint(10, 300)] * rng.randint(1, 8))
        t = 1e-3 + 2e-6 * sum(n for n, _ in step[0]) + 1e-4 * len(step[1]) + 4e-4 * rec
        samples.append({"prefill": step[0], "decode": step[1], "time_s": t, "recency": rec})
        rec = next_recency(rec, *step)
    fit = FittedCostModel.fit(samples, features=("const", "prefill_tokens", "decode_seqs", "after_big_step"))
    assert fit.coefficients["after_big_step"] == pytest.approx(4e-4, rel=1e-6)
    assert fit.step_time([], [100], recency=1.0) - fit.step_time([], [100]) == pytest.approx(4e-4, rel=1e-6)
    assert "after_big_step" in FittedCostModel.fit(samples).feature_names      # default when recorded
    plain = [{k: v for k, v in s.items() if k != "recency"} for s in samples]
    assert "after_big_step" not in FittedCostModel.fit(plain).feature_names


def test_the_simulator_charges_the_steps_after_a_big_one(tmp_path):
    from minibatch.runner import run
    from minibatch.workload import fixed, synthetic

    path = tmp_path / "m.json"
    FittedCostModel({"const": 1e-3, "after_big_step": 1e-3}, metadata={"kv_capacity_tokens": 4096}).save(path)
    wl = synthetic(1, float("inf"), input_len=fixed(100), output_len=fixed(4), seed=0)
    steps = run(wl, executor="sim", model="tiny", hardware=f"profile:{path}").steps
    # prefill (recency 0), then decodes at recency 1, 0.5, 0.25
    assert [round(s.duration * 1e3, 6) for s in steps] == [1.0, 2.0, 1.5, 1.25]


def _with_spells(samples, share=0.06, slowdown=1.8, seed=3):
    """Every ~1/share-th sample run during a slow spell of the machine."""
    rng = random.Random(seed)
    out = []
    for s_ in samples:
        spell = rng.random() < share
        out.append({**s_, "time_s": s_["time_s"] * (slowdown if spell else 1.0), "spell": spell})
    return out


def test_outlier_ratio_drops_slow_spells_and_recovers_the_machine():
    samples = _with_spells(synthetic_samples(n=400, noise=0.03, seed=4))
    spells = sum(s_["spell"] for s_ in samples)
    plain = FittedCostModel.fit(samples, features=LINEAR_FEATURES)
    robust = FittedCostModel.fit(samples, features=LINEAR_FEATURES, outlier_ratio=1.2)
    clean = [s_ for s_ in samples if not s_["spell"]]

    def total_error(model):
        pred = sum(model.step_time(s_["prefill"], s_["decode"]) for s_ in clean)
        return pred / sum(s_["time_s"] for s_ in clean) - 1

    assert total_error(plain) > 0.03                 # the spells inflate the plain fit
    assert abs(total_error(robust)) < 0.01
    # About the spells are dropped (plus the odd noisy sample), not a large share.
    assert spells <= robust.metadata["outliers_dropped"] <= spells + 0.02 * len(samples)
    assert robust.metadata["outlier_ratio"] == 1.2
    assert "outliers_dropped" not in plain.metadata


def test_outlier_ratio_must_exceed_one():
    with pytest.raises(ValueError, match="outlier_ratio"):
        FittedCostModel.fit(synthetic_samples(), features=LINEAR_FEATURES, outlier_ratio=1.0)


def test_profiler_fit_drops_outliers_by_default():
    from minibatch.sim.calibrate import fit_profile
    from minibatch.sim.fitted import PROFILE_OUTLIER_RATIO

    samples = _with_spells(synthetic_samples(n=300, seed=5))
    model = fit_profile(samples, {"model": "tiny"})
    assert model.metadata["outlier_ratio"] == PROFILE_OUTLIER_RATIO
    assert model.metadata["outliers_dropped"] > 0 and model.metadata["model"] == "tiny"
    every = fit_profile(samples, {"model": "tiny"}, outlier_ratio=None)   # keeps every step
    assert "outliers_dropped" not in every.metadata and every.num_samples == len(samples)
