"""Tuning sweeps on the simulator: the goodput-optimal configuration and the Pareto front.

    from minibatch import tune
    res = tune.sweep(workload, model="llama-2-7b", hardware="a100-80g",
                     grid={"max_num_seqs": [16, 64], "max_num_batched_tokens": [512, 2048],
                           "max_wait_ms": [0], "policy": ["continuous", "sjf"]},
                     slo={"ttft": 0.5, "tpot": 0.05})
    res.best, res.num_runs, res.pareto          # res.table() prints every trial

Every configuration is the product of the grid's values (``EngineConfig`` fields; the
other engine options are ``**engine_kwargs``); a list of grids is the union of their
products, in list order (scikit-learn's ``ParameterGrid`` form: a knob that matters only
with another, such as ``max_wait_ms`` with the ``dynamic`` policy, goes in a grid of its own
instead of multiplying every other one). Each is run on ``workload`` under the simulator and
summarized with :func:`minibatch.results.summarize` (``RunResult.summary(slo, trim)``):
goodput, SLO attainment and the p90 latency (``latency_metric``, default ``e2e_p90``)
of the steady state (``trim=0.1``). Two objectives:

* **goodput at the workload's own rate** (``rates=None``): one run per configuration;
  the optimum is the highest goodput; the **Pareto front** is the set of configurations
  that no other beats on both goodput (higher) and p90 latency (lower).
* **capacity** (``rates=[...]``, ascending request rates): DistServe's capacity,
  :func:`minibatch.results.capacity`, the highest rate up to which at least ``target``
  of the requests meet the SLO. ``method="grid"`` runs every configuration at every rate
  (``len(configs) * len(rates)`` runs); ``method="bisect"`` is Vidur-Search's idea
  (Agrawal et al., MLSys'24, ``vidur/config_optimizer``): per configuration, a binary
  search of the capacity over the rate ladder, and pruning: a configuration that fails
  the target at the rate just above the best capacity found so far cannot beat it and
  costs one run. It finds the same optimum as the grid when attainment does not rise with
  the rate (the assumption of any capacity search), in far fewer runs. The Pareto front is
  then capacity (higher) vs the p90 latency at that capacity (lower), over the
  configurations whose capacity was measured (pruned ones are not on it). Ties go to the
  configuration first in grid order.

:func:`summaries` runs any list of ``(workload, engine_kwargs)`` the same way and returns each
run's whole summary. Runs go to ``processes`` local processes (``concurrent.futures.ProcessPoolExecutor``;
``processes=1`` runs in this process), or, with ``ray_address`` (``"auto"``, ``"local"``
for a new local Ray instance, or ``ray://host:port``), to Ray tasks: the same jobs,
``ray.remote`` instead of a process pool. Ray is optional and imported only then. Under
``method="bisect"`` configurations are searched ``processes`` at a time, each batch
pruned against the best of the batches before it (so a few more runs than one by one).

:func:`capacities` (``minibatch/tune/seeds.py``) measures each configuration's capacity on several seeds
by bisection (median and spread, :class:`minibatch.results.CapacityEstimate`), each run the same number
of seconds of traffic whatever the rate.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from minibatch.config import EngineConfig

DEFAULT_GRID = {"max_num_seqs": [16, 64, 256], "max_num_batched_tokens": [512, 2048, 8192],
                "max_wait_ms": [0.0], "policy": ["continuous"]}


@dataclass
class Trial:
    """One configuration's result (``goodput`` in req/s, ``latency`` in s, at ``rate``)."""

    config: dict
    goodput: float | None = None
    attainment: float | None = None
    latency: float | None = None
    rate: float | None = None               # the rate these metrics were measured at (None: the workload's)
    capacity: float | None = None           # capacity mode: req/s; None if pruned
    pruned: bool = False
    runs: int = 0
    probes: dict = field(default_factory=dict)   # capacity mode: {rate: attainment} of the runs made


@dataclass
class TuneResult:
    """What :func:`sweep` returns."""

    best: dict                      # the optimal configuration (the grid's knobs only)
    best_trial: Trial
    trials: list[Trial]             # one per configuration, in grid order
    pareto: list[Trial]             # non-dominated trials, by objective descending
    num_runs: int                   # simulated runs this sweep took
    full_grid_runs: int             # runs the exhaustive grid takes for the same objective
    objective: str                  # "goodput" | "capacity"
    method: str                     # "grid" | "bisect"
    latency_metric: str = "e2e_p90"

    def score(self, t: Trial) -> float:
        return (t.capacity if self.objective == "capacity" else t.goodput) or 0.0

    def table(self) -> str:
        keys = list(dict.fromkeys(k for t in self.trials for k in t.config))    # a list of grids: every knob
        cap = self.objective == "capacity"
        head = keys + (["capacity", "at rate"] if cap else []) + ["goodput", self.latency_metric, "runs", ""]
        rows = [head]
        for t in self.trials:
            mark = "best" if t is self.best_trial else ("pareto" if any(t is p for p in self.pareto) else
                                                        ("pruned" if t.pruned else ""))
            measured = ["-" if t.capacity is None else f"{t.capacity:.2f}",
                        "-" if t.rate is None else f"{t.rate:.2f}"] if cap else []
            rows.append([str(t.config.get(k, "-")) for k in keys] + measured + [
                "-" if t.goodput is None else f"{t.goodput:.2f}",
                "-" if t.latency is None else f"{t.latency:.2f}", str(t.runs), mark])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"{self.num_runs} simulated runs ({self.method}; the full grid takes {self.full_grid_runs})")
        return "\n".join(lines)


def grid_configs(grid: dict | list[dict]) -> list[dict]:
    """The product of ``grid``'s values, in order (the last key varies fastest); for a list of
    grids, the union of their products in list order."""
    if isinstance(grid, (list, tuple)):
        if not grid or not all(isinstance(g, dict) for g in grid):
            raise ValueError(f"grid must be a dict or a non-empty list of dicts, got {grid!r}")
        return [config for g in grid for config in grid_configs(g)]
    names = {f.name for f in EngineConfig.__dataclass_fields__.values()} | {"scheduling_policy"}
    for key, values in grid.items():
        if key not in names:
            raise ValueError(f"grid key {key!r} is not an engine option; known options: {sorted(names)}")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got {values!r}")
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def pareto_front(trials: list[Trial], objective: str = "goodput") -> list[Trial]:
    """Trials not dominated on (objective higher, latency lower): nothing else is at least as good on
    both and better on one. Sorted by objective, best first."""
    def score(t):
        return t.capacity if objective == "capacity" else t.goodput

    pts = [t for t in trials if score(t) is not None and t.latency is not None and not math.isnan(t.latency)]
    front = [t for t in pts if not any(score(o) >= score(t) and o.latency <= t.latency
                                       and (score(o) > score(t) or o.latency < t.latency) for o in pts)]
    return sorted(front, key=lambda t: (-score(t), t.latency))


# -- one simulated run (top level: it is pickled to worker processes and Ray tasks) ------------------
def evaluate(job: tuple) -> dict:
    """Run ``workload`` (at ``rate`` if given) with ``engine_kwargs`` and summarize it under ``slo``."""
    from minibatch.runner import run

    workload, rate, engine_kwargs, slo, trim, latency_metric, *rest = job
    duration_s = rest[0] if rest else None
    wl = workload if rate is None else workload_at(workload, rate, duration_s)
    s = run(wl, **engine_kwargs).summary(slo, trim=trim)
    return {"goodput": s["goodput"], "attainment": s["slo_attainment"], "latency": s[latency_metric]}


def _summary(job: tuple) -> dict:
    from minibatch.runner import run

    workload, engine_kwargs, slo, trim = job
    return run(workload, **engine_kwargs).summary(slo, trim=trim)


def summaries(jobs, slo: dict | None = None, trim: float = 0.1, processes: int = 2,
              ray_address: str | None = None) -> list[dict]:
    """``run(workload, **engine_kwargs).summary(slo, trim)`` for each ``(workload, engine_kwargs)``
    of ``jobs``, in order, on the sweep's local processes or Ray tasks: the full summary (TTFT,
    TPOT, throughput, preemptions, ...) of runs a grid does not describe, e.g. seeds or presets."""
    return parallel_map(_summary, [(wl, dict(kw), slo, trim) for wl, kw in jobs], processes, ray_address)


def search_capacity(job: tuple) -> dict:
    """Vidur-style search of one configuration's capacity on the rate ladder ``rates``:
    ``floor`` is the ladder index of the best capacity known (-1: none); a configuration
    failing at ``floor + 1`` is pruned. Returns the probes ``{index: metrics}``, the capacity
    index (-1: even the lowest rate misses the target; None: pruned)."""
    workload, rates, engine_kwargs, slo, trim, latency_metric, target, floor, *rest = job
    duration_s = rest[0] if rest else None
    probes: dict[int, dict] = {}

    def passes(i: int) -> bool:
        probes[i] = evaluate((workload, rates[i], engine_kwargs, slo, trim, latency_metric, duration_s))
        return probes[i]["attainment"] >= target

    first = floor + 1
    if first >= len(rates):                  # the best already holds the top rate: nothing to gain
        return {"probes": probes, "index": None}
    if not passes(first):
        return {"probes": probes, "index": -1 if floor < 0 else None}
    lo, hi = first, len(rates)               # rates[lo] passes; rates[hi] fails (len: none known)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return {"probes": probes, "index": lo}


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("ray_address was given but Ray is not installed; pip install 'ray[default]' "
                           "(or leave ray_address=None to use local processes)") from None
    return ray


def parallel_map(fn, jobs: list, processes: int = 2, ray_address: str | None = None) -> list:
    """``[fn(job) for job in jobs]``, on Ray tasks if ``ray_address``, else on local processes."""
    if ray_address is not None:
        ray = _ray()
        if not ray.is_initialized():
            from minibatch.cluster.ray_backend import local_ray_environment   # imports no Ray

            with local_ray_environment():      # used only if this starts a local instance
                ray.init(address=None if ray_address == "local" else ray_address, ignore_reinit_error=True,
                         include_dashboard=False, log_to_driver=False)
        task = ray.remote(fn)
        return ray.get([task.remote(job) for job in jobs])
    if processes <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(processes, len(jobs))) as pool:
        return list(pool.map(fn, jobs))


def sweep(workload, model: str = "llama-2-7b", hardware: str | None = "a100-80g", grid: dict | list | None = None,
          slo: dict | None = None, executor: str = "sim", processes: int = 2, ray_address: str | None = None,
          rates=None, target: float = 0.9, method: str = "grid", trim: float = 0.1,
          latency_metric: str = "e2e_p90", duration_s: float | None = None, **engine_kwargs) -> TuneResult:
    """Sweep ``grid`` (default :data:`DEFAULT_GRID`; a dict, or a list of dicts for their union) under
    ``slo`` (required; seconds, e.g. ``{"ttft": 0.5, "tpot": 0.05}``); see the module docstring for the
    two objectives. With ``rates`` and ``duration_s``, every run replays ``duration_s`` seconds of the
    workload's arrivals at each rate (its first requests, :func:`workload_at`) instead of the whole
    workload rescaled (which lasts less the higher the rate)."""
    from minibatch.workload import Workload

    if not slo:
        raise ValueError("sweep needs an SLO, e.g. slo={'ttft': 0.5, 'tpot': 0.05} (seconds): goodput counts "
                         "the requests that meet it")
    if method not in ("grid", "bisect"):
        raise ValueError(f"unknown method {method!r}; expected 'grid' or 'bisect'")
    if method == "bisect" and rates is None:
        raise ValueError("method='bisect' searches the capacity: give the request rates to search, rates=[...]")
    if not isinstance(workload, Workload):
        workload = Workload(list(workload))
    configs = grid_configs(grid or DEFAULT_GRID)
    base = {"model": model, "hardware": hardware, "executor": executor, **engine_kwargs}
    kwargs = [{**base, **c} for c in configs]
    for kw in kwargs:                          # a bad grid point fails here, before any run
        EngineConfig.from_kwargs(**kw)
    if rates is None:
        return _sweep_goodput(workload, configs, kwargs, slo, trim, latency_metric, processes, ray_address)
    rates = sorted(float(r) for r in rates)
    if not rates or rates[0] <= 0:
        raise ValueError(f"rates must be positive request rates, got {rates!r}")
    if duration_s is not None:
        workload_at(workload, rates[-1], duration_s)          # enough requests for the top rate, before any run
    args = (workload, rates, slo, trim, latency_metric, target, duration_s)
    if method == "grid":
        return _capacity_grid(configs, kwargs, args, processes, ray_address)
    return _capacity_bisect(configs, kwargs, args, processes, ray_address)


def _sweep_goodput(workload, configs, kwargs, slo, trim, latency_metric, processes, ray_address):
    jobs = [(workload, None, kw, slo, trim, latency_metric) for kw in kwargs]
    out = parallel_map(evaluate, jobs, processes, ray_address)
    trials = [Trial(c, o["goodput"], o["attainment"], o["latency"], runs=1) for c, o in zip(configs, out)]
    best = max(trials, key=lambda t: t.goodput)        # max keeps the first of equals: grid order
    return TuneResult(best.config, best, trials, pareto_front(trials), len(jobs), len(jobs), "goodput", "grid",
                      latency_metric)


def _at_capacity(config, probes: dict, rates, index, target) -> Trial:
    """A trial from a configuration's probes ``{ladder index: metrics}``: its capacity
    (:func:`minibatch.results.capacity` over the rates tried) and the metrics measured there."""
    from minibatch.results import capacity

    cap = capacity({rates[i]: m["attainment"] for i, m in probes.items()}, target=target)
    t = Trial(config, runs=len(probes), capacity=cap, probes={rates[i]: m["attainment"] for i, m in probes.items()})
    at = index if index is not None and index >= 0 else (min(probes) if probes else None)
    if at is not None:
        m = probes[at]
        t.goodput, t.attainment, t.latency, t.rate = m["goodput"], m["attainment"], m["latency"], rates[at]
    return t


def _capacity_grid(configs, kwargs, args, processes, ray_address):
    workload, rates, slo, trim, latency_metric, target, duration_s = args
    jobs = [(workload, r, kw, slo, trim, latency_metric, duration_s) for kw in kwargs for r in rates]
    out = parallel_map(evaluate, jobs, processes, ray_address)
    trials = []
    for i, c in enumerate(configs):
        probes = dict(enumerate(out[i * len(rates):(i + 1) * len(rates)]))
        ok = [j for j in range(len(rates)) if all(probes[k]["attainment"] >= target for k in range(j + 1))]
        trials.append(_at_capacity(c, probes, rates, ok[-1] if ok else -1, target))
    best = max(trials, key=lambda t: t.capacity)
    return TuneResult(best.config, best, trials, pareto_front(trials, "capacity"), len(jobs), len(jobs),
                      "capacity", "grid", latency_metric)


def _capacity_bisect(configs, kwargs, args, processes, ray_address):
    workload, rates, slo, trim, latency_metric, target, duration_s = args
    width = 1 if ray_address is None and processes <= 1 else max(1, processes)
    trials: list[Trial] = []
    best: Trial | None = None
    floor = -1                                  # ladder index of the best capacity so far
    runs = 0
    for start in range(0, len(configs), width):
        chunk = list(range(start, min(start + width, len(configs))))
        jobs = [(workload, rates, kwargs[i], slo, trim, latency_metric, target, floor, duration_s) for i in chunk]
        for i, o in zip(chunk, parallel_map(search_capacity, jobs, processes, ray_address)):
            runs += len(o["probes"])
            if o["index"] is None:
                t = Trial(configs[i], pruned=True, runs=len(o["probes"]),
                          probes={rates[j]: m["attainment"] for j, m in o["probes"].items()})
            else:
                t = _at_capacity(configs[i], o["probes"], rates, o["index"], target)
            trials.append(t)
            if not t.pruned and (best is None or t.capacity > best.capacity):
                best = t
        if best is not None and best.capacity > 0:
            floor = max(floor, rates.index(best.capacity))
    if best is None:                              # every configuration pruned: cannot happen with floor -1
        best = trials[0]
    return TuneResult(best.config, best, trials, pareto_front([t for t in trials if not t.pruned], "capacity"),
                      runs, len(configs) * len(rates), "capacity", "bisect", latency_metric)


from minibatch.tune.seeds import SeededCapacity, capacities, verdict, workload_at  # noqa: E402  (uses parallel_map)
