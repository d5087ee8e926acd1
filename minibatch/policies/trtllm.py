"""TensorRT-LLM's in-flight batching: its capacity scheduler and micro-batch scheduler.

TensorRT-LLM (1.x; ``cpp/tensorrt_llm/batch_manager/``, read at the stored snapshot
commits cf6abc4 and 02a10fe of ``capacityScheduler.cpp`` (the later one adds a
``PREFILL_FIRST`` policy, not modelled) and b8b7b78 and 0a949d3 of ``microBatchScheduler.cpp``)
schedules one iteration in two passes over its active requests, which are kept in
arrival order (a paused request keeps its place):

1. **Capacity scheduler** (``CapacitySchedulerPolicy``): which requests may hold KV this
   iteration. ``GUARANTEED_NO_EVICT`` (the default, ``SchedulerConfig`` in
   ``tensorrt_llm/llmapi/llm_args.py``) keeps every request in generation and admits
   pending ones in order while the blocks they need *to finish* fit, stopping at the
   first that does not; ``MAX_UTILIZATION`` admits in order whatever fits *this step* and,
   when one does not fit, pauses (evicts) the last started request in the order and
   retries, and the iteration's walk then ends at the paused request's place (``reqItEnd``:
   nothing that arrived after it is scheduled in that iteration); ``STATIC_BATCH`` is
   ``GUARANTEED_NO_EVICT`` with no admission while any request is in progress. Here they are
   the admission modes ``guaranteed_no_evict``, ``max_utilization`` and ``static_batch``
   (``minibatch.admission``; TensorRT-LLM's names are accepted as
   ``capacity_scheduler_policy=``), all with this policy's arrival order.
2. **Micro-batch scheduler**: at most ``max_batch_size`` requests (``max_num_seqs``) and
   ``max_num_tokens`` tokens (``max_num_batched_tokens``). Generation requests take their
   one token each first; with context chunking on (``enable_chunked_prefill``), the
   context requests then share what is left, first come first served
   (``ContextChunkingPolicy.FIRST_COME_FIRST_SERVED``), a chunk cut short by the budget
   rounded down to whole KV blocks (``chunkUnitSize`` = tokens per block). Without
   chunking a context request runs whole or not at all.

The policy is the order (all requests by arrival) plus the scheduler switches that
reproduce pass 2 (``decode_budget_first``, ``chunk_to_block``) and pass 1's "stop at the
first refusal, and at a paused request" (``stop_at_refusal``); it is ``preemptive`` so
that under ``max_utilization`` a request earlier in the order evicts the last started one
after it.

Differences that remain: without chunking, TensorRT-LLM ends the micro-batch at the
first request over ``max_num_tokens`` (later generation requests wait a step), while
minibatch's scheduler skips it and still runs later running requests; TensorRT-LLM's
``MAX_UTILIZATION`` can also look two steps ahead (``twoStepsLookAhead``, later
``manyMicroBatches``) and reserves a new context's whole prompt at its first chunk, and both
capacity policies skip a context whose first new block another context is computing this
iteration (``beneficialToSkip``, block reuse): none of these is modelled. A token budget
smaller than one block chunks by the room left, unrounded (rounded down to a block, such a
chunk would be 0 tokens every step and the prompt would never start).
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register


@register
class TRTLLMPolicy(Policy):
    name = "trtllm"
    preemptive = True
    decode_budget_first = True
    chunk_to_block = True
    stop_at_refusal = True

    def schedule_order(self, state: SchedulerState):
        # Python's sort is stable: equal arrival times keep admission order, then queue order.
        return sorted(state.running + state.waiting, key=lambda r: r.arrival_time)
