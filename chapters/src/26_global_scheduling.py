# %% [markdown]
# # 第 26 章 多副本全局调度与负载均衡
#
# 一个副本（Replica）——一个引擎、一个 KV 池——扛不住的流量，就多开几个副本。多了副本，就多了一个调度层：每个请求到达时，
# **路由器**（Router）要决定它去哪个副本。这一层看不到副本内部的调度（那是前面各章的事），它只能看见每个副本对外报告的负载
# （运行与等待的请求数、KV 使用率），或者自己记下的“把什么发到了哪里”。本章把 minibatch 集群层的每一种路由规则放到同一个负载上比较，
# 再看两件单个引擎里没有的事：**缓存感知路由**（Cache-aware Routing：共享前缀的请求去同一个副本，前缀缓存才命中），以及 Llumnix 式的**在线迁移**
# （请求已经在跑了，还能连同 KV 搬到别的副本）。最后，在本机上真的起两个 tiny 模型的服务进程和一个 HTTP 路由器，看请求怎样被分配。
#
# ## 学习目标
#
# - 说清路由器能看见什么（`ReplicaView`）、看不见什么，以及为什么“看得见的负载”总是滞后的；
# - 写出各路由规则：轮询（Round Robin）、随机、最少请求（Least Requests，即加入最短队列 JSQ）、二选一（Power of Two Choices）、
#   最低 KV 使用率、会话粘滞（Session Affinity）、SGLang 的缓存感知规则与 NVIDIA Dynamo 的 KV 代价（KV 感知路由，KV-aware Routing），
#   并对照各自的源码版本；
# - 在模拟的 4 副本集群上（Llama-3-8B / A10）、稳态、3 个种子下比较全部路由器的 TTFT 与 SLO 达成率，扫到达率求出每个路由器的服务容量，
#   并解释“最低 KV 使用率”为什么反而最差（羊群效应，Herding）；
# - 在多租户共享前缀的负载上量出缓存感知路由带来的命中率与 TTFT 变化，对照 llm-d 发表的数字；
# - 读懂 Llumnix 式迁移的负载度量（虚拟用量）与两段式拷贝，在长尾负载上量它的收益与代价；
# - 在真实的进程上跑通 `python -m minibatch serve` × 2 + `python -m minibatch router`：读路由器与上游的 `/metrics`，
#   确认贪心输出与单个引擎一致，并关掉所有进程。

# %%
import inspect
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

import minibatch
from minibatch import LLM, SamplingParams, cluster
from minibatch.bench import run_benchmark
from minibatch.cluster import Migration, ReplicaView, routers
from minibatch.cluster.migration import load as virtual_usage
from minibatch.results import capacity
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import lognormal, multi_tenant, synthetic

SIM = {"executor": "sim", "model": "llama-3-8b", "hardware": "a10"}   # every replica: Llama-3-8B on one A10
REPLICAS = 4
SLO, TARGET = {"ttft": 1.0, "tpot": 0.05}, 0.9   # per request: TTFT <= 1 s and TPOT <= 50 ms; capacity at >= 90%
SEEDS = [1, 2, 3]
RUN_S, RATE0 = 20.0, 20.0                         # seconds of traffic per run (26.2-26.3); section 26.2's rate
KV_TOKENS = make_cost_model(SIM["model"], SIM["hardware"]).kv_capacity_tokens(0.9)   # one replica's KV pool
TENANTS_, SYS_LEN_ = 16, 4096                     # section 26.4's tenants and their system prompts
T_DECODE1 = make_cost_model(SIM["model"], SIM["hardware"]).step_time([], [300])   # one decode step, batch 1
print("minibatch", minibatch.__version__, "| routers:", routers.available())

# %% [markdown]
# ## 26.1 路由器看见什么
#
# 路由规则在 minibatch 里是一个小类，只有一个决策方法 `choose(request, replicas, now) -> 下标`。`replicas` 是服务该请求所要模型的
# 各副本的 `ReplicaView`——一个只读的快照：

# %%
print(inspect.getsource(ReplicaView))

# %% [markdown]
# 这些数字就是一个真实的路由器能从副本的 Prometheus 指标里轮询到的（`vllm:num_requests_running`、`vllm:num_requests_waiting`、
# `vllm:kv_cache_usage_perc`），外加路由器自己记下的东西（发过去多少请求、多少 Token）。它们天然**滞后**：模拟器里，一个副本正在执行
# 一步时，路由器看到的是这一步开始时的状态，加上此后路由过去的请求（`minibatch/cluster/replica.py` 的模块说明）；HTTP 路由器里，
# 轮询到的数字最多晚一个轮询间隔（`minibatch/serving/router.py`）。每条规则的出处都写在它的类说明里：

# %%
rows = []
for name in routers.available():
    cls = routers.ROUTERS.classes[name]
    doc = inspect.getdoc(cls)
    first = doc.split("\n\n")[0].replace("\n", " ")
    source = next((p.replace("\n", " ") for p in doc.split("\n\n") if p.startswith("Source")), "minibatch's own rule")
    rows.append([f"`{name}`", first if len(first) <= 120 else first[:117] + "...",
                 source if len(source) <= 120 else source[:117] + "..."])
md_table(["router", "rule", "source"], rows)

# %% [markdown]
# 两类规则的直觉来自排队论。把 $n$ 个请求**随机**分给 $n$ 个副本，负载最重的副本期望上有 $\Theta(\log n / \log\log n)$ 个；
# 每次随机抽**两个**、发给负载较小的那个（二选一），最重的只剩 $\log\log n / \log 2 + O(1)$ 个——指数级的改善
# （Mitzenmacher, *The Power of Two Choices in Randomized Load Balancing*, IEEE TPDS 2001）；看遍所有副本选最短的队列
# （最少请求，JSQ）再好一些，代价是每次都要知道所有副本的负载。另一类规则看的不是负载，而是**缓存**：把共享前缀的请求送到同一个副本，
# 它们的预填充就能复用那里的 KV（第 13、14 章），这与**负载均衡**（Load Balancing）天然冲突——SGLang 的规则先检查是否失衡，Dynamo 的规则把两者加成一个代价。
#
# ## 26.2 同一个负载，八种路由器
#
# 集群：{{REPLICAS}} 个副本，每个是一张 A10 上的 Llama-3-8B（模拟器）。负载：泊松到达，提示词中位数 256（对数正态，$\sigma$ = 0.8），
# 输出中位数 48、$\sigma$ = 0.8、最长 512——长度差别大，盲目的分配会让某些副本攒下更多的活。SLO：每个请求 TTFT ≤ 1 s **且**
# TPOT ≤ 50 ms（逐请求判断；A10 上 8B 模型只解码一个请求的一步就要 {{T_DECODE1 * 1e3:.0f}} ms，一个副本上同时跑的请求与预填充块越多，它的每个请求就越慢）。
# 每次回放 {{RUN_S:.0f}} s 的流量，稳态（`summary(trim=0.2)`，中间 60% 的请求），3 个种子取中位数。这个负载没有共享前缀、也没有租户，
# 所以 `prefix_aware` 退化为“发给路由过的提示词 Token 最少的副本”（失衡时发给请求最少的），`kv_aware` 只剩负载项，
# `session` 与 `least_requests` 完全相同（下面核对一次，之后不再单独列出）。

# %%
LEN = {"input_len": lognormal(median=256, sigma=0.8, max=2048), "output_len": lognormal(median=48, sigma=0.8, max=512)}
ROUTERS = [n for n in routers.available() if n != "session"]


def workload(rate, seed, n=None):
    """RUN_S seconds of Poisson arrivals at ``rate`` req/s (the whole cluster)."""
    return synthetic(n or int(rate * RUN_S), rate, **LEN, seed=seed)


def repeat_fraction(res) -> float:
    """Fraction of consecutive arrivals routed to the same replica as the one before."""
    where = [q.replica for q in sorted(res.requests, key=lambda q: q.arrival_time)]
    return float(np.mean([a == b for a, b in zip(where, where[1:])]))


def token_spread(res) -> float:
    """Most / fewest prompt tokens routed to one replica."""
    per = [sum(q.prompt_len for q in res.requests if q.replica == i) for i in range(len(res.replicas))]
    return max(per) / min(per)


def summarize_run(res) -> dict:
    return dict(res.summary(slo=SLO, trim=0.2), repeat=repeat_fraction(res), spread=token_spread(res))


runs = {}
for seed in SEEDS:
    wl = workload(RATE0, seed)
    for name in ROUTERS:
        res = cluster.run(wl, replicas=REPLICAS, router=name, **SIM)
        runs[name, RATE0, seed] = (res, summarize_run(res))
session_same = cluster.run(workload(RATE0, 1), replicas=REPLICAS, router="session", **SIM).requests == \
    runs["least_requests", RATE0, 1][0].requests
COLS = [("slo_attainment", "attainment", "{:.0%}"), ("ttft_p99", "TTFT p99 (s)", "{:.2f}"),
        ("tpot_p50", "TPOT p50 (ms)", "{:.0f}"), ("tpot_p99", "TPOT p99 (ms)", "{:.0f}"),
        ("spread", "prompt tokens, most / fewest replica", "{:.2f}"), ("repeat", "same replica as previous", "{:.0%}")]
med = {n: {k: float(np.median([runs[n, RATE0, s][1][k] for s in SEEDS])) for k, _, _ in COLS} for n in ROUTERS}
for n in ROUTERS:
    med[n]["tpot_p50"] *= 1e3
    med[n]["tpot_p99"] *= 1e3
md_table([f"router ({RATE0:g} req/s, median of 3 seeds)"] + [label for _, label, _ in COLS],
         [[f"`{n}`"] + [fmt.format(med[n][k]) for k, _, fmt in COLS] for n in ROUTERS])
fig, ax = plt.subplots(figsize=(9, 3))
order = sorted(ROUTERS, key=lambda n: -med[n]["slo_attainment"])
ax.bar(range(len(order)), [med[n]["slo_attainment"] * 100 for n in order], color="C0", alpha=0.7,
       label="median of 3 seeds")
for i, n in enumerate(order):
    ax.plot([i] * len(SEEDS), [runs[n, RATE0, s][1]["slo_attainment"] * 100 for s in SEEDS], "k.", ms=4,
            label="each seed" if i == 0 else None)
ax.axhline(TARGET * 100, color="k", ls=":", lw=1, label=f"{TARGET:.0%}")
ax.set_xticks(range(len(order)), order, fontsize=8)
ax.set(ylabel="% requests meeting the SLO", ylim=(40, 101),
       title=f"{REPLICAS} x Llama-3-8B / A10, {RATE0:g} req/s: TTFT <= 1 s and TPOT <= 50 ms, steady state")
ax.legend(fontsize=7, loc="lower left")
ax.grid(alpha=0.3, axis="y")
plt.show()
print("session routes exactly as least_requests without tenants:", session_same)
att0 = {n: med[n]["slo_attainment"] for n in ROUTERS}
tpot99 = {n: med[n]["tpot_p99"] for n in ROUTERS}
assert session_same
assert all(med[n]["ttft_p99"] < SLO["ttft"] for n in ROUTERS), "misses come from TPOT, not TTFT"
assert min(tpot99, key=tpot99.get) == "prefix_aware" and max(tpot99, key=tpot99.get) == "least_kv"
assert att0["round_robin"] > att0["random"] + 0.1 and med["round_robin"]["spread"] > med["least_requests"]["spread"], \
    "the prose: round robin beats random by far, though its token spread is wider than least_requests'"
assert abs(att0["round_robin"] - att0["least_requests"]) <= 0.03 and abs(att0["power_of_two"] - att0["least_requests"]) <= 0.03, \
    "the prose: round robin, least_requests and power_of_two are within a few points"
assert att0["prefix_aware"] >= max(att0.values()) - 0.005 and med["prefix_aware"]["spread"] == min(med[n]["spread"] for n in ROUTERS)
assert order[-1] == "least_kv" and med["least_kv"]["repeat"] > 2 * med["random"]["repeat"]

# %% [markdown]
# 所有路由器的 TTFT p99 都在 1 s 以内，不达标的请求几乎都败在 TPOT 上：一个副本上同时运行的请求越多、插进来的预填充块越多，它的每一步就越长
# （TPOT p99 从 `prefix_aware` 的 {{tpot99["prefix_aware"]:.0f}} ms 到 `least_kv` 的 {{tpot99["least_kv"]:.0f}} ms）。几件值得注意的事：
#
# - **不看负载的轮询已经不差，随机却差得多。** `round_robin` 给每个副本的请求数完全相同，虽然请求有长有短（各副本收到的提示词 Token
#   最多与最少之比 {{med["round_robin"]["spread"]:.2f}}，`least_requests` 是 {{med["least_requests"]["spread"]:.2f}}），
#   达成率 {{att0["round_robin"]:.0%}}，与看负载的 `least_requests`（{{att0["least_requests"]:.0%}}）、只抽两个副本比较的 `power_of_two`
#   （{{att0["power_of_two"]:.0%}}）相差无几；`random` 只有 {{att0["random"]:.0%}}。原因在到达过程（第 3 章）：轮询让每个副本每隔 {{REPLICAS}} 个请求
#   收到一个，到达间隔是 {{REPLICAS}} 个指数分布之和，变异系数 $1/\sqrt{ {{REPLICAS}} }$ = {{1 / REPLICAS ** 0.5:.1f}}；随机分配时每个副本的到达仍是泊松过程，
#   变异系数为 1。由 Kingman 近似，排队时间与 $C_a^2 + C_s^2$ 成正比，轮询把到达一项降到了 1/{{REPLICAS}}。
#   看负载的规则还能纠正长短不一的服务时间，但在这个负载上差别不大。
# - **达成率最高、Token 分得最平均的是 `prefix_aware`**（{{att0["prefix_aware"]:.0%}}，Token 之比只有 {{med["prefix_aware"]["spread"]:.2f}}）——
#   在没有共享前缀的负载上，它的规则退化为“发给路由器的树里 Token 最少的副本”，也就是按累计的提示词 Token 均衡。
#   这不是缓存的功劳，而是它恰好按**工作量**均衡；26.3 节会看到它的优势在更高的到达率上更明显。
# - **最差的是看起来最“聪明”的 `least_kv`**（{{med["least_kv"]["slo_attainment"]:.0%}}）。最后一列揭示原因：
#   {{med["least_kv"]["repeat"]:.0%}} 的请求被发到了和上一个请求相同的副本（随机是 {{med["random"]["repeat"]:.0%}}，轮询是 0）。
#   一个请求被路由过去之后，要等那个副本的下一步接纳它、为它分配块，KV 使用率才会上涨；在这之前到达的请求看到的还是同一个“最空”的副本，
#   于是一拥而上——**羊群效应**（Herding）。`least_requests` 数的是请求，路由器刚发过去、还没被接纳的也算（`ReplicaView.num_waiting`），
#   所以不会滞后。滞后的指标加上“选最小”的贪心规则，是负载均衡里的经典陷阱（Mitzenmacher, *How Useful Is Old Information?*,
#   IEEE TPDS 2000：负载信息过时时，发给“看上去最空”的服务器会明显变差，随机抽两个取较空者却依然有效）；真实的 HTTP 路由器按轮询间隔读 `/metrics`，滞后只会更大
#   （`minibatch/serving/router.py` 因此把自己在途的请求也算进去）。
#
# ## 26.3 每个路由器的服务容量
#
# 服务容量是达成率 ≥ {{TARGET:.0%}} 的最高到达率。对每个路由器沿到达率阶梯从低往高测，每一级 3 个种子（各回放 {{RUN_S:.0f}} s），
# 达成率取中位数，第一次低于目标就停（再往上只是更过载；{{RATE0:g}} req/s 在 26.2 节已经测过）：

# %%
SWEEP = [12.0, 16.0, 20.0, 24.0]
workloads = {(rate, seed): workload(rate, seed) for rate in SWEEP for seed in SEEDS}
att = {n: {} for n in ROUTERS}
for name in ROUTERS:                     # climb the ladder; stop at the first median below the target
    for rate in SWEEP:
        for seed in SEEDS:
            if (name, rate, seed) not in runs:
                res = cluster.run(workloads[rate, seed], replicas=REPLICAS, router=name, **SIM)
                runs[name, rate, seed] = (res, summarize_run(res))
        att[name][rate] = float(np.median([runs[name, rate, s][1]["slo_attainment"] for s in SEEDS]))
        if att[name][rate] < TARGET and rate >= RATE0:
            break
cap = {n: capacity(att[n], target=TARGET) for n in ROUTERS}


def cap_text(n: str) -> str:
    return f"{cap[n]:g} req/s" if cap[n] else f"< {SWEEP[0]:g} req/s"


fig, ax = plt.subplots(figsize=(8, 3.2))
for i, n in enumerate(ROUTERS):
    ax.plot(list(att[n]), [a * 100 for a in att[n].values()], "o-", color=f"C{i}",
            label=f"{n} (capacity {cap_text(n)})")
ax.axhline(TARGET * 100, color="k", ls=":", lw=1)
ax.set(xlabel="request rate (req/s, whole cluster)", ylabel="% requests meeting the SLO (median of 3)",
       title=f"SLO attainment vs load, {REPLICAS} replicas, steady state")
ax.legend(fontsize=7, ncol=2)
ax.grid(alpha=0.3)
plt.show()
print("capacity (req/s), TTFT <= 1 s and TPOT <= 50 ms for 90% of requests (0: below the lowest rate tried):", cap)
assert cap["prefix_aware"] > max(c for n, c in cap.items() if n != "prefix_aware"), "prefix_aware: the highest capacity"
assert cap["least_kv"] == min(cap.values()) and cap["round_robin"] > cap["random"]

# %% [markdown]
# 阶梯只有 {{len(SWEEP)}} 级（{{SWEEP[0]:g}}–{{SWEEP[-1]:g}} req/s，间隔 {{SWEEP[1] - SWEEP[0]:g}}），容量的分辨率就是这个间隔，
# 每点是 3 个种子的中位数。容量：`prefix_aware`（按 Token 均衡）{{cap_text("prefix_aware")}}、`least_requests` {{cap_text("least_requests")}}、
# `power_of_two` {{cap_text("power_of_two")}}、`kv_aware` {{cap_text("kv_aware")}}、`round_robin` {{cap_text("round_robin")}}、
# `random` {{cap_text("random")}}、`least_kv` {{cap_text("least_kv")}}。
# 同样 {{REPLICAS}} 张卡、同样的 SLO，只换路由规则，最好的路由器能接的流量是最差的 {{max(cap.values()) / min(cap.values()):.2g}} 倍。
#
# ## 26.4 缓存感知路由：让缓存留在一个副本上
#
# 换一个负载：{{TENANTS_}} 个租户，每个租户的请求都以自己 {{SYS_LEN_}} Token 的系统提示词开头（`workload.multi_tenant`），后面接一个中位数 128 Token 的问题，
# 8 req/s，每个副本开前缀缓存。每个副本的 KV 约 {{KV_TOKENS:,}} 个 Token，{{TENANTS_}} 个系统提示词合计 {{TENANTS_ * SYS_LEN_:,}} 个 Token，
# 是它的 {{TENANTS_ * SYS_LEN_ / KV_TOKENS:.0%}}：一个副本装不下所有租户的前缀。轮询把每个租户撒到所有副本上，
# 每个副本都要缓存所有租户的前缀，只能不断驱逐、重算。
# 两条缓存感知的规则：
#
# - **SGLang 的缓存感知规则**（sglang-router 0.2.1 `src/policies/cache_aware.rs`，默认值来自 `py_src/sglang_router/router_args.py`）：
#   负载（未完成请求数）失衡——最大减最小 > `balance_abs_threshold` = 64 **且** 最大 > `balance_rel_threshold` = 1.5 × 最小——时发给负载最小的；
#   否则在路由器为每个副本维护的基数树里找与提示词最长的公共前缀，匹配比例 > `cache_threshold` = 0.3 就发到那里，否则发给树最小的副本。
# - **NVIDIA Dynamo 的 KV 路由**（ai-dynamo 0.5.0，`lib/llm/src/kv_router/scheduler.rs`）：对每个副本算
#
#   $$ \text{logit} = w \cdot \frac{\text{提示词 Token} - \text{该副本已缓存的 Token}}{B} + \text{加入后该副本的活跃块数}, \qquad w = 1 , $$
#
#   取最小者。前者是还要算的预填充块，后者是解码要占的块；缓存命中从两项里都减掉。它看的是副本**真实**的缓存（Dynamo 从工作进程的
#   KV 事件流里建索引），不是路由器自己的记录。

# %%
print(inspect.getsource(routers.PrefixAware.choose))
print(inspect.getsource(routers.KVAware.logit))

# %% [markdown]
# llm-d 的“精确前缀缓存感知”调度也走 Dynamo 这条路：`llm-d-inference-scheduler` 的 `pkg/plugins/scorer/precise_prefix_cache.go`
# （commit 057d2c7）订阅 vLLM 的 KV 事件，给每个副本打出“已缓存前缀所占比例”的分数（0–1），再与负载类的打分加权合成。
# 它的博客（*KV-Cache Wins You Can See*，llm-d.ai，2025-09-24）在 8 个 vLLM 副本（16 张 H100，Qwen-32B）、150 个企业客户、
# 每个客户 6000 Token 上下文的负载上报告：精确调度的 TTFT p90 为 0.542 s，随机调度为 92.551 s；输出吞吐 8730 对 4428.7 tok/s。
# minibatch 的 `benchmarks/cluster.py --llmd` 按这个形状在模拟器里重放。本章的负载小得多，每个规则 3 个种子：

# %%
PREFIX_ROUTERS = ["round_robin", "session", "prefix_aware", "kv_aware"]
TENANTS, SYS_LEN, PREFIX_RATE, N_PREFIX = TENANTS_, SYS_LEN_, 8.0, 160
pre = {}
for seed in SEEDS:
    wl = multi_tenant(N_PREFIX, PREFIX_RATE, num_tenants=TENANTS, system_prompt_len=SYS_LEN,
                      question_len=lognormal(median=128, sigma=0.5, max=512),
                      output_len=lognormal(median=64, sigma=0.6, max=512), seed=seed)
    for name in PREFIX_ROUTERS:
        res = cluster.run(wl, replicas=REPLICAS, router=name, enable_prefix_caching=True, **SIM)
        pre[name, seed] = res.summary(slo=SLO, trim=0.2)
PK = [("prefix_cache_hit_rate", "prefix hit rate", "{:.0%}"), ("ttft_p50", "TTFT p50 (s)", "{:.3f}"),
      ("ttft_p90", "TTFT p90 (s)", "{:.3f}"), ("slo_attainment", "attainment", "{:.0%}")]
pm = {n: {k: float(np.median([pre[n, s][k] for s in SEEDS])) for k, _, _ in PK} for n in PREFIX_ROUTERS}
md_table([f"router ({TENANTS} tenants x {SYS_LEN}-token prompts, {PREFIX_RATE:g} req/s, median of 3 seeds)"]
         + [label for _, label, _ in PK], [[f"`{n}`"] + [fmt.format(pm[n][k]) for k, _, fmt in PK] for n in PREFIX_ROUTERS])
fig, ax = plt.subplots(figsize=(7, 3))
ax.scatter([pm[n]["prefix_cache_hit_rate"] * 100 for n in PREFIX_ROUTERS], [pm[n]["ttft_p90"] for n in PREFIX_ROUTERS],
           c=[f"C{i}" for i in range(len(PREFIX_ROUTERS))], s=40)
for n in PREFIX_ROUTERS:
    ax.annotate(n, (pm[n]["prefix_cache_hit_rate"] * 100, pm[n]["ttft_p90"]), fontsize=8, xytext=(4, 4),
                textcoords="offset points")
ax.set(xlabel="prefix-cache hit rate (%)", ylabel="TTFT p90 (s, log)", yscale="log", title="Shared prefixes: hits buy latency")
ax.grid(alpha=0.3)
plt.show()
assert pm["prefix_aware"]["prefix_cache_hit_rate"] > pm["round_robin"]["prefix_cache_hit_rate"] + 0.1
assert pm["prefix_aware"]["ttft_p90"] < pm["round_robin"]["ttft_p90"] / 10, "an order of magnitude in TTFT p90"
assert pm["round_robin"]["slo_attainment"] < 0.5 <= TARGET <= pm["prefix_aware"]["slo_attainment"]
assert pm["session"]["prefix_cache_hit_rate"] > pm["kv_aware"]["prefix_cache_hit_rate"] > pm["round_robin"]["prefix_cache_hit_rate"]

# %% [markdown]
# 轮询的命中率是 {{pm["round_robin"]["prefix_cache_hit_rate"]:.0%}}（一个租户的请求散在 4 个副本上，每个副本都要各算一遍它的前缀，KV 不够时还要驱逐、再重算），
# 每次未命中都要重算 {{SYS_LEN_}} Token 的预填充，副本被重算压垮：TTFT p90 {{pm["round_robin"]["ttft_p90"]:.1f}} s，达成率只有 {{pm["round_robin"]["slo_attainment"]:.0%}}。
# SGLang 的规则把命中率提到 {{pm["prefix_aware"]["prefix_cache_hit_rate"]:.0%}}，TTFT p90 降到 {{pm["prefix_aware"]["ttft_p90"]:.2f}} s，达成率 {{pm["prefix_aware"]["slo_attainment"]:.0%}}——与 llm-d 报告的数量级差别同一个方向。`session`（按租户粘滞）在这个负载上同样好
# （{{pm["session"]["prefix_cache_hit_rate"]:.0%}}）——因为这里“租户”恰好等于“前缀”。真实负载里两者不同：llm-d 的博客指出，
# 按会话粘滞只能复用同一个用户的前缀，同一个客户下不同用户共享的系统提示词就错过了。`kv_aware` 介于两者之间
# （{{pm["kv_aware"]["prefix_cache_hit_rate"]:.0%}}）：它的代价里解码块（负载）与预填充块（缓存）权重相同，副本一忙，
# 负载项就压过了缓存项；调大 `kv_overlap_score_weight` 会让它更看重缓存（练习 3）。
#
# ## 26.5 Llumnix：请求开始之后还能搬
#
# 路由只在请求**到达**时做一次决定。可是输出长度事先不知道：轮询给每个副本的请求数一样，但某个副本可能恰好分到几个很长的请求，
# 它的 KV 被占满、新请求排队甚至被抢占，而隔壁的副本还空着。Llumnix（Sun et al., OSDI'24）的办法是**在线迁移**（Live Migration）：
# 把运行中的请求连同它的 KV 块从忙的副本搬到闲的副本。负载用**虚拟用量**（Virtual Usage）衡量——在用的块加上等待请求需要的块，
# 除以总块数（Llumnix commit 9529a78 的 `llumnix/load_computation.py`）：

# %%
print(inspect.getsource(virtual_usage))
print(Migration())

# %% [markdown]
# minibatch 的迁移（`minibatch/cluster/migration.py`）每 {{Migration().interval_s:g}} s 比较一次：虚拟用量最高与最低之差超过 {{Migration().imbalance:g}} 时，从最忙的副本挑一个块最少的解码中请求，
# 两段式地拷过去——第一段边解码边拷已写满的块（耗时 = 块数 × 每块字节数 / 链路带宽，默认 {{Migration().link_gbps:g}} Gb/s），第二段暂停它、拷剩下的块，
# 然后在目标副本上继续。不丢 Token，也不重算。Llumnix 的论文报告：尾延迟改善一个数量级，高优先级请求加速最多 1.5 倍，
# 在相近的尾延迟下节省最多 36% 的成本。
#
# 实验：提示词中位数 512、输出长尾（中位数 64、$\sigma$ = 1.5、最长 2048），14 req/s、每个种子 200 个请求，每个副本的 KV 限制为 700 块（11,200 个 Token），
# 让 KV 成为瓶颈；轮询（不看负载）与最少请求，各自有无迁移，3 个种子：

# %%
MIG_LEN = {"input_len": lognormal(median=512, sigma=0.8, max=4096), "output_len": lognormal(median=64, sigma=1.5, max=2048)}
MIG_KV, MIG_RATE, N_MIG = 700, 14.0, 200
SETUPS = [("round_robin", "round_robin", None), ("round_robin + migration", "round_robin", Migration()),
          ("least_requests", "least_requests", None), ("least_requests + migration", "least_requests", Migration())]
mig = {}
for seed in SEEDS:
    wl = synthetic(N_MIG, MIG_RATE, **MIG_LEN, seed=seed)
    for name, router, m in SETUPS:
        res = cluster.run(wl, replicas=REPLICAS, router=router, migration=m, num_kv_blocks=MIG_KV, **SIM)
        mig[name, seed] = dict(res.summary(slo=SLO, trim=0.2), moved_gb=res.summary()["kv_transfer_bytes"] / 1e9,
                               moves=res.summary()["migrations"])
MK = [("ttft_p50", "TTFT p50 (s)", "{:.2f}"), ("ttft_p99", "TTFT p99 (s)", "{:.1f}"), ("e2e_p99", "E2E p99 (s)", "{:.1f}"),
      ("num_preemptions", "preemptions", "{:.0f}"), ("moves", "migrations", "{:.0f}"), ("moved_gb", "KV moved (GB)", "{:.1f}")]
mg = {n: {k: float(np.median([mig[n, s][k] for s in SEEDS])) for k, _, _ in MK} for n, _, _ in SETUPS}
md_table(["setup (median of 3 seeds)"] + [label for _, label, _ in MK],
         [[n] + [fmt.format(mg[n][k]) for k, _, fmt in MK] for n, _, _ in SETUPS])
rr, rrm = mg["round_robin"], mg["round_robin + migration"]
lr, lrm = mg["least_requests"], mg["least_requests + migration"]
assert rrm["moves"] > 0 and rrm["ttft_p99"] < rr["ttft_p99"] / 2 and lrm["ttft_p99"] < lr["ttft_p99"] / 2
assert rrm["e2e_p99"] < rr["e2e_p99"] and lrm["e2e_p99"] < lr["e2e_p99"]
assert rrm["ttft_p50"] > rr["ttft_p50"] and lrm["ttft_p50"] > lr["ttft_p50"]
assert rrm["num_preemptions"] >= rr["num_preemptions"]

# %% [markdown]
# 迁移治的是尾巴：对轮询，TTFT p99 从 {{rr["ttft_p99"]:.1f}} s 降到 {{rrm["ttft_p99"]:.1f}} s，E2E p99 从 {{rr["e2e_p99"]:.1f}} s
# 降到 {{rrm["e2e_p99"]:.1f}} s；最少请求也一样（TTFT p99 {{lr["ttft_p99"]:.1f}} → {{lrm["ttft_p99"]:.1f}} s）。这几个副本里，长请求占满了 KV 的副本
# 让新请求排长队，迁移把它的长请求搬走，队就散了。代价也看得见：中位数下 {{rrm["moves"]:.0f}} 次迁移、搬了 {{rrm["moved_gb"]:.1f}} GB 的 KV；
# TTFT 的中位数反而从 {{rr["ttft_p50"]:.2f}} s 升到 {{rrm["ttft_p50"]:.2f}} s（搬过去的请求占了目标副本的块，之后被派到那里的新请求要等），
# 稳态窗口里的抢占也没有减少（{{rr["num_preemptions"]:.0f}} 次与 {{rrm["num_preemptions"]:.0f}} 次）。
# 迁移是把负载从“最忙”挪到“最闲”，它不凭空增加容量。这里只有 4 个副本、KV 又故意很紧，论文的收益出现在更大的集群与它自己的调度策略上，
# 数字不能直接比较。
#
# ## 26.6 真的多副本：两个服务进程和一个 HTTP 路由器
#
# 模拟器里每个副本是一台独立的机器。现在在本机上真的起三个进程：两个 tiny 模型的 `python -m minibatch serve`（每个一个线程），
# 一个 `python -m minibatch router --policy least_requests`（它每 0.2 s 轮询两个上游的 `/health` 与 `/metrics`）。三个进程同时启动，
# 等路由器报告两个上游都健康；然后用 `minibatch.bench.run_benchmark`（`vllm bench serve` 的 Python 接口）经路由器发 24 个请求
# （8 req/s，输入 32、输出 16 个 Token），读路由器与两个上游的 `/metrics`，再用 4 个贪心请求对照单个引擎的输出。
# **必须说清楚**：这台机器只有 2 个共享的 CPU 核，两个副本在抢同一份 CPU，真实运行展示的是**机制**（路由、指标、进程管理），
# 不是加速；副本是独立机器时的效果要看前面的模拟。`finally` 保证无论成败都关掉三个进程。

# %% tags=["nbval-ignore-output"]
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_values(url: str, name: str) -> dict:
    """Samples of ``name`` on a /metrics page, keyed by their labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


GREEDY_PROMPTS = ["Once upon a time", "The little cat", "Tom found a box", "小明和他的狗"]
env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
ports = [free_port() for _ in range(3)]
upstreams = [f"http://127.0.0.1:{p}" for p in ports[:2]]
router_url = f"http://127.0.0.1:{ports[2]}"
cmds = [[sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(p),
         "--max-num-seqs", "8", "--uvicorn-log-level", "warning"] for p in ports[:2]]
cmds.append([sys.executable, "-m", "minibatch", "router", "--upstream", *upstreams, "--policy", "least_requests",
             "--host", "127.0.0.1", "--port", str(ports[2]), "--poll-interval", "0.2", "--uvicorn-log-level", "warning"])
logs = [tempfile.TemporaryFile() for _ in cmds]
procs = []
t_start = time.perf_counter()
try:
    procs = [subprocess.Popen(c, stdout=log, stderr=log, env=env, start_new_session=True) for c, log in zip(cmds, logs)]
    deadline = time.monotonic() + 180
    while True:                                   # until the router reports both upstreams healthy
        assert all(p.poll() is None for p in procs), "a process exited during start-up"
        assert time.monotonic() < deadline, "not healthy after 180 s"
        try:
            health = httpx.get(f"{router_url}/health", timeout=1).json()
            if all(u["healthy"] for u in health["upstreams"]):
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    t_ready = time.perf_counter() - t_start
    bench = run_benchmark(base_url=router_url, num_prompts=24, request_rate=8.0, random_input_len=32,
                          random_output_len=16, seed=0, percentiles=(50, 99))
    routed = {u: metric_values(router_url, "minibatch_router_requests_routed_total").get((("upstream", u),), 0.0)
              for u in upstreams}
    served = {u: sum(v for k, v in metric_values(u, "vllm:request_success_total").items()
                     if ("finished_reason", "length") in k) for u in upstreams}
    greedy = [httpx.post(f"{router_url}/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0,
                               "return_token_ids": True}).json()["choices"][0] for p in GREEDY_PROMPTS]
    routed_after = {u: metric_values(router_url, "minibatch_router_requests_routed_total").get((("upstream", u),), 0.0)
                    for u in upstreams}
except Exception:
    for log in logs:
        log.seek(0)
        print(log.read().decode(errors="replace")[-1500:])
    raise
finally:
    for p in procs:                               # SIGTERM each process group, then SIGKILL what is left
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    for log in logs:
        log.close()
exit_codes = [p.returncode for p in procs]
print(f"ready after {t_ready:.1f} s; bench: {bench['completed']} completed, {bench['failed']} failed, "
      f"TTFT p50 {bench['median_ttft_ms']:.0f} ms, {bench['output_throughput']:.0f} tok/s")
print("router routed:", {u[-5:]: int(v) for u, v in routed.items()}, "| upstreams served:",
      {u[-5:]: int(v) for u, v in served.items()}, "| processes stopped, exit codes:", exit_codes)

# %% [markdown]
# 上面一格的时间是本机的墙钟时间，每次运行都不同（`nbval-ignore-output`），但下面这些事每次都必须成立：24 个请求全部完成，
# 路由器记下的分配（`minibatch_router_requests_routed_total`，按上游）与两个上游各自完成的请求数（`vllm:request_success_total`）一致，
# 两个上游都分到了请求；经路由器的贪心输出与进程内的单个引擎（`LLM("tiny")`，同样一个线程）逐 Token 相同；三个进程都已退出。

# %%
torch.set_num_threads(1)
reference = LLM("tiny").generate(GREEDY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
same_tokens = [c["token_ids"] == r.outputs[0].token_ids for c, r in zip(greedy, reference)]
greedy_routed = {u: routed_after[u] - routed[u] for u in upstreams}
print("bench requests completed:", bench["completed"], "| routed == served per upstream:",
      all(routed[u] == served[u] for u in upstreams), "| both upstreams used:", min(routed.values()) > 0)
print("greedy outputs through the router equal one engine's:", same_tokens, "| greedy requests per upstream:",
      sorted(int(v) for v in greedy_routed.values()))
print("all processes exited:", all(p.poll() is not None for p in procs))
assert bench["completed"] == 24 and bench["failed"] == 0
assert sum(routed.values()) == 24 and all(routed[u] == served[u] for u in upstreams) and min(routed.values()) > 0
assert all(same_tokens) and sum(greedy_routed.values()) == len(GREEDY_PROMPTS)
assert all(p.poll() is not None for p in procs)

# %% [markdown]
# 同样的事用命令行做只要两行：`python -m minibatch serve --replicas 2 --router-policy least_requests --port 8000`
# 会自己起两个引擎进程和一个路由器，退出时按顺序关掉它们（`minibatch/serving/replicas.py`：子进程各在自己的进程组里，
# 父进程被杀时靠 `prctl(PR_SET_PDEATHSIG)` 让子进程也退出）；`python -m minibatch bench serve --base-url http://127.0.0.1:8000 ...`
# 压测它。路由器对失败的上游会换一个重试，对中途断掉的贪心流会在另一个上游上接着生成同样的 Token（`router.py` 的模块说明）。
#
# ## 26.7 动手：路由器与到达率
#
# 选一个路由器和到达率（26.2–26.3 节的负载，种子 1），看每个副本上未完成的请求数随时间怎样变化，以及 TTFT：

# %% tags=["nbval-ignore-output"]
def explore(router="least_kv", rate=18.0):
    key = (router, rate, 1)
    if key not in runs:
        res = cluster.run(workload(rate, 1), replicas=REPLICAS, router=router, **SIM)
        runs[key] = (res, res.summary(slo=SLO, trim=0.2))
    res, s = runs[key]
    _fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 2.8))
    for i, rep in enumerate(res.replicas):
        a1.plot([st.start_time for st in rep.steps], [st.num_running + st.num_waiting for st in rep.steps], lw=0.8,
                label=f"replica {i}")
    a1.set(xlabel="time (s)", ylabel="unfinished requests", title=f"{router}, {rate:g} req/s")
    a1.legend(fontsize=7)
    a2.plot([q.arrival_time for q in res.requests], [q.ttft for q in res.requests], ".", ms=3)
    a2.axhline(SLO["ttft"], color="k", ls=":", lw=1)
    a2.set(xlabel="arrival time (s)", ylabel="TTFT (s)", yscale="log", title="TTFT of each request")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    plt.show()
    print(f"attainment {s['slo_attainment']:.0%}, TTFT p50 {s['ttft_p50']:.2f} s, p99 {s['ttft_p99']:.2f} s; "
          f"routed {s['routed']}")


W.interact(explore, router=W.Dropdown(options=ROUTERS, value="least_kv"),
           rate=W.FloatSlider(value=18.0, min=6.0, max=36.0, step=6.0, continuous_update=False, description="req/s"));

# %% [markdown]
# ## 小结
#
# - 路由器只看得见副本对外报告的负载与自己的记录（`ReplicaView`），而且总是滞后的；一条规则是一个 `choose` 方法，
#   同一批类在模拟的集群、HTTP 路由器与 Ray 上共用。
# - 轮询让每个副本的到达变得平稳，已经远好于随机；看负载的规则还能纠正长短不一的请求，按累计 Token 均衡的 `prefix_aware` 容量最高。
#   只看一个滞后指标、再取最小的规则会产生羊群效应，本章里 `least_kv` 反而最差。只换路由规则，同样的卡在同一 SLO 下，
#   最好的路由器能接的流量是最差的 {{max(cap.values()) / min(cap.values()):.2g}} 倍。
# - 共享前缀的负载上，缓存感知路由（SGLang 的规则、按租户粘滞）把命中率与 TTFT 大幅改善；它必须与负载均衡折中（SGLang 的失衡阈值、
#   Dynamo 的加权代价、llm-d 的打分相加）。
# - Llumnix 式迁移在请求开始之后再纠正分配：它大幅压低了 TTFT 的尾巴（E2E 的尾巴也有所下降），代价是搬 KV、目标副本上的 KV 更紧、中位 TTFT 上升。
# - 真实的多进程运行说明机制（路由、指标、重试、进程管理）与贪心输出不变；在 2 个共享的 CPU 核上它不会变快。
#
# 实验 **L10**（多副本路由器，见课程地图）请你自己写一个路由器。下一章（第 27 章）把预填充与解码放到不同的副本上。
#
# ## 练习
#
# 1. **滞后的代价。** 给 `least_kv` 加一个“刚发过去的请求也算”的修正：写一个路由器，用 `v.kv_blocks_used + v.active_blocks`
#    之类的量代替 `kv_usage`（`@routers.register` 注册，见 `minibatch/cluster/__init__.py` 的例子），在 26.2 节的负载上与 `least_kv` 比较。
# 2. **二选一。** 把副本数从 4 改成 16（到达率按比例放大），`random`、`power_of_two` 与 `least_requests` 的 TTFT p99 怎样变？与 26.1 节的
#    $\log n/\log\log n$ 对 $\log\log n$ 的结论对照。
# 3. **KV 感知的权重。** 用 `router_kwargs={"kv_overlap_score_weight": 4.0}` 重跑 26.4 节的 `kv_aware`，命中率与 TTFT 怎样变？再试 0。
# 4. **失衡阈值。** SGLang 的 Rust 默认（`CacheAwareConfig::default()`）是 `cache_threshold=0.5, balance_abs_threshold=32,
#    balance_rel_threshold=1.1`，与启动器的默认不同。用 `router_kwargs` 换成这一组，重跑 26.4 节，`prefix_aware` 的命中率与负载分布
#    （`summary()["routed"]`）怎样变？
# 5. **迁移的节奏。** 把 `Migration(interval_s=0.5)`、`Migration(imbalance=0.05)` 与 `Migration(link_gbps=10)` 分别用于 26.5 节，
#    迁移次数、搬运量与 TTFT 怎样变？
#
# <details><summary>提示与参考答案</summary>
#
# 1. `ReplicaView.active_blocks` 已经包含了路由过去、还没被接纳的请求的块（`Replica.admitted` 会把它们加上），用它（除以 `kv_blocks_total`）
#    代替 `kv_usage` 就不再滞后；羊群效应消失后，这条规则与 `least_requests` 接近。
# 2. 副本越多，随机分配最重的那个副本越重（$\log n/\log\log n$ 增长），`power_of_two` 与 `least_requests` 几乎不变。
#    构造负载时用 `workload(rate * 4, seed, n=800)` 保持每个副本的负载相同。
# 3. 权重越大，预填充块（缓存项）在代价里越重要，命中率上升、直到负载失衡开始伤害 TTFT；权重为 0 时它只看负载，命中率接近 `least_requests`。
# 4. 更小的失衡阈值让“先均衡”更常触发，命中率下降、负载更平均；`cache_threshold` 更高则匹配不够长的请求不再粘到原副本。
# 5. 决策间隔越长、迁移越少、纠正越慢；`imbalance` 越小，迁移越频繁，搬运量与目标副本上的等待都增加；链路越慢，第一段拷贝越久，
#    被搬的请求在源副本上多占一会儿块。
#
# </details>
#
# **本章引用**：Mitzenmacher, *The Power of Two Choices in Randomized Load Balancing*, IEEE TPDS 12(10), 2001；
# Mitzenmacher, *How Useful Is Old Information?*, IEEE TPDS 11(1), 2000；
# sglang-router 0.2.1（`src/policies/cache_aware.rs`、`round_robin.rs`、`random.rs`、`power_of_two.rs`，`py_src/sglang_router/router_args.py`）；
# ai-dynamo 0.5.0（`lib/llm/src/kv_router/scheduler.rs`，`dynamo/frontend/main.py`）；llm-d-inference-scheduler commit 057d2c7
# （`pkg/plugins/scorer/precise_prefix_cache.go`）与 llm-d 博客 *KV-Cache Wins You Can See*（2025-09-24）；
# Llumnix（Sun et al., *Llumnix: Dynamic Scheduling for Large Language Model Serving*, OSDI'24, arXiv:2406.03243；
# `AlibabaPAI/llumnix` commit 9529a78 的 `llumnix/load_computation.py`）。
