"""Sampling: temperature, top-k, top-p, seeds, stop strings, EOS."""

from __future__ import annotations

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.request import Request
from minibatch.sampler import apply_top_k_top_p, draw_inverse_cdf, sample


def test_top_k_and_top_p_masks():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [2], [1.0])).tolist() == [[True, True, False, False]]
    # top_p=0.7: 0.5 alone < 0.7, 0.5+0.3 >= 0.7 -> keep two tokens.
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [-1], [0.7])).tolist() == [[True, True, False, False]]
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [-1], [0.1])).tolist() == [[True, False, False, False]]


def test_top_p_boundary_is_exact():
    """Keep the smallest set whose mass reaches p: a token whose strictly-more-likely mass
    equals top_p exactly is dropped (the set before it already reaches p). Probabilities
    0.5, 0.25, 0.25 are exact in float32, so the boundary is hit exactly."""
    z = torch.tensor([[0.0, -0.6931471805599453, -0.6931471805599453]])
    assert torch.softmax(z, -1).tolist() == [[0.5, 0.25, 0.25]]
    kept = lambda p: torch.isfinite(apply_top_k_top_p(z.clone(), [-1], [p])).tolist()[0]
    assert kept(0.5) == [True, False, False]
    assert kept(0.75) == [True, True, False]
    assert kept(0.7500001) == [True, True, True]
    assert kept(1.0) == [True, True, True]
    # top-k and top-p together: the tighter one wins, and the most likely token always stays.
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [2], [1.0])).tolist()[0] == [True, True, False]
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [1], [0.9])).tolist()[0] == [True, False, False]
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [-1], [1e-9])).tolist()[0] == [True, False, False]


def test_inverse_cdf_draw_never_picks_a_masked_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([[0.0], [0.4999], [0.5], [1.0 - 2 ** -53]], dtype=torch.float64)
    assert draw_inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]
    # Rows that do not sum to 1 (float32 softmax) are scaled, and an overshoot past the
    # end (u == 1) falls back to a token that has probability.
    assert draw_inverse_cdf(torch.tensor([[0.2, 0.3, 0.0]]), torch.tensor([[1.0]], dtype=torch.float64)).tolist() == [1]


def test_batched_unseeded_sampling_follows_each_rows_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [-1.0, 0.0, 3.0, 0.0]]).repeat(1500, 1)
    reqs = [Request(str(i), [1], SamplingParams(temperature=1.0), 0.0) for i in range(len(logits))]
    draws = torch.tensor(sample(logits, reqs)).view(1500, 2)
    for col in range(2):
        freq = torch.bincount(draws[:, col], minlength=4).float() / 1500
        assert torch.allclose(freq, torch.softmax(logits[col], -1), atol=0.04)


def test_sampling_follows_temperature_and_is_seeded():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draws = [sample(logits, [Request("r", [1], SamplingParams(temperature=1.0, seed=s), 0.0)])[0]
             for s in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, expected, atol=0.03)
    a = Request("a", [1], SamplingParams(temperature=0.8, seed=7), 0.0)
    b = Request("b", [1], SamplingParams(temperature=0.8, seed=7), 0.0)
    big = torch.randn(3, 50)
    row = big[1:2]
    # Same seed, different batch companions: the same draw.
    assert sample(big, [Request("x", [1], SamplingParams(temperature=1.0), 0.0), a,
                        Request("y", [1], SamplingParams(temperature=0.0), 0.0)])[1] == sample(row, [b])[0]


def test_top_k_1_is_greedy(checkpoints):
    path, _ = checkpoints["llama-gqa"]
    llm = LLM(str(path))
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    topk = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]
    s1 = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    s2 = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    assert s1[0].outputs[0].token_ids == s2[0].outputs[0].token_ids


def test_eos_stops_unless_ignored(checkpoints):
    path, _ = checkpoints["llama-gqa"]
    llm = LLM(str(path))
    full = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    toks = full.outputs[0].token_ids
    eos = toks[4]
    llm.engine.eos_token_ids = (eos,)
    cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert cut.outputs[0].token_ids == toks[:toks.index(eos) + 1]
    assert cut.outputs[0].finish_reason == "stop"
    kept = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert kept.outputs[0].token_ids == toks
    via_ids = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                       stop_token_ids=[eos]))[0]
    assert via_ids.outputs[0].stop_reason == eos


def test_stop_string_truncates_text():
    llm = LLM("tiny", max_num_seqs=4)
    # A seeded draw is reproducible, so the second run follows the first until the stop.
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Once upon a time"], params)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, seed=1234, max_tokens=24,
                                                         ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert cut.text == full.text[:full.text.find(stop)]


def test_a_row_that_breaks_the_sampler_fails_alone_and_seeded_rows_keep_their_draws():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)

    def reqs():
        bad = Request("bad", [1], SamplingParams(temperature=0.7), 0.0)
        bad.sampling_params.temperature = 10 ** 400         # past the validator: torch cannot hold it
        return [Request("s", [1], SamplingParams(temperature=0.8, top_p=0.9, seed=5), 0.0), bad,
                Request("g", [1], SamplingParams(temperature=0.0), 0.0)]

    with pytest.raises((RuntimeError, OverflowError)):
        sample(logits, reqs())
    errors = {}
    got = sample(logits, reqs(), errors)
    assert list(errors) == [1]
    alone = Request("s2", [1], SamplingParams(temperature=0.8, top_p=0.9, seed=5), 0.0)
    assert got[0] == sample(logits[0:1], [alone])[0]          # the seeded row: the draw of a clean run
    assert got[2] == int(logits[2].argmax())
