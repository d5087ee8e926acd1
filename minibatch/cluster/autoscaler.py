"""The autoscaler: every ``interval_s`` of virtual time, decide how many replicas the cluster needs.

Ray Serve's request-based autoscaling, with its names and its rule, as in Ray 2.60.0 (the
``ray[serve]`` release this project's ``ray`` extra installs; read in its installed sources):

* ``ray/serve/config.py``, ``AutoscalingConfig``: ``min_replicas=1``, ``initial_replicas=None``
  (then ``min_replicas``), ``max_replicas=1``, ``target_ongoing_requests=2``
  (``DEFAULT_TARGET_ONGOING_REQUESTS`` in ``ray/serve/_private/constants.py``; it was 1.0 before
  the 2.32.0 rename from ``target_num_ongoing_requests_per_replica``),
  ``metrics_interval_s=10.0``, ``look_back_period_s=30.0``, ``upscale_delay_s=30.0``,
  ``downscale_delay_s=600.0``, ``smoothing_factor=1.0`` and ``upscaling_factor`` /
  ``downscaling_factor`` unset (so 1), ``aggregation_function="mean"``.
* ``ray/serve/autoscaling_policy.py``, ``replica_queue_length_autoscaling_policy``: with the
  factors at 1, ``desired = ceil(total ongoing requests / target_ongoing_requests)`` (the
  per-replica means over ``look_back_period_s``, summed over the running replicas), clamped to
  ``[min_replicas, max_replicas]``. A change needs that decision on consecutive control-loop
  periods: ``_apply_delay_logic`` keeps a direction (``decision_counter``, reset when the
  direction flips or ``desired`` equals the target) and the timestamp of the first decision of
  the run, and moves the target to ``desired`` once ``now - first >= upscale_delay_s`` (the
  same downwards with ``downscale_delay_s``). ``ray/serve/_private/constants.py``:
  ``CONTROL_LOOP_INTERVAL_S = 0.1`` (this module's ``interval_s``). Here the elapsed time is
  counted in control-loop periods (``counter > int(delay / interval_s)``), which is the same
  moment when the decisions come every ``interval_s`` of virtual time.

So a load that stays above target from the decision at ``t0`` on scales up at exactly
``t0 + upscale_delay_s`` (when the delay is a multiple of ``interval_s``).

What minibatch adds (not Ray Serve's): ``metric="queue"`` (waiting requests per replica) and
``metric="kv_usage"`` (the fraction of a replica's KV blocks in use; ``target_ongoing_requests``
is then the target fraction, e.g. 0.7) in place of ongoing requests, through the same rule;
``metric="slo_attainment"``, a feedback rule on the TTFT SLO (``slo={"ttft": seconds}``): the
attainment is the fraction of the cluster's requests, over the last ``look_back_period_s``,
that got their first token within the SLO, counting a request still waiting past the SLO as
a miss as soon as it is late (a backlog shows before its first tokens do). Below
``target_attainment`` the decision is one replica more; at or above it, the decision is one
replica less only where the ongoing-requests rule also asks for fewer (attainment alone
cannot tell a right-sized cluster from an over-provisioned one); both go through Ray Serve's
delay counters above.
``cold_start_s``, the virtual time a new replica takes before it serves (loading weights):
routers do not see it before. Scaling down removes replicas that are still starting first
(newest first, as Ray Serve stops starting replicas before running ones), then drains running
ones (fewest ongoing requests first): a draining replica gets no new request, finishes what it
holds and then leaves, so no request is ever lost. Metrics are sampled once per
``interval_s`` from what a router would see (``ReplicaView``) and averaged over the samples
of the last ``look_back_period_s``. Scale to zero (``min_replicas=0``) is not modelled.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

METRICS = ("ongoing_requests", "queue", "kv_usage", "slo_attainment")


@dataclass
class Autoscaler:
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    cold_start_s: float = 0.0
    metric: str = "ongoing_requests"
    interval_s: float = 0.1
    initial_replicas: int | None = None
    slo: dict | None = None               # metric="slo_attainment": {"ttft": seconds}
    target_attainment: float = 0.95
    # state (one run)
    decision_counter: int = field(default=0, init=False, repr=False)
    _samples: dict = field(default_factory=dict, init=False, repr=False)
    _outcomes: deque = field(default_factory=deque, init=False, repr=False)   # (time, met) of first tokens

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"unknown autoscaler metric {self.metric!r}; expected one of {METRICS}")
        if self.min_replicas < 1:
            raise ValueError("min_replicas must be >= 1 (scale to zero is not modelled)")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.target_ongoing_requests <= 0 or self.interval_s <= 0 or self.look_back_period_s <= 0:
            raise ValueError("target_ongoing_requests, interval_s and look_back_period_s must be > 0")
        if min(self.upscale_delay_s, self.downscale_delay_s, self.cold_start_s) < 0:
            raise ValueError("upscale_delay_s, downscale_delay_s and cold_start_s must be >= 0")
        if self.metric == "slo_attainment":
            if not self.slo or "ttft" not in self.slo or self.slo["ttft"] <= 0:
                raise ValueError('metric="slo_attainment" needs slo={"ttft": seconds > 0}')
            if not 0 < self.target_attainment <= 1:
                raise ValueError("target_attainment must lie in (0, 1]")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")

    @property
    def start_replicas(self) -> int:
        """Replicas at the start (Ray Serve: ``initial_replicas``, else ``min_replicas``)."""
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas

    def reset(self) -> None:
        self.decision_counter = 0
        self._samples = {}
        self._outcomes = deque()

    def record_first_token(self, when: float, ttft: float) -> None:
        """A request's first token came at ``when``, ``ttft`` after its arrival."""
        self._outcomes.append((when, ttft <= self.slo["ttft"] + 1e-12))

    def attainment(self, now: float, overdue: int = 0) -> float:
        """Fraction of first tokens in the look-back window within the SLO; ``overdue`` waiting
        requests already past it count as misses. 1.0 when there is nothing to judge."""
        q = self._outcomes
        while q and q[0][0] <= now - self.look_back_period_s:
            q.popleft()
        n = len(q) + overdue
        return (sum(met for _, met in q) / n) if n else 1.0

    def value(self, view) -> float:
        """The metric of one replica, as a router sees it (a ``ReplicaView``)."""
        if self.metric == "ongoing_requests":
            return float(view.num_requests)
        if self.metric == "queue":
            return float(view.num_waiting)
        return view.kv_usage

    def record(self, key, now: float, value: float) -> None:
        """One sample of replica ``key``'s metric at ``now``."""
        q = self._samples.setdefault(key, deque())
        q.append((now, value))
        while q and q[0][0] <= now - self.look_back_period_s:
            q.popleft()

    def average(self, key) -> float:
        q = self._samples.get(key)
        return sum(v for _, v in q) / len(q) if q else 0.0

    def desired(self, total: float) -> int:
        """``ceil(total / target)`` clamped to ``[min_replicas, max_replicas]``."""
        want = math.ceil(total / self.target_ongoing_requests - 1e-9)
        return max(self.min_replicas, min(self.max_replicas, want))

    def desired_slo(self, current_target: int, attainment: float, total_ongoing: float) -> int:
        """``metric="slo_attainment"``: one more below target attainment; one fewer when it holds
        and ``ceil(total ongoing / target_ongoing_requests)`` is below the current target."""
        if attainment < self.target_attainment:
            want = current_target + 1
        elif math.ceil(total_ongoing / self.target_ongoing_requests - 1e-9) < current_target:
            want = current_target - 1
        else:
            want = current_target
        return max(self.min_replicas, min(self.max_replicas, want))

    def decide(self, current_target: int, total: float, desired: int | None = None) -> int:
        """Ray Serve's ``replica_queue_length_autoscaling_policy``: the new target (``desired``,
        when given, replaces ``ceil(total / target)``)."""
        desired = self.desired(total) if desired is None else desired
        up = int(self.upscale_delay_s / self.interval_s + 1e-9)
        down = int(self.downscale_delay_s / self.interval_s + 1e-9)
        if desired > current_target:
            if self.decision_counter < 0:
                self.decision_counter = 0
            self.decision_counter += 1
            if self.decision_counter > up:
                self.decision_counter = 0
                return desired
        elif desired < current_target:
            if self.decision_counter > 0:
                self.decision_counter = 0
            self.decision_counter -= 1
            if self.decision_counter < -down:
                self.decision_counter = 0
                return desired
        else:
            self.decision_counter = 0
        return current_target
