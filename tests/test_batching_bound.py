"""The roofline floor of recorded steps (``minibatch.sim.calibrate``'s machine measurements and
``benchmarks/batching_bound.py``): floors, buckets, recording."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from minibatch import LLM
from minibatch.sim.calibrate import floor_hardware, measure_gemm_peak, measure_read_bandwidth
from minibatch.sim import RooflineCostModel, get_model_spec

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "batching_bound.py"
_spec = importlib.util.spec_from_file_location("batching_bound", _PATH)
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)

TINY = get_model_spec("tiny")


def test_floor_of_a_one_sequence_decode_step_is_its_bytes_over_bandwidth():
    # At one row every GEMM and the attention are memory-bound, so the floor is the
    # bytes they must read (weights, activations, the sequence's K/V) over the bandwidth.
    bw, ctx = 10e9, 100
    model = RooflineCostModel(TINY, floor_hardware("t", gemm_flops=1e15, bandwidth=bw))
    m, b = TINY, 4
    h, q, kv, i = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    gemm_bytes = sum(k * n + k + n for k, n in ((h, q + 2 * kv), (q, h), (h, 2 * i), (i, h))) * m.num_layers
    gemm_bytes += h * m.vocab_size + h + m.vocab_size
    attn_bytes = (2 * kv * ctx + 2 * (q + kv)) * m.num_layers
    assert bb.floor_seconds([{"prefill": [], "decode": [ctx]}], model) == pytest.approx(
        (gemm_bytes + attn_bytes) * b / bw, rel=1e-9)
    assert model.step_time([], []) == 0.0                      # no step overhead in a floor


def test_floor_of_a_big_prefill_is_its_flops_over_the_gemm_peak():
    peak = 1e11
    model = RooflineCostModel(TINY, floor_hardware("t", gemm_flops=peak, bandwidth=1e15))
    n = 2048
    flops = 2 * n * TINY.layer_linear_params * TINY.num_layers + 2 * TINY.hidden_size * TINY.vocab_size
    pairs = n * (n + 1) / 2
    flops += 4 * TINY.num_heads * TINY.head_dim * pairs * TINY.num_layers
    assert bb.floor_seconds([{"prefill": [(n, n)], "decode": []}], model) == pytest.approx(flops / peak, rel=1e-9)


def test_batching_lowers_the_floor_per_token():
    model = RooflineCostModel(TINY, floor_hardware("t", gemm_flops=2e11, bandwidth=3e10))
    one = model.step_time([], [200])
    many = model.step_time([], [200] * 64)
    assert many < 64 * one / 5          # weights are read once for the whole batch


def test_bucket_table_splits_steps_by_kind():
    model = RooflineCostModel(TINY, floor_hardware("t", gemm_flops=1e11, bandwidth=1e10))
    samples = [{"prefill": [(50, 50)], "decode": [10], "time_s": 0.5},
               {"prefill": [], "decode": [10], "time_s": 0.1},
               {"prefill": [], "decode": [10] * 5, "time_s": 0.2},
               {"prefill": [], "decode": [10] * 7, "time_s": 0.3},
               {"prefill": [], "decode": [10] * 70, "time_s": 0.4}]
    rows = bb.bucket_table(samples, model)
    assert [(r[0], r[1]) for r in rows] == [("steps with prefill", 1), ("decode, 1 seq", 1),
                                            ("decode, 2-16", 2), ("decode, 65+", 1)]
    assert rows[2][2] == pytest.approx(0.5)
    assert rows[2][3] == pytest.approx(bb.floor_seconds(samples[2:4], model))


def test_recorded_steps_match_the_engine_steps_and_restore_the_executor():
    llm = LLM("tiny", max_num_seqs=2)
    inner = llm.engine.executor
    before = len(llm.engine.steps)
    samples = bb.recorded_steps(llm, [[5, 6, 7], [8, 9, 10, 11], [12, 13]], [3, 2, 4])
    steps = llm.engine.steps[before:]
    assert llm.engine.executor is inner
    assert len(samples) == len(steps)
    assert [len(s["decode"]) for s in samples] == [r.num_decode_seqs for r in steps]
    assert [sum(n for n, _ in s["prefill"]) for s in samples] == [r.num_prefill_tokens for r in steps]
    assert max(len(s["decode"]) + len(s["prefill"]) for s in samples) == 2
    assert sum(len(s["decode"]) for s in samples) + 3 == 3 + 2 + 4   # each request's first token comes from its prefill


def test_summarize_reports_floors_and_excess():
    model = RooflineCostModel(TINY, floor_hardware("t", gemm_flops=1e11, bandwidth=1e10))
    samples = [{"prefill": [(20, 20)], "decode": [], "time_s": 0.01},
               {"prefill": [], "decode": [21], "time_s": 0.002}]
    out = bb.summarize(samples, 0.05, {"dram": model, "cache": replace_bw(model, 1e11)})
    floor = bb.floor_seconds(samples, model)
    assert out["steps"] == 2 and out["tokens"] == 21
    assert out["floor_dram_s"] == pytest.approx(floor)
    assert out["floor_cache_s"] < out["floor_dram_s"]
    assert out["excess_per_step_ms"] == pytest.approx((0.05 - floor) / 2 * 1e3)


def replace_bw(model: RooflineCostModel, bw: float) -> RooflineCostModel:
    return RooflineCostModel(model.model, replace(model.hardware, memory_bandwidth=bw))


def test_the_measurements_are_positive_and_finite():
    assert 1e8 < measure_read_bandwidth(1 << 20, repeats=3) < 1e13
    small = replace(TINY, num_layers=1, vocab_size=256)
    assert 1e8 < measure_gemm_peak(small, rows=(64,), repeats=2) < 1e14
