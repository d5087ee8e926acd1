"""A Grafana-style dashboard of scraped ``/metrics`` series (``minibatch.serving.scrape.Scraper``).

Six panels, each a PromQL query over vLLM's metric names, one line per scraped target:

===============================  ===========================================================
requests running / waiting       ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
KV cache usage                   ``vllm:kv_cache_usage_perc`` (x 100)
preemptions per second           ``rate(vllm:num_preemptions_total[w])``
TTFT p50 / p99                   ``histogram_quantile(q, rate(vllm:time_to_first_token_seconds_bucket[w]))``
inter-token latency p99          the same over ``vllm:time_per_output_token_seconds`` (every gap)
generation tokens per second     ``rate(vllm:generation_tokens_total[w])``
===============================  ===========================================================

Scrapes of a target that was down (``up == 0``) are shaded.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from minibatch.viz._common import new_figure

PANELS = ("requests", "kv", "preemptions", "ttft", "itl", "throughput")


def metrics_dashboard(scrapers, window_s: float = 5.0, title: str | None = None, figsize=(11, 5.6)):
    """The six panels for ``scrapers`` (a ``Scraper``, a list, or ``{label: Scraper}``)."""
    from minibatch.serving.scrape import quantile_over_time, rate

    if not isinstance(scrapers, (list, tuple, Mapping)):
        scrapers = [scrapers]
    if not isinstance(scrapers, Mapping):
        scrapers = {(f"replica {i}" if len(scrapers) > 1 else "engine"): s for i, s in enumerate(scrapers)}
    fig, axes = new_figure(figsize, 2, 3, sharex=True)
    ax_req, ax_kv, ax_pre, ax_ttft, ax_itl, ax_tok = axes.flat
    for k, (label, sc) in enumerate(scrapers.items()):
        c = f"C{k}"
        t, run_ = sc.values("vllm:num_requests_running")
        _, wait = sc.values("vllm:num_requests_waiting")
        ax_req.plot(t, run_, color=c, lw=1.2, label=f"{label} running")
        ax_req.plot(t, wait, color=c, lw=1.2, ls="--", label=f"{label} waiting")
        _, kv = sc.values("vllm:kv_cache_usage_perc")
        ax_kv.plot(t, kv * 100, color=c, lw=1.2, label=label)
        ax_pre.plot(*rate(sc, "vllm:num_preemptions_total", window_s), color=c, lw=1.2, label=label)
        for q, ls in ((0.5, "-"), (0.99, "--")):
            tq, v = quantile_over_time(sc, q, "vllm:time_to_first_token_seconds", window_s)
            ax_ttft.plot(tq, v, color=c, lw=1.2, ls=ls, label=f"{label} p{round(q * 100)}")
        tq, v = quantile_over_time(sc, 0.99, "vllm:time_per_output_token_seconds", window_s)
        ax_itl.plot(tq, v * 1e3, color=c, lw=1.2, label=f"{label} p99")
        ax_tok.plot(*rate(sc, "vllm:generation_tokens_total", window_s), color=c, lw=1.2, label=label)
        tu, up = sc.values("up")
        for ax in axes.flat:
            for i in np.flatnonzero(up == 0):
                ax.axvspan(tu[i] - sc.interval_s / 2, tu[i] + sc.interval_s / 2, color="0.85", lw=0, zorder=0)
    for ax, name in zip(axes.flat, ["requests (solid running, dashed waiting)", "KV cache usage (%)",
                                    f"preemptions / s (rate {window_s:g} s)", "TTFT (s), p50 solid, p99 dashed",
                                    "inter-token latency p99 (ms)", f"generation tokens / s (rate {window_s:g} s)"]):
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    ax_kv.set_ylim(0, 105)
    ax_ttft.set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("time (s)")
    if len(scrapers) > 1:
        ax_kv.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


__all__ = ["metrics_dashboard", "PANELS"]
