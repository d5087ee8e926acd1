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
# - 能区分三种浪费：**预留未用**（Reservation）、**内部碎片**（Internal Fragmentation）、**外部碎片**（External Fragmentation），
#   并在 minibatch 引擎里用 `kv_allocator="contiguous"` 与 `"paged"` 实测它们；
# - 看懂显存浪费如何直接变成批大小与吞吐量的损失，为第 7 章的 PagedAttention 做铺垫。

# %%
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

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

print(f"{'model':<12} {'L':>3} {'H':>3} {'H_kv':>4} {'d':>4} {'KiB/token':>9} {'GiB per 4k seq':>14}")
for name in MODELS:
    m = get_model_spec(name)
    by_hand = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
    assert by_hand == m.kv_bytes_per_token
    print(f"{name:<12} {m.num_layers:>3} {m.num_heads:>3} {m.num_kv_heads:>4} {m.head_dim:>4} "
          f"{by_hand / 1024:>9.0f} {by_hand * 4096 / GiB:>14.2f}")

# %%
m7, m13, m70, m8 = (get_model_spec(n) for n in ("llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b"))
display(Markdown(
    f"几点观察（数字由上一格计算）：Llama-3-8B 和 Llama-2-7B 层数、头维度相同，但它只有 {m8.num_kv_heads} 个 KV 头"
    f"（GQA，每 {m8.num_heads // m8.num_kv_heads} 个查询头共用一个），所以每个 Token 的 KV 只有 Llama-2-7B 的 "
    f"{m8.kv_bytes_per_token / m7.kv_bytes_per_token:.2f} 倍；Llama-2-70B 参数是 13B 的 "
    f"{m70.num_params / m13.num_params:.1f} 倍，但同样得益于 GQA，每个 Token 的 KV 反而只有 13B 的 "
    f"{m70.kv_bytes_per_token / m13.kv_bytes_per_token:.2f} 倍。"
    f"一条 4096 Token 的 Llama-2-13B 序列就要 {m13.kv_bytes_per_token * 4096 / GiB:.2f} GiB——"
    "KV Cache 与权重一样，是显存里的“大户”。"))

# %% [markdown]
# ## 6.2 一张 GPU 能放下多少 KV
#
# 推理引擎启动时先加载权重，再把剩下的显存（扣掉 CUDA 上下文、激活值等预留）全部切给 KV Cache。
# vLLM 用 `gpu_memory_utilization`（默认 0.9）限定引擎可用的显存比例。于是：
#
# $$
# N_{\text{tokens}} = \left\lfloor \frac{M_{\text{GPU}} \cdot u - W - R}{\text{kv\_bytes\_per\_token}} \right\rfloor,
# \qquad
# N_{\text{seqs}} = \left\lfloor \frac{N_{\text{tokens}}}{\text{每条序列的 Token 数}} \right\rfloor
# $$
#
# 其中 $M_{\text{GPU}}$ 是显存容量，$u$ 是 `gpu_memory_utilization`，$W$ 是权重字节数，$R$ 是激活与运行时预留。
# minibatch 的模拟器用 `RooflineCostModel.kv_capacity_tokens` 计算它（下面打印其源码的文档部分），
# `SimExecutor` 正是用这个数决定模拟时 KV 池有多少块：

# %%
from minibatch.sim import RooflineCostModel

print(inspect.getdoc(RooflineCostModel.kv_capacity_tokens))

# %% [markdown]
# 下表对 7B / 13B / 70B 在 A10（24 GB）、A100（40 GB 与 80 GB）、H100（80 GB）上逐一计算。
# 每格给出 KV 能容纳的 Token 数，以及两种口径的并发序列数：按 `max_model_len = 4096` **整段预留**时能放几条，
# 以及按一条“典型”请求 1024 Token（输入加输出）**按需分配**时能放几条。放不下权重的组合标为 `does not fit`：

# %% tags=["nbval-check-output"]
GPUS = ["a10", "a100-40g", "a100-80g", "h100"]
MAX_LEN, TYPICAL = 4096, 1024


def capacity(model, gpu, tp=1):
    """(weights GiB per GPU, KV tokens, seqs at MAX_LEN, seqs at TYPICAL) or None if it does not fit."""
    cm = make_cost_model(model, gpu, tensor_parallel_size=tp)
    try:
        tokens = cm.kv_capacity_tokens()
    except ModelDoesNotFitError:
        return None
    return cm.weight_bytes_per_gpu / GiB, tokens, tokens // MAX_LEN, tokens // TYPICAL


print(f"{'model':<12}" + "".join(f"{g:>24}" for g in GPUS))
print(f"{'':<12}" + "".join(f"{'tokens / @4096 / @1024':>24}" for _ in GPUS))
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
          f"weights {c[0]:5.1f} GiB/GPU, KV {c[1]:>9,} tokens, {c[2]:>3} seqs @4096, {c[3]:>4} @1024"))

# %% [markdown]
# 这张表说明三件事：第一，**同一张卡上，模型越大，留给 KV 的空间越少**，13B 在 A10 上连权重都放不下，
# 在 A100-40G 上也只剩很少的 KV 空间——第 1 章的 RAG 案例把 13B 部署在 4 张 A10 上，正是张量并行的典型用法；
# 第二，H100 与 A100-80G 显存容量相同，KV 容量也相同，H100 的优势在算力与带宽（第 2 章），不在容量；第三，并发序列数强烈依赖“每条序列按多长来算”——整段预留 `max_model_len` 与按实际长度分配，差距是数倍。
# 下一节就来看这个差距从哪里来。

# %% [markdown]
# ## 6.3 连续预分配与实际使用
#
# 在 PagedAttention 出现之前，FasterTransformer、Orca 等系统为每个请求在显存里预留一段**连续**的 KV 缓冲区，
# 长度按这个请求“可能的最大长度”（通常就是 `max_model_len`）来定：因为生成开始时没人知道它会输出多少 Token，
# 而注意力算子要求一条序列的 KV 在地址上连续。结果是：大多数请求远没有用满自己的预留。
#
# 用真实数据看一看。Azure LLM 推理公开数据集的对话（conv）轨迹（Splitwise, ISCA'24；随课程放在 `datasets/traces/`，来源与许可证见其中的 `SOURCES.md`）
# 记录了每个请求的输入与输出 Token 数。假设每个请求都按 `max_model_len = 4096` 预留，实际用上的比例是多少？

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
# 预留而没有用到的部分，其他请求也用不了——这是连续预分配最大的一块浪费。vLLM 论文测量了当时的系统，
# 报告 KV Cache 显存中**只有 20.4%–38.2%** 真正存放了 Token 的状态（Kwon et al., SOSP'23, Figure 2），
# 与上面用公开轨迹算出的比例是同一个数量级。

# %% [markdown]
# ## 6.4 三种浪费：预留未用、内部碎片、外部碎片
#
# 设 KV 池有 $N$ 个块，每块 $B$ 个 Token 槽位（slot）。一个已计算 $c$ 个 Token、持有 $k$ 个块的请求：
#
# - **预留未用**（reserved-but-unused）：整块持有、却一个 Token 也没写的块，$(k - \lceil c/B \rceil) \cdot B$ 个槽位。
#   连续预分配一次拿下 $\lceil \text{max\_model\_len}/B \rceil$ 个块，这一项很大；按需分配时它为 0。
# - **内部碎片**（internal fragmentation，又称末块浪费 last-block waste）：最后一个块没写满的槽位，
#   $\lceil c/B \rceil \cdot B - c$，每个请求最多 $B-1$ 个。
# - **外部碎片**（external fragmentation）：空闲的显存加起来够用，却因为不连续而分不出一段足够长的区间，
#   只能让请求在队列里等。
#
# minibatch 的 `KVCacheManager` 在每个 step 之后统计前两项（记入 `StepRecord.kv_reserved_unused` 与
# `kv_internal_waste`，`RunResult.summary()` 给出按时间加权的平均 `kv_reserved_unused_mean`、`kv_internal_waste_mean`）：

# %%
print(inspect.getsource(KVCacheManager.waste_slots))

# %% [markdown]
# 外部碎片要在**可变长度**的连续分配里才看得清。下面直接用引擎的 `BlockPool` 做一个小实验：
# 16 个块，依次为 A、B、C、D 连续分配 5、3、5、3 个块（正好占满），再释放 B 和 D。此时空闲块的总数足够一个 4 块的请求，
# 但没有一段连续空闲区间有那么长——这就是外部碎片。

# %%
pool = BlockPool(16)
runs = {name: pool.allocate_contiguous(n) for name, n in zip("ABCD", [5, 3, 5, 3])}
pool.release(runs.pop("B"))
pool.release(runs.pop("D"))
print("held:", {k: f"blocks {v[0]}-{v[-1]}" for k, v in runs.items()}, " free:", sorted(pool.free_queue))
print(f"{pool.num_free_blocks} free blocks; 4 contiguous blocks: {pool.allocate_contiguous(4)}; "
      f"4 blocks anywhere (paged): {pool.allocate(4)}")

# %% [markdown]
# 按需分配的分页（Paged）方式只要有空闲块就能用，外部碎片在这里根本不存在——这正是第 7 章 PagedAttention 的出发点。
#
# ### 在引擎里实测：`contiguous` 与 `paged`
#
# minibatch 的 `kv_allocator` 选项提供两种分配器（见 `minibatch/kv_cache.py` 模块文档）：
#
# - `"paged"`（默认）：块按需一块一块地分配，可以在池中任意位置；
# - `"contiguous"`：请求被接纳时一次性预留 `max_model_len`（向上取整到块）个**连续**块，模拟分页出现之前的系统。
#
# 实验设置：模拟器里的 Llama-2-7B 跑在一张 A10 上，`max_model_len = 4096`。负载用 `load_workload("chat")`
# （按 Azure conv 轨迹的长度与到达统计拟合的对话负载）的前 120 个请求，其到达速率高于 A10 的处理能力，
# 所以两次运行都处在饱和状态，比较的是**满负荷下**的 KV 利用与吞吐。模拟器是确定性的，每次运行结果完全相同。

# %%
wl = load_workload("chat", n=120, max_len=MAX_LEN)
SETUP = dict(executor="sim", model="llama-2-7b", hardware="a10", max_model_len=MAX_LEN)
results = {alloc: run(wl, kv_allocator=alloc, **SETUP) for alloc in ("contiguous", "paged")}
r0 = results["paged"]
print(f"{len(wl)} requests, mean prompt {wl.prompt_lens.mean():.0f} + output {wl.output_lens.mean():.0f} tokens; "
      f"KV pool {r0.kv_blocks_total} blocks x {r0.config['block_size']} tokens = "
      f"{r0.kv_blocks_total * r0.config['block_size']:,} tokens")


# %% tags=["nbval-check-output"]
def waste_table(results):
    """One row per run: where the KV pool's slots go (time-weighted means over steps)."""
    rows = {}
    for name, r in results.items():
        s = r.summary()
        w = np.array([st.duration for st in r.steps])
        free_waiting = np.array([(1 - st.kv_usage) if st.num_waiting > 0 else np.nan for st in r.steps])
        m = ~np.isnan(free_waiting)
        rows[name] = {
            "tokens": s["kv_util_mean"] - s["kv_reserved_unused_mean"] - s["kv_internal_waste_mean"],
            "reserved_unused": s["kv_reserved_unused_mean"],
            "last_block": s["kv_internal_waste_mean"],
            "free_while_waiting": float((free_waiting[m] * w[m]).sum() / w[m].sum()) if m.any() else 0.0,
            "batch": s["mean_batch_size"],
            "tok_s": s["throughput_tok_s"],
            "preempt": s["num_preemptions"],
        }
    return rows


table = waste_table(results)
print(f"{'allocator':<11} {'tokens':>7} {'reserved':>9} {'last-blk':>9} {'free+wait':>10} "
      f"{'batch':>6} {'out tok/s':>10} {'preempt':>8}")
for name, row in table.items():
    print(f"{name:<11} {row['tokens']:>7.1%} {row['reserved_unused']:>9.1%} {row['last_block']:>9.2%} "
          f"{row['free_while_waiting']:>10.1%} {row['batch']:>6.1f} {row['tok_s']:>10.1f} {row['preempt']:>8}")

# %% [markdown]
# 各列的含义：`tokens` 是真正存放 Token 的槽位占整个池的比例；`reserved` 是预留未用；`last-blk` 是末块浪费；
# `free+wait` 是“**有请求在排队时**池中仍空闲的比例”——对连续分配器，它就是外部碎片：剩下的块凑不出一整段
# `max_model_len`，只能闲着；`batch` 是每个 step 的平均序列数。分页分配器在排队时也有少量空闲，但那不是碎片：
# 任何请求都能用这些块，它们暂时空着，只是因为队首请求这一步要预填充的 Prompt 片段需要的块比空闲块多，
# 而正在解码的请求很快就会把它们用掉。

# %%
c, p = table["contiguous"], table["paged"]
per_req = math.ceil(MAX_LEN / r0.config["block_size"])     # blocks in one contiguous reservation
display(Markdown(
    f"连续预分配时，池子看起来很满，但其中 {c['reserved_unused']:.0%} 是预留未用，真正存放 Token 的只有 "
    f"{c['tokens']:.0%}；{r0.kv_blocks_total} 个块只够 {r0.kv_blocks_total // per_req} 段 {per_req} 块的连续预留，"
    f"剩下的 {r0.kv_blocks_total % per_req} 块永远分不出去，请求排队时平均有 {c['free_while_waiting']:.0%} 的池子闲着；"
    f"平均每步只能跑 {c['batch']:.1f} 条序列。分页分配把 Token 占比提高到 {p['tokens']:.0%}，"
    f"末块浪费只有 {p['last_block']:.1%}，平均批大小升到 {p['batch']:.1f}，输出吞吐从 {c['tok_s']:.0f} 提高到 "
    f"{p['tok_s']:.0f} tokens/s（{p['tok_s'] / c['tok_s']:.1f} 倍）。代价是分页时 KV 可能被用光，"
    f"引擎发生了 {p['preempt']} 次抢占（Preemption，第 12 章详谈）；连续预分配一开始就为每个请求留足了空间，从不抢占。"))

# %% [markdown]
# vLLM 论文在 ShareGPT 等负载上报告，同等延迟下 vLLM 的吞吐是 FasterTransformer 和 Orca 的 2–4 倍（Kwon et al., SOSP'23）。
# 我们的倍数取决于负载的长度分布与 `max_model_len`：请求越短、`max_model_len` 越大，连续预分配浪费越多，差距越大；
# 本实验的负载输入较长（预填充 Prefill 计算占了很大比重，而预填充并不因批更大而变快），所以上面算出的倍数
# 如果低于论文的 2–4 倍并不矛盾：论文的对比负载（ShareGPT、Alpaca）输入更短，且对照系统还要按各自的方式预留。
#
# 把每个 step 之后的 KV 池画出来，浪费的来源一目了然（两次运行时长不同，各用自己的时间轴）：

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


fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharey=True)
for ax, (name, r) in zip(axes, results.items()):
    _, reserved = binned(r, [s.kv_reserved_unused for s in r.steps])
    _, internal = binned(r, [s.kv_internal_waste for s in r.steps])
    t, used = binned(r, [s.kv_usage for s in r.steps])
    ax.stackplot(t, (used - reserved - internal) * 100, internal * 100, reserved * 100,
                 labels=["token states", "last-block waste", "reserved, unused"],
                 colors=["#4e79a7", "#f28e2b", "#ff9d9a"], step="post")
    if name == "contiguous":
        per_req = math.ceil(MAX_LEN / r.config["block_size"])
        usable = (r.kv_blocks_total // per_req) * per_req / r.kv_blocks_total
        ax.axhline(usable * 100, color="k", ls="--", lw=1,
                   label=f"{r.kv_blocks_total // per_req} whole reservations; above: unusable")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"kv_allocator='{name}'", fontsize=10)
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("% of KV pool slots")
fig.suptitle("llama-2-7b on A10, max_model_len=4096: where the KV cache goes", fontsize=11)
plt.show()

# %% [markdown]
# 左图中，蓝色（真正的 Token）只占红色预留的一小部分；虚线以上那条始终空着的带子凑不出一整段预留，
# 是连续分配的外部碎片。右图几乎全是蓝色，橙色的末块浪费细得几乎看不见；偶尔的下探是抢占释放了整条序列的块。
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

# %% [markdown]
# ## 本章小结
#
# - 每个 Token 的 KV 字节数是 $2 \cdot L \cdot H_{kv} \cdot d \cdot b$；GQA 通过减少 KV 头数把它成倍缩小，
#   这也是新一代模型（Llama-3、Qwen3）更“好服务”的原因之一。
# - KV 容量 = （显存 × 利用率 − 权重 − 预留）÷ 每 Token 字节数。模型越大、卡越小，留给 KV 的越少；
#   70B 级模型在单卡上放不下，必须张量并行。
# - 按 `max_model_len` 连续预分配会带来大量**预留未用**，加上**外部碎片**，真正存放 Token 的显存只占一小部分；
#   按需分块分配只剩**末块浪费**（每请求最多 $B-1$ 个槽位）。
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
#    提示：`make_cost_model("llama-2-13b", "a10", dtype_bytes=1)` 会把权重也按 1 字节计算，想一想这与“只量化 KV”有何不同。
# 3. 在 6.4 的实验中把 `max_model_len` 改成 2048（负载用 `load_workload("chat", n=120, max_len=2048)`），
#    重新比较两种分配器。连续预分配的劣势变大还是变小？为什么？
# 4. 在 `BlockPool` 的外部碎片小实验里，换一种释放顺序，使得 7 个空闲块恰好能满足一个 4 块的连续请求。
#    外部碎片与分配、释放的顺序有什么关系？
# 5. （思考）连续预分配从不抢占，分页分配会抢占。设计一个负载，使分页分配的抢占代价大到抵消它的批大小优势，
#    并用模拟器验证。
