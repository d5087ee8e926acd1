"""minibatch's routers as a Ray Serve request router (imports Ray: load it through ``ray_backend``).

Ray Serve picks a replica for each call of a deployment handle with a ``RequestRouter``
that lives in the caller's process (here: the ingress replica). Its one decision is
``async choose_replicas(candidate_replicas, pending_request) -> list[list[RunningReplica]]``,
ranks of replicas, best first; Ray then sends the request to the replica of the first rank
whose queue has room (at most ``max_ongoing_requests``), and calls
``on_request_routed`` / ``on_request_completed`` around it. :class:`MinibatchRequestRouter`
turns that into one call of a minibatch router (``minibatch.routing.routers``)::

    choose(request, [ReplicaView ...], now) -> position   =>   [[that replica], [the others]]

The chosen replica alone is the first rank; the others come second only so that a
request still goes somewhere if that replica's queue is full (Ray then backs off and asks
again). A ``ReplicaView`` is built from what Ray tells the router and what the router
itself has sent, never from the engine:

- ``index``: a stable number per replica, in the order the router first saw it (Ray's
  replica ids are strings); the views are ordered by it, so position ``i`` is the same
  replica between calls while the set of replicas does not change;
- ``num_running`` / ``num_waiting`` / ``kv_blocks_*`` / ``block_size``: the replica's
  ``record_routing_stats()`` (``EngineReplica``), which Ray polls every
  ``request_routing_stats_period_s`` (``RunningReplica.routing_stats``); ``num_waiting``
  is raised so that running + waiting is at least the requests this router has in flight
  there (fresher than a poll);
- ``in_flight_tokens`` / ``active_blocks`` / ``num_routed``: the prompts this router has
  sent there and not yet seen complete (``on_request_routed`` / ``on_request_completed``);
- ``cached_prefix_tokens``: the longest prefix, in whole blocks, that this prompt shares
  with a prompt this router sent to that replica (a tree per replica, as ``prefix_aware``
  keeps: an estimate of the replica's prefix cache, exact only while nothing was evicted).

Source read: Ray 2.60.0, ``ray/serve/request_router.py`` (the public names) and
``ray/serve/_private/request_router/request_router.py`` (``RequestRouter``:
``choose_replicas``, ``initialize_state(**request_router_kwargs)``, ``on_request_routed``,
``on_request_completed``; without ``FIFOMixin`` a choice is matched to the very request it
was made for, by ``internal_request_id``; a rank that cannot take the request leads to a
backoff only if ``routing_context.should_backoff`` is set, as ``LocalityMixin`` does).
"""

from __future__ import annotations

import base64
import logging
import pickle
import time
from types import SimpleNamespace

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from minibatch.routing import routers
from minibatch.routing.view import ReplicaView

logger = logging.getLogger("minibatch.cluster.ray_router")


def encode_router(router) -> dict:
    """``request_router_kwargs`` (JSON) naming a router: a registered name as is, a class or
    an instance pickled (Ray's cloudpickle, by value where its module is not importable)."""
    if isinstance(router, str):
        return {"router": router}
    import sys

    from ray import cloudpickle

    cls = router if isinstance(router, type) else type(router)
    module = sys.modules.get(cls.__module__)
    if module is not None and not cls.__module__.startswith("minibatch.") and cls.__module__ != "__main__":
        # A test's or a notebook's module is not importable in the ingress process: send it by value.
        cloudpickle.register_pickle_by_value(module)
        try:
            data = cloudpickle.dumps(router)
        finally:
            cloudpickle.unregister_pickle_by_value(module)
    else:
        data = cloudpickle.dumps(router)
    return {"router_pickle": base64.b64encode(data).decode("ascii")}


def decode_router(router: str | None = None, router_pickle: str | None = None,
                  router_kwargs: dict | None = None) -> routers.Router:
    if router_pickle is not None:
        return routers.get(pickle.loads(base64.b64decode(router_pickle)), **(router_kwargs or {}))
    return routers.get(router or "round_robin", **(router_kwargs or {}))


class MinibatchRequestRouter(RequestRouter):
    """A Ray Serve ``RequestRouter`` that asks a minibatch router (module docstring)."""

    def initialize_state(self, router: str | None = None, router_pickle: str | None = None,
                         router_kwargs: dict | None = None, model: str = "tiny", block_size: int = 16, **_):
        self.router = decode_router(router, router_pickle, router_kwargs)
        self.model = model
        self.default_block_size = block_size
        self.numbers: dict[ReplicaID, int] = {}
        self.in_flight: dict[ReplicaID, dict[str, int]] = {}     # internal request id -> prompt tokens
        self.routed: dict[ReplicaID, int] = {}
        self.trees: dict[ReplicaID, routers.TokenTree] = {}
        self.decisions: list[tuple[str, int]] = []               # (internal request id, replica number)

    def number(self, replica_id: ReplicaID) -> int:
        if replica_id not in self.numbers:
            self.numbers[replica_id] = len(self.numbers)
        return self.numbers[replica_id]

    @staticmethod
    def payload(pending_request: PendingRequest | None) -> dict:
        if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
            return {}
        return pending_request.args[0]

    def spec(self, payload: dict):
        """What a minibatch router reads of a request (``RequestSpec``'s field names)."""
        ids = list(payload.get("prompt_token_ids") or [])
        params = payload.get("params")
        return SimpleNamespace(prompt_len=len(ids), prompt_token_ids=ids,
                               max_tokens=getattr(params, "max_tokens", 0), tenant=payload.get("tenant"),
                               model=self.model, request_id=payload.get("request_id"))

    def view(self, replica: RunningReplica, spec) -> ReplicaView:
        rid = replica.replica_id
        stats = replica.routing_stats or {}
        bs = int(stats.get("block_size", self.default_block_size)) or 1
        sent = self.in_flight.get(rid, {})
        running = int(stats.get("num_running", 0))
        waiting = max(int(stats.get("num_waiting", 0)), len(sent) - running)
        tokens = sum(sent.values())
        active = sum(-(-n // bs) for n in sent.values())
        cached = 0
        tree = self.trees.get(rid)
        if tree is not None and spec.prompt_len > 1:
            cached = min(tree.match(spec.prompt_token_ids), spec.prompt_len - 1) // bs * bs
        return ReplicaView(self.number(rid), self.model, running, waiting, int(stats.get("kv_blocks_used", 0)),
                           int(stats.get("kv_blocks_total", 0)), bs, tokens, active, cached, self.routed.get(rid, 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: self.number(r.replica_id))
        spec = self.spec(self.payload(pending_request))
        views = [self.view(r, spec) for r in ordered]
        pos = self.router.choose(spec, views, time.monotonic())
        if not (isinstance(pos, int) and 0 <= pos < len(ordered)):
            raise ValueError(f"router {self.router!r} chose position {pos!r} of {len(ordered)} replicas")
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        chosen = ordered[pos]
        return [[chosen], [r for r in ordered if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        payload = self.payload(pending_request)
        ids = payload.get("prompt_token_ids") or []
        self.in_flight.setdefault(replica_id, {})[pending_request.metadata.internal_request_id] = len(ids)
        self.routed[replica_id] = self.routed.get(replica_id, 0) + 1
        if ids:
            self.trees.setdefault(replica_id, routers.TokenTree()).insert(list(ids))
        self.decisions.append((pending_request.metadata.internal_request_id, self.number(replica_id)))
        del self.decisions[:-1000]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id, {}).pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        self.trees.pop(replica_id, None)
