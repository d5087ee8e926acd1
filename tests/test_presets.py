"""Framework presets (``minibatch.presets``): what each sets, precedence, the CLI flag, and
greedy outputs under every preset equal to the default engine's and to transformers'."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest
import torch
from conftest import hf_greedy

from minibatch import LLM, TINY_MODEL_PATH, SamplingParams, presets
from minibatch.config import PRESET_NAMES, EngineConfig, add_engine_args, engine_kwargs

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def test_every_preset_names_its_framework_version_and_a_source_per_knob():
    assert tuple(presets.PRESETS) == PRESET_NAMES == ("vllm", "sglang", "trtllm", "tgi")
    for name in PRESET_NAMES:
        p = presets.get(name)
        assert p.version and p.framework
        assert {"policy", "admission", "enable_chunked_prefill", "max_num_batched_tokens"} <= set(p.settings())
        for knob in p.knobs:
            assert knob.name in FIELDS, f"{name}: {knob.name} is not an EngineConfig field"
            assert knob.source, f"{name}: {knob.name} has no source"
        EngineConfig(**p.settings()).validate()           # every preset is a valid configuration


def test_the_presets_follow_their_frameworks():
    s = presets.settings
    assert (s("vllm")["policy"], s("vllm")["admission"]) == ("continuous", "max_utilization")
    assert s("sglang")["admission"] == "conservative"
    assert (s("trtllm")["policy"], s("trtllm")["admission"], s("trtllm")["enable_chunked_prefill"]) == \
        ("trtllm", "guaranteed_no_evict", False)
    assert s("trtllm")["block_size"] == 32          # KvCacheConfig.tokens_per_block, the chunk unit too
    assert (s("tgi")["max_waiting_tokens"], s("tgi")["waiting_served_ratio"],
            s("tgi")["max_inflight_requests"], s("tgi")["max_num_batched_tokens"]) == (20, 0.3, 128, 4096)


def test_sources_name_what_the_cited_version_has():
    """Read in the frameworks' sources (chapter 20 lists them): vLLM v0.11.0 sets its batch defaults in
    EngineArgs._set_default_args (get_batch_defaults is a later name) and its CUDA block size in
    vllm/platforms/cuda.py; SGLang gives 8192 chunked-prefill tokens to an A100-80GB (60-160 GiB), not
    to every GPU from 35 GiB; TGI's prefill budget is computed from the GPU and capped by the context."""
    src = {name: {k.name: k.source for k in presets.get(name).knobs} for name in PRESET_NAMES}
    assert presets.get("vllm").version.startswith("v0.11.0")
    for knob in ("max_num_seqs", "max_num_batched_tokens"):
        assert "_set_default_args" in src["vllm"][knob] and "get_batch_defaults" not in src["vllm"][knob]
    assert "vllm/platforms/cuda.py" in src["vllm"]["block_size"]
    assert "60-160 GiB" in src["sglang"]["max_num_batched_tokens"]
    assert "35-90" not in src["sglang"]["max_num_batched_tokens"]
    assert "max_position_embeddings" in src["tgi"]["max_num_batched_tokens"]
    assert "A100-80GB" in presets.__doc__ and "under 70 GiB" not in presets.__doc__


def test_describe_lists_each_knob_with_value_and_source():
    text = presets.describe("tgi")
    assert "Text Generation Inference v3.3.7" in text
    lines = text.splitlines()
    for knob, value, source in presets.rows("tgi"):
        row = next(ln for ln in lines if ln.startswith(knob + " "))
        assert repr(value) in row and source in row
    assert len(presets.rows("tgi")) == len(presets.get("tgi").knobs)


@pytest.mark.parametrize("make", [lambda: presets.get("orca"), lambda: presets.describe("orca"),
                                  lambda: EngineConfig.from_kwargs(preset="orca"), lambda: LLM("tiny", preset="orca")])
def test_an_unknown_preset_names_the_choices(make):
    with pytest.raises(ValueError, match=r"orca.*vllm.*sglang.*trtllm.*tgi"):
        make()


def test_an_explicit_option_beats_the_preset():
    c = EngineConfig.from_kwargs(preset="trtllm", max_num_seqs=8, enable_chunked_prefill=True)
    assert (c.max_num_seqs, c.enable_chunked_prefill) == (8, True)          # given
    assert (c.policy, c.admission, c.max_num_batched_tokens) == ("trtllm", "guaranteed_no_evict", 8192)
    assert EngineConfig.from_kwargs(preset="tgi", policy="continuous").policy == "continuous"
    assert EngineConfig.from_kwargs(preset="trtllm", capacity_scheduler_policy="STATIC_BATCH").admission == \
        "static_batch"
    # The preset fills only what is missing: a copy with everything given keeps it all.
    assert c.replace(preset="vllm").max_num_seqs == 8
    assert EngineConfig.from_kwargs().preset is None and EngineConfig.from_kwargs().policy == "continuous"


def test_preset_is_a_flag_of_the_engine_commands():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--preset", "tgi", "--max-num-seqs", "4"])
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (c.preset, c.policy, c.max_num_seqs, c.max_inflight_requests) == ("tgi", "tgi", 4, 128)
    with pytest.raises(SystemExit):
        ap.parse_args(["--preset", "orca"])


# -- greedy outputs ----------------------------------------------------------------------------------
MAX_NEW = 12
PROMPT_LENS = (1, 15, 16, 17, 45, 100)
# Each preset as is, and squeezed (explicit options over the preset): a 112-token pool, small token
# budgets, chunked prefill on, so chunking, block rounding and (max_utilization) preemption happen.
VARIANTS = {"as-is": {},
            "squeezed": {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 24,
                         "enable_chunked_prefill": True, "max_num_seqs": 6},
            "unchunked": {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 128,
                          "enable_chunked_prefill": False, "max_num_seqs": 6}}


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL_PATH), local_files_only=True,
                                                 dtype=torch.float32).eval()
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]
    hf = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    default = LLM("tiny").generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in default] == hf
    return prompts, hf


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_greedy_outputs_are_the_same_under_every_preset(reference, preset, variant):
    prompts, expected = reference
    llm = LLM("tiny", preset=preset, **VARIANTS[variant])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.outputs[0].token_ids == ref, f"{preset}/{variant}: prompt of {len(prompt)} tokens diverged"
    assert llm.config.policy == presets.settings(preset)["policy"]
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_the_presets_command_prints_every_table_and_refuses_unknown_names(capsys):
    from minibatch.presets.__main__ import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"preset {name!r}" in out for name in PRESET_NAMES)
    assert main(["orca"]) == 2 and "orca" in capsys.readouterr().err


def test_tgi_prefill_budget_follows_the_launchers_formula():
    """TGI v3.3.7 launcher/src/main.rs: Config::flop counts three H-wide projections (Q, attention, O)
    and two H_kv-wide ones (K, V) per layer; the budget is the GPU's f16 FLOP/s over it, capped by the
    context, 4096 when the GPU is unknown."""
    from minibatch.presets import tgi
    from minibatch.sim import get_model_spec

    m = get_model_spec("llama-2-7b")
    h, d, heads, kv = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads
    five = 2 * heads * d * h + 2 * kv * d * h + 2 * kv * d * h + 2 * heads * d * h + 2 * heads * d * h
    assert tgi.flop_per_token(m) == (five + 2 * 3 * h * m.intermediate_size) * m.num_layers
    g = get_model_spec("llama-3-8b")
    assert tgi.default_max_batch_prefill_tokens("llama-2-7b") == 4096 == presets.settings("tgi")[
        "max_num_batched_tokens"]                        # 312e12 / 14.0e9 = 22,245, capped by the 4,096 context
    assert tgi.default_max_batch_prefill_tokens("llama-3-8b") == 8192       # capped by its 8,192 context
    assert tgi.default_max_batch_prefill_tokens("llama-2-7b", gpu="unknown") == 4096
    assert tgi.default_max_batch_prefill_tokens("llama-3-8b", gpu="t4") == int(65e12 // tgi.flop_per_token(g))


def test_vllm_serve_defaults_differ_from_the_llm_class_only_in_the_token_budget():
    """vLLM v0.11.0 EngineArgs._set_default_args: on an A100 UsageContext.OPENAI_API_SERVER gets 2048
    batched tokens (the LLM class 8192) and the same 256 sequences; the other frameworks' servers are
    their only entry point here."""
    assert presets.serve_settings("vllm") == {"max_num_batched_tokens": 2048}
    assert presets.settings("vllm", serve=True) == {**presets.settings("vllm"), "max_num_batched_tokens": 2048}
    assert presets.settings("vllm")["max_num_batched_tokens"] == 8192
    for name in ("sglang", "trtllm", "tgi"):
        assert presets.serve_settings(name) == {} and presets.settings(name, serve=True) == presets.settings(name)
    text = presets.describe("vllm")
    assert "as a server: max_num_batched_tokens = 2048" in text and "OPENAI_API_SERVER" in text
