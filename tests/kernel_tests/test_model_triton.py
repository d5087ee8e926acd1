"""The whole model on the Triton kernels generates what transformers generates.

A tiny random Llama (GQA: 4 query heads over 2 KV heads, head_dim 32) is saved as a
Hugging Face checkpoint; minibatch with ``attention_backend="triton"`` (the kernels in
the interpreter on CPU, compiled on a GPU) must reproduce ``generate``'s greedy tokens
for prompts of edge lengths, batched with chunked prefill so that steps mix decodes
with prefill chunks that sit after a cached prefix.
"""

from __future__ import annotations

import random

import pytest
import torch

BLOCK = 16
MAX_NEW = 8
PROMPT_LENS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 40)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         initializer_range=0.15)   # spread logits: greedy near-ties would be flaky
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(path))
    return path, model


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def test_triton_backend_matches_transformers(tiny_llama, device):
    from minibatch import LLM, SamplingParams

    path, hf_model = tiny_llama
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]
    expected = [_hf_greedy(hf_model, p) for p in prompts]

    llm = LLM(model=str(path), attention_backend="triton", device=device.type, dtype="float32",
              block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=24, enable_chunked_prefill=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    steps = llm.engine.steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no mixed decode + prefill step"
