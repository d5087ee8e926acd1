"""Routing: which replica serves a request, below both the simulated cluster and the servers.

- :mod:`.view`: :class:`ReplicaView`, one replica as a router sees it;
- :mod:`.routers`: the router classes, registered by name (``round_robin`` ... ``kv_aware``).

The simulator (``minibatch.cluster``), the HTTP router (``minibatch.serving.router``) and
the Ray Serve backend (``minibatch.cluster.ray_router``) all route with these classes.
``minibatch.cluster.routers``, ``minibatch.cluster.ReplicaView`` and
``minibatch.cluster.replica.ReplicaView`` are the same objects under their older names.
"""

from minibatch.routing import routers
from minibatch.routing.routers import Router, TokenTree, available, register
from minibatch.routing.view import ReplicaView

__all__ = ["ReplicaView", "Router", "TokenTree", "available", "register", "routers"]
