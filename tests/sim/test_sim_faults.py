"""Chapter 29's engine faults: a slow replica stretches its steps and nothing else; a KV leak keeps
blocks out of the pool for good, shows on an idle engine and fails the block-conservation check."""

from __future__ import annotations

import pytest

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.runner import run
from minibatch.sim.faults import leak_kv, slow_down
from minibatch.workload import synthetic, uniform

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=16)


def engine(**kw):
    return LLMEngine(EngineConfig.from_kwargs(**{**SIM, **kw}), clock="virtual")


@pytest.fixture(scope="module")
def workload():
    return synthetic(60, rate=float("inf"), input_len=uniform(32, 128), output_len=uniform(8, 48), seed=7)


def test_slow_down_multiplies_step_times_from_its_start_and_changes_no_decision(workload):
    calm = run(workload, engine=engine())
    e = engine()
    slow = slow_down(e, factor=3.0, start_s=0.5)
    hurt = run(workload, engine=e)
    assert len(hurt.steps) == len(calm.steps)
    for a, b in zip(calm.steps, hurt.steps):
        assert (a.num_prefill_tokens, a.num_decode_tokens) == (b.num_prefill_tokens, b.num_decode_tokens)
        factor = 3.0 if b.start_time >= 0.5 else 1.0
        assert b.duration == pytest.approx(factor * a.duration)
    assert 0 < slow.num_slowed_steps < len(hurt.steps)
    assert hurt.summary()["duration_s"] > 2 * calm.summary()["duration_s"]
    assert e.executor.num_kv_blocks == e.kv.num_blocks      # the wrapper passes attributes through
    with pytest.raises(ValueError):
        slow_down(engine(), factor=0)


def test_a_kv_leak_keeps_blocks_out_of_an_idle_pool_and_fails_the_conservation_check(workload):
    clean = engine()
    run(workload, engine=clean)
    assert clean.kv.num_used_blocks == 0
    clean.kv.check_invariants()

    e = engine()
    leak = leak_kv(e, every=5)
    res = run(workload, engine=e)
    assert all(r.finish_reason == "length" for r in res.requests), "the leak loses no request, only blocks"
    assert len(leak.leaked_requests) == len(workload) // 5
    assert leak.num_leaked_blocks > 0
    assert e.kv.num_used_blocks == leak.num_leaked_blocks, "an idle engine still holds the leaked blocks"
    assert e.kv.usage > 0 and not e.scheduler.running and not e.scheduler.waiting
    with pytest.raises(AssertionError, match="owners"):
        e.kv.check_invariants()
    leak.remove()
    assert e.kv.free.__func__ is type(e.kv).free


def test_a_leak_that_starts_late_leaks_only_after_its_start(workload):
    e = engine()
    leak = leak_kv(e, every=1, start_s=1e9)
    run(workload, engine=e)
    assert leak.num_leaked_blocks == 0 and e.kv.num_used_blocks == 0


def test_a_kv_leak_ends_in_preemptions_that_a_sound_pool_never_needs():
    wl = synthetic(300, rate=40.0, input_len=uniform(64, 256), output_len=uniform(32, 128), seed=3)
    kw = dict(num_kv_blocks=400)
    calm = run(wl, engine=engine(**kw))
    e = engine(**kw)
    leak_kv(e, every=25)
    hurt = run(wl, engine=e)
    assert calm.summary()["num_preemptions"] == 0
    assert hurt.summary()["num_preemptions"] > 0
    assert all(r.finish_reason in ("length", "rejected") for r in hurt.requests)
    with pytest.raises(ValueError):
        leak_kv(engine(), every=0)
