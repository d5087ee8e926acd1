"""A Llama-family decoder that reads and writes its K/V through the paged cache.

The model sees a *flat* batch: the new tokens of every scheduled request concatenated
into one ``[num_tokens]`` vector (no padding), with their positions. Each attention
layer first stores the new tokens' K/V into their cache slots, then attends from the
cache, so a prefill, a chunk of one, a prefix-cache hit and a decode differ only in
the metadata (``AttentionMetadata``). Decode requests come first in the batch and use
the one-query-per-sequence kernel; the rest use the ragged prefill kernel.

Layer math (per token ``x``): ``h = x + Attn(RMSNorm(x))``, ``y = h + MLP(RMSNorm(h))``,
``MLP(u) = W_down(silu(W_gate u) * W_up u)`` (SwiGLU),
``RMSNorm(u) = g * u / sqrt(mean(u^2) + eps)``.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import minibatch
from minibatch import kernels
from minibatch.kernels import cpu_paged
from minibatch.config import env
from minibatch.model.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to.

    The first ``num_decode_tokens`` tokens are decodes, one per sequence
    (``decode_block_tables``, ``decode_context_lens``); the remaining tokens are ragged
    query chunks described by ``prefill_query_start_loc`` (relative to the first
    prefill token), ``prefill_context_lens`` and ``prefill_block_tables``.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefill_block_tables: torch.Tensor | None
    prefill_context_lens: torch.Tensor | None
    prefill_query_start_loc: torch.Tensor | None
    backend: str | None = None
    positions: torch.Tensor | None = None     # token positions; set by LlamaModel.forward


class RMSNorm(nn.Module):
    fused_cpu_ops = False       # set by LlamaModel.use_fused_cpu_ops

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu_ops:
            return cpu_paged.rms_norm_c(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # torch's fused kernel: the same float32 arithmetic as below, fewer passes.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """``theta_i = base^(-2i/d)``, with Llama 3's frequency-dependent rescaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    fused_cpu_ops = False       # set by LlamaModel.use_fused_cpu_ops: RoPE in C, in place
    lora = None                 # minibatch.lora's hook (enable_lora): adds adapters' deltas

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            self.lora("qkv", x, qkv)
        if self.q_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:]
        if self.fused_cpu_ops:                          # here cos/sin are the whole caches
            qk = cpu_paged.rope_c_(qk, cos, sin, meta.positions)
        else:
            qk = qk * cos + rotate_half(qk) * sin      # RoPE on the query and key heads at once
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        d = meta.num_decode_tokens
        if d == n:
            out = kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, backend=meta.backend)
        elif d == 0:
            out = kernels.paged_prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                                  meta.prefill_context_lens, meta.prefill_query_start_loc,
                                                  self.scale, backend=meta.backend)
        else:
            out = torch.empty_like(q)
            out[:d] = kernels.paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                                     meta.decode_context_lens, self.scale, backend=meta.backend)
            out[d:] = kernels.paged_prefill_attention(q[d:], k_cache, v_cache, meta.prefill_block_tables,
                                                      meta.prefill_context_lens, meta.prefill_query_start_loc,
                                                      self.scale, backend=meta.backend)
        if self.lora is not None:
            y = self.o_proj(out := out.view(n, self.q_size))
            self.lora("o", out, y)
            return y
        return self.o_proj(out.view(n, self.q_size))


class MLP(nn.Module):
    fused_cpu_ops = False       # set by LlamaModel.use_fused_cpu_ops
    lora = None                 # minibatch.lora's hook (enable_lora)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        if self.lora is not None:
            return self._forward_lora(x)
        if self.fused_cpu_ops:
            return self.down_proj(cpu_paged.silu_mul_c(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True) * up)   # silu in place; the product is contiguous

    def _forward_lora(self, x):
        gate_up = self.gate_up_proj(x)
        self.lora("gate_up", x, gate_up)
        if self.fused_cpu_ops:
            h = cpu_paged.silu_mul_c(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = F.silu(gate) * up
        y = self.down_proj(h)
        self.lora("down", h, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        # h = x + Attn(norm(x)); y = h + MLP(norm(h)); the sums land in the sublayers' fresh outputs.
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache).add_(x)
        return self.mlp(self.post_attention_layernorm(h)).add_(h)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = config.max_position_embeddings
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed_lm_head: torch.Tensor | None = None     # set by prepack_for_cpu
        self._small_m_lm_head = False                        # set by prepack_for_cpu
        self._lm_head_panels: torch.Tensor | None = None     # set by prepack_for_cpu
        self.fused_cpu_ops = False                           # set by use_fused_cpu_ops
        self._fused_decode: FusedDecode | None = None        # set by enable_fused_decode
        self.lora_slots = None                               # minibatch.lora.LoRASlots (enable_lora)

    def rope_cache(self, device, dtype):
        if self._rope_cache is None or self._rope_cache[0].device != device or self._rope_cache[0].dtype != dtype:
            inv_freq = rope_inv_freq(self.config).to(device)
            t = torch.arange(self.max_positions, device=device).float()
            freqs = t[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n = input_ids.shape[0]
        if self._fused_decode is not None and 0 < n <= SMALL_M_ROWS and meta.num_decode_tokens == n \
                and (self.lora_slots is None or self.lora_slots.groups is None):   # no adapter in this step
            return self._fused_decode(input_ids, positions, meta, kv_caches)
        x = self.embed_tokens(input_ids)
        cos_cache, sin_cache = self.rope_cache(x.device, x.dtype)
        if self.fused_cpu_ops:                  # the C RoPE picks rows by position itself
            cos, sin = cos_cache, sin_cache
            meta.positions = positions
        else:
            cos = cos_cache[positions].unsqueeze(1)
            sin = sin_cache[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.norm(x)

    def use_fused_cpu_ops(self) -> bool:
        """Run RMSNorm, RoPE and the SwiGLU gate as fused C ops (``cpu_ops.c``).

        For a CPU float32 model where the C kernels build. One pass over memory and one
        call each instead of 5-6 torch ops; measured here a decode step of 1 sequence went
        from 2.2 to 1.9 ms, of 100 sequences ~1 ms faster. Returns False, changing nothing,
        elsewhere.
        """
        if not cpu_paged.ops_supported(self.embed_tokens.weight):
            return False
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, LlamaModel)):
                module.fused_cpu_ops = True
        return True

    def enable_fused_decode(self) -> bool:
        """Run decode steps of at most ``SMALL_M_ROWS`` sequences as one C call
        (``cpu_decode.c``): the embedding, every layer and the final norm, with the same
        kernels and arithmetic as the per-op path, without ~60 Python dispatches a step.

        Needs the fused C ops (:meth:`use_fused_cpu_ops`) and panel-packed projections
        (:meth:`prepack_for_cpu` with ``small_m``), and a plain Llama layer (no QK norm,
        no bias outside the QKV projection). Returns False, changing nothing, otherwise.
        """
        if not self.fused_cpu_ops or self._lm_head_panels is None:
            return False
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            projections = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if a.q_norm is not None or any(getattr(p, "_panels", None) is None for p in projections):
                return False
            if a.o_proj.bias is not None or m.gate_up_proj.bias is not None or m.down_proj.bias is not None:
                return False
        try:
            self._fused_decode = FusedDecode(self)
        except ValueError:
            return False
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        fused = self._fused_decode
        if fused is not None and fused.last is not None:   # the fused decode step made them already
            last, fused.last = fused.last, None
            if last[0] is hidden:
                return last[1]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._packed_lm_head is not None:
            out = small_m_linear(hidden, weight, None, self._lm_head_panels) if self._small_m_lm_head else None
            if out is None:
                out = packed_linear(hidden, self._packed_lm_head, None)
            return out.float()
        return F.linear(hidden, weight).float()

    def prepack_for_cpu(self, small_m: bool = True) -> bool:
        """Re-lay every projection's weight once for oneDNN (CPU, float32).

        This is the step ``torch.compile`` calls weight prepacking ("freezing") on CPU:
        a GEMM whose weight is already in the library's blocked layout skips re-packing
        it every call, which at small batches costs more than the multiply itself
        (here 2-4x faster at 1-16 tokens, ~1.2x at 2048). The original weights stay in
        place, so the projections' memory doubles (16 MiB more for ``tiny``; set
        ``MINIBATCH_PREPACK=0`` for a large checkpoint on a small machine). Returns False,
        changing nothing, where the op is missing or disagrees with ``F.linear`` on a
        test input. With ``small_m``, inputs of up to ``SMALL_M_ROWS`` rows skip oneDNN
        for the C matrix-vector product on the original weight (:func:`small_m_linear`).
        """
        if not onednn_linear_available(self.embed_tokens.weight):
            return False
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module._packed = _pack(module.weight)
                module._small_m = small_m and _small_m_ok(module.weight, module.bias)
                module._panels = cpu_paged.pack_panels(module.weight) if module._small_m else None
                module.forward = _packed_forward.__get__(module)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._packed_lm_head = _pack(weight)
        self._small_m_lm_head = small_m and _small_m_ok(weight, None)
        self._lm_head_panels = cpu_paged.pack_panels(weight) if self._small_m_lm_head else None
        return True


class FusedDecode:
    """The C decoder stack for small decode steps (see :meth:`LlamaModel.enable_fused_decode`)."""

    def __init__(self, model: LlamaModel):
        c = model.config
        self.model = model
        self.sizes = (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        self.eps = float(c.rms_norm_eps)
        self.scale = float(model.layers[0].self_attn.scale)
        ptrs = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            ptrs += [layer.input_layernorm.weight.data_ptr(), a.qkv_proj._panels.data_ptr(),
                     a.qkv_proj.bias.data_ptr() if a.qkv_proj.bias is not None else None,
                     a.o_proj._panels.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                     m.gate_up_proj._panels.data_ptr(), m.down_proj._panels.data_ptr()]
        self.weights = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._kv: tuple | None = None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None   # (hidden, logits) of the last step
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if head.shape != model.embed_tokens.weight.shape:
            raise ValueError("the fused decode path needs an LM head of the embedding's shape")

    def _kv_pointers(self, kv_caches):
        key = (id(kv_caches), kv_caches[0][0].data_ptr())
        if self._kv is None or self._kv[0] != key:
            ptrs = [t.data_ptr() for pair in kv_caches for t in pair]
            self._kv = (key, (ctypes.c_void_p * len(ptrs))(*ptrs))
        return self._kv[1]

    def __call__(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        # A batch-1 step's C call takes well under a millisecond, so this wrapper keeps to
        # plain attribute reads: no nn.Module attribute writes, no conversions of tensors
        # that already have the dtype and layout the C code needs.
        model = self.model
        embed = model.embed_tokens.weight
        n, hidden = input_ids.shape[0], embed.shape[1]
        k_cache = kv_caches[0][0]
        if k_cache.dtype != torch.float32 or not k_cache.is_contiguous():
            raise ValueError("the fused decode path needs contiguous float32 KV caches")
        rope = model._rope_cache                   # a CPU float32 model's (checked in enable_fused_decode)
        cos, sin = rope if rope is not None and rope[0].dtype == torch.float32 else model.rope_cache(embed.device,
                                                                                                      embed.dtype)
        ids, pos = _c_array(input_ids, torch.int64), _c_array(positions, torch.int64)
        slots = _c_array(meta.slot_mapping, torch.int64)
        tables = _c_array(meta.decode_block_tables, torch.int32)
        lens = _c_array(meta.decode_context_lens, torch.int32)
        if not (pos.shape[0] == slots.shape[0] == tables.shape[0] == lens.shape[0] == n):
            raise ValueError(f"a fused decode step of {n} tokens needs {n} positions, slots, block tables and "
                             f"context lengths (got {pos.shape[0]}, {slots.shape[0]}, {tables.shape[0]}, "
                             f"{lens.shape[0]})")
        vocab = embed.shape[0]                     # the LM head's rows too (checked in FusedDecode.__init__)
        out = torch.empty(n, hidden, dtype=embed.dtype)
        logits = torch.empty(n, vocab, dtype=embed.dtype)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        status = cpu_paged.load().decode_model_f32(
            ids.data_ptr(), embed.data_ptr(), vocab, model._lm_head_panels.data_ptr(), out.data_ptr(),
            logits.data_ptr(), n, hidden, len(model.layers), self.weights, self._kv_pointers(kv_caches),
            model.norm.weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), slots.data_ptr(),
            num_slots, tables.data_ptr(), tables.shape[1], lens.data_ptr(), *self.sizes, k_cache.shape[1],
            self.eps, self.scale, int(torch.get_num_threads() > 1 and minibatch.OMP_THREADS_SLEEP))
        if status:
            raise {1: IndexError(f"a slot in slot_mapping is outside the KV cache ({num_slots} slots)"),
                   2: MemoryError("the fused decode kernel could not allocate its scratch"),
                   3: IndexError(f"a token id is outside the vocabulary ({vocab} ids)")}[status]
        self.last = (out, logits)                  # compute_logits(out) returns these
        return out


def _c_array(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor, itself when it already is one."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def warm_up_gemms(model: "LlamaModel", max_rows: int, max_sampled_rows: int) -> int:
    """Build oneDNN's kernel for every GEMM shape a run can meet, before timing anything.

    Runs each distinct prepacked projection once per :func:`gemm_rows` size up to
    ``max_rows`` (the LM head up to ``max_sampled_rows``) on zeros. Returns the number of
    GEMMs run; 0 where the weights are not prepacked.
    """
    if model._packed_lm_head is None:
        return 0
    shapes: dict[tuple, nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and hasattr(module, "_packed"):
            shapes.setdefault((tuple(module.weight.shape), module.bias is not None), module)
    sizes = sorted({gemm_rows(m) for m in range(1, max_rows + 1)})
    n = 0
    with torch.inference_mode():
        for module in shapes.values():
            for rows in sizes:
                module(torch.zeros(rows, module.in_features))
                n += 1
        for rows in (r for r in sizes if r <= gemm_rows(max_sampled_rows)):
            model.compute_logits(torch.zeros(rows, model.config.hidden_size))
            n += 1
    return n


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def gemm_rows(m: int) -> int:
    """The row count a GEMM of ``m`` rows is padded to: exact up to 32, then 16 sizes per
    doubling (32 + 16 * 6 = 128 sizes up to 2048; at most 6% extra rows, ~3% on average).

    oneDNN builds and JIT-compiles a kernel ("primitive") for every new GEMM shape, about
    0.5 ms each here, ~3 ms for the model's five weight shapes. Batch sizes change every
    step in a serving engine, so without buckets a busy run keeps paying that (and churns
    oneDNN's 1024-entry primitive cache); with them each size is built once per process.
    This is the CPU cousin of vLLM padding batches to its captured CUDA-graph sizes.
    """
    if m <= 32:
        return m
    step = 1 << ((m - 1).bit_length() - 5)
    return -(-m // step) * step


_BUCKETS = env("MINIBATCH_GEMM_BUCKETS", "1") != "0"


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    rows = gemm_rows(m) if _BUCKETS and x.dim() == 2 else m
    if rows != m:                                   # zero rows below; their outputs are dropped
        padded = x.new_empty(rows, x.shape[1])
        padded[:m] = x
        padded[m:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


#: Up to this many rows a prepacked projection runs in C from panel-packed weights
#: (``cpu_paged.linear_panels_c``) instead, and a decode step of up to this many
#: sequences runs as one C call (:class:`FusedDecode`): oneDNN's fixed cost per call and
#: the per-op dispatch dominate there. Measured here (the forward and LM head of one
#: decode step of ``tiny``, 2 threads, medians of 100): 4 rows 3.7 -> 1.5 ms, 8 rows
#: 3.8-6.5 -> 2.4-2.8 ms, 16 rows 6.9-7.5 -> 4.2-5.4 ms. From 6 rows the kernel works in
#: register blocks of 6 rows, and whole decode steps of 48-128 sequences took 1.5-1.8x
#: less time fused than per op with oneDNN (alternating in one process, 6 rounds); the
#: offline workloads of ``benchmarks/offline_throughput.py`` gained 1.12x (skewed) and
#: 1.31x (uniform) from 32 to 128 (4 rounds). At 256 the gain was not steady.
#: ``MINIBATCH_SMALL_M_ROWS=0`` keeps oneDNN for every size.
SMALL_M_ROWS = int(env("MINIBATCH_SMALL_M_ROWS", "128"))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   panels: torch.Tensor | None = None) -> torch.Tensor | None:
    """The C matrix-vector path for a 2-D ``x`` of at most ``SMALL_M_ROWS`` rows, or None.

    With ``panels`` (``cpu_paged.pack_panels(weight)``, made once by ``prepack_for_cpu``)
    the weight is read as sequential panels (``linear_panels_c``); without, from its own
    rows (``linear_small_m_c``).
    """
    if x.dim() != 2 or x.shape[0] > SMALL_M_ROWS or x.shape[0] == 0:
        return None
    if panels is not None:
        return cpu_paged.linear_panels_c(x, panels, weight.shape[0], bias)
    return cpu_paged.linear_small_m_c(x, weight, bias)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self._small_m:
        out = small_m_linear(x, self.weight, self.bias, self._panels)
        if out is not None:
            return out
    return packed_linear(x, self._packed, self.bias)


def _small_m_ok(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`small_m_linear` can serve this layer (CPU float32, contiguous, C built)."""
    return (SMALL_M_ROWS > 0 and cpu_paged.ops_supported(weight) and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())))


def onednn_linear_available(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked linear exists here and matches ``F.linear`` on a small test input."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x, b = torch.randn(24, 40, generator=g), torch.randn(5, 40, generator=g), torch.randn(24, generator=g)
        got = packed_linear(x, _pack(w), b)
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False
