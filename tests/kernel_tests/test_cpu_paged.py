"""The C paged-attention kernels (the CPU engine's default) equal the plain reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minibatch import kernels
from minibatch.kernels import cpu_paged
from minibatch.kernels.reference import paged_decode_attention_ref

from .test_torch_paged import _paged

needs_kernel = pytest.mark.skipif(not cpu_paged.available(),
                                  reason=f"C kernel not built here: {cpu_paged.build_error}")


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["dispatch", "portable"])
@pytest.mark.parametrize("heads, kv_heads, head_dim",
                         [(8, 4, 32), (8, 8, 64), (8, 1, 128), (6, 2, 48), (4, 4, 16), (16, 1, 32), (6, 6, 96),
                          (4, 2, 20), (4, 1, 8), (2, 2, 136)])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size, portable):
    # 300 and 700 tokens run past the AVX-512 path's 32-row prefetch distance; 7 and 1
    # leave partial reduction trees.
    lens = [1, block_size, block_size + 1, 2 * block_size - 1, 45, 130, 7, 300, 700]
    k, v, tables = _paged(lens, block_size, kv_heads, head_dim, seed=heads + block_size)
    q = torch.randn(len(lens), heads, head_dim)
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx)
    out = cpu_paged.paged_decode_attention_c(q, k, v, tables, ctx, portable=portable)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_avx512_path_serves_the_common_shapes_where_the_cpu_has_it():
    has_avx512 = "avx512f" in cpu_paged._cpu_signature().split()
    assert cpu_paged.uses_avx512(8, 4, 32) == has_avx512       # the embedded model
    assert cpu_paged.uses_avx512(32, 8, 128) == has_avx512     # Llama-3-8B's sizes
    assert not cpu_paged.uses_avx512(6, 2, 48)                 # group of 3: portable path
    assert not cpu_paged.uses_avx512(4, 4, 24)                 # head_dim not a multiple of 16


@needs_kernel
def test_decode_takes_strided_queries_and_int64_tables():
    lens = [33, 64, 5]
    k, v, tables = _paged(lens, 16, 2, 32, seed=3)
    qk = torch.randn(len(lens), 8 + 2, 32)
    q = qk[:, :8]                                   # a non-contiguous view, as the model passes
    ctx = torch.tensor(lens)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, scale=0.3)
    out = cpu_paged.paged_decode_attention_c(q, k, v, tables.long(), ctx, scale=0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_dispatcher_defaults_to_the_kernel_on_cpu_and_honours_overrides(monkeypatch):
    monkeypatch.delenv("MINIBATCH_KERNELS", raising=False)
    cpu = torch.device("cpu")
    assert kernels.resolve_backend(None, cpu) == "cpu"
    monkeypatch.setenv("MINIBATCH_KERNELS", "torch")
    assert kernels.resolve_backend(None, cpu) == "torch"
    assert kernels.resolve_backend("cpu", cpu) == "cpu"
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-graphs'"):
        kernels.resolve_backend("cuda-graphs", cpu)


def test_dispatcher_keeps_bfloat16_on_the_torch_path():
    lens = [20, 3]
    k, v, tables = _paged(lens, 8, 2, 32, seed=4)
    q = torch.randn(2, 4, 32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = kernels.paged_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, ctx, backend="cpu")
    ref = paged_decode_attention_ref(q, k, v, tables, ctx)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_no_compiler_falls_back_to_torch_with_a_reason(tmp_path):
    """Without a working C compiler the engine still runs (torch path) and says why."""
    code = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            from minibatch.kernels import cpu_paged, resolve_backend
            import torch
            assert not cpu_paged.available()
            assert resolve_backend(None, torch.device("cpu")) == "torch"
        assert "false failed" in cpu_paged.build_error, cpu_paged.build_error
        assert any("C kernels unavailable" in str(x.message) for x in w)
        from minibatch import LLM, SamplingParams
        out = LLM("tiny").generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        print("ok")
    """)
    env = dict(os.environ, CC="false", MINIBATCH_CACHE=str(tmp_path))
    env.pop("MINIBATCH_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


def _prefill_case(q_lens, ctx_lens, block_size=16, heads=8, kv_heads=4, head_dim=32, seed=0):
    k, v, tables = _paged(ctx_lens, block_size, kv_heads, head_dim, seed=seed)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed))
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables.clamp(min=0), torch.tensor(ctx_lens, dtype=torch.int32), starts


@needs_kernel
@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([136] * 3, [136] * 3),                          # whole prompts, three 64-token tiles each
    ([1, 17, 40, 5], [1, 57, 40, 305]),              # chunks after cached context (chunked prefill, prefix hits)
    ([16, 16], [16, 32]),                            # block-aligned
    ([64, 65, 63], [64, 65, 700]),                   # one tile exactly, one token past, long cached context
    ([300], [1100]),                                 # a late chunk of a long prompt
], ids=["prompts", "chunks", "aligned", "tile-edges", "long"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 32), (8, 8, 64), (8, 1, 128), (6, 2, 40)],
                         ids=["gqa-32", "mha-64", "mqa-128", "portable-40"])
def test_tiled_prefill_matches_reference(q_lens, ctx_lens, heads, kv_heads, head_dim):
    # head_dim 40 is not a multiple of 16: the loops the compiler vectorises serve it.
    from minibatch.kernels.reference import paged_prefill_attention_ref
    args = _prefill_case(q_lens, ctx_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=head_dim)
    ref = paged_prefill_attention_ref(*args)
    torch.testing.assert_close(cpu_paged.paged_prefill_attention_c(*args), ref, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 8])
def test_tiled_prefill_other_block_sizes(block_size):
    from minibatch.kernels.reference import paged_prefill_attention_ref
    args = _prefill_case([70, 3], [90, 3], block_size=block_size, seed=block_size)
    torch.testing.assert_close(cpu_paged.paged_prefill_attention_c(*args), paged_prefill_attention_ref(*args),
                               atol=2e-5, rtol=2e-5)


@needs_kernel
def test_prefill_dispatch_sends_every_context_length_to_the_c_kernel(monkeypatch):
    """The cpu backend's prefill is one C call for the whole ragged batch, long contexts too."""
    from minibatch.kernels.reference import paged_prefill_attention_ref
    calls = []
    real_c = cpu_paged.paged_prefill_attention_c
    monkeypatch.setattr(cpu_paged, "paged_prefill_attention_c",
                        lambda q, *a: calls.append(q.shape[0]) or real_c(q, *a))
    args = _prefill_case([30, 64, 7, 20], [30, 900, 7, 620], seed=5)
    out = kernels.paged_prefill_attention(*args, backend="cpu")
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=2e-5, rtol=2e-5)
    assert calls == [121]


@needs_kernel
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-views"])
def test_c_store_kv_matches_reference(strided):
    from minibatch.kernels.reference import store_kv_ref
    g = torch.Generator().manual_seed(7)
    n, kvh, d = 37, 4, 32
    if strided:      # K and V as the model passes them: views into one fused QKV buffer
        qkv = torch.randn(n, (8 + 2 * kvh) * d, generator=g)
        key = qkv[:, 8 * d:(8 + kvh) * d].view(n, kvh, d)
        value = qkv[:, (8 + kvh) * d:].view(n, kvh, d)
    else:
        key, value = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    slots = torch.randperm(10 * 16, generator=g)[:n]
    slots[[3, 20]] = -1                                  # skipped rows
    caches = [torch.zeros(10, 16, kvh, d) for _ in range(4)]
    assert cpu_paged.store_kv_c(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


@needs_kernel
def test_c_store_kv_rejects_slots_outside_the_cache_and_declines_other_dtypes():
    key = torch.randn(3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    with pytest.raises(IndexError, match="outside the KV cache"):
        cpu_paged.store_kv_c(key, key, k_cache, v_cache, torch.tensor([0, 8, 1]))
    half = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    assert cpu_paged.store_kv_c(key.bfloat16(), key.bfloat16(), half, half, torch.tensor([0, 1, 2])) is False


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["dispatch", "portable"])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("num_threads", [2, 4])
def test_split_context_decode_matches_reference(portable, block_size, num_threads):
    """Fewer sequences than threads: long contexts run in parts merged by log-sum-exp."""
    lens = [1500, 300] if num_threads == 4 else [1037]      # 1037: a part that ends mid-block
    k, v, tables = _paged(lens, block_size, 4, 32, seed=block_size + num_threads)
    q = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(num_threads)) * 3
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx)
    out = cpu_paged.paged_decode_attention_c(q, k, v, tables, ctx, portable=portable, num_threads=num_threads)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
