"""The GPU sweep of chapter 17.6: times minibatch's own Triton decode and store kernels on a CUDA
device (compiled, not interpreted) at Llama-3-8B's shapes, and prints one JSON line.

    .venv/bin/python benchmarks/triton_gpu_sweep.py '{"device": "cuda", "dtype": "bfloat16", "scale": 1.0, "iters": 20,
        "sweep": {"block_size": [16, 32], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]},
        "heads": [32, 8, 128]}'

Chapter 17 runs it in a subprocess (without TRITON_INTERPRET) and, on a CPU, as a smoke test at a
small ``scale`` with TRITON_INTERPRET=1.
"""
import json, statistics, sys, time, torch
from minibatch.kernels import triton_decode, triton_store_kv

cfg = json.loads(sys.argv[1])
dev, dt, scale = cfg["device"], getattr(torch, cfg["dtype"]), cfg["scale"]   # scale < 1 only for a CPU smoke test
H, HKV, D = cfg["heads"]                            # query heads, KV heads, head_dim
cuda = dev == "cuda"
flush = torch.empty(256 * 2**20 if cuda else 1, dtype=torch.uint8, device=dev)


def timed(fn, iters):
    for _ in range(2 if cuda else 1):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def paged(batch, ctx, bs):
    per_seq = -(-ctx // bs)
    k = torch.randn(batch * per_seq, bs, HKV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    tables = torch.randperm(batch * per_seq, device=dev).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return torch.randn(batch, H, D, device=dev, dtype=dt), k, v, tables, lens


rows = []
iters = cfg["iters"]
for batch, ctx in [(64, 4096), (1, 32768)]:
    batch, ctx = max(1, int(batch * scale)), max(64, int(ctx * scale))
    q, k, v, t, l = paged(batch, ctx, 16)
    nbytes = batch * ctx * HKV * D * 2 * k.element_size()
    for split in (False, True):
        s = timed(lambda: triton_decode.paged_decode_attention(q, k, v, t, l, split_kv=split), iters)
        rows.append(dict(kind="decode", batch=batch, ctx=ctx, block_size=16, split=split, s=s, bytes=nbytes))
    del q, k, v, t, l
batch, ctx = max(1, int(64 * scale)), max(64, int(4096 * scale))
grid = cfg["sweep"]
for bs in grid["block_size"]:
    q, k, v, t, l = paged(batch, ctx, bs)
    nbytes = batch * ctx * HKV * D * 2 * k.element_size()
    for bn in grid["block_n"]:
        for warps in grid["num_warps"]:
            for stages in grid["num_stages"]:
                row = dict(kind="sweep", batch=batch, ctx=ctx, block_size=bs, block_n=bn, num_warps=warps,
                           num_stages=stages, bytes=nbytes)
                try:
                    row["s"] = timed(lambda: triton_decode.paged_decode_attention(
                        q, k, v, t, l, split_kv=False, block_n=bn, num_warps=warps, num_stages=stages), max(1, iters // 2))
                except Exception as e:      # e.g. out of shared memory for a large tile with many stages
                    row["error"] = f"{type(e).__name__}: {e}"[:120]
                rows.append(row)
    del q, k, v, t, l
n_tok = max(16, int(8192 * scale))
kv = torch.randn(n_tok, 3, HKV, D, device=dev, dtype=dt)
kc = torch.zeros(-(-n_tok // 16) + 1, 16, HKV, D, device=dev, dtype=dt)
vc = torch.zeros_like(kc)
slots = torch.randperm(kc.shape[0] * 16, device=dev)[:n_tok]
s = timed(lambda: triton_store_kv.store_kv(kv[:, 1], kv[:, 2], kc, vc, slots), iters)
rows.append(dict(kind="store", tokens=n_tok, s=s, bytes=2 * 2 * n_tok * HKV * D * kv.element_size()))
name = torch.cuda.get_device_name() if cuda else "cpu (interpreter smoke test)"
print(json.dumps(dict(gpu=name, rows=rows)))
