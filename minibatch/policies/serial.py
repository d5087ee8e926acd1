"""Serial: one request at a time, first come first served (no batching at all).

The baseline of chapter 1: a request runs from its prefill to its last token alone,
then the next one in arrival order starts. Throughput is one sequence's decode speed.
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register


@register
class SerialPolicy(Policy):
    """Order: the running request if there is one, else the oldest waiting one."""

    name = "serial"

    def schedule_order(self, state: SchedulerState):
        return (state.running + state.waiting)[:1]
