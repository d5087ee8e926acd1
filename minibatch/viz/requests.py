"""Per-request figures: the Gantt chart of request phases and latency CDFs."""

from __future__ import annotations

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch

from minibatch.viz._common import (COLORS, METRIC_NAMES, as_named, mark_reconfigurations, metric_values,
                                   new_figure)


def preemption_spans(rec, events=None) -> tuple[list[tuple[float, float]], bool]:
    """Spans ``(start, end)`` during which ``rec`` was preempted, and whether they are exact.

    With an event log (``(time, "preempt", request_id)`` entries), a span runs from each
    preemption to the request's next token (re-queueing plus recompute) or its finish.
    Without one, the ``num_preemptions`` longest gaps between tokens are taken (inferred).
    """
    end = rec.finish_time if rec.finish_time is not None else (rec.token_times[-1] if rec.token_times else None)
    tt = np.asarray(rec.token_times, dtype=float)
    if events is not None:
        spans = []
        for t in sorted(t for t, ev, rid in events if ev == "preempt" and rid == rec.request_id):
            i = np.searchsorted(tt, t, side="right")
            stop = tt[i] if i < tt.size else end
            if stop is not None and stop > t:
                spans.append((t, float(stop)))
        return spans, True
    if not rec.num_preemptions or tt.size < 2:
        return [], False
    gaps = np.diff(tt)
    typical = float(np.median(gaps))
    idx = np.argsort(gaps)[::-1][:rec.num_preemptions]
    return [(float(tt[i]), float(tt[i + 1])) for i in sorted(idx) if gaps[i] > 2 * typical], False


def gantt(result, max_requests: int = 40, events=None, figsize=(8, 4.5)):
    """Request timeline: queued, prefill, decode and preempted spans per request.

    Rows are the first ``max_requests`` requests in arrival order (top to bottom).
    Queued = arrival to first schedule; prefill = first schedule to first token;
    decode = first token to finish. Preempted spans come from ``events`` or
    ``result.extra["events"]`` (see :func:`preemption_spans`), else they are inferred.
    Rejected or aborted requests are marked with an ``x`` at their end.
    """
    if events is None:
        events = (getattr(result, "extra", None) or {}).get("events")
    recs = sorted(result.requests, key=lambda r: r.arrival_time)[:max_requests]
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    spans: dict[str, list] = {"queued": [], "prefill": [], "decode": [], "preempted": []}
    failed = []
    exact = True
    for y, r in enumerate(recs):
        end = r.finish_time if r.finish_time is not None else (r.token_times[-1] if r.token_times else r.arrival_time)
        sched = r.first_scheduled_time
        first = r.first_token_time
        spans["queued"].append((y, r.arrival_time, (sched if sched is not None else end)))
        if sched is not None:
            spans["prefill"].append((y, sched, first if first is not None else end))
        if first is not None:
            spans["decode"].append((y, first, end))
        pre, ok = preemption_spans(r, events)
        exact &= ok or not pre
        spans["preempted"] += [(y, a, b) for a, b in pre]
        if r.finish_reason in ("abort", "rejected"):
            failed.append((end, y))
    height = 0.7
    for z, kind in enumerate(("queued", "prefill", "decode", "preempted")):
        bars = [(a, max(b - a, 0.0)) for _, a, b in spans[kind]]
        ys = [y for y, _, _ in spans[kind]]
        # One collection (of rectangles) per phase.
        verts = [[(a, y - height / 2), (a, y + height / 2), (a + w, y + height / 2), (a + w, y - height / 2)]
                 for y, (a, w) in zip(ys, bars)]
        coll = PolyCollection(verts, facecolors=COLORS[kind], edgecolors="none", zorder=2 + z,
                              alpha=0.85 if kind == "preempted" else 1.0, label=kind)
        ax.add_collection(coll)
    if failed:
        ax.scatter([t for t, _ in failed], [y for _, y in failed], marker="x", color="k", zorder=10,
                   label="rejected / aborted")
    ax.autoscale_view()
    ax.set_ylim(len(recs) - 0.5, -0.5)
    if len(recs) <= 25:
        ax.set_yticks(range(len(recs)), [r.request_id for r in recs], fontsize=6)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request (arrival order)")
    n_all = len(result.requests)
    shown = f"first {len(recs)} of {n_all} requests" if n_all > len(recs) else f"{n_all} requests"
    ax.set_title(f"Request timeline ({shown})")
    mark_reconfigurations([ax], getattr(result, "reconfigurations", None), ax)
    pre_label = "preempted" if exact else "preempted (inferred)"
    handles = [Patch(color=COLORS["queued"], label="queued"), Patch(color=COLORS["prefill"], label="prefill"),
               Patch(color=COLORS["decode"], label="decode"), Patch(color=COLORS["preempted"], label=pre_label)]
    fig.legend(handles=handles, loc="outside lower center", fontsize=7, ncols=4, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


def latency_cdf(results, metric: str = "ttft", log: bool = False, figsize=(8, 4)):
    """Empirical CDF of a latency metric (ms), one line per run.

    ``results``: a ``RunResult``, a list of them, or ``{name: RunResult}``.
    ``metric``: ``"ttft"``, ``"tpot"``, ``"e2e"``, ``"itl"`` or ``"queue_delay"``.
    """
    runs = as_named(results)
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    for name, r in runs.items():
        v = np.sort(metric_values(r, metric)) * 1e3
        if v.size == 0:
            ax.plot([], [], label=f"{name} (no data)")
            continue
        y = np.arange(1, v.size + 1) / v.size
        p50, p99 = np.percentile(v, [50, 99])
        ax.step(v, y, where="post", label=f"{name}: p50 {p50:.4g} ms, p99 {p99:.4g} ms")
    for q in (0.5, 0.99):
        ax.axhline(q, color="0.6", lw=0.8, ls=":")
    if log:
        ax.set_xscale("log")
    label = METRIC_NAMES.get(metric, metric)
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{label} distribution (CDF)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return fig
