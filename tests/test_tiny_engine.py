"""The embedded tiny model through minibatch equals plain transformers, on text prompts."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from minibatch import LLM, TINY_MODEL_PATH, SamplingParams

PROMPTS = ["Once upon a time", "Lily went to the park", "从前，有一只小猫", "有一天，小明去公园玩"]


@pytest.fixture(scope="module")
def hf_tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL_PATH), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL_PATH), local_files_only=True,
                                                 dtype=torch.float32).eval()
    return tok, model


def test_text_prompts_match_transformers_in_both_languages(hf_tiny):
    tok, model = hf_tiny
    llm = LLM("tiny", max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model, ids, 24), prompt
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_stops_at_eos_unless_ignored(hf_tiny):
    llm = LLM("tiny")
    stopped = llm.generate(["从前，有一只小猫"], SamplingParams(temperature=0.0, max_tokens=300))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids[-1] in llm.engine.eos_token_ids
    n = len(stopped.outputs[0].token_ids)
    forced = llm.generate(["从前，有一只小猫"], SamplingParams(temperature=0.0, max_tokens=n + 5, ignore_eos=True))[0]
    assert forced.outputs[0].finish_reason == "length" and len(forced.outputs[0].token_ids) == n + 5
    assert forced.outputs[0].token_ids[:n] == stopped.outputs[0].token_ids


def test_chat_template_prompt_ends_with_im_end(hf_tiny):
    tok, _ = hf_tiny
    text = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": "What is your name?"}],
                                   tokenize=False, add_generation_prompt=True)
    out = LLM("tiny").generate([text], SamplingParams(temperature=0.0, max_tokens=100))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert tok.convert_ids_to_tokens(out.outputs[0].token_ids[-1]) == "<|im_end|>"
    assert len(out.outputs[0].text.split()) >= 3
