# %% [markdown]
# # 第 2 章　Prefill 与 Decode：两阶段的计算与访存
#
# 第 1 章看到，批处理在（模拟的）GPU 上能把吞吐提升一个数量级，在 CPU 上的小模型上只有几倍，而单请求的解码速度
# 有一个由显存带宽决定的物理上限。这一章把这两句话
# 背后的机制讲清楚：一次生成请求分成**预填充（Prefill）**与**解码（Decode）**两个阶段，它们的计算量与访存量完全不同，
# 一个是算力受限（Compute-bound），一个是访存受限（Memory-bound）。用 Roofline 模型量化之后，你会明白为什么
# “解码阶段的批处理几乎是免费的”，以及这份“免费”在什么时候结束。

# %% [markdown]
# ## 学习目标
#
# 读完并运行本章后，你将能够：
#
# 1. 说明 Prefill 与 Decode 各自做什么、决定了哪个延迟指标（TTFT 与 TPOT）；
# 2. 计算矩阵乘（GEMM）与注意力的算术强度（Arithmetic Intensity，FLOP/Byte），判断一个内核是算力受限还是访存受限；
# 3. 用 Roofline 公式 $t = \max(F/P,\; B/W)$ 估算一步的耗时，并算出每种 GPU 的“脊点”（Ridge Point）；
# 4. 在 CPU 上实测真实小模型的单步耗时随批大小、上下文长度的变化，并用代价模型预测 LLaMA-7B 在 A100/H100 上的同一条曲线；
# 5. 解释“解码批处理几乎免费”的条件：权重读取被摊薄，直到 GEMM 变成算力受限，或 KV Cache 的读取量压过权重。

# %% [markdown]
# ## 2.1 一次生成的两个阶段
#
# 给定一个长度为 $P$ 的 Prompt，自回归生成分两步走：
#
# - **Prefill（预填充）**：一次前向计算处理全部 $P$ 个 Prompt Token，把每一层的 Key/Value 写进 KV Cache，
#   并采样出第一个输出 Token。它决定了首 Token 延迟（TTFT）中“计算”的那一部分。
# - **Decode（解码）**：此后每一步只为每个序列输入 **1 个** 新 Token，读取它此前全部 Token 的 KV，生成下一个 Token。
#   相邻两个 Token 的间隔就是 TPOT（Time Per Output Token）。
#
# 对一个输出 $N$ 个 Token 的请求（忽略排队）：
#
# $$\text{TTFT} \approx t_{\text{prefill}}(P), \qquad \text{E2E} \approx \text{TTFT} + (N-1)\cdot \text{TPOT}.$$
#
# 先在真实的 `tiny` 模型上看一看。准备一个引擎和一个小工具：提交一批 Prompt、生成到底，返回引擎记录的每一步。
# （CPU 上的耗时随机器负载浮动，这类单元格不做输出比对。）

# %% tags=["nbval-ignore-output"]
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

from minibatch import LLM, SamplingParams
from minibatch.sim import RooflineCostModel, available_hardware, get_hardware, get_model_spec, make_cost_model

torch.set_num_threads(1)          # one thread: steadier CPU step times on a shared machine
plt.rcParams["figure.dpi"] = 90
rng = np.random.default_rng(0)

llm = LLM(model="tiny", max_num_seqs=64, max_num_batched_tokens=4096)


def generate_and_steps(prompts, max_tokens):
    """Run prompts (token-id lists) to completion; return the engine's new StepRecords."""
    n0 = len(llm.engine.steps)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm.engine.steps[n0:]


PROMPT_LEN, GEN_TOKENS = 256, 16

# %% [markdown]
# 提交一个 {{PROMPT_LEN}} Token 的 Prompt，生成 {{GEN_TOKENS}} 个 Token，然后读引擎记录的每一步：

# %% tags=["nbval-ignore-output"]
generate_and_steps([rng.integers(5, 4000, 16).tolist()], 4)          # warm-up
steps = generate_and_steps([rng.integers(5, 4000, PROMPT_LEN).tolist()], GEN_TOKENS)
for st in steps[:4]:
    print(f"step {st.step}: prefill tokens {st.num_prefill_tokens:3d}, decode seqs {st.num_decode_seqs}, "
          f"{st.duration * 1e3:6.1f} ms")
print(f"... {len(steps)} steps in all: 1 prefill + {len(steps) - 1} decode steps")

# %% tags=["nbval-ignore-output"]
t_pre = steps[0].duration
t_dec = np.median([st.duration for st in steps[1:]])
per_token_pre = t_pre / steps[0].num_prefill_tokens
assert t_dec > per_token_pre, "the prose says a decode token costs more than a prefill token"

# %% [markdown]
# 这次运行里，Prefill 一步处理 {{steps[0].num_prefill_tokens}} 个 Token 用了 {{t_pre * 1e3:.0f}} ms，每个 Decode 步只处理
# {{steps[1].num_decode_seqs}} 个 Token，用了 {{t_dec * 1e3:.1f}} ms（中位数）。按 Token 算，Prefill 的单 Token 成本是 {{per_token_pre * 1e3:.2f}} ms，
# Decode 是它的 {{t_dec / per_token_pre:.0f}} 倍：Decode 一步做的计算很少，却付出了整整一步的固定成本。

# %% [markdown]
# ## 2.2 计算量与访存量：算术强度
#
# 一个内核（Kernel）的耗时取决于两件事：做多少浮点运算（FLOPs，记为 $F$），以及要从显存搬多少字节（记为 $B$）。
# 二者之比是**算术强度（Arithmetic Intensity）**：
#
# $$I = \frac{F}{B}\quad(\text{FLOP/Byte}).$$
#
# **矩阵乘（GEMM）。** Transformer 每层的 QKV、O、gate/up、down 投影都是 $(M\times k)\cdot(k\times n)$ 的矩阵乘，
# $M$ 是这一步的 Token 数（Prefill 时是 Prompt 长度之和，Decode 时是批大小 $B$），$b$ 是每个元素的字节数：
#
# $$F = 2Mkn,\qquad B = (kn + Mk + Mn)\,b,\qquad I = \frac{2Mkn}{(kn+Mk+Mn)\,b}\;\approx\;\frac{2M}{b}\quad(M\ll k,n).$$
#
# fp16（$b=2$）时 $I\approx M$：**Decode 的批大小就是 GEMM 的算术强度**。批为 1 时每读 2 字节权重只做 2 次浮点运算；
# Prefill 一次处理上千个 Token，强度高达上千。
#
# **解码注意力。** 每个序列读取自己长度为 $c$ 的 KV（$K$ 个 KV 头、头维 $d$），与 $H$ 个查询头做点积与加权求和：
#
# $$F = 4Hdc,\qquad B \approx 2Kdc\,b,\qquad I \approx \frac{2H}{K\,b}.$$
#
# 它与批大小、上下文长度都无关：多头注意力（MHA，$H=K$）在 fp16 下约为 1 FLOP/Byte，分组查询注意力（GQA）按
# $H/K$ 倍提高。每个序列的 KV 只属于它自己，批处理摊薄不了这部分读取。
#
# 代价模型 `RooflineCostModel` 里的 GEMM 正是这样计算的：

# %%
print(inspect.getsource(RooflineCostModel._gemm))
print(inspect.getsource(RooflineCostModel.roofline))

# %% [markdown]
# 用 LLaMA-2-7B 的真实形状算一算：一层里 gate+up 投影（$k={{get_model_spec('llama-2-7b').hidden_size}},\ n=2\times {{get_model_spec('llama-2-7b').intermediate_size}}$）在不同 $M$ 下的算术强度，
# 以及解码注意力的强度（LLaMA-2-7B 是 MHA；LLaMA-3-8B 是 {{get_model_spec('llama-3-8b').num_kv_heads}} 个 KV 头的 GQA）。

# %% tags=["nbval-check-output"]
spec = get_model_spec("llama-2-7b")
k, n, b = spec.hidden_size, 2 * spec.intermediate_size, spec.dtype_bytes


def gemm_intensity(m, k=k, n=n, b=b):
    return 2 * m * k * n / ((k * n + m * k + m * n) * b)


for m in [1, 8, 64, 256, 2048]:
    print(f"gate+up GEMM, M={m:5d} tokens: I = {gemm_intensity(m):7.1f} FLOP/B")
for name in ["llama-2-7b", "llama-3-8b"]:
    s = get_model_spec(name)
    print(f"decode attention, {name} (H={s.num_heads}, K={s.num_kv_heads}): I = {2 * s.num_heads / (s.num_kv_heads * s.dtype_bytes):.0f} FLOP/B")

# %% [markdown]
# ## 2.3 Roofline 模型
#
# 硬件有两个上限：峰值算力 $P$（FLOP/s）和显存带宽 $W$（Byte/s）。一个内核要么被算力卡住，要么被带宽卡住，
# 耗时取两者中较大的那个（Williams et al., *Roofline*, CACM 2009）：
#
# $$t = \max\!\left(\frac{F}{P},\; \frac{B}{W}\right), \qquad \text{attainable FLOP/s} = \min(P,\; I\cdot W).$$
#
# 两条线的交点叫**脊点（Ridge Point）**：$I^{*} = P/W$。强度低于 $I^{*}$ 的内核是访存受限的，高于它的是算力受限的。
# 实际内核达不到数据手册的峰值，minibatch 的硬件规格里记录了可达比例（`flop_efficiency`、`bandwidth_efficiency`），
# 代价模型用的是打折后的“有效”算力与带宽。下面列出几种 GPU 的脊点：

# %% tags=["nbval-check-output"]
GPUS = ["a10", "l4", "a100-80g", "h100", "h200"]
print(f"{'gpu':10s} {'TFLOP/s':>8s} {'GB/s':>6s} {'ridge (peak)':>13s} {'ridge (effective)':>18s}")
for name in GPUS:
    hw = get_hardware(name)
    print(f"{name:10s} {hw.peak_flops / 1e12:8.0f} {hw.memory_bandwidth / 1e9:6.0f} "
          f"{hw.peak_flops / hw.memory_bandwidth:13.0f} {hw.ridge_point:18.0f}")

# %% [markdown]
# 表中 GPU 的有效脊点都在 {{min(get_hardware(g).ridge_point for g in GPUS):.0f}} FLOP/Byte 以上，而批为 1 的解码 GEMM 强度约为
# {{gemm_intensity(1):.0f}}：解码时 GPU 的算力几乎全部闲置，
# 时间都花在读权重上。下图把 LLaMA-2-7B 的几个典型内核画到 A10、A100、H100 的 Roofline 上（点画在 A100 的线上）。

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
I = np.logspace(-1, 4, 300)
for name, c in [("a10", "C2"), ("a100-80g", "C0"), ("h100", "C3")]:
    hw = get_hardware(name)
    ax.loglog(I, np.minimum(hw.effective_flops, I * hw.effective_bandwidth) / 1e12, color=c, label=f"{name} (effective)")
    ax.axvline(hw.ridge_point, color=c, ls=":", lw=0.8)
a100 = get_hardware("a100-80g")
points = {f"decode GEMM B={m}": gemm_intensity(m) for m in [1, 8, 64, 256]}
points["prefill GEMM 2048 tok"] = gemm_intensity(2048)
points["decode attention (MHA)"] = 2 * spec.num_heads / (spec.num_kv_heads * spec.dtype_bytes)
offsets = {"decode GEMM B=64": (-95, 6), "decode GEMM B=256": (-20, -14), "decode attention (MHA)": (4, -12)}
for label, x in points.items():
    y = min(a100.effective_flops, x * a100.effective_bandwidth) / 1e12
    ax.plot(x, y, "o", color="k", ms=4)
    ax.annotate(label, (x, y), textcoords="offset points", xytext=offsets.get(label, (4, 4)), fontsize=7)
ax.set_xlabel("arithmetic intensity (FLOP/byte)")
ax.set_ylabel("attainable TFLOP/s")
ax.set_title("Roofline (effective peaks); dotted lines: ridge points; points: llama-2-7b kernels", fontsize=9)
ax.legend(fontsize=7, loc="lower right")
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# ## 2.4 实测：CPU 上的真实小模型
#
# 理论讲完，动手测。我们让 `tiny` 模型在 CPU 上解码，分别改变批大小与上下文长度，读取引擎记录的每步耗时
# （`LLMEngine.steps` 里的 `StepRecord`），取纯解码步的中位数。
#
# 两个实验共用一个测量函数：一批同样长的 Prompt 生成固定个数的 Token，取纯解码步耗时的中位数，并记下 Prefill 的总耗时。

# %%
DECODE_TOKENS = 12                   # tokens each request generates in experiments A and B


def decode_step_time(batch, prompt_len, max_tokens=DECODE_TOKENS):
    steps = generate_and_steps([rng.integers(5, 4000, prompt_len).tolist() for _ in range(batch)], max_tokens)
    dec = [st.duration for st in steps if st.num_prefill_tokens == 0 and st.num_decode_seqs == batch]
    pre = [st.duration for st in steps if st.num_prefill_tokens > 0]
    return float(np.median(dec)), float(sum(pre))


BATCHES, PROMPT_A = [1, 2, 4, 8, 16, 32, 64], 32           # experiment A
ROUNDS = 3                           # experiment A and the floors below: best of this many rounds
BATCH_B, CONTEXTS = 4, [32, 128, 256, 512, 768]            # experiment B

# %% [markdown]
# **实验 A：批大小。** 每个批里的请求都有 {{PROMPT_A}} 个 Token 的 Prompt，生成 {{DECODE_TOKENS}} 个 Token，
# 批大小从 {{BATCHES[0]}} 到 {{BATCHES[-1]}}。各个批大小轮流测 {{ROUNDS}} 轮，每个取最快的一轮：别的进程抢走的 CPU 时间
# 只会让一步变慢，最快的一轮最接近这台机器独占时的耗时。

# %% tags=["nbval-ignore-output"]
rounds_a = [{B: decode_step_time(B, PROMPT_A)[0] for B in BATCHES} for _ in range(ROUNDS)]
cpu_batch = {B: min(r[B] for r in rounds_a) for B in BATCHES}
for B, t in cpu_batch.items():
    print(f"B={B:3d}: {t * 1e3:6.1f} ms/step -> {B / t:7.0f} tokens/s")

# %% [markdown]
# **实验 B：上下文长度。** 批大小固定为 {{BATCH_B}}，Prompt 长度从 {{CONTEXTS[0]}} 到 {{CONTEXTS[-1]}}
# （`tiny` 的最大长度是 {{get_model_spec('tiny').max_model_len}}），同时记下 Prefill 一步的耗时。

# %% tags=["nbval-ignore-output"]
cpu_ctx = {P: decode_step_time(BATCH_B, P) for P in CONTEXTS}
for P, (t_dec, t_pre) in cpu_ctx.items():
    print(f"context {P:4d}: decode {t_dec * 1e3:6.1f} ms/step; prefill of {BATCH_B}x{P} tokens {t_pre * 1e3:7.1f} ms "
          f"({t_pre / (BATCH_B * P) * 1e3:.3f} ms/token)")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
Bs = np.array(BATCHES)
ts = np.array([cpu_batch[B] for B in BATCHES])
ax1.plot(Bs, ts * 1e3, "o-", color="C0", label="step time")
ax1.set_xscale("log", base=2)
ax1.set_xlabel("batch size (decode sequences)")
ax1.set_ylabel("ms per decode step", color="C0")
ax1b = ax1.twinx()
ax1b.plot(Bs, Bs / ts, "s--", color="C1", label="tokens/s")
ax1b.set_ylabel("output tokens/s", color="C1")
ax1.set_title("tiny on CPU: decode step vs batch size (measured)", fontsize=9)
ax1.grid(alpha=0.3)
Ps = np.array(CONTEXTS)
ax2.plot(Ps, [cpu_ctx[P][0] * 1e3 for P in CONTEXTS], "o-", color="C0")
ax2.set_xlabel(f"context length (tokens), batch {BATCH_B}")
ax2.set_ylabel("ms per decode step")
ax2.set_title("tiny on CPU: decode step vs context (measured)", fontsize=9)
ax2.grid(alpha=0.3)
plt.show()

# %% tags=["nbval-ignore-output"]
slope, intercept = np.polyfit(Bs, ts, 1)
tiny, cpu = get_model_spec("tiny"), get_hardware("cpu")
slowdown = cpu_batch[BATCHES[-1]] / cpu_batch[1]
gain = BATCHES[-1] / slowdown
assert slowdown < BATCHES[-1], "the prose says the step grows far slower than the batch"

# %% [markdown]
# 线性拟合 $t_{\text{step}}(B) \approx a + bB$ 得到 $a \approx$ {{intercept * 1e3:.1f}} ms、$b \approx$ {{slope * 1e3:.2f}} ms/序列：
# 批从 1 增到 {{BATCHES[-1]}}，单步只慢了 {{slowdown:.1f}} 倍，吞吐却涨了 {{gain:.0f}} 倍。注意 CPU 上的 `tiny` 与 GPU 上的大模型
# 不是一回事：`tiny` 的权重只有 {{tiny.weight_bytes / 2**20:.1f}} MiB（float32），实测的固定成本主要是 Python 调度、算子启动与
# 逐层的小矩阵开销，而不是读权重（下一段会测出读权重要多久）。道理相同——每一步有一份与批大小无关的固定成本，
# 批越大摊得越薄——只是 GPU 上这份固定成本的主体是读权重。

# %% [markdown]
# **这台机器的下限。** 固定成本里有多少是硬件必须付的？把实验 A 的每一步按这台机器自己的 Roofline 定价：
# 先实测单线程（与上面的实验一致）的 GEMM 峰值算力（`tiny` 的各个线性层，走引擎同一条预打包路径）和
# 读内存的带宽，再把它们填进一份 `HardwareSpec`，效率取 1、每步固定开销取 0。这样 `RooflineCostModel` 给出的就是
# 任何引擎在这台机器上都快不过的时间：每个 GEMM 至少要读一遍权重、每个序列至少要读一遍自己的 KV。
# （范数、激活这类逐元素运算不计入，所以它偏乐观，是“下限”。）

# %%
from minibatch.sim.calibrate import floor_hardware, measure_gemm_peak, measure_read_bandwidth

MiB = 2**20
GEMM_ROWS = 512                      # rows per GEMM when measuring the peak
LLC = 32 * MiB                       # this machine's last-level cache (lscpu: L3)
DRAM_PROBE, CACHE_PROBE, WEIGHT_PROBE = 256 * MiB, 8 * MiB, 16 * MiB   # tensors read to measure bandwidth

# %% [markdown]
# **读的是哪一级存储？** 带宽取决于数据在哪里。`tiny` 的权重只有 {{tiny.weight_bytes / MiB:.0f}} MiB，比这台机器的
# 末级缓存（Last-Level Cache, LLC；`lscpu` 报告 L3 为 {{LLC // MiB}} MiB）还小：连续两步之间权重可能一直留在缓存里，
# 读它的速度是缓存带宽，而不是内存（DRAM）带宽。所以有两条下限，`benchmarks/batching_bound.py` 也是这样分的：
#
# - **DRAM 下限**：每步都从内存读权重与 KV（对一个 {{DRAM_PROBE // MiB}} MiB 的张量求和测带宽，它放不进任何缓存）。工作集
#   （权重 + 这一步读的 KV）远大于末级缓存时，它成立——GPU 上的大模型正是这种情形；
# - **缓存下限**：权重与 KV 一直留在末级缓存里（对一个 {{CACHE_PROBE // MiB}} MiB 的张量反复求和测带宽，它稳稳地待在缓存里）。
#   工作集小于末级缓存、两步之间没有别的数据把它挤出去时，它成立，而且更低。
#
# 再测一个与权重差不多大的 {{WEIGHT_PROBE // MiB}} MiB 张量：机器空闲时它留在缓存里，读得和 {{CACHE_PROBE // MiB}} MiB
# 一样快；与别的进程共享缓存时它被挤出去，读得和 DRAM 一样慢——它告诉我们此刻哪条下限更接近事实。
#
# 下面两条都算，并打印每个批大小的工作集有多大。

# %% tags=["nbval-ignore-output"]
# peaks: the best of ROUNDS readings (other processes only ever slow a reading down)
gemm_peak = max(measure_gemm_peak(tiny, rows=(GEMM_ROWS,)) for _ in range(ROUNDS))   # the model's linear layers
dram_bw = max(measure_read_bandwidth(DRAM_PROBE, repeats=3) for _ in range(ROUNDS))  # far larger than any cache
# well inside the last-level cache; never slower than DRAM (a lower reading means other processes
# evicted the tensor while it was measured, and the read then came from DRAM)
cache_bw = max(max(measure_read_bandwidth(CACHE_PROBE, repeats=5) for _ in range(ROUNDS)), dram_bw)
bw16 = measure_read_bandwidth(WEIGHT_PROBE, repeats=5)            # about the size of tiny's weights
floors = {name: RooflineCostModel("tiny", floor_hardware(f"this CPU, 1 thread, {name}", gemm_peak, bw))
          for name, bw in (("DRAM", dram_bw), ("cache", cache_bw))}
ctx_a = PROMPT_A + DECODE_TOKENS // 2   # experiment A: its prompts, the middle of its decode steps
cpu_floor = {B: floors["DRAM"].step_time([], [ctx_a] * B) for B in BATCHES}
cache_floor = {B: floors["cache"].step_time([], [ctx_a] * B) for B in BATCHES}
working_set = {B: tiny.weight_bytes + B * ctx_a * tiny.kv_bytes_per_token for B in BATCHES}
print(f"this machine, 1 thread: GEMM peak {gemm_peak / 1e9:.0f} GFLOP/s, read bandwidth DRAM {dram_bw / 1e9:.1f} GB/s, "
      f"cache {cache_bw / 1e9:.1f} GB/s, a {WEIGHT_PROBE // MiB} MiB tensor {bw16 / 1e9:.1f} GB/s")
for B in BATCHES:
    print(f"B={B:3d}: measured {cpu_batch[B] * 1e3:6.2f} ms | floor DRAM {cpu_floor[B] * 1e3:5.2f} ms, "
          f"cache {cache_floor[B] * 1e3:5.2f} ms | working set {working_set[B] / MiB:5.1f} MiB "
          f"({'fits' if working_set[B] < LLC else 'exceeds'} the LLC)")

# %% tags=["nbval-ignore-output"]
gain_measured = BATCHES[-1] * cpu_batch[1] / cpu_batch[BATCHES[-1]]
gain_floor = BATCHES[-1] * cpu_floor[1] / cpu_floor[BATCHES[-1]]
gain_cache = BATCHES[-1] * cache_floor[1] / cache_floor[BATCHES[-1]]
overhead = {B: cpu_batch[B] - cache_floor[B] for B in (1, BATCHES[-1])}   # above the floor that holds here
per_token = {B: overhead[B] / B for B in overhead}

# %% tags=["check"]
assert all(working_set[B] < LLC for B in BATCHES), "the prose says every batch's working set fits in the LLC"
assert overhead[1] > 0, "the prose says the batch-1 step costs more than the hardware floor"
assert per_token[BATCHES[-1]] < per_token[1] / 2, "the prose says batching spreads the per-step overhead thin"

# %% [markdown]
# 批为 1 时，DRAM 下限是 {{cpu_floor[1] * 1e3:.2f}} ms（主要是以 {{dram_bw / 1e9:.0f}} GB/s 读一遍
# {{tiny.weight_bytes / 2**20:.1f}} MiB 权重），缓存下限是 {{cache_floor[1] * 1e3:.2f}} ms（{{cache_bw / 1e9:.0f}} GB/s），
# 实测 {{cpu_batch[1] * 1e3:.2f}} ms，是 DRAM 下限的 {{cpu_batch[1] / cpu_floor[1]:.1f}} 倍、缓存下限的
# {{cpu_batch[1] / cache_floor[1]:.1f}} 倍。这个实验里每个批大小的工作集都小于末级缓存（上表最后一列），所以在一台
# 空闲的机器上成立的是**缓存下限**：DRAM 下限是每步都把权重从内存读一遍的引擎的下限，对 `tiny` 过于宽松。与别的进程
# 共享缓存时，权重会在两步之间被挤出去，DRAM 下限才是合适的参照：此刻读一个 {{WEIGHT_PROBE // MiB}} MiB 张量的带宽是
# {{bw16 / 1e9:.1f}} GB/s，它越接近 DRAM 的 {{dram_bw / 1e9:.1f}} GB/s，缓存被占得越多。
#
# 批为 1 时，一步里高出缓存下限的 {{overhead[1] * 1e3:.2f}} ms 是硬件不必付的**软件开销**（Python 调度、算子分发与库调用）；
# 批 {{BATCHES[-1]}} 时这份开销摊到每个 Token 上只剩 {{per_token[BATCHES[-1]] * 1e3:.3f}} ms，是批 1 的
# {{per_token[BATCHES[-1]] / per_token[1]:.0%}}。**实测的批处理收益里，有一部分来自摊薄软件的每步开销**，而不只是摊薄读权重。
# 只按硬件下限算，批 {{BATCHES[-1]}} 的吞吐是批 1 的 {{gain_cache:.0f}} 倍（缓存下限）或 {{gain_floor:.0f}} 倍（DRAM 下限），实测是
# {{gain_measured:.0f}} 倍：权重读得越慢，摊薄读权重的收益越大——GPU 上的大模型正是这样。
# 这提醒我们两件事：一是比较“连续批处理比逐个处理快多少倍”时，要看清分母里有多少是软件开销——
# 引擎把每步开销做得越小，这个倍数反而越小，用户却更快了；二是 GPU 引擎同样如此，vLLM 用 CUDA Graph、把调度与前向重叠等
# 手段压缩每步开销，道理相同（第 9、10 章）。GPU 上 7B 模型的权重（{{spec.weight_bytes / 1e9:.1f}} GB）远大于任何缓存，那里成立的是显存（HBM）
# 带宽的下限。`benchmarks/batching_bound.py` 对第 5 章那种偏斜负载做了同样的分解。

# %% [markdown]
# ## 2.5 预测：LLaMA-7B 在 A100 / H100 上
#
# 没有 GPU 也能预测：代价模型 `RooflineCostModel` 对一步里的每个内核套用 Roofline，再加上每步的固定开销（调度、
# 准备输入、启动内核；代价模型默认取 {{get_hardware('a100-80g').step_overhead_s * 1e3:.0f}} ms，见 `minibatch/sim/hardware.py`）。
# `breakdown()` 给出每一部分的秒数，加起来就是 `step_time()`。先看 A100 上一小一大两个批的解码步：

# %% tags=["nbval-check-output"]
cms = {name: make_cost_model("llama-2-7b", name) for name in ["a100-80g", "h100"]}
CTX = 512                            # every sequence's context in 2.5
FITS_DEFAULTS = {k: q.default for k, q in inspect.signature(RooflineCostModel.fits).parameters.items()
                 if q.default is not inspect.Parameter.empty}
SMALL_B, LARGE_B = 1, 128
for B in [SMALL_B, LARGE_B]:
    parts = cms["a100-80g"].breakdown([], [CTX] * B)
    print(f"A100, B={B:3d}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items() if v) +
          f"  -> total {sum(parts.values()) * 1e3:.2f} ms")

# %% [markdown]
# 每个序列的上下文都是 {{CTX}} Token。批从 {{SMALL_B}} 增到 {{LARGE_B}}，GEMM 的时间几乎不变（仍在读同一份权重），
# 增加的主要是解码注意力——每个序列都要读自己的 KV。
# 下面把 CPU 实测与 GPU 预测放在一张图上：左图是相对单步耗时 $t(B)/t(1)$（不同模型、不同硬件可以直接比较），
# 右图是吞吐。只画 KV Cache 放得下的批：{{CTX}} Token 的上下文下，A100-80G 最多放得下
# {{cms['a100-80g'].max_batch(CTX)}} 条序列、H100 最多 {{cms['h100'].max_batch(CTX)}} 条（`RooflineCostModel.fits`，
# 块大小 {{FITS_DEFAULTS['block_size']}}、`gpu_memory_utilization={{FITS_DEFAULTS['gpu_memory_utilization']}}`），
# 更大的批根本不会出现——引擎在此之前就会抢占。

# %%
GPU_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
gpu_batches = {name: [B for B in GPU_BATCHES if cm.fits(B, CTX)] for name, cm in cms.items()}
gpu_step = {name: np.array([cm.step_time([], [CTX] * B) for B in gpu_batches[name]]) for name, cm in cms.items()}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.6), layout="constrained")
ax1.plot(Bs, ts / ts[0], "o-", color="C2", label="tiny on CPU (measured)")
for (name, t), c in zip(gpu_step.items(), ["C0", "C3"]):
    gb = np.array(gpu_batches[name])
    ax1.plot(gb, t / t[0], "s-", color=c, label=f"llama-2-7b on {name} (model, ctx {CTX})")
    ax2.plot(gb, gb / t, "s-", color=c, label=f"llama-2-7b on {name} (model)")
gb = np.array(GPU_BATCHES[:len(gpu_batches["a100-80g"])])
ax2.plot(Bs, Bs / ts, "o-", color="C2", label="tiny on CPU (measured)")
ax1.plot(gb, gb, color="gray", ls=":", lw=1, label="no sharing: t grows like B")
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (decode sequences)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
ax1.set_ylim(0.8, 600)
ax1.set_ylabel("step time relative to batch 1")
ax2.set_ylabel("output tokens/s")
ax1.set_title("Decode step time vs batch size", fontsize=9)
ax2.set_title("Decode throughput vs batch size", fontsize=9)
plt.show()

# %% tags=["check"]
assert all(max(b) < GPU_BATCHES[-1] for b in gpu_batches.values()), "the largest batch does not fit: never drawn"

# %% [markdown]
# **“几乎免费”在哪里结束？** 有两处。第一，GEMM 的强度 $I\approx B$ 越过脊点后变成算力受限，之后每多一个序列都要
# 多付一份算力时间。下面对 LLaMA-2-7B 每层的 {{len(cms['a100-80g']._layer_gemms)}} 个投影求出这个临界批大小
# （第一个让每个投影都 $F/P \ge B/W$ 的 $M$）：

# %% tags=["nbval-check-output"]
def compute_bound_from(cm):
    """Smallest token count M at which every per-layer GEMM of the model is compute-bound."""
    m = 1
    while any(2 * m * kk * nn / cm.flops < (kk * nn + m * kk + m * nn) * cm.model.dtype_bytes / cm.bandwidth
              for kk, nn in cm._layer_gemms):
        m += 1
    return m


for name in ["a10", "a100-80g", "h100"]:
    cm = make_cost_model("llama-2-7b", name)
    print(f"{name:9s}: GEMMs turn compute-bound at M = {compute_bound_from(cm)} tokens per step "
          f"(effective ridge {cm.hardware.ridge_point:.0f} FLOP/B)")

# %% [markdown]
# 第二处是 **KV Cache 的读取量**。解码注意力的字节数正比于 $B\times c$，批大、上下文长时它会超过权重本身；
# 对 MHA 模型，它往往比 GEMM 的临界点来得更早。下面先求出上下文 {{CTX}} 时注意力耗时超过 GEMM 的批大小（只在放得下的批里找），
# 再固定一个批大小，看上下文变长时 A100 上一步的构成：

# %% tags=["nbval-check-output"]
cm = cms["a100-80g"]
KV_B, KV_CONTEXTS = 16, [256, 1024, 4096]
print(f"weights: {spec.weight_bytes / 1e9:.1f} GB; KV per token: {spec.kv_bytes_per_token / MiB:.2f} MiB")
cross = next(B for B in range(1, cm.max_batch(CTX) + 1)
             if (p := cm.breakdown([], [CTX] * B))["attention_decode"] > p["gemm"])
print(f"context {CTX}: decode attention takes longer than the GEMMs from B = {cross} on "
      f"(at most {cm.max_batch(CTX)} sequences fit)")
for c in KV_CONTEXTS:
    p = cm.breakdown([], [c] * KV_B)
    kv_gb = KV_B * c * spec.kv_bytes_per_token / 1e9
    print(f"B={KV_B}, context {c:4d}: KV read {kv_gb:5.1f} GB | gemm {p['gemm'] * 1e3:5.1f} ms, "
          f"attention {p['attention_decode'] * 1e3:5.1f} ms, total {sum(p.values()) * 1e3:5.1f} ms "
          f"-> {KV_B / sum(p.values()):5.0f} tok/s")

# %% tags=["check"]
assert all(cm.fits(KV_B, c) for c in KV_CONTEXTS), "every step of the table fits in the KV cache"

# %% [markdown]
# 批大小固定为 {{KV_B}}，上下文从 {{KV_CONTEXTS[0]}} 增到 {{KV_CONTEXTS[-1]}}；上下文 {{KV_CONTEXTS[-1]}} 时
# A100 最多放得下 {{cm.max_batch(KV_CONTEXTS[-1])}} 条序列，这张表里的每一步都放得下。
#
# 上下文变长后，注意力成了一步里的大头，吞吐随之下降：这时再加大批并不能摊薄什么，因为每个序列的 KV 都得单独读。
# 这也是 GQA（更少的 KV 头）、KV 量化和 PagedAttention 这类技术的价值所在（第 6、7 章）。
#
# ## 2.6 Prefill 与 Decode 同批：搭车与卡顿
#
# Prefill 的 GEMM 强度很高，本身就是算力受限的。如果把一批解码序列与一段 Prefill 放进同一步，解码序列几乎是
# “搭便车”；反过来，解码序列这一步的 TPOT 被拉长到了 Prefill 的时长。

# %% tags=["nbval-check-output"]
MIX_B, LONG_PROMPT = 32, 2048
t_p = cm.step_time([(CTX, CTX)], [])
t_d = cm.step_time([], [CTX] * MIX_B)
t_mix = cm.step_time([(CTX, CTX)], [CTX] * MIX_B)
t_long = cm.step_time([(LONG_PROMPT, LONG_PROMPT)], [])
print(f"A100, llama-2-7b: prefill {CTX} tokens {t_p * 1e3:.1f} ms; decode step of {MIX_B} seqs {t_d * 1e3:.1f} ms")
print(f"mixed step (prefill {CTX} + {MIX_B} decodes): {t_mix * 1e3:.1f} ms "
      f"= prefill + {(t_mix - t_p) * 1e3:.1f} ms (vs {t_d * 1e3:.1f} ms run separately)")
print(f"prefill of {LONG_PROMPT} tokens: {t_long * 1e3:.0f} ms = {t_long / t_d:.0f} decode steps of {MIX_B}")

# %% [markdown]
# 一个 {{LONG_PROMPT}} Token 的长 Prompt（{{t_long * 1e3:.0f}} ms）会让同批里所有正在解码的请求“卡”一大步，
# 相当于 {{t_long / t_d:.0f}} 个批 {{MIX_B}} 的解码步，这就是 TPOT 长尾的来源之一。
# 分块预填充（Chunked Prefill）把长 Prompt 切成小块、每步只做一块，兼顾两者（Sarathi-Serve, Agrawal et al., OSDI'24；
# 第 11 章）。
#
# ## 2.7 交互：一步的耗时分解
#
# 选择模型、硬件（`Nx` 前缀表示 N 路张量并行）、解码批大小、上下文长度和同批的 Prefill Token 数，看代价模型给出的
# 分解。试试：批大小从最小拖到最大；把上下文拉长；把 LLaMA-2-7B 换成 GQA 的 LLaMA-3-8B；把 A100 换成 H100 或 4×A10。

# %% tags=["nbval-ignore-output"]
HW_CHOICES = ["a10", "2xa10", "4xa10", "l4", "a100-40g", "a100-80g", "h100", "h200", "2xa100-80g", "8xh100"]


def show_breakdown(model="llama-2-7b", hardware="a100-80g", batch=32, context=512, prefill_tokens=0):
    try:
        cm = make_cost_model(model, hardware)
        cm.kv_capacity_tokens()                           # raises if the weights do not fit
    except ValueError as e:
        print(e)
        return
    if not cm.fits(batch, context):
        print(f"{batch} sequences of {context} tokens do not fit in the KV cache "
              f"(at most {cm.max_batch(context)}): the engine would preempt before such a step ran")
        return
    prefill = [(prefill_tokens, prefill_tokens)] if prefill_tokens else []
    parts = cm.breakdown(prefill, [context] * batch)
    total = sum(parts.values())
    fig, ax = plt.subplots(figsize=(7, 2.2), layout="constrained")
    left = 0.0
    for i, (kk, v) in enumerate(parts.items()):
        ax.barh(0, v * 1e3, left=left, color=f"C{i}", label=f"{kk} {v * 1e3:.2f} ms")
        left += v * 1e3
    ax.set_yticks([])
    ax.set_xlabel("ms per step")
    ax.set_title(f"{model} on {hardware}: {total * 1e3:.2f} ms/step, {batch / total:.0f} decode tok/s", fontsize=9)
    ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    plt.show()
    print(f"KV needed {batch * context:,} tokens of {cm.kv_capacity_tokens():,} available")


W.interact(show_breakdown,
           model=W.Dropdown(options=["llama-2-7b", "llama-3-8b", "llama-2-13b", "mistral-7b", "llama-2-70b"]),
           hardware=W.Dropdown(options=HW_CHOICES, value="a100-80g"),
           batch=W.IntSlider(value=32, min=1, max=512, step=1),
           context=W.IntSlider(value=512, min=16, max=8192, step=16),
           prefill_tokens=W.IntSlider(value=0, min=0, max=4096, step=64));

# %% tags=["check"]
# The figures the exercises' hints quote.
s13, s3 = get_model_spec("llama-2-13b"), get_model_spec("llama-3-8b")
EX_M = [1, 64, 4096]
ex_I = {m: gemm_intensity(m, k=s13.intermediate_size, n=s13.hidden_size, b=s13.dtype_bytes) for m in EX_M}
ex_ridge = {g: get_hardware(g).ridge_point for g in ("a10", "h100")}
assert all(ex_I[m] < min(ex_ridge.values()) for m in EX_M[:-1]), "hint 1: the small M are memory-bound"
assert ex_I[EX_M[-1]] > max(ex_ridge.values()), "hint 1: the largest M is compute-bound on both"
ex_kv = s3.kv_bytes_per_token / spec.kv_bytes_per_token
ex_fit = make_cost_model("llama-3-8b", "a100-80g").max_batch(KV_CONTEXTS[-1]) / cm.max_batch(KV_CONTEXTS[-1])

# %% [markdown]
# ## 本章小结
#
# - Prefill 一次处理整个 Prompt，GEMM 的算术强度约等于 Token 数，是算力受限的，决定 TTFT；Decode 每步每序列只处理
#   1 个 Token，强度约等于批大小，是访存受限的，决定 TPOT。
# - Roofline：$t=\max(F/P,\,B/W)$，脊点 $I^*=P/W$。2.3 节表中 GPU 的有效脊点都在 {{min(get_hardware(g).ridge_point for g in GPUS):.0f}}
#   FLOP/Byte 以上，批为 1 的解码离它很远。
# - 解码批处理“几乎免费”：$B$ 个序列共用一次权重读取，单步时间增长远慢于 $B$，吞吐近似线性增长。CPU 上的 `tiny`
#   实测与 A100/H100 上的模型预测呈现同样的形状。
# - “免费”有两个终点：GEMM 强度越过脊点后变成算力受限；KV Cache 的读取量（$\propto B\times c$）超过权重后，
#   加大批不再摊薄成本。对 MHA 模型和较长的上下文，后者往往先到，而且受显存容量限制（第 6 章）。
# - Prefill 与 Decode 同批时，解码可以搭车，但会被长 Prefill 拖慢，这是分块预填充要解决的问题（第 11 章）。
#
# ## 练习
#
# 1. **手算强度。** 对 LLaMA-2-13B 的 down 投影（$k={{s13.intermediate_size}},\ n={{s13.hidden_size}}$），分别在
#    $M={{EX_M[0]}}$、$M={{EX_M[1]}}$、$M={{EX_M[2]}}$ 时计算算术强度，
#    并判断在 A10 与 H100 上它是算力受限还是访存受限。用 `make_cost_model("llama-2-13b", "h100")._gemm` 验证你的耗时估算。
# 2. **GQA 的收益。** 用 2.5 节最后一个单元格的方法，比较 LLaMA-2-7B（MHA）与 LLaMA-3-8B（GQA，{{s3.num_kv_heads}} 个 KV 头）
#    在 A100 上、批大小 {{KV_B}}、上下文 {{KV_CONTEXTS[-1]}} 时的单步耗时与吞吐。差距主要来自哪一项？LLaMA-3-8B 在这个上下文下
#    最多放得下多少条序列（`max_batch({{KV_CONTEXTS[-1]}})`）？
# 3. **CPU 的脊点。** 查一查你自己机器的内存带宽与浮点峰值（或用 `get_hardware("cpu")` 的粗略值），算出它的脊点。
#    为什么 `tiny` 在 CPU 上的实测曲线在批大小很小时就开始明显上升？（提示：对比 2.4 节实测的固定成本与读权重的时间。）
# 4. **拟合代价模型。** 在仓库根目录运行 `.venv/bin/python -m minibatch profile --model tiny --out /tmp/tiny-cpu.json`，它会在真实引擎上测量
#    各种批组合的单步耗时并拟合一个代价模型（`FittedCostModel`）：`g(M)` 是一步里 M 个 token 的权重开销（分段线性、
#    不随 M 下降），`decode_ctx` 是每个上下文 token 的 KV 读取开销。它们分别对应本章实验 A、B 中的哪一条曲线？
#    为什么 `g(M)` 在 M 很小时几乎是平的？
# 5. **Prefill 的临界长度。** 在 A100 上，一个多长的 Prompt 的 Prefill 时间等于一次批大小 {{MIX_B}} 的解码步？在交互控件里
#    找出这个长度，并解释为什么答案接近第 2.5 节求出的 GEMM 临界 $M$。
#
# <details><summary>提示与参考答案</summary>
#
# 1. $I = 2Mkn / ((kn + Mk + Mn)\,b)$：$M={{EX_M[0]}}$ 时约 {{ex_I[EX_M[0]]:.0f}}，$M={{EX_M[1]}}$ 时约 {{ex_I[EX_M[1]]:.0f}}，
#    $M={{EX_M[2]}}$ 时约 {{ex_I[EX_M[2]]:.0f}}（fp16）。A10 的有效脊点约 {{ex_ridge['a10']:.0f}}、
#    H100 约 {{ex_ridge['h100']:.0f}} FLOP/Byte（2.3 节的表）：$M={{EX_M[0]}}$、{{EX_M[1]}} 在两者上都访存受限，
#    $M={{EX_M[2]}}$ 都算力受限。`cm._gemm(M, {{s13.intermediate_size}}, {{s13.hidden_size}})` 给出对应的秒数。
# 2. 差距几乎全在 `attention_decode`：GQA 的 KV 头只有 {{s3.num_kv_heads}} 个（查询头 {{s3.num_heads}} 个），每个 Token 的 KV
#    是 LLaMA-2-7B 的 {{ex_kv:.0%}}，每步读的 KV 也少到这么多；GEMM 一项相近。同样的原因，LLaMA-3-8B 能放下的序列数约是
#    LLaMA-2-7B 的 {{ex_fit:.1f}} 倍。
# 3. `get_hardware("cpu")` 的脊点只有 {{get_hardware('cpu').ridge_point:.0f}} FLOP/Byte 左右，而 2.4 节测得每步的固定成本远大于读权重的时间（缓存下限）：
#    小批时步长由软件开销决定，不是由 Roofline 决定。
# 4. `g(M)` 对应实验 A（批大小，即每步的 Token 数），`decode_ctx` 对应实验 B（上下文长度）。M 很小时每步的成本是固定开销加
#    读一遍权重，与 M 无关，所以几乎是平的。
# 5. 找使 `step_time([(P, P)], [])` ≈ `step_time([], [{{CTX}}] * {{MIX_B}})` 的 $P$。批 32 的解码步仍以读权重为主、时间接近
#    访存的下限；Prefill 变成算力受限之后，时间才随 $P$ 线性增长，拐点正是 GEMM 的临界 $M$。
#
# </details>
