"""The HTTP router's cost and what a second replica buys on this machine (not a test).

Two comparisons, each the median of ``--runs`` runs (the modes alternate run by run, so
that a change in the machine's other load hits both alike), with the ``minibatch bench
serve`` client (``minibatch.bench.client.run_benchmark``) sending the same requests: random
prompts of ``--input-len`` tokens, ``--output-len`` tokens each (``ignore_eos``), greedy,
streamed, at most ``--concurrency`` in flight.

1. Overhead: one ``minibatch serve`` process, directly vs through ``python -m minibatch
   router`` with that one upstream, at ``--overhead-concurrency`` requests in flight (1: the
   latency the hop adds; 16: a loaded server, where the router's CPU competes with it). Goal (issue 19): >= 0.9x the direct throughput and
   <= +5 ms TTFT p50 on loopback.
2. Scale: 2 replicas behind the router vs 1 server alone, and the same requests (all sent
   at once) in the simulator's cluster (``minibatch.cluster.run(..., executor="sim",
   model="tiny", hardware="cpu")``), whose replicas are independent machines. On a 2-core
   machine two real replicas share the cores (each server runs ``OMP_NUM_THREADS=1``), and
   the client and the router need CPU too: the real figure shows what process-level
   replication gives here, the simulator what it would give on separate machines.

    python benchmarks/router.py                     # both, 3 runs each
    python benchmarks/router.py --only overhead --runs 5

Servers listen on free loopback ports and are stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A ``python -m minibatch ...`` child on a free port, healthy once started."""

    def __init__(self, command: str, *args: str, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{command}-{self.port}.log", "wb")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", "minibatch", command, "--port", str(self.port),
                                      "--uvicorn-log-level", "warning", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command} exited with {self.proc.returncode}; see {self.log.name}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                if r.status == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{command} not healthy after 180 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def bench(url: str, args) -> dict:
    from minibatch.bench.client import run_benchmark

    res = run_benchmark(base_url=url, model="tiny", num_prompts=args.num_prompts,
                        random_input_len=args.input_len, random_output_len=args.output_len,
                        max_concurrency=args.concurrency, seed=0, tokenizer="tiny")
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed at {url}: {set(res['errors'])}")
    return {"tok_s": res["output_throughput"], "ttft_p50_ms": res["median_ttft_ms"]}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def alternate(targets: dict[str, str], args) -> dict[str, dict]:
    for url in targets.values():        # warm up each path once (connections, first steps)
        bench(url, argparse.Namespace(**{**vars(args), "num_prompts": 8}))
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    for _ in range(args.runs):
        for name, url in targets.items():
            runs[name].append(bench(url, args))
    return {name: medians(r) for name, r in runs.items()}


def show(title: str, results: dict[str, dict], base: str) -> None:
    print(f"\n{title} (medians of runs)")
    b = results[base]
    for name, r in results.items():
        print(f"  {name:<28} {r['tok_s']:8.1f} output tok/s ({r['tok_s'] / b['tok_s']:.2f}x)   "
              f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms ({r['ttft_p50_ms'] - b['ttft_p50_ms']:+.1f} ms)")


def simulated(args) -> dict[str, float]:
    from minibatch import cluster
    from minibatch.workload import synthetic

    out = {}
    for n in (1, 2):
        wl = synthetic(args.num_prompts, math.inf, input_len=args.input_len, output_len=args.output_len, seed=0)
        res = cluster.run(wl, replicas=n, router="least_requests", executor="sim", model="tiny",
                          hardware="cpu", max_num_seqs=args.max_num_seqs)
        out[f"sim {n} replica(s)"] = res.summary()["throughput_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["overhead", "scale"], default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (scale)")
    p.add_argument("--overhead-concurrency", type=int, nargs="+", default=[1, 16],
                   help="requests in flight for the overhead runs: 1 shows the added latency alone")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--policy", default="least_requests")
    args = p.parse_args(argv)
    engine = ["--max-num-seqs", str(args.max_num_seqs)]
    print(f"load: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens, "
          f"concurrency {args.concurrency}; servers: tiny, max_num_seqs {args.max_num_seqs}, one torch thread; "
          f"router policy {args.policy}; {os.cpu_count()} CPUs (shared)", flush=True)
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="minibatch-router-bench-") as tmp:
        logs = Path(tmp)
        try:
            a = Proc("serve", *engine, log_dir=logs)
            procs.append(a)
            if args.only in (None, "overhead"):
                r1 = Proc("router", "--upstream", a.url, "--policy", args.policy, log_dir=logs)
                procs.append(r1)
                for c in args.overhead_concurrency:
                    at = argparse.Namespace(**{**vars(args), "concurrency": c})
                    show(f"Router overhead, 1 server, concurrency {c}",
                         alternate({"direct": a.url, "via router": r1.url}, at), "direct")
                r1.stop()
            if args.only in (None, "scale"):
                b = Proc("serve", *engine, log_dir=logs)
                procs.append(b)
                r2 = Proc("router", "--upstream", a.url, b.url, "--policy", args.policy, log_dir=logs)
                procs.append(r2)
                res = alternate({"1 server (direct)": a.url, "2 replicas via router": r2.url}, args)
                show("2 replicas behind the router vs 1 server", res, "1 server (direct)")
                sim = simulated(args)
                one = sim["sim 1 replica(s)"]
                print("  simulator (virtual time, replicas are separate machines; all requests at t=0):")
                for name, v in sim.items():
                    print(f"  {name:<28} {v:8.1f} output tok/s ({v / one:.2f}x)")
        finally:
            for pr in reversed(procs):
                pr.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
