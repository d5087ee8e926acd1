"""Shortest job first, on an estimate of remaining work, with linear aging.

Rule: running requests first, then waiting ones, each group in increasing order of

    key = remaining(req) - aging_tokens_per_s * (now - arrival_time)
    remaining(req) = prefill_weight * (num_tokens - num_computed_tokens)   # tokens to (re)compute now
                   + max(0, predicted_output - num_output_tokens)          # tokens still to generate

i.e. ``prompt + max_tokens - done`` for a fresh request (``prefill_weight=1``, the default).
``prefill_weight`` says what a prompt token costs relative to a generated one: a prompt is
computed in one or a few chunked steps while each output token takes a step of its own, so
when the scarce resource is a batch slot (``max_num_seqs``) the time a request holds it
grows with its output, not its prompt; ``prefill_weight=0`` ranks by output alone. ``predictor(req)`` predicts
the output length (default: ``max_tokens``, an oracle when runs use
``ignore_eos=True``; plug in a learned length predictor as in Qiu et al. 2024, or
*S^3*, Jin et al. NeurIPS'23). SJF minimises mean waiting time when the estimates
are right (Smith's rule; for LLMs: Fu et al., *Efficient LLM Scheduling by Learning
to Rank*, 2024).

Aging (so nothing starves): the key falls by ``aging_tokens_per_s`` per second
waited. Every key of a fresh request is >= 1, so a request of remaining work ``S``
ranks ahead of every request that arrives after it once it has waited
``(S - 1) / aging_tokens_per_s`` seconds; from then on no newcomer overtakes it: it
waits only for requests that arrived before then (shorter ones that arrived after it,
within that time, may stay ahead). ``aging_tokens_per_s=0`` is pure SJF.

Non-preemptive by default (a running request keeps running; when KV runs short the
running request with the most remaining work is preempted first, being last in the
order). ``preemptive=True`` ranks everything together: shortest remaining first (SRPT).
"""

from __future__ import annotations

from collections.abc import Callable

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


@register
class SJFPolicy(Policy):
    name = "sjf"

    def __init__(self, predictor: Callable[[Request], int] | None = None,
                 aging_tokens_per_s: float = 50.0, preemptive: bool = False, prefill_weight: float = 1.0):
        if prefill_weight < 0:
            raise ValueError(f"prefill_weight must be >= 0, got {prefill_weight!r}")
        self.predictor = predictor
        self.aging_tokens_per_s = aging_tokens_per_s
        self.preemptive = preemptive
        self.prefill_weight = prefill_weight

    def predicted_output(self, req: Request) -> int:
        if self.predictor is None:
            return req.sampling_params.max_tokens
        if "sjf_predicted" not in req.policy_state:       # predict once per request
            req.policy_state["sjf_predicted"] = int(self.predictor(req))
        return req.policy_state["sjf_predicted"]

    def remaining(self, req: Request) -> int:
        return (self.prefill_weight * (req.num_tokens - req.num_computed_tokens)
                + max(0, self.predicted_output(req) - req.num_output_tokens))

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return (self.remaining(req) - self.aging_tokens_per_s * self.waited(req, now), req.arrival_time)

    def schedule_order(self, state: SchedulerState):
        def k(r):
            return self.key(r, state.now)

        if self.preemptive:
            return sorted(state.running + state.waiting, key=k)
        return sorted(state.running, key=k) + sorted(state.waiting, key=k)
