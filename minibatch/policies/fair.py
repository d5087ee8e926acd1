"""Per-tenant fairness with a Virtual Token Counter (VTC; Sheng et al., *Fairness in
Serving Large Language Models*, OSDI'24).

Each tenant ``u`` (``req.tenant``; ``None`` is tenant ``"default"``) has a counter
``c_u`` of the service it received, in weighted tokens:

    c_u += (input_weight * prompt tokens computed + output_weight * tokens generated) / weight_u

(the paper's ``w_p = 1``, ``w_q = 2``: an output token costs about twice an input
token; ``tenant_weights`` gives weighted VTC). Rules:

* **Selection**: running requests keep running (in arrival order); waiting requests are
  admitted one by one from the backlogged tenant with the *smallest* counter (its
  oldest request), the counter being advanced tentatively by the pick's prompt so that
  one step's admissions alternate between tenants.
* **Lift**: a tenant that becomes backlogged (it had nothing waiting) has its counter
  raised to the smallest counter of the other active tenants (those with requests
  waiting or running), so that idling does not bank credit.

Bound: Sheng et al. prove that, over any interval in which two tenants are both
backlogged, the weighted service they receive differs by at most a constant ``2U``
(``U`` set by the longest prompt and by how many tokens a batch holds), independent of
the interval's length; FCFS instead serves tenants in proportion to their load, so the
gap grows without limit. ``tests/test_policy_behaviour.py`` checks the bound
``2 * (input_weight * longest prompt + output_weight * longest output)`` on a
simulated overload.

``served`` keeps each tenant's weighted service without lifts, for measurement.
Recomputed tokens after a preemption are not charged twice.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


def tenant_of(req: Request) -> str:
    return req.tenant if req.tenant is not None else "default"


@register
class FairPolicy(Policy):
    name = "fair"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0,
                 tenant_weights: dict[str, float] | None = None):
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tenant_weights = dict(tenant_weights or {})
        self.counters: dict[str, float] = {}
        self.served: dict[str, float] = defaultdict(float)
        self._backlogged: set[str] = set()

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def schedule_order(self, state: SchedulerState):
        queues: dict[str, list[Request]] = defaultdict(list)
        for r in sorted(state.waiting, key=lambda r: r.arrival_time):
            queues[tenant_of(r)].append(r)
        active = set(queues) | {tenant_of(r) for r in state.running}
        for u in set(queues) - self._backlogged:               # newly backlogged: lift
            others = [self.counters[v] for v in active if v != u and v in self.counters]
            self.counters[u] = max(self.counters.get(u, 0.0), min(others, default=0.0))
        self._backlogged = set(queues)
        heap = [(self.counters[u], u) for u in queues]
        heapq.heapify(heap)
        picks: list[Request] = []
        while heap:
            c, u = heapq.heappop(heap)
            r = queues[u].pop(0)
            picks.append(r)
            if queues[u]:
                tentative = c + self.input_weight * (r.num_tokens - r.num_computed_tokens) / self.weight(u)
                heapq.heappush(heap, (tentative, u))
        return sorted(state.running, key=lambda r: r.arrival_time) + picks

    def on_step(self, scheduled, now):
        for r, _ in scheduled:
            st = r.policy_state
            new_in = min(r.num_computed_tokens, r.num_prompt_tokens) - st.get("fair_in", 0)
            new_out = r.num_output_tokens - st.get("fair_out", 0)
            if new_in <= 0 and new_out <= 0:
                continue
            st["fair_in"] = st.get("fair_in", 0) + max(0, new_in)
            st["fair_out"] = r.num_output_tokens
            u = tenant_of(r)
            cost = self.input_weight * max(0, new_in) + self.output_weight * max(0, new_out)
            self.counters[u] = self.counters.get(u, 0.0) + cost / self.weight(u)
            self.served[u] += cost
