"""Achieved K/V read bandwidth of paged decode attention on the CPU.

Decode attention reads every cached K and V byte of every sequence once per layer
and does a few FLOPs per byte, so on a CPU its limit is memory bandwidth once the
cache outgrows L3. For each implementation this prints the median time of a call and
the K/V bytes it had to read divided by that time::

    bytes = sum(context lengths) * num_kv_heads * head_dim * 2 (K and V) * 4 (float32)

Implementations: the C kernel as the engine calls it (AVX-512 path where the CPU and
shapes allow; with fewer sequences than threads, each context split over the threads),
for one sequence the same kernel on one thread (no split), the same kernel forced onto
its portable C path, and the torch path
(gather the pages, then scaled_dot_product_attention). Blocks are shuffled, as a
long-running engine leaves them. A second pool is streamed through between calls so
that every call reads its K/V from DRAM, as in the engine, where four layers' caches
together exceed L3. For reference the script also times a plain ``tensor.sum()`` over
256 MiB (the machine's streaming read bandwidth with the same threads).

A second table times causal *prefill* attention (caches warm, as in the engine, where a
chunk's own K/V were just written): the tiled C kernel (``cpu_prefill.c``), one decode
row per query token through the decode kernel (what the engine did before), and the
torch path.

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
    # One sequence: its context is split over the otherwise idle threads.
    ("tiny model, 1 seq x ~2048", 1, 2048, 8, 4, 32),
    ("Llama-3-8B heads, 1 seq x ~4096", 1, 4096, 32, 8, 128),
]


def make_case(num_seqs, ctx, heads, kv_heads, head_dim, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx // 2, ctx * 3 // 2 + 1, (num_seqs,), generator=g).to(torch.int32)
    k, v, tables = paged_pool(lens.tolist(), kv_heads, head_dim, block_size, g)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    return q, k, v, tables, lens


def paged_pool(lens, kv_heads, head_dim, block_size=16, g=None):
    """K/V pages for sequences of these lengths, blocks shuffled; and their block tables."""
    g = g or torch.Generator().manual_seed(0)
    num_seqs = len(lens)
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
    return k, v, tables


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
        if n < torch.get_num_threads():      # what the split buys: the same call on one thread
            impls.insert(1, ("C kernel, context not split (1 thread)",
                             lambda: cpu_paged.paged_decode_attention_c(q, k, v, tables, lens, num_threads=1)))
        for name, fn in impls:
            with torch.inference_mode():
                sec = time_calls(fn, args.iters, flush)
            rows.append({"case": label, "impl": name, "ms": sec * 1e3, "gbs": kv_bytes / sec / 1e9,
                         "kv_mib": kv_bytes / 2**20})
            print(f"| {label} ({kv_bytes / 2**20:.0f} MiB K/V) | {name} | {sec * 1e3:.3f} | {kv_bytes / sec / 1e9:.1f} |")
    prefill_rows = prefill_table(args.iters)
    if args.out:
        Path(args.out).write_text(json.dumps({"stream_read_gbs": stream_gbs, "results": rows,
                                              "prefill": prefill_rows}, indent=1))


PREFILL_CASES = [
    # label, query tokens per sequence, context per sequence, heads, kv heads, head dim
    ("tiny, 15 prompts of 16-256", None, None, 8, 4, 32),
    ("tiny, 1 prompt of 2048", [2048], [2048], 8, 4, 32),
    ("tiny, chunk of 512 at context 2048", [512], [2048], 8, 4, 32),
    ("Llama-3-8B heads, 2 prompts of 512", [512, 512], [512, 512], 32, 8, 128),
]


def decode_rows_prefill(q, k, v, tables, lens, starts):
    """Each query token as one decode over the keys up to its own position."""
    q_lens = (starts[1:] - starts[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    index_in_chunk = torch.arange(q.shape[0]) - starts[:-1].long()[seq_of]
    row_lens = (lens.long()[seq_of] - q_lens[seq_of] + index_in_chunk + 1).int()
    return cpu_paged.paged_decode_attention_c(q, k, v, tables[seq_of], row_lens)


def prefill_table(iters):
    from minibatch.kernels.reference import paged_prefill_attention_ref
    from minibatch.kernels.torch_paged import paged_prefill_attention_torch

    rows = []
    print(f"\n| prefill case | implementation | ms per call |\n|---|---|---:|")
    for label, q_lens, ctxs, h, kvh, d in PREFILL_CASES:
        if q_lens is None:
            q_lens = torch.randint(16, 257, (15,), generator=torch.Generator().manual_seed(1)).tolist()
            ctxs = q_lens
        k, v, tables = paged_pool(ctxs, kvh, d)
        lens = torch.tensor(ctxs, dtype=torch.int32)
        q = torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(2))
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        args = (q, k, v, tables, lens, starts)
        ref = paged_prefill_attention_ref(*args)
        impls = [("tiled C kernel", lambda: cpu_paged.paged_prefill_attention_c(*args)),
                 ("one decode row per query token", lambda: decode_rows_prefill(*args)),
                 ("torch (gather + SDPA)", lambda: paged_prefill_attention_torch(*args))]
        for name, fn in impls:
            with torch.inference_mode():
                torch.testing.assert_close(fn(), ref, atol=1e-4, rtol=1e-4)
                sec = time_calls(fn, iters, torch.zeros(1))
            rows.append({"case": label, "impl": name, "ms": sec * 1e3})
            print(f"| {label} | {name} | {sec * 1e3:.2f} |")
    return rows


if __name__ == "__main__":
    main()
