"""Capacity over several seeds, for several configurations at once.

    from minibatch import tune
    found = tune.capacities({1: wl1, 2: wl2, 3: wl3}, [{"max_num_seqs": 32}, {"max_num_seqs": 64}],
                            slo={"ttft": 0.5, "tpot": 0.05}, lo=1.0, hi=12.0, duration_s=80,
                            model="llama-2-7b", hardware="a100-80g", executor="sim")
    found[0].estimate.median, found[0].estimate.lo, found[0].estimate.hi   # req/s over the seeds

One capacity is one draw of the arrivals: :func:`minibatch.results.capacity_over_seeds` bisects the
rate once per seed and reports the median with the spread. :func:`capacities` does that for each
configuration, with one job per (configuration, seed) on the sweep's local processes or Ray tasks
(:func:`minibatch.tune.parallel_map`).

Every run lasts the same time whatever the rate (``duration_s``): at rate ``r`` the job replays the
first ``ceil(r * duration_s) + 1`` requests of the seed's workload, rescaled to ``r`` req/s
(:func:`workload_at`), so that the steady window (``trim``) holds as many seconds at every rate and
a high rate is not judged on a shorter run than a low one. Without ``duration_s`` the whole
workload is rescaled (its length in seconds then shrinks as the rate grows, as in ``sweep``).

A configuration is a dict of engine options; its ``"policy"`` may be a policy *instance*
(a ``minibatch.policies.base.Policy``, e.g. ``SJFPolicy(predictor=...)``): each run then gets a
fresh copy of it on an engine built from the other options.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from minibatch.results import CapacityEstimate, capacity


def workload_at(workload, rate: float, duration_s: float | None = None):
    """``workload`` at ``rate`` req/s; with ``duration_s``, only its first ``ceil(rate * duration_s) + 1``
    requests, so that the arrivals span ``duration_s`` seconds (the mean rate is ``(n - 1) / span``)."""
    if duration_s is None:
        return workload.with_rate(rate)
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    n = math.ceil(rate * duration_s) + 1
    if n > len(workload):
        raise ValueError(f"{duration_s:g} s at {rate:g} req/s needs {n} requests; the workload has {len(workload)} "
                         f"(give a longer workload or a lower hi)")
    return workload.slice(0, n).with_rate(rate)


def steady_attainment(job: tuple) -> float:
    """SLO attainment of the steady state of one run: ``job = (workload, engine options, slo, trim)``."""
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine
    from minibatch.policies.base import Policy
    from minibatch.runner import run

    wl, config, slo, trim = job
    policy = config.get("policy")
    if isinstance(policy, Policy):
        options = {k: v for k, v in config.items() if k != "policy"}
        engine = LLMEngine(EngineConfig.from_kwargs(**options), clock="virtual")
        engine.scheduler.policy = copy.deepcopy(policy)
        result = run(wl, engine=engine)
    else:
        result = run(wl, **config)
    return result.summary(slo, trim=trim)["slo_attainment"]


def _search(job: tuple) -> dict:
    """Bisect one configuration's capacity on one seed's workload; the probes ``{rate: attainment}``."""
    wl, config, slo, trim, target, lo, hi, tol, duration_s = job
    probes: dict[float, float] = {}

    def attainment(rate: float) -> float:
        probes[rate] = steady_attainment((workload_at(wl, rate, duration_s), config, slo, trim))
        return probes[rate]

    return {"capacity": capacity(attainment, target=target, lo=lo, hi=hi, tol=tol), "probes": probes}


@dataclass
class SeededCapacity:
    """One configuration's capacity on each seed (``estimate``) and the runs that found it."""

    config: dict
    estimate: CapacityEstimate
    probes: dict = field(default_factory=dict)      # seed -> {rate: attainment}

    @property
    def runs(self) -> int:
        return sum(len(p) for p in self.probes.values())


def capacities(workloads, configs, slo: dict, *, target: float = 0.9, lo: float = 0.5, hi: float = 16.0,
               tol: float = 0.05, trim: float = 0.1, duration_s: float | None = None, processes: int = 2,
               ray_address: str | None = None, **engine_kwargs) -> list[SeededCapacity]:
    """Capacity by bisection (:func:`minibatch.results.capacity`) of every configuration on every seed.

    ``workloads``: ``{seed: Workload}`` (or a list of ``(seed, Workload)``); ``configs``: engine options
    per configuration, laid over ``engine_kwargs``. Returns one :class:`SeededCapacity` per configuration,
    in order; its ``estimate`` is a :class:`minibatch.results.CapacityEstimate` (median, min-max)."""
    from minibatch.tune import parallel_map

    if not slo:
        raise ValueError("capacities needs an SLO, e.g. slo={'ttft': 0.5, 'tpot': 0.05} (seconds)")
    pairs = list(workloads.items()) if isinstance(workloads, dict) else [tuple(p) for p in workloads]
    if not pairs:
        raise ValueError("capacities needs at least one seed's workload")
    configs = [dict(c) for c in configs]
    if not configs:
        raise ValueError("capacities needs at least one configuration")
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    if duration_s is not None:
        for seed, wl in pairs:              # fail before any run if the top rate needs more requests
            workload_at(wl, hi, duration_s)
    jobs = [(wl, {**engine_kwargs, **c}, slo, trim, target, lo, hi, tol, duration_s) for c in configs for _, wl in pairs]
    out = parallel_map(_search, jobs, processes, ray_address)
    found = []
    for i, c in enumerate(configs):
        mine = out[i * len(pairs):(i + 1) * len(pairs)]
        seeds = tuple(s for s, _ in pairs)
        found.append(SeededCapacity(c, CapacityEstimate(tuple(o["capacity"] for o in mine), seeds),
                                    {s: o["probes"] for s, o in zip(seeds, mine)}))
    return found


def verdict(a: CapacityEstimate, b: CapacityEstimate) -> str:
    """How firmly ``a`` is above ``b`` over the seeds: ``"higher"`` if a's lowest seed is above b's
    highest, ``"lower"`` the other way round, else ``"overlap"`` (the seeds do not separate them)."""
    if a.lo > b.hi:
        return "higher"
    if a.hi < b.lo:
        return "lower"
    return "overlap"
