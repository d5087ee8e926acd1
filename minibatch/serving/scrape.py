"""Prometheus in miniature: scrape an in-process engine's ``/metrics`` page, then query it as PromQL does.

A server is watched through the page it exposes at ``/metrics``; Prometheus reads that page
every ``scrape_interval`` and dashboards query the stored samples. For drills in the
simulator (chapter 29) the same page is produced without a server: a :class:`Scraper`
subscribes the server's own :class:`~minibatch.serving.metrics.ServingMetrics` to an
``LLMEngine`` (vLLM's metric names, types and buckets) and renders the page every
``interval_s`` of the engine's clock, virtual or real::

    scraper = Scraper(engine, interval_s=1.0)
    result = run(workload, engine=engine, on_step=scraper.on_step)
    scraper.finish()                       # scrape on to the end (an idle engine too)
    t, running = scraper.values("vllm:num_requests_running")
    t, tok_s = rate(scraper, "vllm:generation_tokens_total", window_s=5)
    t, p99 = quantile_over_time(scraper, 0.99, "vllm:time_to_first_token_seconds", window_s=5)

A scrape sees the engine as it is after the step in flight at the scrape time (a step is
atomic: its tokens and events all land at its end), so a sample is at most one step late.
:meth:`Scraper.mark_down` makes later scrapes fail, as a dead target's do: they record
``up = 0`` and no sample (Prometheus' synthetic ``up`` series).

The queries follow PromQL (Prometheus ``promql/functions.go`` and ``promql/quantile.go``):

* ``rate(v[w])`` at ``t``: the counter's increase over the window ending at ``t`` divided by
  the time between the two samples that bound it,
  :math:`\\frac{v(t) - v(t')}{t - t'}` with ``t'`` the first sample at or after ``t - w``
  (Prometheus extrapolates the increase to the window's edges; this does not);
* ``histogram_quantile(q, rate(h_bucket[w]))``: the buckets' increases over the window,
  then :func:`histogram_quantile`: the rank :math:`r = q \\cdot N` (``N`` the ``+Inf``
  bucket's count) falls in the first bucket ``b`` whose cumulative count reaches it, and the
  quantile is interpolated linearly inside that bucket,
  :math:`\\ell_{b-1} + (\\ell_b - \\ell_{b-1}) \\frac{r - c_{b-1}}{c_b - c_{b-1}}`
  (``\\ell`` the upper bounds, ``c`` the cumulative counts, :math:`\\ell_{-1} = 0`); a rank in
  the ``+Inf`` bucket returns the highest finite bound. The answer is only as fine as the
  buckets: vLLM's TTFT buckets jump from 0.5 to 0.75 to 1.0 s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from minibatch.serving.metrics import ServingMetrics, engine_gauges


class Scraper:
    """Every ``interval_s`` of ``engine``'s clock, render and parse its ``/metrics`` page."""

    def __init__(self, engine, interval_s: float = 1.0, model_name: str | None = None, engine_label: str = "0",
                 start_s: float | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.engine = engine
        self.interval_s = float(interval_s)
        name = model_name or str(engine.config.model)
        self.metrics = ServingMetrics(name, engine.max_model_len, engine=engine_label)
        engine.subscribe(self.metrics.on_event)
        self.times: list[float] = []
        self.samples: list[dict[tuple, float]] = []     # one dict per scrape: (name, labels) -> value
        self.up: list[float] = []                       # 1 scraped, 0 target down
        self.page = ""                                  # the last page rendered
        self.down_since: float | None = None
        self._next = engine.clock.now() if start_s is None else float(start_s)

    # -- feeding ----------------------------------------------------------------------
    def on_step(self, engine, step) -> None:
        """``minibatch.run``'s ``on_step(engine, step)``: count the step's tokens, then take
        the scrapes due by the step's end."""
        self.metrics.on_step(step.num_prefill_tokens + step.num_decode_tokens)
        self.scrape_until(step.start_time + step.duration)

    def scrape_until(self, t: float) -> None:
        """Take every scrape due at or before ``t``."""
        while self._next <= t + 1e-9:
            self.scrape(self._next)
            self._next += self.interval_s

    def finish(self, t: float | None = None) -> None:
        """Scrape on until ``t`` (default: the engine's clock), e.g. over an idle tail."""
        self.scrape_until(self.engine.clock.now() if t is None else t)

    def mark_down(self, t: float) -> None:
        """From ``t`` on the target is down: scrapes record ``up = 0`` and no samples."""
        self.down_since = float(t)

    def scrape(self, t: float) -> None:
        self.times.append(float(t))
        if self.down_since is not None and t >= self.down_since:
            self.up.append(0.0)
            self.samples.append({})
            return
        e = self.engine
        self.page = self.metrics.render(engine_gauges(e), len(e.scheduler.running) + len(e.scheduler.waiting))
        self.up.append(1.0)
        self.samples.append(parse_page(self.page))

    # -- reading ----------------------------------------------------------------------
    def values(self, name: str, **labels: str) -> tuple[np.ndarray, np.ndarray]:
        """``(times, values)`` of one series (samples summed over labels not given); NaN where
        a scrape failed or the series was absent. ``name="up"`` gives the ``up`` series."""
        t = np.asarray(self.times, dtype=float)
        if name == "up":
            return t, np.asarray(self.up, dtype=float)
        want = set(labels.items())
        out = np.full(len(self.samples), np.nan)
        for i, sample in enumerate(self.samples):
            vals = [v for (n, lab), v in sample.items() if n == name and want <= set(lab)]
            if vals:
                out[i] = float(sum(vals))
        return t, out

    def buckets(self, histogram: str) -> tuple[np.ndarray, list[float], np.ndarray]:
        """``(times, upper bounds, cumulative counts [scrape, bucket])`` of ``<histogram>_bucket``."""
        name = histogram + "_bucket"
        bounds = sorted({float(dict(lab)["le"]) for s in self.samples for (n, lab) in s if n == name})
        counts = np.full((len(self.samples), len(bounds)), np.nan)
        for i, sample in enumerate(self.samples):
            for (n, lab), v in sample.items():
                if n == name:
                    counts[i, bounds.index(float(dict(lab)["le"]))] = v
        return np.asarray(self.times, dtype=float), bounds, counts


def parse_page(text: str) -> dict[tuple, float]:
    """The samples of a Prometheus exposition page: ``{(name, ((label, value), ...)): value}``,
    read with ``prometheus_client``'s own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _window_start(t: np.ndarray, i: int, window_s: float) -> int:
    """Index of the first scrape at or after ``t[i] - window_s``."""
    return int(np.searchsorted(t, t[i] - window_s - 1e-9, side="left"))


def rate(scraper: Scraper, name: str, window_s: float, **labels: str) -> tuple[np.ndarray, np.ndarray]:
    """PromQL ``rate(name[window_s])`` at every scrape (NaN until two samples bound a window)."""
    t, v = scraper.values(name, **labels)
    out = np.full(len(t), np.nan)
    for i in range(len(t)):
        j = _window_start(t, i, window_s)
        if j < i and not (math.isnan(v[i]) or math.isnan(v[j])):
            out[i] = max(v[i] - v[j], 0.0) / (t[i] - t[j])
    return t, out


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float:
    """Prometheus' ``bucketQuantile`` (``promql/quantile.go``): the ``q`` quantile of a histogram
    given its buckets' upper bounds (the last ``+Inf``) and cumulative counts; NaN with no
    observation."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must lie in [0, 1], got {q!r}")
    bounds = list(bounds)
    counts = np.maximum.accumulate(np.asarray(cumulative, dtype=float))   # ensureMonotonic
    if len(bounds) < 2 or not math.isinf(bounds[-1]) or counts[-1] <= 0:
        return float("nan")
    rank = q * counts[-1]
    b = int(np.searchsorted(counts[:-1], rank, side="left"))   # first bucket with count >= rank
    if b == len(bounds) - 1:
        return float(bounds[-2])
    if b == 0 and bounds[0] <= 0:
        return float(bounds[0])
    start, count = 0.0, counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return float(start + (bounds[b] - start) * (rank / count))


def quantile_over_time(scraper: Scraper, q: float, histogram: str, window_s: float) -> tuple[np.ndarray, np.ndarray]:
    """``histogram_quantile(q, rate(<histogram>_bucket[window_s]))`` at every scrape."""
    t, bounds, counts = scraper.buckets(histogram)
    out = np.full(len(t), np.nan)
    for i in range(len(t)):
        j = _window_start(t, i, window_s)
        if j < i and not (np.isnan(counts[i]).any() or np.isnan(counts[j]).any()):
            out[i] = histogram_quantile(q, bounds, counts[i] - counts[j])
    return t, out


__all__ = ["Scraper", "parse_page", "rate", "histogram_quantile", "quantile_over_time"]
