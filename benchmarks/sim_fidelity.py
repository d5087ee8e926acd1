"""Simulator fidelity: calibrate on a profile of this machine, predict unseen workloads.

1. Profile the real engine (``minibatch.profile``: varied training workloads) and fit
   a step-time model.
2. For workloads the profile never saw (other rates, burstiness, length mixes), run
   the real engine under the virtual clock and the simulator with
   ``hardware="profile:FILE"`` (same KV pool), and compare mean, p50 and p90 E2E
   latency and output throughput. Goal: within 15% (Vidur, MLSys'24, reports < 9% on GPUs).

    python benchmarks/sim_fidelity.py [--profile FILE] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from minibatch.profile import fit_profile, profile_engine
from minibatch.runner import run
from minibatch.workload import fixed, lognormal, synthetic, uniform

METRICS = ("e2e_mean", "e2e_p50", "e2e_p90", "throughput_tok_s")


def test_workloads():
    return {
        "poisson, short prompts": (dict(max_num_seqs=16), synthetic(
            40, 6.0, input_len=uniform(32, 256), output_len=lognormal(median=20, sigma=0.7, max=100), seed=101)),
        "bursty (burstiness 0.3)": (dict(max_num_seqs=32), synthetic(
            40, 10.0, burstiness=0.3, input_len=uniform(16, 128), output_len=fixed(32), seed=102)),
        "long prompts, chunked": (dict(max_num_seqs=8, max_num_batched_tokens=256), synthetic(
            30, 3.0, input_len=uniform(300, 700), output_len=uniform(8, 40), seed=103)),
        "saturated, all at t=0": (dict(max_num_seqs=64), synthetic(
            48, float("inf"), input_len=uniform(16, 200), output_len=lognormal(median=30, sigma=0.8, max=150),
            seed=104)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="reuse a profile (from python -m minibatch profile)")
    ap.add_argument("--runs", type=int, default=3, help="real runs per workload (median)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.profile:
        path = args.profile
    else:
        samples, meta = profile_engine("tiny")
        model = fit_profile(samples, meta)
        path = str(Path(tempfile.mkdtemp()) / "tiny-profile.json")
        model.save(path)
        print(model.describe())
    kv_blocks = json.loads(Path(path).read_text())["metadata"]["kv_capacity_tokens"] // 16
    rows, worst = [], 0.0
    print(f"\n{'workload':28s} {'metric':18s} {'real':>10s} {'sim':>10s} {'error':>8s}")
    for name, (kw, wl) in test_workloads().items():
        reals = [run(wl, model="tiny", **kw).summary() for _ in range(args.runs)]
        sim = run(wl, executor="sim", model="tiny", hardware=f"profile:{path}", num_kv_blocks=kv_blocks,
                  **kw).summary()
        for m in METRICS:
            real = statistics.median(r[m] for r in reals)
            err = (sim[m] - real) / real
            worst = max(worst, abs(err))
            rows.append({"workload": name, "metric": m, "real": real, "sim": sim[m], "rel_error": err})
            print(f"{name:28s} {m:18s} {real:10.3f} {sim[m]:10.3f} {err:+8.1%}")
    print(f"\nlargest |error|: {worst:.1%} (goal <= 15%)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
