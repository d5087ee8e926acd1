"""Executors run one scheduled batch. ``ModelExecutor`` runs the real model.

The executor owns the KV tensors: one ``(K, V)`` pair per layer, each
``[num_kv_blocks, block_size, num_kv_heads, head_dim]``, allocated once at start-up,
so a step never allocates KV memory. For each step it flattens the batch into token
ids, positions and cache slots (``slot = block_table[p // block_size] * block_size
+ p % block_size``), runs the model, and samples the requests whose prompt (or
recompute) is now fully in the cache.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from minibatch import kernels
from minibatch.config import EngineConfig, env
from minibatch.kv_cache import KVCacheManager
from minibatch.model.llama import AttentionMetadata
from minibatch.model.loader import load_model
from minibatch.request import Request
from minibatch.sampler import sample
from minibatch.scheduler import ScheduledBatch, is_decode
from minibatch.kernels.cpu_threads import threads_for_step

DEFAULT_CPU_KV_BYTES = 256 * 2**20
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}   # config.DTYPES


@dataclass
class StepOutput:
    sampled: list[tuple[Request, int]]   # (request, new token) for requests that sampled
    duration: float                      # seconds the step took (measured or modelled)
    forward_time: float                  # seconds inside the model forward + sampling
    # (request, error) for requests whose part of the step failed (e.g. their sampling); the
    # engine aborts them with that error, and the rest of the step stands.
    failed: list[tuple[Request, str]] = field(default_factory=list)
    # request_id -> (token logprob, top logprobs) for sampled requests that asked for them
    logprobs: dict[str, tuple] = field(default_factory=dict)


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def pick_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if config.dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif config.dtype in TORCH_DTYPES:
        dtype = TORCH_DTYPES[config.dtype]
    else:
        raise ValueError(f"unknown dtype {config.dtype!r}; expected one of {sorted(TORCH_DTYPES)}")
    return device, dtype


class ModelExecutor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = pick_device_dtype(config)
        self.model, self.model_config, self.hf_config, self.model_path = load_model(
            config.model, self.device, self.dtype, seed=config.seed)
        mc = self.model_config
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        # CPU float32: oneDNN-prepacked weights (MINIBATCH_PREPACK=0 keeps plain F.linear);
        # with the "cpu" backend, projections of one or two rows run in C.
        self.prepacked = (self.device.type == "cpu" and env("MINIBATCH_PREPACK", "1") != "0"
                          and self.model.prepack_for_cpu(small_m=self.backend == "cpu"))
        self.block_size = config.block_size
        self.block_bytes = config.block_size * mc.kv_bytes_per_token(self.dtype.itemsize)
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_kv_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        # The "cpu" backend also fuses RMSNorm, RoPE and the SwiGLU gate into C ops.
        self.fused_ops = self.backend == "cpu" and self.model.use_fused_cpu_ops()
        # ... and runs decode steps of a few sequences as one C call (MINIBATCH_FUSED_DECODE=0: per op).
        self.fused_decode = (self.fused_ops and self.prepacked and env("MINIBATCH_FUSED_DECODE", "1") != "0"
                             and self.model.enable_fused_decode())
        self.lora = None                # adapter slots and their device buffers (enable_lora; minibatch.lora)
        if config.enable_lora:
            from minibatch.lora import LoRASlots
            self.lora = LoRASlots(self.model, mc, config.max_loras, config.max_lora_rank)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(mc.num_layers)]

    def warm_up(self) -> int:
        """Build every GEMM kernel this engine's batch limits can need (CPU prepacked weights).

        A new GEMM shape costs oneDNN ~0.5 ms to build the first time; the profiler calls
        this first so that its step times are those of a warmed-up engine. Returns the
        number of warm-up GEMMs run (0 when there is nothing to warm).
        """
        from minibatch.model.llama import warm_up_gemms

        if not self.prepacked:
            return 0
        return warm_up_gemms(self.model, self.config.max_num_batched_tokens, self.config.max_num_seqs)

    def add_lora(self, lora_request) -> None:
        """Read and check a request's adapter (``ValueError`` naming the problem)."""
        if self.lora is None:
            raise ValueError("lora_request given but the engine was built without enable_lora=True")
        self.lora.register(lora_request)

    def _blocks_from_budget(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization) - 2 * 2**30
            else:
                budget = DEFAULT_CPU_KV_BYTES
        blocks = budget // self.block_bytes
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {self.block_bytes} bytes")
        return int(blocks)

    # -- one step --------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, kv: KVCacheManager):
        """Flatten the batch: decodes (query length 1) first, then the longer chunks."""
        bs = self.block_size
        decodes = [(r, n) for r, n in batch.items if is_decode(n)]
        chunks = [(r, n) for r, n in batch.items if not is_decode(n)]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        dec_tables, dec_lens = [], []
        for r, _ in decodes:
            p = r.num_computed_tokens
            table = kv.block_table(r.request_id)
            ids.append(r.token_at(p))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            dec_tables.append(table)
            dec_lens.append(p + 1)
            if p + 1 == r.num_tokens:
                sample_idx.append(len(ids) - 1)
                sample_reqs.append(r)
        pre_tables, pre_lens, starts = [], [], [0]
        spec_rows: list[tuple[Request, int]] = []      # (speculating request, its first row)
        for r, n in chunks:
            p0 = r.num_computed_tokens
            table = kv.block_table(r.request_id)
            if r.spec_token_ids:        # the pending token, then the drafts (minibatch.spec_decode)
                spec_rows.append((r, len(ids)))
                ids.append(r.token_at(p0))
                ids.extend(r.spec_token_ids)
            else:
                ids.extend(r.all_token_ids[p0:p0 + n])
            positions = range(p0, p0 + n)
            pos.extend(positions)
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            pre_tables.append(table)
            pre_lens.append(p0 + n)
            starts.append(starts[-1] + n)
            if p0 + n == r.num_tokens:
                sample_idx.append(len(ids) - 1)
                sample_reqs.append(r)
        dev = self.device

        # Lists become tensors through numpy: torch.tensor(list) costs ~0.7 us an element
        # here, numpy ~0.03 (at 96 sequences, ~0.1 ms a step).
        def tensor(values, dtype):
            t = torch.from_numpy(np.array(values, dtype=dtype))
            return t if dev.type == "cpu" else t.to(dev)

        def table_tensor(tables):
            width = max(len(t) for t in tables)
            flat: list[int] = []
            for t in tables:
                flat += t
                if len(t) < width:
                    flat += [0] * (width - len(t))
            return tensor(flat, np.int32).view(len(tables), width)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, np.int64),
            num_decode_tokens=len(decodes),
            decode_block_tables=table_tensor(dec_tables) if decodes else None,
            decode_context_lens=tensor(dec_lens, np.int32) if decodes else None,
            prefill_block_tables=table_tensor(pre_tables) if chunks else None,
            prefill_context_lens=tensor(pre_lens, np.int32) if chunks else None,
            prefill_query_start_loc=tensor(starts, np.int32) if chunks else None,
            backend=self.backend,
        )
        self._spec_rows = spec_rows
        return tensor(ids, np.int64), tensor(pos, np.int64), meta, sample_idx, sample_reqs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv: KVCacheManager) -> StepOutput:
        t0 = time.perf_counter()
        input_ids, positions, meta, sample_idx, sample_reqs = self.prepare(batch, kv)
        if self.lora is not None:       # rows in prepare's order: decodes first, then chunks
            from minibatch.lora import lora_id
            rows = [lora_id(r) for r, n in batch.items if is_decode(n)]
            for r, n in batch.items:
                if not is_decode(n):
                    rows += [lora_id(r)] * n
            self.lora.begin_step(rows)
        t1 = time.perf_counter()
        # A small CPU step may run on one OpenMP thread (minibatch.kernels.cpu_threads; off by default).
        with threads_for_step(input_ids.numel()) if self.device.type == "cpu" else nullcontext():
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            sampled: list[tuple[Request, int]] = []
            failed: list[tuple[Request, str]] = []
            logprobs: dict[str, tuple] = {}
            if sample_reqs:
                # In a decode-only step every row samples: no gather.
                rows = hidden if len(sample_idx) == hidden.shape[0] else hidden[sample_idx]
                logits = self.model.compute_logits(rows)
                errors: dict[int, Exception] = {}
                row_logprobs: dict[int, tuple] = {}
                tokens = sample(logits, sample_reqs, errors, row_logprobs)
                sampled = [(r, t) for i, (r, t) in enumerate(zip(sample_reqs, tokens)) if i not in errors]
                failed = [(sample_reqs[i], describe_error(e)) for i, e in errors.items()]
                logprobs = {sample_reqs[i].request_id: lp for i, lp in row_logprobs.items()}
            if self._spec_rows:
                sampled += self._verify(hidden, self._spec_rows)
        if self.lora is not None:
            self.lora.end_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        return StepOutput(sampled, t2 - t0, t2 - t1, failed, logprobs)

    def _verify(self, hidden: torch.Tensor, spec_rows: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Greedy verification of each speculating request's drafts: the argmax of its ``1 + k``
        rows, the accepted prefix plus one token (``minibatch.spec_decode.accepted_tokens``),
        as ``(request, token)`` pairs in order."""
        from minibatch.sampler import argmax_rows
        from minibatch.spec_decode import accepted_tokens

        rows = [i for r, start in spec_rows for i in range(start, start + 1 + len(r.spec_token_ids))]
        targets = argmax_rows(self.model.compute_logits(hidden[rows])).tolist()
        out, j = [], 0
        for r, _ in spec_rows:
            n = 1 + len(r.spec_token_ids)
            out += [(r, t) for t in accepted_tokens(r.spec_token_ids, targets[j:j + n])]
            j += n
        return out

