"""How much can batching buy on this machine? The skewed workload against its roofline floor.

``offline_throughput.py`` reports minibatch's continuous batching against minibatch with
``max_num_seqs=1`` (the goal there is 8x). That ratio mixes two things: what batching
saves in hardware work (each step reads the weights once for the whole batch), and what
it saves in *software* cost per step (Python scheduling, op dispatch, thread wake-ups),
which a one-sequence engine pays once per token. This script separates them.

It runs the skewed workload through both engines, records every step's composition
(prefill chunks and decode context lengths, as the profiler does) and its measured time,
and prices each recorded step on the roofline of this machine, measured here:

* compute: the best FLOP/s of the model's own GEMM shapes at 2,048 rows (oneDNN prepacked);
* memory: read bandwidth from DRAM (a 256 MiB tensor) and from the last-level cache
  (a 16 MiB one), both with the engine's thread count.

The floor of a step is :class:`minibatch.sim.RooflineCostModel`'s step time on that
hardware with no step overhead and efficiencies of 1: every GEMM reads its weights and
every attention call its K/V once, at the measured bandwidth, or runs at the measured
GEMM peak, whichever is slower. Elementwise ops are not charged. With DRAM bandwidth it
is the floor of an engine whose weights do not stay in cache between steps; with
cache bandwidth, of one whose weights and KV all stay cached (a lower floor still).

It prints, for both engines, the measured time, the floors and the excess over the floor
per step and per token, and the continuous / one-sequence ratio measured and at the
floors. The ratio of the floors is what batching buys on this hardware; the rest of the
measured ratio is software cost per step that the one-sequence engine pays per token.

    python benchmarks/batching_bound.py              # CPU, embedded tiny model, 3 runs
    python benchmarks/batching_bound.py --runs 1 --out bound.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import minibatch_run, skewed_workload  # noqa: E402

from minibatch import LLM  # noqa: E402
from minibatch.sim.calibrate import (RecordingExecutor, floor_hardware, measure_gemm_peak,  # noqa: E402
                               measure_read_bandwidth)
from minibatch.sim import RooflineCostModel  # noqa: E402
from minibatch.sim.model_specs import ModelSpec  # noqa: E402


def floor_seconds(samples: list[dict], model: RooflineCostModel) -> float:
    """The roofline floor of a run: the sum of its recorded steps' floors."""
    return sum(model.step_time(s["prefill"], s["decode"]) for s in samples)


def recorded_steps(llm: LLM, prompts, olens) -> list[dict]:
    """The steps of one run, recorded (composition and time); the schedule of an offline
    run does not depend on timing, so one recorded run gives every run's steps."""
    rec = RecordingExecutor(llm.engine.executor)
    llm.engine.executor = rec
    try:
        minibatch_run(llm, prompts, olens)
    finally:
        llm.engine.executor = rec.inner
    return rec.samples


BUCKETS = (("steps with prefill", None), ("decode, 1 seq", (1, 1)), ("decode, 2-16", (2, 16)),
           ("decode, 17-64", (17, 64)), ("decode, 65+", (65, 1 << 30)))


def bucket_table(samples: list[dict], model: RooflineCostModel) -> list[tuple[str, int, float, float]]:
    """``(bucket, steps, measured s, floor s)`` for each kind of step that occurs."""
    rows = []
    for name, span in BUCKETS:
        if span is None:
            sel = [s for s in samples if s["prefill"]]
        else:
            sel = [s for s in samples if not s["prefill"] and span[0] <= len(s["decode"]) <= span[1]]
        if sel:
            rows.append((name, len(sel), sum(s["time_s"] for s in sel), floor_seconds(sel, model)))
    return rows


def summarize(samples: list[dict], seconds: float, floors: dict[str, RooflineCostModel]) -> dict:
    tokens = sum(len(s["decode"]) + sum(n for n, _ in s["prefill"]) for s in samples)
    out = {"seconds": seconds, "steps": len(samples), "tokens": tokens}
    for name, model in floors.items():
        out[f"floor_{name}_s"] = floor_seconds(samples, model)
    out["buckets"] = [dict(zip(("kind", "steps", "measured_s", "floor_dram_s"), row))
                      for row in bucket_table(samples, floors["dram"])]
    out["excess_per_step_ms"] = (seconds - out["floor_dram_s"]) / len(samples) * 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--runs", type=int, default=3, help="runs of each engine (median)")
    ap.add_argument("--target", type=float, default=8.0, help="ratio goal to report against")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    from minibatch.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    spec = replace(ModelSpec.from_hf_config(path), dtype_bytes=4)     # the engine runs float32 on CPU
    llm = LLM(str(path))
    llm1 = LLM(str(path), max_num_seqs=1)
    for engine_llm in (llm, llm1):
        engine_llm.engine.executor.warm_up()
    prompts, olens = skewed_workload(spec.vocab_size)
    minibatch_run(llm, prompts[:8], olens[:8])
    minibatch_run(llm1, prompts[:2], olens[:2])

    peak = measure_gemm_peak(spec)
    dram = measure_read_bandwidth(256 << 20)
    cache = measure_read_bandwidth(16 << 20)
    print(f"this machine ({torch.get_num_threads()} threads): GEMM peak {peak / 1e9:.0f} GFLOP/s "
          f"(the model's shapes, best of 128-2,048 rows); read bandwidth DRAM {dram / 1e9:.1f} GB/s, "
          f"cache (16 MiB) {cache / 1e9:.1f} GB/s", flush=True)
    floors = {"dram": RooflineCostModel(spec, floor_hardware("dram", peak, dram)),
              "cache": RooflineCostModel(spec, floor_hardware("cache", peak, cache))}

    results = {"machine": {"gemm_flops": peak, "dram_bytes_per_s": dram, "cache_bytes_per_s": cache,
                           "threads": torch.get_num_threads()},
               "workload": {"requests": len(prompts), "output_tokens": sum(olens),
                            "prompt_tokens": sum(len(p) for p in prompts)}}
    # Timed runs without the recorder (its bookkeeping is per step, which would weigh on
    # the one-sequence engine's 7,000 steps); the two engines alternate run by run, so that
    # the machine's drift falls on both alike, as in offline_throughput.py.
    walls = {"continuous": [], "max_num_seqs=1": []}
    for _ in range(args.runs):
        for name, engine_llm in (("continuous", llm), ("max_num_seqs=1", llm1)):
            t = time.perf_counter()
            minibatch_run(engine_llm, prompts, olens)
            walls[name].append(time.perf_counter() - t)
    for name, engine_llm in (("continuous", llm), ("max_num_seqs=1", llm1)):
        results[name] = summarize(recorded_steps(engine_llm, prompts, olens),
                                  statistics.median(walls[name]), floors)
        results[name]["runs_s"] = walls[name]
    c, s = results["continuous"], results["max_num_seqs=1"]
    print(f"\nskewed workload: {len(prompts)} requests, {sum(olens)} output tokens; "
          f"medians of {args.runs} runs\n")
    print(f"{'engine':16s} {'steps':>6s} {'measured':>9s} {'floor DRAM':>11s} {'floor cache':>12s} "
          f"{'excess/step':>12s}")
    for name, r in (("continuous", c), ("max_num_seqs=1", s)):
        print(f"{name:16s} {r['steps']:6d} {r['seconds']:8.3f}s {r['floor_dram_s']:10.3f}s "
              f"{r['floor_cache_s']:11.3f}s {r['excess_per_step_ms']:9.3f} ms")
    print("\nwhere the time goes (the recorded run; measured vs DRAM floor):")
    for name, r in (("continuous", c), ("max_num_seqs=1", s)):
        for b in r["buckets"]:
            print(f"  {name:16s} {b['kind']:20s} {b['steps']:5d} steps {b['measured_s']:7.3f}s "
                  f"floor {b['floor_dram_s']:7.3f}s  ({b['measured_s'] / b['floor_dram_s']:.2f}x)")
    ratios = {"measured": s["seconds"] / c["seconds"],
              "floor_dram": s["floor_dram_s"] / c["floor_dram_s"],
              "floor_cache": s["floor_cache_s"] / c["floor_cache_s"]}
    results["ratios"] = ratios
    need = s["seconds"] / args.target
    results["target"] = {"ratio": args.target, "continuous_s_needed": need,
                         "continuous_over_floor_dram": need / c["floor_dram_s"]}
    print(f"\ncontinuous / max_num_seqs=1: measured {ratios['measured']:.2f}x; "
          f"at the DRAM floor {ratios['floor_dram']:.2f}x; at the cache floor {ratios['floor_cache']:.2f}x")
    print(f"{args.target:g}x against the measured max_num_seqs=1 run needs the continuous run in "
          f"{need:.3f} s: {need / c['floor_dram_s']:.2f}x its DRAM floor (now "
          f"{c['seconds'] / c['floor_dram_s']:.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
