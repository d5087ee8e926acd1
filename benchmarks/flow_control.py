"""Gateway flow control: queue at the router (by band, fair across tenants) or inside the engines.

Simulator cluster: 4 replicas of Llama-3-8B, each on one A10 (roofline cost model, virtual
clock), router ``least_requests``. Workload ``two_band_workload(seed)`` (minibatch.cluster.
flow_control): 60 s; band 0 = chat tenants, Poisson 2 req/s; band 1 = a ``batch`` tenant that
sends 120 requests at once every 15 s (from t = 2 s) plus 3 light tenants at 0.5 req/s each;
prompts U[256, 1024), outputs U[64, 256) tokens. Steady state: only requests arriving in
[``--t0``, ``--t1``) = [10, 50) s are measured (the first burst's fill-up and the drain after the
last arrival are discarded); ``--seeds`` seeds (default 0 1 2).

Three configurations, each on the same workload per seed:
  engine     every arrival routed at once; the engines queue it (FCFS, minibatch's default policy)
  priority   the same, but the engines schedule by priority (``policy="priority"``, vLLM's
             ``--scheduling-policy priority``): band order inside the engine, no tenant fairness
  flow       ``FlowControl(max_requests_per_replica=--cap)``: held at the router, band first,
             round robin across tenants in a band, released when a replica has room

Printed per configuration (median over seeds): band-0 TTFT mean and p90, the light tenants'
TTFT p90 (band 1, fairness against the bursty ``batch`` tenant), the batch tenant's TTFT p90,
output tokens/s over the whole run. The effect is the ratio flow / engine of each (one run per
seed, same workloads), and ``--caps`` sweeps the bound (the cost: a tight bound shrinks batches).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flow_control.py            # ~25 s here (loaded 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flow_control.py --cap 20 --caps 16 24 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minibatch import cluster
from minibatch.cluster.flow_control import FlowControl, two_band_workload

SIM = dict(replicas=4, router="least_requests", executor="sim", model="llama-3-8b", hardware="a10")


def stats(res, t0: float, t1: float) -> dict:
    """TTFT by band / tenant group of the requests arriving in [t0, t1); throughput of the run."""
    recs = [r for r in res.requests if t0 <= r.arrival_time < t1 and r.ttft is not None]

    def pick(pred):
        return np.array([r.ttft for r in recs if pred(r)])

    hi = pick(lambda r: r.priority == 0)
    light = pick(lambda r: (r.tenant or "").startswith("light"))
    batch = pick(lambda r: r.tenant == "batch")
    end = max(r.finish_time for r in res.requests)
    start = min(r.arrival_time for r in res.requests)
    return {"hi_mean": float(hi.mean()), "hi_p90": float(np.percentile(hi, 90)),
            "light_p90": float(np.percentile(light, 90)), "batch_p90": float(np.percentile(batch, 90)),
            "tok_s": sum(r.output_len for r in res.requests) / (end - start)}


def run_config(name: str, seed: int, cap: int) -> dict:
    wl = two_band_workload(seed)
    if name == "engine":
        res = cluster.run(wl, **SIM)
    elif name == "priority":
        res = cluster.run(wl, **SIM, policy="priority")
    else:
        res = cluster.run(wl, **SIM, flow_control=FlowControl(max_requests_per_replica=cap))
    assert len(res.requests) == len(wl) and all(r.finish_reason == "length" for r in res.requests)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cap", type=int, default=24, help="FlowControl.max_requests_per_replica")
    ap.add_argument("--caps", type=int, nargs="*", default=[16, 20, 32], help="bounds to sweep (seed 0 .. all seeds)")
    ap.add_argument("--t0", type=float, default=10.0)
    ap.add_argument("--t1", type=float, default=50.0)
    args = ap.parse_args()
    wall = time.perf_counter()
    keys = ("hi_mean", "hi_p90", "light_p90", "batch_p90", "tok_s")
    table = {}
    for name in ("engine", "priority", "flow"):
        per_seed = [stats(run_config(name, s, args.cap), args.t0, args.t1) for s in args.seeds]
        table[name] = {k: float(np.median([p[k] for p in per_seed])) for k in keys}
        table[name]["per_seed"] = per_seed
    print(f"4 x llama-3-8b on A10, least_requests, two_band_workload seeds {args.seeds}, "
          f"measured arrivals in [{args.t0:g}, {args.t1:g}) s; medians over seeds")
    print(f"{'config':<22}" + "".join(f"{k:>11}" for k in keys))
    for name, row in table.items():
        label = name if name != "flow" else f"flow (cap {args.cap})"
        print(f"{label:<22}" + "".join(f"{row[k]:>11.3f}" for k in keys))
    e, f = table["engine"], table["flow"]
    print("\nratio flow / engine (per seed, then median):")
    for k in keys:
        r = [pf[k] / pe[k] for pf, pe in zip(f["per_seed"], e["per_seed"])]
        print(f"  {k:<10} {float(np.median(r)):7.3f}   per seed {[round(x, 3) for x in r]}")
    if args.caps:
        print(f"\nsweep of the bound (max_requests_per_replica), medians over seeds {args.seeds}:")
        print(f"{'cap':>6}" + "".join(f"{k:>11}" for k in keys))
        for cap in args.caps:
            per_seed = [stats(run_config("flow", s, cap), args.t0, args.t1) for s in args.seeds]
            print(f"{cap:>6}" + "".join(f"{float(np.median([p[k] for p in per_seed])):>11.3f}" for k in keys))
    print(f"\nwall {time.perf_counter() - wall:.1f} s")


if __name__ == "__main__":
    main()
