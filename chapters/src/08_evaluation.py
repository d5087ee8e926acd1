# %% [markdown]
# # 第 8 章 评估体系与压测方法论
#
# 前七章里我们一直在比较“更快”“更慢”“吞吐更高”。本章把这些词变成精确的定义和可复现的测量方法。
# 第 1 章 1.1 节把“能够设计评估体系”列为课程目标之一：建立以吞吐量（Tokens/s）、首 Token 延迟（TTFT）、
# 每 Token 延迟（TPOT）、SLO 达成率为核心的指标体系，并掌握压测方法论。一个推理服务的数字是否可信，
# 取决于三件事：**指标怎么定义**、**负载怎么施加**、**在哪一段时间里统计**。任何一处含糊，两份压测报告就无法比较。
#
# minibatch 的指标定义与 `vllm bench serve` 完全一致（minibatch 一侧是 `minibatch/results.py`、`minibatch/bench/client.py`；
# vLLM 一侧是 vLLM v0.10.2 的 `vllm/benchmarks/serve.py`），
# 所以本章学到的读数方法可以直接用在 vLLM、SGLang 等框架的压测报告上。
#
# ## 学习目标
#
# - 准确定义 TTFT、TPOT、ITL、E2E 延迟、吞吐量、Goodput 与 SLO 达成率，并能从一条请求的事件时间线手算它们；
# - 会计算百分位数（Percentile），理解为什么要看 p99 而不只看平均值；
# - 区分开环（Open-loop，按请求速率）与闭环（Closed-loop，按并发数）两种施压方式，理解预热（Warm-up）的必要性；
# - 理解协调遗漏（Coordinated Omission）：闭环客户端如何把排队延迟“藏”起来，以及如何纠正；
# - 用 `.venv/bin/python -m minibatch serve` 起一个真实的服务，用 `minibatch.bench.run_benchmark` 压测，画出延迟–吞吐曲线；
#   并用模拟器画出 Llama-2-7B 在 A100 上的同一条曲线，找到它的“拐点”。

# %%
import inspect
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import matplotlib.pyplot as plt
import numpy as np
from IPython import get_ipython
from IPython.display import display

import minibatch.results
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.bench import format_result, run_benchmark
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.viz import latency_throughput
from minibatch.workload import load_workload

SLO = {"ttft": 0.8, "tpot": 0.05}      # chapter 1's RAG case: TTFT < 800 ms, TPOT < 50 ms (seconds here)
print("SLO:", SLO)

# %% [markdown]
# ## 8.1 指标的定义
#
# 设一个请求在时刻 $a$ 到达（客户端发出），第 $i$ 个输出 Token 在时刻 $t_i$ 产生（$i = 1 \dots n$），在 $e$ 时刻结束：
#
# | 指标 | 定义 | 它回答的问题 |
# |---|---|---|
# | 首 Token 延迟（TTFT, Time To First Token） | $t_1 - a$ | 用户要等多久才看到第一个字（含排队与预填充 Prefill） |
# | 每输出 Token 延迟（TPOT, Time Per Output Token） | $\dfrac{t_n - t_1}{n - 1}$ | 首 Token 之后，平均每个 Token 多快（流式输出的“读速”） |
# | Token 间延迟（ITL, Inter-Token Latency） | 每一个间隔 $t_{i+1} - t_i$ | 输出是否卡顿：一次长停顿会被 TPOT 的平均抹平，却逃不过 ITL 的 p99 |
# | 端到端延迟（E2E Latency） | $e - a$ | 整个回答要多久 |
# | 输出吞吐（Output Throughput） | $\dfrac{\sum_r n_r}{T}$ | 每秒产生多少输出 Token；$T$ 为第一个请求到达到最后一个请求结束 |
# | Goodput | $\dfrac{\#\{r : r \text{ 满足全部 SLO}\}}{T}$ | 每秒有多少请求**既完成又达标** |
# | SLO 达成率（SLO Attainment） | $\dfrac{\#\{r : r \text{ 满足全部 SLO}\}}{\#\{r\}}$ | 多大比例的请求达标 |
#
# 注意 TPOT 不含第一个 Token（首 Token 的时间里有排队和预填充，性质完全不同），且是**每个请求一个值**；
# ITL 则是**每个间隔一个值**，一个请求贡献 $n-1$ 个。统计 TPOT 的 p99 与统计 ITL 的 p99 回答的是不同的问题。
# minibatch 的定义写在 `minibatch.results` 的模块文档里：

# %%
print(inspect.getdoc(minibatch.results)[:760])

# %% [markdown]
# ## 8.2 从一条请求的事件时间线手算
#
# 引擎对每个请求发出事件（Event）：`arrival`（到达）、`schedule`（第一次被调度）、`token`（每产生一个 Token）、
# `finish`（结束），以及 `preempt`、`abort` 等。用 `LLMEngine.subscribe` 订阅它们，就得到原始的事件日志。
# 下面用模拟器（Llama-2-7B，A100-80G，虚拟时钟，结果完全确定）跑一小段对话负载，记下全部事件：

# %%
N_SMALL, RATE_SMALL, MAX_LEN, PICK = 40, 4.0, 4096, 10      # requests, req/s, max_model_len; the request we follow
events = []
engine = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g"), clock="virtual")
engine.subscribe(lambda event, t, req, info: events.append((t, event, req.request_id, info)))
small = load_workload("chat", n=N_SMALL, rate=RATE_SMALL, max_len=MAX_LEN)
res = run(small, engine=engine)
print(f"{len(events)} events; kinds: {sorted({e[1] for e in events})}")

# %% [markdown]
# 这是 {{N_SMALL}} 个对话请求，以 {{RATE_SMALL:g}} req/s 到达。挑出其中一个请求（第 {{PICK}} 个），看它的事件：

# %% tags=["nbval-check-output"]
rid = res.requests[PICK].request_id
mine = [e for e in events if e[2] == rid]
for t, ev, _, info in mine[:5] + [("...", "", "", {})] + mine[-2:]:
    print(f"{t if isinstance(t, str) else f'{t:9.4f}'}  {ev:<12} {({k: v for k, v in info.items() if k != 'token'} or '')}")

# %% [markdown]
# 从这条时间线手算各个指标，再与库的 `RequestRecord` 属性对账：

# %% tags=["nbval-check-output"]
arrival = next(t for t, ev, _, _ in mine if ev == "arrival")
scheduled = next(t for t, ev, _, _ in mine if ev == "schedule")
tokens = [t for t, ev, _, _ in mine if ev == "token"]
finish = next(t for t, ev, _, _ in mine if ev == "finish")
n = len(tokens)
by_hand = {"ttft": tokens[0] - arrival, "tpot": (tokens[-1] - tokens[0]) / (n - 1),
           "e2e": finish - arrival, "queue_delay": scheduled - arrival}
itl = np.diff(tokens)
rec = next(r for r in res.requests if r.request_id == rid)
for k, v in by_hand.items():
    print(f"{k:<12} by hand {v * 1e3:9.2f} ms   library {getattr(rec, k) * 1e3:9.2f} ms")
print(f"ITL: {n - 1} gaps, mean {itl.mean() * 1e3:.2f} ms (= TPOT), max {itl.max() * 1e3:.2f} ms; "
      f"library ITL equal: {np.allclose(itl, rec.itl)}")

# %% [markdown]
# ITL 的均值恰好等于 TPOT（相邻间隔之和就是 $t_n - t_1$），但 ITL 的最大值可能远大于均值：
# 这个请求解码期间，每当有新请求的预填充挤进同一个 step，那一步就变长（第 11 章的分块预填充 Chunked Prefill 就是为了控制它）。
# 实验 **L01** 会让你从一份事件日志出发，完整实现这些指标和 Goodput，并与 `minibatch.results` 逐项对账。
#
# ## 8.3 百分位数：为什么看 p99
#
# 把 $N$ 个值排序为 $x_{(0)} \le \dots \le x_{(N-1)}$，第 $p$ 百分位数按线性插值（NumPy 与 vLLM 的默认做法）取
#
# $$
# r = \frac{p}{100}(N-1), \qquad P_p = x_{(\lfloor r \rfloor)} + (r - \lfloor r \rfloor)\,\bigl(x_{(\lfloor r \rfloor + 1)} - x_{(\lfloor r \rfloor)}\bigr).
# $$
#
# 延迟分布通常右偏（长尾）：大多数请求很快，少数请求因为排队、被抢占或遇到长预填充而慢得多。平均值会被长尾拉高、
# 又会掩盖长尾有多长；p50 描述“典型”用户，p99 描述“最倒霉的 1%”。面向用户的 SLO 几乎总是写成百分位数。

# %% tags=["nbval-check-output"]
def percentile(values, p):
    x = np.sort(np.asarray(values, dtype=float))
    r = p / 100 * (len(x) - 1)
    lo = int(np.floor(r))
    hi = min(lo + 1, len(x) - 1)
    return x[lo] + (r - lo) * (x[hi] - x[lo])


summary = res.summary(slo=SLO)
ttfts = [r.ttft for r in res.requests if r.completed]
for p in (50, 90, 99):
    print(f"TTFT p{p}: by hand {percentile(ttfts, p) * 1e3:8.2f} ms   library {summary[f'ttft_p{p}'] * 1e3:8.2f} ms")
print(f"TTFT mean {summary['ttft_mean'] * 1e3:.2f} ms; max {max(ttfts) * 1e3:.2f} ms")

# %% [markdown]
# ## 8.4 吞吐量、Goodput 与 SLO 达成率
#
# 吞吐量只数 Token，不问每个请求是否满意；Goodput（DistServe, OSDI'24 提出用它衡量服务质量）只数**达标**的请求。
# 一个系统可以靠把批塞满换来很高的吞吐，同时让大多数请求超出 TTFT 的 SLO——这时它的 Goodput 很低。
# 用第 1 章 RAG 案例的 SLO（TTFT < {{SLO['ttft'] * 1e3:.0f}} ms 且 TPOT < {{SLO['tpot'] * 1e3:.0f}} ms）手算一遍：

# %% tags=["nbval-check-output"]
done = [r for r in res.requests if r.completed]
T = max(r.finish_time for r in done) - min(r.arrival_time for r in res.requests)
good = [r for r in done if r.ttft <= SLO["ttft"] and (r.tpot is None or r.tpot <= SLO["tpot"])]
print(f"duration T = {T:.2f} s; output throughput by hand {sum(r.output_len for r in done) / T:.1f} tok/s, "
      f"library {summary['throughput_tok_s']:.1f}")
print(f"goodput by hand {len(good) / T:.3f} req/s, library {summary['goodput']:.3f}; "
      f"SLO attainment by hand {len(good) / len(res.requests):.1%}, library {summary['slo_attainment']:.1%}")

# %% [markdown]
# ## 8.5 怎么施加负载：开环、闭环与预热
#
# **开环（Open-loop）**：请求按预定的时间表到达，与服务端是否忙完无关，例如速率为 $\lambda$ 的泊松过程
# （`vllm bench serve --request-rate`）。它模拟的是大量彼此独立的用户——真实线上流量就是这样：
# 服务变慢了，用户并不会因此少来。
#
# **闭环（Closed-loop）**：固定 $C$ 个“虚拟用户”（并发数），每个用户发出请求、等回答完成、再发下一个
# （`vllm bench serve --max-concurrency`）。服务端越慢，请求发得越少，系统永远不会过载。
# 它适合回答“$C$ 个并发时延迟是多少”，却**不能**回答“每秒来 $\lambda$ 个请求时延迟是多少”。
#
# **预热（Warm-up）**：刚启动的服务要付一次性的代价——加载内核、分配内存池、编译 CUDA Graph、填充缓存；
# 压测开始时系统是空的，排队还没有形成。所以正式统计前要先发一批预热请求，或丢弃开头一段时间的数据。
# 8.7 节会在真实服务上看到第一个请求明显更慢。
#
# ### 协调遗漏（Coordinated Omission）
#
# 设想一个闭环压测工具按计划每 $1/\lambda$ 秒发一个请求，但某个连接上一个请求还没回来，它就只能等。
# 等待期间本该发出的请求被**推迟**了，工具却从“实际发出”的那一刻开始计时——用户本该经历的排队时间，
# 在测量中凭空消失了。这个现象由 Gil Tene 命名为协调遗漏：压测工具与被测系统“协调”一致地漏掉了最慢的那段时间。
# 纠正方法（wrk2 等工具的做法）是从**计划发送时间**开始计时。
#
# 下面在模拟器里做这个实验：一组虚拟用户按一个总速率的计划轮流发请求，这个速率高于 Llama-2-7B 在 A100 上
# 处理该负载的能力（见 8.6 节）。客户端循环直接驱动 `LLMEngine`（它只是一个负载发生器，调度仍由引擎完成）：

# %%
def closed_loop(wl, users, rate, **engine_kw):
    """A closed-loop client on the simulator: request k is planned for k / rate and belongs to user k % users,
    which sends it only after its previous request finished. Returns planned, sent, first-token, finish times."""
    eng = LLMEngine(EngineConfig.from_kwargs(executor="sim", **engine_kw), clock="virtual")
    specs = list(wl)
    planned = np.arange(len(specs)) / rate
    sent = np.full(len(specs), np.nan)
    ready = {u: planned[u] for u in range(min(users, len(specs)))}    # user -> when its next request may go
    nxt = {u: u for u in ready}                                       # user -> index of its next request
    in_flight = {}                                                    # user -> request index
    while ready or in_flight:
        for u in [u for u, t in ready.items() if t <= eng.clock.now() + 1e-12]:
            k = nxt[u]
            sent[k] = ready.pop(u)
            params = SamplingParams(temperature=0.0, max_tokens=specs[k].max_tokens, ignore_eos=True)
            eng.add_request([0] * specs[k].prompt_len, params, request_id=str(k), arrival_time=sent[k])
            in_flight[u] = k
        if not eng.has_unfinished_requests():
            eng.clock.advance_to(min(ready.values()))
            continue
        eng.step()
        for u, k in list(in_flight.items()):
            req = eng.requests[str(k)]
            if req.is_finished:
                del in_flight[u]
                if k + users < len(specs):
                    nxt[u] = k + users
                    ready[u] = max(planned[k + users], req.finish_time)
    reqs = [eng.requests[str(k)] for k in range(len(specs))]
    return planned, sent, np.array([r.first_token_time for r in reqs]), np.array([r.finish_time for r in reqs])

# %%
CO_RATE, USERS, N_CO = 8.0, 64, 300

# %% [markdown]
# {{USERS}} 个虚拟用户按总速率 {{CO_RATE:g}} req/s 的计划轮流发 {{N_CO}} 个请求；同一负载再以开环方式回放一次作对照：

# %%
co_wl = load_workload("chat", n=N_CO, rate=CO_RATE, max_len=MAX_LEN)
planned, sent, first, finish = closed_loop(co_wl, USERS, CO_RATE, model="llama-2-7b", hardware="a100-80g")
open_res = run(co_wl, executor="sim", model="llama-2-7b", hardware="a100-80g")
open_ttft = np.array([r.ttft for r in open_res.requests])

# %% tags=["nbval-check-output"]
naive, corrected = first - sent, first - planned
closed_x = len(sent) / (finish.max() - sent.min())
open_x = open_res.summary()["request_throughput"]
print(f"planned {CO_RATE:g} req/s; completed: closed loop ({USERS} users) {closed_x:.2f} req/s, open loop {open_x:.2f} req/s")
for name, v in [("closed loop, timed from actual send", naive), ("closed loop, timed from planned send", corrected),
                (f"open loop at {CO_RATE:g} req/s", open_ttft)]:
    print(f"{name:<38} TTFT p50 {np.percentile(v, 50):6.2f} s   p99 {np.percentile(v, 99):6.2f} s")

# %%
fig, ax = plt.subplots(figsize=(8, 3.4))
ax.plot(planned, corrected, ".", ms=4, color="C3", label="closed loop, from planned send (corrected)")
ax.plot(planned, naive, ".", ms=4, color="C0", label="closed loop, from actual send (what the client reports)")
ax.plot([r.arrival_time for r in open_res.requests], open_ttft, "-", lw=1, color="0.4", alpha=0.7,
        label=f"open loop at {CO_RATE:g} req/s")
ax.axhline(SLO["ttft"], color="r", ls=":", lw=1, label="TTFT SLO")
ax.set_xlabel("planned send time (s)")
ax.set_ylabel("TTFT (s)")
ax.set_title(f"Coordinated omission: llama-2-7b on A100-80G, {USERS} users, {CO_RATE:g} req/s planned", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# %% tags=["check"]
assert np.percentile(naive, 99) < SLO["ttft"], "the prose says the closed-loop p99 looks within the SLO"
assert corrected.max() > 10 * SLO["ttft"] and np.percentile(open_ttft, 99) > SLO["ttft"]
assert closed_x < open_x, "the prose says the closed loop completes fewer requests"

# %% [markdown]
# 蓝点是闭环工具报告的 TTFT：p99 只有 {{np.percentile(naive, 99):.2f}} s，低于 {{SLO['ttft']:g}} s 的 SLO，看起来服务完全达标。
# 红点从计划发送时刻算起，整体随时间上升，最高到 {{corrected.max():.0f}} s——请求其实在客户端里排起了越来越长的队，
# 只是这段时间没被计入。开环压测（灰线）没有这个盲区，TTFT 的 p99 为 {{np.percentile(open_ttft, 99):.1f}} s。
# 校正后的闭环结果甚至比开环更差：{{USERS}} 个并发的上限本身限制了服务端的批大小，闭环只完成了 {{closed_x:.2f}} req/s，
# 开环则是 {{open_x:.2f}} req/s。由 Little 定律（第 3 章），闭环吞吐 $X = C / \bar{E}$（$C$ 为并发数，
# $\bar{E}$ 为平均端到端延迟）：压测工具自己成了瓶颈。

# %% [markdown]
# 所以：**容量规划和 SLO 验证要用开环负载**；闭环负载只用来回答“给定并发数下”的问题，而且报告里必须写明并发数。
#
# `minibatch bench serve` 与 `vllm bench serve` 一样（vLLM v0.10.2 `vllm/benchmarks/serve.py`：`limited_request_func`
# 先取得并发信号量，再调用请求函数，请求函数在发出请求时才开始计时），在同时给出 `--request-rate` 和 `--max-concurrency` 时，
# 请求先按计划时间排队、再等并发信号量，TTFT 从**拿到信号量、真正发出**时开始计时（见下面 `send_request` 的开头），
# 因此同样会“藏起”客户端里的等待——读这类报告时要留意。

# %%
src = inspect.getsource(minibatch.bench.send_request).splitlines()
print("\n".join(line for line in src if "st = time.perf_counter()" in line or "out.ttft = now - st" in line))

# %% [markdown]
# ## 8.6 延迟–吞吐曲线（模拟器）
#
# 压测的标准做法是扫一组开环请求速率，每个速率跑一次，把**达到的吞吐**和**延迟百分位**画成一条曲线。
# 低负载时延迟几乎不随速率变化；接近容量时排队出现，延迟急剧上升（第 3 章的“曲棍球棒”），吞吐却不再增加。
# 下面是 Llama-2-7B 在一张 A100-80G 上、`chat` 负载的曲线：

# %%
RATES = [1, 2, 3, 4, 5, 6, 7, 8, 10]
N_SWEEP, TRIM, TARGET = 300, 0.2, 0.9     # requests per rate; share trimmed at each end; capacity's attainment

# %% [markdown]
# 表格按**稳态**统计：每个速率 {{N_SWEEP}} 个请求，去掉到达时间跨度最前与最后 {{TRIM:.0%}} 里到达的请求
# （预热：批与队列还在变满；收尾：到达已停止），吞吐只数这段时间窗里完成的请求与产出的 Token
# （`RunResult.summary(trim={{TRIM}})`）。模拟器完全确定，表格每次相同：

# %%
sim_runs = {r: run(load_workload("chat", n=N_SWEEP, rate=r, max_len=MAX_LEN), executor="sim", model="llama-2-7b",
                   hardware="a100-80g") for r in RATES}

# %% tags=["nbval-check-output"]
print(f"{'rate':>5} {'out tok/s':>10} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
      f"{'goodput':>8} {'SLO met':>8}")
sims = {}
for rate, r in sim_runs.items():
    s = sims[rate] = r.summary(slo=SLO, trim=TRIM)
    print(f"{rate:>5} {s['throughput_tok_s']:>10.0f} {s['request_throughput']:>6.2f} {s['ttft_p50'] * 1e3:>7.0f}ms "
          f"{s['ttft_p99'] * 1e3:>7.0f}ms {s['tpot_p50'] * 1e3:>7.1f}ms {s['tpot_p99'] * 1e3:>7.1f}ms "
          f"{s['goodput']:>8.2f} {s['slo_attainment']:>8.1%}")

# %%
fig = latency_throughput({"llama-2-7b @ a100-80g (sim)": sim_runs}, metrics=("ttft", "tpot"), stat="p99", slo=SLO,
                         figsize=(10, 3.4))
display(fig)

# %%
cap = capacity({r: sims[r]["slo_attainment"] for r in RATES}, target=TARGET)
beyond = RATES[RATES.index(cap) + 1]
check = {r: run(load_workload("chat", n=N_SWEEP, rate=r, max_len=MAX_LEN, seed=1), executor="sim", model="llama-2-7b",
                hardware="a100-80g").summary(slo=SLO, trim=TRIM)["slo_attainment"] for r in (cap, beyond)}
best = max(RATES, key=lambda r: sims[r]["goodput"])
peak = max(RATES, key=lambda r: sims[r]["throughput_tok_s"])
print(f"capacity at >= {TARGET:.0%} attainment: {cap} req/s; a second seed: {cap} req/s -> {check[cap]:.0%}, "
      f"{beyond} req/s -> {check[beyond]:.0%}")

# %% tags=["check"]
assert check[cap] >= TARGET > sims[beyond]["slo_attainment"], "the prose says the capacity holds on a second seed"
assert peak >= best and sims[peak]["slo_attainment"] < sims[best]["slo_attainment"]

# %% [markdown]
# 按“SLO 达成率 ≥ {{TARGET:.0%}} 的最高到达率”（DistServe 的服务容量）算，这套配置的容量是 **{{cap}} req/s**（换一个随机种子复核，
# 仍是 {{check[cap]:.0%}}；再高一档到 {{beyond}} req/s 就只有 {{sims[beyond]['slo_attainment']:.0%}}）。Goodput 在
# {{best}} req/s 处最高（{{sims[best]['goodput']:.2f}} req/s，SLO 达成率 {{sims[best]['slo_attainment']:.0%}}）；而输出吞吐在
# {{peak}} req/s 处才到顶（{{sims[peak]['throughput_tok_s']:.0f}} tok/s），那时只有 {{sims[peak]['slo_attainment']:.0%}} 的请求达标。
# **只看吞吐会把系统推过拐点**：再加压，吞吐不再增长，延迟和不达标的请求却不断增加。负载超过容量后，TTFT 的 p99 主要由排队
# 决定，会随压测时长（请求数）继续变大——过载时报告的延迟数字本身没有意义，有意义的是“在哪个速率之前还达标”。

# %% [markdown]
# 调一调 SLO，看 Goodput 曲线怎么变（SLO 越严，Goodput 的峰值越早出现、越低）：

# %% tags=["nbval-ignore-output"]
import ipywidgets as widgets


def goodput_curve(ttft_ms=round(SLO["ttft"] * 1e3), tpot_ms=round(SLO["tpot"] * 1e3)):
    slo = {"ttft": ttft_ms / 1e3, "tpot": tpot_ms / 1e3}
    g = [sim_runs[r].summary(slo=slo)["goodput"] for r in RATES]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(RATES, [sims[r]["request_throughput"] for r in RATES], "o--", color="0.5", label="request throughput")
    ax.plot(RATES, g, "o-", color="C2", label=f"goodput (TTFT<{ttft_ms} ms, TPOT<{tpot_ms} ms)")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    plt.show()


widgets.interact(goodput_curve, ttft_ms=widgets.IntSlider(value=round(SLO["ttft"] * 1e3), min=100, max=5000, step=100),
                 tpot_ms=widgets.IntSlider(value=round(SLO["tpot"] * 1e3), min=10, max=200, step=5));

# %% [markdown]
# ## 8.7 真实服务与压测客户端
#
# 现在把同样的方法用到一个真正的 HTTP 服务上。`.venv/bin/python -m minibatch serve` 启动一个 OpenAI 兼容的服务
# （`/v1/completions`、`/v1/chat/completions`，SSE 流式输出），`minibatch.bench.run_benchmark` 是
# `.venv/bin/python -m minibatch bench serve` 的 Python 接口，参数与 `vllm bench serve` 同名：`request_rate`（开环速率，
# `inf` 表示全部同时发出）、`burstiness`（Gamma 到达的形状参数，1 为泊松）、`max_concurrency`（闭环并发上限）、
# `goodput`（SLO：命令行与 `vllm bench serve` 一样写毫秒，`--goodput ttft:500 tpot:50`；Python 里写秒，`{"ttft": 0.5, "tpot": 0.05}`，换算只在 `minibatch.results.parse_goodput` 一处）。客户端从流式响应的每个数据块（Chunk）测时间：TTFT 是第一个 Token 块到达的时刻，
# ITL 是相邻块的间隔。先准备两个小工具和压测的设置：

# %% tags=["nbval-ignore-output"]
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


SERVE_SEQS = 4                           # the server's --max-num-seqs
N_WARM, N_PER_RATE, N_CLOSED, CONCURRENCY = 4, 16, 12, 2
REAL_RATES = [4.0, 16.0, float("inf")]   # inf: all requests at once (the peak)
BENCH = dict(random_input_len=64, random_output_len=16, seed=0, percentiles=(50, 90, 99),
             goodput={"ttft": 0.5, "tpot": 0.05})

# %% [markdown]
# 下面的单元格：在本机找一个空闲端口，以子进程启动 tiny 模型的服务（只监听 127.0.0.1），等 `/health` 就绪；
# 先一个接一个地发 {{N_WARM}} 个预热请求；再以 {{len(REAL_RATES)}} 个开环速率（{{'、'.join(f'{r:g}' for r in REAL_RATES[:-1])}} req/s
# 和全部同时发出）各发 {{N_PER_RATE}} 个请求（输入 {{BENCH['random_input_len']}}、输出 {{BENCH['random_output_len']}} 个 Token）；
# 最后做一次闭环（`max_concurrency={{CONCURRENCY}}`，{{N_CLOSED}} 个请求同时“计划”发出）；
# 无论成功与否，`finally` 都会关闭服务。这里的数字是真实的墙钟时间，取决于机器当时的负载，每次运行都不同；
# 服务用 `--max-num-seqs {{SERVE_SEQS}}` 启动，让 tiny 模型在这台 CPU 上的客户端发得出的速率下就达到饱和，好看清曲线的拐点；
# 在一台繁忙的共享机器上，低速率时的延迟甚至可能比中等速率还高（空闲的服务线程被唤醒要排队等 CPU），
# 这正说明压测要在安静、固定的环境里做，并且每个点要多跑几次。

# %% tags=["nbval-ignore-output"]
port = free_port()
base = f"http://127.0.0.1:{port}"
log = tempfile.TemporaryFile()
server = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--host", "127.0.0.1",
                           "--port", str(port), "--max-num-seqs", str(SERVE_SEQS), "--uvicorn-log-level", "warning"],
                          stdout=log, stderr=log)
BENCH["base_url"] = base
try:
    print(f"server healthy after {wait_healthy(base, server):.1f} s on port {port}")
    warm = run_benchmark(num_prompts=N_WARM, request_rate=float("inf"), max_concurrency=1, **BENCH)
    real = {rate: run_benchmark(num_prompts=N_PER_RATE, request_rate=rate, **BENCH) for rate in REAL_RATES}
    closed = run_benchmark(num_prompts=N_CLOSED, request_rate=float("inf"), max_concurrency=CONCURRENCY, **BENCH)
except Exception:
    log.seek(0)
    print(log.read().decode(errors="replace")[-2000:])
    raise
finally:
    server.terminate()
    server.wait(timeout=60)
    log.close()
print("warm-up TTFTs (ms):", [round(t * 1e3) for t in warm["ttfts"]])

# %% [markdown]
# 预热请求是一个接一个发的（`max_concurrency=1`）。在 GPU 服务上，头几个请求往往明显更慢：CUDA Graph 捕获、
# Triton 内核编译、显存池分配、分词器缓存都发生在第一次用到的时候；tiny 模型在 CPU 上的这类开销很小，
# 在繁忙的机器上可能被噪声淹没，所以上面打印的几个预热 TTFT 未必单调。无论如何，正式的测量都放在预热之后。下面是“全部同时发出”（`request_rate=inf`）那一次的完整结果表，格式与 `vllm bench serve` 的输出一致：

# %% tags=["nbval-ignore-output"]
print(format_result(real[REAL_RATES[-1]]))

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
xs = [real[r]["output_throughput"] for r in REAL_RATES]
for ax, key, title in [(axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")]:
    for stat, style in [("median", "o-"), ("p99", "s--")]:
        ax.plot(xs, [real[r][f"{stat}_{key}_ms"] for r in REAL_RATES], style, label=stat)
    for r, x in zip(REAL_RATES, xs):
        ax.annotate(f"{r:g} req/s" if r != float("inf") else "all at once", (x, real[r][f"median_{key}_ms"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("output throughput (tok/s, measured)")
    ax.set_ylabel(f"{title} (ms)")
    ax.set_title(f"tiny model on this CPU: {title} vs throughput", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# 最后看闭环那一次：{{N_CLOSED}} 个请求在 0 时刻“计划”同时发出，但客户端最多只允许 {{CONCURRENCY}} 个在途。
# 客户端报告的 TTFT 从请求真正发出算起；把它加上请求在客户端里等待的时间（`start_times`，相对压测开始），
# 才是从计划时刻算起的 TTFT——与 8.5 节的协调遗漏是同一回事：

# %% tags=["nbval-ignore-output"]
reported = np.array(closed["ttfts"]) * 1e3
waited = np.array(closed["start_times"]) * 1e3
print(f"reported TTFT   p50 {np.median(reported):7.1f} ms  max {reported.max():7.1f} ms")
print(f"from plan (t=0) p50 {np.median(reported + waited):7.1f} ms  max {(reported + waited).max():7.1f} ms")

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX_USERS = [4, 4 * USERS]
gaps = np.diff(tokens)
worst = tokens[int(np.argmax(gaps))] + gaps.max() / 2                # the middle of the longest gap
worst_step = next(st for st in res.steps if st.start_time <= worst <= st.start_time + st.duration)
assert worst_step.num_prefill_tokens > 0, "hint 2 says a prefill shares the step of the longest gap"

# %% [markdown]
# 用命令行做同样的事，只需要两个终端（都在仓库根目录）：
#
# ```bash
# .venv/bin/python -m minibatch serve --model tiny --port 8000
# .venv/bin/python -m minibatch bench serve --base-url http://127.0.0.1:8000 --dataset random \
#     --random-input-len 64 --random-output-len 32 --num-prompts 200 --request-rate 20 \
#     --metric-percentiles 50,90,99 --goodput ttft:500 tpot:50 --plot bench.png
# ```
#
# `bench serve` 可以压测任何 OpenAI 兼容的服务（vLLM、SGLang、TGI……），后面的框架章节都会用它做同一负载下的对比。
#
# ## 本章小结
#
# - TTFT = 首 Token 时刻 − 到达时刻；TPOT = 首 Token 之后的平均间隔（每请求一个值）；ITL = 每个相邻间隔；
#   E2E = 结束 − 到达。吞吐数 Token，Goodput 数**达标**的请求，SLO 达成率是达标请求的比例。
# - 百分位数按线性插值计算；延迟分布右偏，SLO 应写成 p90/p99，而不是平均值。
# - 开环负载（请求速率）模拟独立到达的真实用户，是容量规划与 SLO 验证的正确工具；闭环负载（并发数）会随服务变慢而自动减压，
#   必须写明并发数，并警惕协调遗漏——从计划发送时刻计时才能看到真实的排队延迟。
# - 正式统计前要预热；过载时的延迟会随压测时长无限增长，报告“在什么负载下仍达标”比报告过载时的延迟更有意义。
# - 延迟–吞吐曲线与 Goodput 曲线一起看：Goodput 的峰值就是这套配置在该 SLO 下的实际服务能力。
#
# ## 练习
#
# 1. 完成实验 **L01**：从事件日志计算 TTFT、TPOT、ITL、百分位数与 Goodput，并与 `minibatch.results` 对账。
# 2. 在 8.2 中找出 ITL 最大的那个间隔，对照 `res.steps` 找到那一步：它里面有多少预填充 Token？
# 3. 把 8.5 的虚拟用户数改成 {{EX_USERS[0]}} 和 {{EX_USERS[1]}}，协调遗漏的程度如何变化？当用户数足够多时，闭环与开环的结果为什么会趋于一致？
# 4. 在 8.6 中把负载换成 `load_workload("code_bursty", ...)`（突发到达）并保持相同的平均速率，拐点提前还是推后？为什么？
# 5. 用 `.venv/bin/python -m minibatch bench serve` 的 `--burstiness 0.25` 压测真实服务，与泊松到达（`--burstiness 1`）
#    在相同速率下比较 TTFT 的 p99。
# 6. （思考）压测报告中只写了“并发 64 时吞吐 X tok/s、TTFT 200 ms”。你还需要知道哪些信息，才能判断这个服务能否承受每秒 20 个请求？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 按 L01 的任务顺序：先单请求的 TTFT/TPOT/ITL/E2E，再线性插值的百分位数，最后 Goodput 与达成率；每一步都可以用
#    `minibatch.results` 的同名量对账。
# 2. `np.argmax(np.diff(tokens))` 找到最大间隔，它的起止时刻落在某个 `StepRecord` 的 `start_time` 与
#    `start_time + duration` 之间；这次运行里那一步有 {{worst_step.num_prefill_tokens}} 个预填充 Token——一个新请求的预填充
#    挤进了这一步。
# 3. 用户少时，闭环把到达率压到远低于计划（校正后的 TTFT 巨大，报告的 TTFT 很小）；用户足够多时，每个用户都不再等上一个请求，
#    计划发送时刻几乎都能按时发出，闭环就退化成开环，两者趋于一致。
# 4. 突发到达在同样的平均速率下让排队更严重（第 3 章的 $C_a^2$），拐点提前、容量变小。
# 5. `--burstiness 0.25` 时 TTFT p99 明显高于泊松到达；在安静的机器上重复几次，看差距是否稳定。
# 6. 还需要：请求长度分布（输入/输出 Token）、是开环还是闭环（这里是闭环 64，吞吐被并发数钉住）、TTFT 是均值还是
#    百分位、是否预热、压测持续多久、硬件与框架版本。判断能否承受 20 req/s，要在 20 req/s 的开环负载下测稳态的 SLO 达成率。
#
# </details>
