"""Figures that compare runs: latency-throughput curves and metric bars."""

from __future__ import annotations

import math
from numbers import Number
from typing import Mapping

import numpy as np
from matplotlib.patches import Patch

from minibatch.viz._common import LATENCY_METRICS, METRIC_NAMES, as_named, new_figure, offered_rate, result_label

DEFAULT_BAR_METRICS = ("throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")

_UNITS = {"throughput_tok_s": ("Output throughput", "tok/s", 1.0),
          "total_throughput_tok_s": ("Total throughput", "tok/s", 1.0),
          "request_throughput": ("Request throughput", "req/s", 1.0),
          "goodput": ("Goodput", "req/s", 1.0),
          "slo_attainment": ("SLO attainment", "%", 100.0),
          "kv_util_mean": ("KV usage (mean)", "%", 100.0),
          "kv_util_max": ("KV usage (max)", "%", 100.0),
          "prefix_cache_hit_rate": ("Prefix cache hit rate", "%", 100.0),
          "num_preemptions": ("Preemptions", "count", 1.0),
          "mean_batch_size": ("Mean batch size", "sequences", 1.0),
          "completed": ("Completed requests", "count", 1.0),
          "duration_s": ("Duration", "s", 1.0)}


def metric_title(key: str) -> tuple[str, str, float]:
    """``(title, unit, scale)`` of a summary key, e.g. ``ttft_p99`` -> ("TTFT p99", "ms", 1000)."""
    if key in _UNITS:
        return _UNITS[key]
    for m in LATENCY_METRICS:
        if key.startswith(m + "_"):
            return f"{METRIC_NAMES[m]} {key[len(m) + 1:]}", "ms", 1e3
    return key, "", 1.0


def compare_bars(results, metrics=DEFAULT_BAR_METRICS, slo: dict | None = None, figsize=None):
    """One small panel per summary metric, one bar per run (``{name: RunResult}``)."""
    runs = as_named(results)
    metrics = list(metrics)
    summaries = {name: r.summary(slo) for name, r in runs.items()}
    ncols = min(len(metrics), 3 if len(metrics) > 4 else len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = new_figure(figsize or (8, 2.6 * nrows + 0.4), nrows, ncols)
    colors = [f"C{i}" for i in range(len(runs))]
    names = list(runs)
    short = max(map(len, names)) <= 12      # long names go to a legend instead of tick labels
    for ax, key in zip(axes.flat, metrics):
        title, unit, scale = metric_title(key)
        vals = [summaries[n].get(key, float("nan")) * scale for n in names]
        bars = ax.bar(range(len(names)), vals, color=colors)
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in vals], fontsize=7, padding=1)
        if short:
            ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20 if len(names) > 3 else 0)
        else:
            ax.set_xticks([])
        ax.set_title(f"{title} ({unit})" if unit else title, fontsize=9)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    if not short:
        fig.legend(handles=[Patch(color=c, label=n) for c, n in zip(colors, names)], loc="outside lower center",
                   ncols=min(len(names), 2), fontsize=8, frameon=False)
    fig.suptitle("Run comparison" + (f" (SLO {slo})" if slo else ""), fontsize=10)
    return fig


def _curves(results_by_rate) -> dict[str, list[tuple[float, object]]]:
    """Normalise to ``{policy: [(rate, RunResult), ...]}`` sorted by rate."""
    if isinstance(results_by_rate, Mapping):
        items = list(results_by_rate.items())
        if items and all(isinstance(k, Number) for k, _ in items):            # {rate: result}
            return {result_label(items[0][1]): sorted(((float(k), v) for k, v in items), key=lambda p: p[0])}
        out = {}
        for name, val in items:
            if isinstance(val, Mapping):                                      # {policy: {rate: result}}
                out[str(name)] = sorted(((float(k), v) for k, v in val.items()), key=lambda p: p[0])
            else:                                                             # {policy: [results]}
                out[str(name)] = sorted(((offered_rate(r), r) for r in val), key=lambda p: p[0])
        return out
    out: dict = {}
    for r in results_by_rate:                                                 # [results]: group by policy
        out.setdefault(result_label(r), []).append((offered_rate(r), r))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def latency_throughput(results_by_rate, metrics=("ttft", "tpot"), stat: str = "p50", x: str = "throughput",
                       slo: dict | None = None, figsize=None):
    """Latency against throughput (or offered request rate), one curve per policy.

    ``results_by_rate``: ``{policy: {rate: RunResult}}``, ``{rate: RunResult}``,
    ``{policy: [RunResult, ...]}`` or a list of results (grouped by their policy).
    ``stat``: ``mean``, ``p50``, ``p90`` or ``p99``; ``x``: ``"throughput"`` (output
    tok/s achieved) or ``"rate"`` (offered req/s). ``slo`` draws its bounds.
    """
    if isinstance(metrics, str):
        metrics = [metrics]
    curves = _curves(results_by_rate)
    fig, axes = new_figure(figsize or (4 * len(metrics), 3.6), 1, len(metrics))
    for ax, metric in zip(axes[0], metrics):
        for i, (name, pts) in enumerate(curves.items()):
            sums = [(rate, r.summary()) for rate, r in pts]
            xs = [s["throughput_tok_s"] if x == "throughput" else rate for rate, s in sums]
            ys = [s[f"{metric}_{stat}"] * 1e3 for _, s in sums]
            ax.plot(xs, ys, marker="o", ms=4, color=f"C{i}", label=name)
        if slo and metric in slo:
            ax.axhline(slo[metric] * 1e3, color="r", ls=":", lw=1, label=f"SLO {slo[metric] * 1e3:.4g} ms")
        ax.set_xlabel("output throughput (tok/s)" if x == "throughput" else "request rate (req/s)")
        ax.set_ylabel(f"{METRIC_NAMES.get(metric, metric)} {stat} (ms)")
        ax.set_title(f"{METRIC_NAMES.get(metric, metric)} {stat} vs {'throughput' if x == 'throughput' else 'load'}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def summary_table(results, metrics=DEFAULT_BAR_METRICS, slo: dict | None = None) -> list[list]:
    """Rows ``[metric, value per run..., change of the last vs the first (%)]``, in display units."""
    runs = as_named(results)
    sums = [r.summary(slo) for r in runs.values()]
    rows = [["metric", *runs, "change"]]
    for key in metrics:
        title, unit, scale = metric_title(key)
        vals = [s.get(key, float("nan")) * scale for s in sums]
        a, b = vals[0], vals[-1]
        change = (b - a) / a * 100 if a and np.isfinite(a) and np.isfinite(b) else float("nan")
        rows.append([f"{title} ({unit})" if unit else title, *vals, change])
    return rows
