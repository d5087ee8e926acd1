"""How much of a simulated cluster run the cyclic garbage collector costs (minibatch.runner).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_gc.py [--rounds 5]

Chapter 27's setups (4 A100-80G replicas of Llama-3-8B, 60 s of Poisson traffic: colocated,
chunked 512, 3P1D) replayed alternately with CPython's default thresholds (700, 10, 10) and with
the thresholds ``minibatch.runner.run`` / ``minibatch.cluster.run`` set while they run, each
round in the same process with the earlier rounds' results kept alive, as a notebook keeps
them. Prints the median wall time of each and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from minibatch import cluster
from minibatch.cluster import Disaggregation
from minibatch.runner import RUN_THRESHOLDS
from minibatch.workload import lognormal, synthetic

ENGINE = dict(executor="sim", model="llama-3-8b", hardware="a100-80g")
PROMPT, OUTPUT = lognormal(median=2048, sigma=0.5, max=6144), lognormal(median=128, sigma=0.5, max=512)


def workload(rate, seed):
    return synthetic(int(rate * 60), rate, input_len=PROMPT, output_len=OUTPUT, seed=seed)


def one_round(seed, kept):
    run = cluster.run.__wrapped__          # the undecorated run: the thresholds are this script's
    kept.append(run(workload(10.0, seed), router="least_requests", replicas=4, enable_chunked_prefill=False,
                    max_num_batched_tokens=8192, **ENGINE))
    kept.append(run(workload(10.0, seed), router="least_requests", replicas=4, max_num_batched_tokens=512, **ENGINE))
    kept.append(run(workload(16.0, seed), router="least_requests",
                    disaggregation=Disaggregation(3, 1, link_gbps=200), **ENGINE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    old, kept, times = gc.get_threshold(), [], {"default": [], "run": []}
    try:
        for r in range(args.rounds):
            for name, th in (("default", (700, 10, 10)), ("run", RUN_THRESHOLDS))[:: 1 if r % 2 == 0 else -1]:
                gc.set_threshold(*th)
                t0 = time.perf_counter()
                one_round(1 + r, kept)
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.set_threshold(*old)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>8} thresholds: median {med[k]:.2f} s over {len(v)} rounds ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"run / default = {med['run'] / med['default']:.2f}")


if __name__ == "__main__":
    main()
