"""``minibatch.results`` on small hand-made records and steps: every key of the run summary,
the latency definitions, the SLO parser, percentiles, the event-log rebuild and the JSON dump.

Times are binary fractions (0.25, 0.5, 1.75 ...) so that latencies are exact; each expected
value is worked out by hand in a comment next to it. numpy's percentile of two values a <= b
is ``a + p/100 * (b - a)`` (linear interpolation between order statistics).
"""

from __future__ import annotations

import json
import math

import pytest

from minibatch.results import (RequestRecord, RunResult, meets_slo, parse_goodput, percentiles, records_from_events,
                               reject_reason, summarize, tpot)
from minibatch.timeline import StepRecord

NAN_KEYS = [f"{m}_{s}" for m in ("ttft", "tpot", "itl", "e2e", "queue_delay") for s in ("mean", "p50", "p90", "p99")]
BASE_KEYS = {"num_requests", "completed", "failed", "rejected", "rejected_reasons", "duration_s",
             "total_input_tokens", "total_output_tokens", "request_throughput", "throughput_tok_s",
             "total_throughput_tok_s", *NAN_KEYS, "prefix_cache_hit_rate", "num_preemptions",
             "num_computed_tokens", "num_recomputed_tokens", "recompute_waste",
             "num_swapped_blocks", "kv_util_mean", "kv_util_max", "kv_reserved_unused_mean",
             "kv_internal_waste_mean", "kv_reserved_mean", "kv_internal_frag_mean", "kv_external_frag_mean",
             "padding_waste"}
STEP_KEYS = {"num_steps", "mean_batch_size"}
SLO_KEYS = {"goodput", "slo_attainment"}


def rec(rid, arrival, prompt_len, tokens=(), sched=None, finish=None, reason=None, **kw) -> RequestRecord:
    """A record whose first token is its first token time and output_len the number of tokens."""
    tokens = list(tokens)
    return RequestRecord(rid, arrival, prompt_len, len(tokens), first_scheduled_time=sched,
                         first_token_time=tokens[0] if tokens else None, finish_time=finish,
                         token_times=tokens, finish_reason=reason, **kw)


def step(duration, num_seqs, used, total=8, padded=0, swapped_out=0, reserved=0.0, internal=0.0, i=0,
         frag=(0.0, 0.0, 0.0)) -> StepRecord:
    return StepRecord(step=i, start_time=0.0, duration=duration, forward_time=duration, num_seqs=num_seqs,
                      num_prefill_seqs=0, num_decode_seqs=num_seqs, num_prefill_tokens=0,
                      num_decode_tokens=num_seqs, num_waiting=0, num_running=num_seqs, num_preempted=0,
                      kv_blocks_used=used, kv_blocks_total=total, num_padded_slots=padded,
                      num_swapped_out_blocks=swapped_out, kv_reserved_unused=reserved, kv_internal_waste=internal,
                      kv_reserved=frag[0], kv_internal_frag=frag[1], kv_external_frag=frag[2])


# ---------------------------------------------------------------- tpot, percentiles


def test_tpot_excludes_the_first_token_and_needs_two():
    assert tpot(1.0, 2.0, 5) == 0.25                    # (2 - 1) / (5 - 1)
    assert tpot(1.0, 1.5, 2) == 0.5                     # two tokens: one gap
    assert tpot(3.0, 3.0, 1) is None                    # one token: no TPOT
    assert tpot(None, None, 0) is None
    assert tpot(None, 2.0, 3) is None and tpot(1.0, None, 3) is None


def test_percentiles_interpolate_linearly_and_skip_none():
    # [1, 2, 3, 4]: index p/100 * 3 -> p50 at 1.5 (2.5), p90 at 2.7 (3.7), p99 at 2.97 (3.97).
    got = percentiles([4.0, None, 1.0, 3.0, 2.0])
    assert list(got) == [50, 90, 99]
    assert got[50] == pytest.approx(2.5) and got[90] == pytest.approx(3.7) and got[99] == pytest.approx(3.97)
    assert percentiles([5.0], ps=(25, 75)) == {25: 5.0, 75: 5.0}
    empty = percentiles([None])
    assert list(empty) == [50, 90, 99] and all(math.isnan(v) for v in empty.values())
    assert math.isnan(percentiles([])[50])


# ---------------------------------------------------------------- parse_goodput


def test_parse_goodput_reads_vllm_milliseconds_as_seconds():
    assert parse_goodput("ttft:800 tpot:50,e2el:5000") == pytest.approx({"ttft": 0.8, "tpot": 0.05, "e2e": 5.0})
    got = parse_goodput(["ttft :250", "e2e:1500"])      # names are stripped; e2e is e2el's other name
    assert got == pytest.approx({"ttft": 0.25, "e2e": 1.5}) and list(got) == ["ttft", "e2e"]
    assert parse_goodput(["tpot:2.5"]) == pytest.approx({"tpot": 0.0025})


def test_parse_goodput_takes_a_dict_as_seconds():
    assert parse_goodput({"ttft": 0.8, "tpot": "0.05"}) == {"ttft": 0.8, "tpot": 0.05}
    assert parse_goodput({"e2e": 2}) == {"e2e": 2.0}
    with pytest.raises(ValueError, match=r"unknown SLO metric 'e2el'; use ttft, tpot, e2e \(seconds\)"):
        parse_goodput({"e2el": 5.0})                    # the CLI name is not a Python key


@pytest.mark.parametrize("empty", [None, "", [], {}, ()])
def test_parse_goodput_of_nothing_is_no_slo(empty):
    assert parse_goodput(empty) == {}


@pytest.mark.parametrize("goodput, message", [
    ("ttft800", r"cannot read SLO term 'ttft800'; write e\.g\. ttft:800 tpot:50 \(milliseconds\)"),
    (["latency:5"], r"unknown SLO metric 'latency'; use ttft, tpot, e2el \(milliseconds\)"),
    ("ttft:fast", r"SLO ttft must be a number, got 'fast'"),
    ("tpot:1:2", r"SLO tpot must be a number, got '1:2'"),
    ({"ttft": None}, r"SLO ttft must be a number, got None"),
    ("ttft:0", r"SLO ttft must be a positive, finite bound, got '0'"),
    ("e2el:-5", r"SLO e2el must be a positive, finite bound, got '-5'"),
    ("ttft:inf", r"SLO ttft must be a positive, finite bound, got 'inf'"),
    ({"tpot": float("nan")}, r"SLO tpot must be a positive, finite bound, got nan"),
    ({"e2e": 0.0}, r"SLO e2e must be a positive, finite bound, got 0\.0"),
])
def test_parse_goodput_errors_name_the_problem(goodput, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        parse_goodput(goodput)


# ---------------------------------------------------------------- RequestRecord


def test_record_latencies_follow_vllm_bench_definitions():
    r = RequestRecord("a", 0.5, 10, 3, first_scheduled_time=0.75, first_token_time=1.0, finish_time=2.25,
                      token_times=[1.0, 1.25, 2.0], finish_reason="length")
    assert r.ttft == 0.5                                # 1.0 - 0.5
    assert r.tpot == 0.5                                # (2.0 - 1.0) / (3 - 1): the last token time, not finish
    assert r.itl == [0.25, 0.75]                        # every gap
    assert r.e2e == 1.75                                # 2.25 - 0.5
    assert r.queue_delay == 0.25                        # 0.75 - 0.5
    fresh = RequestRecord("b", 1.0, 4, 0)
    assert fresh.ttft is None and fresh.tpot is None and fresh.e2e is None and fresh.queue_delay is None
    assert fresh.itl == [] and not fresh.completed
    assert (fresh.priority, fresh.tenant, fresh.num_preemptions, fresh.num_cached_tokens) == (0, None, 0, 0)
    assert fresh.error is None and fresh.output_token_ids is None and fresh.token_times == []
    one = RequestRecord("c", 0.0, 4, 1, first_token_time=0.5, token_times=[0.5], finish_reason="stop")
    assert one.tpot is None and one.itl == []           # one token: no TPOT, no gap


def test_record_tpot_uses_the_first_token_time_and_output_len():
    # token_times may hold fewer entries than output_len (a record built by hand): TPOT is
    # (t_n - first_token_time) / (output_len - 1) = (3.0 - 1.0) / (5 - 1).
    r = RequestRecord("a", 0.0, 4, 5, first_token_time=1.0, token_times=[2.0, 3.0])
    assert r.tpot == 0.5


@pytest.mark.parametrize("reason, completed", [("stop", True), ("length", True), ("abort", False),
                                               ("rejected", False), (None, False)])
def test_record_completed_means_stop_or_length(reason, completed):
    assert RequestRecord("a", 0.0, 1, 0, finish_reason=reason).completed is completed


# ---------------------------------------------------------------- records_from_events


def test_records_from_events_rebuilds_every_field():
    events = [
        (2.0, "token", "a", None), (0.5, "schedule", "a", {}),              # out of order: sorted by time
        (0.25, "arrival", "a", {"prompt_len": 7, "priority": 3, "tenant": "t1"}),
        (1.0, "token", "a", None), (1.25, "preempt", "a", None), (1.5, "schedule", "a", None),
        (1.75, "preempt", "a", None), (1.75, "schedule", "a", None),
        (2.5, "token", "a", None), (2.5, "finish", "a", {"reason": "stop"}),
        (0.0, "arrival", "b", None), (0.75, "schedule", "b", None), (1.0, "token", "b", None),
        (1.5, "finish", "b", None),                                        # reason defaults to length
        (1.0, "arrival", "c", {}), (1.0, "abort", "c", {"error": "client went away"}),
        (3.0, "arrival", "d", {"prompt_len": 99}), (3.0, "reject", "d", {"error": "too long"}),
        (3.5, "unknown-event", "d", {}),                                   # ignored
    ]
    recs = records_from_events(events)
    assert [r.request_id for r in recs] == ["b", "a", "c", "d"]          # by arrival
    b, a, c, d = recs
    assert a == RequestRecord("a", 0.25, 7, 3, 3, "t1", first_scheduled_time=0.5, first_token_time=1.0,
                              finish_time=2.5, token_times=[1.0, 2.0, 2.5], num_preemptions=2,
                              finish_reason="stop")
    assert b == RequestRecord("b", 0.0, 0, 1, 0, None, first_scheduled_time=0.75, first_token_time=1.0,
                              finish_time=1.5, token_times=[1.0], finish_reason="length")
    assert c == RequestRecord("c", 1.0, 0, 0, finish_time=1.0, finish_reason="abort", error="client went away")
    assert d == RequestRecord("d", 3.0, 99, 0, finish_time=3.0, finish_reason="rejected", error="too long")


def test_records_from_events_keeps_the_log_order_of_events_at_one_time():
    # An arrival and its abort at the same instant, in that order ("abort" sorts before
    # "arrival" by name: only the time orders events).
    recs = records_from_events([(1.0, "arrival", "x", {"prompt_len": 2}), (1.0, "abort", "x", None)])
    assert len(recs) == 1 and recs[0].finish_reason == "abort" and recs[0].finish_time == 1.0
    assert recs[0].error is None


# ---------------------------------------------------------------- reject_reason


def test_reject_reason_names_each_engine_refusal():
    assert reject_reason("prompt of 600 tokens over max_num_batched_tokens 512") == "prompt over max_num_batched_tokens"
    assert reject_reason("invalid sampling parameter: top_p must be in (0, 1]") == "invalid sampling parameter"
    assert reject_reason("prompt of 9000 tokens is too long: max_model_len is 8192") == "prompt longer than max_model_len"


def test_reject_reason_falls_back_to_the_first_clause_with_numbers_as_n():
    assert reject_reason(None) == "unknown" and reject_reason("") == "unknown"
    assert reject_reason("quota of tenant 7 exceeded: try later") == "quota of tenant N exceeded"
    assert reject_reason("rate 2.5 too high; slow down") == "rate N too high"       # a decimal is one N
    assert reject_reason("bad  header\n value (see docs)") == "bad header value"  # whitespace collapsed
    assert reject_reason(": nothing before the colon") == "unknown"
    assert reject_reason("   ") == "unknown"
    long = "x" * 100
    assert reject_reason(long) == "x" * 80                                        # at most 80 characters


# ---------------------------------------------------------------- meets_slo


def test_meets_slo_checks_every_bound_inclusively():
    r = rec("a", 0.0, 4, [0.5, 0.75, 1.0], finish=1.0, reason="length")   # ttft 0.5, tpot 0.25, e2e 1.0
    assert meets_slo(r, {"ttft": 0.5, "tpot": 0.25, "e2e": 1.0})        # equal to a bound meets it
    assert not meets_slo(r, {"ttft": 0.25})
    assert not meets_slo(r, {"tpot": 0.125})
    assert not meets_slo(r, {"ttft": 1.0, "e2e": 0.75})
    assert meets_slo(r, {})


def test_meets_slo_one_token_output_has_no_tpot_bound_but_others_still_count():
    one = rec("a", 0.0, 4, [0.5], finish=0.5, reason="stop")
    assert meets_slo(one, {"tpot": 0.001})
    assert not meets_slo(one, {"tpot": 0.001, "ttft": 0.25})            # tpot skipped, ttft still checked
    no_token = rec("b", 0.0, 4, [], finish=0.5, reason="length")        # completed with no first token
    assert not meets_slo(no_token, {"ttft": 10.0})


def test_meets_slo_only_for_completed_requests_and_known_metrics():
    aborted = rec("a", 0.0, 4, [0.5, 0.75], finish=0.75, reason="abort")
    assert not meets_slo(aborted, {"ttft": 10.0})
    done = rec("b", 0.0, 4, [0.5, 0.75], finish=0.75, reason="stop")
    with pytest.raises(ValueError, match=r"unknown SLO metric 'e2el'; use ttft, tpot, e2e \(seconds\)"):
        meets_slo(done, {"e2el": 5.0})


# ---------------------------------------------------------------- summarize


def mixed_records() -> list[RequestRecord]:
    """Two completed requests (a, b), an aborted one (c), four rejected (d, e, f, g), one running (h)."""
    return [
        rec("d", 0.0, 100, finish=0.0, reason="rejected", error="prompt of 100 tokens is too long: max_model_len is 64"),
        rec("a", 0.5, 10, [1.0, 1.25, 2.0], sched=0.75, finish=2.0, reason="length", num_preemptions=1,
            num_cached_tokens=4),
        rec("e", 0.0, 5, finish=0.0, reason="rejected", error="quota of tenant 7 exceeded: try later"),
        rec("b", 1.0, 6, [1.75], sched=1.0, finish=1.75, reason="stop"),
        rec("c", 0.25, 8, [1.0, 1.5], sched=0.5, finish=4.0, reason="abort", num_preemptions=2,
            num_cached_tokens=8),
        rec("f", 0.0, 5, finish=0.0, reason="rejected", error="quota of tenant 12 exceeded"),
        rec("g", 0.0, 0, finish=0.0, reason="rejected", error="empty prompt: a request needs at least one token"),
        rec("h", 1.5, 4, [], sched=1.75, num_cached_tokens=2),
    ]


def mixed_steps() -> list[StepRecord]:
    return [step(0.5, 2, used=8, swapped_out=2, reserved=0.25, internal=0.125, i=0, frag=(0.5, 0.25, 0.0)),
            step(0.5, 3, used=6, padded=1, reserved=0.5, internal=0.25, i=1, frag=(0.25, 0.125, 0.5)),
            step(1.0, 1, used=2, padded=2, swapped_out=3, i=2, frag=(0.125, 0.0, 0.25))]


def test_summary_of_a_mixed_run_every_key():
    s = summarize(mixed_records(), mixed_steps(), slo={"ttft": 0.625, "tpot": 0.5})
    assert set(s) == BASE_KEYS | STEP_KEYS | SLO_KEYS
    assert s["num_requests"] == 8 and s["completed"] == 2   # a, b
    assert s["failed"] == 5                                 # c aborted + d, e, f, g rejected; h still running
    assert s["rejected"] == 4
    # By count, then by name: "empty prompt" before "prompt longer..." although d comes first.
    assert list(s["rejected_reasons"].items()) == [("quota of tenant N exceeded", 2), ("empty prompt", 1),
                                                   ("prompt longer than max_model_len", 1)]
    assert s["duration_s"] == 2.0                           # first arrival (d, 0.0) to last completed finish (a, 2.0)
    assert s["total_input_tokens"] == 16                    # 10 + 6, completed only
    assert s["total_output_tokens"] == 4                    # 3 + 1
    assert s["request_throughput"] == 1.0                   # 2 / 2.0
    assert s["throughput_tok_s"] == 2.0                     # 4 / 2.0
    assert s["total_throughput_tok_s"] == 10.0              # (4 + 16) / 2.0
    # Latencies of completed requests only. ttft: a 0.5, b 0.75.
    assert s["ttft_mean"] == 0.625
    assert (s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]) == pytest.approx((0.625, 0.725, 0.7475))
    # tpot: a (2.0 - 1.0) / 2 = 0.5; b has one token, no TPOT.
    assert (s["tpot_mean"], s["tpot_p50"], s["tpot_p90"], s["tpot_p99"]) == (0.5, 0.5, 0.5, 0.5)
    # itl: a's gaps 0.25, 0.75 (c's 0.5 not counted: aborted).
    assert s["itl_mean"] == 0.5
    assert (s["itl_p50"], s["itl_p90"], s["itl_p99"]) == pytest.approx((0.5, 0.7, 0.745))
    # e2e: a 1.5, b 0.75.
    assert s["e2e_mean"] == 1.125
    assert (s["e2e_p50"], s["e2e_p90"], s["e2e_p99"]) == pytest.approx((1.125, 1.425, 1.4925))
    # queue delay: a 0.25, b 0.0.
    assert s["queue_delay_mean"] == 0.125
    assert (s["queue_delay_p50"], s["queue_delay_p90"], s["queue_delay_p99"]) == pytest.approx((0.125, 0.225, 0.2475))
    # SLO ttft 0.625, tpot 0.5: a meets both (0.5, 0.5), b misses ttft (0.75).
    assert s["goodput"] == 0.5                              # 1 / 2.0 s
    assert s["slo_attainment"] == 0.125                     # 1 of all 8 requests
    # Cached prompt tokens 4 + 8 + 2 over the prompts of the scheduled a, b, c, h: 10 + 6 + 8 + 4.
    assert s["prefix_cache_hit_rate"] == 0.5
    assert s["num_preemptions"] == 3                        # a 1 + c 2
    assert s["num_swapped_blocks"] == 5                     # 2 + 0 + 3
    # Step durations 0.5, 0.5, 1.0 (2.0 in all); KV usage 8/8, 6/8, 2/8.
    assert s["kv_util_mean"] == 0.5625                      # (0.5 * 1 + 0.5 * 0.75 + 1.0 * 0.25) / 2
    assert s["kv_util_max"] == 1.0
    assert s["kv_reserved_unused_mean"] == 0.1875           # (0.5 * 0.25 + 0.5 * 0.5 + 1.0 * 0) / 2
    assert s["kv_internal_waste_mean"] == 0.09375           # (0.5 * 0.125 + 0.5 * 0.25 + 1.0 * 0) / 2
    assert s["kv_reserved_mean"] == 0.25                    # (0.5 * 0.5 + 0.5 * 0.25 + 1.0 * 0.125) / 2
    assert s["kv_internal_frag_mean"] == 0.09375            # (0.5 * 0.25 + 0.5 * 0.125 + 1.0 * 0) / 2
    assert s["kv_external_frag_mean"] == 0.25               # (0.5 * 0 + 0.5 * 0.5 + 1.0 * 0.25) / 2
    assert s["num_steps"] == 3
    assert s["mean_batch_size"] == 2.0                      # (2 + 3 + 1) / 3
    assert s["padding_waste"] == pytest.approx(1 / 3)      # padded 0 + 1 + 2 = 3 over 3 + (2 + 3 + 1)


def test_summary_without_steps_or_slo():
    s = summarize(mixed_records())
    assert set(s) == BASE_KEYS                              # no goodput, no step counts
    assert s["num_swapped_blocks"] == 0
    assert (s["kv_util_mean"], s["kv_util_max"], s["kv_reserved_unused_mean"], s["kv_internal_waste_mean"],
            s["kv_reserved_mean"], s["kv_internal_frag_mean"], s["kv_external_frag_mean"],
            s["padding_waste"]) == (0.0,) * 8
    assert set(summarize(mixed_records(), [], slo={})) == BASE_KEYS


def test_summary_of_no_requests():
    s = summarize([], slo={"ttft": 1.0})
    assert set(s) == BASE_KEYS | SLO_KEYS
    assert (s["num_requests"], s["completed"], s["failed"], s["rejected"], s["rejected_reasons"]) == (0, 0, 0, 0, {})
    assert s["duration_s"] == 0.0 and s["total_input_tokens"] == 0 and s["total_output_tokens"] == 0
    assert (s["request_throughput"], s["throughput_tok_s"], s["total_throughput_tok_s"]) == (0.0, 0.0, 0.0)
    assert all(math.isnan(s[k]) for k in NAN_KEYS)
    assert (s["goodput"], s["slo_attainment"]) == (0.0, 0.0)
    assert (s["prefix_cache_hit_rate"], s["num_preemptions"]) == (0.0, 0)


def test_summary_with_no_completed_request_has_nan_latencies_and_zero_rates():
    recs = [rec("a", 0.0, 4, [0.5, 1.0], sched=0.25, finish=1.0, reason="abort", num_cached_tokens=1),
            rec("b", 0.5, 4, finish=0.5, reason="rejected", error="too long")]
    s = summarize(recs, slo={"ttft": 1.0})
    assert (s["completed"], s["failed"], s["rejected"], s["rejected_reasons"]) == (0, 2, 1, {"too long": 1})
    assert s["duration_s"] == 0.0                           # no completed finish
    assert (s["request_throughput"], s["throughput_tok_s"], s["goodput"], s["slo_attainment"]) == (0, 0, 0, 0)
    assert s["total_output_tokens"] == 0
    assert all(math.isnan(s[k]) for k in NAN_KEYS)
    assert s["prefix_cache_hit_rate"] == 0.25               # 1 cached of a's 4 (b never scheduled)


def test_summary_of_a_run_with_zero_duration():
    # One request arrives, gets its one token and finishes at the same instant.
    s = summarize([rec("a", 1.0, 4, [1.0], sched=1.0, finish=1.0, reason="stop")], slo={"ttft": 1.0})
    assert s["duration_s"] == 0.0 and s["completed"] == 1
    assert (s["request_throughput"], s["throughput_tok_s"], s["total_throughput_tok_s"], s["goodput"]) == (0, 0, 0, 0)
    assert s["slo_attainment"] == 1.0
    assert s["ttft_mean"] == 0.0 and math.isnan(s["tpot_mean"]) and math.isnan(s["itl_mean"])


def test_summary_rates_over_a_run_shorter_than_a_second():
    # a: 0.0 -> 0.5, 3 tokens; prompt 5. Duration 0.5 s.
    s = summarize([rec("a", 0.0, 5, [0.25, 0.375, 0.5], sched=0.0, finish=0.5, reason="length")],
                  slo={"e2e": 0.5})
    assert s["duration_s"] == 0.5
    assert s["request_throughput"] == 2.0                   # 1 / 0.5
    assert s["throughput_tok_s"] == 6.0                     # 3 / 0.5
    assert s["total_throughput_tok_s"] == 16.0              # (3 + 5) / 0.5
    assert s["goodput"] == 2.0 and s["slo_attainment"] == 1.0


def test_summary_ignores_a_completed_record_without_finish_time_for_duration():
    recs = [rec("a", 0.0, 2, [0.5], finish=1.5, reason="stop"), rec("b", 0.25, 2, [0.75], reason="length")]
    s = summarize(recs)
    assert s["duration_s"] == 1.5 and s["completed"] == 2 and s["e2e_mean"] == 1.5   # b has no e2e


def test_summary_kv_means_over_steps_of_zero_duration_are_plain_means():
    steps = [step(0.0, 1, used=4), step(0.0, 1, used=8)]      # usage 0.5, 1.0
    s = summarize([], steps)
    assert s["kv_util_mean"] == 0.75 and s["kv_util_max"] == 1.0 and s["padding_waste"] == 0.0


def test_summary_kv_usage_of_a_step_with_no_pool_is_zero():
    s = summarize([], [step(1.0, 1, used=0, total=0), step(1.0, 1, used=2, total=4)])
    assert s["kv_util_mean"] == 0.25 and s["kv_util_max"] == 0.5


# ---------------------------------------------------------------- RunResult


class Named:
    def __str__(self) -> str:
        return "lifo"


def small_result() -> RunResult:
    recs = [RequestRecord("a", 0.0, 4, 2, first_scheduled_time=0.0, first_token_time=0.5, finish_time=1.0,
                          token_times=[0.5, 1.0], finish_reason="length", output_token_ids=[7, 8]),
            RequestRecord("b", 0.5, 3, 0, finish_time=0.5, finish_reason="rejected", error="too long")]
    return RunResult(recs, [step(1.0, 1, used=2, total=4)], {"policy": "fcfs", "max_num_seqs": 2},
                     reconfigurations=[(0.5, "policy", Named())], kv_blocks_total=4)


def test_run_result_summary_is_summarize_of_its_records_and_steps():
    r = small_result()
    assert r.summary() == summarize(r.requests, r.steps)
    with_slo = r.summary({"ttft": 0.5})
    assert with_slo["goodput"] == 1.0 and with_slo["slo_attainment"] == 0.5    # a meets it; 1 s run, 2 requests
    assert r.extra == {} and r.wall_time_s == 0.0
    assert RunResult([], [], {}).reconfigurations == [] and RunResult([], [], {}).kv_blocks_total == 0


def test_run_result_to_json_content():
    r = small_result()
    text = r.to_json(slo={"ttft": 0.5})
    data = json.loads(text)
    assert list(data) == ["summary", "config", "reconfigurations", "requests"]
    assert text.splitlines()[:2] == ["{", ' "summary": {']                    # indent of one space
    assert data["summary"]["goodput"] == 1.0 and data["summary"]["rejected_reasons"] == {"too long": 1}
    assert data["config"] == {"policy": "fcfs", "max_num_seqs": 2}
    assert data["reconfigurations"] == [[0.5, "policy", "lifo"]]               # any value as its str
    a, b = data["requests"]
    assert "token_times" not in a and "output_token_ids" not in a
    assert a == {"request_id": "a", "arrival_time": 0.0, "prompt_len": 4, "output_len": 2, "priority": 0,
                 "tenant": None, "first_scheduled_time": 0.0, "first_token_time": 0.5, "finish_time": 1.0,
                 "num_preemptions": 0, "num_cached_tokens": 0, "finish_reason": "length", "error": None,
                 "replica": None, "model": None, "computed_tokens": 0, "recomputed_tokens": 0}
    assert b["finish_reason"] == "rejected" and b["error"] == "too long"
    assert "goodput" not in json.loads(r.to_json())["summary"]


def test_run_result_to_json_writes_the_same_text_to_a_file(tmp_path):
    r = small_result()
    path = tmp_path / "run.json"
    text = r.to_json(path)
    assert path.read_text() == text
    r.to_json(str(path), slo={"e2e": 1.0})                   # overwrites
    assert json.loads(path.read_text())["summary"]["slo_attainment"] == 0.5


def test_run_result_to_json_keeps_nan_of_a_run_without_completions():
    r = RunResult([RequestRecord("x", 0.0, 4, 0, finish_time=0.0, finish_reason="rejected")], [], {})
    data = json.loads(r.to_json())
    assert math.isnan(data["summary"]["ttft_mean"]) and data["summary"]["rejected_reasons"] == {"unknown": 1}
