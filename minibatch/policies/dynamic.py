"""Dynamic batching: a batching window, then request-level batches (Triton, TF Serving).

Rule: a batch is dispatched when ``max_num_seqs`` requests wait (a full batch) or the
oldest waiting request has waited ``max_wait_ms`` (the window closes), whichever comes
first; it then runs to completion like a static batch (no joining; finished members
pad until the last one ends). This is Triton Inference Server's dynamic batcher
(``max_batch_size`` / ``max_queue_delay_microseconds``) and TF Serving's batching
(``max_batch_size`` / ``batch_timeout_micros``).

:meth:`next_wakeup` returns the time the window closes, so a run with a virtual clock
jumps straight there when nothing else happens. At low load every request waits out
the window alone: its TTFT grows by about ``max_wait_ms``.
"""

from __future__ import annotations

from minibatch.policies.base import SchedulerState, register
from minibatch.policies.static import StaticPolicy

_EPS = 1e-9


@register
class DynamicPolicy(StaticPolicy):
    name = "dynamic"

    def __init__(self, max_wait_ms: float | None = None):
        super().__init__()
        self.max_wait_ms = max_wait_ms        # None: the engine's max_wait_ms

    def window(self, state: SchedulerState) -> float:
        return state.max_wait_s if self.max_wait_ms is None else self.max_wait_ms / 1000.0

    def window_closes(self, state: SchedulerState) -> float:
        return min(r.arrival_time for r in state.waiting) + self.window(state)

    def dispatch_ready(self, state: SchedulerState) -> bool:
        if not state.waiting:
            return False
        return len(state.waiting) >= state.max_num_seqs or state.now >= self.window_closes(state) - _EPS

    def next_wakeup(self, state: SchedulerState) -> float | None:
        queued = {r.request_id for r in state.running}
        queued.update(r.request_id for r in state.waiting)
        in_flight = state.running or any(r.request_id in queued for r in self.batch)
        if in_flight or not state.waiting:
            return None
        return self.window_closes(state)
