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


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 4096), (3, 63), (7, 64), (5, 65), (96, 4096), (40, 5000)])
def test_argmax_rows_matches_torch(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g)
    assert torch.equal(cpu_paged.argmax_rows_c(x), x.argmax(dim=-1))
    # Ties: the first index of the maximum, wherever the copies fall.
    x[:, cols // 3] = 9.0
    x[:, cols - 1] = 9.0
    assert torch.equal(cpu_paged.argmax_rows_c(x), x.argmax(dim=-1))


def test_argmax_rows_follows_torch_on_nan_inf_and_constant_rows():
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(1))
    x[0, 70], x[0, 150] = float("nan"), float("nan")       # the first NaN wins
    x[1] = 2.0                                             # all equal: index 0
    x[2] = float("-inf")
    x[3, 5], x[3, 180] = float("inf"), float("inf")
    x[4, 0] = float("-inf")                                # -inf elsewhere than the maximum
    x[5, 199] = 50.0                                       # the last element
    x[6, 10], x[6, 20] = float("inf"), float("nan")        # NaN beats +inf
    assert torch.equal(cpu_paged.argmax_rows_c(x), x.argmax(dim=-1))


def test_argmax_rows_takes_a_row_strided_view_and_rejects_bad_shapes():
    base = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    view = base[::2, 10:290]                               # rows 600 floats apart
    assert torch.equal(cpu_paged.argmax_rows_c(view), view.argmax(dim=-1))
    with pytest.raises(ValueError):
        cpu_paged.argmax_rows_c(base.t())                  # columns not contiguous
    with pytest.raises(ValueError):
        cpu_paged.argmax_rows_c(torch.randn(10))


def test_greedy_sampling_uses_the_c_argmax(monkeypatch):
    from minibatch import sampler
    calls = []
    real = cpu_paged.argmax_rows_c
    monkeypatch.setattr(cpu_paged, "argmax_rows_c", lambda t: calls.append(t.shape) or real(t))
    out = LLM("tiny").generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert calls and all(s[1] == 4096 for s in calls)
    n = len(calls)
    assert torch.equal(sampler.argmax_rows(torch.tensor([[1.0, 3.0]], dtype=torch.float64)), torch.tensor([1]))
    assert len(calls) == n                                  # other dtypes: torch's argmax


@pytest.mark.parametrize("m,n,k", [(1, 512, 256), (2, 256, 688), (1, 4096, 256), (3, 13, 40), (1, 1, 7),
                                   (2, 6, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_small_m_matches_f_linear(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(m, k, generator=g)
    torch.testing.assert_close(cpu_paged.linear_small_m_c(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_linear_small_m_takes_row_strided_inputs():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g)
    wide = torch.randn(2, 100, generator=g)
    x = wide[:, 30:70]                                     # rows 100 floats apart
    torch.testing.assert_close(cpu_paged.linear_small_m_c(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 64])     # 6 and more: row blocks of 6 and a remainder
@pytest.mark.parametrize("n,k", [(32, 16), (70, 40), (256, 688), (5, 3), (20, 9)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_panels_matches_f_linear(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = cpu_paged.pack_panels(w)
    assert panels.shape == (-(-n // cpu_paged.PANEL), k, cpu_paged.PANEL)
    torch.testing.assert_close(cpu_paged.linear_panels_c(x, panels, n, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_linear_panels_rows_blocked_together_equal_each_row_alone_bit_for_bit():
    # The fused decode step and the per-op path must agree exactly whatever the batch
    # size, so a row's result may not depend on which block of rows it was computed in.
    g = torch.Generator().manual_seed(8)
    w, x, b = torch.randn(70, 200, generator=g), torch.randn(29, 200, generator=g), torch.randn(70, generator=g)
    panels = cpu_paged.pack_panels(w)
    together = cpu_paged.linear_panels_c(x, panels, 70, b)
    alone = torch.cat([cpu_paged.linear_panels_c(x[i:i + 1], panels, 70, b) for i in range(29)])
    pairs = torch.cat([cpu_paged.linear_panels_c(x[i:i + 2], panels, 70, b) for i in range(0, 28, 2)])
    assert torch.equal(together, alone)
    assert torch.equal(together[:28], pairs)


def test_pack_panels_layout_and_padding():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    p = cpu_paged.pack_panels(w)
    assert p.shape == (2, 3, 32)
    assert p[0, 2, 5] == w[5, 2] and p[1, 1, 7] == w[39, 1]      # panel p, k, j = w[32p + j, k]
    assert (p[1, :, 8:] == 0).all()                               # rows past N are zeros


def test_linear_panels_takes_row_strided_inputs_and_checks_shapes():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(24, 40, generator=g)
    wide = torch.randn(3, 100, generator=g)
    x = wide[:, 30:70]                                     # rows 100 floats apart
    panels = cpu_paged.pack_panels(w)
    torch.testing.assert_close(cpu_paged.linear_panels_c(x, panels, 24, None), F.linear(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_paged.linear_panels_c(torch.randn(1, 41), panels, 24, None)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_paged.linear_panels_c(torch.randn(1, 40), panels, 33, None)


def test_prepacked_projections_take_the_c_path_only_for_a_few_rows(monkeypatch):
    from minibatch.model import llama
    llm = LLM("tiny")
    model = llm.engine.executor.model
    proj = model.layers[0].self_attn.qkv_proj
    if not getattr(proj, "_small_m", False):
        pytest.skip("prepacked oneDNN linear not available here")
    calls = []
    real = cpu_paged.linear_panels_c
    monkeypatch.setattr(cpu_paged, "linear_panels_c", lambda x, p, n, b: calls.append(x.shape[0]) or real(x, p, n, b))
    for rows in range(1, llama.SMALL_M_ROWS + 3):
        x = torch.randn(rows, proj.in_features)
        torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=1e-4, rtol=1e-4)
    assert calls == list(range(1, llama.SMALL_M_ROWS + 1))
    calls.clear()
    h = torch.randn(1, proj.in_features)
    torch.testing.assert_close(model.compute_logits(h), F.linear(h, model.embed_tokens.weight), atol=1e-4, rtol=1e-4)
    assert calls == [1]                                    # the tied LM head too
    calls.clear()
    monkeypatch.setattr(llama, "SMALL_M_ROWS", 0)
    proj(torch.randn(1, proj.in_features))
    assert calls == []                                     # SMALL_M_ROWS=0: oneDNN for every size


def test_the_torch_backend_keeps_every_projection_in_torch():
    llm = LLM("tiny", attention_backend="torch")
    model = llm.engine.executor.model
    assert not model._small_m_lm_head
    assert not any(getattr(m, "_small_m", False) for m in model.modules())
    cpu = LLM("tiny", attention_backend="cpu").engine.executor
    if not cpu.prepacked:
        pytest.skip("prepacked oneDNN linear not available here")
    assert cpu.model._small_m_lm_head and cpu.model.layers[0].mlp.down_proj._small_m


@pytest.fixture
def threads():
    """Run the body with ``n`` torch/OpenMP threads (``make test`` gives each worker one), then restore."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [2, 3])
def test_fused_ops_give_the_one_thread_answer_on_several_threads(threads, n):
    """Every row is independent, so the parallel loops (taken above PARALLEL_MIN elements) must give
    exactly the one-thread result; ``make test`` runs one thread per worker, so this is where the
    parallel paths of rms_norm, silu_mul, rope, store_kv and argmax run."""
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(300, 256, generator=g) * 3, torch.randn(256, generator=g)
    gu = torch.randn(64, 2 * 688, generator=g) * 4
    qkv = torch.randn(2048, 16 * 32, generator=g)
    # [max_positions, head_dim] (head_dim 32): narrower rows made the kernel read past the tensor
    cos, sin = torch.randn(4096, 32, generator=g), torch.randn(4096, 32, generator=g)
    pos = torch.randint(0, 4096, (2048,), generator=g)
    logits = torch.randn(64, 4096, generator=g)
    key, value = torch.randn(300, 4, 32, generator=g), torch.randn(300, 4, 32, generator=g)
    slots = torch.randperm(512, generator=g)[:300]

    def run_all():
        kc, vc = torch.zeros(32, 16, 4, 32), torch.zeros(32, 16, 4, 32)
        assert cpu_paged.store_kv_c(key, value, kc, vc, slots)
        q = qkv.clone().view(2048, 16, 32)
        return (cpu_paged.rms_norm_c(x, w, 1e-6), cpu_paged.silu_mul_c(gu),
                cpu_paged.rope_c_(q, cos, sin, pos), cpu_paged.argmax_rows_c(logits), kc, vc)

    threads(1)
    one = run_all()
    threads(n)
    assert torch.get_num_threads() == n
    for i, (a, b) in enumerate(zip(one, run_all())):
        assert torch.equal(a, b), i
