"""Model architectures the simulator knows, by name, and from any HF ``config.json``.

A :class:`ModelSpec` is the handful of numbers that decide a decoder-only transformer's
cost: layer count, widths, head layout and vocabulary. Registry entries use the true
architecture numbers from each model's Hugging Face ``config.json``.

Parameter count (Llama family: RMSNorm, SwiGLU MLP, no biases)::

    per layer  = h * (n_heads * d)          # W_q
               + 2 * h * (n_kv_heads * d)   # W_k, W_v
               + (n_heads * d) * h          # W_o
               + 3 * h * i                  # gate, up, down
               + 2 * h                      # two RMSNorm weights
    total      = L * per_layer + V * h * (1 if tied else 2) + h   # embeddings, LM head, final norm

(Qwen2's q/k/v biases and Qwen3's q/k norms add < 0.01 % and are left out.)

Weight-only quantization (W8A16 such as GPTQ/AWQ-int8, W4A16 such as AWQ/GPTQ-int4):
``weight_dtype_bytes`` is the bytes per weight of the layers' matmuls (1 for int8 / fp8, 0.5 for
int4, scales ignored); embeddings, the LM head and the norms keep ``dtype_bytes`` (vLLM's AWQ and
GPTQ leave ``lm_head`` unquantized), and so do activations and the KV cache::

    weight_bytes = L * linear * weight_dtype_bytes + (L * 2h + V*h*(1 if tied else 2) + h) * dtype_bytes

``None`` (the default) means ``dtype_bytes``: an unquantized checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (Llama/Mistral/Qwen2/Qwen3 layout)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    max_model_len: int = 4096
    weight_dtype_bytes: float | None = None   # the matmuls' weights, if quantized (see module doc)

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "dtype_bytes", "max_model_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be >= 1")
        wb = self.weight_dtype_bytes
        if wb is not None and not (isinstance(wb, (int, float)) and 0 < wb <= self.dtype_bytes):
            raise ValueError(f"ModelSpec {self.name!r}: weight_dtype_bytes must be in (0, dtype_bytes="
                             f"{self.dtype_bytes}], got {wb!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec {self.name!r}: num_heads ({self.num_heads}) must be a "
                             f"multiple of num_kv_heads ({self.num_kv_heads})")

    # -- derived sizes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """Weights in one layer's matmuls: ``h*(q + 2kv) + q*h + 3*h*i``."""
        h = self.hidden_size
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        """All parameters: ``L*(linear + 2h) + V*h*(1 if tied else 2) + h``."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (self.layer_linear_params + 2 * h) + embed + h

    @property
    def linear_weight_bytes_per_param(self) -> float:
        """Bytes per weight of the layers' matmuls: ``weight_dtype_bytes``, else ``dtype_bytes``."""
        return self.dtype_bytes if self.weight_dtype_bytes is None else self.weight_dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """``num_params * dtype_bytes``; with quantized matmul weights, those count
        ``weight_dtype_bytes`` each (module doc)."""
        if self.weight_dtype_bytes is None:
            return self.num_params * self.dtype_bytes
        linear = self.num_layers * self.layer_linear_params
        return math.ceil(linear * self.weight_dtype_bytes + (self.num_params - linear) * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies, all layers:

            kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes

        (the 2 is K and V). Llama-2-7B: 2*32*32*128*2 = 524,288 B = 0.5 MiB;
        Llama-3-8B (GQA, 8 KV heads): 2*32*8*128*2 = 131,072 B.
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        n = self.num_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        quant = "" if self.weight_dtype_bytes is None else f", matmul weights {self.weight_dtype_bytes:g} B"
        return (f"{self.name}: {size} params ({self.weight_bytes / 1e9:.2f} GB{quant}), "
                f"L={self.num_layers} h={self.hidden_size} heads={self.num_heads}/{self.num_kv_heads} "
                f"d={self.head_dim} i={self.intermediate_size} V={self.vocab_size}, "
                f"KV {self.kv_bytes_per_token / 1024:.0f} KiB/token")

    # -- from a Hugging Face config -------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any],
                       name: str | None = None) -> "ModelSpec":
        """Read a HF ``config.json`` (a dict, the file, or the checkpoint directory).

        Missing ``num_key_value_heads`` means MHA; missing ``head_dim`` means
        ``hidden_size // num_attention_heads``; ``torch_dtype``/``dtype`` gives dtype_bytes
        (default 2). Multimodal configs are read through their ``text_config``.
        """
        if isinstance(path_or_dict, dict):
            cfg = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            name = name or os.path.basename(os.path.dirname(os.path.abspath(path)))
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = {**cfg, **cfg["text_config"]}
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            layers, inter, vocab = (int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]),
                                    int(cfg["vocab_size"]))
        except KeyError as e:
            raise ValueError(f"HF config lacks {e.args[0]!r}; is it a decoder-only LM config?") from None
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        return cls(
            name=name or cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model",
            num_layers=layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=inter, vocab_size=vocab,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
            max_model_len=int(cfg.get("max_position_embeddings") or 4096),
        )


def _spec(name, L, h, heads, kv, i, V, *, d=None, tied=False, max_len=4096, dtype_bytes=2) -> ModelSpec:
    return ModelSpec(name, L, h, heads, kv, d or h // heads, i, V, tied, dtype_bytes, max_len)


# Numbers from each model's config.json on the Hugging Face Hub.
_REGISTRY: dict[str, ModelSpec] = {m.name: m for m in [
    _spec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),                   # meta-llama/Llama-2-7b-hf
    _spec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),                  # meta-llama/Llama-2-13b-hf
    _spec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),                   # meta-llama/Llama-2-70b-hf
    _spec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, max_len=8192),     # meta-llama/Meta-Llama-3-8B
    _spec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, max_len=8192),    # meta-llama/Meta-Llama-3-70B
    _spec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, max_len=32768),     # mistralai/Mistral-7B-v0.1
    # Long-context models (128k positions), for traces such as Mooncake's; config.json of each on
    # the Hugging Face Hub: meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, Qwen/Qwen2.5-7B,
    # Qwen/Qwen2.5-14B, Qwen/Qwen2.5-32B (the Qwen2.5 -Instruct configs say 32768 positions, for
    # the same shapes; their model cards serve 128k with YaRN).
    _spec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, max_len=131072),
    _spec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, max_len=131072),
    _spec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, max_len=131072),
    _spec("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, max_len=131072),
    _spec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, max_len=131072),
    _spec("qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, d=128, tied=True, max_len=40960),  # Qwen/Qwen3-0.6B
    # minibatch's embedded model (minibatch/assets/tiny/config.json), float32 on CPU
    _spec("tiny", 4, 256, 8, 4, 688, 4096, tied=True, max_len=1024, dtype_bytes=4),
]}

_ALIASES = {"llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b", "llama2-70b": "llama-2-70b",
            "llama-7b": "llama-2-7b", "llama-13b": "llama-2-13b", "llama3-8b": "llama-3-8b",
            "llama3-70b": "llama-3-70b", "mistral-7b-v0.1": "mistral-7b", "llama3.1-8b": "llama-3.1-8b",
            "llama3.1-70b": "llama-3.1-70b", "meta-llama-3.1-8b": "llama-3.1-8b",
            "meta-llama-3.1-70b": "llama-3.1-70b"}


def available_models() -> list[str]:
    """Names accepted by :func:`get_model_spec`."""
    return sorted(_REGISTRY)


def get_model_spec(name: str | ModelSpec) -> ModelSpec:
    """The :class:`ModelSpec` called ``name`` (case-insensitive); a spec passes through, and a
    path to a checkpoint directory or ``config.json`` is read with ``from_hf_config``."""
    if isinstance(name, ModelSpec):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key in _REGISTRY:
        return _REGISTRY[key]
    if os.path.isfile(name) or os.path.isfile(os.path.join(str(name), "config.json")):
        return ModelSpec.from_hf_config(name)
    raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())} "
                     f"(or a path to a checkpoint directory with config.json)")
