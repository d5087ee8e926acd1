"""Admission control: may a waiting request start now, given the KV it will need later?

The scheduler asks ``can_admit`` before it gives a waiting (or swapped-out) request its
first blocks. Four modes (``EngineConfig.admission``):

``max_utilization`` (default; vLLM, TensorRT-LLM ``MAX_UTILIZATION``)
    Optimistic: admit whenever this step's blocks are free. If running requests later
    run out of blocks, some are preempted (recompute or swap). Highest concurrency,
    but preemptions under memory pressure.

``guaranteed_no_evict`` (TensorRT-LLM's default ``GUARANTEED_NO_EVICT``; TGI's router)
    Admit only if the request's *whole* future, ``min(prompt + max_tokens,
    max_model_len)`` tokens, fits next to the reserved futures of everything running::

        blocks(final_len(new)) - hit_blocks + sum_running(blocks(final_len(r)) - held(r))
            <= free_blocks

    A running request can then always grow: the engine never preempts.

``conservative`` (SGLang ``schedule_policy.PrefillAdder``)
    Reserve an *estimate* of each request's future tokens, ``new_token_ratio *
    min(max_tokens - generated, 4096)`` (4096 is SGLang's
    ``CLIP_MAX_NEW_TOKENS_ESTIMATION``), and admit if the new request's uncomputed
    tokens plus its own estimate fit in the free slots left after the running
    requests' estimates (counted in blocks). ``new_token_ratio`` starts at 0.7
    (``default_init_new_token_ratio``), decays linearly each step to 0.7 * 0.14 ~ 0.1
    (``default_min_new_token_ratio_factor``) over 600 steps
    (``default_new_token_ratio_decay_steps``), and after a preemption is reset upward
    to SGLang's retract estimate ``(generated + 20 * n_running) / sum(max_tokens)``
    (``retract_decode``; never below the initial ratio here, capped at 1).

``static_batch`` (TensorRT-LLM ``STATIC_BATCH``)
    ``guaranteed_no_evict``'s rule, and no new request at all while any request that was
    running before this step is unfinished: a batch is admitted together, runs to its
    end, and only then is the next one admitted (up to ``max_num_seqs``, as far as
    their whole futures fit).

TensorRT-LLM's capacity scheduler is ``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``
(read at the stored snapshot commit cf6abc4, TensorRT-LLM 1.x). ``GuaranteedNoEvictScheduler``
keeps every request in generation, subtracts the blocks each needs to finish from the free
blocks (``NoEvictScheduledBlocksManager``) and then admits pending requests in order while
their blocks-to-completion fit, stopping at the first that does not: the same rule as
``guaranteed_no_evict`` here. ``StaticBatchScheduler`` is that rule with pending requests
considered only when no request is in progress (``impl<true>``). ``MaxUtilizationScheduler``
is ``max_utilization`` here with the ``trtllm`` policy (``minibatch.policies.trtllm``): it
schedules in order what fits this step and, when a request does not fit, pauses the last
started request in the order and retries.

Modes other than ``max_utilization`` never evict a running request to admit a waiting
one, even under a preemptive policy.
"""

from __future__ import annotations

import math

from minibatch.config import ADMISSION_MODES


class Overloaded(ValueError):
    """A request refused on arrival because ``max_inflight_requests`` are in flight (backpressure;
    TGI answers it with HTTP 429). A ``ValueError``, so it is rejected and counted like bad input."""


class Admission:
    """``max_utilization``: admit whenever this step's blocks can be allocated."""

    name = "max_utilization"
    evicts = True          # may admitting a request preempt running ones (preemptive policies)?

    def can_admit(self, sched, req, computed_blocks: list[int]) -> bool:
        return True

    def on_step(self, sched, num_preempted: int) -> None:
        """Called once per scheduled step with the number of requests it preempted."""


class GuaranteedNoEvict(Admission):
    name = "guaranteed_no_evict"
    evicts = False

    def can_admit(self, sched, req, computed_blocks):
        kv = sched.kv
        future = sum(max(0, kv.blocks_for_request(sched.final_len(r)) - len(kv.block_table(r.request_id)))
                     for r in sched.running)
        need = (kv.blocks_for_request(sched.final_len(req)) - len(computed_blocks)
                + kv.num_free_hits(computed_blocks))
        return need + future <= kv.num_free_blocks


class Conservative(Admission):
    name = "conservative"
    evicts = False
    clip_max_new_tokens = 4096
    retract_decode_steps = 20

    def __init__(self, init_ratio: float = 0.7, min_ratio_factor: float = 0.14, decay_steps: int = 600):
        self.init_ratio = init_ratio
        self.min_ratio = init_ratio * min_ratio_factor
        self.decay = (init_ratio - self.min_ratio) / decay_steps
        self.new_token_ratio = init_ratio

    def estimate(self, sched, req) -> int:
        """Future tokens reserved for ``req``: ``ratio * min(max_tokens - generated, clip)``,
        at most what ``max_model_len`` still allows."""
        left = max(0, req.sampling_params.max_tokens - req.num_output_tokens)
        est = math.ceil(self.new_token_ratio * min(left, self.clip_max_new_tokens))
        return min(est, max(0, sched.final_len(req) - req.num_tokens))

    def can_admit(self, sched, req, computed_blocks):
        # In blocks (SGLang counts tokens; its page size is usually 1): what the running
        # requests' estimates need beyond the blocks they hold, plus the new request's
        # prompt and estimate (its whole reservation under the contiguous allocator).
        kv = sched.kv
        reserved = sum(max(0, kv.blocks_for(r.num_tokens + self.estimate(sched, r))
                           - len(kv.block_table(r.request_id))) for r in sched.running)
        need = (kv.blocks_for_request(req.num_tokens + self.estimate(sched, req)) - len(computed_blocks)
                + kv.num_free_hits(computed_blocks))
        return need + reserved <= kv.num_free_blocks

    def on_step(self, sched, num_preempted):
        if num_preempted:
            running = sched.running
            total = sum(r.sampling_params.max_tokens for r in running)
            estimate = ((sum(r.num_output_tokens for r in running) + self.retract_decode_steps * len(running))
                        / total if total else 1.0)
            self.new_token_ratio = min(1.0, max(estimate, self.init_ratio))
        else:
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.decay)


class StaticBatch(GuaranteedNoEvict):
    """TensorRT-LLM ``STATIC_BATCH``: admit only while nothing from an earlier step still runs."""

    name = "static_batch"

    def can_admit(self, sched, req, computed_blocks):
        admitted = sched.admitted_this_step
        if any(r.request_id not in admitted for r in sched.running):
            return False
        return super().can_admit(sched, req, computed_blocks)


_MODES = {"max_utilization": Admission, "guaranteed_no_evict": GuaranteedNoEvict, "conservative": Conservative,
          "static_batch": StaticBatch}


def make_admission(mode: str) -> Admission:
    if mode not in _MODES:
        raise ValueError(f"unknown admission mode {mode!r}; expected one of {ADMISSION_MODES}")
    return _MODES[mode]()
