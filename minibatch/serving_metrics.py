"""Server metrics in the Prometheus text format, named like vLLM's (``vllm:`` -> ``minibatch:``).

Written by hand (no ``prometheus_client`` dependency): the format is a few lines per
metric, ``# HELP``, ``# TYPE`` and ``name{labels} value``. A histogram is cumulative:
``name_bucket{le="b"}`` counts observations <= b, plus ``name_sum`` and ``name_count``.

Counters and histograms are fed by the engine's events (on the engine thread); gauges
come from a snapshot the engine thread publishes after every loop turn.
"""

from __future__ import annotations

import bisect
import threading

from minibatch.request import Request, RequestMetrics

# Bucket bounds in seconds, as vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "rejected")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(list(self.buckets) + ["+Inf"], self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServingMetrics:
    """Counters and histograms of one served model; ``render(gauges)`` gives the page."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {r: 0 for r in FINISH_REASONS}
        self.http_rejected = {"overload": 0, "invalid": 0, "unauthorized": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_event(self, event: str, time: float, req: Request, info: dict) -> None:
        """An ``LLMEngine.subscribe`` listener (runs on the engine thread)."""
        with self._lock:
            if event == "schedule":
                self.prompt_tokens += req.num_prompt_tokens
            elif event == "token":
                self.generation_tokens += 1
            elif event in ("finish", "abort", "reject"):
                self.finished[req.status.value] = self.finished.get(req.status.value, 0) + 1
                m = RequestMetrics.of(req)
                if m.ttft is not None:
                    self.ttft.observe(m.ttft)
                if m.tpot is not None:
                    self.tpot.observe(m.tpot)
                if m.e2e is not None and event != "reject":
                    self.e2e.observe(m.e2e)

    def count_http_rejection(self, reason: str) -> None:
        with self._lock:
            self.http_rejected[reason] = self.http_rejected.get(reason, 0) + 1

    def render(self, gauges: dict, num_in_flight: int) -> str:
        L = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP minibatch:{name} {help_}", f"# TYPE minibatch:{name} {kind}"])
            lines.extend(f"minibatch:{s}" for s in samples)

        with self._lock:
            metric("num_requests_running", "gauge", "Requests in the running batch.",
                   [f"num_requests_running{{{L}}} {gauges['running']}"])
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                   [f"num_requests_waiting{{{L}}} {gauges['waiting']}"])
            metric("num_requests_in_flight", "gauge", "HTTP requests admitted and not yet finished.",
                   [f"num_requests_in_flight{{{L}}} {num_in_flight}"])
            metric("kv_cache_usage_perc", "gauge", "KV cache usage, 0 to 1 (1 = every block used).",
                   [f"kv_cache_usage_perc{{{L}}} {gauges['kv_usage']!r}"])
            metric("kv_cache_used_blocks", "gauge", "KV cache blocks in use.",
                   [f"kv_cache_used_blocks{{{L}}} {gauges['kv_used_blocks']}"])
            metric("kv_cache_total_blocks", "gauge", "KV cache blocks in the pool.",
                   [f"kv_cache_total_blocks{{{L}}} {gauges['kv_total_blocks']}"])
            metric("num_preemptions_total", "counter", "Cumulative number of preemptions.",
                   [f"num_preemptions_total{{{L}}} {gauges['preemptions']}"])
            metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.",
                   [f"prompt_tokens_total{{{L}}} {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Generated tokens.",
                   [f"generation_tokens_total{{{L}}} {self.generation_tokens}"])
            metric("request_success_total", "counter", "Finished requests, by finish reason.",
                   [f'request_success_total{{{L},finished_reason="{r}"}} {n}' for r, n in self.finished.items()])
            metric("request_rejected_total", "counter", "HTTP requests refused before the engine, by reason.",
                   [f'request_rejected_total{{{L},reason="{r}"}} {n}' for r, n in self.http_rejected.items()])
            metric("time_to_first_token_seconds", "histogram", "Time to first token (TTFT).",
                   self.ttft.lines("time_to_first_token_seconds", L))
            metric("time_per_output_token_seconds", "histogram",
                   "Time per output token after the first (TPOT).",
                   self.tpot.lines("time_per_output_token_seconds", L))
            metric("e2e_request_latency_seconds", "histogram", "End-to-end request latency.",
                   self.e2e.lines("e2e_request_latency_seconds", L))
        return "\n".join(lines) + "\n"
