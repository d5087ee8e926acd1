"""The policy interface and the registry of policies by name.

A policy makes one decision per engine step: in which order the requests compete for
this step's token budget, sequence slots and KV blocks. The scheduler
(``minibatch.scheduler``) does the rest the same way for every policy: it walks the
order, hands each request its new tokens (a chunk of them if the budget runs short),
allocates KV blocks, and when the pool is exhausted preempts running requests from the
*end* of the order. Requests the policy leaves out of the order simply wait (a running
one keeps its KV blocks but computes nothing this step).

Rules every policy keeps, so that it can be switched in mid-run (``RunController``):

* its state lives in the policy object and in ``req.policy_state`` (a dict; use keys
  prefixed with the policy's name);
* it must cope with requests it has never seen (running ones included): it builds
  their state lazily from the request itself;
* it orders only requests of ``state.running`` and ``state.waiting`` (the scheduler
  ignores anything else). ``state.waiting`` may hold preempted requests (status
  ``WAITING`` after a recompute preemption, ``SWAPPED`` after a swap).
"""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.policies.registry import Registry
from minibatch.request import Request


@dataclass
class SchedulerState:
    """What a policy may look at when it decides (read-only by convention)."""

    now: float
    running: list[Request]        # admitted requests holding KV, in admission order
    waiting: list[Request]        # arrived requests not admitted (or preempted), queue order
    max_num_seqs: int
    max_num_batched_tokens: int
    max_wait_s: float
    kv: object                    # KVCacheManager
    config: object = None         # the engine's EngineConfig (policies with their own knobs read them here)


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`schedule_order`.

    ``preemptive = True`` lets a waiting request that the order ranks above a running
    one take that running request's KV blocks (the running one is preempted).

    Three switches change how the scheduler hands out one step (all off by default;
    TensorRT-LLM's rules, ``minibatch.policies.trtllm``, turn them on):
    ``decode_budget_first`` (with chunked prefill) sets aside one token of the budget for
    every decode among the first ``max_num_seqs`` of the order before any prompt chunk is
    cut; ``chunk_to_block`` rounds a prompt chunk cut short by the budget down to whole KV
    blocks; ``stop_at_refusal`` admits no later waiting request once one was refused, even
    when the refused one could have evicted, and schedules nothing that comes after a
    preempted request in the order (that step's walk ends at its place).
    """

    name: str = ""
    preemptive: bool = False
    decode_budget_first: bool = False
    chunk_to_block: bool = False
    stop_at_refusal: bool = False
    num_padded_slots: int = 0   # request-level batching: slots of finished members this step

    @staticmethod
    def waited(req: Request, now: float) -> float:
        """Seconds since ``req`` arrived (the age that aging rules use)."""
        return max(0.0, now - req.arrival_time)

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        raise NotImplementedError

    def fallback_order(self, state: SchedulerState) -> list[Request] | None:
        """Asked once when nothing of :meth:`schedule_order`'s order could run this step (admission
        or KV refused all of it): another order for the same step, or ``None`` (the default)."""
        return None

    def next_wakeup(self, state: SchedulerState) -> float | None:
        """A time at which the policy wants a step even if no request arrives (e.g. a
        batching window closing); ``None`` if it has no such deadline."""
        return None

    def on_finished(self, req: Request) -> None:
        """Called when a request leaves the engine (finished or aborted)."""

    def on_step(self, scheduled: list[tuple[Request, int]], now: float) -> None:
        """Called after each step with the requests that ran and their new token counts."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


POLICIES = Registry(Policy, "scheduling policy", "policies")
register = POLICIES.register          # ``@register``: add a policy under its ``name``
available = POLICIES.available        # names of all registered policies
make_policy = POLICIES.make           # an instance from a name (or a class, or an instance as is)
