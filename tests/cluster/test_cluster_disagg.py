"""Prefill/decode disaggregation (DistServe, Splitwise): tokens equal a single engine's with the
real tiny model, the transfer timing by hand in the simulator, KV blocks conserved on both pools
and in flight, TTFT from the prefill side, no decode step on a prefill replica, no request lost."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch import cluster, run
from minibatch.cluster import Disaggregation, goodput_per_gpu
from minibatch.cluster.disagg import Disaggregator
from minibatch.workload import RequestSpec, Workload
from tests.cluster.helpers import tiny_engine

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}
BB = 2 * 32 * 32 * 128 * 2 * 16      # llama-2-7b: K and V x 32 layers x 32 heads x 128 dims x 2 bytes x 16 tokens


def mixed(n=6, gap=0.0, prompts=(20, 9, 33), outs=(12, 1, 7)):
    return Workload([RequestSpec(i * gap, prompts[i % len(prompts)], outs[i % len(outs)], request_id=f"q{i}")
                     for i in range(n)])


def test_tokens_equal_a_single_engines_on_the_tiny_model():
    engine = {"max_num_seqs": 4, "block_size": 8, "num_kv_blocks": 64}
    wl = mixed(n=6, gap=0.005)
    single = run(wl, engine=tiny_engine(**engine))
    reference = {r.request_id: r.output_token_ids for r in single.requests}
    engines = [tiny_engine(**engine) for _ in range(3)]
    res = cluster.run(wl, engines=engines, router="round_robin",
                      disaggregation=Disaggregation(prefill=1, decode=2, link_gbps=1.0, link_latency_s=0.003))
    assert {r.request_id: r.output_token_ids for r in res.requests} == reference
    s = res.summary()
    multi = [r for r in res.requests if r.output_len > 1]
    assert s["kv_transfers"] == len(multi) == len(res.extra["transfer_log"])
    assert s["kv_transfer_bytes"] == sum(e["bytes"] for e in res.extra["transfer_log"]) > 0
    for r in res.requests:
        assert r.finish_reason == "length"
        assert r.replica == (0 if r.output_len == 1 else next(e["dst"] for e in res.extra["transfer_log"]
                                                              if e["request_id"] == r.request_id))
    for e in engines:
        e.kv.check_invariants()
        assert e.kv.num_free_blocks == e.kv.num_blocks and not e.kv.req_blocks


def test_an_infinitely_fast_link_with_one_prefill_and_one_decode_gives_colocated_tokens():
    engine = {"max_num_seqs": 4, "block_size": 8, "num_kv_blocks": 64}
    wl = mixed(n=5, gap=0.01, prompts=(17, 30), outs=(9, 5, 2))
    colocated = cluster.run(wl, engines=[tiny_engine(**engine)])
    res = cluster.run(wl, engines=[tiny_engine(**engine), tiny_engine(**engine)],
                      disaggregation=Disaggregation(prefill=1, decode=1, link_gbps=math.inf))
    assert [r.output_token_ids for r in res.requests] == [r.output_token_ids for r in colocated.requests]
    assert all(e["t_end"] == e["t0"] for e in res.extra["transfer_log"])    # free link: no time


def test_transfer_timing_by_hand_in_the_simulator():
    # one request at a time: prefill replica 0, decode replica 1, a 10 Gb/s link with 2 ms latency
    wl = Workload([RequestSpec(i * 1.0, p, 5, request_id=f"q{i}") for i, p in enumerate((100, 16, 33))])
    dis = Disaggregation(prefill=1, decode=1, link_gbps=10, link_latency_s=0.002)
    res = cluster.run(wl, disaggregation=dis, num_kv_blocks=200, block_size=16, **SIM)
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine
    e = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=8, block_size=16, **SIM), clock="virtual")
    per_token = e.executor.cost_model.kv_bytes_per_token_per_gpu
    assert per_token * 16 == BB                                       # the model spec's KV bytes
    log = {x["request_id"]: x for x in res.extra["transfer_log"]}
    pre, dec = res.replicas
    for rec, prompt in zip(res.requests, (100, 16, 33)):
        x = log[rec.request_id]
        blocks = -(-prompt // 16)                                     # prompt tokens rounded to blocks
        assert (x["blocks"], x["bytes"]) == (blocks, blocks * per_token * 16)
        step = next(s for s in pre.steps if s.num_prefill_tokens == prompt)
        t_prefilled = step.start_time + step.duration
        assert rec.ttft == pytest.approx(t_prefilled - rec.arrival_time)    # TTFT from the prefill side
        assert x["t0"] == x["t_ready"] == pytest.approx(t_prefilled)
        assert x["t_end"] == pytest.approx(t_prefilled + blocks * BB / (10e9 / 8) + 0.002)
        first_decode = next(s for s in dec.steps if s.start_time >= x["t0"])
        assert first_decode.start_time == pytest.approx(x["t_end"])        # an idle decoder waits for it
        assert rec.token_times[1] == pytest.approx(first_decode.start_time + first_decode.duration)
    assert res.summary()["kv_transfer_bytes"] == (7 + 1 + 3) * BB
    assert res.extra["pools"]["prefill"] == [0] and res.extra["pools"]["decode"] == [1]
    assert res.extra["pools"]["prefill_results"][0] is pre


def test_each_replicas_link_carries_one_transfer_at_a_time():
    # Two 64-token prompts (4 blocks each) arrive together; a 1 Gb/s link with 5 ms latency.
    wl = Workload([RequestSpec(0.0, 64, 5, request_id=f"q{i}") for i in range(2)])
    busy = 4 * BB / (1e9 / 8)                                         # seconds one transfer holds a link

    def transfers(p, d, **kw):
        dis = Disaggregation(prefill=p, decode=d, link_gbps=1, link_latency_s=0.005, **kw)
        res = cluster.run(wl, router="round_robin", disaggregation=dis, num_kv_blocks=100, block_size=16, **SIM)
        assert all(r.output_len == 5 for r in res.requests)
        return sorted(res.extra["transfer_log"], key=lambda x: x["t0"])

    # one prefill replica sends both: the second waits until the first has left its link
    a, b = transfers(1, 1)
    assert a["t_ready"] == b["t_ready"] == a["t0"]
    assert b["t0"] == pytest.approx(a["t0"] + busy)                  # the latency holds no link
    assert b["t_end"] == pytest.approx(b["t0"] + busy + 0.005)
    # two prefill replicas to two decode replicas: separate links, in parallel
    a, b = transfers(2, 2, decode_router="round_robin")
    assert {a["src"], b["src"]} == {0, 1} and {a["dst"], b["dst"]} == {2, 3}
    assert a["t0"] == b["t0"] == a["t_ready"] and a["t_end"] == pytest.approx(a["t0"] + busy + 0.005)
    # two prefill replicas to one decode replica: its link takes one at a time
    a, b = transfers(2, 1)
    assert a["dst"] == b["dst"] == 2 and b["t0"] == pytest.approx(a["t0"] + busy)


def test_kv_conserved_on_both_pools_and_in_flight_and_no_decode_on_prefill(monkeypatch):
    seen = {"started": 0, "ended": 0}
    start, fire = Disaggregator.try_start, Disaggregator.fire

    def try_start(self, now):
        before = {id(t) for t in self.transfers}
        start(self, now)
        for t in self.transfers:
            if id(t) in before:
                continue
            seen["started"] += 1
            n = t.src.engine.kv.blocks_for(t.req.num_computed_tokens)
            assert len(t.src.engine.kv.block_table(t.rid)) == n == len(t.dst.engine.kv.block_table(t.rid))
            assert t.req not in t.src.engine.scheduler.running and t.req not in t.dst.engine.scheduler.running
        check(self)

    def fire_(self, now):
        tr = min(self.transfers, key=lambda t: t.t_end)
        src_used, dst_used = tr.src.engine.kv.num_used_blocks, tr.dst.engine.kv.num_used_blocks
        held = len(tr.src.engine.kv.block_table(tr.rid))
        fire(self, now)
        seen["ended"] += 1
        assert tr.rid not in tr.src.engine.kv.req_blocks                 # freed on the prefill side, once
        assert tr.src.engine.kv.num_used_blocks == src_used - held
        assert tr.dst.engine.kv.num_used_blocks == dst_used
        assert tr.req in tr.dst.engine.scheduler.running
        check(self)

    def check(self):
        for rep in self.prefill + self.decode:
            rep.engine.kv.check_invariants()
            kv = rep.engine.kv
            # every used block is held by a request of this replica's queues or by one between pools
            mine = {r.request_id for r in rep.engine.scheduler.running} | \
                   {r.request_id for r in rep.engine.scheduler.waiting}
            between = {q.request_id for q, r, _ in self.ready if r is rep} | \
                      {t.rid for t in self.transfers if rep in (t.src, t.dst)}
            assert set(kv.req_blocks) <= mine | between

    monkeypatch.setattr(Disaggregator, "try_start", try_start)
    monkeypatch.setattr(Disaggregator, "fire", fire_)
    wl = Workload([RequestSpec(i * 0.004, 40 + 17 * (i % 5), 30 + (i % 3) * 20, request_id=f"q{i}")
                   for i in range(40)])
    res = cluster.run(wl, router="round_robin", num_kv_blocks=60, block_size=16, max_num_seqs=8,
                      disaggregation=Disaggregation(prefill=2, decode=2, link_gbps=5), **SIM)
    s = res.summary()
    assert seen["started"] == seen["ended"] == s["kv_transfers"] == 40 and s["completed"] == 40
    assert res.extra["max_in_flight_blocks"] > 0
    for i in res.extra["pools"]["prefill"]:
        assert all(st_.num_decode_tokens == 0 for st_ in res.replicas[i].steps)   # no decode on a prefill replica
        assert not res.replicas[i].requests                                         # none finished there
    for i in res.extra["pools"]["decode"]:
        steps = res.replicas[i].steps
        assert sum(st_.num_prefill_tokens for st_ in steps) == 0 or s["num_preemptions"] > 0
    for r in res.requests:
        pre = res.extra["prefill_replica"][r.request_id]
        assert pre in (0, 1) and r.replica in (2, 3)
        x = next(x for x in res.extra["transfer_log"] if x["request_id"] == r.request_id)
        assert r.arrival_time + r.ttft <= x["t_ready"] + 1e-12 and r.token_times[0] == pytest.approx(x["t_ready"])
        assert all(t >= x["t_end"] - 1e-12 for t in r.token_times[1:])            # decoded after the transfer


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="prefill >= 1"):
        Disaggregation(prefill=0, decode=1)
    with pytest.raises(ValueError, match="link_gbps"):
        Disaggregation(link_gbps=0)
    with pytest.raises(ValueError, match="migration"):
        cluster.run(mixed(), disaggregation=Disaggregation(), migration=True, **SIM)


def test_a_request_no_decode_replica_can_hold_is_rejected_with_a_reason():
    wl = Workload([RequestSpec(0.0, 100, 10, request_id="big"), RequestSpec(0.0, 10, 10, request_id="ok")])
    engines = []
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine
    for blocks in (64, 4):
        engines.append(LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=blocks, block_size=16, **SIM), clock="virtual"))
    res = cluster.run(wl, engines=engines, disaggregation=Disaggregation(prefill=1, decode=1))
    big, ok = res.requests
    assert big.finish_reason == "rejected" and "decode replica" in big.error
    assert ok.finish_reason == "length" and ok.output_len == 10


def test_goodput_per_gpu_divides_capacity_by_the_gpu_count():
    def at(rate):
        return Workload([RequestSpec(i / rate, 64, 8, request_id=f"q{i}") for i in range(12)])

    slo = {"ttft": 10.0, "tpot": 10.0}                                # everything meets it
    kw = dict(num_kv_blocks=100, block_size=16, **SIM)
    assert goodput_per_gpu(at, slo, hi=4.0, replicas=2, **kw) == pytest.approx(2.0)
    assert goodput_per_gpu(at, slo, hi=4.0, disaggregation=Disaggregation(prefill=1, decode=3), **kw) == \
        pytest.approx(1.0)
    assert goodput_per_gpu(at, {"ttft": 1e-9}, hi=4.0, replicas=1, **kw) == 0.0


request = st.tuples(st.floats(0, 0.5, allow_nan=False), st.integers(1, 80), st.integers(1, 40))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=14), p=st.integers(1, 2), d=st.integers(1, 2),
       blocks=st.integers(12, 40), router=st.sampled_from(["round_robin", "least_requests"]),
       decode_router=st.sampled_from([None, "round_robin", "least_kv"]), gbps=st.sampled_from([1, 100, math.inf]),
       prefix=st.booleans())
def test_no_request_is_lost_and_kv_is_conserved(reqs, p, d, blocks, router, decode_router, gbps, prefix):
    specs = [RequestSpec(t, n, o, request_id=f"q{i}", prefix_id=i % 2 if prefix else None,
                         prefix_len=min(n, 16) if prefix else 0) for i, (t, n, o) in enumerate(reqs)]
    engines = {}

    def after_step(index, engine, step):
        engines[index] = engine
        for e in engines.values():
            e.kv.check_invariants()

    res = cluster.run(Workload(specs), router=router, on_step=after_step, block_size=8, num_kv_blocks=blocks,
                      max_num_seqs=4, max_model_len=256, enable_prefix_caching=prefix,
                      disaggregation=Disaggregation(prefill=p, decode=d, link_gbps=gbps, link_latency_s=0.001,
                                                    decode_router=decode_router), **SIM)
    assert [r.request_id for r in res.requests] == [s.request_id for s in sorted(specs, key=lambda s: s.arrival_time)]
    assert res.summary()["kv_transfers"] == sum(1 for r in res.requests if r.output_len > 1)
    for r in res.requests:
        assert r.finish_reason in ("length", "rejected"), r
        if r.finish_reason == "length":
            assert r.output_len == next(s.max_tokens for s in specs if s.request_id == r.request_id)
            assert len(r.token_times) == r.output_len and r.token_times == sorted(r.token_times)
    log = {x["request_id"]: x for x in res.extra["transfer_log"]}
    for r in res.requests:
        if r.request_id in log:          # one token on the prefill side, the rest after the transfer
            x = log[r.request_id]
            assert r.token_times[0] == pytest.approx(x["t_ready"]) and x["src"] < p <= x["dst"]
            assert all(t >= x["t_end"] - 1e-12 for t in r.token_times[1:])
    for e in engines.values():
        e.kv.check_invariants()
        assert not e.kv.req_blocks                       # every block free or held by the prefix cache


def test_each_pool_runs_on_its_own_hardware():
    wl = Workload([RequestSpec(0.0, 500, 4, request_id="q0")])
    dis = Disaggregation(prefill=1, decode=2, prefill_hardware="h100", decode_hardware="a100-80g")
    res = cluster.run(wl, disaggregation=dis, num_kv_blocks=100, block_size=16, **SIM)
    assert [r.config["hardware"] for r in res.replicas] == ["h100", "a100-80g", "a100-80g"]
    alone = cluster.run(wl, num_kv_blocks=100, block_size=16, **{**SIM, "hardware": "h100"})
    assert res.requests[0].ttft == pytest.approx(alone.requests[0].ttft)     # prefilled on the H100
    assert res.extra["gpus"] == 3 and res.summary()["routed"] == [1, 1, 0]
