"""The per-step timeline the engine records."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRecord:
    """One engine step: when it ran, what it computed, and the KV cache after it."""

    step: int
    start_time: float
    duration: float
    forward_time: float
    num_seqs: int
    num_prefill_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_total: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
