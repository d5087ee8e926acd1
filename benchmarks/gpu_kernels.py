"""Achieved memory bandwidth of paged decode attention (CUDA only).

Decode attention reads every cached K and V byte of every sequence once and does
little arithmetic per byte, so its speed limit is HBM bandwidth. This benchmark
reports, for each implementation, the K/V bytes it had to read divided by its time::

    bytes = batch * context * num_kv_heads * head_dim * 2 (K and V) * bytes per element

and that as a percentage of the GPU's peak HBM bandwidth (H100 SXM 3.35 TB/s, H200
4.8 TB/s, by device name; ``--peak-gbps`` overrides).

Implementations: the Triton kernel in its one-pass and split-KV forms (the automatic
heuristic picks one; that one is the "triton" result), the torch reference (gathers
the pages, then einsum), ``torch.nn.functional.scaled_dot_product_attention`` on the
same KV stored contiguously (no paging: an upper reference), and FlashInfer's or
flash-attn's paged decode kernels when they are importable (skipped otherwise).

Each timing is the median of ``--iters`` runs after ``--warmup`` runs, timed with
CUDA events; the L2 cache is flushed (a 256 MiB write) before every timed run so that
small cases are not served from L2. Goal: >= 70 % of peak at batch 64, context 4096.

    python benchmarks/gpu_kernels.py                          # the full grid, bf16
    python benchmarks/gpu_kernels.py --out kernels.json --peak-gbps 3350
    python benchmarks/gpu_kernels.py --sweep                  # also try tile/warp/stage configs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

PEAK_GBPS = [  # (substring of torch.cuda.get_device_name, GB/s); first match wins
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
    ("H800", 3350.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("RTX 4090", 1008.0),
]
GOAL_POINT = (64, 4096)
GOAL_PCT = 70.0


def peak_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key in name:
            return gbps
    return None


class Timer:
    """Median CUDA-event time of ``fn`` in milliseconds, L2 flushed before each run."""

    def __init__(self, warmup: int, iters: int):
        self.warmup, self.iters = warmup, iters
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def make_point(batch, context, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    """A paged cache holding ``batch`` sequences of ``context`` tokens in shuffled blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = math.ceil(context / block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=g, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, generator=g, device="cuda").view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=g, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, tables, lens


def flashinfer_runner(q, k_cache, v_cache, tables, lens):
    import flashinfer

    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    per_seq = tables.shape[1]
    indptr = torch.arange(0, (batch + 1) * per_seq, per_seq, dtype=torch.int32, device="cuda")
    last = (lens - 1) % block_size + 1
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, tables.reshape(-1), last.to(torch.int32), heads, kv_heads, head_dim, block_size,
                 pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def flash_attn_runner(q, k_cache, v_cache, tables, lens):
    try:   # FlashAttention-3 (Hopper) first, then FlashAttention-2 (needs page size % 256 == 0)
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError:
        from flash_attn import flash_attn_with_kvcache
    q4 = q.unsqueeze(1)
    return lambda: flash_attn_with_kvcache(q4, k_cache, v_cache, cache_seqlens=lens, block_table=tables,
                                           causal=True)


def sdpa_runner(q, k_cache, v_cache, tables, lens):
    """SDPA on the same KV laid out contiguously per sequence ([B, H_kv, T, D])."""
    batch, heads, head_dim = q.shape
    context = int(lens[0])
    kv_heads = k_cache.shape[2]

    def contiguous(cache):
        return cache[tables.long()].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q4 = q.unsqueeze(2)                       # [B, H, 1, D]
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        f(q4, k, v, enable_gqa=True)
        return lambda: f(q4, k, v, enable_gqa=True)
    except (TypeError, RuntimeError):        # older torch: expand the KV heads instead
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: f(q4, k, v)


def bench_point(timer, batch, context, block_size, args, dtype, impls):
    from minibatch.kernels.reference import paged_decode_attention_ref
    from minibatch.kernels.triton_decode import choose_split, paged_decode_attention

    q, k_cache, v_cache, tables, lens = make_point(batch, context, block_size, args.heads, args.kv_heads,
                                                   args.head_dim, dtype)
    kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * k_cache.element_size()
    auto_split = choose_split(batch, args.kv_heads, tables.shape[1] * block_size, q.device)
    runners = {
        "triton-1pass": lambda: (lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, split_kv=False)),
        "triton-split": lambda: (lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, split_kv=True)),
        "torch-ref": lambda: (lambda: paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)),
        "sdpa-contiguous": lambda: sdpa_runner(q, k_cache, v_cache, tables, lens),
        "flashinfer": lambda: flashinfer_runner(q, k_cache, v_cache, tables, lens),
        "flash-attn": lambda: flash_attn_runner(q, k_cache, v_cache, tables, lens),
    }
    rows = []
    for impl in impls:
        try:
            fn = runners[impl]()
            ms = timer(fn)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append(dict(impl=impl, error="out of memory"))
            continue
        except Exception as e:   # optional peers (FlashInfer, flash-attn) are skipped silently
            if impl in ("flashinfer", "flash-attn"):
                continue
            rows.append(dict(impl=impl, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        rows.append(dict(impl=impl, ms=ms, gbps=kv_bytes / ms / 1e6))
    del q, k_cache, v_cache, tables, lens
    torch.cuda.empty_cache()
    base = dict(batch=batch, context=context, block_size=block_size, kv_bytes=kv_bytes,
                auto="triton-split" if auto_split else "triton-1pass")
    return [dict(base, **r) for r in rows]


def sweep(timer, args, dtype) -> list[dict]:
    """Try tile sizes, warps and pipeline stages at the goal point and at batch 1."""
    from minibatch.kernels.triton_decode import paged_decode_attention

    out = []
    for batch, context, split in [(*GOAL_POINT, False), (1, 8192, True)]:
        for block_size in args.block_sizes:
            q, k_cache, v_cache, tables, lens = make_point(batch, context, block_size, args.heads, args.kv_heads,
                                                           args.head_dim, dtype)
            kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * k_cache.element_size()
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in (2, 3, 4):
                        cfg = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                        try:
                            ms = timer(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                                      split_kv=split, **cfg))
                        except Exception as e:
                            out.append(dict(batch=batch, context=context, block_size=block_size, split=split,
                                            **cfg, error=f"{type(e).__name__}"))
                            continue
                        out.append(dict(batch=batch, context=context, block_size=block_size, split=split,
                                        **cfg, ms=ms, gbps=kv_bytes / ms / 1e6))
            del q, k_cache, v_cache, tables, lens
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3-8B's 32)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--impls", default="triton-1pass,triton-split,torch-ref,sdpa-contiguous,flashinfer,flash-attn")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--peak-gbps", type=float, default=None, help="peak HBM bandwidth in GB/s")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile/warp/stage configs")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_kernels.py measures GPU memory bandwidth and needs a CUDA device; none found.\n"
              "(The kernels' correctness tests run on CPU: pytest tests/kernel_tests)", file=sys.stderr)
        return 2

    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    impls = [x for x in args.impls.split(",") if x]
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps(name)
    points = [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    points = [GOAL_POINT] + [p for p in points if p != GOAL_POINT]     # the goal first
    print(f"device: {name}; peak HBM {f'{peak:.0f} GB/s' if peak else 'unknown (use --peak-gbps)'}; "
          f"{args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype}")

    timer = Timer(args.warmup, args.iters)
    results, goal, sweep_rows = [], [], []

    def save():   # after every point, so that a run cut short still leaves its results
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=name, peak_gbps=peak, dtype=args.dtype, heads=args.heads,
                               kv_heads=args.kv_heads, head_dim=args.head_dim, warmup=args.warmup,
                               iters=args.iters, torch=torch.__version__, results=results, goal=goal,
                               sweep=sweep_rows), f, indent=1)

    started = time.time()
    header = f"{'batch':>5} {'ctx':>5} {'bs':>3} {'impl':<16} {'time us':>9} {'GB/s':>8} {'% peak':>7}"
    print(header + "\n" + "-" * len(header))
    for block_size in args.block_sizes:
        for batch, context in points:
            for row in bench_point(timer, batch, context, block_size, args, dtype, impls):
                row["pct_peak"] = 100 * row["gbps"] / peak if peak and "gbps" in row else None
                results.append(row)
                mark = " (auto)" if row["impl"] == row["auto"] else ""
                if "error" in row:
                    print(f"{batch:>5} {context:>5} {block_size:>3} {row['impl']:<16} {row['error']}")
                else:
                    pct = f"{row['pct_peak']:6.1f}%" if row["pct_peak"] is not None else "    n/a"
                    print(f"{batch:>5} {context:>5} {block_size:>3} {row['impl']:<16} {row['ms'] * 1e3:9.1f} "
                          f"{row['gbps']:8.0f} {pct}{mark}", flush=True)
            save()

    for block_size in args.block_sizes:
        hit = [r for r in results if (r["batch"], r["context"]) == GOAL_POINT and r["block_size"] == block_size
               and r["impl"] == r["auto"] and "gbps" in r]
        if hit:
            r = hit[0]
            goal.append(dict(block_size=block_size, impl=r["impl"], gbps=r["gbps"], pct_peak=r["pct_peak"],
                             met=(r["pct_peak"] or 0) >= GOAL_PCT if peak else None))
            pct = f"{r['pct_peak']:.1f}% of peak" if peak else "peak unknown"
            print(f"goal (batch {GOAL_POINT[0]}, context {GOAL_POINT[1]}, block {block_size}): "
                  f"{r['gbps']:.0f} GB/s = {pct} (target >= {GOAL_PCT:.0f}%)")

    if args.sweep:
        sweep_rows += sweep(timer, args, dtype)
        for r in sorted((r for r in sweep_rows if "gbps" in r), key=lambda r: -r["gbps"])[:10]:
            print(f"sweep: batch {r['batch']} ctx {r['context']} bs {r['block_size']} split={r['split']} "
                  f"block_n={r['block_n']} warps={r['num_warps']} stages={r['num_stages']}: {r['gbps']:.0f} GB/s")
    print(f"({time.time() - started:.0f} s)")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
