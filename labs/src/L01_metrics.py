# %% [markdown]
# # L01 · 从事件日志计算 TTFT、TPOT、ITL 与 Goodput
#
# 对应章节：第 8 章《评估体系与压测方法论》。
#
# 评估一个推理服务，第一步是把“延迟”说清楚。本实验从最原始的数据——引擎的事件日志（Event Log）——出发，
# 亲手算出首 Token 延迟（TTFT, Time To First Token）、每输出 Token 延迟（TPOT, Time Per Output Token）、
# Token 间延迟（ITL, Inter-Token Latency）、端到端延迟（E2E Latency）、百分位数（Percentile）与有效吞吐（Goodput），
# 并与 `minibatch.results` 的实现逐项对账。`minibatch.results` 的定义与 `vllm bench serve` 一致，
# 所以你在这里写对的代码，换到 vLLM 的压测报告上也读得懂。
#
# **学习目标**
#
# - 能从 `(time, event, request_id, info)` 形式的事件日志还原每个请求的时间线；
# - 能准确区分 TPOT 与 ITL：TPOT 不含首 Token，是一个请求的平均值；ITL 是每一个相邻 Token 的间隔；
# - 能用线性插值（Linear Interpolation）计算百分位数，并解释为什么 p99 比均值更能反映用户体验；
# - 能在服务等级目标（SLO, Service Level Objective）下计算 Goodput 与 SLA 达成率（SLA Attainment）。
#
# **怎么做**：只修改带 `task:N` 标签的“任务单元格”，把其中的 `raise NotImplementedError(...)` 换成你的实现；
# 紧随其后的“检查单元格”（`check:N` 标签）会断言你的结果。全部完成后，在终端里评分：
#
# ```bash
# python -m minibatch.labs check L01 labs/L01_metrics.ipynb
# ```
#
# 检查单元格下方已保存的输出来自参考答案，你的运行结果应当与之一致。

# %%
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np

import minibatch.results
from minibatch.results import meets_slo, records_from_events, summarize

# %% [markdown]
# ## 1. 事件日志（Event Log）
#
# 引擎在每个请求的生命周期里发出事件，每条事件是一个四元组 `(time, event, request_id, info)`，时间单位为秒：
#
# | event | 含义 | info |
# |---|---|---|
# | `arrival` | 请求到达服务 | `prompt_len` |
# | `schedule` | 请求被调度进批次（引擎只记第一次；手写日志里可能重复，只有第一次算数） | |
# | `first_token` | 第一个输出 Token（紧接着还有一条同一时刻的 `token`） | |
# | `token` | 产出一个输出 Token（每个 Token 一条） | |
# | `preempt` | 请求被抢占（Preemption），KV 被回收 | |
# | `finish` | 请求正常结束 | `reason`：`"length"`（达到 `max_tokens`）或 `"stop"` |
# | `abort` / `reject` | 客户端取消 / 请求被拒绝 | `reject` 带 `error` |
#
# 下面是一份手写的小日志，五个请求各有特点：`b` 中途被抢占（注意它的 Token 间隔），`c` 只产出一个 Token，
# `d` 还没出 Token 就被客户端取消，`e` 以 `stop` 结束。日志已按时间排序（同一时刻的事件保持记录顺序）。

# %%
EVENTS = [
    (0.00, "arrival", "a", {"prompt_len": 12}),
    (0.00, "schedule", "a", {}),
    (0.05, "arrival", "b", {"prompt_len": 30}),
    (0.10, "token", "a", {}),
    (0.15, "token", "a", {}),
    (0.15, "schedule", "b", {}),
    (0.20, "arrival", "c", {"prompt_len": 8}),
    (0.22, "token", "a", {}),
    (0.22, "token", "b", {}),
    (0.22, "schedule", "c", {}),
    (0.25, "arrival", "d", {"prompt_len": 500}),
    (0.30, "token", "a", {}),
    (0.30, "finish", "a", {"reason": "length"}),
    (0.30, "token", "b", {}),
    (0.30, "token", "c", {}),
    (0.30, "finish", "c", {"reason": "length"}),
    (0.31, "arrival", "e", {"prompt_len": 16}),
    (0.32, "preempt", "b", {}),
    (0.32, "schedule", "e", {}),
    (0.40, "token", "e", {}),
    (0.40, "abort", "d", {}),
    (0.45, "token", "e", {}),
    (0.50, "token", "e", {}),
    (0.50, "finish", "e", {"reason": "stop"}),
    (0.52, "schedule", "b", {}),
    (0.60, "token", "b", {}),
    (0.65, "token", "b", {}),
    (0.65, "finish", "b", {"reason": "length"}),
]
print(len(EVENTS), "events,", len({e[2] for e in EVENTS}), "requests")

# %% [markdown]
# 先用引擎自己的 `records_from_events` 把这份日志画成时间线（这是参考实现，不是你的任务）：
# 横条从到达（Arrival）到结束，竖线是每个输出 Token 的时刻，浅色段是首 Token 之前的等待。

# %%
records = {r.request_id: r for r in records_from_events(EVENTS)}
fig, ax = plt.subplots(figsize=(7, 2.6))
for y, (rid, r) in enumerate(sorted(records.items())):
    end = r.finish_time
    first = r.first_token_time if r.first_token_time is not None else end
    ax.barh(y, first - r.arrival_time, left=r.arrival_time, color="#f2c6a0", height=0.5)
    ax.barh(y, end - first, left=first, color="#8fb8de", height=0.5)
    ax.vlines(r.token_times, y - 0.3, y + 0.3, color="k", lw=1.5)
    ax.text(end + 0.005, y, r.finish_reason, va="center", fontsize=8)
ax.set_yticks(range(len(records)), sorted(records))
ax.set_xlabel("time (s)")
ax.set_title("before the first token (orange), decoding (blue), tokens (|)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 任务 1 · 按请求整理事件（timelines）
#
# 把事件日志整理成每个请求一条时间线 `Timeline`（数据结构已给出）。规则与引擎一致：
#
# - `arrival` 新建时间线，`arrival` 记到达时刻；
# - 第一次 `schedule` 记为 `first_scheduled`（之后的 `schedule` 忽略）；
# - 每个 `token` 把时刻追加到 `token_times`；
# - `finish` 记 `finish` 时刻，`reason` 取 `info` 里的 `"reason"`（缺省为 `"length"`）；
#   `abort` 的 `reason` 为 `"abort"`，`reject` 的为 `"rejected"`；
# - 其他事件（如 `preempt`、`first_token`）不影响时间线。
#
# 返回 `{request_id: Timeline}`，字典的顺序按请求到达的顺序。

# %%
@dataclass
class Timeline:
    """One request's life, rebuilt from the event log (times in seconds)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finish: float | None = None
    reason: str | None = None          # "length" | "stop" | "abort" | "rejected"; None while running

    @property
    def completed(self) -> bool:
        return self.reason in ("length", "stop")

# %% tags=["task:1"]
def timelines(events) -> dict[str, Timeline]:
    """Group ``(time, event, request_id, info)`` events into one Timeline per request."""
    ### BEGIN SOLUTION
    out: dict[str, Timeline] = {}
    for time, event, rid, info in sorted(events, key=lambda e: e[0]):
        info = info or {}
        if event == "arrival":
            out[rid] = Timeline(arrival=time)
            continue
        tl = out[rid]
        if event == "schedule" and tl.first_scheduled is None:
            tl.first_scheduled = time
        elif event == "token":
            tl.token_times.append(time)
        elif event in ("finish", "abort", "reject"):
            tl.finish = time
            tl.reason = {"finish": info.get("reason", "length"), "abort": "abort", "reject": "rejected"}[event]
    return out
    ### END SOLUTION

# %% tags=["check:1"]
tls = timelines(EVENTS)
assert list(tls) == ["a", "b", "c", "d", "e"], f"requests in arrival order, got {list(tls)}"
assert tls["b"].token_times == [0.22, 0.30, 0.60, 0.65], tls["b"].token_times
assert tls["b"].first_scheduled == 0.15, "the first schedule counts, not the one after the preemption"
assert (tls["d"].reason, tls["d"].finish, tls["d"].token_times) == ("abort", 0.40, [])
assert tls["e"].reason == "stop" and tls["c"].completed and not tls["d"].completed
for rid, rec in records.items():        # the engine's records, rebuilt from the same log
    tl = tls[rid]
    assert (tl.arrival, tl.token_times, tl.first_scheduled, tl.finish, tl.reason) == \
        (rec.arrival_time, rec.token_times, rec.first_scheduled_time, rec.finish_time, rec.finish_reason), rid
for rid, tl in tls.items():
    print(rid, tl.reason, len(tl.token_times), "tokens")

# %% [markdown]
# ## 任务 2 · 单请求指标：TTFT、TPOT、ITL、E2E
#
# 记请求的到达时刻为 $a$，输出 Token 的时刻为 $t_1 < t_2 < \dots < t_n$，结束时刻为 $e$。按 `vllm bench serve` 的定义：
#
# $$\mathrm{TTFT} = t_1 - a, \qquad \mathrm{E2E} = e - a, \qquad
# \mathrm{TPOT} = \frac{t_n - t_1}{n - 1}, \qquad \mathrm{ITL} = [\,t_2 - t_1,\ t_3 - t_2,\ \dots,\ t_n - t_{n-1}\,].$$
#
# 要点：
#
# - TPOT **不含首 Token**：首 Token 的等待已经计入 TTFT，分母是 $n-1$；只有一个 Token 时 TPOT 无定义，返回 `None`；
# - ITL 是**每一个**相邻间隔组成的列表，不做平均——请求 `b` 被抢占造成的 0.30 s 停顿会原样出现在 ITL 里，
#   却被 TPOT 的平均摊薄了；
# - 还没有首 Token 的请求，`ttft` 返回 `None`；还没结束的请求，`e2e` 返回 `None`。

# %% tags=["task:2"]
def ttft(tl: Timeline) -> float | None:
    ### BEGIN SOLUTION task 2
    return tl.token_times[0] - tl.arrival if tl.token_times else None
    ### END SOLUTION


def tpot(tl: Timeline) -> float | None:
    ### BEGIN SOLUTION task 2
    n = len(tl.token_times)
    return (tl.token_times[-1] - tl.token_times[0]) / (n - 1) if n >= 2 else None
    ### END SOLUTION


def itl(tl: Timeline) -> list[float]:
    ### BEGIN SOLUTION task 2
    return [b - a for a, b in zip(tl.token_times, tl.token_times[1:])]
    ### END SOLUTION


def e2e(tl: Timeline) -> float | None:
    ### BEGIN SOLUTION task 2
    return tl.finish - tl.arrival if tl.finish is not None else None
    ### END SOLUTION

# %% tags=["check:2", "needs:1"]
def close(x, y):
    if x is None or y is None:
        return x is None and y is None
    if isinstance(x, list):
        return len(x) == len(y) and all(close(p, q) for p, q in zip(x, y))
    return abs(x - y) < 1e-9

tls = timelines(EVENTS)
assert close(ttft(tls["b"]), 0.17) and close(tpot(tls["b"]), (0.65 - 0.22) / 3)
assert close(itl(tls["b"]), [0.08, 0.30, 0.05]), "ITL keeps every gap, the preemption stall included"
assert tpot(tls["c"]) is None and itl(tls["c"]) == [], "one token: no TPOT, no ITL"
assert ttft(tls["d"]) is None and close(e2e(tls["d"]), 0.15)
for rid, rec in records.items():
    tl = tls[rid]
    for name, mine, ref in [("ttft", ttft(tl), rec.ttft), ("tpot", tpot(tl), rec.tpot),
                            ("itl", itl(tl), rec.itl), ("e2e", e2e(tl), rec.e2e)]:
        assert close(mine, ref), f"{rid}.{name}: yours {mine}, minibatch.results {ref}"
fmt = lambda v: "  -  " if v is None else f"{v:.3f}"
print("req  TTFT   TPOT   E2E    ITL")
for rid, tl in tls.items():
    print(f"{rid}    {fmt(ttft(tl))}  {fmt(tpot(tl))}  {fmt(e2e(tl))}  {[round(g, 3) for g in itl(tl)]}")

# %% [markdown]
# 引擎里的定义就是这几行（`minibatch.results.tpot`：引擎的请求记录 `RequestRecord` 和压测客户端
# `minibatch.bench` 共用这一个函数），你的实现与它逐项相同：

# %%
print(inspect.getsource(minibatch.results.tpot))

# %% [markdown]
# ## 任务 3 · 百分位数（Percentile）
#
# 压测报告里的 p50 / p90 / p99 用的是线性插值：把 $n$ 个值从小到大排序为 $x_0 \le \dots \le x_{n-1}$，
# 第 $p$ 百分位的位置是 $r = \frac{p}{100}(n-1)$，取 $k = \lfloor r \rfloor$，
#
# $$P_p = x_k + (x_{k+1} - x_k)\,(r - k)$$
#
# （$r$ 恰为整数时就是 $x_r$）。这正是 `numpy.percentile` 的默认方法，也是 `vllm bench serve` 用的方法。
# 请**不要**调用 `np.percentile` / `np.quantile`，用排序和上面的公式自己实现；空列表返回 `nan`。

# %% tags=["task:3"]
def percentile(values, p: float) -> float:
    """The p-th percentile (0 <= p <= 100) of ``values`` by linear interpolation."""
    ### BEGIN SOLUTION
    xs = sorted(values)
    if not xs:
        return float("nan")
    r = p / 100 * (len(xs) - 1)
    k = int(r)
    if k + 1 >= len(xs):
        return float(xs[-1])
    return float(xs[k] + (xs[k + 1] - xs[k]) * (r - k))
    ### END SOLUTION

# %% tags=["check:3"]
rng = np.random.default_rng(0)
for n in (1, 2, 3, 10, 101, 1000):
    xs = rng.lognormal(size=n).tolist()
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        want = float(np.percentile(xs, p))
        got = percentile(xs, p)
        assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), f"n={n}, p={p}: yours {got}, numpy {want}"
assert np.isnan(percentile([], 50))
assert percentile([3, 1, 2], 50) == 2.0, "sort first"
print("p50, p90, p99 of 1..100:", [round(percentile(range(1, 101), p), 6) for p in (50, 90, 99)])

# %% [markdown]
# ## 任务 4 · Goodput 与 SLA 达成率
#
# 吞吐量（Throughput）数的是所有完成的请求；Goodput 只数**满足 SLO 的**完成请求。给定 SLO，例如
# `{"ttft": 0.2, "tpot": 0.03}`（秒），一个请求“达标”当且仅当：
#
# - 它正常完成（`reason` 为 `"length"` 或 `"stop"`；取消、拒绝的不算）；
# - SLO 里的每一项指标都不超过上限（`<=`）；指标可以是 `"ttft"`、`"tpot"`、`"e2e"`；
# - 例外：只有一个 Token 的请求没有 TPOT，对它**跳过** `"tpot"` 这一项。
#
# 设所有请求中最早的到达为 $a_{\min}$，已完成请求中最晚的结束为 $e_{\max}$，时长 $T = e_{\max} - a_{\min}$，则
#
# $$\mathrm{Goodput} = \frac{\#\text{达标请求}}{T}\ (\text{req/s}), \qquad
# \text{SLA 达成率} = \frac{\#\text{达标请求}}{\#\text{全部请求}}.$$
#
# 返回 `(goodput, attainment)`；没有完成的请求时两者都为 `0.0`。请使用你在任务 2 中写的函数。

# %% tags=["task:4"]
METRICS = {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def goodput(tls: dict[str, Timeline], slo: dict[str, float]) -> tuple[float, float]:
    """(requests per second that meet every bound of ``slo``, fraction of all requests that do)."""
    ### BEGIN SOLUTION
    def good(tl: Timeline) -> bool:
        if not tl.completed:
            return False
        for key, bound in slo.items():
            value = METRICS[key](tl)
            if key == "tpot" and value is None:
                continue
            if value is None or value > bound:
                return False
        return True

    ends = [tl.finish for tl in tls.values() if tl.completed]
    if not ends:
        return 0.0, 0.0
    duration = max(ends) - min(tl.arrival for tl in tls.values())
    n_good = sum(good(tl) for tl in tls.values())
    return (n_good / duration if duration > 0 else 0.0), n_good / len(tls)
    ### END SOLUTION

# %% tags=["check:4", "needs:1", "needs:2"]
tls = timelines(EVENTS)
slo = {"ttft": 0.15, "tpot": 0.07}
gp, att = goodput(tls, slo)
ref = summarize(list(records.values()), slo=slo)
assert abs(gp - ref["goodput"]) < 1e-9 and abs(att - ref["slo_attainment"]) < 1e-9, (gp, att, ref["goodput"])
assert att == 0.6, "a, c and e meet the SLO: c has no TPOT, d was aborted, b's TTFT is 0.17 s"
gp25, att25 = goodput(tls, {"e2e": 0.25})
assert abs(gp25 - 2 / 0.65) < 1e-9 and att25 == 0.4, "c and e finish within 0.25 s of arriving"
assert goodput({"x": Timeline(0.0, [0.1], 0.0)}, slo) == (0.0, 0.0), "nothing finished yet"
print(f"goodput = {gp:.3f} req/s, SLA attainment = {att:.0%}")

# %% [markdown]
# ## 2. 用引擎产生的日志对账
#
# 手写日志太小，容易“碰巧对”。下面让引擎在模拟器（Simulator）里跑 200 个请求：LLaMA-2-7B、A100-80G，
# 输入输出长度服从对数正态分布（LogNormal），到达率 12 req/s；我们订阅引擎的事件流（`engine.subscribe`），
# 得到一份真实的事件日志。模拟器用成本模型给出每步耗时，配合虚拟时钟（Virtual Clock），结果完全可复现。

# %%
from minibatch import EngineConfig, LLMEngine
from minibatch.runner import run
from minibatch.workload import lognormal, synthetic

engine = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g",
                                            max_num_seqs=16), clock="virtual")
LOG = []
engine.subscribe(lambda event, t, req, info: LOG.append((t, event, req.request_id, info)))
workload = synthetic(200, rate=12, input_len=lognormal(median=256, sigma=0.8, max=2048),
                     output_len=lognormal(median=64, sigma=0.8, max=512), seed=7)
result = run(workload, engine=engine)
print(len(LOG), "events from", len(result.requests), "requests; first:", LOG[0][:3])

# %% [markdown]
# 用你的四个任务拼出一张压测报告，与 `summarize(records_from_events(LOG))` 逐项比较。

# %%
def my_report(events, slo):
    """TTFT/TPOT/ITL/E2E mean and percentiles plus goodput, from your functions only."""
    tls = timelines(events)
    done = [tl for tl in tls.values() if tl.completed]
    series = {"ttft": [ttft(tl) for tl in done], "tpot": [tpot(tl) for tl in done if tpot(tl) is not None],
              "itl": [g for tl in done for g in itl(tl)], "e2e": [e2e(tl) for tl in done]}
    out = {}
    for name, xs in series.items():
        out[f"{name}_mean"] = sum(xs) / len(xs)
        for p in (50, 90, 99):
            out[f"{name}_p{p}"] = percentile(xs, p)
    out["goodput"], out["slo_attainment"] = goodput(tls, slo)
    return out

# %% tags=["check:4", "needs:1", "needs:2", "needs:3"]
SLO = {"ttft": 0.2, "tpot": 0.03}
mine = my_report(LOG, SLO)
ref = summarize(records_from_events(LOG), slo=SLO)
for k, v in mine.items():
    assert abs(v - ref[k]) <= 1e-9 * max(1.0, abs(ref[k])), f"{k}: yours {v}, minibatch.results {ref[k]}"
print("metric   mean    p50     p90     p99   (ms)")
for name in ("ttft", "tpot", "itl", "e2e"):
    print(f"{name:6s}" + "".join(f"{1000 * mine[f'{name}_{s}']:8.1f}" for s in ("mean", "p50", "p90", "p99")))
print(f"goodput {mine['goodput']:.2f} req/s, SLA attainment {mine['slo_attainment']:.1%}")

fig, ax = plt.subplots(figsize=(6, 2.6))
tls = timelines(LOG)
gaps = np.array([g for tl in tls.values() for g in itl(tl)]) * 1000
ax.hist(gaps, bins=np.logspace(np.log10(gaps.min()), np.log10(gaps.max()), 50), color="#8fb8de")
ax.set_xscale("log")
for s, ls in (("p50", "-"), ("p99", "--")):
    ax.axvline(1000 * mine[f"itl_{s}"], color="k", ls=ls, label=f"ITL {s}")
ax.axvline(1000 * mine["tpot_p99"], color="C3", ls=":", label="TPOT p99")
ax.set_xlabel("inter-token latency (ms)")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 小结
#
# - TTFT 由排队与预填充（Prefill）决定，TPOT/ITL 由解码（Decode）步的长短决定；
# - 上表中 ITL 的 p99 远高于 TPOT 的 p99：长 Prompt 的预填充插进批次时，正在解码的请求会“卡”一步，
#   这种停顿只在 ITL 里看得见，在 TPOT 的平均中被摊薄——这就是第 11 章分块预填充（Chunked Prefill）要解决的问题；
# - Goodput 把延迟和吞吐放进同一个数：吞吐再高，不达标的请求也不算数。第 19 章会在 SLA 下搜索使 Goodput 最大的配置。
#
# **思考题**：把 `SLO` 中的 `tpot` 改为 `0.015`，SLA 达成率会怎样变化？为什么 TPOT 的上限比 TTFT 的更“敏感”？
