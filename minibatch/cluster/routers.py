"""The router classes under their older name: everything here is ``minibatch.routing.routers``
(where they now live, below both the cluster and the servers); see that module's docstring."""

from minibatch.routing.routers import (  # noqa: F401  (re-exports)
    ROUTERS,
    KVAware,
    LeastKV,
    LeastRequests,
    PowerOfTwo,
    PrefixAware,
    Random,
    RoundRobin,
    Router,
    Session,
    TokenTree,
    available,
    get,
    register,
)
from minibatch.routing.view import ReplicaView  # noqa: F401

__all__ = ["ROUTERS", "KVAware", "LeastKV", "LeastRequests", "PowerOfTwo", "PrefixAware", "Random",
           "ReplicaView", "RoundRobin", "Router", "Session", "TokenTree", "available", "get", "register"]
