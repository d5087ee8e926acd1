"""Shared helpers for the figures: figure creation, result naming, units, rolling windows."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

# One colour per phase, used by every figure and the live dashboard.
COLORS = {
    "queued": "#bdbdbd",
    "prefill": "#f28e2b",
    "decode": "#4e79a7",
    "preempted": "#e15759",
    "free": "#f4f4f4",
    "cached": "#a0cbe8",
    "wasted": "#ff9d9a",
    "shared": "#59a14f",
    "mark": "#7b3294",
}

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue_delay")
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency",
                "queue_delay": "queue delay"}


def new_figure(figsize=(8, 4), nrows: int = 1, ncols: int = 1, **subplot_kw):
    """A figure that needs no pyplot (safe in threads and under Agg) and its axes."""
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, axes


def result_label(result, default: str = "run") -> str:
    cfg = getattr(result, "config", None) or {}
    return str(cfg.get("policy", default))


def as_named(results) -> dict:
    """``RunResult`` / list / dict -> ``{name: RunResult}`` (duplicate names get a suffix)."""
    if isinstance(results, Mapping):
        return {str(k): v for k, v in results.items()}
    if hasattr(results, "requests") and hasattr(results, "steps"):
        results = [results]
    out: dict = {}
    for i, r in enumerate(results):
        name = result_label(r, f"run {i}")
        if name in out:
            name = f"{name} #{i}"
        out[name] = r
    return out


def metric_values(result, metric: str) -> np.ndarray:
    """Per-request values (seconds) of a latency metric over completed requests (ITL: every gap)."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {LATENCY_METRICS}")
    done = [r for r in result.requests if r.completed]
    if metric == "itl":
        vals = [g for r in done for g in r.itl]
    else:
        vals = [getattr(r, metric) for r in done]
    return np.asarray([v for v in vals if v is not None], dtype=float)


def offered_rate(result) -> float:
    """The request rate a run was offered: (n - 1) / arrival span."""
    t = np.sort([r.arrival_time for r in result.requests])
    if t.size < 2 or t[-1] <= t[0]:
        return float("inf")
    return (t.size - 1) / (t[-1] - t[0])


def group_marks(reconfigurations, tol: float = 1e-9) -> list[tuple[float, str]]:
    """``[(time, "name=value, ...")]``: changes applied at the same time share one label."""
    out: list[tuple[float, str]] = []
    for t, name, value in sorted(reconfigurations or (), key=lambda m: m[0]):
        if out and abs(t - out[-1][0]) <= tol:
            out[-1] = (out[-1][0], f"{out[-1][1]}, {name}={value}")
        else:
            out.append((t, f"{name}={value}"))
    return out


def mark_reconfigurations(axes: Sequence, reconfigurations, label_axis=None) -> list:
    """Dashed vertical lines at each ``(time, name, value)``; labels on ``label_axis``."""
    artists = []
    for t, label in group_marks(reconfigurations):
        for ax in axes:
            artists.append(ax.axvline(t, color=COLORS["mark"], ls="--", lw=1, alpha=0.8))
        if label_axis is not None:
            artists.append(label_axis.text(t, 1.0, f" {label}", transform=label_axis.get_xaxis_transform(),
                                           rotation=90, va="top", ha="left", fontsize=7, color=COLORS["mark"]))
    return artists


# -- rolling windows (shared with the live dashboard) ---------------------------------------
def rolling_count_rate(times: np.ndarray, grid: np.ndarray, window: float) -> np.ndarray:
    """Events per second in ``(t - window, t]`` for each ``t`` of ``grid``; ``times`` sorted."""
    hi = np.searchsorted(times, grid, side="right")
    lo = np.searchsorted(times, grid - window, side="right")
    return (hi - lo) / window


def rolling_cum_rate(times: np.ndarray, cum: np.ndarray, grid: np.ndarray, window: float) -> np.ndarray:
    """Rate of a cumulative counter ``cum`` (sampled at sorted ``times``) over ``(t - window, t]``."""
    def at(t):
        i = np.searchsorted(times, t, side="right") - 1
        return np.where(i >= 0, cum[np.clip(i, 0, None)] if cum.size else 0, 0)
    if times.size == 0:
        return np.zeros_like(grid, dtype=float)
    return (at(grid) - at(grid - window)) / window


def rolling_percentiles(times: np.ndarray, values: np.ndarray, grid: np.ndarray, window: float,
                        qs=(50, 99)) -> np.ndarray:
    """Percentiles ``qs`` of ``values`` whose (sorted) ``times`` fall in ``(t - window, t]``.

    Returns an array ``[len(grid), len(qs)]``; NaN where the window is empty.
    """
    out = np.full((len(grid), len(qs)), np.nan)
    hi = np.searchsorted(times, grid, side="right")
    lo = np.searchsorted(times, grid - window, side="right")
    for i, (a, b) in enumerate(zip(lo, hi)):
        if b > a:
            out[i] = np.percentile(values[a:b], qs)
    return out


def interval_means(times: np.ndarray, values: np.ndarray, grid: np.ndarray, dt: float) -> np.ndarray:
    """Mean of ``values`` sampled at sorted ``times`` within ``(t - dt, t]``; else the last value before."""
    if times.size == 0:
        return np.full(len(grid), np.nan)
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=float)])
    hi = np.searchsorted(times, grid, side="right")
    lo = np.searchsorted(times, grid - dt, side="right")
    n = hi - lo
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (csum[hi] - csum[lo]) / n
    last = np.where(hi > 0, values[np.clip(hi - 1, 0, None)], np.nan)
    return np.where(n > 0, mean, last)


def auto_window(t0: float, t1: float) -> float:
    """A rolling window about 1/20 of the span (at least a millisecond)."""
    return max((t1 - t0) / 20.0, 1e-3)
