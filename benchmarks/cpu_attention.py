"""Achieved K/V read bandwidth of paged decode attention on the CPU.

Decode attention reads every cached K and V byte of every sequence once per layer
and does a few FLOPs per byte, so on a CPU its limit is memory bandwidth once the
cache outgrows L3. For each implementation this prints the median time of a call and
the K/V bytes it had to read divided by that time::

    bytes = sum(context lengths) * num_kv_heads * head_dim * 2 (K and V) * 4 (float32)

Implementations: the C kernel as the engine calls it (AVX-512 path where the CPU and
shapes allow), the same kernel forced onto its portable C path, and the torch path
(gather the pages, then scaled_dot_product_attention). Blocks are shuffled, as a
long-running engine leaves them. A second pool is streamed through between calls so
that every call reads its K/V from DRAM, as in the engine, where four layers' caches
together exceed L3. For reference the script also times a plain ``tensor.sum()`` over
256 MiB (the machine's streaming read bandwidth with the same threads).

    python benchmarks/cpu_attention.py                 # medians of 20 calls per case
    python benchmarks/cpu_attention.py --iters 50 --out cpu_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from minibatch.kernels import cpu_paged                     # noqa: E402
from minibatch.kernels.torch_paged import paged_decode_attention_torch  # noqa: E402

# (label, num_seqs, mean context, num_heads, num_kv_heads, head_dim)
CASES = [
    ("tiny model, 100 seqs x ~256", 100, 256, 8, 4, 32),
    ("tiny model, 100 seqs x ~512", 100, 512, 8, 4, 32),
    ("tiny model, 8 seqs x ~256", 8, 256, 8, 4, 32),
    ("Llama-3-8B heads, 16 seqs x ~1024", 16, 1024, 32, 8, 128),
]


def make_case(num_seqs, ctx, heads, kv_heads, head_dim, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx // 2, ctx * 3 // 2 + 1, (num_seqs,), generator=g).to(torch.int32)
    nblocks = [-(-int(n) // block_size) for n in lens]
    total = sum(nblocks)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(num_seqs, max(nblocks), dtype=torch.int32)
    o = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[o:o + n]
        o += n
    k = torch.randn(total, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(total, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    return q, k, v, tables, lens


def time_calls(fn, iters, flush):
    fn()
    times = []
    for _ in range(iters):
        flush.sum()                          # evict the K/V from the caches (reads only: no write-backs)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if not cpu_paged.available():
        sys.exit(f"the C kernel is unavailable here: {cpu_paged.build_error}")

    flush = torch.zeros(64 * 1024 * 1024)    # 256 MiB
    t = time_calls(lambda: flush.sum(), args.iters, torch.zeros(1))
    stream_gbs = flush.numel() * 4 / t / 1e9
    print(f"threads {torch.get_num_threads()}; streaming read (tensor.sum over 256 MiB): {stream_gbs:.1f} GB/s\n")

    rows = []
    print(f"| case | implementation | ms per call | K/V GB/s |\n|---|---|---:|---:|")
    for label, n, ctx, h, kvh, d in CASES:
        q, k, v, tables, lens = make_case(n, ctx, h, kvh, d)
        kv_bytes = int(lens.sum()) * kvh * d * 2 * 4
        impls = [
            ("C kernel (AVX-512)" if cpu_paged.uses_avx512(h, kvh, d) else "C kernel",
             lambda: cpu_paged.paged_decode_attention_c(q, k, v, tables, lens)),
            ("C kernel, portable path",
             lambda: cpu_paged.paged_decode_attention_c(q, k, v, tables, lens, portable=True)),
            ("torch (gather + SDPA)", lambda: paged_decode_attention_torch(q, k, v, tables, lens)),
        ]
        for name, fn in impls:
            with torch.inference_mode():
                sec = time_calls(fn, args.iters, flush)
            rows.append({"case": label, "impl": name, "ms": sec * 1e3, "gbs": kv_bytes / sec / 1e9,
                         "kv_mib": kv_bytes / 2**20})
            print(f"| {label} ({kv_bytes / 2**20:.0f} MiB K/V) | {name} | {sec * 1e3:.3f} | {kv_bytes / sec / 1e9:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"stream_read_gbs": stream_gbs, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
