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

Two more modes (medians over ``--seeds`` seeds):

    python benchmarks/cluster.py --autoscale    # Azure conversation trace: autoscaler vs static for the peak
    python benchmarks/cluster.py --migration    # long-tail outputs: round robin with and without migration

``--autoscale``: the shipped Azure LLM inference trace (conversation, 2023-11-16, one hour),
each request kept with probability ``--keep`` (the seed draws which: the rate's shape over
the hour stays), on llama-3-8b / A10 replicas behind ``least_requests``. The autoscaler uses
Ray Serve's defaults for its delays and look-back (upscale 30 s, downscale 600 s, look back
30 s, decisions every 0.1 s), ``--target`` ongoing requests per replica, 1..``--max-replicas``
replicas and a ``--cold-start`` (loading the weights). The static cluster is provisioned for
the peak: as many replicas as the autoscaler needed at most in that seed. Printed: peak
replicas, replica-seconds, SLO attainment (TTFT <= ``--ttft-slo``, TPOT <= ``--tpot-slo``),
TTFT p99 and E2E p99.

``--migration``: Poisson arrivals, prompts lognormal (median 512), outputs long-tailed
(lognormal median 64, sigma 1.5, max 4,096: minibatch's ``long_tail`` preset's lengths) on
``--replicas`` llama-3-8b / A10 replicas; round robin (blind to how long each request will
run), with and without Llumnix-style migration (defaults of ``Migration``: a decision every
0.1 s, 100 Gb/s link), and least_requests without migration for reference. Printed: TTFT
p50 / p99, E2E p99, migrations and KV bytes moved.
"""

from __future__ import annotations

import argparse
import statistics
import time

from minibatch import cluster
from minibatch.cluster import Autoscaler, Migration
from minibatch.workload import Workload, load_shipped_trace, lognormal, multi_tenant, synthetic

METRICS = (("prefix_cache_hit_rate", "prefix hit", "{:.3f}"), ("ttft_p50", "TTFT p50 s", "{:.3f}"),
           ("ttft_p90", "TTFT p90 s", "{:.3f}"), ("throughput_tok_s", "out tok/s", "{:.0f}"))


def workload(n: int, rate: float, seed: int, tenants: int, prompt: int):
    return multi_tenant(n, rate, num_tenants=tenants, system_prompt_len=prompt,
                        question_len=lognormal(median=128, sigma=0.5, max=512),
                        output_len=lognormal(median=128, sigma=0.6, max=512), seed=seed)


def thinned_trace(keep: float, seed: int) -> Workload:
    import numpy as np

    rng = np.random.default_rng(seed)
    wl = load_shipped_trace("azure_conv")
    return Workload([r for r in wl if rng.random() < keep], name=f"azure_conv x{keep:g}")


def autoscale(args) -> None:
    engine = {"executor": "sim", "model": args.model, "hardware": args.hardware}
    slo = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    keys = (("replicas_peak", "peak repl", "{:.0f}"), ("replica_seconds", "replica-s", "{:.0f}"),
            ("slo_attainment", "SLO att.", "{:.3f}"), ("ttft_p99", "TTFT p99 s", "{:.2f}"),
            ("e2e_p99", "E2E p99 s", "{:.1f}"))
    rows: dict[str, list[dict]] = {"autoscaled": [], "static (peak)": []}
    n = []
    for seed in range(args.seeds):
        wl = thinned_trace(args.keep, seed)
        n.append(len(wl))
        a = Autoscaler(min_replicas=1, max_replicas=args.max_replicas, target_ongoing_requests=args.target,
                       upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_period_s=30.0,
                       cold_start_s=args.cold_start, interval_s=0.1)
        s = cluster.run(wl, router="least_requests", autoscaler=a, **engine).summary(slo=slo)
        s["replicas_peak"] = max([1] + [k for _, k in s["scale_events"]])
        rows["autoscaled"].append(s)
        peak = s["replicas_peak"]
        st = cluster.run(wl, replicas=peak, router="least_requests", **engine).summary(slo=slo)
        st["replicas_peak"] = peak
        rows["static (peak)"].append(st)
    print(f"Azure conv trace (1 h) x {args.keep:g} ({statistics.median(n):.0f} requests), {args.model} on "
          f"{args.hardware}, least_requests; autoscaler target {args.target:g} ongoing/replica, 1..{args.max_replicas}, "
          f"cold start {args.cold_start:g} s; SLO TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo:g} s; "
          f"medians over {args.seeds} seeds")
    print(f"{'cluster':<16}" + "".join(f"{label:>12}" for _, label, _ in keys))
    for name, rs in rows.items():
        print(f"{name:<16}" + "".join(f"{fmt.format(statistics.median(r[k] for r in rs)):>12}" for k, _, fmt in keys))


def migration_bench(args) -> None:
    engine = {"executor": "sim", "model": args.model, "hardware": args.hardware}
    keys = (("ttft_p50", "TTFT p50 s", "{:.3f}"), ("ttft_p99", "TTFT p99 s", "{:.2f}"),
            ("e2e_p99", "E2E p99 s", "{:.1f}"), ("migrations", "moves", "{:.0f}"),
            ("kv_transfer_bytes", "KV GB moved", "{:.1f}"))
    setups = (("round_robin", "round_robin", None), ("round_robin+migration", "round_robin", Migration()),
              ("least_requests", "least_requests", None))
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in setups}
    for seed in range(args.seeds):
        wl = synthetic(args.n, args.rate, input_len=lognormal(median=512, sigma=0.8, max=4096),
                       output_len=lognormal(median=64, sigma=1.5, max=4096), seed=seed, name="long_tail")
        for name, router, mig in setups:
            s = cluster.run(wl, replicas=args.replicas, router=router, migration=mig, **engine).summary()
            s["kv_transfer_bytes"] = s["kv_transfer_bytes"] / 1e9
            rows[name].append(s)
    print(f"long-tail outputs (lognormal median 64, sigma 1.5), {args.n} requests at {args.rate:g} req/s on "
          f"{args.replicas} x {args.model} / {args.hardware}; medians over {args.seeds} seeds")
    print(f"{'router':<24}" + "".join(f"{label:>12}" for _, label, _ in keys))
    for name, rs in rows.items():
        print(f"{name:<24}" + "".join(f"{fmt.format(statistics.median(r[k] for r in rs)):>12}" for k, _, fmt in keys))


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
    ap.add_argument("--autoscale", action="store_true", help="autoscaler vs static provisioning (Azure conv)")
    ap.add_argument("--migration", action="store_true", help="round robin with and without migration")
    ap.add_argument("--keep", type=float, default=0.25, help="--autoscale: fraction of the trace's requests kept")
    ap.add_argument("--target", type=float, default=8.0, help="--autoscale: target ongoing requests per replica")
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--cold-start", type=float, default=60.0, help="--autoscale: seconds before a new replica serves")
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--tpot-slo", type=float, default=0.15)
    args = ap.parse_args(argv)
    if args.autoscale or args.migration:
        if args.autoscale:
            autoscale(args)
        if args.migration:
            if args.n == 1500 and args.rate == 12.0:          # this mode's own defaults
                args.n, args.rate = 800, 14.0
            if args.replicas == 8:
                args.replicas = 4
            migration_bench(args)
        return
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
