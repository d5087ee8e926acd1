# %% [markdown]
# # 第 6 章 KV Cache 与显存管理基础
#
# 前面几章把批处理当成一个“调度”问题：什么时候把哪些请求放进同一个 step。但调度器能放进去多少请求，
# 最终由显存决定——更准确地说，由 **KV Cache** 还剩多少空间决定。第 2 章讲过，解码（Decode）阶段几乎是
# 访存受限（Memory-bound）的，批越大越划算；而批的上限，恰恰是 KV Cache 能同时容纳的序列数。
# 第 1 章 1.5.2 节把“显存管理的复杂性”列为动态批处理的四大挑战之一：传统的预分配方式会导致大量碎片与浪费。
# 本章把这句话变成可以计算、可以测量的数字。
#
# ## 学习目标
#
# - 会用公式 $2 \cdot L \cdot H_{kv} \cdot d \cdot b$ 计算任意模型每个 Token 的 KV 字节数，理解 GQA 为什么能把它缩小数倍；
# - 会估算一个模型在一张 GPU 上能放下多少 KV Token、能同时服务多少条序列，并知道哪些组合根本放不下；
# - 理解“按最大长度连续预分配”（Contiguous Pre-allocation）与实际使用量之间的差距；
# - 按 vLLM 论文（SOSP'23 §3）的定义区分 KV 显存里的四种状态：**Token 状态**（已写入）、**预留**（Reserved，
#   将来会写入）、**内部碎片**（Internal Fragmentation，分配了却永远不会写入）、**外部碎片**（External Fragmentation，
#   空闲却因不连续而分不出去），并在 minibatch 引擎里用 `kv_allocator="contiguous"`（两种预留大小）与 `"paged"` 实测它们；
# - 分清两个常被混为一谈的现象：大小相同的预留之间**不会**产生外部碎片，池子除不尽预留大小剩下的块只是**取整余量**；
# - 看懂显存浪费如何直接变成批大小与吞吐量的损失，为第 7 章的 PagedAttention 做铺垫。

# %%
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
import minibatch
from minibatch.kv_cache import BlockPool, KVCacheManager
from minibatch.runner import run
from minibatch.sim import ModelDoesNotFitError, get_hardware, get_model_spec, make_cost_model
from minibatch.workload import load_shipped_trace, load_workload

GiB = 1 << 30
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 6.1 KV Cache 是什么，一个 Token 要占多少字节
#
# 自回归生成第 $t$ 个 Token 时，注意力要用到前面所有 Token 的键（Key）和值（Value）。它们在生成过程中不会改变，
# 所以推理引擎把每层、每个 KV 头的 $K, V$ 向量缓存起来，这就是 **KV Cache**。没有它，每生成一个 Token 都要把整个前缀重算一遍。
#
# 一个 Token 在所有层里留下的 K 和 V 一共占：
#
# $$
# \text{kv\_bytes\_per\_token} = 2 \cdot L \cdot H_{kv} \cdot d \cdot b
# $$
#
# 其中 $2$ 表示 K 和 V 两份，$L$ 是层数，$H_{kv}$ 是 KV 头数，$d$ 是每个头的维度（head_dim），$b$ 是每个元素的字节数
# （bf16/fp16 为 2）。一条长度为 $n$ 的序列占 $n$ 倍。对多头注意力（MHA），$H_{kv}=H$（查询头数）；
# 分组查询注意力（GQA, Grouped-Query Attention）让 $G$ 个查询头共用一个 KV 头，$H_{kv}=H/G$，KV Cache 随之缩小 $G$ 倍。
#
# vLLM 论文（Kwon et al., *Efficient Memory Management for Large Language Model Serving with PagedAttention*, SOSP'23）
# 用 OPT-13B 举例：一个 Token 的 KV 要 $2 \times 5120 \times 40 \times 2$ 字节 = 800 KB，一条 2048 Token 的序列最多要 1.6 GB。
# 下面用 `minibatch.sim` 里登记的真实模型结构（来自各模型 Hugging Face 的 `config.json`）计算几种常见模型，
# 并与库函数 `ModelSpec.kv_bytes_per_token` 对账：

# %% tags=["nbval-check-output"]
MODELS = ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "qwen3-0.6b"]
MAX_LEN = 4096                       # a long sequence: the max_model_len used throughout this chapter

print(f"{'model':<12} {'L':>3} {'H':>3} {'H_kv':>4} {'d':>4} {'KiB/token':>9} {'GiB per seq':>12}")
for name in MODELS:
    m = get_model_spec(name)
    by_hand = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    assert by_hand == m.kv_bytes_per_token
    print(f"{name:<12} {m.num_layers:>3} {m.num_heads:>3} {m.num_kv_heads:>4} {m.head_dim:>4} "
          f"{by_hand / 1024:>9.0f} {by_hand * MAX_LEN / GiB:>12.2f}")

# %%
m7, m13, m70, m8 = (get_model_spec(n) for n in ("llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b"))

# %% tags=["check"]
assert m8.kv_bytes_per_token < m7.kv_bytes_per_token and m70.kv_bytes_per_token < m13.kv_bytes_per_token, \
    "the prose says GQA makes the bigger models' KV per token smaller"

# %% [markdown]
# 几点观察：Llama-3-8B 和 Llama-2-7B 层数、头维度相同，但它只有 {{m8.num_kv_heads}} 个 KV 头
# （GQA，每 {{m8.num_heads // m8.num_kv_heads}} 个查询头共用一个），所以每个 Token 的 KV 只有 Llama-2-7B 的
# {{m8.kv_bytes_per_token / m7.kv_bytes_per_token:.2f}} 倍；Llama-2-70B 参数是 13B 的
# {{m70.num_params / m13.num_params:.1f}} 倍，但同样得益于 GQA，每个 Token 的 KV 反而只有 13B 的
# {{m70.kv_bytes_per_token / m13.kv_bytes_per_token:.2f}} 倍。
# 表的最后一列是一条 {{MAX_LEN}} Token 的序列：一条这样的 Llama-2-13B 序列就要 {{m13.kv_bytes_per_token * MAX_LEN / GiB:.2f}} GiB——
# KV Cache 与权重一样，是显存里的“大户”。

# %% [markdown]
# ## 6.2 一张 GPU 能放下多少 KV
#
# 推理引擎启动时先加载权重，再把剩下的显存（扣掉 CUDA 上下文、激活值等预留）全部切给 KV Cache。
# vLLM 用 `gpu_memory_utilization` 限定引擎可用的显存比例（vLLM v0.10.2 `vllm/config/cache.py` 的
# `CacheConfig.gpu_memory_utilization`，默认 0.9，`vllm serve` 与 `LLM` 类相同）。于是：
#
# $$
# N_{\text{tokens}} = \left\lfloor \frac{M_{\text{GPU}} \cdot u - W - R}{\text{kv\_bytes\_per\_token}} \right\rfloor,
# \qquad
# N_{\text{seqs}} = \left\lfloor \frac{N_{\text{tokens}}}{\text{每条序列的 Token 数}} \right\rfloor
# $$
#
# 其中 $M_{\text{GPU}}$ 是显存容量，$u$ 是 `gpu_memory_utilization`，$W$ 是权重字节数，$R$ 是留给激活值与运行时的保留量
# （不要与 6.4 节 KV 的“预留”混淆）。
# minibatch 的模拟器用 `RooflineCostModel.kv_capacity_tokens` 计算它（下面打印其源码的文档部分），
# `SimExecutor` 正是用这个数决定模拟时 KV 池有多少块：

# %%
from minibatch.sim import RooflineCostModel

print(inspect.getdoc(RooflineCostModel.kv_capacity_tokens))
GPUS = ["a10", "a100-40g", "a100-80g", "h100"]
TYPICAL = 1024                       # a typical request's prompt + output tokens

# %% [markdown]
# 下表对 7B / 13B / 70B 在 {{'、'.join(f'{g}（{get_hardware(g).memory_bytes / GiB:g} GiB）' for g in GPUS)}} 上逐一计算。
# 每格给出 KV 能容纳的 Token 数，以及两种口径的并发序列数：按 `max_model_len = {{MAX_LEN}}` **整段预留**时能放几条，
# 以及按一条“典型”请求 {{TYPICAL}} Token（输入加输出）**按需分配**时能放几条。放不下权重的组合标为 `does not fit`：

# %% tags=["nbval-check-output"]

def capacity(model, gpu, tp=1):
    """(weights GiB per GPU, KV tokens, seqs at MAX_LEN, seqs at TYPICAL) or None if it does not fit."""
    cm = make_cost_model(model, gpu, tensor_parallel_size=tp)
    try:
        tokens = cm.kv_capacity_tokens()
    except ModelDoesNotFitError:
        return None
    return cm.weight_bytes_per_gpu / GiB, tokens, tokens // MAX_LEN, tokens // TYPICAL


print(f"{'model':<12}" + "".join(f"{g:>24}" for g in GPUS))
print(f"{'':<12}" + "".join(f"{f'tokens / @{MAX_LEN} / @{TYPICAL}':>24}" for _ in GPUS))
for name in ["llama-2-7b", "llama-2-13b", "llama-2-70b"]:
    cells = []
    for g in GPUS:
        c = capacity(name, g)
        cells.append("does not fit" if c is None else f"{c[1]:,} / {c[2]} / {c[3]}")
    print(f"{name:<12}" + "".join(f"{c:>24}" for c in cells))

# %% [markdown]
# 70B 的权重本身就超过了任何一张单卡的显存（下一格第一行打印它的大小），必须用张量并行（Tensor Parallelism）
# 把权重和 KV 头切到多张卡上，每张卡只存自己那份 KV 头。模拟器的 `hardware="4xa100-80g"` 这类写法表示 4 路张量并行：

# %% tags=["nbval-check-output"]
print(f"llama-2-70b weights in bf16: {m70.weight_bytes / GiB:.1f} GiB")
for model, hw in [("llama-2-70b", "2xa100-80g"), ("llama-2-70b", "4xa100-80g"), ("llama-2-70b", "8xa10"),
                  ("llama-2-13b", "4xa10")]:
    count, gpu = hw.split("x", 1)
    c = capacity(model, gpu, tp=int(count))
    print(f"{model} on {hw:<11}" + ("does not fit" if c is None else
          f"weights {c[0]:5.1f} GiB/GPU, KV {c[1]:>9,} tokens, {c[2]:>3} seqs @{MAX_LEN}, {c[3]:>4} @{TYPICAL}"))

# %% tags=["check"]
assert all(capacity("llama-2-70b", g) is None for g in GPUS) and capacity("llama-2-13b", "a10") is None, \
    "the prose says 70B fits on no single GPU and 13B not on an A10"
assert capacity("llama-2-7b", "h100")[1] == capacity("llama-2-7b", "a100-80g")[1], "the prose: same memory, same KV"

# %% [markdown]
# 这张表说明三件事：第一，**同一张卡上，模型越大，留给 KV 的空间越少**，13B 在 A10 上连权重都放不下，
# 在 A100-40G 上也只剩很少的 KV 空间——第 1 章的 RAG 案例把 13B 部署在 4 张 A10 上，正是张量并行的典型用法；
# 第二，H100 与 A100-80G 显存容量相同，KV 容量也相同，H100 的优势在算力与带宽（第 2 章），不在容量；第三，并发序列数强烈依赖“每条序列按多长来算”——整段预留 `max_model_len`（{{MAX_LEN}}）与按 {{TYPICAL}} Token 分配，差距是 {{MAX_LEN // TYPICAL}} 倍。
# 下一节就来看这个差距从哪里来。

# %% [markdown]
# ## 6.3 连续预分配与实际使用
#
# 在 PagedAttention 出现之前，FasterTransformer、Orca 等系统为每个请求在显存里预留一段**连续**的 KV 缓冲区，
# 长度按这个请求“可能的最大长度”（通常就是 `max_model_len`）来定：因为生成开始时没人知道它会输出多少 Token，
# 而注意力算子要求一条序列的 KV 在地址上连续。结果是：大多数请求远没有用满自己的预留。
#
# 用真实数据看一看。Azure LLM 推理公开数据集的对话（conv）轨迹（Splitwise, ISCA'24；随课程放在 `datasets/traces/`，来源与许可证见其中的 `SOURCES.md`）
# 记录了每个请求的输入与输出 Token 数。假设每个请求都按 `max_model_len = {{MAX_LEN}}` 预留，实际用上的比例是多少？

# %%
conv = load_shipped_trace("azure_conv")
total = conv.prompt_lens + conv.output_lens
fits = total[total <= MAX_LEN]
used = fits / MAX_LEN
print(f"{len(total):,} requests; {len(fits):,} fit in {MAX_LEN} tokens "
      f"(mean length {fits.mean():.0f}, p50 {np.median(fits):.0f}, p99 {np.percentile(fits, 99):.0f})")
print(f"share of a {MAX_LEN}-token reservation actually used: mean {used.mean():.1%}, "
      f"median {np.median(used):.1%}")
fig, ax = plt.subplots(figsize=(7, 2.8))
ax.hist(fits, bins=80, color="C0", alpha=0.8)
ax.axvline(MAX_LEN, color="r", ls="--", label=f"reserved per request (max_model_len={MAX_LEN})")
ax.axvline(fits.mean(), color="k", ls=":", label=f"mean actual length ({fits.mean():.0f})")
ax.set_xlabel("prompt + output tokens per request")
ax.set_ylabel("requests")
ax.set_title("Azure conv 2023 trace: actual KV length vs a contiguous reservation", fontsize=10)
ax.legend(fontsize=8)
plt.show()


# %% [markdown]
# 按 `max_model_len` 预留而直到请求结束都没有用到的部分，其他请求也用不了——这是连续预分配最大的一块浪费，
# vLLM 论文把它归入**内部碎片**（下一节）。论文测量了当时的系统（Orca 的三种预留方式），报告 KV Cache 显存中
# **只有 20.4%（按最大长度预留，Orca-Max）到 38.2%（按真实输出长度预留，Orca-Oracle）** 真正存放了 Token 状态
# （Kwon et al., SOSP'23, §2.3 与 Figure 2）。上面的比例只是“一个请求用满了自己预留的几成”，
# 不是整个池子的构成，两者不能直接相比；6.4 节在引擎里按论文的口径测量。

# %% [markdown]
# ## 6.4 论文的分类：预留、内部碎片、外部碎片
#
# vLLM 论文（Kwon et al., SOSP'23, §3 与 Figure 3）把连续预分配的 KV 显存分成 Token 状态之外的三类浪费，本课程的
# 术语表（`docs/glossary.md`）沿用同样的定义。设一个请求已计算 $c$ 个 Token，持有 $h$ 个槽位（slot），到结束时一共会写入
# $w$ 个槽位（提示词加输出，减去最后一个输出 Token——它的 K/V 从来不会被计算）：
#
# - **预留**（Reserved）：为这个请求将来的 Token 占下、尚未写入的槽位，$\min(h, w) - c$。它们迟早会被用上，
#   但在被用上之前，别的请求也用不了。
# - **内部碎片**（Internal Fragmentation）：分配给了这个请求、但**直到它结束都不会被写入**的槽位，$\max(0, h - w)$。
#   按 `max_model_len` 预留时，它就是“最大长度减去实际长度”的那一大段；分页时它至多是最后一块里没写满的部分。
# - **外部碎片**（External Fragmentation）：空闲显存加起来够一个请求的预留，却因为散落在几段**大小不一的**预留之间，
#   分不出一段足够长的连续区间，只能让请求等待。
#
# $c$、预留与内部碎片加起来恰好是请求持有的 $h$ 个槽位；外部碎片则是空闲块的一部分。minibatch 的 `KVCacheManager`
# 在每个 step 之后按这个定义统计（`StepRecord.kv_reserved`、`kv_internal_frag`、`kv_external_frag`，
# `RunResult.summary()` 给出按时间加权的 `kv_reserved_mean`、`kv_internal_frag_mean`、`kv_external_frag_mean`）。
# $w$ 取的是请求计划的长度 $\min(\text{prompt} + \text{max\_tokens}, \text{max\_model\_len})$：模拟器里每个请求都
# 生成到 `max_tokens`，所以它是精确的。

# %%
print(inspect.getsource(KVCacheManager.fragmentation_slots))

# %% [markdown]
# 注意这与引擎里另一组按**块表位置**划分的统计不同：`waste_slots` 的“预留未用”（`kv_reserved_unused`，最后一个已写
# Token 之后整块持有的槽位）把论文的“预留”和一部分“内部碎片”混在一起；“末块浪费”（Last-block Waste，
# `kv_internal_waste`，最后一块里没写满的槽位）只是论文内部碎片的一小部分。本章只用论文的口径，
# 这样才能与论文的 Figure 2 对照。
#
# **外部碎片从哪里来？** 下面直接用引擎的 `BlockPool` 做一个小实验：A、B、C、D 依次连续分配**大小不同**的几段块，
# 正好占满池子，再释放 B 和 D，然后请求一段连续的块：

# %%
SIZES, ASK = [5, 3, 5, 3], 4                 # A, B, C, D's reservations; the next request's
pool = BlockPool(sum(SIZES))
runs = {name: pool.allocate_contiguous(n) for name, n in zip("ABCD", SIZES)}
pool.release(runs.pop("B"))
pool.release(runs.pop("D"))
free_blocks, longest = pool.num_free_blocks, pool.longest_free_run()
print("held:", {k: f"blocks {v[0]}-{v[-1]}" for k, v in runs.items()}, " free:", sorted(pool.free_queue))
print(f"{free_blocks} free blocks, longest free run {longest}; "
      f"{ASK} contiguous blocks: {pool.allocate_contiguous(ASK)}; {ASK} blocks anywhere (paged): {pool.allocate(ASK)}")

# %% tags=["check"]
assert free_blocks >= ASK > longest, "the prose says enough blocks are free, yet no run is long enough"

# %% [markdown]
# 池子有 {{sum(SIZES)}} 个块，四段预留分别是 {{'、'.join(map(str, SIZES))}} 块。释放 B 和 D 之后有 {{free_blocks}} 个空闲块，
# 够一个 {{ASK}} 块的请求，但最长的一段连续空闲区间只有 {{longest}} 块——这就是外部碎片；按块分页则照样分得出来。

# %% [markdown]
# 如果所有预留**大小相同**（都按 `max_model_len`），外部碎片就不会出现：首次适配（First Fit）总把新预留放进
# 某个与旧预留一样长的空洞里，只要空闲块数不少于一个预留，就一定有一段够长的连续区间（论文 §3 也把外部碎片归因于
# “不同请求的预留大小不同”）。这时池子里分不出去的那几个块，是池子大小除以预留大小的**取整余量**（Rounding
# Remainder）：它们是空闲的，只是凑不成一整段预留——不是碎片，换一种排列也分不出去。
#
# 按需分页（Paged）的方式只要有空闲块就能用，既没有外部碎片，也没有取整余量——这正是第 7 章 PagedAttention 的出发点。
#
# ### 在引擎里实测：两种连续预留与分页
#
# minibatch 的 `kv_allocator` 与 `contiguous_reserve` 选项组合出三种分配方式（见 `minibatch/kv_cache.py` 模块文档）：
#
# | 配置 | 每个请求占下什么 | 对应论文 Figure 2 中的 |
# |---|---|---|
# | `kv_allocator="contiguous"`（`contiguous_reserve="max_model_len"`，默认） | 一段 `max_model_len` 的连续块，大小都相同 | Orca (Max) |
# | `kv_allocator="contiguous", contiguous_reserve="request"` | 一段 $\min(\text{prompt}+\text{max\_tokens}, \text{max\_model\_len})$ 的连续块，大小各不相同 | Orca (Oracle)：这里 `max_tokens` 就是真实输出长度 |
# | `kv_allocator="paged"`（默认） | 按需一块一块地分配，位置任意 | vLLM |
#
# 实验设置：

# %%
N_CHAT = 120
wl = load_workload("chat", n=N_CHAT, max_len=MAX_LEN)
SETUP = dict(executor="sim", model="llama-2-7b", hardware="a10", max_model_len=MAX_LEN)

# %% [markdown]
# 模拟器里的 Llama-2-7B 跑在一张 A10 上，`max_model_len = {{MAX_LEN}}`。负载用 `load_workload("chat")`
# （按 Azure conv 轨迹的长度与到达统计拟合的对话负载）的前 {{N_CHAT}} 个请求，其到达速率高于 A10 的处理能力。
# 比较的是**满负荷的那段时间**：下面只统计有请求在排队的 step（按时长加权），去掉最后队列排空、池子渐渐变空的收尾阶段。
# 模拟器是确定性的，每次运行结果完全相同。

# %%
ALLOCATORS = {"contiguous, max_model_len": dict(kv_allocator="contiguous"),
              "contiguous, per request": dict(kv_allocator="contiguous", contiguous_reserve="request"),
              "paged": dict(kv_allocator="paged")}
results = {name: run(wl, **SETUP, **kw) for name, kw in ALLOCATORS.items()}
r0 = results["paged"]
BS = r0.config["block_size"]
print(f"{len(wl)} requests, mean prompt {wl.prompt_lens.mean():.0f} + output {wl.output_lens.mean():.0f} tokens; "
      f"KV pool {r0.kv_blocks_total} blocks x {BS} tokens = {r0.kv_blocks_total * BS:,} tokens")


# %% tags=["nbval-check-output"]
def pool_shares(r):
    """Time-weighted shares of the pool over the steps with a queue (the saturated part of the run)."""
    steps = [st for st in r.steps if st.num_waiting > 0]
    w = np.array([st.duration for st in steps])

    def mean(values):
        return float((w * np.array(values)).sum() / w.sum())

    used = mean([st.kv_usage for st in steps])
    reserved, internal = mean([st.kv_reserved for st in steps]), mean([st.kv_internal_frag for st in steps])
    external = mean([st.kv_external_frag for st in steps])
    s = r.summary()
    return {"tokens": used - reserved - internal, "reserved": reserved, "internal": internal,
            "external": external, "free": 1 - used - external, "batch": mean([st.num_seqs for st in steps]),
            "tok_s": s["throughput_tok_s"], "preempt": s["num_preemptions"]}


table = {name: pool_shares(r) for name, r in results.items()}
print(f"{'allocator':<26} {'tokens':>7} {'reserved':>9} {'internal':>9} {'external':>9} {'free':>6} "
      f"{'batch':>6} {'out tok/s':>10} {'preempt':>8}")
for name, row in table.items():
    print(f"{name:<26} {row['tokens']:>7.1%} {row['reserved']:>9.1%} {row['internal']:>9.1%} "
          f"{row['external']:>9.1%} {row['free']:>6.1%} {row['batch']:>6.1f} {row['tok_s']:>10.1f} {row['preempt']:>8}")

# %% [markdown]
# 各列都是占整个 KV 池槽位的比例：`tokens` 是 Token 状态，`reserved` 是预留，`internal` 是内部碎片，`external` 是
# 外部碎片（有请求因为找不到够长的连续区间而等待时的空闲槽位），`free` 是其余的空闲；`batch` 是每个 step 的平均序列数。

# %%
cm, cr, p = (table[n] for n in ALLOCATORS)
per_req = math.ceil(MAX_LEN / BS)                       # blocks in one max_model_len reservation
remainder = r0.kv_blocks_total % per_req

# %% tags=["check"]
assert cm["external"] == 0 and cr["external"] > 0, "the prose says only different-size reservations fragment externally"
assert cm["internal"] > cr["internal"] > p["internal"], "the prose orders internal fragmentation so"
assert cm["tokens"] < cr["tokens"] < p["tokens"], "the prose orders the token-state shares so"
assert p["batch"] > cm["batch"] and p["tok_s"] > cm["tok_s"], "the prose says paging runs bigger batches, faster"
assert results["contiguous, max_model_len"].summary()["num_preemptions"] == 0 < p["preempt"]

# %% [markdown]
# 按 `max_model_len` 连续预留时，池子看起来很满，但其中 {{cm['internal']:.0%}} 是内部碎片（每个请求都占着 {{MAX_LEN}} 个
# Token 的位置，实际只用到一小部分），真正存放 Token 的只有 {{cm['tokens']:.0%}}；外部碎片为 0——预留大小都相同。
# {{r0.kv_blocks_total}} 个块只够 {{r0.kv_blocks_total // per_req}} 段 {{per_req}} 块的预留，剩下的 {{remainder}} 块
# 是取整余量，落在 `free` 一列里。平均每步只能跑 {{cm['batch']:.1f}} 条序列。
#
# 按各自的长度预留（论文的 Orca-Oracle：假设事先知道输出长度）时，内部碎片降到 {{cr['internal']:.1%}}，Token 状态升到
# {{cr['tokens']:.0%}}，平均批大小 {{cr['batch']:.1f}}；但预留大小各不相同，释放之后池中留下大小不一的空洞，
# 满负荷时平均有 {{cr['external']:.0%}} 的池子是外部碎片：空闲块够下一个请求用，却没有一段足够长。
#
# 分页分配的 Token 状态占 {{p['tokens']:.0%}}，内部碎片只有 {{p['internal']:.2%}}，没有外部碎片；平均批大小
# {{p['batch']:.1f}}，输出吞吐从 {{cm['tok_s']:.0f}} 提高到 {{p['tok_s']:.0f}} tokens/s
# （{{p['tok_s'] / cm['tok_s']:.1f}} 倍）。代价是分页时 KV 可能被用光，引擎发生了 {{p['preempt']}} 次抢占
# （Preemption，第 12 章详谈）；连续预分配一开始就为每个请求留足了空间，从不抢占。
#
# 和论文对照：Figure 2 中 Orca (Max) 的 Token 状态占 20.4%、Orca (Oracle) 占 38.2%，vLLM 的浪费不到 4%。这里是同一种
# 口径（占 KV 池的比例，同样的四类），顺序与论文一致，具体数值取决于负载的长度分布与 `max_model_len`：论文用的是
# ShareGPT 与 Alpaca 负载和 OPT 模型，这里是对话负载（输入较长）和 Llama-2-7B。吞吐的倍数也一样：论文报告同等延迟下
# vLLM 的吞吐是 Orca 的 2–4 倍（§6.2），本实验的负载预填充占比大（预填充并不因批更大而变快），倍数因此不同。
#
# 把每个 step 之后的 KV 池画出来（按时间分段平均，三次运行时长不同，各用自己的时间轴）：

# %%
def binned(r, values, bins=120):
    """Time-weighted mean of a per-step quantity in equal time bins (steps are ms apart: too spiky raw)."""
    end = np.array([s.start_time + s.duration for s in r.steps])
    w = np.array([s.duration for s in r.steps])
    edges = np.linspace(0, end[-1], bins + 1)
    idx = np.clip(np.searchsorted(edges, end, side="right") - 1, 0, bins - 1)
    tot = np.bincount(idx, weights=w, minlength=bins)
    mean = np.bincount(idx, weights=w * np.asarray(values), minlength=bins) / np.where(tot > 0, tot, 1)
    return edges[:-1], mean


fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
for ax, (name, r) in zip(axes, results.items()):
    _, reserved = binned(r, [s.kv_reserved for s in r.steps])
    _, internal = binned(r, [s.kv_internal_frag for s in r.steps])
    _, external = binned(r, [s.kv_external_frag for s in r.steps])
    t, used = binned(r, [s.kv_usage for s in r.steps])
    ax.stackplot(t, (used - reserved - internal) * 100, reserved * 100, internal * 100, external * 100,
                 labels=["token states", "reserved", "internal fragmentation", "external fragmentation"],
                 colors=["#4e79a7", "#a0cbe8", "#ff9d9a", "#b07aa1"], step="post")
    if name == "contiguous, max_model_len":
        usable = (r.kv_blocks_total // per_req) * per_req / r.kv_blocks_total
        ax.axhline(usable * 100, color="k", ls="--", lw=1, label="above: rounding remainder")
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("% of KV pool slots")
axes[1].legend(loc="lower center", fontsize=7)
axes[0].legend(loc="lower center", fontsize=7)
fig.suptitle(f"llama-2-7b on A10, max_model_len={MAX_LEN}: where the KV cache goes (vLLM §3 taxonomy)", fontsize=11)
fig.tight_layout()
plt.show()

# %% [markdown]
# 左图中，蓝色（Token 状态）只占一小部分，大片粉色是内部碎片；虚线以上那条带子是取整余量。中图内部碎片几乎消失，
# 紫色的外部碎片时有时无：它只在“有请求等着、空闲块够、却没有够长的一段”时出现。右图几乎全是蓝色；
# 偶尔的下探是抢占释放了整条序列的块，以及最后队列排空的收尾阶段。
#
# ## 6.5 动手：模型 × GPU × max_model_len → 容量
#
# 拖动下面的控件，看看换一张卡、换一个模型、或把 `max_model_len` 调大调小，能放下多少 KV、能并发多少序列。
# 注意 `max_model_len` 只影响“按整段预留”的并发数；按需分配的并发数取决于请求的**实际**平均长度。

# %% tags=["nbval-ignore-output"]
import ipywidgets as widgets


def show_capacity(model="llama-2-13b", gpu="a100-80g", tp=1, max_model_len=4096, mean_len=1024,
                  gpu_memory_utilization=0.9):
    cm = make_cost_model(model, gpu, tensor_parallel_size=tp)
    hw = get_hardware(gpu)
    try:
        tokens = cm.kv_capacity_tokens(gpu_memory_utilization)
    except (ModelDoesNotFitError, ValueError) as e:
        print(e)
        return
    kv_gib = tokens * cm.kv_bytes_per_token_per_gpu / GiB
    print(f"{model} on {tp}x{gpu}: {hw.memory_bytes / GiB:.1f} GiB per GPU, weights {cm.weight_bytes_per_gpu / GiB:.1f} GiB, "
          f"KV {kv_gib:.1f} GiB per GPU")
    print(f"KV capacity: {tokens:,} tokens ({cm.kv_bytes_per_token_per_gpu / 1024:.0f} KiB/token/GPU)")
    print(f"contiguous, reserving max_model_len={max_model_len}: {tokens // max_model_len} concurrent sequences")
    print(f"paged, mean actual length {mean_len}: about {tokens // mean_len} concurrent sequences")


widgets.interact(
    show_capacity,
    model=widgets.Dropdown(options=MODELS + ["llama-3-70b", "mistral-7b", "qwen2.5-7b"], value="llama-2-13b"),
    gpu=widgets.Dropdown(options=["a10", "l4", "a100-40g", "a100-80g", "h100", "h200"], value="a100-80g"),
    tp=widgets.Dropdown(options=[1, 2, 4, 8], value=1),
    max_model_len=widgets.SelectionSlider(options=[1024, 2048, 4096, 8192, 16384, 32768], value=4096),
    mean_len=widgets.IntSlider(value=1024, min=128, max=8192, step=128),
    gpu_memory_utilization=widgets.FloatSlider(value=0.9, min=0.5, max=0.98, step=0.01),
);

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
mis, qw = get_model_spec("mistral-7b"), get_model_spec("qwen2.5-7b")
assert mis.head_dim == qw.head_dim == m7.head_dim and mis.dtype_bytes == qw.dtype_bytes == m7.dtype_bytes
assert mis.num_layers == m7.num_layers, "hint 1 says Mistral-7B and Llama-2-7B have as many layers"
EX_LEN = MAX_LEN // 2
chat_len = float((wl.prompt_lens + wl.output_lens).mean())
assert chat_len < EX_LEN, "hint 3 says the chat requests are shorter than the smaller reservation"
EX_FREE, EX_SAME = "AB", ASK                 # exercise 4: release A and B; every reservation this size
ab = [b for name, n in zip("ABCD", SIZES) for b in [name] * n]          # which reservation holds each block
ab_free = [i for i, name in enumerate(ab) if name in EX_FREE]
assert ab_free == list(range(len(ab_free))) and len(ab_free) >= ASK, "hint 4: A and B free one run of blocks"
EX5_PROMPT, EX5_OUT = 1000, 1500             # exercise 5: a workload that makes paging preempt a lot

# %% [markdown]
# ## 本章小结
#
# - 每个 Token 的 KV 字节数是 $2 \cdot L \cdot H_{kv} \cdot d \cdot b$；GQA 通过减少 KV 头数把它成倍缩小，
#   这也是新一代模型（Llama-3、Qwen3）更“好服务”的原因之一。
# - KV 容量 = （显存 × 利用率 − 权重 − 运行时保留量）÷ 每 Token 字节数。模型越大、卡越小，留给 KV 的越少；
#   70B 级模型在单卡上放不下，必须张量并行。
# - 按 vLLM 论文的定义，KV 显存分成 Token 状态、预留（将来会写）、内部碎片（永远不会写）和外部碎片（空闲却分不出去）。
#   按 `max_model_len` 连续预留时，内部碎片是最大的一块；按各自长度预留时内部碎片变小，但大小不一的预留之间出现外部碎片；
#   大小相同的预留没有外部碎片，分不出去的只是取整余量。按需分页只剩每个请求最后一块里至多 $B-1$ 个槽位的内部碎片。
# - 显存浪费直接变成批大小的损失，进而变成吞吐量的损失：在同一张卡、同一负载下，分页分配的批更大、吞吐更高。
#
# 第 7 章将打开 PagedAttention 的黑盒：块表（Block Table）如何把逻辑 Token 映射到物理块，块大小如何取舍，
# 块如何在请求之间共享，以及注意力算子如何从不连续的块里读 KV。
#
# ## 练习
#
# 1. 用 `get_model_spec("mistral-7b")` 和 `get_model_spec("qwen2.5-7b")` 计算它们的 KV 字节数，与 Llama-2-7B 比较，
#    说出差异来自公式里的哪一项。
# 2. 如果把 KV Cache 量化为 FP8（`dtype_bytes=1`），A10 上 Llama-2-13B 的 KV 容量变成多少？
#    `make_cost_model("llama-2-13b", "a10", dtype_bytes=1)` 会把权重也按 1 字节计算，想一想这与“只量化 KV”有何不同。
# 3. 在 6.4 的实验中把 `max_model_len` 改成 {{EX_LEN}}（负载用 `load_workload("chat", n={{N_CHAT}}, max_len={{EX_LEN}})`），
#    重新比较三种分配方式。按 `max_model_len` 预留的劣势变大还是变小？为什么？
# 4. 在 `BlockPool` 的外部碎片小实验里，改为释放 A 和 B（而不是 B 和 D）。现在能分出 {{ASK}} 个连续块吗？
#    外部碎片与分配、释放的顺序有什么关系？如果四个预留都是 {{EX_SAME}} 块，还会出现外部碎片吗？
# 5. （思考）连续预分配从不抢占，分页分配会抢占。设计一个负载，使分页分配的抢占代价大到抵消它的批大小优势，
#    并用模拟器验证。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 三者头维度都是 {{m7.head_dim}}、每个元素 {{m7.dtype_bytes}} 字节；Mistral-7B 与 Llama-2-7B 都是 {{m7.num_layers}} 层，
#    Mistral 用 GQA（{{mis.num_kv_heads}} 个 KV 头），KV 字节数是 Llama-2-7B 的 {{mis.num_kv_heads}}/{{m7.num_kv_heads}}；
#    Qwen2.5-7B 只有 {{qw.num_kv_heads}} 个 KV 头、{{qw.num_layers}} 层，是
#    ({{qw.num_kv_heads}}/{{m7.num_kv_heads}})·({{qw.num_layers}}/{{m7.num_layers}})。差别主要在 $H_{kv}$ 一项。
#    `get_model_spec(name).kv_bytes_per_token` 直接给出结果。
# 2. 两处都减半：权重从约 {{m13.weight_bytes / GiB:.0f}} GiB 变成约 {{m13.weight_bytes / GiB / 2:.0f}} GiB（放得下了），每 Token 的 KV 也减半，所以容量远不止翻倍。
#    只量化 KV 时权重仍是 {{m13.dtype_bytes}} 字节，13B 在 {{get_hardware('a10').memory_bytes / GiB:g}} GiB 的 A10 上依然放不下——量化 KV 救不了放不下的权重。
# 3. 变小：预留只有 {{EX_LEN}} Token，每个请求的内部碎片（预留减去实际长度）少了一大截，并发的预留段数翻倍。
#    `chat` 负载的平均长度约 {{chat_len:.0f}} Token，离 {{EX_LEN}} 更近，Token 状态的占比随之上升。
# 4. 释放 A（块 0–{{SIZES[0] - 1}}）与 B（块 {{SIZES[0]}}–{{SIZES[0] + SIZES[1] - 1}}）后，空闲块 0–{{ab_free[-1]}} 连成一段，
#    {{ASK}} 个连续块分得出来：外部碎片取决于哪些预留相邻地被释放。
#    若所有预留都是 {{EX_SAME}} 块，任何一个被释放的空洞都恰好容纳一个新预留，不会出现外部碎片（见 6.4 节）。
# 5. 让请求的输出很长且长度接近（例如 `output_len=fixed({{EX5_OUT}})`、提示 {{EX5_PROMPT}} Token），并同时到达：分页分配会先接纳很多请求，
#    KV 用尽后反复抢占并重算长前缀（`num_preemptions` 很大），吞吐可能低于连续预留；对比 `preemption_mode="swap"`
#    或 `admission="guaranteed_no_evict"`（第 12 章）。
#
# </details>
