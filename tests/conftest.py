"""Shared fixtures: small random Hugging Face checkpoints and a transformers reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Random weights from HF's N(0, 0.02) initialiser give near-uniform logits, where greedy
# choices are near-ties that float rounding can flip. A larger scale spreads the logits.
INIT_STD = 0.15

ARCHS = {
    # Llama with GQA (8 query heads over 2 KV heads), untied LM head.
    "llama-gqa": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=False),
    # Qwen2: q/k/v bias, tied embeddings, MQA (one KV head).
    "qwen2-mqa": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=512,
                      tie_word_embeddings=True, use_sliding_window=False),
    # Qwen3: RMSNorm on q and k, head_dim (32) independent of hidden_size / heads (16).
    "qwen3-qknorm": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256,
                         max_position_embeddings=512, tie_word_embeddings=False, use_sliding_window=False),
}


def make_checkpoint(path, arch: str, seed: int = 0, init_std: float = INIT_STD, **overrides):
    """Save a seeded random model of ``arch`` (config fields in ``overrides`` replaced) as a
    HF checkpoint directory; return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**ARCHS[arch], **overrides}
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, initializer_range=init_std, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 in HF; perturb them so a missing norm is caught
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers`` greedy ``generate`` on one prompt alone, never stopping early."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """``{arch: (path, hf_model)}`` for every architecture in ARCHS."""
    out = {}
    for i, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, make_checkpoint(path, arch, seed=i))
    return out


class FixedStepTime:
    """An executor wrapper: every step lasts ``seconds`` of virtual time. A real model's tokens
    with a clock that does not depend on how fast, or how busy, the machine is, so that
    time-dependent decisions (aging, windows) and their counts are the same on every run."""

    def __init__(self, inner, seconds: float = 0.01):
        self.inner = inner
        self.seconds = seconds

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch, kv):
        import dataclasses

        out = self.inner.execute(batch, kv)
        return dataclasses.replace(out, duration=self.seconds, forward_time=self.seconds)


def drive(engine, limit: int = 5000, before_step=None, after_step=None) -> int:
    """Step ``engine`` until nothing is left; fail after ``limit`` calls of ``step()``, whether
    or not they recorded a step (a guard on ``len(engine.steps)`` misses steps that ran nothing).
    ``before_step(i)`` may add requests and returns whether more will come."""
    for i in range(limit):
        more = before_step(i) if before_step is not None else False
        if not more and not engine.has_unfinished_requests():
            return i
        engine.step()
        if after_step is not None:
            after_step(engine)
    raise AssertionError(f"the engine still had work after {limit} calls of step()")
