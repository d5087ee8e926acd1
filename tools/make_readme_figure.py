"""Draw the README's picture: the same workload under four policies, in the simulator.

    python tools/make_readme_figure.py   # writes docs/policies.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from minibatch.runner import run
from minibatch.viz import latency_cdf
from minibatch.workload import lognormal, synthetic, uniform

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    wl = synthetic(600, rate=9.0, input_len=uniform(64, 1024), output_len=lognormal(median=80, sigma=1.0, max=1024),
                   seed=7)
    results = {p: run(wl, executor="sim", model="llama-2-7b", hardware="a100-80g", policy=p, max_num_seqs=32,
                      max_wait_ms=50)
               for p in ("static", "dynamic", "continuous")}
    fig = latency_cdf(results, metric="e2e")
    fig.axes[0].set_xscale("log")
    fig.suptitle("Same 600 requests, LLaMA-2-7B on A100-80G (simulated): end-to-end latency by policy")
    out = ROOT / "docs" / "policies.png"
    fig.savefig(out, dpi=90, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
