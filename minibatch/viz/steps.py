"""Step-level figures: batch composition per step, and rolling metrics over time."""

from __future__ import annotations

import numpy as np

from minibatch.viz._common import (COLORS, auto_window, interval_means, mark_reconfigurations, new_figure,
                                   rolling_count_rate, rolling_percentiles)


def _step_arrays(steps):
    start = np.asarray([s.start_time for s in steps], dtype=float)
    dur = np.asarray([s.duration for s in steps], dtype=float)
    pre = np.asarray([s.num_prefill_tokens for s in steps], dtype=float)
    dec = np.asarray([s.num_decode_tokens for s in steps], dtype=float)
    seqs = np.asarray([s.num_seqs for s in steps], dtype=float)
    return start, dur, pre, dec, seqs


def batch_composition(result, max_bars: int = 300, figsize=(8, 4)):
    """Tokens computed per step, prefill stacked on decode, with the batch size on a twin axis.

    One bar per step (at its start time, as wide as the step) when the run has at most
    ``max_bars`` steps; otherwise steps are grouped into ``max_bars`` equal time bins and
    each bar shows the mean tokens per step in its bin.
    """
    fig, axes = new_figure(figsize)
    ax = axes[0, 0]
    ax2 = ax.twinx()
    start, dur, pre, dec, seqs = _step_arrays(result.steps)
    binned = len(start) > max_bars
    if binned:
        edges = np.linspace(start[0], start[-1] + dur[-1], max_bars + 1)
        idx = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, max_bars - 1)
        cnt = np.bincount(idx, minlength=max_bars)
        keep = cnt > 0

        def mean(v):
            return np.bincount(idx, weights=v, minlength=max_bars)[keep] / cnt[keep]
        x, width = edges[:-1][keep], np.diff(edges)[keep]
        pre, dec, seqs = mean(pre), mean(dec), mean(seqs)
    else:
        x, width = start, dur
    ax.bar(x, dec, width=width, align="edge", color=COLORS["decode"], label="decode tokens", linewidth=0)
    ax.bar(x, pre, width=width, bottom=dec, align="edge", color=COLORS["prefill"], label="prefill tokens",
           linewidth=0)
    if len(x):
        ax2.step(np.append(x, x[-1] + width[-1]), np.append(seqs, seqs[-1]), where="post", color="k", lw=1,
                 label="sequences in batch")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("sequences in batch")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens per step" + (" (mean per bin)" if binned else ""))
    ax.set_title(f"Batch composition per step ({len(result.steps)} steps)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    mark_reconfigurations([ax], getattr(result, "reconfigurations", None), ax)
    return fig


def timeline(result, window: float | None = None, points: int = 200, figsize=(8, 6.5)):
    """Rolling metrics over time, with reconfigurations marked.

    Panels: output throughput (tok/s) over a trailing ``window`` (seconds; default
    1/20 of the run); TTFT (by first-token time) and TPOT (by finish time) p50/p99 over
    the same window; queue length, batch size and KV usage (mean per grid interval).
    """
    recs = result.requests
    steps = result.steps
    t0 = min([r.arrival_time for r in recs] or [0.0])
    t1 = max([r.finish_time for r in recs if r.finish_time is not None]
             + [s.start_time + s.duration for s in steps] + [t0 + 1e-3])
    window = window or auto_window(t0, t1)
    grid = np.linspace(t0, t1, points)
    dt = grid[1] - grid[0]
    fig, axes = new_figure(figsize, 3, 1, sharex=True)
    ax_tp, ax_lat, ax_q = axes[:, 0]

    tok = np.sort([t for r in recs for t in r.token_times])
    ax_tp.plot(grid, rolling_count_rate(tok, grid, window), color=COLORS["decode"], label="output tokens/s")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.set_title(f"Throughput and latency over time (window {window:.3g} s)")

    done = [r for r in recs if r.completed]
    ft = sorted((r.first_token_time, r.ttft) for r in done if r.ttft is not None)
    fin = sorted((r.finish_time, r.tpot) for r in done if r.tpot is not None)
    ax_tpot = ax_lat.twinx()
    for ax, data, name, color in ((ax_lat, ft, "TTFT", COLORS["prefill"]), (ax_tpot, fin, "TPOT", COLORS["decode"])):
        if data:
            t, v = map(np.asarray, zip(*data))
            p = rolling_percentiles(t, v * 1e3, grid, window)
        else:
            p = np.full((len(grid), 2), np.nan)
        ax.plot(grid, p[:, 0], color=color, label=f"{name} p50")
        ax.plot(grid, p[:, 1], color=color, ls="--", label=f"{name} p99")
    ax_lat.set_ylabel("TTFT (ms)", color=COLORS["prefill"])
    ax_tpot.set_ylabel("TPOT (ms)", color=COLORS["decode"])
    h1, l1 = ax_lat.get_legend_handles_labels()
    h2, l2 = ax_tpot.get_legend_handles_labels()
    ax_lat.legend(h1 + h2, l1 + l2, fontsize=7, ncols=4, loc="upper left")

    st = np.asarray([s.start_time + s.duration for s in steps], dtype=float)
    for attr, name, color in (("num_waiting", "queue length", COLORS["queued"]),
                              ("num_seqs", "batch size", "k")):
        v = np.asarray([getattr(s, attr) for s in steps], dtype=float)
        ax_q.plot(grid, interval_means(st, v, grid, dt), color=color, label=name)
    ax_q.set_ylabel("requests")
    ax_kv = ax_q.twinx()
    kv = np.asarray([s.kv_usage * 100 for s in steps], dtype=float)
    ax_kv.plot(grid, interval_means(st, kv, grid, dt), color=COLORS["shared"], label="KV usage")
    ax_kv.set_ylabel("KV usage (%)", color=COLORS["shared"])
    ax_kv.set_ylim(0, 105)
    h1, l1 = ax_q.get_legend_handles_labels()
    h2, l2 = ax_kv.get_legend_handles_labels()
    ax_q.legend(h1 + h2, l1 + l2, fontsize=7, ncols=3, loc="upper left")
    ax_q.set_xlabel("time (s)")
    for ax in (ax_tp, ax_lat, ax_q):
        ax.grid(alpha=0.3)
    mark_reconfigurations([ax_tp, ax_lat, ax_q], getattr(result, "reconfigurations", None), ax_tp)
    return fig
