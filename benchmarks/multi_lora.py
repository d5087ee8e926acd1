"""Multi-LoRA batching: adapter slots per step (vLLM's max_loras), the simulator's costs, and
an adapter-aware router against least_requests; plus what an adapter costs on this CPU.

slots   Llama-3-8B on one A100-80GB (roofline cost model, virtual clock), ``enable_lora``,
        ``max_lora_rank=16``; every tenant of the workload is a customer with its own adapter
        (``minibatch.sim.lora.tenant_adapter_engine``), tenants uniform at random. Poisson
        arrivals, 512-token prompts, 128-token outputs. For ``--adapters`` (4, 16, 64) and
        ``max_loras`` in (1, 2, 4, 8, 16): output throughput under overload (``--overload``
        req/s, above what the engine serves: the throughput is its capacity) and TTFT p50 / p90
        at ``--rate`` req/s (below the capacity with enough slots). Steady state: the middle
        80 % of arrivals (``summary(trim=0.1)``); ``--seeds`` workload seeds, medians.
        Effect: throughput with max_loras=16 over max_loras=1, and TTFT p90 with max_loras=1
        over max_loras=16, per number of adapters.
router  4 such replicas, ``max_loras=4``, 16 adapters, ``--cluster-rate`` req/s: the
        ``lora_affinity`` router (Gateway API Inference Extension's filters) against
        ``least_requests``: adapter loads, TTFT p90 / p99, throughput; ratios per seed, medians.
tiny    The embedded tiny model really run on this CPU: the measured time of loading one
        rank-8 adapter into a slot (all 7 projections of 4 layers), and of a decode step of
        16 sequences with 0, 1 and 4 adapters in it (medians of ``--rounds`` rounds).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multi_lora.py                  # all (443 s on this loaded machine)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multi_lora.py --only router --seeds 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from minibatch.cluster.runner import run as run_cluster
from minibatch.runner import run
from minibatch.sim.lora import tenant_adapter_engine
from minibatch.workload.synthetic import synthetic

SIM = dict(model="llama-3-8b", hardware="a100-80g", max_lora_rank=16)
SLOTS = (1, 2, 4, 8, 16)


def workload(n: int, rate: float, adapters: int, seed: int):
    return synthetic(n, rate=rate, input_len=512, output_len=128, seed=seed,
                     tenants=[f"adapter-{i}" for i in range(adapters)])


def one_engine(n: int, rate: float, adapters: int, max_loras: int, seed: int) -> dict:
    engine = tenant_adapter_engine(max_loras=max_loras, **SIM)
    s = run(workload(n, rate, adapters, seed), engine=engine).summary(trim=0.1)
    return {"tput": s["throughput_tok_s"], "ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"],
            "loads": engine.executor.lora.num_loads, "batch": s["mean_batch_size"]}


def slots(args) -> None:
    print(f"== slots: Llama-3-8B, A100-80GB, {args.n} requests, seeds {args.seeds} (medians)")
    for adapters in args.adapters:
        print(f"-- {adapters} adapters")
        print(f"{'max_loras':>9} {'tok/s @' + str(args.overload):>12} {'batch':>6} {'loads':>6} "
              f"{'TTFT p50 @' + str(args.rate):>14} {'TTFT p90':>9}")
        rows = {}
        for ml in SLOTS:
            over = [one_engine(args.n, args.overload, adapters, ml, s) for s in args.seeds]
            under = [one_engine(args.n, args.rate, adapters, ml, s) for s in args.seeds]
            rows[ml] = (statistics.median(r["tput"] for r in over), statistics.median(r["batch"] for r in over),
                        statistics.median(r["loads"] for r in over),
                        statistics.median(r["ttft_p50"] for r in under), statistics.median(r["ttft_p90"] for r in under))
            print(f"{ml:>9} {rows[ml][0]:>12.0f} {rows[ml][1]:>6.1f} {rows[ml][2]:>6.0f} {rows[ml][3]:>14.3f} "
                  f"{rows[ml][4]:>9.3f}")
        print(f"   effect: throughput max_loras=16 / max_loras=1 = {rows[16][0] / rows[1][0]:.2f}x; "
              f"TTFT p90 max_loras=1 / max_loras=16 = {rows[1][4] / rows[16][4]:.1f}x")


def router(args) -> None:
    print(f"== router: 4 replicas, max_loras=4, 16 adapters, {args.cluster_n} requests at {args.cluster_rate} req/s")
    ratios = {"loads": [], "ttft_p90": [], "ttft_p99": [], "tput": []}
    for seed in args.seeds:
        wl = workload(args.cluster_n, args.cluster_rate, 16, seed)
        got = {}
        for name, kw in (("least_requests", {}), ("lora_affinity", {"adapter_field": "tenant"})):
            engines = [tenant_adapter_engine(max_loras=4, **SIM) for _ in range(4)]
            s = run_cluster(wl, engines=engines, router=name, router_kwargs=kw).summary(trim=0.1)
            got[name] = {"loads": sum(e.executor.lora.num_loads for e in engines), "ttft_p90": s["ttft_p90"],
                         "ttft_p99": s["ttft_p99"], "tput": s["throughput_tok_s"]}
            print(f"  seed {seed} {name:>15}: loads {got[name]['loads']:>4}  TTFT p90 {s['ttft_p90']:.3f} s  "
                  f"p99 {s['ttft_p99']:.3f} s  {s['throughput_tok_s']:.0f} tok/s")
        a, b = got["least_requests"], got["lora_affinity"]
        for k in ratios:
            ratios[k].append(a[k] / b[k] if k != "tput" else b[k] / a[k])
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"   effect (least_requests / lora_affinity, medians over seeds): adapter loads {med['loads']:.1f}x, "
          f"TTFT p90 {med['ttft_p90']:.1f}x, p99 {med['ttft_p99']:.1f}x; throughput lora_affinity / "
          f"least_requests {med['tput']:.3f}")


def tiny(args) -> None:
    import torch

    from minibatch import LLM, SamplingParams
    from minibatch.lora import LoRARequest, random_adapter
    from minibatch.scheduler import ScheduledBatch

    llm = LLM("tiny", enable_lora=True, max_loras=4, max_lora_rank=8, max_num_seqs=16)
    ex, mc = llm.engine.executor, llm.engine.executor.model_config
    loras = [LoRARequest(f"a{i}", i, adapter=random_adapter(mc, rank=8, seed=i)) for i in range(1, 5)]
    for lr in loras:
        ex.add_lora(lr)
    loads = []
    for r in range(args.rounds):                      # a slot load: copy into the padded buffers
        t0 = time.perf_counter()
        ex.lora._copy_in(1 + r % 4, r % 4)
        loads.append(time.perf_counter() - t0)
    # 16 sequences of 64 prompt tokens, prefilled, then decode steps timed with 0, 1, 4 adapters
    e = llm.engine
    ids = [e.add_request([5 + i] * 64, SamplingParams(max_tokens=10_000, ignore_eos=True), lora_request=None)
           for i in range(16)]
    for _ in range(3):
        e.step()
    reqs = [e.requests[i] for i in ids]
    # "fused": no adapter, the one-C-call decode path; 0: no adapter, per op (the path adapters take)
    times = {"fused": [], 0: [], 1: [], 4: []}
    model, fused = ex.model, ex.model._fused_decode
    for r in range(args.rounds):
        for k in times:
            for j, q in enumerate(reqs):
                q.lora_request = None if k in ("fused", 0) else loras[j % k]
            model._fused_decode = fused if k == "fused" else None
            batch = ScheduledBatch(items=[(q, 1) for q in reqs])
            with torch.inference_mode():
                t0 = time.perf_counter()
                ex.execute(batch, e.kv)           # the same 16 positions each time: KV rewritten in place
                times[k].append(time.perf_counter() - t0)
    model._fused_decode = fused
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"== tiny (this CPU, {args.rounds} rounds, medians): loading a rank-8 adapter into a slot "
          f"{statistics.median(loads) * 1e3:.2f} ms; decode step of 16 sequences: fused C path (no adapter) "
          f"{med['fused']:.2f} ms, per op: no adapter {med[0]:.2f} ms, 1 adapter {med[1]:.2f} ms "
          f"({med[1] / med[0]:.2f}x), 4 adapters {med[4]:.2f} ms ({med[4] / med[0]:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("slots", "router", "tiny"))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--n", type=int, default=800)
    p.add_argument("--adapters", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--overload", type=float, default=25.0)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--cluster-n", type=int, default=600)
    p.add_argument("--cluster-rate", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    t0 = time.perf_counter()
    for name, fn in (("slots", slots), ("router", router), ("tiny", tiny)):
        if args.only in (None, name):
            fn(args)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
