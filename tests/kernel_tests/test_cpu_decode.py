"""The fused C decode stack (minibatch/kernels/cpu_decode.c): same tokens, same hidden
states as the per-op path, taken only where it applies, and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kernels import cpu_paged
from minibatch.model import llama

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason=f"C kernels not built here: {cpu_paged.build_error}")


def _llm(monkeypatch, fused: bool, **kw) -> LLM:
    monkeypatch.setenv("MINIBATCH_FUSED_DECODE", "1" if fused else "0")
    return LLM("tiny", **kw)


def _prompts(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 4000, int(rng.integers(3, 150))).tolist() for _ in range(n)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("max_num_seqs, rows", [(1, None), (2, None), (5, None), (40, 32), (70, None)],
                         ids=["1", "2", "5", "40-past-32-rows", "70"])
def test_fused_decode_gives_the_per_op_tokens(monkeypatch, threads, max_num_seqs, rows):
    if rows is not None:                           # a lower bound, so larger steps keep the per-op path
        monkeypatch.setattr(llama, "SMALL_M_ROWS", rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompts = _prompts(max(7, max_num_seqs + 4), seed=max_num_seqs)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        fused = _llm(monkeypatch, True, max_num_seqs=max_num_seqs)
        assert fused.engine.executor.fused_decode
        calls = []
        real_call = llama.FusedDecode.__call__
        monkeypatch.setattr(llama.FusedDecode, "__call__",
                            lambda self, ids, *a: calls.append(ids.shape[0]) or real_call(self, ids, *a))
        got = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
        plain = _llm(monkeypatch, False, max_num_seqs=max_num_seqs)
        assert not plain.engine.executor.fused_decode
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert got == want
        assert calls and max(calls) <= min(max_num_seqs, llama.SMALL_M_ROWS)
        steps = fused.engine.steps
        small = sum(1 for s in steps if s.num_decode_seqs == s.num_seqs and 0 < s.num_seqs <= llama.SMALL_M_ROWS)
        assert len(calls) == small                # every small decode-only step, and only those
        if max_num_seqs > llama.SMALL_M_ROWS:    # larger decode batches keep the per-op path
            assert any(s.num_decode_seqs == s.num_seqs > llama.SMALL_M_ROWS for s in steps)
    finally:
        torch.set_num_threads(before)


def test_fused_decode_hidden_states_equal_the_per_op_forward(monkeypatch):
    llm = _llm(monkeypatch, True)
    ex = llm.engine.executor
    model = ex.model
    # Two sequences with cached prompts: run the prompts, then one decode step both ways.
    for p in _prompts(2, seed=9):
        llm.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.engine.step()                                     # the prefills
    batch = llm.engine.scheduler.schedule(llm.engine.clock.now())
    assert batch.num_seqs == 2 and all(n == 1 for _, n in batch.items)
    ids, pos, meta, _, _ = ex.prepare(batch, llm.engine.kv)
    with torch.inference_mode():
        fused = model(ids, pos, meta, ex.kv_caches).clone()
        saved, model._fused_decode = model._fused_decode, None
        plain = model(ids, pos, meta, ex.kv_caches)
        model._fused_decode = saved
    assert torch.equal(fused, plain)


def test_fused_decode_rejects_bad_ids_and_slots(monkeypatch):
    llm = _llm(monkeypatch, True)
    ex = llm.engine.executor
    llm.engine.add_request(_prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.engine.step()
    batch = llm.engine.scheduler.schedule(llm.engine.clock.now())
    ids, pos, meta, _, _ = ex.prepare(batch, llm.engine.kv)
    vocab = ex.model.embed_tokens.weight.shape[0]
    with torch.inference_mode():
        with pytest.raises(IndexError, match="outside the vocabulary"):
            ex.model(torch.tensor([vocab]), pos, meta, ex.kv_caches)
        num_slots = ex.kv_caches[0][0].shape[0] * ex.kv_caches[0][0].shape[1]
        meta.slot_mapping = torch.tensor([num_slots])
        with pytest.raises(IndexError, match="outside the KV cache"):
            ex.model(ids, pos, meta, ex.kv_caches)


def test_fused_decode_is_off_where_it_does_not_apply(monkeypatch):
    assert not _llm(monkeypatch, True, attention_backend="torch").engine.executor.fused_decode
    assert not _llm(monkeypatch, False).engine.executor.fused_decode
    monkeypatch.setattr(llama, "SMALL_M_ROWS", 0)
    llm = _llm(monkeypatch, True)
    # No small-m projections, no panels: nothing to fuse.
    assert not llm.engine.executor.fused_decode


def _counters():
    c = cpu_paged.decode_helper_counters()
    return {n: c[n] for n in ("decode_helper_steps", "decode_backoffs")}


@pytest.fixture
def helper_llm(monkeypatch):
    """A fused-decode LLM with the helper thread allowed (torch's threads sleep); the
    test sets the thread count, restored afterwards."""
    import minibatch

    before = torch.get_num_threads()
    monkeypatch.setattr(minibatch, "OMP_THREADS_SLEEP", True)
    yield _llm(monkeypatch, True)
    torch.set_num_threads(before)


def test_small_steps_also_run_alone_to_compare_and_give_the_same_tokens(helper_llm):
    """At one or two rows the step keeps timing both ways (with the helper and alone) and
    runs the faster, trying the other every 16th step: some steps run alone, and the
    tokens are those of one thread."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    torch.set_num_threads(1)
    want = [o.outputs[0].token_ids for o in helper_llm.generate(_prompts(1, seed=3), params)]
    torch.set_num_threads(2)
    c0 = cpu_paged.decode_helper_counters()
    got = [o.outputs[0].token_ids for o in helper_llm.generate(_prompts(1, seed=3), params)]
    c1 = cpu_paged.decode_helper_counters()
    assert got == want
    # 47 one-row steps: in every 16 consecutive ones at least one ran each way, unless a
    # long wait (a loaded machine) sent steps to the caller alone anyway.
    assert c1["decode_alone_steps"] > c0["decode_alone_steps"] or c1["decode_backoffs"] > c0["decode_backoffs"]
    assert c1["decode_helper_steps"] > c0["decode_helper_steps"] or c1["decode_backoffs"] > c0["decode_backoffs"]


def test_the_helper_thread_is_offered_the_step_only_with_several_threads(monkeypatch, helper_llm):
    import minibatch

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    torch.set_num_threads(1)
    c0 = _counters()
    helper_llm.generate(_prompts(1), params)
    assert _counters() == c0                       # one thread: the caller alone, no helper at all
    torch.set_num_threads(2)
    helper_llm.generate(_prompts(1), params)
    c1 = _counters()
    # Each small step either ran with the helper or ran alone after a long wait (a loaded machine).
    assert c1["decode_helper_steps"] + c1["decode_backoffs"] > c0["decode_helper_steps"] + c0["decode_backoffs"]
    # Beside spinning OpenMP threads (OMP_WAIT_POLICY not PASSIVE) the helper stays out.
    monkeypatch.setattr(minibatch, "OMP_THREADS_SLEEP", False)
    helper_llm.generate(_prompts(1), params)
    assert _counters() == c1
