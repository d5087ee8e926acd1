"""Priority scheduling with aging, preemptive or not, with optional per-class limits (QoS).

Rule: requests are ranked by

    key = (priority - (now - arrival_time) / aging_s,  arrival_time)

lower first: ``priority`` is the request's class, lower = more urgent (vLLM's
convention), ties go to the earlier arrival.

``preemptive=True`` (the default) ranks running and waiting requests together: a
waiting request ranked above running ones runs first, and takes their KV blocks (they
are preempted, lowest ranked first) when the pool is short; running requests ranked
below the ``max_num_seqs`` best keep their KV but pause. This is what vLLM V0's
priority scheduling did (PR #5958, "force preemption" of running requests of lower
priority than waiting ones). A waiting request goes ahead of a running one only if
its level (the key's first part) is lower by *more* than ``margin`` levels; otherwise
the running one stays ahead. With the default ``margin=0`` and strict priority, a
request never evicts one of its own class (that would only trade KV back and forth
between equals); SGLang's ``--priority-scheduling-preemption-threshold`` (v0.5.3,
default 10, ``schedule_policy.py`` ``PrefillAdder.preempt_to_schedule``) is the same
rule in its own priority units.

``preemptive=False`` is vLLM V1's ``--scheduling-policy priority`` (v0.11.0,
``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule`` and ``request_queue.py``
``PriorityRequestQueue``): running requests first, then the waiting queue, each in key
order. A waiting request never evicts a running one; when a *running* request cannot
grow, the victim is the lowest-ranked running request (vLLM:
``max(self.running, key=lambda r: (r.priority, r.arrival_time))``). So an urgent
arrival waits while less urgent requests hold the KV pool: priority inversion.

Aging: a request gains one priority level per ``aging_s`` seconds since its arrival,
so a class-``p`` request outranks fresh class-0 requests after ``p * aging_s``
seconds, which bounds starvation. ``aging_s=None`` gives strict priority (vLLM's
behaviour, which can starve low classes under sustained overload).

Per-class limits, for admission only (running requests are never cut): a waiting
request of class ``c`` is left out of the order (it waits) while

* ``max_running[c]`` requests of class ``c`` already run (a concurrency cap per class), or
* ``kv_quota[c]`` would be exceeded: every admitted request of class ``c`` counts the
  blocks it holds at most over its life, ``blocks(min(prompt + max_tokens,
  max_model_len))``, and their sum stays within the quota. A class then never holds
  more than its quota, so the other classes always find the rest of the pool: a KV
  reservation for them. A single request larger than its class's whole quota is
  admitted only while its class holds nothing (so it cannot wait forever).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


def _limits(name: str, limits: Mapping[int, int] | None) -> dict[int, int]:
    out = dict(limits or {})
    for cls, n in out.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}[{cls!r}] must be an integer >= 1, got {n!r}")
    return out


@register
class PriorityPolicy(Policy):
    name = "priority"

    def __init__(self, aging_s: float | None = 60.0, preemptive: bool = True, margin: float = 0.0,
                 max_running: Mapping[int, int] | None = None, kv_quota: Mapping[int, int] | None = None):
        self.aging_s = aging_s
        self.preemptive = preemptive
        self.margin = margin
        self.max_running = _limits("max_running", max_running)
        self.kv_quota = _limits("kv_quota", kv_quota)

    def key(self, req: Request, now: float) -> tuple[float, float]:
        boost = self.waited(req, now) / self.aging_s if self.aging_s else 0.0
        return (req.priority - boost, req.arrival_time)

    @staticmethod
    def committed_blocks(req: Request, kv) -> int:
        """The most blocks ``req`` holds over its life (what a KV quota counts)."""
        return kv.blocks_for_request(kv.planned_len(req))

    def schedule_order(self, state: SchedulerState):
        def k(r):
            return self.key(r, state.now)

        running, waiting = sorted(state.running, key=k), sorted(state.waiting, key=k)
        if self.preemptive:
            order = self._merge(running, waiting, k)
        else:
            order = running + waiting
        if self.max_running or self.kv_quota:
            order = self._within_limits(order, state)
        return order

    def _merge(self, running: list[Request], waiting: list[Request], k) -> list[Request]:
        """Both lists (each in key order) in one order: a waiting request goes before a
        running one iff its level is lower by more than ``margin``."""
        out, i, j = [], 0, 0
        while i < len(waiting) and j < len(running):
            if k(waiting[i])[0] + self.margin < k(running[j])[0]:
                out.append(waiting[i])
                i += 1
            else:
                out.append(running[j])
                j += 1
        return out + waiting[i:] + running[j:]

    def _within_limits(self, order: list[Request], state: SchedulerState) -> list[Request]:
        """``order`` without the waiting requests that their class's limits keep out. The
        counts include waiting requests kept earlier in the order (the scheduler may admit
        them this step)."""
        running = {r.request_id for r in state.running}
        count = Counter(r.priority for r in state.running)
        held = Counter()
        if self.kv_quota:
            for r in state.running:
                held[r.priority] += self.committed_blocks(r, state.kv)
        out = []
        for req in order:
            cls = req.priority
            if req.request_id not in running:
                if cls in self.max_running and count[cls] >= self.max_running[cls]:
                    continue
                if cls in self.kv_quota:
                    need = self.committed_blocks(req, state.kv)
                    if held[cls] + need > self.kv_quota[cls] and (held[cls] or count[cls]):
                        continue
                    held[cls] += need
                count[cls] += 1
            out.append(req)
        return out
