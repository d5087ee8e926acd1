"""KV offloading: a host tier below the device pool keeps evicted prefix blocks and loads them back."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch import LLM, SamplingParams
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.kv_cache import hash_block
from minibatch.kv_offload import GiB, HostKVTier
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.sim.offload import (HOST_LINK_BYTES_PER_S, load_time, lru_hit_rate, recompute_time, stack_distances,
                                   transfer_time)
from minibatch.workload import RequestSpec, Workload

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conftest import drive, hf_greedy  # noqa: E402
from kv_checking import KVCheckingExecutor  # noqa: E402

BS = 4
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def _engine(num_blocks=10, host=16, policy="write_back", **kw):
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=BS, enable_prefix_caching=True, max_num_seqs=2,
                          kv_offload_blocks=host, kv_offload_policy=policy, **kw)
    return LLMEngine(config, clock="virtual", executor=KVCheckingExecutor(num_blocks, BS))


def _prompt(seed: int, n: int = 4 * BS + 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def _serve(engine, prompts):
    """Each prompt alone, one after another (a later one meets what the earlier ones left)."""
    ids = []
    for p in prompts:
        ids.append(engine.add_request(p, PARAMS))
        drive(engine, limit=500, after_step=lambda e: e.kv.check_invariants())
    return [engine.requests[i] for i in ids]


# -- the host tier on its own ---------------------------------------------------------------
def test_host_tier_evicts_least_recently_used_and_keeps_a_prefix_longer_than_its_tail():
    tier = HostKVTier(3)
    assert tier.store([(1, 0), (2, 1), (3, 2)]) == 3            # a chain 1 -> 2 -> 3, stored together
    assert list(tier.entries) == [3, 2, 1]                        # tail least recent, prefix most recent
    tier.store([(4, 3)])                                          # full: the tail (3) goes
    assert list(tier.entries) == [2, 1, 4] and tier.num_dropped == 1
    tier.touch([2])                                               # 1 is now the least recently used
    tier.store([(5, 0)])
    assert list(tier.entries) == [4, 2, 5]
    assert tier.store([(2, 7), (5, 8)]) == 0                      # already held: touched, not copied
    assert list(tier.entries) == [4, 5, 2] and tier.num_stored == 5
    tier.check()


def test_pinned_host_blocks_are_never_evicted():
    tier = HostKVTier(2)
    tier.store([(1, 0), (2, 1)])
    tier.pin([1, 2])
    assert tier.store([(3, 2)]) == 0 and 3 not in tier            # nothing evictable: the new block is not kept
    tier.unpin([2])
    assert tier.store([(3, 2)]) == 1 and 2 not in tier and 1 in tier
    tier.check()


def test_real_copies_restore_the_device_blocks_bytes():
    ex = KVCheckingExecutor(num_kv_blocks=6, block_size=BS)
    k, v = ex.kv_caches[0]
    k.copy_(torch.arange(k.numel(), dtype=k.dtype).view_as(k))
    v.copy_(-k)
    tier = HostKVTier(4, ex, BS)
    tier.store([(11, 2), (12, 5)])
    before = k[[2, 5]].clone(), v[[2, 5]].clone()
    k.fill_(0.0)
    v.fill_(0.0)
    tier.load([11, 12], [0, 3])
    assert torch.equal(k[[0, 3]], before[0]) and torch.equal(v[[0, 3]], before[1])
    assert tier.num_loaded == 2 and tier.take_time() > 0.0 and tier.take_time() == 0.0


def test_simulated_copy_time_is_blocks_times_bytes_over_the_bandwidth():
    engine = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-3.1-8b", hardware="h100",
                                                enable_prefix_caching=True, kv_offload_blocks=10,
                                                kv_offload_policy="write_back", kv_offload_bandwidth=1e10),
                       clock="virtual")
    tier = engine.kv.host
    block_bytes = 16 * 128 * 1024                                 # llama-3.1-8b: 128 KiB of KV per token
    assert tier.block_bytes == block_bytes
    tier.store([(1, 0), (2, 1), (3, 2)])                          # a write-back store: on the critical path
    assert tier.take_time() == pytest.approx(3 * block_bytes / 1e10)
    tier.store([(4, 3)], on_critical_path=False)                  # write-through: overlapped, bytes only
    assert tier.take_time() == 0.0 and tier.store_bytes == 4 * block_bytes
    tier.load([1, 2], [5, 6])
    assert tier.take_time() == pytest.approx(transfer_time(2, block_bytes, 1e10))


# -- in the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_evicted_prefix_comes_back_from_the_host(policy):
    """A's 4 full blocks are evicted by B and C (10 device blocks); D repeats A's prompt: without
    a host tier it recomputes everything, with one it loads A's 4 blocks (16 tokens) back. The
    checking executor reads every position back, so a load into the wrong block would fail."""
    prompts = [_prompt(s) for s in (1, 2, 3, 1)]
    off = _engine(host=0)
    assert off.kv.host is None
    assert [r.num_cached_tokens for r in _serve(off, prompts)] == [0, 0, 0, 0]
    engine = _engine(policy=policy)
    reqs = _serve(engine, prompts)
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 0, 4 * BS]
    assert engine.kv.prefix_host_hits == 4 * BS and engine.kv.host_hit_tokens == {reqs[3].request_id: 4 * BS}
    assert engine.kv.host.num_loaded == 4
    assert [r.output_token_ids for r in reqs[:1]] == [reqs[3].output_token_ids]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_write_through_copies_when_computed_write_back_when_evicted():
    """One request alone, no pressure on the pool: write-through has copied its 4 full blocks
    (17 prompt tokens + 3 output tokens, 19 computed), write-back nothing, since nothing was evicted."""
    through, back = _engine(policy="write_through"), _engine(policy="write_back")
    for engine in (through, back):
        _serve(engine, [_prompt(1)])
        assert engine.kv.pool.num_evictions == 0
    assert through.kv.host.num_stored == 4 and back.kv.host.num_stored == 0
    _serve(back, [_prompt(2), _prompt(3)])                       # now the pool evicts A's blocks
    assert back.kv.pool.num_evictions > 0 and back.kv.host.num_stored >= back.kv.pool.num_evictions


def test_host_hits_are_device_misses_only_and_counted_once_per_request():
    """D's first blocks are still on the device (a device hit), the rest come from the host;
    the prefix-cache counters split them and count each request once although it waits."""
    engine = _engine(num_blocks=12, host=32, max_num_batched_tokens=64)
    a, b = _prompt(1, 8 * BS + 1), _prompt(2, 5 * BS + 1)
    _serve(engine, [a, b])                                        # B evicts A's tail blocks first
    on_device = engine.kv.get_computed_blocks(engine.requests[engine.add_request(a, PARAMS)])
    device_tokens = len(on_device[0]) * BS
    assert 0 < device_tokens < on_device[1] == 8 * BS            # part device, the rest host
    drive(engine, limit=500)
    d = engine.finished[-1]
    assert d.num_cached_tokens == 8 * BS
    assert engine.kv.prefix_host_hits == 8 * BS - device_tokens
    assert engine.kv.prefix_hits == 8 * BS


def test_summary_hit_rate_counts_host_hits_once_despite_waiting():
    """Six requests with the same prompt, one running at a time: each later one is looked up
    every step while it waits, but its hit (device or host) is counted once."""
    prompt = _prompt(5, 8 * BS)
    specs = [RequestSpec(0.0, len(prompt), 6, prompt_token_ids=prompt, request_id=f"r{i}") for i in range(3)]
    specs += [RequestSpec(0.0, 12, 6, prompt_token_ids=_prompt(10 + i, 12), request_id=f"x{i}") for i in range(3)]
    specs += [RequestSpec(1.0, len(prompt), 6, prompt_token_ids=prompt, request_id=f"s{i}") for i in range(3)]
    engine = LLMEngine(EngineConfig(num_kv_blocks=12, block_size=BS, enable_prefix_caching=True, max_num_seqs=1,
                                    kv_offload_blocks=32), clock="virtual", executor=KVCheckingExecutor(12, BS))
    result = run(Workload(specs), engine=engine, on_step=lambda e, step: e.kv.check_invariants())
    cached = {r.request_id: r.num_cached_tokens for r in result.requests}
    assert engine.kv.prefix_hits == sum(cached.values())
    assert engine.kv.prefix_host_hits == sum(engine.kv.host_hit_tokens.values()) > 0
    assert set(engine.kv.host_hit_tokens) <= {f"s{i}" for i in range(3)} | {"r1", "r2"}
    assert result.summary()["prefix_cache_hit_rate"] == sum(cached.values()) / sum(s.prompt_len for s in specs)


def test_a_request_preempted_and_readmitted_counts_its_host_hit_once():
    """D loads A's 4 blocks from the host, is preempted (recompute) by a higher-priority request
    whose blocks evict them, and on readmission loads some of them again: the loads are counted,
    its host hit is not counted twice."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=10, block_size=BS, enable_prefix_caching=True, max_num_seqs=2,
                     kv_offload_blocks=16, kv_offload_policy="write_back", policy="priority"),
        clock="virtual", executor=KVCheckingExecutor(10, BS))
    a = _prompt(1)
    _serve(engine, [a, _prompt(2), _prompt(3)])
    d = engine.add_request(a, SamplingParams(max_tokens=8, ignore_eos=True), priority=1)
    engine.step()
    assert engine.kv.host.num_loaded == 4 and engine.kv.prefix_host_hits == 4 * BS
    engine.add_request(_prompt(7, 29), SamplingParams(max_tokens=4, ignore_eos=True), priority=0)
    drive(engine, limit=500, after_step=lambda e: e.kv.check_invariants())
    assert engine.requests[d].num_preemptions == 1 and engine.kv.host.num_loaded > 4
    assert engine.kv.prefix_host_hits == 4 * BS == engine.requests[d].num_cached_tokens
    assert engine.kv.host_hit_tokens == {d: 4 * BS}


shared = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3 * BS), st.integers(1, 12), st.integers(0, 6)),
                  min_size=1, max_size=20)      # (prefix group, suffix length, max_tokens, arrival step)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=shared, num_blocks=st.integers(10, 40), host=st.integers(1, 48),
       policy=st.sampled_from(["write_through", "write_back"]), swap=st.booleans(), max_num_seqs=st.integers(1, 6))
def test_blocks_conserved_across_both_tiers(workload, num_blocks, host, policy, swap, max_num_seqs):
    """Random shared-prefix traffic on a small pool, with swap preemption or recompute: after every
    step the device blocks are conserved, the host slots are conserved and pins match the
    planned loads; every request ends with its tokens (the executor checks every KV read);
    afterwards no device block is held."""
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=BS, enable_prefix_caching=True,
                          max_num_seqs=max_num_seqs, kv_offload_blocks=host, kv_offload_policy=policy,
                          preemption_mode="swap" if swap else "recompute", swap_space_blocks=8)
    engine = LLMEngine(config, clock="virtual", executor=KVCheckingExecutor(num_blocks, BS))
    pending = sorted(enumerate(workload), key=lambda x: x[1][3])
    ids = []

    def arrive(step):
        while pending and pending[0][1][3] <= step:
            i, (group, suffix, max_tokens, _) = pending.pop(0)
            prompt = _prompt(100 + group, 3 * BS) + _prompt(i, suffix)
            if -(-(len(prompt) + max_tokens) // BS) <= num_blocks:
                ids.append(engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return bool(pending)

    def check(e):
        e.kv.check_invariants()
        assert e.kv.num_used_blocks + e.kv.num_free_blocks == num_blocks
        assert len(e.kv.host.entries) + len(e.kv.host.free_slots) == host

    drive(engine, limit=3000, before_step=arrive, after_step=check)
    for rid in ids:
        req = engine.requests[rid]
        assert req.status.value == "length" and req.num_output_tokens == req.sampling_params.max_tokens
    assert engine.kv.num_free_blocks == num_blocks and not engine.kv.host.pins


def test_swap_preemption_and_the_host_tier_work_together():
    """Both host pools at once: preempted requests are swapped out and back, evicted prefixes
    come back from the host tier, and every KV read is right."""
    prompts = [_prompt(100 + i % 3, 3 * BS) + _prompt(i, 5) for i in range(24)]
    specs = [RequestSpec(i * 0.001, len(p), 16, prompt_token_ids=p, request_id=f"r{i}") for i, p in enumerate(prompts)]
    engine = LLMEngine(EngineConfig(num_kv_blocks=12, block_size=BS, enable_prefix_caching=True, max_num_seqs=4,
                                    preemption_mode="swap", kv_offload_blocks=24),
                       clock="virtual", executor=KVCheckingExecutor(12, BS, step_s=0.01))
    result = run(Workload(specs), engine=engine, on_step=lambda e, step: e.kv.check_invariants())
    assert result.summary()["completed"] == 24
    assert engine.scheduler.swapper.num_swapped_in > 0 and engine.kv.host.num_loaded > 0
    assert engine.scheduler.swapper.num_used == 0 and engine.kv.num_free_blocks == 12


def test_greedy_outputs_equal_transformers_when_prefixes_come_back_from_the_host(checkpoints):
    """A real model: prompts that share long prefixes cycle through a device pool too small to
    keep them, so later requests load their prefixes from the host tier; every request's greedy
    tokens equal transformers' generate for that prompt alone."""
    path, hf_model = checkpoints["llama-gqa"]
    rng = random.Random(3)
    heads = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(3)]
    prompts = [heads[i % 3] + [rng.randrange(3, 256) for _ in range(5)] for i in range(9)]
    expected = [hf_greedy(hf_model, p, 6) for p in prompts]
    llm = LLM(str(path), block_size=16, num_kv_blocks=9, max_num_seqs=1, enable_prefix_caching=True,
              kv_offload_blocks=12)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    kv = llm.engine.kv
    assert kv.prefix_host_hits >= 3 * 48 and kv.host.num_loaded >= 9
    kv.check_invariants()


def test_kv_offloading_size_is_gib_over_the_bytes_of_a_block():
    def host_blocks(**kw):
        engine = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-3.1-8b", enable_prefix_caching=True,
                                                    **kw), clock="virtual")
        return engine.kv.host.capacity
    block = 16 * 128 * 1024
    assert host_blocks(hardware="h100", kv_offloading_size=2) == 2 * GiB // block
    # vLLM's size is summed over the tensor-parallel GPUs; each holds half of every block's heads.
    assert host_blocks(hardware="2xh100", kv_offloading_size=2) == 2 * GiB // block
    assert host_blocks(hardware="h100", kv_offload_blocks=7) == 7


@pytest.mark.parametrize("kw, message", [
    (dict(kv_offload_blocks=-1), "kv_offload_blocks must be an integer >= 0"),
    (dict(kv_offload_blocks=2.5), "kv_offload_blocks must be an integer >= 0"),
    (dict(kv_offloading_size=0), "kv_offloading_size must be a number of GiB > 0"),
    (dict(kv_offloading_size=float("inf")), "kv_offloading_size must be a number of GiB > 0"),
    (dict(kv_offload_blocks=4, kv_offloading_size=1.0), "pass one of them"),
    (dict(kv_offload_bandwidth=0), "kv_offload_bandwidth must be"),
    (dict(kv_offload_policy="write_around"), "unknown kv_offload_policy 'write_around'"),
])
def test_bad_offload_options_are_rejected_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(enable_prefix_caching=True, **kw)


def test_a_host_tier_needs_prefix_caching_and_a_block_to_hold():
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        EngineConfig.from_kwargs(kv_offload_blocks=8)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-3.1-8b", enable_prefix_caching=True,
                                           kv_offloading_size=1e-6), clock="virtual")
    config = EngineConfig.from_kwargs(enable_prefix_caching=True, kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="pass kv_offload_blocks instead"):
        LLMEngine(config, clock="virtual", executor=_NoKV())


class _NoKV(KVCheckingExecutor):
    """An executor that says nothing about the size of its blocks."""

    def __init__(self):
        super().__init__(8, 16)
        self.kv_caches = None


# -- load back or recompute -------------------------------------------------------------------
def test_recomputing_a_short_prefix_is_cheaper_than_loading_it_a_long_one_is_not():
    """llama-3.1-8b on an H100 (ridge ~226 tokens): a 64-token prefix in front of a 64-token
    prompt rides in a memory-bound step almost free; 8,192 tokens cost far more than the copy."""
    cm = make_cost_model("llama-3.1-8b", "h100")
    assert recompute_time(cm, 64, rest=64) < load_time(cm, 64)
    assert recompute_time(cm, 8192, rest=64) > 2 * load_time(cm, 8192)
    assert load_time(cm, 8192) == pytest.approx(8192 * 128 * 1024 / HOST_LINK_BYTES_PER_S)
    with pytest.raises(ValueError, match="rest >= 1"):
        recompute_time(cm, 10, rest=0)


def test_host_lookup_follows_the_chained_hash():
    """The host is keyed by the device cache's chained hash, so a block is found only behind its
    own prefix: the same 4 tokens after a different prefix are a miss."""
    engine = _engine(num_blocks=12, host=32)
    a = _prompt(1, 4 * BS + 1)
    _serve(engine, [a, _prompt(2), _prompt(3)])
    h = None
    for i in range(4):
        h = hash_block(h, tuple(a[i * BS:(i + 1) * BS]))
    assert h in engine.kv.host
    other = _prompt(9, BS) + a[BS:]                               # a's blocks 1..3 behind another first block
    req = engine.requests[engine.add_request(other, PARAMS)]
    assert engine.kv.get_computed_blocks(req) == ([], 0)


def _lru_by_hand(workload, capacity_blocks: int) -> float:
    """An LRU cache of whole 512-token blocks, replayed reference by reference."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in workload:
        for j, h in enumerate(r.hash_ids):
            tokens = min(512, r.prompt_len - 512 * j)
            total += tokens
            if h in cache:
                hit += tokens
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hit / total


def test_stack_distances_give_the_hit_rate_of_every_lru_size():
    rng = random.Random(0)
    specs = []
    for i in range(200):
        n = rng.randint(1, 6)
        ids = [rng.randrange(40) * 10 + j for j in range(n)]        # shared first blocks, varied tails
        specs.append(RequestSpec(float(i), 512 * n - rng.randrange(300), 4, hash_ids=ids))
    wl = Workload(specs)
    dist = stack_distances(wl)
    for blocks in (1, 5, 20, 60, 400):
        assert lru_hit_rate(dist, blocks * 512) == pytest.approx(_lru_by_hand(wl, blocks))
    assert lru_hit_rate(dist, 512, 100.0, 150.0) <= lru_hit_rate(dist, 60 * 512, 100.0, 150.0)
    long = Workload([RequestSpec(0.0, 2000, 4, hash_ids=[1, 2, 3, 4]), RequestSpec(1.0, 600, 4, hash_ids=[1, 2])])
    assert lru_hit_rate(stack_distances(long, max_prompt=1000), 10 * 512) == 0.0   # the long prompt is left out


def test_metrics_count_host_hits_as_vllms_external_prefix_cache():
    """/metrics: the host tier's hits are vLLM's external_prefix_cache_* (a KV connector's), the
    device's stay in prefix_cache_hits; the tier's copies are counted."""
    from minibatch.serving.metrics import ServingMetrics, engine_gauges
    from minibatch.serving.scrape import parse_page

    engine = _engine(policy="write_back")
    _serve(engine, [_prompt(s) for s in (1, 2, 3, 1)])
    m = ServingMetrics("tiny")
    page = parse_page(m.render(engine_gauges(engine), 0))
    key = (("engine", "0"), ("model_name", "tiny"))
    kv = engine.kv
    assert kv.prefix_host_hits == 4 * BS
    assert page[("vllm:prefix_cache_hits_total", key)] == kv.prefix_hits - kv.prefix_host_hits
    assert page[("vllm:external_prefix_cache_hits_total", key)] == kv.prefix_host_hits
    assert page[("vllm:external_prefix_cache_queries_total", key)] == \
        kv.prefix_queries - (kv.prefix_hits - kv.prefix_host_hits)
    assert page[("minibatch:kv_offload_loaded_blocks_total", key)] == kv.host.num_loaded == 4
    assert page[("minibatch:kv_offload_stored_blocks_total", key)] == kv.host.num_stored > 0
    seconds = {dict(k[1])["direction"]: v for k, v in page.items() if k[0] == "minibatch:kv_offload_copy_seconds_total"}
    assert seconds == {"store": kv.host.store_seconds, "load": kv.host.load_seconds}
    plain = parse_page(ServingMetrics("tiny").render(engine_gauges(_engine(host=0)), 0))
    assert not any(k[0].startswith(("vllm:external_prefix", "minibatch:kv_offload")) for k in plain)
