"""Preemption: which victim (vllm#54644) and priority preemption of running requests (vllm#40004).

Both on the simulator (Llama-2-7B on one A100-80GB, roofline cost model, virtual clock), in steady
state (``summary(trim=0.1)``: requests that arrived in the middle 80 % of the arrival span), one run
per seed and rule, the effect printed as a ratio per seed and its median.

victim  Recompute preemption under KV pressure. ``--n`` (400) requests, Poisson arrivals at
        ``--rate`` (3 req/s), prompts uniform in [256, 768] and outputs uniform in [128, 384]
        tokens (each 50 % around its mean, the shape of ``vllm bench serve --random-range-ratio
        0.5``, vllm#54644's heterogeneous case), KV pools of ``--pools`` blocks of 16 tokens
        (default 500 and 600: 8k and 9.6k tokens, where ``last`` recomputes about 20 % and 10 %
        of all computed tokens, the RFC's 10-23 % range). For ``preemption_victim`` = ``last`` (vLLM's FCFS rule, minibatch's default)
        and ``least_computed`` (the RFC's least-computed-first): the engine's own
        ``recompute_waste`` (tokens computed again after a recompute preemption / all computed
        tokens), recomputed tokens per preemption, TTFT p50 and throughput; the effect is
        waste(least_computed) / waste(last).

classes The victim workload with every request drawn class 0 or 1 at random (pool 500 blocks),
        still FCFS order: ``preemption_victim`` = ``last`` against ``lowest_priority`` (vLLM's
        victim under ``--scheduling-policy priority``). The effect: class 0's preemptions and its
        E2E p90, as ratios lowest_priority / last (the victim rule alone, without a priority order).

priority  ``max_num_seqs`` is the bottleneck (vllm#40004): 16 sequence slots, a pool large enough
        for everyone. A background class (priority 1: prompts 512, outputs 512 tokens, 2 req/s)
        keeps the slots full; interactive requests (priority 0: prompts 256, outputs 32 tokens,
        1 req/s) arrive among them, over ``--duration`` (120) s. ``priority`` policy without aging,
        non-preemptive (vLLM V1's ``--scheduling-policy priority``: a waiting request never
        displaces a running one) against preemptive (a more urgent waiting request goes first;
        the running request it displaces pauses, or is evicted when KV is short); the effect is
        the interactive class's TTFT p50 / p90 ratio (preemptive / non-preemptive), with the
        background class's throughput ratio as its cost.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/preemption.py                 # all three (~1.5 min here)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/preemption.py --part victim --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minibatch import EngineConfig, LLMEngine
from minibatch.policies.priority import PriorityPolicy
from minibatch.results import percentiles, steady_state
from minibatch.runner import run
from minibatch.workload import RequestSpec, Workload
from minibatch.workload.lengths import Uniform
from minibatch.workload.synthetic import synthetic

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}
VICTIM_RULES = ("last", "least_computed")


def victim_workload(n: int, rate: float, seed: int) -> Workload:
    return synthetic(n, rate=rate, input_len=Uniform(256, 768), output_len=Uniform(128, 384), seed=seed,
                     name="heterogeneous")


def victim_run(n: int, rate: float, pool: int, rule: str, seed: int) -> dict:
    res = run(victim_workload(n, rate, seed), **SIM, num_kv_blocks=pool, preemption_victim=rule)
    s = res.summary(trim=0.1)
    pre = s["num_preemptions"]
    return {"waste": s["recompute_waste"], "preemptions": pre,
            "per_preemption": s["num_recomputed_tokens"] / pre if pre else 0.0,
            "ttft_p50": s["ttft_p50"], "tok_s": s["throughput_tok_s"]}


def victim_part(args) -> dict:
    out = {}
    for pool in args.pools:
        print(f"\nvictim choice, pool {pool} blocks ({pool * 16} tokens), {args.n} requests at {args.rate} req/s")
        print(f"{'seed':>4} {'rule':>15} {'waste':>7} {'preempt':>8} {'tok/preempt':>12} {'TTFT p50 s':>11} "
              f"{'tok/s':>7}")
        ratios, per_ratios, ttft_ratios, tput_ratios, wastes = [], [], [], [], {r: [] for r in VICTIM_RULES}
        for seed in args.seeds:
            rows = {rule: victim_run(args.n, args.rate, pool, rule, seed) for rule in VICTIM_RULES}
            for rule, r in rows.items():
                wastes[rule].append(r["waste"])
                print(f"{seed:>4} {rule:>15} {r['waste']:>7.1%} {r['preemptions']:>8} {r['per_preemption']:>12.0f} "
                      f"{r['ttft_p50']:>11.2f} {r['tok_s']:>7.0f}")
            a, b = rows["last"], rows["least_computed"]
            if not a["preemptions"]:
                print("     (no preemption with this seed: no ratio)")
                continue
            ratios.append(b["waste"] / a["waste"])
            per_ratios.append(b["per_preemption"] / a["per_preemption"])
            ttft_ratios.append(b["ttft_p50"] / a["ttft_p50"])
            tput_ratios.append(b["tok_s"] / a["tok_s"])
        res = {"waste_last": float(np.median(wastes["last"])), "waste_lcf": float(np.median(wastes["least_computed"])),
               "ratio": float(np.median(ratios)) if ratios else float("nan"), "ratios": ratios, "per_preemption": float(np.median(per_ratios)) if ratios else float("nan"),
               "ttft": float(np.median(ttft_ratios)) if ratios else float("nan"),
               "tput": float(np.median(tput_ratios)) if ratios else float("nan")}
        out[pool] = res
        print(f"waste: last {res['waste_last']:.1%}, least_computed {res['waste_lcf']:.1%} (medians); "
              f"least_computed / last = x{res['ratio']:.2f} (median; per seed "
              f"{', '.join(f'{x:.2f}' for x in ratios)}), per preemption x{res['per_preemption']:.2f}, "
              f"TTFT p50 x{res['ttft']:.2f}, tokens/s x{res['tput']:.2f}")
    return out


def classes_part(args) -> dict:
    pool = args.pools[0]
    print(f"\nvictim by class under FCFS, pool {pool} blocks, {args.n} requests of classes 0/1 at {args.rate} req/s")
    print(f"{'seed':>4} {'rule':>16} {'class-0 preempt':>16} {'class-1 preempt':>16} {'class-0 E2E p90':>16} "
          f"{'class-1 E2E p90':>16}")
    pre, e2e = [], []
    for seed in args.seeds:
        wl = synthetic(args.n, rate=args.rate, input_len=Uniform(256, 768), output_len=Uniform(128, 384), seed=seed,
                       priorities=[0, 1], name="two-class")
        rows = {}
        for rule in ("last", "lowest_priority"):
            mid = steady_state(run(wl, **SIM, num_kv_blocks=pool, preemption_victim=rule).requests, 0.1)
            by = {c: [q for q in mid if q.priority == c] for c in (0, 1)}
            rows[rule] = r = {c: (sum(q.num_preemptions for q in by[c]), percentiles([q.e2e for q in by[c]], (90,))[90])
                              for c in (0, 1)}
            print(f"{seed:>4} {rule:>16} {r[0][0]:>16} {r[1][0]:>16} {r[0][1]:>16.2f} {r[1][1]:>16.2f}")
        pre.append(rows["lowest_priority"][0][0] / max(rows["last"][0][0], 1))
        e2e.append(rows["lowest_priority"][0][1] / rows["last"][0][1])
    res = {"preempt": float(np.median(pre)), "e2e_p90": float(np.median(e2e))}
    print(f"class 0, lowest_priority / last: preemptions x{res['preempt']:.2f}, E2E p90 x{res['e2e_p90']:.2f} (medians)")
    return res


def priority_workload(duration: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    specs = []
    for cls, rate, prompt, out in ((1, 2.0, 512, 512), (0, 1.0, 256, 32)):
        t = 0.0
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= duration:
                break
            specs.append(RequestSpec(t, prompt, out, priority=cls, request_id=f"c{cls}-{len(specs)}"))
    return Workload(specs, name="two-class")


def priority_run(duration: float, preemptive: bool, seed: int) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, max_num_seqs=16), clock="virtual")
    engine.scheduler.policy = PriorityPolicy(aging_s=None, preemptive=preemptive)
    res = run(priority_workload(duration, seed), engine=engine)
    steady = steady_state(res.requests, 0.1)
    hi = [r.ttft for r in steady if r.priority == 0 and r.completed]
    lo_tokens = sum(r.output_len for r in steady if r.priority == 1 and r.completed)
    span = max(r.finish_time for r in res.requests) - min(r.arrival_time for r in res.requests)
    p = percentiles(hi, (50, 90))
    return {"ttft_p50": p[50], "ttft_p90": p[90], "lo_tok_s": lo_tokens / span,
            "preemptions": sum(r.num_preemptions for r in steady)}


def priority_part(args) -> dict:
    print(f"\npriority preemption at max_num_seqs = 16, {args.duration:.0f} s of arrivals")
    print(f"{'seed':>4} {'policy':>15} {'hi TTFT p50':>12} {'hi TTFT p90':>12} {'lo tok/s':>9} {'preempt':>8}")
    p50, p90, tput = [], [], []
    for seed in args.seeds:
        rows = {}
        for preemptive in (False, True):
            r = rows[preemptive] = priority_run(args.duration, preemptive, seed)
            name = "preemptive" if preemptive else "non-preemptive"
            print(f"{seed:>4} {name:>15} {r['ttft_p50']:>12.3f} {r['ttft_p90']:>12.3f} {r['lo_tok_s']:>9.0f} "
                  f"{r['preemptions']:>8}")
        p50.append(rows[True]["ttft_p50"] / rows[False]["ttft_p50"])
        p90.append(rows[True]["ttft_p90"] / rows[False]["ttft_p90"])
        tput.append(rows[True]["lo_tok_s"] / rows[False]["lo_tok_s"])
    res = {"p50": float(np.median(p50)), "p90": float(np.median(p90)), "tput": float(np.median(tput))}
    print(f"interactive TTFT preemptive / non-preemptive: p50 x{res['p50']:.3f}, p90 x{res['p90']:.3f} (medians "
          f"over seeds); background tokens/s x{res['tput']:.2f}")
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("victim", "classes", "priority", "all"), default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--pools", type=int, nargs="+", default=[500, 600])
    ap.add_argument("--duration", type=float, default=120.0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.part in ("victim", "all"):
        victim_part(args)
    if args.part in ("classes", "all"):
        classes_part(args)
    if args.part in ("priority", "all"):
        priority_part(args)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
