"""Async (overlap) scheduling (``EngineConfig.async_scheduling``, minibatch.overlap): step N+1 is
planned while step N runs. Greedy outputs stay token-equal; a finished request wastes its
slot in the next step; a request arriving mid-step gets its first token one step later."""

from __future__ import annotations

import random
import threading

import pytest

from conftest import ARCHS, FixedStepTime, drive, hf_greedy
from kv_checking import KVCheckingExecutor
from minibatch import LLM, SamplingParams
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.executor import ModelExecutor
from minibatch.request import RequestStatus
from minibatch.runner import run
from minibatch.workload import synthetic

MAX_NEW = 10
PROMPT_LENS = (1, 15, 16, 17, 45, 100)
CONFIGS = {
    "batched": dict(max_num_seqs=16),
    "chunked": dict(max_num_seqs=16, max_num_batched_tokens=24),
    # 14 blocks of 8 tokens hold ~112 tokens: far less than the batch needs.
    "preempting": dict(max_num_seqs=16, num_kv_blocks=14, block_size=8),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lens]


def tokens(llm, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


@pytest.fixture(scope="module")
def references(checkpoints):
    out = {}
    for i, (arch, (path, hf_model)) in enumerate(checkpoints.items()):
        ps = prompts(i)
        out[arch] = (path, ps, [hf_greedy(hf_model, p, MAX_NEW) for p in ps])
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers_with_async_scheduling(references, arch, config):
    path, ps, expected = references[arch]
    llm = LLM(str(path), async_scheduling=True, **CONFIGS[config])
    assert llm.engine.overlap.threaded, "the real model's forward should run on the worker thread"
    assert tokens(llm, ps) == expected
    engine = llm.engine
    if config == "preempting":
        assert engine.scheduler.num_preemptions > 0, "the small pool should preempt requests in flight"
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.overlap.num_discarded_tokens == len(ps)     # each request's step after its last


@pytest.mark.parametrize("policy", ["continuous", "sglang", "mlfq", "static"])
def test_async_equals_sync_for_every_policy(policy):
    ps = prompts(1, (3, 40, 9, 70, 25))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6, 3, 8)]
    kw = dict(policy=policy, max_num_seqs=4, max_num_batched_tokens=48)
    sync = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(ps, params)]
    llm = LLM("tiny", async_scheduling=True, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, params)] == sync
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def _fixed_engine(async_scheduling: bool, step_s: float = 0.01, **kw) -> LLMEngine:
    cfg = EngineConfig(model="tiny", async_scheduling=async_scheduling, **kw)
    return LLMEngine(cfg, clock="virtual", executor=FixedStepTime(ModelExecutor(cfg), step_s))


def test_each_finished_request_wastes_its_slot_in_the_next_step():
    ps = prompts(2, (5, 12, 30, 8))
    maxes = (3, 5, 7, 9)

    def go(async_scheduling):
        e = _fixed_engine(async_scheduling, max_num_seqs=8)
        ids = [e.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
               for p, m in zip(ps, maxes)]
        drive(e, limit=100)
        return e, [e.output(i).outputs[0].token_ids for i in ids]

    sync, sync_out = go(False)
    e, out = go(True)
    assert out == sync_out
    assert sync.overlap is None
    # Every request was planned into the step after the one that finished it.
    assert e.overlap.num_wasted_slots == e.overlap.num_discarded_tokens == len(ps)
    assert len(e.steps) == len(sync.steps) + 1          # the last step computes only discarded tokens
    # Each wasted slot is a sequence of a recorded step: the steps hold one more sequence per request.
    assert sum(s.num_seqs for s in e.steps) == sum(s.num_seqs for s in sync.steps) + len(ps)


def test_a_stop_token_finish_matches_sync_and_discards_the_token_in_flight():
    p = prompts(3, (20,))[0]
    free = LLM("tiny").generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    sync = LLM("tiny").generate([p], params)[0].outputs[0]
    llm = LLM("tiny", async_scheduling=True)
    out = llm.generate([p], params)[0].outputs[0]
    assert out.token_ids == sync.token_ids and out.token_ids[-1] == stop
    assert out.finish_reason == sync.finish_reason == "stop"
    assert llm.engine.overlap.num_discarded_tokens == 1


def test_a_request_arriving_mid_step_gets_its_first_token_one_step_later():
    d = 0.01
    ttft = {}
    for mode in (False, True):
        e = _fixed_engine(mode, d, max_num_seqs=8)
        e.add_request(prompts(4, (10,))[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        for _ in range(4):
            e.step()
        late = e.add_request(prompts(5, (6,))[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        drive(e, limit=100)
        r = e.requests[late]
        ttft[mode] = r.first_token_time - r.arrival_time
    assert ttft[False] == pytest.approx(d)
    assert ttft[True] == pytest.approx(2 * d)       # planned into the step after the one in flight


def test_abort_while_a_step_is_in_flight():
    ps = prompts(6, (12, 30, 7))
    sync = tokens(LLM("tiny", max_num_seqs=4), ps)
    llm = LLM("tiny", async_scheduling=True, max_num_seqs=4)
    e = llm.engine
    ids = [e.add_request(p, GREEDY) for p in ps]
    for _ in range(3):
        e.step()
    assert e.overlap.busy and any(r.request_id == ids[1] for r, _ in e.overlap.inflight.batch.items)
    assert e.abort_request(ids[1])
    drive(e, limit=100)
    aborted = e.requests[ids[1]]
    assert aborted.status is RequestStatus.FINISHED_ABORTED and min(aborted.output_token_ids) >= 0
    assert [e.output(i).outputs[0].token_ids for i in (ids[0], ids[2])] == [sync[0], sync[2]]
    assert e.overlap.num_wasted_slots >= 1            # its slot in the step in flight
    e.kv.check_invariants()
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_no_output_a_caller_reads_holds_a_placeholder():
    llm = LLM("tiny", async_scheduling=True, max_num_seqs=4)
    e = llm.engine
    ids = [e.add_request(p, GREEDY) for p in prompts(7, (5, 9))]
    seen = []
    while e.has_unfinished_requests():
        e.step()
        seen += [t for i in ids for t in e.requests[i].output_token_ids]
    assert seen and min(seen) >= 0


def _kv_checked_run(async_scheduling: bool):
    rng = random.Random(8)
    shared = [rng.randrange(3, 90) for _ in range(24)]
    cfg = EngineConfig(model="tiny", executor="sim", block_size=4, num_kv_blocks=24, max_num_seqs=6,
                       max_num_batched_tokens=32, enable_prefix_caching=True, async_scheduling=async_scheduling)
    e = LLMEngine(cfg, clock="virtual", executor=KVCheckingExecutor(24, 4))
    reqs = [(shared[:rng.randrange(4, 24)] + [rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))],
             rng.randrange(2, 14)) for _ in range(24)]
    ids = []

    def arrive(i):
        while reqs and i % 3 == 0 and len(ids) % 3 != 2:
            p, m = reqs.pop()
            ids.append(e.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)))
        if reqs and i % 3 == 0:
            p, m = reqs.pop()
            ids.append(e.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)))
        e.kv.check_invariants()
        return bool(reqs)

    drive(e, limit=2000, before_step=arrive)
    e.kv.check_invariants()
    assert e.kv.num_free_blocks == e.kv.num_blocks
    return e, [e.requests[i].output_token_ids for i in ids]


def test_kv_stays_consistent_with_prefix_caching_and_preemption():
    """KVCheckingExecutor asserts on every read that each request finds its own tokens, and its
    tokens depend on what it reads: equal outputs mean equal KV contents."""
    sync, expected = _kv_checked_run(False)
    e, out = _kv_checked_run(True)
    assert e.scheduler.num_preemptions > 0 and e.kv.prefix_hits > 0
    assert out == expected


def test_the_forward_runs_on_the_worker_thread():
    llm = LLM("tiny", async_scheduling=True, max_num_seqs=4)
    model = llm.engine.executor.model
    threads = set()
    forward = model.forward

    def spy(*a, **k):
        threads.add(threading.current_thread().name)
        return forward(*a, **k)

    model.forward = spy
    ps = prompts(9, (6, 11))
    assert tokens(llm, ps) == tokens(LLM("tiny", max_num_seqs=4), ps)
    assert threads and all(n.startswith("minibatch-forward") for n in threads)


def test_async_scheduling_rejects_what_it_cannot_overlap():
    with pytest.raises(ValueError, match="async_scheduling needs preemption_mode='recompute'"):
        EngineConfig(async_scheduling=True, preemption_mode="swap").validate()
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(async_scheduling="yes").validate()


def test_the_simulator_overlaps_the_cpu_overhead_with_the_forward():
    wl = synthetic(40, rate=20, seed=3, input_len=200, output_len=100)
    kw = dict(executor="sim", model="llama-3-8b", hardware="h100", max_num_seqs=64)
    engine = LLMEngine(EngineConfig(async_scheduling=True, **kw), clock="virtual")
    sync, asy = run(wl, **kw), run(wl, engine=engine)
    overhead = engine.executor.cost_model.step_overhead_s
    for s in asy.steps:          # a step lasts the longer of the forward and the CPU overhead
        assert s.duration == pytest.approx(max(s.forward_time, overhead))
    mean = lambda r: sum(s.duration for s in r.steps) / len(r.steps)     # noqa: E731
    assert mean(asy) < mean(sync)
    assert asy.summary()["completed"] == sync.summary()["completed"] == 40


def test_stop_strings_and_eos_finish_as_in_the_synchronous_engine():
    """The stop check runs in step N's bookkeeping while N+1 is in flight: the output (text, tokens,
    reason) is the synchronous one, and the token computed after the stop is discarded."""
    prompts_ = ["Once upon a time", "The little dog", "One day, Lily"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=["garden", "."]),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["ball"], include_stop_str_in_output=True),
              SamplingParams(temperature=0.0, max_tokens=60)]                        # EOS may end it
    sync = LLM("tiny", max_num_seqs=4).generate(prompts_, params)
    llm = LLM("tiny", max_num_seqs=4, async_scheduling=True)
    out = llm.generate(prompts_, params)
    for a, s in zip(out, sync):
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) == \
               (s.outputs[0].text, s.outputs[0].token_ids, s.outputs[0].finish_reason)
    assert any(s.outputs[0].finish_reason == "stop" for s in sync)
    assert llm.engine.overlap.num_discarded_tokens == len(prompts_)


def test_the_servers_engine_thread_streams_the_synchronous_tokens():
    """The OpenAI server's AsyncEngine drives step() from its own thread: the streamed deltas
    of an async-scheduling engine are the synchronous engine's tokens, and no placeholder."""
    import asyncio

    from minibatch.serving.async_engine import AsyncEngine

    ps = prompts(10, (6, 20, 11))
    sync = tokens(LLM("tiny", max_num_seqs=4), ps)
    ae = AsyncEngine(LLM("tiny", max_num_seqs=4, async_scheduling=True).engine)

    async def go():
        streams = [await ae.add_request(p, GREEDY, f"s{i}") for i, p in enumerate(ps)]
        out = []
        for s in streams:
            ids = []
            async for delta in s:
                ids += delta.token_ids
            out.append((ids, s.finish_reason))
        return out

    try:
        got = asyncio.run(asyncio.wait_for(go(), timeout=120))
    finally:
        ae.shutdown()
    assert [ids for ids, _ in got] == sync and {r for _, r in got} == {"length"}
