"""Async (overlap) scheduling on the tiny model: what it saves per step, what it costs a new request.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/async_scheduling.py [--rounds 5] [--requests 32]

Each round runs the same offline batch twice, synchronous then async (``async_scheduling=True``),
alternating which goes first, on the wall clock: ``--requests`` greedy requests of
``--prompt-len`` tokens and ``--max-tokens`` outputs, all queued at the start. Reported per mode
(medians over rounds): the median wall time of a decode-only step, output tokens per second,
and the CPU time of a synchronous step outside the forward (schedule + prepare + bookkeeping).
The TTFT cost is measured in the same run: a probe request added between two steps of a
running batch; its first token comes ``ttft_steps`` steps later (1 synchronous, 2 async).

The effect is printed as ratios (async / sync) measured in one run. The overlap needs a free
core for the worker thread: on a machine whose cores are busy it shrinks (see the load line).
vLLM's published figure for comparison: PR #32618 (async scheduling + pipeline parallelism,
Qwen3-30B-A3B-FP8 with -pp 4): "30.8% E2E throughput improvement, 31.8% TPOT improvement".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from minibatch import LLMEngine, SamplingParams
from minibatch.config import EngineConfig


def run_once(async_scheduling: bool, n: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    import random

    cfg = EngineConfig(model="tiny", max_num_seqs=n + 1, async_scheduling=async_scheduling)
    engine = LLMEngine(cfg)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(n):
        engine.add_request([rng.randrange(3, 250) for _ in range(prompt_len)], params)
    # Warm-up: the first steps build the GEMM kernels (and the first prefill); not measured.
    for _ in range(4):
        engine.step()
    sched_cpu = []
    orig = engine.scheduler.schedule

    def timed(now):
        t = time.perf_counter()
        out = orig(now)
        sched_cpu.append(time.perf_counter() - t)
        return out

    engine.scheduler.schedule = timed
    step_times, probe_id, probe_step = [], None, None
    t_start = time.perf_counter()
    tokens0 = sum(r.num_output_tokens for r in engine.requests.values())
    i = 0
    while engine.has_unfinished_requests():
        if i == 8:                       # the probe arrives between two steps of the running batch
            probe_id = engine.add_request([rng.randrange(3, 250) for _ in range(prompt_len)],
                                          SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            probe_step = len(engine.steps)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        last = engine.steps[-1] if engine.steps else None
        if last is not None and last.num_prefill_tokens == 0 and last.num_decode_seqs >= n // 2:
            step_times.append(dt)
        i += 1
    wall = time.perf_counter() - t_start
    tokens = sum(r.num_output_tokens for r in engine.requests.values()) - tokens0
    probe = engine.requests[probe_id]
    first = next(k for k, s in enumerate(engine.steps) if s.start_time + s.duration >= probe.first_token_time - 1e-9)
    fwd = statistics.median(s.forward_time for s in engine.steps[4:]
                            if s.num_prefill_tokens == 0 and s.num_decode_seqs >= n // 2)
    return {"step_s": statistics.median(step_times), "tok_per_s": tokens / wall,
            "ttft_steps": first - probe_step + 1, "ttft_s": probe.first_token_time - probe.arrival_time,
            "forward_s": fwd, "schedule_s": statistics.median(sched_cpu),
            "discarded": engine.overlap.num_discarded_tokens if engine.overlap else 0}


def simulated(async_scheduling: bool, seed: int) -> dict:
    """Llama-3-8B on one H100 (the simulator's roofline, 2 ms of CPU overhead per step):
    200 requests at 8 req/s, 512-token prompts, 256 output tokens (virtual clock)."""
    from minibatch.runner import run
    from minibatch.workload import synthetic

    wl = synthetic(200, rate=8, seed=seed, input_len=512, output_len=256)
    s = run(wl, executor="sim", model="llama-3-8b", hardware="h100", async_scheduling=async_scheduling).summary()
    return {"tpot": s["tpot_mean"], "ttft": s["ttft_mean"], "tok_per_s": s["throughput_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}")
    res = {False: [], True: []}
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            res[mode].append(run_once(mode, args.requests, args.prompt_len, args.max_tokens, seed=r))

    def med(mode, key):
        return statistics.median(x[key] for x in res[mode])

    for mode in (False, True):
        name = "async" if mode else "sync "
        print(f"{name}: decode step {med(mode, 'step_s') * 1e3:.2f} ms (forward {med(mode, 'forward_s') * 1e3:.2f}"
              f" ms, schedule {med(mode, 'schedule_s') * 1e3:.3f} ms), {med(mode, 'tok_per_s'):.0f} tok/s, "
              f"probe TTFT {med(mode, 'ttft_steps'):.0f} steps = {med(mode, 'ttft_s') * 1e3:.1f} ms, "
              f"discarded tokens {med(mode, 'discarded'):.0f}")
    ratios = {k: statistics.median(a[k] / s[k] for a, s in zip(res[True], res[False]))
              for k in ("step_s", "tok_per_s", "ttft_s", "ttft_steps")}
    print(f"tiny, wall clock, ratio async/sync (median of {args.rounds} paired rounds): decode step time "
          f"{ratios['step_s']:.3f}, throughput {ratios['tok_per_s']:.3f}, probe TTFT {ratios['ttft_s']:.2f} "
          f"({ratios['ttft_steps']:.0f}x the steps)")
    # What a perfect overlap could save: a synchronous step's CPU work outside the forward.
    cpu = [x["step_s"] - x["forward_s"] for x in res[False]]
    bound = statistics.median((x["step_s"]) / max(x["forward_s"], x["step_s"] - x["forward_s"]) for x in res[False])
    print(f"tiny, sync step anatomy: CPU outside the forward {statistics.median(cpu) * 1e3:.3f} ms of "
          f"{med(False, 'step_s') * 1e3:.2f} ms; a perfect overlap would make steps {1 / bound:.3f}x as long")
    sim = {m: [simulated(m, seed) for seed in (1, 2, 3)] for m in (False, True)}
    sr = {k: statistics.median(a[k] / b[k] for a, b in zip(sim[True], sim[False])) for k in ("tpot", "ttft", "tok_per_s")}
    print(f"simulator, llama-3-8b on h100, 3 seeds: TPOT ratio {sr['tpot']:.3f}, TTFT ratio {sr['ttft']:.3f}, "
          f"throughput ratio {sr['tok_per_s']:.3f} (vLLM PR #32618: TPOT -31.8%, i.e. ratio 0.682, with -pp 4)")


if __name__ == "__main__":
    main()
