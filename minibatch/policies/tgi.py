"""Text Generation Inference's router: when to pause decoding to prefill new requests.

TGI (v3.3.7, ``backends/v3/src/backend.rs`` ``batching_task`` and
``backends/v3/src/queue.rs`` ``State::next_batch``) runs one batch at a time. Without
prefill chunking its loop is::

    batch = next_batch(min_size=None)            # an empty server: take what fits
    prefill(batch); waiting_tokens = 1
    while batch is not empty:
        min_size = None if waiting_tokens >= max_waiting_tokens
                   else floor(batch_size * waiting_served_ratio)
        new = next_batch(min_size, max_size=max_batch_size - batch_size,
                         prefill_budget=max_batch_prefill_tokens,
                         token_budget=max_batch_total_tokens - batch_max_tokens)
        if new:  prefill(new) alone (the running batch waits), batch += new; waiting_tokens = 1
        decode(batch); waiting_tokens += 1

``next_batch`` takes queued requests from the front while they fit: each reserves KV
for ``input + max_new_tokens`` tokens (it fails, and the queue stops, when the blocks are
not free: TGI never preempts), and their uncached prompt tokens must fit the prefill
budget (padded up to a whole block); it returns nothing if fewer than ``min_size``
requests are queued or fit. So new requests wait until either enough of them are queued
(``waiting_served_ratio`` x running) or the running batch has decoded
``max_waiting_tokens - 1`` times since the last prefill; then one prefill-only step runs.

With prefill chunking (TGI's default where the attention backend supports it,
``PREFILL_CHUNKING`` in ``server/text_generation_server/models/globals.py``; here
``enable_chunked_prefill=True``) ``backend.rs`` ignores ``max_waiting_tokens`` and
``waiting_served_ratio`` (it says so in a warning): every turn of the loop the queue's front
is concatenated to the running batch within ``max_batch_prefill_tokens`` minus the batch's
current tokens, the last request chunked to fit (one forward: the running batch's next tokens
and the newcomers' prefill), and then the whole batch decodes once. So a join is always
followed by a decode step (except the first prefill of an empty server, after which the loop
asks the queue at once). This policy does the same.

Knobs (``EngineConfig`` fields): ``max_waiting_tokens``, ``waiting_served_ratio``,
``max_batch_prefill_tokens`` (default and upper bound: ``max_num_batched_tokens``),
``max_batch_total_tokens`` (default: the KV pool) and ``max_num_seqs`` for TGI's
``max_batch_size``. TGI's backpressure, ``max_concurrent_requests``, is the engine's
``max_inflight_requests`` (the HTTP server's own ``--max-concurrent-requests`` answers 429
before that): a request arriving beyond it is rejected (``LLMEngine.add_request``).
"""

from __future__ import annotations

import math
from collections import Counter

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request

_DEFAULTS = {"max_waiting_tokens": 20, "waiting_served_ratio": 0.3, "max_batch_prefill_tokens": None,
             "max_batch_total_tokens": None, "enable_chunked_prefill": False}


@register
class TGIPolicy(Policy):
    name = "tgi"

    def __init__(self):
        self.waiting_tokens = 0          # TGI's counter: 1 after a prefill, +1 per decode
        self.decode_next = False         # a prefill that joined a running batch is followed by a decode
        self.plan: str | None = None     # what the last order asked for: "prefill" | "decode"
        self.planned_first = False       # ... and whether that prefill started a new batch
        self.planned: set[str] | None = None   # chunked: the newcomers a planned join listed
        self.num_prefills = 0
        self.reason: str | None = None   # why the planned prefill joins a running batch
        # TGI's ``tgi_batch_concat`` counter: prefills that joined a running batch, by ``reason``:
        # "backpressure" (enough requests waited: waiting_served_ratio), "wait_exceeded"
        # (max_waiting_tokens reached), "chunking" (prefill chunking, where neither knob applies).
        self.concat_reasons: Counter = Counter()

    @staticmethod
    def knob(state: SchedulerState, name: str):
        return getattr(state.config, name, _DEFAULTS[name]) if state.config is not None else _DEFAULTS[name]

    @staticmethod
    def final_len(req: Request, kv) -> int:
        n = req.num_prompt_tokens + req.sampling_params.max_tokens
        limit = getattr(kv, "max_model_len", None)
        return n if limit is None else min(n, limit)

    def select(self, state: SchedulerState, max_size: int, budget: int, chunked: bool) -> list[Request]:
        """``next_batch``: queued requests from the front while they fit (no ``min_size`` here)."""
        kv = state.kv
        total_budget = self.knob(state, "max_batch_total_tokens")
        used_total = sum(self.final_len(r, kv) for r in state.running)
        free = None
        if kv is not None:
            free = kv.num_free_blocks - sum(max(0, kv.blocks_for_request(self.final_len(r, kv))
                                                - len(kv.block_table(r.request_id))) for r in state.running)
            budget = math.ceil(budget / kv.block_size) * kv.block_size
        budget = min(budget, state.max_num_batched_tokens)
        chosen: list[Request] = []
        prefill = 0
        for req in state.waiting:
            if len(chosen) >= max_size:
                break
            need = self.final_len(req, kv)
            if total_budget is not None and used_total + need > total_budget:
                break
            if free is not None:
                blocks = kv.blocks_for_request(need) - len(kv.block_table(req.request_id))
                if blocks > free:
                    break
            postfix = req.num_tokens - req.num_computed_tokens
            if prefill + postfix > budget:
                if chunked and budget - prefill > 0:
                    chosen.append(req)           # the scheduler cuts it to what is left
                break
            chosen.append(req)
            prefill += postfix
            used_total += need
            if free is not None:
                free -= blocks
        return chosen

    def schedule_order(self, state: SchedulerState):
        running, waiting = state.running, state.waiting
        prefill_budget = self.knob(state, "max_batch_prefill_tokens") or state.max_num_batched_tokens
        max_size = max(0, state.max_num_seqs - len(running))
        if self.knob(state, "enable_chunked_prefill"):
            if running and self.decode_next:                    # a join is followed by a decode
                self.plan = "decode"
                return list(running)
            budget = max(0, prefill_budget - len(running))      # minus the batch's current tokens
            new = self.select(state, max_size, budget, True) if budget else []
            self.plan, self.planned_first = ("prefill", not running) if new else ("decode", False)
            self.reason = "chunking"
            self.planned = {r.request_id for r in new}
            return running + new
        if not running:
            self.plan, self.planned_first = "prefill", True
            return self.select(state, max_size, prefill_budget, False)
        if not self.decode_next and waiting:
            min_size = (None if self.waiting_tokens >= self.knob(state, "max_waiting_tokens")
                        else math.floor(len(running) * self.knob(state, "waiting_served_ratio")))
            if min_size is None or len(waiting) >= min_size:
                new = self.select(state, max_size, prefill_budget, False)
                if new and (min_size is None or len(new) >= min_size):
                    self.plan, self.planned_first = "prefill", False
                    self.reason = "wait_exceeded" if min_size is None else "backpressure"
                    return new
        self.plan = "decode"
        return list(running)

    def fallback_order(self, state: SchedulerState):
        """A planned prefill that admission refused (none of it could start): decode instead,
        as TGI does when ``next_batch`` returns nothing."""
        if self.plan == "prefill" and state.running:
            self.plan = "decode"
            return list(state.running)
        return None

    def on_step(self, scheduled, now):
        if self.plan == "prefill" and self.planned is not None:
            # Chunked: a join happened only if one of the newcomers ran (next_batch gave something).
            if not any(r.request_id in self.planned for r, _ in scheduled):
                self.plan = "decode"
            self.planned = None
        if self.plan == "prefill" and scheduled:
            self.waiting_tokens = 1
            self.decode_next = not self.planned_first
            self.num_prefills += 1
            if not self.planned_first:
                self.concat_reasons[self.reason] += 1
        elif self.plan == "decode":
            self.waiting_tokens += 1
            self.decode_next = False
