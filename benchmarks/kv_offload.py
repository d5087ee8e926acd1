"""KV offload tier: a host tier below the device pool, on the Mooncake trace and on the tiny model.

sim   The shipped Mooncake trace (``load_shipped_trace("mooncake")``: 3,993 requests over
      1,022 s, prompts of 15k tokens on average, ``hash_ids`` of 512-token blocks) replayed
      by the simulator: Llama-3.1-8B on one H100 (roofline cost model, virtual clock),
      ``block_size=64``, ``max_model_len=32768`` (longer prompts are rejected, the same in
      both runs). The device pool is the default (90 % of the GPU: 7,173 blocks, 459k
      tokens); the trace's working set is far larger (its reuse distances run to millions
      of tokens), so the pool evicts prefixes that later requests want. The host tier holds
      ``--host-ratio`` (2) times the device pool, SGLang's default ``--hicache-ratio``, with
      ``--policy`` write_through (both frameworks' default). One H100 cannot keep up with the
      trace's ~60k prompt tokens/s, so it is replayed ``--slowdown`` (2) times slower
      (``Workload.scale_time``). One continuous replay from trace second ``--start``; the
      first ``--warmup`` trace seconds fill both tiers and are not measured; then windows of
      ``--window`` trace seconds; requests arriving after the last window run (drain) but
      are not measured. Per window: prefix-cache hit rate (prompt tokens served from the
      cache, split by tier) and TTFT p50 / p90, without and with the host tier; the effect
      is the ratio with/without per window, and its median over the windows.
tiny  The embedded tiny model, really run on this CPU (virtual clock advanced by measured
      step and copy times): 24 requests, 8 shared 160-token system prompts cycled through a
      device pool of 24 blocks that cannot keep them; greedy outputs with and without the
      tier must be equal token for token; TTFT ratio with/without over ``--rounds``
      alternating rounds (median), and the measured cost of a host load per block against
      the prefill time it saves.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_offload.py              # both (~3 min here)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_offload.py --skip-tiny --policy write_back
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minibatch import LLMEngine, EngineConfig, SamplingParams
from minibatch.runner import run
from minibatch.sim.offload import lru_hit_rate, stack_distances
from minibatch.workload import load_shipped_trace

SIM = dict(executor="sim", model="llama-3.1-8b", hardware="h100", block_size=64, max_model_len=32768,
           enable_prefix_caching=True)
TINY = dict(model="tiny", block_size=16, num_kv_blocks=24, max_num_seqs=4, enable_prefix_caching=True)


def tier_stats(result, engine, t0: float, t1: float) -> dict:
    """Hit rates by tier and TTFT percentiles of the completed requests arriving in ``[t0, t1)``."""
    recs = [q for q in result.requests if q.completed and t0 <= q.arrival_time < t1]
    prompt = sum(q.prompt_len for q in recs)
    host = sum(engine.kv.host_hit_tokens.get(q.request_id, 0) for q in recs)
    ttft = np.array([q.ttft for q in recs])
    return {"n": len(recs), "hit": sum(q.num_cached_tokens for q in recs) / prompt, "host_hit": host / prompt,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90))}


def sim(args) -> None:
    moon = load_shipped_trace("mooncake", materialize=False)
    end = args.start + args.warmup + args.windows * args.window
    wl = moon.time_window(args.start, end + args.drain).scale_time(args.slowdown).materialize(32000, seed=0)
    runs = {}
    for on in (False, True):
        probe = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual")
        host = dict(kv_offload_blocks=round(args.host_ratio * probe.kv.num_blocks), kv_offload_policy=args.policy)
        engine = LLMEngine(EngineConfig.from_kwargs(**SIM, **(host if on else {})), clock="virtual")
        t = time.perf_counter()
        runs[on] = (run(wl, engine=engine), engine)
        print(f"sim {'with' if on else 'without'} host tier: {len(wl)} requests replayed in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
    engine = runs[True][1]
    print(f"device pool {engine.kv.num_blocks} blocks ({engine.kv.num_blocks * 64:,} tokens), host tier "
          f"{engine.kv.host.capacity} blocks ({args.policy}); stored {engine.kv.host.num_stored}, loaded "
          f"{engine.kv.host.num_loaded}, dropped {engine.kv.host.num_dropped} blocks; "
          f"{engine.kv.host.store_bytes / 1e9:.0f} GB to host, {engine.kv.host.load_bytes / 1e9:.0f} GB back")
    # What an LRU cache of the same size would hit (stack distances of the trace's 512-token blocks):
    # write-through keeps the host a copy of what the device holds (inclusive), write-back adds to it.
    device = engine.kv.num_blocks * 64
    both = engine.kv.host.capacity * 64 + (device if args.policy == "write_back" else 0)
    dist = stack_distances(moon, max_prompt=SIM["max_model_len"])
    print(f"{'trace window (s)':>17} {'n':>4} {'hit off':>8} {'hit on':>7} {'of it host':>10} {'LRU off/on':>11} "
          f"{'p50 off':>8} {'p50 on':>7} {'p50 on/off':>10} {'p90 off':>8} {'p90 on':>7} {'p90 on/off':>10}")
    r50, r90, hits = [], [], []
    for i in range(args.windows):
        lo = args.start + args.warmup + i * args.window
        t0, t1 = (lo - args.start) * args.slowdown, (lo + args.window - args.start) * args.slowdown
        off, on = (tier_stats(*runs[k], t0, t1) for k in (False, True))
        r50.append(on["ttft_p50"] / off["ttft_p50"])
        r90.append(on["ttft_p90"] / off["ttft_p90"])
        hits.append((off["hit"], on["hit"]))
        lru = f"{lru_hit_rate(dist, device, lo, lo + args.window):.1%}/{lru_hit_rate(dist, both, lo, lo + args.window):.1%}"
        print(f"{f'[{lo:.0f}, {lo + args.window:.0f})':>17} {on['n']:>4} {off['hit']:>8.1%} {on['hit']:>7.1%} "
              f"{on['host_hit']:>10.1%} {lru:>11} {off['ttft_p50']:>8.3f} {on['ttft_p50']:>7.3f} {r50[-1]:>10.2f} "
              f"{off['ttft_p90']:>8.3f} {on['ttft_p90']:>7.3f} {r90[-1]:>10.2f}")
    h = np.array(hits)
    print(f"median over {args.windows} windows: hit rate {np.median(h[:, 0]):.1%} -> {np.median(h[:, 1]):.1%}; "
          f"TTFT p50 x{np.median(r50):.2f}, p90 x{np.median(r90):.2f} with the host tier")


def tiny(args) -> None:
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    heads = [rng.integers(3, 4096, 160).tolist() for _ in range(8)]
    # Three rounds over the 8 prefixes: when a prefix comes back, 7 others have passed through the pool.
    prompts = [heads[g] + rng.integers(3, 4096, 8).tolist() for _ in range(3) for g in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ttft = {False: [], True: []}
    outs = {}
    loads = None
    for _ in range(args.rounds):
        for on in (False, True):
            llm_kw = dict(TINY, **({"kv_offload_blocks": 96} if on else {}))
            engine = LLMEngine(EngineConfig.from_kwargs(**llm_kw), clock="virtual")
            ids = []
            for p in prompts:                       # one at a time: each meets what the earlier ones left
                ids.append(engine.add_request(p, params))
                while engine.has_unfinished_requests():
                    engine.step()
            reqs = [engine.requests[i] for i in ids]
            ttft[on].append(np.median([r.first_token_time - r.arrival_time for r in reqs]))
            outs[on] = [r.output_token_ids for r in reqs]
            if on:
                loads = (engine.kv.host.num_loaded, engine.kv.prefix_host_hits, engine.kv.host.load_seconds)
    assert outs[True] == outs[False], "greedy outputs differ with the host tier"
    ratio = np.median(np.array(ttft[True]) / np.array(ttft[False]))
    print(f"tiny: {len(prompts)} requests, greedy outputs equal with and without the host tier; "
          f"{loads[0]} blocks ({loads[1]} tokens) loaded from the host per run, "
          f"{loads[2] / loads[0] * 1e6:.0f} us a block (measured copies, last run)")
    print(f"tiny: median TTFT {np.median(ttft[False]) * 1e3:.1f} ms without, {np.median(ttft[True]) * 1e3:.1f} ms "
          f"with the host tier: x{ratio:.2f} (median of {args.rounds} alternating rounds)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", type=float, default=0.0, help="trace second the replay starts at")
    p.add_argument("--warmup", type=float, default=60.0, help="trace seconds replayed before measuring")
    p.add_argument("--window", type=float, default=120.0, help="trace seconds per measured window")
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--drain", type=float, default=40.0, help="trace seconds replayed after the last window")
    p.add_argument("--slowdown", type=float, default=2.0, help="replay the trace this many times slower")
    p.add_argument("--host-ratio", type=float, default=2.0, help="host tier blocks / device pool blocks")
    p.add_argument("--policy", default="write_through", choices=("write_through", "write_back"))
    p.add_argument("--rounds", type=int, default=5, help="tiny: alternating rounds without/with the tier")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    args = p.parse_args()
    if not args.skip_sim:
        sim(args)
    if not args.skip_tiny:
        tiny(args)


if __name__ == "__main__":
    main()
