"""Load the real Azure LLM inference traces and print their statistics.

Checks ``minibatch.workload.load_trace`` and ``Workload.stats`` against the table in
datasets/traces/SOURCES.md (Azure code: CV 13.15, IoD 13.18; conv: CV 1.09, IoD
1.39; ...) and reports how long loading takes. The trace folder defaults to the
repository's ``datasets/traces``.

    python benchmarks/trace_stats.py [TRACE_DIR]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minibatch.workload import format_stats_table, load_trace  # noqa: E402

# SOURCES.md §2-3, for comparison: (n, duration, rate, CV, IoD, in p50, out p50)
PUBLISHED = {
    "code": (8819, 3435.9, 2.57, 13.15, 13.18, 1469, 13),
    "conv": (19366, 3501.7, 5.53, 1.09, 1.39, 1020, 129),
}
KEYS = ("n", "duration", "rate", "cv", "iod_1s", "input_p50", "output_p50")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir", nargs="?", type=Path, default=REPO / "datasets" / "traces")
    args = ap.parse_args()
    rows, ok = {}, True
    for kind in ("code", "conv"):
        path = args.trace_dir / f"AzureLLMInferenceTrace_{kind}.csv"
        if not path.exists():
            print(f"missing: {path}")
            return 1
        t0 = time.perf_counter()
        wl = load_trace(path)
        elapsed = time.perf_counter() - t0
        s = wl.stats()
        rows[f"Azure {kind} 2023"] = s
        mism = [f"{k}={s[k]:.4g} (published {p})" for k, p in zip(KEYS, PUBLISHED[kind])
                if abs(s[k] - p) > 0.0051 * max(1.0, abs(p)) and round(s[k], 2) != p]
        ok &= not mism
        print(f"{path.name}: {len(wl):,} requests loaded in {elapsed * 1000:.0f} ms "
              f"({len(wl) / elapsed:,.0f} rows/s); "
              + ("matches SOURCES.md" if not mism else "DIFFERS: " + ", ".join(mism)))
    print()
    print(format_stats_table(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
