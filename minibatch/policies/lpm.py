"""Longest prefix match: SGLang's cache-aware ordering (Zheng et al., NeurIPS'24), with aging.

Rule: running requests first; then waiting requests in decreasing order of

    score = cached_prefix_tokens(req) + aging_tokens_per_s * (now - arrival_time)

where ``cached_prefix_tokens`` is how much of the request's prompt the prefix cache
holds now, found by walking the KV manager's radix tree (``minibatch.radix``). Serving
the requests that share what is cached first keeps the cache hot (fewer evictions,
higher hit rate, less prefill). SGLang's ``schedule_policy.py`` calls this ``lpm`` and
falls back to FCFS when the queue is long (matching every request each step costs
time); so does this policy above ``max_queue`` (128, SGLang's threshold) waiting
requests. It needs ``enable_prefix_caching=True``; without it every score is its age
alone and the order is FCFS.

Aging guard: pure LPM can starve a cache-cold request forever while requests sharing a
hot prefix keep arriving. With aging, a request with no cached prefix ranks ahead of
every request with a cached prefix of ``p`` tokens that arrived ``p / aging_tokens_per_s``
seconds or more after it (ties go to the earlier arrival).
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register


@register
class LPMPolicy(Policy):
    name = "lpm"

    def __init__(self, aging_tokens_per_s: float = 100.0, max_queue: int = 128):
        self.aging_tokens_per_s = aging_tokens_per_s
        self.max_queue = max_queue

    def schedule_order(self, state: SchedulerState):
        waiting = state.waiting
        if len(waiting) > self.max_queue or getattr(state.kv, "radix", None) is None:
            return state.running + sorted(waiting, key=lambda r: r.arrival_time)
        now, kv = state.now, state.kv

        def key(r):
            score = kv.cached_prefix_len(r) + self.aging_tokens_per_s * self.waited(r, now)
            return (-score, r.arrival_time)

        return state.running + sorted(waiting, key=key)
