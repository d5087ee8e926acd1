"""How long one engine step takes on a named GPU: a roofline model of a transformer step.

One step runs a batch that mixes *prefill* chunks, ``(num_new_tokens, context_len)``
with ``context_len`` counted after the chunk (a chunk of a long prompt, or a prompt
whose prefix came from the prefix cache, has ``num_new_tokens < context_len``), and
*decode* sequences, each adding one token on top of ``context_len`` cached ones.

Every kernel is timed with the roofline (Williams et al., CACM 2009)::

    t = max(F / (peak_flops * flop_eff), B / (mem_bw * bw_eff))

and the step is the sum over kernels (T = all new tokens, S = sequences that sample,
h = hidden, d = head_dim, per GPU: H = num_heads/tp, K = ceil(num_kv_heads/tp)):

* GEMMs, per layer: QKV, O, gate+up, down. A (M=T) x (k x n/tp) GEMM has
  F = 2*T*k*n/tp and B = k*n/tp * w + (T*k + T*n/tp) * dtype_bytes, w the bytes per weight
  (``dtype_bytes``, or ``ModelSpec.weight_dtype_bytes`` for weight-only quantization: the
  weights are read small and dequantized, the arithmetic stays 16-bit, and the dequantization
  itself is not counted): at small T it reads weights (memory-bound, the time is flat in T),
  at large T it is compute-bound.
* LM head: the same for M = S rows at ``dtype_bytes`` (one per sequence; a chunk that does not
  end its prompt samples nothing in reality, so this slightly over-counts).
* Prefill attention (one varlen flash-attention call): a chunk of n new tokens after
  p = c - n cached ones scores P = n*p + n*(n+1)/2 (query, key) pairs (causal);
  F = 4*H*d*P per layer, B = (2*K*d*c + 2*K*d*n + 2*H*d*n) * dtype_bytes.
* Decode attention (paged decode kernel): F = 4*H*d*c, B = 2*K*d*c * dtype_bytes per
  sequence and layer; reading the KV cache makes it memory-bound (~1 FLOP/byte for MHA).
* Tensor parallelism: 2 all-reduces of T*h*dtype_bytes bytes per layer (after attention
  and after the MLP), ring algorithm ``2*(tp-1)/tp * bytes / link_bw + latency``, plus
  one all-gather of the S x vocab logits; not overlapped with compute (as in vLLM).
* Overhead: ``step_overhead_s`` (CPU scheduling, input preparation, kernel launches and
  sampling; ~1-3 ms for a GPU engine with CUDA graphs, up to ~10 ms without) plus
  ``per_seq_overhead_s`` per sequence (0 by default).

Not modelled: norms, rotary embeddings and activations (a few % of the GEMM bytes),
kernel efficiency that drops near the roofline's ridge point and at small shapes, and
GPU clock throttling. The efficiency factors in :mod:`minibatch.sim.hardware` absorb
the average of these effects.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol, Sequence

from .hardware import GiB, HardwareSpec, get_hardware, parse_hardware
from .model_specs import ModelSpec, get_model_spec

Prefill = Sequence[tuple[int, int]]

#: Default memory kept out of the KV cache on each GPU: CUDA context, cuBLAS/NCCL
#: workspaces, CUDA graphs and the activation peak of a ~2k-token step of a 7-13B model.
DEFAULT_ACTIVATION_RESERVE_BYTES = 1 * GiB


class CostModel(Protocol):
    """What the SimExecutor asks: the seconds one step takes."""

    def step_time(self, prefill: Prefill, decode_context_lens: Sequence[int]) -> float: ...

    def describe(self) -> str: ...


class ModelDoesNotFitError(ValueError):
    """The weights (plus reserve) exceed the memory given to the model on each GPU."""


def _check_batch(prefill: Prefill, decode_context_lens: Sequence[int]) -> None:
    for new, ctx in prefill:
        if new < 1 or ctx < new:
            raise ValueError(f"prefill entry (num_new_tokens={new}, context_len={ctx}) needs "
                             f"1 <= num_new_tokens <= context_len")
    for ctx in decode_context_lens:
        if ctx < 1:
            raise ValueError(f"decode context_len must be >= 1, got {ctx}")


class RooflineCostModel:
    """Step time of ``model`` on ``tensor_parallel_size`` x ``hardware`` (see module doc)."""

    def __init__(self, model: str | ModelSpec, hardware: str | HardwareSpec,
                 tensor_parallel_size: int = 1, dtype_bytes: int | None = None,
                 step_overhead_s: float | None = None, per_seq_overhead_s: float = 0.0,
                 flop_efficiency: float | None = None, bandwidth_efficiency: float | None = None):
        self.model = get_model_spec(model)
        if dtype_bytes is not None:
            self.model = replace(self.model, dtype_bytes=dtype_bytes)
        self.hardware = get_hardware(hardware)
        tp = tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if self.model.num_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {self.model.name}'s "
                             f"num_heads={self.model.num_heads}")
        self.tp = tp
        self.step_overhead_s = self.hardware.step_overhead_s if step_overhead_s is None else step_overhead_s
        self.per_seq_overhead_s = per_seq_overhead_s
        hw = self.hardware
        self.flops = hw.peak_flops * (hw.flop_efficiency if flop_efficiency is None else flop_efficiency)
        self.bandwidth = hw.memory_bandwidth * (hw.bandwidth_efficiency if bandwidth_efficiency is None
                                                else bandwidth_efficiency)
        m = self.model
        self.heads_per_gpu = m.num_heads // tp
        # vLLM replicates KV heads when tp > num_kv_heads: each GPU keeps at least one.
        self.kv_heads_per_gpu = math.ceil(m.num_kv_heads / tp)
        d, h = m.head_dim, m.hidden_size
        # (k, n) of each per-layer weight matrix on one GPU.
        self._layer_gemms = [
            (h, (self.heads_per_gpu + 2 * self.kv_heads_per_gpu) * d),  # QKV (column-parallel)
            (self.heads_per_gpu * d, h),                                 # O (row-parallel)
            (h, 2 * m.intermediate_size // tp),                          # gate+up (column-parallel)
            (m.intermediate_size // tp, h),                              # down (row-parallel)
        ]
        self._lm_head = (h, math.ceil(m.vocab_size / tp))

    # -- roofline pieces ---------------------------------------------------------------
    def roofline(self, flops: float, bytes_moved: float) -> float:
        """``max(flops / effective_flops, bytes / effective_bandwidth)`` in seconds."""
        return max(flops / self.flops, bytes_moved / self.bandwidth)

    def _gemm(self, rows: int, k: int, n: int, weight_bytes: float | None = None) -> float:
        b = self.model.dtype_bytes
        w = b if weight_bytes is None else weight_bytes
        return self.roofline(2.0 * rows * k * n, k * n * w + (rows * k + rows * n) * b)

    def _allreduce(self, nbytes: float) -> float:
        """Ring all-reduce: ``2*(tp-1)/tp * bytes / (link_bw * link_eff) + latency``."""
        hw = self.hardware
        link = hw.interconnect_bandwidth * hw.link_efficiency
        return 2 * (self.tp - 1) / self.tp * nbytes / link + hw.allreduce_latency_s

    def _allgather(self, nbytes: float) -> float:
        """Ring all-gather of ``bytes`` in total: ``(tp-1)/tp * bytes / link + latency``."""
        hw = self.hardware
        link = hw.interconnect_bandwidth * hw.link_efficiency
        return (self.tp - 1) / self.tp * nbytes / link + hw.allreduce_latency_s

    def breakdown(self, prefill: Prefill, decode_context_lens: Sequence[int]) -> dict[str, float]:
        """Seconds per component: gemm, lm_head, attention_prefill, attention_decode,
        communication, overhead. Their sum is :meth:`step_time`."""
        _check_batch(prefill, decode_context_lens)
        m, L, b = self.model, self.model.num_layers, self.model.dtype_bytes
        num_tokens = sum(new for new, _ in prefill) + len(decode_context_lens)
        num_seqs = len(prefill) + len(decode_context_lens)
        out = dict.fromkeys(("gemm", "lm_head", "attention_prefill", "attention_decode",
                             "communication", "overhead"), 0.0)
        if num_seqs == 0:
            return out
        w = m.linear_weight_bytes_per_param
        out["gemm"] = L * sum(self._gemm(num_tokens, k, n, w) for k, n in self._layer_gemms)
        out["lm_head"] = self._gemm(num_seqs, *self._lm_head)
        H, K, d = self.heads_per_gpu, self.kv_heads_per_gpu, m.head_dim
        if prefill:
            pairs = sum(new * (ctx - new) + new * (new + 1) / 2 for new, ctx in prefill)
            kv_read = sum(ctx for _, ctx in prefill)
            new_total = num_tokens - len(decode_context_lens)
            nbytes = (2 * K * d * (kv_read + new_total) + 2 * H * d * new_total) * b
            out["attention_prefill"] = L * self.roofline(4.0 * H * d * pairs, nbytes)
        if decode_context_lens:
            ctx_total = sum(decode_context_lens)
            nbytes = (2 * K * d * ctx_total + 2 * (H + K) * d * len(decode_context_lens)) * b
            out["attention_decode"] = L * self.roofline(4.0 * H * d * ctx_total, nbytes)
        if self.tp > 1:
            out["communication"] = (2 * L * self._allreduce(num_tokens * m.hidden_size * b)
                                    + self._allgather(num_seqs * m.vocab_size * b))
        out["overhead"] = self.step_overhead_s + self.per_seq_overhead_s * num_seqs
        return out

    def step_time(self, prefill: Prefill, decode_context_lens: Sequence[int]) -> float:
        """Seconds for one step; ``prefill`` = [(num_new_tokens, context_len_after_chunk)],
        ``decode_context_lens`` = KV length of each decoding sequence. An empty batch is 0."""
        return sum(self.breakdown(prefill, decode_context_lens).values())

    # -- memory ------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> int:
        """``weight_bytes / tp`` (replicated KV-head weights ignored)."""
        return math.ceil(self.model.weight_bytes / self.tp)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """``2 * num_layers * ceil(num_kv_heads/tp) * head_dim * dtype_bytes``."""
        m = self.model
        return 2 * m.num_layers * self.kv_heads_per_gpu * m.head_dim * m.dtype_bytes

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9,
                           activation_reserve_bytes: int | None = None) -> int:
        """Tokens of KV cache that fit (every GPU holds its heads' share of every token)::

            (memory_bytes * gpu_memory_utilization - weight_bytes/tp - reserve)
                // (kv_bytes_per_token / tp)

        Raises :class:`ModelDoesNotFitError` (a ValueError) when nothing is left.
        """
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        reserve = DEFAULT_ACTIVATION_RESERVE_BYTES if activation_reserve_bytes is None else activation_reserve_bytes
        budget = self.hardware.memory_bytes * gpu_memory_utilization
        free = budget - self.weight_bytes_per_gpu - reserve
        if free < self.kv_bytes_per_token_per_gpu:
            need = next((t for t in (2, 4, 8, 16, 32, 64) if t > self.tp
                         and budget - self.model.weight_bytes / t - reserve > 0), None)
            hint = f"; try tensor_parallel_size={need}" if need else ""
            raise ModelDoesNotFitError(
                f"{self.model.name} does not fit on {self.tp}x{self.hardware.name}: "
                f"weights {self.weight_bytes_per_gpu / GiB:.2f} GiB per GPU "
                f"({self.model.weight_bytes:,} bytes / tp={self.tp}) + reserve {reserve / GiB:.2f} GiB "
                f"> {gpu_memory_utilization} x {self.hardware.memory_bytes / GiB:.1f} GiB "
                f"({self.hardware.memory_bytes:,} bytes){hint}")
        return int(free // self.kv_bytes_per_token_per_gpu)

    def max_batch(self, context_len: int, gpu_memory_utilization: float = 0.9, block_size: int = 16) -> int:
        """Most sequences of ``context_len`` tokens each whose KV fits at once: the pool's
        blocks (``kv_capacity_tokens // block_size``, as ``SimExecutor`` sizes it) over
        ``ceil(context_len / block_size)`` blocks per sequence; 0 if the weights do not fit."""
        try:
            blocks = self.kv_capacity_tokens(gpu_memory_utilization) // block_size
        except ModelDoesNotFitError:
            return 0
        return blocks // -(-context_len // block_size)

    def fits(self, batch: int, context_len: int, gpu_memory_utilization: float = 0.9,
             block_size: int = 16) -> bool:
        """Can ``batch`` sequences of ``context_len`` tokens be decoding at once? A decode step
        of a batch that does not fit never happens (the engine preempts first), so sweeps and
        plots keep only configurations for which this is true."""
        return batch <= self.max_batch(context_len, gpu_memory_utilization, block_size)

    def describe(self) -> str:
        m, hw = self.model, self.hardware
        weights = (f"{m.dtype_bytes}-byte weights and KV" if m.weight_dtype_bytes is None else
                   f"{m.weight_dtype_bytes:g}-byte matmul weights, {m.dtype_bytes}-byte activations and KV")
        lines = [f"RooflineCostModel: {m.name} on {self.tp}x{hw.name} ({weights})",
                 f"  model:    {m.describe()}",
                 f"  hardware: {hw.describe()}",
                 f"  weights/GPU {self.weight_bytes_per_gpu / 1e9:.2f} GB, KV/token/GPU "
                 f"{self.kv_bytes_per_token_per_gpu / 1024:.0f} KiB, ridge {hw.ridge_point:.0f} FLOP/B, "
                 f"overhead {self.step_overhead_s * 1e3:.1f} ms/step"]
        try:
            lines.append(f"  KV capacity @0.9: {self.kv_capacity_tokens():,} tokens")
        except ModelDoesNotFitError as e:
            lines.append(f"  KV capacity: {e}")
        lines.append(f"  decode batch 1 @ctx 512: {self.step_time([], [512]) * 1e3:.2f} ms/step; "
                     f"prefill 2048 tokens: {self.step_time([(2048, 2048)], []) * 1e3:.1f} ms")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RooflineCostModel({self.model.name!r}, {self.hardware.name!r}, tensor_parallel_size={self.tp})"


def make_cost_model(model: str | ModelSpec, hardware: str | HardwareSpec,
                    tensor_parallel_size: int | None = None, **kw) -> CostModel:
    """Cost model for ``model`` on ``hardware``.

    ``hardware`` is a name from :func:`available_hardware`, optionally prefixed ``"Nx"``
    for N-way tensor parallelism (``"4xa10"`` = ``hardware="a10", tensor_parallel_size=4``;
    an explicit ``tensor_parallel_size`` must agree), or ``"profile:FILE"`` for a
    :class:`FittedCostModel` saved by the profiler (``model`` is then only recorded).
    Other keywords go to :class:`RooflineCostModel`.
    """
    if isinstance(hardware, str) and hardware.startswith("profile:"):
        from .fitted import FittedCostModel
        return FittedCostModel.load(hardware[len("profile:"):])
    hw, count = parse_hardware(hardware)
    tp = tensor_parallel_size if tensor_parallel_size is not None else count
    if count != 1 and tp != count:
        raise ValueError(f"hardware {hardware!r} means tensor_parallel_size={count}, "
                         f"but tensor_parallel_size={tensor_parallel_size} was given")
    return RooflineCostModel(model, hw, tensor_parallel_size=tp, **kw)


def load_cost_model(spec: str, model: str | ModelSpec | None = None, **kw) -> CostModel:
    """A cost model from one string, as a config or CLI flag gives it:

    * ``"profile:FILE"`` or ``"FILE.json"``: a :class:`FittedCostModel` saved by the profiler;
    * ``"MODEL@HARDWARE"`` (``"llama-2-13b@4xa10"``): a :class:`RooflineCostModel`;
    * ``"HARDWARE"`` (``"a100-80g"``, ``"4xa10"``) with ``model=`` given.
    """
    from .fitted import FittedCostModel
    text = str(spec).strip()
    if text.startswith("profile:"):
        return FittedCostModel.load(text[len("profile:"):])
    if text.endswith(".json"):
        return FittedCostModel.load(text)
    if "@" in text:
        model_name, _, hardware = text.partition("@")
        return make_cost_model(model_name, hardware, **kw)
    if model is None:
        raise ValueError(f"cost model spec {spec!r} names no model: use 'MODEL@HARDWARE', "
                         f"'profile:FILE', or pass model=")
    return make_cost_model(model, text, **kw)
