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
