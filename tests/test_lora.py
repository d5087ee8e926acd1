"""Multi-LoRA batching (minibatch.lora): adapters on the real tiny model, the slot rule, the
simulator's costs, and the adapter-aware router.

Greedy outputs with adapter X equal transformers ``generate`` on a model whose weights were
merged here, ``W + scale * B @ A`` (no peft needed); adapters are random, saved as PEFT
directories in a temp dir.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import hf_greedy
from minibatch import LLM, SamplingParams
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.lora import (AdapterSlots, LoRARequest, adapter_view, lora_id, merge_into_hf_state, random_adapter,
                            save_peft)
from minibatch.routing import routers
from minibatch.routing.view import ReplicaView

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


# -- the real model -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """Three adapters (ranks 4, 8, 8), the first on disk, the prompts, and HF references."""
    from transformers import AutoModelForCausalLM
    from minibatch.model.config import ModelConfig
    from minibatch.model.loader import load_hf_config, tiny_model_path

    path = tiny_model_path()
    mc = ModelConfig.from_hf(load_hf_config(path))
    adapters = [random_adapter(mc, rank=r, seed=s, std=0.08) for r, s in ((4, 11), (8, 12), (8, 13))]
    # the third adapts attention only: the MLP's slot parts stay zero
    adapters[2].weights = {k: v for k, v in adapters[2].weights.items() if k[1] in ("q_proj", "v_proj", "o_proj")}
    disk = save_peft(adapters[0], tmp_path_factory.mktemp("lora") / "a1")
    requests = [LoRARequest("a1", 1, str(disk)), LoRARequest("a2", 2, adapter=adapters[1]),
                LoRARequest("a3", 3, adapter=adapters[2])]
    rng = random.Random(5)
    lens = (5, 17, 30, 9, 40, 3, 22, 12, 16, 8)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in lens]
    which = [1, 2, 0, 3, 1, 3, 2, 0, 1, 3]                   # adapter id per prompt (0: base model)
    base = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    models = {0: base}
    state = base.state_dict()
    for i, adapter in enumerate(adapters, start=1):
        m = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        m.load_state_dict(merge_into_hf_state(state, adapter))
        models[i] = m
    expected = [hf_greedy(models[w], p, MAX_NEW) for p, w in zip(prompts, which)]
    base_out = [hf_greedy(base, p, MAX_NEW) for p in prompts]
    return requests, prompts, which, expected, base_out


def _spy_steps(engine):
    """Record the set of adapter ids of every step the executor runs."""
    seen: list[set[int]] = []
    inner = engine.executor.execute

    def execute(batch, kv):
        seen.append({lora_id(r) for r, _ in batch.items})
        return inner(batch, kv)

    engine.executor.execute = execute
    return seen


@pytest.mark.parametrize("config", [dict(max_num_seqs=8), dict(max_num_seqs=8, max_num_batched_tokens=16),
                                    dict(max_num_seqs=8, attention_backend="torch")],
                         ids=["batched", "chunked", "torch-kernels"])
def test_adapters_batched_in_one_step_match_merged_hf(tiny_lora, config):
    requests, prompts, which, expected, base_out = tiny_lora
    llm = LLM("tiny", enable_lora=True, max_loras=2, max_lora_rank=8, **config)
    steps = _spy_steps(llm.engine)
    outs = llm.generate(prompts, GREEDY, lora_request=[requests[w - 1] if w else None for w in which])
    for p, o, ref, w in zip(prompts, outs, expected, which):
        assert o.outputs[0].token_ids == ref, f"prompt of {len(p)} tokens with adapter {w} diverged"
    for w in (1, 2, 3):       # each adapter changes some output: the equality is not the base model's
        assert any(e != b for e, b, x in zip(expected, base_out, which) if x == w), f"adapter {w} changes nothing"
    assert max(len(s - {0}) for s in steps) == 2, "the step never held two adapters at once"
    assert all(len(s - {0}) <= 2 for s in steps), "a step held more adapters than max_loras"
    assert any(len(s - {0}) == 2 and 0 in s for s in steps), "no step mixed two adapters and the base model"
    slots = llm.engine.executor.lora
    assert slots.num_loads >= 3 and slots.num_evictions >= 1


def test_an_adapter_step_can_follow_the_fused_decode_path(tiny_lora):
    """Base-only decode steps take the fused C path; a step with an adapter must not."""
    requests, prompts, which, expected, base_out = tiny_lora
    i = next(i for i, (w, e, b) in enumerate(zip(which, expected, base_out)) if w and e != b)
    llm = LLM("tiny", enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=1)
    assert llm.engine.executor.fused_decode
    outs = llm.generate([prompts[2], prompts[i], prompts[7]], GREEDY, lora_request=[None, requests[which[i] - 1], None])
    assert [o.outputs[0].token_ids for o in outs] == [expected[2], expected[i], expected[7]]


# -- the slot rule (simulator: no model, real scheduler) ------------------------------------------
def _sim_engine(**kw) -> LLMEngine:
    cfg = dict(executor="sim", model="llama-3-8b", enable_lora=True, max_loras=2, max_num_seqs=64, num_kv_blocks=4000)
    return LLMEngine(EngineConfig.from_kwargs(**{**cfg, **kw}), clock="virtual")


def _add(engine, adapter: int, n: int = 1, prompt: int = 64, out: int = 8) -> list[str]:
    lr = LoRARequest(f"a{adapter}", adapter) if adapter else None
    return [engine.add_request([7] * prompt, SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=0.0,
                               lora_request=lr) for _ in range(n)]


def test_a_step_holds_at_most_max_loras_adapters_and_a_third_waits_for_a_slot():
    e = _sim_engine()
    steps = _spy_steps(e)
    a1, a2, a3 = _add(e, 1, 3), _add(e, 2, 3), _add(e, 3, 3)
    base = _add(e, 0, 2)
    while e.has_unfinished_requests():
        e.step()
    assert all(len(s - {0}) <= 2 for s in steps)
    assert steps[0] == {0, 1, 2}, "the first step: adapters 1 and 2 and the base model (not limited)"
    first3 = min(e.requests[i].first_scheduled_time for i in a3)
    done12 = min(max(e.requests[i].finish_time for i in a1), max(e.requests[i].finish_time for i in a2))
    assert first3 >= done12 - 1e-12, "adapter 3 ran before a slot was free"
    assert all(e.requests[i].status.value == "length" for i in a1 + a2 + a3 + base)


def test_a_request_blocked_by_the_slot_rule_does_not_block_later_ones():
    """vLLM skips it and goes on walking the waiting queue (scheduled_loras, v0.11.0)."""
    e = _sim_engine(max_loras=1)
    steps = _spy_steps(e)
    first, blocked, later = _add(e, 1), _add(e, 2), _add(e, 1)
    e.step()
    assert steps[0] == {1}
    assert e.requests[later[0]].first_scheduled_time is not None, "the later adapter-1 request was held back"
    assert e.requests[blocked[0]].first_scheduled_time is None
    assert first


def test_slots_evict_the_least_recently_used_adapter_the_step_does_not_need():
    slots = AdapterSlots(2)
    assert slots.activate({1}) == [(1, 0)]
    assert slots.activate({2}) == [(2, 1)]
    assert slots.activate({1, 0}) == []                       # resident: no load; 0 is the base model
    assert slots.activate({3}) == [(3, 1)], "adapter 2 (idle longest) should have left slot 1"
    assert slots.activate({3, 1}) == []
    assert slots.activate({2, 3}) == [(2, 0)], "adapter 1, not needed by this step, leaves"
    assert (slots.num_loads, slots.num_evictions) == (4, 2)
    with pytest.raises(RuntimeError, match="max_loras"):
        slots.activate({4, 5, 6})


# -- bad adapters ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_llm():
    return LLM("tiny", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4)


def _bad_cases(tmp, mc):
    from minibatch.lora import LoRAAdapter

    big = save_peft(random_adapter(mc, rank=16, seed=1), tmp / "rank16")
    other = random_adapter(mc, rank=4, seed=2)
    other.weights[(0, "q_proj")] = (torch.zeros(4, 7), torch.zeros(256, 4))
    no_cfg = tmp / "no_cfg"
    no_cfg.mkdir()
    return {
        "missing": (LoRARequest("gone", 5, str(tmp / "nowhere")), "no such directory"),
        "no-config": (LoRARequest("nocfg", 6, str(no_cfg)), "has no adapter_config.json"),
        "rank": (LoRARequest("big", 7, str(big)), "rank 16 but max_lora_rank is 8"),
        "shape": (LoRARequest("other", 8, adapter=other), r"lora_A \(4, 7\).*needs \(4, 256\)"),
        "id": (LoRARequest("zero", 0, adapter=other), "lora_int_id must be an integer >= 1"),
        "empty": (LoRARequest("empty", 9, adapter=LoRAAdapter(4, 4.0, {})), "has no LoRA weights"),
    }


@pytest.mark.parametrize("case", ["missing", "no-config", "rank", "shape", "id", "empty"])
def test_a_bad_adapter_is_a_clear_error_and_queues_nothing(lora_llm, tmp_path, case):
    engine = lora_llm.engine
    lr, message = _bad_cases(tmp_path, engine.executor.model_config)[case]
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6, 7], GREEDY, lora_request=lr)
    assert not engine.has_unfinished_requests()


def test_lora_request_without_enable_lora_and_a_reused_id_are_errors(lora_llm, tiny_lora):
    requests = tiny_lora[0]
    with pytest.raises(ValueError, match="without enable_lora=True"):
        LLM("tiny").engine.add_request([5, 6], GREEDY, lora_request=requests[1])
    e = lora_llm.engine
    e.executor.add_lora(requests[1])
    with pytest.raises(ValueError, match="lora_int_id 2 is already adapter 'a2'"):
        e.executor.add_lora(LoRARequest("someone-else", 2, adapter=requests[1].adapter))


@pytest.mark.parametrize("policy", ["continuous", "lpm"])
def test_prefix_caching_keys_blocks_by_adapter(tiny_lora, policy):
    """A block computed with one adapter (or the base model) is never a hit for another: before
    blocks were keyed by adapter, an adapter's request after a base request with the same prompt
    reused the base model's KV and came out with the base model's tokens. Within one adapter the
    cache still hits. ``lpm`` walks the radix tree, which indexes base-model blocks only."""
    requests, prompts, which, expected, base_out = tiny_lora
    i = next(i for i, (p, w, e, b) in enumerate(zip(prompts, which, expected, base_out))
             if w and e != b and len(p) > 32)
    prompt, adapter = prompts[i], requests[which[i] - 1]
    llm = LLM("tiny", enable_lora=True, enable_prefix_caching=True, max_loras=2, max_lora_rank=8, policy=policy)
    full = (len(prompt) - 1) // 16 * 16           # whole blocks a hit can serve (one token is always computed)
    runs = [(None, base_out[i], 0), (adapter, expected[i], 0), (adapter, expected[i], full), (None, base_out[i], full)]
    for lora, want, cached in runs:
        rid = llm.engine.add_request(prompt, GREEDY, lora_request=lora)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        req = llm.engine.requests[rid]
        assert req.output_token_ids == want, f"{'adapter' if lora else 'base'} request: wrong tokens"
        assert req.num_cached_tokens == cached, f"{'adapter' if lora else 'base'} request: {req.num_cached_tokens} cached"
    llm.engine.kv.radix.check()


def test_one_bad_adapter_never_fails_another_request(lora_llm, tiny_lora, tmp_path):
    requests, prompts, which, expected, _ = tiny_lora
    bad = LoRARequest("gone", 40, str(tmp_path / "nowhere"))
    outs = lora_llm.generate([prompts[0], prompts[1], prompts[2]], GREEDY, lora_request=[requests[0], bad, None])
    assert outs[1].outputs[0].finish_reason == "rejected" and "no such directory" in outs[1].error
    assert outs[0].outputs[0].token_ids == expected[0] and outs[2].outputs[0].token_ids == expected[2]


# -- the simulator's costs ------------------------------------------------------------------------
def test_the_simulator_prices_adapter_loads_and_the_lora_gemms():
    from minibatch.sim import make_cost_model
    from minibatch.sim.lora import adapter_bytes, load_time, lora_step_time

    cm = make_cost_model("llama-3-8b", "a100-80g")
    # q, k, v, o, gate, up, down of Llama-3-8B: (4096+4096) + 2 (4096+1024) + (4096+4096) + 3 (4096+14336)
    assert adapter_bytes(cm.model, 16) == 32 * 16 * 81920 * 2
    assert load_time(cm, 16) == pytest.approx(adapter_bytes(cm.model, 16) / 25e9)
    one, eight = lora_step_time(cm, 64, 1, 16), lora_step_time(cm, 64, 8, 16)
    assert 0 < one < eight, "at decode sizes each adapter in the step adds its weights' bytes"
    e = _sim_engine(max_loras=1)
    _add(e, 1, 1)
    e.step()                                 # loads adapter 1, prefill
    t_load = e.steps[-1].duration
    plain = _sim_engine(enable_lora=False)
    _add(plain, 0, 1)
    plain.step()
    assert t_load - plain.steps[-1].duration == pytest.approx(
        load_time(e.executor.cost_model, 16) + lora_step_time(e.executor.cost_model, 64, 1, 16))


def test_more_adapter_slots_raise_simulated_throughput_with_many_adapters():
    """8 adapters' requests at once: one slot serialises them adapter by adapter."""
    ends = {}
    for slots in (1, 8):
        e = _sim_engine(max_loras=slots)
        for i in range(64):
            _add(e, i % 8 + 1, 1, prompt=128, out=32)
        while e.has_unfinished_requests():
            e.step()
        ends[slots] = e.clock.now()
    assert ends[8] < 0.8 * ends[1]


# -- the router -----------------------------------------------------------------------------------
def _view(i, waiting=0, running=(), queued=(), max_loras=2, kv_used=0):
    return ReplicaView(i, "m", 1, waiting, kv_used, 100, 16, 0, 0, running_adapters=frozenset(running),
                       waiting_adapters=frozenset(queued), max_loras=max_loras)


class _Req:
    def __init__(self, lora_name=None):
        self.lora_name = lora_name


def test_lora_affinity_prefers_a_replica_running_or_queueing_the_adapter():
    r = routers.get("lora_affinity")
    views = [_view(0, running={"x"}), _view(1, running={"a"}, waiting=1), _view(2)]
    assert r.choose(_Req("a"), views, 0.0) == 1, "affinity beats a shorter queue (GIE's filter order)"
    views = [_view(0, running={"x", "y"}), _view(1, queued={"a"}), _view(2, running={"z"})]
    assert r.choose(_Req("a"), views, 0.0) == 1


def test_lora_affinity_falls_back_to_a_replica_with_a_free_slot_then_least_queue():
    r = routers.get("lora_affinity")
    full = _view(0, running={"x", "y"})
    assert r.choose(_Req("a"), [full, _view(1, running={"z"}, waiting=3)], 0.0) == 1, "the one with room"
    views = [_view(0, running={"x", "y"}, waiting=9), _view(1, running={"z", "w"}, waiting=1)]
    assert r.choose(_Req("a"), views, 0.0) == 1, "no affinity, no room: least queue"
    assert r.choose(_Req(None), [_view(0, waiting=5), _view(1, waiting=0)], 0.0) == 1


def test_lora_affinity_leaves_affinity_for_load_when_queues_are_long():
    """Every replica past the queue threshold: least queue first, affinity only among those left."""
    r = routers.get("lora_affinity", queue_threshold=4)
    views = [_view(0, running={"a"}, waiting=40), _view(1, running={"b"}, waiting=5)]
    assert r.choose(_Req("a"), views, 0.0) == 1
    assert routers.get("lora_affinity").choose(_Req("a"), views, 0.0) == 0


def test_the_replica_view_reports_running_and_waiting_adapters():
    e = _sim_engine(max_loras=1, max_num_seqs=1)
    _add(e, 1), _add(e, 2)
    e.step()
    v = adapter_view(e)
    assert v == {"running_adapters": frozenset({"a1"}), "waiting_adapters": frozenset({"a2"}), "max_loras": 1}
    assert adapter_view(_sim_engine(enable_lora=False)) == {}


def test_lora_affinity_loads_fewer_adapters_and_cuts_ttft_on_a_cluster():
    from minibatch.cluster.runner import run
    from minibatch.sim.lora import tenant_adapter_engine
    from minibatch.workload.synthetic import synthetic

    wl = synthetic(240, rate=12.0, input_len=400, output_len=100, seed=3, tenants=[f"t{i}" for i in range(16)])
    got = {}
    for router, kw in (("least_requests", {}), ("lora_affinity", {"adapter_field": "tenant"})):
        engines = [tenant_adapter_engine(model="llama-3-8b", max_loras=4) for _ in range(4)]
        s = run(wl, engines=engines, router=router, router_kwargs=kw).summary()
        got[router] = (sum(e.executor.lora.num_loads for e in engines), s["ttft_p90"], s["completed"])
    assert got["lora_affinity"][2] == got["least_requests"][2] == 240
    assert got["lora_affinity"][0] < 0.6 * got["least_requests"][0]
    assert got["lora_affinity"][1] < got["least_requests"][1]
