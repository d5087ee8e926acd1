"""The cluster layer: N engine replicas behind a router, under one virtual clock.

::

    workload ─► Router ─► replica 0 … N-1   (each an LLMEngine: its own scheduler, KV pool, clock)
                  ▲            │
                  └─ ReplicaView (running, waiting, KV usage, prefix match, in-flight tokens)

``run(workload, replicas=4, router="prefix_aware", executor="sim", model="llama-3-8b",
hardware="a100-80g", **engine_kwargs) -> ClusterResult``; ``ClusterResult.summary()`` has
``RunResult.summary()``'s keys over all requests plus ``replicas``, ``routed``,
``replica_seconds``, ``scale_events`` ...; ``autoscaler=Autoscaler(...)`` adds and drains
replicas with Ray Serve's rule (``minibatch.cluster.autoscaler``); ``migration=True`` (or
``Migration(...)``) moves running requests with their KV blocks from loaded to light replicas
(Llumnix-style, ``minibatch.cluster.migration``); ``disaggregation=Disaggregation(prefill=P, decode=D,
link_gbps=...)`` prefills on P replicas and decodes on D others, the prompt's KV blocks sent over a
link in between (DistServe, ``minibatch.cluster.disagg``; ``goodput_per_gpu`` is its figure of
merit); ``failures=[ReplicaFailure(replica, at_s)]`` kills replicas mid-run and re-dispatches what
they held (``minibatch.cluster.failures``); ``flow_control=FlowControl(max_requests_per_replica=...)``
holds arrivals at the router, in priority bands and fair across tenants, until a replica has room
(llm-d's flow control, ``minibatch.cluster.flow_control``); several models sharing one GPU (memory partitioning,
time-slicing) and placements of models over GPUs are ``minibatch.cluster.multimodel.run``;
``ClusterResult.requests`` holds every record (each with
``.replica``), ``ClusterResult.replicas`` one ``RunResult`` per replica. How the event loop
keeps N replicas' time apart: ``minibatch.cluster.runner``; the routers and where each
rule comes from: ``minibatch.routing.routers`` (also importable as ``minibatch.cluster.routers``).

Your own router is a class with a ``name`` and a ``choose`` that returns a position in the
list of views::

    from minibatch import cluster
    from minibatch.cluster.routers import Router, register

    @register
    class FewestTokens(Router):
        name = "fewest_tokens"

        def choose(self, request, replicas, now):
            return min(range(len(replicas)), key=lambda i: replicas[i].in_flight_tokens)

    result = cluster.run(workload, replicas=4, router="fewest_tokens")
"""

from minibatch.cluster import routers
from minibatch.cluster.autoscaler import Autoscaler
from minibatch.cluster.disagg import Disaggregation, goodput_per_gpu
from minibatch.cluster.failures import ReplicaFailure
from minibatch.cluster.flow_control import FlowControl
from minibatch.cluster.migration import Migration
from minibatch.cluster.replica import Replica, ReplicaView
from minibatch.cluster.routers import Router, available, register
from minibatch.cluster.runner import ClusterResult, run

__all__ = ["Autoscaler", "ClusterResult", "Disaggregation", "FlowControl", "Migration", "Replica", "ReplicaFailure", "ReplicaView", "Router", "available", "goodput_per_gpu", "register", "routers", "run"]
