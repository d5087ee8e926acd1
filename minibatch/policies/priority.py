"""Preemptive priority scheduling with aging (vLLM's ``--scheduling-policy priority``).

Rule: every request, running or waiting, ranked by

    key = (priority - (now - arrival_time) / aging_s,  arrival_time)

lower first: ``priority`` is the request's class, lower = more urgent (vLLM's
convention), ties go to the earlier arrival. The policy is *preemptive*: a waiting
request ranked above running ones runs first, and takes their KV blocks (they are
preempted, lowest ranked first) when the pool is short; running requests ranked below
the ``max_num_seqs`` best keep their KV but pause.

Aging: a request gains one priority level per ``aging_s`` seconds since its arrival,
so a class-``p`` request outranks fresh class-0 requests after ``p * aging_s``
seconds, which bounds starvation. ``aging_s=None`` gives strict priority (vLLM's
behaviour, which can starve low classes under sustained overload).
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


@register
class PriorityPolicy(Policy):
    name = "priority"
    preemptive = True

    def __init__(self, aging_s: float | None = 60.0):
        self.aging_s = aging_s

    def key(self, req: Request, now: float) -> tuple[float, float]:
        boost = self.waited(req, now) / self.aging_s if self.aging_s else 0.0
        return (req.priority - boost, req.arrival_time)

    def schedule_order(self, state: SchedulerState):
        return sorted(state.running + state.waiting, key=lambda r: self.key(r, state.now))
