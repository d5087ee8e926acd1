"""minibatch.sim.model_specs: true architecture numbers, derived sizes, HF configs."""

import json
from pathlib import Path

import pytest

import minibatch.sim
from minibatch.sim import ModelSpec, available_models, get_model_spec

TINY_CONFIG = Path(minibatch.sim.__file__).resolve().parents[1] / "assets" / "tiny" / "config.json"

LLAMA2_7B_HF = {  # meta-llama/Llama-2-7b-hf config.json (abridged)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000,
}
LLAMA3_8B_HF = {
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
QWEN3_06B_HF = {
    "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}


def test_registry_names():
    assert set(available_models()) >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                                       "llama-3-70b", "mistral-7b", "qwen2.5-7b", "qwen3-0.6b", "tiny",
                                       "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-14b", "qwen2.5-32b"}


def test_kv_bytes_per_token():
    assert get_model_spec("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524288
    assert get_model_spec("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert get_model_spec("llama-2-13b").kv_bytes_per_token == 2 * 40 * 40 * 128 * 2


@pytest.mark.parametrize("name, billions", [
    ("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-2-70b", 68.98), ("llama-3-8b", 8.03),
    ("llama-3-70b", 70.55), ("mistral-7b", 7.24), ("qwen2.5-7b", 7.62), ("qwen3-0.6b", 0.596),
    ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("qwen2.5-14b", 14.7), ("qwen2.5-32b", 32.5),
])
def test_parameter_counts_match_published_sizes(name, billions):
    spec = get_model_spec(name)
    assert spec.num_params / 1e9 == pytest.approx(billions, rel=0.01)
    assert spec.weight_bytes == 2 * spec.num_params


def test_tiny():
    t = get_model_spec("tiny")
    assert (t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.intermediate_size,
            t.vocab_size, t.head_dim) == (256, 4, 8, 4, 688, 4096, 32)
    if TINY_CONFIG.exists():  # the registry entry describes the embedded checkpoint exactly
        assert ModelSpec.from_hf_config(TINY_CONFIG, name="tiny") == t


@pytest.mark.parametrize("name, cfg", [("llama-2-7b", LLAMA2_7B_HF), ("llama-3-8b", LLAMA3_8B_HF),
                                       ("qwen3-0.6b", QWEN3_06B_HF)])
def test_from_hf_config_dict_matches_registry(name, cfg):
    assert ModelSpec.from_hf_config(cfg, name=name) == get_model_spec(name)


def test_from_hf_config_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B_HF, "torch_dtype": "float32"}))
    spec = get_model_spec(str(tmp_path))  # a checkpoint directory works where a name does
    assert spec.dtype_bytes == 4 and spec.kv_bytes_per_token == 2 * 524288
    assert ModelSpec.from_hf_config(tmp_path / "config.json").num_layers == 32


def test_bad_inputs():
    with pytest.raises(ValueError, match="llama-2-7b.*tiny"):
        get_model_spec("gpt-5")
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelSpec.from_hf_config({k: v for k, v in LLAMA2_7B_HF.items() if k != "intermediate_size"})


@pytest.mark.parametrize("name, layers, kv_heads, head_dim, vocab", [
    ("llama-3.1-8b", 32, 8, 128, 128256), ("llama-3.1-70b", 80, 8, 128, 128256),
    ("qwen2.5-7b", 28, 4, 128, 152064), ("qwen2.5-14b", 48, 8, 128, 152064), ("qwen2.5-32b", 64, 8, 128, 152064),
])
def test_long_context_models_have_128k_positions_and_their_kv_shapes(name, layers, kv_heads, head_dim, vocab):
    spec = get_model_spec(name)
    assert spec.max_model_len == 131072 and spec.vocab_size == vocab
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (layers, kv_heads, head_dim)
    assert spec.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 2
    assert get_model_spec(name.replace("llama-3.1", "llama3.1")) is spec
