"""Engine configuration: one dataclass, vLLM's names where vLLM has one."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

PREEMPTION_MODES = ("recompute", "swap")
KV_ALLOCATORS = ("paged", "contiguous")
EXECUTORS = ("model", "sim")
ADMISSION_MODES = ("max_utilization", "guaranteed_no_evict", "conservative")


@dataclass
class EngineConfig:
    """Every knob of the engine.

    KV cache size: ``num_kv_blocks`` if given; else ``kv_cache_memory_bytes`` (a budget
    in bytes) divided by the bytes of one block; else a default budget (256 MiB on CPU,
    ``gpu_memory_utilization`` of the free GPU memory on CUDA).
    """

    model: str = "tiny"
    tokenizer: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    policy: str = "continuous"
    max_wait_ms: float = 0.0
    admission: str = "max_utilization"
    executor: str = "model"
    hardware: str | None = None
    kv_allocator: str = "paged"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    attention_backend: str | None = None
    swap_space_blocks: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build a config from keywords; ``scheduling_policy`` is an alias of ``policy``."""
        if "scheduling_policy" in kwargs:
            alias = kwargs.pop("scheduling_policy")
            if "policy" in kwargs and kwargs["policy"] != alias:
                raise ValueError("policy and scheduling_policy disagree; pass one of them")
            kwargs["policy"] = alias
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(names)}")
        config = cls(**kwargs)
        config.validate()
        return config

    @property
    def scheduling_policy(self) -> str:
        return self.policy

    def validate(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive_int(name)
        if self.num_kv_blocks is not None:
            positive_int("num_kv_blocks")
        if self.max_model_len is not None:
            positive_int("max_model_len")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; expected one of {PREEMPTION_MODES}")
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"unknown kv_allocator {self.kv_allocator!r}; expected one of {KV_ALLOCATORS}")
        if self.kv_allocator == "contiguous" and self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching needs kv_allocator='paged' (a contiguous reservation "
                             "cannot share blocks)")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"unknown admission {self.admission!r}; expected one of {ADMISSION_MODES}")
        if self.swap_space_blocks is not None and (not isinstance(self.swap_space_blocks, int)
                                                   or isinstance(self.swap_space_blocks, bool)
                                                   or self.swap_space_blocks < 0):
            raise ValueError(f"swap_space_blocks must be an integer >= 0, got {self.swap_space_blocks!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; expected one of {EXECUTORS}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
