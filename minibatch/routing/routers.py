"""Routers, registered by name: which replica serves an arriving request.

``available()`` lists them; ``get(name, **kw)`` builds one; ``@register`` adds your own.
A router is a small class with one decision::

    choose(request, replicas, now) -> position in ``replicas``

``request`` is the arriving :class:`~minibatch.workload.RequestSpec` (``prompt_len``,
``prompt_token_ids``, ``max_tokens``, ``tenant``, ``model`` ...); ``replicas`` is a list of
:class:`~minibatch.routing.ReplicaView` (only the replicas that serve the request's model),
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
``lora_affinity``   the Gateway API Inference Extension's rule: replicas already running the
                    request's LoRA adapter (or with a free adapter slot), then least queue
==================  ================================================================
"""

from __future__ import annotations

import random as _random

from minibatch.routing.view import ReplicaView
from minibatch.policies.registry import Registry


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


ROUTERS = Registry(Router, "router", "routers")
register = ROUTERS.register           # ``@register``: add a router under its ``name``
available = ROUTERS.available         # names of all registered routers
get = ROUTERS.make                    # an instance from a name (or a class, or an instance as is)


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


@register
class Random(Router):
    """Uniformly at random, from the router's own ``random.Random(seed)``.

    Source: sgl-router 0.2.1, ``src/policies/random.rs`` (a uniform draw over the healthy workers).
    """

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = _random.Random(seed)

    def choose(self, request, replicas, now):
        return self.rng.randrange(len(replicas))


@register
class LeastRequests(Router):
    """Fewest unfinished requests (running + waiting); ties to the lowest position.

    Join-the-shortest-queue, deterministic: every replica's count is read (no sampling, unlike
    ``power_of_two``). The load is sgl-router 0.2.1's worker ``load()`` (requests in flight
    on the worker, ``src/core/worker.rs``), the same number ``prefix_aware`` balances on.
    """

    name = "least_requests"

    def choose(self, request, replicas, now):
        return _argmin(replicas, lambda v: v.num_requests)


@register
class LeastKV(Router):
    """Lowest KV-cache usage (used / total blocks), then fewer requests, then lowest position.

    minibatch's own rule (no reference implementation): the KV pool is what preemption
    and admission hinge on, and vLLM exports it as ``vllm:kv_cache_usage_perc``.
    """

    name = "least_kv"

    def choose(self, request, replicas, now):
        return _argmin(replicas, lambda v: (v.kv_usage, v.num_requests))


@register
class PowerOfTwo(Router):
    """Two distinct replicas drawn at random; the one with fewer unfinished requests (the
    first drawn on a tie). Mitzenmacher's "power of two choices".

    Source: sgl-router 0.2.1, ``src/policies/power_of_two.rs`` (``idx1``, then ``idx2``
    redrawn until it differs; ``load1 <= load2`` keeps ``idx1``). Draws come from
    ``random.Random(seed)``: ``a = randrange(n)``, then ``b = randrange(n)`` until ``b != a``.
    """

    name = "power_of_two"

    def __init__(self, seed: int = 0):
        self.rng = _random.Random(seed)

    def sample_pair(self, n: int) -> tuple[int, int]:
        a = self.rng.randrange(n)
        b = self.rng.randrange(n)
        while b == a:
            b = self.rng.randrange(n)
        return a, b

    def choose(self, request, replicas, now):
        if len(replicas) == 1:
            return 0
        a, b = self.sample_pair(len(replicas))
        return a if replicas[a].num_requests <= replicas[b].num_requests else b


@register
class Session(Router):
    """Sticky by tenant: the first request of a ``request.tenant`` (the workload's user or
    session field; BurstGPT's model column loads into it too) goes to the replica with the
    fewest unfinished requests, and every later request of that tenant to the same replica,
    so a conversation finds its earlier turns in that replica's prefix cache. Requests with
    no tenant go to the least loaded replica.

    minibatch's own rule. vLLM's production-stack router has a session router with the same
    aim that maps a session id through a consistent-hash ring instead; a first-come
    assignment to the least loaded replica is easier to work out by hand.
    """

    name = "session"

    def __init__(self):
        self.home: dict[object, int] = {}       # (tenant, model) -> replica index

    def choose(self, request, replicas, now):
        tenant = getattr(request, "tenant", None)
        if tenant is None:
            return _argmin(replicas, lambda v: v.num_requests)
        key = (tenant, getattr(request, "model", None))
        where = {v.index: i for i, v in enumerate(replicas)}
        if key in self.home and self.home[key] in where:
            return where[self.home[key]]
        pos = _argmin(replicas, lambda v: v.num_requests)
        self.home[key] = replicas[pos].index
        return pos


# -- cache-aware routers --------------------------------------------------------------

class TokenTree:
    """What was routed to one replica: a radix tree over prompt tokens (``minibatch.radix``
    at one token per block, a counter standing in for block ids), and its size in tokens.

    ``match(tokens)`` is the longest prefix of ``tokens`` in the tree, ``insert(tokens)`` adds
    them, ``len(tree)`` counts the tokens held. The cache-aware routers keep one per replica
    (lab L10 hands it to the learner's own router)."""

    def __init__(self):
        from minibatch.radix import RadixTree

        self.tree = RadixTree(1)
        self._ids = 0

    def __len__(self) -> int:
        return len(self.tree)

    def match(self, tokens) -> int:
        return len(self.tree.match_prefix(tokens))

    def insert(self, tokens) -> None:
        n = len(tokens)
        self.tree.insert(tokens, list(range(self._ids, self._ids + n)))
        self._ids += n


@register
class PrefixAware(Router):
    """SGLang's cache-aware routing (sgl-router's ``cache_aware`` policy).

    With ``load`` = a replica's unfinished requests (``ReplicaView.num_requests``):

    1. if the load is imbalanced, ``max - min > balance_abs_threshold`` **and**
       ``max > balance_rel_threshold * min``, route to the least loaded replica;
    2. else find the replica whose tree shares the longest prefix with the prompt; if that
       match is more than ``cache_threshold`` of the prompt, route there;
    3. else route to the replica with the smallest tree (the most room for new prefixes).

    Either way the prompt is then inserted into the chosen replica's tree. Each replica's
    tree records what the router sent there (it never asks the engine: an approximation of
    the engine's cache).

    Source: ``sglang-router`` 0.2.1 (PyPI sdist = sgl-project/sglang ``sgl-router/``),
    ``src/policies/cache_aware.rs`` (``select_worker``) and ``src/tree.rs``
    (``get_smallest_tenant``). Defaults are the launcher's, ``py_src/sglang_router/router_args.py``
    (``RouterArgs``): ``cache_threshold=0.3``, ``balance_abs_threshold=64``,
    ``balance_rel_threshold=1.5`` (the Rust ``CacheAwareConfig::default()`` in
    ``src/policies/mod.rs`` has 0.5, 32, 1.1 for callers that build the policy directly).

    Differences: the tree holds token ids, not characters; ties go to the less loaded replica
    (equal matches) and then to the lowest position, where SGLang's concurrent maps pick any
    of the tied workers; there is no
    eviction (SGLang trims each tree to ``max_tree_size = 2**26`` characters every
    ``eviction_interval_secs = 120``), which these runs never come near.
    """

    name = "prefix_aware"
    uses_prompt_tokens = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees: dict[int, TokenTree] = {}
        self.last_decision: str | None = None     # "balance", "cache_hit" or "cache_miss" (tests, figures)

    def tree(self, index: int) -> TokenTree:
        if index not in self.trees:
            self.trees[index] = TokenTree()
        return self.trees[index]

    def is_imbalanced(self, loads: list[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, request, replicas, now):
        tokens = list(request.prompt_token_ids or [])
        loads = [v.num_requests for v in replicas]
        if self.is_imbalanced(loads):
            self.last_decision = "balance"
            pos = _argmin(replicas, lambda v: v.num_requests)
        else:
            matches = [self.tree(v.index).match(tokens) for v in replicas]
            best = max(range(len(replicas)), key=lambda i: (matches[i], -loads[i], -i))
            rate = matches[best] / len(tokens) if tokens else 0.0
            if rate > self.cache_threshold:
                self.last_decision = "cache_hit"
                pos = best
            else:
                self.last_decision = "cache_miss"
                pos = _argmin(replicas, lambda v: len(self.tree(v.index)))
        if tokens:
            self.tree(replicas[pos].index).insert(tokens)
        return pos


@register
class KVAware(Router):
    """NVIDIA Dynamo's KV router: the replica of lowest cost

        logit = kv_overlap_score_weight * prefill_blocks + decode_blocks

    with ``prefill_blocks = (prompt tokens - cached tokens) / block_size`` (a float: the
    blocks still to compute on that replica; cached = this prompt's hit in that replica's
    prefix cache, ``ReplicaView.cached_prefix_tokens``, as Dynamo's indexer learns it from
    the workers' KV events) and ``decode_blocks`` = the replica's active blocks if the
    request joined it (``ReplicaView.active_blocks`` + the prompt's blocks not cached there).
    ``temperature = 0`` takes the lowest logit (ties: lowest position); ``temperature > 0``
    samples from ``softmax(-logit / (max - min) / temperature)`` (uniform if all are equal),
    from ``random.Random(seed)``.

    Source: ai-dynamo/dynamo ``lib/llm/src/kv_router/scheduler.rs``
    (``DefaultWorkerSelector::select_worker`` and ``softmax_sample``), as shipped in
    ``ai-dynamo-runtime`` 0.5.0, whose binary carries that function's log line
    "Formula for ... = ... * prefill_blocks + decode_blocks"; defaults from ``ai-dynamo``
    0.5.0 ``dynamo/frontend/main.py``: ``--kv-overlap-score-weight 1.0``,
    ``--router-temperature 0.0`` (and ``KvRouterConfig(overlap_score_weight=1.0,
    router_temperature=0.0)`` in the runtime). Differences: Dynamo breaks ties by the
    smallest indexer tree; here the lowest position.
    """

    name = "kv_aware"

    def __init__(self, kv_overlap_score_weight: float = 1.0, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        self.kv_overlap_score_weight = kv_overlap_score_weight
        self.temperature = temperature
        self.rng = _random.Random(seed)

    def logit(self, request, v: ReplicaView) -> float:
        bs = v.block_size
        n = request.prompt_len
        cached = min(v.cached_prefix_tokens, n)
        prefill_blocks = (n - cached) / bs
        new_blocks = -(-n // bs) - cached // bs
        decode_blocks = v.active_blocks + new_blocks
        return self.kv_overlap_score_weight * prefill_blocks + decode_blocks

    def probabilities(self, logits: list[float]) -> list[float]:
        """Dynamo's ``softmax_sample`` weights: logits scaled by their range, negated, over T."""
        import math

        lo, hi = min(logits), max(logits)
        if lo == hi:
            return [1.0 / len(logits)] * len(logits)
        scaled = [-(x / (hi - lo)) / self.temperature for x in logits]
        m = max(scaled)
        e = [math.exp(s - m) for s in scaled]
        total = sum(e)
        return [x / total for x in e]

    def choose(self, request, replicas, now):
        logits = [self.logit(request, v) for v in replicas]
        if self.temperature == 0:
            return min(range(len(replicas)), key=lambda i: (logits[i], i))
        r = self.rng.random()
        acc = 0.0
        probs = self.probabilities(logits)
        for i, p in enumerate(probs):
            acc += p
            if r <= acc:
                return i
        return len(probs) - 1


# -- adapter-aware router ---------------------------------------------------------------

def _least_range(views: list[ReplicaView], key) -> list[ReplicaView]:
    """The views whose ``key`` lies in ``[min, min + (max - min) / len(views)]``: the Gateway API
    Inference Extension's least-queue and least-KV filters (a band near the minimum, not the
    minimum alone, "as it gives more choices for the next filter")."""
    values = [key(v) for v in views]
    lo, hi = min(values), max(values)
    band = (hi - lo) // len(views) if all(isinstance(x, int) for x in values) else (hi - lo) / len(views)
    return [v for v, x in zip(views, values) if lo <= x <= lo + band]


@register
class LoRAAffinity(Router):
    """Prefer replicas where the request's LoRA adapter is already running or queued.

    Source: the Gateway API Inference Extension (the endpoint picker llm-d builds on), v0.3.0,
    ``pkg/epp/scheduling/scheduler.go`` (``lowLatencyFilter``) and ``filter.go``
    (``loRASoftAffinityFilter``, ``leastQueuingFilterFunc``, ``leastKVCacheFilterFunc``); the
    same filters are plugins in v0.5.0 (``pkg/epp/scheduling/framework/plugins/filter/``).
    The decision tree for a request:

    1. low queue: replicas with fewer than ``queue_threshold`` waiting requests (128).
       If there are any: LoRA affinity among them, then least queue, then least KV.
       If none: least queue among all, then LoRA affinity, then least KV.
    2. LoRA affinity: replicas whose running or waiting requests use the adapter
       (vLLM's ``vllm:lora_requests_info`` gauge) form the affinity group; replicas with room for
       one more adapter (running + waiting adapters < ``max_loras``) the available group. With
       both, the affinity group with probability ``affinity_threshold`` (0.999), else the
       available one; else whichever is not empty; else every replica goes on.
    3. least queue / least KV: the band ``[min, min + (max - min) / n]`` of waiting requests /
       KV usage. The last replicas left: one at random (seeded; GIE draws at random too).

    The request's adapter is its ``adapter_field`` attribute (default ``"lora_name"``; a
    workload whose tenants each have their own adapter passes ``adapter_field="tenant"``).
    A request without an adapter skips the affinity filter.
    """

    name = "lora_affinity"

    def __init__(self, seed: int = 0, queue_threshold: int = 128, affinity_threshold: float = 0.999,
                 adapter_field: str = "lora_name"):
        self.rng = _random.Random(seed)
        self.queue_threshold = queue_threshold
        self.affinity_threshold = affinity_threshold
        self.adapter_field = adapter_field

    def _affinity(self, adapter, views: list[ReplicaView]) -> list[ReplicaView]:
        if adapter is None:
            return views
        affinity = [v for v in views if adapter in v.running_adapters or adapter in v.waiting_adapters]
        available = [v for v in views if v not in affinity
                     and len(v.running_adapters | v.waiting_adapters) < v.max_loras]
        if affinity and available:
            return affinity if self.rng.random() < self.affinity_threshold else available
        return affinity or available or views

    def choose(self, request, replicas, now):
        adapter = getattr(request, self.adapter_field, None)
        low = [v for v in replicas if v.num_waiting < self.queue_threshold]
        if low:
            views = self._affinity(adapter, low)
            views = _least_range(views, lambda v: v.num_waiting)
        else:
            views = self._affinity(adapter, _least_range(replicas, lambda v: v.num_waiting))
        views = _least_range(views, lambda v: v.kv_usage)
        pick = views[self.rng.randrange(len(views))] if len(views) > 1 else views[0]
        return replicas.index(pick)
