"""run(): virtual-clock replays, metric definitions shared by sim and real runs, reconfiguration."""

from __future__ import annotations

import json
import threading

import pytest

from minibatch.results import records_from_events, summarize
from minibatch.runner import RunController, run
from minibatch.workload import RequestSpec, Workload, fixed, load_trace, synthetic, uniform


def test_metrics_from_a_hand_made_event_log():
    # r1 arrives at 0, scheduled at 0.5, tokens at 1.0, 1.2, 1.6, finishes at 1.6.
    # r2 arrives at 1, tokens at 2.0, 2.5; r3 is rejected.
    events = [
        (0.0, "arrival", "r1", {"prompt_len": 10}), (0.5, "schedule", "r1", None),
        (1.0, "token", "r1", None), (1.2, "token", "r1", None), (1.6, "token", "r1", None),
        (1.6, "finish", "r1", {"reason": "length"}),
        (1.0, "arrival", "r2", {"prompt_len": 4}), (1.5, "schedule", "r2", None),
        (2.0, "token", "r2", None), (2.5, "token", "r2", None), (2.5, "finish", "r2", {"reason": "stop"}),
        (1.1, "arrival", "r3", {"prompt_len": 9999}), (1.1, "reject", "r3", {"error": "too long"}),
    ]
    recs = {r.request_id: r for r in records_from_events(events)}
    r1, r2 = recs["r1"], recs["r2"]
    assert r1.ttft == pytest.approx(1.0) and r2.ttft == pytest.approx(1.0)
    assert r1.tpot == pytest.approx(0.3)              # (1.6 - 1.0) / (3 - 1): first token excluded
    assert r1.itl == pytest.approx([0.2, 0.4])
    assert r1.e2e == pytest.approx(1.6) and r2.e2e == pytest.approx(1.5)
    assert r1.queue_delay == pytest.approx(0.5)
    s = summarize(list(recs.values()), slo={"ttft": 1.0, "tpot": 0.5})
    assert s["completed"] == 2 and s["failed"] == 1 and s["rejected"] == 1
    assert s["rejected_reasons"] == {"too long": 1}
    assert s["duration_s"] == pytest.approx(2.5)       # first arrival to last finish
    assert s["throughput_tok_s"] == pytest.approx(5 / 2.5)
    assert s["itl_mean"] == pytest.approx((0.2 + 0.4 + 0.5) / 3)
    assert s["slo_attainment"] == pytest.approx(2 / 3)  # r3 (rejected) misses
    s2 = summarize(list(recs.values()), slo={"ttft": 1.0, "tpot": 0.25})
    assert s2["goodput"] == 0.0 and s2["slo_attainment"] == 0.0  # tpot 0.3 and 0.5 > 0.25
    s3 = summarize(list(recs.values()), slo={"ttft": 1.0, "tpot": 0.35})
    assert s3["goodput"] == pytest.approx(1 / 2.5)     # only r1


def _small_workload(n=12, seed=0):
    return synthetic(n, rate=8.0, input_len=uniform(8, 40), output_len=uniform(2, 12), seed=seed)


def test_virtual_clock_real_run_is_deterministic_in_everything_but_timing():
    wl = _small_workload()
    a = run(wl, model="tiny", max_num_seqs=4)
    b = run(wl, model="tiny", max_num_seqs=4)
    assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]
    assert [r.output_len for r in a.requests] == [s.max_tokens for s in wl]
    assert all(r.finish_reason == "length" for r in a.requests)
    # Arrivals are honoured: nothing starts before it arrives.
    for r in a.requests:
        assert r.first_scheduled_time >= r.arrival_time - 1e-12


def test_sim_runs_are_exactly_deterministic_and_ordered_in_time():
    wl = _small_workload(40)
    a = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
    b = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
    assert a.summary() == b.summary()
    for r in a.requests:
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert r.token_times == sorted(r.token_times)


@pytest.mark.parametrize("executor, model", [("sim", "tiny"), ("model", "tiny")])
def test_engine_events_and_records_share_definitions(executor, model):
    """Records rebuilt from the engine's event stream equal the engine's own records."""
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(executor=executor, model=model, max_num_seqs=4,
                                                num_kv_blocks=64 if executor == "sim" else None),
                       clock="virtual")
    events = []
    engine.subscribe(lambda ev, t, req, info: events.append((t, ev, req.request_id, info)))
    result = run(_small_workload(8), engine=engine)
    rebuilt = {r.request_id: r for r in records_from_events(events)}
    for rec in result.requests:
        other = rebuilt[rec.request_id]
        assert other.ttft == pytest.approx(rec.ttft) and other.e2e == pytest.approx(rec.e2e)
        assert other.tpot == pytest.approx(rec.tpot) and other.itl == pytest.approx(rec.itl)
        assert other.queue_delay == pytest.approx(rec.queue_delay)


def test_bad_requests_in_a_workload_are_rejected_not_lost():
    wl = Workload([RequestSpec(0.0, 10, 5), RequestSpec(0.1, 5000, 5), RequestSpec(0.2, 12, 3)])
    res = run(wl, model="tiny")
    reasons = [r.finish_reason for r in res.requests]
    assert reasons == ["length", "rejected", "length"]
    assert "too long" in res.requests[1].error
    assert res.summary()["failed"] == 1


def test_a_trace_longer_than_the_model_reports_rejections_by_reason():
    """Prompts beyond llama-3-8b's 8k context are counted as rejected, with the reason; the
    128k Llama-3.1-8B serves all but the one beyond its own context."""
    lengths = [1000, 9000, 20000, 60000, 140000, 3000]
    wl = Workload([RequestSpec(0.1 * i, n, 4) for i, n in enumerate(lengths)])
    s = run(wl, executor="sim", model="llama-3-8b", hardware="a100-80g").summary()
    assert s["rejected"] == 4 and s["failed"] == 4 and s["completed"] == 2
    assert s["rejected_reasons"] == {"prompt longer than max_model_len": 4}
    s = run(wl, executor="sim", model="llama-3.1-8b", hardware="a100-80g").summary()
    assert s["rejected"] == 1 and s["completed"] == 5
    assert s["rejected_reasons"] == {"prompt longer than max_model_len": 1}


def test_rejection_reasons_are_short_and_counted():
    from minibatch.results import RequestRecord, reject_reason

    errors = ["prompt of 9000 tokens is too long: max_model_len is 8192 (...)",
              "prompt token id 99999 is outside the vocabulary [0, 4096)",
              "request needs 40 KV blocks (640 tokens) but the whole cache has only 30; it can never be served",
              "empty prompt: a request needs at least one token", "quota of tenant 7 exceeded: try later", None]
    assert [reject_reason(e) for e in errors] == [
        "prompt longer than max_model_len", "token id outside the vocabulary",
        "more KV blocks than the cache holds", "empty prompt", "quota of tenant N exceeded", "unknown"]
    recs = [RequestRecord(str(i), 0.0, 10, 0, finish_reason="rejected", error=e) for i, e in enumerate(errors * 2)]
    recs.append(RequestRecord("ok", 0.0, 10, 0, finish_reason="abort"))
    s = summarize(recs)
    assert s["rejected"] == 12 and s["failed"] == 13 and len(s["rejected_reasons"]) == 6
    assert set(s["rejected_reasons"].values()) == {2}


def test_mooncake_prefix_reuse_hits_in_sim_and_never_beats_an_infinite_cache(tmp_path):
    lines = []
    for i in range(30):
        shared = [1, 2, 3] if i % 2 == 0 else [7, 8]
        lines.append({"timestamp": i * 200, "input_length": 512 * len(shared) + 100,
                      "output_length": 20, "hash_ids": shared + [1000 + i]})
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    wl = load_trace(path)
    res = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g", enable_prefix_caching=True)
    off = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
    hit = res.summary()["prefix_cache_hit_rate"]
    assert hit > 0.5 and off.summary()["prefix_cache_hit_rate"] == 0.0
    # An infinite cache hits every full block whose whole prefix was seen before.
    seen, best, total = set(), 0, 0
    for spec in wl:
        ids = spec.prompt_token_ids
        total += len(ids)
        n = 0
        for b in range((len(ids) - 1) // 16):
            key = tuple(ids[:(b + 1) * 16])
            if key not in seen:
                break
            n += 16
        best += n
        for b in range(len(ids) // 16):
            seen.add(tuple(ids[:(b + 1) * 16]))
    assert res.summary()["prefix_cache_hit_rate"] <= best / total + 1e-9
    assert res.summary()["ttft_mean"] < off.summary()["ttft_mean"]


def test_reconfiguration_mid_run_applies_at_next_step_and_is_recorded():
    wl = synthetic(400, rate=50.0, input_len=fixed(200), output_len=fixed(50), seed=3)
    ctl = RunController()
    seen = []

    def on_step(engine, step):
        seen.append((step.start_time, engine.config.max_num_seqs, step.num_seqs))
        if len(seen) == 50:
            ctl.set("max_num_seqs", 2)
            ctl.set("request_rate", 100.0)

    res = run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g", controller=ctl, on_step=on_step)
    assert [name for _, name, _ in res.reconfigurations] == ["max_num_seqs", "request_rate"]
    t_change = res.reconfigurations[0][0]
    assert t_change >= seen[49][0]
    after = [n for t, cap, n in seen[51:]]
    assert after and max(after) <= 2 and max(n for _, _, n in seen[:50]) > 2
    assert all(r.finish_reason == "length" for r in res.requests)


def test_controller_from_another_thread_and_stop():
    wl = synthetic(2000, rate=20.0, input_len=fixed(100), output_len=fixed(100), seed=4)
    ctl = RunController()
    ctl.set("max_num_batched_tokens", 512)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", run(wl, executor="sim", model="llama-2-7b",
                                                                   controller=ctl, pace=20.0)))
    th.start()
    th.join(0.5)
    ctl.stop()
    th.join(30)
    assert not th.is_alive()
    res = out["r"]
    assert res.reconfigurations[0][1:] == ("max_num_batched_tokens", 512)
    assert 0 < len(res.requests) < 2000
    assert len(res.requests) + res.extra["not_submitted"] == 2000
    assert all(r.finish_reason in ("length", "abort") for r in res.requests)
    assert any(r.finish_reason == "abort" for r in res.requests)
    with pytest.raises(ValueError, match="cannot change"):
        ctl.set("block_size", 32)


def test_a_workload_whose_last_request_is_rejected_ends_cleanly():
    wl = Workload([RequestSpec(0.0, 10, 3), RequestSpec(5.0, 9000, 3)])
    res = run(wl, executor="sim", model="llama-2-7b")
    assert [r.finish_reason for r in res.requests] == ["length", "rejected"]
