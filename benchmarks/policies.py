"""Scheduling policies side by side: one skewed Poisson workload near saturation.

Every registered policy (``minibatch.policies.available()``) serves the *same* requests
with the same engine settings (prefix caching on for all, so ``lpm`` has something to
match), in two setups:

  sim  LLaMA-2-7B on one A100-80GB in the simulator (roofline cost model, virtual
       clock); ``--sim-requests`` (400) requests at ``--sim-rate`` (12/s), where FCFS
       continuous batching with ``max_num_seqs=32`` starts to queue.
  cpu  the embedded tiny model, really run on this machine's CPU (measured step times,
       virtual clock); ``--cpu-requests`` (60) shorter requests at 0.9x the capacity
       measured by a burst run of ``continuous``; one torch thread by default
       (``--threads``), as two threads on a shared 2-core machine give erratic steps.

Workload (``workload.shared_prefix``): Poisson arrivals; each prompt = one of 8 shared
system prompts + a lognormal suffix; lognormal outputs (heavy tail); 30 % of requests
urgent (priority 0, the rest 1); tenants a:b = 3:1.

Reported per policy: mean and p99 of TTFT, TPOT and E2E; p90 TTFT of the urgent class;
output tokens/s; goodput
(requests/s meeting TTFT < 0.8 s and TPOT < 0.05 s; for the CPU tiny model both bounds
are scaled by the ratio of its measured one-sequence decode step to the simulated
7B/A100 one, printed with the table); preemptions; prefix-cache hit rate.

    python benchmarks/policies.py --plot policies.png         # both setups
    python benchmarks/policies.py --skip-cpu                  # simulator only (seconds)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from minibatch.policies import available
from minibatch.runner import run
from minibatch.workload import RequestSpec, lognormal, shared_prefix

SLO = {"ttft": 0.8, "tpot": 0.05}
SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=32, max_wait_ms=50.0,
           enable_prefix_caching=True)
CPU = dict(model="tiny", max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=True)
COLUMNS = [("ttft_mean", "TTFT mean", 3), ("ttft_p99", "TTFT p99", 3), ("ttft_p90_urgent", "urgent TTFT p90", 3),
           ("tpot_mean", "TPOT mean", 4),
           ("tpot_p99", "TPOT p99", 4), ("e2e_mean", "E2E mean", 2), ("e2e_p99", "E2E p99", 2),
           ("throughput_tok_s", "tok/s", 0), ("goodput", "goodput req/s", 2), ("num_preemptions", "preempt", 0),
           ("prefix_cache_hit_rate", "hit rate", 2)]


def workload(n: int, rate: float, small: bool, seed: int = 0, vocab_size: int = 32000, reserved=()):
    if small:   # the tiny model: 1024-token context, slow CPU
        lengths = dict(prefix_len=32, suffix_len=lognormal(median=24, sigma=0.8, max=256),
                       output_len=lognormal(median=16, sigma=1.0, max=160))
    else:
        lengths = dict(prefix_len=256, suffix_len=lognormal(median=200, sigma=0.8, max=2048),
                       output_len=lognormal(median=100, sigma=1.0, max=1500))
    return shared_prefix(n, rate, num_prefixes=8, seed=seed, priorities={0: 0.3, 1: 0.7},
                         tenants={"a": 0.75, "b": 0.25}, vocab_size=vocab_size, reserved_ids=reserved,
                         name="skewed", **lengths)


def run_policies(wl, engine_kw, slo, policies, label, repeats=1):
    """One summary row per policy; with ``repeats`` > 1 (measured CPU runs, noisy on a
    shared machine) every policy runs once per round, round after round (so a slow spell
    of the machine hits them alike), and the run with the median throughput is shown."""
    runs = {p: [] for p in policies}
    for rnd in range(repeats):
        for policy in policies:
            t0 = time.perf_counter()
            result = run(wl, policy=policy, **engine_kw)
            s = result.summary(slo=slo)
            urgent = [r.ttft for r in result.requests if r.priority == 0 and r.ttft is not None]
            s.update(setup=label, policy=policy, wall_s=time.perf_counter() - t0,
                     ttft_p90_urgent=float(np.percentile(urgent, 90)) if urgent else float("nan"))
            runs[policy].append(s)
            print(f"  {label:4s} {policy:11s} round {rnd + 1}/{repeats} done in {s['wall_s']:.1f} s", flush=True)
    return [sorted(rs, key=lambda r: r["throughput_tok_s"])[len(rs) // 2] for rs in runs.values()]


def capacity(wl, engine_kw) -> float:
    """Requests/s when ``max_num_seqs`` requests of the workload's mean lengths are
    served together as one batch: ``max_num_seqs / (time to serve them)``."""
    b = engine_kw["max_num_seqs"]
    mean_in = round(sum(r.prompt_len for r in wl) / len(wl))
    mean_out = round(sum(r.max_tokens for r in wl) / len(wl))
    batch = [RequestSpec(0.0, mean_in, mean_out, prompt_token_ids=[7 + i] * mean_in) for i in range(b)]
    return b / run(batch, policy="continuous", **engine_kw).summary()["duration_s"]


def sim_setup(n: int, load: float, policies):
    wl = workload(n, 1.0, small=False)
    rate = load * capacity(wl, SIM)
    print(f"  sim: rate {rate:.2f} req/s", flush=True)
    return run_policies(wl.with_rate(rate), SIM, SLO, policies, "sim"), dict(rate=rate)


def cpu_setup(n: int, load: float, policies, repeats: int):
    """Calibrate the tiny model on this CPU, then run every policy."""
    from minibatch import LLM, SamplingParams
    from minibatch.sim import get_model_spec, make_cost_model

    llm = LLM(**{k: v for k, v in CPU.items() if k != "enable_prefix_caching"})
    engine = llm.engine
    reserved = sorted(set(engine.eos_token_ids))
    llm.generate([[5] * 32], SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
    itl = sorted(s.duration for s in engine.steps[1:])
    cpu_step = itl[len(itl) // 2]
    sim_step = make_cost_model(get_model_spec("llama-2-7b"), "a100-80g").step_time([], [512])
    scale = cpu_step / sim_step
    wl = workload(n, 1.0, small=True, vocab_size=4096, reserved=reserved)
    rate = load * capacity(wl, CPU)
    slo = {k: v * scale for k, v in SLO.items()}
    kw = dict(CPU, max_wait_ms=SIM["max_wait_ms"] * scale)
    info = dict(cpu_decode_step_s=cpu_step, sim_decode_step_s=sim_step, slo_scale=scale, rate=rate,
                slo=slo, max_wait_ms=kw["max_wait_ms"])
    print(f"  cpu: decode step {cpu_step * 1e3:.1f} ms vs 7B/A100 {sim_step * 1e3:.1f} ms -> SLO x{scale:.2f} "
          f"(TTFT < {slo['ttft']:.2f} s, TPOT < {slo['tpot']:.3f} s); rate {rate:.2f}/s", flush=True)
    return run_policies(wl.with_rate(rate), kw, slo, policies, "cpu", repeats), info


def table(rows) -> str:
    head = "| setup | policy | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = [f"{r[k]:.{d}f}" if isinstance(r[k], float) else str(r[k]) for k, _, d in COLUMNS]
        lines.append(f"| {r['setup']} | {r['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in ("sim", "cpu") if any(r["setup"] == s for r in rows)]
    panels = [("ttft", "TTFT (s)", True), ("e2e", "E2E latency (s)", True), ("goodput", "goodput (req/s)", False),
              ("throughput_tok_s", "throughput (tok/s)", False)]
    fig, axes = plt.subplots(len(setups), len(panels), figsize=(4.2 * len(panels), 3.4 * len(setups)),
                             squeeze=False)
    for i, setup in enumerate(setups):
        rs = [r for r in rows if r["setup"] == setup]
        x = np.arange(len(rs))
        for j, (key, title, pct) in enumerate(panels):
            ax = axes[i][j]
            if pct:
                ax.bar(x - 0.2, [r[f"{key}_mean"] for r in rs], 0.4, label="mean")
                ax.bar(x + 0.2, [r[f"{key}_p99"] for r in rs], 0.4, label="p99")
                ax.set_yscale("log")
                ax.legend(fontsize=7)
            else:
                ax.bar(x, [r[key] for r in rs], 0.6, color="tab:green" if key == "goodput" else "tab:gray")
            ax.set_xticks(x, [r["policy"] for r in rs], rotation=60, fontsize=7)
            ax.set_title(f"{setup}: {title}", fontsize=9)
    fig.suptitle("Scheduling policies on one skewed Poisson workload near saturation "
                 "(sim: LLaMA-2-7B / A100-80GB; cpu: tiny model, real run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="*", default=None, help="default: every registered policy")
    ap.add_argument("--sim-requests", type=int, default=400)
    ap.add_argument("--load", type=float, default=1.4,
                    help="arrival rate / capacity estimate (see capacity()); 1.4: FCFS starts to queue")
    ap.add_argument("--cpu-requests", type=int, default=60)
    ap.add_argument("--cpu-load", type=float, default=2.5,
                    help="the same for the cpu setup (CPU steps grow with the batch: the estimate is low)")
    ap.add_argument("--cpu-repeats", type=int, default=3, help="cpu runs per policy; the median one is shown")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for the cpu setup (1: steady step times on a shared machine)")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--plot", metavar="PNG")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    policies = args.policies or available()
    rows, info, sim_info = [], {}, {}
    if not args.skip_sim:
        sim_rows, sim_info = sim_setup(args.sim_requests, args.load, policies)
        rows += sim_rows
    if not args.skip_cpu:
        import torch
        torch.set_num_threads(args.threads)
        cpu_rows, info = cpu_setup(args.cpu_requests, args.cpu_load, policies, args.cpu_repeats)
        rows += cpu_rows
    print()
    print(table(rows))
    if sim_info:
        print(f"\nsim: {sim_info['rate']:.2f} req/s; goodput SLO TTFT < 0.8 s, TPOT < 0.05 s")
    if info:
        print(f"cpu: goodput SLO scaled x{info['slo_scale']:.1f} (TTFT < {info['slo']['ttft']:.2f} s, "
              f"TPOT < {info['slo']['tpot']:.3f} s), rate {info['rate']:.2f} req/s, "
              f"dynamic window {info['max_wait_ms']:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "sim": sim_info, "cpu": info}, f, indent=1, default=str)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
