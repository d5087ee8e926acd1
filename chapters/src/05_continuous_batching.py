# %% [markdown]
# # 第 5 章 迭代级调度：连续批处理
#
# 第 4 章的静态批处理与动态批处理窗口都是**请求级**（Request-level）调度：一批请求一起开始，一起结束。对 LLM 来说这有两个症结，
# Orca 论文（Yu et al., *Orca: A Distributed Serving System for Transformer-Based Generative Models*, OSDI'22）把它们说得很清楚：
#
# 1. **先完成的请求回不去**：批里输出短的请求早就生成完了，却要陪着最长的那个跑到底，才能把结果返回给客户端；
# 2. **新来的请求进不来**：批在运行时，新到达的请求只能在队列里等整批结束，哪怕批里已经空出了许多槽位。
#
# Orca 的解法是**迭代级调度**（Iteration-level Scheduling）：调度的单位不再是“一批请求”，而是模型的“一次迭代”（一步，step）。
# 每一步开始前，调度器重新决定这一步算哪些请求：完成的请求立刻离开，新请求立刻加入。这就是今天所说的**连续批处理**
# （Continuous Batching），TensorRT-LLM 称之为 In-flight Batching，vLLM、SGLang、TGI 都以它为基础。
# Orca 在 GPT-3 175B 上报告，在相同延迟水平下，吞吐是 NVIDIA FasterTransformer 的 36.9 倍（论文摘要）。
#
# 关于术语：业界文章有时把连续批处理也叫 dynamic batching（例如下文引用的 Anyscale 博客）。本课程沿用第 1 章的用法：
# “动态批处理”泛指在运行时聚合请求的一类技术；第 4 章的“动态批处理窗口”特指 Triton 式的请求级做法；
# 本章的“连续批处理”特指迭代级调度。
#
# ## 学习目标
#
# - 理解请求级调度的两个症结，以及迭代级调度如何让请求“随时加入、随时离开”；
# - 读懂 minibatch 调度器的一步：在 `max_num_seqs`（序列数上限）与 `max_num_batched_tokens`（**Token 预算**）之下，
#   怎样把解码与（分块的）预填充放进同一个批；
# - 会用引擎的逐步记录（`StepRecord`）画出**批占用率随时间**的变化，用甘特图看每个请求的排队、预填充与解码；
# - 在真实的 tiny 模型（CPU）与模拟的 Llama-2-7B / A100 上，比较请求级与迭代级调度在偏斜（长尾）负载下的吞吐与延迟，
#   并验证一个不变量：无论怎样组批，贪心解码的输出都完全相同。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import minibatch
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.runner import run
from minibatch.scheduler import Scheduler
from minibatch.viz import batch_composition, diagrams, gantt, md_table
from minibatch.workload import fixed, lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter


print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 5.1 从“一批请求”到“一步”
#
# 用 $o_i$ 表示请求 $i$ 的输出长度。请求级批处理中，一批 $\mathcal{B}$ 占用 GPU 的步数是 $\max_{i\in\mathcal{B}} o_i$，
# 其中只有 $\sum_{i} o_i$ 个“槽位步”在做有用的事（第 4 章的填充浪费）。迭代级调度中，一个请求只占用它自己的 $o_i$ 步，
# 它一结束，槽位就交给队列里的下一个请求，所以只要有请求在排队，批就始终是满的：
#
# $$
# \text{请求级：}\ \text{占用}(\mathcal{B}) = |\mathcal{B}|\cdot\max_{i\in\mathcal{B}} o_i,
# \qquad
# \text{迭代级：}\ \text{占用}(i) = o_i .
# $$
#
# 要做到这一点，批里的请求必须可以处在不同的阶段：有的在预填充（Prefill，一次算完整个提示），有的在解码（Decode，每步一个 Token），
# 而且各自的上下文长度不同。Orca 的第二个技术**选择性批处理**（Selective Batching）解决了这个问题：把批里所有请求的 Token
# 拼成一个不填充的长序列，线性层（QKV 投影、MLP）对它一起做矩阵乘；只有注意力按请求分开算（各自读自己的 KV）。
# minibatch 的模型也是这样实现的（注意力用分页 KV，第 7 章），所以一个 step 可以同时含有预填充和解码。
#
# ## 5.2 调度器的一步：序列上限与 Token 预算
#
# 在 minibatch 里，“连续批处理”这个策略本身只有一行：每一步，运行中的请求排在前面（先到先得），等待中的请求按到达顺序排在后面。

# %%
print(inspect.getsource(ContinuousPolicy))

# %% [markdown]
# 真正的工作在调度器（`minibatch.scheduler.Scheduler.schedule`）里，所有策略共用。它沿着策略给出的顺序走一遍，
# 给每个请求分配本步要算的新 Token 数，直到两个预算之一用完：
#
# - **序列数上限** `max_num_seqs`：一步最多容纳几个请求（相当于批大小上限，也限制了同时占用 KV 的请求数）；
# - **Token 预算** `max_num_batched_tokens`：一步最多计算多少个新 Token。
#
# 与 vLLM V1 引擎一样（vLLM v0.10.2 的 `vllm/v1/request.py` 与 `vllm/v1/core/sched/scheduler.py`），minibatch 对每个请求只用
# 两个计数器：`num_tokens`（提示长度 + 已生成的 Token 数）与 `num_computed_tokens`
# （KV 已经写进缓存的 Token 数）。一步中请求要算的新 Token 数就是两者之差：刚到达的请求差整个提示（预填充），
# 解码中的请求差 1 个，被切块的预填充差剩下的部分，被抢占后重算（Recompute）的请求差全部。于是一步的约束就是
#
# $$
# \sum_{i \in \text{step}} n_i \le \texttt{max\_num\_batched\_tokens}, \qquad |\text{step}| \le \texttt{max\_num\_seqs},
# \qquad n_i = \texttt{num\_tokens}_i - \texttt{num\_computed\_tokens}_i .
# $$
#
# 运行中的请求排在前面，所以解码（每个 1 个 Token）先拿预算，剩下的预算给新请求的预填充；开启分块预填充（Chunked Prefill，
# `enable_chunked_prefill=True`，默认）时，放不下的长提示只算预算剩下的那一块，下一步接着算（第 11 章详谈）。
# KV 块不够时，从顺序的末尾抢占运行中的请求（第 12 章）。先看一张示意图：三个解码中的请求各拿 1 个 Token，
# 等待队列里的第一个长提示词拿走剩下的全部预算（被切成一块），第二个只能等下一步：

# %%
diagrams.scheduler_step([("run0", 1), ("run1", 1), ("run2", 1)], [("wait0", 700), ("wait1", 120)],
                        budget=512, max_num_seqs=8)

# %% [markdown]
# 下面是调度器的源码，它做的就是图中这件事：

# %%
print(inspect.getsource(Scheduler.schedule))

# %% [markdown]
# 用模拟器看一眼 Token 预算的效果：一小段提示较长的请求流，预算 `BUDGET`：

# %%
BUDGET = 512                                     # max_num_batched_tokens of this demo
budget_wl = synthetic(40, 20.0, input_len=lognormal(median=512, sigma=0.5, max=2048),
                      output_len=lognormal(median=48, sigma=0.6, max=256), seed=2)
bs = budget_wl.stats()

# %% [markdown]
# {{bs['n']}} 个请求以约 {{bs['rate']:.0f}} req/s 到达，提示长度中位数 {{bs['input_p50']:.0f}} Token，预算设为 {{BUDGET}}。
# `minibatch.viz.batch_composition` 把每一步计算的 Token 画成柱子（蓝色解码、橙色预填充），黑线是这一步的序列数。
# 每一步的柱高都不超过 {{BUDGET}}：解码 Token 先占，剩余的预算被预填充块填满。

# %%
budget_run = run(budget_wl, **SIM, max_num_batched_tokens=BUDGET)
display(batch_composition(budget_run, figsize=(9, 3.6)))
tokens_per_step = [st.num_prefill_tokens + st.num_decode_tokens for st in budget_run.steps]
print(f"{len(budget_run.steps)} steps; max tokens in a step: {max(tokens_per_step)} (budget {BUDGET}); "
      f"steps that mix prefill and decode: {sum(1 for st in budget_run.steps if st.num_prefill_tokens and st.num_decode_tokens)}")

# %% tags=["check"]
assert max(tokens_per_step) <= BUDGET, "the prose above says no step exceeds the budget"

# %% [markdown]
# 实验 **L03**（`labs/L03_continuous.ipynb`）会让你亲手写出这一步调度（`schedule_step`），在大量随机状态上与 minibatch 的
# `Scheduler` 逐一对比，再把它作为策略插进引擎运行。
#
# ## 5.3 在真实的 tiny 模型上跑一次（CPU）
#
# 先在真实模型上看迭代级调度的行为。一组请求同时到达，输出长度服从对数正态分布（有长有短），批大小上限 `max_num_seqs=4`，
# 分别用请求级的 `static` 与迭代级的 `continuous` 策略运行嵌入的 tiny 模型。所有请求在 $t=0$ 到达，所以两次运行的
# **调度决策**（哪一步算哪些请求）与机器快慢无关，是确定的；步长则是在这台 CPU 上实测的，每次运行都会不同。

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)   # the tiny model's matrices are small: one thread avoids oversubscribing a shared CPU
tiny_wl = synthetic(12, float("inf"), input_len=lognormal(median=24, sigma=0.5, max=64),
                    output_len=lognormal(median=12, sigma=0.9, max=64), seed=0)
tiny = {p: run(tiny_wl, model="tiny", policy=p, max_num_seqs=4, num_kv_blocks=64) for p in ("static", "continuous")}
print("output lengths:", tiny_wl.output_lens.tolist())
for p, r in tiny.items():
    s = r.summary()
    print(f"{p:<10} steps {len(r.steps):>3} | mean seqs per step {s['mean_batch_size']:.2f} | "
          f"padding waste {s['padding_waste']:.2f}")
same = all(a.output_token_ids == b.output_token_ids for a, b in zip(tiny["static"].requests, tiny["continuous"].requests))
print("greedy outputs identical under both policies:", same)

# %% tags=["nbval-ignore-output"]
rows = []
for p, r in tiny.items():
    s = r.summary()
    rows.append([p, f"{s['throughput_tok_s']:.0f}", f"{s['ttft_p50'] * 1e3:.0f}", f"{s['e2e_mean'] * 1e3:.0f}",
                 f"{s['e2e_p99'] * 1e3:.0f}", f"{np.mean([st.duration for st in r.steps]) * 1e3:.1f}"])
md_table(["policy (tiny, CPU)", "tok/s", "TTFT p50 (ms)", "E2E mean (ms)", "E2E p99 (ms)", "mean step (ms)"], rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
for ax, (p, r) in zip(axes, tiny.items()):
    seqs = np.array([st.num_seqs for st in r.steps])
    padded = np.array([st.num_padded_slots for st in r.steps])
    x = np.arange(len(seqs))
    ax.bar(x, seqs, width=1.0, color="C0", label="computing")
    ax.bar(x, padded, width=1.0, bottom=seqs, color="C3", alpha=0.5, label="padded (finished, slot held)")
    ax.axhline(4, color="k", ls=":", lw=1, label="max_num_seqs")
    ax.set(xlabel="step", title=f"{p}: {len(seqs)} steps")
    ax.grid(alpha=0.3, axis="y")
axes[0].set_ylabel("sequences per step")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncols=3, fontsize=8, frameon=False)
fig.suptitle("Batch occupancy per step, tiny model on CPU (12 requests at t=0)", fontsize=10)
fig.tight_layout(rect=(0, 0.07, 1, 1))          # the legend below the panels, off the bars
plt.show()

# %%
st_, ct_ = (tiny[p] for p in ("static", "continuous"))

# %% tags=["check"]
assert len(ct_.steps) < len(st_.steps) and same, "the prose says continuous takes fewer steps, same tokens"

# %% [markdown]
# 调度的差别一目了然：`static` 要 {{len(st_.steps)}} 步，平均每步只有 {{st_.summary()['mean_batch_size']:.2f}} 个序列在计算，
# {{st_.summary()['padding_waste']:.0%}} 的槽位步被已结束的请求白白占着（红色）；`continuous` 只要 {{len(ct_.steps)}} 步，
# 批在队列排空之前一直是满的。两种策略下每个请求生成的 Token 完全相同——组批方式只改变**什么时候**算，不改变**算出什么**
# （这是 minibatch 的测试所保证的不变量：贪心解码的结果与 Hugging Face `transformers` 单独生成一致）。
# 至于墙钟上的收益（上面那张表，数字每次运行都会变）：tiny 模型在 CPU 上的步长随批大小增长得比 GPU 快得多
# （CPU 算力小，一个小批就接近算力受限，第 2 章），所以步数的减少只部分转化为吞吐；在 GPU 上解码是访存受限的，
# 步数减少几乎全部转化为吞吐——这就是下一节要在模拟器里看的。

# %% [markdown]
# ## 5.4 在模拟器里放大：偏斜负载下的请求级与迭代级
#
# 现在换到模拟的 Llama-2-7B / A100-80GB，负载是一个输出长度偏斜的在线流（泊松到达，输出长度对数正态，长尾明显）：

# %% tags=["nbval-check-output"]
SKEW = dict(input_len=lognormal(median=256, sigma=0.5, max=1024),
            output_len=lognormal(median=64, sigma=1.0, max=1024))
skew_wl = synthetic(600, 6.0, **SKEW, seed=0)
ws = skew_wl.stats()
print(f"{len(skew_wl)} requests, {ws['rate']:.2f} req/s; output tokens mean {ws['output_mean']:.0f}, "
      f"p50 {ws['output_p50']:.0f}, p99 {ws['output_p99']:.0f}, max {ws['output_max']:.0f}")
MAX_SEQS, TRIM = 32, 0.2                         # one batch limit for all three; steady state: trim 20% at each end
POLICIES = {"static": {}, "dynamic": {"max_wait_ms": 50}, "continuous": {}}

# %% [markdown]
# 提示长度中位数 {{ws['input_p50']:.0f}}，输出长度中位数 {{ws['output_p50']:.0f}}、p99 {{ws['output_p99']:.0f}}。
# 三种策略使用相同的批大小上限 `max_num_seqs={{MAX_SEQS}}`：`static`、`dynamic`（`max_wait_ms={{POLICIES['dynamic']['max_wait_ms']}}`）
# 与 `continuous`。吞吐与延迟都按稳态统计（`summary(trim={{TRIM}})`：去掉到达时间跨度最前与最后 {{TRIM:.0%}} 里到达的请求，
# 吞吐只数这段时间窗里完成的请求）；过载的策略没有稳态，它的延迟会随回放长度一直增长。

# %% tags=["nbval-check-output"]
skew = {p: run(skew_wl, **SIM, policy=p, max_num_seqs=MAX_SEQS, **kw) for p, kw in POLICIES.items()}
md_table(["policy", "throughput (req/s)", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)", "E2E mean (s)", "E2E p99 (s)",
          "mean seqs per step", "padding waste"],
         [[p, f"{s['request_throughput']:.2f}", f"{s['throughput_tok_s']:.0f}", f"{s['ttft_p50']:.3f}",
           f"{s['ttft_p99']:.2f}", f"{s['e2e_mean']:.2f}", f"{s['e2e_p99']:.2f}", f"{s['mean_batch_size']:.1f}",
           f"{s['padding_waste']:.2f}"] for p, s in ((p, {**r.summary(), **r.summary(trim=TRIM)}) for p, r in skew.items())])

# %%
ss, sd, sc = ({**skew[p].summary(), **skew[p].summary(trim=TRIM)} for p in ("static", "dynamic", "continuous"))
whole = skew["continuous"].summary()
lam_c = whole["num_requests"] / whole["duration_s"]                 # Little's law, as in chapter 3
L_c = sum(st.duration * (st.num_running + st.num_waiting) for st in skew["continuous"].steps) / whole["duration_s"]
offered = sc["num_requests"] / sc["window_s"]                      # arrivals per second inside the steady window

# %% tags=["check"]
assert ss["request_throughput"] < 0.9 * offered and sd["request_throughput"] < 0.9 * offered, \
    "the prose says request-level batching is overloaded"
assert abs(sc["request_throughput"] / offered - 1) < 0.05, "the prose says continuous keeps up"
assert abs(L_c / (lam_c * whole["e2e_mean"]) - 1) < 0.05, "the prose says Little's law holds"

# %% [markdown]
# 稳态时间窗里的到达率是 {{offered:.2f}} req/s（整段负载平均 {{ws['rate']:.2f}} req/s），而请求级的 `static` 在这段时间里只完成了
# {{ss['request_throughput']:.2f}} req/s——它已经过载：
# {{ss['padding_waste']:.0%}} 的槽位步被已完成的请求占着，长尾请求把整批拖住，队列越排越长，TTFT p50 达到
# {{ss['ttft_p50']:.1f}} s（这个数取决于回放了多久：过载时没有稳态）。加一个 {{POLICIES['dynamic']['max_wait_ms']}} ms 的窗口（`dynamic`）无济于事
# （{{sd['request_throughput']:.2f}} req/s）：第 4 章说过，高负载下窗口不起作用，瓶颈是等整批跑完。`continuous` 跟上了到达率
# （{{sc['request_throughput']:.2f}} req/s），TTFT p50 只有 {{sc['ttft_p50'] * 1e3:.0f}} ms，平均 E2E 从 {{ss['e2e_mean']:.1f}} s
# 降到 {{sc['e2e_mean']:.1f}} s。
#
# 再看平均每步**在计算**的序列数：两者相近（{{ss['mean_batch_size']:.1f}} 与 {{sc['mean_batch_size']:.1f}}），含义却完全不同。
# `static` 是在队列很长、严重过载时，{{MAX_SEQS}} 个槽位里平均只有这么几个在计算，其余被已完成的请求占着；`continuous` 没有过载，
# 它的并发数只是负载所需——第 3 章的 Little 定律给出 $\lambda \cdot \overline{E2E}$ = {{lam_c:.2f}} × {{whole['e2e_mean']:.2f}}
# ≈ {{lam_c * whole['e2e_mean']:.1f}}，与引擎按时间平均测得的系统内请求数 {{L_c:.1f}} 一致。Anyscale 的博客（Daniel et al.,
# *How continuous batching enables 23x throughput in LLM inference while reducing p50 latency*, 2023）报告借助 vLLM
# （连续批处理加 PagedAttention），吞吐最高可达朴素静态批处理的 23 倍；倍数取决于输出长度有多偏斜、对比的批大小和负载，
# 这里的负载并未把连续批处理推到饱和，所以吞吐之比只反映了 `static` 的饱和点。

# %% [markdown]
# 把三次运行的批占用率随时间画出来（每一步一个点：在计算的序列数；`static`/`dynamic` 额外画出被已完成请求占住的槽位）。
# 请求级策略的锯齿很典型：一批开始时满员，随后成员陆续完成、槽位空转，直到最慢者结束才重新装满；连续批处理的占用率则随到达的请求数平滑起伏。

# %%
fig, axes = plt.subplots(3, 1, figsize=(10, 6.5), sharex=True, sharey=True)
T_MAX = 40.0
for ax, (p, r) in zip(axes, skew.items()):
    t = np.array([st.start_time for st in r.steps])
    keep = t <= T_MAX
    seqs = np.array([st.num_seqs for st in r.steps])[keep]
    held = seqs + np.array([st.num_padded_slots for st in r.steps])[keep]
    ax.fill_between(t[keep], 0, held, step="post", color="C3", alpha=0.35, lw=0, label="slots held (incl. padded)")
    ax.step(t[keep], seqs, where="post", color="C0", lw=0.8, label="sequences computing")
    ax.plot(t[keep], np.array([st.num_waiting for st in r.steps])[keep], color="0.4", lw=0.8, ls="--",
            label="waiting in queue")
    ax.axhline(MAX_SEQS, color="k", ls=":", lw=1)
    ax.set(ylabel="requests", title=p, ylim=(0, 60))
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=7, loc="upper left", ncols=3)
axes[-1].set_xlabel("time (s)")
fig.suptitle(f"Batch occupancy over the first {T_MAX:.0f} s (max_num_seqs={MAX_SEQS}, dotted), skewed outputs at {ws['rate']:.0f} req/s", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# 最后用甘特图看单个请求的经历（开头的一段请求；灰色排队，橙色预填充，蓝色解码）。上图 `static`：后到的请求排队时间越来越长；
# 下图 `continuous`：每个请求到达后几乎立刻开始预填充，短请求很快结束离开，长请求继续解码，互不阻塞。

# %%
for p in ("static", "continuous"):
    fig = gantt(skew[p], max_requests=40, figsize=(9, 3.8))
    fig.axes[0].set_title(f"{p}: first 40 of {len(skew_wl)} requests (skewed outputs, 6 req/s)")
    display(fig)

# %% [markdown]
# ## 5.5 动手：策略、到达率与批大小
#
# 下面的控件在 5.4 节的偏斜负载（取一段较短的回放）上运行一种策略，画出批占用率随时间的变化并打印主要指标。
# 建议试试：把到达率从 2 调到 12 req/s，分别看 `static` 与 `continuous` 在哪里开始过载（队列一路上涨）；再把 `max_num_seqs`
# 调大，看请求级策略的锯齿怎样变得更深。

# %% tags=["nbval-ignore-output"]
def explore(policy="continuous", rate=6.0, max_num_seqs=32):
    r = run(synthetic(200, rate, **SKEW, seed=1), **SIM, policy=policy, max_num_seqs=max_num_seqs)
    s = r.summary()
    t = np.array([st.start_time for st in r.steps])
    fig, ax = plt.subplots(figsize=(9, 3))
    seqs = np.array([st.num_seqs for st in r.steps])
    ax.fill_between(t, 0, seqs + np.array([st.num_padded_slots for st in r.steps]), step="post", color="C3",
                    alpha=0.35, lw=0, label="slots held")
    ax.step(t, seqs, where="post", lw=0.8, label="computing")
    ax.plot(t, [st.num_waiting for st in r.steps], color="0.4", ls="--", lw=0.8, label="waiting")
    ax.set(xlabel="time (s)", ylabel="requests", title=f"{policy}, {rate:g} req/s, max_num_seqs={max_num_seqs}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plt.show()
    print(f"throughput {s['request_throughput']:.2f} req/s ({s['throughput_tok_s']:.0f} tok/s) | "
          f"TTFT p50/p99 {s['ttft_p50']:.3f}/{s['ttft_p99']:.2f} s | E2E mean/p99 {s['e2e_mean']:.2f}/{s['e2e_p99']:.2f} s | "
          f"padding waste {s['padding_waste']:.2f}")


W.interact(explore,
           policy=W.Dropdown(options=["static", "dynamic", "continuous"], value="continuous"),
           rate=W.FloatSlider(value=6.0, min=1.0, max=15.0, step=0.5, continuous_update=False, description="rate (req/s)"),
           max_num_seqs=W.IntSlider(value=32, min=1, max=128, continuous_update=False));

# %% [markdown]
# 想在运行中途切换策略、观察曲线如何变化，可以用实时仪表盘
# `minibatch.widgets.Dashboard(executor="sim", model="llama-2-7b", hardware="a100-80g", policy="static")`：
# 运行时把 `policy` 从 `static` 切到 `continuous`，图上会标出切换时刻。
#
# ## 本章小结
#
# - 请求级调度的两个症结：完成的请求回不去、新请求进不来。Orca（OSDI'22）的**迭代级调度**每一步重新组批，
#   配合**选择性批处理**（线性层拼接计算、注意力按请求计算）让处于不同阶段、不同长度的请求共处一批。
# - minibatch 的 `continuous` 策略只规定顺序（运行中的在前，等待的按到达顺序），调度器在 `max_num_seqs` 和 Token 预算
#   `max_num_batched_tokens` 之下分配每个请求的新 Token 数 $n_i = \texttt{num\_tokens}_i - \texttt{num\_computed\_tokens}_i$：
#   解码先拿预算，剩余的给（分块的）预填充。
# - 在真实 tiny 模型上，连续批处理用更少的步完成同样的工作，输出与静态批处理逐 Token 相同；在模拟的 7B/A100 上，
#   面对长尾输出，请求级批处理在远低于连续批处理的负载下就已过载。
# - 连续批处理让批“始终是满的”，于是新的瓶颈变成了**每一步能放多少请求**——也就是 KV Cache 的容量。第 6、7 章讨论显存管理与 PagedAttention。
#
# ## 练习
#
# 1. **等价的极限。** 如果所有请求的输出长度相同、且同时到达，`static` 与 `continuous` 的步数和吞吐会有差别吗？
#    先推理，再用 5.3 节的设置（`output_len=fixed(16)`）验证。
# 2. **Token 预算。** 在 5.4 节的负载上，把 `max_num_batched_tokens` 分别设为 256、512、2048、8192（`continuous`），
#    比较 TTFT p99 与 TPOT p50。为什么预算太小时 TTFT 变差？太大时谁的延迟会受影响？（第 11 章会用分块预填充系统地回答。）
# 3. **`max_num_seqs` 的两面。** 用 5.5 节的控件，在 10 req/s 下把 `continuous` 的 `max_num_seqs` 从 8 调到 128。吞吐和 TPOT
#    如何变化？结合第 3 章的 Little 定律，解释为什么 `max_num_seqs` 太小会让 TTFT 爆炸。
# 4. **策略切换。** 用 `minibatch.runner.RunController` 在一次运行的中途把策略从 `static` 切换到 `continuous`
#    （`controller.set("policy", "continuous")`，可在 `on_step` 回调里按时间触发），画出批占用率，标出切换时刻。
# 5. **动手实现。** 完成实验 L03：写出调度一步的函数，并让它在随机状态上与 `Scheduler.schedule` 的结果逐一相同。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 没有差别：所有请求同时结束，请求级批处理没有填充浪费，两者每一步算的东西完全相同（步数相同，`padding_waste` 为 0）。
# 2. 预算太小时，长提示词要被切成很多块、分很多步才能算完，TTFT 变长；预算太大时，一步里塞进大段预填充，同一步里解码的
#    请求被拖慢，TPOT（尤其 ITL 的尾部）变差。
# 3. 吞吐随 `max_num_seqs` 增长到一定程度后持平，TPOT 随批增大而变长。由 Little 定律，系统里要容纳 $\lambda \cdot E2E$ 个请求；
#    `max_num_seqs` 小于它时，多出来的请求只能排队，而排队又让 E2E 变长，TTFT 随之爆炸。
# 4. 在 `on_step` 回调里比较 `now` 与切换时刻，调用一次 `controller.set("policy", "continuous")`；`RunResult.reconfigurations`
#    记录了切换时刻，画批占用率时用 `axvline` 标出即可。
# 5. 先按运行中、再按等待中的顺序遍历，给每个请求 `min(num_tokens - num_computed_tokens, 剩余预算)` 个 Token（不分块时
#    放不下就跳过），直到预算或 `max_num_seqs` 用完；L03 的检查会告诉你哪一步与 `Scheduler.schedule` 不同。
#
# </details>
