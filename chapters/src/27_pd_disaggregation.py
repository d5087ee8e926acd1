# %% [markdown]
# # 第 27 章 Prefill/Decode 分离
#
# 第 2 章讲过，一个请求分两段：**预填充**（Prefill）一次算完整个提示词，算力受限（Compute-bound）；**解码**（Decode）每步只算一个
# Token，访存受限（Memory-bound）。连续批处理（第 5 章）让同一个副本、甚至同一步既做预填充又做解码，这种部署叫**合置**
# （Colocated）。第 11 章看到了它的代价：长提示词的预填充让正在解码的请求停顿，分块预填充（Chunked Prefill）把停顿切碎，
# 可预填充的工作量并没有消失。DistServe（Zhong et al., *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized
# Large Language Model Serving*, OSDI'24, arXiv:2401.09670）与 Splitwise（Patel et al., *Splitwise: Efficient Generative LLM
# Inference Using Phase Splitting*, ISCA'24, arXiv:2311.18677）走得更远：把两段放到**不同的 GPU** 上——预填充实例只做预填充，
# 解码实例只做解码，中间经链路把提示词的 KV Cache 传过去。这就是 **Prefill/Decode 分离**（PD Disaggregation，下文简称 PD 分离）。
#
# 分离不是免费的：KV 要搬，字节数与提示词长度成正比；GPU 要按比例分成两池（P:D 比）；负载低时两池都闲着。本章用 DistServe 的
# 指标——**每 GPU 有效吞吐**（Goodput per GPU）——在模拟器里比较合置与分离，找出它赢在哪里、输在哪里。
#
# ## 学习目标
#
# - 写出合置副本里预填充对解码的干扰：$\text{TPOT} \approx t_d / (1 - \lambda\,\mathbb{E}[T_p])$，并说明分块预填充为什么削掉了 Token 间延迟（ITL）的尾巴，
#   却没有降低 TPOT 的均值；
# - 读懂 minibatch 的分离实现（`minibatch/cluster/disagg.py`）：一个请求从预填充池到解码池的路径，TTFT 在哪里测，KV 何时复制、何时释放；
# - 会算 KV 传输的代价：每 Token 字节数 × 提示词长度 ÷ 链路带宽 + 延迟，并用**链路利用率**判断链路会不会成为瓶颈
#   （NVLink、InfiniBand、PCIe、以太网的带宽都注明出处）；
# - 在模拟的 Llama-3-8B / A100-80G 上、每次 60 s 的稳态、3 个种子、对每个种子二分，测出合置（分块与不分块）与 1P3D、2P2D、3P1D 在同样 4 张 GPU 上的
#   每 GPU 有效吞吐与服务容量，并用两池各自的容量解释最优的 P:D 比；
# - 找出分离输掉的三种情形：慢链路（带宽扫描与交叉点）、短提示词长输出、低负载；
# - 在真实的 tiny 模型上验证：分离后的输出与单个引擎逐 Token 相同，而且解码端读的确实是复制过去的 KV；
# - 知道 vLLM（KV Connector）与 SGLang（`--disaggregation-mode`）怎样部署 PD 分离（版本与源文件），以及论文报告的数字。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import cluster
from minibatch.cluster import Disaggregation
from minibatch.cluster.disagg import Disaggregator
from minibatch.results import capacity_over_seeds, meets_slo, steady_state
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import RequestSpec, Workload, lognormal, synthetic

ENGINE = dict(executor="sim", model="llama-3-8b", hardware="a100-80g")   # every simulated replica: one GPU
SLO = {"ttft": 1.5, "tpot": 0.025}        # per request, seconds: first token within 1.5 s, then 40 tokens/s
TARGET = 0.9                              # capacity: the highest rate at which >= 90% of requests meet the SLO
PROMPT = lognormal(median=2048, sigma=0.5, max=6144)
OUTPUT = lognormal(median=128, sigma=0.5, max=512)
LINK_GBPS = 200.0                         # one HDR InfiniBand port per GPU (DGX A100), see 27.3
UNCHUNKED = dict(enable_chunked_prefill=False, max_num_batched_tokens=8192)   # a whole prompt per step
CHUNKED = dict(max_num_batched_tokens=512)                                    # Sarathi-style 512-token chunks
RATE_DEMO = 3.0                           # req/s per GPU in 27.1
RATE_LINK, RATE_SHORT, RATE_LOW = 4.0, 9.0, 1.0   # 27.6: req/s per GPU for the link sweep and the short prompts; req/s at low load
SHORT = dict(prompt=lognormal(median=256, sigma=0.5, max=1024), output=lognormal(median=512, sigma=0.5, max=1024))
RUN_S, SEEDS = 60.0, (1, 2, 3)            # seconds of traffic per run, and the seeds: every measurement below
GPUS, CAP_TOL = 4, 0.1                    # 27.4: GPUs per deployment; the bisection's relative resolution
EARLIER_RUN_S = 20.0                      # this chapter's earlier version replayed this many seconds per run
cm = make_cost_model(ENGINE["model"], ENGINE["hardware"])
print("minibatch", minibatch.__version__, "|", cm.describe().splitlines()[0])


def workload(rate, seed, duration=RUN_S, prompt=PROMPT, output=OUTPUT):
    """Poisson arrivals at ``rate`` req/s (the whole cluster) for ``duration`` seconds."""
    return synthetic(max(20, int(rate * duration)), rate, input_len=prompt, output_len=output, seed=seed)


def over_seeds(values, spec=".0%") -> str:
    """``median (min–max)`` of one number over the seeds."""
    return f"{np.median(values):{spec}} ({min(values):{spec}}–{max(values):{spec}})"


# %% [markdown]
# 本章的服务器：每个副本是一张 A100-80G 上的 Llama-3-8B（模拟器的屋顶线代价模型，第 2 章）。负载像 RAG 或长对话：提示词对数正态，
# 中位数 {{PROMPT.median:.0f}} Token（$\sigma$ = {{PROMPT.sigma}}），输出中位数 {{OUTPUT.median:.0f}} Token。SLO 对**每个请求**分别判断：
# TTFT ≤ {{SLO["ttft"]}} s 且 TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms（每秒 {{1 / SLO["tpot"]:.0f}} 个 Token，比人读得快）；**服务容量**（Capacity）是达成率不低于
# {{TARGET:.0%}} 的最高到达率（DistServe 的定义，`minibatch.results.capacity`），**每 GPU 有效吞吐**是它除以 GPU 数。
# 本章的每次测量都回放 {{RUN_S:.0f}} s 的泊松到达、跑 {{len(SEEDS)}} 个种子，表里给中位数，括号里是种子间的最小–最大；
# 一条结论只有在每个种子上都成立，才写成结论。
#
# ## 27.1 干扰：合置副本里的 TTFT 与 TPOT
#
# 记一次预填充的耗时为 $T_p$（提示词 $L$ 个 Token，算力受限，约与 $L$ 成正比），一个解码步的耗时为 $t_d(B)$（批大小 $B$，访存受限，
# 随 $B$ 增长很慢）。一个合置副本以速率 $\lambda$ 接收请求。不分块时，每个预填充步要多花 $T_p$，这一步里所有解码请求都只前进一个 Token。
# 在时长 $\tau$ 里，预填充一共占去 $\lambda \tau\, \mathbb{E}[T_p]$，剩下的时间才是解码步，于是每个解码请求平均每个 Token 要等
#
# $$
# \text{TPOT} \approx \frac{t_d(B)}{1 - \rho_p}, \qquad \rho_p = \lambda\, \mathbb{E}[T_p] .
# $$
#
# $\rho_p$ 是副本花在预填充上的时间比例。分块预填充把一次 $T_p$ 的停顿拆成许多较小的停顿（每步最多 $c$ 个提示词 Token），
# **ITL 的尾巴**（最长的停顿）变短了，但 $\rho_p$ 没变：预填充的总工作量还在那里，TPOT 的均值几乎不变；而 TTFT 变长，因为一段提示词要分好几步算完。
# 分离把 $\rho_p$ 从解码 GPU 上拿走：解码副本的 TPOT 就是 $t_d(B)$，预填充副本的 TTFT 是排队加 $T_p$，两者各自用各自的 GPU 来满足。
#
# 实验：2 张 GPU、每 GPU {{RATE_DEMO}} req/s，比较两个合置副本（不分块；分块 {{CHUNKED["max_num_batched_tokens"]}}）与一对分离的副本（1P1D：
# 一个预填充、一个解码，{{LINK_GBPS:.0f}} Gb/s 链路）。稳态指标（去掉最先与最后 10% 到达的请求），{{len(SEEDS)}} 个种子：

# %% tags=["nbval-check-output"]
DEMO = {"colocated": dict(replicas=2, **UNCHUNKED), "colocated, chunked 512": dict(replicas=2, **CHUNKED),
        "1P1D": dict(disaggregation=Disaggregation(1, 1, link_gbps=LINK_GBPS))}
demo = {(name, seed): cluster.run(workload(2 * RATE_DEMO, seed), router="least_requests", **ENGINE, **kw)
        for name, kw in DEMO.items() for seed in SEEDS}


def itls(result):
    return np.concatenate([r.itl for r in steady_state(result.requests, 0.1) if len(r.itl)])


dv = {name: {k: [] for k in ("ttft_p50", "ttft_p90", "tpot_mean", "tpot_p90", "itl_p99", "slo_attainment")} for name in DEMO}
for (name, seed), res in demo.items():
    s = dict(res.summary(slo=SLO, trim=0.1), itl_p99=float(np.percentile(itls(res), 99)))
    for k in dv[name]:
        dv[name][k].append(s[k])
dm = {name: {k: float(np.median(v)) for k, v in d.items()} for name, d in dv.items()}
md_table(["2 GPUs, 3 req/s/GPU (median of 3 seeds)", "TTFT p50 / p90 (s)", "TPOT mean / p90 (ms)", "ITL p99 (ms)",
          "SLO attainment: median (min–max)"],
         [[name, f"{m['ttft_p50']:.2f} / {m['ttft_p90']:.2f}", f"{m['tpot_mean'] * 1e3:.1f} / {m['tpot_p90'] * 1e3:.1f}",
           f"{m['itl_p99'] * 1e3:.0f}", over_seeds(dv[name]["slo_attainment"])] for name, m in dm.items()])


def tpot_formula(seed):
    """t_d / (1 - rho_p) from the colocated run itself: t_d = its decode-only steps, E[T_p] = the cost model's prefill."""
    steps = demo["colocated", seed].steps
    t_d = float(np.mean([st.duration for st in steps if st.num_prefill_tokens == 0]))
    e_tp = float(np.mean([cm.step_time([(p, p)], []) for p in workload(2 * RATE_DEMO, seed).prompt_lens]))
    return t_d, e_tp, RATE_DEMO * e_tp, t_d / (1 - RATE_DEMO * e_tp)


formula = {seed: tpot_formula(seed) for seed in SEEDS}
ratio = [dv["colocated"]["tpot_mean"][i] / formula[s][3] for i, s in enumerate(SEEDS)]
t_d, e_tp, rho_p, tpot_pred = (float(np.median([formula[s][i] for s in SEEDS])) for i in range(4))
print(f"colocated (median of 3 seeds): t_d = {t_d * 1e3:.1f} ms, E[T_p] = {e_tp * 1e3:.0f} ms, rho_p = {rho_p:.2f} "
      f"-> predicted mean TPOT {tpot_pred * 1e3:.1f} ms; measured / predicted per seed: {[round(r, 2) for r in ratio]}")
co, ch, pd = (dv[n] for n in DEMO)


def each(xs, ys, op) -> bool:
    """``op(x, y)`` for the values of every seed."""
    return all(op(x, y) for x, y in zip(xs, ys))

# %% tags=["check"]
assert all(abs(r - 1) < 0.2 for r in ratio), "the formula predicts the colocated mean TPOT within 20% on every seed"
assert each(ch["itl_p99"], co["itl_p99"], lambda x, y: x < y / 2), "chunking cuts the ITL tail"
assert each(ch["tpot_mean"], co["tpot_mean"], lambda x, y: abs(x / y - 1) < 0.25), "... but hardly the mean TPOT"
assert each(ch["ttft_p50"], co["ttft_p50"], lambda x, y: x > y), "... and TTFT grows"
assert each(pd["tpot_p90"], [min(a, b) for a, b in zip(co["tpot_p90"], ch["tpot_p90"])], lambda x, y: x < 0.7 * y)
assert each(pd["ttft_p90"], co["ttft_p90"], lambda x, y: x > y), "1P1D: one prefill GPU queues the prompts"

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.3))
for name, col in zip(DEMO, ("C3", "C1", "C0")):
    res = demo[name, SEEDS[0]]                       # one seed drawn; the table has all three
    x = np.sort(itls(res)) * 1e3
    ax1.plot(x, np.linspace(0, 1, len(x)), color=col, label=name)
    t = np.sort([r.ttft for r in steady_state(res.requests, 0.1)])
    ax2.plot(t, np.linspace(0, 1, len(t)), color=col, label=name)
ax1.axvline(SLO["tpot"] * 1e3, color="k", ls=":", lw=1, label="TPOT SLO")
ax1.set(xscale="log", xlabel="inter-token latency (ms)", ylabel="fraction of gaps", title=f"ITL: prefill stalls decodes (seed {SEEDS[0]})")
ax2.axvline(SLO["ttft"], color="k", ls=":", lw=1, label="TTFT SLO")
ax2.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT")
for ax in (ax1, ax2):
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# 以下每一条在三个种子上都成立（数字是中位数）。合置、不分块时，副本有 $\rho_p$ = {{rho_p:.2f}} 的时间在做预填充：公式给出 TPOT 均值约
# {{tpot_pred * 1e3:.1f}} ms，实测 {{dm["colocated"]["tpot_mean"] * 1e3:.1f}} ms（每个种子上实测与公式之比在 {{min(ratio):.2f}}–{{max(ratio):.2f}}），
# 已经贴着 {{SLO["tpot"] * 1e3:.0f}} ms 的 SLO。左图是所有 Token 间隔的分布：不分块时有一截间隔长达一次整段预填充（p99 为 {{dm["colocated"]["itl_p99"] * 1e3:.0f}} ms）；
# 分块 512 把它压到 {{dm["colocated, chunked 512"]["itl_p99"] * 1e3:.0f}} ms，但 TPOT 均值只从 {{dm["colocated"]["tpot_mean"] * 1e3:.1f}} 变为
# {{dm["colocated, chunked 512"]["tpot_mean"] * 1e3:.1f}} ms——停顿被摊开了，没有消失；代价是 TTFT 中位数从 {{dm["colocated"]["ttft_p50"]:.2f}} s 升到
# {{dm["colocated, chunked 512"]["ttft_p50"]:.2f}} s。1P1D 的解码 GPU 上没有预填充，TPOT p90 只有 {{dm["1P1D"]["tpot_p90"] * 1e3:.1f}} ms；
# 可 {{2 * RATE_DEMO:.0f}} req/s 的提示词全压在一张预填充 GPU 上，TTFT p90 升到 {{dm["1P1D"]["ttft_p90"]:.2f}} s（右图）。
# 这正是 DistServe 说的两件事：合置时两种延迟**互相干扰**，而且两段**共用同一份资源与并行方式**，只能一起扩；分离之后，TTFT 由预填充池负责、
# TPOT 由解码池负责，可以分别配 GPU——1P1D 显然不是这份负载的好比例，27.5 节来选。
#
# ## 27.2 分离式架构：minibatch 的实现
#
# ```
#  arrival ─► router ─► prefill replica 0..P-1 ──(first token: TTFT)──► ready queue (FIFO)
#                                                                          │ a decode replica with room
#                                                                          ▼
#              decode replica P..P+D-1 ◄── KV blocks over the link: bytes / bandwidth + latency
# ```
#
# `cluster.run(..., disaggregation=Disaggregation(prefill=P, decode=D, link_gbps=..., link_latency_s=...))` 建 P 个预填充副本、D 个解码副本。
# 路由器只在预填充池里选；预填充副本算完提示词、采样出第一个 Token（**TTFT 在预填充端测**），这一步结束时请求离开它的调度器，
# 进入一个先来先服务的就绪队列；解码池选一个有足够空闲块的副本（默认选虚拟 KV 占用最少的），预留块，KV 经链路传过去；
# 传完之前请求在两边都占着块，传完才释放预填充端的块、加入解码副本的运行队列。下面是这段代码（本章读的就是跑实验的代码）：

# %%
print(inspect.getsource(Disaggregator.after_prefill_step))
print(inspect.getsource(Disaggregator.try_start))

# %% [markdown]
# 注意 `try_start` 里的链路模型：**每个副本只有一条链路**（一块网卡），同一时刻只传一份 KV，先来先服务，所以一次传输从
# $t_0 = \max(t_\text{ready}, \text{两端链路空闲})$ 开始，占用两端链路 $\text{bytes}/W$，再加上延迟 $\alpha$ 才到达。
# 写这一章时发现 minibatch 原来的实现让任意多份传输同时以满带宽跑（慢链路永远不会排队），已修正并加了单元测试
# （`tests/cluster/test_cluster_disagg.py::test_each_replicas_link_carries_one_transfer_at_a_time`）。真实系统会把传输与计算重叠
# （逐层发送），minibatch 在预填充完成后整段发送，是偏保守的模型。
#
# ## 27.3 KV 传输的代价
#
# 每个 Token 的 KV 字节数是每层的 K 与 V：
#
# $$
# b = 2 \cdot n_\text{layers} \cdot n_\text{kv\_heads} \cdot d_\text{head} \cdot \text{bytes per element},\qquad
# T_x(L) = \frac{\lceil L / B \rceil \cdot B \cdot b}{W} + \alpha ,
# $$
#
# $B$ 是块大小（minibatch 按整块传），$W$ 是链路带宽，$\alpha$ 是延迟。链路是共享的：一个副本的链路每秒要搬 $\lambda_\text{link} \cdot \mathbb{E}[b L]$ 字节，
# **链路利用率** $\rho_\text{link} = \lambda_\text{link}\, \mathbb{E}[b L] / W$ 必须小于 1，否则传输无限排队（$\lambda_\text{link}$ 是经过这条链路的请求速率：
# 一个预填充副本发出的，或一个解码副本收到的）。下表用代价模型的字节数（bf16）给出一个 2048 Token 提示词在各种链路上的传输时间，
# 与同一提示词在 A100 上的预填充时间对照：

# %% tags=["nbval-check-output"]
# Per-direction bandwidth in Gb/s (datasheets print NVLink and PCIe as the sum of both directions).
LINKS = {"NVLink 3 (A100 SXM, 600 GB/s both ways)": 300 * 8, "NVLink 4 (H100 SXM, 900 GB/s both ways)": 450 * 8,
         "PCIe Gen5 x16 (128 GB/s both ways)": 64 * 8, "InfiniBand NDR, 400 Gb/s (ConnectX-7)": 400,
         "PCIe Gen4 x16 (64 GB/s both ways)": 32 * 8, "InfiniBand HDR, 200 Gb/s (ConnectX-6)": 200,
         "100 Gb Ethernet": 100, "25 Gb Ethernet": 25, "10 Gb Ethernet": 10}
L_EX = 2048
kv_tok = {m: make_cost_model(m, "a100-80g").kv_bytes_per_token_per_gpu for m in ("llama-3-8b", "llama-2-13b")}
t_pre = {m: make_cost_model(m, "a100-80g").step_time([(L_EX, L_EX)], []) for m in kv_tok}
rows, t_x = [], {}
for link, gbps in sorted(LINKS.items(), key=lambda kv: -kv[1]):
    t_x[link] = {m: Disaggregation(link_gbps=gbps).seconds(L_EX * b) for m, b in kv_tok.items()}
    rows.append([link, f"{gbps:,.0f}"] + [f"{t_x[link][m] * 1e3:,.1f} ms ({1 / t_x[link][m]:,.0f} req/s)" for m in kv_tok])
md_table(["link (per direction)", "Gb/s"] + [f"{m}: {kv_tok[m] // 1024} KiB/token x {L_EX}" for m in kv_tok], rows)
print("prefill of the same 2048 tokens on one A100:", {m: f"{t * 1e3:.0f} ms" for m, t in t_pre.items()})

# %% tags=["check"]
assert kv_tok["llama-3-8b"] == 2 * 32 * 8 * 128 * 2 and kv_tok["llama-2-13b"] == 2 * 40 * 40 * 128 * 2
assert t_x["InfiniBand HDR, 200 Gb/s (ConnectX-6)"]["llama-3-8b"] < 0.2 * t_pre["llama-3-8b"]
assert t_x["10 Gb Ethernet"]["llama-2-13b"] > 4 * t_pre["llama-2-13b"]

# %% [markdown]
# 括号里是这条链路每秒最多传多少个这样的请求（$1/T_x$），也就是 $\rho_\text{link} = 1$ 时的速率。几点：
#
# - **GQA 让 KV 变小**：Llama-3-8B 有 8 个 KV 头，每 Token {{kv_tok["llama-3-8b"] // 1024}} KiB；Llama-2-13B 是多头注意力（40 个 KV 头），每 Token
#   {{kv_tok["llama-2-13b"] // 1024}} KiB，同样 2048 Token 要传 {{kv_tok["llama-2-13b"] * L_EX / 2**30:.2f}} GiB。
# - 在 HDR InfiniBand（200 Gb/s）上，Llama-3-8B 的传输只要 {{t_x["InfiniBand HDR, 200 Gb/s (ConnectX-6)"]["llama-3-8b"] * 1e3:.1f}} ms，远小于它的预填充
#   （{{t_pre["llama-3-8b"] * 1e3:.0f}} ms）；在 10 Gb 以太网上，Llama-2-13B 要 {{t_x["10 Gb Ethernet"]["llama-2-13b"]:.2f}} s，是预填充的
#   {{t_x["10 Gb Ethernet"]["llama-2-13b"] / t_pre["llama-2-13b"]:.0f}} 倍——这时分离得不偿失。
# - 带宽的出处：NVLink 3 每 GPU 600 GB/s、PCIe Gen4 64 GB/s（NVIDIA A100 数据手册）；NVLink 4 900 GB/s、PCIe Gen5 128 GB/s（NVIDIA H100 数据手册）；
#   DGX A100 每张 GPU 配一块 200 Gb/s HDR InfiniBand（ConnectX-6），DGX H100 每张 GPU 一块 400 Gb/s NDR（ConnectX-7，NVIDIA DGX BasePOD
#   参考架构）；以太网按 IEEE 802.3 的线速。手册上 NVLink 与 PCIe 印的是两个方向之和，表里取单向；这些都是线速，实际能用上的还要打个折扣。
#   `minibatch.sim.hardware` 里 A100/H100 的 `interconnect_bandwidth` 用的是同样的数。
#
# DistServe 的放置算法正是按带宽来的：节点间带宽高时，预填充与解码实例可以放在不同节点；带宽低时，把对应的实例放在同一节点内，
# 走 NVLink（论文摘要："places the two phases according to the serving cluster's bandwidth"）。
#
# ## 27.4 每 GPU 有效吞吐：同样 4 张 GPU
#
# 四种部署用同样 {{GPUS}} 张 GPU：合置 {{GPUS}} 个副本（不分块；分块 512），以及三种分离比例 1P3D、2P2D、3P1D（{{LINK_GBPS:.0f}} Gb/s 链路）。
# 每种部署、每个种子**分别**二分求容量（`minibatch.results.capacity_over_seeds`）：在一个包住答案的区间里取几何中点，回放 {{RUN_S:.0f}} s，
# 达标就往上、不达标就往下，直到区间两端相差不到 {{CAP_TOL:.0%}}；稳态指标去掉最先与最后 10% 到达的请求。各部署的区间不同（下表第二列），
# 二分会先核对区间的下端达标、上端不达标。

# %% tags=["nbval-check-output"]
SETUPS = {"colocated": dict(replicas=GPUS, **UNCHUNKED), "colocated, chunked 512": dict(replicas=GPUS, **CHUNKED),
          **{f"{p}P{GPUS - p}D": dict(disaggregation=Disaggregation(p, GPUS - p, link_gbps=LINK_GBPS))
             for p in (1, 2, 3)}}
BRACKET = {"colocated": (1.8, 3.6), "colocated, chunked 512": (2.2, 4.4), "1P3D": (0.9, 1.8), "2P2D": (2.0, 4.0),
           "3P1D": (3.0, 6.0)}          # req/s per GPU: where each setup's capacity lies
sweep = {}          # (setup, rate per GPU, seed) -> steady-state summary; every run happens once


def measure(name, rate, seed, **override):
    """The steady-state summary of one run, plus the attainment of each SLO bound on its own."""
    key = (name, rate, seed, tuple((k, repr(v)) for k, v in sorted(override.items())))
    if key not in sweep:
        res = cluster.run(workload(GPUS * rate, seed), router="least_requests", **ENGINE, **{**SETUPS[name], **override})
        s = res.summary(slo=SLO, trim=0.1)
        done = [r for r in steady_state(res.requests, 0.1) if r.completed]
        for k, bound in SLO.items():
            s[f"{k}_only"] = sum(meets_slo(r, {k: bound}) for r in done) / len(done)
        sweep[key] = s
    return sweep[key]


cap = {name: capacity_over_seeds(lambda r, s, n=name: measure(n, r, s)["slo_attainment"], SEEDS, target=TARGET,
                                 lo=BRACKET[name][0], hi=BRACKET[name][1], tol=CAP_TOL) for name in SETUPS}
md_table([f"{GPUS} GPUs", "bracket (req/s/GPU)", "capacity (req/s/GPU): median (min–max)", "per seed"],
         [[name, f"{lo:g}–{hi:g}", f"{cap[name]:.2f}", " / ".join(f"{c:.2f}" for c in cap[name].per_seed)]
          for name, (lo, hi) in BRACKET.items()])
print(f"{len(sweep)} simulated runs of {RUN_S:.0f} s")

# %%
def probes(name, seed) -> dict:
    """{rate: summary} of every run the bisection made for this setup and seed."""
    return {r: v for (n, r, s, o), v in sweep.items() if n == name and s == seed and not o}


def first_miss(name, key) -> float:
    """Median over the seeds of ``key`` at each seed's lowest rate that missed the target (just above capacity)."""
    return float(np.median([min(((r, v) for r, v in probes(name, s).items() if v["slo_attainment"] < TARGET),
                                key=lambda rv: rv[0])[1][key] for s in SEEDS]))


best = max(SETUPS, key=lambda n: cap[n].median)
best_colo = max(("colocated", "colocated, chunked 512"), key=lambda n: cap[n].median)
gain = [a / b for a, b in zip(cap["3P1D"].per_seed, cap[best_colo].per_seed)]
miss = {name: {k: first_miss(name, k) for k in ("ttft_only", "tpot_only", "ttft_p90", "tpot_p90")} for name in SETUPS}

# %% tags=["check"]
assert best == "3P1D" and cap["3P1D"].lo > cap[best_colo].hi and min(gain) >= 1.3, "3P1D serves the most per GPU, every seed"
assert cap["1P3D"].hi < cap["colocated"].lo, "1P3D below colocated on every seed"
assert cap["colocated, chunked 512"].lo > cap["colocated"].hi, "chunking helps colocated, every seed"
assert all(abs(a / b - 1) <= 0.15 for a, b in zip(cap["2P2D"].per_seed, cap["colocated, chunked 512"].per_seed))
assert all(lo < c < hi for n, (lo, hi) in BRACKET.items() for c in cap[n].per_seed), "every capacity inside its bracket"
assert miss["colocated"]["tpot_only"] < TARGET <= miss["colocated"]["ttft_only"], "colocated fails on TPOT, not TTFT"
assert miss["1P3D"]["ttft_only"] < TARGET <= miss["1P3D"]["tpot_only"], "1P3D fails on TTFT (its one prefill GPU queues)"

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
styles = {"colocated": ("C3", "s--"), "colocated, chunked 512": ("C1", "s--"), "1P3D": ("C4", "o-"),
          "2P2D": ("C2", "o-"), "3P1D": ("C0", "o-")}
for name in SETUPS:
    col, ls = styles[name]
    for i, seed in enumerate(SEEDS):
        pts = sorted(probes(name, seed).items())
        rs = [r for r, _ in pts]
        ax1.plot(rs, [r * v["slo_attainment"] for r, v in pts], ls, color=col, lw=0.8, ms=3, label=name if i == 0 else None)
        ax2.plot(rs, [v["slo_attainment"] * 100 for _, v in pts], ls, color=col, lw=0.8, ms=3, label=name if i == 0 else None)
ax1.plot([0, 6], [0, 6], color="0.7", lw=1, label="every request meets the SLO")
ax2.axhline(TARGET * 100, color="k", ls=":", lw=1)
ax1.set(xlabel="offered rate (req/s per GPU)", ylabel="rate x attainment (req/s per GPU)",
        title="Goodput per GPU (4 GPUs; every run the bisection made, one line per seed)", xlim=(0.8, 6.2), ylim=(0, 6))
ax2.set(xlabel="offered rate (req/s per GPU)", ylabel="SLO attainment (%)", title="TTFT <= 1.5 s and TPOT <= 25 ms")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# 左图的有效吞吐取“到达率 × 达成率”：稳态里每秒到达、并且会满足 SLO 的请求数（除以 {{GPUS}} 张 GPU）。它先沿对角线上升，过了容量就掉下来；
# 每条线是一个种子上二分试过的到达率。容量（中位数与三个种子的范围）：
#
# - **合置**：不分块时每 GPU {{cap["colocated"]:.2f}} req/s，分块 512 为 {{cap["colocated, chunked 512"]:.2f}}——分块在每个种子上都更高。
#   限制合置的是 TPOT：到达率越高，$\rho_p$ 越大，TPOT 被预填充拖过 SLO。在每个种子刚刚不达标的到达率上（不分块），只看 TPOT 的达成率是
#   {{miss["colocated"]["tpot_only"]:.0%}}，只看 TTFT 的却有 {{miss["colocated"]["ttft_only"]:.0%}}（三个种子的中位数）。
# - **3P1D**：每 GPU {{cap["3P1D"]:.2f}} req/s，是最好的合置部署的 {{cap["3P1D"].median / cap[best_colo].median:.2f}} 倍；它最差的种子也高于合置最好的种子。
# - **2P2D**（{{cap["2P2D"]:.2f}}）与分块的合置差不多（每个种子上相差不到 15%），**1P3D**（{{cap["1P3D"]:.2f}}）比合置还差：
#   一张预填充 GPU 接不住 {{GPUS}} 张 GPU 份量的提示词——在刚刚不达标的到达率上只有 {{miss["1P3D"]["ttft_only"]:.0%}} 的请求满足 TTFT
#   （p90 为 {{miss["1P3D"]["ttft_p90"]:.1f}} s），而三张解码 GPU 的 TPOT p90 只有 {{miss["1P3D"]["tpot_p90"] * 1e3:.1f}} ms，远没用满。
#   **分离本身不带来容量，比例才带来容量。**
#
# 本章早先的版本每次只回放 {{EARLIER_RUN_S:.0f}} s、容量取自一条步长 1 req/s/GPU 的阶梯；换成 {{RUN_S:.0f}} s、每个种子二分之后，
# 上面四条结论（3P1D 最好且高出 1.3 倍以上、1P3D 最差、分块好于不分块、2P2D 与分块合置相当）都还在，而且不依赖种子；
# 变的是精度：容量现在二分到 {{CAP_TOL:.0%}} 以内、带着三个种子的范围，不再是阶梯上的整数。`.venv/bin/python benchmarks/cluster.py --disagg`
# 用同样的二分法、更多的请求做这组比较，更精确也更慢。
#
# ## 27.5 P:D 比怎么选
#
# 两个池各有各的容量。预填充池：一张 GPU 每秒最多做 $\mu_p = 1/\mathbb{E}[T_p]$ 个预填充（TTFT 的 SLO 还要求它别太满）。解码池：一张 GPU
# 在 TPOT 的 SLO 下最多同时解码 $B^\ast$ 个请求（$t_d(B^\ast) \le$ SLO），每个请求要 $\mathbb{E}[L_\text{out}]$ 步，所以
# $\mu_d = B^\ast / (\mathbb{E}[L_\text{out}]\, t_d(B^\ast))$。$P$ 个预填充、$D$ 个解码 GPU 的每 GPU 容量约为
#
# $$
# \frac{\min(P\mu_p,\; D\mu_d)}{P + D}, \qquad \text{最优比例}\quad \frac{P}{D} \approx \frac{\mu_d}{\mu_p} .
# $$
#
# 用代价模型算这两个数（不跑模拟），与上面测得的容量对照：

# %% tags=["nbval-check-output"]
rng = np.random.default_rng(0)
prompts, outs = PROMPT.sample(2000, rng), OUTPUT.sample(2000, rng)
mu_p = 1 / float(np.mean([cm.step_time([(int(p), int(p))], []) for p in prompts[:400]]))
ctx = int(prompts.mean() + outs.mean() / 2)                    # a decoding request's mean context
b_star = max(b for b in range(1, 513) if cm.step_time([], [ctx] * b) <= SLO["tpot"])
mu_d = b_star / (outs.mean() * cm.step_time([], [ctx] * b_star))
predicted = {f"{p}P{GPUS - p}D": min(p * mu_p, (GPUS - p) * mu_d) / GPUS for p in (1, 2, 3)}
md_table(["split", "predicted (req/s/GPU)", "bound by", "measured capacity: median (min–max)"],
         [[k, f"{v:.2f}", "prefill pool" if int(k[0]) * mu_p < (GPUS - int(k[0])) * mu_d else "decode pool", f"{cap[k]:.2f}"]
          for k, v in predicted.items()])
print(f"mu_p = {mu_p:.1f} prefills/s per GPU, B* = {b_star} (t_d = {cm.step_time([], [ctx] * b_star) * 1e3:.1f} ms "
      f"at context {ctx}), mu_d = {mu_d:.1f} requests/s per GPU -> best P/D ~ {mu_d / mu_p:.1f}")
shortfall = {k: 1 - cap[k].median / v for k, v in predicted.items()}

# %% tags=["check"]
assert max(predicted, key=predicted.get) == best, "the model and the measurement pick the same split"
assert all(p * mu_p < (GPUS - p) * mu_d for p in (1, 2)), "1P3D and 2P2D are bound by their prefill pool"
assert all(cap[k].hi <= v for k, v in predicted.items()), "the prediction is an upper bound, on every seed"
assert all(0 <= x < 0.25 for x in shortfall.values()), "measured within 25% below the bound"

# %% [markdown]
# 一张 A100 每秒能做约 {{mu_p:.1f}} 个这样的预填充，却能在 {{SLO["tpot"] * 1e3:.0f}} ms 的 TPOT 下同时解码 {{b_star}} 个请求、每秒送走约
# {{mu_d:.0f}} 个：解码池的一张 GPU 抵得上预填充池的 {{mu_d / mu_p:.1f}} 张。所以这份“长提示词、短输出”的负载要 3P1D；1P3D 与 2P2D 都被预填充池卡住，
# 测得的容量（中位数）比模型预测的低 {{min(shortfall.values()):.0%}}–{{max(shortfall.values()):.0%}}。预测的是瓶颈池 100% 忙时的上限，每个种子测得的容量都不高于它：TTFT 的 SLO 要求预填充池留有余量，
# 它一满，排队就会把 TTFT 推过 SLO。这个算法就是 DistServe 放置搜索的简化版：论文对每个阶段分别搜索并行方式与实例数，
# 用模拟器估计每个实例满足 SLO 的最大速率，再按到达率复制实例。比例取决于负载：输出越长、提示词越短，需要的解码 GPU 越多（27.6 节）。
#
# Splitwise 换了一个角度：既然解码不需要最新 GPU 的算力（访存受限），就让两池用**不同的硬件**——预填充用 H100，解码用更便宜或更省电的 A100。
# minibatch 的 `Disaggregation(prefill_hardware=..., decode_hardware=...)` 可以模拟这种异构集群（练习 4）。
#
# ## 27.6 分离输在哪里
#
# **慢链路。** 3P1D 唯一的解码 GPU 要接收全部请求的 KV，它的链路利用率 $\rho_\text{link} = \lambda\, \mathbb{E}[bL] / W$。在每 GPU {{RATE_LINK:g}} req/s
# （高于合置的容量、低于 3P1D 的容量：上一节每个种子都是如此）下扫描链路带宽，3 个种子：

# %% tags=["nbval-check-output"]
BANDWIDTHS = [200, 100, 50, 25, 10]
link_s = {(g, s): measure("3P1D", RATE_LINK, s, disaggregation=Disaggregation(3, 1, link_gbps=g)) for g in BANDWIDTHS for s in SEEDS}
colo_s = {s: measure(best_colo, RATE_LINK, s) for s in SEEDS}
colo_goodput = float(np.median([RATE_LINK * colo_s[s]["slo_attainment"] for s in SEEDS]))
link_goodput = {g: [RATE_LINK * link_s[g, s]["slo_attainment"] for s in SEEDS] for g in BANDWIDTHS}
bytes_mean = float(np.mean([-(-int(p) // 16) * 16 for p in prompts])) * kv_tok["llama-3-8b"]
gbps_needed = GPUS * RATE_LINK * bytes_mean * 8 / 1e9                # rho_link = 1 on the decode GPU's link
md_table(["link Gb/s", "rho_link (decode GPU)", "SLO attainment: median (min–max)", "TPOT p90 (ms)", "rate x attainment / GPU"],
         [[g, f"{gbps_needed / g:.2f}", over_seeds([link_s[g, s]["slo_attainment"] for s in SEEDS]),
           f"{np.median([link_s[g, s]['tpot_p90'] for s in SEEDS]) * 1e3:.0f}", f"{np.median(link_goodput[g]):.2f}"]
          for g in BANDWIDTHS])
wins = [g for g in BANDWIDTHS if min(link_goodput[g]) > max(RATE_LINK * colo_s[s]["slo_attainment"] for s in SEEDS)]
crossover = min(wins)
below = max(g for g in BANDWIDTHS if g < crossover)
print(f"{best_colo} at the same load: goodput {colo_goodput:.2f} req/s/GPU (median); the decode link saturates at "
      f"{gbps_needed:.0f} Gb/s; disaggregation wins on every seed down to {crossover} Gb/s")
tpot90 = {g: float(np.median([link_s[g, s]["tpot_p90"] for s in SEEDS])) for g in BANDWIDTHS}

# %% tags=["check"]
assert cap[best_colo].hi < RATE_LINK < cap["3P1D"].lo, "the rate sits between the two capacities on every seed"
assert all(link_s[BANDWIDTHS[0], s]["slo_attainment"] >= TARGET and link_s[10, s]["slo_attainment"] < 0.5 for s in SEEDS)
assert below < gbps_needed <= crossover, "the crossover sits where the decode GPU's link saturates"
assert all(max(link_goodput[g]) < colo_goodput for g in BANDWIDTHS if g < crossover)
assert tpot90[crossover] < 1.3 * tpot90[BANDWIDTHS[0]], "above saturation the link adds little"

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(BANDWIDTHS, [np.median(link_goodput[g]) for g in BANDWIDTHS], "o-", color="C0", label="3P1D (median of 3 seeds)")
for g in BANDWIDTHS:
    ax.plot([g] * len(SEEDS), link_goodput[g], ".", color="C0", alpha=0.5)
ax.axhline(colo_goodput, color="C1", ls="--", label=f"{best_colo} (same 4 GPUs)")
ax.axvline(gbps_needed, color="k", ls=":", lw=1, label="decode link saturates")
ax.set(xscale="log", xlabel="link bandwidth per GPU (Gb/s)", ylabel="rate x attainment (req/s per GPU)",
       title=f"{RATE_LINK:g} req/s per GPU: where the link decides")
ax.legend(fontsize=7)
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# 每秒 {{GPUS * RATE_LINK:.0f}} 个请求、每个平均 {{bytes_mean / 2**20:.0f}} MiB 的 KV，解码 GPU 的链路要 {{gbps_needed:.0f}} Gb/s 才不排队。
# 带宽高于它时，传输只给第二个 Token 添几十毫秒以内（{{BANDWIDTHS[0]}} 到 {{crossover}} Gb/s 时 TPOT p90 只从
# {{tpot90[BANDWIDTHS[0]] * 1e3:.0f}} 变为 {{tpot90[crossover] * 1e3:.0f}} ms），3P1D 的有效吞吐远高于合置；低于它时传输排起长队，解码端的请求等 KV 等到 TPOT 超标，
# 在 {{below}} Gb/s 及以下分离就输给了同样 4 张 GPU 的合置部署——交叉点正落在链路饱和的地方，三个种子都一样。这也是 3P1D 的弱点：
# 一个解码 GPU 收全部流量；同样的带宽下，1P3D 的每条解码链路只接收三分之一。
#
# **短提示词、长输出。** 干扰来自预填充；预填充少了，分离就只剩代价。把负载换成提示词中位数 {{SHORT["prompt"].median:.0f}}、输出中位数
# {{SHORT["output"].median:.0f}}，在 2 张 GPU 上比较合置与 1P1D（每 GPU {{RATE_SHORT:g}} req/s，3 个种子）：

# %% tags=["nbval-check-output"]
short = {(name, seed): cluster.run(workload(2 * RATE_SHORT, seed, **SHORT), router="least_requests", **ENGINE, **kw)
         .summary(slo=SLO, trim=0.1)
         for name, kw in (("colocated", dict(replicas=2)),
                          ("1P1D", dict(disaggregation=Disaggregation(1, 1, link_gbps=LINK_GBPS)))) for seed in SEEDS}
sv = {n: {k: [short[n, s][k] for s in SEEDS] for k in ("ttft_p90", "tpot_p90", "slo_attainment")} for n in ("colocated", "1P1D")}
md_table(["prompt 256 / output 512, 2 GPUs", "TTFT p90 (s)", "TPOT p90 (ms)", "SLO attainment: median (min–max)"],
         [[n, f"{np.median(v['ttft_p90']):.2f}", f"{np.median(v['tpot_p90']) * 1e3:.1f}", over_seeds(v["slo_attainment"])]
          for n, v in sv.items()])
short_wl = workload(2 * RATE_SHORT, SEEDS[0], **SHORT)
mu_p_short = 1 / float(np.mean([cm.step_time([(p, p)], []) for p in short_wl.prompt_lens]))
ctx_short = int(short_wl.prompt_lens.mean() + short_wl.output_lens.mean() / 2)
b_short = max(b for b in range(1, 1025) if cm.step_time([], [ctx_short] * b) <= SLO["tpot"])
mu_d_short = b_short / (short_wl.output_lens.mean() * cm.step_time([], [ctx_short] * b_short))
print(f"{RATE_SHORT:g} req/s per GPU; mu_p = {mu_p_short:.0f} prefills/s, mu_d = {mu_d_short:.1f} requests/s per GPU")

# %% tags=["check"]
assert all(short["colocated", s]["slo_attainment"] >= TARGET > short["1P1D", s]["slo_attainment"] for s in SEEDS)
assert RATE_SHORT < mu_d_short < 2 * RATE_SHORT < mu_p_short, "the prose: 1P1D's decode GPU gets more than it can take"

# %% [markdown]
# 这份负载的预填充很便宜（一张 GPU 每秒能做 {{mu_p_short:.0f}} 个），解码才是主要的工作：一张 GPU 在 TPOT SLO 下每秒最多送走约 {{mu_d_short:.1f}} 个请求。
# 两个合置副本都在解码，每个只分到 {{RATE_SHORT:g}} req/s，达成率 {{over_seeds(sv["colocated"]["slo_attainment"])}}；1P1D 只有一张 GPU 解码，
# 却要接 {{2 * RATE_SHORT:g}} req/s，解码批越积越大，TPOT p90 升到 {{np.median(sv["1P1D"]["tpot_p90"]) * 1e3:.1f}} ms，达成率只有
# {{over_seeds(sv["1P1D"]["slo_attainment"])}}，而预填充 GPU 只忙约 {{2 * RATE_SHORT / mu_p_short:.0%}} 的时间。
# 按 27.5 节的公式，这里应该多配解码 GPU；但当 $\mu_p \gg \mu_d$ 时，同样的 GPU 全部合置至少不差：每张 GPU 都在解码。
#
# **低负载。** 每秒只有 {{RATE_LOW:g}} 个请求时，一个合置副本就能满足 SLO；分离至少要一对 GPU：

# %% tags=["nbval-check-output"]
low = {(n, s): cluster.run(workload(RATE_LOW, s), **ENGINE, **kw).summary(slo=SLO, trim=0.1)
       for n, kw in (("colocated, 1 GPU", dict(replicas=1, **UNCHUNKED)),
                     ("1P1D, 2 GPUs", dict(disaggregation=Disaggregation(1, 1, link_gbps=LINK_GBPS)))) for s in SEEDS}
LOW_GPUS = {"colocated, 1 GPU": 1, "1P1D, 2 GPUs": 2}
lv = {n: {k: [low[n, s][k] for s in SEEDS] for k in ("slo_attainment", "e2e_p50")} for n in LOW_GPUS}
md_table([f"{RATE_LOW:g} req/s, 3 seeds", "SLO attainment: median (min–max)", "E2E p50 (s)", "rate x attainment / GPU"],
         [[n, over_seeds(v["slo_attainment"]), f"{np.median(v['e2e_p50']):.2f}",
           f"{RATE_LOW * np.median(v['slo_attainment']) / LOW_GPUS[n]:.2f}"] for n, v in lv.items()])

# %% tags=["check"]
assert all(low[n, s]["slo_attainment"] >= TARGET for n in LOW_GPUS for s in SEEDS)
assert all(low["1P1D, 2 GPUs", s]["e2e_p50"] < low["colocated, 1 GPU", s]["e2e_p50"] for s in SEEDS), "1P1D is a bit faster"

# %% [markdown]
# 每个种子上两者都满足 SLO；1P1D 的 E2E 中位数甚至略短（{{np.median(lv["1P1D, 2 GPUs"]["e2e_p50"]):.2f}} s 对 {{np.median(lv["colocated, 1 GPU"]["e2e_p50"]):.2f}} s，没有干扰），
# 但它用了两倍的 GPU，每 GPU 有效吞吐只有一半。最小的分离部署就是一对 GPU，负载低时缩不下去；
# 第 28 章的弹性伸缩对合置副本可以一张一张地加减，对分离部署则要两个池分别伸缩。
#
# ## 27.7 真实的 tiny 模型：KV 真的被复制了
#
# 在模拟器里 KV 只是字节数；`executor="model"` 时 minibatch 用真实的 tiny 模型，预填充副本算出的 KV 块会被逐层复制到解码副本的
# KV 池里（`minibatch.cluster.migration.copy_blocks`）。8 个请求、1 个预填充副本、2 个解码副本，贪心解码；与单个引擎的输出逐 Token 比较。
# 再做一次“破坏实验”：把复制换成什么也不做，解码副本读到的就是空块里的旧数据：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
TINY = dict(executor="model", model="tiny", max_num_seqs=4, block_size=8, num_kv_blocks=128)
tiny_wl = Workload([RequestSpec(0.01 * i, 12 + 5 * i, 16, request_id=f"q{i}") for i in range(8)]).materialize(4096, seed=0)
single = run(tiny_wl, **TINY)
ref = {r.request_id: r.output_token_ids for r in single.requests}
split = cluster.run(tiny_wl, router="round_robin", disaggregation=Disaggregation(1, 2, link_gbps=1.0), **TINY)
same = all(r.output_token_ids == ref[r.request_id] for r in split.requests)
log = split.extra["transfer_log"]
print(f"1P2D on the tiny model: {len(log)} KV transfers, {split.summary()['kv_transfer_bytes']:,} bytes; "
      f"decode replicas {sorted({e['dst'] for e in log})}; outputs equal a single engine's: {same}")
import minibatch.cluster.disagg as disagg_module

real_copy = disagg_module.copy_blocks
disagg_module.copy_blocks = lambda *args: None          # sabotage: the decode side gets blocks it never received
try:
    broken = cluster.run(tiny_wl, router="round_robin", disaggregation=Disaggregation(1, 2, link_gbps=1.0), **TINY)
finally:
    disagg_module.copy_blocks = real_copy
differ = sum(r.output_token_ids != ref[r.request_id] for r in broken.requests)
first_ok = all(r.output_token_ids[0] == ref[r.request_id][0] for r in broken.requests)
print(f"without the copy: {differ} of {len(ref)} outputs differ; first tokens (from the prefill side) still equal: {first_ok}")
assert same and len(log) == len(ref) and differ >= len(ref) // 2 and first_ok

# %% [markdown]
# 分离之后，{{len(log)}} 次传输一共搬了 {{split.summary()["kv_transfer_bytes"]:,}} 字节，输出与单个引擎逐 Token 相同。去掉复制之后，第一个 Token（在预填充端采样）
# 仍然正确，可之后的 Token 有 {{differ}} 个请求不同——解码端的注意力确实读的是传过去的 KV。
#
# ## 27.8 框架里的 PD 分离
#
# | 系统（版本，源文件） | 怎样部署 | 要点 |
# |---|---|---|
# | vLLM 0.33.0（`vllm/config/kv_transfer.py`，`vllm/distributed/kv_transfer/kv_connector/factory.py`，`.../kv_connector/v1/base.py`，`.../v1/nixl/`） | 预填充实例 `vllm serve --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'`，解码实例用 `"kv_role": "kv_consumer"`（`kv_both` 在 0.33.0 的 `nixl/connector.py` 里已标为弃用）；前面的代理先把请求发给预填充实例（`kv_transfer_params` 带 `do_remote_decode`），再带着它返回的参数发给解码实例（`do_remote_prefill`） | `KVTransferConfig.kv_role` 取 `kv_producer` / `kv_consumer` / `kv_both`；工厂里注册的连接器有 `NixlConnector`、`MooncakeConnector`、`LMCacheConnectorV1`、`OffloadingConnector`、`MultiConnector` 等；接口 `KVConnectorBase_V1` 分调度器一侧（`get_num_new_matched_tokens`、`update_state_after_alloc`、`build_connector_meta`、`request_finished`）与工作进程一侧（`start_load_kv`、`wait_for_layer_load`、`save_kv_layer`、`wait_for_save`、`get_finished`）；NIXL 是解码端来**拉**：预填充实例的 `request_finished` 返回 `True`，块延迟释放，直到解码端读走或租约到期（`nixl/pull_scheduler.py`）——传输期间两边都占着块，与 minibatch 的模型相同 |
# | SGLang 0.5.23（`python/sglang/srt/arg_groups/fields/disagg.py`） | `--disaggregation-mode prefill` 与 `--disaggregation-mode decode` 各起一组服务（默认 `null`，不分离），前面是 sglang-router 0.3.2 的 `--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL`（`sglang_router/router_args.py`，可分别给 `--prefill-policy` 与 `--decode-policy`） | `--disaggregation-transfer-backend` 默认 `mooncake`（还有 `nixl`、`mooncake_tcp`、`mori`、`ascend`、`fake`），`--disaggregation-bootstrap-port` 默认 8998，`--disaggregation-ib-device` 选 RDMA 网卡；`--disaggregation-decode-allocation-policy` 默认 `early`：解码端提前预留 KV（minibatch 也是在选定解码副本时预留） |
# | minibatch（`minibatch/cluster/disagg.py`） | `cluster.run(..., disaggregation=Disaggregation(P, D, link_gbps, link_latency_s, prefill_hardware, decode_hardware, decode_router))` | 整段传输、每副本一条 FIFO 链路；模型执行器下真实复制 KV 块；`goodput_per_gpu` 是 DistServe 的指标 |
#
# 发表的数字（各自的模型、负载与硬件，不能直接与本章比较）：DistServe 在多种模型、应用与 SLO 下，比当时最好的系统多服务 **7.4 倍**的请求，
# 或满足**严 12.6 倍**的 SLO，且 90% 以上的请求满足延迟约束（OSDI'24 版，arXiv:2401.09670v3 摘要；v1 写的是 4.48 倍与 10.2 倍）。
# Splitwise 的集群在成本低 20% 时吞吐最多高 **1.4 倍**，或在相同功耗与成本下吞吐最多高 **2.35 倍**（ISCA'24，微软研究院论文页的摘要）。
# Mooncake（Qin et al., FAST'25, arXiv:2407.00079；Kimi 的服务平台）以 KV Cache 为中心做分离，摘要报告在某些模拟场景下满足 SLO 时吞吐最多提高
# **525%**，在真实负载下让 Kimi 多处理 **75%** 的请求。
#
# ## 27.9 动手：P:D 比、链路与负载
#
# 控件在同样 4 张 GPU 上重跑一次分离部署（种子 1）：拖动预填充 GPU 数、链路带宽、每 GPU 到达率与提示词中位数，看达成率、两种延迟与链路利用率怎样变。

# %% tags=["nbval-ignore-output"]
def explore(prefill=3, link_gbps=200.0, rate=4.0, prompt_median=2048):
    prompt = lognormal(median=prompt_median, sigma=0.5, max=6144)
    wl = workload(GPUS * rate, 1, prompt=prompt)
    res = cluster.run(wl, router="least_requests", disaggregation=Disaggregation(prefill, GPUS - prefill, link_gbps=link_gbps),
                      **ENGINE)
    s = res.summary(slo=SLO, trim=0.1)
    need = GPUS * rate * float(np.mean(wl.prompt_lens)) * kv_tok["llama-3-8b"] * 8 / 1e9 / (GPUS - prefill)
    print(f"{prefill}P{GPUS - prefill}D at {rate:g} req/s/GPU, prompts ~{prompt_median}: attainment {s['slo_attainment']:.0%}, "
          f"TTFT p90 {s['ttft_p90']:.2f} s, TPOT p90 {s['tpot_p90'] * 1e3:.1f} ms, "
          f"goodput {s['goodput'] / GPUS:.2f} req/s/GPU; each decode link at rho = {need / link_gbps:.2f}")


W.interact(explore,
           prefill=W.IntSlider(value=3, min=1, max=3, description="prefill GPUs"),
           link_gbps=W.SelectionSlider(options=[10.0, 25.0, 50.0, 100.0, 200.0, 400.0], value=200.0, description="link Gb/s"),
           rate=W.FloatSlider(value=4.0, min=1.0, max=6.0, step=0.5, continuous_update=False, description="req/s/GPU"),
           prompt_median=W.SelectionSlider(options=[256, 512, 1024, 2048, 4096], value=2048, description="prompt"));

# %% [markdown]
# ## 小结
#
# - 合置副本里预填充占去 $\rho_p = \lambda\,\mathbb{E}[T_p]$ 的时间，TPOT 约为 $t_d / (1-\rho_p)$；分块预填充削掉 ITL 的尾巴，却不减少预填充的工作量，
#   TPOT 均值几乎不变，TTFT 还会变长。
# - PD 分离把两段放到不同的 GPU：TTFT 由预填充池负责，TPOT 由解码池负责，两池可以分别配 GPU、甚至用不同的硬件（Splitwise）。
#   代价是 KV 传输：$\lceil L/B \rceil B\, b / W + \alpha$，GQA 模型的 $b$ 小得多；链路利用率必须小于 1。
# - 在长提示词、短输出、严 TPOT 的负载上，3P1D 的每 GPU 服务容量是最好的合置部署的 {{cap["3P1D"].median / cap[best_colo].median:.1f}} 倍
#   （本章的模拟，{{RUN_S:.0f}} s、3 个种子，每个种子都如此）；比例由两池容量 $\mu_d/\mu_p$ 决定，比例选错（1P3D）比合置还差。
# - 分离输在：慢链路（交叉点在解码链路饱和处）、短提示词长输出（干扰本来就小）、低负载（最小部署是一对 GPU）。
# - 在真实模型上，KV 被复制到解码副本，输出与单个引擎逐 Token 相同；vLLM 用 KV Connector（如 NIXL）、SGLang 用 `--disaggregation-mode` 与
#   Mooncake/NIXL 传输后端实现同样的路径。
#
# 下一章（第 28 章）讲弹性伸缩：副本数随负载变化时，怎样决定加减、冷启动与延迟又带来什么代价。
#
# ## 练习
#
# 1. **Llama-2-13B。** 把 `ENGINE` 的模型换成 `llama-2-13b`（多头注意力，每 Token {{kv_tok["llama-2-13b"] // 1024}} KiB 的 KV，A100-80G 上只放得下约 {{make_cost_model("llama-2-13b", "a100-80g").kv_capacity_tokens(0.9) / 1e4:.0f}} 万 Token），
#    SLO 改为 TTFT ≤ 2 s、TPOT ≤ 60 ms，重跑 27.4 与 27.5 节。哪种部署最好？分离的优势变大还是变小？为什么？
# 2. **运行时长。** 把 `RUN_S` 改成 10 秒、再改成 120 秒重跑 27.4 节。哪些配置的容量变了？为什么以排队为瓶颈的配置对运行时长更敏感？
# 3. **链路延迟。** 给 27.6 节的 3P1D 加上 `link_latency_s=0.05`。TTFT 会变吗？TPOT 呢？延迟与带宽，哪一个会让链路排队？
# 4. **异构硬件（Splitwise）。** 用 `Disaggregation(3, 1, prefill_hardware="h100", decode_hardware="a100-80g")` 重跑 27.4 节的 3P1D。
#    预填充池的 $\mu_p$ 变成多少？如果 H100 比 A100 贵 1.6 倍，按每美元的有效吞吐，哪种组合最划算？
# 5. **比例随负载变。** 用 27.5 节的公式，对提示词中位数 512、1024、2048、4096 分别算出最优的 P/D，再用控件验证其中两个。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 13B 的解码访存量大（MHA），$t_d(B)$ 随 $B$ 增长得快，KV 池又小：$B^\ast$ 小得多，$\mu_d$ 掉下来，$\mu_d/\mu_p$ 接近 1，最优比例变成 2P2D 一类，
#    而合置加分块与它差距不大。分离的收益来自“解码 GPU 能以大批量高效解码”，这个前提在 13B 上弱了。同时每次传输的字节数是 8B 的 {{kv_tok["llama-2-13b"] / kv_tok["llama-3-8b"]:.2f}} 倍，慢链路更早输。
# 2. 合置的瓶颈是 TPOT，一步有多长与运行多久关系不大；3P1D、2P2D 的瓶颈是预填充池的排队，$\rho \approx 1$ 时队列每秒只增长一点点，
#    短的回放看不出来，容量会被高估；回放越长，越轻微的过载越看得出来，测得的容量只会持平或下降，种子之间的差别也随之显现。
#    离饱和越近，测量越要长、种子越要多——稳态测量要足够长，这是第 8 章讲过的。
# 3. TTFT 不变（在预填充端测）；TPOT 增加约 $\alpha/(L_\text{out}-1)$。延迟不占用链路（模型里 $\alpha$ 不计入链路忙的时间），带宽才会排队。
# 4. $\mu_p$ 约按 H100 与 A100 的有效算力之比增长（`make_cost_model("llama-3-8b", "h100")`）；每美元的比较要用 (P×价格_H100 + D×价格_A100)
#    去除容量。Splitwise 的结论是：预填充用新卡、解码用旧卡，成本与功耗更低。
# 5. $\mu_p \propto 1/\mathbb{E}[T_p]$，提示词越长越小；$\mu_d$ 随上下文变长略降。提示词 512 时 $\mu_d/\mu_p$ 小于 1，应多配解码 GPU。
#
# </details>
#
# **本章引用**：DistServe（Zhong et al., OSDI'24, arXiv:2401.09670 v1 与 v3）；Splitwise（Patel et al., ISCA'24, arXiv:2311.18677）；
# Mooncake（Qin et al., FAST'25, arXiv:2407.00079）；Sarathi-Serve（Agrawal et al., OSDI'24）；vLLM 0.33.0 与 SGLang 0.5.23、sglang-router 0.3.2
# 的源文件见 27.8 节的表；NVIDIA A100、H100 数据手册与 DGX BasePOD 参考架构。
