"""Summary statistics of a workload: how requests arrive and how long they are.

The definitions follow datasets/traces/SOURCES.md so that our numbers and the
published ones can be compared directly:

- ``duration``: last arrival minus first arrival (seconds);
- ``rate``: mean arrival rate, ``(n - 1) / duration`` = 1 / mean inter-arrival gap
  (the rate a gamma/Poisson process with that mean gap is generated at);
- ``cv``: coefficient of variation (std/mean, population std) of the gaps between
  sorted arrivals; 1 for Poisson, > 1 for bursty traffic;
- ``iod_1s``: index of dispersion, variance/mean of the number of arrivals in each
  1-second bin (bins start at the first arrival; empty bins count); 1 for Poisson;
- ``peak_1s``: most arrivals in one such bin;
- lengths: mean, p50, p90, p99 (``np.percentile``, linear interpolation) and max.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

__all__ = ["arrival_stats", "length_stats", "workload_stats", "format_stats_table"]


def arrival_stats(times: Sequence[float] | np.ndarray) -> dict:
    t = np.sort(np.asarray(times, dtype=np.float64))
    n = int(t.size)
    out = {"n": n, "duration": 0.0, "rate": math.nan, "cv": math.nan,
           "iod_1s": math.nan, "peak_1s": n}
    if n == 0:
        out["peak_1s"] = 0
        return out
    t = t - t[0]
    duration = float(t[-1])
    out["duration"] = duration
    if n >= 2:
        gaps = np.diff(t)
        mean_gap = float(gaps.mean())
        out["rate"] = (n - 1) / duration if duration > 0 else math.inf
        out["cv"] = float(gaps.std() / mean_gap) if mean_gap > 0 else math.nan
    counts = np.bincount(np.floor(t).astype(np.int64))
    out["iod_1s"] = float(counts.var() / counts.mean())
    out["peak_1s"] = int(counts.max())
    return out


def length_stats(lengths: Sequence[int] | np.ndarray, prefix: str) -> dict:
    x = np.asarray(lengths, dtype=np.float64)
    if x.size == 0:
        return {f"{prefix}_{k}": math.nan for k in ("mean", "p50", "p90", "p99", "max")}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {f"{prefix}_mean": float(x.mean()), f"{prefix}_p50": float(p50),
            f"{prefix}_p90": float(p90), f"{prefix}_p99": float(p99),
            f"{prefix}_max": float(x.max())}


def workload_stats(times, input_lens, output_lens) -> dict:
    """All of the above in one flat dict (the same keys as ``Workload.stats()``)."""
    return {**arrival_stats(times), **length_stats(input_lens, "input"),
            **length_stats(output_lens, "output")}


_COLUMNS = [  # (header, key, format)
    ("n", "n", "{:,.0f}"), ("duration s", "duration", "{:,.1f}"), ("rate/s", "rate", "{:.2f}"),
    ("CV", "cv", "{:.2f}"), ("IoD 1s", "iod_1s", "{:.2f}"), ("peak 1s", "peak_1s", "{:.0f}"),
    ("in mean", "input_mean", "{:,.1f}"), ("in p50", "input_p50", "{:,.0f}"),
    ("in p90", "input_p90", "{:,.1f}"), ("in p99", "input_p99", "{:,.1f}"),
    ("in max", "input_max", "{:,.0f}"), ("out mean", "output_mean", "{:,.1f}"),
    ("out p50", "output_p50", "{:,.0f}"), ("out p90", "output_p90", "{:,.1f}"),
    ("out p99", "output_p99", "{:,.1f}"), ("out max", "output_max", "{:,.0f}"),
]


def format_stats_table(rows: Mapping[str, Mapping]) -> str:
    """A Markdown table: one row per named stats dict (as returned by ``stats()``)."""
    def cell(fmt, v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
    head = "| workload | " + " | ".join(h for h, _, _ in _COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(_COLUMNS)
    body = ["| " + name + " | " + " | ".join(cell(f, s.get(k)) for _, k, f in _COLUMNS) + " |"
            for name, s in rows.items()]
    return "\n".join([head, rule, *body])
