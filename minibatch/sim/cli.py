"""``python -m minibatch simulate``: replay a trace or named workload in the simulator.

    python -m minibatch simulate --workload chat --model llama-2-13b --hardware 4xa10 \\
        --max-num-seqs 16 --max-wait 20ms --goodput ttft:800 tpot:50 --out result.json
    python -m minibatch simulate --trace datasets/traces/AzureLLMInferenceTrace_conv.csv \\
        --model llama-2-7b --hardware a100-80g

SLOs are written as ``vllm bench serve --goodput`` writes them, in milliseconds
(``ttft:800 tpot:50 e2el:5000``); in Python they are seconds (``minibatch.results.parse_goodput``).
"""

from __future__ import annotations

import argparse
import sys
import time

from minibatch.config import add_engine_args, engine_kwargs
from minibatch.results import parse_goodput

DEFAULTS = {"model": "llama-2-7b", "hardware": "a100-80g"}


def format_summary(summary: dict) -> str:
    rows = [("Requests (completed / total)", f"{summary['completed']} / {summary['num_requests']}"),
            ("Duration (s)", f"{summary['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['throughput_tok_s']:.1f}"),
            ("Total token throughput (tok/s)", f"{summary['total_throughput_tok_s']:.1f}")]
    for m in ("ttft", "tpot", "itl", "e2e", "queue_delay"):
        rows.append((f"{m.upper()} mean / p50 / p90 / p99 (ms)",
                     " / ".join(f"{summary[f'{m}_{s}'] * 1000:.1f}" for s in ("mean", "p50", "p90", "p99"))))
    if "goodput" in summary:
        rows.append(("Goodput (req/s)", f"{summary['goodput']:.2f}"))
        rows.append(("SLO attainment", f"{summary['slo_attainment']:.1%}"))
    rows += [("Preemptions", str(summary["num_preemptions"])),
             ("Prefix cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
             ("KV utilisation mean / max", f"{summary['kv_util_mean']:.1%} / {summary['kv_util_max']:.1%}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="minibatch simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a trace file (Azure CSV, Mooncake JSONL, BurstGPT CSV, minibatch JSONL)")
    src.add_argument("--workload", help="a named workload (chat, rag, code_bursty, long_tail, shared_prefix)")
    add_engine_args(ap, DEFAULTS)
    ap.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--request-rate", type=float, default=None, help="rescale arrivals to this mean rate")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                    help="SLOs for goodput, e.g. ttft:800 tpot:50 e2el:5000 (milliseconds, as vllm bench serve)")
    ap.add_argument("--out", default=None, help="write the summary and per-request records as JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from minibatch.runner import run
    from minibatch.workload import load_trace, load_workload

    try:
        slo = parse_goodput(args.goodput)
        wl = load_trace(args.trace) if args.trace else load_workload(args.workload)
        if args.num_requests:
            wl = wl.slice(0, args.num_requests)
        if args.request_rate:
            wl = wl.with_rate(args.request_rate)
        kw = {**engine_kwargs(args, DEFAULTS), "executor": "sim"}
        t = time.perf_counter()
        result = run(wl, progress=not args.no_progress, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = result.summary(slo or None)
    print(f"\n{len(wl)} requests, {kw['model']} on {kw['hardware']}, policy {result.config['policy']}; "
          f"simulated in {time.perf_counter() - t:.1f} s")
    print(format_summary(summary))
    if summary["rejected"]:
        print(f"{summary['rejected']} requests rejected: " +
              ", ".join(f"{n} {reason}" for reason, n in summary["rejected_reasons"].items()))
    if args.out:
        result.to_json(args.out, slo or None)
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
