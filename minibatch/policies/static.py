"""Static (request-level) batching: fixed batches that run until their slowest member ends.

Rule: when no batch is in flight, take up to ``max_num_seqs`` waiting requests in
arrival order as the next batch; nothing joins a batch in flight, and the next batch
starts only when the *last* member of this one has finished. This is how
``model.generate`` on a padded batch behaves, and what request-level serving did before
Orca (Yu et al., OSDI'22) introduced iteration-level scheduling.

Padding: a finished member keeps its slot until the batch ends (in a padded tensor it
would still be computed). ``num_padded_slots`` = batch size at dispatch - members still
unfinished, counted every step; ``RunResult.summary()["padding_waste"]`` is the
fraction of slot-steps wasted so. (The engine skips those slots, so the step times
here do not include the padded compute: padding shows up as lost concurrency.)

A batch is formed from the requests already running first (requests a previous policy
left running when this one was switched in), then from the waiting queue.
"""

from __future__ import annotations

from minibatch.policies.base import Policy, SchedulerState, register
from minibatch.request import Request


@register
class StaticPolicy(Policy):
    name = "static"

    def __init__(self):
        self.batch: list[Request] = []
        self.batch_size = 0
        self.num_batches = 0

    def dispatch_ready(self, state: SchedulerState) -> bool:
        """May a new batch start now? Static batching: whenever the last one has ended."""
        return bool(state.waiting)

    def schedule_order(self, state: SchedulerState):
        queued = {r.request_id for r in state.running}
        queued.update(r.request_id for r in state.waiting)
        members = [r for r in self.batch if r.request_id in queued]
        if not members:
            members = list(state.running)          # adopted from a previous policy
            if members or self.dispatch_ready(state):
                members += state.waiting[:max(0, state.max_num_seqs - len(members))]
            self.batch, self.batch_size = members, len(members)
            self.num_batches += bool(members)
        self.num_padded_slots = self.batch_size - len(members)
        return members
