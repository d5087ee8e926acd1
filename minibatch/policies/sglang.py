"""SGLang's default step: prefill first, decode only when no prefill can run.

SGLang (v0.5.3, ``python/sglang/srt/managers/scheduler.py``, ``Scheduler.get_next_batch_to_run``)
builds each step in two tries::

    new_batch = self.get_new_batch_prefill()      # the chunked request's next chunk + new requests
    if new_batch is not None:
        ret = new_batch                            # "Run prefill first if possible"
    else:
        ret = self.running_batch                   # "Run decode"

``get_new_batch_prefill`` returns ``None`` when nothing is waiting and no prompt is being
chunked, when the running batch is full (``max_running_requests``), or when its
``PrefillAdder`` admits nobody (token budget ``chunked_prefill_size``, KV with the
``new_token_ratio`` reservation: the ``conservative`` admission here). Only with
``--enable-mixed-chunk`` (``ServerArgs.enable_mixed_chunk = False`` in
``python/sglang/srt/server_args.py``) does it add the running batch's decodes to a prefill
step (``new_batch.mix_with_running``). So by default a step is either prefill-only or
decode-only, and while a long prompt is being chunked every decode waits for its chunks.

As a minibatch policy: the order holds the running requests whose prompt is still being
computed (SGLang's ``chunked_req``) and then the waiting queue, FCFS, at most
``max_num_seqs`` requests running in all (SGLang's ``max_running_requests``); the decodes
are left out. When nothing of that order can run (no prompt fits the budget or the KV),
the scheduler asks :meth:`fallback_order`: the decodes, and only they, run this step.

Differences: SGLang keeps the KV reserved for a chunked prompt between its chunks; minibatch
allocates each chunk's blocks when it runs, and a chunk short of blocks may preempt a
decode left out of the step (the scheduler's victims: requests left out of the order first).
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


def in_prefill(req: Request) -> bool:
    """A running request whose prompt (or, after a recompute, its tokens so far) is not all in the KV."""
    return req.num_computed_tokens < max(req.num_prompt_tokens, req.num_tokens - 1)


@register
class SGLangPolicy(Policy):
    """Prefill-only steps while any prompt can start or continue; decode-only steps otherwise."""

    name = "sglang"

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        chunked = [r for r in state.running if in_prefill(r)]
        room = max(0, state.max_num_seqs - len(state.running))
        if not chunked and not (state.waiting and room):
            return self.decodes(state)
        return chunked + list(state.waiting)[:room]

    def fallback_order(self, state: SchedulerState) -> list[Request] | None:
        # No prefill could run this step: decode instead (SGLang's ``new_batch is None`` branch).
        return self.decodes(state) or None

    @staticmethod
    def decodes(state: SchedulerState) -> list[Request]:
        return [r for r in state.running if not in_prefill(r)]
