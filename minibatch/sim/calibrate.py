"""``python -m minibatch profile``: time real engine steps and fit a cost model to them.

The profiler runs a set of varied workloads (request rates, prompt and output
lengths, batch limits) through the real engine under the virtual clock, records every
step's composition (prefill chunks ``(new, context)`` and decode context lengths) and
its measured duration, and fits a :class:`~minibatch.sim.FittedCostModel`. The
simulator then replays other workloads with ``hardware="profile:FILE"``.

    python -m minibatch profile --model tiny --out profiles/tiny-cpu.json

The engine is warmed up first (``ModelExecutor.warm_up``: oneDNN builds a kernel for
each new GEMM shape, ~3 ms per step the first time a batch size occurs), so the model
predicts a warmed-up engine; GEMM row counts are bucketed (``gemm_rows``), which
bounds the shapes a run can meet.

The fit drops the steps that ran more than ``PROFILE_OUTLIER_RATIO`` (1.2) times slower
than a first fit predicts and fits again (:data:`minibatch.sim.fitted.PROFILE_OUTLIER_RATIO`
says why); the saved model's metadata records how many were dropped.

Profile under the conditions you will predict: the same machine, quiet, and the same
OpenMP setting. (minibatch defaults to ``OMP_WAIT_POLICY=PASSIVE``, robust when
processes share the cores; ``OMP_WAIT_POLICY=ACTIVE python -m minibatch profile ...``
times the engine's fastest, steadiest mode on an idle machine, as
``benchmarks/sim_fidelity.py`` does.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

from minibatch.config import add_engine_args, engine_kwargs
from minibatch.executor import StepOutput
from minibatch.model.llama import _pack, packed_linear
from minibatch.sim.hardware import GiB, HardwareSpec
from minibatch.sim.model_specs import ModelSpec
from minibatch.sim.fitted import PROFILE_OUTLIER_RATIO, next_recency

_PASSES = itertools.count()     # profile_engine calls in this process


class RecordingExecutor:
    """Wraps an executor; keeps ``{"prefill", "decode", "time_s", "recency"}`` for every step."""

    def __init__(self, inner):
        self.inner = inner
        self.samples: list[dict] = []
        self.recency = 0.0          # see minibatch.sim.fitted.next_recency

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch, kv) -> StepOutput:
        prefill, decode = batch.shape()
        out = self.inner.execute(batch, kv)
        self.samples.append({"prefill": prefill, "decode": decode, "time_s": out.duration,
                             "recency": self.recency})
        self.recency = next_recency(self.recency, prefill, decode)
        return out


# -- this machine's roofline, for floors (benchmarks/batching_bound.py, chapter 2) ------------

def _median_seconds(fn, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def measure_gemm_peak(spec: ModelSpec, rows=(128, 256, 512, 1024, 2048), repeats: int = 5) -> float:
    """The best FLOP/s of the model's linear layers together (fp32, the engine's prepacked
    oneDNN path), over a few row counts: small ones stay in cache, large ones amortize more."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i), (spec.vocab_size, h)]
    g = torch.Generator().manual_seed(0)
    weights = [_pack(torch.randn(n, k, generator=g) * 0.05) for n, k in shapes]
    best = 0.0
    for m in rows:
        flops, seconds = 0.0, 0.0
        for (n, k), packed in zip(shapes, weights):
            x = torch.randn(m, k, generator=g)
            seconds += _median_seconds(lambda: packed_linear(x, packed, None), repeats,
                                       max(1, 1024 // m))
            flops += 2.0 * m * n * k
        best = max(best, flops / seconds)
    return best


def measure_read_bandwidth(nbytes: int, repeats: int = 9) -> float:
    """Bytes/s of one full read of a float32 tensor of ``nbytes`` (``sum``)."""
    x = torch.randn(nbytes // 4)
    inner = max(1, (64 << 20) // nbytes)
    return nbytes / _median_seconds(lambda: x.sum(), repeats, inner)


def floor_hardware(name: str, gemm_flops: float, bandwidth: float) -> HardwareSpec:
    """A roofline with no step overhead and efficiencies of 1: the floor of any engine
    (``RooflineCostModel(model, floor_hardware(...))`` prices a step at that floor)."""
    return HardwareSpec(name, peak_flops=gemm_flops, memory_bandwidth=bandwidth, memory_bytes=32 * GiB,
                        interconnect="none", interconnect_bandwidth=1.0, flop_efficiency=1.0,
                        bandwidth_efficiency=1.0, step_overhead_s=0.0, source="measured here")


def training_workloads(scale: float = 1.0):
    """Varied workloads that exercise prefill-heavy, decode-heavy and mixed steps."""
    from minibatch.workload import fixed, lognormal, synthetic, uniform

    n = max(4, int(24 * scale))
    return [
        ("decode-heavy", dict(max_num_seqs=64), synthetic(max(8, int(64 * scale)), float("inf"),
                                                          input_len=uniform(8, 128), output_len=fixed(40),
                                                          seed=11)),
        ("light-load", dict(max_num_seqs=16), synthetic(max(4, n // 2), 4.0, input_len=uniform(16, 160),
                                                        output_len=uniform(8, 40), seed=15)),
        ("prefill-heavy", dict(max_num_seqs=16, max_num_batched_tokens=512),
         synthetic(n, float("inf"), input_len=uniform(100, 600), output_len=fixed(4), seed=12)),
        ("mixed", dict(max_num_seqs=32, max_num_batched_tokens=256),
         synthetic(n, 20.0, input_len=uniform(16, 300), output_len=lognormal(median=24, sigma=0.8, max=120),
                   seed=13)),
        ("big-chunks", dict(max_num_seqs=32, max_num_batched_tokens=2048),
         synthetic(max(4, n // 2), float("inf"), input_len=uniform(200, 900), output_len=fixed(6), seed=16)),
        ("draining", dict(max_num_seqs=24), synthetic(max(8, int(40 * scale)), float("inf"),
                                                      input_len=uniform(16, 128), output_len=uniform(4, 80),
                                                      seed=17)),
        ("many-short-prompts", dict(max_num_seqs=128), synthetic(max(8, int(64 * scale)), float("inf"),
                                                                input_len=uniform(8, 160), output_len=fixed(2),
                                                                seed=19)),
        ("long-context", dict(max_num_seqs=4, max_num_batched_tokens=512),
         synthetic(max(4, n // 3), float("inf"), input_len=uniform(400, 900), output_len=uniform(20, 60), seed=18)),
        ("small-batches", dict(max_num_seqs=4), synthetic(max(4, n // 2), 5.0, input_len=uniform(16, 200),
                                                          output_len=fixed(16), seed=14)),
        # Steady decoding at 2-8 sequences: the bend of g(M) at small M, which the
        # workloads above (mostly 1 sequence, or dozens) only pass through.
        ("small-decode", dict(max_num_seqs=8), synthetic(n, float("inf"), input_len=uniform(16, 160),
                                                         output_len=uniform(16, 64), seed=20)),
        ("pairs", dict(max_num_seqs=2), synthetic(max(4, n // 2), float("inf"), input_len=uniform(16, 200),
                                                  output_len=fixed(32), seed=21)),
    ]


def profile_engine(model: str = "tiny", scale: float = 1.0, repeats: int = 1, **engine_kwargs) -> tuple[list, dict]:
    """Run the training workloads on the real engine; return (samples, metadata)."""
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine
    from minibatch.executor import ModelExecutor
    from minibatch.runner import run

    base = EngineConfig.from_kwargs(model=model, **engine_kwargs)
    executor = RecordingExecutor(ModelExecutor(base))
    # Time a warmed-up engine: every GEMM kernel built before the first timed step
    # (otherwise each batch size's first step carries ~3 ms of oneDNN kernel building).
    executor.inner.warm_up()
    samples: list[dict] = []
    # Segment names must differ between calls too: sim_fidelity fits two passes together,
    # and a shared name would give both passes' runs of a workload one speed factor.
    tag = f"{os.getpid()}.{next(_PASSES)}"
    for _ in range(repeats):
        for _name, kw, wl in training_workloads(scale):
            cfg = base.replace(**kw)
            engine = LLMEngine(cfg, clock="virtual", executor=executor)
            executor.samples = []
            run(wl, engine=engine)
            for s in executor.samples:
                s["segment"] = f"{_name}#{tag}.{len(samples)}"     # this workload in this pass
            samples.extend(executor.samples)
    meta = {"model": model, "device": str(executor.inner.device), "dtype": str(executor.inner.dtype),
            "kv_capacity_tokens": executor.inner.num_kv_blocks * base.block_size,
            "block_size": base.block_size}
    return samples, meta


def fit_profile(samples, meta, outlier_ratio: float | None = PROFILE_OUTLIER_RATIO):
    """The profiler's fit: the default features, slow outliers dropped (``outlier_ratio``;
    None keeps every step)."""
    from minibatch.sim import FittedCostModel

    return FittedCostModel.fit(samples, metadata=meta, outlier_ratio=outlier_ratio)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="minibatch profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--out", required=True, help="where to write the fitted model (JSON)")
    ap.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--samples-out", default=None, help="also write the raw samples (JSON)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    try:
        samples, meta = profile_engine(scale=args.scale, repeats=args.repeats, **engine_kwargs(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = fit_profile(samples, meta)
    model.save(args.out)
    if args.samples_out:
        with open(args.samples_out, "w") as f:
            json.dump(samples, f)
    print(model.describe())
    print(f"{len(samples)} steps profiled in {time.perf_counter() - t:.1f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
