"""GEMM row buckets and warm-up for the prepacked CPU projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minibatch import LLM
from minibatch.model.llama import _pack, gemm_rows, onednn_linear_available, packed_linear

needs_onednn = pytest.mark.skipif(not onednn_linear_available(torch.zeros(8, 8)), reason="no oneDNN prepacked linear")


def test_gemm_rows_bounds_the_shapes_and_the_padding():
    sizes = [gemm_rows(m) for m in range(1, 2049)]
    assert sizes[:32] == list(range(1, 33))                   # small batches stay exact
    assert all(r >= m for m, r in zip(range(1, 2049), sizes))
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))       # monotone
    assert max((r - m) / m for m, r in zip(range(1, 2049), sizes)) <= 1 / 16
    assert len(set(sizes)) == 128                              # well under oneDNN's 1024-entry cache
    assert gemm_rows(2048) == 2048 and gemm_rows(33) == 34 and gemm_rows(1025) == 1088


@needs_onednn
@pytest.mark.parametrize("m", [1, 33, 100, 1025])
def test_padded_packed_linear_equals_f_linear(m):
    g = torch.Generator().manual_seed(m)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(m, 64, generator=g)
    out = packed_linear(x, _pack(w), b)
    assert out.shape == (m, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_warm_up_runs_every_bucket_once_per_weight_shape():
    llm = LLM("tiny", max_num_batched_tokens=64, max_num_seqs=8)
    ex = llm.engine.executor
    assert ex.prepacked
    sizes = len({gemm_rows(m) for m in range(1, 65)})          # 32 exact + 16 buckets in (32, 64]
    # Four distinct projection shapes in a Llama layer (qkv, o, gate_up, down), then the
    # LM head up to max_num_seqs rows.
    assert ex.warm_up() == 4 * sizes + 8
