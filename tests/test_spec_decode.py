"""Speculative decoding inside the batch (minibatch.spec_decode): the n-gram drafter's rules,
greedy verification, the token budget, the draft length by batch size, KV rollback, stops
inside an accepted run, the counters, and greedy outputs equal with and without it (and HF)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import ARCHS, hf_greedy, make_checkpoint
from minibatch import LLM, LLMEngine, SamplingParams
from minibatch.config import EngineConfig
from minibatch.executor import StepOutput
from minibatch.policies import available
from minibatch.sim import make_cost_model
from minibatch.sim.spec_decode import best_draft_length, spec_step_speedup
from minibatch.request import Request
from minibatch.spec_decode import (accepted_tokens, can_speculate, draft_length, expected_tokens_per_step,
                                   lookup_range, max_drafts, propose_ngram)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
# Repetitive prompts (prompt lookup finds the pattern) and one that never repeats.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, [20, 21, 22, 23] * 10, list(range(30, 90)),
           [40, 41, 42] * 9 + [7, 8]]


# -- the n-gram drafter (vLLM v0.11.0 _find_longest_matched_ngram_and_propose_tokens) ----------
def test_ngram_docstring_example_of_vllm():
    # vLLM's own example: [4,2,3] (max_n = 3) has no earlier match, [2,3] has: the 3 tokens after it.
    assert propose_ngram([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4) == [4, 2, 3]


def test_ngram_prefers_the_longest_match():
    tokens = [3, 2, 9, 1, 2, 8, 1, 2]
    assert propose_ngram(tokens, min_n=1, max_n=2, k=3) == [8, 1, 2]     # [1, 2] matched
    assert propose_ngram(tokens, min_n=1, max_n=1, k=3) == [9, 1, 2]     # [2] alone: its first place


def test_ngram_takes_the_earliest_occurrence():
    assert propose_ngram([1, 2, 5, 1, 2, 6, 1, 2], min_n=2, max_n=2, k=3) == [5, 1, 2]


def test_ngram_respects_min_n_k_and_the_end_of_the_sequence():
    assert propose_ngram([1, 2, 3, 4, 9, 4], min_n=2, max_n=3, k=3) == []
    assert propose_ngram([1, 2, 3, 4, 9, 4], min_n=1, max_n=3, k=3) == [9, 4]
    assert propose_ngram([1, 1, 1], min_n=1, max_n=1, k=5) == [1, 1]     # overlapping, cut at the end
    assert propose_ngram([7, 8, 7, 8, 7], min_n=1, max_n=2, k=1) == [8]      # [8, 7] first at 1
    assert propose_ngram([7], min_n=1, max_n=1, k=3) == []
    assert propose_ngram([1, 2, 1, 2], min_n=1, max_n=2, k=0) == []


def test_lookup_range_defaults_as_vllm():
    assert lookup_range(None, None) == (5, 5)
    assert lookup_range(2, None) == (2, 2)
    assert lookup_range(None, 3) == (3, 3)
    assert lookup_range(1, 4) == (1, 4)


def test_greedy_verification_accepts_the_matching_prefix_plus_one():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]      # all accepted + bonus
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]            # stop at the first mismatch
    assert accepted_tokens([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted_tokens([], [3]) == [3]
    with pytest.raises(ValueError, match="one target token more"):
        accepted_tokens([1, 2], [1, 2])


def test_drafts_stop_at_max_tokens_and_max_model_len_and_only_greedy_requests_draft():
    req = Request("r", [1] * 10, SamplingParams(temperature=0.0, max_tokens=8), 0.0)
    req.output_token_ids = [1] * 5                       # 3 tokens left: at most 2 drafts
    assert max_drafts(req, None) == 2 and max_drafts(req, 17) == 1 and max_drafts(req, 16) == 0
    assert can_speculate(req)
    assert not can_speculate(Request("s", [1], SamplingParams(temperature=0.7), 0.0))
    assert not can_speculate(Request("l", [1], SamplingParams(temperature=0.0, logprobs=2), 0.0))
    assert not can_speculate(Request("m", [1], SamplingParams(temperature=0.0, min_tokens=3), 0.0))


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_draft_length_by_batch_size():
    table = [[1, 4, 3], [9, 16, 1]]
    assert [draft_length(3, table, b) for b in (1, 4, 5, 8, 9, 16, 17, 500)] == [3, 3, 3, 3, 1, 1, 1, 1]
    assert draft_length(2, table, 1) == 2                  # clamped to num_speculative_tokens
    assert draft_length(4, [[3, 8, 1]], 2) == 4            # below the first range
    assert draft_length(2, None, 100) == 2


@pytest.mark.parametrize("bad, field", [
    (dict(num_speculative_tokens=-1, speculative_method="ngram"), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2), "speculative_method"),
    (dict(speculative_method="eagle"), "speculative_method"),
    (dict(speculative_method="ngram", prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="ngram", num_speculative_tokens_per_batch_size=[[1, 4]]),
     "num_speculative_tokens_per_batch_size"),
    (dict(speculative_method="ngram", num_speculative_tokens_per_batch_size=[[1, 8, 2], [4, 9, 1]]),
     "overlap"),
    (dict(speculative_method="ngram", num_speculative_tokens_per_batch_size=[[2, 9, 1]]), "start at batch size 1"),
    (dict(spec_acceptance_rate=1.5), "spec_acceptance_rate"),
])
def test_bad_speculative_options_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**bad)


# -- the real model: greedy outputs stay exact ---------------------------------------------------
def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain_tokens():
    return _tokens(LLM("tiny", max_num_seqs=8), PROMPTS)


@pytest.mark.parametrize("policy", available())
def test_greedy_outputs_equal_with_speculation_under_every_policy(plain_tokens, policy):
    llm = LLM("tiny", max_num_seqs=8, policy=policy, **SPEC)
    assert _tokens(llm, PROMPTS) == plain_tokens
    m = llm.engine.spec_decode_metrics()
    # Drafts were proposed, some accepted and some rejected: the run exercised both paths.
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("options", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=24),
    dict(enable_prefix_caching=True, block_size=4),
    dict(num_kv_blocks=16, block_size=8),            # too few blocks: preemption and recompute
    dict(attention_backend="torch"),                 # the verify chunk through the torch kernels
    dict(preemption_mode="swap", num_kv_blocks=16, block_size=8),
    dict(kv_allocator="contiguous", max_model_len=128, num_kv_blocks=64),
    dict(enable_prefix_caching=True, kv_offload_blocks=32, num_kv_blocks=16, block_size=8),   # a host tier
])
def test_greedy_outputs_equal_with_chunking_prefix_caching_preemption_and_allocators(plain_tokens, options):
    llm = LLM("tiny", max_num_seqs=8, **SPEC, **options)
    prompts = PROMPTS + PROMPTS[:2] if options.get("enable_prefix_caching") else PROMPTS
    expected = plain_tokens + plain_tokens[:2] if options.get("enable_prefix_caching") else plain_tokens
    assert _tokens(llm, prompts) == expected
    assert llm.engine.spec_decode_metrics()["vllm:spec_decode_num_accepted_tokens"] > 0
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_outputs_equal_transformers_with_speculation(tmp_path, arch):
    hf_model = make_checkpoint(tmp_path, arch, seed=5)
    prompts = [[9, 10, 11, 12, 13] * 5, [50, 60] * 12 + [70], [3, 4, 5, 6, 7, 8, 9, 100, 101]]
    expected = [hf_greedy(hf_model, p, 24) for p in prompts]
    llm = LLM(str(tmp_path), max_num_seqs=4, **SPEC)
    assert _tokens(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) == expected
    assert llm.engine.spec_decode_metrics()["vllm:spec_decode_num_accepted_tokens"] > 0


def test_sampled_requests_do_not_speculate():
    llm = LLM("tiny", max_num_seqs=4, **SPEC)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True))
    assert llm.engine.spec_decode_metrics()["vllm:spec_decode_num_draft_tokens"] == 0


def _engine_run(prompts, params, **kw):
    """The finished requests of a tiny-model engine on a virtual clock (each step its own time)."""
    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", max_num_seqs=8, **kw), clock="virtual")
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, sorted(engine.finished, key=lambda r: int(r.request_id))


def test_accepted_counter_matches_the_tokens_each_step_appended():
    engine, finished = _engine_run(PROMPTS, GREEDY, **SPEC)
    # Tokens appended in one step share their time: every token beyond the first of a step is an
    # accepted draft.
    extra = sum(len(r.token_times) - len(set(r.token_times)) for r in finished)
    assert engine.spec_decode_metrics()["vllm:spec_decode_num_accepted_tokens"] == extra > 0


def test_max_tokens_inside_an_accepted_run_ends_the_request_there(plain_tokens):
    _, finished = _engine_run(PROMPTS[:1], GREEDY, **SPEC)
    out, times = finished[0].output_token_ids, finished[0].token_times
    assert out == plain_tokens[0]
    # A token inside a run of several appended in one step, not the run's last.
    j = next(i for i in range(len(out) - 1) if times[i] == times[i + 1])
    _, (length,) = _engine_run(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=j + 1, ignore_eos=True),
                               **SPEC)
    assert length.output_token_ids == plain_tokens[0][:j + 1]
    assert length.status.value == "length"


# -- the scheduler's rules, on a fake executor that checks the KV it reads --------------------------
def _next_token(ctx: list[int]) -> int:
    """A deterministic 'model': repeats the token three back, except every 7th position."""
    return ctx[-3] if len(ctx) % 7 and len(ctx) >= 3 else (ctx[-1] * 7 + len(ctx)) % 89 + 3


class SpecKVCheckingExecutor:
    """Writes each step's token ids (drafts included) into its slots, reads every position the
    request has computed back through its block table, and verifies drafts with _next_token."""

    model_config = None
    max_model_len = 4096

    def __init__(self, num_kv_blocks: int, block_size: int):
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        shape = (num_kv_blocks, block_size, 1, 1)
        self.kv_caches = [(torch.full(shape, -1.0), torch.full(shape, -1.0))]
        self.batches: list[list[tuple[str, int, int]]] = []    # per step: (request id, new tokens, drafts)

    def execute(self, batch, kv):
        bs = self.block_size
        k = self.kv_caches[0][0].view(-1).numpy()
        self.batches.append([(r.request_id, n, len(r.spec_token_ids)) for r, n in batch.items])
        sampled = []
        for req, n in batch.items:
            table = np.asarray(kv.block_table(req.request_id), dtype=np.int64)
            p0 = req.num_computed_tokens
            seq = req.all_token_ids[:p0 + n - len(req.spec_token_ids)] + req.spec_token_ids
            assert len(table) * bs >= p0 + n, "step writes beyond the request's blocks"
            pos = np.arange(p0 + n)
            slots = table[pos // bs] * bs + pos % bs
            k[slots[p0:]] = seq[p0:p0 + n]
            assert np.array_equal(k[slots], np.asarray(seq[:p0 + n], dtype=np.float32)), \
                f"request {req.request_id} reads corrupted KV"
            if req.spec_token_ids:
                base = p0 + 1
                targets = [_next_token(seq[:base + i]) for i in range(len(req.spec_token_ids) + 1)]
                sampled += [(req, t) for t in accepted_tokens(req.spec_token_ids, targets)]
            elif p0 + n == req.num_tokens:
                sampled.append((req, _next_token(seq)))
        return StepOutput(sampled, 0.001, 0.001)


def _fake_engine(num_kv_blocks=64, block_size=4, **kw):
    executor = SpecKVCheckingExecutor(num_kv_blocks, block_size)
    config = EngineConfig.from_kwargs(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                      **{"speculative_method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3, **kw})
    return LLMEngine(config, clock="virtual", executor=executor), executor


def _run(engine, prompts, max_tokens=30, after_step=None):
    for i, p in enumerate(prompts):
        n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), request_id=str(i))
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        if after_step is not None:
            after_step(engine)
    raise AssertionError("the engine did not finish")


def _reference(prompt, max_tokens=30):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(_next_token(seq))
    return seq[len(prompt):]


FAKE_PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [31, 32]]


def test_rollback_keeps_kv_exact_and_frees_the_rejected_blocks():
    engine, _ = _fake_engine()
    held = []

    def check(e):
        e.kv.check_invariants()
        for r in e.scheduler.running:       # no block beyond what the request's tokens need
            held.append(len(e.kv.block_table(r.request_id)) <= e.kv.blocks_for(r.num_tokens))

    _run(engine, FAKE_PROMPTS, after_step=check)
    m = engine.spec_decode_metrics()
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]
    assert held and all(held)
    for r in engine.finished:
        assert r.output_token_ids == _reference(FAKE_PROMPTS[int(r.request_id)])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_rollback_under_preemption_and_prefix_caching():
    engine, _ = _fake_engine(num_kv_blocks=14, enable_prefix_caching=True)
    _run(engine, FAKE_PROMPTS * 2, after_step=lambda e: e.kv.check_invariants())
    assert engine.scheduler.num_preemptions > 0
    for r in engine.finished:
        assert r.output_token_ids == _reference(FAKE_PROMPTS[int(r.request_id) % len(FAKE_PROMPTS)])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_drafts_count_against_the_budget_and_never_take_a_later_decodes_token():
    engine, executor = _fake_engine(max_num_batched_tokens=6, max_num_seqs=3)
    for i, p in enumerate([[31, 32], [11, 12], [3, 4]]):      # one 6-token prefill, then three decodes
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), request_id=str(i))
    for _ in range(12):
        engine.step()
    assert all(sum(n for _, n, _ in b) <= 6 for b in executor.batches)
    assert len(engine.scheduler.running) == 3
    batch = engine.scheduler.schedule(engine.clock.now())
    # The three decodes run together; the drafts take only the 6 - 3 tokens the decodes leave.
    assert len(batch.items) == 3 and batch.num_tokens == 6
    assert sum(len(r.spec_token_ids) for r, _ in batch.items) == 3


def test_draft_length_follows_the_batch_size_table():
    table = [[1, 2, 3], [3, 512, 0]]
    engine, executor = _fake_engine(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=table)
    _run(engine, FAKE_PROMPTS, max_tokens=[10, 12, 40, 40])   # k = 0 while 3+ run, up to 3 once 2 are left
    drafts_at = {}
    for b in executor.batches:
        for _, _, d in b:
            drafts_at.setdefault(len(b), set()).add(d)
    assert drafts_at[4] == {0}
    assert max(drafts_at.get(1, {0}) | drafts_at.get(2, {0})) == 3
    assert all(d <= 3 for s in drafts_at.values() for d in s)


def test_drafts_never_run_past_max_tokens():
    engine, executor = _fake_engine()
    _run(engine, FAKE_PROMPTS, max_tokens=5)
    assert all(len(r.output_token_ids) == 5 for r in engine.finished)
    # A request with r tokens left carries at most r - 1 drafts: none is computed for nothing.
    assert engine.spec_decode_metrics()["vllm:spec_decode_num_draft_tokens"] <= 4 * 4



def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    engine, _ = _fake_engine()
    _run(engine, FAKE_PROMPTS[:1])
    (req,) = engine.finished
    out, times = req.output_token_ids, req.token_times
    # A token inside a run appended in one step (not the run's last), not generated before.
    j = next(i for i in range(len(out) - 1) if times[i] == times[i + 1] and out[i] not in out[:i])
    engine, _ = _fake_engine()
    engine.add_request(FAKE_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[out[j]]))
    while engine.has_unfinished_requests():
        engine.step()
    (stopped,) = engine.finished
    assert stopped.output_token_ids == _reference(FAKE_PROMPTS[0])[:j + 1]
    assert stopped.status.value == "stop" and stopped.stop_reason == out[j]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


# -- the simulator's model ------------------------------------------------------------------------
def test_simulator_accepts_at_the_given_rate():
    rates = {}
    for a in (0.0, 1.0, 0.6):
        engine = LLMEngine(EngineConfig.from_kwargs(model="llama-3.1-8b", executor="sim", hardware="h100",
                                                    speculative_method="ngram", num_speculative_tokens=3,
                                                    spec_acceptance_rate=a), clock="virtual")
        for i in range(8):
            engine.add_request([7] * 64, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        m = engine.spec_decode_metrics()
        rates[a] = m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_draft_tokens"]
        assert all(r.num_output_tokens == 200 for r in engine.finished)
    assert rates[0.0] == 0.0 and rates[1.0] == 1.0
    # Per draft accepted: a(1 - a^k) / ((1 - a) k) for independent drafts until the first rejection.
    assert rates[0.6] == pytest.approx(0.6 * (1 - 0.6 ** 3) / (0.4 * 3), abs=0.05)


def test_simulated_speedup_falls_as_the_batch_grows():
    cm = make_cost_model("llama-3.1-8b", "h100")
    speed = [spec_step_speedup(cm, b, 256, 3, 0.6)["speedup"] for b in (1, 16, 256, 1024)]
    assert speed[0] > 1.5 and speed[-1] < 1.0          # pays when memory-bound, costs when compute-bound
    assert speed == sorted(speed, reverse=True)
    assert best_draft_length(cm, 1, 256, 0.6) > best_draft_length(cm, 1024, 256, 0.6)
    # A long context keeps the step memory-bound (the KV read does not grow with the drafts).
    assert spec_step_speedup(cm, 1024, 4096, 3, 0.6)["speedup"] > 1.0


def test_metrics_page_has_vllms_spec_decode_counters_only_when_speculating():
    from minibatch.serving.metrics import ServingMetrics, engine_gauges
    from minibatch.serving.scrape import parse_page

    pages = {}
    for method in (None, "ngram"):
        kw = dict(speculative_method="ngram", num_speculative_tokens=3) if method else {}
        engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", **kw))
        for i in range(3):
            engine.add_request([5, 6, 7, 8] * 6 + [9 + i], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        pages[method] = (engine, parse_page(ServingMetrics("tiny").render(engine_gauges(engine), 0)))
    labels = (("engine", "0"), ("model_name", "tiny"))
    engine, page = pages["ngram"]
    counts = engine.spec_decode_metrics()
    assert counts["vllm:spec_decode_num_draft_tokens"] > 0
    for name, value in counts.items():
        assert page[(name + "_total", labels)] == value
    assert not any(name.startswith("vllm:spec_decode") for name, _ in pages[None][1])
