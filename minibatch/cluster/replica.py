"""A replica (one ``LLMEngine`` with its own virtual clock) and what a router may see of it.

Each replica's engine keeps its own :class:`~minibatch.clock.VirtualClock`: after a step
that started at ``t`` and lasted ``d`` its clock reads ``t + d``, the time at which that
machine is free again. The cluster loop (``minibatch.cluster.runner``) always advances the
replica whose next event is earliest, so N replicas behave as N machines running side by
side although their steps run one after another in this process.

A router sees a replica through a :class:`ReplicaView`, built at the arrival's time
``now``. A replica whose step is still in flight at ``now`` (its clock is past ``now``)
is seen as it was when that step started, plus the requests routed to it since: what a
router polling the replica's metrics would see, since a step's results only exist when
it ends. The one exception is the request's prefix-cache match, read from the replica's
cache as it is (blocks the in-flight step fills already count).
"""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.engine import LLMEngine
from minibatch.lora import adapter_view
from minibatch.routing.view import ReplicaView


@dataclass
class _Load:
    """The load numbers of a view, kept apart so that an in-flight step can be seen as it started."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    in_flight_tokens: int
    active_blocks: int


class Replica:
    """One engine of the cluster, and the bookkeeping the event loop needs for it."""

    def __init__(self, index: int, engine: LLMEngine, model: str):
        if not engine.clock.virtual:
            raise ValueError("a cluster replica needs a virtual clock (LLMEngine(..., clock='virtual'))")
        self.index = index
        self.engine = engine
        self.model = model
        self.ids: list[str] = []          # request ids routed here, in routing order
        self.blocked_until: float | None = None  # the policy holds its queue until then (inf: an arrival)
        self._started: _Load | None = None  # load when the in-flight step started
        self._added = _Load(0, 0, 0, 0, 0)  # requests routed here since then
        # Life in an autoscaled cluster (virtual times): provisioned at started_at, serving from
        # ready_at (after its cold start), draining (no new requests) and then removed.
        self.started_at: float = 0.0
        self.ready_at: float = 0.0
        self.draining = False
        self.drain_at: float | None = None
        self.removed_at: float | None = None

    def serving(self, now: float) -> bool:
        """May a router send a request here at ``now``? (ready, not draining, not removed)"""
        return self.removed_at is None and not self.draining and self.ready_at <= now + 1e-12

    # -- time ----------------------------------------------------------------------
    @property
    def clock(self):
        return self.engine.clock

    def next_event_time(self) -> float:
        """When this replica next needs the loop: its next step's start, or ``inf``."""
        if not self.engine.has_unfinished_requests():
            return float("inf")
        if self.blocked_until is not None:
            return self.blocked_until
        return self.clock.now()

    def step(self):
        """Run one engine step at this replica's time; return its StepRecord or None."""
        engine = self.engine
        if self.blocked_until is not None:
            self.engine.clock.advance_to(self.blocked_until)
            self.blocked_until = None
        self._started = self._live_load()
        self._added = _Load(0, 0, 0, 0, 0)
        n = len(engine.steps)
        engine.step()
        if len(engine.steps) > n:
            return engine.steps[-1]
        # Nothing ran: the policy holds its queue (a batching window). Sleep until its
        # wake-up, or until the next request routed here.
        now = self.clock.now()
        wake = engine.scheduler.policy.next_wakeup(engine.scheduler.state(now))
        self.blocked_until = wake if wake is not None and wake > now else float("inf")
        return None

    # -- requests ------------------------------------------------------------------
    def admitted(self, rid: str, num_tokens: int, now: float, queued: bool = True) -> None:
        """Bookkeeping after the loop handed request ``rid`` to this engine at ``now``
        (``queued=False``: the engine rejected it, so it adds no load)."""
        self.ids.append(rid)
        if queued:
            self.enqueued(num_tokens, now)

    def enqueued(self, num_tokens: int, now: float) -> None:
        """A request of ``num_tokens`` tokens joined this engine's queue at ``now`` (routed here,
        or re-dispatched from a replica that died, ``minibatch.cluster.failures``)."""
        self.blocked_until = None
        if self.busy(now):
            a = self._added
            a.num_waiting += 1
            a.in_flight_tokens += num_tokens
            a.active_blocks += self.engine.kv.blocks_for(num_tokens)

    def busy(self, now: float) -> bool:
        """Is a step of this replica in flight at ``now``?"""
        return self.clock.now() > now + 1e-12

    # -- what a router sees ----------------------------------------------------------
    def _live_load(self) -> _Load:
        sched = self.engine.scheduler
        kv = self.engine.kv
        tokens = blocks = 0
        for req in sched.running:
            tokens += req.num_tokens
            blocks += kv.blocks_for(req.num_tokens)
        for req in sched.waiting:
            tokens += req.num_tokens
            blocks += kv.blocks_for(req.num_tokens)
        return _Load(len(sched.running), len(sched.waiting), kv.num_used_blocks, tokens, blocks)

    def view(self, now: float, prompt_token_ids=None) -> ReplicaView:
        if self.busy(now) and self._started is not None:
            s, a = self._started, self._added
            load = _Load(s.num_running, s.num_waiting + a.num_waiting, s.kv_blocks_used,
                         s.in_flight_tokens + a.in_flight_tokens, s.active_blocks + a.active_blocks)
        else:
            load = self._live_load()
        kv = self.engine.kv
        cached = 0
        if prompt_token_ids is not None and kv.radix is not None and len(prompt_token_ids) > 1:
            # As the engine counts a hit: whole blocks, at least one token left to compute.
            max_blocks = (len(prompt_token_ids) - 1) // kv.block_size
            cached = len(kv.radix.match_prefix(prompt_token_ids, max_blocks)) * kv.block_size
        return ReplicaView(self.index, self.model, load.num_running, load.num_waiting, load.kv_blocks_used,
                           kv.num_blocks, kv.block_size, load.in_flight_tokens, load.active_blocks,
                           cached, len(self.ids), **adapter_view(self.engine))
