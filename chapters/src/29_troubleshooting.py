# %% [markdown]
# # 第 29 章 故障排查手册
#
# 前面 28 章讲的都是“怎样让服务变快、变省”。上线之后，更常见的问题是：**它突然变慢了，为什么？**
# 用户只会说“卡”“超时”，值班工程师手里只有监控面板。本章是一场演练（Drill）：我们在第 1 章的 RAG 服务上
# 依次**注入故障**（Fault Injection）——一个变慢的副本、一个宕掉的副本、一场抢占风暴、一处 KV 泄漏、一次流量激增、
# 一批超长的提示词——只给你看监控面板，请你像值班时一样诊断；答案折叠在每题后面，答案里还有引擎时间线
# （`StepRecord`）给出的确证、修复办法，以及修复后重新运行、指标回到基线的验证。
#
# 排障的信息有三个来源，本章都会用到：
#
# 1. **指标**（Metrics）：服务在 `/metrics` 上暴露的 Prometheus 时间序列。minibatch 用的是 vLLM 的指标名
#    （`vllm:num_requests_running`、`vllm:kv_cache_usage_perc`、`vllm:num_preemptions_total`、TTFT 直方图……），
#    所以这里读面板的方法，原样适用于 vLLM 的 Grafana 面板；
# 2. **引擎时间线**：每一步调度了什么、花了多久、KV 用了多少（`minibatch.timeline.StepRecord`），相当于 vLLM 的调度日志加上性能剖析；
# 3. **请求记录与客户端视角**：每个请求的 TTFT、TPOT，以及服务端指标看不到的东西（网络、网关、5xx）。
#
# ## 学习目标
#
# - 读懂 vLLM 的 Prometheus 指标：名称、类型（Gauge / Counter / Histogram）与直方图的桶；用 `rate()` 与
#   `histogram_quantile()` 把计数器和直方图变成面板上的曲线，知道直方图分位数的误差从哪里来；
# - 记住六类常见故障的“指纹”：排队（waiting 线性增长）、抢占风暴（KV 100% + 抢占速率）、KV 泄漏（空闲时 KV 不归零）、
#   长预填充（ITL 尖峰）、慢副本（同样的批、几倍的步长）、副本宕机（`up == 0`、请求被重新分发）；
# - 用引擎时间线确认诊断，而不是只看面板猜；
# - 会用 minibatch 注入故障（`minibatch.sim.faults`、`minibatch.cluster.failures`、`serve --enable-fault-injection`），
#   修复之后重跑，用同一组指标验证回到基线；
# - 得到一张“症状 → 指标 → 原因 → 修复”的运行手册（Runbook）。

# %%
import inspect
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import ipywidgets as W
import numpy as np
from IPython.display import display

import minibatch
from minibatch import EngineConfig, LLMEngine, cluster
from minibatch.bench import run_benchmark
from minibatch.cluster.failures import Failover, ReplicaFailure
from minibatch.runner import run
from minibatch.serving.scrape import Scraper, histogram_quantile, parse_page, quantile_over_time, rate
from minibatch.sim import make_cost_model
from minibatch.sim.faults import KVLeak, leak_kv, slow_down
from minibatch.viz import md_table, metrics_dashboard
from minibatch.workload import from_arrivals, uniform

print("minibatch", minibatch.__version__)

# %% [markdown]
# 本章的服务就是第 1 章 1.6 节的 RAG 案例：LLaMA-13B（`llama-2-13b`）在 4 张 A10 上做张量并行（TP=4，`hardware="4xa10"`），
# 提示词 150–250 Token、输出 40–120 Token（均匀分布），SLO 是每个请求 TTFT < 0.8 s 且 TPOT < 50 ms。
# 引擎参数用第 1 章扫描出的最好一组：`max_num_seqs=64`、`max_num_batched_tokens=4096`；这一组的服务容量约 16 QPS
# （第 1 章的扫描与第 30 章 30.3 节的复核都按 60 s 的稳态回放测得；容量附近，达成率随随机种子起伏很大）。
# 平时的流量是 8 QPS（容量的一半，留足余量）。每次演练回放 40 s 的流量，监控每 1 s 抓取（Scrape）一次 `/metrics`，
# 面板上的 `rate()` 与分位数取 5 s 窗口。

# %%
SIM = dict(executor="sim", model="llama-2-13b", hardware="4xa10", max_num_seqs=64, max_num_batched_tokens=4096)
SLO = {"ttft": 0.8, "tpot": 0.05}
LENGTHS = dict(input_len=uniform(150, 250), output_len=uniform(40, 120))
DURATION, SCRAPE_S, WINDOW_S = 40.0, 1.0, 5.0

# %%
def poisson_segments(segments, seed):
    """Arrival times of a Poisson process whose rate is piecewise constant: [(t0, t1, rate), ...]."""
    rng = np.random.default_rng(seed)
    times = []
    for t0, t1, lam in segments:
        t = t0 + rng.exponential(1 / lam)
        while t < t1:
            times.append(t)
            t += rng.exponential(1 / lam)
    return np.array(times)


def traffic(segments, seed=1, name="rag", **lengths):
    return from_arrivals(poisson_segments(segments, seed), seed=seed, name=name, **{**LENGTHS, **lengths})


def engine(**kw):
    return LLMEngine(EngineConfig.from_kwargs(**{**SIM, **kw}), clock="virtual")


def serve_one(workload, eng):
    """Replay ``workload`` on one engine with a scraper attached; scrape on to the end of the drill."""
    sc = Scraper(eng, interval_s=SCRAPE_S)
    res = run(workload, engine=eng, on_step=sc.on_step)
    sc.finish(max(DURATION + 5.0, eng.clock.now()))
    return res, [sc]


def serve_cluster(workload, engines, router="round_robin", failures=None):
    """The same for replicas behind a router; a replica that died is a scrape target that is down."""
    scs = [Scraper(e, interval_s=SCRAPE_S, engine_label=str(i)) for i, e in enumerate(engines)]
    res = cluster.run(workload, engines=engines, router=router, failures=failures,
                      on_step=lambda i, e, st: scs[i].on_step(e, st))
    for f in res.extra.get("failures", []):
        scs[f["replica"]].mark_down(f["t"])
    for sc in scs:
        sc.finish(max([DURATION + 5.0] + [e.clock.now() for e in engines]))
    return res, scs


base_wl = traffic([(0, DURATION, 8.0)])
print(f"{len(base_wl)} requests in {DURATION:.0f} s; SLO {SLO} per request")

# %% [markdown]
# ## 29.1 指标：从 `/metrics` 到面板上的曲线
#
# vLLM 的 V1 引擎由 `PrometheusStatLogger` 暴露指标（vLLM 0.10 系列，`vllm/v1/metrics/loggers.py`，本章读的是 commit 005a810 的版本）；
# minibatch 的 `minibatch/serving/metrics.py` 用同样的名字、类型、标签（`model_name`、`engine`）和桶。本章用到的是：
#
# | 指标 | 类型 | 含义 | 面板上怎么用 |
# |---|---|---|---|
# | `vllm:num_requests_running` | Gauge | 正在批里的请求数 | 与 `max_num_seqs` 比：顶满说明批满了 |
# | `vllm:num_requests_waiting` | Gauge | 等待中的请求（含被抢占的） | 持续增长 = 到达快于服务 |
# | `vllm:kv_cache_usage_perc` | Gauge | 已用 KV 块 / 全部块（0–1） | 接近 1 且有抢占 = KV 不够；空闲时不为 0 = 泄漏 |
# | `vllm:num_preemptions` | Counter | 累计抢占次数 | `rate(vllm:num_preemptions_total[5s])` |
# | `vllm:generation_tokens` | Counter | 累计生成的 Token | `rate(...)` 即输出吞吐 |
# | `vllm:time_to_first_token_seconds` | Histogram | 每个请求的 TTFT | `histogram_quantile(0.99, rate(..._bucket[5s]))` |
# | `vllm:inter_token_latency_seconds`（旧名 `vllm:time_per_output_token_seconds`） | Histogram | **每一个** Token 间隔（即 ITL，不是每请求的 TPOT） | p99 的尖峰 = 生成停顿 |
# | `vllm:iteration_tokens_total` | Histogram | 每一步计算的 Token 数 | 大步（长预填充）出现在高桶 |
#
# **两个版本的名字。** Token 间隔直方图在 vLLM 0.10 叫 `vllm:time_per_output_token_seconds`；v0.10.2 加了新名
# `vllm:inter_token_latency_seconds`，旧名的说明改成 “DEPRECATED: Use vllm:inter_token_latency_seconds instead.”；
# v0.11.0 两个都导出（`vllm/v1/metrics/loggers.py` 的注释 “Deprecated in 0.11 - Renamed as vllm:inter_token_latency_seconds”），
# v0.12 起旧名只在 `--show-hidden-metrics-for-version=0.11` 时出现，之后删除。照 vLLM 0.10 写的告警规则在新版本上会“静默”——
# 查不到序列，不是没有停顿。minibatch 两个名字都导出（同一组观测），本章的查询用旧名，换成新名结果相同。
# 要每请求的 TPOT，新版 vLLM 另有 `vllm:request_time_per_output_token_seconds`（minibatch 没有导出它）。
#
# 三种类型：**仪表**（Gauge）是当前值，可升可降；**计数器**（Counter）只增不减，面板上画的是它的增长速率；
# **直方图**（Histogram）在客户端按预先定好的桶（Bucket）计数，`le`（less or equal）标签是桶的上界，每个桶计“不超过上界”的观测数（累积）。
# `prometheus_client` 在暴露格式里给计数器加 `_total` 后缀，给直方图生成 `_bucket`、`_sum`、`_count` 三组样本，
# 所以 vLLM 源码里的 `vllm:num_preemptions` 在页面上是 `vllm:num_preemptions_total`。
#
# Prometheus 每隔 `scrape_interval` 抓取一次页面（Prometheus 的示例配置 `documentation/examples/prometheus.yml` 写明默认 1 分钟、示例取 15 s），
# 两次抓取之间发生的事看不见。面板上的两个查询函数（PromQL）：
#
# $$
# \text{rate}(v[w])(t) = \frac{v(t) - v(t')}{t - t'}, \qquad t' = \text{窗口 } [t-w, t] \text{ 内的第一个样本},
# $$
#
# （Prometheus 的 `promql/functions.go` 还会把增量外推到窗口两端，minibatch 不外推）；直方图分位数先取每个桶在窗口内的增量
# $c_b$（累积计数），秩 $r = q \cdot c_{+\infty}$ 落在第一个 $c_b \ge r$ 的桶 $b$ 里，在桶内**线性插值**：
#
# $$
# \text{histogram\_quantile}(q) = \ell_{b-1} + (\ell_b - \ell_{b-1}) \cdot \frac{r - c_{b-1}}{c_b - c_{b-1}}, \qquad \ell_{-1} = 0 ,
# $$
#
# 落在 `+Inf` 桶时返回最高的有限上界（Prometheus `promql/quantile.go` 的 `bucketQuantile`）。minibatch 的实现在
# `minibatch/serving/scrape.py`：`Scraper` 把服务端同一份 `ServingMetrics` 挂到进程内的引擎上，按引擎的时钟每 `interval_s` 渲染、解析一次页面：

# %%
print(inspect.getsource(histogram_quantile))

# %% [markdown]
# 先跑健康的基线，看一眼抓到的页面（节选几行），再拿直方图算出的 TTFT p99 与逐请求算出的精确 p99 对比：

# %% tags=["nbval-check-output"]
base_res, base_sc = serve_one(base_wl, engine())
page = base_sc[0].page.splitlines()
for prefix in ("vllm:num_requests_running{", "vllm:kv_cache_usage_perc{", "vllm:num_preemptions_total{",
               'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"', "vllm:time_to_first_token_seconds_count{"):
    print(next(line for line in page if line.startswith(prefix)))
t_, bounds, counts = base_sc[0].buckets("vllm:time_to_first_token_seconds")
hist_p99 = histogram_quantile(0.99, bounds, counts[-1])
true_p99 = float(np.percentile([r.ttft for r in base_res.requests], 99))
b_hi = min(b for b in bounds if b >= true_p99)
b_lo = max([0.0] + [b for b in bounds if b < true_p99])
print(f"TTFT p99: from the histogram {hist_p99 * 1e3:.0f} ms, exact {true_p99 * 1e3:.0f} ms (bucket {b_lo}-{b_hi} s)")
assert b_lo <= hist_p99 <= b_hi, "the histogram quantile lies in the bucket of the true quantile"

# %% [markdown]
# 直方图给出的 p99 是 {{hist_p99 * 1e3:.0f}} ms，逐请求算出的精确值是 {{true_p99 * 1e3:.0f}} ms：两者都在同一个桶
# （{{b_lo}}–{{b_hi}} s）里，差别来自“桶内均匀分布”的插值假设。vLLM 的 TTFT 桶在 0.5 s 之后是 0.75、1.0、2.5 s，
# 所以面板上的 TTFT p99 只能精确到这个粒度：要判断“是否 < 800 ms”，它够用；要比较 620 ms 与 680 ms，它不够用——
# 那时要看逐请求的记录或客户端的压测结果（第 8 章）。
#
# ## 29.2 基线：健康的服务长什么样
#
# 没有基线，面板上的数字就没有意义。下面是 8 QPS 下健康服务的六联面板（`minibatch.viz.metrics_dashboard`，每个面板一个 PromQL 查询，
# 见它的文档字符串）。它们大致对应 Google SRE 书《Monitoring Distributed Systems》一章的四个**黄金信号**（Golden Signals）：
# 延迟（TTFT、ITL）、流量（生成吞吐）、错误（本章 29.5 节）、饱和度（running / waiting、KV 使用率、抢占）。

# %%
def fingerprint(scrapers):
    """The numbers a person reads off the six panels (over all targets): maxima, and the median throughput."""
    def over(fn):
        return np.concatenate([fn(sc)[1] for sc in scrapers])

    def nanmax(v):
        return float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")

    tok = np.nansum(np.vstack([rate(sc, "vllm:generation_tokens_total", WINDOW_S)[1] for sc in scrapers]), axis=0)
    return {"running": nanmax(over(lambda s: s.values("vllm:num_requests_running"))),
            "waiting": nanmax(over(lambda s: s.values("vllm:num_requests_waiting"))),
            "kv": nanmax(over(lambda s: s.values("vllm:kv_cache_usage_perc"))),
            "preempt_s": nanmax(over(lambda s: rate(s, "vllm:num_preemptions_total", WINDOW_S))),
            "ttft_p99": nanmax(over(lambda s: quantile_over_time(s, 0.99, "vllm:time_to_first_token_seconds", WINDOW_S))),
            "itl_p99": nanmax(over(lambda s: quantile_over_time(s, 0.99, "vllm:time_per_output_token_seconds", WINDOW_S))),
            "tok_s": float(np.median(tok[np.isfinite(tok) & (tok > 0)])),
            "up_min": float(np.nanmin(over(lambda s: s.values("up"))))}


def fp_row(name, fp):
    return [name, f"{fp['running']:.0f}", f"{fp['waiting']:.0f}", f"{fp['kv']:.0%}", f"{fp['preempt_s']:.1f}",
            f"{fp['ttft_p99']:.2f}", f"{fp['itl_p99'] * 1e3:.0f}", f"{fp['tok_s']:.0f}"]


FP_HEADER = ["", "running max", "waiting max", "KV max", "preempt/s max", "TTFT p99 max (s)", "ITL p99 max (ms)",
             "gen tok/s (median)"]
base_fp = fingerprint(base_sc)
base_sum = base_res.summary(slo=SLO)
display(metrics_dashboard(base_sc, WINDOW_S, title="baseline: the RAG service at 8 QPS"))
md_table(FP_HEADER, [fp_row("baseline", base_fp)])
assert base_fp["waiting"] <= 2 and base_fp["preempt_s"] == 0 and base_sum["slo_attainment"] >= 0.99

# %% [markdown]
# 健康的样子：批里同时有不超过 {{base_fp["running"]:.0f}} 个请求（上限 64），几乎不排队，KV 最多用到 {{base_fp["kv"]:.0%}}，
# 没有抢占，TTFT p99 的最大值 {{base_fp["ttft_p99"]:.2f}} s，ITL p99 的最大值 {{base_fp["itl_p99"] * 1e3:.0f}} ms，
# 输出吞吐约 {{base_fp["tok_s"]:.0f}} tok/s（= 到达率 × 平均输出长度），{{base_sum["slo_attainment"]:.0%}} 的请求满足 SLO。
# 把这一行记下来，后面每道题都拿它对照。
#
# ## 29.3 故障注入工具箱
#
# 演练要能**按需**制造故障。minibatch 提供四类注入点，每一类只包装一个对象、不改其他代码：
#
# | 故障 | 怎样注入 | 代码 |
# |---|---|---|
# | 慢副本（Straggler） | 从 `start_s` 起每一步耗时乘以 `factor`（GPU 过热降频、功耗封顶、邻居抢占主机、PCIe 链路降速） | `minibatch.sim.faults.slow_down` |
# | KV 泄漏（KV Leak） | 从 `start_s` 起每第 `every` 个结束的请求不归还它的 KV 块 | `minibatch.sim.faults.leak_kv` |
# | 副本宕机 | 集群里第 `replica` 个副本在 `at_s` 死掉，它手里的请求经路由器**重新分发**（Re-dispatch）到活着的副本、重算后继续 | `minibatch.cluster.failures.ReplicaFailure` |
# | 服务端故障 | `serve --enable-fault-injection` 打开 `POST /admin/fault`：`slow`、`error`、`cut_stream` | `minibatch.serving.faults` |
#
# 抢占风暴、流量激增、超长提示词不需要注入点：它们是**配置**或**流量**造成的，演练里直接改配置、改负载。
# 泄漏与重新分发的核心几行如下（泄漏：块表项删了，引用却没有释放；重新分发：像重算抢占一样清零 `num_computed_tokens`，经路由器送到别的副本）：

# %%
print(inspect.getsource(KVLeak._maybe_leak))
src = inspect.getsource(Failover.fire)
print(src[src.index("        for req in"):src.index("        self.redispatched")])

# %% [markdown]
# ## 29.4 演练：六个未知故障
#
# 下面的单元格准备了六起“事故”（Incident）。**先别读它的代码**（在 JupyterLab 里它是折叠的）：那里写着答案。
# 每一题只给你面板和一行指纹，先自己写下诊断，再展开答案。有两题是两个副本的集群（面板上每个副本一种颜色）。

# %% jupyter={"source_hidden": true}
# Spoilers: the six incidents of the drill.
def incident_1():
    return serve_one(base_wl, engine(gpu_memory_utilization=0.34))


def incident_2(router="round_robin"):
    engines = [engine() for _ in range(2)]
    slow_down(engines[1], factor=3.0, start_s=15.0)
    return serve_cluster(traffic([(0, DURATION, 16.0)], seed=2), engines, router=router)


def incident_3():
    eng = engine()
    incident_3.leak = leak_kv(eng, every=3)
    return serve_one(base_wl, eng)


LONG_DOCS = traffic([(5, DURATION - 5, 0.3)], seed=9, name="doc", input_len=uniform(3000, 3800))


def incident_4(**kw):
    return serve_one(base_wl.merge(LONG_DOCS), engine(**kw))


SURGE = traffic([(0, 15, 8.0), (15, 30, 24.0), (30, DURATION, 8.0)], seed=5)


def incident_5():
    return serve_one(SURGE, engine())


def incident_6(replicas=2):
    return serve_cluster(traffic([(0, DURATION, 20.0)], seed=3), [engine() for _ in range(replicas)],
                         router="least_requests", failures=[ReplicaFailure(1, 15.0)])


# %% [markdown]
# ### 事故 1

# %%
res1, sc1 = incident_1()
fp1 = fingerprint(sc1)
display(metrics_dashboard(sc1, WINDOW_S, title="incident 1"))
md_table(FP_HEADER, [fp_row("baseline", base_fp), fp_row("incident 1", fp1)])

# %% [markdown]
# 流量和基线一样，吞吐却从 {{base_fp["tok_s"]:.0f}} 降到了 {{fp1["tok_s"]:.0f}} tok/s。你的诊断？
# 先写下来，再运行下一格（时间线上的证据与修复的验证），然后展开答案。

# %%
cm13 = make_cost_model("llama-2-13b", "4xa10")
storm_tokens = cm13.kv_capacity_tokens(0.34)
normal_tokens = int(base_fp["running"] * (200 + 80))
storm_steps = float(np.mean([s.num_preempted > 0 for s in res1.steps]))
storm_prefill = sum(s.num_prefill_tokens for s in res1.steps)
storm_prompt = sum(r.prompt_len for r in res1.requests)
res1b, sc1b = serve_one(base_wl, engine(gpu_memory_utilization=0.34, admission="conservative", max_num_seqs=16))
fp1b = fingerprint(sc1b)
s1, s1b = res1.summary(slo=SLO), res1b.summary(slo=SLO)
md_table(FP_HEADER + ["SLO met"], [fp_row("incident 1", fp1) + [f"{s1['slo_attainment']:.0%}"],
                                   fp_row("same memory, conservative, 16 seqs", fp1b) + [f"{s1b['slo_attainment']:.0%}"],
                                   fp_row("memory restored (= baseline)", base_fp) + [f"{base_sum['slo_attainment']:.0%}"]])
pool_reqs = storm_tokens // 280

# %% tags=["check"]
assert fp1["kv"] > 0.99 and fp1["preempt_s"] > 1 and fp1["tok_s"] < 0.9 * base_fp["tok_s"], "incident 1's fingerprint"
assert fp1["running"] < SIM["max_num_seqs"] / 2 and fp1["waiting"] > 10
assert storm_tokens < normal_tokens and storm_prefill > 1.2 * storm_prompt, "the prose: the pool is too small, recompute"
assert fp1b["preempt_s"] < fp1["preempt_s"] / 4, "the prose: conservative admission and 16 seqs stop the thrash"
assert fp1b["tok_s"] < 0.9 * base_fp["tok_s"] and s1b["slo_attainment"] < 0.5, "but the throughput does not come back"
assert pool_reqs < base_fp["running"]

# %% [markdown]
# <details><summary>答案：抢占风暴（Preemption Storm）——KV 池太小</summary>
#
# **指纹**：KV 使用率顶在 {{fp1["kv"]:.0%}}，抢占速率最高 {{fp1["preempt_s"]:.1f}} 次/s（基线为 0）；running 上不去（最多
# {{fp1["running"]:.0f}}，远低于 `max_num_seqs=64`），waiting 却在涨（最多 {{fp1["waiting"]:.0f}}）；TTFT p99 升到 {{fp1["ttft_p99"]:.1f}} s。
# 批满不了而 KV 满了：瓶颈是显存，不是算力。
#
# **原因**：这个副本的 `gpu_memory_utilization` 被调到了 0.34（比如为了在同一组卡上放检索用的向量模型），KV 池只剩
# {{storm_tokens:,}} 个 Token，而 8 QPS 下正常的批要 {{normal_tokens:,}} 个左右（约 {{base_fp["running"]:.0f}} 个请求 × 280 Token）。
# 这是第 12 章的抖动：被抢占的请求回到队首，重算时又把别人挤出去。**时间线确证**：{{storm_steps:.0%}} 的步里发生了抢占；
# 引擎一共计算了 {{storm_prefill:,}} 个预填充 Token，而这些请求的提示词一共只有 {{storm_prompt:,}} 个，多出的
# {{storm_prefill / storm_prompt - 1:.0%}} 都是重算。吞吐下降有两个原因：池只放得下十来个请求，批变小了（每一步产出的 Token 变少）；
# 再加上重算占去的算力。
#
# **修复**：把 `gpu_memory_utilization` 调回 0.9（即基线）。显存确实要让出去时，保守的准入加上更小的批
# （`admission="conservative"`、`max_num_seqs=16`，第 12 章）能止住抖动：上一格里抢占速率从 {{fp1["preempt_s"]:.1f}} 降到
# {{fp1b["preempt_s"]:.1f}} 次/s。但吞吐回不来（{{fp1b["tok_s"]:.0f}} tok/s），SLO 达成率仍只有 {{s1b["slo_attainment"]:.0%}}：
# 池里只放得下约 {{pool_reqs}} 个 280 Token 的请求，而 8 QPS 下要同时服务 {{base_fp["running"]:.0f}} 个左右——显存不够就是不够，
# 不抖动也只是排队。治本是把显存还给 KV，或者给检索模型另找一张卡。
#
# </details>
#
# ### 事故 2（两个副本，轮询路由）

# %%
res2, sc2 = incident_2()
fp2 = [fingerprint([sc]) for sc in sc2]
display(metrics_dashboard(sc2, WINDOW_S, title="incident 2: two replicas behind a round-robin router, 16 QPS"))
md_table(FP_HEADER, [fp_row("baseline (one replica, 8 QPS)", base_fp)] + [fp_row(f"replica {i}", f) for i, f in enumerate(fp2)])

# %% [markdown]
# 两个副本分到的流量一样多（各约 8 QPS），一个健康，另一个从 15 s 起排起了长队。你的诊断？

# %%
def decode_step_ratio(result, t0, ctx=280):
    """Decode-only steps after ``t0``: median duration (ms), median batch size, and the median of each
    step's duration over a healthy machine's for that batch (the cost model at ``ctx`` tokens of context)."""
    steps = [s for s in result.steps if s.start_time >= t0 and s.num_prefill_tokens == 0 and s.num_seqs > 0]
    ratio = [s.duration / cm13.step_time([], [ctx] * s.num_seqs) for s in steps]
    return (float(np.median([s.duration for s in steps]) * 1e3), float(np.median([s.num_seqs for s in steps])),
            float(np.median(ratio)))


dec_ms, dec_batch, dec_ratio = zip(*(decode_step_ratio(r, 15.0) for r in res2.replicas))
res2b, sc2b = incident_2(router="least_requests")
s2, s2b = res2.summary(slo=SLO), res2b.summary(slo=SLO)
md_table(["router", "routed to 0 / 1", "TTFT p99 (s)", "TPOT p99 (ms)", "SLO met"],
         [[name, f"{s['routed'][0]} / {s['routed'][1]}", f"{s['ttft_p99']:.2f}", f"{s['tpot_p99'] * 1e3:.0f}",
           f"{s['slo_attainment']:.0%}"] for name, s in (("round_robin", s2), ("least_requests", s2b))])

# %% tags=["check"]
assert 2.7 < dec_ratio[1] < 3.3 and 0.9 < dec_ratio[0] < 1.1, "the prose: 3x a healthy machine's step, and 1x"
assert fp2[1]["waiting"] > 20 * max(fp2[0]["waiting"], 1) and fp2[1]["preempt_s"] == 0 == fp2[0]["preempt_s"]
assert s2b["ttft_p99"] < s2["ttft_p99"] / 5 and s2b["slo_attainment"] > s2["slo_attainment"], "least_requests helps"
assert s2b["tpot_p99"] > SLO["tpot"], "but the slow replica still misses the TPOT SLO"

# %% [markdown]
# <details><summary>答案：慢副本（Straggler）——同样的批，三倍的步长</summary>
#
# **指纹**：副本 1 的 running 顶到 {{fp2[1]["running"]:.0f}}、waiting 涨到 {{fp2[1]["waiting"]:.0f}}，ITL p99 最高
# {{fp2[1]["itl_p99"] * 1e3:.0f}} ms、TTFT p99 最高 {{fp2[1]["ttft_p99"]:.1f}} s；副本 0 一切如常。KV 不紧、没有抢占：不是显存。
# 两个副本的配置、模型、流量都一样，只有一个变慢，问题在**这台机器**上。
#
# **时间线确证**：比较 15 s 之后两个副本的纯解码步。副本 0 的步长中位数 {{dec_ms[0]:.1f}} ms（批大小中位数 {{dec_batch[0]:.0f}}），
# 副本 1 是 {{dec_ms[1]:.1f}} ms（批大小 {{dec_batch[1]:.0f}}）。批大小不同，步长不能直接比；拿每一步与“健康机器上同样批大小的步长”
# （这里是代价模型在 280 Token 上下文时的预测，生产中是这个型号的基准剖面，如 `python -m minibatch profile` 的结果）相比：
# 副本 0 的比值中位数是 {{dec_ratio[0]:.2f}}，副本 1 是 {{dec_ratio[1]:.2f}}。同样的活干得慢了三倍，只能是这台机器的问题
# （降频、功耗封顶、PCIe 降速）或主机上的邻居；批变大（{{dec_batch[1]:.0f}}）是排队的结果，不是原因。生产中可以把每个副本每秒的步数
# （`rate(vllm:iteration_tokens_total_count[5s])`）与每步耗时画在一起，离群的那个就是。
#
# **修复**：先止血——轮询（Round Robin）不看负载，照样把一半的请求发给慢副本；换成按在途请求数路由（`least_requests`，第 26 章），
# 路由器把 {{s2b["routed"][0]}} 个请求发给健康的副本、只给慢副本 {{s2b["routed"][1]}} 个，TTFT p99 从 {{s2["ttft_p99"]:.1f}} s 降到
# {{s2b["ttft_p99"]:.2f}} s，SLO 达成率从 {{s2["slo_attainment"]:.0%}} 升到 {{s2b["slo_attainment"]:.0%}}。但慢副本上每个 Token
# 都慢三倍，TPOT p99 仍是 {{s2b["tpot_p99"] * 1e3:.0f}} ms，超过 50 ms：路由只能让它少接活，不能让它变快。治本是把这台机器摘下来
# （Drain）、换掉。
#
# </details>
#
# ### 事故 3

# %%
res3, sc3 = incident_3()
fp3 = fingerprint(sc3)
display(metrics_dashboard(sc3, WINDOW_S, title="incident 3"))
md_table(FP_HEADER, [fp_row("baseline", base_fp), fp_row("incident 3", fp3)])

# %% [markdown]
# 流量、延迟、吞吐都和基线一样，SLO 也全部满足。有什么不对吗？

# %%
t3, kv3 = sc3[0].values("vllm:kv_cache_usage_perc")
_, run3 = sc3[0].values("vllm:num_requests_running")
_, wait3 = sc3[0].values("vllm:num_requests_waiting")
idle = (run3 == 0) & (wait3 == 0) & (t3 > DURATION)
idle_kv = float(kv3[idle].max())
late = (t3 >= DURATION - 20) & (t3 <= DURATION)
leak_slope = float(np.polyfit(t3[late], kv3[late], 1)[0])
to_full_s = (1 - kv3[late][-1]) / leak_slope
leak3 = incident_3.leak
try:
    leak3.kv.check_invariants()
    invariant_error = "none"
except AssertionError as e:
    invariant_error = str(e)
print(f"idle KV usage {idle_kv:.1%} (baseline {base_sc[0].values('vllm:kv_cache_usage_perc')[1][-1]:.1%}); "
      f"slope {leak_slope:.2%}/s; check_invariants: {invariant_error}")

# %% tags=["check"]
assert idle.any() and idle_kv > 0.2 and base_sc[0].values("vllm:kv_cache_usage_perc")[1][-1] == 0
assert invariant_error != "none" and "owners" in invariant_error
assert abs(fp3["ttft_p99"] - base_fp["ttft_p99"]) < 0.05 and res3.summary(slo=SLO)["slo_attainment"] >= 0.99

# %% [markdown]
# <details><summary>答案：KV 泄漏（KV Leak）——空闲时 KV 使用率不归零</summary>
#
# **指纹**：KV 使用率随时间**一路爬升**（最高 {{fp3["kv"]:.0%}}，基线只有 {{base_fp["kv"]:.0%}}），running 却与基线一样；
# 流量在 {{DURATION:.0f}} s 停止后，running 与 waiting 都是 0，KV 使用率却停在 {{idle_kv:.0%}}——没有请求，却有块被占着。
# 这是面板上最容易被忽略的一类故障：延迟与吞吐全都正常，直到池被吃光。按最后 20 s 的斜率（每秒 {{leak_slope:.2%}}），
# 以这样的负载再过约 {{to_full_s:.0f}} s 池就满了，之后就是事故 1 的抢占风暴（演练里的泄漏被故意放大了：每 3 个请求漏一个；
# 真实的泄漏往往慢得多，要几小时、几天才出事，所以更难发现）。
#
# **引擎确证**：块守恒检查 `KVCacheManager.check_invariants()`（每个引用必须恰好有一个主人）失败了：`{{invariant_error}}`。
# 泄漏的块有 {{leak3.num_leaked_blocks:,}} 个，来自 {{len(leak3.leaked_requests)}} 个请求。真实世界的例子：vLLM issue #46283
# （分离式部署中被中止的远程 KV 加载，解码端的块要等一个永远不会来的完成通知才释放），以及 issue #27073（v0.10.2 上几次超长请求报错之后，
# KV 使用率一直停在接近 100%，重启才恢复；该 issue 没有确认根因）。
#
# **修复**：止血是滚动重启副本（重启后池是空的，但泄漏还会再来）；治本是找到不释放的那条路径——通常是中止、超时、出错这类不常走的分支。
# 监控上加一条告警：`vllm:num_requests_running == 0` 且 `vllm:num_requests_waiting == 0` 时 `vllm:kv_cache_usage_perc > 0`
# （开启前缀缓存时，缓存着前缀的空闲块在空闲队列里，不算“已用”，所以这条规则照样成立）。
#
# </details>
#
# ### 事故 4

# %%
res4, sc4 = incident_4()
fp4 = fingerprint(sc4)
display(metrics_dashboard(sc4, WINDOW_S, title="incident 4"))
md_table(FP_HEADER, [fp_row("baseline", base_fp), fp_row("incident 4", fp4)])

# %% [markdown]
# 没有排队、没有抢占、KV 很空，但 ITL 的 p99 一阵一阵地冲高。你的诊断？

# %%
big_steps = [s for s in res4.steps if s.num_prefill_tokens > 3000]
big_ms_min, big_ms_max = min(s.duration for s in big_steps) * 1e3, max(s.duration for s in big_steps) * 1e3
big_decodes = float(np.median([s.num_decode_tokens for s in big_steps]))
normal_ms = float(np.median([s.duration for s in res4.steps]) * 1e3)
_, it_bounds, it_counts = sc4[0].buckets("vllm:iteration_tokens_total")
big_bucket = it_counts[-1][it_bounds.index(4096.0)] - it_counts[-1][it_bounds.index(2048.0)]
res4b, sc4b = incident_4(max_num_batched_tokens=512)
fp4b = fingerprint(sc4b)
s4, s4b = res4.summary(slo=SLO), res4b.summary(slo=SLO)
md_table(FP_HEADER + ["TPOT p99 (ms)"], [fp_row("budget 4096", fp4) + [f"{s4['tpot_p99'] * 1e3:.0f}"],
                                         fp_row("budget 512 (chunked)", fp4b) + [f"{s4b['tpot_p99'] * 1e3:.0f}"]])

# %% tags=["check"]
assert len(big_steps) >= 5 and big_ms_min > 5 * normal_ms and big_bucket == len(big_steps)
assert fp4["itl_p99"] > 3 * base_fp["itl_p99"] and fp4["waiting"] <= 3 and fp4["preempt_s"] == 0
assert fp4b["itl_p99"] < fp4["itl_p99"] / 3, "chunking with a small budget removes the stalls"

# %% [markdown]
# <details><summary>答案：长预填充造成的生成停顿（Generation Stall）</summary>
#
# **指纹**：ITL p99 的尖峰最高 {{fp4["itl_p99"] * 1e3:.0f}} ms（基线 {{base_fp["itl_p99"] * 1e3:.0f}} ms），TTFT p99 也有尖峰
# （{{fp4["ttft_p99"]:.2f}} s），时间上零零散散、与排队无关；`vllm:iteration_tokens_total` 直方图里 2048–4096 的桶有 {{big_bucket:.0f}} 个计数。
#
# **时间线确证**：有 {{len(big_steps)}} 步的预填充超过 3000 Token，每一步耗时 {{big_ms_min:.0f}}–{{big_ms_max:.0f}} ms，而全部步的
# 中位数只有 {{normal_ms:.0f}} ms；这些步里还夹着（中位数）{{big_decodes:.0f}} 个正在解码的请求，它们的下一个 Token 都被推迟了这么久——
# 第 11 章讲的生成停顿。原因是流量里混进了少量 3000–3800 Token 的“文档总结”请求（{{len(LONG_DOCS)}} 个），而 Token 预算
# `max_num_batched_tokens=4096` 允许一个长提示词在一步里整段预填充。
#
# **修复**：分块预填充配一个小的 Token 预算（Sarathi-Serve 的做法，第 11 章）：`max_num_batched_tokens=512`，长提示词被切成多块，
# 每一步都给解码留位置。上一格里 ITL p99 的最高值从 {{fp4["itl_p99"] * 1e3:.0f}} ms 降到 {{fp4b["itl_p99"] * 1e3:.0f}} ms。
# 代价在第 11 章讲过：长提示词要分 7–8 步算完，它们自己的 TTFT 会变长一些。
#
# </details>
#
# ### 事故 5

# %%
res5, sc5 = incident_5()
fp5 = fingerprint(sc5)
display(metrics_dashboard(sc5, WINDOW_S, title="incident 5"))
md_table(FP_HEADER, [fp_row("baseline", base_fp), fp_row("incident 5", fp5)])

# %% [markdown]
# 15 s 起 waiting 直线上涨，TTFT 跟着涨，30 s 之后又慢慢回落。你的诊断？

# %%
t5, w5 = sc5[0].values("vllm:num_requests_waiting")
win = (t5 >= 16) & (t5 <= 30)
surge_slope = float(np.polyfit(t5[win], w5[win], 1)[0])
_, done5 = rate(sc5[0], "vllm:request_success_total", WINDOW_S)
surge_mu = float(np.nanmedian(done5[win]))
res5b, sc5b = serve_cluster(SURGE, [engine() for _ in range(2)], router="least_requests")
fp5b = fingerprint(sc5b)
s5, s5b = res5.summary(slo=SLO), res5b.summary(slo=SLO)
md_table(FP_HEADER + ["SLO met"], [fp_row("one replica", fp5) + [f"{s5['slo_attainment']:.0%}"],
                                   fp_row("two replicas", fp5b) + [f"{s5b['slo_attainment']:.0%}"]])

# %% tags=["check"]
assert fp5["running"] == SIM["max_num_seqs"] and fp5["preempt_s"] == 0 and fp5["ttft_p99"] > 3
assert 18 < surge_slope + surge_mu < 30, "the waiting slope plus the completion rate recovers the 24 QPS surge"
assert s5b["slo_attainment"] >= 0.95 and fp5b["waiting"] < fp5["waiting"] / 5, "two replicas absorb the surge"

# %% [markdown]
# <details><summary>答案：流量激增（Traffic Surge）——到达率超过了服务容量</summary>
#
# **指纹**：running 顶在 `max_num_seqs` = {{fp5["running"]:.0f}}，waiting **线性**增长到 {{fp5["waiting"]:.0f}}，TTFT p99 升到
# {{fp5["ttft_p99"]:.1f}} s；KV 只用了 {{fp5["kv"]:.0%}}、没有抢占——每个在批里的请求都算得不慢，是在排队。
#
# **估算**：waiting 在 16–30 s 的斜率是每秒 {{surge_slope:.1f}} 个，这就是“到达 − 完成”：$\lambda - \mu \approx$ {{surge_slope:.1f}}/s；
# 饱和时的完成率 $\mu \approx$ {{surge_mu:.1f}} req/s（`rate(vllm:request_success_total[5s])`），所以这段时间的到达率约为
# {{surge_slope + surge_mu:.0f}} QPS，而真实值是 24 QPS（第 3 章：到达率超过服务能力时，队列没有稳态）。
# vLLM 的指标里没有“到达的请求数”（计数器都在请求出第一个 Token 或结束时才加），到达率要从网关、路由器看，或者像这里这样从队列的斜率反推。
#
# **修复**：扩容（第 26、28 章）——加一个副本、按在途请求数路由；或者在入口限流、返回 429（第 16 章的背压），把排队挡在服务外面。
# 上一格验证了扩容：两个副本时激增期间每个副本约 12 QPS，低于一个副本的容量（第 1、30 章：约 16 QPS），waiting 最多 {{fp5b["waiting"]:.0f}}，SLO 达成率
# {{s5b["slo_attainment"]:.0%}}（一个副本时 {{s5["slo_attainment"]:.0%}}）。
#
# </details>
#
# ### 事故 6（两个副本，按在途请求数路由）

# %%
res6, sc6 = incident_6()
fp6 = [fingerprint([sc]) for sc in sc6]
display(metrics_dashboard(sc6, WINDOW_S, title="incident 6: two replicas, least_requests, 20 QPS"))
md_table(FP_HEADER + ["up min"], [fp_row(f"replica {i}", f) + [f"{f['up_min']:.0f}"] for i, f in enumerate(fp6)])

# %% [markdown]
# 灰色区域是抓取失败的时段。你的诊断？

# %%
t_dead = res6.extra["failures"][0]["t"]
s6 = res6.summary(slo=SLO)
res6b, sc6b = incident_6(replicas=3)
s6b = res6b.summary(slo=SLO)
md_table(["replicas", "re-dispatched", "completed", "TTFT p99 (s)", "SLO met"],
         [[n, r.extra["redispatched"], f"{s['completed']} / {len(r.requests)}", f"{s['ttft_p99']:.2f}",
           f"{s['slo_attainment']:.0%}"] for n, r, s in ((2, res6, s6), (3, res6b, s6b))])

# %% tags=["check"]
assert fp6[1]["up_min"] == 0 and fp6[0]["up_min"] == 1 and res6.extra["redispatched"] > 0
assert s6["completed"] == len(res6.requests) and s6b["completed"] == len(res6b.requests), "no request is lost"
assert fp6[0]["waiting"] > 50 and s6["slo_attainment"] < 0.6 and s6b["slo_attainment"] >= 0.95

# %% [markdown]
# <details><summary>答案：副本宕机——剩下的副本接不住全部流量</summary>
#
# **指纹**：副本 1 的抓取从 {{t_dead:.1f}} s 起失败（Prometheus 的 `up` 序列为 0，面板上的灰色区域；它的曲线在这里中断）。
# 紧接着副本 0 的 running 顶到 {{fp6[0]["running"]:.0f}}、waiting 涨到 {{fp6[0]["waiting"]:.0f}}、TTFT p99 升到 {{fp6[0]["ttft_p99"]:.1f}} s。
#
# **原因**有两层：副本 1 死了，它手里的 {{res6.extra["failures"][0]["redispatched"]}} 个请求由路由器**重新分发**到副本 0、从头重算
# （没有请求丢失：{{s6["completed"]}} / {{len(res6.requests)}} 完成）；更大的问题是之后 20 QPS 全部压在一个副本上，超过了它的容量（第 1、30 章：约 16 QPS）——
# 事故 5 的排队，只是由宕机引起。
#
# **修复**：副本数按 **N+1** 规划（第 30 章）：任何一个副本宕机，剩下的仍能承载峰值流量；宕机本身靠健康检查摘除、自动拉起替补
# （第 28 章的伸缩器会因为在途请求增多而扩容，但要等冷启动）。上一格用三个副本重演了同一次宕机：剩下两个副本各约 10 QPS，
# SLO 达成率 {{s6b["slo_attainment"]:.0%}}（两个副本时 {{s6["slo_attainment"]:.0%}}）。被重新分发的请求要从头重算，它们的 TTFT 或 TPOT
# 会多出一截，这是宕机无法避免的代价。
#
# </details>
#
# ## 29.5 真实服务：服务端指标看不见的故障
#
# 最后用真实的 HTTP 服务把“指标的视角”补完整。下面的单元格在本机的空闲端口上启动
# `python -m minibatch serve --model tiny --enable-fault-injection`（只监听 127.0.0.1），先压测一轮作为基线，
# 再通过 `POST /admin/fault` 注入 `slow`（每个生成请求进入引擎前、以及每个流式事件前都等 0.15 s）与 `error`（一半的请求直接返回 500），
# 每一轮前后各读一次 `/metrics`，比较**客户端**测到的 TTFT 与**服务端**直方图里的 TTFT（`_sum` / `_count` 的增量，即这一轮的平均值）。
# 无论成功与否，最后都会关闭服务。数字是墙钟时间，随机器负载变化。

# %% tags=["nbval-ignore-output"]
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def server_ttft(before, after):
    """Mean server-side TTFT of the requests between two /metrics pages, from the histogram's _sum and _count."""
    def tot(page, suffix):
        return sum(v for (name, _), v in page.items() if name == f"vllm:time_to_first_token_seconds_{suffix}")
    n = tot(after, "count") - tot(before, "count")
    return (tot(after, "sum") - tot(before, "sum")) / n if n else float("nan"), n


def successes(page):
    return sum(v for (name, _), v in page.items() if name == "vllm:request_success_total")

# %%
port = free_port()
base = f"http://127.0.0.1:{port}"
log = tempfile.TemporaryFile()
server = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--host", "127.0.0.1",
                           "--port", str(port), "--max-num-seqs", "4", "--enable-fault-injection",
                           "--uvicorn-log-level", "warning"], stdout=log, stderr=log)
BENCH = dict(base_url=base, num_prompts=8, request_rate=float("inf"), random_input_len=32, random_output_len=8, seed=0)
rounds = {}
try:
    t0 = time.perf_counter()
    while True:
        try:
            http(base + "/health")
            break
        except OSError:
            if server.poll() is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
    run_benchmark(**{**BENCH, "num_prompts": 2})                        # warm-up
    for name, fault in (("healthy", {"kind": "none"}), ("slow 0.15 s", {"kind": "slow", "delay_s": 0.15}),
                        ("error 50%", {"kind": "error", "rate": 0.5, "seed": 1})):
        http(base + "/admin/fault", fault)
        before = parse_page(http(base + "/metrics"))
        out = run_benchmark(**BENCH)
        after = parse_page(http(base + "/metrics"))
        rounds[name] = dict(client_ttft=out["mean_ttft_ms"] / 1e3, server=server_ttft(before, after),
                            ok=out["completed"], failed=out["num_prompts"] - out["completed"],
                            counted=successes(after) - successes(before))
except Exception:
    log.seek(0)
    print(log.read().decode(errors="replace")[-2000:])
    raise
finally:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:      # it did not stop on SIGTERM: kill it
        server.kill()
        server.wait(timeout=10)
    log.close()
md_table(["round", "client TTFT mean (s)", "server TTFT mean (s)", "requests OK / failed (client)",
          "vllm:request_success_total +"],
         [[k, f"{v['client_ttft']:.3f}", f"{v['server'][0]:.3f}", f"{v['ok']} / {v['failed']}", f"{v['counted']:.0f}"]
          for k, v in rounds.items()])

# %% tags=["nbval-ignore-output"]
gap_healthy = rounds["healthy"]["client_ttft"] - rounds["healthy"]["server"][0]
gap_slow = rounds["slow 0.15 s"]["client_ttft"] - rounds["slow 0.15 s"]["server"][0]
err = rounds["error 50%"]

# %% tags=["check"]
assert gap_slow > gap_healthy + 0.1, "the delay before the engine shows at the client, not in the server's TTFT"
assert err["failed"] > 0 and err["counted"] == err["ok"], "errors before the engine are not in vllm's counters"
assert server.poll() is not None, "the server process was stopped"

# %% [markdown]
# 两个现象都是真实值班中最让人困惑的情况：
#
# - **`slow`**：客户端测到的 TTFT 与服务端直方图里的平均 TTFT 之差，从健康时的 {{gap_healthy:.3f}} s 涨到 {{gap_slow:.2f}} s，
#   多出的 {{gap_slow - gap_healthy:.2f}} s 与注入的延迟相当（进入引擎之前与第一个流式事件之前各 0.15 s；墙钟测量，有噪声）。服务端的 TTFT 从请求**进入引擎**算起
#   （minibatch 在 `LLMEngine.add_request` 时记下到达时间），这段延迟它看不见：服务端面板照常，用户却在抱怨——网络、网关、API 层的排队
#   都属于这一类。（服务端 TTFT 本身在繁忙的共享机器上也随负载浮动，所以这里比的是两者之差。）必须同时看客户端（或网关）一侧的延迟：
#   第 8 章的压测客户端就是客户端视角。
# - **`error`**：{{err["failed"]}} 个请求在进入引擎之前就被回了 500，`vllm:request_success_total` 只增加了成功的
#   {{err["counted"]:.0f}} 个——vLLM 风格的引擎指标里根本没有这些失败。错误率要从路由器（minibatch 路由器的
#   `minibatch_router_upstream_errors`，按 `kind` 分为 connect、status、timeout、stall、stream_cut，定义在
#   `minibatch/serving/upstreams.py` 的 `RouterMetrics`）或负载均衡器的 5xx 计数看；路由器会把出错的上游标为不健康、
#   把请求重试到别的副本，这正是事故 6 的重新分发在 HTTP 层的样子。上游冻住（进程还在、不出 Token）时不会有 5xx：
#   `kind="stall"` 计的是首 Token 或 Token 间超时（路由器的 `--first-token-timeout`、`--inter-token-timeout`），
#   超时后（`minibatch/serving/relay.py`）：还没发出 Token 的请求原样改发到别的副本；已发出 Token 的贪心补全请求带着已发的 Token
#   在别的副本上续写（`minibatch_router_retries{kind="resume"}`）；对话流与采样请求以 OpenAI 格式的错误事件结束
#   （`minibatch_router_stream_errors`）——流从不“静默地变短”。
#
# ## 29.6 运行手册：症状 → 指标 → 原因 → 修复
#
# 把演练的结论整理成值班时查的表。“指标”一列是 PromQL 写法；数字来自本章的演练。
#
# | 症状 | 看哪个指标（本章的读数） | 可能原因 | 先止血 | 再治本 |
# |---|---|---|---|---|
# | TTFT 持续上涨，ITL 正常 | `vllm:num_requests_waiting` 线性增长、`vllm:num_requests_running` 顶在 `max_num_seqs`（事故 5：waiting 涨到 {{fp5["waiting"]:.0f}}） | 到达率 > 容量（流量激增、副本变少） | 限流 / 返回 429，扩容 | 按峰值 + 余量做容量规划（第 30 章） |
# | 吞吐下降、TTFT 与尾延迟上涨 | `vllm:kv_cache_usage_perc` ≈ 1 且 `rate(vllm:num_preemptions_total)` > 0（事故 1：{{fp1["preempt_s"]:.1f}} 次/s） | KV 池太小：`gpu_memory_utilization` 太低、`max_num_seqs` 太大、输出变长 | 降 `max_num_seqs`，保守准入 | 把显存还给 KV、换更大显存的卡 |
# | 指标都正常，但 KV 使用率一路爬升 | 空闲时（running = waiting = 0）`vllm:kv_cache_usage_perc` > 0（事故 3：{{idle_kv:.0%}}） | KV 泄漏：某条路径不释放块 | 滚动重启 | 找到泄漏路径（中止、超时、出错分支），加告警 |
# | ITL / TPOT 尾部尖峰，TTFT 偶发尖峰 | ITL p99 尖峰（事故 4：{{fp4["itl_p99"] * 1e3:.0f}} ms）、`vllm:iteration_tokens_total` 的高桶有计数 | 长提示词整段预填充，生成停顿 | 分块预填充 + 小 Token 预算 | 把预填充与解码分开（第 27 章的 PD 分离） |
# | 一个副本延迟高、队列长，其他正常 | 按副本比较每步耗时与同批大小的基准（事故 2：{{dec_ratio[1]:.1f}} 倍） | 慢副本：降频、功耗、邻居、链路 | 按负载路由（`least_requests`），摘除 | 换机器、查硬件 |
# | 一个副本的曲线中断，其余副本排队 | `up == 0`，剩余副本的 waiting 上涨（事故 6） | 副本宕机，剩余容量不够 | 重新分发（路由器重试），拉起替补 | N+1 冗余 |
# | 用户说慢，服务端面板正常 | 客户端 / 网关的 TTFT 与服务端 TTFT 之差（29.5：{{gap_slow:.2f}} s） | 引擎之前的延迟：网络、网关、API 层 | 定位是哪一跳 | 在每一跳加延迟指标 |
# | 用户看到错误，服务端计数正常 | 路由器 / 负载均衡的 5xx（29.5：{{err["failed"]}} 个失败不在 vLLM 计数里） | 引擎之外的失败 | 重试到别的副本 | 修复出错的那一层 |
#
# ## 29.7 动手：调一调故障的强度
#
# 控件选择一种故障并调它的强度，画出面板与指纹。建议：把 `gpu_memory_utilization` 从 0.40 慢慢降到 0.33，找出抢占风暴出现的阈值；
# 把泄漏间隔 `every` 从 10 调到 2，看 KV 曲线的斜率；把慢副本的倍数从 1.5 调到 4，看轮询路由在多慢时开始排队。

# %% tags=["nbval-ignore-output"]
def explore(fault="storm: gpu_memory_utilization", strength=0.34):
    if fault.startswith("storm"):
        res, scs = serve_one(base_wl, engine(gpu_memory_utilization=strength))
    elif fault.startswith("leak"):
        eng = engine()
        leak_kv(eng, every=max(1, int(round(strength))))
        res, scs = serve_one(base_wl, eng)
    else:
        engines = [engine() for _ in range(2)]
        slow_down(engines[1], factor=strength, start_s=15.0)
        res, scs = serve_cluster(traffic([(0, DURATION, 16.0)], seed=2), engines)
    display(metrics_dashboard(scs, WINDOW_S, title=f"{fault} = {strength:g}"))
    md_table(FP_HEADER, [fp_row(f"SLO met {res.summary(slo=SLO)['slo_attainment']:.0%}", fingerprint(scs))])


W.interact(explore, fault=W.Dropdown(options=["storm: gpu_memory_utilization", "leak: every", "slow replica: factor"]),
           strength=W.FloatText(value=0.34, description="strength"));

# %% [markdown]
# ## 小结
#
# - 排障的三件工具：Prometheus 指标（vLLM 的名字，minibatch 的 `ServingMetrics` 原样暴露）、引擎时间线（`StepRecord`）、
#   客户端视角。面板先告诉你**哪类**问题，时间线再告诉你**为什么**。
# - Gauge 看当前值，Counter 看 `rate()`，Histogram 用 `histogram_quantile()`；分位数只精确到桶，抓取间隔之内的事看不见。
# - 六类故障各有指纹：排队是 waiting 线性增长、running 顶满；抢占风暴是 KV 顶满加抢占速率；KV 泄漏是空闲时 KV 不归零；
#   长预填充是 ITL 尖峰与大步；慢副本是同样的批、数倍的步长；宕机是 `up == 0` 与剩余副本的排队。
# - 每次修复都要重跑、用同一组指标验证回到基线；止血（限流、路由、重启）与治本（扩容、改配置、修 bug）分开做。
# - 服务端指标有盲区：进入引擎之前的延迟与失败，要从客户端、网关或路由器看。
#
# 下一章（第 30 章）把整门课收束到容量规划：一个 QPS 目标需要多少 GPU、每百万 Token 花多少钱，并把第 1 章的 RAG 案例从头复盘一遍。
#
# ## 练习
#
# 1. **抢占风暴的阈值。** 在 `gpu_memory_utilization` ∈ {0.40, 0.37, 0.35, 0.34, 0.33} 上重跑事故 1，画出抢占速率与 SLO 达成率。
#    用 `make_cost_model("llama-2-13b", "4xa10").kv_capacity_tokens(u)` 与“running × 平均序列长度”解释阈值在哪里。
# 2. **泄漏要多久才出事。** 用 `leak_kv(engine, every=k)` 在 `k` ∈ {2, 3, 5, 10} 下，根据 KV 曲线的斜率估计池被吃满的时间；
#    再把 `DURATION` 加长到那个时间之后，验证抢占确实出现。
# 3. **告警规则。** 为六个事故各写一条 Prometheus 告警表达式（例如 `vllm:num_requests_waiting > 10` 持续 30 s），
#    用本章的 `Scraper` 在每个事故与基线上求值：哪条规则会在基线上误报？哪条会漏报事故 3？
# 4. **慢副本与路由器。** 事故 2 里把路由器换成 `power_of_two` 与 `kv_aware`（`minibatch.cluster.routers.available()`），
#    比较发给慢副本的请求数与 SLO 达成率。什么信息能让路由器更早发现慢副本？
# 5. **抓取间隔。** 把 `SCRAPE_S` 改成 15 s（Prometheus 示例配置的值），重画事故 4 的面板：ITL 尖峰还看得见吗？
#    直方图与 Gauge 在这件事上有什么不同？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 阈值大约在 KV 容量 ≈ 正常批占用的 KV 处：8 QPS 时批里约 {{base_fp["running"]:.0f}} 个请求、每个约 280 Token；
#    容量低于它之后，每降一点，抢占速率都急剧上升（抖动是正反馈：被抢占者重算时又挤掉别人）。
# 2. 斜率按 `np.polyfit` 取；泄漏的块数约为“结束的请求数 / k × 每个请求的块数”，所以斜率与到达率成正比、与 k 成反比。
#    池满之前一切正常，这正是泄漏危险的地方。
# 3. 规则在 `Scraper.values(...)` 与 `rate(...)` 上用 numpy 求值即可。只看延迟的规则会漏掉事故 3（延迟正常）；
#    `vllm:kv_cache_usage_perc > 0.9` 会在正常的高负载时误报，要与抢占速率一起看；空闲时 KV 不归零那条规则在基线上从不触发。
# 4. `power_of_two` 与 `least_requests` 一样看在途请求数，会少给慢副本；`kv_aware` 看 KV 块，慢副本的 KV 也更满，效果类似。
#    更早的信号是每个副本的步长或 TPOT：在途请求数要等队列积起来才变化，步长一变慢就能看到。
# 5. 15 s 的间隔里，Gauge 只取到这一刻的值，两次抓取之间的尖峰完全看不见；直方图是累积计数，尖峰里的那些 ITL 仍然被计入
#    15 s 窗口的桶，p99 看得见，但时间分辨率只有 15 s。这就是延迟一定要用直方图（或 Summary）而不是 Gauge 暴露的原因。
#
# </details>
#
# **本章引用**：vLLM 0.10 系列 `vllm/v1/metrics/loggers.py`（`PrometheusStatLogger`，commit 005a810）；Prometheus `promql/quantile.go`
# （`bucketQuantile`）、`promql/functions.go`（`rate`）、`documentation/examples/prometheus.yml`；Beyer et al., *Site Reliability Engineering*
# （O'Reilly 2016）第 6 章 Monitoring Distributed Systems；vLLM issues #46283、#27073；Sarathi-Serve（Agrawal et al., OSDI'24）。
