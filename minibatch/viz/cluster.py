"""Figures of a cluster run (:func:`minibatch.cluster.run`): load per replica, routing
decisions, the replica count against the arrival rate, and goodput against the rate."""

from __future__ import annotations

import numpy as np

from minibatch.viz._common import auto_window, new_figure, rolling_count_rate

LOAD_METRICS = {"num_running": "running requests", "num_waiting": "waiting requests",
                "kv_usage": "KV cache usage", "num_seqs": "batch size"}


def replica_load(result, metric: str = "num_running", figsize=(8, 3.2)):
    """``metric`` of every replica's steps over time, one line per replica (a step plot: the
    value holds from a step's start to the next step's).

    ``metric``: ``num_running``, ``num_waiting``, ``kv_usage`` or ``num_seqs`` (``StepRecord``)."""
    if metric not in LOAD_METRICS:
        raise ValueError(f"metric must be one of {sorted(LOAD_METRICS)}, got {metric!r}")
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    for i, rep in enumerate(result.replicas):
        if not rep.steps:
            continue
        t = np.array([s.start_time for s in rep.steps])
        v = np.array([getattr(s, metric) for s in rep.steps], dtype=float)
        ax.step(t, v, where="post", lw=1, label=f"replica {i} ({result.models[i]})")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(LOAD_METRICS[metric])
    ax.set_title(f"{LOAD_METRICS[metric]} per replica, router {result.router}", fontsize=10)
    if len(result.replicas) <= 10:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return fig


def routing(result, figsize=(8, 3.2)):
    """Each request's arrival time against the replica it was routed to (coloured by tenant
    where requests carry one), and the number of requests each replica got."""
    fig, axes = new_figure(figsize, ncols=2, gridspec_kw={"width_ratios": [3, 1]})
    ax, bars = axes[0, 0], axes[0, 1]
    recs = [r for r in result.requests if r.replica is not None]
    tenants = sorted({r.tenant for r in recs if r.tenant is not None}, key=str)
    colour = {t: k for k, t in enumerate(tenants)}
    c = [colour.get(r.tenant, -1) for r in recs]
    ax.scatter([r.arrival_time for r in recs], [r.replica for r in recs], c=c, s=6, cmap="tab20" if tenants else None)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("replica")
    ax.set_yticks(range(len(result.replicas)))
    ax.set_title(f"routing decisions ({result.router}" + (f", {len(tenants)} tenants)" if tenants else ")"),
                 fontsize=10)
    counts = np.bincount([r.replica for r in recs], minlength=len(result.replicas))
    bars.barh(range(len(counts)), counts, color="0.5")
    bars.set_yticks(range(len(counts)))
    bars.set_xlabel("requests")
    return fig


def replica_count(result, window: float | None = None, figsize=(8, 3.2)):
    """Replicas provisioned over time (each replica from its start, cold start included, to
    its removal; a run without an autoscaler keeps all of them) against the arrival rate
    (requests per second over a rolling ``window``), on a twin axis."""
    arrivals = np.sort([r.arrival_time for r in result.requests])
    if not len(arrivals):
        raise ValueError("the run has no requests")
    ends = [s.start_time + s.duration for s in result.steps]
    t0, t1 = float(arrivals[0]), float(max([arrivals[-1], *ends]))
    lifetimes = result.extra.get("lifetimes") or [(t0, None)] * len(result.replicas)
    window = window or auto_window(t0, t1)
    grid = np.linspace(t0, t1, 400)
    provisioned = [sum(1 for a, b in lifetimes if a <= t and (b is None or t < b)) for t in grid]
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    ax.plot(grid, rolling_count_rate(arrivals, grid, window), color="0.55", lw=1,
            label=f"arrival rate ({window:g} s window)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests / s")
    twin = ax.twinx()
    twin.step(grid, provisioned, where="post", color="C3", lw=1.5, label="replicas")
    twin.set_ylabel("replicas")
    twin.set_ylim(0, max(provisioned) + 1)
    ax.set_title("replicas against the arrival rate", fontsize=10)
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper left")
    return fig


def goodput_curve(curves: dict[str, dict[float, float]], per: str = "GPU", figsize=(6, 3.2)):
    """Goodput against the offered rate, one line per setup (e.g. colocated vs
    disaggregated): ``curves[name] = {rate: goodput}``."""
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    for name, pts in curves.items():
        rates = sorted(pts)
        ax.plot(rates, [pts[r] for r in rates], marker="o", ms=3, label=name)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel(f"goodput (req/s per {per})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig
