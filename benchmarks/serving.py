"""Serving overhead and latency-throughput curves: offline ``LLM.generate`` vs ``serve`` + ``bench``.

1. Overhead. The same requests (random, ``--input-len`` in / ``--output-len`` out, ``ignore_eos``)
   run offline (``LLM.generate``, all at once) and through the HTTP server at request rate
   inf (``bench serve``, streaming), ``--runs`` times each, interleaved. Reported: output and
   total tokens/s of both (median run) and the ratio server / offline (goal: >= 0.8, i.e.
   HTTP, SSE and the engine thread cost < 20%).
2. Latency-throughput. For two scheduling set-ups, ``--curve-prompts`` requests are sent
   at each of ``--rates`` (Poisson arrivals): ``continuous`` against ``static`` or ``serial``
   if ``minibatch.policies`` has one, otherwise against ``continuous`` with
   ``max_num_seqs=1`` (one request at a time). Printed as a table; ``--plot FILE`` draws
   TTFT and E2E latency against achieved throughput.

    python benchmarks/serving.py --plot serving.png
    python benchmarks/serving.py --num-prompts 16 --rates 4,inf          # quick
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from minibatch import LLM, SamplingParams  # noqa: E402
from minibatch.bench import run_benchmark  # noqa: E402
from minibatch.bench.datasets import make_requests  # noqa: E402
from minibatch.policies import available  # noqa: E402
from serving_utils import ServerProcess  # noqa: E402


def overhead(requests, runs: int, log: Path) -> tuple[dict, dict]:
    """Offline and served runs of the same requests, interleaved (a busy machine's noise hits
    both alike); returns the run with the median output throughput of each."""
    llm = LLM("tiny")
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt], params[0])                 # first-call costs out of the timing
    n_in = sum(r.prompt_len for r in requests)
    srv = ServerProcess(log, threads=None)
    offline_runs, served_runs = [], []
    try:
        run_benchmark(base_url=srv.url, requests=requests[:1])   # warm-up
        for _ in range(runs):
            t0 = time.perf_counter()
            outs = llm.generate([r.prompt for r in requests], params)
            dt = time.perf_counter() - t0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            offline_runs.append({"duration": dt, "output_throughput": n_out / dt,
                                 "total_token_throughput": (n_in + n_out) / dt})
            res = run_benchmark(base_url=srv.url, requests=requests)
            assert res["failed"] == 0, res["errors"][:3]
            served_runs.append(res)
    finally:
        srv.stop()

    def median(rs):
        return sorted(rs, key=lambda r: r["output_throughput"])[len(rs) // 2]

    return median(offline_runs), median(served_runs)


def serve_args(engine_args: dict) -> list[str]:
    return [a for k, v in engine_args.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def curve(name: str, engine_args: dict, rates, n: int, input_len: int, output_len: int, log: Path) -> list[dict]:
    srv = ServerProcess(log, *serve_args(engine_args), threads=None)
    rows = []
    try:
        run_benchmark(base_url=srv.url, num_prompts=1, random_input_len=input_len, random_output_len=4)
        for rate in rates:
            res = run_benchmark(base_url=srv.url, num_prompts=n, random_input_len=input_len,
                                random_output_len=output_len, request_rate=rate, seed=1)
            rows.append({"setup": name, "rate": rate, "req_s": res["request_throughput"],
                         "tok_s": res["output_throughput"], "failed": res["failed"],
                         "ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
                         "tpot_mean": res["mean_tpot_ms"], "e2el_p50": res["median_e2el_ms"],
                         "e2el_p99": res["p99_e2el_ms"]})
            print(fmt_row(rows[-1]), flush=True)
    finally:
        srv.stop()
    return rows


HEADER = (f"{'setup':<24} {'rate':>6} {'req/s':>7} {'tok/s':>8} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT':>7} {'E2E p50':>9} {'E2E p99':>9}   (latencies in ms)")


def fmt_row(r: dict) -> str:
    return (f"{r['setup']:<24} {r['rate']:>6g} {r['req_s']:>7.2f} {r['tok_s']:>8.1f} {r['failed']:>4} "
            f"{r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} {r['tpot_mean']:>7.1f} {r['e2el_p50']:>9.1f} "
            f"{r['e2el_p99']:>9.1f}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for setup in dict.fromkeys(r["setup"] for r in rows):
        rs = [r for r in rows if r["setup"] == setup]
        x = [r["tok_s"] for r in rs]
        for ax, key in ((axes[0], "ttft"), (axes[1], "e2el")):
            line, = ax.plot(x, [r[f"{key}_p50"] for r in rs], "o-", label=f"{setup} p50")
            ax.plot(x, [r[f"{key}_p99"] for r in rs], "s--", color=line.get_color(), alpha=0.6,
                    label=f"{setup} p99")
            for r in rs:
                ax.annotate(f"{r['rate']:g}/s", (r["tok_s"], r[f"{key}_p50"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    for ax, title in ((axes[0], "Time to first token"), (axes[1], "End-to-end latency")):
        ax.set(title=title, xlabel="achieved output throughput (tokens/s)", ylabel="ms", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("minibatch serve, tiny model: latency vs throughput (labels: offered request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="offline/served runs for the overhead (median)")
    p.add_argument("--curve-prompts", type=int, default=32)
    p.add_argument("--rates", default="2,4,8,16,inf", help="request rates for the curve (req/s)")
    p.add_argument("--plot", default=None, metavar="FILE")
    p.add_argument("--log-dir", default="/tmp", help="where the server logs go")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for both offline and server (OMP_NUM_THREADS); default: torch's")
    args = p.parse_args()
    if args.threads:
        # Same thread count on both sides: on a busy machine, more OpenMP threads than free
        # cores makes every step many times slower, which would swamp the comparison.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    log = Path(args.log_dir)

    requests = make_requests("random", args.num_prompts, "tiny", input_len=args.input_len,
                             output_len=args.output_len, seed=0)
    print(f"== overhead: {args.num_prompts} requests, {args.input_len} in / {args.output_len} out, "
          f"rate inf, median of {args.runs} runs")
    off, srv = overhead(requests, args.runs, log / "serving_bench_server.log")
    ratio = srv["output_throughput"] / off["output_throughput"]
    print(f"{'':<10} {'duration (s)':>12} {'output tok/s':>13} {'total tok/s':>12}")
    for name, r in (("offline", off), ("server", srv)):
        print(f"{name:<10} {r['duration']:>12.2f} {r['output_throughput']:>13.1f} {r['total_token_throughput']:>12.1f}")
    print(f"server / offline = {ratio:.2f}  (goal >= 0.80)  "
          f"[server TTFT p50 {srv['median_ttft_ms']:.0f} ms, TPOT {srv['mean_tpot_ms']:.1f} ms]")

    rates = [float(r) for r in args.rates.split(",")]
    names = available()
    other = next((n for n in ("static", "serial") if n in names), None)
    setups = [("continuous", {"policy": "continuous"}),
              (other, {"policy": other}) if other else ("continuous, max_num_seqs=1", {"max_num_seqs": 1})]
    print(f"\n== latency vs throughput: {args.curve_prompts} requests per point, "
          f"{args.input_len} in / {args.output_len} out, Poisson arrivals")
    print(HEADER)
    rows = []
    for name, engine_args in setups:
        rows += curve(name, engine_args, rates, args.curve_prompts, args.input_len, args.output_len,
                      log / f"serving_bench_{name.split(',')[0]}.log")
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0 if all(math.isfinite(r["tok_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
