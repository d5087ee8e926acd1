"""Weight-only quantization in the simulator: ``ModelSpec.weight_dtype_bytes`` (chapter 30's estimate).

The matmuls' weights are read at ``weight_dtype_bytes`` each; embeddings, LM head, activations
and KV stay at ``dtype_bytes``. So a memory-bound step (small-batch decode) gets faster by about
the weight bytes saved, a compute-bound one (a long prefill) does not, and the KV pool grows by
the bytes the weights no longer take.
"""

import dataclasses

import pytest

from minibatch.runner import run
from minibatch.sim import ModelSpec, get_model_spec, make_cost_model
from minibatch.workload import synthetic

GiB = 1 << 30


def int8(name: str, wb: float = 1) -> ModelSpec:
    spec = get_model_spec(name)
    return dataclasses.replace(spec, name=f"{spec.name}-w{int(wb * 8)}", weight_dtype_bytes=wb)


def test_weight_bytes_count_matmul_weights_at_their_own_width():
    fp16, q8, q4 = get_model_spec("llama-2-13b"), int8("llama-2-13b"), int8("llama-2-13b", 0.5)
    linear = fp16.num_layers * fp16.layer_linear_params
    rest = fp16.num_params - linear                       # embeddings, LM head, norms
    assert q8.weight_bytes == linear * 1 + rest * 2
    assert q4.weight_bytes == linear // 2 + rest * 2
    assert fp16.weight_bytes == 2 * fp16.num_params       # the default is unchanged
    assert 0.5 < q8.weight_bytes / fp16.weight_bytes < 0.52  # 13B: the embeddings are ~2.5% of it
    assert q8.kv_bytes_per_token == fp16.kv_bytes_per_token


def test_bad_weight_width_is_refused():
    with pytest.raises(ValueError, match="weight_dtype_bytes"):
        int8("llama-2-7b", 0)
    with pytest.raises(ValueError, match="weight_dtype_bytes"):
        int8("llama-2-7b", 4)                             # wider than the model's 2-byte dtype


def test_memory_bound_decode_speeds_up_by_the_weight_bytes_saved():
    fp16 = make_cost_model("llama-2-13b", "a10", tensor_parallel_size=2)
    q8 = make_cost_model(int8("llama-2-13b"), "a10", tensor_parallel_size=2)
    batch1 = ([], [256])
    g16, g8 = fp16.breakdown(*batch1)["gemm"], q8.breakdown(*batch1)["gemm"]
    assert g8 == pytest.approx(g16 / 2, rel=0.01)         # reading the weights is the step
    assert q8.step_time(*batch1) < 0.65 * fp16.step_time(*batch1)
    prefill = ([(4096, 4096)], [])                        # compute-bound: the weights do not matter
    assert q8.breakdown(*prefill)["gemm"] == pytest.approx(fp16.breakdown(*prefill)["gemm"], rel=0.01)
    assert q8.breakdown(*batch1)["lm_head"] == fp16.breakdown(*batch1)["lm_head"]


def test_kv_pool_grows_by_the_weight_bytes_saved():
    fp16 = make_cost_model("llama-2-13b", "2xa10")
    q8 = make_cost_model(int8("llama-2-13b"), "2xa10")
    saved = fp16.weight_bytes_per_gpu - q8.weight_bytes_per_gpu
    assert saved > 5 * GiB                                # about half of 13 GB per GPU
    assert q8.kv_capacity_tokens() - fp16.kv_capacity_tokens() == pytest.approx(
        saved / fp16.kv_bytes_per_token_per_gpu, abs=1)
    # 13B no longer needs two A10s: int8 weights fit on one, with room for KV
    with pytest.raises(ValueError, match="does not fit"):
        make_cost_model("llama-2-13b", "a10").kv_capacity_tokens()
    assert make_cost_model(int8("llama-2-13b"), "a10").kv_capacity_tokens() > 8_000   # two 4k-token requests


def test_the_simulated_engine_uses_the_quantized_spec():
    wl = synthetic(12, 0.2, seed=1)                       # light load: TPOT is a small-batch decode step
    fp16 = run(wl, executor="sim", model="llama-2-13b", hardware="2xa10")
    q8 = run(wl, executor="sim", model=int8("llama-2-13b"), hardware="2xa10")
    assert [r.output_token_ids for r in q8.requests] == [r.output_token_ids for r in fp16.requests]
    assert q8.summary()["tpot_mean"] < 0.7 * fp16.summary()["tpot_mean"]
