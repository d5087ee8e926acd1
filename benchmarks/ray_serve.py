"""Ray Serve backend: 2 replicas vs 1 engine and vs the HTTP router's 2 processes, and autoscaling.

1. Static. The same requests (random, ``--input-len`` in / ``--output-len`` out, ``ignore_eos``,
   streaming, at most ``--concurrency`` in flight, the ``minibatch.bench.run_benchmark`` client)
   go to three arms, ``--runs`` times each, interleaved run by run (1 engine, Ray, router):

   - one ``minibatch serve`` process;
   - the Ray Serve backend with ``--replicas`` engine replicas (``round_robin``);
   - ``python -m minibatch serve --replicas N`` (same N): the HTTP router
     (``minibatch.serving.replicas``) in front of N plain ``minibatch serve`` child processes,
     routing with ``--router-policy`` (default ``round_robin``, the policy the Ray arm uses).

   Reported: the median over the runs of output tokens/s, TTFT p50 and p90 per arm, and the
   throughput ratios Ray / 1 engine and Ray / router's N processes. Every engine (the single
   server, each Ray replica, each router child) runs torch with one thread
   (``OMP_NUM_THREADS=1``, what Ray gives a replica of fractional ``num_cpus``), so on this
   2-core machine 2 replicas can use both cores where the single engine uses one. The last
   two arms differ only in what carries the requests: Ray Serve's proxy, handles and actors,
   or one asyncio HTTP router process and loopback HTTP.
2. Autoscaling. A fresh deployment with Ray Serve's autoscaling (``--autoscale``) gets three
   phases of load: ``--low`` requests in flight, then ``--high``, then none; the number of
   replicas (RUNNING, and STARTING) is sampled every 0.5 s. Written: ``--out``/autoscale.csv
   (time, phase, running, starting, in-flight requests) and autoscale.png (replicas vs time).

    python benchmarks/ray_serve.py                         # both parts
    python benchmarks/ray_serve.py --skip-autoscale --runs 1 --num-prompts 16   # quick

Ray is started here (``ray.init(num_cpus=2)``) and shut down at the end; nothing runs ``ray stop``.
The router arm is stopped with SIGTERM (the router then stops its children: SIGTERM, wait,
SIGKILL), and the script checks that none of the child pids the router logged is left.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import itertools

import httpx
from serving_utils import ServerProcess, alive, free_port

from minibatch.bench import run_benchmark
from minibatch.bench.datasets import make_requests
from minibatch.cluster import ray_backend

SERVE_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
             "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "OMP_NUM_THREADS": "1",
             "OMP_WAIT_POLICY": "PASSIVE"}


def summary(res: dict) -> dict:
    assert res["failed"] == 0, res["errors"][:3]
    return {"output_throughput": res["output_throughput"], "p50_ttft_ms": res["median_ttft_ms"],
            "p90_ttft_ms": res["p90_ttft_ms"]}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


class RouterServer(ServerProcess):
    """``python -m minibatch serve --replicas N`` (router + N engine children) on a free port.
    Stopped with SIGTERM so that the router stops its children itself; SIGKILL only as a
    last resort, then any child pid the router logged that is still alive is killed too."""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.left = [pid for pid in self.child_pids() if alive(pid)]
        for pid in self.left:                      # checked by the caller once everything is stopped
            os.kill(pid, signal.SIGKILL)

    def child_pids(self) -> list[int]:
        text = open(self.log_path, errors="replace").read()
        return [int(m) for m in re.findall(r"minibatch: replica \d+ pid (\d+) on ", text)]


def static(args, port: int, log: Path) -> None:
    from ray import serve

    requests = make_requests("random", args.num_prompts, "tiny", input_len=args.input_len,
                             output_len=args.output_len, seed=0)
    kw = {"requests": requests, "max_concurrency": args.concurrency, "percentiles": (50, 90)}
    router_log = log.with_name(log.stem.replace("single_engine", "router") + log.suffix)
    names = ("1 engine (minibatch serve)", f"Ray Serve, {args.replicas} replicas",
             f"router, {args.replicas} processes")
    servers: list[ServerProcess] = []
    deployed = False
    try:
        srv = ServerProcess(log, threads=1)
        servers.append(srv)
        routed = RouterServer(router_log, "--replicas", str(args.replicas), "--router-policy", args.router_policy,
                              "--startup-timeout", "300", threads=1)
        servers.append(routed)
        print(f"router pid {routed.proc.pid}, children {routed.child_pids()} ({args.router_policy})", flush=True)
        ray_backend.deploy(model="tiny", num_replicas=args.replicas, router="round_robin", num_cpus=0.5)
        deployed = True
        wait(lambda: ray_backend.num_running_replicas() == args.replicas, "replicas")
        urls = (srv.url, f"http://127.0.0.1:{port}", routed.url)
        runs: list[list[dict]] = [[], [], []]
        run_benchmark(base_url=srv.url, requests=requests[:2])      # warm-up
        run_benchmark(base_url=urls[1], requests=requests[:4])
        run_benchmark(base_url=routed.url, requests=requests[:4])
        for i in range(args.runs):
            for name, url, out in zip(names, urls, runs, strict=True):
                out.append(summary(run_benchmark(base_url=url, **kw)))
                print(f"run {i + 1}: {name:28s} {out[-1]}", flush=True)
    finally:
        for s in reversed(servers):
            s.stop()
        if deployed:
            serve.delete(ray_backend.DEFAULT_APP)
    left = getattr(servers[1], "left", None)
    assert left == [], f"router children still alive after the router stopped (killed now): {left}"
    print(f"stopped: the router and its children {routed.child_pids()} are gone", flush=True)
    a, b, c = (medians(r) for r in runs)
    print(f"\n{args.num_prompts} requests, {args.input_len} in / {args.output_len} out, concurrency "
          f"{args.concurrency}, medians of {args.runs} runs")
    print(f"{'':28s} {'out tok/s':>10s} {'TTFT p50 ms':>12s} {'TTFT p90 ms':>12s}")
    for name, m in zip(names, (a, b, c), strict=True):
        print(f"{name:28s} {m['output_throughput']:10.1f} {m['p50_ttft_ms']:12.1f} {m['p90_ttft_ms']:12.1f}")
    print(f"ratio Ray / 1 engine: throughput {b['output_throughput'] / a['output_throughput']:.2f}x")
    print(f"ratio Ray / router {args.replicas} processes: throughput "
          f"{b['output_throughput'] / c['output_throughput']:.2f}x, TTFT p50 "
          f"{b['p50_ttft_ms'] / c['p50_ttft_ms']:.2f}x, TTFT p90 {b['p90_ttft_ms'] / c['p90_ttft_ms']:.2f}x")


def wait(cond, what: str, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.25)
    raise RuntimeError(f"timed out waiting for {what}")


def autoscale(args, port: int, out: Path) -> None:
    from ray import serve

    scaling = ray_backend.parse_autoscale(args.autoscale)
    ray_backend.deploy(model="tiny", autoscale=scaling, router="least_requests", num_cpus=0.5)
    wait(lambda: ray_backend.num_running_replicas() >= 1, "the first replica")
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": args.output_len, "temperature": 0,
            "ignore_eos": True}
    state = {"target": 0, "in_flight": 0, "phase": "start", "done": False, "failed": 0}
    lock = threading.Lock()

    def worker(k: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not state["done"]:
                if k >= state["target"]:
                    time.sleep(0.05)
                    continue
                with lock:
                    state["in_flight"] += 1
                try:
                    if client.post(url, json=body).status_code != 200:
                        state["failed"] += 1
                finally:
                    with lock:
                        state["in_flight"] -= 1

    rows = []
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.high)]
    for t in threads:
        t.start()
    phases = [("low", args.low, args.phase_s), ("high", args.high, args.phase_s * 2),
              ("idle", 0, args.phase_s * 2)]
    t0 = time.monotonic()
    try:
        for name, target, length in phases:
            state["phase"], state["target"] = name, target
            end = time.monotonic() + length
            while time.monotonic() < end:
                c = ray_backend.replica_counts()
                rows.append((round(time.monotonic() - t0, 2), name, c.get("RUNNING", 0), c.get("STARTING", 0),
                             state["in_flight"]))
                time.sleep(0.5)
    finally:
        state["done"] = True
        for t in threads:
            t.join(timeout=300)
        serve.delete(ray_backend.DEFAULT_APP)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "autoscale.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "phase", "running", "starting", "in_flight"])
        w.writerows(rows)
    changes = [rows[0]] + [r for p, r in itertools.pairwise(rows) if (r[2], r[3]) != (p[2], p[3])]
    print(f"\nautoscaling {scaling}, load {args.low} -> {args.high} -> 0 requests in flight "
          f"({args.output_len} tokens each), failed requests: {state['failed']}")
    for r in changes:
        print(f"  t={r[0]:7.2f} s  phase={r[1]:5s} running={r[2]} starting={r[3]} in_flight={r[4]}")
    plot(rows, out / "autoscale.png", scaling)
    print(f"wrote {out / 'autoscale.csv'} and {out / 'autoscale.png'}")


def plot(rows, path: Path, scaling: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(t, [r[2] for r in rows], where="post", label="replicas RUNNING", lw=2)
    ax.step(t, [r[2] + r[3] for r in rows], where="post", label="RUNNING + STARTING", ls="--")
    ax2 = ax.twinx()
    ax2.plot(t, [r[4] for r in rows], color="gray", alpha=0.5, label="requests in flight")
    ax2.set_ylabel("requests in flight")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, scaling.get("max_replicas", 3) + 0.5)
    ax.set_title("Ray Serve autoscaling of minibatch engines\n" + ", ".join(f"{k}={v:g}" for k, v in scaling.items()),
                 fontsize=7)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--router-policy", default="round_robin",
                   help="the router arm's policy (default: round_robin, as the Ray arm)")
    p.add_argument("--autoscale", default="min=1,max=3,target_ongoing_requests=2,upscale_delay_s=1,"
                                          "downscale_delay_s=5,look_back_period_s=2,metrics_interval_s=0.5")
    p.add_argument("--low", type=int, default=1)
    p.add_argument("--high", type=int, default=8)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "figures")
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--skip-autoscale", action="store_true")
    args = p.parse_args()
    import ray
    from ray import serve

    os.environ.update(SERVE_ENV)
    ray_backend.start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
                                runtime_env={"env_vars": {**SERVE_ENV, "PYTHONPATH": str(ROOT)}})
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"ray_serve_single_engine_{os.getpid()}.log"
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        if not args.skip_static:
            static(args, port, log)
        if not args.skip_autoscale:
            autoscale(args, port, args.out)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
