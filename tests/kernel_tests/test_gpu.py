"""Compiled kernels on a CUDA GPU in bfloat16 and float16, larger shapes.

Ground truth is the torch reference evaluated in float32 on the *same* 16-bit inputs,
so the tolerances only cover the kernels' own roundings: the probabilities cast to
16 bits for the P.V product and the final cast of the output. Stated tolerances
(absolute and relative): bfloat16 1e-2 (8-bit mantissa), float16 2e-3 (11-bit mantissa).
"""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)

from .paged import make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available — not run"),
]

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.fixture(autouse=True)
def _compiled_kernels():
    from minibatch.kernels._triton_utils import interpreting
    if interpreting():
        pytest.skip("TRITON_INTERPRET=1: the compiled kernels are not run")


def _close(out, expected, dtype):
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@DTYPES
@pytest.mark.parametrize("split", [False, True, None], ids=["one-pass", "split-kv", "heuristic"])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 32, 8, 128), (32, 16, 1, 64),
                                                                 (16, 28, 4, 128), (32, 8, 8, 256)])
def test_decode_gpu(dtype, split, block_size, heads, kv_heads, head_dim):
    from minibatch.kernels.triton_kernels import paged_decode_attention

    g = torch.Generator().manual_seed(heads + head_dim)
    lens = [1, block_size - 1, block_size + 1, 4096, 3001] + torch.randint(1, 2048, (11,), generator=g).tolist()
    case = make_case(lens, block_size, kv_heads, head_dim, dtype=dtype, device="cuda", seed=block_size)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to("cuda", dtype)
    expected = paged_decode_attention_ref(q.float(), case.k_cache.float(), case.v_cache.float(),
                                          case.block_tables.clamp_min(0), case.context_lens)
    k_poisoned, v_poisoned = case.poisoned()
    out = paged_decode_attention(q, k_poisoned, v_poisoned, case.block_tables, case.context_lens, split_kv=split)
    _close(out, expected, dtype)


@DTYPES
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(16, 32, 8, 128), (32, 16, 2, 64),
                                                                 (16, 8, 1, 80)])
def test_prefill_gpu(dtype, block_size, heads, kv_heads, head_dim):
    from minibatch.kernels.triton_kernels import paged_prefill_attention

    # (context, queries): full prefills, chunks after a prefix, a decode step, an idle sequence.
    seqs = [(1024, 1024), (1500, 477), (700, 1), (129, 129), (2000, 64), (64, 0), (333, 300)]
    case = make_case([c for c, _ in seqs], block_size, kv_heads, head_dim, dtype=dtype, device="cuda",
                     seed=head_dim)
    q_lens = [n for _, n in seqs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to("cuda", torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    expected = paged_prefill_attention_ref(q.float(), case.k_cache.float(), case.v_cache.float(),
                                           case.block_tables.clamp_min(0), case.context_lens, qsl)
    k_poisoned, v_poisoned = case.poisoned()
    out = paged_prefill_attention(q, k_poisoned, v_poisoned, case.block_tables, case.context_lens, qsl)
    _close(out, expected, dtype)


@DTYPES
def test_store_kv_gpu(dtype):
    from minibatch.kernels.triton_kernels import store_kv

    num_blocks, block_size, kv_heads, head_dim = 512, 16, 8, 128
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:3000]
    slots[::7] = -1
    key = torch.randn(3000, kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_decode_gpu_cuda_graph():
    """Decode is sync-free (no .item()), so it can be captured in a CUDA graph and replayed."""
    from minibatch.kernels.triton_kernels import paged_decode_attention

    case = make_case([37, 900, 5], 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)
    for split in (False, True):
        paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, split_kv=split)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                         split_kv=split)
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = paged_decode_attention_ref(q.float(), case.k_cache.float(), case.v_cache.float(),
                                              case.block_tables.clamp_min(0), case.context_lens)
        _close(out, expected, torch.bfloat16)


def test_sampling_a_cuda_batch_stays_on_the_gpu_and_follows_top_k_and_top_p():
    """Temperature, top-k, top-p and the inverse-CDF draw on CUDA logits (every tensor the
    sampler makes must be on the logits' device; tests/mutants/sampler.md, CUDA only)."""
    from minibatch.request import Request
    from minibatch.sampler import draw_inverse_cdf, sample
    from minibatch.sampling_params import SamplingParams

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 64, device="cuda")
    reqs = [Request(str(i), [1], SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=i), 0.0)
            for i in range(64)]
    draws = sample(logits, reqs)
    # top_k 3 keeps tokens 0-2; at temperature 0.7 their masses are about 0.77, 0.18, 0.04, and
    # top_p 0.9 then keeps 0 and 1 (0.77 < 0.9 <= 0.96): only those two can be drawn.
    assert set(draws) <= {0, 1} and all(isinstance(t, int) for t in draws)
    assert draws.count(0) > draws.count(1)
    probs = torch.softmax(logits[:2], -1)
    u = torch.rand(2, 1, device="cuda", dtype=torch.float64)
    assert draw_inverse_cdf(probs, u).device.type == "cuda"


def test_swap_on_cuda_moves_kv_to_host_and_back_with_the_same_greedy_output(checkpoints):
    """Swap preemption with CUDA KV tensors (tests/mutants/swap.md, CUDA only): the saved
    copies are host tensors and swapped requests resume with identical greedy output."""
    from conftest import drive, hf_greedy          # tests/conftest.py, loaded by pytest before this package

    from minibatch import EngineConfig, LLMEngine, SamplingParams

    path, hf_model = checkpoints["qwen2-mqa"]
    prompts = [[(i * 11 + j) % 250 + 3 for j in range(20 + 5 * i)] for i in range(4)]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), num_kv_blocks=10, block_size=8, device="cuda",
                                                preemption_mode="swap", policy="priority"), clock="virtual")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids, host_devices = [], set()
    swapper = engine.scheduler.swapper
    original = swapper.swap_out

    def spy(*a, **kw):
        out = original(*a, **kw)
        for _, data in swapper.saved.values():            # request id -> (blocks, [(K, V) per layer])
            host_devices.update(t.device.type for kv in data or [] for t in kv)
        return out

    swapper.swap_out = spy
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, params, priority=len(prompts) - i))
        engine.step()
    drive(engine, limit=1000)
    assert swapper.num_swapped_in > 0
    assert [engine.output(i).outputs[0].token_ids for i in ids] == expected
    assert host_devices <= {"cpu"}, f"swapped KV copies must be host tensors, found {host_devices}"
