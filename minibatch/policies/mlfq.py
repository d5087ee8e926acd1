"""FastServe's skip-join multi-level feedback queue (Wu et al., *Fast Distributed
Inference Serving for Large Language Models*, arXiv:2305.05920, 2023).

Levels ``0 .. num_levels-1``; level ``i`` has a quantum of
``base_quantum * 2**i`` generated tokens (the last level's is unbounded).

* **Skip-join**: a new request enters the highest level whose quantum covers its
  prefill, instead of always level 0: ``level = min{i : quantum_i >= prefill_cost}``,
  with ``prefill_cost = ceil(prompt_len / prompt_tokens_per_iteration)`` decode
  iterations (a prefill of that many tokens takes about as long as one decode
  iteration; or pass ``prefill_cost(req)``). Long prompts skip the top levels, so they
  cannot block short ones there.
* **Demotion**: after generating its level's quantum of tokens at that level, a
  request drops one level (its counter restarts).
* **Preemption at token granularity**: every step, requests are ordered by
  ``(level, time they entered the level)``; a newcomer at a higher level runs ahead of
  running lower-level requests at the very next step (``preemptive = True``: they pause,
  keeping their KV, or give it up if the pool is short).
* **Starvation promotion**: a request not served for ``starve_limit_s`` seconds goes
  back to level 0.

State per request (``req.policy_state``): ``mlfq_level``, ``mlfq_used`` (tokens generated
at this level), ``mlfq_since`` (time it entered the level), ``mlfq_served`` (last time it
ran), ``mlfq_out`` (output tokens already counted). Requests never seen before (e.g.
after a mid-run policy switch) are skip-joined on first sight.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


@register
class MLFQPolicy(Policy):
    name = "mlfq"
    preemptive = True

    def __init__(self, num_levels: int = 6, base_quantum: int = 4, prompt_tokens_per_iteration: int = 128,
                 starve_limit_s: float = 10.0, prefill_cost: Callable[[Request], float] | None = None):
        self.num_levels = num_levels
        self.base_quantum = base_quantum
        self.prompt_tokens_per_iteration = prompt_tokens_per_iteration
        self.starve_limit_s = starve_limit_s
        self.prefill_cost = prefill_cost
        self.num_demotions = 0
        self.num_promotions = 0

    def quantum(self, level: int) -> float:
        return math.inf if level >= self.num_levels - 1 else self.base_quantum * 2 ** level

    def skip_join_level(self, req: Request) -> int:
        cost = (self.prefill_cost(req) if self.prefill_cost is not None
                else math.ceil(req.num_prompt_tokens / self.prompt_tokens_per_iteration))
        return next(i for i in range(self.num_levels) if self.quantum(i) >= cost)

    def _enter(self, req: Request, level: int, now: float) -> None:
        st = req.policy_state
        st["mlfq_level"], st["mlfq_used"], st["mlfq_since"] = level, 0, now
        st.setdefault("mlfq_out", req.num_output_tokens)

    def schedule_order(self, state: SchedulerState):
        now = state.now
        reqs = state.running + state.waiting
        for r in reqs:
            st = r.policy_state
            if "mlfq_level" not in st:                       # skip-join
                self._enter(r, self.skip_join_level(r), r.arrival_time)
                st["mlfq_served"] = r.arrival_time
            elif st["mlfq_level"] > 0 and now - st["mlfq_served"] > self.starve_limit_s:
                self._enter(r, 0, now)                       # starvation promotion
                st["mlfq_served"] = now
                self.num_promotions += 1
        return sorted(reqs, key=lambda r: (r.policy_state["mlfq_level"], r.policy_state["mlfq_since"],
                                           r.arrival_time))

    def on_step(self, scheduled, now):
        for r, _ in scheduled:
            st = r.policy_state
            if "mlfq_level" not in st or r.is_finished:
                continue
            st["mlfq_served"] = now
            st["mlfq_used"] += r.num_output_tokens - st["mlfq_out"]
            st["mlfq_out"] = r.num_output_tokens
            if st["mlfq_used"] >= self.quantum(st["mlfq_level"]):
                self._enter(r, st["mlfq_level"] + 1, now)     # demotion
                self.num_demotions += 1
