"""Simulator fidelity: calibrate on a profile of this machine, predict unseen workloads.

1. Profile the real engine (``minibatch.profile``: varied training workloads) and fit
   a step-time model. The machine's speed drifts, so the runs are paired: a profile
   pass, a round of real runs, a profile pass, another round, ...; each round's
   simulation uses the model fitted to the passes just before and after it.
2. For workloads the profile never saw (other rates, burstiness, length mixes), run
   the real engine under the virtual clock and the simulator with
   ``hardware="profile:FILE"`` (same KV pool), and compare mean, p50 and p90 E2E
   latency and output throughput (medians over the rounds). Goal: within 15% (Vidur, MLSys'24, reports < 9% on GPUs).

3. The machine's own drift, measured: a fixed probe (12 short requests, ~0.3 s) runs on
   the real engine just before and just after every real test run. Its measured /
   predicted step time is the machine's speed at that moment relative to the fitted
   model, and the simulation is repeated with the model scaled by it
   (``FittedCostModel.scaled``). This column ("sim@probe") separates the simulator's
   error from the VM's: per round, each real run against the simulation at that
   round's probe speed, then the median of those errors. No step of a test workload is
   used for it.

    python benchmarks/sim_fidelity.py [--profile FILE] [--runs 5]

Five rounds by default: a single real run of these workloads scatters by up to ~30%
between rounds here (the VM's speed drifts over seconds), and the medians of three
rounds still moved the largest error between 7% and 18% from one invocation to the
next; with five it stayed within 6-14% (figures in the issue's closing note).

Timing conditions: this script sets ``OMP_WAIT_POLICY=ACTIVE`` (unless the environment
sets it), before torch loads, for the profile and the real runs alike. Spinning OpenMP
threads are the engine's fastest and steadiest setting on an otherwise idle machine;
minibatch's own default (``PASSIVE``, right when processes share the cores) makes
small steps ~40% slower here and their times about twice as noisy, which a
step-time model cannot predict. Run it on a quiet machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")   # before torch is imported (see above)

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.executor import ModelExecutor
from minibatch.profile import RecordingExecutor, fit_profile, profile_engine
from minibatch.runner import run
from minibatch.sim import FittedCostModel
from minibatch.workload import fixed, lognormal, synthetic, uniform

METRICS = ("e2e_mean", "e2e_p50", "e2e_p90", "throughput_tok_s")


def test_workloads():
    # Sized so that each real run lasts several seconds of compute: shorter runs are at
    # the mercy of this VM's second-long slow spells (measured +-15% between runs).
    return {
        "poisson, short prompts": (dict(max_num_seqs=16), synthetic(
            120, 6.0, input_len=uniform(32, 256), output_len=lognormal(median=20, sigma=0.7, max=100), seed=101)),
        "bursty (burstiness 0.3)": (dict(max_num_seqs=32), synthetic(
            120, 10.0, burstiness=0.3, input_len=uniform(16, 128), output_len=fixed(32), seed=102)),
        "long prompts, chunked": (dict(max_num_seqs=8, max_num_batched_tokens=256), synthetic(
            60, 3.0, input_len=uniform(300, 700), output_len=uniform(8, 40), seed=103)),
        "saturated, all at t=0": (dict(max_num_seqs=64), synthetic(
            96, float("inf"), input_len=uniform(16, 200), output_len=lognormal(median=30, sigma=0.8, max=150),
            seed=104)),
    }


# The speed probe: a fixed, small mix of prefill and decode steps (~0.3 s of compute),
# run on the real engine just before and just after every real test run.
PROBE = (dict(max_num_seqs=6), synthetic(12, float("inf"), input_len=uniform(16, 128), output_len=fixed(24), seed=7))


def run_recorded(workload, **engine_kwargs):
    """Run ``workload`` on the real engine (virtual clock); return (summary, step samples)."""
    cfg = EngineConfig.from_kwargs(model="tiny", **engine_kwargs)
    executor = RecordingExecutor(ModelExecutor(cfg))
    result = run(workload, engine=LLMEngine(cfg, clock="virtual", executor=executor))
    return result.summary(), executor.samples


def probe_speed(model: FittedCostModel, samples) -> float:
    """Measured / predicted time of the probe's steps: the machine's speed then, relative
    to the speed the model was fitted at."""
    return sum(s["time_s"] for s in samples) / sum(model.step_time(s["prefill"], s["decode"]) for s in samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="reuse a profile (from python -m minibatch profile)")
    ap.add_argument("--runs", type=int, default=5, help="rounds of real runs (median)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    workloads = test_workloads()

    probes: list[dict] = []      # per round: workload -> probe samples around its real run

    def real_round():
        out, around = {}, {}
        for name, (kw, wl) in workloads.items():
            _, before = run_recorded(PROBE[1], **PROBE[0])
            out[name], _ = run_recorded(wl, **kw)       # the test run's own steps are not used
            _, after = run_recorded(PROBE[1], **PROBE[0])
            around[name] = before + after
        probes.append(around)
        return out

    if args.profile:
        paths = [args.profile] * args.runs
        rounds = [real_round() for _ in range(args.runs)]
    else:
        # Paired calibration: the machine's speed drifts (here by 10-20% over minutes), so
        # each round of real runs is bracketed by profile passes, and that round's
        # simulation uses the model fitted to the two passes around it.
        passes, rounds, meta = [], [], {}
        for r in range(args.runs + 1):
            samples, meta = profile_engine("tiny")
            passes.append(samples)
            if r < args.runs:
                rounds.append(real_round())
        tmp = Path(tempfile.mkdtemp())
        paths = []
        for r in range(args.runs):
            model = fit_profile(passes[r] + passes[r + 1], meta)
            paths.append(str(tmp / f"tiny-profile-{r}.json"))
            model.save(paths[-1])
            print(f"round {r + 1}: {model.describe()}")
    kv_blocks = json.loads(Path(paths[0]).read_text())["metadata"]["kv_capacity_tokens"] // 16
    rows, worst, worst_at_speed, spread, factors = [], 0.0, 0.0, 0.0, []
    tmp = Path(tempfile.mkdtemp())
    print(f"\n{'workload':28s} {'metric':18s} {'real':>9s} {'sim':>9s} {'error':>8s} "
          f"{'sim@probe':>9s} {'error':>8s}   per round: real / sim")
    for name, (kw, wl) in workloads.items():
        sims, sims_at_speed = [], []
        for r, path in enumerate(paths):
            sims.append(run(wl, executor="sim", model="tiny", hardware=f"profile:{path}",
                            num_kv_blocks=kv_blocks, **kw).summary())
            if r < len(probes):
                model = FittedCostModel.load(path)
                factor = probe_speed(model, probes[r][name])
                factors.append(factor)
                scaled = tmp / f"speed-{r}-{len(factors)}.json"
                model.scaled(factor).save(scaled)
                sims_at_speed.append(run(wl, executor="sim", model="tiny", hardware=f"profile:{scaled}",
                                         num_kv_blocks=kv_blocks, **kw).summary())
        for m in METRICS:
            reals = [rnd[name][m] for rnd in rounds]
            simv = [s_[m] for s_ in sims]
            real, sim = statistics.median(reals), statistics.median(simv)
            err = (sim - real) / real
            worst = max(worst, abs(err))
            spread = max(spread, (max(reals) - min(reals)) / real)   # the real runs' own scatter
            row = {"workload": name, "metric": m, "real": real, "sim": sim, "rel_error": err,
                   "real_rounds": reals, "sim_rounds": simv}
            at = ""
            if sims_at_speed:
                # Paired per round: each round's real run against the simulation at that
                # round's probe speed; the median of the per-round errors.
                errs = [(s_[m] - rv) / rv for s_, rv in zip(sims_at_speed, reals)]
                err_at = statistics.median(errs)
                worst_at_speed = max(worst_at_speed, abs(err_at))
                row.update({"sim_at_probe_speed_rounds": [s_[m] for s_ in sims_at_speed],
                            "rel_error_at_probe_speed": err_at})
                at = f"{statistics.median(s_[m] for s_ in sims_at_speed):9.3f} {err_at:+8.1%}"
            rows.append(row)
            pairs = "  ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(reals, simv))
            print(f"{name:28s} {m:18s} {real:9.3f} {sim:9.3f} {err:+8.1%} {at:>18s}   {pairs}")
    print(f"\nlargest |error|: {worst:.1%} (goal <= 15%); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"largest spread of the real runs themselves, (max - min) / median: {spread:.1%}")
    if factors:
        print(f"largest |error| simulating at the probe's measured speed: {worst_at_speed:.1%}; "
              f"probe speed / fitted speed ranged {min(factors):.2f}-{max(factors):.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
