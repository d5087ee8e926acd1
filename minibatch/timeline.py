"""The per-step timeline the engine records."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRecord:
    """One engine step: when it ran, what it computed, and the KV cache after it.

    Padding (request-level batching, ``static``/``dynamic``): a batch keeps the slots of
    its finished members until its last member finishes; ``num_padded_slots`` counts
    those idle slots in this step. KV waste fractions are measured after the step over
    the running requests: ``kv_reserved_unused`` and ``kv_internal_waste`` by position
    in the block table (``KVCacheManager.waste_slots``); ``kv_reserved``,
    ``kv_internal_frag`` and ``kv_external_frag`` as the vLLM paper (§3) defines reserved
    slots, internal and external fragmentation (``KVCacheManager.fragmentation_slots``,
    ``take_stranded_blocks``). All are fractions of the pool's slots.
    """

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
    policy: str = ""                  # the scheduling policy that made this step
    num_padded_slots: int = 0         # slots held by finished members of a request-level batch
    num_swapped_out_blocks: int = 0   # KV blocks copied device -> host (swap preemption)
    num_swapped_in_blocks: int = 0    # KV blocks copied host -> device (resume)
    kv_reserved_unused: float = 0.0   # whole blocks held beyond requests' last tokens / pool slots
    kv_internal_waste: float = 0.0    # empty slots in requests' last, partly filled blocks / pool slots
    kv_reserved: float = 0.0          # held slots the requests will still write (vLLM §3 "reserved")
    kv_internal_frag: float = 0.0     # held slots the requests will never write (vLLM §3)
    kv_external_frag: float = 0.0     # free slots while a contiguous reservation that would fit in
                                      # them in total found no run long enough (vLLM §3), else 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
