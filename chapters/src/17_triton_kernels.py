# %% [markdown]
# # 第 17 章 Triton Kernel 实战
#
# 第 7 章逐行读过 minibatch 的分页解码（Paged Decode）内核，实验 L05 让你从零写出它的几个版本。本章换一个角度：
# 把这些内核当作要交付、要上线的代码来看。一次解码步里，模型的每一层先用 **KV 写入内核**（KV Store）把新 Token 的 K/V
# 写进分页缓存，再用**分页解码内核**读遍整段上下文；上下文很长而序列很少时，解码内核拆成分区（Split-KV），
# 再由一个**归约内核**（Reduce Kernel）合并。本章要回答工程上的几个问题：引擎怎样把一层的注意力派发给内核，
# 内核的网格（Grid）、Tile 大小、`num_warps`、`num_stages` 为什么这样取，一次解码步要从显存读多少字节、
# 在各种 GPU 上最快能多快（带宽模型与屋顶线），以及怎样测试一个内核才放心把它交给引擎。
#
# 所有内核都在 CPU 上的 **Triton 解释器**里运行（`TRITON_INTERPRET=1`，必须在导入 Triton 之前设置），形状都很小；
# 每个内核先与一个直白的 torch 参考实现逐元素对照（Triton 教程的做法），再谈性能。性能的结论来自字节模型与
# `minibatch/sim/hardware.py` 里的硬件参数；真正的带宽只能在 GPU 上测——17.6 节的单元格只在有 GPU 时运行，没有 GPU 时只说明它没有运行。
#
# ## 学习目标
#
# - 说清引擎怎样派发注意力：`resolve_backend` 选后端，`Attention.forward` 每层先写 KV、再把解码行与预填充行分给两个内核；
# - 读懂 KV 写入内核 `_store_kv_kernel` 的网格与 Tile，与 vLLM v0.11.0 的 Triton 写入内核对照，按 Triton 教程的方式先对照参考实现、再做形状上的属性测试；
# - 掌握 Split-KV 的分区规划（`split_partitions`）与归约内核的合并公式，知道什么时候值得拆；
# - 理解页大小 `block_size` 与循环 Tile `BLOCK_N` 的关系，以及 `num_warps`、`num_stages` 的默认值从哪里来；
# - 用字节模型算出解码注意力一步读多少 KV、算术强度 $2G/b$ 为什么远低于各 GPU 的脊点，并给出 A10、L4、A100、H100、H200 上的下限；
# - 掌握内核的测试策略：参考实现、毒化缓存（NaN）、边界长度、属性测试，以及只能在 GPU 上做的检查。

# %%
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"   # before triton (and minibatch's kernel modules) is imported

import inspect
import json
import re
import statistics
import subprocess
import sys
import time

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton.backends.nvidia.compiler import CUDAOptions

import minibatch
import minibatch.kernels as mb_kernels
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.kernels import cpu_paged, triton_decode, triton_kernels, triton_store_kv
from minibatch.kernels._triton_utils import block_dim
from minibatch.kernels.reference import paged_decode_attention_ref, store_kv_ref
from minibatch.model.llama import Attention
from minibatch.sim import make_cost_model
from minibatch.sim.hardware import get_hardware
from minibatch.sim.model_specs import get_model_spec
from minibatch.viz import md_table

torch.set_num_threads(1)
print("minibatch", minibatch.__version__, "| triton", triton.__version__, "| torch", torch.__version__)
print("Triton interpreter:", triton_decode.interpreting(), "| CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 17.1 引擎怎样派发到内核
#
# minibatch 的注意力有三个后端（`minibatch/kernels/__init__.py`）：`"triton"`（CUDA 上的默认；CPU 上只能在解释器里跑）、
# `"cpu"`（C 内核，CPU 上的默认）、`"torch"`（先把分页的 KV 收集成连续张量，再做普通注意力）。
# 执行器在构造时调用一次 `resolve_backend` 定下后端（环境变量 `MINIBATCH_KERNELS` 可以覆盖），之后每一层都按它派发：

# %%
print(inspect.getsource(mb_kernels.resolve_backend))
src = inspect.getsource(Attention.forward).splitlines()
start = next(i for i, line in enumerate(src) if "kernels.store_kv" in line)
print("\n".join(src[start:]))

# %% [markdown]
# 一层注意力最多三次内核调用：先 `store_kv` 把本步**所有**新 Token 的 K/V 写进缓存（预填充块与解码各自的新 Token 一起写），
# 再做注意力。执行器在拼批时把解码行放在前面（第 9 章 `ModelExecutor.prepare`），所以前 `num_decode_tokens` 行交给解码内核，
# 其余行交给预填充内核；全是解码或全是预填充时只调一个。
#
# 在解释器里用真实的 tiny 模型验证这条派发路径：两个请求同时到达，第一步之后再来第三个请求，于是有纯预填充步、混合步和纯解码步。
# 把 `triton_kernels` 的三个入口包一层计数（不改任何逻辑），再用 C 内核后端（CPU 上的默认）与 `torch` 后端跑同样的请求，贪心输出必须逐 Token 相同：

# %%
DISPATCH_PROMPTS = {"A": "Once upon a time", "B": "小明和他的狗", "C": "The little cat"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def dispatch_run(backend):
    """Run A and B, then C one step later; per step: (decode tokens, prefill tokens, kernel calls)."""
    eng = LLMEngine(EngineConfig.from_kwargs(model="tiny", attention_backend=backend, block_size=16, num_kv_blocks=64),
                    clock="virtual")
    calls, steps = {}, []
    saved = {name: getattr(triton_kernels, name) for name in ("store_kv", "paged_decode_attention",
                                                             "paged_prefill_attention")}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return saved[name](*args, **kwargs)
        return wrapper

    for name in saved:
        setattr(triton_kernels, name, counting(name))
    try:
        for rid in ("A", "B"):
            eng.add_request(DISPATCH_PROMPTS[rid], GREEDY, request_id=rid)
        while eng.has_unfinished_requests():
            calls.clear()
            eng.step()
            st_ = eng.steps[-1]
            steps.append((st_.num_decode_tokens, st_.num_prefill_tokens, dict(calls)))
            if len(eng.steps) == 1:
                eng.add_request(DISPATCH_PROMPTS["C"], GREEDY, request_id="C")
    finally:
        for name, fn in saved.items():
            setattr(triton_kernels, name, fn)
    return {rid: eng.requests[rid].output_token_ids for rid in DISPATCH_PROMPTS}, steps


tokens_triton, dispatch_steps = dispatch_run("triton")
tokens_cpu, _ = dispatch_run("cpu")
tokens_torch, _ = dispatch_run("torch")
n_layers = get_model_spec("tiny").num_layers
md_table(["step", "decode tokens", "prefill tokens", "store_kv calls", "decode calls", "prefill calls"],
         [[i, d, p, c.get("store_kv", 0), c.get("paged_decode_attention", 0), c.get("paged_prefill_attention", 0)]
          for i, (d, p, c) in enumerate(dispatch_steps)])

# %% tags=["nbval-check-output"]
print("greedy tokens, triton backend (interpreter):", tokens_triton)
print("identical to the C-kernel and torch backends:", tokens_triton == tokens_cpu == tokens_torch)
mixed = [i for i, (d, p, c) in enumerate(dispatch_steps) if d and p]

# %% tags=["check"]
assert tokens_triton == tokens_cpu == tokens_torch, "the prose says the three backends give the same greedy tokens"
assert mixed and all(c.get("paged_decode_attention") == c.get("paged_prefill_attention") == n_layers
                     for d, p, c in (dispatch_steps[i] for i in mixed)), "a mixed step calls both kernels in every layer"
assert all(c.get("store_kv") == n_layers for _, _, c in dispatch_steps), "one store_kv per layer and step"

# %% [markdown]
# tiny 模型有 {{n_layers}} 层，所以每一步调用 {{n_layers}} 次 `store_kv`；第 {{mixed[0]}} 步是混合步（A、B 解码，C 预填充），
# 每层既调解码内核、也调预填充内核。三个后端的贪心输出逐 Token 相同——这是引擎级别的端到端检查，17.7 节会把它放进测试策略里。
# 解释器很慢（每次启动内核，它都在 Python 里逐个程序地执行），所以本章其余的检查都直接调用内核、用很小的形状。
#
# ## 17.2 KV 写入内核
#
# 本步有 $N$ 个新 Token，第 $t$ 个要写到扁平槽位 $s_t$（执行器按块表算好的 `slot_mapping`，第 7 章 7.2 节）；$s_t = -1$ 表示不写
# （例如填充的 Token）。写入就是一次按行的散射（Scatter）：
#
# $$
# K_\text{cache}[\lfloor s_t / B \rfloor,\ s_t \bmod B,\ :,\ :] = K_t,\qquad V_\text{cache}[\ldots] = V_t,\qquad s_t \ge 0 .
# $$
#
# 它读 $2 N H_{kv} d\, b_\text{in}$ 字节、写 $2 N H_{kv} d\, b_\text{cache}$ 字节，没有任何计算，是纯粹的访存。
# minibatch 的内核（`minibatch/kernels/triton_store_kv.py`）一个程序（Program）负责一个 Token，一次搬一个 `[BLOCK_H, BLOCK_D]`
# 的二维 Tile（全部 KV 头 × `head_dim`，各自补齐到 2 的幂）：

# %%
print(inspect.getsource(triton_store_kv._store_kv_kernel.fn))

# %% [markdown]
# 几个工程细节都在这几十行里：`slot < 0` 的程序直接返回；槽位先转成 `int64` 再乘步长（大缓存里块号 × 块步长会超过 $2^{31}$）；
# 按张量**步长**（Stride）寻址，所以引擎传进来的 `k`、`v`（从一次 QKV 投影里切出来的视图，不连续）不用先复制；
# 写入时 `.to(k_cache_ptr.dtype.element_ty)` 把激活的精度转成缓存的精度（例如 fp32 激活写进 fp16/bf16 缓存）。
#
# 网格怎么切是一个设计选择，三种常见做法：
#
# | 实现（版本，源文件） | 网格 | 一个程序搬运 | 说明 |
# |---|---|---|---|
# | 实验 L05 任务 4 | `(num_tokens, num_kv_heads)` | 一个头的一行，`BLOCK_D` 个元素 | 最直白；程序最多 |
# | minibatch（`minibatch/kernels/triton_store_kv.py`） | `(num_tokens,)` | `[BLOCK_H, BLOCK_D]` 的二维 Tile | 按步长寻址，K/V 行可以不连续 |
# | vLLM v0.11.0（`vllm/attention/ops/triton_reshape_and_cache_flash.py`，`reshape_and_cache_kernel_flash`） | `(num_tokens, cdiv(H_kv·d, TILE_SIZE))` | 把一个 Token 的 `H_kv·d` 个元素压平成一维，每次 `TILE_SIZE` 个 | `TILE_SIZE = min(2048, next_pow2(H_kv·d))`，计算能力 < 9 时不超过 512；CUDA 上 `num_warps=16`、`num_stages=10`；要求一个 Token 的一行在内存里连续 |
#
# 为了看清“压平的一维 Tile”这种切法，下面在 notebook 里写一个教学用的小内核（vLLM 的思路，没有 FP8 等分支），
# 然后**与 minibatch 的内核逐位对照**——引擎用的始终是包里的那一个。

# %%
@triton.jit
def _store_kv_flat_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          stride_key_t, stride_value_t, stride_cache_b, stride_cache_t,
                          ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """Grid (num_tokens, cdiv(ROW, TILE)): copy TILE of token t's ROW = num_kv_heads * head_dim elements."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < ROW
    dst = (slot // BLOCK_SIZE) * stride_cache_b + (slot % BLOCK_SIZE) * stride_cache_t + offs
    k = tl.load(key_ptr + token * stride_key_t + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_flat(key, value, k_cache, v_cache, slot_mapping, tile=64):
    """The teaching kernel's launcher; needs each token's [num_kv_heads, head_dim] row contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == head_dim
    _store_kv_flat_kernel[(num_tokens, triton.cdiv(row, tile))](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        k_cache.stride(0), k_cache.stride(1), ROW=row, BLOCK_SIZE=k_cache.shape[1], TILE=tile)


def store_case(num_tokens, num_blocks, block_size, kv_heads, head_dim, seed=0, skip=0.25, cache_dtype=torch.float32):
    """New K/V rows as the engine has them (views into one projection), distinct random slots, some -1."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < skip] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    return qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots

# %%
def store_matches_reference(store, case):
    """``store`` writes exactly what ``store_kv_ref`` writes, and nothing else."""
    key, value, k_cache, v_cache, slots = case
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, ref_k, ref_v, slots)
    store(key, value, k_cache, v_cache, slots)
    return torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


case = store_case(num_tokens=20, num_blocks=8, block_size=16, kv_heads=4, head_dim=32)
print("slot_mapping:", case[4].tolist())
print("key is a non-contiguous view:", not case[0].is_contiguous())
ok_package = store_matches_reference(triton_store_kv.store_kv, case)
contiguous_case = tuple(t.contiguous() if i < 2 else t for i, t in enumerate(store_case(20, 8, 16, 4, 32)))
ok_flat = store_matches_reference(store_kv_flat, contiguous_case)
ok_fp16 = store_matches_reference(triton_store_kv.store_kv, store_case(20, 8, 16, 4, 32, cache_dtype=torch.float16))
print(f"package kernel == store_kv_ref: {ok_package} | teaching flat kernel == store_kv_ref: {ok_flat} | "
      f"fp32 rows into an fp16 cache: {ok_fp16}")

# %% tags=["check"]
assert ok_package and ok_flat and ok_fp16, "the prose says all three stores match the reference bit for bit"

# %% [markdown]
# 两个内核写出的缓存都与 `store_kv_ref`（`index_copy_` 的一行 torch）**逐位相同**，包括跳过 `-1` 的槽位、不连续的 `key` 视图
# （教学内核要求连续，所以它的用例先 `.contiguous()`）、以及 fp32 行写进 fp16 缓存。
#
# 一个固定的用例只覆盖一组形状。Triton 内核最容易出错的地方恰恰在形状的边上：`num_kv_heads` 不是 2 的幂（`BLOCK_H` 要补齐）、
# `head_dim` 不是 2 的幂（`block_dim` 把它补到 ≥ 16 的 2 的幂，例如 80 → 128）、块大小为 1、全部槽位都是 `-1`……
# **属性测试**（Property-based Testing）让工具替我们挑形状：`hypothesis` 在给定的范围里生成用例，检查一条对所有用例都该成立的性质——
# 这里的性质是“与参考实现逐位相同”。`derandomize=True` 让它每次挑同样的用例（notebook 的输出因此稳定），`database=None` 不在磁盘上留记录。

# %%
store_examples = []


@settings(max_examples=14, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(num_tokens=st.integers(1, 24), block_size=st.sampled_from([1, 2, 8, 16]), kv_heads=st.integers(1, 5),
       head_dim=st.sampled_from([8, 12, 32, 80]), skip=st.sampled_from([0.0, 0.3, 1.0]), fp16=st.booleans(),
       seed=st.integers(0, 10_000))
def store_property(num_tokens, block_size, kv_heads, head_dim, skip, fp16, seed):
    num_blocks = -(-num_tokens // block_size) + 2
    c = store_case(num_tokens, num_blocks, block_size, kv_heads, head_dim, seed, skip,
                   torch.float16 if fp16 else torch.float32)
    assert store_matches_reference(triton_store_kv.store_kv, c), \
        f"store_kv differs from store_kv_ref: {num_tokens} tokens, block {block_size}, {kv_heads} KV heads, d {head_dim}"
    store_examples.append((block_size, kv_heads, head_dim, block_dim(head_dim)))


store_property()
print(f"{len(store_examples)} shapes checked, all identical to store_kv_ref")
print("(block_size, kv_heads, head_dim -> BLOCK_D):", sorted(set(store_examples))[:8], "...")
assert len(store_examples) >= 10 and any(d == 80 for _, _, d, _ in store_examples), "the prose says d=80 was covered"

# %% [markdown]
# KV 写入在解码步里几乎不花时间：解码一步每条序列只写 **1** 个 Token 的 K/V，却要读**整段上下文**的 K/V，读写之比就是上下文长度。
# 写入只在大段预填充时才显得多；它的字节数按上面的公式算，17.5 节的带宽模型同样适用。
#
# ## 17.3 Split-KV：分区与归约
#
# 第 7 章 7.5 节 ⑥ 与 L05 任务 5 讲过 Split-KV 的动机：程序数 = 序列数 × KV 头数，序列少而上下文长时，GPU 的大部分
# SM（Streaming Multiprocessor）没有活干；于是把上下文切成长 $P$ 的分区，每个分区一个程序，分区 $p$ 写出部分结果
# $(m_p, l_p, \mathbf{acc}_p)$，再由第二个内核合并：
#
# $$
# M = \max_p m_p,\qquad
# o = \frac{\sum_p e^{m_p - M}\,\mathbf{acc}_p}{\sum_p e^{m_p - M}\, l_p}.
# $$
#
# 这里看工程上的两件事。其一，**分区规划**：归约内核把一个查询头的全部分区放进一个 Tile（`BLOCK_P` = 分区数补到 2 的幂），
# 所以分区数有上限 `MAX_PARTITIONS`；上下文太长时把分区加倍，直到放得下（`split_partitions`，本章从 `paged_decode_attention` 里提出来的一个小函数）：

# %%
print(inspect.getsource(triton_decode.split_partitions))
plan = {n: triton_decode.split_partitions(n) for n in (600, 4096, 32768, 131072, 1_000_000)}
md_table(["context (tokens)", "partition size", "partitions"], [[f"{n:,}", p, k] for n, (p, k) in plan.items()])

# %% [markdown]
# 默认分区 {{triton_decode.DEFAULT_PARTITION_SIZE}} 个 Token，最多 {{triton_decode.MAX_PARTITIONS}} 个分区：
# 32k 的上下文正好 {{plan[32768][1]}} 个分区；128k 时分区加倍到 {{plan[131072][0]}} 个 Token。
# 其二，**归约内核**本身（`_split_kv_reduce_kernel`）：网格 `(num_seqs, num_heads)`，每个程序读一个头的全部分区，
# 按上面的公式合并。注意两处防御：只读这条序列自己的分区（`num_parts = cdiv(ctx_len, PARTITION_SIZE)`，越过序列末尾的分区根本没写），
# 以及空上下文时把 $M$ 从 $-\infty$ 换成 0，避免 $-\infty - (-\infty)$ 的 NaN：

# %%
print(inspect.getsource(triton_decode._split_kv_reduce_kernel.fn))

# %% [markdown]
# 合并是**精确**的，不是近似：任何分区大小下，拆分后的结果与不拆分的结果只差浮点舍入。在解释器里对一条 300 Token 的序列和一条 37 Token 的序列
# （后者只占第一个分区，其余分区直接返回）扫一遍分区大小，与 torch 参考实现比较：

# %%
def paged_case(lens, block_size=16, num_heads=8, num_kv_heads=2, head_dim=32, seed=0, spare=3):
    """Random q and paged K/V for sequences of ``lens`` tokens in shuffled blocks; tables padded with 0."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(max(need), 1), dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


split_case = paged_case([300, 37])
ref = paged_decode_attention_ref(*split_case)
one_pass = triton_decode.paged_decode_attention(*split_case, split_kv=False)
split_err = {}
for ps in (32, 64, 128, 256):
    out = triton_decode.paged_decode_attention(*split_case, split_kv=True, partition_size=ps)
    split_err[ps] = (out - ref).abs().max().item()
err_one_pass = (one_pass - ref).abs().max().item()
print("max |error| vs reference, one pass:", f"{err_one_pass:.0e}")
print("split-KV, by partition size:", {ps: f"{e:.0e}" for ps, e in split_err.items()})
assert max(split_err.values()) < 1e-5 and err_one_pass < 1e-5, "the prose says splitting is exact up to rounding"

# %% [markdown]
# 什么时候拆？引擎的规则是 `choose_split`：上下文超过一个分区，**并且**序列数 × KV 头数少于 SM 数（一个 SM 都分不到一个程序）。
# 在 CPU 解释器里 SM 数是一个固定的替身 16（`_triton_utils.num_sms`）；在 GPU 上它读设备的真实 SM 数：

# %%
print(inspect.getsource(triton_decode.choose_split))

# %% [markdown]
# 下图用这条规则的同一个不等式，画出 Llama-3-8B（8 个 KV 头）在 A100（108 个 SM）与 H100 SXM（132 个 SM；两数均出自 NVIDIA 的
# *A100 Tensor Core GPU Architecture* 与 *H100 Tensor Core GPU Architecture* 白皮书）上，一次解码启动的程序数能占满多少 SM（只看第一波）：
# 批小时，不拆分只有 `batch × 8` 个程序；拆分后乘上分区数。这只是并行度的账，不是耗时——耗时要看读多少字节（17.5 节）与实测（17.6 节）。

# %%
SMS = {"a100-80g": 108, "h100": 132}      # SMs per GPU (NVIDIA A100 / H100 architecture whitepapers)
spec8 = get_model_spec("llama-3-8b")
contexts = np.array([256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])


def sm_share(batch, context, sms, split):
    """Programs of one decode launch as a share of the SMs (one wave), with choose_split's condition."""
    programs = batch * spec8.num_kv_heads
    if split and context > triton_decode.DEFAULT_PARTITION_SIZE and programs < sms:
        programs *= triton_decode.split_partitions(context)[1]
    return min(1.0, programs / sms)


fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
for ax, (gpu, sms) in zip(axes, SMS.items()):
    for batch, color in zip((1, 4, 16), ("C0", "C1", "C2")):
        ax.plot(contexts, [sm_share(batch, c, sms, False) * 100 for c in contexts], "--", color=color, lw=1)
        ax.plot(contexts, [sm_share(batch, c, sms, True) * 100 for c in contexts], "o-", color=color, ms=3,
                label=f"batch {batch}: split (solid) / one pass (dashed)")
    ax.set(xscale="log", xlabel="context (tokens)", title=f"{gpu}: {sms} SMs, llama-3-8b (8 KV heads)")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("SMs given a program (%)")
axes[0].legend(fontsize=7)
plt.tight_layout()
plt.show()
share_b1 = {split: sm_share(1, 8192, SMS["h100"], split) for split in (False, True)}
parts_8192 = triton_decode.split_partitions(8192)[1]
first_unsplit = next(b for b in range(1, 64) if b * spec8.num_kv_heads >= SMS["h100"])   # choose_split's condition fails
assert share_b1[False] < 0.1 and share_b1[True] > 0.9, "the prose quotes these shares"
assert 16 < first_unsplit and 16 * spec8.num_kv_heads < SMS["h100"], "the prose says batch 16 is still split on an H100"

# %% [markdown]
# 批大小为 1、上下文 8192 时，不拆分只有 {{spec8.num_kv_heads}} 个程序，占 H100 的 {{share_b1[False]:.0%}}；拆成 {{parts_8192}} 个分区后程序数达到 {{parts_8192 * spec8.num_kv_heads}} 个，
# 占 {{share_b1[True]:.0%}}（图中的曲线在程序数超过 SM 数时按 100% 封顶）。Flash-Decoding 的作者报告，在很长的序列上这种拆分让生成快到 8 倍
# （Dao, Haziza, Massa, Sizov, *Flash-Decoding for long-context inference*, 2023 年 10 月博客）。批大小为 16 时，
# 16 × {{spec8.num_kv_heads}} = {{16 * spec8.num_kv_heads}} 个程序已接近一波，`choose_split` 仍会拆（{{16 * spec8.num_kv_heads}} < {{SMS["h100"]}}），多出的归约只是一次很小的读写；
# 批大小到 {{first_unsplit}} 时（{{first_unsplit * spec8.num_kv_heads}} 个程序）就不拆了。
#
# vLLM v0.11.0 的 CUDA 内核有同样的两档：`paged_attention_v1` 不分区，`v2` 按 512 个 Token 分区再归约，
# 选择条件写在 `vllm/attention/ops/paged_attn.py` 的 `use_v1`（L05 第 4 节有完整的表）。
#
# 要注意，`paged_attention_v1/v2` 是 vLLM 旧引擎（V0）的内核，本章拿它们对照是因为它们与 minibatch 的内核同构、好读。
# V1 引擎（v0.8.0 起默认）在 NVIDIA GPU 上解码时默认**不用**它们。v0.11.0 的 `vllm/platforms/cuda.py`
# 在 `CudaPlatformBase.get_attn_backend_cls` 里挑注意力后端（未指定 `VLLM_ATTENTION_BACKEND` 时）：
# Blackwell（SM 10.0）装了 FlashInfer 就用 **FlashInfer**（并把 KV 布局改成 HND）；SM 8.0 以上（Ampere、Hopper）用 **FlashAttention**
# （`vllm/v1/attention/backends/flash_attn.py`，FlashAttention-2/3 的变长、分页 KV 内核，解码同样按 KV 长度拆分再归约），
# 只在有注意力 sink 或 FP8 KV 缓存且不是 Hopper 时改用 Triton（`TRITON_ATTN`）；更老的 GPU 用 FlexAttention。
# 较新的 vLLM 把这段判断改写成了 `_get_backend_priorities` 返回的一张优先级表，顺序随版本调整。这些后端的分页方式、拆分规则和 minibatch 一样，只是每一步都做了更多的硬件专门优化；
# 练习第 6 题把 minibatch 的内核与 FlashInfer、flash-attn 放在同一张表里比。
#
# ## 17.4 页大小、Tile 与 `num_warps`、`num_stages`
#
# 解码内核有两种“块”，不要混淆：
#
# - **页大小** `block_size`（$B$）：KV 缓存的分配单位，由引擎配置决定（vLLM 在 CUDA 上默认 16，第 7 章）；
# - **循环 Tile** `BLOCK_N`：内核每次循环处理的上下文 Token 数，是内核的调参旋钮，与页大小无关——minibatch 的内核对 Tile 里的每个位置
#   各查一次块表（`offs_n // BLOCK_SIZE`），所以一个 Tile 可以跨多页，也可以是半页。
#
# 启动参数 `num_warps`（一个程序用多少个 32 线程的线程束，Warp）和 `num_stages`（循环的软件流水线级数：提前几轮发出下一块 K/V 的读取）
# 只影响编译出的 GPU 代码，解释器里没有意义。它们的默认值：

# %%
print(inspect.getsource(triton_decode._decode_config))
triton_defaults = {f: getattr(CUDAOptions, f) for f in ("num_warps", "num_stages")}
print(f"Triton {triton.__version__} defaults (triton/backends/nvidia/compiler.py, CUDAOptions):", triton_defaults)

# %% [markdown]
# minibatch 在 GPU 上的 bf16 配置是 `BLOCK_N` = 64、`num_warps` = 4、`num_stages` = 3，后两个正是 Triton {{triton.__version__}}
# 的默认值（`num_warps` = {{triton_defaults["num_warps"]}}、`num_stages` = {{triton_defaults["num_stages"]}}）；函数的文档说明它们“未经调优”，
# 调优用 `benchmarks/gpu_kernels.py --sweep`（17.6 节的 GPU 单元格也扫这几个旋钮）。别人的选择可以作参照（均核对自 vLLM v0.11.0 源码）：
#
# | 内核（源文件） | Tile | `num_warps` | `num_stages` |
# |---|---|---|---|
# | CUDA `paged_attention_v1`（`csrc/attention/paged_attention_v1.cu`） | 一个线程束一次处理一页；页大小只编译了 8、16、32 三种 | `NUM_THREADS = 128`，即 4 个线程束 | — |
# | Triton 解码，MHA（`vllm/attention/ops/triton_decode_attention.py`，`_decode_att_m_fwd`） | `BLOCK = 64` | 4（GQA 时 2） | 2 |
# | Triton 解码，GQA（同一文件，`_decode_grouped_att_m_fwd`） | `BLOCK = 32`，查询头补到 `BLOCK_H = 16` 行 | 4 | 2 |
# | Triton KV 写入（`vllm/attention/ops/triton_reshape_and_cache_flash.py`） | `TILE_SIZE` ≤ 2048 | 16 | 10 |
#
# 注意 vLLM 的 GQA 内核和 minibatch 一样把一组查询头补到 16 行（`tl.dot` 每维至少 16）；17.5 节会算这些补出来的行花掉的是什么。
#
# 在解释器里可以检查的是**正确性不依赖这些选择**：页大小 × `BLOCK_N` 的每一种组合，输出都与参考实现一致。
# 可以算出来的是每种 Tile 的**无效工作**：一个程序处理 $n$ 个 Token 要循环 $\lceil n / \text{BLOCK\_N} \rceil$ 次，最后一个 Tile
# 里 $\text{BLOCK\_N}\lceil n/\text{BLOCK\_N}\rceil - n$ 个位置被掩码屏蔽（读不到数据，但占着线程）。

# %%
tile_case_lens = [1, 15, 16, 17, 100]
tile_errors = {}
for bs in (1, 16, 64):
    c = paged_case(tile_case_lens, block_size=bs, seed=bs)
    r = paged_decode_attention_ref(*c)
    for bn in (16, 64):
        tile_errors[bs, bn] = (triton_decode.paged_decode_attention(*c, split_kv=False, block_n=bn) - r).abs().max().item()
print(f"{len(tile_errors)} (block_size, BLOCK_N) pairs, contexts {tile_case_lens}: max |error| "
      f"{max(tile_errors.values()):.0e}")
assert max(tile_errors.values()) < 1e-5, "the prose says every pair agrees with the reference"

# %%
chat_ctx = np.random.default_rng(0).lognormal(np.log(600), 0.9, 4000).astype(int) + 1     # a spread of decode contexts
tile_sizes = [16, 32, 64, 128, 256]
masked_share = {bn: float(np.mean((np.ceil(chat_ctx / bn) * bn - chat_ctx) / (np.ceil(chat_ctx / bn) * bn)))
                for bn in tile_sizes}
short_ctx = chat_ctx[chat_ctx < 128]
masked_short = {bn: float(np.mean((np.ceil(short_ctx / bn) * bn - short_ctx) / (np.ceil(short_ctx / bn) * bn)))
                for bn in tile_sizes}
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.plot(tile_sizes, [masked_share[b] * 100 for b in tile_sizes], "o-", label="all contexts (median 600)")
ax.plot(tile_sizes, [masked_short[b] * 100 for b in tile_sizes], "s--", label="contexts < 128 tokens")
ax.set(xscale="log", xlabel="BLOCK_N (tokens per loop iteration)", ylabel="masked lanes (%)",
       title="Work wasted in the last tile of each (sequence, KV head)")
ax.set_xticks(tile_sizes, [str(b) for b in tile_sizes])
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()
assert masked_share[64] < 0.1 < masked_short[64], "the prose says 64 wastes little overall but much on short contexts"

# %% [markdown]
# 对数正态分布、中位数 600 Token 的解码上下文上，`BLOCK_N` = 64 时只有 {{masked_share[64]:.1%}} 的位置被屏蔽；
# 但对短于 128 Token 的上下文，这个比例是 {{masked_short[64]:.0%}}，到 `BLOCK_N` = 256 时是 {{masked_short[256]:.0%}}。
# 更大的 Tile 每轮读得更多、循环开销更少，却要更多寄存器与共享内存（K、V 各一块 `BLOCK_N × BLOCK_D`，再乘流水线级数），
# 程序能同时驻留在一个 SM 上的数量随之下降；短上下文还白白屏蔽更多位置。这就是 64 这类“中间值”常见的原因——
# 但最终要由 GPU 上的扫描决定（17.6 节）。vLLM 论文报告，它的 PagedAttention 内核因为要查块表、处理变长序列，
# 注意力内核的延迟比高度优化的 FasterTransformer 高 20%–26%（Kwon et al., SOSP'23, §7.1 与 Figure 18a）：分页的间接寻址不是免费的。
#
# ## 17.5 字节模型：解码注意力读多少、最快多快
#
# 解码一步，批里序列 $s$ 有 $c_s$ 个上下文 Token。每层每条序列，注意力要把它的 K 与 V 全部读一遍：
#
# $$
# \text{Bytes}_\text{layer} = \sum_s 2\, H_{kv}\, d\, b\, c_s \;(+\ \text{读 } q \text{、写输出的 } 2 H d b \text{，每条序列一次}),\qquad
# \text{FLOPs}_\text{layer} = \sum_s 4\, H\, d\, c_s ,
# $$
#
# 其中 $b$ 是每个元素的字节数，FLOPs 的 4 是 $QK^\top$ 与 $PV$ 各一次乘加（2 FLOPs）。于是**算术强度**
#
# $$
# I = \frac{4 H d}{2 H_{kv} d\, b} = \frac{2G}{b}\ \text{FLOP/Byte},\qquad G = H / H_{kv},
# $$
#
# 与批大小、上下文长度都无关——解码注意力不能靠“凑批”变成算力受限：每条序列读的是自己的 KV。这与权重矩阵乘法（GEMM）不同，
# 后者的权重被批里的所有 Token 共用（第 2 章）。minibatch 的代价模型（`minibatch/sim/cost_model.py`）里解码注意力用的正是这个公式：

# %%
cm_src = inspect.getsource(make_cost_model("llama-3-8b", "h100").breakdown).splitlines()
i = next(k for k, line in enumerate(cm_src) if "if decode_context_lens:" in line)
print("\n".join(cm_src[i:i + 4]))

GPUS = ["a10", "l4", "a100-80g", "h100", "h200"]
MODELS = {"llama-2-7b": "MHA", "llama-3-8b": "GQA", "qwen2.5-7b": "GQA"}
intensity = {}
for name in MODELS:
    m = get_model_spec(name)
    g = m.num_heads // m.num_kv_heads
    intensity[name] = dict(G=g, useful=2 * g / m.dtype_bytes,
                           executed=2 * max(16, triton.next_power_of_2(g)) / m.dtype_bytes)   # BLOCK_G rows computed
ridge = {gpu: get_hardware(gpu).ridge_point for gpu in GPUS}
md_table(["model", "G = H / H_kv", "intensity 2G/b (FLOP/B)", "executed with BLOCK_G = max(16, G)"],
         [[n, v["G"], f"{v['useful']:.0f}", f"{v['executed']:.0f}"] for n, v in intensity.items()])

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
xs = np.logspace(-0.5, 3.5, 200)
for gpu, color in zip(GPUS, plt.cm.viridis(np.linspace(0, 0.9, len(GPUS)))):
    hw = get_hardware(gpu)
    ax.plot(xs, np.minimum(hw.effective_flops, xs * hw.effective_bandwidth) / 1e12, color=color,
            label=f"{gpu}: {hw.effective_bandwidth / 1e9:.0f} GB/s, ridge {hw.ridge_point:.0f}")
for (name, v), marker in zip(intensity.items(), ("o", "s", "^")):
    for key, fill in (("useful", "k"), ("executed", "none")):
        ax.axvline(v[key], color="0.5", lw=0.5, ls=":")
        ax.plot([v[key]], [v[key] * get_hardware("h100").effective_bandwidth / 1e12], marker, mfc=fill, mec="k",
                label=f"{name} decode attention ({key})" if key == "useful" else None)
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable TFLOP/s (effective)",
       title="Roofline (minibatch/sim/hardware.py, effective peaks); markers on the H100 roof")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=6.5, loc="lower right")
plt.show()
assert all(v["executed"] < min(ridge.values()) for v in intensity.values()), "the prose says even padded decode is memory-bound"

# %% [markdown]
# Llama-3-8B（$G$ = {{intensity["llama-3-8b"]["G"]}}，bf16）的解码注意力只有 {{intensity["llama-3-8b"]["useful"]:.0f}} FLOP/Byte；
# MHA 的 Llama-2-7B 只有 {{intensity["llama-2-7b"]["useful"]:.0f}}。而脊点（Ridge Point，`HardwareSpec.ridge_point`，按可达效率算）
# 最低的 GPU 也有 {{min(ridge.values()):.0f}}（{{min(ridge, key=ridge.get)}}），最高 {{max(ridge.values()):.0f}}（{{max(ridge, key=ridge.get)}}）。
# 即使算上 `tl.dot` 把一组查询头补到 16 行之后**实际执行**的运算（图中空心标记：Llama-3-8B 为 {{intensity["llama-3-8b"]["executed"]:.0f}} FLOP/Byte），
# 也远在脊点左边：补出来的行浪费的是本来就闲着的算力，不多读一个字节。这回答了 L05 结尾的思考题。
#
# 既然访存受限，解码注意力的时间下限就是“读的字节 ÷ 可达带宽”。以 Llama-3-8B、16 条序列、每条 2048 Token 的上下文为例，
# 先检查这批 KV 在每种 GPU 上放得下（代价模型的 `kv_capacity_tokens`：显存 × 0.9 − 权重 − 预留），再用代价模型的 `breakdown` 拆出
# 一个解码步里注意力与 GEMM（读权重）各占多少：

# %% tags=["nbval-check-output"]
BATCH, CTX = 16, 2048
rows, attn_share, attn_us = [], {}, {}
for gpu in GPUS:
    cm = make_cost_model("llama-3-8b", gpu)
    assert BATCH * CTX <= cm.kv_capacity_tokens(), f"{BATCH} x {CTX} tokens of KV must fit on {gpu}"
    parts = cm.breakdown([], [CTX] * BATCH)
    kv_bytes = spec8.num_layers * BATCH * CTX * 2 * spec8.num_kv_heads * spec8.head_dim * spec8.dtype_bytes
    hw = get_hardware(gpu)
    assert abs(parts["attention_decode"] - (kv_bytes + spec8.num_layers * BATCH * 2 * (spec8.num_heads + spec8.num_kv_heads)
                                             * spec8.head_dim * spec8.dtype_bytes) / hw.effective_bandwidth) < 1e-9, \
        "the cost model's decode attention is its bytes over the effective bandwidth (memory-bound)"
    attn_us[gpu] = parts["attention_decode"] * 1e6
    attn_share[gpu] = parts["attention_decode"] / (parts["attention_decode"] + parts["gemm"] + parts["lm_head"])
    rows.append([gpu, f"{hw.memory_bandwidth / 1e9:.0f}", f"{kv_bytes / 1e9:.2f}", f"{kv_bytes / hw.memory_bandwidth * 1e6:,.0f}",
                 f"{attn_us[gpu]:,.0f}", f"{attn_share[gpu]:.0%}"])
print(f"llama-3-8b, batch {BATCH} x context {CTX}: {kv_bytes / 1e9:.2f} GB of K/V read per decode step (32 layers)")
md_table(["GPU", "peak GB/s", "KV GB/step", "us at peak", "us at effective (model)", "attention share of the step"], rows)

# %% tags=["check"]
assert max(attn_share.values()) - min(attn_share.values()) < 0.01, "the prose says the share is the same on every GPU"

# %% [markdown]
# 这批请求每个解码步要读 {{kv_bytes / 1e9:.2f}} GB 的 K/V。在 H100 上按数据手册的峰值带宽至少要 {{kv_bytes / get_hardware("h100").memory_bandwidth * 1e6:,.0f}} µs，
# 按 minibatch 假设的可达带宽（峰值 × {{get_hardware("h100").bandwidth_efficiency}}）是 {{attn_us["h100"]:,.0f}} µs，
# 约占整个解码步（不含每步的固定开销）的 {{attn_share["h100"]:.0%}}。五种 GPU 上这个份额都一样：批只有 {{BATCH}} 时，读权重的 GEMM
# 也是访存受限的，两部分都按“字节 ÷ 带宽”计时，比值只剩字节之比（KV {{kv_bytes / 1e9:.2f}} GB 对权重 {{spec8.weight_bytes / 1e9:.1f}} GB）。
# 上下文越长、批越大，注意力的份额越高，
# 而它的下限只由字节数决定——这就是 GQA、KV 量化（FP8）、前缀共享这些“少读 KV”的办法有用的原因。
#
# **实测带宽**（Achieved Bandwidth）= 内核读的字节 ÷ 实测时间；与峰值之比就是带宽利用率（MBU）。同样的量法在 CPU 上也能做：
# 下面测引擎在 CPU 上默认的 C 解码内核（`minibatch/kernels/cpu_paged.c`），形状取 tiny 模型的一层（4 个 KV 头、`head_dim` 32、fp32），
# 16 条序列 × 4096 Token 的上下文，KV 共 {{16 * 4096 * 2 * 4 * 32 * 4 / 2**20:.0f}} MiB（若 CPU 的末级缓存比这还大，量到的多半是缓存带宽）。
# 这是墙钟时间，随机器负载变化（输出不做比对）；`minibatch.sim.hardware` 里的 `cpu` 只是一个笼统的估计（不是数据手册），所以只作量级参照。

# %% tags=["nbval-ignore-output"]
def measure_cpu_decode(batch=16, context=4096, kv_heads=4, heads=8, head_dim=32, repeats=5):
    """Median seconds and K/V bytes of the C decode kernel on one fp32 layer (the engine's CPU path)."""
    c = paged_case([context] * batch, block_size=16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, spare=0)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        cpu_paged.paged_decode_attention_c(*c)
        times.append(time.perf_counter() - t)
    return statistics.median(times), batch * context * 2 * kv_heads * head_dim * 4


if cpu_paged.available():
    secs, nbytes = measure_cpu_decode()
    cpu_hw = get_hardware("cpu")
    print(f"C decode kernel: {nbytes / 2**20:.0f} MiB of K/V in {secs * 1e3:.1f} ms -> {nbytes / secs / 1e9:.1f} GB/s achieved "
          f"(the generic 'cpu' spec assumes {cpu_hw.effective_bandwidth / 1e9:.0f} GB/s effective)")
else:
    print("the C kernels are not available here (no C compiler):", cpu_paged.build_error)

# %% [markdown]
# ## 17.6 在 GPU 上：编译后的内核与实测带宽
#
# 下面的单元格只在 `torch.cuda.is_available()` 时运行。它在一个**子进程**里（不设 `TRITON_INTERPRET`，内核真正编译到 GPU 上）
# 计时引擎自己的内核，形状取 Llama-3-8B 的一层（bf16）：
#
# 1. 解码：批 64 × 4096 Token 与批 1 × 32768 Token，不拆分与 Split-KV 各一次；
# 2. 在批 64 × 4096 上扫 页大小 ∈ {16, 32} × `BLOCK_N` ∈ {32, 64, 128} × `num_warps` ∈ {4, 8} × `num_stages` ∈ {2, 3}；
# 3. KV 写入：一次 8192 个 Token 的预填充写入。
#
# 每个时间是 CUDA 事件计时的中位数，每次计时前写 256 MiB 冲掉 L2 缓存（与 `benchmarks/gpu_kernels.py` 相同；脚本是 `benchmarks/triton_gpu_sweep.py`）。
# 打印实测 GB/s，以及它占 `minibatch/sim/hardware.py` 里这块 GPU 峰值带宽的比例。没有 GPU 时只打印一句说明，**不报告任何 GPU 数字**。

# %%
SWEEP = dict(block_size=[16, 32], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3])
GPU_BENCH = (Path(minibatch.__file__).resolve().parents[1] / "benchmarks" / "triton_gpu_sweep.py").read_text(encoding="utf-8")

# %%
def hardware_for(device_name):
    """The minibatch.sim.hardware entry of a CUDA device name, or None if it has none."""
    table = [(r"H200", "h200"), (r"H100", "h100"), (r"A100.*80GB", "a100-80g"), (r"A100", "a100-40g"),
             (r"RTX 4090", "rtx4090"), (r"\bL4\b", "l4"), (r"\bA10\b", "a10")]
    return next((get_hardware(key) for pattern, key in table if re.search(pattern, device_name)), None)


if torch.cuda.is_available():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}      # compiled, not interpreted
    try:
        proc = subprocess.run([sys.executable, "-c", GPU_BENCH,
                               json.dumps(dict(device="cuda", dtype="bfloat16", scale=1.0, iters=20, sweep=SWEEP,
                                               heads=[spec8.num_heads, spec8.num_kv_heads, spec8.head_dim]))],
                              env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], returncode=-1, stdout="", stderr="timed out after 240 s")
    if proc.returncode != 0:
        print("the GPU benchmark failed:\n", proc.stderr[-3000:])
    else:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        hw = hardware_for(res["gpu"])
        peak = hw.memory_bandwidth if hw else None
        print(f"{res['gpu']}; peak {peak / 1e9:.0f} GB/s ({hw.name}, minibatch/sim/hardware.py)" if hw
              else f"{res['gpu']}: not in minibatch/sim/hardware.py, no peak to compare with")
        good = [r for r in res["rows"] if "s" in r]
        for r in good:
            r["gbps"] = r["bytes"] / r["s"] / 1e9
        for r in good:
            if r["kind"] != "sweep":
                what = (f"decode batch {r['batch']} x {r['ctx']}, {'split-KV' if r['split'] else 'one pass'}"
                        if r["kind"] == "decode" else f"store_kv of {r['tokens']} tokens")
                share = f" = {r['gbps'] * 1e9 / peak:.0%} of peak" if peak else ""
                print(f"{what}: {r['s'] * 1e6:.1f} us, {r['gbps']:.0f} GB/s{share}")
        sweep_rows = sorted((r for r in good if r["kind"] == "sweep"), key=lambda r: -r["gbps"])
        for r in sweep_rows[:5] + sweep_rows[5:][-2:]:           # the five fastest and the two slowest
            print(f"sweep: block_size {r['block_size']}, BLOCK_N {r['block_n']}, warps {r['num_warps']}, "
                  f"stages {r['num_stages']}: {r['gbps']:.0f} GB/s")
        failed = [r for r in res["rows"] if "error" in r]
        print(f"{len(failed)} sweep configurations failed to compile or run" + (f", e.g. {failed[0]['error']}" if failed else ""))
else:
    print("no GPU (torch.cuda.is_available() is False): the compiled-kernel benchmark was not run, "
          "and this notebook reports no GPU figure")

# %% [markdown]
# 这个脚本本身也要测试：它可以在 CPU 上、在解释器里用很小的形状跑一遍（`device="cpu"`、`dtype="float16"`、
# `scale` 取 1/64、头数与 `head_dim` 取小的 4/2/16、扫描每个旋钮只取一个值），只检查它能跑完、每一行都有结果——不看数字（解释器的时间毫无意义）。
# 这样 GPU 单元格不至于在第一次见到 GPU 时才暴露拼写错误；CUDA 事件计时那几行只有在 GPU 上才会执行：

# %%
smoke_cfg = dict(device="cpu", dtype="float16", scale=1 / 64, iters=1, heads=[4, 2, 16],
                 sweep={key: values[:1] for key, values in SWEEP.items()})     # one point of each sweep axis
smoke = subprocess.run([sys.executable, "-c", GPU_BENCH, json.dumps(smoke_cfg)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
assert smoke.returncode == 0, f"the benchmark script fails on CPU:\n{smoke.stderr[-2000:]}"
smoke_rows = json.loads(smoke.stdout.strip().splitlines()[-1])["rows"]
smoke_errors = [r for r in smoke_rows if "error" in r]
print(f"smoke test: {len(smoke_rows)} rows ({sum(r['kind'] == 'sweep' for r in smoke_rows)} sweep points), "
      f"{len(smoke_errors)} errors")
assert not smoke_errors and all("s" in r for r in smoke_rows), "every benchmark row ran in the interpreter"

# %% [markdown]
# ## 17.7 测试策略
#
# 一个内核要交给引擎，minibatch 的做法分几层（测试都在 `tests/kernel_tests/`）：
#
# 1. **参考实现优先**：每个 Triton 内核都有一个直白的 torch 版本（`minibatch/kernels/reference.py`），它是所有测试的“真值”，
#    也是 17.1 节三种后端之一的基础；
# 2. **同一套测试，两种运行方式**：`tests/kernel_tests/conftest.py` 在没有 GPU 时设置 `TRITON_INTERPRET=1`，测试在解释器里跑；
#    有 GPU 时同样的测试跑编译后的内核。bf16 只能在 GPU 上测（解释器算 bf16 的 `tl.dot` 是错的，minibatch 直接拒绝），
#    这些测试标记为 `gpu`（`tests/kernel_tests/test_gpu.py`），没有 GPU 时跳过——跳过不等于通过，报告里要写明；
# 3. **毒化缓存**（Poisoned Cache）：把不属于任何上下文的槽位都填成 NaN（未用的块、每条序列末块里没写满的部分）。内核只要多读一个槽位，
#    输出就变成 NaN——哪怕它随后用权重 0 去乘：$0 \times \text{NaN} = \text{NaN}$，而 $0 \times$ 随机数 $= 0$ 会把这个错误藏起来；
# 4. **边界长度与填充**：上下文取 1、$B-1$、$B$、$B+1$、$3B+5$，块表在序列末尾之后填 `-1`、`0` 或 $10^6$；
# 5. **属性测试**：`hypothesis` 在形状空间里挑用例（`tests/kernel_tests/test_prefill.py`），17.2 节已用在写入内核上；
# 6. **端到端**：真实模型在各后端上的贪心输出逐 Token 相同（17.1 节），并与 Hugging Face `transformers` 的 `generate` 相同（`tests/test_correctness.py`）。
#
# 下面把第 3、5 层合在一起用在解码内核上：形状（页大小、GQA 组大小、`head_dim` 含 80、上下文含 0）、是否拆分、分区大小都由 `hypothesis` 挑，
# 缓存先毒化，再与参考实现比较：

# %%
def poisoned(k_cache, v_cache, tables, lens):
    """Copies of the caches with NaN in every slot outside every context."""
    block_size = k_cache.shape[1]
    used = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        used[tables[s, t // block_size].long() * block_size + t % block_size] = True
    unused = ~used.view(k_cache.shape[:2])
    k, v = k_cache.clone(), v_cache.clone()
    k[unused], v[unused] = float("nan"), float("nan")
    return k, v


decode_examples = []


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(lens=st.lists(st.integers(0, 90), min_size=1, max_size=3), block_size=st.sampled_from([1, 4, 16]),
       kv_heads=st.integers(1, 2), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([16, 32, 80]),
       split=st.booleans(), partition=st.sampled_from([32, 64]), seed=st.integers(0, 10_000))
def decode_property(lens, block_size, kv_heads, group, head_dim, split, partition, seed):
    q, kc, vc, tables, cl = paged_case(lens, block_size, kv_heads * group, kv_heads, head_dim, seed)
    expected = paged_decode_attention_ref(q, kc, vc, tables, cl)
    expected[cl == 0] = 0.0                                  # an empty context attends to nothing
    kp, vp = poisoned(kc, vc, tables, cl)
    out = triton_decode.paged_decode_attention(q, kp, vp, tables, cl, split_kv=split,
                                               partition_size=partition if split else None)
    assert not out.isnan().any(), f"a slot outside a context was read: lens {lens}, block {block_size}"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    decode_examples.append((tuple(lens), block_size, group, head_dim, split))


decode_property()
print(f"{len(decode_examples)} decode cases on poisoned caches, all equal to the reference")
print("e.g.", decode_examples[:3])
assert len(decode_examples) >= 8 and any(0 in lens for lens, *_ in decode_examples), "an empty context was covered"

# %% [markdown]
# 毒化的威力在于它让“读了不该读的数据”变成一个响亮的失败。给内核一个比真实上下文长 1 的 `context_lens`——这正是一个差一（Off-by-one）的
# 调用方错误——干净的随机缓存上只会得到一个“数值不同”的结果，毒化的缓存上则直接是 NaN：

# %% tags=["nbval-check-output"]
q, kc, vc, tables, cl = paged_case([13, 40], block_size=16, seed=3)
kp, vp = poisoned(kc, vc, tables, cl)
clean = triton_decode.paged_decode_attention(q, kp, vp, tables, cl)
off_by_one = triton_decode.paged_decode_attention(q, kp, vp, tables, cl + 1)
print("correct lengths on the poisoned cache: NaN in output:", bool(clean.isnan().any()))
print("lengths + 1 on the poisoned cache:      NaN rows per sequence:", off_by_one.isnan().any(dim=-1).sum(dim=-1).tolist())
assert not clean.isnan().any() and off_by_one.isnan().all(), "the prose says the off-by-one read shows up as NaN"

# %% [markdown]
# ## 17.8 动手：字节模型的旋钮
#
# 下面的控件在代价模型上算一个解码步：选模型与 GPU，拖动批大小与上下文长度，看注意力读多少 KV、占一步的多少时间
# （放不下的配置直接报出，不画）。试试：把上下文从 1k 拉到 32k，注意力的份额怎样变化；从 Llama-2-7B（MHA）换到 Llama-3-8B（GQA），同样的批读的字节少几倍。

# %% tags=["nbval-ignore-output"]
def decode_step_explorer(model="llama-3-8b", gpu="h100", batch=16, context=2048):
    cm = make_cost_model(model, gpu)
    cap = cm.kv_capacity_tokens()
    if batch * context > cap:
        print(f"{batch} x {context} = {batch * context:,} tokens of KV do not fit: {gpu} holds {cap:,} for {model}")
        return
    parts = cm.breakdown([], [context] * batch)
    m = get_model_spec(model)
    kv = m.num_layers * batch * context * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    fig, ax = plt.subplots(figsize=(6, 1.6))
    left = 0.0
    for key, color in (("gemm", "C0"), ("lm_head", "C2"), ("attention_decode", "C3"), ("overhead", "0.6")):
        ax.barh([0], [parts[key] * 1e3], left=left, color=color, label=key)
        left += parts[key] * 1e3
    ax.set(xlabel="ms per decode step (cost model)", yticks=[])
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, 1.6))
    plt.show()
    print(f"{model} on {gpu}: {kv / 1e9:.2f} GB of K/V per step; attention {parts['attention_decode'] * 1e3:.2f} ms of "
          f"{sum(parts.values()) * 1e3:.2f} ms ({parts['attention_decode'] / sum(parts.values()):.0%}); KV fits "
          f"{cap:,} tokens")


W.interact(decode_step_explorer, model=W.Dropdown(options=list(MODELS), value="llama-3-8b"),
           gpu=W.Dropdown(options=GPUS, value="h100"),
           batch=W.IntSlider(value=16, min=1, max=256, step=1, continuous_update=False),
           context=W.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384, 32768], value=2048,
                                     continuous_update=False));

# %% [markdown]
# ## 小结
#
# - 引擎用 `resolve_backend` 选定后端（CUDA 上 Triton，CPU 上 C 内核），每层先 `store_kv` 写下本步全部新 Token 的 K/V，
#   再把排在前面的解码行交给解码内核、其余行交给预填充内核；三个后端的贪心输出逐 Token 相同。
# - KV 写入是纯散射：一个程序一个 Token（minibatch，二维 Tile、按步长寻址），或按压平的一维 Tile 再切（vLLM v0.11.0）；
#   解码步里它只写 1 个 Token、读整段上下文，几乎不占时间。
# - Split-KV 的合并是精确的；分区数受归约 Tile 的限制（`MAX_PARTITIONS`），上下文太长时分区加倍；只在程序数不足一波时才拆。
# - 页大小与循环 Tile 是两回事；`BLOCK_N`、`num_warps`、`num_stages` 的默认值来自经验与 Triton 的默认值，要在 GPU 上扫描决定。
# - 解码注意力的算术强度是 $2G/b$，与批大小无关，远低于任何 GPU 的脊点：它的时间下限是“KV 字节 ÷ 带宽”，
#   实测带宽与峰值之比（MBU）是衡量内核的尺子。
# - 测试分层：参考实现、解释器与 GPU 同一套测试、毒化缓存、边界长度、属性测试、端到端的逐 Token 一致；没有 GPU 就不报告 GPU 数字。
#
# 下一章（第 18 章）离开内核，回到一个请求的出口：采样、停止条件与流式输出。
#
# ## 练习
#
# 1. **写入内核的带宽。** 一次 8192 Token 的预填充，Llama-3-8B 一层的 `store_kv` 读写多少字节？在 H100 的可达带宽下至少要多久？
#    与同一步的预填充注意力（代价模型 `breakdown([(8192, 8192)], [])["attention_prefill"] / 32`）比一比。
# 2. **教学内核的边界。** 17.2 节的 `store_kv_flat` 要求一个 Token 的 `[H_kv, d]` 行连续。把引擎里真实的 `key`（不连续的视图）直接传给它会怎样？
#    改写它，使它像包里的内核一样按步长寻址（提示：一维偏移要拆回 (头, 列) 两维）。
# 3. **分区与 SM。** 用 `split_partitions` 与 17.3 节的 `sm_share`，找出 H100 上批大小为 2、4、8 时，上下文多长才让拆分后的程序数超过一波（132）。
#    为什么 `choose_split` 不在程序数已经足够时再拆？
# 4. **MHA 与 GQA 的字节。** 在 17.8 节的控件里比较 Llama-2-7B 与 Llama-3-8B 在 A100-80G 上、批 16 × 4096 的注意力时间。差几倍？
#    用 $2 H_{kv} d b$ 解释；Llama-2-7B 这个批放得下吗？
# 5. **毒化的反例。** 把 17.7 节的毒化缓存换成普通的随机数（不填 NaN），再用 `context_lens + 1` 调用内核。输出与正确结果差多少？
#    为什么这类错误在随机数据上容易漏掉？
# 6. （有 GPU 时）运行 17.6 节的单元格，找出扫描里最快的配置，与 `_decode_config` 的默认值比较；再用 `.venv/bin/python benchmarks/gpu_kernels.py`
#    把 minibatch 的内核与 FlashInfer、flash-attn（若已安装）放在一张表里。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 读 $2 \cdot 8192 \cdot 8 \cdot 128 \cdot 2$ 字节（K 与 V，bf16）= 32 MiB，写同样多，共 64 MiB；H100 可达带宽约 {{get_hardware("h100").effective_bandwidth / 1e12:.2f}} TB/s，
#    约 {{2 * 2 * 8192 * 8 * 128 * 2 / get_hardware("h100").effective_bandwidth * 1e6:.0f}} µs。预填充注意力是算力受限的（每个新 Token 要对前面所有 Token 打分），时间大得多，所以预填充时写入也不是瓶颈。
# 2. `key.stride(1) != head_dim` 时断言失败；若去掉断言，一维偏移会读到 Q 或 V 的数据。按步长寻址：`h = offs // HEAD_DIM`、
#    `col = offs % HEAD_DIM`，地址为 `token * stride_t + h * stride_h + col`（缓存一侧同理）。
# 3. 程序数为 `batch × 8 × partitions`；批 2 时 8 个分区（4096 Token）就有 128 个程序，还差一点，9 个分区（4097–4608 Token）超过一波；
#    同理批 4 时上下文要超过 2048（5 个分区，160 个程序），批 8 时超过 1024（3 个分区，192 个程序）。程序数足够时每个 SM 都有活干，拆分只增加部分结果的读写与一次归约内核的启动。
# 4. Llama-2-7B 每 Token 每层读 $2 \cdot 32 \cdot 128 \cdot 2$ 字节，是 Llama-3-8B（8 个 KV 头）的 4 倍，注意力时间也是约 4 倍；
#    16 × 4096 = 65,536 个 Token 的 KV 在 A100-80G 上对 Llama-2-7B 是 32 GiB，放得下（控件会告诉你容量）。
# 5. 多读的是下一个块里的随机 K/V，它参与 Softmax，输出会偏一点，但仍是有限的数；只有与参考实现比较才能发现，而且误差可能落在容差之内。
#    NaN 不会被任何容差放过。
# 6. 以扫描结果为准；注意 `num_stages` 大、`BLOCK_N` 大时可能因共享内存不足而编译失败（单元格会数出失败的配置）。
#
# </details>
