"""Sampling: temperature, top-k, top-p, seeds, stop strings, EOS."""

from __future__ import annotations

import math

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kernels import cpu_paged
from minibatch.request import Request
from minibatch.sampler import (
    apply_min_p,
    apply_top_k_top_p,
    argmax_rows,
    draw_inverse_cdf,
    sample,
    token_logprobs,
)


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
    assert all(isinstance(t, int) for t in got), "the failed row's entry is meaningless but still a token id"
    alone = Request("s2", [1], SamplingParams(temperature=0.8, top_p=0.9, seed=5), 0.0)
    assert got[0] == sample(logits[0:1], [alone])[0]          # the seeded row: the draw of a clean run
    assert got[2] == int(logits[2].argmax())


# -- unit checks of each step, expected values worked out by hand ------------------------
def _first_uniform(seed: int) -> float:
    """The uniform number a request seeded with ``seed`` draws first: a float64 from its own
    ``torch.Generator().manual_seed(seed)``."""
    return torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).item()


def test_argmax_rows_is_the_last_dim_argmax_for_every_dtype_and_layout():
    rows = [[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]]                    # row maxima at 0 and 1
    assert argmax_rows(torch.tensor(rows)).tolist() == [0, 1]
    assert argmax_rows(torch.tensor(rows, dtype=torch.float64)).tolist() == [0, 1]
    assert argmax_rows(torch.tensor(rows, dtype=torch.bfloat16)).tolist() == [0, 1]
    transposed = torch.tensor(rows).t().contiguous().t()        # columns 2 floats apart
    assert transposed.stride() == (1, 2) and argmax_rows(transposed).tolist() == [0, 1]
    every_other = torch.tensor([[3.0, 9, 1, 9, 2, 9], [0, 9, 5, 9, 4, 9]])[:, ::2]
    assert every_other.stride(1) == 2 and argmax_rows(every_other).tolist() == [0, 1]
    assert argmax_rows(torch.tensor([1.0, 3.0, 2.0])).tolist() == 1   # one row, 1-D: a scalar index


def test_argmax_rows_takes_the_c_kernel_only_for_contiguous_float32_rows(monkeypatch):
    if cpu_paged.load() is None:
        pytest.skip("the C kernel is not built here")
    calls = []
    real = cpu_paged.argmax_rows_c
    monkeypatch.setattr(cpu_paged, "argmax_rows_c", lambda t: calls.append(tuple(t.shape)) or real(t))
    rows = [[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]]
    assert argmax_rows(torch.tensor(rows)).tolist() == [0, 1]
    assert calls == [(2, 3)], "a contiguous 2-D float32 tensor goes through the C kernel"
    argmax_rows(torch.tensor(rows, dtype=torch.float64))
    argmax_rows(torch.tensor(rows).t().contiguous().t())
    argmax_rows(torch.tensor([[3.0, 9, 1, 9, 2, 9]])[:, ::2])
    argmax_rows(torch.tensor([1.0, 3.0, 2.0]))
    assert calls == [(2, 3)], "float64, strided columns and 1-D tensors take torch's argmax"


def test_a_seeded_draw_uses_the_float64_uniform_of_its_own_generator():
    # 2**16 equal logits: each probability is 2**-16 exactly, the cumulative sums are k * 2**-16,
    # so the first whose sum exceeds u is token floor(u * 2**16).
    vocab = 2 ** 16
    logits = torch.zeros(1, vocab)
    for seed in range(20):
        req = Request("r", [1], SamplingParams(temperature=1.0, seed=seed), 0.0)
        assert sample(logits, [req]) == [math.floor(_first_uniform(seed) * vocab)], f"seed {seed}"


@pytest.mark.parametrize("logits,params,probs", [
    # temperature 2 halves the logits: [0, ln 3] -> probabilities 1/4, 3/4
    ([0.0, 2 * math.log(3)], {"temperature": 2.0}, [0.25, 0.75]),
    # temperature 0.5 doubles them: [0, ln 3] -> 1/4, 3/4
    ([0.0, math.log(3) / 2], {"temperature": 0.5}, [0.25, 0.75]),
    # top-k 2 of one row keeps the two largest: softmax of [3, 2] = e/(1+e), 1/(1+e)
    ([3.0, 2.0, 1.0, 0.0], {"temperature": 1.0, "top_k": 2}, [math.e / (1 + math.e), 1 / (1 + math.e), 0, 0]),
])
def test_seeded_draws_follow_the_distribution_worked_out_by_hand(logits, params, probs):
    cdf = [sum(probs[:i + 1]) for i in range(len(probs))]
    seen = set()
    for seed in range(100):
        u = _first_uniform(seed)
        if any(abs(u - c) < 1e-5 for c in cdf):
            continue                                            # too close to a boundary for float32
        expected = next(i for i, c in enumerate(cdf) if u < c)  # inverse CDF: first sum above u
        req = Request("r", [1], SamplingParams(seed=seed, **params), 0.0)
        assert sample(torch.tensor([logits]), [req]) == [expected], f"seed {seed}, u={u}"
        seen.add(expected)
    assert seen == {0, 1}, "the seeds reach both kept tokens"


def test_no_top_k_and_top_p_1_change_nothing():
    """A float32 softmax rounds the tail mass of [0, -30, -30] away (1 + 9e-14 == 1): with
    nothing to filter the logits still come back as they were, tail included."""
    z = torch.tensor([[0.0, -30.0, -30.0]])
    assert torch.equal(apply_top_k_top_p(z.clone(), [-1], [1.0]), z)


def test_top_k_drops_tokens_even_where_the_kept_mass_rounds_below_top_p_1():
    # softmax of [2, 0, 0] in float32 sums to 1 - 2**-24 < 1.0: the top-p test alone would keep
    # the two tokens past k, so only the top-k mask removes them.
    z = torch.tensor([[2.0, 0.0, 0.0, -1.0, -1.0]])
    assert torch.softmax(z[:, :3], -1).cumsum(-1)[0, -1] < 1.0
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [3], [1.0])).tolist() == [[True, True, True, False, False]]


def test_top_p_is_compared_in_the_logits_precision():
    """float64 logits: probabilities 1/2, 1/4, 1/4 exactly; top_p = 1/2 + 2**-30 (which float32
    would round to 1/2) is not reached by the first token alone, so the second stays."""
    z = torch.tensor([[0.0, -math.log(2), -math.log(2)]], dtype=torch.float64)
    assert torch.softmax(z, -1).tolist() == [[0.5, 0.25, 0.25]]
    assert torch.isfinite(apply_top_k_top_p(z.clone(), [-1], [0.5 + 2 ** -30])).tolist() == [[True, True, False]]


def test_inverse_cdf_sums_in_float64_scales_by_the_row_total_and_falls_back_per_row():
    f64 = {"dtype": torch.float64}
    # Cumulative sums 1, 1 + 1e-8, 2 + 1e-8 (float32 would round the second to 1): u * total =
    # 1 + 5e-9 falls in the tiny token's interval.
    assert draw_inverse_cdf(torch.tensor([[1.0, 1e-8, 1.0]]), torch.tensor([[0.5]], **f64)).tolist() == [1]
    # Total 4: u = 0.3 -> 1.2, past the first sum (1), before the second (2).
    assert draw_inverse_cdf(torch.tensor([[1.0, 1.0, 2.0]]), torch.tensor([[0.3]], **f64)).tolist() == [1]
    # Two rows: row 0 draws 2 (0.5 is past 0.1); row 1 overshoots onto a zero token and falls
    # back to its own most likely token (1), not to the batch's.
    probs = torch.tensor([[0.0, 0.1, 0.9], [0.2, 0.3, 0.0]])
    assert draw_inverse_cdf(probs, torch.tensor([[0.5], [1.0]], **f64)).tolist() == [2, 1]


# -- vLLM's further options: min_p, min_tokens, raw logprobs ---------------------------------
def _req(rid: str, outputs: int = 0, eos=(0,), **kw) -> Request:
    r = Request(rid, [1], SamplingParams(**kw), 0.0, eos_token_ids=eos)
    r.output_token_ids = [7] * outputs
    return r


def test_min_p_drops_tokens_below_min_p_times_the_largest_probability():
    # probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs): min_p 0.5 keeps >= 0.25
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(apply_min_p(z, [0.5]))[0].tolist()
    assert kept == [True, True, False, False]
    assert torch.isfinite(apply_min_p(z, [0.0])).all(), "0 keeps every token"
    assert torch.isfinite(apply_min_p(z, [1.0]))[0].tolist() == [True, False, False, False]
    # Row by row: the second row's min_p does not touch the first.
    two = apply_min_p(torch.cat([z, z]), [0.0, 0.9])
    assert torch.isfinite(two).sum(dim=-1).tolist() == [4, 1]


def test_min_p_is_applied_after_temperature_and_masked_tokens_are_never_drawn():
    # At T=1 token 2 has 0.15 < 0.5 * 0.5: dropped. At T=4 the distribution flattens
    # (0.5**.25 : 0.15**.25 = 1 : 0.74) and token 2 survives min_p 0.5.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    drawn_t1 = {sample(logits, [_req("a", temperature=1.0, min_p=0.5)])[0] for _ in range(300)}
    drawn_t4 = {sample(logits, [_req("b", temperature=4.0, min_p=0.5)])[0] for _ in range(300)}
    assert drawn_t1 <= {0, 1} and 2 in drawn_t4


def test_min_tokens_masks_eos_and_stop_tokens_until_reached_in_its_row_only():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0, 0.0]] * 3)   # argmax 0 (EOS), then 2, then 3
    below = _req("below", outputs=2, temperature=0.0, min_tokens=3, stop_token_ids=[2])
    reached = _req("reached", outputs=3, temperature=0.0, min_tokens=3, stop_token_ids=[2])
    plain = _req("plain", outputs=0, temperature=0.0)
    assert sample(logits, [below, reached, plain]) == [3, 0, 0]
    ignoring = _req("ignoring", outputs=0, temperature=0.0, min_tokens=1, ignore_eos=True)
    assert sample(logits[:1], [ignoring]) == [2], "EOS is masked even with ignore_eos, as in vLLM"
    assert float(logits[0, 0]) == 5.0, "the caller's logits are left untouched"
    sampled = _req("sampled", outputs=0, temperature=1.0, min_tokens=2, stop_token_ids=[2], seed=1)
    assert all(sample(logits[:1], [sampled])[0] not in (0, 2) for _ in range(200))


def test_logprobs_are_log_softmax_of_the_raw_logits_whatever_the_sampling():
    torch.manual_seed(3)
    logits = torch.randn(3, 40) * 3
    reqs = [_req("g", temperature=0.0, logprobs=4), _req("s", temperature=2.5, top_k=5, seed=9, logprobs=2),
            _req("none", temperature=0.0)]
    out: dict = {}
    tokens = sample(logits, reqs, logprobs=out)
    assert sorted(out) == [0, 1], "only rows that ask get log probabilities"
    for row, k in ((0, 4), (1, 2)):
        values = logits[row].double().tolist()
        lse = math.log(sum(math.exp(v) for v in values))
        want = [v - lse for v in values]
        lp, top = out[row]
        assert lp == pytest.approx(want[tokens[row]], abs=1e-5)
        order = sorted(range(40), key=lambda t: -want[t])[:k]
        assert [t for t, _ in top] == order
        assert [v for _, v in top] == pytest.approx([want[t] for t in order], abs=1e-5)
    assert tokens[0] == out[0][1][0][0], "greedy picks the most likely token"
    assert sample(logits[:1], reqs[:1], logprobs={}) == tokens[:1]


def test_logprobs_before_the_min_tokens_mask():
    """The mask changes the choice but not the reported distribution (vLLM's raw logprobs are
    taken before any logits processor): the EOS that cannot be chosen keeps its log probability."""
    logits = torch.tensor([[5.0, 1.0, 4.0]])
    out: dict = {}
    assert sample(logits, [_req("m", temperature=0.0, min_tokens=1, logprobs=1)], logprobs=out) == [2]
    lp, top = out[0]
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert lp == pytest.approx(float(raw[2]), abs=1e-6) and top[0][0] == 0


def test_logprobs_go_where_asked_and_only_to_rows_that_did_not_fail():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    reqs = [_req("a", temperature=0.0, logprobs=1), _req("b", temperature=0.0, logprobs=1)]
    # No dict to fill: the tokens alone (argmax per row: 1 and 0).
    assert sample(logits, reqs) == [1, 0]
    # With failure isolation on and no row failing, every asking row gets its log probabilities.
    out: dict = {}
    assert sample(logits, reqs, errors={}, logprobs=out) == [1, 0]
    assert sorted(out) == [0, 1] and out[0][1][0][0] == 1 and out[1][1][0][0] == 0


def test_min_p_scales_by_each_rows_own_largest_probability():
    # Row 0: 0.8, 0.1, 0.1 -> min_p 0.5 keeps >= 0.4: token 0 only. Row 1: 0.4, 0.3, 0.3 -> keeps
    # >= 0.2: all three (scaled by the batch's largest, 0.8, it would keep token 0 only).
    z = torch.tensor([[0.8, 0.1, 0.1], [0.4, 0.3, 0.3]]).log()
    assert torch.isfinite(apply_min_p(z, [0.5, 0.5])).tolist() == [[True, False, False], [True, True, True]]


def test_min_p_is_compared_in_the_logits_precision():
    """float64 logits: probabilities 1/2, 1/4, 1/4 exactly; min_p = 1/2 + 2**-30 (which float32
    would round to 1/2) puts the threshold just above 1/4, so only the first token stays."""
    z = torch.tensor([[0.0, -math.log(2), -math.log(2)]], dtype=torch.float64)
    assert torch.softmax(z, -1).tolist() == [[0.5, 0.25, 0.25]]
    assert torch.isfinite(apply_min_p(z, [0.5 + 2 ** -30])).tolist() == [[True, False, False]]


def test_min_tokens_ignores_stop_ids_outside_the_vocabulary():
    # Vocabulary of 3: a stop id 3 (or more) cannot be produced, so there is nothing to mask for it.
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    r = _req("r", eos=(2,), temperature=0.0, min_tokens=2, stop_token_ids=[3, 7])
    assert sample(logits, [r]) == [1]                  # EOS (2) masked, the stop ids ignored


def test_zero_logprobs_reports_the_sampled_tokens_alone():
    row = torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), dim=-1)
    lp, top = token_logprobs(row, 1, 0)
    assert lp == pytest.approx(float(row[1])) and top == []
