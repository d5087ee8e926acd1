"""A replica that dies mid-run, and the re-dispatch of every request it held: no request is lost.

``minibatch.cluster.run(..., failures=[ReplicaFailure(replica=1, at_s=20.0)])`` kills replica 1
at virtual time 20 s:

* from ``at_s`` on the replica serves nothing: the router no longer sees it (its
  ``removed_at`` is set, as for a replica the autoscaler removed);
* its KV cache is gone. A step in flight at ``at_s`` completes (a step is atomic in the
  simulator), so the failure takes effect at ``t = max(at_s, end of that step)``;
* every request it held, running or waiting, is **re-dispatched**: it goes through the
  router again, at ``t``, to a live replica serving its model, joins the back of that
  replica's waiting queue and recomputes what it had (its prompt and the tokens it had
  generated) before it generates on, like a recompute preemption (``minibatch.scheduler``),
  only on another machine. This is what minibatch's HTTP router does with a stream cut by a
  dead upstream (``minibatch.serving.router``: the prompt plus the tokens already sent go to
  another upstream). The request keeps its arrival time, so the failure shows in its TTFT
  (no first token yet) or its TPOT (the gap while it moved);
* if no live replica serves the model, the request is aborted with the reason in its record.

With the real model (``executor="model"``) the re-dispatched requests' greedy tokens equal an
undisturbed run's: the destination recomputes the same prefix. ``ClusterResult.extra`` gets
``failures`` (one entry per failure: replica, ``at_s``, ``t``, requests re-dispatched,
aborted) and ``redispatched`` (the total). Not combined with ``migration`` or
``disaggregation``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.request import RequestStatus


@dataclass(frozen=True)
class ReplicaFailure:
    """Replica ``replica`` (its index) dies at virtual time ``at_s``."""

    replica: int
    at_s: float

    def __post_init__(self):
        if not (isinstance(self.replica, int) and self.replica >= 0):
            raise ValueError(f"replica must be an index >= 0, got {self.replica!r}")
        if not self.at_s >= 0:
            raise ValueError(f"at_s must be >= 0, got {self.at_s!r}")


class Failover:
    """The runner's side of a list of :class:`ReplicaFailure`: when they fire, what they moved."""

    def __init__(self, failures, num_replicas: int):
        for f in failures:
            if not isinstance(f, ReplicaFailure):
                raise TypeError(f"failures= takes ReplicaFailure objects, got {f!r}")
        self.pending = sorted(failures, key=lambda f: f.at_s)
        for f in self.pending:
            if f.replica >= num_replicas:
                raise ValueError(f"ReplicaFailure names replica {f.replica}; the cluster has {num_replicas}")
        self.moved_to: dict = {}       # request id -> the replica it was re-dispatched to (last)
        self.log: list[dict] = []
        self.redispatched = 0

    def next_event(self) -> float:
        return self.pending[0].at_s if self.pending else float("inf")

    def fire(self, reps, router, spec_of: dict, now: float) -> None:
        """Kill the next failing replica at ``now`` and re-dispatch what it held."""
        f = self.pending.pop(0)
        rep = reps[f.replica]
        if rep.removed_at is not None:
            self.log.append({"replica": f.replica, "at_s": f.at_s, "t": now, "redispatched": 0, "aborted": 0})
            return
        t = max(now, rep.clock.now())          # its step in flight completes first
        rep.removed_at = now
        engine = rep.engine
        sched = engine.scheduler
        moved = aborted = 0
        for req in list(sched.running) + list(sched.waiting):
            sched.remove(req)                  # its blocks (gone with the machine) and its policy state
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            spec = spec_of[req.request_id]
            live = [r for r in reps if r.serving(t) and (spec.model is None or r.model == spec.model)]
            if not live:
                req.status = RequestStatus.FINISHED_ABORTED
                req.finish_time = t
                req.error = f"replica {f.replica} died and no live replica serves model {rep.model!r}"
                aborted += 1
                continue
            pos = router.choose(spec, [r.view(t, spec.prompt_token_ids) for r in live], t)
            dst = live[pos]
            del engine.requests[req.request_id]
            dst.engine.clock.advance_to(t)     # an idle machine waits for it; a busy one is past it
            dst.engine.requests[req.request_id] = req
            dst.engine.scheduler.add(req)
            dst.enqueued(req.num_tokens, t)
            self.moved_to[req.request_id] = dst
            moved += 1
        self.redispatched += moved
        self.log.append({"replica": f.replica, "at_s": f.at_s, "t": t, "redispatched": moved, "aborted": aborted})


__all__ = ["Failover", "ReplicaFailure"]
