"""Iteration-level FCFS: continuous batching (Orca, OSDI'22; vLLM's default)."""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register


@register
class ContinuousPolicy(Policy):
    """Every step, running requests first (oldest first), then waiting ones in arrival order.

    New requests join the batch at any step and finished ones leave at once; when KV
    runs out the most recently admitted running request is preempted (vLLM's choice).
    There is no batching window: ``max_wait_ms`` is ignored (vLLM has no such flag; the
    ``dynamic`` policy is the one that waits).
    """

    name = "continuous"

    def schedule_order(self, state: SchedulerState):
        return state.running + state.waiting
