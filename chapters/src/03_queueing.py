# %% [markdown]
# # 第 3 章 请求调度的第一性原理：排队论视角
#
# 第 1 章结尾说，接下来要深入动态批处理的第一性原理——请求调度机制。调度器面对的不是一个请求，而是一条
# **请求流**：请求在随机的时刻到达，在队列里等待，被聚合进批次，算完离开。“平均 TTFT 为什么在 GPU 还没满载时就开始变差”
# “流量突发为什么比平均流量更可怕”“GPU 利用率能不能拉到 100%”——这些问题的答案不在某个框架的参数表里，
# 而在排队论（Queueing Theory）里。本章用排队论的几条基本定律把直觉变成公式，再用 minibatch 的模拟器逐条验证。
#
# ## 学习目标
#
# - 会描述请求的**到达过程**（Arrival Process）：泊松过程（Poisson Process）与 Gamma 突发流量，用变异系数（CV）和
#   离散指数（Index of Dispersion）量化“突发度”（Burstiness），并读懂真实 trace（Azure LLM 推理 trace）的突发性；
# - 掌握 **Little 定律**（Little's Law）$L = \lambda W$，并在引擎的模拟运行上验证它；
# - 理解**利用率与等待时间**的非线性关系：M/M/1 与 M/G/1（Pollaczek–Khinchine 公式），知道为什么 $\rho \to 1$ 时排队时间发散，
#   以及服务时间和到达间隔的波动为什么会放大排队；
# - 用模拟器复现 LLM 服务的**延迟“曲棍球棒”**（Hockey Stick）曲线，找到饱和吞吐（Saturation Throughput），
#   并解释连续批处理下延迟上升的两种机制：批变大导致每步变慢，以及 KV Cache 用尽后请求开始排队。

# %%
import inspect
import math

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np

import minibatch
from minibatch.config import EngineConfig
from minibatch.runner import run
from minibatch.viz import md_table
from minibatch.sim import make_cost_model
from minibatch.workload import arrival_stats, fixed, gamma_arrivals, load_shipped_trace, lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter


print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 3.1 请求是怎样到达的：泊松过程与突发流量
#
# 设平均到达率为 $\lambda$（请求/秒，req/s）。最常用的模型是**泊松过程**：相邻两个请求的到达间隔（Inter-arrival Time）
# 相互独立，服从指数分布 $\text{Exp}(\lambda)$；任意长 $t$ 的时间窗内到达的请求数服从泊松分布
#
# $$
# P\{N(t)=k\} = e^{-\lambda t}\frac{(\lambda t)^k}{k!}, \qquad \mathbb{E}[N(t)] = \operatorname{Var}[N(t)] = \lambda t .
# $$
#
# 大量彼此独立的用户叠加在一起时，总的请求流近似泊松，这是它被当作“默认负载”的原因。但真实流量常常更“扎堆”。
# `vllm bench serve` 用 `--burstiness` 参数生成 **Gamma 到达**（vLLM v0.10.2 `vllm/benchmarks/serve.py`）：间隔服从 $\text{Gamma}(k,\ \theta = 1/(\lambda k))$，
# 均值始终是 $1/\lambda$，而间隔的变异系数（Coefficient of Variation, CV，标准差/均值）是
#
# $$
# C_a = \frac{\operatorname{std}(\text{gap})}{\mathbb{E}[\text{gap}]} = \frac{1}{\sqrt{k}} .
# $$
#
# $k=1$ 就是泊松过程（$C_a=1$）；$k<1$ 更突发（一阵密集、一阵空闲）；$k>1$ 更均匀。另一个常用指标是**离散指数**
# （Index of Dispersion, IoD）：把时间切成 1 秒的格子，数每格的到达数，IoD = 方差/均值，泊松过程为 1。
# minibatch 的 `synthetic(n, rate, burstiness=k)` 正是这样生成到达时间的（`minibatch.workload.arrivals.gamma_arrivals`）：

# %%
print(inspect.getsource(gamma_arrivals).split('    """')[0] + inspect.getdoc(gamma_arrivals))

# %% [markdown]
# 下面以同一个平均到达率生成三条请求流：均匀一些的、泊松的、突发的：

# %%
RATE, N_STREAM = 5.0, 3000
BURSTINESS = [4.0, 1.0, 0.25]
streams = {k: synthetic(N_STREAM, RATE, burstiness=k, seed=3) for k in BURSTINESS}

# %% [markdown]
# 三条流各 {{N_STREAM}} 个请求，平均到达率都是 {{RATE:g}} req/s，$k$ 分别为 {{BURSTINESS[0]:g}}、{{BURSTINESS[1]:g}}（泊松）、
# {{BURSTINESS[2]:g}}。测量它们的 CV 与 IoD，并与理论值 $1/\sqrt{k}$ 对比：

# %% tags=["nbval-check-output"]
rows = []
for k, wl in streams.items():
    s = arrival_stats(wl.arrival_times)
    rows.append([f"{k:g}", f"{s['rate']:.2f}", f"{1 / math.sqrt(k):.2f}", f"{s['cv']:.2f}", f"{s['iod_1s']:.2f}",
                 f"{s['peak_1s']}"])
md_table(["burstiness k", "measured rate (req/s)", "CV theory", "CV measured", "IoD (1 s)", "peak in 1 s"], rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
for k, wl in streams.items():
    t = wl.arrival_times
    counts = np.bincount(np.floor(t[t < 120]).astype(int), minlength=120)
    axes[0].step(np.arange(120), counts, where="post", lw=1, label=f"k={k:g} (CV {1 / math.sqrt(k):.1f})")
    gaps = np.sort(np.diff(t)) * RATE                       # gaps in units of the mean gap
    axes[1].plot(gaps, 1 - np.arange(gaps.size) / gaps.size, lw=1.2, label=f"k={k:g}")
axes[0].set(xlabel="time (s)", ylabel="arrivals per second", title=f"Same mean rate ({RATE:g} req/s), different burstiness")
axes[1].set(xlabel="gap / mean gap", ylabel="P(gap > x)", yscale="log", xlim=(0, 8), ylim=(1e-3, 1.05),
            title="Inter-arrival gaps (CCDF)")
for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# 左图三条曲线的平均高度相同，但 $k={{BURSTINESS[-1]:g}}$ 的那条时而冲到很高、时而长时间一个请求都没有；右图是间隔的互补累积分布（CCDF），
# 突发流里既有大量极短的间隔（请求扎堆），也有远长于均值的空档。对服务端而言，**平均到达率相同，突发流需要的排队缓冲和
# 尾延迟完全不同**——3.4 节会给出定量关系。
#
# ## 3.2 真实流量有多突发：Azure LLM 推理 trace
#
# 微软在 Splitwise 论文（Patel et al., ISCA'24）中公开了 Azure 上两类 LLM 服务各约一小时的请求 trace：代码补全（code）与对话
# （conversation）。它们随课程一起放在 `datasets/traces/`，`datasets/traces/SOURCES.md` 记录了来源、许可证与统计：
# code trace 的到达间隔 CV 为 13.15，conv trace 为 1.09。下面用 `load_shipped_trace` 读入（它读 `load_trace` 同样的格式），
# 逐项重新计算，并画出每分钟的请求数：

# %%
traces = {f"Azure {name}": load_shipped_trace(f"azure_{name}") for name in ("code", "conv")}
rows = []
for name, wl in traces.items():
    s = wl.stats()
    rows.append([name, f"{s['n']:,}", f"{s['duration']:,.0f}", f"{s['rate']:.2f}", f"{s['cv']:.2f}",
                 f"{s['iod_1s']:.2f}", f"{s['peak_1s']}", f"{1 / s['cv'] ** 2:.3g}"])
md_table(["trace", "requests", "duration (s)", "rate (req/s)", "CV", "IoD (1 s)", "peak in 1 s",
          "gamma k with same CV"], rows)

# %%
fig, ax = plt.subplots(figsize=(10, 3.2))
for name, wl in traces.items():
    t = wl.arrival_times
    per_min = np.bincount(np.floor(t / 60).astype(int))
    ax.step(np.arange(per_min.size), per_min, where="post", label=name)
ax.set(xlabel="minute since first request", ylabel="requests per minute",
       title="Azure LLM inference traces 2023 (Splitwise): arrivals per minute")
ax.grid(alpha=0.3)
ax.legend()
plt.show()

# %%
code, conv = (traces[f"Azure {n}"] for n in ("code", "conv"))
pm_code = np.bincount(np.floor(code.arrival_times / 60).astype(int))
pm_conv = np.bincount(np.floor(conv.arrival_times / 60).astype(int))
cv_code, cv_conv = code.stats()["cv"], conv.stats()["cv"]

# %% tags=["check"]
assert (pm_code == 0).any() and cv_code > 5 * cv_conv, "the prose says the code trace is on/off and far burstier"
assert round(cv_code, 2) == 13.15 and round(cv_conv, 2) == 1.09, "the prose says these match SOURCES.md"

# %% [markdown]
# 两条 trace 的性格截然不同。code trace 平均每分钟 {{pm_code.mean():.0f}} 个请求，但有 {{int((pm_code == 0).sum())}} 分钟
# 一个请求都没有，最忙的一分钟却有 {{pm_code.max()}} 个——这是典型的开/关（On/Off）突发，间隔 CV 高达 {{cv_code:.1f}}，
# 用 Gamma 过程匹配同样的 CV 需要 $k \approx$ {{1 / cv_code ** 2:.3g}}。conv trace 的 CV 为 {{cv_conv:.2f}}，短时间尺度上接近泊松，
# 但它的速率在一小时内漂移：每分钟请求数从 {{pm_conv.min()}} 到 {{pm_conv.max()}} 不等。以上数字与 SOURCES.md 公布的统计一致。
# Gamma 过程只能匹配 CV，复现不了这种慢漂移；第 28 章（弹性伸缩）会专门处理它。

# %% [markdown]
# ## 3.3 Little 定律：并发、吞吐与延迟的恒等式
#
# 把推理服务看成一个黑盒“系统”。记 $L$ 为系统内（排队中 + 计算中）的平均请求数，$\lambda$ 为（长期）到达率，
# $W$ 为每个请求在系统内的平均停留时间（对 LLM 服务就是端到端延迟 E2E）。**Little 定律**说
#
# $$
# L = \lambda W .
# $$
#
# 它几乎不需要任何假设：不管到达过程、服务时间分布、调度策略是什么，只要系统是稳定的（长期来看进多少、出多少），它就成立。
# 对排队部分同样成立：$L_q = \lambda W_q$，$W_q$ 是平均排队时间（minibatch 的 `queue_delay`：从到达到第一次被调度）。
#
# 它的工程含义非常直接：**并发数 = 吞吐 × 延迟**。想以 $\lambda$ req/s 服务平均 E2E 为 $W$ 秒的请求，系统里平均就有 $\lambda W$ 个请求在飞——
# 连续批处理的 `max_num_seqs` 和 KV Cache 必须容得下它们；压测时用固定并发数（闭环，Closed-loop）发请求，
# 吞吐就被“并发数/延迟”钉死（第 8 章）。
#
# 下面在模拟的 Llama-2-7B / A100-80GB 上跑一段负载（连续批处理，vLLM 的默认策略），用两条**独立的测量路径**验证它：
# 左边 $L$ 来自引擎每一步记录的队列长度（`StepRecord.num_running + num_waiting`，按步长加权的时间平均），
# 右边 $\lambda W$ 来自每个请求自己的时间戳（到达率 × 平均 E2E）。

# %% tags=["nbval-check-output"]
SHAPE = dict(input_len=lognormal(median=512, sigma=0.6, max=2048),
             output_len=lognormal(median=96, sigma=0.6, max=512))
little_wl = synthetic(400, 9.0, **SHAPE, seed=0)
res = run(little_wl, **SIM)
s = res.summary()
T = s["duration_s"]                                   # first arrival to last finish
lam = s["num_requests"] / T
L = sum(st.duration * (st.num_running + st.num_waiting) for st in res.steps) / T
Lq = sum(st.duration * st.num_waiting for st in res.steps) / T
step_mean = float(np.mean([st.duration for st in res.steps]))
md_table(["quantity", "engine side: time average of num_running + num_waiting", "request side: lambda x mean E2E",
          "ratio"], [["requests in system L", f"{L:.2f}", f"{lam * s['e2e_mean']:.2f}", f"{L / (lam * s['e2e_mean']):.3f}"]])

# %% tags=["check"]
assert abs(L / (lam * s["e2e_mean"]) - 1) < 0.05, "the prose says both sides agree"
assert s["queue_delay_mean"] < 5 * step_mean, "the prose says the queueing time is of the order of a step"
assert Lq < lam * s["queue_delay_mean"], "the prose says the step-end count underestimates L_q"

# %% [markdown]
# 这次运行有 {{little_wl.stats()['n']}} 个请求，$\lambda$ = {{lam:.2f}} req/s，平均 E2E 为 {{s['e2e_mean']:.2f}} s，所以系统里平均有约 {{lam * s['e2e_mean']:.0f}}
# 个请求；引擎按步记录的时间平均给出几乎相同的数（微小差别来自：引擎只在每一步结束时记一次队列长度，而请求的到达与完成
# 散落在步与步之间）。平均排队时间只有 {{s['queue_delay_mean'] * 1e3:.1f}} ms，与一步的平均时长（{{step_mean * 1e3:.1f}} ms）
# 同一量级：在这个负载下，新请求只需等当前这一步算完就能加入批次，连续批处理几乎让它们“随到随算”。
# （同样的方法却测不准排队部分的 $L_q$：请求总是在两步之间到达、在下一步开始时就被接纳，步末记录的等待数按时间平均只有
# {{Lq:.3f}}，而 $\lambda W_q$ = {{lam * s['queue_delay_mean']:.3f}}。测量方式本身也是排队分析的一部分。）

# %% [markdown]
# ## 3.4 利用率与等待时间：M/M/1 与 M/G/1
#
# Little 定律说明了 $L$、$\lambda$、$W$ 之间的关系，但没说 $W$ 本身有多大。为此需要具体的排队模型。最简单的是**单服务台队列**：
# 一次只服务一个请求，先来先服务（FCFS）。记服务时间为 $S$，服务率 $\mu = 1/\mathbb{E}[S]$，**利用率**（Utilisation）
#
# $$
# \rho = \lambda\,\mathbb{E}[S] = \lambda/\mu \quad (<1 \text{ 才稳定}).
# $$
#
# Kendall 记号 A/S/c 中，M 表示无记忆（泊松到达或指数服务时间），D 表示确定（常数），G 表示一般分布。
#
# - **M/M/1**（泊松到达、指数服务时间）：平均排队时间
#   $$W_q = \frac{\rho}{\mu(1-\rho)} = \frac{\rho}{1-\rho}\,\mathbb{E}[S].$$
# - **M/G/1**（泊松到达、任意服务时间）：**Pollaczek–Khinchine（P-K）公式**
#   $$W_q = \frac{\lambda\,\mathbb{E}[S^2]}{2(1-\rho)} = \frac{1+C_s^2}{2}\cdot\frac{\rho}{1-\rho}\,\mathbb{E}[S],$$
#   其中 $C_s$ 是服务时间的 CV。指数分布 $C_s=1$，退化为 M/M/1；常数服务时间（M/D/1）$C_s=0$，排队时间减半。
# - **G/G/1** 没有精确公式，常用 **Kingman 近似**（重负载下准确）：
#   $$W_q \approx \frac{C_a^2+C_s^2}{2}\cdot\frac{\rho}{1-\rho}\,\mathbb{E}[S].$$
#
# 三个公式共享同一个因子 $\rho/(1-\rho)$：利用率从 50% 到 90%，它从 1 涨到 9；到 99% 是 99。**在单服务台上，“把 GPU 利用率
# 拉满”与“低延迟”天然矛盾**；而到达与服务的波动（$C_a^2 + C_s^2$）会把这条曲线整体抬高。
#
# 在 minibatch 里可以精确地搭出一个单服务台队列：`serial` 策略一次只处理一个请求、先来先服务；再让每个请求只生成一个 Token
# （只做预填充，像分类、打分或 Embedding 服务），于是每个请求的服务时间就是它那一次 Prefill 的耗时，由模拟器的成本模型给出。
# 三种队列只差在提示长度的分布与到达过程：

# %%
cm = make_cost_model("llama-2-7b", "a100-80g")
SERIAL = dict(**SIM, policy="serial", max_num_batched_tokens=4096)   # one whole prompt per step
N_PK, OUT_PK = 1500, 1                                               # requests per run; tokens each generates
FIXED_LEN, BURSTY_K = 1024, 0.25
CASES = {  # name: (prompt length distribution, burstiness of arrivals)
    "M/D/1": (fixed(FIXED_LEN), 1.0),
    "M/G/1": (lognormal(median=512, sigma=1.0, max=4000), 1.0),
    f"G/G/1 (k={BURSTY_K:g})": (lognormal(median=512, sigma=1.0, max=4000), BURSTY_K),
}
RHOS = [0.3, 0.5, 0.7, 0.85]

# %% [markdown]
# 每个请求生成 {{OUT_PK}} 个 Token（`max_tokens={{OUT_PK}}`）。提示长度固定（{{FIXED_LEN}} Token）时服务时间是常数，就是 M/D/1；
# 提示长度服从对数正态分布时就是 M/G/1；再把到达换成突发的 Gamma 过程（$k={{BURSTY_K:g}}$，$C_a^2={{1 / BURSTY_K:g}}$），
# 就是 G/G/1。对每个目标利用率 $\rho$（{{'、'.join(f'{r:g}' for r in RHOS)}}），我们用成本模型算出 $\mathbb{E}[S]$，
# 据此设定到达率 $\lambda = \rho/\mathbb{E}[S]$，跑 {{N_PK}} 个请求的模拟，再把测得的平均排队时间与公式比较。
# `serial` 策略就是这样一个单服务台：

# %%
print(inspect.getsource(minibatch.policies.serial.SerialPolicy))

# %% tags=["nbval-check-output"]
pk = {}
rows = []
mean_service = {}     # E[S] from the cost model, per length distribution (lengths do not depend on the rate)
for name, (plen, k) in CASES.items():
    if repr(plen) not in mean_service:
        lens = synthetic(N_PK, 1.0, input_len=plen, output_len=OUT_PK, seed=7).prompt_lens
        mean_service[repr(plen)] = np.mean([cm.step_time([(int(n), int(n))], []) for n in lens])
    ES = mean_service[repr(plen)]
    for rho in RHOS:
        wl = synthetic(N_PK, rho / ES, burstiness=k, input_len=plen, output_len=OUT_PK, seed=7)
        r = run(wl, **SERIAL)
        S = np.array([q.finish_time - q.first_scheduled_time for q in r.requests])   # service times
        lam_m = wl.stats()["rate"]
        rho_m = lam_m * S.mean()
        cs2 = S.var() / S.mean() ** 2
        ca2 = wl.stats()["cv"] ** 2
        wq_sim = r.summary()["queue_delay_mean"]
        wq_theory = (ca2 + cs2) / 2 * rho_m / (1 - rho_m) * S.mean()      # P-K when ca2 = 1, Kingman otherwise
        pk.setdefault(name, []).append((rho_m, wq_sim / S.mean(), wq_theory / S.mean(), cs2, ca2))
        rows.append([name, f"{rho:.2f}", f"{rho_m:.3f}", f"{S.mean() * 1e3:.1f}", f"{cs2:.2f}", f"{ca2:.2f}",
                     f"{wq_sim * 1e3:.1f}", f"{wq_theory * 1e3:.1f}"])
md_table(["queue", "target rho", "measured rho", "E[S] (ms)", "Cs^2", "Ca^2", "W_q sim (ms)", "W_q formula (ms)"], rows)

# %%
fig, ax = plt.subplots(figsize=(7, 4))
x = np.linspace(0.02, 0.93, 200)
ax.plot(x, x / (1 - x), "k-", lw=1, label="M/M/1: rho/(1-rho)")
for i, (name, pts) in enumerate(pk.items()):
    rho_m, sim, _, cs2, ca2 = map(np.array, zip(*pts))
    factor = (ca2.mean() + cs2.mean()) / 2
    ax.plot(x, factor * x / (1 - x), "--", color=f"C{i}", lw=1,
            label=f"{name} formula, (Ca²+Cs²)/2 = {factor:.2f}")
    ax.plot(rho_m, sim, "o", color=f"C{i}", label=f"{name} simulated (serial policy)")
ax.set(xlabel="utilisation rho", ylabel="mean queueing time W_q / E[S]", yscale="log", ylim=(0.05, 50),
       title="Waiting time explodes as utilisation approaches 1")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=7)
plt.show()

# %%
md1, mg1, gg1 = (pk[n] for n in CASES)
dev = {name: np.mean([abs(sim / th - 1) for _, sim, th, _, _ in pts]) for name, pts in pk.items()}
GG1 = list(CASES)[-1]

# %% tags=["check"]
assert md1[-1][1] < mg1[-1][1] < gg1[-1][1], "the prose orders the waiting times at the highest load"
assert gg1[0][1] > mg1[0][1], "the prose says bursty arrivals queue more at low load"
assert dev[GG1] > max(dev["M/D/1"], dev["M/G/1"]), "the prose says Kingman is off by more than P-K"

# %% [markdown]
# M/D/1 与 M/G/1 的模拟值与 P-K 公式基本吻合（表中最后两列，平均相对偏差分别为 {{dev['M/D/1']:.0%}} 与
# {{dev['M/G/1']:.0%}}；$\rho$ 越接近 1，一次有限长运行的样本均值波动越大，偏差也越大）。几点值得记住：同样是
# $\rho \approx$ {{md1[-1][0]:.2f}}，常数服务时间（M/D/1）的平均排队时间约为 {{md1[-1][1]:.1f}} 个服务时间；服务时间波动大
# （$C_s^2$ = {{mg1[-1][3]:.2f}}）时涨到 {{mg1[-1][1]:.1f}} 个；到达再变突发（$C_a^2$ = {{gg1[-1][4]:.1f}}）时是
# {{gg1[-1][1]:.1f}} 个。低利用率下突发的影响更显眼：$\rho \approx$ {{gg1[0][0]:.2f}} 时，泊松到达只排队
# {{mg1[0][1]:.2f}} 个服务时间，突发到达却要 {{gg1[0][1]:.2f}} 个——扎堆到达的请求即使在“平均很闲”的服务器上也要互相等待。
# Kingman 公式只是近似（它在 $\rho \to 1$ 的重负载极限下才精确），它与模拟的平均相对偏差是 {{dev[GG1]:.0%}}，
# 明显大于 P-K 公式；而且突发到达下排队时间的样本均值收敛更慢，一次 {{N_PK}} 个请求、一个随机种子的运行本身就有可观的统计误差
# （练习 3 换几个种子看看它有多大）。对 LLM 来说，服务时间由输入输出长度决定，长度分布越偏斜（第 1 章 1.5.3 节的长尾请求），
# $C_s$ 越大——这正是后面的章节要用 SJF、分块预填充等手段削减的那一项。

# %% [markdown]
# ## 3.5 LLM 服务的延迟“曲棍球棒”
#
# 真正的 LLM 推理服务不是单服务台：连续批处理让很多请求同时在一个批里解码。这带来一个重要差别——**服务能力随负载增长**：
# 负载越高，批越大，每一步虽然慢一点，但每秒产出的 Token 多得多（第 2 章：解码阶段访存受限，加大批次几乎免费）。
# 所以延迟不会像 M/M/1 那样从低负载就开始平滑上升，而是先长时间平坦、然后在某个点急剧拐起，形如曲棍球棒。
#
# 拐点之前，延迟上升的主因是**批变大导致每一步变慢**（TPOT 上升，E2E 随之上升）；拐点之后，**KV Cache 或 `max_num_seqs`
# 装满**，新请求开始排队，TTFT 急剧上升，而吞吐停在**饱和吞吐**上不再增长——此时多来的请求只会让队列无限变长。
#
# 下面固定负载形状（与 3.3 节相同：提示长度中位数 {{SHAPE['input_len'].median:.0f}}、输出长度中位数
# {{SHAPE['output_len'].median:.0f}} 的对数正态分布，泊松到达），在模拟的 Llama-2-7B / A100-80GB
# 上用 `max_num_seqs={{EngineConfig().max_num_seqs}}`、`max_num_batched_tokens={{EngineConfig().max_num_batched_tokens}}`
# （minibatch 的默认值，也是 vLLM v0.10.2 中 `vllm serve` 在
# A100 与显存小于 70 GiB 的卡上的默认值；同一版本的 `LLM` 类默认 8192 个 Token，H100 这类大显存卡上 `vllm serve` 默认
# 1024 条序列、8192 个 Token——见 `vllm/engine/arg_utils.py` 的 `EngineArgs._set_default_args`）扫描请求速率。
# 扫描的设置如下：

# %%
N_HS, TRIM = 600, 0.2                # requests per rate; share of the arrival span dropped at each end
RATES = [3, 6, 9, 12, 15, 18, 24, 30]

# %% [markdown]
# 每个速率回放 {{N_HS}} 个请求，按稳态统计（`RunResult.summary(trim={{TRIM}})`：去掉到达时间跨度最前与最后的 {{TRIM:.0%}}，
# 吞吐只数这段时间窗里完成的请求）；饱和吞吐取 KV Cache 用满之后各到达率下稳态请求吞吐的最大值。

# %% tags=["nbval-check-output"]
sweep = {}
for rate in RATES:
    r = run(synthetic(N_HS, rate, **SHAPE, seed=0), **SIM)
    steady = r.summary(trim=TRIM)
    steady["mean_batch_size"] = r.summary()["mean_batch_size"]
    sweep[rate] = (steady, max(st.kv_usage for st in r.steps))
# the saturation throughput: the most the server completes once the KV cache is full
sat = max((sweep[r][0] for r in RATES if sweep[r][1] >= 0.999), key=lambda st: st["request_throughput"])
md_table(["offered rate", "throughput (req/s)", "mean batch", "peak KV use", "TTFT p50 (s)", "TTFT p99 (s)",
          "TPOT p50 (ms)", "E2E p50 (s)", "E2E p99 (s)"],
         [[f"{rate}", f"{s['request_throughput']:.2f}", f"{s['mean_batch_size']:.1f}", f"{kv:.0%}",
           f"{s['ttft_p50']:.3f}", f"{s['ttft_p99']:.2f}", f"{s['tpot_p50'] * 1e3:.0f}", f"{s['e2e_p50']:.2f}",
           f"{s['e2e_p99']:.2f}"] for rate, (s, kv) in sweep.items()])
print(f"saturation throughput (the highest steady throughput with the KV cache full): {sat['request_throughput']:.2f} req/s")

# %%
xs = np.array(RATES, dtype=float)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
axes[0].plot(xs, [sweep[r][0]["request_throughput"] for r in RATES], "o-", label="achieved")
axes[0].plot(xs, xs, "k:", lw=1, label="offered = achieved")
for key, ax in (("ttft", axes[1]), ("e2e", axes[2])):
    for stat, style in (("p50", "o-"), ("p99", "s--")):
        ax.plot(xs, [sweep[r][0][f"{key}_{stat}"] for r in RATES], style, label=f"{key.upper()} {stat}")
    ax.set(ylabel="seconds")
for ax, title in zip(axes, ("Throughput (req/s)", "TTFT", "E2E latency")):
    ax.axvline(sat["request_throughput"], color="r", ls=":", lw=1.2,
               label=f"saturation {sat['request_throughput']:.1f} req/s")
    ax.set(xlabel="offered request rate (req/s)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
fig.suptitle("llama-2-7b on a100-80g (simulated), continuous batching: the latency hockey stick", fontsize=10)
fig.tight_layout()
plt.show()

# %%
lo, hi = sweep[RATES[0]][0], sweep[RATES[-1]][0]
knee = next(r for r in RATES if sweep[r][1] >= 0.999)          # first rate that fills the KV cache
before = RATES[RATES.index(knee) - 1]
below = [r for r in RATES if r < knee]
TRACK = 0.1                                                     # throughput within this of the offered rate

# %% tags=["check"]
assert all(abs(sweep[r][0]["request_throughput"] / r - 1) < TRACK for r in below), \
    "the prose says throughput follows the offered rate before the knee"
assert sweep[before][0]["tpot_p50"] > lo["tpot_p50"], "the prose says TPOT grows with the batch"
assert sat["request_throughput"] < 0.9 * RATES[-1] and hi["ttft_p99"] > 10 * lo["ttft_p99"]
assert all(sweep[r][0]["request_throughput"] <= sat["request_throughput"] for r in RATES if r >= knee), \
    "the prose says throughput stops growing past the knee"

# %% [markdown]
# 从 {{RATES[0]}} req/s 到 {{before}} req/s，稳态吞吐跟随到达率（误差在 {{TRACK:.0%}} 以内），TTFT p50 始终在
# {{lo['ttft_p50'] * 1e3:.0f}}–{{sweep[before][0]['ttft_p50'] * 1e3:.0f}} ms；但 E2E 已经在上升（TPOT p50 从
# {{lo['tpot_p50'] * 1e3:.0f}} ms 涨到 {{sweep[before][0]['tpot_p50'] * 1e3:.0f}} ms）——这是批变大的代价。到 {{knee}} req/s，
# KV Cache 第一次被用满，TTFT p99 跳到 {{sweep[knee][0]['ttft_p99']:.1f}} s；再往上，吞吐不再增长，停在饱和吞吐
# （{{sat['request_throughput']:.1f}} req/s）以下（{{RATES[-1]}} req/s 时只有 {{hi['request_throughput']:.1f}} req/s），
# 到 {{RATES[-1]}} req/s 时 TTFT p99 已达 {{hi['ttft_p99']:.1f}} s。
# 注意：超过饱和点后，队列随时间线性增长，这些尾延迟的数值取决于这次运行有多长（这里 {{N_HS}} 个请求）——跑得越久越糟，
# 没有稳态；去掉预热与收尾也改变不了这一点，只有拐点左侧的数字才是稳态的数字。容量规划的第一原则因此是：
# **把工作点放在拐点左侧并留出余量**，而不是追求 100% 利用率（第 19、30 章）。

# %% [markdown]
# ## 3.6 动手：到达率与突发度
#
# 下面的函数在同一个模拟服务器上重放一段负载（负载形状同 3.5 节），画出系统内请求数随时间的变化和 TTFT 的分布：

# %% tags=["nbval-ignore-output"]
N_EXPLORE, K_RANGE = 300, (0.1, 5.0)


def explore(rate=9.0, burstiness=1.0):
    wl = synthetic(N_EXPLORE, rate, burstiness=burstiness, **SHAPE, seed=1)
    r = run(wl, **SIM)
    s = r.summary()
    t = np.array([st.start_time for st in r.steps])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    axes[0].step(t, [st.num_running for st in r.steps], where="post", label="running (in the batch)")
    axes[0].step(t, [st.num_waiting for st in r.steps], where="post", label="waiting (queued)")
    axes[0].set(xlabel="time (s)", ylabel="requests", title=f"rate {rate:g} req/s, burstiness {burstiness:g}")
    ttft = np.sort([q.ttft for q in r.requests if q.ttft is not None])
    axes[1].plot(ttft, np.arange(1, ttft.size + 1) / ttft.size)
    axes[1].set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    print(f"measured CV {wl.stats()['cv']:.2f} | throughput {s['request_throughput']:.2f} req/s | "
          f"TTFT p50/p99 {s['ttft_p50']:.3f}/{s['ttft_p99']:.2f} s | E2E p50/p99 {s['e2e_p50']:.2f}/{s['e2e_p99']:.2f} s")

# %% [markdown]
# 每次重放 {{N_EXPLORE}} 个请求。拖动到达率与突发度 $k$（`burstiness`，$C_a = 1/\sqrt{k}$，可调范围
# {{K_RANGE[0]:g}}–{{K_RANGE[1]:g}}）。建议试试：到达率固定在 {{inspect.signature(explore).parameters['rate'].default:g}} req/s，
# 把 $k$ 从 {{BURSTINESS[0]:g}} 调到 {{K_RANGE[0]:g}}——平均负载没变，尾延迟却完全不同；再把到达率调过饱和吞吐
# （3.5 节测得 {{sat['request_throughput']:.1f}} req/s），看队列如何一路上涨。

# %% tags=["nbval-ignore-output"]
W.interact(explore,
           rate=W.FloatSlider(value=9.0, min=1.0, max=30.0, step=1.0, continuous_update=False,
                              description="rate (req/s)"),
           burstiness=W.FloatLogSlider(value=1.0, base=10, min=np.log10(K_RANGE[0]), max=np.log10(K_RANGE[1]),
                                       step=0.1, continuous_update=False,
                                       description="burstiness k"));

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX_RATES, EX_LOAD, EX_K, EX_WINDOW_S = [6, 12, 18], 0.7, [4, 1, 0.25, 0.1], 600
conv_p50 = conv.stats()["input_p50"]
assert conv_p50 > 1.5 * SHAPE["input_len"].median, "exercise 4 says the conv trace's prompts are far longer"

# %% [markdown]
# 想看一次运行“活”起来的样子，可以用 minibatch 的实时仪表盘 `minibatch.widgets.Dashboard(executor="sim", model="llama-2-7b",
# hardware="a100-80g")`：运行中拖动 `request_rate` 滑块，曲线上会标出每次改动的时刻（第 1 章已用过它）。
#
# ## 本章小结
#
# - 请求流用到达率 $\lambda$ 和突发度刻画。泊松过程的间隔 CV 为 1；Gamma 到达的 CV 为 $1/\sqrt{k}$（即 `vllm bench serve --burstiness`）。
#   真实 trace 可以极其突发（Azure code trace 的 CV 为 {{cv_code:.0f}}），也可能接近泊松但速率漂移（Azure conv trace）。
# - **Little 定律** $L=\lambda W$ 对任何稳定系统成立：并发数 = 吞吐 × 延迟。它把 `max_num_seqs`、KV 容量、压测并发数与延迟目标联系在一起。
# - 单服务台上，排队时间正比于 $\frac{C_a^2+C_s^2}{2}\cdot\frac{\rho}{1-\rho}$：利用率趋近 1 时发散；到达越突发、
#   服务时间（即请求长度）越不均匀，排队越严重。minibatch 的 `serial` 策略在模拟器上复现了 M/D/1、M/G/1 的 P-K 公式。
# - 连续批处理的服务能力随负载增长，因此延迟曲线先平后陡（曲棍球棒）：拐点前 E2E 因批变大而缓升，拐点后
#   （KV Cache / `max_num_seqs` 用尽）TTFT 急剧上升，吞吐停在饱和吞吐。工作点应留在拐点左侧。
#
# 下一章从“怎样把请求聚成批”开始：静态批处理与动态批处理窗口（`max_wait`）——它们正是在排队延迟与批大小之间做交换。
#
# ## 练习
#
# 1. **Little 定律的另一面。** 用 3.3 节的负载，分别以 {{'、'.join(map(str, EX_RATES))}} req/s 运行，计算 $\lambda\cdot$E2E 与引擎测得的平均
#    `num_running`。当到达率超过饱和吞吐时，“系统稳定”这一前提不再成立，Little 定律还能用吗？用 `res.steps` 画出系统内
#    请求数随时间的曲线来回答。
# 2. **M/M/1。** 仿照 3.4 节，构造一个服务时间近似指数分布的单服务台：提示长度用 `minibatch.workload.empirical`
#    从一组指数分布的样本中重采样。测得的 $C_s^2$ 是多少？为什么它小于提示长度本身的 CV²？（提示：Prefill 时间 ≈ 固定开销 + 与长度成正比的部分。）
# 3. **突发度与尾延迟。** 在 3.5 节的设置下，固定到达率为饱和吞吐的 {{EX_LOAD:.0%}}，比较 `burstiness` 为 {{'、'.join(f'{k:g}' for k in EX_K)}} 时的
#    TTFT p99 与 E2E p99。用 Kingman 公式的 $(C_a^2+C_s^2)/2$ 因子定性解释你看到的趋势。
# 4. **真实 trace 回放。** 用 `load_trace` 读入 Azure conv trace，取前 {{EX_WINDOW_S // 60}} 分钟（`time_window(0, {{EX_WINDOW_S}})`），在模拟器里回放
#    （注意它的提示长度比 3.5 节的负载长得多：中位数 {{conv_p50:.0f}} 对 {{SHAPE['input_len'].median:.0f}}）。TTFT 随时间如何变化？与每分钟请求数的曲线对照。
# 5. **思考题。** 为什么对连续批处理的服务器，不能直接把 M/M/1 的 $\mu$ 取为“单个请求的服务速率”？
#    如果把整个批看成一个服务台，它的服务率如何随队列长度变化？这类模型在排队论中叫什么？（提示：批量服务队列，Bulk-service Queue。）
#
# <details><summary>提示与参考答案</summary>
#
# 1. 未饱和时两边相等；超过饱和吞吐后系统里的请求数随时间线性增长（画 `num_running + num_waiting` 随时间的曲线就能看到），
#    “长期平均”不存在，Little 定律只在一段时间窗内、并计入窗口两端还在系统里的请求时才成立。
# 2. Prefill 时间 ≈ 固定开销 + 与长度成正比的部分：固定开销对每个请求都一样，它拉高了均值却不增加方差，
#    所以服务时间的 $C_s^2$ 小于提示长度的 CV²。
# 3. $k$ 越小，$C_a^2 = 1/k$ 越大，Kingman 的因子 $(C_a^2 + C_s^2)/2$ 越大，尾延迟越高；$k={{EX_K[-1]:g}}$ 时即使平均负载只有 {{EX_LOAD:.0%}}，
#    也会出现长时间的排队。换几个 `seed` 重复，比较结果的波动——突发到达下需要更多的请求或种子才能得到稳定的均值。
# 4. conv trace 的提示长度中位数是 {{conv_p50:.0f}}，预填充更重；TTFT 随每分钟请求数的起伏而起伏，速率高的几分钟排队明显。
#    注意把超过模型 `max_model_len` 的请求去掉，或看 `summary()["rejected"]`。
# 5. 连续批处理的服务率随批大小（也就是队列长度）增长，直到 `max_num_seqs` 或 KV 用尽；这类模型叫批量服务队列
#    （Bulk-service Queue），或服务率依赖于状态的队列（State-dependent Service）。
#
# </details>
