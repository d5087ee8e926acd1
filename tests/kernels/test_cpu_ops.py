"""The fused C element-wise ops (``cpu_ops.c``) equal the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minibatch import LLM, SamplingParams
from minibatch.kernels import cpu_paged
from minibatch.model.llama import MLP, Attention, RMSNorm, rotate_half

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason=f"C kernels not built here: {cpu_paged.build_error}")


@pytest.mark.parametrize("rows", [1, 7, 300])        # 300 x 256 floats crosses the parallel threshold
@pytest.mark.parametrize("dim", [16, 256, 100])
def test_rms_norm_matches_torch(rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g) * 3
    w = torch.randn(dim, generator=g)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(cpu_paged.rms_norm_c(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)


def test_rms_norm_takes_strided_views_and_keeps_the_shape():
    """Qwen3's q/k norm runs over head-sized slices of the fused QKV output."""
    qkv = torch.randn(5, 3 * 64)
    q = qkv[:, :128].view(5, 2, 64)                 # non-contiguous across tokens
    w = torch.randn(64)
    out = cpu_paged.rms_norm_c(q, w, 1e-5)
    assert out.shape == (5, 2, 64)
    torch.testing.assert_close(out, F.rms_norm(q, (64,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul_matches_torch(rows):
    gu = torch.randn(rows, 2 * 688) * 4
    ref = F.silu(gu[:, :688]) * gu[:, 688:]
    torch.testing.assert_close(cpu_paged.silu_mul_c(gu), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 33, 2048])
def test_rope_in_place_on_a_qkv_view_matches_rotate_half(n):
    heads, kv_heads, d = 8, 4, 32
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(4096).float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d)
    pos = torch.randint(0, 4096, (n,))
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    ref = qk * cos[pos].unsqueeze(1) + rotate_half(qk) * sin[pos].unsqueeze(1)
    out = cpu_paged.rope_c_(qk, cos, sin, pos)
    assert out.data_ptr() == qkv.data_ptr()         # in place, in the QKV buffer
    torch.testing.assert_close(qk, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)    # V untouched


def test_rope_rejects_heads_that_are_not_contiguous():
    x = torch.randn(4, 32, 3).transpose(1, 2)       # [4, 3, 32] with strided heads
    with pytest.raises(ValueError, match="contiguous"):
        cpu_paged.rope_c_(x, torch.ones(8, 32), torch.zeros(8, 32), torch.zeros(4, dtype=torch.int64))


def test_the_cpu_backend_switches_the_fused_ops_on_and_the_torch_backend_off():
    fused_llm, plain_llm = LLM("tiny", attention_backend="cpu"), LLM("tiny", attention_backend="torch")
    fused, plain = fused_llm.engine.executor, plain_llm.engine.executor
    assert fused.fused_ops and not plain.fused_ops
    kinds = (RMSNorm, Attention, MLP)
    assert all(m.fused_cpu_ops for m in fused.model.modules() if isinstance(m, kinds))
    assert not any(m.fused_cpu_ops for m in plain.model.modules() if isinstance(m, kinds))
    # Same greedy tokens either way.
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "动态批处理"]
    a = [o.outputs[0].token_ids for o in fused_llm.generate(prompts, p)]
    b = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, p)]
    assert a == b
