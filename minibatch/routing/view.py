"""What a router may see of one replica: :class:`ReplicaView`.

The same view is built by the simulated cluster (``minibatch.cluster.replica``, from an
engine under a virtual clock), by the HTTP router (``minibatch.serving.upstreams``, from
what it polls of each upstream's ``/metrics`` and what it has sent there) and by the Ray
Serve request router (``minibatch.cluster.ray_router``, from Ray's routing stats), so that
one router class routes in all three.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaView:
    """One replica as a router sees it when a request arrives (read-only)."""

    index: int                    # the replica's number in the cluster (0..N-1)
    model: str                    # the model it serves
    num_running: int              # admitted requests (holding KV blocks)
    num_waiting: int              # queued requests, preempted ones included
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    in_flight_tokens: int         # prompt + generated tokens of its unfinished requests
    active_blocks: int            # KV blocks those tokens fill, sum of ceil(tokens / block_size)
    cached_prefix_tokens: int = 0  # this request's prompt tokens in its prefix cache (0 if caching is off)
    num_routed: int = 0           # requests routed to it so far
    # LoRA adapters (vLLM's vllm:lora_requests_info gauge: running_lora_adapters, waiting_lora_adapters,
    # max_lora): the adapter names of its running and of its waiting requests, and its slots (0: no LoRA).
    running_adapters: frozenset = frozenset()
    waiting_adapters: frozenset = frozenset()
    max_loras: int = 0

    @property
    def num_requests(self) -> int:
        """Unfinished requests: running + waiting (sgl-router's worker ``load``)."""
        return self.num_running + self.num_waiting

    @property
    def kv_usage(self) -> float:
        """Fraction of its KV blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
