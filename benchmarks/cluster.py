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
    python benchmarks/cluster.py --llmd                # llm-d's shape: 150 tenants x 6,000 tokens, saturated

``--llmd``: llm-d's prefix-aware routing benchmark's shape (150 tenants with 6,000-token
system prompts on 8 replicas; llm-d reports P90 TTFT 0.54 s vs 92.6 s for random routing and
1.97x throughput) on llama-3-8b / A100-80GB replicas (about 450k tokens of KV each: one replica
holds some 75 tenants' prompts, fewer than 150, so round robin thrashes every cache while a
router that keeps tenants apart needs about 19 per replica), offered 40 req/s, more than round
robin can sustain. Hit rate and TTFT are steady state (``summary(trim=0.2)``: the first and
last 20% of requests by arrival left out); throughput is over the whole run (output tokens /
makespan), which for a router past its capacity is that capacity (a trimmed window would
leave out the tokens a backlog of earlier requests produces inside it).

``--speed``: the wall time of 8 simulated replicas over the whole shipped Azure conversation
trace (19,366 requests in an hour), least_requests.

Two more modes (medians over ``--seeds`` seeds):

    python benchmarks/cluster.py --autoscale    # Azure conversation trace: autoscaler vs static for the peak
    python benchmarks/cluster.py --migration    # long-tail outputs: round robin with and without migration
    python benchmarks/cluster.py --disagg       # colocated vs prefill/decode disaggregation, goodput per GPU

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

``--disagg``: DistServe's comparison at equal GPU count (``--gpus``, default 4 llama-3-8b /
A100-80GB replicas, one GPU each): colocated (``least_requests``) vs every prefill/decode split
P + D = gpus (``Disaggregation``, ``--link-gbps`` link, least-loaded decode side). Figure of merit:
goodput per GPU, the highest Poisson rate (1..512 req/s, runs of at least ``--duration`` s of arrivals) at which >= 90% of the steady-state requests (trim 0.1)
meet both TTFT <= ``--ttft-slo`` and TPOT <= ``--tpot-slo`` (``minibatch.cluster.goodput_per_gpu``,
bisection to 10%), medians over ``--seeds`` seeds. Three regimes: long prompts (lognormal median
``--disagg-prompt``) with a tight TPOT SLO, where prefills stall colocated decodes; the same on a
slow link (``--slow-gbps``); short prompts (median 128), where there is little prefill to isolate.
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
                       upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
                       look_back_period_s=30.0, cold_start_s=args.cold_start, interval_s=0.1,
                       metric=args.metric, slo={"ttft": args.ttft_slo} if args.metric == "slo_attainment" else None)
        s = cluster.run(wl, router="least_requests", autoscaler=a, **engine).summary(slo=slo)
        s["replicas_peak"] = max([1] + [k for _, k in s["scale_events"]])
        rows["autoscaled"].append(s)
        peak = s["replicas_peak"]
        st = cluster.run(wl, replicas=peak, router="least_requests", **engine).summary(slo=slo)
        st["replicas_peak"] = peak
        rows["static (peak)"].append(st)
    print(f"Azure conv trace (1 h) x {args.keep:g} ({statistics.median(n):.0f} requests), {args.model} on "
          f"{args.hardware}, least_requests; autoscaler metric {args.metric}, target {args.target:g} ongoing/replica, "
          f"delays up {args.upscale_delay:g} s / down {args.downscale_delay:g} s, 1..{args.max_replicas}, "
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


def disagg_bench(args) -> None:
    from minibatch.cluster import Disaggregation, goodput_per_gpu

    engine = {"executor": "sim", "model": args.model, "hardware": args.hardware}
    slo = {"ttft": args.ttft_slo, "tpot": args.tpot_slo}
    regimes = (("long prompts", args.disagg_prompt, args.link_gbps),
               (f"long prompts, {args.slow_gbps:g} Gb/s link", args.disagg_prompt, args.slow_gbps),
               ("short prompts", 128, args.link_gbps))
    splits = [(p, args.gpus - p) for p in range(1, args.gpus)]
    print(f"{args.gpus} GPUs of {args.model} / {args.hardware}, SLO TTFT <= {args.ttft_slo:g} s and TPOT <= "
          f"{args.tpot_slo:g} s for >= 90% of requests, max({args.n}, rate x {args.duration:g} s) Poisson requests a "
          "run; goodput per GPU "
          f"(req/s/GPU), medians over {args.seeds} seeds")
    print(f"{'regime':<34}{'colocated':>11}" + "".join(f"{f'{p}P+{d}D':>9}" for p, d in splits) + f"{'wall s':>8}")
    for name, prompt, gbps in regimes:
        t0 = time.perf_counter()
        cols: dict[str, list[float]] = {}
        for seed in range(args.seeds):
            def at(rate, prompt=prompt, seed=seed):
                n = max(args.n, int(rate * args.duration))       # at least --duration s of arrivals
                return synthetic(n, rate, input_len=lognormal(median=prompt, sigma=0.5, max=4 * prompt),
                                 output_len=lognormal(median=128, sigma=0.5, max=512), seed=seed)
            kw = dict(slo=slo, trim=0.1, lo=1.0, hi=512.0, tol=0.1, **engine)
            cols.setdefault("colocated", []).append(
                goodput_per_gpu(at, replicas=args.gpus, router="least_requests", **kw))
            for p, d in splits:
                dis = Disaggregation(prefill=p, decode=d, link_gbps=gbps)
                cols.setdefault(f"{p}P+{d}D", []).append(
                    goodput_per_gpu(at, disaggregation=dis, router="least_requests", **kw))
        med = {k: statistics.median(v) for k, v in cols.items()}
        print(f"{name:<34}{med['colocated']:>11.3f}" + "".join(f"{med[f'{p}P+{d}D']:>9.3f}" for p, d in splits)
              + f"{time.perf_counter() - t0:>8.0f}")


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
    ap.add_argument("--llmd", action="store_true", help="llm-d's shape: 150 tenants x 6,000 tokens, 40 req/s")
    ap.add_argument("--speed", action="store_true", help="wall time of the whole Azure conv trace")
    ap.add_argument("--autoscale", action="store_true", help="autoscaler vs static provisioning (Azure conv)")
    ap.add_argument("--migration", action="store_true", help="round robin with and without migration")
    ap.add_argument("--keep", type=float, default=0.25, help="--autoscale: fraction of the trace's requests kept")
    ap.add_argument("--target", type=float, default=8.0, help="--autoscale: target ongoing requests per replica")
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--upscale-delay", type=float, default=30.0, help="--autoscale: s (Ray Serve's default 30)")
    ap.add_argument("--downscale-delay", type=float, default=600.0,
                    help="--autoscale: s (Ray Serve's default 600)")
    ap.add_argument("--metric", default="ongoing_requests", help="--autoscale: the autoscaler's metric "
                    "(ongoing_requests, queue, kv_usage, slo_attainment: on the TTFT SLO)")
    ap.add_argument("--cold-start", type=float, default=60.0, help="--autoscale: seconds before a new replica serves")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (default 5; --disagg: 1.5)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds (default 0.15; --disagg: 0.025)")
    ap.add_argument("--disagg", action="store_true", help="colocated vs disaggregated goodput per GPU")
    ap.add_argument("--gpus", type=int, default=4, help="--disagg: GPUs (replicas) of either cluster")
    ap.add_argument("--disagg-prompt", type=int, default=2048, help="--disagg: median prompt of the long regime")
    ap.add_argument("--link-gbps", type=float, default=100.0, help="--disagg: prefill-to-decode link")
    ap.add_argument("--duration", type=float, default=10.0, help="--disagg: seconds of arrivals a run, at least")
    ap.add_argument("--slow-gbps", type=float, default=1.0, help="--disagg: the slow link's Gb/s")
    args = ap.parse_args(argv)
    if args.disagg:
        args.ttft_slo = 1.5 if args.ttft_slo is None else args.ttft_slo
        args.tpot_slo = 0.025 if args.tpot_slo is None else args.tpot_slo
        if args.n == 1500:
            args.n = 300
        if args.hardware == "a10":
            args.hardware = "a100-80g"
        disagg_bench(args)
        return
    args.ttft_slo = 5.0 if args.ttft_slo is None else args.ttft_slo
    args.tpot_slo = 0.15 if args.tpot_slo is None else args.tpot_slo
    if args.speed:
        wl = load_shipped_trace("azure_conv")
        t = time.perf_counter()
        res = cluster.run(wl, replicas=args.replicas, router="least_requests", executor="sim", model=args.model,
                          hardware=args.hardware)
        wall = time.perf_counter() - t
        print(f"Azure conv trace, {len(wl)} requests on {args.replicas} x {args.model} / {args.hardware}: "
              f"{len(res.steps)} steps, {res.summary()['duration_s']:.0f} s simulated in {wall:.1f} s wall")
        return
    if args.llmd:
        args.tenants, args.prompt, args.hardware, args.rate = 150, 6000, "a100-80g", 40.0
        args.n = 1000 if args.n == 1500 else args.n
        args.long = 0
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
          f"system prompts, {args.n} requests at {args.rate:g} req/s; steady state (trim 0.2), medians over "
          f"{args.seeds} seeds")
    print(f"{'router':<16}" + "".join(f"{label:>12}" for _, label, _ in METRICS) + f"{'wall s':>9}")
    for name in args.routers:
        rows, walls = [], []
        for seed in range(args.seeds):
            wl = workload(args.n, args.rate, seed, args.tenants, args.prompt)
            t = time.perf_counter()
            res = cluster.run(wl, replicas=args.replicas, router=name, **engine)
            walls.append(time.perf_counter() - t)
            row = res.summary(trim=0.2)
            if args.llmd:
                row["throughput_tok_s"] = res.summary()["throughput_tok_s"]     # whole run: the capacity
            rows.append(row)
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
