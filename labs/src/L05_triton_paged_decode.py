# %% [markdown]
# # L05 · 用 Triton 写分页注意力解码内核（CPU 上用解释器运行）
#
# 对应章节：第 7 章《PagedAttention：分页 KV 与块管理器》7.5 节（另见第 17 章《Triton Kernel 实战》）。
#
# 第 7 章逐行读过 minibatch 的 Triton 分页解码内核 `minibatch/kernels/triton_decode.py`。本实验让你从零写出它：
# 解码（Decode）时每条序列只有 1 个新的查询 Token，它要读遍自己散落在各个物理块里的全部 K/V。
# 内核在 CPU 上用 Triton 解释器（Triton Interpreter，`TRITON_INTERPRET=1`）运行：它用 NumPy 逐个程序执行内核，
# 慢，但每一行都真的执行了，结果可以与 torch 参考实现逐元素对照。形状因此都很小（`head_dim` 16、块大小 4、
# 至多 40 个 Token），每个检查单元格几秒内跑完。
#
# 五个任务：
#
# 1. 按块表从分页缓存里取出一条序列的 K/V（第一个 Triton 内核）；
# 2. 一个程序算一个查询头：逐块遍历上下文，用在线 Softmax（Online Softmax）一次读完；
# 3. GQA 分组：一个程序算共享同一个 KV 头的全部查询头，每个 K/V 块只读一次；
# 4. 把新 Token 的 K/V 写进缓存（`store_kv`），再把你的两个内核插进 tiny 模型的解码：贪心输出必须与 torch 后端逐 Token 相同；
# 5. **进阶任务**：Split-KV（Flash-Decoding 的做法），把长上下文切成分区（Partition）分给多个程序，再合并部分结果。
#
# **学习目标**
#
# - 会写、会启动一个 Triton 内核：程序编号（`tl.program_id`）、网格（Grid）、向量化下标（`tl.arange`）、掩码（Mask）与步长（Stride）；
# - 掌握分页寻址 `slot = table[t // B] * B + t % B` 与在线 Softmax 的三个状态（运行最大值、运行分母、重新缩放的累加器）；
# - 理解 GQA 分组为什么能少读 KV，以及 Split-KV 在什么情况下值得（vLLM 的 paged_attention v1/v2 之分）。
#
# **怎么做**：任务单元格里是带签名的空内核，只改 `raise NotImplementedError` 那部分。完成后评分：
#
# ```bash
# python -m minibatch.labs check L05 labs/L05_triton_paged_decode.ipynb
# ```

# %%
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: every kernel below runs in the CPU interpreter

import contextlib
import inspect
import math
import random

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

import minibatch.kernels as mb_kernels
from minibatch import LLM, SamplingParams
from minibatch.kernels.reference import gather_kv, paged_decode_attention_ref, store_kv_ref
from minibatch.kernels.triton_decode import DEFAULT_PARTITION_SIZE, choose_split
from minibatch.sim.hardware import get_hardware
from minibatch.sim.model_specs import get_model_spec

torch.set_num_threads(1)
# Checked in the source of vLLM v0.11.0 (section 4 names the files).
VLLM = dict(partition_size=512, v1_max_seq_len=8192, v1_min_seqs_x_heads=512, block_size=16, segments=16)
print("triton", triton.__version__, "| interpreter:", os.environ["TRITON_INTERPRET"] == "1")

# %% [markdown]
# ## 1. 约定：缓存布局、块表与启动内核
#
# 与 minibatch 的引擎相同，K 缓存与 V 缓存的形状都是 `[num_blocks, block_size, num_kv_heads, head_dim]`。
# 序列 `s` 的第 `t` 个 Token 位于物理块 `block_tables[s, t // block_size]` 的第 `t % block_size` 个槽位；
# 把前两维压平成 `[num_blocks * block_size, num_kv_heads, head_dim]` 后，它的行号就是槽位（Slot）
#
# $$\text{slot}(t) = \text{table}[\lfloor t/B \rfloor]\cdot B + (t \bmod B).$$
#
# `random_paged` 造一个小的分页缓存：每条序列的块从打乱的物理块里取，块表按最长序列补齐（补 0，和引擎一样），
# 并且**所有不存放 Token 的槽位都填成 NaN**——未用的块、以及每条序列末块里写不满的部分。
# 内核只要读了不该读的槽位（掩码漏了），输出就会变成 NaN。
#
# Triton 内核用 `kernel[grid](...)` 启动：网格 `grid` 里每个下标是一个程序（Program，相当于 CUDA 的一个线程块），
# 内核里用 `tl.program_id(axis)` 知道自己是谁。解释器会把内核里抛出的异常包成 `InterpreterError`；
# 下面的 `launch` 把原来的异常取出来，报错直接指向你内核里的那一行。

# %%
def random_paged(seed, lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, spare_blocks=6):
    """q, K/V caches, block tables and context lens of a small random paged batch; empty slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for s, (n, nb) in enumerate(zip(lens, need)):
        table = [physical.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(table)
        for t in range(n):                                   # only the slots that hold a token get numbers
            k_cache[table[t // block_size], t % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[table[t // block_size], t % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32)


def launch(kernel, grid, *args, **constexprs):
    """``kernel[grid](*args, **constexprs)``, re-raising the error raised inside the kernel itself."""
    try:
        kernel[grid](*args, **constexprs)
    except InterpreterError as e:
        raise (e.__cause__ or e) from None


BLOCK_SIZE, HEAD_DIM = 4, 16
LENS = [1, 8, 13, 40]           # one token; a multiple of the block size; ending mid-block; the longest
q, k_cache, v_cache, block_tables, context_lens = random_paged(0, LENS)
print("k_cache", tuple(k_cache.shape), "| context_lens", context_lens.tolist())
print("block_tables\n", block_tables)

# %% [markdown]
# ## 任务 1 · 按块表取出一条序列的 K/V（gather）
#
# 写内核 `_gather_kernel`：把一条序列的前 `num_tokens` 个 Token 的 K（或 V）从分页缓存复制到连续张量
# `out[num_tokens, num_kv_heads, head_dim]`。网格是 `(num_tokens, num_kv_heads)`：程序 `(t, h)` 复制 Token `t` 在 KV 头 `h` 上的
# 一行 `head_dim` 个数。
#
# - 缓存已经压平成槽位：Token `t` 的这一行从 `cache_ptr + slot * stride_slot + h * stride_head` 开始，连续 `HEAD_DIM` 个元素；
# - 用 `tl.arange(0, BLOCK_D)` 生成列下标。Triton 的块尺寸必须是 2 的幂，所以 `BLOCK_D` 是 `HEAD_DIM` 向上取整到 2 的幂，
#   多出来的列用 `mask=offs_d < HEAD_DIM` 屏蔽（读、写都要）；
# - 块表里的物理块号用 `tl.load(table_ptr + i)` 读出。
#
# 检查单元格把结果与 `minibatch.kernels.reference.gather_kv`（先按块表取出整块，再压平、截断）逐元素比较。

# %% tags=["task:1"]
@triton.jit
def _gather_kernel(cache_ptr, table_ptr, out_ptr,
                   stride_slot, stride_head,           # cache viewed as [num_slots, num_kv_heads, head_dim]
                   stride_out_t, stride_out_h,         # out: [num_tokens, num_kv_heads, head_dim]
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_tokens, num_kv_heads): copy token t's row of KV head h out of the paged cache."""
    ### BEGIN SOLUTION
    t = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.load(table_ptr + t // BLOCK_SIZE)
    slot = block * BLOCK_SIZE + t % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row = tl.load(cache_ptr + slot * stride_slot + h * stride_head + offs_d, mask=mask_d)
    tl.store(out_ptr + t * stride_out_t + h * stride_out_h + offs_d, row, mask=mask_d)
    ### END SOLUTION

# %% [markdown]
# 启动它的包装函数（已给出）：注意块表的一行本身就是一个连续的 int32 张量，可以直接当指针传给内核。

# %%
def gather_kv_triton(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first ``num_tokens`` tokens of ``cache`` as ``[num_tokens, num_kv_heads, head_dim]``."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    out = cache.new_empty(num_tokens, num_kv_heads, head_dim)
    launch(_gather_kernel, (num_tokens, num_kv_heads), flat, block_table, out,
           flat.stride(0), flat.stride(1), out.stride(0), out.stride(1),
           HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(head_dim))
    return out

# %% tags=["check:1"]
for s, n in enumerate(LENS):
    for cache in (k_cache, v_cache):
        mine, ref = gather_kv_triton(cache, block_tables[s], n), gather_kv(cache, block_tables[s], n)
        assert not mine.isnan().any(), f"sequence {s} ({n} tokens): NaN in your copy, a slot outside the sequence was read"
        torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=lambda m: f"sequence {s} ({n} tokens): {m}")
odd = random_paged(1, [7, 3], num_kv_heads=3, head_dim=12, block_size=2)     # head_dim not a power of two
for s, n in enumerate([7, 3]):
    torch.testing.assert_close(gather_kv_triton(odd[1], odd[3][s], n), gather_kv(odd[1], odd[3][s], n), rtol=0, atol=0)
print(f"gathered {len(LENS)} sequences ({sum(LENS)} tokens) exactly as the reference; also head_dim 12, block size 2")

# %% tags=["check:1", "hidden"]
rng = random.Random(5050)
for trial in range(6):
    bs, d, kvh = rng.choice([1, 2, 4, 8]), rng.choice([4, 8, 16, 20]), rng.choice([1, 2, 3])
    lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 3))]
    _, kc, vc, bt, _ = random_paged(100 + trial, lens, num_heads=kvh, num_kv_heads=kvh, head_dim=d, block_size=bs)
    for s, n in enumerate(lens):
        torch.testing.assert_close(gather_kv_triton(vc, bt[s], n), gather_kv(vc, bt[s], n), rtol=0, atol=0,
                                   msg=lambda m: f"block_size {bs}, head_dim {d}, {kvh} KV heads, lens {lens}: {m}")
print("hidden: 6 random shapes gathered exactly")

# %% [markdown]
# ## 2. 在线 Softmax：逐块读一遍上下文
#
# 有了取数的办法，最直白的解码注意力是“先取出整段 K/V，再做 Softmax”——参考实现正是这样做的。但内核不该把全部分数存下来：
# 它逐块（每块 $B$ 个 Token）读 K/V，只保留三样状态（第 7 章 7.5 节 ③⑤）：运行最大值 $m$、运行分母 $l$、未归一化的输出 $\text{acc}$。
# 对新一块的分数 $s_j = q\cdot k_j / \sqrt{d}$：
#
# $$
# m' = \max(m, \max_j s_j),\quad \alpha = e^{m - m'},\quad
# l \leftarrow \alpha\, l + \sum_j e^{s_j - m'},\quad
# \text{acc} \leftarrow \alpha\,\text{acc} + \sum_j e^{s_j - m'}\, v_j,\quad m \leftarrow m',
# $$
#
# 读完最后一块，$\text{acc}/l$ 就是整段上下文上的 Softmax 加权和。下图用纯 torch 把这个循环在 {{LENS[-1]}} 个 Token 的序列、
# 第 0 个查询头上走一遍：左边是每个 Token 的分数与运行最大值，右边是“假如在第 $i$ 块停下，$\text{acc}/l$ 与最终输出差多少”。

# %%
s_demo, h_demo = len(LENS) - 1, 0
k_seq = gather_kv(k_cache, block_tables[s_demo], LENS[s_demo])[:, h_demo // 2]      # GQA: query head 0 reads KV head 0
v_seq = gather_kv(v_cache, block_tables[s_demo], LENS[s_demo])[:, h_demo // 2]
scores = k_seq @ q[s_demo, h_demo] / math.sqrt(HEAD_DIM)
final = torch.softmax(scores, 0) @ v_seq
m, l, acc = float("-inf"), 0.0, torch.zeros(HEAD_DIM)
running_max, gap = [], []
for start in range(0, LENS[s_demo], BLOCK_SIZE):
    s_j, v_j = scores[start:start + BLOCK_SIZE], v_seq[start:start + BLOCK_SIZE]
    m_new = max(m, s_j.max().item())
    alpha = math.exp(m - m_new)
    p = torch.exp(s_j - m_new)
    l, acc, m = l * alpha + p.sum().item(), acc * alpha + p @ v_j, m_new
    running_max.append(m)
    gap.append((acc / l - final).norm().item())
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 2.8))
ax1.plot(scores.numpy(), ".", label="score $s_t$")
edges = [min(i * BLOCK_SIZE, LENS[s_demo]) - 0.5 for i in range(len(running_max) + 1)]
ax1.stairs(running_max, edges, baseline=None, label="running max $m$ after each block")
ax1.set(xlabel="token t", title="scores and the running max, block by block")
ax1.legend(fontsize=7)
ax2.semilogy(range(1, len(gap) + 1), [max(g, 1e-8) for g in gap], "o-")
ax2.set(xlabel="blocks read", ylabel="|acc/l - o|", title="stop early and the output is wrong; read all and it is exact")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 任务 2 · 一个程序一个查询头（_decode_head_kernel）
#
# 写内核 `_decode_head_kernel`，网格 `(num_seqs, num_heads)`：程序 `(s, h)` 计算序列 `s`、查询头 `h` 的输出
# `out[s, h] = softmax(scale · q[s, h] · Kᵀ) V`，只用它的 `context_lens[s]` 个 Token。
#
# 1. 查询头 `h` 读 KV 头 `h // GROUP`（`GROUP = num_heads // num_kv_heads`，本任务的检查里既有 1 也有 2）；
# 2. 读入 `q[s, h]`（长 `HEAD_DIM`，补齐到 `BLOCK_D`）；状态 `m`、`l` 是 fp32 标量（`tl.full([], float("-inf"), tl.float32)`、
#    `tl.zeros([], tl.float32)`），`acc` 是长 `BLOCK_D` 的 fp32 向量；
# 3. 逐块循环：第 `i` 块的物理块号是 `tl.load(table_ptr + s * stride_bt_s + i)`，块内 `BLOCK_SIZE` 个槽位用 `tl.arange` 一次取出，
#    得到 `[BLOCK_SIZE, BLOCK_D]` 的 K 与 V 块；超出 `context_lens[s]` 的位置要屏蔽：分数置为 `-inf`，读 K/V 时也要带掩码
#    （那些槽位是 NaN，而 0 × NaN 仍是 NaN）；
# 4. 打分可以不用 `tl.dot`：`tl.sum(k * q[None, :], axis=1)`；按上面的公式更新 `m`、`l`、`acc`；最后写回 `acc / l`；
# 5. 长度为 0 的上下文（批里补齐的空行）一块也不读，`l` 仍是 0：写回 0，而不是 0/0 = NaN
#    （引擎自己的内核 `minibatch/kernels/triton_decode.py` 也这样约定）。
#
# `scale` 由包装函数传入，默认 $1/\sqrt{d}$。检查单元格用 `torch.testing.assert_close`（fp32 的默认容差）与
# `minibatch.kernels.reference.paged_decode_attention_ref` 比较，长度包括 1、块大小的整数倍和在块中间结束的序列。
#
# <details><summary>提示</summary>
#
# - 循环的次数 `tl.cdiv(ctx_len, BLOCK_SIZE)` 依赖运行时的值，用普通的 `for i in range(0, n_blocks):` 即可；
# - 每一块至少有一个有效 Token，所以 `m'` 总是有限的，不会出现 $e^{-\infty-(-\infty)}$；
# - 块号乘以步长之前转成 `tl.int64`（`.to(tl.int64)`），大缓存里 32 位的地址会溢出——解释器里不会出错，GPU 上会。
# </details>

# %% tags=["task:2"]
@triton.jit
def _decode_head_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                        stride_q_s, stride_q_h,                  # q, out: [num_seqs, num_heads, head_dim]
                        stride_k_b, stride_k_t, stride_k_h,      # caches: [num_blocks, block_size, num_kv_heads, head_dim]
                        stride_bt_s,                             # block_tables: [num_seqs, max_blocks]
                        stride_o_s, stride_o_h,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_seqs, num_heads): one query head of one sequence over its paged context."""
    ### BEGIN SOLUTION
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    ctx_len = tl.load(context_lens_ptr + seq)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_s + head * stride_q_h + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i in range(0, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt_s + i).to(tl.int64)
        mask_t = i * BLOCK_SIZE + offs_t < ctx_len
        offs = block * stride_k_b + offs_t[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :]
        mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(mask_t, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)                 # an empty context: zeros, not 0/0
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + offs_d, out, mask=mask_d)
    ### END SOLUTION

# %% [markdown]
# 包装函数（已给出）：它按引擎的调用约定接收参数，把张量的步长逐个传给内核——所以 `q` 不必连续（引擎里的 `q` 正是一个切片视图）。

# %%
def decode_per_head(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Paged decode attention with ``_decode_head_kernel``: ``[num_seqs, num_heads, head_dim]``."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    launch(_decode_head_kernel, (num_seqs, num_heads), q, k_cache, v_cache, block_tables, context_lens, out, scale,
           q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
           GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
           BLOCK_D=triton.next_power_of_2(head_dim))
    return out


def check_decode(fn, case, what, **kw):
    q, k_cache, v_cache, block_tables, context_lens = case
    mine = fn(q, k_cache, v_cache, block_tables, context_lens, **kw)
    # The reference gathers whole blocks and masks scores, so it would spread the NaN of empty slots: give it zeros.
    ref = paged_decode_attention_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), block_tables, context_lens,
                                     kw.get("scale"))
    ref[context_lens == 0] = 0.0                      # an empty context attends to nothing: a zero row
    assert mine.shape == ref.shape, f"{what}: shape {tuple(mine.shape)}, expected {tuple(ref.shape)}"
    bad = [s for s in range(len(context_lens)) if mine[s].isnan().any()]
    assert not bad, f"{what}: NaN for the sequences of length {[int(context_lens[s]) for s in bad]} " \
                    "(a masked-off slot was read, or 0/0)"
    torch.testing.assert_close(mine, ref, msg=lambda m: f"{what}, lens {context_lens.tolist()}: {m}")
    return (mine - ref).abs().max().item()

# %% tags=["check:2"]
errs = [check_decode(decode_per_head, (q, k_cache, v_cache, block_tables, context_lens), "GQA, group 2")]
errs.append(check_decode(decode_per_head, random_paged(2, LENS, num_heads=2, num_kv_heads=2), "MHA (group 1)"))
errs.append(check_decode(decode_per_head, random_paged(3, [5, 16]), "scale 0.5", scale=0.5))
errs.append(check_decode(decode_per_head, random_paged(7, [0, 6, 0]), "context 0 (padded rows)"))
assert max(errs) < 1e-5
print(f"matches paged_decode_attention_ref on lens {LENS} (GQA and MHA), with scale 0.5, and gives zeros "
      f"for empty contexts; max |error| < 1e-5")

# %% tags=["check:2", "hidden"]
rng = random.Random(2050)
for trial in range(6):
    kvh, g = rng.choice([1, 2]), rng.choice([1, 2, 3])
    bs, d = rng.choice([1, 2, 4, 8]), rng.choice([8, 12, 16, 32])
    lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
    check_decode(decode_per_head, random_paged(200 + trial, lens, kvh * g, kvh, d, bs),
                 f"hidden: {kvh * g} heads, {kvh} KV heads, head_dim {d}, block_size {bs}")
print("hidden: 6 random shapes match the reference")

# %% [markdown]
# ## 3. 解码读多少字节
#
# 解码一步，每条序列的每个上下文 Token 都要从显存读一遍 K 和 V：每层 $2 \cdot H_{kv} \cdot d \cdot$ 每元素字节数。
# 每读一个字节只做约 1 次乘加，解码注意力是访存受限（Memory-bound）的（第 2 章的屋顶线模型）。GQA 让 $G$ 个查询头共享一个 KV 头，
# 缓存因此小 $G$ 倍——但只有内核真的“一个 KV 块读一次、给 $G$ 个头用”，读的字节才跟着少 $G$ 倍。
# 任务 2 的内核一个程序只算一个头，同一个 K/V 块被同组的 $G$ 个程序各读一遍（GPU 的 L2 缓存能接住一部分，但不保证）。
# 以 Llama-3-8B（bf16）为例，每个上下文 Token 每层读的字节数：

# %%
spec = get_model_spec("llama-3-8b")
group = spec.num_heads // spec.num_kv_heads
per_token = 2 * spec.num_kv_heads * spec.head_dim * 2                         # K and V, bf16, one layer
print(f"llama-3-8b: {spec.num_heads} query heads, {spec.num_kv_heads} KV heads (G = {group}), head_dim {spec.head_dim}")
print(f"KV read per context token per layer: {per_token} B once per group (task 3), "
      f"{per_token * group} B once per query head (task 2)")
print(f"one sequence of 4096 tokens, all {spec.num_layers} layers: {per_token * 4096 * spec.num_layers / 2**20:.0f} MiB "
      f"vs {per_token * group * 4096 * spec.num_layers / 2**20:.0f} MiB a decode step")

# %% [markdown]
# ## 任务 3 · GQA 分组：一个程序算一组查询头（_decode_group_kernel）
#
# 写内核 `_decode_group_kernel`，网格 `(num_seqs, num_kv_heads)`：程序 `(s, g)` 一次算出共享 KV 头 `g` 的全部 `GROUP` 个查询头
# `g * GROUP … g * GROUP + GROUP - 1`（第 7 章读过的引擎内核就是这样组织的）。与任务 2 相比：
#
# - 查询是一个 `[BLOCK_G, BLOCK_D]` 的块（`BLOCK_G` 是 `GROUP` 向上取整到 2 的幂，多出的行用掩码屏蔽，不写回）；
# - `m`、`l` 变成长 `BLOCK_G` 的向量，`acc` 是 `[BLOCK_G, BLOCK_D]`；
# - 每个 K/V 块只读一次，分数是 `[BLOCK_G, BLOCK_SIZE]`：`tl.sum(q[:, None, :] * k[None, :, :], axis=2)`，
#   加权和同理 `tl.sum(p[:, :, None] * v[None, :, :], axis=1)`。
#
# （引擎的内核把这两步写成 `tl.dot`，在 GPU 上走 Tensor Core；`tl.dot` 要求每维至少 16，所以它把 `BLOCK_G` 补到 16。
# 这里的形状很小，用广播求和即可，结果相同。）检查覆盖 $G$ = 2、4、MQA（只有 1 个 KV 头）与长度为 0 的上下文。
#
# <details><summary>提示</summary>
#
# - 从任务 2 的内核出发：把每个“标量”状态加一维 `BLOCK_G`，`tl.max(s, axis=1)`、`tl.sum(p, axis=1)` 沿 Token 维归约；
# - 缩放 `acc` 时 `alpha` 要广播到列：`acc * alpha[:, None]`；
# - 补齐出来的查询行读成 0，它们的分数全是 0、输出也有限，只要写回时带上 `mask_g` 就不会越界。
# </details>

# %% tags=["task:3"]
@triton.jit
def _decode_group_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                         stride_q_s, stride_q_h,
                         stride_k_b, stride_k_t, stride_k_h,
                         stride_bt_s,
                         stride_o_s, stride_o_h,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_seqs, num_kv_heads): all GROUP query heads of one KV head, each K/V block read once."""
    ### BEGIN SOLUTION
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_d = offs_d < HEAD_DIM
    mask_q = (offs_g < GROUP)[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :], mask=mask_q,
                other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(0, tl.cdiv(ctx_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt_s + i).to(tl.int64)
        mask_t = i * BLOCK_SIZE + offs_t < ctx_len
        offs = block * stride_k_b + offs_t[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :]
        mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale            # [BLOCK_G, BLOCK_SIZE]
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    tl.store(out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :], acc / tl.where(l > 0, l, 1.0)[:, None],
             mask=mask_q)
    ### END SOLUTION

# %%
def decode_grouped(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Paged decode attention with ``_decode_group_kernel``: one program per (sequence, KV head)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    launch(_decode_group_kernel, (num_seqs, num_kv_heads), q, k_cache, v_cache, block_tables, context_lens, out, scale,
           q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
           GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=triton.next_power_of_2(group),
           BLOCK_D=triton.next_power_of_2(head_dim))
    return out

# %% tags=["check:3"]
errs = [check_decode(decode_grouped, (q, k_cache, v_cache, block_tables, context_lens), "GQA, group 2")]
errs.append(check_decode(decode_grouped, random_paged(4, LENS, num_heads=8, num_kv_heads=2), "GQA, group 4"))
errs.append(check_decode(decode_grouped, random_paged(5, [3, 21], num_heads=4, num_kv_heads=1), "MQA (1 KV head)"))
errs.append(check_decode(decode_grouped, random_paged(6, [9, 2, 30], num_heads=6, num_kv_heads=2, head_dim=24),
                         "group 3, head_dim 24 (both padded)"))
errs.append(check_decode(decode_grouped, random_paged(8, [0, 11], num_heads=4, num_kv_heads=2), "context 0 (padded row)"))
assert max(errs) < 1e-5
print(f"one program per (sequence, KV head) matches the reference for G = 2, 4, MQA and a padded group of 3; "
      f"max |error| < 1e-5")

# %% tags=["check:3", "hidden"]
rng = random.Random(3050)
for trial in range(6):
    kvh, g = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4, 8])
    bs, d = rng.choice([1, 2, 4, 8]), rng.choice([8, 12, 16, 32])
    lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
    check_decode(decode_grouped, random_paged(300 + trial, lens, kvh * g, kvh, d, bs),
                 f"hidden: {kvh * g} heads, {kvh} KV heads, head_dim {d}, block_size {bs}")
print("hidden: 6 random shapes match the reference")

# %% [markdown]
# ## 任务 4 · 写入新 Token 的 K/V（_store_kv_kernel），插进引擎
#
# 引擎的每一层在做注意力之前，先把本步新 Token 的 K/V 写进缓存：Token `i` 写到槽位 `slot_mapping[i]`
# （执行器按 $\text{table}[\lfloor p/B \rfloor]\cdot B + p \bmod B$ 算好，第 7 章 7.2 节）；槽位为 `-1` 的 Token 不写。
# 这正是任务 1 的反方向。写内核 `_store_kv_kernel`，网格 `(num_tokens, num_kv_heads)`：程序 `(i, h)` 把 `key[i, h]` 与 `value[i, h]`
# 两行写到压平的缓存 `[num_slots, num_kv_heads, head_dim]` 的第 `slot_mapping[i]` 行。
#
# 然后检查单元格用 `engine_kernels(store, decode)`（下面已给出）把你的 `store_kv_triton` 和任务 3 的 `decode_grouped`
# 换进引擎：模型每一层调用的 `minibatch.kernels.store_kv` 与 `minibatch.kernels.paged_decode_attention` 在 `with` 块内
# 指向你的函数（预填充的注意力仍走 torch）。真实的 tiny 模型在几条提示上贪心生成，
# 必须与纯 torch 后端（`attention_backend="torch"`）**逐 Token** 相同。
#
# <details><summary>提示</summary>
#
# - `key`、`value` 在引擎里是切片视图，不连续：用包装函数传入的步长 `stride_key_t`、`stride_key_h`（最后一维步长为 1）；
# - 槽位为 `-1` 时可以 `return`，也可以把它并进写入的掩码：`mask = (offs_d < HEAD_DIM) & (slot >= 0)`；
# - 槽位乘以步长之前转成 `tl.int64`。
# </details>

# %% tags=["task:4"]
@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_key_t, stride_key_h,           # key, value: [num_tokens, num_kv_heads, head_dim]
                     stride_val_t, stride_val_h,
                     stride_slot, stride_head,             # caches viewed as [num_slots, num_kv_heads, head_dim]
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_tokens, num_kv_heads): write token i's K and V rows of KV head h into slot slot_mapping[i]."""
    ### BEGIN SOLUTION
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k = tl.load(key_ptr + i * stride_key_t + h * stride_key_h + offs_d, mask=mask_d)
    v = tl.load(value_ptr + i * stride_val_t + h * stride_val_h + offs_d, mask=mask_d)
    dst = slot * stride_slot + h * stride_head + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask_d)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask_d)
    ### END SOLUTION

# %%
def store_kv_triton(key, value, k_cache, v_cache, slot_mapping):
    """Write ``key[i]``/``value[i]`` (``[num_tokens, num_kv_heads, head_dim]``) into flat slot ``slot_mapping[i]``."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_flat.stride() == v_flat.stride()
    if key.shape[0] == 0:
        return
    launch(_store_kv_kernel, (key.shape[0], num_kv_heads), key, value, k_flat, v_flat, slot_mapping,
           key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_flat.stride(0), k_flat.stride(1),
           HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


@contextlib.contextmanager
def engine_kernels(store, decode):
    """Inside the block, every layer of the model stores K/V with ``store`` and runs decode attention with ``decode``."""
    saved = mb_kernels.store_kv, mb_kernels.paged_decode_attention
    calls = {"store_kv": 0, "decode": 0}

    def store_hook(key, value, k_cache, v_cache, slot_mapping, backend=None):
        calls["store_kv"] += 1
        store(key, value, k_cache, v_cache, slot_mapping)

    def decode_hook(q, k_cache, v_cache, block_tables, context_lens, scale=None, backend=None):
        calls["decode"] += 1
        return decode(q, k_cache, v_cache, block_tables, context_lens, scale)

    mb_kernels.store_kv, mb_kernels.paged_decode_attention = store_hook, decode_hook
    try:
        yield calls
    finally:
        mb_kernels.store_kv, mb_kernels.paged_decode_attention = saved


PROMPTS = ["The paged cache", "Once upon a time", "Triton kernels run in the interpreter on a CPU"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TINY = dict(model="tiny", attention_backend="torch", block_size=BLOCK_SIZE, num_kv_blocks=64)
tiny = LLM(**TINY)
mc = tiny.engine.executor.model_config
TINY_HEADS = f"{mc.num_layers} 层，{mc.num_heads} 个查询头、{mc.num_kv_heads} 个 KV 头，head_dim {mc.head_dim}"
torch_outputs = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, GREEDY)]
print("torch backend, greedy:", torch_outputs)

# %% [markdown]
# tiny 模型：{{TINY_HEADS}}，块大小 {{BLOCK_SIZE}}。它的 GQA 组大小是 {{mc.num_heads // mc.num_kv_heads}}，
# 所以你的 `decode_grouped` 在每层启动 `num_seqs × {{mc.num_kv_heads}}` 个程序；
# {{len(PROMPTS)}} 条提示各生成 {{GREEDY.max_tokens}} 个 Token。

# %% tags=["check:4", "needs:3"]
# Unit check first: slots anywhere in the pool, -1 skipped, non-contiguous key/value (as in the engine).
gen = torch.Generator().manual_seed(4)
shape = (10, BLOCK_SIZE, 2, HEAD_DIM)
kc, vc = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
kv = torch.randn(7, 3, 2, HEAD_DIM, generator=gen)              # [tokens, (q, k, v), kv heads, d]: k, v are views
key, value = kv[:, 1], kv[:, 2]
slots = torch.tensor([5, 39, -1, 0, 17, -1, 22], dtype=torch.int64)
ref_k, ref_v = kc.clone(), vc.clone()
store_kv_ref(key, value, ref_k, ref_v, slots)
store_kv_triton(key, value, kc, vc, slots)
assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), \
    "the caches differ from store_kv_ref (slot -1 must be skipped; key/value are not contiguous)"

with engine_kernels(store_kv_triton, decode_grouped) as calls:
    mine = [o.outputs[0].token_ids for o in LLM(**TINY).generate(PROMPTS, GREEDY)]
assert calls["decode"] > 0 and calls["store_kv"] > 0, f"your kernels were not called: {calls}"
for p, a, b in zip(PROMPTS, mine, torch_outputs):
    assert a == b, f"{p!r}: your kernels generate {a}, the torch backend {b}"
print(f"tiny model with your store_kv and decode kernels: {calls['store_kv']} store calls, {calls['decode']} "
      f"decode calls; greedy outputs identical to the torch backend on {len(PROMPTS)} prompts")

# %% tags=["check:4", "hidden"]
rng = random.Random(4050)
for trial in range(4):
    bs, d, kvh = rng.choice([1, 2, 4, 8]), rng.choice([8, 12, 16]), rng.choice([1, 2, 3])
    n_slots = 6 * bs
    kc, vc = torch.zeros(6, bs, kvh, d), torch.zeros(6, bs, kvh, d)
    n = rng.randint(1, n_slots)
    slots = torch.tensor([s if rng.random() > 0.2 else -1 for s in rng.sample(range(n_slots), n)], dtype=torch.int64)
    key, value = torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv_ref(key, value, ref_k, ref_v, slots)
    store_kv_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), \
        f"hidden: block_size {bs}, head_dim {d}, {kvh} KV heads, slots {slots.tolist()}: caches differ from store_kv_ref"
print("hidden: 4 random slot mappings stored exactly")

# %% [markdown]
# ## 4. 序列少、上下文长：Split-KV
#
# 任务 3 的网格是 `(num_seqs, num_kv_heads)`。一条 32k Token 的序列、8 个 KV 头，只有 8 个程序，每个程序独自走完 32k 个 Token，
# GPU 上一百多个 SM 大多闲着。Flash-Decoding（Tri Dao、Daniel Haziza、Francisco Massa、Grigory Sizov，2023 年 10 月的博客
# *Flash-Decoding for long-context inference*）的做法是把上下文再切成分区，每个分区一个程序，各自写出部分结果
# $(m_p, l_p, \text{acc}_p)$，再由一次归约按在线 Softmax 的同一规则合并：
#
# $$M = \max_p m_p,\qquad o = \frac{\sum_p e^{m_p - M}\,\text{acc}_p}{\sum_p e^{m_p - M}\, l_p}.$$
#
# 框架里的对应（均核对自 **vLLM v0.11.0** 的源码）：
#
# | 事实 | 值 | 出处 |
# |---|---|---|
# | paged_attention v2 的分区大小 | {{VLLM["partition_size"]}} 个 Token | `vllm/attention/ops/paged_attn.py` 的 `_PARTITION_SIZE`（注释：须与 CUDA 端 `paged_attention_v2_launcher` 的 `PARTITION_SIZE` 相同） |
# | 何时用不分区的 v1 | `max_seq_len <= {{VLLM["v1_max_seq_len"]}}` 且（只有 1 个分区，或 `num_seqs * num_heads > {{VLLM["v1_min_seqs_x_heads"]}}`） | 同一文件，`PagedAttention.forward_decode` 中的 `use_v1` |
# | 分区必须是块的整数倍 | `_PARTITION_SIZE % block_size == 0` | 同上（v2 分支的 `assert`） |
# | CUDA 上默认块大小 | {{VLLM["block_size"]}} | `vllm/platforms/cuda.py`：`cache_config.block_size` 未设置时取 16 |
# | V1 Triton 后端的分段数 | 每条序列 {{VLLM["segments"]}} 段（仅当整批都是解码且程序数不多时用三维网格） | `vllm/attention/ops/triton_unified_attention.py` 的 `unified_attention`（`NUM_SEGMENTS = 16`） |
#
# minibatch 的引擎内核用同样的判断：`triton_decode.choose_split` 在“上下文超过一个分区 **且** 序列数 × KV 头数少于 SM 数”时才拆分，
# 默认分区 `DEFAULT_PARTITION_SIZE` = {{DEFAULT_PARTITION_SIZE}}：

# %%
print(inspect.getsource(choose_split))
PARTITION_SIZES = [4, 8, 16, 40]      # task 5 checks these (the last: a single partition)

# %% [markdown]
# ## 任务 5 · 进阶：Split-KV（_split_kv_kernel 与 merge_partitions）
#
# 写两部分：
#
# 1. 内核 `_split_kv_kernel`，网格 `(num_seqs, num_kv_heads, num_partitions)`：程序 `(s, g, p)` 只处理序列 `s` 的 Token
#    `[p * PARTITION_SIZE, min((p + 1) * PARTITION_SIZE, context_lens[s]))`（像任务 3 一样一次算整组查询头），
#    把这一段上的 $m_p$、$l_p$ 与未归一化的 $\text{acc}_p$ 写进 `part_m[s, h, p]`、`part_l[s, h, p]`、`part_acc[s, h, p, :]`。
#    `PARTITION_SIZE` 是 `BLOCK_SIZE` 的整数倍（与 vLLM 的 `assert` 相同），所以一个分区恰好是若干整块。
#    分区完全在序列末尾之后时什么都不写（包装函数已把 `part_m` 填成 `-inf`、`part_l` 与 `part_acc` 填成 0）；
# 2. 纯 torch 的 `merge_partitions(part_m, part_l, part_acc)`：按上面的公式合并成 `[num_seqs, num_heads, head_dim]`；
#    空分区的 $m_p = -\infty$、权重 $e^{m_p - M} = 0$。
#
# 检查单元格不只看最终输出：它还用 torch 逐分区算出每一段的最大分数与 $\sum e^{s - m_p}$，和你写出的 `part_m`、`part_l` 对照，
# 所以必须真的按分区计算；分区大小取 {{PARTITION_SIZES}}（最后一个只有一个分区，等于不分）。
#
# <details><summary>提示</summary>
#
# - 分区 `p` 覆盖的块号是 `p * (PARTITION_SIZE // BLOCK_SIZE)` 起的若干块，循环上界用 `tl.minimum(..., tl.cdiv(ctx_len, BLOCK_SIZE))`；
#   也可以在开头 `if lo >= ctx_len: return`；
# - 合并时 `M` 沿分区维取最大（`part_m.max(dim=-1, keepdim=True)`），`part_acc` 的权重要在最后一维上广播；
# - 第 7 章读过的引擎内核 `_paged_decode_kernel` 的 `SPLIT` 分支与 `_split_kv_reduce_kernel` 做的就是这两件事。
# </details>

# %% tags=["task:5"]
@triton.jit
def _split_kv_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                     part_m_ptr, part_l_ptr, part_acc_ptr, scale,
                     stride_q_s, stride_q_h,
                     stride_k_b, stride_k_t, stride_k_h,
                     stride_bt_s,
                     stride_pm_s, stride_pm_h,             # part_m, part_l: [num_seqs, num_heads, num_partitions], partition stride 1
                     stride_pa_s, stride_pa_h, stride_pa_p,  # part_acc: [num_seqs, num_heads, num_partitions, head_dim]
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION_SIZE: tl.constexpr):
    """Grid (num_seqs, num_kv_heads, num_partitions): partial (m, l, acc) of one partition for a group of heads."""
    ### BEGIN SOLUTION
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    lo = part * PARTITION_SIZE
    if lo >= ctx_len:
        return
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_q = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :], mask=mask_q,
                other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = lo // BLOCK_SIZE
    last = tl.minimum(first + PARTITION_SIZE // BLOCK_SIZE, tl.cdiv(ctx_len, BLOCK_SIZE))
    for i in range(first, last):
        block = tl.load(block_tables_ptr + seq * stride_bt_s + i).to(tl.int64)
        mask_t = i * BLOCK_SIZE + offs_t < ctx_len
        offs = block * stride_k_b + offs_t[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :]
        mask = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    ml = seq * stride_pm_s + heads * stride_pm_h + part
    tl.store(part_m_ptr + ml, m, mask=mask_g)
    tl.store(part_l_ptr + ml, l, mask=mask_g)
    tl.store(part_acc_ptr + seq * stride_pa_s + heads[:, None] * stride_pa_h + part * stride_pa_p + offs_d[None, :],
             acc, mask=mask_q)
    ### END SOLUTION


def merge_partitions(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor) -> torch.Tensor:
    """``[S, H, P]``, ``[S, H, P]``, ``[S, H, P, D]`` partial results -> ``[S, H, D]`` attention output."""
    ### BEGIN SOLUTION
    big_m = part_m.max(dim=-1, keepdim=True).values
    w = torch.exp(part_m - big_m)                       # 0 for the empty partitions
    return (part_acc * w[..., None]).sum(dim=2) / (part_l * w).sum(dim=-1)[..., None]
    ### END SOLUTION

# %%
def split_kv_decode(q, k_cache, v_cache, block_tables, context_lens, partition_size, scale=None):
    """Split-KV decode: returns (out, part_m, part_l); partitions of ``partition_size`` tokens, one program each."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert partition_size % block_size == 0, "a partition is a whole number of blocks"
    group = num_heads // num_kv_heads
    num_parts = triton.cdiv(block_tables.shape[1] * block_size, partition_size)
    part_m = torch.full((num_seqs, num_heads, num_parts), float("-inf"))
    part_l = torch.zeros(num_seqs, num_heads, num_parts)
    part_acc = torch.zeros(num_seqs, num_heads, num_parts, head_dim)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    launch(_split_kv_kernel, (num_seqs, num_kv_heads, num_parts), q, k_cache, v_cache, block_tables, context_lens,
           part_m, part_l, part_acc, scale, q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
           part_m.stride(0), part_m.stride(1), *part_acc.stride()[:3],
           GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=triton.next_power_of_2(group),
           BLOCK_D=triton.next_power_of_2(head_dim), PARTITION_SIZE=partition_size)
    return merge_partitions(part_m, part_l, part_acc).to(q.dtype), part_m, part_l


def partition_stats(q, k_cache, block_tables, context_lens, partition_size, scale=None):
    """What part_m and part_l must hold, computed densely in torch (-inf and 0 for empty partitions)."""
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    num_parts = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], partition_size)
    m = torch.full((num_seqs, num_heads, num_parts), float("-inf"))
    l = torch.zeros(num_seqs, num_heads, num_parts)
    for s, n in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[s], n).repeat_interleave(group, dim=1)        # [n, H, D]
        scores = torch.einsum("hd,thd->ht", q[s].float(), k.float()) * scale
        for p in range(0, n, partition_size):
            chunk = scores[:, p:p + partition_size]
            m[s, :, p // partition_size] = chunk.max(dim=1).values
            l[s, :, p // partition_size] = torch.exp(chunk - chunk.max(dim=1, keepdim=True).values).sum(dim=1)
    return m, l


def check_split(case, partition_size, what, **kw):
    err = check_decode(lambda *a, **k: split_kv_decode(*a, partition_size, **k)[0], case,
                       f"{what}, partition_size {partition_size}", **kw)
    _, part_m, part_l = split_kv_decode(*case, partition_size, **kw)
    m, l = partition_stats(case[0], case[1], case[3], case[4], partition_size, kw.get("scale"))
    torch.testing.assert_close(part_m, m, msg=lambda e: f"{what}, partition_size {partition_size}: part_m {e}")
    torch.testing.assert_close(part_l, l, msg=lambda e: f"{what}, partition_size {partition_size}: part_l {e}")
    return err

# %% tags=["check:5"]
case = (q, k_cache, v_cache, block_tables, context_lens)
errs = [check_split(case, ps, "GQA, group 2") for ps in PARTITION_SIZES]
errs.append(check_split(random_paged(7, [40, 3], num_heads=8, num_kv_heads=2), 8, "group 4"))
num_parts = [triton.cdiv(block_tables.shape[1] * BLOCK_SIZE, ps) for ps in PARTITION_SIZES]
assert max(errs) < 1e-5
print(f"split-KV matches the reference, and every partition's (m, l) matches torch, for partition sizes "
      f"{PARTITION_SIZES} ({num_parts} partitions); max |error| < 1e-5")

# %% tags=["check:5", "hidden"]
rng = random.Random(5050)
for trial in range(4):
    kvh, g = rng.choice([1, 2]), rng.choice([1, 2, 4])
    bs, d = rng.choice([1, 2, 4]), rng.choice([8, 16])
    lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
    ps = bs * rng.choice([1, 2, 3, 5])
    check_split(random_paged(500 + trial, lens, kvh * g, kvh, d, bs), ps,
                f"hidden: {kvh * g} heads, {kvh} KV heads, head_dim {d}, block_size {bs}")
print("hidden: 4 random shapes and partition sizes match")

# %% [markdown]
# 在 vLLM v0.11.0 的规则下，什么时候会用分区的 v2？下面只用它的 `use_v1` 条件与分区大小 {{VLLM["partition_size"]}} 算一张表
# （Llama-3-8B 的 {{spec.num_heads}} 个查询头）：序列多时已有足够的并行度，拆分只增加一次归约；序列少而上下文长时才拆。

# %%
def vllm_v0_11_uses_v2(num_seqs, max_seq_len, num_heads):
    """vLLM v0.11.0, vllm/attention/ops/paged_attn.py: the negation of use_v1."""
    parts = -(-max_seq_len // VLLM["partition_size"])
    use_v1 = max_seq_len <= VLLM["v1_max_seq_len"] and (parts == 1 or num_seqs * num_heads > VLLM["v1_min_seqs_x_heads"])
    return not use_v1


seq_counts, ctx_lens = [1, 4, 16, 64], [256, 1024, 4096, 16384]
print("num_seqs \\ max_seq_len " + "".join(f"{n:>8}" for n in ctx_lens))
for s in seq_counts:
    print(f"{s:>22} " + "".join(f"{'v2' if vllm_v0_11_uses_v2(s, n, spec.num_heads) else 'v1':>8}" for n in ctx_lens))

# %% [markdown]
# ## 5. 读字节的模型，和 GPU 上实际跑到的带宽
#
# 第 3 节算过：Llama-3-8B 每个上下文 Token 每层、每个 KV 头要读 $2 \cdot d \cdot 2$ = {{2 * spec.head_dim * 2}} 字节（K 与 V，bf16）。
# 解码注意力是访存受限的，所以一个好的内核的耗时应当接近“读的字节 ÷ 显存带宽”。下一个单元格只在有 GPU 时运行：
# 它在**子进程**里（不设 `TRITON_INTERPRET`，内核真正编译到 GPU 上）计时引擎自己的内核
# `minibatch.kernels.triton_decode.paged_decode_attention`，形状取 Llama-3-8B 的一层（bf16、块大小 16），
# 打印实际达到的 GB/s 与按字节模型的预期；没有 GPU 时只打印一句说明，不运行（本 Notebook 的其余部分都在解释器里）。

# %% tags=["nbval-ignore-output"]
GPU_BENCH = r'''
import json, sys, torch
from minibatch.kernels.triton_decode import paged_decode_attention
batch, ctx, heads, kv_heads, d, bs = json.loads(sys.argv[1])
dev, dt = "cuda", torch.bfloat16
blocks = batch * ctx // bs
k = torch.randn(blocks, bs, kv_heads, d, device=dev, dtype=dt)
v = torch.randn_like(k)
q = torch.randn(batch, heads, d, device=dev, dtype=dt)
tables = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, ctx // bs)
lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
for _ in range(3):
    paged_decode_attention(q, k, v, tables, lens)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize()
start.record()
for _ in range(20):
    paged_decode_attention(q, k, v, tables, lens)
end.record()
torch.cuda.synchronize()
print(json.dumps({"s": start.elapsed_time(end) / 20 / 1e3, "gpu": torch.cuda.get_device_name()}))
'''

if torch.cuda.is_available():
    import json, subprocess, sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}      # compiled, not interpreted
    for batch, ctx in [(16, 4096), (1, 32768)]:
        shape = [batch, ctx, spec.num_heads, spec.num_kv_heads, spec.head_dim, 16]
        run = subprocess.run([sys.executable, "-c", GPU_BENCH, json.dumps(shape)], env=env, capture_output=True,
                             text=True, timeout=300)
        if run.returncode != 0:
            print(f"batch {batch}, context {ctx}: the benchmark failed:\n{run.stderr[-2000:]}")
            continue
        res = json.loads(run.stdout.strip().splitlines()[-1])
        moved = batch * ctx * spec.num_kv_heads * 2 * spec.head_dim * 2             # K and V, bf16, one layer
        hw = get_hardware("h200" if "H200" in res["gpu"] else "h100")                # the model's bandwidth
        print(f"{res['gpu']}: batch {batch}, context {ctx}: {res['s'] * 1e6:.1f} us, {moved / 2**20:.0f} MiB read "
              f"-> {moved / res['s'] / 1e9:.0f} GB/s achieved; the bytes-moved model ({hw.name}, "
              f"{hw.effective_bandwidth / 1e9:.0f} GB/s): {moved / hw.effective_bandwidth * 1e6:.1f} us, "
              f"so {moved / res['s'] / hw.effective_bandwidth:.0%} of it")
else:
    print("no GPU (torch.cuda.is_available() is False): the compiled-kernel bandwidth benchmark was not run")

# %%
H100 = get_hardware("h100")
NUM_SMS = 132                          # H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper)
KV_BYTES_PER_TOKEN = 2 * spec.head_dim * 2          # K and V of one KV head, bf16
T_PROGRAM = 1e-6                       # fixed cost of one program (load q and its block table, write out)
T_REDUCE_LAUNCH = 4e-6                 # the second (reduce) kernel's launch
PARTITION_CANDIDATES = [16 * 2**i for i in range(12)]      # 16 .. 32768 tokens
TOLERANCE = 0.10
SHOWN_CASES = [(1, 8, 32768), (4, 8, 8192), (16, 8, 4096), (64, 8, 2048), (1, 8, 1024), (2, 8, 100_000)]


def split_decode_time(batch, num_kv_heads, context, partition):
    """Modelled seconds of one layer's split-KV decode attention on an H100 (see the text above)."""
    group = spec.num_heads // spec.num_kv_heads
    longest = min(partition, context)
    parts = -(-context // partition)
    programs = batch * num_kv_heads * parts
    waves = -(-programs // NUM_SMS)
    per_sm = H100.effective_bandwidth / NUM_SMS
    t = waves * (T_PROGRAM + longest * KV_BYTES_PER_TOKEN / per_sm)
    if parts > 1:
        partial_bytes = batch * num_kv_heads * group * parts * (spec.head_dim + 2) * 4
        t += T_REDUCE_LAUNCH + 2 * partial_bytes / H100.effective_bandwidth
    return t


def best_partition(batch, num_kv_heads, context):
    return min(PARTITION_CANDIDATES, key=lambda p: split_decode_time(batch, num_kv_heads, context, p))


print("batch, KV heads, context | best partition | us: best, 512 (engine default), no split")
for case in SHOWN_CASES:
    b = best_partition(*case)
    t = [split_decode_time(*case, p) * 1e6 for p in (b, 512, max(case[2], PARTITION_CANDIDATES[-1]))]
    print(f"{str(case):>24} | {b:>14} | {t[0]:7.1f} {t[1]:7.1f} {t[2]:7.1f}")

# %% [markdown]
# ## 任务 6 · 开放任务：给一个解码批选分区大小（choose_partition）
#
# 引擎的 `choose_split` 只决定“拆不拆”，分区大小固定为 {{DEFAULT_PARTITION_SIZE}}。但最好的分区大小取决于批：
# 程序太少，SM 闲着；分区太小，程序太多、每个程序的固定开销与合并的代价占了上风；而且 SM 是按**波次**（Wave）执行程序的——
# {{NUM_SMS}} 个 SM 上有 {{NUM_SMS + 1}} 个程序，最后一个程序要单独再跑一波。
#
# 下面的 `split_decode_time` 是一个 H100 上的简化模型（参数都写在单元格里，你可以改它们做实验，但评分用的是答案里的这一份）：
#
# - **{{NUM_SMS}} 个 SM**：H100 SXM5 的 SM 数（NVIDIA *H100 Tensor Core GPU Architecture* 白皮书：完整的 GH100 有 144 个 SM，
#   SXM5 版的 H100 启用 132 个）；显存带宽取 `minibatch.sim.hardware` 里 h100 的可达带宽 {{H100.effective_bandwidth / 1e12:.2f}} TB/s
#   （数据手册 3.35 TB/s × {{H100.bandwidth_efficiency}}），每个 SM 分到其中的 1/{{NUM_SMS}}；
# - 每个程序读自己分区的 K/V（每 Token {{KV_BYTES_PER_TOKEN}} 字节，一个 KV 头），另加 {{T_PROGRAM * 1e6:g}} µs 的固定开销；
#   程序按波次执行，一波最多 {{NUM_SMS}} 个，每波的时间是其中最长的程序；
# - 分区多于 1 个时，另有一次归约：启动 {{T_REDUCE_LAUNCH * 1e6:g}} µs，加上把部分结果 $(m, l, \text{acc})$（fp32）写出再读回的字节。
#
# 写 `choose_partition(batch, num_kv_heads, context)`：批里有 `batch` 条长 `context` 的序列（Llama-3-8B 的一层：
# 每个 KV 头 {{spec.num_heads // spec.num_kv_heads}} 个查询头、head_dim {{spec.head_dim}}），返回分区大小（Token 数）。
#
# **评分规则**：返回值必须是 {{VLLM["block_size"]}} 的正整数倍（vLLM 在 CUDA 上的块大小，分区须是整块）；在下面列出的情形和隐藏的
# 随机情形上，按 `split_decode_time` 你的选择的耗时都不超过候选 `PARTITION_CANDIDATES`（{{PARTITION_CANDIDATES[0]}} 到
# {{PARTITION_CANDIDATES[-1]}} 的 2 的幂）中最好者的 **{{1 + TOLERANCE:.2f}} 倍**。
# 你的函数**不许调用** `split_decode_time`（检查时它会报错）：要你自己从模型推出一条规则，而不是枚举它。
# 最后，检查单元格用你在一个小批上的选择，在解释器里跑你任务 5 的 Split-KV 内核，输出必须正确。

# %% tags=["task:6"]
def choose_partition(batch: int, num_kv_heads: int, context: int) -> int:
    """Split-KV partition size (tokens, a multiple of 16) for a decode batch on an H100."""
    ### BEGIN SOLUTION
    # A program's time is (fixed cost + its tokens / one SM's bandwidth); programs run in waves of NUM_SMS.
    # In tokens of one SM's reading: minimise waves * (fixed + partition) + the reduce if split.
    tokens_per_s = H100.effective_bandwidth / NUM_SMS / KV_BYTES_PER_TOKEN

    def cost(p):
        parts = -(-context // p)
        waves = -(-batch * num_kv_heads * parts // NUM_SMS)
        return waves * (T_PROGRAM * tokens_per_s + min(p, context)) + (parts > 1) * T_REDUCE_LAUNCH * tokens_per_s

    return min(PARTITION_CANDIDATES, key=cost)
    ### END SOLUTION

# %% [markdown]
# <details><summary>提示</summary>
#
# - 先只看一波：`batch × num_kv_heads` 个（序列，KV 头）对，每对切成 `parts` 个分区，程序数是它们的乘积；
#   程序数不到 {{NUM_SMS}} 时，分区越小越快（每个 SM 读得越少）；
# - 再看波次：一个程序读 `P` 个 Token，`w` 波的耗时大约是 `w × (固定开销 + P 个 Token 的读取)`。
#   把固定开销也折算成“相当于读多少个 Token”，比较各个候选的 `w × (开销 + P)` 即可；
# - “让程序数刚好填满一波”再向上取到 2 的幂，在 `batch × num_kv_heads` 整除 {{NUM_SMS}} 时很好，否则可能差出一倍：
#   多跑几波、每波更短，往往更接近理想的“总字节 ÷ 总带宽”；
# - 合并的代价只在分区多于 1 个时才有；上下文不超过分区时就是不拆分（vLLM 的 v1）。
# </details>

# %%
def check_partition_choice(cases, what):
    real = split_decode_time
    def forbidden(*args, **kwargs):
        raise AssertionError("choose_partition must not call split_decode_time: derive a rule from the model")
    globals()["split_decode_time"] = forbidden
    try:
        choices = [choose_partition(*case) for case in cases]
    finally:
        globals()["split_decode_time"] = real
    worst = 1.0
    for case, p in zip(cases, choices):
        assert isinstance(p, int) and p > 0 and p % VLLM["block_size"] == 0, \
            f"{what} {case}: choose_partition returned {p!r}, expected a positive multiple of {VLLM['block_size']}"
        best = best_partition(*case)
        ratio = split_decode_time(*case, p) / split_decode_time(*case, best)
        assert ratio <= 1 + TOLERANCE, (
            f"{what} (batch, KV heads, context) = {case}: partition {p} takes {split_decode_time(*case, p) * 1e6:.1f} us, "
            f"{ratio:.2f}x the best ({best}: {split_decode_time(*case, best) * 1e6:.1f} us); "
            f"expected within {1 + TOLERANCE:.2f}x")
        worst = max(worst, ratio)
    return choices, worst

# %% tags=["check:6", "needs:5", "nbval-ignore-output"]
choices, worst = check_partition_choice(SHOWN_CASES, "")
for case, p in zip(SHOWN_CASES, choices):
    print(f"{str(case):>24}: your partition {p}, best {best_partition(*case)}")
print(f"every choice within {1 + TOLERANCE:.2f}x of the best partition")
small = random_paged(11, [2000, 700], num_heads=8, num_kv_heads=2, block_size=16, spare_blocks=2)
ps = choose_partition(2, 2, 2000)
err = check_split(small, ps, "your choice for (batch 2, 2 KV heads, context 2000)")
assert err < 1e-5
print(f"and your split-KV kernel (task 5) with your choice for (batch 2, 2 KV heads, context 2000), partition {ps}, "
      f"is correct in the interpreter: max |error| < 1e-5")

# %% tags=["check:6", "hidden"]
rng = random.Random(6050)
hidden_cases = [(rng.randint(1, 256), rng.choice([1, 2, 4, 8]), rng.randint(128, 131072)) for _ in range(40)]
_, worst = check_partition_choice(hidden_cases, "hidden:")
print(f"hidden: 40 random batches, every choice within {1 + TOLERANCE:.2f}x of the best")

# %% [markdown]
# ## 小结
#
# - 分页解码内核的核心只有两行寻址：先 `tl.load` 块表得到物理块号，再按 `block * stride + (t % B) * stride` 取 K/V；
#   掩码决定读哪些槽位，漏一个就会读到别人的（这里是 NaN 的）数据。
# - 在线 Softmax 用 $(m, l, \text{acc})$ 三个状态一次读完上下文，块与块之间只差一个缩放因子 $e^{m-m'}$；
#   同一个合并规则既用于块与块之间，也用于 Split-KV 的分区之间。
# - GQA 分组让一个程序给 $G$ 个查询头共用一次 K/V 读取：解码是访存受限的，读的字节少 $G$ 倍就是快 $G$ 倍的上限。
# - Split-KV 增加的是并行度而不是效率：它多写一份部分结果、多一次归约，只在序列少、上下文长时划算——vLLM v0.11.0 的
#   v1/v2 选择与 minibatch 的 `choose_split` 都是这个判断。
#
# **思考题**：引擎内核用 `tl.dot` 计算分数，而 `tl.dot` 要求每维至少 16，于是 $G = 2$ 的一组查询头被补成 16 行。
# 在访存受限的解码里，这些补出来的行浪费的是算力还是带宽？为什么它几乎不影响解码速度？
