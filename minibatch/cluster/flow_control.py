"""Gateway flow control: requests wait at the router, by priority band and fair across tenants,
until a replica has room (llm-d / Gateway API Inference Extension's flow controller, Dynamo's
router queue).

Without flow control the cluster routes every arrival at once, and a burst queues *inside* the
engines: a replica's waiting queue is FCFS (or whatever its policy is), the router's choice is
final, and a late urgent request waits behind everything routed before it. With
``minibatch.cluster.run(..., flow_control=FlowControl(...))`` an arrival is held in a queue at
the router instead, and released only when some replica serving it *has room*:

* a replica has room while its unfinished requests (running + waiting, as the router sees them,
  ``ReplicaView.num_requests``) are fewer than ``max_requests_per_replica`` and, if
  ``max_kv_usage`` is set, its KV usage (``ReplicaView.kv_usage``) is below that bound. An idle
  replica (no request at all) always has room, so a held request can never wait forever;
* the router then chooses among the replicas **with room** only (its own rule: round robin,
  least requests, prefix aware ...).

Which held request goes next (the three tiers of llm-d's flow controller,
``pkg/epp/framework/plugins/flowcontrol/fairness/doc.go`` at v1.5.0):

1. **band**: the most urgent priority band that holds a request goes first, strictly (a lower
   ``RequestSpec.priority`` is more urgent, as in vLLM; llm-d numbers the other way round,
   higher = more urgent). A band never waits for a less urgent one;
2. **flow** within the band, by ``fairness``: ``"round_robin"`` cycles through the band's
   tenants (``RequestSpec.tenant``; ``None`` is one flow), skipping those with nothing held, so
   a heavy tenant cannot starve a light one (llm-d's ``round-robin-fairness-policy``);
   ``"fcfs"`` takes the oldest held request of the band whatever its tenant (llm-d's default
   ``global-strict-fairness-policy``: no isolation);
3. **order** within a flow: first come, first served (llm-d's default ``fcfs-ordering-policy``).

Bounds: ``queue_timeout_s`` rejects a request held longer than that (llm-d's request TTL);
``max_queued`` rejects an arrival that finds that many requests held already and cannot go at
once (llm-d's band capacity; ``max_queued=0``: nothing is ever held, what finds no room is
rejected). A rejected request has ``finish_reason="rejected"`` and its reason in ``error``; no
request is lost.

The held time counts in the request's TTFT: the engine records the request's arrival at the
router, not at its release.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FAIRNESS = ("round_robin", "fcfs")


@dataclass(frozen=True)
class FlowControl:
    """Flow control at the cluster's router (see the module docstring for each rule)."""

    max_requests_per_replica: int = 8       # room while running + waiting < this (llm-d: maxConcurrency)
    max_kv_usage: float | None = None       # and KV usage < this, if set (llm-d: kvCacheUtilThreshold)
    fairness: str = "round_robin"           # between tenants of one band: "round_robin" | "fcfs"
    queue_timeout_s: float | None = None    # reject a request held longer than this
    max_queued: int | None = None           # reject an arrival that finds this many held

    def __post_init__(self):
        m = self.max_requests_per_replica
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"FlowControl.max_requests_per_replica must be an int >= 1, got {m!r}")
        k = self.max_kv_usage
        if k is not None and not (isinstance(k, (int, float)) and 0.0 < k <= 1.0):
            raise ValueError(f"FlowControl.max_kv_usage must be in (0, 1], got {k!r}")
        if self.fairness not in FAIRNESS:
            raise ValueError(f"FlowControl.fairness must be one of {FAIRNESS}, got {self.fairness!r}")
        t = self.queue_timeout_s
        if t is not None and not (isinstance(t, (int, float)) and t > 0):
            raise ValueError(f"FlowControl.queue_timeout_s must be > 0 seconds, got {t!r}")
        q = self.max_queued
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
            raise ValueError(f"FlowControl.max_queued must be an int >= 0, got {q!r}")

    def has_room(self, view) -> bool:
        """May a held request be released to the replica seen as ``view`` (a ReplicaView)?"""
        n = view.num_requests
        if n == 0:
            return True
        if n >= self.max_requests_per_replica:
            return False
        return self.max_kv_usage is None or view.kv_usage < self.max_kv_usage


class _Held:
    __slots__ = ("item", "since", "seq", "band", "flow", "live")

    def __init__(self, item, since: float, seq: int, band: int, flow):
        self.item, self.since, self.seq, self.band, self.flow = item, since, seq, band, flow
        self.live = True


class FlowQueue:
    """The held requests: bands (lower number first), per band one FIFO per flow (tenant).

    ``push(item, band, flow, now)`` holds an item, ``peek()``/``pop()`` give the next one under
    the band / fairness / FCFS rules, ``expire(now)`` removes those held past the timeout.
    Pure bookkeeping with no clock of its own, shared by the simulated cluster and the HTTP
    router (``minibatch.serving.flow``).
    """

    def __init__(self, control: FlowControl):
        self.control = control
        self._bands: dict[int, dict] = {}          # band -> {flow: deque[_Held]} (insertion-ordered)
        self._cursor: dict[int, int] = {}          # band -> round-robin position in its flow list
        self._fifo: deque[_Held] = deque()         # every held item in push order (timeouts)
        self._seq = 0
        self._len = 0
        self.max_len = 0                           # the most ever held at once
        self.released = 0
        self.rejected = 0

    def __len__(self) -> int:
        return self._len

    def full(self) -> bool:
        q = self.control.max_queued
        return q is not None and self._len >= q

    def push(self, item, band: int, flow, now: float) -> None:
        h = _Held(item, now, self._seq, int(band), flow)
        self._seq += 1
        self._bands.setdefault(h.band, {}).setdefault(flow, deque()).append(h)
        self._cursor.setdefault(h.band, 0)
        self._fifo.append(h)
        self._len += 1
        self.max_len = max(self.max_len, self._len)

    def _next(self) -> tuple[int, object, int] | None:
        """(band, flow, position of the flow in the band's list) of the next item to release."""
        for band in sorted(self._bands):
            flows = self._bands[band]
            keys = [f for f, q in flows.items() if q]
            if not keys:
                continue
            if self.control.fairness == "fcfs":
                flow = min(keys, key=lambda f: flows[f][0].seq)
                return band, flow, 0
            order = list(flows)
            start = self._cursor[band] % len(order)
            for k in range(len(order)):
                pos = (start + k) % len(order)
                if flows[order[pos]]:
                    return band, order[pos], pos
        return None

    def peek(self):
        nxt = self._next()
        return None if nxt is None else self._bands[nxt[0]][nxt[1]][0].item

    def pop(self):
        """Remove and return the next item (``None`` if nothing is held)."""
        nxt = self._next()
        if nxt is None:
            return None
        band, flow, pos = nxt
        h = self._bands[band][flow].popleft()
        h.live = False
        self._len -= 1
        self.released += 1
        if self.control.fairness == "round_robin":
            self._cursor[band] = pos + 1           # the next flow of this band gets the next turn
        return h.item

    def next_expiry(self) -> float:
        """When the oldest held item times out (``inf`` without a timeout or with nothing held)."""
        t = self.control.queue_timeout_s
        while self._fifo and not self._fifo[0].live:
            self._fifo.popleft()
        if t is None or not self._fifo:
            return float("inf")
        return self._fifo[0].since + t

    def expire(self, now: float, eps: float = 1e-12) -> list:
        """Remove and return the items held for ``queue_timeout_s`` or longer at ``now``."""
        out = []
        while self.next_expiry() <= now + eps:
            h = self._fifo.popleft()
            h.live = False
            self._bands[h.band][h.flow].remove(h)
            self._len -= 1
            self.rejected += 1
            out.append(h.item)
        return out


def two_band_workload(seed: int = 0, duration_s: float = 60.0, chat_rate: float = 2.0,
                      chat_tenants: int = 4, light_tenants: int = 3, light_rate: float = 0.5,
                      burst: int = 120, burst_every_s: float = 15.0, first_burst_s: float = 2.0,
                      prompt_len: tuple[int, int] = (256, 1024), output_len: tuple[int, int] = (64, 256)):
    """A bursty multi-tenant workload with two priority bands (the flow-control benchmark's and
    chapter 26's):

    * band 0 (urgent): ``chat_tenants`` chat tenants ``chat0..``, Poisson arrivals at ``chat_rate``
      requests/s in all;
    * band 1: a ``batch`` tenant sending ``burst`` requests at once (2 ms apart) every
      ``burst_every_s`` seconds from ``first_burst_s``, and ``light_tenants`` light tenants
      ``light0..``, each Poisson at ``light_rate`` requests/s.

    Prompt and output lengths are uniform integers in ``[lo, hi)``; one seeded generator.
    """
    import numpy as np

    from minibatch.workload import RequestSpec, Workload

    rng = np.random.default_rng(seed)
    reqs = []

    def add(t: float, priority: int, tenant: str) -> None:
        reqs.append(RequestSpec(float(t), int(rng.integers(*prompt_len)), int(rng.integers(*output_len)),
                                priority=priority, tenant=tenant))

    def poisson(rate: float, priority: int, tenant) -> None:
        t = rng.exponential(1.0 / rate)
        while t < duration_s:
            add(t, priority, tenant() if callable(tenant) else tenant)
            t += rng.exponential(1.0 / rate)

    poisson(chat_rate, 0, lambda: f"chat{int(rng.integers(chat_tenants))}")
    for k in range(light_tenants):
        poisson(light_rate, 1, f"light{k}")
    t = first_burst_s
    while t < duration_s:
        for i in range(burst):
            add(t + 0.002 * i, 1, "batch")
        t += burst_every_s
    reqs.sort(key=lambda r: r.arrival_time)
    return Workload(reqs, name="two_band")
