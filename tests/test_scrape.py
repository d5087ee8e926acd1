"""minibatch.serving.scrape: an in-process engine's /metrics page scraped on its clock, and the two
PromQL queries the dashboards use (rate, histogram_quantile) as Prometheus computes them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.runner import run
from minibatch.serving.metrics import TTFT_BUCKETS, engine_gauges
from minibatch.serving.scrape import Scraper, histogram_quantile, parse_page, quantile_over_time, rate
from minibatch.workload import synthetic, uniform

INF = float("inf")


def test_histogram_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    bounds = [0.1, 0.5, 1.0, INF]
    cum = [10, 30, 40, 40]
    assert histogram_quantile(0.25, bounds, cum) == pytest.approx(0.1)            # rank 10: end of bucket 0
    assert histogram_quantile(0.5, bounds, cum) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(0.1, bounds, cum) == pytest.approx(0.1 * 4 / 10)    # first bucket from 0
    assert histogram_quantile(1.0, bounds, cum) == pytest.approx(1.0)
    # a rank in the +Inf bucket returns the highest finite bound
    assert histogram_quantile(0.99, bounds, [10, 30, 40, 100]) == 1.0
    assert math.isnan(histogram_quantile(0.5, bounds, [0, 0, 0, 0]))
    assert math.isnan(histogram_quantile(0.5, [0.1, 0.5], [1, 2]))                 # no +Inf bucket
    assert histogram_quantile(0.5, bounds, [10, 8, 40, 40]) == histogram_quantile(0.5, bounds, [10, 10, 40, 40])
    with pytest.raises(ValueError):
        histogram_quantile(1.5, bounds, cum)


@pytest.fixture(scope="module")
def scraped():
    cfg = EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=32)
    engine = LLMEngine(cfg, clock="virtual")
    scraper = Scraper(engine, interval_s=0.5)
    wl = synthetic(200, rate=20.0, input_len=uniform(64, 512), output_len=uniform(16, 128), seed=2)
    res = run(wl, engine=engine, on_step=scraper.on_step)
    scraper.finish(engine.clock.now() + 2.0)
    return engine, scraper, res


def test_scrapes_come_every_interval_and_read_vllms_names(scraped):
    engine, scraper, res = scraped
    t = np.asarray(scraper.times)
    assert np.allclose(np.diff(t), 0.5) and t[0] == 0.0
    assert t[-1] >= engine.clock.now() + 1.5
    assert "vllm:num_requests_running" in scraper.page and "vllm:time_to_first_token_seconds_bucket" in scraper.page
    _, gen = scraper.values("vllm:generation_tokens_total")
    assert gen[-1] == sum(r.output_len for r in res.requests)
    _, ok = scraper.values("vllm:request_success_total", finished_reason="length")
    assert ok[-1] == len(res.requests)
    _, running = scraper.values("vllm:num_requests_running")
    assert running.max() > 0 and running[-1] == 0           # idle at the end
    page = parse_page(scraper.page)
    g = engine_gauges(engine)
    assert page[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "llama-2-7b")))] == g["kv_usage"]


def test_rate_is_the_counters_increase_over_the_window(scraped):
    _, scraper, res = scraped
    t, tok_s = rate(scraper, "vllm:generation_tokens_total", window_s=2.0)
    _, gen = scraper.values("vllm:generation_tokens_total")
    i = int(np.argmax(t >= 5.0))
    j = int(np.searchsorted(t, t[i] - 2.0 - 1e-9))
    assert tok_s[i] == pytest.approx((gen[i] - gen[j]) / (t[i] - t[j]))
    assert math.isnan(tok_s[0])
    # a whole-run window: the tokens after the first scrape (at most one step late) per second
    span = t[-1] - t[0]
    _, whole = rate(scraper, "vllm:generation_tokens_total", window_s=span)
    first_step_end = res.steps[0].start_time + res.steps[0].duration
    made_later = sum(1 for r in res.requests for x in r.token_times if x > first_step_end + 1e-12)
    assert whole[-1] == pytest.approx(made_later / span)


def test_the_ttft_quantile_from_buckets_lies_in_the_bucket_of_the_true_quantile(scraped):
    _, scraper, res = scraped
    t, p90 = quantile_over_time(scraper, 0.9, "vllm:time_to_first_token_seconds", window_s=t_span(scraper))
    true = float(np.percentile([r.ttft for r in res.requests], 90))
    bounds = list(TTFT_BUCKETS)
    hi = next(b for b in bounds if b >= true)
    lo = max([0.0] + [b for b in bounds if b < true])
    assert lo <= p90[-1] <= hi


def t_span(scraper):
    return scraper.times[-1] - scraper.times[0]


def test_a_target_marked_down_records_up_zero_and_no_samples():
    cfg = EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g")
    engine = LLMEngine(cfg, clock="virtual")
    scraper = Scraper(engine, interval_s=1.0)
    scraper.mark_down(2.0)
    scraper.finish(4.0)
    t, up = scraper.values("up")
    assert list(t) == [0.0, 1.0, 2.0, 3.0, 4.0] and list(up) == [1, 1, 0, 0, 0]
    _, running = scraper.values("vllm:num_requests_running")
    assert running[1] == 0 and np.isnan(running[2:]).all()
    with pytest.raises(ValueError):
        Scraper(engine, interval_s=0)


def test_the_dashboard_draws_six_panels_with_a_line_per_target(scraped):
    from minibatch.viz import metrics_dashboard

    _, scraper, _ = scraped
    fig = metrics_dashboard({"a": scraper, "b": scraper}, window_s=2.0)
    assert len(fig.axes) == 6
    assert len(fig.axes[1].lines) == 2                      # KV usage: one line per target
