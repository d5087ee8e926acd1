# %% [markdown]
# # 第 16 章 TGI 路由器的批处理参数
#
# Hugging Face 的 Text Generation Inference（TGI）把服务拆成两部分：一个 Rust 写的**路由器**（Router）接收 HTTP 请求、排队、
# 决定每一次前向算哪些请求；若干 Python 的**模型分片**（Shard）只管执行路由器发来的 `prefill` 与 `decode` 调用。
# 所以 TGI 的批处理策略几乎全在路由器的一个循环里：`backends/v3/src/backend.rs` 的 `batching_task`，以及它调用的
# `backends/v3/src/queue.rs` 的 `State::next_batch`。
#
# > **TGI 自 2025-12 起处于维护模式。** `huggingface/text-generation-inference` 仓库 `README.md` 顶部的 CAUTION 写着：
# > “text-generation-inference is now in maintenance mode. Going forward, we will accept pull requests for minor bug fixes,
# > documentation improvements and lightweight maintenance tasks.”并推荐改用 vLLM、SGLang 等引擎。这段话由 commit 55f7f7cb
# > （PR #3344，2025-12-11）加入 `README.md`，同日的 commit 34988476（PR #3345）把同样的说明加到文档首页 `docs/source/index.md`。
# > 本章读的 v3.3.7 是此后一周（2025-12-18）打的标签。新部署不宜再选 TGI；读它，是因为它的路由器把
# > “何时停下解码、插入预填充”做成了两个显式的旋钮，这个取舍在任何引擎里都存在。
#
# 默认值来自 v3.3.7 `launcher/src/main.rs` 的 `Args`，并发上限来自 `router/src/infer/mod.rs`。
#
# TGI 的路由器有一个与 vLLM、TensorRT-LLM 都不同的习惯：不分块时，新请求的预填充**单独成一步**，正在解码的请求在这一步里全部停下；
# 于是“什么时候停下解码、让等待的请求进来”成了要调的参数——`max_waiting_tokens` 与 `waiting_served_ratio`。
# TGI v3 默认打开分块预填充（TGI 叫 Prefill Chunking）之后，这两个参数被忽略了。本章在 minibatch 里复现这套规则（`minibatch/policies/tgi.py`、
# `tgi` 预设），测量它们对 TTFT 与 TPOT 的取舍，再看 `max_concurrent_requests` 怎样做**背压**（Backpressure）。
#
# ## 学习目标
#
# - 读懂 TGI 路由器的批处理循环：一次 `next_batch`、一次可能的预填充、一次解码，`waiting_tokens` 计数器怎样前进；
# - 写出何时暂停解码做预填充的条件（`max_waiting_tokens`、`waiting_served_ratio`），以及 `next_batch` 的三个预算
#   （`max_batch_prefill_tokens`、`max_batch_total_tokens`、`max_batch_size`），在手工构造的状态上验证；
# - 在时间线上看到预填充造成的生成停顿（Generation Stall，第 11 章），并在稳态、多个种子下量出两个参数对 TTFT、TPOT、ITL 尾部与吞吐的影响（不分块，即 TGI v2 的行为）；
# - 说清 TGI v3 的变化：分块默认打开，哪些参数因此失效，以及它在同一负载上的效果；
# - 用 `max_concurrent_requests`（minibatch 的 `max_inflight_requests`）做背压：超载时拒绝请求（HTTP 429）与无界排队的对比；
# - 在真实的 tiny 模型上验证：`tgi` 预设下贪心输出逐 Token 不变。

# %%
import inspect
import os
import subprocess
import sys
import urllib.request

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import EngineConfig, LLMEngine, presets, tune
from minibatch.policies import SchedulerState
from minibatch.policies.tgi import TGIPolicy
from minibatch.presets import tgi as tgi_launcher
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.sim import get_model_spec
from minibatch.viz import md_table
from minibatch.workload import lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", preset="tgi")   # this chapter's server
V2 = dict(SIM, enable_chunked_prefill=False)            # TGI v2's behaviour: no prefill chunking
TGI = presets.settings("tgi")
DUR = 60.0                                              # seconds of arrivals in every measured run
CHAT_P = dict(prompt=512, output=128, sigma=0.6, rate=8.0, n=int(8.0 * DUR) + 1)   # 16.3-16.5: chat load, Poisson arrivals
CHAT = dict(input_len=lognormal(median=CHAT_P["prompt"], sigma=CHAT_P["sigma"], max=2048),
            output_len=lognormal(median=CHAT_P["output"], sigma=CHAT_P["sigma"], max=512))
SEEDS, TRIM = [1, 2, 3], 0.2
OVER_RATE = 20.0                                        # 16.6: an offered load above the server's capacity
OVER_N = int(OVER_RATE * DUR) + 1
SLO = {"ttft": 1.0, "tpot": 0.1}                        # per request, seconds
CAP16 = dict(lo=6.0, hi=16.0, tol=0.1, target=0.9, trim=TRIM, duration_s=DUR, processes=2)   # 16.5: capacity, bisection
LIMITS = [None, 128, 64, 32]                            # 16.6: max_concurrent_requests (None: no limit)
STALL_WINDOW = 4.0                                      # 16.3: seconds of the timeline shown
torch.set_num_threads(1)
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 16.1 路由器的批处理循环
#
# 不分块时，`batching_task`（v3.3.7，`backends/v3/src/backend.rs`）可以写成下面的伪代码：
#
# ```text
# loop:                                                   # 空闲时等新请求的通知
#     batch = next_batch(min_size=None, max_size=max_batch_size,
#                        prefill_budget=max_batch_prefill_tokens, token_budget=max_batch_total_tokens)
#     prefill(batch); waiting_tokens = 1
#     while batch 非空:
#         if waiting_tokens >= max_waiting_tokens: min_size = None          # 等够了：有几个算几个
#         else: min_size = floor(len(batch) * waiting_served_ratio)         # 否则要等到积压够多
#         new = next_batch(min_size, max_batch_size - len(batch),
#                          max_batch_prefill_tokens, max_batch_total_tokens - batch.max_tokens)
#         if new: prefill(new)                  # 单独一步：batch 里的请求这一步不出 Token
#                 batch += new; waiting_tokens = 1
#         decode(batch); waiting_tokens += 1
# ```
#
# `next_batch`（`queue.rs`）从队首依次取请求：每个请求要为 `input_length + max_new_tokens + speculate − 1` 个 Token 分配 KV 块
# （分配失败就停——TGI 从不抢占）；未命中前缀缓存的提示 Token 之和不超过 `max_batch_prefill_tokens`（先向上取整到块大小的整数倍）；
# 取到的请求数少于 `min_size` 就全部放回、返回空。记运行中的请求数为 $n$、队列长度为 $q$、
# 距上次预填充已解码的步数为 $w$（`waiting_tokens`，预填充后置 1，每次解码加 1），则这一轮插入预填充当且仅当
#
# $$
# \big( w \ge M \big) \ \lor\ \big( q \ge \lfloor \rho\, n \rfloor \ \land\ |\text{next\_batch 放得下的请求}| \ge \lfloor \rho\, n \rfloor \big),
# \qquad M = \texttt{max\_waiting\_tokens},\ \rho = \texttt{waiting\_served\_ratio} .
# $$
#
# 两个参数的方向相反：$M$ 越小、$\rho$ 越小，新请求越早进来（TTFT 小），但运行中的请求被打断得越频繁（TPOT、ITL 变大）；
# 反之亦然。`backend.rs` 把每次插入，即**批拼接**（Batch Concatenation），记进 `tgi_batch_concat` 计数器，标签 `reason` 说明是哪个条件触发的：
# `backpressure`（$\rho$ 条件，即 `min_size` 有值时）、`wait_exceeded`（$M$ 条件）、`chunking`（分块时）。
# minibatch 的 `tgi` 策略逐行复现这个循环，并用同样的名字计数（`TGIPolicy.concat_reasons`）：

# %%
print(inspect.getsource(TGIPolicy.schedule_order))

# %% [markdown]
# 预设 `tgi` 把 v3.3.7 的默认值填进 `EngineConfig`，每一行注明出处：

# %% tags=["nbval-check-output"]
print(presets.describe("tgi"))
assert (TGI["max_waiting_tokens"], TGI["waiting_served_ratio"], TGI["max_inflight_requests"], TGI["enable_chunked_prefill"]) \
    == (20, 0.3, 128, True), "the prose quotes these defaults"

# %% [markdown]
# `max_batch_prefill_tokens` 没有写死的默认值：v3.3.7 的启动器（`launcher/src/main.rs` 的 `main`）用 GPU 的 FP16 峰值算力除以模型每个
# Token 的 FLOPs（`Config::flop`：每层 Q、注意力、O 三个 $2 H d_h h$ 项与 K、V 两个 $2 H_{kv} d_h h$ 项，加上 MLP 的 $2 \cdot 3 \cdot h \cdot I$）作为
# “算力最优”的值，再取它与 `max_position_embeddings`、显存允许值的最小者；算不出来时用 4096（v2.4.1 则一律是 $\min(4096, \text{max\_position\_embeddings})$）。
# `minibatch.presets.tgi` 照这段代码实现（不含显存上限），在 A100 上计算：

# %% tags=["nbval-check-output"]
A100_F16 = tgi_launcher.F16_FLOPS["a100"]                # launcher/src/main.rs ComputeType::f16_flop, Gpu::A100
prefill_default = {}
for name in ("llama-2-7b", "llama-3-8b"):
    spec = get_model_spec(name)
    optimal = int(A100_F16 // tgi_launcher.flop_per_token(spec))
    prefill_default[name] = tgi_launcher.default_max_batch_prefill_tokens(spec, gpu="a100")
    print(f"{name}: {tgi_launcher.flop_per_token(spec) / 1e9:.1f} GFLOP/token, compute-optimal {optimal:,} tokens, "
          f"max_position_embeddings {spec.max_model_len} -> max_batch_prefill_tokens {prefill_default[name]}")
assert prefill_default["llama-2-7b"] == TGI["max_num_batched_tokens"], "the preset's 4096 is Llama-2's value"
assert prefill_default["llama-3-8b"] == get_model_spec("llama-3-8b").max_model_len, "capped by the context too"

# %% [markdown]
# （A100 的 FP16 峰值取启动器 `ComputeType::f16_flop` 里的 {{A100_F16 / 1e12:.0f}} TFLOP/s。）
# 所以 Llama-2-7B 在 A100 上得到 {{prefill_default["llama-2-7b"]}}（被 `max_position_embeddings` 截住），这正是预设的值；
# 同样的 GPU 上 Llama-3-8B 得到 {{prefill_default["llama-3-8b"]}}（同样被它 {{get_model_spec("llama-3-8b").max_model_len}} Token 的上下文截住）。minibatch 的 `max_batch_prefill_tokens` 默认取 `max_num_batched_tokens`。
# `max_batch_total_tokens` 由启动时的显存测量推出（对应 minibatch 的 KV 池），`max_batch_size` 没有默认值（不限）。
# 另有两处与 minibatch 的差别：TGI 在 flashinfer 注意力下 KV 块大小是 1 个 Token（`server/text_generation_server/models/globals.py` 的 `BLOCK_SIZE`），
# minibatch 保留自己的块大小；TGI 预留 `input + max_new_tokens − 1` 个 Token，minibatch 预留 `input + max_tokens` 个。
#
# ## 16.2 手工状态：什么时候插入预填充
#
# 直接对 `TGIPolicy` 调用 `schedule_order`，每一步记下它的决定（`P` = 这一步只做预填充，`D` = 解码整批）。
# 一个 10 个请求的批刚做完预填充，之后每一步都有新请求排队：

# %% tags=["nbval-check-output"]
def rq(rid, prompt=6, max_tokens=4, out=0):
    r = Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), 0.0)
    r.output_token_ids = [9] * out
    return r


def plans(waiting_per_step, n_running=10, steps=10, prompt=6, budget=4096, **knobs):
    """The policy's decision at each step, for a batch of ``n_running`` that was just prefilled; ``prompt``
    tokens per waiting request, ``budget`` the prefill token budget."""
    config = EngineConfig(policy="tgi", enable_chunked_prefill=False, **knobs)
    p, out = TGIPolicy(), []
    batch = [rq(f"b{i}", out=1) for i in range(n_running)]
    first = p.schedule_order(SchedulerState(0.0, [], batch, 256, 8192, 0.0, None, config))   # the empty server's prefill
    p.on_step([(r, 6) for r in first], 0.0)
    for k in range(steps):
        waiting = [rq(f"w{k}_{j}", prompt=prompt) for j in range(waiting_per_step)]
        order = p.schedule_order(SchedulerState(0.0, batch, waiting, 256, budget, 0.0, None, config))
        p.on_step([(r, 1) for r in order], 0.0)
        out.append("D" if order == batch else "P")
    return "".join(out), dict(p.concat_reasons)


cases = {"1 waiting, max_waiting_tokens=5": plans(1, max_waiting_tokens=5),
         "3 waiting (= floor(10 x 0.3))": plans(3, max_waiting_tokens=5),
         "1 waiting, waiting_served_ratio=0.1": plans(1, max_waiting_tokens=5, waiting_served_ratio=0.1)}
for name, (seq, reasons) in cases.items():
    print(f"{name:<38} {seq}   tgi_batch_concat: {reasons}")
ex1 = plans(5, n_running=20, steps=16, max_waiting_tokens=8)          # exercise 1's answer
ex5 = {b: plans(12, n_running=40, steps=16, prompt=600, budget=b, max_waiting_tokens=8) for b in (4096, 8192)}   # exercise 5

# %% tags=["check"]
assert cases["1 waiting, max_waiting_tokens=5"][0] == "DDDDPDDDDP", "four decodes, then the wait is exceeded"
assert cases["3 waiting (= floor(10 x 0.3))"][0] == "PDPDPDPDPD", "enough requests wait: prefill, decode, prefill ..."
assert cases["1 waiting, waiting_served_ratio=0.1"][0] == "PDPDPDPDPD", "floor(10 x 0.1) = 1 is enough"
assert ex5[4096][1] == {"wait_exceeded": 2} and set(ex5[8192][1]) == {"backpressure"}, "exercise 5's hint"

# %% [markdown]
# - 只有 1 个请求在等、`max_waiting_tokens=5`：预填充后计数器为 1，每次解码加 1，第 4 次解码后到 5，于是第 5 步插入预填充
#   （原因 `wait_exceeded`），新请求等了 4 个解码步；
# - 有 3 个请求在等：$\lfloor 10 \times 0.3 \rfloor = 3$，条件立即满足（原因 `backpressure`）；插入之后 TGI 总要先解码一次，
#   所以最多每隔一步插入一次；
# - `waiting_served_ratio=0.1` 时 $\lfloor 10 \times 0.1 \rfloor = 1$，1 个等待的请求就够了。
#
# ## 16.3 预填充让解码停顿
#
# 在模拟的 Llama-2-7B / A100-80G 上，用 TGI v2 的行为（不分块）跑一个聊天负载：提示词中位数 {{CHAT_P["prompt"]}}、输出中位数
# {{CHAT_P["output"]}}（对数正态，$\sigma$ = {{CHAT_P["sigma"]}}），泊松到达，{{CHAT_P["rate"]}} req/s，{{DUR:.0f}} s 的到达（{{CHAT_P["n"]}} 个请求）。
# 下图截取稳态中的 {{STALL_WINDOW:g}} 秒：上面是每一步的时长（红色是只做预填充的一步），下面是这一时刻正在解码的几个请求的 Token 时刻，
# 每条竖线是一个 Token——红色区间里它们一个 Token 也不出：

# %%
def tgi_run(seed=1, n=CHAT_P["n"], rate=CHAT_P["rate"], **kw):
    """One run of the chat load; returns the result and the policy (for its concat counters)."""
    engine = LLMEngine(EngineConfig.from_kwargs(**{**V2, **kw}), clock="virtual")
    result = run(synthetic(n, rate, **CHAT, seed=seed), engine=engine)
    return result, engine.scheduler.policy


base, base_policy = tgi_run()
steps = base.steps
t_mid = np.median([q.arrival_time for q in base.requests])
window = (t_mid, t_mid + STALL_WINDOW)
shown = [st for st in steps if window[0] <= st.start_time <= window[1]]
is_prefill = [bool(st.num_prefill_tokens) and not st.num_decode_tokens for st in shown]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
ax1.bar([st.start_time for st in shown], [st.duration * 1e3 for st in shown], width=[st.duration for st in shown],
        align="edge", color=["C3" if p else "C0" for p in is_prefill])
ax1.set(ylabel="step (ms)", title=f"TGI v2 behaviour (no chunking), {CHAT_P['rate']:g} req/s: prefill-only steps in red")
live = [q for q in base.requests if q.first_token_time is not None and q.first_token_time < window[0]
        and q.finish_time > window[1]][:8]
ax2.eventplot([[t for t in q.token_times if window[0] <= t <= window[1]] for q in live], colors="0.2", linelengths=0.7)
for st, p in zip(shown, is_prefill):
    if p:
        ax2.axvspan(st.start_time, st.start_time + st.duration, color="C3", alpha=0.25, lw=0)
ax2.set(xlabel="time (s)", ylabel="running request", yticks=range(len(live)), xlim=window)
fig.tight_layout()
plt.show()

# %% tags=["nbval-check-output"]
mid = [st for st in steps if st.start_time >= np.quantile([q.arrival_time for q in base.requests], TRIM)
       and st.start_time <= np.quantile([q.arrival_time for q in base.requests], 1 - TRIM)]
pre = [st for st in mid if st.num_prefill_tokens and not st.num_decode_tokens]
dec = [st for st in mid if st.num_decode_tokens and not st.num_prefill_tokens]
stall_ms = float(np.median([st.duration for st in pre])) * 1e3
decode_ms = float(np.median([st.duration for st in dec])) * 1e3
stall_share = sum(st.duration for st in pre) / sum(st.duration for st in mid)
mixed = sum(1 for st in steps if st.num_prefill_tokens and st.num_decode_tokens)
print(f"steady window: {len(pre)} prefill-only steps (median {stall_ms:.0f} ms) among {len(mid)} steps; "
      f"decode steps median {decode_ms:.1f} ms; prefill share of time {stall_share:.0%}; mixed steps in the run: {mixed}")
assert mixed == 0, "without chunking TGI never mixes prefill and decode in one step"
assert stall_ms > 5 * decode_ms, "the prose says a prefill step lasts many decode steps"

# %% [markdown]
# 不分块时 TGI 从不把预填充与解码放进同一步（这次运行里混合步为 {{mixed}} 个）。稳态窗口里有 {{len(pre)}} 个只做预填充的步，
# 中位时长 {{stall_ms:.0f}} ms，而一个解码步的中位时长只有 {{decode_ms:.1f}} ms：每插入一次预填充，所有正在解码的请求就多等约
# {{stall_ms / decode_ms:.0f}} 个解码步的时间，这就是它们 ITL 的尖峰。这段时间占了总时间的 {{stall_share:.0%}}。
#
# ## 16.4 `max_waiting_tokens` 与 `waiting_served_ratio` 的取舍
#
# 同一负载、同一服务器，不分块，分别扫描 `max_waiting_tokens`（`waiting_served_ratio` 取默认 {{TGI["waiting_served_ratio"]}}）与 `waiting_served_ratio`
# （`max_waiting_tokens` 取默认 {{TGI["max_waiting_tokens"]}}），每个配置 {{len(SEEDS)}} 个种子，稳态指标（`summary(trim={{TRIM}})`）取中位数：

# %%
MWT = [1, 5, 20, 50]
WSR = [0.05, 0.1, 0.3, 1.2]
CONFIGS = [(m, 0.3) for m in MWT] + [(20, w) for w in WSR if w != 0.3]
KEYS = ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99", "throughput_tok_s"]
sweep_runs = {}
for mwt, wsr in CONFIGS:
    for seed in SEEDS:
        sweep_runs[mwt, wsr, seed] = (base, base_policy) if (mwt, wsr, seed) == (20, 0.3, 1) else \
            tgi_run(seed, max_waiting_tokens=mwt, waiting_served_ratio=wsr)
sw = {(m, w, k): float(np.median([sweep_runs[m, w, s][0].summary(trim=TRIM)[k] for s in SEEDS]))
      for m, w in CONFIGS for k in KEYS}
reasons = {(m, w): {r: int(np.median([sweep_runs[m, w, s][1].concat_reasons[r] for s in SEEDS]))
                    for r in ("wait_exceeded", "backpressure")} for m, w in CONFIGS}

fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
for ax, (ykey, ylabel) in zip(axes, [("ttft_p50", "TTFT p50 (s)"), ("itl_p99", "ITL p99 (ms)")]):
    for label, pts, color in [("max_waiting_tokens (ratio 0.3)", [(m, 0.3) for m in MWT], "C0"),
                              ("waiting_served_ratio (max_waiting_tokens 20)", [(20, w) for w in WSR], "C2")]:
        xs = [sw[m, w, "tpot_p50"] * 1e3 for m, w in pts]
        ys = [sw[m, w, ykey] * (1e3 if "itl" in ykey else 1) for m, w in pts]
        ax.plot(xs, ys, "o-", color=color, label=label)
        for (m, w), x, y in zip(pts, xs, ys):
            ax.annotate(f"{m}" if color == "C0" else f"{w:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="TPOT p50 (ms)", ylabel=ylabel, yscale="log" if "ttft" in ykey else "linear")
    ax.grid(alpha=0.3, which="both")
axes[0].legend(fontsize=7)
fig.suptitle(f"TGI router knobs, no chunking: Llama-2-7B on A100-80G, {CHAT_P['rate']:g} req/s, median of {len(SEEDS)} seeds",
             fontsize=10)
fig.tight_layout()
plt.show()
md_table(["max_waiting_tokens", "waiting_served_ratio", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "ITL p99 (ms)",
          "output tok/s", "joins: wait_exceeded", "joins: backpressure"],
         [[m, w, f"{sw[m, w, 'ttft_p50']:.2f}", f"{sw[m, w, 'ttft_p99']:.2f}", f"{sw[m, w, 'tpot_p50'] * 1e3:.1f}",
           f"{sw[m, w, 'itl_p99'] * 1e3:.0f}", f"{sw[m, w, 'throughput_tok_s']:.0f}", reasons[m, w]["wait_exceeded"],
           reasons[m, w]["backpressure"]] for m, w in CONFIGS])

# %% tags=["nbval-check-output"]
d = (20, 0.3)
thr = [sw[c + ("throughput_tok_s",)] for c in CONFIGS]
thr_gap = max(thr) / min(thr) - 1                       # how far apart the configurations' throughputs are
print(f"default: TTFT p50 {sw[d + ('ttft_p50',)]:.2f} s, TPOT p50 {sw[d + ('tpot_p50',)] * 1e3:.1f} ms, "
      f"ITL p99 {sw[d + ('itl_p99',)] * 1e3:.0f} ms, joins {reasons[d]}; throughputs within {thr_gap:.1%}")

# %% tags=["check"]
assert sw[1, 0.3, "ttft_p50"] < sw[20, 0.3, "ttft_p50"] / 3, "small max_waiting_tokens: much lower TTFT"
assert sw[1, 0.3, "tpot_p50"] > sw[20, 0.3, "tpot_p50"] > sw[50, 0.3, "tpot_p50"], "... at some cost in TPOT"
assert sw[1, 0.3, "itl_p99"] < sw[20, 0.3, "itl_p99"], "more, smaller prefills: shorter stalls"
assert reasons[d]["backpressure"] < reasons[d]["wait_exceeded"] / 2, "by default the wait triggers most joins"
assert reasons[50, 0.3]["backpressure"] > reasons[50, 0.3]["wait_exceeded"], "with a long wait the ratio takes over"
assert sw[20, 0.05, "ttft_p50"] < sw[20, 0.3, "ttft_p50"] / 3, "a small ratio lets requests in early"
assert sw[20, 1.2, "ttft_p50"] >= sw[20, 0.3, "ttft_p50"], "a large ratio only delays"
assert thr_gap < 0.05, "every configuration keeps up with the load"

# %% [markdown]
# 读图与表（{{len(SEEDS)}} 个种子的中位数；每个配置的吞吐都在 {{min(thr):.0f}}–{{max(thr):.0f}} tok/s 之间，
# 相差 {{thr_gap:.1%}}，差别全在延迟上）：
#
# - **`max_waiting_tokens` 是主角。** 默认 {{TGI["max_waiting_tokens"]}} 时 TTFT 的中位数是 {{sw[20, 0.3, "ttft_p50"]:.2f}} s；降到 {{MWT[0]}}（每次检查都允许插入），
#   TTFT 降到 {{sw[1, 0.3, "ttft_p50"]:.2f}} s，代价是 TPOT 的中位数从 {{sw[20, 0.3, "tpot_p50"] * 1e3:.1f}} 升到 {{sw[1, 0.3, "tpot_p50"] * 1e3:.1f}} ms。
#   ITL 的 p99 反而从 {{sw[20, 0.3, "itl_p99"] * 1e3:.0f}} 降到 {{sw[1, 0.3, "itl_p99"] * 1e3:.0f}} ms：等得越久，攒下的请求越多，
#   那一次预填充越长，停顿越长；调到 {{MWT[0]}}，稀少而长的停顿换成了频繁而短的停顿。调到 {{MWT[-1]}}，TPOT 最低（{{sw[50, 0.3, "tpot_p50"] * 1e3:.1f}} ms），
#   TTFT 的中位数升到 {{sw[50, 0.3, "ttft_p50"]:.2f}} s。
# - **`waiting_served_ratio` 是安全阀。** 默认配置下，一次运行里约 {{reasons[d]["wait_exceeded"]}} 次插入是等够了 `max_waiting_tokens`
#   （`wait_exceeded`），只有约 {{reasons[d]["backpressure"]}} 次是积压够多（`backpressure`）：泊松到达时，{{TGI["max_waiting_tokens"]}} 个解码步里很少攒到批大小的 {{TGI["waiting_served_ratio"]:.0%}}。
#   `max_waiting_tokens` = {{MWT[-1]}} 时情形反过来（{{reasons[50, 0.3]["backpressure"]}} 次对 {{reasons[50, 0.3]["wait_exceeded"]}} 次）：等待太久，
#   积压先达到比例，多数插入改由比例条件触发。比例调到 {{WSR[0]:g}}（几个请求就够），
#   TTFT 降到 {{sw[20, 0.05, "ttft_p50"]:.2f}} s；调到 {{WSR[-1]:g}}，TTFT 为 {{sw[20, 1.2, "ttft_p50"]:.2f}} s，只是更晚插入。
#   它是为**突发**设计的：一下子来了一大批请求时不必等满 `max_waiting_tokens` 步（练习 2）。
# - 比例条件还有一个容易忽略的前提：`next_batch` 要在 `max_batch_prefill_tokens` 之内**放得下** $\lfloor \rho\, n \rfloor$ 个请求，
#   否则整批放回：批越大、提示越长，比例条件越难成立（练习 5 构造了一个放不下的例子）。
#
# ## 16.5 TGI v3：分块之后，这两个参数被忽略
#
# TGI v3.0.0（2024-12）把 `PREFILL_CHUNKING` 的默认值从 `"0"` 改成了 `"1"`（`server/text_generation_server/models/globals.py`；v2.4.1 里是 `"0"`）。
# 模型支持分块、注意力后端是 flashinfer 或 flashdecoding、又没有开投机解码（Speculative Decoding）时（`server/text_generation_server/models/model.py`），
# 分片报告 `support_chunking`，路由器启动时打印
# “Model supports prefill chunking. `waiting_served_ratio` and `max_waiting_tokens` will be ignored.”，循环也换了一条路径：
# 每一轮都调用 `next_batch(None, None, max_batch_prefill_tokens − 当前批的 Token 数, …)`——`min_size` 与 `max_size` 都不再使用
# （所以 `max_batch_size` 也不再限制加入），取到的请求与运行中的批**拼成一次前向**（最后一个请求按剩余预算切块），然后整批解码一次。
# 编写本章时发现 minibatch 的 `tgi` 策略在分块模式下每一步都允许加入，而 `backend.rs` 在每次加入之后必定先解码一次；已修正，
# 并在 `tests/test_tgi_rules.py` 中加了单元测试。把同一负载（同样 {{len(SEEDS)}} 个种子、每次 {{DUR:.0f}} s）交给分块的 `tgi` 预设（v3 的默认），
# `max_waiting_tokens` 取 {{MWT[0]}} 与 {{MWT[-1]}}，与 16.4 节 v2 的默认配置逐个种子对比：

# %% tags=["nbval-check-output"]
v3 = {(m, seed): tgi_run(seed, enable_chunked_prefill=True, max_waiting_tokens=m) for m in (MWT[0], MWT[-1]) for seed in SEEDS}
s3 = {k: r.summary(trim=TRIM) for k, (r, _) in v3.items()}
s2 = {seed: sweep_runs[20, 0.3, seed][0].summary(trim=TRIM) for seed in SEEDS}     # v2 defaults, from 16.4
ignored = all(s3[MWT[0], seed] == s3[MWT[-1], seed] for seed in SEEDS)
md_table(["seed", "v2: TTFT p50 (s)", "v3: TTFT p50 (s)", "v2: ITL p99 (ms)", "v3: ITL p99 (ms)", "v2: TPOT p50 (ms)",
          "v3: TPOT p50 (ms)"],
         [[seed, f"{s2[seed]['ttft_p50']:.3f}", f"{s3[1, seed]['ttft_p50']:.3f}", f"{s2[seed]['itl_p99'] * 1e3:.0f}",
           f"{s3[1, seed]['itl_p99'] * 1e3:.0f}", f"{s2[seed]['tpot_p50'] * 1e3:.1f}", f"{s3[1, seed]['tpot_p50'] * 1e3:.1f}"]
          for seed in SEEDS])
print(f"v3 with max_waiting_tokens 1 and 50 identical on every seed: {ignored}; v3 joins (seed 1):",
      dict(v3[1, SEEDS[0]][1].concat_reasons))

# %% tags=["check"]
assert ignored and set(v3[1, SEEDS[0]][1].concat_reasons) == {"chunking"}, "with chunking max_waiting_tokens is ignored"
assert all(s3[1, seed]["ttft_p50"] < s2[seed]["ttft_p50"] and s3[1, seed]["itl_p99"] < s2[seed]["itl_p99"]
           for seed in SEEDS), "the prose: v3 beats v2 on TTFT and ITL on every seed"

# %% [markdown]
# 分块时 `max_waiting_tokens` 取 {{MWT[0]}} 还是 {{MWT[-1]}}，每个种子上两次运行的统计都完全相同，所有加入都记在 `chunking` 名下。与 v2 的默认行为相比，
# **每个种子上** TTFT 的中位数与 ITL 的 p99 都更低（种子 {{SEEDS[0]}}：TTFT {{s2[SEEDS[0]]["ttft_p50"]:.2f}} → {{s3[1, SEEDS[0]]["ttft_p50"]:.2f}} s，
# ITL p99 {{s2[SEEDS[0]]["itl_p99"] * 1e3:.0f}} → {{s3[1, SEEDS[0]]["itl_p99"] * 1e3:.0f}} ms）：新请求不必等 {{TGI["max_waiting_tokens"]}} 个解码步，
# 也不会让整批停下一整步，因为预填充与解码共用一次前向，大小受 `max_batch_prefill_tokens` 限制。
#
# 一个到达率上的比较还不够：v3 的好处能换成多少**服务容量**？对两种行为、每个种子，在 {{CAP16["lo"]:g}}–{{CAP16["hi"]:g}} req/s 之间二分
# （`tune.capacities`，每次 {{DUR:.0f}} s 的到达、`trim={{TRIM}}`，区间两端相差不到 {{CAP16["tol"]:.0%}} 为止），
# 求 SLO（TTFT ≤ {{SLO["ttft"]:g}} s、TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms，每个请求分别判断）达成率 ≥ {{CAP16["target"]:.0%}} 的最高到达率：

# %% tags=["nbval-check-output"]
cap_wl = {seed: synthetic(int(CAP16["hi"] * DUR) + 1, CHAT_P["rate"], **CHAT, seed=seed) for seed in SEEDS}
BEHAVIOURS = {"v2 (no chunking)": dict(enable_chunked_prefill=False), "v3 (chunking)": dict(enable_chunked_prefill=True)}
found = tune.capacities(cap_wl, list(BEHAVIOURS.values()), SLO, **CAP16, **SIM)
caps = {name: f.estimate for name, f in zip(BEHAVIOURS, found)}
md_table(["TGI behaviour", "capacity (req/s): median (min–max)", "per seed", "runs"],
         [[name, f"{caps[name]:.1f}", " / ".join(f"{c:.1f}" for c in caps[name].per_seed), f.runs]
          for name, f in zip(BEHAVIOURS, found)])
v3_gain = caps["v3 (chunking)"].median / caps["v2 (no chunking)"].median - 1
print(f"v3 vs v2: {tune.verdict(caps['v3 (chunking)'], caps['v2 (no chunking)'])} "
      f"(median +{v3_gain:.0%}); offered load of 16.6 vs the v3 capacity: x{OVER_RATE / caps['v3 (chunking)'].median:.1f}")

# %% tags=["check"]
assert tune.verdict(caps["v3 (chunking)"], caps["v2 (no chunking)"]) == "higher", "the prose: v3 higher on every seed"
assert OVER_RATE > 1.2 * caps["v3 (chunking)"].hi, "16.6's offered load is above the capacity on every seed"

# %% [markdown]
# v3 的容量是 {{caps["v3 (chunking)"]:.1f}} req/s，v2 是 {{caps["v2 (no chunking)"]:.1f}} req/s（中位数与最小–最大）：中位数高出 {{v3_gain:.0%}}，
# 而且 v3 **最差的种子**也高于 v2 **最好的种子**，这个结论经得起种子的波动。代价是这两个可以调的旋钮没有了；
# 想让解码更平稳，只剩调小 `max_batch_prefill_tokens`（每步的预填充块更小，第 11 章；练习 3）。
#
# ## 16.6 背压：`max_concurrent_requests`
#
# 到达率超过服务能力时，排队会无限增长：每个新请求都排在更长的队尾，TTFT 随时间不断变大，客户端早就超时了，服务器还在为它们排队。
# TGI 的路由器用一个信号量限制同时在处理（排队 + 运行）的请求数：`Infer::generate_stream`（`router/src/infer/mod.rs`）先
# `try_acquire_owned()`，拿不到就返回 `InferError::Overloaded`，HTTP 层映射为 **429 Too Many Requests**（`router/src/server.rs`）；
# 上限是 `--max-concurrent-requests`，默认 {{TGI["max_inflight_requests"]}}。启动器的帮助文本说得直白：
# “Having a low limit will refuse clients requests instead of having them wait for too long and is usually good to handle backpressure correctly.”
#
# minibatch 里它是 `max_inflight_requests`：`LLMEngine.add_request` 在排队与运行的请求已达上限时抛出 `Overloaded`，
# 请求记为被拒绝（`rejected_reasons` 里的 `over max_inflight_requests`）。下面让到达率为 {{OVER_RATE:g}} req/s——16.5 节量出的 v3 容量的
# {{OVER_RATE / caps["v3 (chunking)"].median:.1f}} 倍，每个种子上都过载——用 TGI v3 的默认配置（分块）比较上限 {{LIMITS}}（`None` 即不限；
# {{TGI["max_inflight_requests"]}} 是 TGI 的默认），{{len(SEEDS)}} 个种子、每个 {{DUR:.0f}} s 的到达：

# %%
over_wl = {seed: synthetic(OVER_N, OVER_RATE, **CHAT, seed=seed) for seed in SEEDS}
over = {lim: run(over_wl[SEEDS[0]], **SIM, max_inflight_requests=lim) for lim in LIMITS}     # seed 1, kept for the figure
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.4))
for lim, color in zip(LIMITS, ("C3", "C0", "C2", "C4")):
    served = sorted((q.arrival_time, q.ttft) for q in over[lim].requests if q.ttft is not None)
    ax1.plot(*zip(*served), ".", ms=2.5, color=color, label=f"max_concurrent_requests = {lim}")
    rej = np.sort([q.arrival_time for q in over[lim].requests if q.finish_reason == "rejected"])
    ax2.plot(rej, np.arange(1, len(rej) + 1), color=color, label=f"{lim}") if len(rej) else None
ax1.set(xlabel="arrival time (s)", ylabel="TTFT of served requests (s)", yscale="log",
        title=f"{OVER_RATE:g} req/s offered, TGI v3 defaults, seed {SEEDS[0]}")
ax1.legend(fontsize=7, markerscale=4)
ax1.grid(alpha=0.3, which="both")
ax2.set(xlabel="arrival time (s)", ylabel="requests rejected (429), cumulative", title="what the limit turns away")
ax2.legend(fontsize=7)
ax2.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% tags=["nbval-check-output"]
so = {(lim, SEEDS[0]): over[lim].summary(slo=SLO, trim=TRIM) for lim in LIMITS}
rest = [(lim, seed) for seed in SEEDS[1:] for lim in LIMITS]
so.update(zip(rest, tune.summaries([(over_wl[seed], {**SIM, "max_inflight_requests": lim}) for lim, seed in rest],
                                   slo=SLO, trim=TRIM)))
for (lim, seed), x in so.items():
    x["rejected_share"] = x["rejected"] / x["num_requests"]


def om(lim, key, fmt):
    """Median over the seeds, with the seeds' min-max, of one summary key at one limit."""
    v = [so[lim, seed][key] for seed in SEEDS]
    return f"{np.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


md_table(["max_concurrent_requests", "rejected", "served TTFT p50 (s)", "TPOT p50 (s)", "output tok/s", "goodput (req/s)"],
         [[str(lim), om(lim, "rejected_share", ".0%"), om(lim, "ttft_p50", ".2f"), om(lim, "tpot_p50", ".3f"),
           om(lim, "throughput_tok_s", ".0f"), om(lim, "goodput", ".2f")] for lim in LIMITS])
first_half = [q.ttft for q in over[None].requests if q.arrival_time < DUR / 2]
second_half = [q.ttft for q in over[None].requests if q.arrival_time >= DUR / 2]
grow = float(np.median(second_half) / np.median(first_half))
med_o = {lim: {k: float(np.median([so[lim, seed][k] for seed in SEEDS])) for k in so[None, SEEDS[0]]
               if isinstance(so[None, SEEDS[0]][k], (int, float))} for lim in LIMITS}
peak = all(min(so[128, seed]["goodput"], so[64, seed]["goodput"]) > max(so[None, seed]["goodput"], so[32, seed]["goodput"])
           for seed in SEEDS)
print(f"no limit, seed {SEEDS[0]}: median TTFT {np.median(first_half):.2f} s (first half of arrivals) -> "
      f"{np.median(second_half):.2f} s (second half); goodput peaks at 64-128 on every seed: {peak}")

# %% tags=["check"]
each = [{lim: so[lim, seed] for lim in LIMITS} for seed in SEEDS]
assert all(x[None]["rejected"] == 0 for x in each) and grow > 2, "without a limit the queue (and TTFT) keeps growing"
assert all(x[128]["ttft_p50"] < x[None]["ttft_p50"] / 4 for x in each), "with the limit, served requests wait far less"
assert all(x[32]["rejected"] > x[64]["rejected"] > x[128]["rejected"] > 0 for x in each), "a lower limit turns more away"
assert all(x[64]["tpot_p50"] < x[128]["tpot_p50"] for x in each), "the limit also caps the batch"
assert peak, "the prose: goodput peaks in between, on every seed"
assert min(x[128]["goodput"] for x in each) > max(x[64]["goodput"] for x in each), "the prose: 128 above 64, no overlap"
assert all(x[32]["throughput_tok_s"] < 0.85 * x[128]["throughput_tok_s"] for x in each), "too low a limit leaves the GPU idle"

# %% [markdown]
# 每格是 {{len(SEEDS)}} 个种子（每个 {{DUR:.0f}} s 的到达）的中位数与最小–最大；下面说的每一条在**每个种子上**都成立。
# 不限时没有一个请求被拒绝，可 TTFT 一直在涨：种子 {{SEEDS[0]}} 上，前一半到达的请求 TTFT 中位数 {{np.median(first_half):.2f}} s，后一半
# {{np.median(second_half):.2f}} s——这是过载，运行得越久越糟（表里“不限”那一行的延迟只说明它有多糟，不是稳态值）。
# 上限 {{LIMITS[1]}}（TGI 的默认）时，稳态窗口里被拒绝的请求占 {{om(128, "rejected_share", ".0%")}}，被接受的请求 TTFT 的中位数只有
# {{om(128, "ttft_p50", ".2f")}} s。上限越低拒绝得越多（{{LIMITS[2]}}：{{om(64, "rejected_share", ".0%")}}；{{LIMITS[3]}}：{{om(32, "rejected_share", ".0%")}}），
# 而且因为“同时在处理”包括**运行中**的请求，上限也截住了批的大小：{{LIMITS[2]}} 时 TPOT 的中位数从 {{med_o[128]["tpot_p50"] * 1e3:.0f}} 降到
# {{med_o[64]["tpot_p50"] * 1e3:.0f}} ms；{{LIMITS[3]}} 时批太小，吞吐只有 {{med_o[32]["throughput_tok_s"]:.0f}} tok/s（{{LIMITS[1]}} 时 {{med_o[128]["throughput_tok_s"]:.0f}}），GPU 没有用满。
# 以 SLO（TTFT ≤ {{SLO["ttft"]:g}} s、TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms，每个请求分别判断）计的有效吞吐（Goodput）：不限
# {{med_o[None]["goodput"]:.1f}} req/s，{{LIMITS[1]}} 为 {{med_o[128]["goodput"]:.1f}}，{{LIMITS[2]}} 为 {{med_o[64]["goodput"]:.1f}}，{{LIMITS[3]}} 为 {{med_o[32]["goodput"]:.1f}} req/s——
# 中间的上限最好，而且在每个种子上都是如此；在这个负载上 {{LIMITS[1]}} 的有效吞吐最差的种子也高于 {{LIMITS[2]}} 最好的种子（两者的范围不重叠），
# 最优的上限在哪里，练习 4 请你扫描。
# 背压把“所有人都慢”变成“一部分人被明确拒绝、其余人按时服务”；被拒绝的客户端拿到 429，可以退避重试或转到别的副本（第 26 章）。
# 上限该设多大，取决于服务器在 SLO 内能同时服务多少请求：太小让 GPU 闲着，太大就回到无界排队。
#
# ## 16.7 动手：路由器的旋钮
#
# 下面的控件运行 16.3 节的聊天负载（种子 1），画出每个请求的 TTFT（按到达时间）与每一步的类型，并打印稳态指标。
# 建议试试：不分块时把 `max_waiting_tokens` 从 1 拖到 60，看 TTFT 怎样从几十毫秒涨到几秒；把 `waiting_served_ratio` 调到 0.05；
# 勾选分块（v3），看两个滑块不再起作用；把到达率推到 20 并设并发上限，看拒绝与排队的取舍。

# %% tags=["nbval-ignore-output"]
def explore(max_waiting_tokens=20, waiting_served_ratio=0.3, chunked=False, rate=8.0, max_concurrent=0):
    r, policy = tgi_run(1, n=200, rate=rate, max_waiting_tokens=max_waiting_tokens, enable_chunked_prefill=chunked,
                        waiting_served_ratio=waiting_served_ratio, max_inflight_requests=max_concurrent or None)
    s = r.summary(slo=SLO, trim=TRIM)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 2.8))
    served = sorted((q.arrival_time, q.ttft) for q in r.requests if q.ttft is not None)
    ax1.plot(*zip(*served), ".", ms=3)
    ax1.set(xlabel="arrival time (s)", ylabel="TTFT (s)", yscale="log", title="TTFT of each served request")
    kinds = [("prefill only", lambda st: st.num_prefill_tokens and not st.num_decode_tokens, "C3"),
             ("mixed", lambda st: st.num_prefill_tokens and st.num_decode_tokens, "C1"),
             ("decode only", lambda st: st.num_decode_tokens and not st.num_prefill_tokens, "C0")]
    ax2.bar([k for k, _, _ in kinds], [sum(st.duration for st in r.steps if f(st)) for _, f, _ in kinds],
            color=[c for _, _, c in kinds])
    ax2.set(ylabel="seconds of steps", title="where the time went")
    fig.tight_layout()
    plt.show()
    print(f"TTFT p50/p99 {s['ttft_p50']:.2f}/{s['ttft_p99']:.2f} s, TPOT p50 {s['tpot_p50'] * 1e3:.1f} ms, "
          f"ITL p99 {s['itl_p99'] * 1e3:.0f} ms, {s['throughput_tok_s']:.0f} tok/s, rejected {s['rejected']}, "
          f"goodput {s['goodput']:.2f} req/s; joins {dict(policy.concat_reasons)}")


W.interact(explore,
           max_waiting_tokens=W.IntSlider(value=20, min=1, max=60, continuous_update=False, description="max_waiting"),
           waiting_served_ratio=W.FloatSlider(value=0.3, min=0.0, max=1.5, step=0.05, continuous_update=False,
                                              description="served_ratio"),
           chunked=W.Checkbox(value=False, description="prefill chunking (v3)"),
           rate=W.FloatSlider(value=8.0, min=2.0, max=20.0, step=1.0, continuous_update=False, description="req/s"),
           max_concurrent=W.IntSlider(value=0, min=0, max=256, step=16, continuous_update=False,
                                      description="max_concurrent (0 = no limit)"));

# %% [markdown]
# ## 16.8 在真实的 tiny 模型上：贪心输出不变
#
# 路由器的规则只决定**什么时候**算。用嵌入的 tiny 模型验证：一组长度不同的请求同时到达，批最多容纳其中一半
# （`max_num_seqs`），先结束的请求空出位置后，等待的请求按 TGI 的规则加入。在默认引擎与 `tgi` 预设的几种变体下各跑一遍
# （v3 的分块、v2 的不分块、`max_waiting_tokens=1`、很小的 `max_batch_prefill_tokens`），贪心输出必须逐 Token 相同：

# %% tags=["nbval-check-output"]
tiny_wl = synthetic(8, float("inf"), input_len=lognormal(median=24, sigma=0.5, max=64),
                    output_len=lognormal(median=24, sigma=0.5, max=48), seed=0)
TINY_VARIANTS = {
    "default engine (continuous)": dict(),
    "tgi preset (v3: chunking)": dict(preset="tgi"),
    "tgi, no chunking (v2)": dict(preset="tgi", enable_chunked_prefill=False),
    "tgi, v2, max_waiting_tokens=1": dict(preset="tgi", enable_chunked_prefill=False, max_waiting_tokens=1),
    "tgi, v3, prefill budget 16": dict(preset="tgi", max_batch_prefill_tokens=16),
}
tiny_runs = {name: run(tiny_wl, model="tiny", max_num_seqs=4, **kw) for name, kw in TINY_VARIANTS.items()}
ref_tokens = [q.output_token_ids for q in tiny_runs["default engine (continuous)"].requests]
for name, r in tiny_runs.items():
    same = [q.output_token_ids for q in r.requests] == ref_tokens
    print(f"{name:<32} steps {len(r.steps):>3}, identical to default: {same}")
    assert same, "greedy outputs must not depend on the router's rules"
tiny_prefill_only = {name: sum(1 for st in r.steps if st.num_prefill_tokens and not st.num_decode_tokens)
                     for name, r in tiny_runs.items()}
print("prefill-only steps:", tiny_prefill_only)
assert tiny_prefill_only["tgi, no chunking (v2)"] > 1, "later requests joined with prefill-only steps"

# %% [markdown]
# 不分块（v2）的变体里有 {{tiny_prefill_only["tgi, no chunking (v2)"]}} 个只做预填充的步——后来的请求都是这样加入的；
# 预填充预算为 {{TINY_VARIANTS["tgi, v3, prefill budget 16"]["max_batch_prefill_tokens"]}} 的 v3 变体把提示切成小块与解码混在一起，
# 用了 {{len(tiny_runs["tgi, v3, prefill budget 16"].steps)}} 步。步骤各不相同，输出完全相同。
#
# ## 16.9 可选：压测一个真实的 TGI 服务
#
# 如果你有一台 GPU 机器，用 TGI 的容器或 `text-generation-launcher --model-id <model>` 起服务，把地址写进环境变量 `TGI_BASE_URL`
# （例如 `http://127.0.0.1:8080`）再运行下一格：它用 `.venv/bin/python -m minibatch bench serve`（即内核所用的解释器，`sys.executable`） 对 TGI 的 OpenAI 兼容接口（`/v1/completions`）
# 发一组与 16.3 节长度相近的随机请求。`TGI_BENCH_ARGS` 追加 `bench serve` 的参数（例如 `--request-rate 12 --num-prompts 600`，
# 配合启动参数 `--max-concurrent-requests 64` 可以复现 16.6 节的 429）。没有配置或连不上时只打印一句说明，不会出错。

# %% tags=["nbval-ignore-output"]
def bench_real_server(env_var, name, extra_env):
    """Benchmark the server at $env_var with `python -m minibatch bench serve`, if one is configured and answers."""
    url = os.environ.get(env_var, "").rstrip("/")
    if not url:
        print(f"skipped: no {name} server configured (set {env_var}=http://HOST:PORT to benchmark one)")
        return
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=3) as resp:
            resp.read()
    except Exception as e:   # any failure to connect: say so and move on
        print(f"skipped: {name} server at {url} did not answer ({type(e).__name__}: {e})")
        return
    cmd = [sys.executable, "-m", "minibatch", "bench", "serve", "--base-url", url, "--dataset", "random",
           "--random-input-len", "512", "--random-output-len", "256", "--num-prompts", "100", "--request-rate", "4",
           "--tokenizer", "tiny", "--metric-percentiles", "50,90,99", "--goodput", "ttft:1000", "tpot:100",
           *os.environ.get(extra_env, "").split()]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        print(out.stdout[-4000:] or out.stderr[-2000:])
    except Exception as e:
        print(f"benchmark did not complete: {type(e).__name__}: {e}")


bench_real_server("TGI_BASE_URL", "TGI", "TGI_BENCH_ARGS")

# %% [markdown]
# 对照时注意：真实的 TGI 在 v3 下默认分块，`max_waiting_tokens` 与 `waiting_served_ratio` 不起作用；要看 16.4 节的现象，
# 启动时设环境变量 `PREFILL_CHUNKING=0`。被拒绝的请求在 `bench serve` 的结果里记为失败（HTTP 429）。
#
# ## 小结
#
# - TGI 的批处理在路由器的一个循环里：每一轮最多一次 `next_batch`、一次预填充、一次解码。`next_batch` 从队首取请求，
#   受 `max_batch_prefill_tokens`、`max_batch_total_tokens`（为每个请求预留输入加 `max_new_tokens`，从不抢占）与 `max_batch_size` 限制。
# - 不分块（v2）时预填充单独成一步，正在解码的请求全部停下：`max_waiting_tokens`（默认 {{TGI["max_waiting_tokens"]}}）决定最多等几个解码步，
#   `waiting_served_ratio`（默认 {{TGI["waiting_served_ratio"]}}）让积压够多时提前插入。调小它们降 TTFT、加 TPOT，调大则停顿更少更长、TTFT 更长
#   （本章的扫描里吞吐相差 {{thr_gap:.1%}}）。在泊松负载上默认的比例只触发少数插入（约 {{reasons[d]["backpressure"]}} 次，对等够步数的 {{reasons[d]["wait_exceeded"]}} 次）。
# - v3 默认分块：这两个参数（以及加入时的 `max_batch_size`）被忽略，新请求每轮与运行中的批拼成一次前向、随后解码一次；
#   同一负载上 TTFT 与 ITL 尾部在每个种子上都比 v2 的默认好，服务容量 {{caps["v3 (chunking)"]:.1f}} 对 {{caps["v2 (no chunking)"]:.1f}} req/s。
# - `max_concurrent_requests`（默认 {{TGI["max_inflight_requests"]}}）是背压：超载时用 429 拒绝一部分请求，换来被接受请求的有界延迟与更高的有效吞吐；
#   它同时限制了批的大小。
# - 路由器只决定先后，不改变结果：贪心输出在所有变体下逐 Token 相同。
#
# 下一章（第 17 章）从调度转到内核：用 Triton 写 KV 写入与分页解码内核。
#
# ## 练习
#
# 1. **预测插入。** 用 16.2 节的 `plans`，在 `n_running=20`、每步 5 个请求排队、`max_waiting_tokens=8` 时，序列会是什么？先用公式推，再运行。
# 2. **突发负载下的比例。** 把 16.4 节的负载换成突发到达（`synthetic(..., burstiness=0.25)`，到达间隔的 CV 为 2），重跑
#    `waiting_served_ratio` 的扫描。`backpressure` 的计数怎样变？默认的 0.3 这时有没有用？
# 3. **分块预算。** 在 v3（分块）下扫描 `max_batch_prefill_tokens` ∈ {512, 1024, 2048, 4096}，画 TTFT p50 与 ITL p99。
#    它与第 11 章 vLLM 的 `max_num_batched_tokens`、第 15 章 TensorRT-LLM 的 `max_num_tokens` 扮演的是不是同一个角色？
# 4. **上限怎么定。** 在 16.6 节的过载负载上，把 `max_inflight_requests` 从 16 扫到 256，画有效吞吐随上限的曲线。最优的上限与
#    服务器在 SLO 内能同时服务的请求数是什么关系？
# 5. **放不下的比例。** 用 `plans` 构造：批里 40 个请求，每步 12 个请求排队、每个提示 600 Token，`max_waiting_tokens=8`，
#    预填充预算分别为 4096 与 8192（`plans(12, n_running=40, steps=16, prompt=600, budget=...)`）。插入由哪个条件触发？用 16.4 节最后一条解释。
# 6. **`max_batch_total_tokens`。** 不分块时把 `max_batch_total_tokens` 设为 20000（远小于 KV 池），重跑默认配置。TTFT 与批大小怎样变？
#    为什么 TGI 的帮助文本（`launcher/src/main.rs`）说它是最重要的参数之一？
#
# <details><summary>提示与参考答案</summary>
#
# 1. $\lfloor 20 \times 0.3 \rfloor = 6 > 5$，比例条件永远不满足，只能等计数器：`plans(5, n_running=20, steps=16, max_waiting_tokens=8)`
#    给出 `{{ex1[0]}}`——每 8 步一次（7 次解码后计数器到 8）。
# 2. 突发时一批请求同时到达，队列常常一下子超过批大小的 30%，`backpressure` 计数明显增加，TTFT 的尾部下降；泊松负载上它较少触发。
#    这正是 `launcher/src/main.rs` 帮助文本举的例子（12 个请求在等、批里只剩 10 个）。
# 3. `tgi_run(1, enable_chunked_prefill=True, max_batch_prefill_tokens=B)`。预算越小，每次前向的预填充越少，ITL 尾部越小、TTFT 越大；
#    三者都是“每次前向最多算多少个新 Token”的预算（TGI 还要减去当前批的 Token 数）。
# 4. `run(over_wl[seed], **SIM, max_inflight_requests=L).summary(slo=SLO, trim=TRIM)["goodput"]`（每个种子各一次，比中位数与范围）。上限太小时 GPU 没有用满（吞吐低），
#    太大时排队让 TTFT 越过 SLO；最优值在服务器满足 SLO 时的并发数附近——Little 定律：并发 ≈ 到达率 × 停留时间。
# 5. $\lfloor 0.3 \times 40 \rfloor = 12$，排队的请求数够了，但 12 个 600 Token 的提示要 7200 个 Token：预算 4096 时 `next_batch` 只放得下 6 个，
#    凑不够 12 个就整批放回，序列是 `{{ex5[4096][0]}}`（{{ex5[4096][1]}}），等于比例条件不存在；预算 8192 时放得下，
#    序列是 `{{ex5[8192][0]}}`（{{ex5[8192][1]}}）。
# 6. 每个请求预留提示加 `max_tokens` 个 Token，`max_batch_total_tokens` 小了，同时能进批的请求就少（`next_batch` 在分配失败处停下），
#    批变小、排队变长。它决定了批最多能有多大，所以帮助文本强调它，并建议让 TGI 按剩余显存自动推断。
#
# </details>
