"""``python -m minibatch profile``: real steps of the tiny model, a fit, and a simulator run on it."""

from __future__ import annotations

import json

from minibatch.__main__ import main as cli
from minibatch.sim.calibrate import profile_engine, training_workloads
from minibatch.runner import run
from minibatch.sim import FittedCostModel
from minibatch.sim.fitted import step_tokens
from minibatch.workload import fixed, synthetic


def test_training_workloads_are_varied():
    names = [name for name, _, _ in training_workloads()]
    assert len(set(names)) == len(names) >= 6
    budgets = {kw.get("max_num_batched_tokens", 2048) for _, kw, _ in training_workloads()}
    seqs = {kw["max_num_seqs"] for _, kw, _ in training_workloads()}
    assert max(budgets) >= 2048 and min(budgets) <= 256 and min(seqs) <= 4 and max(seqs) >= 64


def test_profile_fit_and_simulate(tmp_path):
    samples, meta = profile_engine("tiny", scale=0.15)
    tokens = [step_tokens(s["prefill"], s["decode"]) for s in samples]
    assert min(tokens) == 1 and max(tokens) >= 1024          # single decodes up to big prefill chunks
    assert all(s["time_s"] > 0 for s in samples)
    assert samples[0]["recency"] == 0.0 and max(s["recency"] for s in samples) >= 1.0   # after big steps
    assert meta["model"] == "tiny" and meta["kv_capacity_tokens"] > 0
    # One segment per workload per pass, named apart from every other pass's, so that a
    # fit over two passes (as sim_fidelity does) gives each its own speed factor.
    names = [name for name, _, _ in training_workloads(0.15)]
    segments = list(dict.fromkeys(s["segment"] for s in samples))
    assert [seg.split("#")[0] for seg in segments] == names
    again, _ = profile_engine("tiny", scale=0.05)
    assert not {s["segment"] for s in again} & set(segments)

    out = tmp_path / "tiny.json"
    assert cli(["profile", "--model", "tiny", "--scale", "0.05", "--out", str(out)]) == 0
    model = FittedCostModel.load(out)
    assert any(n.startswith("tokens@") for n in model.feature_names)
    g = [c for n, c in model.coefficients.items() if n.startswith("tokens@")]
    assert all(a <= b for a, b in zip(g, g[1:]))                 # fitted non-decreasing
    assert model.step_time([(512, 512)], []) > model.step_time([], [100]) > 0
    assert json.loads(out.read_text())["metadata"]["model"] == "tiny"

    wl = synthetic(12, 20.0, input_len=fixed(64), output_len=fixed(8), seed=3)
    res = run(wl, executor="sim", model="tiny", hardware=f"profile:{out}")
    summary = res.summary()
    assert summary["completed"] == 12 and summary["throughput_tok_s"] > 0
