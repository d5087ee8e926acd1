# %% [markdown]
# # 第 31 章 异步调度：让调度与计算重叠（Async Scheduling）
#
# 第 9 章把一步（Step）拆成五段：调度 → KV 分配 → 执行 → 采样 → 更新。执行（模型前向）在 GPU 上，其余四段都在 CPU 上，
# 而且在同步引擎里它们**串行**：GPU 算完第 N 步，CPU 才开始记账、检查停止条件、为第 N+1 步排批、准备输入，这段时间 GPU 空着。
# 模型越小、GPU 越快，这段空档占一步的比例越大。2025 年起，三家主流引擎都把它藏到了前向后面：
# vLLM 的异步调度（Async Scheduling，`--async-scheduling`，PR #27614 改为默认打开，v0.14.0 起的发行版默认打开）、SGLang 的重叠调度器（Overlap Scheduler，默认打开）、
# TensorRT-LLM PyTorch 后端的重叠调度器（默认打开）。做法相同：**第 N 步在 GPU 上算的时候，CPU 已经在规划第 N+1 步**。
#
# 本章在 minibatch 里实现它（`EngineConfig.async_scheduling`，`minibatch/overlap.py`），测量它在真实 tiny 模型和模拟的 H100 上省下多少，
# 以及它的代价：新请求的首 Token 晚一步、请求结束时多算一个被丢掉的 Token。
#
# ## 学习目标
#
# - 量出一步里 CPU 占了多少时间（调度 + 准备输入 + 记账），并说明它为什么在小模型、快 GPU 上更重要；
# - 画出重叠的时间线：第 N 步的前向与第 N+1 步的规划并行；理解输出占位符（Output Placeholder）——还没采样出来的 Token 先占一个位置；
# - 在模拟的 Llama-3-8B / H100 上测量异步调度对每输出 Token 延迟（TPOT）与首 Token 延迟（TTFT）的影响（稳态，3 个种子）；
# - 说清它的代价：新到的请求要等一步才能被排进批；一个请求在第 N 步结束时，它在第 N+1 步的位置白算；停止字符串与抢占怎样与之相处；
# - 验证贪心输出逐 Token 不变；读懂 vLLM v0.11.0、SGLang 0.5.3 与 TensorRT-LLM 的对应代码与默认值。

# %%
import inspect
import os
import statistics
import time

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import LLM, EngineConfig, LLMEngine, SamplingParams
from minibatch.executor import ModelExecutor
from minibatch.overlap import OverlapScheduler
from minibatch.runner import run
from minibatch.sim import get_model_spec, make_cost_model
from minibatch.sim.executor import SimExecutor
from minibatch.viz import md_table
from minibatch.workload import synthetic

torch.set_num_threads(1)   # the tiny model's matrices are small: one thread avoids oversubscribing a shared CPU
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 31.1 一步里的 CPU 时间
#
# 先在同步引擎上量一步的构成。嵌入的 tiny 模型在 CPU 上跑，我们给调度器的 `schedule` 和执行器的 `prepare` 计时，
# 前向加采样的时间来自 `StepRecord.forward_time`，一步的墙钟时间减去这三段就是记账（追加 Token、停止检查、事件、`StepRecord`）。
# 只统计解码步（没有预填充），取中位数：

# %%
def anatomy(batch: int, max_tokens: int = 48, seed: int = 0) -> dict:
    """Median seconds per decode step of a synchronous engine: schedule, prepare, forward + sampling, bookkeeping."""
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=batch))
    rng = np.random.default_rng(seed)
    for _ in range(batch):
        engine.add_request(rng.integers(3, 250, 24).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    parts = {"schedule": [], "prepare": []}

    def timed(obj, name, key):
        orig = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = orig(*a, **k)
            parts[key].append(time.perf_counter() - t)
            return out
        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.executor, "prepare", "prepare")
    rows = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        s = engine.steps[-1]
        if s.num_prefill_tokens == 0 and len(engine.steps) > 3:
            sched, prep = parts["schedule"][-1], parts["prepare"][-1]
            rows.append((sched, prep, s.forward_time, wall - sched - prep - s.forward_time))
    med = [statistics.median(col) for col in zip(*rows)]
    return dict(zip(("schedule", "prepare", "forward", "bookkeeping"), med))


BATCHES = (1, 4, 16)
tiny_parts = {b: anatomy(b) for b in BATCHES}
cpu_share = {b: 1 - p["forward"] / sum(p.values()) for b, p in tiny_parts.items()}
md_table(["batch", "schedule (ms)", "prepare (ms)", "forward + sampling (ms)", "bookkeeping (ms)", "CPU share"],
         [[b, *(f"{p[k] * 1e3:.3f}" for k in ("schedule", "prepare", "forward", "bookkeeping")), f"{cpu_share[b]:.0%}"]
          for b, p in tiny_parts.items()])

# %% tags=["check"]
assert all(p["forward"] > 0 and p["schedule"] > 0 for p in tiny_parts.values())
assert all(0 < s < 1 for s in cpu_share.values())
assert cpu_share[BATCHES[0]] > cpu_share[BATCHES[-1]], "the prose says the CPU share falls as the batch grows"

# %% [markdown]
# 这台机器上（测量时负载 {{os.getloadavg()[0]:.1f}}，{{os.cpu_count()}} 个核），批大小 {{BATCHES[0]}} 时一步里 CPU 的部分（调度 + 准备 + 记账）占
# {{cpu_share[BATCHES[0]]:.0%}}，批大小 {{BATCHES[-1]}} 时占 {{cpu_share[BATCHES[-1]]:.0%}}。minibatch 的 CPU 前向本身就是 CPU 时间，
# 批越大前向越长，调度与记账的占比随之变小。在 GPU 上情况相反：前向很快，CPU 的部分就显得大。
# 模拟器用 `HardwareSpec.step_overhead_s` 表示这部分（`minibatch/sim/hardware.py`，默认 2 ms 一步，是模拟器自己的假设，不是从某个框架测来的）。
# 模拟的 Llama-3-8B / H100，上下文 1024 个 Token 的解码步：

# %%
cm = make_cost_model(get_model_spec("llama-3-8b"), "h100")
SIM_BATCHES = (1, 8, 32, 128, 256)
sim_parts = {b: cm.breakdown([], [1024] * b) for b in SIM_BATCHES}
sim_share = {b: p["overhead"] / sum(p.values()) for b, p in sim_parts.items()}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
names = ("schedule", "prepare", "forward", "bookkeeping")
for ax, data, title in ((axes[0], {b: [tiny_parts[b][k] for k in names] for b in BATCHES}, "tiny model on this CPU"),
                        (axes[1], {b: [p["overhead"], sum(p.values()) - p["overhead"]] for b, p in sim_parts.items()},
                         "llama-3-8b on an H100 (simulator)")):
    labels = names if len(next(iter(data.values()))) == 4 else ("CPU overhead", "forward")
    bottom = np.zeros(len(data))
    for i, label in enumerate(labels):
        vals = np.array([v[i] for v in data.values()]) * 1e3
        ax.bar([str(b) for b in data], vals, bottom=bottom, label=label)
        bottom += vals
    ax.set(xlabel="decode batch size", ylabel="ms per step", title=title)
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% tags=["check"]
assert sim_share[1] > sim_share[256] > 0, "the prose says the CPU share falls as the batch grows"

# %% [markdown]
# 模拟的 H100 上，批大小 {{SIM_BATCHES[0]}} 的一步前向只要 {{(sum(sim_parts[1].values()) - sim_parts[1]["overhead"]) * 1e3:.1f}} ms，
# 2 ms 的 CPU 开销占 {{sim_share[1]:.0%}}；批大小 {{SIM_BATCHES[-1]}} 时仍占 {{sim_share[256]:.0%}}。这就是异步调度要藏起来的部分。
#
# ## 31.2 重叠的时间线
#
# 同步引擎里，CPU 与 GPU 轮流干活：
#
# ```
# CPU: [规划 N][      等待      ][记账 N][规划 N+1][      等待      ][记账 N+1] ...
# GPU:         [   前向 N      ]                  [   前向 N+1    ]
# ```
#
# 异步调度让 CPU 提前一步：第 N 步的前向一开始，CPU 就去做第 N−1 步的记账和第 N+1 步的规划（排批、分 KV 块、准备输入）。
# 难点在于第 N+1 步的输入里有第 N 步才会采样出来的 Token。vLLM 的办法是**输出占位符**：规划第 N+1 步时，
# 假设每个在第 N 步采样的请求都会得到一个 Token，用一个占位符占住它的位置（`num_output_placeholders`），
# 真正的 Token ID 在第 N+1 步前向开始前才填进输入张量，在 GPU 上直接拷，不经过 CPU
# （v0.11.0 `vllm/v1/worker/gpu_model_runner.py` 的 `_prepare_input_ids` 把上一步留在 GPU 上的 `prev_sampled_token_ids` 拷进 `input_ids`）。下面按 31.1 节模拟器的数字画出两种时间线：

# %%
B = 32
fwd = sum(sim_parts[B].values()) - sim_parts[B]["overhead"]
ovh = sim_parts[B]["overhead"]


def timeline(ax, overlap: bool, steps: int = 4):
    """Draw CPU and GPU lanes: each step's CPU work (plan the next step + bookkeeping) and its forward."""
    t = 0.0
    for n in range(steps):
        if overlap:
            ax.broken_barh([(t, fwd)], (0, 0.8), color="C0")
            ax.broken_barh([(t, ovh)], (1, 0.8), color="C1")
            ax.text(t + fwd / 2, 0.4, f"fwd {n}", ha="center", va="center", fontsize=7, color="w")
            ax.text(t + ovh / 2, 1.4, f"plan {n + 1}", ha="center", va="center", fontsize=6)
            t += max(fwd, ovh)
        else:
            ax.broken_barh([(t, ovh)], (1, 0.8), color="C1")
            ax.text(t + ovh / 2, 1.4, f"plan {n}", ha="center", va="center", fontsize=6)
            ax.broken_barh([(t + ovh, fwd)], (0, 0.8), color="C0")
            ax.text(t + ovh + fwd / 2, 0.4, f"fwd {n}", ha="center", va="center", fontsize=7, color="w")
            t += ovh + fwd
    ax.set(yticks=[0.4, 1.4], yticklabels=["GPU", "CPU"], xlabel="ms", xlim=(0, steps * (ovh + fwd)),
           title=("async: step N+1 planned during forward N" if overlap else "synchronous"))
    return t


fig, axes = plt.subplots(2, 1, figsize=(9, 3.2), sharex=True)
t_sync, t_async = timeline(axes[0], False), timeline(axes[1], True)
for ax in axes:
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x * 1e3:.0f}"))
plt.tight_layout()
plt.show()

# %% [markdown]
# 批大小 {{B}} 时，同步一步是 {{(ovh + fwd) * 1e3:.2f}} ms（CPU {{ovh * 1e3:.1f}} + 前向 {{fwd * 1e3:.2f}}），异步一步是
# $\max$ = {{max(ovh, fwd) * 1e3:.2f}} ms，步长变为 {{t_async / t_sync:.3f}} 倍。只要 CPU 的部分比前向短，它就被完全藏住。
#
# ## 31.3 minibatch 的实现
#
# `EngineConfig(async_scheduling=True)` 时，`LLMEngine.step` 交给 `OverlapScheduler.step`。它每次完成一步（第 N 步），并让下一步已经在路上：

# %%
print(inspect.getsource(OverlapScheduler.step))

# %% [markdown]
# 顺序是：① 给第 N 步要采样的请求放上占位符（负的 Token ID，`placeholder(k)` = −(k+1)，k 是它在第 N 步采样行里的序号），
# 让调度器把它们当成“已有下一个 Token、等着解码”的请求来规划第 N+1 步，再按这个状态准备输入（占位符原样进入 `input_ids`）；
# ② 等第 N 步的前向在工作线程上结束，采样，把采样结果按 k 填进第 N+1 步输入里的占位符；③ 立即在工作线程上启动第 N+1 步的前向；
# ④ 在第 N+1 步前向期间，主线程做第 N 步的记账：追加 Token、检查停止条件、结束请求、发事件、写 `StepRecord`；
# ⑤ 把第 N+1 步的 Token 计为已算（`num_computed_tokens`），记下它的采样请求，下一次 `step()` 再为它们放占位符。
# 占位符只在 `step()` 内部存在，调用者读到的输出里永远没有它（`tests/test_async_scheduling.py` 每步检查）。
#
# 真实模型（`ModelExecutor`）的前向在一个工作线程上跑：PyTorch 的算子和 minibatch 的 C 内核（经 ctypes 调用）执行时都释放 GIL，
# 主线程可以同时做调度与记账。在虚拟时钟上，一步计 $\max(\text{前向}, \text{下一步的准备}) + \text{采样}$，
# 与同步引擎计入的部分相同（同步计 准备 + 前向 + 采样）。模拟器则把开销与前向重叠：一步 = $\max(\text{前向}, \texttt{step\_overhead\_s})$：

# %%
src = inspect.getsource(SimExecutor.execute)
print(src[src.index("elif self.config.async_scheduling"):src.index("else:\n            t = self.cost_model")])

# %% [markdown]
# vLLM 的对应实现（v0.11.0）：`vllm/v1/core/sched/async_scheduler.py` 的 `AsyncScheduler._update_after_schedule` 在一个请求
# `num_computed_tokens == num_tokens + num_output_placeholders` 时把 `num_output_placeholders` 加一（“这一步会产生一个新 Token”），
# `_update_request_with_output` 收到真正的 Token 后减一；`vllm/v1/core/sched/scheduler.py` 调度运行中请求时，
# 新 Token 数是 `num_tokens_with_spec + num_output_placeholders - num_computed_tokens`。
# `vllm/v1/engine/core.py` 的 `EngineCore.step_with_batch_queue` 先调度并非阻塞地提交新的一批，批队列没满就直接返回，
# 下一次调用再取出最早那一批的结果交给 `update_from_output`；打开异步调度时批队列长度是 2
# （`vllm/v1/executor/multiproc_executor.py` 的 `max_concurrent_batches`）。
#
# ## 31.4 它省了多少
#
# 在模拟的 Llama-3-8B / H100 上跑一段稳态负载（泊松到达，三个种子），各开关一次异步调度，比较 TTFT、TPOT 与吞吐的中位数：

# %%
N_REQ, RATE, PROMPT_LEN, OUT_LEN, SEEDS = 120, 8, 512, 256, (1, 2, 3)
SIM = dict(executor="sim", model="llama-3-8b", hardware="h100")
sim_runs = {mode: [run(synthetic(N_REQ, rate=RATE, seed=s, input_len=PROMPT_LEN, output_len=OUT_LEN),
                       async_scheduling=mode, **SIM).summary() for s in SEEDS] for mode in (False, True)}


def ratio(key):
    return statistics.median(a[key] / b[key] for a, b in zip(sim_runs[True], sim_runs[False]))


md_table(["mode", "TPOT mean (ms)", "TTFT mean (ms)", "output tok/s"],
         [[("async" if m else "sync"), *(f"{statistics.median(r[k] for r in sim_runs[m]) * f:.2f}"
                                         for k, f in (("tpot_mean", 1e3), ("ttft_mean", 1e3), ("throughput_tok_s", 1)))]
          for m in (False, True)])
tpot_ratio, ttft_ratio, tput_ratio = ratio("tpot_mean"), ratio("ttft_mean"), ratio("throughput_tok_s")
ttft_ms = {m: statistics.median(r["ttft_mean"] for r in sim_runs[m]) * 1e3 for m in (False, True)}

# %% tags=["check"]
assert tpot_ratio < 0.85 and ttft_ratio > 1.0, "the prose says TPOT falls and TTFT rises"

# %% [markdown]
# {{N_REQ}} 个请求、每秒 {{RATE}} 个，提示词 {{PROMPT_LEN}} Token，输出 {{OUT_LEN}} Token（`summary()` 的 TTFT、TPOT 不计开头的预热与结尾的排空）。
# 异步调度把 TPOT 降到同步的 {{tpot_ratio:.3f}} 倍（三个种子的中位数）：每一步都省掉了 CPU 的 2 ms。
# TTFT 反而升到 {{ttft_ratio:.3f}} 倍——这是 31.5 节要讲的代价。到达率固定时吞吐（{{tput_ratio:.3f}} 倍）由到达率决定，几乎不变；
# 省下的时间体现在每个 Token 更快，或同样的 TPOT 目标下能接更高的到达率。
# vLLM 公布的数字方向相同：PR #32618（异步调度 + 流水线并行，Qwen3-30B-A3B-FP8，`-pp 4`）的标题报告 TPOT 降低 31.8%、端到端吞吐提高 30.8%，
# 即 TPOT 比为 0.682，与这里的 {{tpot_ratio:.3f}} 接近；那组数字包含流水线并行，不是单卡的效果，只能比方向与量级。
# PR #27614（“[Core] Enable async scheduling by default”，正文说跟踪 issue #27679 列出的障碍都已解决）本身没有给出性能数字。
#
# 真实 tiny 模型上呢？同样的工作线程方案在墙钟上跑一次（8 个请求，各 64 个 Token，配对交替，取中位数）：

# %%
def wall_decode_step(async_scheduling: bool, n: int = 8, seed: int = 0) -> float:
    """Median wall seconds of engine.step() over the decode steps of a small offline batch."""
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=n, async_scheduling=async_scheduling))
    rng = np.random.default_rng(seed)
    for _ in range(n):
        engine.add_request(rng.integers(3, 250, 16).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        if len(engine.steps) > 4 and engine.steps[-1].num_prefill_tokens == 0:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


pairs = [(wall_decode_step(False, seed=r), wall_decode_step(True, seed=r)) for r in range(3)]
wall_ratio = statistics.median(a / s for s, a in pairs)
load = os.getloadavg()[0]
print(f"sync {statistics.median(s for s, _ in pairs) * 1e3:.2f} ms, async {statistics.median(a for _, a in pairs) * 1e3:.2f} ms "
      f"per decode step; ratio {wall_ratio:.2f} (load average {load:.1f} on {os.cpu_count()} cores)")

# %% [markdown]
# 这次测得异步 / 同步的解码步长比为 {{wall_ratio:.2f}}（负载 {{load:.1f}}，{{os.cpu_count()}} 个核），
# 异步{{"更慢" if wall_ratio > 1 else "更快"}}。31.1 节说明了原因的上限：tiny 模型一步里 CPU 的部分只有约 {{cpu_share[4]:.0%}}（批大小 4），
# 完美重叠最多省这么多；而每一步要把前向交给工作线程、再等它的结果，两次线程切换在一台核都忙着的机器上要等操作系统调度，
# 常常比省下的还多。`benchmarks/async_scheduling.py` 给出同样的结论与数字。GPU 上没有这个问题：前向本来就是异步提交给 GPU 的，
# CPU 不必切换线程就能继续规划（vLLM 把调度放在引擎核心进程，模型执行在工作进程里，二者之间用非阻塞的 `execute_model(..., non_block=True)`）。
#
# ## 31.5 代价
#
# **新请求晚一步。** 第 N 步在算时到达的请求，赶不上已经规划好的第 N+1 步，最早进第 N+2 步。
# 用每步固定时长的执行器（真实 tiny 模型的 Token，虚拟时钟，结果与机器快慢无关）看一个中途到达的请求：

# %%
STEP_MS = 10


class FixedStep:
    """The tiny model's tokens, every step lasting STEP_MS of virtual time (as tests/conftest.py FixedStepTime)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch, kv):
        import dataclasses
        return dataclasses.replace(self.inner.execute(batch, kv), duration=STEP_MS / 1e3, forward_time=STEP_MS / 1e3)


def late_ttft(async_scheduling: bool) -> float:
    cfg = EngineConfig(model="tiny", max_num_seqs=8, async_scheduling=async_scheduling)
    engine = LLMEngine(cfg, clock="virtual", executor=FixedStep(ModelExecutor(cfg)))
    engine.add_request(list(range(3, 13)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    rid = engine.add_request(list(range(20, 26)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    r = engine.requests[rid]
    return r.first_token_time - r.arrival_time


late = {m: late_ttft(m) for m in (False, True)}
print({("async" if m else "sync"): f"{v * 1e3:.0f} ms" for m, v in late.items()})

# %% tags=["check"]
assert abs(late[False] - STEP_MS / 1e3) < 1e-9 and abs(late[True] - 2 * STEP_MS / 1e3) < 1e-9

# %% [markdown]
# 每步 {{STEP_MS}} ms。同步引擎里它的 TTFT 是 {{late[False] * 1e3:.0f}} ms（下一步就被排进去），异步是 {{late[True] * 1e3:.0f}} ms，正好多一步。
# 这就是 31.4 节 TTFT 升高的来源：中途到达的请求要多等一个已经规划好的步。那里每一步也变短了，抵消了一部分，
# 平均 TTFT 从 {{ttft_ms[False]:.1f}} ms 升到 {{ttft_ms[True]:.1f}} ms。步长越短，多等的这一步越便宜。
#
# **请求结束时白算一个位置。** 第 N+1 步是在第 N 步的 Token 出来之前规划的，所以在第 N 步结束的请求（遇到 EOS、停止 Token、停止字符串，
# 或达到 `max_tokens`）仍占着第 N+1 步的一个位置，那个 Token 算出来就扔掉。vLLM v0.11.0 的调度器只按 `max_model_len` 截断新 Token 数
# （`vllm/v1/core/sched/scheduler.py`），不看 `max_tokens`，所以按长度结束的请求也一样。minibatch 记在 `num_discarded_tokens`：

# %%
demo = LLM("tiny", async_scheduling=True, max_num_seqs=16)
rng = np.random.default_rng(3)
demo_prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 40, 12)]
demo_params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(4, 40, 12)]
demo_out = demo.generate(demo_prompts, demo_params)
generated = sum(len(o.outputs[0].token_ids) for o in demo_out)
discarded = demo.engine.overlap.num_discarded_tokens
print(f"{len(demo_prompts)} requests, {generated} tokens kept, {discarded} computed and discarded")

# %% tags=["check"]
assert discarded == len(demo_prompts)

# %% [markdown]
# {{len(demo_prompts)}} 个请求生成了 {{generated}} 个 Token，另外白算了 {{discarded}} 个——每个请求一个，占 {{discarded / (generated + discarded):.1%}}。
# 输出越短，这个比例越大（平均输出 $L$ 个 Token 时约为 $1/(L+1)$）。
#
# **停止字符串。** 停止检查在第 N 步的记账里，这时第 N+1 步已经在算了，所以命中停止条件的请求总要多算一个 Token；
# 被丢掉的 Token 不会进入输出，文本与同步时相同。vLLM 也一样：停止字符串由前端的去分词器（Detokenizer）检查（`vllm/v1/engine/detokenizer.py`，v0.11.0），
# 引擎核心要到处理下一批输出时才知道请求结束了。
#
# **抢占。** 规划第 N+1 步时若 KV 不够，调度器可能抢占一个第 N 步还在算的请求（重算模式：释放它的块，`num_computed_tokens` 归零）。
# 第 N 步算出的 Token 照常追加给它（前向已经写完，结果有效），它回到等待队列，恢复时连同这个 Token 一起重算。
# 换出（Swap）模式要在前向还在写 KV 时拷走它，minibatch 不允许二者同时打开（`async_scheduling needs preemption_mode='recompute'`）。
#
# ## 31.6 贪心输出不变
#
# 异步调度只改变**什么时候**规划，不改变算什么：占位符在前向之前被真 Token 替换，请求的 KV 与同步时逐位相同。
# 在 tiny 模型上用几种策略、包括一个小到必然抢占的 KV 池，对照同步与异步的贪心输出：

# %%
POLICIES = ("continuous", "sglang", "trtllm", "tgi")
eq_prompts = [rng.integers(3, 250, int(n)).tolist() for n in (5, 40, 17, 64, 9)]
eq_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
same, preempted = {}, 0
for policy in POLICIES:
    kw = dict(policy=policy, max_num_seqs=8, num_kv_blocks=10, block_size=8)
    sync_tokens = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(eq_prompts, eq_params)]
    llm = LLM("tiny", async_scheduling=True, **kw)
    same[policy] = [o.outputs[0].token_ids for o in llm.generate(eq_prompts, eq_params)] == sync_tokens
    preempted += llm.engine.scheduler.num_preemptions
print(same, "preemptions under async:", preempted)

# %% tags=["check"]
assert all(same.values()) and preempted > 0

# %% [markdown]
# {{len(POLICIES)}} 种策略下异步与同步的输出逐 Token 相同（{{sum(same.values())}} / {{len(POLICIES)}}），其间异步引擎抢占了 {{preempted}} 次。
# `tests/test_async_scheduling.py` 还在三种随机 Hugging Face 检查点上对照了 transformers 的 `generate`（批处理、分块预填充、抢占三种配置），
# 并用逐位置校验 K/V 的执行器检查了前缀缓存与抢占下的块守恒。
#
# ## 31.7 框架里的异步调度
#
# | 框架（版本，源文件） | 选项与默认值 | 做法 |
# |---|---|---|
# | vLLM v0.11.0（`vllm/config/scheduler.py`） | `SchedulerConfig.async_scheduling: bool = False`，注释标为 EXPERIMENTAL，当时不支持结构化输出、投机解码与流水线并行 | 打开时调度器类换成 `vllm.v1.core.sched.async_scheduler.AsyncScheduler` |
# | vLLM PR #19970（提交于 2025-06-23，“Implement Async Scheduling”） | 引入实验性的 `--async-scheduling` | 仿照 NanoFlow 论文，调度器“提前一步”运行；关键是输出占位符；调度器与 GPU 工作进程须在不同进程里才能并行 |
# | vLLM PR #27614（提交于 2025-10-27，“[Core] Enable async scheduling by default”，跟踪 issue #27679 “Async Scheduling Plan”） | 改为默认打开 | 正文：#27679 的障碍都已解决，并通过扩展 CI 测试 |
# | vLLM v0.13.0 → v0.14.0（`vllm/config/scheduler.py`，`vllm/config/vllm.py`） | v0.13.0 仍是 `async_scheduling: bool = False`；v0.14.0 改为 `Field(default=None)`，`VllmConfig.__post_init__` 把 `None` 设为 `True`，除非流水线并行大于 1、投机解码不是 EAGLE/MTP 类（例如 n-gram）、`disable_padded_drafter_batch`，或执行器后端不支持 | 第一个默认打开的发行版是 v0.14.0；打开或关闭都打一行日志 “Asynchronous scheduling is enabled/disabled.” |
# | vLLM v0.11.0（`vllm/v1/engine/core.py`，`vllm/v1/executor/multiproc_executor.py`） | 批队列长度 `max_concurrent_batches`：异步调度时为 2 | `step_with_batch_queue`：先提交新批、不等结果，下一次再处理最早一批的输出 |
# | SGLang 0.5.3（`python/sglang/srt/server_args.py`，`python/sglang/srt/managers/scheduler.py`） | `disable_overlap_schedule: bool = False`，即默认重叠；`--disable-overlap-schedule` 的说明是“overlaps the CPU scheduler with GPU model worker”；流水线并行时被强制关闭 | `Scheduler.event_loop_overlap`：启动本批后，处理上一批的结果（`result_queue`）|
# | TensorRT-LLM（commit `9521caf`，`tensorrt_llm/_torch/pyexecutor/py_executor.py`） | `PyExecutor.__init__(..., disable_overlap_scheduler=False)`；LLM API 的 `disable_overlap_scheduler` 字段默认 `False`，说明“Disable the overlap scheduler.”（`tensorrt_llm/llmapi/llm_args.py`，检索库所存版本） | 流水线并行大于 1 时事件循环取 `_executor_loop_pp`；否则 `disable_overlap_scheduler` 为假取 `_executor_loop_overlap`，为真取同步的 `_executor_loop` |
# | minibatch（`minibatch/overlap.py`，`minibatch/config.py`） | `async_scheduling=False`（默认关，保持以前的行为）；与 `preemption_mode="swap"`、投机解码互斥 | 真实模型：前向在工作线程上，主线程规划与记账；模拟器：一步 = max(前向, `step_overhead_s`) |
#
# TensorRT-LLM 一行引用的是检索库里存的那一版源文件（commit `9521caf`），我们没能确定它对应的发布版本与日期。
#
# ## 31.8 动手：CPU 开销与批大小
#
# 拖动每步的 CPU 开销与解码批大小，看模拟的 Llama-3-8B / H100 上同步与异步的步长，以及异步省下的比例：

# %% tags=["nbval-ignore-output"]
def explore(overhead_ms=2.0, batch=32, context=1024):
    parts = cm.breakdown([], [context] * batch)
    forward = sum(parts.values()) - parts["overhead"]
    sync, asy = forward + overhead_ms / 1e3, max(forward, overhead_ms / 1e3)
    fig, ax = plt.subplots(figsize=(6, 2.2))
    ax.barh(["async", "sync"], [asy * 1e3, sync * 1e3], color=["C0", "C3"])
    ax.set(xlabel="ms per decode step", title=f"async step = {asy / sync:.2f} x sync "
                                               f"(forward {forward * 1e3:.1f} ms, CPU {overhead_ms:.1f} ms)")
    plt.show()


W.interact(explore, overhead_ms=W.FloatSlider(value=2.0, min=0.0, max=20.0, step=0.5, continuous_update=False),
           batch=W.IntSlider(value=32, min=1, max=256, continuous_update=False),
           context=W.IntSlider(value=1024, min=128, max=8192, step=128, continuous_update=False));

# %% [markdown]
# ## 本章小结
#
# - 同步引擎里调度、准备输入与记账都在前向之外串行执行；前向越快（小模型、快 GPU），它们占一步的比例越大。
# - 异步调度在第 N 步前向时规划第 N+1 步：要采样的请求先放一个输出占位符，真 Token 在第 N+1 步前向前填入；第 N 步的记账与第 N+1 步的前向并行。
# - 它把一步从“CPU + 前向”缩短到 $\max$(CPU, 前向)：模拟的 Llama-3-8B / H100 上 TPOT 降到 {{tpot_ratio:.2f}} 倍，与 vLLM 公布的方向一致。
# - 代价：新请求多等一步（TTFT 升到 {{ttft_ratio:.2f}} 倍），每个结束的请求在下一步白算一个位置；停止字符串照常生效，被丢的 Token 不进输出。
# - 贪心输出逐 Token 不变；在 CPU 上、核都忙时，线程切换可能比省下的 CPU 时间还贵——异步调度是为 GPU 设计的。
#
# ## 练习
#
# 1. **CPU 开销多大才值得。** 用 31.8 节的模型，对批大小 1、32、256 找出异步能省 10% 以上的最小 CPU 开销。它与批大小是什么关系？
# 2. **TTFT 的代价与步长。** 把 31.5 节的 `STEP_MS` 改成 1 和 50，中途到达请求的 TTFT 差多少？在 31.4 节的负载上把每秒请求数提高一倍，TTFT 比会变大还是变小？
# 3. **白算的比例。** 把 31.5 节请求的 `max_tokens` 都改成 2，`num_discarded_tokens` 占全部计算的 Token 多少？为什么短输出的负载（分类、打分）受影响最大？
# 4. **读 vLLM。** 在 vLLM v0.11.0 的 `vllm/v1/core/sched/scheduler.py` 里找到运行中请求的新 Token 数怎样计算，
#    说明 `num_output_placeholders` 为什么让一个刚被规划过解码的请求在下一次调度时仍然得到 1 个新 Token。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 异步省下的比例是 $1 - \max(f, c)/(f + c)$，$f$ 是前向、$c$ 是 CPU 开销；$c \le f$ 时它等于 $c/(f+c)$，要省 10% 需要 $c \ge f/9$。
#    前向随批大小变长（批大小 {{SIM_BATCHES[-1]}} 时 {{(sum(sim_parts[256].values()) - sim_parts[256]["overhead"]) * 1e3:.1f}} ms），所以批越大需要的 CPU 开销越大。
# 2. 中途到达的请求多等正好一步：`STEP_MS` 为 1 时差 1 ms，为 50 时差 50 ms。负载更高时批更大、步更长，多等的一步更贵，但排队本身也变长，
#    TTFT 比取决于二者之比；按 31.4 节的代码把 `RATE` 改成 16 跑一次即可。
# 3. 每个请求白算 1 个 Token、保留 2 个，白算的占 1/3。输出越短，占比 $1/(L+1)$ 越大；这类负载上异步调度的收益（每步省下的 CPU）也更少，因为预填充占了大头。
# 4. 运行中请求的新 Token 数是 `num_tokens_with_spec + num_output_placeholders - num_computed_tokens`。规划第 N 步后 `num_computed_tokens`
#    已经加上了这一步的输入，而 `num_tokens` 还没有这一步的输出；占位符补上这个差，所以第 N+1 步仍给它 1 个新 Token。
#
# </details>
