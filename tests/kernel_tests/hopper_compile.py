"""Compile the Triton kernels for a Hopper GPU (sm_90) on a machine that has none.

CI has no GPU and the interpreter accepts code that the compiler may reject (or
compile into register spills), so this script takes each launch exactly as the
wrappers in ``minibatch.kernels`` issue it for realistic shapes, specialises the
arguments the way ``triton.jit`` does at launch (ints equal to 1 become constants,
16-divisible ints and 16-byte-aligned pointers get divisibility hints), compiles to
a cubin with Triton's bundled ``ptxas`` and reports registers, spill stack and shared
memory (via Triton's bundled ``cuobjdump``).

It must run in a process *without* ``TRITON_INTERPRET`` (see test_compile_hopper.py).
Prints one JSON object per compiled launch. Uses Triton internals (checked with
Triton 3.9); exits with status 3 when they are missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as e:      # pragma: no cover - depends on the Triton version
    print(f"unsupported Triton internals: {e}", file=sys.stderr)
    sys.exit(3)

from minibatch.kernels import triton_decode, triton_prefill, triton_store_kv

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = [(triton_store_kv, "_store_kv_kernel"), (triton_decode, "_paged_decode_kernel"),
           (triton_decode, "_split_kv_reduce_kernel"), (triton_prefill, "_paged_prefill_kernel")]


class _Capture:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.kernel, args, kwargs))


def capture(fn) -> list:
    """The kernel launches ``fn()`` makes, with the kernels and device checks stubbed."""
    log, saved = [], []
    for module, name in KERNELS:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, _Capture(getattr(module, name), log))
    for module in (triton_store_kv, triton_decode, triton_prefill):
        saved.append((module, "check_device", module.check_device))
        module.check_device = lambda *tensors: None   # CPU tensors stand in for CUDA ones
    try:
        fn()
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)
    return log


def compile_launch(kernel, args, kwargs) -> dict:
    """Compile one launch the way ``JITFunction.run`` would on an sm_90 device."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return dict(kernel=kernel.__name__, registers=regs, spill_stack_bytes=stack,
                shared_bytes=compiled.metadata.shared,
                constants={k: v for k, v in kwargs.items() if k.isupper()})


def launches() -> list:
    """Realistic launches: Llama-3-8B-like attention in bf16, a smaller MQA shape in fp16."""
    from minibatch.kernels.triton_kernels import paged_decode_attention, paged_prefill_attention, store_kv

    out = []
    for dtype, heads, kv_heads, head_dim, block_size in [(torch.bfloat16, 32, 8, 128, 16),
                                                         (torch.float16, 8, 1, 64, 32)]:
        num_seqs, max_blocks = 4, 64
        k_cache = torch.zeros(256, block_size, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        lens = torch.full((num_seqs,), 100, dtype=torch.int32)
        q = torch.zeros(num_seqs, heads, head_dim, dtype=dtype)
        out += capture(lambda: store_kv(q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache,
                                        torch.zeros(num_seqs, dtype=torch.int64)))
        for split in (False, True):
            out += capture(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, split_kv=split))
        qp = torch.zeros(400, heads, head_dim, dtype=dtype)
        qsl = torch.tensor([0, 100, 200, 300, 400], dtype=torch.int32)
        out += capture(lambda: paged_prefill_attention(qp, k_cache, v_cache, tables, lens, qsl))
    return out


def main() -> None:
    for kernel, args, kwargs in launches():
        record = compile_launch(kernel, args, kwargs)
        record["dtype"] = str(next(a.dtype for a in args if isinstance(a, torch.Tensor)))
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run hopper_compile.py without TRITON_INTERPRET")
    main()
