"""The model architecture, read from a Hugging Face ``config.json``.

One decoder covers the Llama family: Llama 2/3, Mistral, Qwen2 (bias on q/k/v) and
Qwen3 (RMSNorm on q and k per head, ``head_dim`` independent of ``hidden_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a ``transformers`` config object (or anything with the same attributes)."""
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = getattr(hf, "model_type", None)
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if model_type in by_type:
                arch = by_type[model_type]
            else:
                raise ValueError(
                    f"unsupported model architecture {archs or model_type!r}; minibatch runs "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_scaling = getattr(hf, "rope_scaling", None)
        rope_theta = getattr(hf, "rope_theta", None)
        rope_params = getattr(hf, "rope_parameters", None)
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}; minibatch supports default and llama3")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; minibatch supports silu (SwiGLU)")
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if kind == "qwen2":
            bias = True
        else:
            bias = bool(getattr(hf, "attention_bias", False))
        sliding = getattr(hf, "sliding_window", None) if kind == "mistral" else None
        if kind in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
            raise ValueError("Qwen sliding-window attention is not supported; set use_sliding_window=false")
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            attention_bias=bias,
            qk_norm=(kind == "qwen3"),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """``2 (K and V) * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
