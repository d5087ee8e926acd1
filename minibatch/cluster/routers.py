"""Routers, registered by name: which replica serves an arriving request.

``available()`` lists them; ``get(name, **kw)`` builds one; ``@register`` adds your own.
A router is a small class with one decision::

    choose(request, replicas, now) -> position in ``replicas``

``request`` is the arriving :class:`~minibatch.workload.RequestSpec` (``prompt_len``,
``prompt_token_ids``, ``max_tokens``, ``tenant``, ``model`` ...); ``replicas`` is a list of
:class:`~minibatch.cluster.ReplicaView` (only the replicas that serve the request's model),
``now`` the arrival time. A router may keep state between calls (a counter, a tree of what
it routed where), keyed by ``ReplicaView.index``, the replica's number in the cluster. It
never reaches into an engine: what it knows is what a real router could poll or track.
Seeded routers draw from their own ``random.Random(seed)``, so runs are reproducible.

==================  ================================================================
``round_robin``     the next replica in turn
``random``          uniformly at random (seeded)
``least_requests``  fewest unfinished requests (running + waiting)
``least_kv``        lowest KV-cache usage
``power_of_two``    two distinct replicas at random, the one with fewer requests (seeded)
``session``         sticky by ``request.tenant``: a tenant's first request goes to the least
                    loaded replica, its later ones to the same replica
``prefix_aware``    SGLang's cache-aware rule: balance thresholds, then the longest prefix
                    match in per-replica trees of what was routed there
``kv_aware``        NVIDIA Dynamo's KV router cost: overlap weight x prefill blocks + decode
                    blocks, lowest wins (optional softmax temperature)
==================  ================================================================
"""

from __future__ import annotations

import random as _random
from typing import Callable

from minibatch.cluster.replica import ReplicaView

_REGISTRY: dict[str, type["Router"]] = {}


class Router:
    """Base class. Subclasses set ``name`` and implement :meth:`choose`.

    ``uses_prompt_tokens = True`` asks the cluster for prompt token ids even where the
    engines would not need them (a simulator run without prefix caching), because the
    router matches prefixes.
    """

    name: str = ""
    uses_prompt_tokens: bool = False

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register(cls: type[Router] | None = None, *, name: str | None = None) -> Callable:
    """Class decorator: ``@register`` adds a router under its ``name``."""

    def wrap(c: type[Router]) -> type[Router]:
        key = name or c.name
        if not key:
            raise ValueError(f"router class {c.__name__} has no name")
        c.name = key
        _REGISTRY[key] = c
        return c

    return wrap(cls) if cls is not None else wrap


def available() -> list[str]:
    """Names of all registered routers."""
    return sorted(_REGISTRY)


def get(router: "str | Router | type[Router]", **kwargs) -> Router:
    """A router instance from a name (or a class, or an instance, returned as is)."""
    if isinstance(router, Router):
        return router
    if isinstance(router, type) and issubclass(router, Router):
        return router(**kwargs)
    if router not in _REGISTRY:
        raise ValueError(f"unknown router {router!r}; available routers: {available()}")
    return _REGISTRY[router](**kwargs)


def _argmin(replicas: list[ReplicaView], key) -> int:
    """Position of the replica with the smallest ``key``; ties go to the lowest position."""
    return min(range(len(replicas)), key=lambda i: (key(replicas[i]), i))


# -- load-only routers ----------------------------------------------------------------

@register
class RoundRobin(Router):
    """The next replica in turn: ``counter % len(replicas)``, one counter per set of replicas.

    Source: sgl-router 0.2.1 (``sglang-router`` on PyPI), ``src/policies/round_robin.rs``
    (an atomic counter modulo the number of workers). Here the counter is kept per model
    (per set of candidate replicas), so that two models' requests do not skip each other's turns.
    """

    name = "round_robin"

    def __init__(self):
        self._next: dict[tuple[int, ...], int] = {}

    def choose(self, request, replicas, now):
        key = tuple(v.index for v in replicas)
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        return i % len(replicas)
