"""minibatch.cluster.multimodel: what fits in a share of a GPU, how a partitioned GPU and a
time-sliced GPU run their models, and routing by model over several GPUs (hand-made cases)."""

from __future__ import annotations

import math

import pytest

from minibatch import cluster
from minibatch.cluster import multimodel as mm
from minibatch.sim import get_model_spec, make_cost_model
from minibatch.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES, ModelDoesNotFitError
from minibatch.swap import HOST_LINK_BYTES_PER_S
from minibatch.workload import RequestSpec, Workload
from tests.cluster.helpers import record_dicts

HW = "a100-80g"
GiB = 2 ** 30
A, B = "llama-2-7b", "llama-2-13b"


def _wl(*reqs):
    """(arrival, model, prompt, output) tuples -> a workload with ids q0, q1 ..."""
    return Workload([RequestSpec(t, p, o, request_id=f"q{i}", model=m) for i, (t, m, p, o) in enumerate(reqs)])


def _mixed(n=40, gap=0.05):
    return _wl(*[(gap * i, A if i % 3 else B, 64 + 8 * (i % 5), 6 + i % 7) for i in range(n)])


# -- memory -------------------------------------------------------------------------------------

def test_kv_tokens_is_what_the_share_leaves_after_weights_and_reserve():
    cm = make_cost_model(A, HW)
    mem = 80 * GiB
    for share in (0.3, 0.5, 0.9):
        expect = math.floor((share * mem - get_model_spec(A).weight_bytes - DEFAULT_ACTIVATION_RESERVE_BYTES)
                            / cm.kv_bytes_per_token_per_gpu)
        assert mm.kv_tokens(A, HW, share) == expect
    assert mm.kv_tokens(A, HW, 0.15) == 0           # 12 GiB < 12.6 GiB of weights: nothing fits


def test_partition_shares_give_each_model_its_weights_and_a_part_of_the_rest():
    archs = {"a": A, "b": B}
    even = mm.partition_shares(archs, HW)
    assert sum(even.values()) == pytest.approx(0.9)
    kv_bytes = {m: even[m] * 80 * GiB - mm.weight_bytes(a, HW) - DEFAULT_ACTIVATION_RESERVE_BYTES
                for m, a in archs.items()}
    assert kv_bytes["a"] == pytest.approx(kv_bytes["b"])           # equal parts of what is left
    skew = mm.partition_shares(archs, HW, kv_split={"a": 3, "b": 1})
    kv3 = {m: skew[m] * 80 * GiB - mm.weight_bytes(a, HW) - DEFAULT_ACTIVATION_RESERVE_BYTES
           for m, a in archs.items()}
    assert kv3["a"] == pytest.approx(3 * kv3["b"])
    with pytest.raises(ModelDoesNotFitError, match="do not fit together"):
        mm.partition_shares({"big": "llama-2-70b", "b": B}, HW)
    report = mm.fit_report(archs, HW, even)
    assert all(r["fits"] and r["min_kv_tokens"] == 4096 for r in report.values())
    assert report["a"]["kv_tokens"] == mm.kv_tokens(A, HW, even["a"])


def test_run_refuses_what_does_not_fit():
    wl = _wl((0.0, "x", 16, 2), (0.0, "y", 16, 2))
    with pytest.raises(ValueError, match="do not fit together"):    # two 13B on a 40 GB A100
        mm.run(wl, [["x", "y"]], "partition", "a100-40g", models={"x": B, "y": B})
    with pytest.raises(ValueError, match="needs 4096"):             # fits, but less KV than one max-length request
        mm.run(wl, [["x", "y"]], "partition", HW, models={"x": A, "y": A}, shares={"x": 0.17, "y": 0.5})
    with pytest.raises(ValueError, match="more than the whole GPU"):
        mm.run(wl, [["x", "y"]], "partition", HW, models={"x": A, "y": A}, shares={"x": 0.6, "y": 0.6})
    with pytest.raises(ValueError, match="holds 0 KV tokens"):      # time-slicing: each model alone must fit
        mm.run(wl, [["x", "y"]], "time_slice", "a100-40g", models={"x": "llama-2-70b", "y": A})
    mm.run(wl, [["x", "y"]], "time_slice", "a100-40g", models={"x": B, "y": B})   # one at a time: fits


def test_switch_seconds_is_the_weight_bytes_over_the_host_link():
    assert mm.switch_seconds(B, HW) == pytest.approx(get_model_spec(B).weight_bytes / HOST_LINK_BYTES_PER_S)
    assert mm.switch_seconds(B, HW, 50e9, 0.2) == pytest.approx(get_model_spec(B).weight_bytes / 50e9 + 0.2)
    assert mm.switch_seconds(B, "2xa100-80g") == pytest.approx(mm.switch_seconds(B, HW) / 2)   # a link per GPU


# -- a GPU per model ------------------------------------------------------------------------------

def test_one_model_per_gpu_is_cluster_run_with_models():
    wl = _mixed()
    ded = mm.run(wl, [[A], [B]], "partition", HW)
    ref = cluster.run(wl, models=[A, B], router="least_requests", executor="sim", hardware=HW)
    assert record_dicts(ded.requests, drop=()) == record_dicts(ref.requests, drop=())
    assert [e.steps for e in ded.engines] == [r.steps for r in ref.replicas]
    s = ded.summary()
    assert s["gpus"] == 2 and s["switches"] == 0 and s["routed"] == [26, 14]    # i % 3 == 0 asks for B
    assert s["gpu_seconds"] == pytest.approx(ref.summary()["replica_seconds"])


# -- memory partitioning ------------------------------------------------------------------------

def test_partitioned_models_get_their_share_of_kv_and_take_turns_on_the_gpu():
    wl = _mixed()
    res = mm.run(wl, [[A, B]], "partition", HW)
    shares = mm.partition_shares({A: A, B: B}, HW)
    assert [e.kv_blocks_total for e in res.engines] == [mm.kv_tokens(m, HW, shares[m]) // 16 for m in (A, B)]
    steps = sorted(((s.start_time, s.duration, e.extra["model"]) for e in res.engines for s in e.steps))
    for (t0, d0, _), (t1, _, _) in zip(steps, steps[1:]):
        assert t1 >= t0 + d0 - 1e-12, "one GPU runs one step at a time"
    # While both models have work, their steps alternate: model B's requests arrive every 0.15 s,
    # so some B step follows every A step within a run of at most a few A steps.
    models = [m for _, _, m in steps]
    assert sum(1 for a, b in zip(models, models[1:]) if a != b) > 20
    assert all(r.finish_reason == "length" for r in res.requests)
    assert res.summary()["gpus"] == 1 and res.summary()["routed"] == [40]


def test_a_partitioned_gpu_is_slower_than_two_gpus_but_costs_half():
    wl = _wl(*[(0.0, A, 128, 32) for _ in range(8)] + [(0.0, B, 128, 32) for _ in range(8)])
    shared = mm.run(wl, [[A, B]], "partition", HW).summary()
    ded = mm.run(wl, [[A], [B]], "partition", HW).summary()
    assert shared["duration_s"] > 1.5 * ded["duration_s"] * 0.9       # the steps of both now add up
    assert shared["busy_gpu_seconds"] == pytest.approx(ded["busy_gpu_seconds"], rel=0.02)
    assert shared["gpu_seconds"] < ded["gpu_seconds"]


# -- time-slicing -------------------------------------------------------------------------------

def test_time_slice_loads_the_other_model_after_the_resident_one_drains():
    wl = _wl((0.0, A, 64, 40), (0.01, B, 64, 5))
    res = mm.run(wl, [[A, B]], "time_slice", HW)
    a, b = res.requests
    sw = mm.switch_seconds(B, HW)
    assert res.switches == [{"gpu": 0, "t": pytest.approx(a.finish_time), "from": A, "to": B, "seconds": sw}]
    assert b.first_scheduled_time == pytest.approx(a.finish_time + sw)
    steps_b = res.engines[1].steps
    assert steps_b[0].start_time == pytest.approx(a.finish_time + sw)
    assert [e.kv_blocks_total for e in res.engines] == [mm.kv_tokens(m, HW, 0.9) // 16 for m in (A, B)]
    s = res.summary()
    assert s["switches"] == 1 and s["switch_seconds"] == pytest.approx(sw)
    assert s["busy_gpu_seconds"] == pytest.approx(sum(x.duration for x in res.steps) + sw)


def test_time_slice_hands_the_gpu_over_after_max_slice_and_holds_later_arrivals():
    """Model A has a long request every 0.1 s (it never runs out of work); one B request at
    0.3 s. After max_slice_s = 1 s, A drains what it holds; A's requests arriving meanwhile wait
    for A's next slice."""
    reqs = [(0.1 * i, A, 32, 100) for i in range(40)] + [(0.3, B, 32, 4)]
    wl = _wl(*sorted(reqs, key=lambda r: r[0]))
    res = mm.run(wl, [[A, B]], "time_slice", HW, max_slice_s=1.0)
    first, back = res.switches[0], res.switches[1]
    assert (first["from"], first["to"], back["from"], back["to"]) == (A, B, B, A)
    b = next(r for r in res.requests if r.model == B)
    assert first["t"] >= 1.0, "A keeps the GPU for its slice"
    a_reqs = [r for r in res.requests if r.model == A]
    before = [r for r in a_reqs if r.first_scheduled_time < first["t"]]
    held = [r for r in a_reqs if r.first_scheduled_time >= first["t"] and r.arrival_time < back["t"]]
    assert max(r.finish_time for r in before) == pytest.approx(first["t"]), "the switch starts when A has drained"
    assert held and all(r.first_scheduled_time >= back["t"] + back["seconds"] - 1e-9 for r in held), \
        "A's arrivals during the drain and B's slice wait for A's next slice"
    assert len(before) + len(held) < len(a_reqs)
    assert b.first_scheduled_time == pytest.approx(first["t"] + first["seconds"])
    assert all(r.finish_reason == "length" for r in res.requests)


def test_time_slice_never_runs_two_models_or_a_switch_at_once():
    res = mm.run(_mixed(60, 0.03), [[A, B]], "time_slice", HW, max_slice_s=0.5)
    spans = [(s.start_time, s.start_time + s.duration) for s in res.steps]
    spans += [(x["t"], x["t"] + x["seconds"]) for x in res.switches]
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert b0 >= a1 - 1e-12
    assert len(res.switches) >= 2 and all(r.completed for r in res.requests)


# -- routing by model -----------------------------------------------------------------------------

def test_a_model_no_gpu_serves_is_rejected():
    res = mm.run(_wl((0.0, A, 16, 2), (0.0, "gpt-9", 16, 2)), [[A]], "partition", HW)
    bad = res.requests[1]
    assert bad.finish_reason == "rejected" and bad.replica is None
    assert bad.error == f"no GPU serves model 'gpt-9'; the placement serves ['{A}']"
    assert res.summary()["routed"] == [1]


def test_with_every_model_on_every_gpu_a_burst_of_one_model_uses_both():
    """Two fine-tunes of one base (AlpaServe's statistical multiplexing): a burst of "chat"
    goes to one GPU when each model has its own, to both when both GPUs hold both models."""
    archs = {"chat": A, "code": A}
    burst = _wl(*[(0.01 * i, "chat", 256, 32) for i in range(20)])
    own = mm.run(burst, [["chat"], ["code"]], "partition", HW, models=archs)
    pooled = mm.run(burst, [["chat", "code"], ["chat", "code"]], "partition", HW, models=archs)
    assert own.summary()["routed"] == [20, 0]
    assert pooled.summary()["routed"] == [10, 10]
    assert max(r.e2e for r in pooled.requests) < max(r.e2e for r in own.requests)
    assert {e.extra["arch"] for e in pooled.engines} == {A}
