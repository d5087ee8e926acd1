"""Engine configuration: one dataclass, vLLM's names where vLLM has one.

Every engine option is declared once, as a field of :class:`EngineConfig`: its type, its
default, its help text and (where it has a fixed set) its choices. The command line is
generated from those fields (:func:`add_engine_args`), so a new field appears in
``generate``, ``serve``, ``simulate`` and ``profile`` without editing a list.

The environment variables minibatch reads are listed once too, in :data:`ENV_VARS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field, fields

PREEMPTION_MODES = ("recompute", "swap")
# Which running request a preemption evicts (minibatch.scheduler.Scheduler._pick_victim); vLLM's open
# PR #53723 names the option preemption_victim too ("fcfs" = "last" here, "lcf" = "least_computed").
PREEMPTION_VICTIMS = ("last", "least_computed", "lowest_priority")
KV_ALLOCATORS = ("paged", "contiguous")
CONTIGUOUS_RESERVES = ("max_model_len", "request")
EXECUTORS = ("model", "sim")
ADMISSION_MODES = ("max_utilization", "guaranteed_no_evict", "conservative", "static_batch")
PRESET_NAMES = ("vllm", "sglang", "trtllm", "tgi")
KV_OFFLOAD_POLICIES = ("write_through", "write_back")
SPECULATIVE_METHODS = ("ngram",)
# TensorRT-LLM's CapacitySchedulerPolicy names -> minibatch's admission modes (the same rules; see
# minibatch.admission). ``capacity_scheduler_policy=`` is accepted as an alias of ``admission=``.
CAPACITY_SCHEDULER_POLICIES = {"GUARANTEED_NO_EVICT": "guaranteed_no_evict",
                               "MAX_UTILIZATION": "max_utilization", "STATIC_BATCH": "static_batch"}
ATTENTION_BACKENDS = ("torch", "triton", "cpu")
DTYPES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")

# Every environment variable minibatch reads, and what it does.
ENV_VARS = {
    "OMP_WAIT_POLICY": "set to PASSIVE by `import minibatch` unless already set (spinning OpenMP threads "
                       "slow torch down badly when processes share the cores); ACTIVE is faster on an idle machine",
    "MINIBATCH_KERNELS": "attention kernels: triton | cpu | torch (default: triton on CUDA, cpu on CPU "
                         "when the C kernels build)",
    "MINIBATCH_CPU_KERNEL": "0 turns the C kernels off (the torch path runs)",
    "MINIBATCH_CACHE": "where the C kernels are compiled to (default: $XDG_CACHE_HOME/minibatch or "
                       "~/.cache/minibatch)",
    "MINIBATCH_PREPACK": "0 keeps plain F.linear instead of oneDNN-prepacked projection weights (CPU float32)",
    "MINIBATCH_GEMM_BUCKETS": "0 stops padding GEMM row counts to a bounded set of sizes (CPU prepacked weights)",
    "MINIBATCH_SMALL_M_ROWS": "projections of at most this many rows, and decode steps of at most this many "
                              "sequences, run in C from panel-packed weights (default 128; 0 turns it off)",
    "MINIBATCH_FUSED_DECODE": "0 runs small decode steps op by op instead of as one C call over every layer "
                              "(CPU float32, cpu backend; minibatch/kernels/cpu_decode.c)",
    "MINIBATCH_ONE_THREAD_TOKENS": "CPU steps of at most this many tokens run on one OpenMP thread, so no "
                                   "parallel region wakes or waits for another thread (default 0: off; "
                                   "minibatch.kernels.cpu_threads)",
    "MINIBATCH_API_KEY": "default of `serve --api-key`",
    "MINIBATCH_LABS_DIR": "the labs folder that `python -m minibatch.labs` uses (default: the checkout's labs/)",
    "MINIBATCH_PROPERTY_EXAMPLES": "tests: examples per Hypothesis property test",
    "MINIBATCH_ARTIFACTS": "tests: where screenshots and other test artifacts go (default: artifacts/)",
}


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ[name]`` for a variable listed in :data:`ENV_VARS` (a typo fails loudly)."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not one of minibatch's environment variables: {sorted(ENV_VARS)}")
    return os.environ.get(name, default)


def option(default, help: str, choices=None, flags: tuple[str, ...] = (), parse=None, **kw):
    """A config field with what the command line needs to know about it."""
    meta = {"help": help, "choices": choices, "flags": flags, "parse": parse}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def parse_duration_ms(text) -> float:
    """``"30ms"``, ``"0.03s"`` or a bare number of milliseconds -> milliseconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    t = str(text).strip().lower()
    try:
        if t.endswith("ms"):
            return float(t[:-2])
        if t.endswith("s"):
            return float(t[:-1]) * 1000.0
        return float(t)
    except ValueError:
        raise ValueError(f"cannot read duration {text!r}; write e.g. 30ms or 0.03s") from None


def _policy_names() -> tuple[str, ...]:
    from minibatch.policies import available
    return tuple(available())


@dataclass
class EngineConfig:
    """Every knob of the engine.

    KV cache size: ``num_kv_blocks`` if given; else ``kv_cache_memory_bytes`` (a budget
    in bytes) divided by the bytes of one block; else a default budget (256 MiB on CPU,
    ``gpu_memory_utilization`` of the free GPU memory on CUDA). The engine records the
    values it resolves (``max_model_len``, ``num_kv_blocks``) on its own copy of the
    config, ``LLMEngine.config``.
    """

    model: str = option("tiny", "'tiny' (embedded), a local Hugging Face checkpoint directory, or (simulator) "
                                "a model name such as llama-2-7b")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's)")
    max_num_seqs: int = option(256, "most requests in one step's batch")
    max_num_batched_tokens: int = option(2048, "most new tokens computed in one step (the token budget)")
    max_model_len: int | None = option(None, "longest sequence, prompt + output (default: what the model supports)")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks in the pool (default: from kv_cache_memory_bytes)")
    kv_cache_memory_bytes: int | None = option(None, "KV cache budget in bytes (default: 256 MiB on CPU, "
                                                     "gpu_memory_utilization of free GPU memory)")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights + KV cache")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    enable_prefix_caching: bool = option(False, "reuse the KV blocks of identical prompt prefixes")
    preemption_mode: str = option("recompute", "what preemption does with a victim's KV", PREEMPTION_MODES)
    preemption_victim: str = option("last", "which running request a preemption evicts, among those the policy "
                                            "ranks below the one that needs blocks: the lowest ranked (last), the "
                                            "one with the fewest computed tokens (least_computed), or the largest "
                                            "(priority, arrival_time) (lowest_priority)", PREEMPTION_VICTIMS)
    policy: str = option("continuous", "scheduling policy", _policy_names, flags=("--scheduling-policy",))
    max_wait_ms: float = option(0.0, "dynamic batching window, e.g. 30ms or 0.03s (a bare number is ms)",
                                flags=("--max-wait",), parse=parse_duration_ms)
    admission: str = option("max_utilization", "admission control", ADMISSION_MODES)
    executor: str = option("model", "run the real model, or the simulator's cost model", EXECUTORS)
    hardware: str | None = option(None, "simulator hardware, e.g. a100-80g, 4xa10, profile:FILE")
    kv_allocator: str = option("paged", "KV allocator (contiguous reserves max_model_len per request)",
                               KV_ALLOCATORS)
    contiguous_reserve: str = option("max_model_len", "what a contiguous reservation holds: max_model_len for "
                                     "every request, or each request's own min(prompt + max_tokens, "
                                     "max_model_len)", CONTIGUOUS_RESERVES)
    device: str | None = option(None, "cpu or cuda (default: cuda if available)")
    dtype: str | None = option(None, "weight and KV dtype (default: bfloat16 on CUDA, float32 on CPU)", DTYPES)
    seed: int = option(0, "seed of the random weights and of unseeded sampling")
    attention_backend: str | None = option(None, "attention kernels (default: $MINIBATCH_KERNELS, else triton "
                                                 "on CUDA, cpu on CPU)", ATTENTION_BACKENDS)
    swap_space_blocks: int | None = option(None, "host blocks for swap preemption (default: as many as the pool)")
    # Async scheduling (minibatch.overlap): vLLM's --async-scheduling (SchedulerConfig.async_scheduling).
    async_scheduling: bool = option(False, "plan step N+1 while step N's forward runs (vLLM's async scheduling: "
                                           "less CPU time between steps, one more step before a new request's "
                                           "first token)")
    # A host tier below the device pool for prefix blocks (minibatch.kv_offload): off unless one is sized.
    kv_offloading_size: float | None = option(None, "host tier for prefix-cache blocks, in GiB (vLLM's "
                                                    "--kv-offloading-size; needs enable_prefix_caching)")
    kv_offload_blocks: int = option(0, "host tier for prefix-cache blocks, in blocks (0: none; instead of "
                                       "kv_offloading_size)")
    kv_offload_policy: str = option("write_through", "when blocks reach the host tier: when computed, or when the "
                                                     "device pool evicts them (SGLang's --hicache-write-policy)",
                                    KV_OFFLOAD_POLICIES)
    kv_offload_bandwidth: float = option(25e9, "simulator: host<->device copy bandwidth in bytes/s (PCIe Gen4 x16 "
                                               "achieves ~25 GB/s per direction)")
    # Multi-LoRA serving (minibatch.lora): vLLM's --enable-lora, --max-loras, --max-lora-rank.
    enable_lora: bool = option(False, "serve LoRA adapters (a request names one with lora_request)")
    max_loras: int = option(1, "adapter slots: most distinct LoRA adapters in one step (vLLM's max_loras)")
    max_lora_rank: int = option(16, "largest LoRA rank accepted; slots are sized for it (vLLM's max_lora_rank)")
    preset: str | None = option(None, "a framework's defaults (policy, admission, chunking, limits) for the "
                                      "options not given; see minibatch.presets.describe(name)", PRESET_NAMES)
    # TGI's router (policy "tgi", minibatch.policies.tgi); max_inflight_requests applies to every policy.
    max_waiting_tokens: int = option(20, "tgi policy, unchunked: decode steps after which waiting requests are "
                                         "prefilled even if few")
    waiting_served_ratio: float = option(0.3, "tgi policy, unchunked: prefill new requests early when at least "
                                              "this ratio x running are waiting and fit")
    max_batch_prefill_tokens: int | None = option(None, "tgi policy: prompt tokens in one prefill step (default: "
                                                        "max_num_batched_tokens)")
    max_batch_total_tokens: int | None = option(None, "tgi policy: prompt + max_tokens summed over the running "
                                                      "batch (default: what the KV pool holds)")
    max_inflight_requests: int | None = option(None, "backpressure (TGI's max_concurrent_requests): a request "
                                                     "arriving while this many wait or run is rejected "
                                                     "(default: no limit)")
    # Speculative decoding inside the batch (minibatch.spec_decode): off unless a method is given.
    speculative_method: str | None = option(None, "speculative decoding: 'ngram' (prompt lookup, vLLM's "
                                                  "method='ngram'); greedy requests only", SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(0, "draft tokens per sequence and step (vLLM's num_speculative_tokens)")
    prompt_lookup_min: int | None = option(None, "shortest n-gram the ngram drafter matches (vLLM's; default: "
                                                 "prompt_lookup_max, or 5)")
    prompt_lookup_max: int | None = option(None, "longest n-gram the ngram drafter matches (vLLM's; default: "
                                                 "prompt_lookup_min, or 5)")
    num_speculative_tokens_per_batch_size: list | None = option(
        None, "draft length by batch size, JSON [[lo, hi, k], ...]: k drafts while lo <= running requests <= hi, "
              "a gap inherits the range below, at most num_speculative_tokens (vLLM's name)", parse=json.loads)
    spec_acceptance_rate: float = option(0.6, "simulator only: probability that each draft token is accepted "
                                              "(until the first rejection)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build a config from keywords; ``scheduling_policy`` is an alias of ``policy`` and
        ``capacity_scheduler_policy`` (TensorRT-LLM's names, e.g. ``"MAX_UTILIZATION"``) of
        ``admission``. With ``preset=NAME`` the preset's settings fill every option not given
        (:mod:`minibatch.presets`): an explicit keyword always beats the preset."""
        if "scheduling_policy" in kwargs:
            alias = kwargs.pop("scheduling_policy")
            if "policy" in kwargs and kwargs["policy"] != alias:
                raise ValueError("policy and scheduling_policy disagree; pass one of them")
            kwargs["policy"] = alias
        if "capacity_scheduler_policy" in kwargs:
            name = kwargs.pop("capacity_scheduler_policy")
            mode = CAPACITY_SCHEDULER_POLICIES.get(str(name).upper())
            if mode is None:
                raise ValueError(f"unknown capacity_scheduler_policy {name!r}; expected one of "
                                 f"{tuple(CAPACITY_SCHEDULER_POLICIES)}")
            if "admission" in kwargs and kwargs["admission"] != mode:
                raise ValueError("admission and capacity_scheduler_policy disagree; pass one of them")
            kwargs["admission"] = mode
        if kwargs.get("preset") is not None:
            from minibatch.presets import settings
            kwargs = {**settings(kwargs["preset"]), **kwargs}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(names)}")
        config = cls(**kwargs)
        config.validate()
        return config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "EngineConfig":
        """A validated copy with ``changes`` applied."""
        return EngineConfig.from_kwargs(**{**self.to_dict(), **changes})

    @property
    def scheduling_policy(self) -> str:
        return self.policy

    def validate(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting_tokens", "max_loras",
                     "max_lora_rank"):
            positive_int(name)
        for name in ("num_kv_blocks", "max_model_len", "kv_cache_memory_bytes", "max_batch_prefill_tokens",
                     "max_batch_total_tokens", "max_inflight_requests"):
            if getattr(self, name) is not None:
                positive_int(name)
        if not isinstance(self.waiting_served_ratio, (int, float)) or isinstance(self.waiting_served_ratio, bool) \
                or not 0 <= self.waiting_served_ratio < float("inf"):
            raise ValueError(f"waiting_served_ratio must be a finite number >= 0, got {self.waiting_served_ratio!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if isinstance(choices, tuple) and getattr(self, f.name) is not None \
                    and getattr(self, f.name) not in choices:
                raise ValueError(f"unknown {f.name} {getattr(self, f.name)!r}; expected one of {choices}")
        if self.kv_allocator == "contiguous" and self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs kv_allocator='paged' (a contiguous reservation "
                             "cannot share blocks)")
        if self.swap_space_blocks is not None and (not isinstance(self.swap_space_blocks, int)
                                                   or isinstance(self.swap_space_blocks, bool)
                                                   or self.swap_space_blocks < 0):
            raise ValueError(f"swap_space_blocks must be an integer >= 0, got {self.swap_space_blocks!r}")
        self._validate_kv_offload()
        self._validate_async_scheduling()
        self._validate_speculative()
        if not isinstance(self.max_wait_ms, (int, float)) or isinstance(self.max_wait_ms, bool) \
                or not 0 <= self.max_wait_ms < float("inf"):
            raise ValueError(f"max_wait_ms must be a finite number >= 0, got {self.max_wait_ms!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def _validate_speculative(self) -> None:
        """The speculative-decoding options (minibatch.spec_decode)."""
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.prompt_lookup_min is not None and self.prompt_lookup_max is not None \
                and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        table = self.num_speculative_tokens_per_batch_size
        if table is not None:
            def is_int(x):
                return isinstance(x, int) and not isinstance(x, bool)
            if not isinstance(table, (list, tuple)) or not all(
                    isinstance(e, (list, tuple)) and len(e) == 3 and all(map(is_int, e))
                    and 1 <= e[0] <= e[1] and e[2] >= 0 for e in table):
                raise ValueError("num_speculative_tokens_per_batch_size must be a list of [lo, hi, k] integer "
                                 f"triples with 1 <= lo <= hi and k >= 0, got {table!r}")
            spans = sorted((e[0], e[1]) for e in table)
            if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
                raise ValueError(f"num_speculative_tokens_per_batch_size ranges overlap: {table!r}")
            if not spans or spans[0][0] != 1:     # as vLLM 0.34.0 (vllm/v1/spec_decode/dynamic/utils.py)
                raise ValueError("num_speculative_tokens_per_batch_size: the first range must start at batch "
                                 f"size 1, got {table!r}")
        if (k or table) and self.speculative_method is None:
            raise ValueError("num_speculative_tokens / num_speculative_tokens_per_batch_size need "
                             "speculative_method (e.g. 'ngram')")
        a = self.spec_acceptance_rate
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not 0.0 <= a <= 1.0:
            raise ValueError(f"spec_acceptance_rate must be a probability in [0, 1], got {a!r}")

    def _validate_async_scheduling(self) -> None:
        """What async scheduling (minibatch.overlap) cannot be combined with."""
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if not self.async_scheduling:
            return
        if self.preemption_mode == "swap":
            raise ValueError("async_scheduling needs preemption_mode='recompute': a swap copies a victim's KV "
                             "while the step in flight may still write it")
        if getattr(self, "speculative_method", None) is not None:
            raise ValueError("async_scheduling does not support speculative_method (as in vLLM v0.11.0: "
                             "async scheduling without speculative decoding)")

    def _validate_kv_offload(self) -> None:
        """The host tier's options (minibatch.kv_offload)."""
        blocks, size, bw = self.kv_offload_blocks, self.kv_offloading_size, self.kv_offload_bandwidth
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
            raise ValueError(f"kv_offload_blocks must be an integer >= 0, got {blocks!r}")
        if size is not None and (not isinstance(size, (int, float)) or isinstance(size, bool)
                                 or not 0 < size < float("inf")):
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {size!r}")
        if blocks and size is not None:
            raise ValueError("kv_offload_blocks and kv_offloading_size both size the host tier; pass one of them")
        if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not 0 < bw < float("inf"):
            raise ValueError(f"kv_offload_bandwidth must be a finite number of bytes/s > 0, got {bw!r}")
        if (blocks or size is not None) and not self.enable_prefix_caching:
            raise ValueError("a host tier (kv_offload_blocks / kv_offloading_size) extends the prefix cache: "
                             "it needs enable_prefix_caching=True")


# -- the command line, generated from the fields ----------------------------------------------
def _field_type(f: dataclasses.Field):
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return hint


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One flag per :class:`EngineConfig` field (``--max-num-seqs`` for ``max_num_seqs``).

    Every flag defaults to ``None`` ("not given"), so that only what the user typed
    reaches the config and the field's own default applies otherwise; ``defaults``
    overrides a field's default for this command (``simulate``: ``model="llama-2-7b"``).
    """
    defaults = defaults or {}
    group = parser.add_argument_group("engine options (EngineConfig fields)")
    for f in fields(EngineConfig):
        meta = f.metadata
        kind = _field_type(f)
        shown = defaults.get(f.name, f.default)
        help_ = meta.get("help", "") + ("" if shown is None else f" (default: {shown})")
        names = [f"--{f.name.replace('_', '-')}", *meta.get("flags", ())]
        kw: dict = {"dest": f.name, "default": None, "help": help_}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = meta.get("parse") or kind
            choices = meta.get("choices")
            if callable(choices):
                choices = choices()
            if choices:
                kw["choices"] = choices
                kw["metavar"] = "{" + ",".join(choices) + "}"
        group.add_argument(*names, **kw)


def engine_kwargs(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The engine options given on the command line (and ``defaults`` for the rest)."""
    kw = dict(defaults or {})
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            kw[f.name] = value
    return kw
