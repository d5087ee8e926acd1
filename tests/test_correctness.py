"""Greedy outputs equal transformers ``generate``, token for token, whatever the batching."""

from __future__ import annotations

import random

import pytest

from conftest import ARCHS, drive, hf_greedy, make_checkpoint
from minibatch import LLM, SamplingParams

BLOCK = 16
MAX_NEW = 12
# 1 token, a block minus one, exactly a block, a block plus one, several blocks.
PROMPT_LENS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 45, 100)

CONFIGS = {
    "serial": dict(max_num_seqs=1),
    "batched": dict(max_num_seqs=16),          # on CPU: the C paged-decode kernel
    "torch-kernels": dict(max_num_seqs=16, attention_backend="torch"),
    "chunked": dict(max_num_seqs=16, max_num_batched_tokens=24, enable_chunked_prefill=True),
    "unchunked": dict(max_num_seqs=16, max_num_batched_tokens=128, enable_chunked_prefill=False),
    # 14 blocks of 8 tokens hold ~112 tokens: far less than the ~420 the batch needs.
    "preempting": dict(max_num_seqs=16, num_kv_blocks=14, block_size=8),
}


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for arch, (path, hf_model) in checkpoints.items():
        rng = random.Random(hash(arch) % 1000)
        prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]
        refs[arch] = (path, prompts, [hf_greedy(hf_model, p, MAX_NEW) for p in prompts])
    return refs


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(references, arch, config):
    path, prompts, expected = references[arch]
    llm = LLM(str(path), block_size=CONFIGS[config].get("block_size", BLOCK),
              **{k: v for k, v in CONFIGS[config].items() if k != "block_size"})
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
    if config == "preempting":
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the small pool should force preemption"
    engine = llm.engine
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_requests_arriving_mid_run_match(references):
    """Requests that join a running batch (continuous batching) still match."""
    path, prompts, expected = references["llama-gqa"]
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=40)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [engine.add_request(prompts[0], params)]
    pending = list(prompts[1:])

    def arrive(i):
        if pending and i % 3 == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        return bool(pending)

    drive(engine, limit=1000, before_step=arrive)
    assert [engine.output(i).outputs[0].token_ids for i in ids] == expected
    assert max(s.num_seqs for s in engine.steps) > 1
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.steps), "no mixed step"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_long_context_single_sequence_matches(tmp_path, arch):
    """A 700-token prompt alone: prefill in eleven 64-token tiles of the C prefill kernel,
    then decodes whose context is split over the threads (cpu backend) or not (torch)."""
    hf_model = make_checkpoint(tmp_path, arch, seed=3, max_position_embeddings=1024)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 256) for _ in range(700)]
    expected = hf_greedy(hf_model, prompt, MAX_NEW)
    for backend in ("cpu", "torch"):
        llm = LLM(str(tmp_path), max_num_seqs=1, block_size=BLOCK, attention_backend=backend)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == expected, f"{backend} diverged"
