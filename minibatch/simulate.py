"""``python -m minibatch simulate``: replay a trace or named workload in the simulator.

    python -m minibatch simulate --workload chat --model llama-2-13b --hardware 4xa10 \\
        --max-num-seqs 16 --max-wait 20ms --slo ttft=0.8,tpot=0.05 --out result.json
    python -m minibatch simulate --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv \\
        --model llama-2-7b --hardware a100-80g
"""

from __future__ import annotations

import argparse
import sys
import time

from minibatch.__main__ import add_engine_args, engine_kwargs


def parse_slo(text: str | None) -> dict[str, float] | None:
    """``"ttft=0.8,tpot=0.05"`` (seconds) -> ``{"ttft": 0.8, "tpot": 0.05}``."""
    if not text:
        return None
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("ttft", "tpot", "e2e", "itl"):
            raise ValueError(f"cannot read SLO term {part!r}; write e.g. ttft=0.8,tpot=0.05 (seconds)")
        slo[key] = float(value)
    return slo


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
    add_engine_args(ap)
    ap.set_defaults(model="llama-2-7b")
    ap.add_argument("--hardware", default="a100-80g", help="e.g. a100-80g, 4xa10, h100, profile:FILE")
    ap.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--request-rate", type=float, default=None, help="rescale arrivals to this mean rate")
    ap.add_argument("--slo", default=None, help="e.g. ttft=0.8,tpot=0.05 (seconds)")
    ap.add_argument("--out", default=None, help="write the summary and per-request records as JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from minibatch.runner import run
    from minibatch.workload import load_trace, load_workload

    try:
        slo = parse_slo(args.slo)
        wl = load_trace(args.trace) if args.trace else load_workload(args.workload)
        if args.num_requests:
            wl = wl.slice(0, args.num_requests)
        if args.request_rate:
            wl = wl.with_rate(args.request_rate)
        kw = engine_kwargs(args)
        t = time.perf_counter()
        result = run(wl, executor="sim", hardware=args.hardware, progress=not args.no_progress, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = result.summary(slo)
    print(f"\n{len(wl)} requests, {args.model} on {args.hardware}, policy {result.config['policy']}; "
          f"simulated in {time.perf_counter() - t:.1f} s")
    print(format_summary(summary))
    rejected = [r for r in result.requests if r.finish_reason == "rejected"]
    if rejected:
        print(f"{len(rejected)} requests rejected, e.g.: {rejected[0].error}")
    if args.out:
        result.to_json(args.out, slo)
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
