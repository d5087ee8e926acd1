# %% [markdown]
# # 第 23 章 抢占式多级反馈队列与公平性
#
# 第 21 章用**预测的**输出长度做最短作业优先，第 22 章按请求自带的优先级调度。两者都要“事先知道”点什么：长度或等级。
# 本章讲两种**不需要事先知道**的做法。第一种是 FastServe（Wu et al., *Fast Distributed Inference Serving for Large Language
# Models*, arXiv:2305.05920）的**跳级加入多级反馈队列**（Skip-join MLFQ）：调度器看不到输出长度，但能看到每个请求
# **已经生成了多少**，生成得越多就把它放得越低——短请求自然先完成，长请求让路，而且让路是**逐 Token 的抢占**
# （Token-level Preemption）。第二种关心的不是单个请求，而是**租户**（Tenant）：一个客户疯狂发请求时，FCFS 会把服务按请求量分给它，
# 其他客户跟着排长队；Sheng et al.（*Fairness in Serving Large Language Models*, OSDI'24）的**虚拟 Token 计数器**
# （VTC, Virtual Token Counter）按“已经得到多少服务”分配，让安静的租户不被洪泛的租户拖垮。
#
# 两者是同一个思想的两种粒度：**谁得到的服务少，谁先被服务**——MLFQ 按请求算，VTC 按租户算。
#
# ## 学习目标
#
# - 从 M/G/1 的 Pollaczek–Khinchine 公式出发，说清楚长尾的长度分布为什么让 FCFS 的平均等待变长（$E[S^2]$ 项）；
# - 写出 MLFQ 的三条规则：第 $i$ 级时间片 $q_i = q_0 \cdot 2^i$、用完即降级、久未服务即提升；以及 FastServe 的跳级加入
#   $i^\ast = \min\{i : q_i \ge c(p)\}$，并读懂 minibatch 的实现（`minibatch/policies/mlfq.py`）；
# - 在模拟的 Llama-2-7B / A100-80G 上、长尾负载、稳态、3 个种子下比较 MLFQ 与 FCFS 的任务完成时间（JCT），按输出长度分组
#   看谁受益、谁付出代价，并用服务容量（Capacity）量化；
# - 写出 VTC 的计数器 $c_u$ 的更新、选择与提升（Lift）规则，以及它对“两个都积压的租户”所给出的服务差上界；
# - 复现“一个租户洪泛”：FCFS 与 VTC 下每个租户随时间得到的服务，以及安静租户的 TTFT；再用 `multi_tenant` 负载看
#   最大最小公平（Max-min Fairness）；
# - 在真实的 tiny 模型上验证：换了调度顺序，贪心输出逐 Token 相同，只有完成的先后变了。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.policies.fair import FairPolicy
from minibatch.policies.mlfq import MLFQPolicy
from minibatch.request import Request
from minibatch.results import capacity, steady_state
from minibatch.runner import run
from minibatch.viz import md_table
from minibatch.workload import RequestSpec, Workload, lognormal, multi_tenant, synthetic

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g", "max_num_seqs": 16}   # this chapter's server
print("minibatch", minibatch.__version__)


def engine_with(policy, **kw):
    """A simulated engine (this chapter's server, ``kw`` overriding) whose scheduler runs ``policy``:
    a registered name, or a Policy instance with its own parameters."""
    cfg = {**SIM, **kw}
    if isinstance(policy, str):
        return LLMEngine(EngineConfig.from_kwargs(**cfg, policy=policy), clock="virtual")
    eng = LLMEngine(EngineConfig.from_kwargs(**cfg), clock="virtual")
    eng.scheduler.policy = policy
    return eng


# %% [markdown]
# 本章的模拟服务器是 Llama-2-7B / A100-80G，`max_num_seqs = {{SIM["max_num_seqs"]}}`：每一步最多 {{SIM["max_num_seqs"]}} 个请求，
# 批的**槽位**是被争用的资源（KV 池足够大，本章的负载不会把它用完，下面的运行里抢占次数都是 0，会打印出来）。
# 槽位少、请求多，谁先占槽位就是调度要决定的事；练习 1 请你把 `max_num_seqs` 调大，看差别怎样缩小。
#
# ## 23.1 长尾与队头阻塞：为什么 FCFS 的平均等待长
#
# 第 3 章的 M/G/1 队列里，FCFS 的平均等待时间由 Pollaczek–Khinchine 公式给出：
#
# $$
# W_\text{FCFS} = \frac{\lambda\, E[S^2]}{2(1-\rho)} = \frac{\rho}{1-\rho}\cdot\frac{E[S^2]}{2E[S]},\qquad \rho = \lambda E[S] .
# $$
#
# 在同样的利用率 $\rho$ 下，等待与 $E[S^2]/E[S]$ 成正比：服务时间的**二阶矩**越大（长尾越重），排在长作业后面的短作业等得越久——
# 这就是**队头阻塞**（Head-of-line Blocking）。LLM 的服务时间大致正比于输出长度。输出长度服从对数正态分布 $\ln S \sim N(\mu, \sigma^2)$ 时，
# $E[S^2]/E[S]^2 = e^{\sigma^2}$：$\sigma$ 从 0.5 到 1.5，这个比值从 {{np.exp(0.5 ** 2):.1f}} 涨到 {{np.exp(1.5 ** 2):.1f}}。
#
# 排队论给了另一条路。如果知道作业的长度，**最短剩余处理时间优先**（SRPT）使平均响应时间最小；不知道长度时，可以按**已经得到的服务**来排：
# 已服务最少的先服务（LAS, Least Attained Service，也叫 FB）。长尾分布下“已经跑了很久的作业”往往还要跑很久，所以 LAS 近似于 SRPT。
# **多级反馈队列**（MLFQ, Multi-Level Feedback Queue）是 LAS 的离散版本：
#
# - 队列分 $K$ 级，第 $i$ 级的**时间片**（Quantum）为 $q_i = q_0 \cdot 2^i$ 个生成的 Token，最后一级不限；
# - 每一步按（级别，进入该级的时间）排序，高级别的请求先占槽位——新到的请求在下一步就能排到正在运行的低级别请求前面
#   （**逐 Token 抢占**；被挤下去的请求暂停，保留 KV，池不够时才让出）；
# - 在一级里生成满 $q_i$ 个 Token 就**降级**（Demotion）到 $i+1$ 级；
# - 超过 `starve_limit_s` 秒没被服务的请求被放回第 0 级（**饥饿提升**，Starvation Promotion），限制长请求的等待。
#
# FastServe 的改动在第一条规则之前：LLM 推理是“半信息不可知”（semi information-agnostic）的——输出长度未知，**输入长度已知**，
# 而第一次迭代（预填充）的耗时随输入长度增长。一个长提示词放进第 0 级，它的预填充本身就比第 0 级的时间片还长，它会挡住第 0 级的短请求，
# 然后马上被降级。于是 FastServe 让新请求**跳级加入**（Skip-join）：直接进入时间片足以覆盖它预填充代价的那一级，
#
# $$
# i^\ast(p) = \min\{\, i : q_i \ge c(p) \,\},\qquad c(p) = \Big\lceil \frac{p}{P_\text{iter}} \Big\rceil ,
# $$
#
# 其中 $c(p)$ 是把长为 $p$ 的预填充折算成“相当于几次解码迭代”，minibatch 取 $P_\text{iter}$ = `prompt_tokens_per_iteration`
# （这么多提示词 Token 的预填充约等于一次解码迭代的时间；也可以传入自己的 `prefill_cost(req)`）。比 $i^\ast$ 高的队列被跳过，省掉了注定要发生的降级。
#
# **minibatch 的 MLFQ 与 FastServe 不完全相同，要说清楚。** FastServe 的时间片以**时间**计：各级的时间片按迭代时间度量、逐级加倍，
# 跳级加入比较的是“第一次迭代（预填充）的耗时”与各级的时间片，预填充本身就要用掉所在级的时间片。minibatch 的时间片以**生成的 Token**计：
# 第 $i$ 级给一个请求 $q_i$ 个 Token（也就是 $q_i$ 次迭代），不管这些迭代各花了多久（批越大、上下文越长，一次迭代越慢）；
# 预填充不计入时间片，只在跳级加入时按 $c(p)$ 折算一次，决定从哪一级进入。所以这里的“跳级加入”是 FastServe 规则的 Token 计数近似：
# 它保留了“长提示词不在最高级挡路”的意图，但一个长提示词即使从第 0 级进入，也要生成满 $q_0$ 个 Token 才降级（23.5 节会看到这让效果变小）。
# 想要按时间的时间片，可以把 `prefill_cost` 与每级的份额都换成以秒计的估计（例如用第 2 章的代价模型），这是本章练习之外的改动。
# 下面是 minibatch 的实现（`minibatch/policies/mlfq.py`，本章读的就是跑实验的代码）：

# %%
print(inspect.getsource(MLFQPolicy.quantum))
print(inspect.getsource(MLFQPolicy.skip_join_level))
print(inspect.getsource(MLFQPolicy.schedule_order))
print(inspect.getsource(MLFQPolicy.on_step))
default_mlfq = MLFQPolicy()
quanta = [default_mlfq.quantum(i) for i in range(default_mlfq.num_levels)]
print("default quanta (tokens per level):", quanta, "| starve_limit_s =", default_mlfq.starve_limit_s)

# %% [markdown]
# 默认 {{default_mlfq.num_levels}} 级，时间片为 {{quanta[:-1]}} 个 Token，最后一级不限；`starve_limit_s` = {{default_mlfq.starve_limit_s:.0f}} s；
# `prompt_tokens_per_iteration` = {{default_mlfq.prompt_tokens_per_iteration}}，即提示词不超过 {{quanta[0] * default_mlfq.prompt_tokens_per_iteration}}
# Token 的请求从第 0 级进入，再长的从下面某一级进入。
# `schedule_order` 每一步先给第一次见到的请求跳级加入、把饿太久的请求提升，再整体排序；`on_step` 在每一步之后给跑过的请求记账、降级。
# 注意 `preemptive = True`：等待中的请求排在运行中的请求前面时，调度器可以让运行中的请求暂停（第 12 章的 `_pick_victim` 在池不够时
# 从顺序末尾挑抢占对象，末尾正是最低级的请求）。
#
# FastServe 的论文还有一半是显存：被暂停的请求仍占着 KV，它们多了，GPU 显存就不够了。FastServe 因此设计了**主动的**
# KV 卸载与上载（proactively offloads and uploads，在 GPU 显存与主机内存之间搬运即将不用/即将要用的请求的 KV；arXiv:2305.05920 摘要）。
# minibatch 没有实现这部分：暂停的请求一直保留 KV，池不够时按第 12 章的规则抢占（重算或换出）。23.3 节会量出 MLFQ 让多少请求同时占着 KV。
#
# ## 23.2 一个小例子：请求怎样一级一级沉下去
#
# 4 个长请求（提示词 256、生成 300 Token）在 0 时刻前后到达，占满了 4 个槽位（这个例子里 `max_num_seqs=4`）；0.5 s 起每 0.1 s 来一个短请求
# （生成 8 Token）。每一步记下每个请求所在的级别：

# %%
demo_specs = [RequestSpec(0.01 * i, 256, 300, request_id=f"long{i}") for i in range(4)]
demo_specs += [RequestSpec(0.5 + 0.1 * i, 256, 8, request_id=f"short{i}") for i in range(12)]
demo_wl = Workload(demo_specs)
levels: dict[str, list[tuple[float, int]]] = {}


def record_levels(eng, step):
    for rid, r in eng.requests.items():
        if "mlfq_level" in r.policy_state and not r.is_finished:
            levels.setdefault(rid, []).append((step.start_time + step.duration, r.policy_state["mlfq_level"]))


demo = {}
for name in ("continuous", "mlfq"):
    eng = engine_with(MLFQPolicy() if name == "mlfq" else "continuous", max_num_seqs=4)
    demo[name] = run(demo_wl, engine=eng, on_step=record_levels if name == "mlfq" else None)
    if name == "mlfq":
        demo_policy = eng.scheduler.policy


def mean_e2e(result, prefix):
    return float(np.mean([q.e2e for q in result.requests if q.request_id.startswith(prefix)]))


fig, ax = plt.subplots(figsize=(9, 3))
for rid in ["long0", "long3", "short0", "short5", "short11"]:
    t, lv = zip(*levels[rid])
    ax.step(t, lv, where="post", label=rid, lw=1.5 if rid.startswith("long") else 1)
ax.invert_yaxis()
ax.set(xlabel="time (s)", ylabel="MLFQ level (0 = highest)",
       title="Levels over time: long requests sink, short ones stay on top")
ax.legend(fontsize=7, ncol=5)
ax.grid(alpha=0.3)
plt.show()
demo_rows = [[name, f"{mean_e2e(r, 'short'):.2f}", f"{mean_e2e(r, 'long'):.2f}"] for name, r in demo.items()]
md_table(["policy", "short requests: mean E2E (s)", "long requests: mean E2E (s)"], demo_rows)
print("demotions:", demo_policy.num_demotions, "| promotions:", demo_policy.num_promotions)
short_gain = mean_e2e(demo["continuous"], "short") / mean_e2e(demo["mlfq"], "short")
long_loss = mean_e2e(demo["mlfq"], "long") / mean_e2e(demo["continuous"], "long")
assert short_gain > 4 and long_loss > 1, "the prose says short requests gain a lot and long ones lose a little"
assert all(lv[-1][1] == demo_policy.num_levels - 1 for rid, lv in levels.items() if rid.startswith("long"))

# %% [markdown]
# 长请求每生成满一级的时间片就降一级（这次运行共降级 {{demo_policy.num_demotions}} 次），最后都沉到第 {{demo_policy.num_levels - 1}} 级；
# 短请求一到就在第 0 级，只生成 8 个 Token，在第 0、1 级里就做完了。FCFS 下短请求要等 4 个长请求中的某一个结束才有槽位，
# MLFQ 下短请求的平均 E2E 缩短为 FCFS 的 1/{{short_gain:.0f}}，长请求的平均 E2E 变为 {{long_loss:.2f}} 倍——短请求借用的是长请求的时间，
# 而短请求很短，长请求多等的时间不多。
#
# ## 23.3 长尾负载：MLFQ 与 FCFS 的任务完成时间
#
# **任务完成时间**（JCT, Job Completion Time）是 FastServe 论文的指标，对一个请求来说就是它的端到端延迟（E2E）。负载：
# 提示词中位数 256（对数正态，$\sigma = 0.8$），输出中位数 32、$\sigma = 1.5$、最长 2048——一条很重的尾巴。每个种子 400 个请求，泊松到达，
# 12 req/s；稳态指标用 `summary(trim=0.2)`（只统计到达时间落在中间 60% 的请求），3 个负载种子，报告中位数。
# 先看一眼尾巴有多重（打印的 $E[S^2]/E[S]^2$ 是样本值，比公式的 $e^{2.25}$ 小，因为输出被截断在 2048，且有限样本很少抽到极端的尾部）：

# %%
LONGTAIL = {"input_len": lognormal(median=256, sigma=0.8, max=4096), "output_len": lognormal(median=32, sigma=1.5, max=2048)}
N_REQ, RATE, SEEDS = 400, 12.0, [1, 2, 3]
BUCKETS = [(1, 32, "<= 32"), (33, 256, "33-256"), (257, 10**9, "> 256")]


def workload(seed, rate=RATE, n=N_REQ):
    return synthetic(n, rate, **LONGTAIL, seed=seed)


wl1 = workload(1)
out = wl1.output_lens.astype(float)
second_moment = float(np.mean(out ** 2) / np.mean(out) ** 2)
print(f"seed 1: output mean {out.mean():.0f}, p50 {np.median(out):.0f}, p99 {np.percentile(out, 99):.0f}, "
      f"max {out.max():.0f}; "
      f"E[S^2]/E[S]^2 = {second_moment:.1f} (lognormal sigma 1.5: e^2.25 = {np.exp(2.25):.1f}, before the cap at 2048)")

runs = {}
for seed in SEEDS:
    wl = wl1 if seed == 1 else workload(seed)
    for name in ("continuous", "mlfq"):
        runs[name, seed] = run(wl, engine=engine_with(name))


def steady(result):
    return steady_state(result.requests, 0.2)


def med(name, fn):
    """Median over seeds of fn(run)."""
    return float(np.median([fn(runs[name, s]) for s in SEEDS]))


KEYS = [("e2e_mean", "JCT mean"), ("e2e_p50", "JCT p50"), ("e2e_p99", "JCT p99"), ("ttft_p50", "TTFT p50"),
        ("ttft_p99", "TTFT p99"), ("throughput_tok_s", "output tok/s")]
summ = {(n, s): runs[n, s].summary(trim=0.2) for n in ("continuous", "mlfq") for s in SEEDS}
table = {n: {k: float(np.median([summ[n, s][k] for s in SEEDS])) for k, _ in KEYS} for n in ("continuous", "mlfq")}
md_table(["policy (median of 3 seeds)"] + [f"{label} ({'s' if 'tok' not in k else 'tok/s'})" for k, label in KEYS],
         [[n] + [f"{table[n][k]:.0f}" if "tok" in k else f"{table[n][k]:.2f}" for k, _ in KEYS] for n in table])
preempts = sum(summ[k]["num_preemptions"] for k in summ)
print("preemptions in all six runs:", preempts)
assert preempts == 0, "the prose says the KV pool never runs short in this chapter's MLFQ runs"

# %%
def bucket_e2e(result, lo, hi):
    v = [q.e2e for q in steady(result) if lo <= q.output_len <= hi]
    return float(np.mean(v)) if v else float("nan")


bucket = {(n, b[2]): med(n, lambda r, b=b: bucket_e2e(r, b[0], b[1])) for n in ("continuous", "mlfq") for b in BUCKETS}
share = {b[2]: float(np.mean([(b[0] <= o <= b[1]) for o in out])) for b in BUCKETS}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
xb = np.arange(len(BUCKETS))
for k, (name, col) in enumerate((("continuous", "C3"), ("mlfq", "C0"))):
    ax1.bar(xb + (k - 0.5) * 0.38, [bucket[name, b[2]] for b in BUCKETS], 0.38, color=col, label=name)
ax1.set_xticks(xb, [f"output {b[2]}\n({share[b[2]]:.0%} of requests)" for b in BUCKETS], fontsize=8)
ax1.set(yscale="log", ylabel="mean JCT (s), median of 3 seeds", title="Who gains, who pays: JCT by output length")
ax1.legend(fontsize=7)
ax1.grid(alpha=0.3, axis="y")
for name, col in (("continuous", "C3"), ("mlfq", "C0")):
    st = runs[name, 1].steps
    ax2.plot([s.start_time for s in st], [s.num_running for s in st], lw=0.7, color=col, label=name)
ax2.axhline(SIM["max_num_seqs"], color="k", ls=":", lw=1, label="max_num_seqs")
ax2.set(xlabel="time (s)", ylabel="requests holding KV", title="Paused requests keep their KV (seed 1)")
ax2.legend(fontsize=7)
ax2.grid(alpha=0.3)
fig.tight_layout()
plt.show()
held = {n: max(s.num_running for s in runs[n, 1].steps) for n in ("continuous", "mlfq")}
print("JCT by output length (s):", {k: round(v, 2) for k, v in bucket.items()}, "| most requests holding KV:", held)
t_fc, t_ml = table["continuous"], table["mlfq"]

# %% tags=["check"]
assert t_ml["e2e_p50"] < 0.7 * t_fc["e2e_p50"] and t_ml["ttft_p99"] < t_fc["ttft_p99"] / 3, "MLFQ: p50 JCT, TTFT tail"
assert t_ml["e2e_mean"] < t_fc["e2e_mean"], "the prose says the mean JCT also falls, if less"
assert t_ml["e2e_p99"] > t_fc["e2e_p99"], "the prose says the p99 JCT (the longest requests) rises"
assert bucket["mlfq", "<= 32"] < bucket["continuous", "<= 32"] and bucket["mlfq", "> 256"] > bucket["continuous", "> 256"]
assert held["mlfq"] > held["continuous"] == SIM["max_num_seqs"]

# %% [markdown]
# 种子 1 的输出长度 $E[S^2]/E[S]^2$ = {{second_moment:.1f}}：中位数只有 {{np.median(out):.0f}} Token，p99 却有 {{np.percentile(out, 99):.0f}}。三个种子的中位数：
#
# - **短请求大幅受益**：JCT 的 p50 从 {{t_fc["e2e_p50"]:.2f}} s 降到 {{t_ml["e2e_p50"]:.2f}} s；TTFT 的 p99 从 {{t_fc["ttft_p99"]:.2f}} s
#   降到 {{t_ml["ttft_p99"]:.2f}} s——多数新请求一到就在第 0 级，下一步就能拿到槽位；
# - **平均 JCT 也降了，但降得少**：{{t_fc["e2e_mean"]:.2f}} s → {{t_ml["e2e_mean"]:.2f}} s。平均值被少数长请求主导；
# - **长请求付出代价**：JCT 的 p99 从 {{t_fc["e2e_p99"]:.2f}} s 升到 {{t_ml["e2e_p99"]:.2f}} s。按输出长度分组（左图）：输出不超过 32 Token 的
#   请求（占 {{share["<= 32"]:.0%}}）平均 JCT 从 {{bucket["continuous", "<= 32"]:.2f}} s 降到 {{bucket["mlfq", "<= 32"]:.2f}} s，
#   超过 256 Token 的请求（占 {{share["> 256"]:.0%}}）从 {{bucket["continuous", "> 256"]:.1f}} s 升到 {{bucket["mlfq", "> 256"]:.1f}} s；
# - 吞吐几乎不变（{{t_fc["throughput_tok_s"]:.0f}} 与 {{t_ml["throughput_tok_s"]:.0f}} tok/s）：调度只改变了**先后**，没有增加工作量。
#
# 右图是代价的另一面：FCFS 下占着 KV 的请求数不超过槽位数 {{SIM["max_num_seqs"]}}，MLFQ 下被暂停的请求也占着 KV，种子 1 里最多
# {{held["mlfq"]}} 个请求同时持有 KV。这里池够大，所以没有抢占；池紧时这些请求就要被换出或重算——这正是 FastServe 要主动卸载 KV 的原因。
#
# 发表的数字（作为对照，不是本章复现的）：FastServe 第一版（arXiv:2305.05920v1，原型基于 NVIDIA FasterTransformer）报告与 Orca 相比，
# 平均与尾部 JCT 最多改善 5.1 倍与 6.4 倍；第三版（arXiv:2305.05920v3）报告与 vLLM 相比，在相同的平均与尾部延迟要求下吞吐最多提高
# 31.4 倍与 17.9 倍；NSDI'26 的版本写的是与 vLLM 相比吞吐最多提高 6.1 倍。论文的负载与硬件都和这里不同，倍数不可直接比较。
#
# ## 23.4 负载与服务容量：看 TTFT 的 SLO，也看长请求
#
# 改变到达率（种子 1），对每个到达率计算稳态的 JCT 与 SLO 达成率。SLO 取 TTFT ≤ 0.5 s（每个请求分别判断），服务容量是达成率不低于 90%
# 的最高到达率（`minibatch.results.capacity`，对扫描结果取值）：

# %%
RATES = [8.0, 10.0, 12.0, 14.0]
SLO, TARGET = {"ttft": 0.5}, 0.9
sweep = {}
for rate in RATES:
    for name in ("continuous", "mlfq"):
        res = runs[name, 1] if rate == RATE else run(workload(1, rate), engine=engine_with(name))
        s = res.summary(trim=0.2, slo=SLO)
        long_jct = [q.e2e for q in steady(res) if q.output_len > 256]
        sweep[name, rate] = dict(s, long_jct=float(np.mean(long_jct)))
cap = {n: capacity({r: sweep[n, r]["slo_attainment"] for r in RATES}, target=TARGET) for n in ("continuous", "mlfq")}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
for name, col in (("continuous", "C3"), ("mlfq", "C0")):
    ax1.plot(RATES, [sweep[name, r]["e2e_p50"] for r in RATES], "o-", color=col, label=f"{name}: JCT p50")
    ax1.plot(RATES, [sweep[name, r]["long_jct"] for r in RATES], "s--", color=col, label=f"{name}: mean JCT, output > 256")
    ax2.plot(RATES, [sweep[name, r]["slo_attainment"] * 100 for r in RATES], "o-", color=col, label=name)
ax1.set(xlabel="request rate (req/s)", ylabel="s", yscale="log", title="JCT vs load (seed 1, steady state)")
ax2.axhline(TARGET * 100, color="k", ls=":", lw=1)
ax2.set(xlabel="request rate (req/s)", ylabel="% requests with TTFT <= 0.5 s", title="SLO attainment")
for ax in (ax1, ax2):
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
fig.tight_layout()
plt.show()
COLS = ("attainment", "JCT p50 (s)", "JCT out>256 (s)")


def sweep_cells(n, r):
    v = sweep[n, r]
    return [f"{v['slo_attainment']:.0%}", f"{v['e2e_p50']:.2f}", f"{v['long_jct']:.1f}"]


md_table(["rate (req/s)"] + [f"{n}: {k}" for n in ("continuous", "mlfq") for k in COLS],
         [[r] + sweep_cells("continuous", r) + sweep_cells("mlfq", r) for r in RATES])
print("capacity at TTFT <= 0.5 s for 90% of requests:", cap)
assert cap["mlfq"] == RATES[-1] > cap["continuous"], "the prose: MLFQ meets the SLO at every rate, FCFS does not"
assert all(sweep["mlfq", r]["long_jct"] > sweep["continuous", r]["long_jct"] for r in RATES[1:])

# %% [markdown]
# 在这个 SLO 下，FCFS 的服务容量是 {{cap["continuous"]:.0f}} req/s；MLFQ 在扫描的最高点 {{RATES[-1]:.0f}} req/s 仍达标，容量不低于它
# （只扫了这 {{len(RATES)}} 个到达率，容量的分辨率就是扫描的间隔）。但这个 SLO **看不见**长请求：在 {{RATES[-1]:.0f}} req/s 下，输出超过 256 Token 的请求平均 JCT 在 FCFS 下是
# {{sweep["continuous", RATES[-1]]["long_jct"]:.1f}} s、在 MLFQ 下是 {{sweep["mlfq", RATES[-1]]["long_jct"]:.1f}} s。选调度策略之前，先问清楚 SLO 约束的是谁：
# 只约束 TTFT 的 SLO 会奖励一切“先给新请求一个 Token”的策略。
#
# ## 23.5 跳级加入的作用
#
# 跳级加入只在**提示词**长短不一时起作用。换一个提示词也长尾的负载（中位数 256、$\sigma = 1.2$、最长 8192），比较三种做法：FCFS、
# MLFQ（跳级加入）、以及让所有请求都从第 0 级进入的 MLFQ（`prefill_cost=lambda r: 0`）：

# %%
LONGPROMPT = {"input_len": lognormal(median=256, sigma=1.2, max=8192), "output_len": LONGTAIL["output_len"]}
wl_lp = synthetic(N_REQ, RATE, **LONGPROMPT, seed=1)
variants = {"continuous": "continuous", "mlfq (skip-join)": MLFQPolicy(),
            "mlfq (all join level 0)": MLFQPolicy(prefill_cost=lambda r: 0)}
skip = {}
for name, pol in variants.items():
    eng = engine_with(pol)
    res = run(wl_lp, engine=eng)
    mid = steady(res)
    short_p = [q for q in mid if q.prompt_len < 512]
    skip[name] = {"demotions": getattr(eng.scheduler.policy, "num_demotions", 0),
                      "ttft_short_p99": float(np.percentile([q.ttft for q in short_p], 99)),
                      "jct_short": float(np.mean([q.e2e for q in short_p])), "jct_mean": res.summary(trim=0.2)["e2e_mean"]}
entry = np.bincount([default_mlfq.skip_join_level(Request("x", [1] * int(p), SamplingParams(), 0.0))
                     for p in wl_lp.prompt_lens], minlength=default_mlfq.num_levels)
md_table(["policy", "demotions", "TTFT p99, prompts < 512 (s)", "mean JCT, prompts < 512 (s)", "mean JCT, all (s)"],
         [[n, v["demotions"], f"{v['ttft_short_p99']:.3f}", f"{v['jct_short']:.2f}", f"{v['jct_mean']:.2f}"]
          for n, v in skip.items()])
print("skip-join entry level of each request (level: count):", dict(enumerate(entry.tolist())))
sj, l0 = skip["mlfq (skip-join)"], skip["mlfq (all join level 0)"]
assert sj["demotions"] < l0["demotions"], "the prose says skip-join saves demotions"
assert sj["jct_mean"] >= skip["continuous"]["jct_mean"], "the prose says MLFQ's mean JCT is no better here"

# %% [markdown]
# 跳级加入把 {{int(entry[1:].sum())}} 个长提示词的请求直接放到第 1 级及以下（各级人数见上面的打印），这次运行的降级次数从
# {{l0["demotions"]}} 次减到 {{sj["demotions"]}} 次。对短提示词请求的 TTFT p99，两者是 {{l0["ttft_short_p99"]:.3f}} s 与
# {{sj["ttft_short_p99"]:.3f}} s——只有一个种子，差别也小，不足以下结论。在 minibatch 里这个效应不大，一个可能的原因是：
# 时间片以**生成的 Token**计，长提示词的请求即使从第 0 级进入，做完预填充、生成 {{quanta[0]}} 个 Token 就降级了，挡住别人的时间只有那一次预填充；
# 而分块预填充（第 11 章）又把这次预填充切成了块。另外，在这个提示词也长尾的负载上，MLFQ 的**平均** JCT
# （{{sj["jct_mean"]:.2f}} s）反而不比 FCFS（{{skip["continuous"]["jct_mean"]:.2f}} s）好：
# 长提示词、长输出的请求被一再推后。MLFQ 的收益取决于负载，不是白来的。
#
# ## 23.6 多租户：按租户算的“谁得到的少，谁先来”
#
# MLFQ 关心单个请求。生产里的另一个问题是**租户**（Tenant，一个用户、一个应用或一个 API key）：租户 A 一口气发来大量请求时，
# FCFS 会让所有人排在 A 的请求后面。常见的办法是**速率限制**（Rate Limit，例如每分钟请求数 RPM），但它在系统空闲时也限制 A，浪费了容量。
# VTC 的目标是**工作保持**（Work-conserving：只要有请求在等，就不让资源空着）的公平。它定义租户 $u$ 在时间段 $[t_1, t_2)$ 内得到的服务为
#
# $$
# W_u(t_1, t_2) = w_p \cdot (\text{处理的输入 Token 数}) + w_q \cdot (\text{生成的输出 Token 数}),
# $$
#
# 论文取 $w_p = 1$、$w_q = 2$（一个输出 Token 的代价约为输入 Token 的两倍）。每个租户有一个计数器 $c_u$：
#
# - **记账**：每一步之后 $c_u \mathrel{+}= (w_p \cdot \Delta\text{input} + w_q \cdot \Delta\text{output}) / \text{weight}_u$（加权 VTC 用 $\text{weight}_u$ 给租户不同的份额）；
# - **选择**：运行中的请求继续运行；等待中的请求一个一个地接纳，每次从**积压**（Backlogged：有请求在等）的租户中选计数器**最小**的那个，取它最早的请求；
# - **提升**（Counter Lift）：一个租户从“没有请求在等”变为积压时，把它的计数器提到其他活跃租户的最小值，$c_u \leftarrow \max(c_u, \min_{v} c_v)$——
#   闲着不能攒额度，否则它回来后会独占一段时间。
#
# Sheng et al. 证明：对任意两个在某段时间内**都积压**的租户，VTC 给它们的服务之差有一个与时间长度无关的常数上界（由最长输入与一批能容纳的 Token 数决定，
# arXiv:2401.00588v1 的摘要称之为“2× tight upper bound”）；FCFS 按到达分配，差距随时间无限增长。minibatch 的测试 `tests/test_policy_behaviour.py`
# 在一个模拟过载上检查上界 $2(w_p L_\text{in,max} + w_q L_\text{out,max})$。实现（`minibatch/policies/fair.py`）：

# %%
print(inspect.getsource(FairPolicy.schedule_order))
print(inspect.getsource(FairPolicy.on_step))

# %% [markdown]
# 与论文的参考实现（VTC-artifact，commit 192c2e2，`slora/server/router/vtc_req_queue.py` 的 `VTCReqQueue`）对照：它的默认价格也是
# `input_price=1`、`output_price=2`；它在**接纳**请求时就把整段输入记到计数器上，每个解码步再给批里每个请求加 `output_price`（`update_counter`），
# minibatch 则在每一步之后按实际计算的 Token 记账，接纳时只“暂记”提示词以便同一步里的接纳在租户之间交替。提升的参照集合也略有不同：
# 参考实现取“还有请求在等待队列里”的租户的最小计数器，minibatch 取“有请求在等待或在运行”的租户。
# 主流框架没有内置这类调度：vLLM 的 `SchedulerConfig.policy` 只有 `"fcfs"`（默认）与 `"priority"` 两个取值
# （`vllm/config/scheduler.py`，commit 01230b4 的 `SchedulerPolicy = Literal["fcfs", "priority"]`）。
#
# ## 23.7 实验：一个租户洪泛
#
# 租户 A 在 20 s 内以 16 req/s 洪泛（远超这台服务器的处理能力），租户 B 安静地以 2 req/s 发请求；两者的长度分布相同。
# 对每个租户，按 VTC 的代价（输入 ×1 + 输出 ×2）从请求记录里算出截至时刻 $t$ 得到的累计服务 $W_u(0, t)$——对 FCFS 与 VTC 用同一把尺子。
# 3 个负载种子，表中是中位数，图是种子 1：

# %%
TENANT_LEN = {"input_len": lognormal(median=256, sigma=0.6, max=2048),
              "output_len": lognormal(median=96, sigma=0.7, max=1024)}
FLOOD_S = 20.0


def two_tenants(rate_a=16.0, rate_b=2.0, seed=1):
    """Tenants A and B, Poisson at their rates, every arrival in [0, FLOOD_S)."""
    def one(rate, tenant, s):
        n = int(2 * rate * FLOOD_S) + 10          # more than enough, then cut at FLOOD_S
        return synthetic(n, rate, **TENANT_LEN, seed=s, tenants=[tenant], name=tenant).time_window(0.0, FLOOD_S)
    return one(rate_a, "A", seed).merge(one(rate_b, "B", seed + 100), name="flood")


def service(records, tenant, grid, w_in=1.0, w_out=2.0):
    """Cumulative weighted service W_u(0, t) on ``grid``: prompt tokens at the first token, output tokens at each token."""
    rs = [q for q in records if q.tenant == tenant and q.first_token_time is not None]
    t_in = np.array([q.first_token_time for q in rs])
    p_in = np.array([q.prompt_len for q in rs], dtype=float)
    t_out = np.sort(np.concatenate([q.token_times for q in rs]))
    return np.array([w_in * p_in[t_in <= t].sum() + w_out * np.searchsorted(t_out, t, side="right") for t in grid])


grid = np.linspace(0, FLOOD_S, 81)
W0, W1 = 5.0, FLOOD_S          # window in which A is backlogged throughout (after the first 5 s)


def flood_stats(res):
    sa, sb = service(res.requests, "A", [W0, W1]), service(res.requests, "B", [W0, W1])
    b_ttft = [q.ttft for q in res.requests if q.tenant == "B"]
    return {"rate_a": (sa[1] - sa[0]) / (W1 - W0), "rate_b": (sb[1] - sb[0]) / (W1 - W0),
            "b_ttft_p50": float(np.median(b_ttft)), "b_ttft_p99": float(np.percentile(b_ttft, 99)),
            "a_ttft_p50": float(np.median([q.ttft for q in res.requests if q.tenant == "A"])),
            "end": max(q.finish_time for q in res.requests)}

# %%
flood, flood_per_seed, b_demands = {}, {}, []
for seed in SEEDS:
    wl_f = two_tenants(seed=seed)
    b_demands.append(sum(r.prompt_len + 2 * r.max_tokens for r in wl_f if r.tenant == "B") / FLOOD_S)
    for name in ("continuous", "fair"):
        res = run(wl_f, engine=engine_with(name))
        flood_per_seed[name, seed] = flood_stats(res)
        if seed == SEEDS[0]:
            flood[name] = res                  # seed 1's runs, for the figures
fl = {n: {k: float(np.median([flood_per_seed[n, s][k] for s in SEEDS])) for k in flood_per_seed[n, 1]}
      for n in ("continuous", "fair")}
b_demand = float(np.median(b_demands))

fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, (name, res) in zip(axes[:2], flood.items()):
    for tenant, col in (("A", "C1"), ("B", "C2")):
        ax.plot(grid, service(res.requests, tenant, grid) / 1e3, color=col, label=f"tenant {tenant}")
    ax.set(xlabel="time (s)", ylabel="cumulative service (k weighted tokens)", title=f"{name}: service per tenant")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
for name, col in (("continuous", "C3"), ("fair", "C0")):
    bs = sorted((q.arrival_time, q.ttft) for q in flood[name].requests if q.tenant == "B")
    axes[2].plot(*zip(*bs), "o-", ms=3, color=col, label=name)
axes[2].set(xlabel="arrival time (s)", ylabel="TTFT of tenant B (s)", yscale="log", title="The quiet tenant's TTFT")
axes[2].legend(fontsize=7)
axes[2].grid(alpha=0.3, which="both")
fig.tight_layout()
plt.show()
md_table(["policy (median of 3 seeds)", f"A: service rate {W0:.0f}-{W1:.0f} s", "B: service rate", "B: TTFT p50 / p99 (s)", "A: TTFT p50 (s)",
          "last request done (s)"],
         [[n, f"{v['rate_a']:,.0f}", f"{v['rate_b']:,.0f}", f"{v['b_ttft_p50']:.2f} / {v['b_ttft_p99']:.2f}",
           f"{v['a_ttft_p50']:.1f}", f"{v['end']:.1f}"] for n, v in fl.items()])
print(f"tenant B asks for {b_demand:,.0f} weighted tokens/s on average (median of 3 seeds); figures: seed 1")
fc, vt = fl["continuous"], fl["fair"]
half = (vt["rate_a"] + vt["rate_b"]) / 2
b_fcfs = [q.ttft for q in sorted(flood["continuous"].requests, key=lambda q: q.arrival_time) if q.tenant == "B"]

# %% tags=["check"]
assert np.median(b_fcfs[len(b_fcfs) // 2:]) > 2 * np.median(b_fcfs[:len(b_fcfs) // 2]), "FCFS: B's TTFT grows"
assert b_demand < 0.6 * half, "the prose says B asks for well under half of the service"
assert fc["rate_b"] < b_demand, "the prose says under FCFS B gets less than it asks for in the window"
assert all(flood_per_seed["fair", s]["b_ttft_p50"] < flood_per_seed["continuous", s]["b_ttft_p50"] / 10 for s in SEEDS), \
    "the prose says VTC cuts B's TTFT by more than 10x (every seed)"
assert vt["rate_b"] > fc["rate_b"] and abs(vt["end"] - fc["end"]) / fc["end"] < 0.05, "B served more; same total work"

# %% [markdown]
# FCFS 下，B 的请求排在 A 的洪水后面：B 的 TTFT 中位数 {{fc["b_ttft_p50"]:.2f}} s，而且随时间越来越长（右图）——B 什么也没做错，只是和 A 共用一台服务器。
# VTC 下 B 的 TTFT 中位数是 {{vt["b_ttft_p50"]:.2f}} s。B 平均每秒只要 {{b_demand:,.0f}} 个加权 Token，明显少于一半的服务
# （VTC 下这段时间服务器每秒共给出 {{vt["rate_a"] + vt["rate_b"]:,.0f}} 个，一半是 {{half:,.0f}}，B 只要其中的 {{b_demand / half:.0%}}），
# 所以 B 一来就是计数器最小的积压租户，它的请求几乎随到随做：{{W0:.0f}}–{{W1:.0f}} s 内 B 每秒得到 {{vt["rate_b"]:,.0f}} 个加权 Token
# （FCFS 下 {{fc["rate_b"]:,.0f}}：B 的请求积在队里，这段时间得到的比它要的少）。
# A 得到其余的全部，服务器没有空转：两种策略下最后一个请求完成的时间几乎相同（{{fc["end"]:.1f}} s 与 {{vt["end"]:.1f}} s），
# 这就是工作保持。A 的请求反正要排队，VTC 只是把 B 的少量请求插到了 A 的队伍前面。
#
# ## 23.8 多个租户：最大最小公平
#
# 课程的 `multi_tenant` 负载给每个租户一段自己的系统提示词；`popularity` > 0 时租户的请求量按 Zipf 分布，有的租户忙、有的闲。
# 4 个租户、`popularity=1.5`、14 req/s（超过服务能力），比较每个租户在稳态窗口里得到的服务份额：

# %%
mt = multi_tenant(400, 14.0, num_tenants=4, system_prompt_len=256, question_len=lognormal(median=64, sigma=0.6, max=1024),
                  output_len=TENANT_LEN["output_len"], popularity=1.5, seed=3)
TENANTS = sorted({r.tenant for r in mt})
mt_runs = {name: run(mt, engine=engine_with(name)) for name in ("continuous", "fair")}
t_lo, t_hi = np.quantile([r.arrival_time for r in mt], [0.2, 0.8])
demand = {u: sum(r.prompt_len + 2 * r.max_tokens for r in mt if r.tenant == u) for u in TENANTS}
mt_share = {}
for name, res in mt_runs.items():
    got = {u: float(np.diff(service(res.requests, u, [t_lo, t_hi]))[0]) for u in TENANTS}
    mt_share[name] = {u: got[u] / sum(got.values()) for u in TENANTS}
mt_ttft = {(n, u): float(np.median([q.ttft for q in steady(mt_runs[n]) if q.tenant == u])) for n in mt_runs for u in TENANTS}
demand_share = {u: demand[u] / sum(demand.values()) for u in TENANTS}
md_table(["tenant", "share of demand", "FCFS: share of service", "VTC: share of service", "FCFS: TTFT p50 (s)",
          "VTC: TTFT p50 (s)"],
         [[u, f"{demand_share[u]:.0%}", f"{mt_share['continuous'][u]:.0%}", f"{mt_share['fair'][u]:.0%}",
           f"{mt_ttft['continuous', u]:.2f}", f"{mt_ttft['fair', u]:.2f}"] for u in TENANTS])
fig, ax = plt.subplots(figsize=(6.5, 3))
xt = np.arange(len(TENANTS))
ax.bar(xt - 0.27, [demand_share[u] * 100 for u in TENANTS], 0.27, color="0.6", label="share of demand")
ax.bar(xt, [mt_share["continuous"][u] * 100 for u in TENANTS], 0.27, color="C3", label="FCFS: share of service")
ax.bar(xt + 0.27, [mt_share["fair"][u] * 100 for u in TENANTS], 0.27, color="C0", label="VTC: share of service")
ax.set_xticks(xt, TENANTS)
ax.set(ylabel="%", title="multi_tenant, popularity 1.5, 14 req/s (steady window)")
ax.legend(fontsize=7)
ax.grid(alpha=0.3, axis="y")
plt.show()
by_demand = sorted(TENANTS, key=demand.get, reverse=True)
busiest, quietest, quiet = by_demand[0], by_demand[-1], by_demand[1:]
maxmin_level = (1 - mt_share["fair"][by_demand[2]] - mt_share["fair"][by_demand[3]]) / 2

# %% tags=["check"]
assert mt_share["fair"][busiest] < mt_share["continuous"][busiest], "the prose says VTC takes service from the busiest"
assert mt_ttft["fair", quietest] < mt_ttft["continuous", quietest] / 5, "and the quietest tenant waits far less"
assert all(mt_share["fair"][u] > demand_share[u] for u in quiet) and max(mt_ttft["fair", u] for u in quiet) < 0.5
assert mt_share["fair"][by_demand[2]] < 0.25 and mt_share["fair"][by_demand[3]] < 0.25, "the prose: two use less than 1/4"
assert mt_share["fair"][by_demand[1]] < maxmin_level < mt_share["fair"][busiest], "the prose's max-min split"

# %% [markdown]
# FCFS 按到达分配，服务份额大致跟着需求份额走：最忙的 {{busiest}}（需求的 {{demand_share[busiest]:.0%}}）拿到
# {{mt_share["continuous"][busiest]:.0%}} 的服务，所有租户的 TTFT 中位数都不低于 {{min(mt_ttft["continuous", u] for u in TENANTS):.2f}} s——
# 大家一起排 {{busiest}} 造成的长队。VTC 下，其余三个租户的 TTFT 中位数都不超过 {{max(mt_ttft["fair", u] for u in quiet):.2f}} s：
# 它们的请求随到随做，需求全部得到满足，所以服务份额**高于**需求份额（总需求超过了容量，它们拿到的却是全部需求）；
# {{busiest}} 得到剩下的 {{mt_share["fair"][busiest]:.0%}}，TTFT 中位数从 {{mt_ttft["continuous", busiest]:.2f}} s 升到
# {{mt_ttft["fair", busiest]:.2f}} s。这就是**最大最小公平**（Max-min Fairness）：把容量平分成四份，{{by_demand[2]}} 与 {{by_demand[3]}}
# 用不完自己的一份（它们只占 {{mt_share["fair"][by_demand[2]]:.0%}} 与 {{mt_share["fair"][by_demand[3]]:.0%}}），多出来的在其余两个租户之间再平分，
# 每个 {{maxmin_level:.0%}}；{{by_demand[1]}} 只要 {{mt_share["fair"][by_demand[1]]:.0%}}，也全部满足，其余都归 {{busiest}}——
# 别人用不完的份额不会空着（工作保持）。这里只有一个负载种子，份额的具体数字会随种子变化。
#
# ## 23.9 在真实的 tiny 模型上：换了顺序，输出不变
#
# MLFQ 让请求暂停又继续，VTC 改变接纳的顺序；它们都只改变**什么时候**算，不改变**算出什么**。用嵌入的 tiny 模型验证：
# 2 个长请求（生成 48 Token）和 6 个短请求（生成 6 Token，其中 3 个属于租户 B）同时到达，`max_num_seqs=2`。
# 三种策略下贪心输出必须逐 Token 相同；每个请求在第几步完成（与机器快慢无关）则各不相同：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
tiny_specs = [RequestSpec(0.0, 24, 48, request_id=f"long{i}", tenant="A") for i in range(2)]
tiny_specs += [RequestSpec(0.0, 24, 6, request_id=f"short{i}", tenant="A" if i < 3 else "B") for i in range(6)]
tiny_wl = Workload(tiny_specs).materialize(4096, seed=0)
tiny_runs, done_at = {}, {}
for name in ("continuous", "mlfq", "fair"):
    finished: dict[str, int] = {}

    def on_step(eng, st, finished=finished):
        for rid, r in eng.requests.items():
            if r.is_finished and rid not in finished:
                finished[rid] = st.step

    tiny_runs[name] = run(tiny_wl, model="tiny", policy=name, max_num_seqs=2, on_step=on_step)
    done_at[name] = finished
ref = {q.request_id: q.output_token_ids for q in tiny_runs["continuous"].requests}
for name, r in tiny_runs.items():
    same = all(q.output_token_ids == ref[q.request_id] for q in r.requests)
    print(f"{name:<10} outputs identical to FCFS: {same}; finished at step:",
          {rid: done_at[name][rid] for rid in sorted(done_at[name], key=lambda k: (done_at[name][k], k))})
    assert same, "greedy outputs must not depend on the scheduling order"
tiny_short = {n: max(v for k, v in done_at[n].items() if k.startswith("short")) for n in done_at}
assert tiny_short["mlfq"] < tiny_short["continuous"] and min(done_at["fair"], key=done_at["fair"].get) == "short3"

# %% [markdown]
# FCFS 先把两个长请求做完，短请求最晚在第 {{tiny_short["continuous"]}} 步才完成；MLFQ 下长请求生成 {{quanta[0]}} 个 Token 就降级，
# 短请求到第 {{tiny_short["mlfq"]}} 步全部完成，长请求最后完成。VTC 下，接纳在两个租户之间交替，租户 B 的 short3 与 A 的 long0
# 最先被接纳，short3 第 {{done_at["fair"]["short3"]}} 步就完成了；但之后运行中的请求一直运行到结束——VTC 只决定**接纳的顺序**，
# 不抢占（`FairPolicy.preemptive` 为 {{FairPolicy.preemptive}}），其余短请求又要等长请求。三种顺序，输出完全相同。
#
# ## 23.10 动手：洪泛的租户与权重
#
# 下面的控件重放 23.7 节的洪泛：拖动 B 的到达率，看 B 什么时候从“要多少给多少”变成“也被限到一半”；给 B 加权（加权 VTC，
# `FairPolicy(tenant_weights={"B": w})`），看份额怎样按权重分配；切换到 FCFS 对照。

# %% tags=["nbval-ignore-output"]
def explore(rate_b=2.0, weight_b=1.0, policy="fair"):
    wl = two_tenants(rate_b=rate_b)
    res = run(wl, engine=engine_with(FairPolicy(tenant_weights={"B": weight_b}) if policy == "fair" else "continuous"))
    _fig, ax = plt.subplots(figsize=(8, 2.8))
    for tenant, col in (("A", "C1"), ("B", "C2")):
        ax.plot(grid, service(res.requests, tenant, grid) / 1e3, color=col, label=f"tenant {tenant}")
    ax.set(xlabel="time (s)", ylabel="k weighted tokens", title=f"{policy}, B at {rate_b:g} req/s, weight {weight_b:g}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    plt.show()
    sa, sb = (np.diff(service(res.requests, u, [W0, W1]))[0] for u in ("A", "B"))
    bt = [q.ttft for q in res.requests if q.tenant == "B"]
    print(f"{W0:.0f}-{W1:.0f} s: B gets {sb / (sa + sb):.0%} of the service; B's TTFT p50 {np.median(bt):.2f} s, "
          f"p99 {np.percentile(bt, 99):.2f} s")


W.interact(explore,
           rate_b=W.FloatSlider(value=2.0, min=0.5, max=16.0, step=0.5, continuous_update=False, description="B req/s"),
           weight_b=W.FloatSlider(value=1.0, min=0.25, max=4.0, step=0.25, continuous_update=False, description="B weight"),
           policy=W.Dropdown(options=["fair", "continuous"], value="fair"));

# %% [markdown]
# ## 本章小结
#
# - 同样的利用率下，FCFS 的平均等待与 $E[S^2]/E[S]$ 成正比；LLM 输出长度的长尾让短请求排在长请求后面（队头阻塞）。
# - MLFQ 不需要知道输出长度：按已生成的 Token 逐级降级（时间片 $q_0 2^i$），新请求在最高级，逐 Token 抢占；饥饿提升限制长请求的等待。
#   FastServe 的跳级加入利用已知的输入长度，让长提示词直接进入时间片够长的那一级，省掉注定的降级。
# - 在长尾负载上，MLFQ 大幅降低了 JCT 的中位数与 TTFT 的尾部，平均 JCT 也降了一些，代价是最长的请求更慢、被暂停的请求占着更多 KV
#   （FastServe 因此主动卸载 KV）；只看 TTFT 的 SLO 会高估 MLFQ 的好处。
# - VTC 按租户记账（输入 ×1、输出 ×2），每次从积压租户里选计数器最小的，新积压的租户计数器被提升；两个都积压的租户的服务差有常数上界，
#   同时保持工作保持。一个租户洪泛时，安静的租户照样得到它要的服务，TTFT 不受影响；多个租户时得到最大最小公平。
# - 两者都只改变计算的先后：贪心输出逐 Token 不变。
#
# 实验 **L09**（SJF 与 MLFQ 调度策略，见课程地图）请你实现 SJF 与 MLFQ 策略，并设计一个在保留的负载上 p99 E2E 胜过 FCFS、又不让长请求饿过界限的策略。
# 下一章（第 24 章）回到显存：碎片的诊断与治理。
#
# ## 练习
#
# 1. **槽位不再稀缺。** 把 `SIM` 的 `max_num_seqs` 改为 64，重跑 23.3 节。MLFQ 与 FCFS 的差别变大还是变小？为什么？
# 2. **时间片的大小。** 用 `MLFQPolicy(base_quantum=1)`、`base_quantum=16` 与 `num_levels=2` 重跑 23.3 节（`engine_with(MLFQPolicy(...))`），
#    比较 JCT p50、p99 与降级次数。时间片趋于无穷时 MLFQ 退化成什么？
# 3. **饥饿提升。** 在 14 req/s 下分别用 `starve_limit_s=1.0`、`10.0`、`float("inf")`，看输出超过 256 Token 的请求的最长 JCT 与提升次数
#    （`policy.num_promotions`）。提升太频繁会怎样？
# 4. **KV 紧张时的 MLFQ。** 给 23.3 节的引擎 `num_kv_blocks=600`，MLFQ 下会发生多少次抢占？换成 `preemption_mode="swap"` 呢？
#    这与 FastServe 的主动卸载有什么不同？
# 5. **测一测 VTC 的上界。** 用 23.7 节的 `two_tenants(rate_a=16, rate_b=8)`（两个租户都积压），在 `run(..., on_step=...)` 里记下
#    两个租户都有请求在等待时的服务差 $W_A - W_B$，它的变化幅度与 $2(w_p L_\text{in,max} + w_q L_\text{out,max})$ 相比如何？FCFS 呢？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 变小。64 个槽位时，短请求大多一到就有槽位，不必等长请求结束；MLFQ 能重排的只有“抢槽位”的那部分等待。决定收益的是排队，
#    而不是策略本身：`summary(trim=0.2)["queue_delay_p50"]` 在两种策略下都接近 0 时，调度顺序就无关紧要了。
# 2. `base_quantum=1` 时降级最频繁，更接近 LAS；时间片很大（或 `num_levels=1`）时所有请求都在同一级，按进入时间排序，就是 FCFS。
#    `num_levels=2` 相当于“前 $q_0$ 个 Token 优先、其余 FCFS”。
# 3. `starve_limit_s` 越小，长请求越常被提回第 0 级，最长 JCT 下降，但短请求的收益也被吃掉（极端情况下所有请求不断被提升，又接近轮转）。
#    `float("inf")` 时没有提升，在持续过载下最长的请求可能一直等到负载停止。
# 4. 用 `engine_with("mlfq", num_kv_blocks=600)`；打印 `summary()["num_preemptions"]`。被暂停的请求在顺序末尾，池不够时先被抢占，
#    重算要把它们的提示词和已生成 Token 再算一遍；换出把 KV 拷到主机。FastServe 是**提前**把即将不用的 KV 卸载、在轮到它之前上载，
#    让拷贝与计算重叠，而不是在分配失败时才处理。
# 5. 参考 `tests/test_policy_behaviour.py` 的 `_backlogged_spans`：每步用 `e.requests` 累加每个租户的 `num_prompt_tokens`（已被调度的）
#    与 `2 * num_output_tokens`，在 `{r.tenant for r in e.scheduler.waiting} == {"A", "B"}` 的区间内记录差值，取区间内最大值减最小值。
#    VTC 下它在上界之内；FCFS 下它随区间长度增长，A 发得越多、差得越多。
#
# </details>
#
# **本章引用**：FastServe（Wu et al., arXiv:2305.05920 v1 与 v3；NSDI'26 版本见 USENIX 网站）；VTC（Sheng et al., OSDI'24, arXiv:2401.00588；
# 参考实现 `github.com/Ying1123/VTC-artifact` commit 192c2e2 的 `slora/server/router/vtc_req_queue.py`）；vLLM `vllm/config/scheduler.py`（commit 01230b4）。
