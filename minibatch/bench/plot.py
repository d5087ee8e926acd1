"""Figures of a ``bench serve`` result: latency CDFs and output throughput over time."""

from __future__ import annotations

import numpy as np


def _cdf(ax, values_s, title: str) -> None:
    ms = np.sort(np.asarray([v for v in values_s if v is not None], dtype=np.float64) * 1000.0)
    if ms.size:
        ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        ax.axvline(np.percentile(ms, 99), color="grey", ls=":", lw=1, label="p99")
        ax.legend(loc="lower right", fontsize=8)
    ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def throughput_over_time(res: dict, bin_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(bin start times, output tokens/s)``; each chunk carries its request's share of tokens."""
    times, weights = [], []
    for chunks, n, err in zip(res["chunk_times"], res["output_lens"], res["errors"]):
        if chunks and not err:
            times.extend(chunks)
            weights.extend([n / len(chunks)] * len(chunks))
    duration = max(res["duration"], 1e-9)
    bin_s = bin_s or max(duration / 40, 0.05)
    edges = np.arange(0.0, duration + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def plot_result(res: dict, path: str) -> None:
    """Save a 2x2 figure: TTFT, TPOT and E2EL CDFs, and output tokens/s over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [not e for e in res["errors"]]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0, 0], [v for v, g in zip(res["ttfts"], ok) if g], "TTFT")
    _cdf(axes[0, 1], [v for v, g in zip(res["tpots"], ok) if g], "TPOT")
    _cdf(axes[1, 0], [v for v, g in zip(res["e2els"], ok) if g], "E2E latency")
    t, tput = throughput_over_time(res)
    ax = axes[1, 1]
    ax.step(t, tput, where="post")
    ax.set(title="Output throughput", xlabel="time since start (s)", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{res.get('model')} @ {res.get('base_url')}: {res['completed']} ok, {res['failed']} failed, "
                 f"rate {res.get('request_rate')}, {res['output_throughput']:.1f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
