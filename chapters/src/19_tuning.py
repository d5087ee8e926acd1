# %% [markdown]
# # 第 19 章 参数调优：在 SLA 下寻找帕累托前沿
#
# 第 1 章的 RAG 案例是这样调参的：先设 `--max-num-seqs 8 --max-wait 30ms`，压测，看着 TTFT 与吞吐改成 16 与 20 ms，再压测。
# 这种“改一个数、压一次、凭感觉”的办法有四个问题：不知道要满足的到底是什么（平均 TTFT？每个请求的 TTFT？），
# 不知道改过的配置之外还有没有更好的，不知道为了找到它要压测多少次，也不知道两次压测之间的差别是不是只是运气。本章把调参写成一个**优化问题**：
# 在一组旋钮（`max_num_seqs`、`max_num_batched_tokens`、`max_wait_ms`、调度策略）组成的**配置空间**（Configuration Space）里，
# 在每个请求都要满足的 SLO 之下，找**有效吞吐**（Goodput）或**服务容量**（Capacity）最高的配置，
# 并画出“有效吞吐 / 容量”与“延迟”之间的**帕累托前沿**（Pareto Front）。
# 标题沿用第 1 章的说法“SLA”；按术语表，对用户的承诺是服务等级协议（SLA），其中的延迟约束才是服务等级目标（SLO），下文只说 SLO。
#
# 真机上每个配置点都要占 GPU 跑一遍。Vidur（Agrawal et al., *Vidur: A Large-Scale Simulation Framework for LLM Inference*,
# MLSys'24, arXiv:2405.05465）的思路是：先用模拟器在 CPU 上把配置空间搜一遍，再只把最优的几个拿到 GPU 上验证。
# 本章用 minibatch 的模拟器（第 1 章起用的 `executor="sim"`）与 `minibatch.tune` 做同一件事，数一数找到最优点要模拟多少次，
# 并且每个结论都在**稳态**（Steady State）、多个负载种子上检验：种子之间的差别比配置之间的差别还大时，“最优”就只是运气。
#
# ## 学习目标
#
# - 写出配置空间、每个请求的 SLO、有效吞吐、SLO 达成率与服务容量的定义，以及“支配”与帕累托前沿；
# - 区分稳态与**过载**（Overload）：过载时没有稳态，延迟随压测时长一直增长，这时量出的延迟不能拿来比较配置；
# - 读懂 `minibatch.tune` 的网格搜索与 Vidur 式的容量二分搜索（加上剪枝），算出两者各需多少次模拟；
# - 在模拟的 Llama-2-7B / A100-80G、chat 负载上，用多个种子、足够长的稳态运行，找有效吞吐与容量最优的配置，画出前沿；
# - 量出错配一个旋钮（`max_num_seqs`、Token 预算、`max_wait_ms`、策略）损失多少容量，并判断这个损失是否超出种子之间的波动；
# - 看 SLO 怎样移动最优点（紧的与松的 TTFT），以及太短的压测怎样高估容量；
# - 用控件选择 SLO，看前沿怎样移动。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np

import minibatch
from minibatch import tune
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import load_workload

SIM = {"model": "llama-2-7b", "hardware": "a100-80g"}        # the simulated server of this chapter
SEEDS, DUR, TRIM = (1001, 1002, 1003), 60.0, 0.1              # 3 seeds; 60 s of arrivals per run; middle 80% kept
CHAT = {s: load_workload("chat", n=700, seed=s) for s in SEEDS}   # Azure conversation trace 2023, fitted
CHAT_RATE = CHAT[SEEDS[0]].stats()["rate"]                     # the trace's own mean rate
SLO, TARGET = {"ttft": 0.5, "tpot": 0.05}, 0.9                # per request, in seconds; 90% must meet it
LAT = "ttft_p90"                                              # the latency axis of the Pareto front
POOL_BLOCKS = make_cost_model(SIM["model"], SIM["hardware"]).kv_capacity_tokens() // 16   # exercise 5: the default pool
SWEEP = dict(processes=2, target=TARGET, latency_metric=LAT, trim=TRIM, **SIM)
CAP = dict(lo=2.0, hi=8.0, tol=0.05, trim=TRIM, target=TARGET, duration_s=DUR, processes=2, executor="sim", **SIM)
RATE_A = 4.0                                                  # 19.2: a fixed rate below every capacity of S >= 32
GRID_A = [{"policy": ["continuous"], "max_num_seqs": [16, 32, 64, 256], "max_num_batched_tokens": [512, 2048, 8192]},
          {"policy": ["continuous"], "max_num_seqs": [32], "max_num_batched_tokens": [2048], "max_wait_ms": [100.0]},
          {"policy": ["dynamic"], "max_num_seqs": [32], "max_num_batched_tokens": [8192], "max_wait_ms": [0.0, 100.0]}]
GRID_B = {"max_num_seqs": [16, 32, 64], "max_num_batched_tokens": [512, 2048, 8192]}      # 19.3-19.6
RATES = [3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0]                                               # 19.3: the rate ladder
FINE = list(np.arange(RATES[0], RATES[-1] + 1e-9, (RATES[1] - RATES[0]) / 2))             # exercise 1's ladder
SLOS = {"tight": {"ttft": 0.25, "tpot": 0.05}, "main": SLO, "loose": {"ttft": 2.0, "tpot": 0.05}}   # 19.5
B_PAIR = [512, 2048]                                                                       # 19.4-19.5: budgets compared
SHORT = 120                                                                                # 19.6: requests per run, first edition
print("minibatch", minibatch.__version__)
print({k: round(v, 2) for k, v in CHAT[SEEDS[0]].stats().items() if k in ("rate", "cv", "input_p50", "output_p50")})


# %%
S_LIST, B_LIST = GRID_A[0]["max_num_seqs"], GRID_A[0]["max_num_batched_tokens"]    # for the prose


def sset(xs):
    """A set of knob values as the prose writes it: {16, 32, 64}."""
    return "{" + ", ".join(f"{x:g}" for x in xs) + "}"


def trial(result, **config):
    """The trial of ``result`` whose configuration is exactly ``config``."""
    return next(t for t in result.trials if t.config == config)


def cfg(s, b):
    return {"max_num_seqs": s, "max_num_batched_tokens": b}


def label(c):
    return f"S={c['max_num_seqs']}, B={c['max_num_batched_tokens']}" + \
        (f", W={c['max_wait_ms']:g}ms" if "max_wait_ms" in c else "")


# %% [markdown]
# 负载是课程的 `chat`（按 Azure LLM inference trace 2023 的对话部分拟合：提示词中位数约 1,020、输出中位数约 129 Token，
# Gamma 到达、间隔的变异系数约 1.09，见 `minibatch/workload/named.py`），平均到达率 {{CHAT_RATE:.2f}} req/s。
# 服务器是模拟的 Llama-2-7B / A100-80G。SLO 对**每个请求**分别判断：
# TTFT ≤ {{SLO["ttft"]:.1f}} s 且 TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms，要求至少 {{TARGET:.0%}} 的请求满足。
#
# **怎样测才算数。** 每次运行回放 {{DUR:.0f}} s 的到达（到达率为 $\lambda$ 时约 $\lambda \cdot$ {{DUR:.0f}} 个请求，`tune.workload_at`），
# 只统计到达时间落在中间 {{1 - 2 * TRIM:.0%}} 的请求（`trim={{TRIM}}`：去掉空载开始的预热与没有新到达的收尾），有效吞吐只数这段时间窗里完成的请求；
# 每个结论都在 {{len(SEEDS)}} 个负载种子（{{"、".join(map(str, SEEDS))}}：同样的分布、不同的到达与长度样本）上各测一次，报中位数与最小–最大。
#
# ## 19.1 把调参写成优化问题
#
# 一个**配置**是旋钮的一组取值 $c = (\pi, S, B, W)$：调度策略 $\pi$、`max_num_seqs` $S$、`max_num_batched_tokens` $B$、
# `max_wait_ms` $W$；**配置空间** $\mathcal{C}$ 是要比较的全部配置。到达率 $\lambda$ 下，稳态窗口 $[t_0, t_1]$ 里请求 $i$ 满足 SLO，记作
#
# $$
# \text{ok}_i = \big[\,\text{TTFT}_i \le T_\text{ttft}\ \wedge\ \text{TPOT}_i \le T_\text{tpot}\,\big],\qquad
# A(c,\lambda) = \frac{1}{|R|}\sum_{i \in R} \text{ok}_i ,\qquad
# G(c,\lambda) = \frac{\#\{i : \text{ok}_i,\ t^\text{fin}_i \in [t_0, t_1]\}}{t_1 - t_0} ,
# $$
#
# 其中 $R$ 是稳态窗口里到达的请求，$A$ 是 **SLO 达成率**（SLO Attainment），$G$ 是**有效吞吐**（DistServe, OSDI'24 的 Goodput，单位 req/s）。
# **服务容量**是达成率不低于目标 $X$ 的最高到达率：
#
# $$
# \text{Cap}(c) = \max\{\lambda : A(c, \lambda') \ge X\ \ \forall \lambda' \le \lambda\} ,
# $$
#
# 在一个**到达率阶梯**（Rate Ladder）$\lambda_1 < \dots < \lambda_K$ 上，它取阶梯上的值（一级也不满足时为 0）。
# 两种目标对应两种问题：到达率已知时最大化 $G(c, \lambda_0)$；要回答“这台机器最多扛多少”时最大化
# $\text{Cap}(c)$。只看一个目标会漏掉代价：有效吞吐一样高的两个配置，延迟可能差很多。于是再看一个延迟 $L(c)$
# （本章取 p90 TTFT）。配置 $c$ **支配**（Dominance）$c'$，当且仅当 $f(c) \ge f(c')$ 且 $L(c) \le L(c')$、至少一个严格成立（$f$ 是有效吞吐或容量）；
# 不被任何配置支配的那些组成**帕累托前沿**：前沿上的每一点，想再降延迟就得牺牲吞吐，反之亦然。前沿之外的配置不必考虑。
#
# 这些量只在**稳态**下有定义。到达率高于容量时系统**过载**：队列一直变长，$A$ 与 $L$ 取决于压测跑了多久，而不是配置本身。
# 所以固定到达率的比较要选在容量以下，过载要说成过载（19.2 节）。
#
# **搜索的代价。** 全**网格搜索**（Grid Search）要在每个配置、每级到达率上各模拟一次：$|\mathcal{C}| \cdot K$ 次。
# 容量的定义有单调性（到达率越高，达成率越低——这是任何**容量搜索**（Capacity Search）的前提），所以对一个配置可以在阶梯上**二分**：
# 约 $\lceil \log_2 (K+1) \rceil$ 次。再加**剪枝**（Pruning）：已知的最佳容量是 $\lambda^\ast$ 时，下一个配置先只测 $\lambda^\ast$ 的上一级，
# 不达标就不可能超过 $\lambda^\ast$，1 次就淘汰。于是总次数大约在 $1 + \log_2 K + (|\mathcal{C}| - 1)$ 与 $|\mathcal{C}|(1 + \log_2 K)$ 之间，
# 取决于好配置排得多靠前。下面是 `minibatch.tune` 的实现：一个配置的二分搜索与剪枝，和帕累托前沿：

# %%
print(inspect.getsource(tune.search_capacity))
print(inspect.getsource(tune.pareto_front))

# %% [markdown]
# `search_capacity` 的 `floor` 是目前最佳容量在阶梯上的下标：先测 `floor + 1`，不达标就返回“剪掉”（`None`），
# 达标再在上面二分。`sweep(..., method="bisect")` 每次把 `processes` 个配置并行搜索，每一批都用之前各批的最佳容量来剪枝
# （所以并行时比逐个搜索多几次）。
#
# **Vidur 的做法。** 二分搜容量来自 Vidur-Search（`microsoft/vidur` 仓库 `vidur/config_optimizer/config_explorer/capacity_search.py`，
# commit 0c1a57a 的 `CapacitySearch.search`）：对每个配置在 QPS 上二分，直到区间小于 `--min-search-granularity`（默认 2.5%，
# `main.py`，commit 158eee6），SLO 是调度延迟（`request_scheduling_delay`）的 P99 不超过 `--scheduling-delay-slo-value`（默认 5.0）；各配置彼此独立，
# 由 Ray 并行，没有跨配置的剪枝——剪枝是 minibatch 加上的。论文报告：Vidur 估计推理延迟的误差在 9% 以内；
# Vidur-Search 在一台 CPU 机器上用一小时找到 LLaMA2-70B 的最佳部署配置，而在真机上逐一部署探索需要约 42K GPU 小时、
# 约 21.8 万美元（arXiv:2405.05465 摘要）。这些是论文的数字，本章不复现。
#
# ## 19.2 固定到达率：有效吞吐最优的配置与帕累托前沿
#
# 先回答第一个问题：到达率固定为 {{RATE_A:g}} req/s（低于下面量出的 $S \ge$ {{S_LIST[1]}} 的容量，这些配置有稳态），哪个配置的有效吞吐最高？
# 配置空间是三块网格的并集（`tune.sweep` 接受网格的列表，与 scikit-learn 的 `ParameterGrid` 相同，用来避免“没有意义或不起作用的组合”）：
#
# - 连续批处理（`continuous`）：$S \in$ {{sset(GRID_A[0]["max_num_seqs"])}} × $B \in$ {{sset(GRID_A[0]["max_num_batched_tokens"])}}；
# - `max_wait_ms` 只对请求级的动态批处理窗口（第 4 章的 `dynamic` 策略）有意义，它单独一块：$W \in$ {{sset(GRID_A[2]["max_wait_ms"])}} ms；
#   再加一个 `continuous` 配 $W$ = {{GRID_A[1]["max_wait_ms"][0]:g}} ms 的点，看连续批处理是否理会它。
#
# 每个种子扫一遍（每次 {{len(tune.grid_configs(GRID_A))}} 个配置），每个配置取 {{len(SEEDS)}} 个种子的中位数：

# %%
res_a = {s: tune.sweep(tune.workload_at(CHAT[s], RATE_A, DUR), grid=GRID_A, slo=SLO, **SWEEP) for s in SEEDS}
by_seed = {k: np.array([[getattr(t, k) for t in res_a[s].trials] for s in SEEDS]) for k in ("goodput", "latency", "attainment")}
med_a = [tune.Trial(t.config, *(float(np.median(by_seed[k][:, i])) for k in ("goodput", "attainment", "latency")))
         for i, t in enumerate(res_a[SEEDS[0]].trials)]
front_a = tune.pareto_front(med_a)
best_a = max(med_a, key=lambda t: t.goodput)
index = {label(t.config): i for i, t in enumerate(med_a)}
cont = [t for t in med_a if t.config["policy"] == "continuous" and "max_wait_ms" not in t.config]
dyn = [t for t in med_a if t.config["policy"] == "dynamic"]
md_table(["configuration", "goodput (req/s): median (min–max)", "p90 TTFT (s): median (min–max)", "attainment (median)", ""],
         [[f"{t.config['policy']}, {label(t.config)}",
           f"{t.goodput:.2f} ({by_seed['goodput'][:, i].min():.2f}–{by_seed['goodput'][:, i].max():.2f})",
           f"{t.latency:.2f} ({by_seed['latency'][:, i].min():.2f}–{by_seed['latency'][:, i].max():.2f})",
           f"{t.attainment:.0%}", "best" if t is best_a else ("front" if t in front_a else "")]
          for i, t in enumerate(med_a)])

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.3]})
front = sorted(front_a, key=lambda t: t.latency)
near = [t for t in cont if t.config["max_num_seqs"] >= 32]
for ax, pts in ((ax1, cont), (ax2, near)):
    for t in pts:                                    # bars: the seeds' min-max on both axes
        i = index[label(t.config)]
        ax.errorbar(t.latency, t.goodput, fmt="o", color="C0", ms=4, lw=0.8, zorder=3,
                    xerr=[[t.latency - by_seed["latency"][:, i].min()], [by_seed["latency"][:, i].max() - t.latency]],
                    yerr=[[t.goodput - by_seed["goodput"][:, i].min()], [by_seed["goodput"][:, i].max() - t.goodput]])
    ax.step([t.latency for t in front], [t.goodput for t in front], where="post", color="k", lw=1, label="Pareto front")
    ax.scatter([best_a.latency], [best_a.goodput], marker="*", s=220, color="gold", edgecolor="k", zorder=4,
               label="goodput-optimal (median)")
    ax.grid(alpha=0.3, which="both")
ax1.scatter([t.latency for t in dyn], [t.goodput for t in dyn], marker="s", color="C3", label="dynamic, W=0 and 100 ms")
ax1.axvspan(min(t.latency for t in near) * 0.8, max(t.latency for t in near) * 1.2, color="0.9", zorder=0)
ax1.set(xscale="log", xlabel="p90 TTFT (s, steady state)", ylabel="goodput (req/s)", title="All configurations")
ax1.legend(fontsize=7, loc="center right")
seen = {}
for t in near:                                   # S=64 and S=256 coincide: one label per point
    seen.setdefault((t.latency, t.goodput), []).append(t.config)
for (x, y), cs in seen.items():
    text = f"S={'/'.join(str(c['max_num_seqs']) for c in cs)}, B={cs[0]['max_num_batched_tokens']}"
    ax2.annotate(text, (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
ax2.set(xlabel="p90 TTFT (s, steady state)", ylabel="goodput (req/s)", title="Zoom: max_num_seqs >= 32 (grey band)")
ax2.margins(x=0.3)
fig.suptitle(f"chat at {RATE_A:g} req/s, {DUR:.0f} s per run, median of {len(SEEDS)} seeds (bars: min-max); "
             f"SLO per request: TTFT <= {SLO['ttft']} s, TPOT <= {SLO['tpot'] * 1e3:.0f} ms", fontsize=10)
fig.tight_layout()
plt.show()

# %%
waited = med_a[index[label({**cfg(32, 2048), "max_wait_ms": 100.0})]]
same_no_wait = med_a[index[label(cfg(32, 2048))]]
same_64_256 = all(np.array_equal(by_seed[k][:, index[label(cfg(64, b))]], by_seed[k][:, index[label(cfg(256, b))]])
                  for k in by_seed for b in (512, 2048, 8192))
ok_a = [t for t in cont if t.attainment >= TARGET]                   # the configurations that keep up at RATE_A
gap_a = max(t.goodput for t in ok_a) - min(t.goodput for t in ok_a)  # their median goodputs' range
noise_a = max(np.ptp(by_seed["goodput"][:, index[label(t.config)]]) for t in ok_a)   # one config's seed range
lat_b = {b: by_seed["latency"][:, index[label(cfg(64, b))]] for b in (512, 2048, 8192)}
b_order = bool(np.all(lat_b[512] > lat_b[2048]) and np.all(lat_b[512] > lat_b[8192]))
g16 = max(t.goodput for t in cont if t.config["max_num_seqs"] == S_LIST[0])      # S=16's best median goodput
print(f"{sum(r.num_runs for r in res_a.values())} simulated runs; median goodput of the {len(ok_a)} configurations "
      f"meeting {TARGET:.0%}: {min(t.goodput for t in ok_a):.2f}-{max(t.goodput for t in ok_a):.2f} req/s "
      f"(one configuration's seeds differ by up to {noise_a:.2f}); p90 TTFT at S=64 by B, per seed: "
      + ", ".join(f"B={b}: {np.round(v, 2).tolist()}" for b, v in lat_b.items()))

# %% tags=["check"]
assert (waited.goodput, waited.latency) == (same_no_wait.goodput, same_no_wait.latency), "continuous ignores max_wait"
assert best_a.config["policy"] == "continuous" and max(t.goodput for t in dyn) < 0.05 * best_a.goodput, \
    "the prose says request-level batching is nowhere near"
assert abs(dyn[0].goodput - dyn[1].goodput) < 0.02, "the prose says max_wait barely moves the dynamic policy"
assert same_64_256, "the prose says 64 and 256 sequences give the same runs on every seed"
assert all(t.attainment < 0.5 for t in cont if t.config["max_num_seqs"] == 16), "the prose: S=16 is overloaded here"
assert gap_a < noise_a, "the prose says the goodput gaps are inside one configuration's seed range"
assert b_order, "the prose says B=512 has the higher p90 TTFT on every seed"
assert best_a in front_a and len(front_a) >= 2
assert all(by_seed["attainment"][:, index[label(t.config)]].max() == 0 for t in dyn), "the prose: no dynamic request meets it"
assert g16 < 0.5 * min(t.goodput for t in cont if t.config["max_num_seqs"] > S_LIST[0]), "the prose: under half"

# %% [markdown]
# {{len(SEEDS)}} 次扫描共模拟了 {{sum(r.num_runs for r in res_a.values())}} 次。按中位数，有效吞吐最高的是
# **{{label(best_a.config)}}**（{{best_a.goodput:.2f}} req/s，p90 TTFT {{best_a.latency:.2f}} s），但这个“最高”经不起种子的检验。先说站得住的结论：
#
# - `continuous` 配 $W$ = {{GRID_A[1]["max_wait_ms"][0]:g}} ms 与 $W$ = 0 的结果在每个种子上**逐位相同**：连续批处理没有批处理窗口，`max_wait_ms` 对它不起作用
#   （`minibatch/policies/continuous.py` 的文档字符串；vLLM 也没有这个参数，见第 1 章）。第 1 章案例里调 `--max-wait` 的那一步，
#   对迭代级调度器是空操作。
# - 请求级的 `dynamic` 策略，$W$ 取 0 与 {{GRID_A[2]["max_wait_ms"][1]:g}} ms，在每个种子上都没有一个请求满足 SLO（有效吞吐 {{max(by_seed["goodput"][:, index[label(t.config)]].max() for t in dyn):.0f}} req/s），
#   p90 TTFT 在 {{min(t.latency for t in dyn):.0f}} s 以上：整批要等最慢的成员（第 4、5 章），它在这个到达率下过载，
#   调窗口解决不了过载。**错的不是 $W$，是策略。**
# - $S$ = {{S_LIST[0]}} 同样过载（达成率的中位数至多 {{max(t.attainment for t in cont if t.config["max_num_seqs"] == S_LIST[0]):.0%}}）；$S$ = {{S_LIST[2]}} 与 $S$ = {{S_LIST[3]}} 在每个种子上结果完全相同：
#   这个到达率下同时运行的请求从来不到 {{S_LIST[2]}} 个，上限不起作用。
#
# 再说站不住的：达成率 ≥ {{TARGET:.0%}} 的 {{len(ok_a)}} 个配置，有效吞吐的中位数彼此只差 {{gap_a:.2f}} req/s，而**同一个配置**在三个种子之间就差到
# {{noise_a:.2f}} req/s——在容量以下，有效吞吐约等于到达率乘以达成率，配置之间分不出高下，“有效吞吐最优”只是并列里的一个。
# 能分开它们的是延迟：同为 $S$ = {{S_LIST[2]}}，$B$ = {{B_LIST[0]}} 的 p90 TTFT 在**每个种子上**都高于 {{B_LIST[1]}} 与 {{B_LIST[2]}}（上面打印的逐种子数值）——
# 同一个种子上的成对比较消掉了负载本身的波动，这是多种子比较里最有力的一种。
# 前沿上有 {{len(front_a)}} 个配置（按中位数），它们之间的取舍只在延迟一侧是实的。
#
# **过载时没有稳态。** chat 自己的到达率是 {{CHAT_RATE:.2f}} req/s，高于下面量出的所有容量。本章的第一版在这个到达率下只回放了 {{SHORT}} 个请求（约 {{(SHORT - 1) / CHAT_RATE:.0f}} s），
# 把那时的延迟当成了稳态。同一个配置，到达率不变，只改压测时长：

# %%
LENGTHS = (20.0, 120.0)                                   # seconds of arrivals
over_cfg = {**SIM, "executor": "sim", **{k: v for k, v in best_a.config.items() if k != "policy"}}
over = tune.summaries([(tune.workload_at(CHAT[SEEDS[0]], r, d), over_cfg) for r in (CHAT_RATE, RATE_A) for d in LENGTHS],
                      slo=SLO, trim=TRIM)
over = {(r, d): s for (r, d), s in zip([(r, d) for r in (CHAT_RATE, RATE_A) for d in LENGTHS], over)}
md_table(["rate (req/s)", "seconds of arrivals", "TTFT p50 (s)", "TTFT p90 (s)", "attainment"],
         [[f"{r:.2f}", f"{d:.0f}", f"{s['ttft_p50']:.2f}", f"{s['ttft_p90']:.2f}", f"{s['slo_attainment']:.0%}"]
          for (r, d), s in over.items()])
grow = {r: over[r, LENGTHS[1]]["ttft_p50"] / over[r, LENGTHS[0]]["ttft_p50"] for r in (CHAT_RATE, RATE_A)}
print(f"{label(best_a.config)}, seed {SEEDS[0]}: TTFT p50 grows x{grow[CHAT_RATE]:.1f} at {CHAT_RATE:.2f} req/s "
      f"and x{grow[RATE_A]:.2f} at {RATE_A:g} req/s from {LENGTHS[0]:.0f} s to {LENGTHS[1]:.0f} s of arrivals")

# %% tags=["check"]
assert grow[CHAT_RATE] > 2 and abs(grow[RATE_A] - 1) < 0.25, "the prose: overload grows with the run, RATE_A does not"

# %% [markdown]
# 在 {{CHAT_RATE:.2f}} req/s 下，TTFT 的中位数从 {{LENGTHS[0]:.0f}} s 压测的 {{over[CHAT_RATE, LENGTHS[0]]["ttft_p50"]:.2f}} s 涨到 {{LENGTHS[1]:.0f}} s 压测的
# {{over[CHAT_RATE, LENGTHS[1]]["ttft_p50"]:.2f}} s（× {{grow[CHAT_RATE]:.1f}}），压得越久越糟，这是过载；在 {{RATE_A:g}} req/s 下它几乎不变
# （× {{grow[RATE_A]:.2f}}），这才是稳态。过载时“有效吞吐”量的是饱和时还能保住多少请求，延迟只说明“在变坏”，不能放在前沿上比较。
#
# ## 19.3 服务容量：全网格与二分搜索
#
# 容量要在一串到达率上测。阶梯取 {{RATES[0]:g}} 到 {{RATES[-1]:g}} req/s、步长 {{RATES[1] - RATES[0]:g}}（{{len(RATES)}} 级）；每一级都回放 {{DUR:.0f}} s 的到达
# （`tune.sweep(..., duration_s=...)`：取负载的前 $\lceil \lambda \cdot$ {{DUR:.0f}} $\rceil + 1$ 个请求，再伸缩到 $\lambda$，于是高到达率不会只测一小段）。
# 配置空间取 $S \in$ {{sset(GRID_B["max_num_seqs"])}} × $B \in$ {{sset(GRID_B["max_num_batched_tokens"])}}（上面已经看到 $S$ = {{S_LIST[3]}} 与 {{S_LIST[2]}} 相同，`dynamic` 无缘）。
# 这一节只数**模拟次数**，所以只用种子 {{SEEDS[0]}}；先跑全网格，再跑带剪枝的二分搜索：

# %%
full = tune.sweep(CHAT[SEEDS[0]], grid=GRID_B, slo=SLO, rates=RATES, method="grid", duration_s=DUR, **SWEEP)
fast = tune.sweep(CHAT[SEEDS[0]], grid=GRID_B, slo=SLO, rates=RATES, method="bisect", duration_s=DUR, **SWEEP)

# %% tags=["nbval-check-output"]
opt = full.best_trial
ties = [t for t in full.trials if t.capacity == opt.capacity]
print(f"capacity optimum (full grid): {label(opt.config)}, {opt.capacity:.1f} req/s, p90 TTFT there {opt.latency:.2f} s; "
      f"configurations at that capacity: {[label(t.config) for t in ties]}")
print(f"capacity optimum (bisect):    {label(fast.best_trial.config)}, {fast.best_trial.capacity:.1f} req/s")
print(f"simulated runs: full grid {full.num_runs}, bisect with pruning {fast.num_runs} "
      f"({fast.num_runs / full.num_runs:.0%}); pruned configurations: {sum(t.pruned for t in fast.trials)}")

# %% tags=["check"]
assert fast.best == full.best and fast.best_trial.capacity == opt.capacity > 0, "the search finds the grid's optimum"
assert full.num_runs == len(RATES) * 9 and fast.num_runs < full.num_runs / 2
assert len(ties) >= 2 and opt.capacity < CHAT_RATE, "the prose: ties at the optimum; chat's own rate is above it"

# %% [markdown]
# 下图是全网格的每一格：颜色是达成率，深蓝框出“达标”（≥ {{TARGET:.0%}}）的格子；圆圈是二分搜索实际模拟过的格子。
# 剪掉的配置只测了一格：它在当时最佳容量的上一级就不达标。

# %%
configs = [t.config for t in full.trials]
att = np.array([[t.probes[r] for r in RATES] for t in full.trials])
fig, ax = plt.subplots(figsize=(8, 3.8))
im = ax.imshow(att, cmap="RdYlGn", vmin=0.5, vmax=1.0, aspect="auto")
for i, (tf, tb) in enumerate(zip(full.trials, fast.trials)):
    for j, r in enumerate(RATES):
        if att[i, j] >= TARGET:
            ax.add_patch(plt.Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, ec="navy", lw=1.2))
        if r in tb.probes:
            ax.plot(j, i, "o", ms=7, mfc="none", mec="k", mew=1.5)
    ax.text(len(RATES) - 0.4, i, ("pruned" if tb.pruned else f"cap {tb.capacity:.1f}") + f", {tb.runs} run(s)",
            va="center", fontsize=7)
ax.set_xticks(range(len(RATES)), [f"{r:g}" for r in RATES])
ax.set_yticks(range(len(configs)), [label(c) for c in configs], fontsize=7)
ax.set(xlabel="request rate (req/s)", xlim=(-0.5, len(RATES) + 2.2),
       title=f"SLO attainment, seed {SEEDS[0]} (full grid: {full.num_runs} runs); circles: the {fast.num_runs} runs of the bisection")
fig.colorbar(im, ax=ax, fraction=0.03, label="attainment")
plt.show()
print("capacity (req/s) by configuration, seed", SEEDS[0], {label(t.config): t.capacity for t in full.trials})

# %% [markdown]
# 全网格模拟了 {{full.num_runs}} 次，二分搜索加剪枝只用了 {{fast.num_runs}} 次（{{fast.num_runs / full.num_runs:.0%}}），
# 找到的是同一个最优配置 **{{label(opt.config)}}**，容量 {{opt.capacity:.1f}} req/s——低于 chat 自己的 {{CHAT_RATE:.2f}} req/s。
# 省下的来自两处：二分（一个配置只测阶梯上的几级）与剪枝（{{sum(t.pruned for t in fast.trials)}} 个配置各只测了一次）。
# 阶梯越细、配置越多，差距越大：全网格的次数随 $K$ 线性增长，二分只多 $\log_2 K$（练习 1）。
#
# 但“同一个最优”要打折扣：在 {{RATES[1] - RATES[0]:g}} req/s 的阶梯上，有 {{len(ties)}} 个配置的容量都是 {{opt.capacity:.1f}}（{{[label(t.config) for t in ties]}}），
# `tune` 按网格顺序取了第一个；这只是一个种子、一种阶梯分辨率上的并列。下一节用三个种子、连续的二分来分开它们。
#
# ## 19.4 敏感性：错配一个旋钮损失多少
#
# **敏感性**（Sensitivity）：从最优点出发，每次只改一个旋钮，看容量损失多少。这次每个配置、每个种子都单独二分容量
# （`tune.capacities`：在 {{CAP["lo"]:g}}–{{CAP["hi"]:g}} req/s 之间取几何中点，直到区间两端相差不到 {{CAP["tol"]:.0%}}，每次回放 {{DUR:.0f}} s；
# 底层是 `minibatch.results.capacity`，结果是 `CapacityEstimate`：中位数与最小–最大）。
# `tune.verdict` 判断一个损失是否“站得住”：改过的配置在**最好的种子**上也低于最优点**最差的种子**，才算更差；两者的范围重叠，就是分不开：

# %%
s0, b0 = opt.config["max_num_seqs"], opt.config["max_num_batched_tokens"]
AROUND = [cfg(s0, b0)] + [cfg(s, b0) for s in GRID_B["max_num_seqs"] if s != s0] + [cfg(s0, b) for b in B_PAIR if b != b0]
around = {label(f.config): f for f in tune.capacities(CHAT, AROUND, SLO, **CAP)}
base = around[label(opt.config)].estimate
loss = {k: 1 - f.estimate.median / base.median for k, f in around.items() if k != label(opt.config)}
sure = {k: tune.verdict(base, around[k].estimate) for k in loss}
md_table(["configuration", "capacity (req/s): median (min–max)", "per seed", "loss vs the optimum (median)", "seeds separate them?"],
         [[k, f"{f.estimate:.2f}", " / ".join(f"{c:.2f}" for c in f.estimate.per_seed),
           "-" if k not in loss else f"{loss[k]:.0%}", "-" if k not in sure else
           {"higher": "yes: worse on every seed", "overlap": "no: ranges overlap", "lower": "no: better"}[sure[k]]]
          for k, f in around.items()])
print(f"{sum(f.runs for f in around.values())} simulated runs ({len(AROUND)} configurations x {len(SEEDS)} seeds)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.3))
rows = [k for k in around]
for i, k in enumerate(rows):
    e = around[k].estimate
    ax1.plot([e.lo, e.hi], [i, i], color="C0", lw=3, alpha=0.5)
    ax1.plot(e.per_seed, [i] * len(SEEDS), "k.", ms=5)
    ax1.plot(e.median, i, "o", color="C3", ms=7)
ax1.set_yticks(range(len(rows)), rows, fontsize=8)
ax1.invert_yaxis()
ax1.set(xlabel="capacity (req/s): red median, black seeds, bar min-max", title="One knob changed from the optimum")
SEQS_A = GRID_A[0]["max_num_seqs"]
for b, col in zip(GRID_A[0]["max_num_batched_tokens"], ("C0", "C1", "C2")):
    g = np.array([by_seed["goodput"][:, index[label(cfg(s, b))]] for s in SEQS_A])
    ax2.errorbar(range(len(SEQS_A)), np.median(g, axis=1), yerr=[np.median(g, axis=1) - g.min(1), g.max(1) - np.median(g, axis=1)],
                 fmt="o-", color=col, label=f"B={b}", capsize=3)
ax2.set_xticks(range(len(SEQS_A)), [str(s) for s in SEQS_A])
ax2.set(xlabel="max_num_seqs", ylabel="goodput (req/s)", title=f"Goodput at {RATE_A:g} req/s (19.2; median, min-max)")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% tags=["check"]
k16, k32 = label(cfg(16, b0)), label(cfg(32, b0))
b_other = [label(cfg(s0, b)) for b in B_PAIR if b != b0]
assert sure[k16] == "higher" and sure[k32] == "higher" and loss[k16] > loss[k32] > 0.1, \
    "the prose says fewer sequences lose capacity on every seed, 16 the most"
assert all(sure[k] == "overlap" for k in b_other), "the prose says the seeds do not separate the token budgets"
assert all(around[k].estimate.median <= base.median for k in b_other)
assert all(CAP["lo"] < c < CAP["hi"] for f in around.values() for c in f.estimate.per_seed), "capacities inside the range"

# %% [markdown]
# 以三个种子的中位数计，最优点 {{label(opt.config)}} 的容量是 {{base:.2f}} req/s。
#
# - **`max_num_seqs` 太小最致命，而且站得住。** $S$ = {{GRID_B["max_num_seqs"][1]}} 少 {{loss[k32]:.0%}}，$S$ = {{GRID_B["max_num_seqs"][0]}} 少 {{loss[k16]:.0%}}
#   （{{around[k16].estimate:.2f}} req/s），两者在**最好的种子**上都低于最优点**最差的种子**。每个请求的输出中位数一百多 Token、
#   要占槽位好几秒，槽位少了，新请求就排队，TTFT 越过 SLO。右图是同一件事在固定到达率下的样子：$S$ = {{S_LIST[0]}} 的有效吞吐（中位数最高 {{g16:.2f}} req/s）
#   不到 $S \ge$ {{S_LIST[1]}} 的一半。
# - **Token 预算的影响落在种子的波动之内。** 在 $S$ = {{s0}} 上把 $B$ 从 {{b0}} 改成其他值，容量的中位数至多少
#   {{max(loss[k] for k in b_other):.0%}}，但它们的范围与最优点重叠（上表最后一列），三个种子分不开。19.3 节单个种子上的“并列”也是这个意思。
#   小预算把长提示词切成更多块，TPOT 更稳、TTFT 更长；大预算反之（第 11 章）。哪个更伤，看 SLO 里哪一项更紧——下一节正是如此。
# - **`max_wait_ms` 错了不要紧，策略错了要命。** 对连续批处理它不起作用；对请求级的动态批处理，它改变不了过载的事实（19.2 节）。
#
# ## 19.5 SLO 决定最优点：紧的与松的 TTFT
#
# 同样的方法，换两个 SLO 再搜一次容量：**紧的** TTFT ≤ {{SLOS["tight"]["ttft"]:g}} s 与**松的** TTFT ≤ {{SLOS["loose"]["ttft"]:g}} s，
# TPOT 都是 ≤ {{SLOS["tight"]["tpot"] * 1e3:.0f}} ms。只比较 $S$ = {{s0}} 上的两个预算 $B \in$ {{sset(B_PAIR)}}，每个种子各自二分：

# %%
by_slo = {name: {b: around[label(cfg(s0, b))].estimate for b in B_PAIR} if name == "main" else
          {f.config["max_num_batched_tokens"]: f.estimate for f in
           tune.capacities(CHAT, [cfg(s0, b) for b in B_PAIR], slo, **{**CAP, "lo": 1.5})}
          for name, slo in SLOS.items()}
md_table(["SLO (per request)", *[f"capacity, B={b}: median (min–max)" for b in B_PAIR], "per seed (B=512 vs 2048)",
          "seeds separate them?"],
         [[f"TTFT <= {SLOS[n]['ttft']:g} s, TPOT <= {SLOS[n]['tpot'] * 1e3:.0f} ms", *[f"{e[b]:.2f}" for b in B_PAIR],
           " / ".join(f"{x:.2f} vs {y:.2f}" for x, y in zip(e[512].per_seed, e[2048].per_seed)),
           {"higher": "yes: 512 higher", "lower": "yes: 2048 higher", "overlap": "no"}[tune.verdict(e[512], e[2048])]]
          for n, e in by_slo.items()])
tight, loose = by_slo["tight"], by_slo["loose"]

# %% tags=["check"]
assert tune.verdict(tight[2048], tight[512]) == "overlap" and tight[2048].median > tight[512].median, \
    "the prose: with a tight TTFT the median favours 2048, but the seeds overlap"
assert tune.verdict(loose[512], loose[2048]) == "higher", "the prose: with a loose TTFT 512 wins on every seed"
assert loose[512].median < 1.1 * by_slo["main"][512].median, "the prose: loosening TTFT adds less than 10%"
assert max(e.spread for e in tight.values()) > 2 * max(e.spread for e in loose.values())

# %% [markdown]
# 最优点随 SLO 移动，但能说到什么程度，取决于种子：
#
# - **TTFT 紧**（≤ {{SLOS["tight"]["ttft"]:g}} s）：容量降到 {{tight[B_PAIR[1]]:.2f}}（$B$ = {{B_PAIR[1]}}）与 {{tight[B_PAIR[0]]:.2f}} req/s（$B$ = {{B_PAIR[0]}}）。
#   中位数偏向大预算——首 Token 要快，长提示词就得一两步算完，小预算把它切成好几步——可三个种子的范围重叠，而且很宽
#   （相对波动 {{tight[B_PAIR[0]].spread:.0%}} 与 {{tight[B_PAIR[1]].spread:.0%}}）：TTFT 的阈值离中位数太近，几次突发就决定了达成率。**这个方向只是倾向，不是结论。**
# - **TTFT 松**（≤ {{SLOS["loose"]["ttft"]:g}} s）：约束变成了 TPOT，$B$ = {{B_PAIR[0]}} 的容量 {{loose[B_PAIR[0]]:.2f}} req/s 在**每个种子上**都高于 {{B_PAIR[1]}} 的
#   {{loose[B_PAIR[1]]:.2f}}——小预算让每一步里的预填充块小，正在解码的请求的 TPOT 不被拖长（第 11 章的生成停顿）。这一条站得住。
# - 把 TTFT 从 {{SLO["ttft"]:g}} s 放宽到 {{SLOS["loose"]["ttft"]:g}} s，$B$ = {{B_PAIR[0]}} 的容量只从 {{by_slo["main"][B_PAIR[0]].median:.2f}} 升到 {{loose[B_PAIR[0]].median:.2f}} req/s：
#   TPOT 在那里就已经是瓶颈了。
#
# 所以“最优配置”这句话必须带上 SLO、负载，以及它在几个种子上成立。
#
# ## 19.6 太短的压测会高估容量
#
# 本章第一版的每次运行只有 {{SHORT}} 个请求：到达率为 $\lambda$ 时只有 $({{SHORT}} - 1)/\lambda$ 秒的到达，稳态窗口里不到 {{int(SHORT * (1 - 2 * TRIM))}} 个请求。
# 这样测出来的容量是什么样？下面用同一个配置（{{label(opt.config)}}），一次按 {{SHORT}} 个请求伸缩到每个到达率（`tune.capacities` 不给 `duration_s`），
# 一次按每级 {{DUR:.0f}} s 的到达（19.4、19.5 节的结果），各在三个种子上二分：

# %%
short_wl = {s: CHAT[s].slice(0, SHORT) for s in SEEDS}
short = {name: tune.capacities(short_wl, [opt.config], SLOS[name], **{**CAP, "duration_s": None, "hi": 16.0})[0].estimate
         for name in ("main", "loose")}
long_ = {"main": base, "loose": loose[b0] if b0 in loose else None}
md_table(["SLO", f"{SHORT} requests per run: median (min–max)", f"{DUR:.0f} s per run: median (min–max)"],
         [[n, f"{short[n]:.2f}", "-" if long_[n] is None else f"{long_[n]:.2f}"] for n in short])

# %% tags=["check"]
assert all(short[n].median > 1.2 * long_[n].median for n in short if long_[n] is not None), "short runs overstate"
assert short["main"].spread > 2 * base.spread, "the prose says short runs also spread the seeds far more"

# %% [markdown]
# {{SHORT}} 个请求的运行把容量高估了很多（居中的 SLO：{{short["main"]:.2f}}，对 {{DUR:.0f}} s 的 {{base:.2f}} req/s），种子之间的波动也大得多
# （相对波动 {{short["main"].spread:.0%}} 对 {{base.spread:.0%}}）。原因正是 19.2 节的过载：到达率略高于容量时，队列增长得很慢，
# 一次短压测在队列攒起来之前就结束了，稳态窗口里大部分是“空载开局”的请求。本章第一版正是这样测的（每次 {{SHORT}} 个请求、一个种子），
# 因此得出过“放宽 TTFT 能让容量高出一大截”的结论：{{SHORT}} 个请求时松的 SLO 下容量是 {{short["loose"]:.2f}} req/s，
# 每级 {{DUR:.0f}} s 时只有 {{long_["loose"]:.2f}}。教训有三条：每次运行要足够长（至少几十秒的稳态窗口），
# 要用多个种子并报出范围，配置之间的差距小于种子之间的波动时，不要相信单个种子选出来的“最优”。
#
# ## 19.7 动手：选一个 SLO，看前沿移动
#
# 下面的控件在 19.2 节的连续批处理网格上、{{RATE_A:g}} req/s、种子 {{SEEDS[0]}} 上重新扫描（{{len(tune.grid_configs(GRID_A[0]))}} 次模拟），
# 画出有效吞吐与 p90 TTFT 的前沿。试试把 TPOT 放宽到 100 ms、再把 TTFT 收紧到 0.25 s：前沿上的配置换成了谁？只有一个种子，记得 19.2 节的教训。

# %% tags=["nbval-ignore-output"]
GRID_W = GRID_A[0]
WL_W = tune.workload_at(CHAT[SEEDS[0]], RATE_A, DUR)
_cache = {(SLO["ttft"], SLO["tpot"]): res_a[SEEDS[0]]}


def explore(ttft_s=0.5, tpot_ms=50):
    key = (ttft_s, tpot_ms / 1000)
    if key not in _cache:
        _cache[key] = tune.sweep(WL_W, grid=GRID_W, slo={"ttft": key[0], "tpot": key[1]}, **SWEEP)
    res = _cache[key]
    pts = [t for t in res.trials if t.config["policy"] == "continuous" and "max_wait_ms" not in t.config]
    front = sorted((t for t in res.pareto if t in pts), key=lambda t: t.latency)
    _fig, ax = plt.subplots(figsize=(7.5, 3))
    ax.scatter([t.latency for t in pts], [t.goodput for t in pts], color="C0")
    ax.step([t.latency for t in front], [t.goodput for t in front], where="post", color="k", lw=1)
    for t in front:
        ax.annotate(label(t.config), (t.latency, t.goodput), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xscale="log", xlabel="p90 TTFT (s)", ylabel="goodput (req/s)",
           title=f"SLO: TTFT <= {ttft_s:g} s, TPOT <= {tpot_ms:g} ms (per request), seed {SEEDS[0]}")
    ax.grid(alpha=0.3, which="both")
    plt.show()
    b = max(pts, key=lambda t: t.goodput)
    print(f"goodput-optimal: {label(b.config)}, {b.goodput:.2f} req/s; front: {[label(t.config) for t in front]}")


W.interact(explore,
           ttft_s=W.SelectionSlider(options=[0.25, 0.5, 1.0, 2.0], value=0.5, description="TTFT SLO (s)",
                                    continuous_update=False),
           tpot_ms=W.SelectionSlider(options=[30, 40, 50, 75, 100], value=50, description="TPOT SLO (ms)",
                                     continuous_update=False));

# %% [markdown]
# ## 小结
#
# - 调参先写清楚问题：配置空间、**每个请求**判断的 SLO、目标（固定到达率下的有效吞吐，或达成率 ≥ {{TARGET:.0%}} 的服务容量），
#   再加一个延迟维度看**帕累托前沿**——前沿之外的配置不必考虑。
# - 先确认有稳态：到达率高于容量时延迟随压测时长增长（本章 {{CHAT_RATE:.2f}} req/s 下 TTFT 中位数 × {{grow[CHAT_RATE]:.1f}}），过载下的延迟不能比较配置。
# - 全网格要 $|\mathcal{C}| \cdot K$ 次模拟；Vidur 式的容量二分加上剪枝，在本章的 {{len(configs)}} 个配置、{{len(RATES)}} 级到达率上只用了
#   {{fast.num_runs}} 次（全网格 {{full.num_runs}} 次），找到同一个最优点。前提是达成率随到达率单调下降。
# - 用 {{len(SEEDS)}} 个种子、每次 {{DUR:.0f}} s 的稳态量容量，站得住的结论是：`max_num_seqs` 太小损失最大（$S$ = 16 少 {{loss[k16]:.0%}}）；
#   TTFT 松时小预算更好；`max_wait_ms` 对连续批处理不起作用。分不开的是：容量以下各配置的有效吞吐、居中与紧的 SLO 下的 Token 预算。
# - 太短的压测高估容量、放大种子波动；配置之间的差距小于种子之间的波动时，报“并列”，不要报“最优”。
#
# 下一章（第 20 章）把 vLLM、SGLang、TensorRT-LLM、TGI（自 2025-12 起处于维护模式，见第 16 章）的默认配置放到同一个负载上比较——它们也只是配置空间里的四个点。
#
# ## 练习
#
# 1. **阶梯更细。** 把 19.3 节的阶梯步长减半（{{len(FINE)}} 级），重跑全网格与二分搜索。两者的模拟次数各变成多少？
#    最优点变了吗？
# 2. **让 `max_wait_ms` 起作用。** 动态批处理窗口在什么负载下才有意义？用
#    `synthetic(200, 4.0, input_len=256, output_len=16)`（`minibatch.workload`，输出很短、长度相同）扫描
#    `{"policy": ["dynamic"], "max_num_seqs": [8, 32], "max_wait_ms": [0, 10, 50, 200]}`，SLO 取 TTFT ≤ 1 s。最优的窗口是多少？为什么？
# 3. **剪枝与顺序。** 把 `GRID_B` 的 `max_num_seqs` 倒过来（好配置排在前面），二分搜索的次数变成多少？
#    反过来把最差的排在前面呢？用 19.1 节的上下界解释。
# 4. **换一个延迟轴。** 用 `latency_metric="e2e_p90"` 重做 19.2 节，前沿变了吗？对聊天应用，哪个延迟更该放在前沿的横轴上？
# 5. **KV 成为约束。** 在 `CAP` 里加上 `num_kv_blocks=1500`（A100-80G 上 7B 的默认池约 {{POOL_BLOCKS:,}} 块），重做 19.4 节。
#    $S$ 的最优值怎样变化？抢占次数（`tune.summaries` 的 `num_preemptions`）说明了什么？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 全网格是 {{len(configs)}} × {{len(FINE)}} = {{len(configs) * len(FINE)}} 次；二分每个未剪枝的配置约 $\lceil\log_2 {{len(FINE) + 1}}\rceil$ = {{int(np.ceil(np.log2(len(FINE) + 1)))}} 次，
#    剪枝的仍是 1 次，总数只多几次。最优点可能变：{{RATES[1] - RATES[0]:g}} 的步长下并列的配置，在 {{FINE[1] - FINE[0]:g}} 的步长下可能分出高下——
#    但按 19.4 节，那很可能只是种子 {{SEEDS[0]}} 的噪声，要换种子再看。
# 2. `tune.sweep(wl, grid=..., slo={"ttft": 1.0}, **SWEEP)`。输出很短、长度一样时，整批等最慢成员的代价小；窗口太短，批凑不满、
#    吞吐低，到达率一高就排队；窗口太长，每个请求白等 $W$。最优的 $W$ 大致让“凑满一批的时间”与“一批的服务时间”相当（第 4 章）。
# 3. 最好情况：第一个配置就是最优，其余配置各 1 次，总数约 $\log_2 K + |\mathcal{C}| - 1$；最坏情况：配置按容量从低到高排，
#    每个都要完整二分，约 $|\mathcal{C}|(1 + \log_2 K)$。并行时每批用的是前几批的最佳，比逐个搜索多几次。
# 4. E2E 主要由输出长度决定，配置之间差别小，前沿上的点更多、区分度更差；聊天关心首 Token（TTFT）和流畅度（TPOT/ITL），
#    TTFT 的尾部更合适。
# 5. 池小了，$S$ 大反而更容易把 KV 用满、触发抢占（第 12 章），抢占的请求要重算，TPOT 与 TTFT 都变差；最优的 $S$ 会变小，
#    并且对 $S$ 更敏感。用 `tune.summaries([(tune.workload_at(CHAT[1001], r, DUR), {**SIM, "executor": "sim", "num_kv_blocks": 1500, **cfg})], slo=SLO)`
#    查看抢占次数。
#
# </details>
#
# **本章引用**：Vidur（Agrawal et al., MLSys'24, arXiv:2405.05465；`github.com/microsoft/vidur` 的
# `vidur/config_optimizer/config_explorer/capacity_search.py`，commit 0c1a57a，与同目录的 `main.py`，commit 158eee6）；
# DistServe（Zhong et al., OSDI'24）的有效吞吐与容量；scikit-learn `sklearn.model_selection.ParameterGrid`（网格的列表）。
