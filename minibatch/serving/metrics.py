"""The server's ``/metrics`` page, produced with ``prometheus_client`` under vLLM's metric names.

Where vLLM has a metric, minibatch exposes it under the same name, type, labels
(``model_name``, ``engine``) and histogram buckets, so Grafana dashboards, routers and
autoscalers written for vLLM read a minibatch server as they read vLLM. The names follow
vLLM's V1 engine, ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``, the 0.10
series, in which ``vllm:gpu_cache_usage_perc`` is the deprecated alias of
``vllm:kv_cache_usage_perc``):

=====================================  =========  =============================================
``vllm:num_requests_running``          gauge      requests in the running batch
``vllm:num_requests_waiting``          gauge      requests waiting (or preempted)
``vllm:kv_cache_usage_perc``           gauge      used KV blocks / all blocks, 0 to 1
``vllm:gpu_cache_usage_perc``          gauge      the same (vLLM's older name)
``vllm:num_preemptions_total``         counter    preemptions (recompute and swap)
``vllm:prompt_tokens_total``           counter    prompt tokens of requests that produced a first token
``vllm:generation_tokens_total``       counter    generated tokens
``vllm:prefix_cache_queries_total``    counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits_total``       counter    of those, tokens served from it
``vllm:request_success_total``         counter    finished requests, by ``finished_reason``
``vllm:time_to_first_token_seconds``   histogram  TTFT per request
``vllm:time_per_output_token_seconds`` histogram  every gap between two output tokens (as vLLM)
``vllm:inter_token_latency_seconds``   histogram  the same (vLLM's newer name, v0.10.2 on)
``vllm:e2e_request_latency_seconds``   histogram  end-to-end latency per request
``vllm:request_queue_time_seconds``    histogram  arrival to first scheduling per request
``vllm:request_prompt_tokens``         histogram  prompt length per request
``vllm:request_generation_tokens``     histogram  output length per request
``vllm:iteration_tokens_total``        histogram  tokens computed per engine step
=====================================  =========  =============================================

minibatch's own, under ``minibatch:``: ``num_requests_in_flight`` (HTTP requests admitted and
not finished), ``kv_cache_used_blocks``, ``kv_cache_total_blocks``, ``recomputed_tokens_total`` (tokens computed again after a recompute
preemption threw their KV away: the engine's wasted compute, vllm#54644's "recompute tax"; the
run summary's ``num_recomputed_tokens``) and
``request_rejected_total`` (refused before the engine, by ``reason``: overload, invalid,
unauthorized, too_large (413), timeout (408), host (a Host header not allowed), media_type
(415), disconnected (the client left while sending its body)).

With a KV offload host tier (``kv_offloading_size`` / ``kv_offload_blocks``) the host tier's prefix
hits count as vLLM counts a KV connector's: ``vllm:external_prefix_cache_queries_total`` (tokens the
device cache missed) and ``vllm:external_prefix_cache_hits_total`` (of those, loaded from the host),
while ``vllm:prefix_cache_hits_total`` keeps the device's own; minibatch adds
``kv_offload_stored_blocks_total``, ``kv_offload_loaded_blocks_total``, ``kv_offload_dropped_blocks_total``
and ``kv_offload_copy_seconds_total{direction="store"|"load"}``.

With speculative decoding on (``speculative_method="ngram"``), vLLM's counters of it
(``vllm/v1/spec_decode/metrics.py``, v0.11.0): ``vllm:spec_decode_num_drafts_total`` (sequence-steps
that carried drafts), ``vllm:spec_decode_num_draft_tokens_total`` and
``vllm:spec_decode_num_accepted_tokens_total``; the acceptance rate is accepted / draft tokens.

Counters and histograms are fed by the engine's events (on the engine thread);
gauges and the engine's cumulative counters come from the snapshot the engine thread
publishes after every loop turn.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Bucket bounds in seconds, vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "rejected")
REJECTION_REASONS = ("overload", "invalid", "unauthorized", "too_large", "timeout", "host", "media_type",
                     "disconnected", "connections")
LABELS = ("model_name", "engine")


def engine_gauges(engine) -> dict:
    """What ``/metrics`` reads from an ``LLMEngine`` at a scrape: its gauges and cumulative counters.

    The server's engine thread publishes this after every loop turn; an in-process drill
    (``minibatch.serving.scrape``) reads it at each scrape of the engine's clock."""
    kv, sched = engine.kv, engine.scheduler
    return {"running": len(sched.running), "waiting": len(sched.waiting),
            "kv_used_blocks": kv.num_used_blocks, "kv_total_blocks": kv.num_blocks,
            "kv_usage": kv.usage, "preemptions": sched.num_preemptions,
            "recomputed_tokens": getattr(sched, "num_recomputed_tokens", 0),
            "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
            "prefix_host_hits": getattr(kv, "prefix_host_hits", 0),
            "host_tier": _host_tier_counters(getattr(kv, "host", None)),
            "spec_decode": engine.spec_decode_metrics() if getattr(sched, "proposer", None) is not None else None}


def _host_tier_counters(host) -> dict | None:
    """The KV offload host tier's cumulative copies (``minibatch.kv_offload``), or None without one."""
    if host is None:
        return None
    return {"stored_blocks": host.num_stored, "loaded_blocks": host.num_loaded, "dropped_blocks": host.num_dropped,
            "store_seconds": host.store_seconds, "load_seconds": host.load_seconds}


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _Snapshot:
    """A collector for what the engine thread publishes: gauges and cumulative counters."""

    def __init__(self, labels: list[str]):
        self.labels = labels
        self.gauges: dict = {}
        self.num_in_flight = 0

    def collect(self):
        g, L = self.gauges, self.labels
        if not g:
            return

        def gauge(name, help_, value):
            fam = GaugeMetricFamily(name, help_, labels=LABELS)
            fam.add_metric(L, value)
            return fam

        def counter(name, help_, value):
            fam = CounterMetricFamily(name, help_, labels=LABELS)
            fam.add_metric(L, value)
            return fam

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", g["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g["kv_usage"])
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
                    "DEPRECATED in vLLM 0.9: use vllm:kv_cache_usage_perc.", g["kv_usage"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      g["preemptions"])
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      g["prefix_queries"])
        # vLLM counts device hits here and a KV connector's (an offload tier's) as "external"
        # (vllm/v1/metrics/loggers.py, 0.11 and later): the host tier's hits go there.
        host_hits = g.get("prefix_host_hits", 0)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      g["prefix_hits"] - host_hits)
        tier = g.get("host_tier")
        if tier is not None:
            yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
                          "connector, in terms of number of queried tokens.", g["prefix_queries"] - (g["prefix_hits"]
                                                                                                   - host_hits))
            yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector, in "
                          "terms of number of cached tokens.", host_hits)
            yield counter("minibatch:kv_offload_stored_blocks", "KV blocks copied device -> host tier.",
                          tier["stored_blocks"])
            yield counter("minibatch:kv_offload_loaded_blocks", "KV blocks copied host tier -> device.",
                          tier["loaded_blocks"])
            yield counter("minibatch:kv_offload_dropped_blocks", "Host tier entries evicted (LRU).",
                          tier["dropped_blocks"])
            fam = CounterMetricFamily("minibatch:kv_offload_copy_seconds", "Seconds of KV copies charged to "
                                      "engine steps, by direction.", labels=LABELS + ("direction",))
            fam.add_metric(L + ["store"], tier["store_seconds"])
            fam.add_metric(L + ["load"], tier["load_seconds"])
            yield fam
        spec = g.get("spec_decode")
        if spec is not None:
            for name, help_ in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")):
                yield counter(name, help_, spec[name])
        yield gauge("minibatch:num_requests_in_flight", "HTTP requests admitted and not yet finished.",
                    self.num_in_flight)
        yield gauge("minibatch:kv_cache_used_blocks", "KV cache blocks in use.", g["kv_used_blocks"])
        yield gauge("minibatch:kv_cache_total_blocks", "KV cache blocks in the pool.", g["kv_total_blocks"])
        yield counter("minibatch:recomputed_tokens", "Tokens computed again after a recompute preemption "
                      "threw their KV away (wasted compute).", g.get("recomputed_tokens", 0))


class ServingMetrics:
    """The metrics of one served model, in a registry of their own (not the process-wide one)."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20, engine: str = "0"):
        self.registry = CollectorRegistry()
        labels = [model_name, engine]
        self._snapshot = _Snapshot(labels)
        self.registry.register(self._snapshot)
        reg = self.registry

        def counter(name, help_):
            return Counter(name, help_, LABELS, registry=reg).labels(*labels)

        def histogram(name, help_, buckets):
            return Histogram(name, help_, LABELS, registry=reg, buckets=buckets).labels(*labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=reg)
        self.finished = {r: success.labels(*labels, r) for r in FINISH_REASONS}
        rejected = Counter("minibatch:request_rejected", "HTTP requests refused before the engine, by reason.",
                           [*LABELS, "reason"], registry=reg)
        self.rejected = {r: rejected.labels(*labels, r) for r in REJECTION_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        # vLLM renamed this histogram (vllm/v1/metrics/loggers.py: the new name from v0.10.2, the old one
        # "Deprecated in 0.11", hidden in 0.12): both names, the same observations, as v0.11 exports them.
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds."
                              "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", TPOT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        length_buckets = one_two_five_buckets(max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    length_buckets)
        self.output_len = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    length_buckets)
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)

    # -- feeding (engine thread) ---------------------------------------------------------------
    def on_event(self, event: str, time: float, req, info: dict) -> None:
        """An ``LLMEngine.subscribe`` listener (runs on the engine thread)."""
        if event == "token":
            self.generation_tokens.inc()
            times = req.token_times
            if len(times) >= 2:
                self.tpot.observe(times[-1] - times[-2])
                self.itl.observe(times[-1] - times[-2])
        elif event == "first_token":
            self.prompt_tokens.inc(req.num_prompt_tokens)
            self.ttft.observe(req.first_token_time - req.arrival_time)
        elif event in ("finish", "abort", "reject"):
            self.finished[req.status.value].inc()
            if event == "reject":
                return
            self.e2e.observe(req.finish_time - req.arrival_time)
            if req.first_scheduled_time is not None:
                self.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            self.prompt_len.observe(req.num_prompt_tokens)
            self.output_len.observe(req.num_output_tokens)

    def on_step(self, num_tokens: int) -> None:
        self.step_tokens.observe(num_tokens)

    def count_http_rejection(self, reason: str) -> None:
        self.rejected[reason].inc()

    # -- the page (event loop) ------------------------------------------------------------------
    def render(self, gauges: dict, num_in_flight: int) -> str:
        self._snapshot.gauges = gauges
        self._snapshot.num_in_flight = num_in_flight
        return generate_latest(self.registry).decode("utf-8")


__all__ = ["ServingMetrics", "CONTENT_TYPE_LATEST", "engine_gauges", "one_two_five_buckets"]
