"""Bad input gets a clear error naming the problem; everything else is still served."""

from __future__ import annotations

import json

import pytest

from minibatch import LLM, SamplingParams
from minibatch.config import EngineConfig


@pytest.fixture(scope="module")
def llm(checkpoints):
    path, _ = checkpoints["llama-gqa"]
    return LLM(str(path), max_model_len=64, num_kv_blocks=6, block_size=16, max_num_seqs=8)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_and_others_served(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7], [], list(range(3, 70)), [5, 6, 7, 8], [3, 9999]]
    outs = llm.generate(prompts, params)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "rejected", "rejected", "length", "rejected"]
    assert "empty prompt" in outs[1].error
    assert "too long" in outs[2].error and "max_model_len" in outs[2].error
    assert "outside the vocabulary" in outs[4].error
    assert len(outs[0].outputs[0].token_ids) == 4 and len(outs[3].outputs[0].token_ids) == 4


def test_request_the_cache_can_never_hold(llm):
    # 6 blocks of 16 tokens = 96 slots; 60 + 50 tokens would need 4 blocks... use max_model_len cap.
    engine = llm.engine
    with pytest.raises(ValueError, match="too long"):
        engine.add_request(list(range(3, 67)), SamplingParams(max_tokens=1))
    small = LLM(llm.config.model, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        small.engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=40))
    out = small.generate([list(range(3, 30))], SamplingParams(max_tokens=40))[0]
    assert out.outputs[0].finish_reason == "rejected" and "can never be served" in out.error


def test_empty_text_prompt(llm):
    with pytest.raises(ValueError, match="no tokenizer|empty prompt"):
        llm.engine.add_request("", SamplingParams())


def test_unknown_model_path_and_unsupported_config(tmp_path):
    with pytest.raises(ValueError, match="neither 'tiny' nor a local directory"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, words", [
    (dict(policy="no-such-policy"), "unknown scheduling policy"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(kv_allocator="buddy"), "kv_allocator"),
    (dict(max_wait_ms=-1), "max_wait_ms"),
])
def test_invalid_engine_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        cfg = EngineConfig.from_kwargs(**kwargs)
        from minibatch.policies import make_policy
        make_policy(cfg.policy)


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_kwargs(max_num_sequences=4)


# -- one validator: type, range and finiteness of every sampling field ----------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 10 ** 400),
    ("temperature", "0.5"), ("temperature", True), ("top_p", float("nan")), ("top_p", -float("inf")),
    ("top_p", 10 ** 400), ("top_k", 1.5), ("top_k", True), ("top_k", -2), ("max_tokens", True),
    ("max_tokens", 2.0), ("ignore_eos", 1), ("stop", 3), ("stop", ["a", 3]), ("seed", 2 ** 64),
    ("seed", -(2 ** 63) - 1), ("seed", "7"), ("seed", 1.0), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]), ("stop_token_ids", 5), ("stop", ["x"] * 65), ("stop_token_ids", [3] * 257),
])
def test_each_field_is_checked_by_type_range_and_finiteness(field, value):
    from minibatch.sampling_params import InvalidParameter

    with pytest.raises(InvalidParameter, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert len(str(e.value)) < 200                         # a huge value is summarised, not printed


def test_the_edges_of_each_range_are_accepted():
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1 and SamplingParams(seed=-(2 ** 63)).seed
    assert SamplingParams(top_k=2 ** 70).top_k == 2 ** 70      # above the vocabulary: keeps every token
    assert SamplingParams(temperature=1e-7).greedy and not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(temperature=2).temperature == 2.0 and isinstance(SamplingParams(top_p=1).top_p, float)


def test_params_changed_after_construction_are_checked_when_added(llm):
    p = SamplingParams(max_tokens=4)
    p.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        llm.engine.add_request([5, 6, 7], p)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.engine.add_request([5, 6, 7], {"temperature": 0.0})
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("seed", [2 ** 64, -2 ** 63 - 1, "seven", 1.5])
def test_a_bad_seed_set_after_construction_rejects_only_that_prompt(llm, seed):
    """One SamplingParams of the batch gets a seed outside [-2**63, 2**64) (or not an integer)
    after construction: that prompt is rejected naming ``seed``, the other is served."""
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bad = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    bad.seed = seed
    outs = llm.generate([[5, 6, 7], [5, 6, 8]], [good, bad])
    alone = llm.generate([[5, 6, 7]], good)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "rejected" and "seed" in outs[1].error
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_huge_top_k_is_served(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(top_k=2 ** 70, seed=1, max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


# -- isolation: a request whose part of a step fails is aborted alone -------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=8, ignore_eos=True)
CLEAN_PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _poisoned_generate(llm, poison):
    """generate(clean[0], POISON, clean[1]) where ``poison(engine, request)`` breaks the
    middle request after it passed validation."""
    engine, add = llm.engine, llm.engine.add_request
    marker = SamplingParams(temperature=0.5, max_tokens=8, ignore_eos=True)

    def add_request(prompt, params=None, **kw):
        rid = add(prompt, params, **kw)
        if params is marker:
            poison(engine, engine.requests[rid])
        return rid

    engine.add_request = add_request
    try:
        return llm.generate([CLEAN_PROMPTS[0], [12, 13, 14], CLEAN_PROMPTS[1]], [GREEDY, marker, SEEDED])
    finally:
        del engine.add_request


def test_a_request_whose_sampling_fails_is_aborted_alone(llm):
    clean = _tokens(llm.generate(CLEAN_PROMPTS, [GREEDY, SEEDED]))

    def poison(engine, req):           # a value the validator would refuse, set behind its back
        req.sampling_params = SamplingParams(temperature=0.5, max_tokens=8, ignore_eos=True)
        req.sampling_params.temperature = 10 ** 400

    outs = _poisoned_generate(llm, poison)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "length"]
    assert "OverflowError" in outs[1].error and outs[0].error is None and outs[2].error is None
    assert _tokens([outs[0], outs[2]]) == clean              # greedy and seeded: a clean run's tokens
    assert not llm.engine.requests and llm.engine.kv.num_used_blocks == 0
    assert _tokens(llm.generate(CLEAN_PROMPTS, [GREEDY, SEEDED])) == clean


def test_a_request_whose_forward_fails_is_aborted_alone(llm):
    clean = _tokens(llm.generate(CLEAN_PROMPTS, [GREEDY, SEEDED]))
    executor = llm.engine.executor
    execute, calls = executor.execute, []

    def execute_failing_for_the_poison(batch, kv):
        calls.append(batch.num_seqs)
        if any(r.policy_state.get("poison") for r, _ in batch.items):
            raise RuntimeError("kernel failure")
        return execute(batch, kv)

    executor.execute = execute_failing_for_the_poison
    try:
        outs = _poisoned_generate(llm, lambda engine, req: req.policy_state.update(poison=True))
    finally:
        del executor.execute
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "length"]
    assert "kernel failure" in outs[1].error and outs[1].outputs[0].token_ids == []
    assert _tokens([outs[0], outs[2]]) == clean
    assert 1 in calls and max(calls) == 3                     # the batch of 3 failed, then one by one
    assert not llm.engine.requests and llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("error", [RuntimeError("the step broke"), KeyboardInterrupt()])
def test_generate_leaves_nothing_behind_after_any_failure(llm, error):
    engine = llm.engine
    clean = _tokens(llm.generate(CLEAN_PROMPTS, [GREEDY, SEEDED]))
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise error
        return step()

    engine.step = failing_step
    try:
        with pytest.raises(type(error)):
            llm.generate(CLEAN_PROMPTS + [[20, 21]], GREEDY)
    finally:
        del engine.step
    assert not engine.requests and not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
    assert _tokens(llm.generate(CLEAN_PROMPTS, [GREEDY, SEEDED])) == clean


def test_prompts_of_the_wrong_type_are_rejected_and_nothing_leaks(llm):
    outs = llm.generate([[5, 6, 7], None, 3.5, b"ab", {"x": 1}, [1.0], (5, 6, 7)], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] + ["rejected"] * 5 + ["length"]
    assert all("prompt" in o.error for o in outs[1:6])
    assert outs[0].outputs[0].token_ids == outs[6].outputs[0].token_ids
    assert not llm.engine.requests and not llm.engine.finished
    again = llm.generate([[5, 6, 7]], GREEDY)
    assert len(again) == 1 and again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
