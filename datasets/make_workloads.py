"""Write the project's named workloads to datasets/workloads/<name>.jsonl.

The workloads themselves are defined in code, in ``minibatch/workload/named.py``
(``presets``, fixed seeds), so ``minibatch.workload.load_workload(name)`` works
without this folder; this script only writes the same workloads to files for
inspection and for other tools (single source of truth). Prompt token ids are
not written (``shared_prefix`` keeps ``prefix_id``/``prefix_len``; call
``Workload.materialize(32000, seed=wl.meta["token_seed"])`` to get them back).

Shapes and their sources (published statistics from datasets/traces/SOURCES.md):

- ``chat``: Azure LLM inference trace 2023, conv (Splitwise, ISCA'24; CC-BY-4.0):
  19,366 requests over 3,501.7 s, 5.53 req/s, inter-arrival CV 1.09, IoD(1 s) 1.39;
  input mean 1,154.7, p50 1,020, p90 2,734.5, p99 4,142, min 2, max 14,050;
  output mean 211.1, p50 129, p90 424, p99 601, min 7, max 1,000.
  -> gamma arrivals with burstiness 1/1.09^2 = 0.84; lognormal lengths with that
  median and mean, clipped to that min and max.
- ``code_bursty``: Azure LLM inference trace 2023, code (Splitwise, ISCA'24):
  8,819 requests over 3,435.9 s, 2.57 req/s, CV 13.15, IoD(1 s) 13.18, peak 67
  in 1 s, silent gaps up to 217 s, median gap 0.064 s; input mean 2,047.8, p50
  1,469, p90 5,187.6, p99 7,436, min 3, max 7,437; output mean 27.9, p50 13,
  p90 55, p99 251.5, min 6, max 1,899.
  -> on/off arrivals fitted to the trace (``--fit``: gaps > 5 s are OFF periods;
  ON 16.74 s mean at 9.02 req/s with gap CV 2.21, OFF 43.25 s mean); lognormal
  lengths with that median and mean, clipped to min and max.
- ``rag``: no public RAG trace in SOURCES.md; design values: prompts 1k-4k
  (median 2,048), answers median 64, Poisson arrivals at 2 req/s.
- ``long_tail``: outputs lognormal with median 64 and sigma 1.5 (p99 ~ 2,100),
  a longer tail than Azure code's outputs (p99/p50 = 251.5/13 ~ 19, sigma ~ 1.27).
- ``shared_prefix``: 8 system prompts of 256-1,024 tokens with Zipf(1) reuse,
  user turns and answers of median 128. Design values (for prefix caching).

The mean rate is rescaled to exactly the nominal one (``Workload.with_rate``).
``vllm bench serve`` conventions: burstiness = gamma shape (CV = 1/sqrt(b)).

Usage (from the repository root)::

    python datasets/make_workloads.py            # write the files, print their stats
    python datasets/make_workloads.py --fit      # re-derive the fitted constants
                                                 # from datasets/traces
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minibatch.workload import format_stats_table, load_trace, presets  # noqa: E402

OUT = REPO / "datasets" / "workloads"
DEFAULT_TRACES = REPO / "datasets" / "traces"

# Published statistics (SOURCES.md §2-3) that chat and code_bursty are fitted to.
PUBLISHED = {
    "Azure conv 2023 (published)": dict(
        n=19366, duration=3501.7, rate=5.53, cv=1.09, iod_1s=1.39, peak_1s=16,
        input_mean=1154.7, input_p50=1020, input_p90=2734.5, input_p99=4142, input_max=14050,
        output_mean=211.1, output_p50=129, output_p90=424, output_p99=601, output_max=1000),
    "Azure code 2023 (published)": dict(
        n=8819, duration=3435.9, rate=2.57, cv=13.15, iod_1s=13.18, peak_1s=67,
        input_mean=2047.8, input_p50=1469, input_p90=5187.6, input_p99=7436, input_max=7437,
        output_mean=27.9, output_p50=13, output_p90=55, output_p99=251.5, output_max=1899),
}


def write_all() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, make in presets.items():
        wl = make()
        path = OUT / f"{name}.jsonl"
        wl.to_jsonl(path, token_ids=False)
        rows[name] = wl.stats()
        print(f"wrote {path.relative_to(REPO)}: {len(wl)} requests, {path.stat().st_size / 1024:.0f} KiB")
    rows.update(PUBLISHED)
    print()
    print(format_stats_table(rows))


def fit(traces: Path) -> None:
    """Print the constants used in minibatch/workload/named.py, from the real traces."""
    for kind in ("conv", "code"):
        wl = load_trace(traces / f"AzureLLMInferenceTrace_{kind}.csv")
        s = wl.stats()
        print(f"Azure {kind}: n={s['n']} rate={s['rate']:.3f} cv={s['cv']:.3f} "
              f"burstiness(1/cv^2)={1 / s['cv'] ** 2:.3f}")
        for col, x in (("input", wl.prompt_lens), ("output", wl.output_lens)):
            print(f"  {col}: lognormal(median={np.median(x):g}, mean={x.mean():.1f}, "
                  f"min={x.min()}, max={x.max()})")
        if kind != "code":
            continue
        t = wl.arrival_times
        gaps = np.diff(t)
        off = gaps > 5.0                      # silent gaps longer than 5 s = OFF periods
        on_gaps = gaps[~off]
        n_on = int(off.sum()) + 1
        on_time = float(on_gaps.sum())
        print(f"  on/off (gap > 5 s is OFF): {int(off.sum())} OFF periods, mean "
              f"{gaps[off].mean() if off.any() else 0:.2f} s (CV "
              f"{gaps[off].std() / gaps[off].mean() if off.any() else 0:.2f}); "
              f"{n_on} ON periods, mean {on_time / n_on:.2f} s; ON gaps mean "
              f"{on_gaps.mean():.4f} s (rate_on {1 / on_gaps.mean():.2f}/s), CV "
              f"{on_gaps.std() / on_gaps.mean():.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="print fitted constants from the real traces")
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="folder with the Azure CSVs")
    args = ap.parse_args()
    if args.fit:
        fit(args.traces)
    else:
        write_all()


if __name__ == "__main__":
    main()
