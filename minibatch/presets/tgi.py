r"""TGI's default prefill budget: how the launcher sizes ``max_batch_prefill_tokens``.

TGI v3.3.7's launcher (``launcher/src/main.rs``, ``main``) leaves ``--max-batch-prefill-tokens``
unset by default and computes it as the "compute-optimal" number of tokens, the GPUs' FP16
peak divided by the model's FLOP per token::

    optimal = f16_flop(card) * num_shard / Config::flop(model)       (None if <= 100)
    value   = min(optimal or 4096, max_position_embeddings, vram_maximum)

with, per layer (``Config::flop``; a dense model, one expert)

$$ F_\text{layer} = \underbrace{2 H d h}_{Q} + \underbrace{2 H_{kv} d h}_{K}
   + \underbrace{2 H_{kv} d h}_{V} + \underbrace{2 H d h}_{\text{attn}} + \underbrace{2 H d h}_{O}
   + 2 \cdot 3 \cdot h \cdot I , $$

times the number of layers ($H$ query heads, $H_{kv}$ KV heads, $d$ head dim, $h$ hidden size,
$I$ intermediate size). The VRAM cap (``vram_maximum``, from ``nvidia-smi``) is left out here.
TGI v2.4.1 used ``min(4096, max_position_embeddings)`` whatever the GPU. Chapters 16 and 20.
"""

from __future__ import annotations

from minibatch.sim.model_specs import ModelSpec, get_model_spec

#: FP16 peak FLOP/s per card, ``launcher/src/main.rs`` ``ComputeType::f16_flop`` (TGI v3.3.7).
F16_FLOPS = {"rtx4090": 82e12, "t4": 65e12, "l4": 121e12, "l40": 181e12, "l40s": 363e12, "a10g": 125e12,
             "a40": 149e12, "a100": 312e12, "h100": 900e12, "h200": 989e12}
#: The launcher's fallback when the model's or the GPU's FLOP are unknown.
FALLBACK_PREFILL_TOKENS = 4096


def flop_per_token(model: str | ModelSpec) -> int:
    """``Config::flop``: Q, K, V, attention and O projections plus the gated MLP, times the layers."""
    m = get_model_spec(model)
    h, d = m.hidden_size, m.head_dim
    attention = 2 * d * h * (3 * m.num_heads + 2 * m.num_kv_heads)    # Q, attn, O use H; K, V use H_kv
    mlp = 2 * 3 * h * m.intermediate_size
    return (attention + mlp) * m.num_layers


def default_max_batch_prefill_tokens(model: str | ModelSpec, gpu: str = "a100", num_shard: int = 1) -> int:
    """The launcher's ``max_batch_prefill_tokens`` when none is given (its VRAM cap left out)."""
    m = get_model_spec(model)
    peak = F16_FLOPS.get(gpu.lower())
    optimal = int(peak * num_shard // flop_per_token(m)) if peak else None
    if optimal is not None and optimal <= 100:         # "Ignore calculations that's too low"
        optimal = None
    return min(optimal or FALLBACK_PREFILL_TOKENS, m.max_model_len)
