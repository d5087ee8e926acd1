# %% [markdown]
# # 第 4 章 批聚合策略：静态批处理与动态批处理窗口
#
# 第 3 章从排队论的角度看到：单服务台的排队时间随利用率非线性上升，而批处理能让服务能力随负载增长。那么，**怎样把到达的请求
# 聚合成批**？最朴素的两种做法在 LLM 出现之前就已经是推理服务的标配：
#
# - **静态批处理**（Static Batching）：把请求按固定大小分组，一组一起算完，再算下一组；
# - **动态批处理窗口**（Dynamic Batching Window）：请求先排队，凑满 `max_batch_size` 个，或者最老的请求已经等了 `max_wait`，
#   二者先到其一就“发车”。NVIDIA Triton Inference Server 的动态批处理器（Dynamic Batcher）和 TensorFlow Serving 的批处理都是这个思路。
#
# 这两种做法都是**请求级**（Request-level）调度：一批一旦开始，就一直跑到其中最慢的请求结束，中途谁也进不来。
# 对一次前向就出结果的模型（图像分类、Embedding）这没有问题；但 LLM 的输出是一个 Token 一个 Token 生成的，
# 输出长度差异巨大，于是出现了第 1 章 1.4 节所说的“等待最慢者”和“填充效应”。本章量化这两个问题，并扫描 `max_wait`，
# 看清第 1 章 1.5.1 节所说的“调度延迟与吞吐的权衡”到底在哪里、有多大。
#
# ## 学习目标
#
# - 理解批处理为什么能提高吞吐：解码一步的耗时增长得远比批大小慢（第 2 章），批越大，每个 Token 分摊的成本越低；
# - 理解静态批处理的两种浪费——**填充**（Padding）与**等待最慢者**，会用公式计算输出填充浪费，并在引擎中测量它（`padding_waste`）；
# - 掌握动态批处理窗口的两个旋钮 `max_batch_size`（minibatch 中是 `max_num_seqs`）与 `max_wait`（`max_wait_ms`），
#   能把它们对应到 Triton 的 `max_queue_delay_microseconds` / `preferred_batch_size` 和 TF Serving 的 `batch_timeout_micros`；
# - 通过扫描 `max_wait_ms` 理解：低负载时窗口几乎原样加到 TTFT 上，换来的是更大的批和更少的 GPU 忙碌时间；
#   高负载时队列自己就能填满批，窗口不再起作用——此时请求级批处理的瓶颈是“等整批跑完”，这正是第 5 章连续批处理要解决的。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

import minibatch
from minibatch.policies.dynamic import DynamicPolicy
from minibatch.policies.static import StaticPolicy
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.viz import gantt, md_table
from minibatch.workload import fixed, lognormal, synthetic, uniform

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter


print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 4.1 为什么要聚合：一次前向，分摊给多个请求
#
# 第 2 章讲过，解码（Decode）一步要把全部权重从显存读一遍，而每个序列只贡献一个 Token 的计算，所以这一步是访存受限的：
# 批里多放几个序列，读权重的开销不变，步长增长得远比批大小慢。用模拟器的成本模型（Roofline）算一下 Llama-2-7B 在 A100-80GB 上
# 解码一步的耗时，以及折算到每个 Token 的成本。只列 KV Cache 放得下的批（`RooflineCostModel.fits`）：

# %% tags=["nbval-check-output"]
cm = make_cost_model("llama-2-7b", "a100-80g")
CTX, CANDIDATES = 512, (1, 4, 16, 64, 128, 256)          # every sequence's context; batch sizes tried
rows = []
batches = [b for b in CANDIDATES if cm.fits(b, CTX)]
print(f"at most {cm.max_batch(CTX)} sequences of {CTX} tokens fit")
for b in batches:
    t = cm.step_time([], [CTX] * b)
    rows.append([b, f"{t * 1e3:.2f}", f"{t / b * 1e3:.3f}", f"{b / t:,.0f}"])
md_table(["batch size", "decode step (ms)", "ms per token", "tokens/s"], rows)

# %% tags=["check"]
assert CANDIDATES[-1] not in batches, "the largest candidate batch does not fit on A100-80G: never tabulated"
step = {b: cm.step_time([], [CTX] * b) for b in batches}
grow_b, grow_t = batches[-1] / batches[0], step[batches[-1]] / step[batches[0]]
assert grow_t < grow_b / 10, "the prose says the step grows far more slowly than the batch"

# %% [markdown]
# 每个序列的上下文是 {{CTX}} Token，这张卡最多放得下 {{cm.max_batch(CTX)}} 条，批 {{CANDIDATES[-1]}} 根本不会出现。
# 批大小从 {{batches[0]}} 到 {{batches[-1]}}（{{grow_b:.0f}} 倍），步长只从 {{step[batches[0]] * 1e3:.1f}} ms 增加到
# {{step[batches[-1]] * 1e3:.1f}} ms（{{grow_t:.1f}} 倍），每秒产出的 Token 因此增长了 {{grow_b / grow_t:.0f}} 倍——这就是所有批处理策略的
# 收益来源。
# 问题在于：请求是一个一个随机到达的，**要凑出大批，就得让先到的请求等**；而 LLM 请求的输出长度各不相同，
# **凑在一起的请求不会同时结束**。下面两节分别讨论这两件事。
#
# ## 4.2 静态批处理：填充与等待最慢者
#
# 静态批处理把请求按到达顺序每 $B$ 个分成一组（`max_num_seqs` = $B$），一组一起预填充、一起解码，**直到组里最长的输出生成完**，
# 下一组才开始。这就是对一个填充后的张量调用 `model.generate` 的行为，也是 Orca（OSDI'22）之前请求级服务系统的做法。
# minibatch 的 `static` 策略实现了它：

# %%
print(inspect.getsource(StaticPolicy))

# %% [markdown]
# 浪费来自两处。第一是**输入填充**：一批里的提示长度不同，要补齐到最长的那个才能拼成矩形张量。第二是**输出填充**：
# 设一批 $B$ 个请求的输出长度为 $o_1,\dots,o_B$，这批要跑 $\max_i o_i$ 步，每一步占 $B$ 个槽位，其中真正在生成的只有
# 还没结束的那些。已结束的请求占着槽位空转，浪费的比例为
#
# $$
# \text{padding\_waste} = 1 - \frac{\sum_i o_i}{B \cdot \max_i o_i}.
# $$
#
# 输出长度越分散、$B$ 越大，$\max_i o_i$ 越被长尾拉高，浪费越大。minibatch 在每一步记录这些空转槽位（`StepRecord.num_padded_slots`），
# `RunResult.summary()["padding_waste"]` 是它们占全部槽位步的比例。（引擎并不真的去算这些空槽位，所以模拟的步长里不含填充计算，
# 浪费体现为**并发度的损失**：本可以用来服务新请求的槽位闲着。真实的填充张量实现还要再为这些槽位付出计算。）
#
# 下面让一组提示长度相同的请求同时到达，输出长度分别取三种分布（平均长度相近，分散程度不同），
# 用不同的批大小 $B$ 跑 `static` 策略：

# %%
N_STATIC, PROMPT_STATIC, B_STATIC = 64, 256, (4, 16, 64)
OUTPUTS = {"fixed(64)": fixed(64), "uniform(16, 112)": uniform(16, 112),
           "lognormal(median 40, mean 64)": lognormal(median=40, mean=64, max=1024)}
BIG_BUDGET = dict(max_num_batched_tokens=16384)          # a whole batch's prefill fits in one step

# %% [markdown]
# {{N_STATIC}} 个请求的提示长度都是 {{PROMPT_STATIC}}，批大小 $B$ 取 {{'、'.join(map(str, B_STATIC))}}。
# 同时按上面的公式直接从输出长度算出浪费，与引擎的测量对照；最后一列是同样的批大小上限下，连续批处理
# （`continuous`，第 5 章）的吞吐：

# %% tags=["nbval-check-output"]
rows = []
static_runs = {}
for name, dist in OUTPUTS.items():
    wl = synthetic(N_STATIC, float("inf"), input_len=fixed(PROMPT_STATIC), output_len=dist, seed=0)
    o = wl.output_lens
    for B in B_STATIC:
        r = run(wl, **SIM, policy="static", max_num_seqs=B, **BIG_BUDGET)
        s = r.summary()
        groups = [o[i:i + B] for i in range(0, len(o), B)]
        formula = 1 - o.sum() / sum(len(g) * g.max() for g in groups)
        cont = run(wl, **SIM, policy="continuous", max_num_seqs=B, **BIG_BUDGET).summary()
        static_runs[(name, B)] = r
        rows.append([name, f"{o.mean():.0f} / {o.max()}", B, f"{formula:.3f}", f"{s['padding_waste']:.3f}",
                     f"{s['throughput_tok_s']:,.0f}", f"{cont['throughput_tok_s']:,.0f}"])
md_table(["output lengths", "mean / max", "B", "waste (formula)", "padding_waste (engine)",
          "static tok/s", "continuous tok/s"], rows)

# %%
ln = "lognormal(median 40, mean 64)"
B1, B2, B_ALL = B_STATIC
w4, w16 = (static_runs[(ln, B)].summary()["padding_waste"] for B in (B1, B2))

# %% tags=["check"]
assert static_runs[("fixed(64)", B2)].summary()["padding_waste"] == 0 and w16 > w4 > 0
assert all(abs(float(r[3]) - float(r[4])) < 1e-3 for r in rows), "the prose says the engine matches the formula"
assert B_ALL == N_STATIC and all(r[5] == r[6] for r in rows if r[2] == B_ALL), "the prose: one batch, same throughput"

# %% [markdown]
# 输出长度固定时没有任何浪费；对数正态分布（典型的真实输出长度分布，有长尾）下，$B={{B1}}$ 时已有 {{w4:.0%}} 的槽位步在空转，
# $B={{B2}}$ 时达到 {{w16:.0%}}。引擎测得的浪费与公式一致（表中两列）。只有 $B={{B_ALL}}$（所有请求一批）时静态与连续批处理吞吐相同：
# 没有别的请求可以补进空出来的槽位，连续批处理也无事可做。

# %% [markdown]
# 把 $B={{B2}}$、对数正态输出的运行画成请求甘特图（`minibatch.viz.gantt`，每行一个请求：灰色为排队，橙色为预填充，蓝色为解码）。
# 可以清楚地看到“等待最慢者”：每一批的大多数请求早早结束，下一批却要等本批最长的那个请求跑完才开始，于是后面几批请求的排队时间
# （也就是它们的 TTFT）成倍增长。

# %%
fig = gantt(static_runs[(ln, B2)], max_requests=N_STATIC, figsize=(9, 5))
fig.axes[0].set_title(f"Static batching, B={B2}, {N_STATIC} requests at t=0 (lognormal outputs)")
display(fig)

# %% [markdown]
# ## 4.3 动态批处理窗口：`max_batch_size` 与 `max_wait`
#
# 静态批处理假设请求已经在那里了；在线服务中请求是陆续到达的。**动态批处理**给队列加一个“发车规则”：
#
# - 排队的请求数达到 `max_batch_size`，立即发车（凑满一批）；
# - 或者队列中最老的请求已经等待了 `max_wait`，不管凑了几个都发车（窗口到期）。
#
# 发车后这一批照样跑到最慢者结束（仍是请求级批处理）。minibatch 的 `dynamic` 策略就是 `static` 加上这条规则，
# `max_num_seqs` 充当 `max_batch_size`，`max_wait_ms` 是窗口；`next_wakeup` 告诉引擎窗口何时关闭，
# 这样虚拟时钟可以直接跳到那一刻：

# %%
print(inspect.getsource(DynamicPolicy))

# %% [markdown]
# 在主流服务框架里，同样的两个旋钮是这样命名的：
#
# - **Triton Inference Server**（NVIDIA；用户指南 *Batchers* 的 Dynamic Batcher 一节，`triton-inference-server/server`
#   仓库的 `docs/user_guide/batcher.md`，2024 年的 2.x 版本）：模型配置里的 `max_batch_size` 限定批的上限；
#   `dynamic_batching { max_queue_delay_microseconds: ... }` 是请求为了等待更多请求而在调度队列里最多被延迟的时间；
#   `preferred_batch_size: [4, 8]` 表示凑到这些大小之一就可以立即发车，不必等到上限（文档提醒大多数模型不需要设置它）。
#   文档还指出，默认配置 `dynamic_batching { }` 会在不超过上限的前提下尽量组大批，**但不做任何延迟**（相当于 `max_wait = 0`）；
#   推荐的调参流程是先用默认配置测出延迟与吞吐，若延迟仍在预算之内，再增大最大批大小或设置非零的延迟，
#   逐步加大延迟直到超出延迟预算，观察吞吐随之如何变化——这正是 4.4 节要做的扫描。
# - **TensorFlow Serving**（*TensorFlow Serving Batching Guide*，`tensorflow/serving` 仓库的
#   `tensorflow_serving/batching/README.md`）：`max_batch_size`、`batch_timeout_micros`（输出一个不满的批之前最多等待的微秒数），
#   另有 `num_batch_threads`（并行处理的批数）、`max_enqueued_batches`（排队的批数上限，超出即快速失败）、
#   `allowed_batch_sizes` 与 `pad_variable_length_inputs`（把变长输入填充对齐，正是 4.2 节说的输入填充）。
#
# 第 1 章 1.6 节案例里的 `--max-wait 30ms` 在 minibatch 里就是 `max_wait_ms=30`（minibatch 自己的选项）。
# 注意 vLLM 的连续批处理并没有同名参数；与之最接近的是 V0 引擎的 `--scheduler-delay-factor`（vLLM PR #3279 引入；vLLM v0.7
# `vllm/engine/arg_utils.py`，默认 0.0），
# 按上一次预填充耗时的倍数推迟下一次预填充。
#
# 窗口的作用可以粗略估算：若服务器空闲，到达率为 $\lambda$（泊松），第一个请求到达后，窗口 $w$ 内平均还会再来 $\lambda w$ 个，
# 所以发车时的批大小约为
#
# $$
# \mathbb{E}[B_{\text{dispatch}}] \approx \min\bigl(B_{\max},\ 1+\lambda w\bigr),
# $$
#
# 而第一个请求为此多等了约 $\min(w,\ \text{凑满 } B_{\max} \text{ 所需的时间})$。当 $\lambda w \ll 1$ 时，几乎每个请求都独自等满整个窗口、
# 批却没有变大——窗口纯粹是延迟。窗口要“值回票价”，需要 $\lambda w$ 达到几个请求的量级。
# 另一方面，如果服务器正忙（上一批还在跑），新请求本来就要排队，等上一批结束时窗口往往早已过期：**窗口只在队列被清空时起作用**。
#
# ## 4.4 扫描 `max_wait`：TTFT 与吞吐的交换
#
# 下面在模拟的 Llama-2-7B / A100-80GB 上，用一个输出较短的负载（均匀分布，泊松到达；这类请求比如分类、抽取、短答）
# 扫描 `max_wait_ms` 与一组到达率：

# %%
WIN_SHAPE = dict(input_len=uniform(64, 512), output_len=uniform(8, 32))
WINDOWS = [0, 50, 100, 200]
WIN_RATES = [1, 4, 10, 20, 30, 40]
N_WIN, SEQS_WIN = 200, 16            # requests per point; the batch limit
DYN = dict(**SIM, policy="dynamic", max_num_seqs=SEQS_WIN, max_num_batched_tokens=8192)

# %% [markdown]
# 提示 {{WIN_SHAPE['input_len'].lo}}–{{WIN_SHAPE['input_len'].hi}} Token，输出 {{WIN_SHAPE['output_len'].lo}}–{{WIN_SHAPE['output_len'].hi}}
# Token；`max_wait_ms` 取 {{'、'.join(map(str, WINDOWS))}}，到达率 {{'、'.join(map(str, WIN_RATES))}} req/s，
# `max_num_seqs={{SEQS_WIN}}`，每个点回放 {{N_WIN}} 个请求。
# 除了 TTFT 与吞吐，我们还记录 **GPU 忙碌比例**（各步耗时之和 / 运行总时长）：同样的请求用更少的 GPU 时间算完，
# 意味着服务器有更多余量，或者可以少用一些 GPU。

# %%
win = {}
for w in WINDOWS:
    for rate in WIN_RATES:
        r = run(synthetic(N_WIN, rate, **WIN_SHAPE, seed=0), **DYN, max_wait_ms=w)
        s = r.summary()
        s["gpu_busy"] = sum(st.duration for st in r.steps) / s["duration_s"]
        win[(w, rate)] = s

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for i, w in enumerate(WINDOWS):
    pts = [win[(w, rate)] for rate in WIN_RATES]
    axes[0].plot([p["request_throughput"] for p in pts], [p["ttft_p50"] * 1e3 for p in pts], "o-", color=f"C{i}",
                 label=f"max_wait_ms={w}")
    axes[1].plot(WIN_RATES, [p["gpu_busy"] for p in pts], "o-", color=f"C{i}", label=f"max_wait_ms={w}")
axes[0].set(xlabel="achieved throughput (req/s)", ylabel="TTFT p50 (ms)", yscale="log",
            title="TTFT vs throughput (one point per request rate)")
axes[1].set(xlabel="offered request rate (req/s)", ylabel="GPU busy fraction", ylim=(0, 1.05),
            title="What the window buys: less GPU time")
for ax in axes:
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
fig.suptitle(f"Dynamic batching window, llama-2-7b on a100-80g (simulated), max_num_seqs={SEQS_WIN}", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# 低负载一端，{{len(WINDOWS)}} 条曲线上下分开，彼此相差约一个窗口；高负载一端它们汇合在一起。下表把最低到达率（{{WIN_RATES[0]}} req/s）下的数字列出来，
# 验证“TTFT 几乎原样增加一个窗口”：

# %% tags=["nbval-check-output"]
base = win[(0, WIN_RATES[0])]
rows = []
for w in WINDOWS:
    s = win[(w, WIN_RATES[0])]
    rows.append([w, f"{s['ttft_p50'] * 1e3:.0f}", f"{(s['ttft_p50'] - base['ttft_p50']) * 1e3:.0f}",
                 f"{s['mean_batch_size']:.2f}", f"{s['gpu_busy']:.3f}", f"{s['request_throughput']:.2f}"])
md_table(["max_wait_ms", "TTFT p50 (ms)", "TTFT p50 increase (ms)", "mean batch", "GPU busy", "throughput (req/s)"], rows)

# %%
mid, high, wmax = WIN_RATES[1], WIN_RATES[-1], max(WINDOWS)
lo200 = win[(wmax, WIN_RATES[0])]
saved = 1 - win[(wmax, mid)]["gpu_busy"] / win[(0, mid)]["gpu_busy"]
high_ttft = "、".join(f"{win[(w, high)]['ttft_p50'] * 1e3:.0f}" for w in WINDOWS)

# %% tags=["check"]
assert abs((lo200["ttft_p50"] - base["ttft_p50"]) - wmax / 1e3) < 0.05, "the prose: the largest window adds about itself"
assert saved > 0, "the prose says the window saves GPU time at the middle rate"
assert max(win[(w, high)]["ttft_p50"] for w in WINDOWS) < 1.2 * min(win[(w, high)]["ttft_p50"] for w in WINDOWS)

# %% [markdown]
# 在 {{WIN_RATES[0]}} req/s 下，即使是最大的窗口，$\lambda w$ 也只有 {{WIN_RATES[0] * max(WINDOWS) / 1000:.1f}}：窗口几乎原样加到了
# TTFT 上（{{wmax}} ms 窗口让 TTFT p50 增加了 {{(lo200['ttft_p50'] - base['ttft_p50']) * 1e3:.0f}} ms），平均批大小却只从
# {{base['mean_batch_size']:.2f}} 变到 {{lo200['mean_batch_size']:.2f}}。到 {{mid}} req/s，窗口开始“买到”东西：GPU 忙碌比例从
# {{win[(0, mid)]['gpu_busy']:.2f}} 降到 {{win[(wmax, mid)]['gpu_busy']:.2f}}（同样的请求少用了 {{saved:.0%}} 的 GPU 时间），
# 代价是 TTFT p50 从 {{win[(0, mid)]['ttft_p50'] * 1e3:.0f}} ms 变为 {{win[(wmax, mid)]['ttft_p50'] * 1e3:.0f}} ms。
# 到 {{high}} req/s，服务器一直忙，队列在上一批运行期间就已积满，{{len(WINDOWS)}} 种窗口的 TTFT p50（{{high_ttft}} ms）与吞吐
# （约 {{win[(0, high)]['request_throughput']:.1f}} req/s）都相差无几——这时服务器已经过载，这几个 TTFT 的绝对值取决于回放了多少个
# 请求（这里每点 {{N_WIN}} 个），只有它们“彼此相近”这一点有意义。注意：在未饱和的区间，吞吐始终等于到达率（第 3 章的 Little
# 定律与稳定性），窗口并不能让你“多处理”请求；它换来的是更少的 GPU 时间。

# %% [markdown]
# ## 4.5 高负载下的瓶颈：批大小与等待最慢者
#
# 既然高负载时窗口无关紧要，决定请求级批处理上限的就是批大小 `max_batch_size` 和“等整批跑完”。下面固定一个超过上面任何配置
# 处理能力的到达率，改变 `max_num_seqs`，并与同一上限下的连续批处理对比：

# %%
OVERLOAD, TRIM, WAIT_HI = WIN_RATES[-1], 0.2, 50     # req/s; share trimmed at each end; dynamic's window (ms)
B_HI = (4, 8, 16, 32)

# %% [markdown]
# 到达率 {{OVERLOAD}} req/s，`max_num_seqs` 取 {{'、'.join(map(str, B_HI))}}，动态批处理的窗口 {{WAIT_HI}} ms。
# 过载时吞吐就是饱和吞吐，按稳态测（`summary(trim={{TRIM}})`，去掉预热与收尾）；TTFT 则随回放长度一直增长，
# 表中的值只能用来比较同样长度的运行：

# %% tags=["nbval-check-output"]
rows, hi_runs = [], {}
for B in B_HI:
    wl = synthetic(N_WIN, OVERLOAD, **WIN_SHAPE, seed=0)
    dr = run(wl, **{**DYN, "max_num_seqs": B}, max_wait_ms=WAIT_HI)
    cr = run(wl, **SIM, policy="continuous", max_num_seqs=B, max_num_batched_tokens=8192)
    d = {**dr.summary(trim=TRIM), "padding_waste": dr.summary()["padding_waste"]}
    c = cr.summary(trim=TRIM)
    hi_runs[B] = (d, c)
    rows.append([B, f"{d['request_throughput']:.1f}", f"{d['padding_waste']:.2f}", f"{d['ttft_p50']:.2f}",
                 f"{c['request_throughput']:.1f}", f"{c['ttft_p50']:.2f}"])
md_table(["max_num_seqs", "dynamic: req/s", "dynamic: padding waste", "dynamic: TTFT p50 (s)",
          "continuous: req/s", "continuous: TTFT p50 (s)"], rows)

# %% tags=["check"]
dyn_tp = [hi_runs[B][0]["request_throughput"] for B in B_HI]
assert dyn_tp == sorted(dyn_tp), "the prose says request-level batching's capacity grows with the batch"
assert all(c["request_throughput"] > d["request_throughput"] and c["ttft_p50"] < d["ttft_p50"]
           for d, c in hi_runs.values()), "the prose says continuous batching serves more and queues less"

# %% [markdown]
# 请求级批处理的处理能力随批大小增长，但即使输出长度只在 {{WIN_SHAPE['output_len'].lo}}–{{WIN_SHAPE['output_len'].hi}} 之间，
# 也有 {{min(d['padding_waste'] for d, _ in hi_runs.values()):.0%}}–{{max(d['padding_waste'] for d, _ in hi_runs.values()):.0%}}
# 的槽位在空转；在同样的批大小上限下，
# 让新请求随时补进空槽位（连续批处理）能处理更多请求，排队也更短。输出长度越偏斜，这个差距越大——第 5 章会在长尾负载上看到它。
#
# ## 4.6 动手：窗口、批大小与到达率
#
# 下面的函数用 4.4 节的负载跑一次 `dynamic` 策略，画出最前面一些请求的甘特图：

# %% tags=["nbval-ignore-output"]
GANTT_ROWS = 40


def explore(rate=2.0, max_wait_ms=100.0, max_batch_size=SEQS_WIN):
    r = run(synthetic(N_WIN, rate, **WIN_SHAPE, seed=1), **{**DYN, "max_num_seqs": max_batch_size},
            max_wait_ms=max_wait_ms)
    s = r.summary()
    fig = gantt(r, max_requests=GANTT_ROWS, figsize=(9, 4))
    display(fig)
    plt.close(fig)
    busy = sum(st.duration for st in r.steps) / s["duration_s"]
    print(f"TTFT p50/p99 {s['ttft_p50'] * 1e3:.0f}/{s['ttft_p99'] * 1e3:.0f} ms | throughput {s['request_throughput']:.2f} req/s | "
          f"mean batch {s['mean_batch_size']:.2f} | padding waste {s['padding_waste']:.2f} | GPU busy {busy:.2f}")

# %% [markdown]
# 控件每次回放 {{N_WIN}} 个请求，甘特图画前 {{GANTT_ROWS}} 个。建议试试：到达率
# {{inspect.signature(explore).parameters['rate'].default:g}} req/s 下把 `max_wait_ms` 从 0 调到
# {{int(1.5 * max(WINDOWS))}}，看每个请求的灰色排队段如何变长、批如何变大；再把到达率调到 {{WIN_RATES[-2]}} req/s，
# 看窗口为什么不再重要。

# %% tags=["nbval-ignore-output"]
W.interact(explore,
           rate=W.FloatLogSlider(value=2.0, base=10, min=-0.5, max=1.7, step=0.05, continuous_update=False,
                                 description="rate (req/s)"),
           max_wait_ms=W.FloatSlider(value=100.0, min=0.0, max=500.0, step=10.0, continuous_update=False,
                                     description="max_wait_ms"),
           max_batch_size=W.IntSlider(value=SEQS_WIN, min=1, max=64, continuous_update=False,
                                      description="max_batch_size"));

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX_B, EX_RATES, EX_WAIT_MS = [2, 4, 8, 16, 32, 64], [2, 4, 8], 100
ex_batch = {lam: 1 + lam * EX_WAIT_MS / 1e3 for lam in EX_RATES}     # 4.3's estimate, lambda * w + 1

# %% [markdown]
# 实验 **L02**（`labs/L02_window.ipynb`）会让你亲手把这个窗口写成一个 minibatch 调度策略（实现 `schedule_order` 与 `next_wakeup`），
# 插进真实引擎，在模拟器里复现本章的结论。
#
# ## 本章小结
#
# - 批处理的收益来自解码步长增长得远比批大小慢：同一次前向分摊给更多请求。代价是请求要**等别人**：等凑批，以及等批里最慢的请求。
# - 静态批处理的输出填充浪费是 $1 - \sum o_i / (B\max o_i)$，输出长度越偏斜、批越大，浪费越大；minibatch 用 `padding_waste` 测量它，
#   与公式一致。“等待最慢者”让后面批次的 TTFT 成倍增长。
# - 动态批处理窗口（Triton 的 `max_queue_delay_microseconds`，TF Serving 的 `batch_timeout_micros`，minibatch 的 `max_wait_ms`）
#   在队列被清空的低负载区间起作用：TTFT 几乎原样增加一个窗口，换来更大的批与更少的 GPU 时间；只有当 $\lambda w$ 达到几个请求时才划算。
#   高负载下队列自己填满批，窗口无关紧要。
# - 请求级批处理的处理能力受“等整批跑完”限制。让请求在每一步都能加入和离开——**迭代级调度**——是下一章的主题。
#
# ## 练习
#
# 1. **填充浪费的期望值。** 对 $B$ 个独立同分布的输出长度，$\mathbb{E}[\text{waste}] \approx 1 - \mathbb{E}[o]/\mathbb{E}[\max_i o_i]$。
#    用 numpy 对 4.2 节的对数正态分布估计 $B = {{', '.join(map(str, EX_B))}}$ 时的 $\mathbb{E}[\max_i o_i]$，画出浪费随 $B$ 的曲线，并与引擎测得的 `padding_waste` 对照。
# 2. **按长度分桶。** 如果先把请求按（预测的）输出长度排序再分批，静态批处理的浪费会怎样变化？在 4.2 节的设置下，
#    把 `wl` 按输出长度排序后重新构造一个 `Workload` 来验证。现实中输出长度事先未知，这个思路会在第 21 章（长尾与 SJF）再出现。
# 3. **窗口何时划算。** 用 4.3 节的估算 $\mathbb{E}[B] \approx 1 + \lambda w$，对到达率 {{'、'.join(map(str, EX_RATES))}} req/s 预测 `max_wait_ms={{EX_WAIT_MS}}` 时的平均批大小，
#    再用模拟器验证（注意服务器忙时请求本来就在排队，预测会偏低还是偏高？）。
# 4. **Triton 的 `preferred_batch_size`。** 写一个 `DynamicPolicy` 的子类：只要等待的请求数达到一组“偏好批大小”中的某一个就发车
#    （提示：覆盖 `dispatch_ready`）。与原策略比较低负载下的 TTFT 与批大小分布。完成 L02 之后再做会更顺手。
# 5. **思考题。** 第 1 章案例把 `max-wait` 从 30 ms 降到 20 ms 的同时把 `max-num-seqs` 从 8 提到 16。结合本章的结果，
#    这两个改动分别在什么负载区间起作用？
#
# <details><summary>提示与参考答案</summary>
#
# 1. `np.random.default_rng(0)` 抽 $B$ 个对数正态样本、重复几千次取 $\max$ 的均值；$\mathbb{E}[\max_i o_i]$ 随 $B$ 增长
#    （长尾分布增长得更快），浪费随之趋近 1。引擎测得的 `padding_waste` 应落在这条曲线附近（一次运行只有 {{N_STATIC}} 个请求，有抽样误差）。
# 2. 排序后同一批的输出长度相近，$\max_i o_i$ 接近批内均值，浪费大幅下降——这就是按长度分桶（Bucketing）；
#    它需要事先知道（或预测）输出长度。
# 3. 预测 $1 + {{EX_RATES[0]}}\times{{EX_WAIT_MS / 1e3:g}} = {{ex_batch[EX_RATES[0]]:.1f}}$、{{'、'.join(f'{ex_batch[r]:.1f}' for r in EX_RATES[1:])}}；服务器忙时请求已在队列里等候，发车时的批比这个估计大，所以估计偏低。
# 4. 在 `dispatch_ready` 里，除了“凑满 `max_num_seqs`”与“窗口到期”，再加一条“等待数属于偏好批大小之一”；低负载下它让批
#    更早发车（TTFT 更短），批大小分布集中在那几个值上。
# 5. 把 `max-wait` 从 30 ms 降到 20 ms 只在低负载、队列常被清空时起作用（TTFT 少等约 10 ms）；把 `max-num-seqs` 从 8 提到 16
#    在高负载时起作用（每批能装更多请求，饱和吞吐更高）。
#
# </details>
