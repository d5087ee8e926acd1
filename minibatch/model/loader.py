"""Load a model: the embedded ``tiny`` one or a local Hugging Face checkpoint directory.

A checkpoint directory holds ``config.json`` (read with ``transformers.AutoConfig``) and
``*.safetensors`` weights (read with ``safetensors``); a tokenizer in the same directory
is optional. Nothing here touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minibatch.model.config import ModelConfig
from minibatch.model.llama import LlamaModel

TINY_NAMES = ("tiny", "tiny-random")


def tiny_model_path() -> Path:
    from minibatch.assets import TINY_MODEL_PATH
    return TINY_MODEL_PATH


def resolve_model_path(model: str | Path) -> Path:
    if str(model) in TINY_NAMES:
        return tiny_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is neither 'tiny' nor a local directory; minibatch never downloads "
            f"weights, so pass the path of a Hugging Face checkpoint (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return path


def load_hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_hf_state_dict(model: LlamaModel, state: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named weights into the model, fusing q/k/v and gate/up."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    cfg = model.config

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return state.pop(name)

    with torch.no_grad():
        model.embed_tokens.weight.copy_(take("embed_tokens.weight"))
        model.norm.weight.copy_(take("norm.weight"))
        if model.lm_head is not None:
            lm = state.pop("lm_head.weight", None)
            model.lm_head.weight.copy_(lm if lm is not None else model.embed_tokens.weight)
        else:
            state.pop("lm_head.weight", None)
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if cfg.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if cfg.qk_norm:
                attn.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                attn.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
    leftover = [k for k in state if "rotary_emb" not in k]
    if leftover:
        raise ValueError(f"checkpoint has weights the model does not use: {leftover[:5]}")


def random_hf_state_dict(hf_config, seed: int, init_std: float | None = None) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face naming, from ``transformers``' own initialiser."""
    from transformers import AutoModelForCausalLM

    if init_std is not None:
        hf_config.initializer_range = init_std
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


def load_model(model: str | Path, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Return ``(LlamaModel, ModelConfig, hf_config, path)``.

    ``"tiny"`` loads the embedded trained weights when present; ``"tiny-random"`` (or a
    tiny directory without weights) gives seeded random weights of the same shape.
    """
    path = resolve_model_path(model)
    hf_config = load_hf_config(path)
    config = ModelConfig.from_hf(hf_config)
    if str(model) == "tiny-random" or not any(path.glob("*.safetensors")) and str(model) in TINY_NAMES:
        state = random_hf_state_dict(hf_config, seed)
    else:
        state = read_safetensors(path)
    with torch.device("meta"):
        net = LlamaModel(config)
    net = net.to_empty(device="cpu")
    net.to(torch.float32)
    load_hf_state_dict(net, state)
    net = net.to(device=device, dtype=dtype).eval()
    gen_eos = _generation_eos(path)
    if gen_eos:
        config.eos_token_ids = tuple(dict.fromkeys(config.eos_token_ids + gen_eos))
    return net, config, hf_config, path


def _generation_eos(path: Path) -> tuple[int, ...]:
    f = path / "generation_config.json"
    if not f.is_file():
        return ()
    eos = json.loads(f.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
