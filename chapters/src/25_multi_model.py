# %% [markdown]
# # 第 25 章 多模型部署
#
# 前面的章节都只服务**一个**模型。生产里很少如此：同一个基座会有面向不同业务的微调版本，大小模型各司其职，
# 还有一长串“偶尔才有人用”的模型。给每个模型一张（或一组）独占的 GPU 最简单，但模型的热度差别很大、
# 流量又有起伏，独占的 GPU 大部分时间在空转。本章讨论把几个模型放在**同一张 GPU** 上的两种方式，以及多张 GPU 之间怎样**按模型路由**：
#
# - **显存划分**（Memory Partitioning，空间上的共享）：几个模型同时常驻，每个模型占显存的固定一份，各自的 KV 池只能用自己那份里放完权重后剩下的部分；
# - **时分复用**（Time-slicing，时间上的共享）：一次只让一个模型常驻、独享显存，别的模型的请求要等它被**换入**（从主机内存把权重拷回 GPU，按主机链路带宽计时）；
# - **按模型路由**：请求带着它要的模型名，路由器只在服务该模型的副本里挑；当每张卡都放下所有模型时，一个模型的突发可以用上所有的卡——AlpaServe（Li et al., OSDI'23）所说的**统计复用**（Statistical Multiplexing）。
#
# minibatch 的集群层（第 26 章的主角）已经会按模型路由（`minibatch.cluster.run(..., models=...)`，`RequestSpec.model`）；
# 一张卡上放几个模型的两种方式则写在本章新增的模块 `minibatch/cluster/multimodel.py` 里，它用现有的引擎与模拟器的代价模型来跑。
#
# ## 学习目标
#
# - 写出显存划分时每个模型的 KV 容量 $\lfloor (s_m M - W_m - R)/b_m \rfloor$，按 vLLM 的规则检查“放不放得下”（权重 + 至少一个最长请求的 KV），
#   并说清 vLLM `gpu_memory_utilization` 是“每个实例”的比例；
# - 写出时分复用的切换代价 $t_\text{switch} = W/B_\text{host}$，以及一次停顿 $D$ 在利用率 $\rho$ 下要再花 $D\rho/(1-\rho)$ 才能消化的排队；
# - 读懂 `minibatch/cluster/multimodel.py` 的两条规则（GPU 上轮流执行各模型的步；常驻模型的时间片、排空与切换）；
# - 在模拟的 A100-80G 上比较 Llama-2-7B + 13B 的三种部署：独占部署（Dedicated Deployment，每个模型一张卡）、一张卡划分显存、一张卡时分复用——SLO 达成率、
#   GPU·秒（GPU-seconds）成本与每卡服务容量，分别在稳定流量与分阶段流量下；
# - 对放不下的组合（两个 13B 微调模型、一张 A100-40G）只比较放得下的方案；
# - 复现统计复用：两个 7B 微调模型、两张卡，突发流量下“一模型一卡”与“每卡两模型 + 按模型路由”；
# - 多 LoRA 批处理：在一份基座上服务多个 LoRA 适配器，说清适配器槽位（vLLM 的 `max_loras`）怎样限制一步里的请求，在真实 tiny 模型上核对带适配器的贪心输出，
#   在模拟器上量出槽位数对吞吐的影响，并比较适配器亲和路由与只看负载的路由。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np

import minibatch
from minibatch import cluster
from minibatch.cluster import multimodel as mm
from minibatch.results import capacity_over_seeds
from minibatch.sim import get_hardware, get_model_spec, make_cost_model
from minibatch.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES
from minibatch.swap import HOST_LINK_BYTES_PER_S
from minibatch.viz import md_table
from minibatch.workload import RequestSpec, Workload, lognormal, synthetic

GiB = 2 ** 30
HW = "a100-80g"                                   # this chapter's GPU
A, B = "llama-2-7b", "llama-2-13b"                # the two models of sections 25.1-25.5
LEN = {"input_len": lognormal(median=512, sigma=0.6, max=2048),
       "output_len": lognormal(median=64, sigma=0.6, max=512)}
SLO, TARGET = {"ttft": 1.0, "tpot": 0.1}, 0.9     # per request: TTFT <= 1 s and TPOT <= 100 ms; >= 90% of requests
STEADY_S = 60.0                                   # seconds of traffic per steady-state measurement
CAP_TOL = 0.1                                     # the capacity bisection's relative resolution (25.4)
SEEDS, RATE0 = [1, 2, 3], 8.0                     # load seeds of every steady-state measurement; 25.4's first rate
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 25.1 显存：一张卡上放得下什么
#
# 一个模型的显存有三块：权重 $W_m$（参数量 × 每参数字节数）、一块预留 $R$（CUDA 上下文、cuBLAS 工作区、一步计算的激活峰值，
# minibatch 的模拟器取 $R$ = `DEFAULT_ACTIVATION_RESERVE_BYTES` = {{DEFAULT_ACTIVATION_RESERVE_BYTES / GiB:.0f}} GiB），以及剩下的全部给 KV Cache。
# 显存划分时，模型 $m$ 只能用显存 $M$ 的一份 $s_m$：
#
# $$
# \text{KV}_m = \Big\lfloor \frac{s_m M - W_m - R}{b_m} \Big\rfloor \ \text{个 Token},\qquad b_m = 2 L_m H^{kv}_m d_m \cdot \text{dtype 字节数},
# \qquad \sum_m s_m \le u ,
# $$
#
# 其中 $b_m$ 是一个 Token 的 KV 字节数（第 6 章），$u$ 是整张卡准备给推理用的比例。这正是在同一张卡上起几个 vLLM 实例的做法：
# vLLM 0.11.0 的 `vllm/config/cache.py` 写明 `gpu_memory_utilization`（默认 0.9）是**每个实例**的上限——
# “两个 vLLM 实例跑在同一张 GPU 上，可以各设 0.5”；`vllm/v1/worker/gpu_worker.py` 在启动时按 总显存 × 该比例 申请，
# 当时空闲的显存不够就报错退出。**放得下**的标准也照 vLLM：`vllm/v1/core/kv_cache_utils.py` 的 `check_enough_kv_cache_memory`
# 要求 KV 至少能装下**一个**长度为 `max_model_len` 的请求，否则拒绝启动。
#
# `mm.partition_shares` 给每个模型它的 $W_m + R$，再把剩下的显存按比例 $f_m$ 分给各模型的 KV（默认平分）：
# $s_m = \big(W_m + R + f_m (uM - \sum_k (W_k + R))\big)/M$。下面算 7B + 13B 在一张 A100-80G 上的账，并与各占一张卡（独占）、
# 以及时分复用（一次只有一个模型，独享 $u$ = 0.9）对比：

# %%
print(inspect.getsource(mm.partition_shares))
ARCHS = {A: A, B: B}
shares = mm.partition_shares(ARCHS, HW)
REQ_TOKENS = 512 + 64                             # a typical request of this chapter: prompt + output
layouts = {"dedicated (one GPU each)": {m: 0.9 for m in ARCHS}, "partition (one GPU)": shares,
           "time-slice (one GPU, one model at a time)": {m: 0.9 for m in ARCHS}}
fit = {name: mm.fit_report(ARCHS, HW, sh) for name, sh in layouts.items()}
rows = []
for name, rep in fit.items():
    for m, r in rep.items():
        rows.append([name, m, f"{r['share']:.3f}", f"{mm.weight_bytes(m, HW) / GiB:.1f}", f"{r['kv_tokens']:,}",
                     f"{r['kv_tokens'] // REQ_TOKENS}", "yes" if r["fits"] else "no"])
md_table(["layout", "model", "share of 80 GiB", "weights (GiB)", "KV tokens", f"requests of {REQ_TOKENS} tokens",
          "fits"], rows)
kv_part = {m: fit["partition (one GPU)"][m]["kv_tokens"] for m in ARCHS}
kv_ded = {m: fit["dedicated (one GPU each)"][m]["kv_tokens"] for m in ARCHS}
assert all(r["fits"] for rep in fit.values() for r in rep.values())
assert abs(sum(shares.values()) - 0.9) < 1e-9 and all(kv_part[m] < kv_ded[m] / 2 for m in ARCHS)

# %% [markdown]
# 两个模型都放得下，但划分之后 7B 的 KV 从独占时的 {{kv_ded[A]:,}} 个 Token 降到 {{kv_part[A]:,}} 个（{{kv_part[A] / kv_ded[A]:.0%}}），
# 13B 从 {{kv_ded[B]:,}} 降到 {{kv_part[B]:,}}（{{kv_part[B] / kv_ded[B]:.0%}}）——都不到一半：两份权重合计
# {{(mm.weight_bytes(A, HW) + mm.weight_bytes(B, HW)) / GiB:.1f}} GiB 先吃掉了共享显存的大头。KV 少了，能同时运行的请求就少（最后一列），
# 高负载时这会先成为瓶颈（第 6、12 章）。再看几种放不下的组合：本章**不画、不表列**任何放不下的配置，只在这里说明为什么排除它们。

# %%
COMBOS = [("two 13B fine-tunes", "a100-40g", {"ft-1": B, "ft-2": B}),
          ("7B + 13B", "a100-40g", {A: A, B: B}),
          ("Llama-2-70B + 7B", "h200", {"llama-2-70b": "llama-2-70b", A: A}),
          ("two 7B fine-tunes", "a100-40g", {"chat": A, "code": A})]
combo_rows, combo_fits = [], {}
for name, hw, archs in COMBOS:
    try:
        rep = mm.fit_report(archs, hw, mm.partition_shares(archs, hw))
        ok = all(r["fits"] for r in rep.values())
        why = ", ".join(f"{m}: {r['kv_tokens']:,} KV tokens" for m, r in rep.items())
    except ValueError:
        ok, why = False, "weights + reserves exceed 0.9 of the memory"
    alone = all(mm.kv_tokens(a, hw, 0.9) >= mm.min_kv_tokens(a) for a in archs.values())
    combo_fits[name] = (ok, alone)
    combo_rows.append([name, hw, "fits" if ok else "does not fit", "fits" if alone else "does not fit", why])
md_table(["models", "GPU", "partitioned", "each alone (time-slice)", "partitioned KV"], combo_rows)
assert combo_fits["two 13B fine-tunes"] == (False, True) and combo_fits["two 7B fine-tunes"] == (True, True)
assert combo_fits["Llama-2-70B + 7B"] == (False, False)
w70 = get_model_spec("llama-2-70b").weight_bytes / GiB
h200_gib = get_hardware("h200").memory_bytes / GiB

# %% [markdown]
# 两个 13B 微调模型在一张 A100-40G 上**分不下**（两份权重加预留已超过 0.9 × 40 GiB），但**单独**放得下——这正是时分复用的用武之地（25.5 节）。
# Llama-2-70B 的权重约 {{w70:.0f}} GiB，比 0.9 × {{h200_gib:.0f}} GiB = {{0.9 * h200_gib:.0f}} GiB 还多：它单独也放不进一张 H200，要张量并行（第 6 章），
# 更谈不上与 7B 同住。
# 下图把三种布局画成一张卡的显存条（只画放得下的；时分复用画的是 7B 常驻的时刻）：

# %%
fig, ax = plt.subplots(figsize=(9, 2.6))
bars = [("dedicated: GPU 0", [(A, 0.9)]), ("dedicated: GPU 1", [(B, 0.9)]),
        ("partition", [(A, shares[A]), (B, shares[B])]), ("time-slice (7B resident)", [(A, 0.9)])]
colors = {A: "C0", B: "C1"}
for y, (label, parts) in enumerate(bars):
    left = 0.0
    for m, sh in parts:
        w_gib, r_gib = mm.weight_bytes(m, HW) / GiB, DEFAULT_ACTIVATION_RESERVE_BYTES / GiB
        kv_gib = sh * 80 - w_gib - r_gib
        for width, alpha, text in ((w_gib, 1.0, "W"), (r_gib, 0.35, ""), (kv_gib, 0.55, "KV")):
            ax.barh(y, width, left=left, color=colors[m], alpha=alpha, edgecolor="white")
            if text and width > 4:
                ax.text(left + width / 2, y, f"{text} {width:.0f}", ha="center", va="center", fontsize=7)
            left += width
ax.axvline(80 * 0.9, color="k", ls=":", lw=1)
ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
ax.set(xlabel="GiB of an 80 GiB A100 (dotted: gpu_memory_utilization 0.9)", xlim=(0, 80),
       title="Weights (solid), reserve (pale) and KV (shaded): blue llama-2-7b, orange llama-2-13b")
ax.invert_yaxis()
plt.show()

# %% [markdown]
# ## 25.2 时分复用：切换要多久
#
# 时分复用让一个模型独享整张卡（上图最后一行），代价是**切换**（Model Switching）：换一个模型，就要把它的权重从主机内存拷进显存。
# 假设每个模型在主机内存里常备一份权重（vLLM 的睡眠模式 level 1 正是这样：vLLM 0.11.0 `vllm/entrypoints/llm.py` 的 `LLM.sleep(level=1)`
# “把权重卸载到 CPU 内存、丢弃 KV Cache”，`wake_up()` 再拷回来；实现在 `vllm/v1/worker/gpu_worker.py` 的 `Worker.sleep`），一次切换至少要
#
# $$
# t_\text{switch} = \frac{W_\text{new}}{B_\text{host}} ,
# $$
#
# $B_\text{host}$ 是主机到 GPU 的链路带宽。minibatch 沿用第 12 章换出（Swap）用的 `HOST_LINK_BYTES_PER_S` =
# {{HOST_LINK_BYTES_PER_S / 1e9:.0f}} GB/s（PCIe Gen4 x16 每方向 32 GB/s 的实际可达值）。旧模型的权重在主机里有副本，直接丢弃即可；
# 它的 KV 无处可去——vLLM 的 `LLM.sleep` 文档要求调用者保证睡眠期间**没有请求在处理**。所以切换之前，旧模型要先**排空**（Draining）：
# 不再接新请求，把手上的请求做完。

# %%
switch = {m: mm.switch_seconds(m, HW) for m in (A, B, "llama-2-70b")}
md_table(["model", "weights (GB)", f"t_switch at {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s (s)", "at 50 GB/s, PCIe Gen5 (s)"],
         [[m, f"{get_model_spec(m).weight_bytes / 1e9:.1f}", f"{switch[m]:.2f}", f"{mm.switch_seconds(m, HW, 50e9):.2f}"]
          for m in switch])
print(inspect.getsource(mm.switch_seconds))

# %% [markdown]
# 7B 换入约 {{switch[A]:.2f}} s，13B 约 {{switch[B]:.2f}} s，70B 要 {{switch["llama-2-70b"]:.1f}} s——这还只是拷贝时间的下限。
# 真实系统还有别的开销：vLLM 的博客（*Zero-Reload Model Switching with vLLM Sleep Mode*，2025-10-26）报告从磁盘**重新加载**一个模型每次要
# 30–100+ 秒（进程启动、分配器初始化、CUDA Graph 捕获、内核编译），睡眠模式的两个级别比完全重载快 18–200 倍。
#
# 切换的代价不止 $t_\text{switch}$。设切换加排空让某个模型的请求停了 $D$ 秒，这期间到达 $\lambda D$ 个请求；恢复之后服务率是 $\mu$，
# 队列以 $\mu - \lambda$ 的速度消化，还要
#
# $$
# \frac{\lambda D}{\mu - \lambda} = D\,\frac{\rho}{1-\rho},\qquad \rho = \lambda/\mu ,
# $$
#
# 才能回到稳态：利用率 0.5 时停顿的影响翻倍（$D/(1-\rho)$ = 2D），0.8 时变成 5 倍。时分复用在负载高时格外吃亏。
#
# ## 25.3 minibatch 怎样模拟一张共享的卡
#
# `mm.run(workload, placement, mode, hardware, ...)` 的 `placement`（放置，Placement）是每张卡上放的模型名列表，例如 `[[A, B]]`（一张卡两个模型）、
# `[[A], [B]]`（各一张卡）、`[["chat", "code"], ["chat", "code"]]`（两张卡都放两个模型）。每个（卡, 模型）是一个真正的 `LLMEngine`
# （自己的调度器与 KV 池，池的大小按上面的份额由模拟器算出）。两条规则决定一张卡上谁先跑：
#
# 1. **显存划分**：一张卡一次只执行一步，有活的模型**轮流**各执行一步。没有 NVIDIA MPS 时，不同进程的内核不会同时在一张卡上运行，
#    GPU 在它们的上下文之间切换（NVIDIA MPS 文档 “When to Use MPS”：MPS 才让不同进程的内核与拷贝重叠）；解码步受显存带宽限制，
#    即使并发也要分带宽，所以“串行、轮流”是一个不算乐观的近似。
# 2. **时分复用**：常驻模型只要有活就一直跑；当别的模型有请求在等、且常驻模型已占卡 `max_slice_s`（默认 5 s）时，它开始**排空**：
#    新到的请求先存着，手上的做完；它空闲时，把卡让给等待最久的请求所属的模型，花 $t_\text{switch}$ 换入。

# %%
print(inspect.getsource(mm._GPU.act))
print(inspect.getsource(mm._GPU.update_drain))

# %% [markdown]
# 每张卡上每个模型一个引擎、只放一个模型时，`mm.run` 与集群层的 `cluster.run(models=[...])`（按模型路由的多副本）是同一回事，
# 下面 25.4 节会逐条核对两者的记录。成本按 `summary()["gpu_seconds"]` 计：卡数 × 运行时长（第一个请求到达到最后一步结束），
# 即这些卡被租用的时间，不论忙闲。
#
# ## 25.4 实验一：稳定的流量
#
# 负载：泊松到达，7B 与 13B 的请求数之比为 3 : 1（热度倾斜），提示词中位数 512、输出中位数 64（对数正态）。SLO：每个请求 TTFT ≤ 1 s
# 且 TPOT ≤ 100 ms（逐请求判断），服务容量是达成率 ≥ 90% 的最高到达率。每个到达率回放 {{STEADY_S:.0f}} s 的泊松流量（至少 240 个请求），稳态取中间 60%（`trim=0.2`）：
# 回放太短时队列来不及长起来，测出的容量偏高（第 30 章 30.3 节）。
# 先在 {{RATE0:g}} req/s 下用 3 个负载种子看三种部署：

# %%
def by_model(wl: Workload) -> Workload:
    """The workload's tenant column (drawn with the popularity weights) names the model."""
    return Workload([RequestSpec(r.arrival_time, r.prompt_len, r.max_tokens, request_id=r.request_id, model=r.tenant)
                     for r in wl], name=wl.name)


def steady(rate, n=None, seed=1, popularity=(3, 1)):
    """STEADY_S seconds of Poisson traffic (at least 240 requests), the models drawn 3:1."""
    n = n or max(240, int(rate * STEADY_S))
    return by_model(synthetic(n, rate, **LEN, seed=seed, tenants={A: popularity[0], B: popularity[1]}))


SETUPS = {"dedicated": ([[A], [B]], "partition"), "partition": ([[A, B]], "partition"),
          "time_slice": ([[A, B]], "time_slice")}
COLORS = {"dedicated": "C2", "partition": "C0", "time_slice": "C3"}


def measure(wl, setup, hw=HW, models=None, trim=0.2):
    placement, mode = SETUPS[setup] if isinstance(setup, str) else setup
    res = mm.run(wl, placement, mode, hw, models=models)
    s = res.summary(slo=SLO, trim=trim)
    s["cost_per_1k"] = res.summary()["gpu_seconds"] / len(wl) * 1000      # GPU-seconds per 1,000 requests
    return res, s

# %%
runs = {}                                  # (setup, rate, seed) -> steady-state summary; every run happens once


def at(setup, rate, seed) -> dict:
    """The steady-state summary of ``setup`` on STEADY_S seconds of seed's traffic at ``rate``."""
    if (setup, rate, seed) not in runs:
        runs[setup, rate, seed] = measure(steady(rate, seed=seed), setup)[1]
    return runs[setup, rate, seed]


def over_seeds(values, spec=".0%") -> str:
    """``median (min–max)`` of one number over the seeds."""
    return f"{np.median(values):{spec}} ({min(values):{spec}}–{max(values):{spec}})"


def span(values, spec=".1f") -> str:
    """``min–max`` of the seeds' values, or the one value if they agree at this precision."""
    lo, hi = f"{min(values):{spec}}", f"{max(values):{spec}}"
    return lo if lo == hi else f"{lo}–{hi}"


KEYS = [("slo_attainment", "attainment", "{:.0%}"), ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
        ("ttft_p99", "TTFT p99 (s)", "{:.2f}"), ("tpot_p99", "TPOT p99 (s)", "{:.3f}"),
        ("cost_per_1k", "GPU-s / 1k requests", "{:.0f}"), ("switches", "switches", "{:.0f}")]
three = {n: {k: [at(n, RATE0, s)[k] for s in SEEDS] for k, _, _ in KEYS} for n in SETUPS}
head = {n: {k: float(np.median(v)) for k, v in three[n].items()} for n in SETUPS}
md_table(["setup (8 req/s, median of 3 seeds)", "attainment: median (min–max)"] + [label for _, label, _ in KEYS[1:]],
         [[n, over_seeds(three[n]["slo_attainment"])] + [fmt.format(head[n][k]) for k, _, fmt in KEYS[1:]] for n in SETUPS])
d, p, t = head["dedicated"], head["partition"], head["time_slice"]

# %% tags=["check"]
assert min(three["dedicated"]["slo_attainment"] + three["partition"]["slo_attainment"]) >= TARGET
assert max(three["time_slice"]["slo_attainment"]) < TARGET
assert all(1.8 < a / b < 2.2 for a, b in zip(three["dedicated"]["cost_per_1k"], three["partition"]["cost_per_1k"]))
assert all(a > b for a, b in zip(three["partition"]["ttft_p99"], three["dedicated"]["ttft_p99"]))

# %% [markdown]
# 8 req/s 时，每个种子上划分显存的一张卡与独占的两张卡都达标（{{over_seeds(three["partition"]["slo_attainment"])}} 与
# {{over_seeds(three["dedicated"]["slo_attainment"])}}），成本却只有约一半：每千个请求 {{p["cost_per_1k"]:.0f}} 与 {{d["cost_per_1k"]:.0f}} GPU·秒；
# 代价是尾延迟略高（TTFT p99 {{p["ttft_p99"]:.2f}} s 对 {{d["ttft_p99"]:.2f}} s，每个种子都如此），因为两个模型的步在一张卡上轮流执行。
# 时分复用在这种“两个模型一直都有人用”的流量下很糟：达成率只有 {{over_seeds(three["time_slice"]["slo_attainment"])}}，
# TTFT p99 {{t["ttft_p99"]:.1f}} s——不在卡上的模型的请求要等常驻模型用满时间片、排空、再花一秒左右换入（中位数 {{t["switches"]:.0f}} 次切换）。
#
# 再求每种部署的服务容量：每个种子**分别**在一个包住答案的区间里几何二分（`capacity_over_seeds`，区间两端相差不到 {{CAP_TOL:.0%}} 为止，
# 每次回放 {{STEADY_S:.0f}} s），报中位数与三个种子的范围。时分复用在区间的下端就不达标时，它的容量记为 0（低于下端）：

# %%
BRACKET = {"dedicated": (13.0, 26.0), "partition": (7.0, 14.0), "time_slice": (4.0, 8.0)}   # req/s, both models
cap = {n: capacity_over_seeds(lambda r, s, n=n: at(n, r, s)["slo_attainment"], SEEDS, target=TARGET,
                              lo=BRACKET[n][0], hi=BRACKET[n][1], tol=CAP_TOL) for n in SETUPS}
gpus = {n: len(SETUPS[n][0]) for n in SETUPS}
per_gpu = {n: cap[n].median / gpus[n] for n in SETUPS}
md_table(["setup", "GPUs", "bracket (req/s)", "capacity (req/s): median (min–max)", "per seed", "per GPU (median)"],
         [[n, gpus[n], f"{BRACKET[n][0]:g}–{BRACKET[n][1]:g}", f"{cap[n]:.1f}", " / ".join(f"{c:.1f}" for c in cap[n].per_seed),
           f"{per_gpu[n]:.1f}"] for n in SETUPS])
COST_RATES = [4.0, RATE0, 16.0]           # two rates one GPU handles, and one it does not
cost_ratio = {r: [at("dedicated", r, s)["cost_per_1k"] / at("partition", r, s)["cost_per_1k"] for s in SEEDS] for r in COST_RATES}
print("cost, dedicated / partition, per seed:", {r: [round(x, 2) for x in v] for r, v in cost_ratio.items()})

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.3))
for n in SETUPS:
    pts = sorted(((r, v) for (m, r, s), v in runs.items() if m == n), key=lambda rv: rv[0])
    ax1.plot([r for r, _ in pts], [v["slo_attainment"] * 100 for _, v in pts], "o", ms=4, color=COLORS[n], alpha=0.7, label=n)
    ax2.plot([r for r, _ in pts], [v["cost_per_1k"] for _, v in pts], "o", ms=4, color=COLORS[n], alpha=0.7,
             label=f"{n} ({gpus[n]} GPU)")
ax1.axhline(TARGET * 100, color="k", ls=":", lw=1)
ax1.set(xlabel="request rate (req/s, both models)", ylabel="% requests meeting the SLO",
        title="Steady traffic, 7B:13B = 3:1: every run of the bisection (3 seeds)")
ax2.set(xlabel="request rate (req/s)", ylabel="GPU-seconds per 1,000 requests", ylim=(0, None), title="What the GPUs cost")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()
ok_ratios = cost_ratio[4.0] + cost_ratio[RATE0]

# %% tags=["check"]
assert cap["dedicated"].lo > cap["partition"].hi and cap["partition"].lo >= RATE0 and cap["time_slice"].hi == 0
assert all(BRACKET[n][0] < c < BRACKET[n][1] for n in ("dedicated", "partition") for c in cap[n].per_seed)
assert per_gpu["partition"] <= 1.1 * per_gpu["dedicated"], "the prose: per GPU, partitioning serves no more than dedicated GPUs"
assert all(1.3 < x < 2.1 for x in ok_ratios) and cap["partition"].hi < COST_RATES[-1]
assert all(a < b for a, b in zip(cost_ratio[COST_RATES[-1]], cost_ratio[4.0])), "the ratio shrinks once one GPU saturates"

# %% [markdown]
# 容量：独占两张卡 {{cap["dedicated"]:.1f}} req/s，划分显存的一张卡 {{cap["partition"]:.1f}} req/s（每个种子上都低于独占），
# 时分复用在区间的下端 {{BRACKET["time_slice"][0]:g}} req/s 就不达标（每个种子都是）。按卡算，划分显存每张卡承担 {{per_gpu["partition"]:.1f}} req/s，
# 独占部署每张卡 {{per_gpu["dedicated"]:.1f}} req/s：划分并没有让一张卡干更多的活，它省下的是负载不高时空转的那张卡。
# 本章早先的版本只在一个种子上沿一条粗的到达率阶梯读容量；换成每个种子二分之后，
# 上面两条结论不变，容量多了一位精度和它的范围。
# 右图是成本：在一张卡还达标的到达率下（{{COST_RATES[0]:g}} 与 {{COST_RATES[1]:g}} req/s），两张卡的成本是一张卡的
# {{span(ok_ratios)}} 倍（三个种子）——多出来的大都花在空转上。不到两倍，是因为成本按整次运行算（第一个请求到达到最后一步结束），
# 一张卡上两个模型的收尾（Drain）更长；一张卡饱和之后（{{COST_RATES[-1]:g}} req/s），积压把它的运行时长拖得更长，两者的成本更接近
# （{{span(cost_ratio[COST_RATES[-1]])}} 倍，那时它已不达标）。
# 结论一：**几个模型一直都有流量、又放得下时，划分显存能在中低负载下以约一半的成本达到同样的 SLO；负载接近一张卡的能力时，
# 划分的 KV 更小、两个模型争一张卡的计算，先于独占部署饱和**；时分复用不适合这种流量。
#
# 核对一下 25.3 节的说法：一模型一卡时，`mm.run` 与集群层按模型路由的 `cluster.run(models=[A, B])` 给出逐条相同的记录：

# %% tags=["nbval-check-output"]
wl_check = steady(12.0)
ours = mm.run(wl_check, [[A], [B]], "partition", HW)
theirs = cluster.run(wl_check, models=[A, B], router="least_requests", executor="sim", hardware=HW)
same = [(q.request_id, q.replica, q.first_token_time, q.finish_time) for q in ours.requests] == \
       [(q.request_id, q.replica, q.first_token_time, q.finish_time) for q in theirs.requests]
print("records identical:", same, "| routed per GPU:", ours.summary()["routed"], theirs.summary()["routed"])
assert same

# %% [markdown]
# ## 25.5 实验二：分阶段的流量，以及放不下的组合
#
# 时分复用适合另一种流量：几个模型**轮流**忙，例如白天一个业务、夜里另一个，或者批处理流水线的前后两级（vLLM 睡眠模式的博客正是用在
# 这种“分阶段”的场景）。构造 4 个 15 s 的阶段，7B 与 13B 交替，每个阶段 3 req/s、只来当前模型的请求。这里不取稳态窗口：
# 阶段的切换本身就是要看的东西，统计全部请求。图中竖线是时分复用的切换时刻：

# %%
PHASE_S, PHASES, PHASE_RATE = 15.0, 4, 3.0


def phased(models, rate=PHASE_RATE, phase_s=PHASE_S, phases=PHASES, seed=1):
    """``phases`` phases of ``phase_s`` seconds; phase k sends Poisson arrivals for models[k % len] only."""
    out = []
    for k in range(phases):
        wl = synthetic(int(2 * rate * phase_s) + 10, rate, **LEN, seed=100 * seed + k)
        out += [RequestSpec(k * phase_s + r.arrival_time, r.prompt_len, r.max_tokens, request_id=f"p{k}-{i}",
                            model=models[k % len(models)])
                for i, r in enumerate(wl) if r.arrival_time < phase_s]
    return Workload(sorted(out, key=lambda r: r.arrival_time), name="phased")


ph_runs = {(name, seed): measure(phased([A, B], seed=seed), name, trim=0.0) for name in SETUPS for seed in SEEDS}
ph = {name: ph_runs[name, SEEDS[0]] for name in SETUPS}          # the figure: seed 1
fig, ax = plt.subplots(figsize=(10, 3))
for name in ("partition", "time_slice"):
    res = ph[name][0]
    ax.plot([q.arrival_time for q in res.requests], [q.ttft for q in res.requests], ".", ms=4, color=COLORS[name],
            label=name)
for x in ph["time_slice"][0].switches:
    ax.axvspan(x["t"], x["t"] + x["seconds"], color=COLORS["time_slice"], alpha=0.25)
ax.axhline(SLO["ttft"], color="k", ls=":", lw=1, label="TTFT SLO")
for k in range(1, PHASES):
    ax.axvline(k * PHASE_S, color="0.5", lw=0.8)
ax.set(xlabel="arrival time (s); grey lines: phase changes, red bands: weight copies", ylabel="TTFT (s)", yscale="log",
       title=f"Phased traffic (7B, 13B, 7B, 13B at 3 req/s, seed {SEEDS[0]}): every phase change costs a drain and a switch")
ax.legend(fontsize=7)
ax.grid(alpha=0.3, which="both")
plt.show()
phv = {n: {k: [ph_runs[n, s][1][k] for s in SEEDS] for k, _, _ in KEYS} for n in SETUPS}
md_table(["setup (phased traffic, all requests; median of 3 seeds)", "attainment: median (min–max)"] + [label for _, label, _ in KEYS[1:]],
         [[n, over_seeds(phv[n]["slo_attainment"])] + [fmt.format(np.median(phv[n][k])) for k, _, fmt in KEYS[1:]] for n in SETUPS])


def late_near_switch(res):
    """(late requests, those of them that arrived from 3 s before a switch to 5 s after it)."""
    late = [q for q in res.requests if q.ttft > SLO["ttft"]]
    return late, [q for q in late if any(x["t"] - 3.0 <= q.arrival_time <= x["t"] + x["seconds"] + 5.0 for x in res.switches)]


near = [late_near_switch(ph_runs["time_slice", s][0]) for s in SEEDS]
ph_s = {n: {k: float(np.median(v)) for k, v in phv[n].items()} for n in SETUPS}
ph_s["time_slice"]["switch_seconds"] = float(np.median([ph_runs["time_slice", s][1]["switch_seconds"] for s in SEEDS]))

# %% tags=["check"]
assert all(x == PHASES - 1 for x in phv["time_slice"]["switches"]) and all(len(n) >= 0.8 * len(l) for l, n in near)
assert all(a > b for a, b in zip(phv["time_slice"]["slo_attainment"], three["time_slice"]["slo_attainment"]))
assert min(phv["partition"]["slo_attainment"]) >= TARGET

# %% [markdown]
# 分阶段流量下，时分复用在每个种子上都只切换了 {{PHASES - 1}} 次（每个阶段交替时一次，中位数共用
# {{ph_s["time_slice"]["switch_seconds"]:.1f}} s 拷权重），达成率升到 {{over_seeds(phv["time_slice"]["slo_attainment"])}}（每个种子都高于稳定流量时）。
# 三个种子里不达标的请求分别有 {{"、".join(f"{len(n)}/{len(l)}" for l, n in near)}} 个紧挨着切换（到达于切换前 3 s 到切换结束后 5 s 之间）：
# 新阶段的第一批请求要等上一个模型排空、再等权重拷完，之后还要消化这段停顿里积下的队列（25.2 节的 $D\rho/(1-\rho)$）。
# 划分显存在这里仍然每个种子都达标（{{over_seeds(phv["partition"]["slo_attainment"])}}）：两个模型都常驻，没有切换。
#
# 那什么时候非时分复用不可？**放不下**的时候。两个 13B 微调模型（同一个架构，两份不同的权重）在一张 A100-40G 上分不下（25.1 节），
# 只能比较“每个模型一张卡”与“一张卡时分复用”（同样的分阶段流量，3 个种子）：

# %%
FT = {"ft-1": B, "ft-2": B}
try:
    mm.run(phased(list(FT)), [list(FT)], "partition", "a100-40g", models=FT)
    partition_40g = "fits"
except ValueError as e:
    partition_40g = str(e)
print("partition on one a100-40g:", partition_40g[:110], "...")
FT_SETUPS = {"dedicated": ([["ft-1"], ["ft-2"]], "partition"), "time_slice": ([list(FT)], "time_slice")}
ft_runs = {(name, s): measure(phased(list(FT), seed=s), setup, hw="a100-40g", models=FT, trim=0.0)
           for name, setup in FT_SETUPS.items() for s in SEEDS}
ftv = {n: {k: [ft_runs[n, s][1][k] for s in SEEDS] for k, _, _ in KEYS} for n in FT_SETUPS}
ft = {n: {k: float(np.median(v)) for k, v in ftv[n].items()} for n in FT_SETUPS}
# The same 13B requests (phases 1 and 3 of the same seeds) on a dedicated 40 GB and 80 GB card: median E2E
e2e13 = {"a100-40g": float(np.median([q.e2e for s in SEEDS for q in ft_runs["dedicated", s][0].requests if q.model == "ft-2"])),
         "a100-80g": float(np.median([q.e2e for s in SEEDS for q in ph_runs["dedicated", s][0].requests if q.model == B]))}
print("median E2E of the 13B requests on a dedicated GPU (s):", {k: round(v, 2) for k, v in e2e13.items()})
md_table(["two 13B fine-tunes on A100-40G (phased, median of 3 seeds)", "attainment: median (min–max)"] + [label for _, label, _ in KEYS[1:]],
         [[n, over_seeds(ftv[n]["slo_attainment"])] + [fmt.format(v[k]) for k, _, fmt in KEYS[1:]] for n, v in ft.items()])
ts_cost = [a / b for a, b in zip(ftv["time_slice"]["cost_per_1k"], ftv["dedicated"]["cost_per_1k"])]

# %% tags=["check"]
assert "do not fit together" in partition_40g
assert max(ts_cost) < 0.6
assert all(t < min(d, p) for t, d, p in zip(ftv["time_slice"]["slo_attainment"], ftv["dedicated"]["slo_attainment"],
                                            phv["time_slice"]["slo_attainment"]))
assert e2e13["a100-40g"] > e2e13["a100-80g"]

# %% [markdown]
# 一张卡时分复用的成本是两张卡的 {{span(ts_cost, ".0%")}}（三个种子），
# 达成率从 {{over_seeds(ftv["dedicated"]["slo_attainment"])}} 降到 {{over_seeds(ftv["time_slice"]["slo_attainment"])}}——损失集中在阶段切换处，
# 每个种子上都比上面 A100-80G 上 7B 与 13B 交替时（{{over_seeds(phv["time_slice"]["slo_attainment"])}}）更差：每次换入的都是 13B（{{switch[B]:.2f}} s），而且 A100-40G 更慢——
# 同样的 13B 请求独占一张 A100-40G 时 E2E 中位数 {{e2e13["a100-40g"]:.2f}} s，A100-80G 上 {{e2e13["a100-80g"]:.2f}} s（显存带宽 {{get_hardware("a100-40g").memory_bandwidth / 1e9:.0f}} 对 {{get_hardware(HW).memory_bandwidth / 1e9:.0f}} GB/s）：
# 排空要等的请求更长，停顿期间积下的队列也消化得更慢。
# 结论二：**时分复用用延迟换显存和卡数**。它适合放不下、且流量按阶段轮换（切换次数少）的模型；阶段越长、切换越快、
# SLO 越宽松，它越划算。
#
# ## 25.6 多张卡：按模型路由与统计复用
#
# 最后看卡多于一张时。两个 7B 微调模型 `chat` 与 `code`（同一架构、两份权重），各自平均 8 req/s，两张 A100-80G。两种放法：
#
# - **一模型一卡**：`[["chat"], ["code"]]`，路由器只能把 `chat` 的请求送到卡 0；
# - **每卡两模型**：`[["chat", "code"], ["chat", "code"]]`（显存划分），路由器在两张卡上服务该模型的引擎中挑请求最少的（`least_requests`）。
#
# 流量是泊松（突发度 1）或很突发的 Gamma 到达（`burstiness` = 0.05，到达间隔的变异系数 $CV = 1/\sqrt{0.05} \approx 4.5$），
# 两个模型的突发彼此独立。AlpaServe 的观察是：模型各占一组卡时，一个模型的突发只能用自己的卡；把所有模型都放到所有卡上
# （AlpaServe 用模型并行让放不下的模型也能这样放），突发就能摊到所有卡上，而两个模型同时突发的概率很小。
# 它的论文（OSDI'23）在生产负载上报告：在 99% 以上的请求满足延迟约束的前提下，能承受最多 10 倍的请求率或 6 倍的突发度。
# 每种情形 3 个负载种子（每个模型回放 60 s、480 个请求，稳态取中间 80%），取中位数：

# %%
TWINS = {"chat": A, "code": A}
PLACES = {"one model per GPU": [["chat"], ["code"]], "both models on both GPUs": [["chat", "code"], ["chat", "code"]]}


def two_streams(rate, burstiness, seed, n=None):
    """Independent gamma arrivals for "chat" and "code", each at ``rate`` req/s."""
    out = []
    for k, m in enumerate(TWINS):
        wl = synthetic(n or int(rate * TWIN_S), rate, burstiness=burstiness, **LEN, seed=10 * seed + k)
        out += [RequestSpec(r.arrival_time, r.prompt_len, r.max_tokens, request_id=f"{m}-{i}", model=m)
                for i, r in enumerate(wl)]
    return Workload(sorted(out, key=lambda r: r.arrival_time), name="two streams")


BURSTS, TWIN_RATE, TWIN_S = [1.0, 0.05], 8.0, 60.0
mux = {}
for burst in BURSTS:
    for seed in SEEDS:
        wl = two_streams(TWIN_RATE, burst, seed)
        for name, placement in PLACES.items():
            res = mm.run(wl, placement, "partition", HW, models=TWINS)
            mux[name, burst, seed] = dict(res.summary(slo=SLO, trim=0.1), res=res)
mx = {(n, b): {k: float(np.median([mux[n, b, s][k] for s in SEEDS])) for k in ("slo_attainment", "ttft_p99", "ttft_p50")}
      for n in PLACES for b in BURSTS}
md_table([f"placement (2 GPUs, {TWIN_RATE:g} + {TWIN_RATE:g} req/s, median of 3 seeds)"] + [f"burstiness {b:g}: {k}" for b in BURSTS
                                                                     for k in ("attainment", "TTFT p99 (s)")],
         [[n] + [v for b in BURSTS for v in (f"{mx[n, b]['slo_attainment']:.0%}", f"{mx[n, b]['ttft_p99']:.2f}")]
          for n in PLACES])
own, pool = "one model per GPU", "both models on both GPUs"

# %% tags=["check"]
assert mx[pool, 0.05]["ttft_p99"] < mx[own, 0.05]["ttft_p99"] and mx[pool, 0.05]["slo_attainment"] >= mx[own, 0.05]["slo_attainment"]
assert all(mux[pool, 0.05, s]["ttft_p99"] < mux[own, 0.05, s]["ttft_p99"] for s in SEEDS)
assert mx[own, 0.05]["ttft_p99"] > 1.5 * mx[own, 1.0]["ttft_p99"]

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3), sharey=True)
seed_fig = SEEDS[0]
for ax, name in zip(axes, PLACES):
    res = mux[name, 0.05, seed_fig]["res"]
    for g in (0, 1):
        qs = [q for q in res.requests if q.replica == g]
        ax.plot([q.arrival_time for q in qs], [q.ttft for q in qs], ".", ms=3, color=f"C{g}", label=f"served on GPU {g}")
    ax.axhline(SLO["ttft"], color="k", ls=":", lw=1)
    ax.set(xlabel="arrival time (s)", title=f"{name} (burstiness 0.05, seed {seed_fig})", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
axes[0].set_ylabel("TTFT (s)")
fig.tight_layout()
plt.show()

# %% [markdown]
# 泊松到达时两种放法差别不大（TTFT p99 {{mx[own, 1.0]["ttft_p99"]:.2f}} s 与 {{mx[pool, 1.0]["ttft_p99"]:.2f}} s）。
# 流量很突发时，一模型一卡的 TTFT p99 升到 {{mx[own, 0.05]["ttft_p99"]:.2f}} s、达成率 {{mx[own, 0.05]["slo_attainment"]:.0%}}；
# 每卡两模型时 p99 是 {{mx[pool, 0.05]["ttft_p99"]:.2f}} s、达成率 {{mx[pool, 0.05]["slo_attainment"]:.0%}}（三个种子里每一个的 p99 都更低）。
# 左图里 `chat` 的一次突发只能排在卡 0 上，右图里它被路由器分到两张卡上。代价是每张卡上每个模型的 KV 只有划分后的那一份——
# 这里 7B 的 KV 够用，换成更大的模型或更小的卡，划分的 KV 会先成为瓶颈，这就是 AlpaServe 要在“复用的收益”与“并行 / 划分的开销”之间做的取舍。
# 这里的收益比论文小：只有两个模型、两张卡，突发能摊开的范围很有限。统计复用摊开的是**突发**，不增加**平均**的服务能力：
# 平均负载一高，突发时两张卡都满，复用就不再占优（练习 6）。
#
# ## 25.7 动手：换一种部署、换一种流量
#
# 选择部署方式与流量形态，拖动到达率、7B 所占的比例与时间片长度，看每个请求的 TTFT 怎样随时间变化（竖带是切换）：

# %% tags=["nbval-ignore-output"]
_explore_cache = {}


def explore(setup="partition", traffic="steady", rate=8.0, share_7b=0.75, max_slice_s=5.0):
    key = (setup, traffic, rate, share_7b, max_slice_s)
    if key not in _explore_cache:
        if traffic == "steady":
            wl = steady(rate, popularity=(share_7b, 1 - share_7b)) if 0 < share_7b < 1 else \
                Workload([RequestSpec(r.arrival_time, r.prompt_len, r.max_tokens, request_id=r.request_id,
                                      model=A if share_7b >= 1 else B) for r in synthetic(max(240, int(rate * STEADY_S)), rate, **LEN, seed=1)])
        else:
            wl = phased([A, B], rate=rate)
        placement, mode = SETUPS[setup]
        res = mm.run(wl, placement, mode, HW, max_slice_s=max_slice_s)
        _explore_cache[key] = (res, res.summary(slo=SLO, trim=0.2 if traffic == "steady" else 0.0))
    res, s = _explore_cache[key]
    _fig, ax = plt.subplots(figsize=(9, 2.8))
    for m, col in ((A, "C0"), (B, "C1")):
        qs = [q for q in res.requests if q.model == m]
        ax.plot([q.arrival_time for q in qs], [q.ttft for q in qs], ".", ms=3, color=col, label=m)
    for x in res.switches:
        ax.axvspan(x["t"], x["t"] + x["seconds"], color="C3", alpha=0.25)
    ax.axhline(SLO["ttft"], color="k", ls=":", lw=1)
    ax.set(xlabel="arrival time (s)", ylabel="TTFT (s)", yscale="log", title=f"{setup}, {traffic}, {rate:g} req/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    plt.show()
    print(f"SLO attainment {s['slo_attainment']:.0%}, TTFT p99 {s['ttft_p99']:.2f} s, "
          f"{res.summary()['gpu_seconds'] / len(res.requests) * 1000:.0f} GPU-s per 1k requests, {s['switches']} switches")


W.interact(explore, setup=W.Dropdown(options=list(SETUPS), value="partition"),
           traffic=W.Dropdown(options=["steady", "phased"], value="steady"),
           rate=W.FloatSlider(value=8.0, min=2.0, max=24.0, step=2.0, continuous_update=False, description="req/s"),
           share_7b=W.FloatSlider(value=0.75, min=0.0, max=1.0, step=0.25, continuous_update=False, description="7B share"),
           max_slice_s=W.FloatSlider(value=5.0, min=0.5, max=20.0, step=0.5, continuous_update=False,
                                     description="max_slice_s"));

# %% [markdown]
# ## 25.8 多 LoRA 批处理（Multi-LoRA）
#
# 同一个基座的许多“微调版本”，常常只是一个个 LoRA 适配器（Low-Rank Adaptation，Hu et al., arXiv:2106.09685）：
# 投影 $y = xW^\top$ 变成 $y = xW^\top + s\,(xA^\top)B^\top$，$A$ 是 $r \times k$、$B$ 是 $n \times r$，缩放 $s = \alpha / r$，秩 $r$ 远小于 $k, n$。
# 把 $W + sBA$ 合并进权重就得到一个普通模型，但那样每个适配器都要一份完整权重，又回到 25.1 节的显存账。
# **多 LoRA 服务**只放一份基座：一步里所有请求的行一起做一次基座 GEMM，每个适配器只对自己的行再加两个很“细”的 GEMM
# （先乘 $A^\top$ 压到 $r$ 维，再乘 $B^\top$ 展开）。这样，用不同适配器的请求可以在同一步里批处理：
#
# - **Punica**（Chen et al., arXiv:2310.18547）的 SGMV 内核（Segmented Gather Matrix-Vector multiplication）在一次内核调用里按行段给每段乘上它自己的 $A$、$B$；
# - **S-LoRA**（Sheng et al., arXiv:2311.03285）把成千上万个适配器放在主机内存、按需换入 GPU，适配器权重与 KV Cache 放在同一个分页池里（统一分页，Unified Paging）。
#
# vLLM 0.11.0 的做法（`--enable-lora`，配置在 `vllm/config/lora.py` 的 `LoRAConfig`）：GPU 上有 `max_loras` 个**适配器槽位**（Adapter Slot，默认 1，
# 注释是 "Max number of LoRAs in a single batch"），每个槽位按 `max_lora_rank`（默认 16）开好缓冲区；主机上缓存 `max_cpu_loras` 个（默认等于 `max_loras`）。
# 调度器（`vllm/v1/core/sched/scheduler.py`）先把本步运行中请求的适配器记进 `scheduled_loras`；等待队列里的请求若用的适配器不在其中、而 `scheduled_loras` 已有 `max_loras` 个，
# 就**跳过**它（放回队首），接着看后面的请求。worker 端（`vllm/lora/worker_manager.py` 的 `LRUCacheWorkerLoRAManager`）在一步开始前把这一步要用、却不在槽位里的适配器加载进来，
# 槽位满时换出最久没用的那个。
#
# minibatch 照此实现（`minibatch/lora.py`）：`LLM(..., enable_lora=True, max_loras=N, max_lora_rank=R)`，请求带 `lora_request=LoRARequest(name, id, path)`（PEFT 格式的目录，或内存里的适配器）。
# 调度规则写在 `Scheduler._build` 里（对运行中的请求同样检查），槽位的加载与换出是 `AdapterSlots.activate`。
# 前缀缓存（第 13 章）可以与 LoRA 同开，但缓存块不能只按 Token 标识：用一个适配器算出的 KV 不能给另一个适配器（或基座模型）的请求用。
# vLLM 0.11.0 把 `lora_int_id` 也算进块哈希（`vllm/v1/core/kv_cache_utils.py` 的 `_gen_lora_extra_hash_keys`）；minibatch 让每个适配器的哈希链
# 从各自的起点开始（`minibatch.kv_cache.chain_root`），同一个适配器的请求之间照样命中。

# %%
from minibatch import LLM, SamplingParams
from minibatch.lora import AdapterSlots, LoRARequest, lora_id, merge_into_hf_state, random_adapter
from minibatch.routing import routers
from minibatch.runner import run as run_one
from minibatch.sim.lora import adapter_bytes, load_time, lora_step_time, tenant_adapter_engine

N_ADAPTERS, LORA_OVERLOAD, LORA_N = 16, 25.0, 160     # 25.8's single engine: adapters, req/s (overload), requests
ROUTE_RATE, ROUTE_N = 10.0, 200                       # 25.8's 4 replicas: req/s, requests
print(inspect.getsource(AdapterSlots.activate))

# %% [markdown]
# 先在真实的 tiny 模型上看一步里有什么。三个随机的秩 8 适配器、两个槽位，9 个请求按 `a1, a2, a3, 基座` 轮流用适配器，`max_num_seqs` = 4：

# %%
lora_llm = LLM("tiny", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4)
tiny_mc = lora_llm.engine.executor.model_config
tiny_adapters = [random_adapter(tiny_mc, rank=8, seed=s, std=0.08) for s in (1, 2, 3)]
tiny_loras = [LoRARequest(f"a{i}", i, adapter=a) for i, a in enumerate(tiny_adapters, start=1)]
step_adapters = []                                     # the adapters of every step the executor runs
_execute = lora_llm.engine.executor.execute


def execute_and_record(batch, kv):
    step_adapters.append(sorted({f"a{lora_id(r)}" if lora_id(r) else "base" for r, _ in batch.items}))
    return _execute(batch, kv)


lora_llm.engine.executor.execute = execute_and_record
lora_rng = np.random.default_rng(0)
lora_prompts = [lora_rng.integers(5, 4000, size=n).tolist() for n in (12, 30, 7, 20, 16, 9, 25, 11, 14)]
lora_of = [tiny_loras[i % 4] if i % 4 < 3 else None for i in range(len(lora_prompts))]
greedy10 = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
lora_outs = lora_llm.generate(lora_prompts, greedy10, lora_request=lora_of)
md_table(["step", "adapters of the step's requests"], [[i, ", ".join(s)] for i, s in enumerate(step_adapters[:6])])
slots_used = lora_llm.engine.executor.lora
print(f"{len(step_adapters)} steps; at most {max(len(set(s) - {'base'}) for s in step_adapters)} adapters in a step; "
      f"{slots_used.num_loads} slot loads, {slots_used.num_evictions} evictions")

# %% tags=["check"]
assert max(len(set(s) - {"base"}) for s in step_adapters) == 2
assert any(len(set(s) - {"base"}) == 2 and "base" in s for s in step_adapters)

# %% [markdown]
# 两个适配器和基座的请求同在一步；第三个适配器的请求要等某个槽位里的适配器在本步里没人用了才进来。
# 按本课程的原则，带适配器的贪心输出要与 Hugging Face transformers 在**合并后**的权重 $W + sBA$ 上 `generate` 的结果逐 Token 相等：

# %%
import torch
from transformers import AutoModelForCausalLM

from minibatch.model.loader import tiny_model_path

from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_tiny = AutoModelForCausalLM.from_pretrained(str(tiny_model_path())).eval()
hf_base = {k: v.clone() for k, v in hf_tiny.state_dict().items()}
lora_equal = {}
for i, lr in enumerate(lora_of[:4]):
    hf_tiny.load_state_dict(hf_base if lr is None else merge_into_hf_state(hf_base, lr.adapter))
    ids = torch.tensor([lora_prompts[i]])
    with torch.no_grad():
        ref = hf_tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    lora_equal[lr.lora_name if lr else "base"] = ref[0, ids.shape[1]:].tolist() == lora_outs[i].outputs[0].token_ids
print(lora_equal)

# %% tags=["check"]
assert all(lora_equal.values()), lora_equal

# %% [markdown]
# **槽位有多少，决定一步能装下多少请求。** 在模拟的 A100-80G 上跑 Llama-3-8B，每个租户是一个有自己适配器的客户（`tenant_adapter_engine`：租户名就是适配器名），
# {{N_ADAPTERS}} 个适配器、租户均匀随机，提示词 512、输出 64 个 Token，到达率 {{LORA_OVERLOAD:g}} req/s 高于引擎的服务能力（此时的吞吐就是它的容量），
# `max_lora_rank` = 16。模拟器给每一步加上两样代价（`minibatch/sim/lora.py`）：这一步用到的每个适配器两次细 GEMM 的 FLOPs 与字节（按屋顶线模型计时，每个适配器的权重读一遍），
# 以及把不在槽位里的适配器经主机链路拷进来的时间。一个秩 16、七个投影都改的 Llama-3-8B 适配器有 {{adapter_bytes(get_model_spec("llama-3-8b"), 16) / 1e6:.0f}} MB，
# 在 25 GB/s 的链路上要拷 {{load_time(make_cost_model("llama-3-8b", HW), 16) * 1e3:.1f}} ms；64 行、1 个与 8 个适配器的步，LoRA 的 GEMM 分别多花
# {{lora_step_time(make_cost_model("llama-3-8b", HW), 64, 1, 16) * 1e3:.2f}} 与 {{lora_step_time(make_cost_model("llama-3-8b", HW), 64, 8, 16) * 1e3:.2f}} ms。
# 每个配置 3 个负载种子，稳态取中间 80%：

# %%
def adapter_traffic(n, rate, seed, output_len=64, adapters=N_ADAPTERS):
    """Poisson arrivals, 512-token prompts; each request's tenant is the adapter it asks for (uniform)."""
    return synthetic(n, rate, input_len=512, output_len=output_len, seed=seed,
                     tenants=[f"adapter-{i}" for i in range(adapters)])


slot_runs = {}
for ml in (1, 4, 16):
    for seed in SEEDS:
        eng = tenant_adapter_engine(model="llama-3-8b", hardware=HW, max_loras=ml, max_lora_rank=16)
        s = run_one(adapter_traffic(LORA_N, LORA_OVERLOAD, seed), engine=eng).summary(trim=0.1)
        slot_runs[ml, seed] = dict(tput=s["throughput_tok_s"], batch=s["mean_batch_size"], loads=eng.executor.lora.num_loads)
slot_med = {ml: {k: float(np.median([slot_runs[ml, s][k] for s in SEEDS])) for k in ("tput", "batch", "loads")}
            for ml in (1, 4, 16)}
md_table(["max_loras", "output tok/s (median, 3 seeds)", "range", "mean batch size", "adapter loads"],
         [[ml, f"{m['tput']:.0f}", f"{min(slot_runs[ml, s]['tput'] for s in SEEDS):.0f}-{max(slot_runs[ml, s]['tput'] for s in SEEDS):.0f}",
           f"{m['batch']:.1f}", f"{m['loads']:.0f}"] for ml, m in slot_med.items()])

# %% tags=["check"]
assert all(slot_runs[1, s]["tput"] < slot_runs[4, s]["tput"] for s in SEEDS)
assert slot_med[16]["tput"] > 2 * slot_med[1]["tput"] and slot_med[1]["batch"] < slot_med[16]["batch"]

# %% [markdown]
# 一个槽位（vLLM 的默认）时，一步里只能有一个适配器的请求：平均批大小只有 {{slot_med[1]["batch"]:.1f}}，吞吐 {{slot_med[1]["tput"]:.0f}} tok/s；
# 4 个槽位时 {{slot_med[4]["tput"]:.0f}} tok/s，16 个（每个适配器一个）时 {{slot_med[16]["tput"]:.0f}} tok/s，是一个槽位的 {{slot_med[16]["tput"] / slot_med[1]["tput"]:.1f}} 倍。
# 解码步读一遍基座权重的时间几乎与批大小无关（第 2 章的屋顶线模型），批越小，每个 Token 分摊的越多；多一个适配器只多读它自己约 {{adapter_bytes(get_model_spec("llama-3-8b"), 16) / 1e6:.0f}} MB 的权重，
# 相对 {{get_model_spec("llama-3-8b").weight_bytes / 1e9:.0f}} GB 的基座很少——这正是 Punica 与 S-LoRA 要在一步里混批不同适配器的理由。
# 适配器的加载次数并不多：跳过规则下，一个适配器一旦在槽位里，它后面到达的请求都能直接进来，别的适配器的请求要等到槽位里那个适配器的请求全部做完（练习 7）。
#
# **多副本：把请求送到已有它的适配器的副本。** 槽位是每个副本自己的。`least_requests` 只看负载，同一个适配器的请求散到所有副本上，
# 每个副本都要在有限的槽位里轮换很多适配器。`lora_affinity`（`minibatch/routing/routers.py`）照搬 Gateway API Inference Extension（llm-d 的端点选择器所基于的项目）
# v0.3.0 `pkg/epp/scheduling/scheduler.go` 的决策树：等待请求少于 128 个的副本里，先选正在运行或排队着这个适配器的副本（读 vLLM 的 `vllm:lora_requests_info` 指标，
# 以 0.999 的概率；否则选还有空槽位的），再在其中选等待队列最短的一档、KV 用量最低的一档，最后随机挑一个。
# 4 个副本、每个 `max_loras` = 4，{{N_ADAPTERS}} 个适配器、{{ROUTE_RATE:g}} req/s（{{ROUTE_N / ROUTE_RATE:.0f}} s 的到达），输出 128 个 Token，3 个负载种子，稳态取中间 80%：

# %%
route_runs = {}
for seed in SEEDS:
    for name, kw in (("least_requests", {}), ("lora_affinity", {"adapter_field": "tenant"})):
        engs = [tenant_adapter_engine(model="llama-3-8b", hardware=HW, max_loras=4, max_lora_rank=16) for _ in range(4)]
        s = cluster.run(adapter_traffic(ROUTE_N, ROUTE_RATE, seed, output_len=128), engines=engs, router=name, router_kwargs=kw).summary(trim=0.1)
        route_runs[name, seed] = dict(loads=sum(e.executor.lora.num_loads for e in engs), ttft_p50=s["ttft_p50"], ttft_p90=s["ttft_p90"])
route_med = {n: {k: float(np.median([route_runs[n, s][k] for s in SEEDS])) for k in ("loads", "ttft_p50", "ttft_p90")}
             for n in ("least_requests", "lora_affinity")}
md_table(["router (4 replicas, median of 3 seeds)", "adapter loads", "TTFT p50 (s)", "TTFT p90 (s)"],
         [[n, f"{m['loads']:.0f}", f"{m['ttft_p50']:.3f}", f"{m['ttft_p90']:.3f}"] for n, m in route_med.items()])

# %% tags=["check"]
assert all(route_runs["lora_affinity", s]["loads"] < route_runs["least_requests", s]["loads"] for s in SEEDS)
assert all(route_runs["lora_affinity", s]["ttft_p90"] < route_runs["least_requests", s]["ttft_p90"] for s in SEEDS)

# %% [markdown]
# 按适配器亲和路由，加载次数从 {{route_med["least_requests"]["loads"]:.0f}} 次降到 {{route_med["lora_affinity"]["loads"]:.0f}} 次，
# TTFT p90 从 {{route_med["least_requests"]["ttft_p90"]:.3f}} s 降到 {{route_med["lora_affinity"]["ttft_p90"]:.3f}} s（每个种子都更低）。
# 差别主要不在拷贝本身（每次约 {{load_time(make_cost_model("llama-3-8b", HW), 16) * 1e3:.1f}} ms），而在槽位规则：`least_requests` 下每个副本都要服务几乎所有 {{N_ADAPTERS}} 个适配器，
# 4 个槽位装不下，请求要等别的适配器的请求做完；亲和路由让每个副本只负责少数几个适配器，一步就能把它们都装下。
# 这里的代价模型没有计入细 GEMM 远离屋顶线上限的低效率、也没有计入从磁盘第一次读适配器，真实 GPU 上每多一个适配器的代价会比这里大。

# %% [markdown]
# ## 小结
#
# - 一张卡放几个模型，显存账是 $\text{KV}_m = \lfloor (s_m M - W_m - R)/b_m \rfloor$：权重先占，剩下的才分给各模型的 KV；
#   放得下的标准是 KV 至少装下一个 `max_model_len` 的请求（vLLM 的启动检查）。vLLM 的 `gpu_memory_utilization` 是每个实例的份额，
#   同卡多实例就是显存划分。
# - **显存划分**：模型都常驻，没有切换；每个模型的 KV 变小、各模型的步在一张卡上轮流执行。几个模型都持续有流量、又放得下时，
#   中低负载下它以约一半的成本达到与独占相同的 SLO；负载高时先饱和。
# - **时分复用**：一次一个模型、独享显存，切换要排空加 $W/B_\text{host}$ 的拷贝，停顿 $D$ 还要再花 $D\rho/(1-\rho)$ 消化排队。
#   它用延迟换显存与卡数，适合放不下、按阶段轮换的模型；两个模型同时有流量时很糟。
# - **按模型路由**：集群层只在服务该模型的副本里挑（`cluster.run(models=...)`）。把每个模型放到更多的卡上（统计复用，AlpaServe），
#   一个模型的突发就能用上更多的卡，突发流量下尾延迟更低，代价是每份 KV 更小。
# - **多 LoRA 批处理**：同一基座的很多微调版本是 LoRA 适配器时，只放一份基座，一步里不同适配器的请求一起做基座 GEMM、各自加两次细 GEMM（Punica 的 SGMV）；
#   一步最多 `max_loras` 个不同的适配器（vLLM 默认 1），槽位太少时批变小、吞吐成倍下降；多副本时按适配器亲和路由（Gateway API Inference Extension）让每个副本只管少数适配器。
# - 成本按卡数 × 时间算（GPU·秒），不论忙闲；比较部署方式时要同时看 SLO 达成率与成本，并且只比较放得下的配置。
#
# 下一章（第 26 章）把视线放到同一模型的多个副本上：路由器怎样在副本之间分配请求。
#
# ## 练习
#
# 1. **给热门模型更多 KV。** 用 `mm.partition_shares(ARCHS, HW, kv_split={A: 3, B: 1})` 得到的份额（`mm.run(..., shares=...)`）重跑 25.4 节的扫描，
#    划分显存的容量变了多少？为什么不是按流量比例分 KV 就一定最好？
# 2. **切换更快。** 把 `host_link_bytes_per_s` 改成 50e9（PCIe Gen5）与 200e9（假想的更快链路），重跑 25.5 节的分阶段流量。
#    时分复用的达成率怎样变？切换之外，还有哪一部分停顿不会因为链路变快而缩短？
# 3. **时间片。** 在 25.4 节的稳定流量（8 req/s）下把 `max_slice_s` 从 0.5 s 调到 20 s，画出时分复用的达成率与切换次数。
#    时间片太短和太长各有什么问题？
# 4. **停顿的放大。** 对 25.5 节时分复用的每次切换，用 `ph["time_slice"][0].switches` 与阶段边界（`k * PHASE_S`）算出停顿 $D$（排空 + 拷贝），
#    再从图里读出切换后 TTFT 回到 SLO 以下用了多久。用 25.2 节的 $D\rho/(1-\rho)$ 能解释这段时间吗？$\rho$ 该怎样估计？
# 5. **统计复用的代价。** 把 25.6 节的两个 7B 换成两个 13B（`TWINS = {"chat": B, "code": B}`），到达率降到 6 req/s，再比较两种放法。
#    每卡两模型还占优吗？看看每个引擎的 `kv_blocks_total`。
# 6. **复用摊不开平均负载。** 把 25.6 节每个模型的到达率提到 16 req/s（`TWIN_RATE = 16.0`），突发度仍为 0.05，重跑。
#    两种放法的达成率与 TTFT p99 怎样变？每卡两模型还占优吗？再把回放缩短到 10 s（`TWIN_S = 10.0`）看一次，结论可信吗？
# 7. **跳过规则的公平性。** 在 25.8 节的单引擎实验里取 `max_loras=1`、到达率 8 req/s（低于 16 个槽位时的容量），按适配器（`RequestRecord.tenant`）分组算 TTFT p90。
#    各适配器的 p90 差别大吗？跳过规则会让某个适配器一直等下去吗？换成 `max_loras=4` 呢？
#
# <details><summary>提示与参考答案</summary>
#
# 1. `kv_split={A: 3, B: 1}` 让 7B 的 KV 变大、13B 的变小。7B 承担 3/4 的请求，通常先饱和的是它，所以容量会上升；但 13B 的每个 Token 的 KV 更大
#    （{{make_cost_model(B, HW).kv_bytes_per_token_per_gpu / 1024:.0f}} KiB 对 {{make_cost_model(A, HW).kv_bytes_per_token_per_gpu / 1024:.0f}} KiB）、
#    步也更慢，按请求比例分可能让 13B 先成为瓶颈。合理的分法要让两个模型同时接近饱和，可以对 `kv_split` 做一个小扫描。
# 2. `mm.run(phased([A, B]), [[A, B]], "time_slice", HW, host_link_bytes_per_s=50e9)`。拷贝时间减半，但**排空**（等上一个模型做完手上最长的请求）
#    与排队的消化不变；链路再快，第一批请求也要等排空。
# 3. 时间片很短时，两个模型都有请求就频繁切换，卡的时间大量花在拷权重上，有效容量下降、排队变长；很长时切换少，但不在卡上的模型的请求要等满一个时间片。
#    稳定流量下两者都不达标，这正是 25.4 节的结论。
# 4. 第 $k$ 个阶段边界 $kT$ 之后的第一次切换开始于 `x["t"]`，$D$ = `x["t"] - k * PHASE_S + x["seconds"]`。$\rho$ 是到达率与该模型在这张卡上
#    的饱和吞吐（req/s）之比：饱和吞吐可以用 `steady(rate, popularity=(1, 0))` 这类单模型负载扫到达率，取达成率开始下降处的吞吐来估计。
#    注意连续批处理下卡几乎总在“忙”（只要有一个请求在运行），`busy_gpu_seconds / duration_s` 不是 $\rho$。
# 5. 两个 13B 的权重约 {{2 * get_model_spec(B).weight_bytes / GiB:.0f}} GiB，每卡两模型后每个模型的 KV 只剩约 {{mm.kv_tokens(B, HW, mm.partition_shares({"x": B, "y": B}, HW)["x"]):,}} 个 Token，
#    能同时运行的请求大为减少；负载一高，划分的 KV 就抵消了复用的收益——AlpaServe 所说的取舍。
# 6. 每个模型 16 req/s 时，一次突发就让两张卡都过载：两种放法的达成率都掉到一半以下，每卡两模型不再更好（有的种子更差——
#    两个模型的步在一张卡上轮流执行，本身就有代价）。只回放 10 s 时却可能看到每卡两模型明显更好：很突发的流量下，
#    10 s 里只有一两次突发，结论取决于它们落在哪里。突发越强，稳态测量越要长、种子越要多。
# 7. `res = run_one(adapter_traffic(240, 8.0, 1), engine=tenant_adapter_engine(model="llama-3-8b", max_loras=1))`，再按 `q.tenant` 分组取 `q.ttft` 的 p90。
#    一个槽位时，引擎的容量（25.8 节的表）低于 8 req/s 的需求，队列一直在长，每个适配器的 TTFT 都很长，而且各适配器之间差别不大：
#    槽位里那个适配器后到的请求可以越过队首别的适配器的请求，但每个适配器的到达率不高，它的请求总会做完，槽位就给队首请求的适配器，
#    所以这里没有哪个适配器一直等下去（某个适配器的请求若源源不断，它就能一直占住槽位）；代价是每次轮换都要等槽位里那个适配器的请求全部做完。4 个槽位时容量高于需求，等待短得多。vLLM 的调度器没有为适配器之间的公平做专门处理。
#
# </details>
#
# **本章引用**：AlpaServe（Li et al., *AlpaServe: Statistical Multiplexing with Model Parallelism for Deep Learning Serving*, OSDI'23, arXiv:2302.11665）；
# vLLM 0.11.0 源码 `vllm/config/cache.py`（`gpu_memory_utilization`）、`vllm/v1/worker/gpu_worker.py`（`requested_memory`、`Worker.sleep`）、
# `vllm/v1/core/kv_cache_utils.py`（`check_enough_kv_cache_memory`）、`vllm/entrypoints/llm.py`（`LLM.sleep`、`LLM.wake_up`）；
# LoRA（Hu et al., arXiv:2106.09685）；Punica（Chen et al., arXiv:2310.18547）；S-LoRA（Sheng et al., arXiv:2311.03285）；
# vLLM 0.11.0 `vllm/config/lora.py`（`LoRAConfig`：`max_loras`、`max_lora_rank`、`max_cpu_loras`）、`vllm/v1/core/sched/scheduler.py`（`scheduled_loras`）、
# `vllm/lora/worker_manager.py`（`LRUCacheWorkerLoRAManager`）、`vllm/v1/metrics/loggers.py`（`vllm:lora_requests_info`）；
# Gateway API Inference Extension v0.3.0 `pkg/epp/scheduling/scheduler.go`（`lowLatencyFilter`）与 `filter.go`（`loRASoftAffinityFilter`）；
# vLLM 博客 *Zero-Reload Model Switching with vLLM Sleep Mode*（blog.vllm.ai，2025-10-26）；NVIDIA Multi-Process Service 文档（docs.nvidia.com/deploy/mps，“When to Use MPS”）。
