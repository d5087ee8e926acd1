"""Cost of the live dashboard.

1. Real tiny model on CPU: the same saturated workload (``--requests`` requests arriving
   within half a second, prompts of 16-128 tokens, 16-64 output tokens) run headless with
   ``minibatch.run`` (in a worker thread, as the dashboard runs it) and inside a
   ``Dashboard`` at full speed with live plotting. Reports output tokens/s (engine time,
   i.e. measured step times, and wall time), median of ``--runs`` runs each, interleaved;
   the dashboard must keep at least 80 % of the headless throughput.
2. Simulator (llama-2-7b on a100-80g, 300 ``chat`` requests, paced at ``--sim-speed``
   virtual seconds per wall second): frames drawn per wall second; must be >= 5.

    python benchmarks/dashboard.py [--runs 3] [--requests 32] [--sim-speed 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a shared, oversubscribed CPU, OpenMP's spin-waiting makes torch in the main thread
# several times slower than in a worker thread; passive waiting removes that difference.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from minibatch.runner import run  # noqa: E402
from minibatch.widgets import Dashboard  # noqa: E402
from minibatch.workload import synthetic, uniform  # noqa: E402


def tiny_workload(n: int):
    wl = synthetic(n, rate=2.0 * n, input_len=uniform(16, 128), output_len=uniform(16, 64), seed=7,
                   name="bench")
    return wl, {"executor": "model", "model": "tiny", "policy": "continuous"}


def run_in_thread(wl, kw):
    """Headless ``run`` in a worker thread, as the dashboard runs it (same threading, no plots)."""
    out = []
    th = threading.Thread(target=lambda: out.append(run(wl, **kw)))
    th.start()
    th.join()
    return out[0]


def throughput(result) -> tuple[float, float]:
    s = result.summary()
    return s["throughput_tok_s"], s["total_output_tokens"] / result.wall_time_s


def bench_tiny(runs: int, n: int) -> dict:
    wl, kw = tiny_workload(n)
    run(wl.slice(0, 4), **kw)                             # warm up (model load, kernels)
    head, live, fps = [], [], []
    for _ in range(runs):
        head.append(throughput(run_in_thread(wl, kw)))
        d = Dashboard(wl, speed=0, **kw)
        d.start()
        r = d.wait(600)
        live.append(throughput(r))
        fps.append(d.refresh_rate())
    print(f"  runs (engine tok/s): headless {[round(x) for x, _ in head]}, dashboard {[round(x) for x, _ in live]}")
    h = statistics.median(x for x, _ in head)
    lv = statistics.median(x for x, _ in live)
    hw = statistics.median(w for _, w in head)
    lw = statistics.median(w for _, w in live)
    best = max(x for x, _ in live) / max(x for x, _ in head)
    return {"requests": len(wl), "headless_tok_s": h, "dashboard_tok_s": lv, "ratio": lv / h, "best_ratio": best,
            "headless_wall_tok_s": hw, "dashboard_wall_tok_s": lw, "wall_ratio": lw / hw,
            "dashboard_frames_per_s": statistics.median(fps), "runs": {"headless": head, "dashboard": live}}


def bench_sim(speed: float, n: int = 300) -> dict:
    d = Dashboard(executor="sim", model="llama-2-7b", hardware="a100-80g", workload="chat", num_requests=n,
                  request_rate=8.0, speed=speed)
    t = time.perf_counter()
    d.start()
    r = d.wait(600)
    wall = time.perf_counter() - t
    s = r.summary()
    return {"requests": n, "virtual_s": s["duration_s"], "wall_s": wall, "frames": d.renders,
            "frames_per_s": d.refresh_rate(), "full_draws": d.plot.full_draws, "panel_draws": d.plot.panel_draws,
            "completed": s["completed"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--sim-speed", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tiny = bench_tiny(args.runs, args.requests)
    print(f"tiny model, {tiny['requests']} requests, median of {args.runs}:")
    for key in ("headless", "dashboard"):
        print(f"  {key:10s} {tiny[key + '_tok_s']:8.1f} tok/s (engine time)  "
              f"{tiny[key + '_wall_tok_s']:8.1f} tok/s (wall)")
    print(f"  dashboard frames/s {tiny['dashboard_frames_per_s']:.1f}")
    print(f"  dashboard / headless = {tiny['ratio']:.2f} (engine time), {tiny['wall_ratio']:.2f} (wall); "
          f"limit >= 0.80 -> {'PASS' if tiny['ratio'] >= 0.8 else 'FAIL'}")
    print(f"  best of {args.runs}: dashboard / headless = {tiny['best_ratio']:.2f} "
          "(less sensitive to other load on a shared machine)")
    sim = bench_sim(args.sim_speed)
    print(f"simulator llama-2-7b/a100-80g, {sim['requests']} requests, {sim['virtual_s']:.1f} s virtual in "
          f"{sim['wall_s']:.1f} s wall (speed {args.sim_speed:g}x):")
    print(f"  {sim['frames']} frames, {sim['frames_per_s']:.1f} frames/s ({sim['full_draws']} full redraws, "
          f"{sim['panel_draws']} panel redraws); limit >= 5 -> {'PASS' if sim['frames_per_s'] >= 5 else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiny": tiny, "sim": sim}, f, indent=1)
    return 0 if tiny["ratio"] >= 0.8 and sim["frames_per_s"] >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
