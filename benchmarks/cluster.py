"""Routers on a multi-tenant shared-prefix workload, in the simulator: prefix_aware vs round_robin.

Every tenant's requests start with that tenant's long system prompt (``workload.multi_tenant``).
Round robin spreads each tenant over all replicas, so every replica must hold (and, when
its KV pool is too small for all tenants, recompute) every tenant's prompt; SGLang's
prefix-aware rule keeps a tenant where its prompt was sent before, while the load stays
balanced. The cluster: ``--replicas`` (8) replicas of llama-3-8b on A10s (about 35k tokens
of KV each, less than the tenants' prompts together), prefix caching on.

For each router it prints the medians over ``--seeds`` seeds (different workloads) of the
prefix-cache hit rate, TTFT p50 / p90 and output throughput, and then the wall time of
one long run (``--long`` requests on the same cluster), to show what a simulated
8-replica run costs on this machine.

    python benchmarks/cluster.py                       # 8 replicas, 3 seeds, 1,500 + 10,000 requests
    python benchmarks/cluster.py --routers round_robin prefix_aware kv_aware session
"""

from __future__ import annotations

import argparse
import statistics
import time

from minibatch import cluster
from minibatch.workload import lognormal, multi_tenant

METRICS = (("prefix_cache_hit_rate", "prefix hit", "{:.3f}"), ("ttft_p50", "TTFT p50 s", "{:.3f}"),
           ("ttft_p90", "TTFT p90 s", "{:.3f}"), ("throughput_tok_s", "out tok/s", "{:.0f}"))


def workload(n: int, rate: float, seed: int, tenants: int, prompt: int):
    return multi_tenant(n, rate, num_tenants=tenants, system_prompt_len=prompt,
                        question_len=lognormal(median=128, sigma=0.5, max=512),
                        output_len=lognormal(median=128, sigma=0.6, max=512), seed=seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--routers", nargs="+", default=["round_robin", "prefix_aware"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("-n", type=int, default=1500, help="requests per seed")
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (the whole cluster)")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=2048, help="system prompt tokens per tenant")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="a10")
    ap.add_argument("--long", type=int, default=10000, help="requests of the timed long run (0: none)")
    args = ap.parse_args(argv)
    engine = {"executor": "sim", "model": args.model, "hardware": args.hardware, "enable_prefix_caching": True}

    print(f"{args.replicas} x {args.model} on {args.hardware}, {args.tenants} tenants x {args.prompt}-token "
          f"system prompts, {args.n} requests at {args.rate:g} req/s; medians over {args.seeds} seeds")
    print(f"{'router':<16}" + "".join(f"{label:>12}" for _, label, _ in METRICS) + f"{'wall s':>9}")
    for name in args.routers:
        rows, walls = [], []
        for seed in range(args.seeds):
            wl = workload(args.n, args.rate, seed, args.tenants, args.prompt)
            t = time.perf_counter()
            res = cluster.run(wl, replicas=args.replicas, router=name, **engine)
            walls.append(time.perf_counter() - t)
            rows.append(res.summary())
        med = {key: statistics.median(r[key] for r in rows) for key, _, _ in METRICS}
        print(f"{name:<16}" + "".join(f"{fmt.format(med[key]):>12}" for key, _, fmt in METRICS)
              + f"{statistics.median(walls):>9.1f}")
    if args.long:
        wl = workload(args.long, args.rate, 0, args.tenants, args.prompt)
        for name in args.routers:
            t = time.perf_counter()
            res = cluster.run(wl, replicas=args.replicas, router=name, **engine)
            wall = time.perf_counter() - t
            s = res.summary()
            print(f"long run, {name}: {args.long} requests, {len(res.steps)} steps on {args.replicas} replicas, "
                  f"{s['duration_s']:.0f} s simulated in {wall:.1f} s wall")


if __name__ == "__main__":
    main()
