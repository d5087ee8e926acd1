# %% [markdown]
# # 第 1 章　课程导入：动态批处理的价值与挑战
#
# 大语言模型（LLM）的推理服务正从“能跑通”走向“跑得稳、跑得省、跑得快”。在生产环境里，一次只处理一个请求的串行推理
# 远远满足不了业务的吞吐需求；动态批处理（Dynamic Batching）正是化解这一矛盾的关键技术：推理引擎在运行时把多个请求
# 聚合到同一次前向计算里，共享 GPU 的显存带宽与算力，从而成倍地提升吞吐量（Throughput）、降低单 Token 成本。
#
# 本章是整门课的开篇：先明确学习路径与适用人群，再剖析动态批处理在工程落地中的价值与挑战。和一般的“导论”不同，
# 本章里的每一个论断都配有一个可以运行的实验——用课程配套的推理引擎 **minibatch**，在 CPU 上跑真实的小模型，
# 或者在模拟器里让 LLaMA-7B/13B “跑”在 A100、A10 上。
#
# 整条链路可以概括为：并发请求进入调度器（Scheduler），经过排队、聚合与超时控制，由推理引擎执行连续批处理
# （Continuous Batching），最终映射到 GPU 的计算与显存资源上（1.3 节的图画出了这条链路）。课程围绕两条主线展开：
# **价值**（为什么批处理能在 GPU 上把吞吐提升一个数量级）与**挑战**（延迟、显存、长尾、全局调度）。

# %% [markdown]
# ## 学习目标
#
# **1.1 整门课的目标：从原理到生产落地的完整能力。** 完成全部 30 章后，你应当能够：
#
# - **理解动态批处理的核心机制**：请求排队、批聚合、调度策略、显存管理，并能解释为什么批处理能显著提升 GPU 利用率；
# - **掌握主流推理框架的批处理实现**：vLLM、TensorRT-LLM、SGLang、TGI 中连续批处理（Continuous Batching）、
#   分页注意力（PagedAttention）等技术的异同与适用场景；
# - **具备性能调优能力**：根据到达率、Token 长度分布与 SLO 要求配置 `max_batch_size`、`max_wait`、调度优先级等参数；
# - **能够设计评估体系**：以吞吐量（Tokens/s）、首 Token 延迟（TTFT）、每输出 Token 延迟（TPOT）、SLO 达成率
#   （SLO Attainment）和有效吞吐（Goodput）为核心建立指标，并掌握压测方法论（种子章节写作“SLA 满足率”：
#   服务等级协议（SLA, Service Level Agreement）是对外的承诺，其中的延迟指标就是服务等级目标（SLO），本课程统一称 SLO 达成率）；
# - **规避常见工程陷阱**：识别显存碎片化、长尾请求阻塞、优先级反转等典型问题，并能排查与解决。
#
# **本章的目标。** 读完并运行本章后，你将能够：
#
# 1. 说出串行、静态批处理、动态批处理（批处理窗口）与连续批处理四种方式的区别，并在真实小模型上测出它们的吞吐差距；
# 2. 用“权重字节数 ÷ 显存带宽”估算单请求解码速度的物理上限，并据此检验“串行 200 Tokens/s、批处理 3000+ Tokens/s”
#    这类说法；
# 3. 在模拟器里复盘一个 RAG 部署案例（LLaMA-13B、4×A10、约 30 QPS），读懂 TTFT、TPOT、吞吐、Goodput 与 SLO
#    达成率组成的前后对比表，在稳态下测出每种配置的服务容量，并能解释模拟结果与“案例数字”不一致的原因（排队还是算力）；
# 4. 打开 minibatch 的实时仪表盘（Dashboard），知道后续章节的实验长什么样。

# %% [markdown]
# ## 1.2 适用人群：谁需要掌握动态批处理？
#
# 动态批处理是 LLM 推理系统性能优化的核心杠杆，下面几类角色都会从本课程中获益：
#
# | 角色 | 关心的问题 | 课程中的重点 |
# |---|---|---|
# | 推理平台 / 基础设施工程师 | 同样的 GPU 能多扛多少流量 | 调度器、KV Cache 管理、框架参数（第 5–20 章） |
# | 算法与应用工程师（部署模型的人） | 为什么上线后延迟忽高忽低 | 指标体系、压测方法、参数调优（第 8、19 章） |
# | SRE / 运维 | 如何告警、扩容、排障 | 弹性伸缩、故障排查手册（第 28、29 章） |
# | 架构师 / 技术负责人 | 要买多少卡、选哪个框架 | 框架横评、容量规划（第 20、30 章） |
#
# 无论你用的是 vLLM、TGI、TensorRT-LLM 还是自研引擎，课程讲的原理与方法论都适用：每个框架的策略都会在 minibatch 里
# 以同一个工作负载复现，帮助你建立“框架无关”的底层认知。

# %% [markdown]
# ## 1.3 课程结构：三阶段递进式学习路径
#
# 全课共 30 章，分三个阶段，每个阶段解决一类核心问题：
#
# | 阶段 | 章节 | 解决的问题 | 代表性实验 |
# |---|---|---|---|
# | 基础原理篇 | 第 1–8 章 | 为什么动态批处理有效、瓶颈在哪里 | Prefill/Decode 的 Roofline、排队论、批处理窗口、连续批处理、KV Cache、PagedAttention、压测方法 |
# | 工程实践篇 | 第 9–20 章 | 主流框架怎么实现、参数怎么调 | vLLM 的 Token 预算、分块预填充（Chunked Prefill）、抢占、前缀缓存、RadixAttention、In-flight Batching、Triton Kernel |
# | 生产进阶篇 | 第 21–30 章 | 大规模生产环境的全局优化 | 长尾与队头阻塞、优先级与公平性、多模型与多副本、PD 分离、弹性伸缩、故障排查、容量规划 |
#
# **实验引擎 minibatch。** 课程的所有实验都由同一个紧凑但完整的推理引擎驱动：请求队列、可切换策略的调度器、
# 分页 KV Cache、真实的 Llama 结构模型、Triton Kernel、OpenAI 兼容服务与压测客户端。它有两种执行器（Executor）：
#
# - `executor="model"`：在 CPU 上真正运行内置的小模型 `tiny`（几百万参数的 Llama 结构），算出的每个 Token 都是真的；
# - `executor="sim"`：不跑模型，由代价模型（Cost Model）按 Roofline 给出每一步的耗时，让 LLaMA-7B/13B/70B
#   “跑”在 A10、A100、H100 等 GPU 上。调度器与 KV 管理器是同一份代码，思路同 Vidur（Agrawal et al., MLSys'24）。
#
# 实验默认使用虚拟时钟（Virtual Clock）：每一步让时钟前进“实测或模型给出”的耗时，所以几千个请求的轨迹几秒钟就能
# 回放完。下面先导入本章要用的东西，看看引擎里注册了哪些调度策略（Policy），再画出一个请求在引擎里走过的路。

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch
import minibatch
from minibatch.policies import available, make_policy
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.sim import get_hardware, get_model_spec, make_cost_model
from minibatch.viz import diagrams
from minibatch.workload import lognormal, synthetic, uniform

torch.set_num_threads(1)          # one thread: steadier CPU step times on a shared machine
plt.rcParams["figure.dpi"] = 90
print(f"minibatch {minibatch.__version__}; policies: {', '.join(available())}")


def text_table(header, rows):
    """A plain-text table (stable in stored outputs)."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


diagrams.request_pipeline()

# %% [markdown]
# 图中每个方框都是 minibatch 里的一个对象：请求进入等待队列；调度器每一步按策略给出的顺序，在序列数上限与
# Token 预算之内组成一个批，并向 KV 管理器申请显存块；执行器跑一步（真实模型或代价模型），采样器产出每个请求的下一个
# Token；没结束的请求回到运行队列，下一步再被调度，结束的请求离开并留下它的 TTFT、TPOT、E2E。第 5 章逐格展开这一步。

# %% [markdown]
# ## 1.4 动态批处理在 LLM 部署中的核心价值
#
# 要理解批处理的价值，先看早期 LLM 服务的两种做法有什么局限：
#
# - **串行推理（Serial）**：一次只处理一个请求。生成一个 Token 要把全部模型权重从显存读一遍，却只做一个 Token 的计算：
#   显存带宽几乎全被读权重占满，算力却大部分闲置（1.6 节会测出这两个利用率）。
# - **静态批处理（Static Batching）**：把请求固定分组，一组一起跑，组内所有请求都要等最慢的那个结束才释放资源。
#   批大小固定、适应不了动态到达的流量；组内长度差异大时，先结束的请求占着“空槽位”（填充效应，Padding）。
#
# 运行时调度解决了这些问题，按“批在什么时候形成、谁能加入”又分成两种：
#
# - **动态批处理（Dynamic Batching，批处理窗口）**：请求先排队，凑满 `max_batch_size` 或最老的请求等满 `max_wait`
#   就发车；发车后仍按请求级（Request-level）批处理跑完整批。这是 Triton Inference Server、TF Serving 的做法。
# - **连续批处理（Continuous Batching，迭代级调度）**：每生成一个 Token（每一步，step）都重新组批：已完成的请求立刻
#   离开，新请求立刻加入（Orca, Yu et al., OSDI'22；vLLM 的默认方式）。
#
# 在 minibatch 里，这四种方式就是四个策略类，每个类只有一个决策方法：本步按什么顺序调度哪些请求。先读一读它们的
# 文档字符串，再看连续批处理的全部决策逻辑——只有一行：

# %%
for name in ["serial", "static", "dynamic", "continuous"]:
    module_doc = inspect.getdoc(inspect.getmodule(type(make_policy(name))))
    print(f"{name:>10}: {module_doc.splitlines()[0]}")
print()
print(inspect.getsource(type(make_policy("continuous")).schedule_order))

# %% [markdown]
# 为什么批处理能带来成倍的提升？设解码一步（为每个在跑的请求各生成一个 Token）的耗时为 $t_{\text{step}}(B)$，
# $B$ 是批大小，则吞吐为
#
# $$\text{Throughput}(B) = \frac{B}{t_{\text{step}}(B)}.$$
#
# 解码时每一步都要把全部权重读一遍，而 $B$ 个请求共用这一次读取；只要读权重的时间占大头，$t_{\text{step}}(B)$
# 随 $B$ 增长得很慢，吞吐就近似随 $B$ 线性增长。第 2 章会用 Roofline 模型把这句话量化。
#
# ### 实验 1：真实小模型上的四种批处理
#
# 我们在 CPU 上运行内置的 `tiny` 模型，先造出一组同时到达、输出长度偏斜的请求：

# %%
tiny_wl = synthetic(48, rate=float("inf"), input_len=uniform(8, 24),
                    output_len=lognormal(median=24, sigma=1.0, max=128), seed=1)
tw = tiny_wl.stats()

# %% [markdown]
# 这 {{tw['n']}} 个请求的提示有 {{min(tiny_wl.prompt_lens)}}–{{max(tiny_wl.prompt_lens)}} 个 Token；输出长度的中位数
# {{tw['output_p50']:.0f}}、最长 {{tw['output_max']:.0f}}，少数请求比多数长得多。它们分别用四种策略处理，
# 批大小上限 `max_num_seqs=8`，动态批处理的窗口 `max_wait_ms=50`。所有请求一开始
# 就在队列里，批处理策略的批始终能装满，比较的是**满负荷**下的吞吐。时间是虚拟时钟：每一步前进的是**实测**的前向耗时，
# 所以结果会随机器负载浮动（下面的单元格因此不做输出比对）；四种策略轮流跑几轮，比较同一轮里的比值，取中位数。

# %% tags=["nbval-ignore-output"]
POLICIES, ROUNDS = ["serial", "static", "dynamic", "continuous"], 5
rounds = {p: [] for p in POLICIES}
for _ in range(ROUNDS):              # the policies take turns, so a burst of other load hits all of them alike
    for p in POLICIES:
        rounds[p].append(run(tiny_wl, model="tiny", policy=p, max_num_seqs=8, max_wait_ms=50))
tok_s = {p: [r.summary()["throughput_tok_s"] for r in rs] for p, rs in rounds.items()}
# per policy, the round with the median throughput (for the table and the plot below)
tiny_runs = {p: rs[int(np.argsort(tok_s[p])[ROUNDS // 2])] for p, rs in rounds.items()}
tiny_sum = {p: r.summary() for p, r in tiny_runs.items()}
print(text_table(
    ["policy", "tok/s", "steps", "TTFT mean (s)", "TPOT mean (ms)", "mean batch", "padding waste"],
    [[p, f"{s['throughput_tok_s']:.0f}", len(tiny_runs[p].steps), f"{s['ttft_mean']:.2f}",
      f"{s['tpot_mean'] * 1e3:.1f}", f"{s['mean_batch_size']:.1f}", f"{s['padding_waste']:.0%}"]
     for p, s in tiny_sum.items()]))


def paired_ratio(a, b):
    """Median over rounds of policy a's throughput over policy b's in the same round."""
    return float(np.median([x / y for x, y in zip(tok_s[a], tok_s[b])]))


# %% [markdown]
# 批更满，吞吐就一定高出同样多吗？把所有轮次里**纯解码步**（这一步没有 Prefill）的耗时按批大小 $B$ 分组，
# 取中位数，就得到这台机器上的 $t_{\text{step}}(B)$，再按上面的公式算出 $B / t_{\text{step}}(B)$：

# %% tags=["nbval-ignore-output"]
step_ms = {}
for p in ("static", "continuous"):   # static's batches shrink as requests finish: every B from 1 to 8
    for r in rounds[p]:
        for st in r.steps:
            if st.num_prefill_tokens == 0 and st.num_seqs:
                step_ms.setdefault(st.num_seqs, []).append(st.forward_time * 1e3)
t_step = {b: float(np.median(v)) for b, v in sorted(step_ms.items())}
# continuous batching's steps that also prefill a new request (decode and prefill mixed)
mixed_ms = float(np.median([st.forward_time * 1e3 for r in rounds["continuous"] for st in r.steps
                            if st.num_prefill_tokens and st.num_decode_tokens]))
print(text_table(["B", "decode steps", "t_step(B) (ms)", "B / t_step(B) (tok/s)"],
                 [[b, len(step_ms[b]), f"{t:.2f}", f"{b / t * 1e3:.0f}"] for b, t in t_step.items()]))

# %% tags=["nbval-ignore-output"]
s = tiny_sum
speedup_tiny = paired_ratio("continuous", "serial")
cont_vs_static = paired_ratio("continuous", "static")
batch_ratio = s["continuous"]["mean_batch_size"] / s["static"]["mean_batch_size"]
step_growth = t_step[8] / t_step[1]

# %% tags=["check"]
assert speedup_tiny > 1.5, "the prose says continuous batching beats serial by a few times"
assert s["static"]["padding_waste"] > 0.3 and batch_ratio > 1.5, "the prose says static runs much smaller batches"
assert cont_vs_static < batch_ratio, "the prose says the throughput gain is smaller than the batch-size gain"
assert step_growth > 1.5, "the prose says a step of 8 sequences costs several times a step of 1"

# %% [markdown]
# 四种策略轮流各跑 {{ROUNDS}} 轮。本次运行中，连续批处理的吞吐是串行的 **{{speedup_tiny:.1f}} 倍**（同一轮内比值的中位数）：
# 在 CPU 上的小模型上是“几倍”，不是数量级。静态批处理有 {{s['static']['padding_waste']:.0%}} 的“槽位·步”被已经结束的
# 请求白白占着（填充浪费），所以它的平均批大小只有 {{s['static']['mean_batch_size']:.1f}}，而连续批处理是
# {{s['continuous']['mean_batch_size']:.1f}}（上限 8），同样的工作，静态批处理走了 {{len(tiny_runs['static'].steps)}} 步，
# 连续批处理只走了 {{len(tiny_runs['continuous'].steps)}} 步。
#
# 可是批满了 {{batch_ratio:.1f}} 倍，吞吐只是静态批处理的 **{{cont_vs_static:.2f}} 倍**。上面那张表给出了原因：在这台 CPU 上，
# 8 个序列的一步要花 1 个序列的一步的 {{step_growth:.1f}} 倍时间，$B / t_{\text{step}}(B)$ 从 $B=1$ 的
# {{1e3 / t_step[1]:.0f}} tok/s 只涨到 $B=8$ 的 {{8e3 / t_step[8]:.0f}} tok/s。第 2 章会解释：CPU 的算力很小，批稍大每步就
# 接近算力受限，$t_{\text{step}}(B)$ 随 $B$ 涨得很快，批处理“白捡”的吞吐很快用完。连续批处理还要把新请求的 Prefill
# 插进解码步里，这种混合步在 CPU 上也不便宜：它们的中位耗时是 {{mixed_ms:.1f}} ms，是 8 个序列纯解码一步的
# {{mixed_ms / t_step[8]:.1f}} 倍（静态批处理把一批的 Prefill 合在一步里做完）。GPU 上的解码直到很大的批都是访存受限的，$t_{\text{step}}(B)$ 几乎不变，
# 批满多少倍吞吐就高多少倍——实验 2 在模拟的 A100 上看到的才是数量级。
#
# 单个请求的 Token 间隔也随批大小变化：这次运行里连续批处理的 TPOT 是 {{s['continuous']['tpot_mean'] * 1e3:.1f}} ms，
# 串行是 {{s['serial']['tpot_mean'] * 1e3:.1f}} ms（墙钟测量，随机器负载浮动）。批处理用一点单请求速度换来整体吞吐
# （实验 2 表中的 TPOT 一列）。

# %% [markdown]
# 下图画出每一步的批大小随（虚拟）时间的变化。静态与动态批处理的“锯齿”就是填充效应：批里的短请求先结束，
# 槽位空着（灰色），直到最长的那个请求结束才发下一批；连续批处理则一直是满的，空出来的槽位下一步就被新请求补上，
# 直到队列排空、只剩最后几个长请求。

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 2, figsize=(9, 4.6), sharey=True, layout="constrained")
for ax, (p, r) in zip(axes.flat, tiny_runs.items()):
    t = np.array([st.start_time for st in r.steps])
    busy = np.array([st.num_seqs for st in r.steps])
    pad = np.array([st.num_padded_slots for st in r.steps])
    ax.fill_between(t, 0, busy, step="post", color="#4e79a7", label="sequences computing")
    ax.fill_between(t, busy, busy + pad, step="post", color="#bdbdbd", label="padded (finished) slots")
    ax.set_title(f"{p}: {tiny_sum[p]['throughput_tok_s']:.0f} tok/s, {tiny_sum[p]['duration_s']:.2f} s", fontsize=9)
    ax.set_xlabel("virtual time (s)")
    ax.grid(alpha=0.3)
axes[0, 0].set_ylabel("batch slots")
axes[1, 0].set_ylabel("batch slots")
axes[0, 1].legend(fontsize=7, loc="upper right")
fig.suptitle("tiny model on CPU: batch occupancy per step (max_num_seqs=8)", fontsize=10)
plt.show()

# %% [markdown]
# ### 实验 2：LLaMA-7B 在 A100 上——检验“串行约 200 Tokens/s，批处理 3000+ Tokens/s”
#
# 种子章节（本课程第 1 章原文）举例说：“在 A100 上部署 LLaMA-7B，串行推理吞吐约 200 Tokens/s，而采用动态批处理后
# 可达 3000+ Tokens/s”，并称批处理可将吞吐提升 5–20 倍。我们先用物理定律估一个上限，再用模拟器验证。
#
# **串行解码的物理上限。** 串行解码每生成一个 Token，都必须把全部权重从显存（HBM）读进计算单元一次，因此
#
# $$t_{\text{token}} \;\ge\; \frac{\text{weight bytes}}{\text{HBM bandwidth}}, \qquad
#   \text{Throughput}_{\text{serial}} \;\le\; \frac{\text{HBM bandwidth}}{\text{weight bytes}}.$$
#
# 下面用模型规格（参数量 × 2 字节，fp16）和 A100-80G 的数据手册带宽算出这个上限，并对照代价模型给出的单步时间
# （它还计入了可达带宽比例与每步固定开销）。

# %% tags=["nbval-check-output"]
spec7, a100 = get_model_spec("llama-2-7b"), get_hardware("a100-80g")
bound_tok_s = a100.memory_bandwidth / spec7.weight_bytes
cm7 = make_cost_model("llama-2-7b", "a100-80g")
t1 = cm7.step_time([], [512])          # one decode step, batch 1, 512 tokens of context
print(f"llama-2-7b: {spec7.num_params / 1e9:.2f} B params -> {spec7.weight_bytes / 1e9:.2f} GB in fp16")
print(f"A100-80G HBM: {a100.memory_bandwidth / 1e9:.0f} GB/s -> at least {spec7.weight_bytes / a100.memory_bandwidth * 1e3:.2f} ms/token")
print(f"physics bound, one fp16 stream: {bound_tok_s:.0f} tokens/s")
print(f"cost model, batch 1: {t1 * 1e3:.2f} ms/step -> {1 / t1:.0f} tokens/s "
      f"(bandwidth efficiency {a100.bandwidth_efficiency:.0%}, overhead {cm7.step_overhead_s * 1e3:.0f} ms/step)")

# %% [markdown]
# 也就是说，fp16 权重下单个请求流的解码速度**不可能**超过上面这个上限；种子章节的“串行约 200 Tokens/s”
# 高于它，只有在量化权重（如 INT8/INT4，读的字节更少）、投机解码（Speculative Decoding）或把 Prompt Token 也算进吞吐时
# 才可能出现。
#
# 接下来在模拟器里回放一个远超单卡处理能力的负载（队列始终有活），输入长度取对数正态、均值按 vLLM 论文
# （Kwon et al., SOSP'23）报告的 ShareGPT 平均输入 161 Token 设定：

# %%
wl7 = synthetic(400, rate=50.0, input_len=lognormal(median=128, mean=161, max=1024),
                output_len=lognormal(median=256, sigma=0.5, max=768), seed=7)
w7 = wl7.stats()
SERIAL_N, MAX_SEQS7, WAIT7_MS = 20, 256, 200     # requests replayed serially; batch limit; dynamic's window

# %% [markdown]
# {{w7['n']}} 个请求以约 {{w7['rate']:.0f}} req/s 到达，输入长度均值 {{w7['input_mean']:.0f}} Token，输出长度中位数
# {{w7['output_p50']:.0f}}。串行的吞吐与请求数无关（每个请求都独占 GPU），为省时间只回放前 {{SERIAL_N}} 个请求；
# 其余三种策略的批大小上限都是 {{MAX_SEQS7}}，动态批处理的窗口是 {{WAIT7_MS}} ms。批处理策略的吞吐取**满负荷**阶段的值：
# 只数队列里还有请求在等的那段时间里产出的 Token，不让最后队列排空、批越来越小的收尾阶段拉低它。

# %% tags=["nbval-check-output"]
sim7 = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")
runs7 = {"serial": run(wl7[:SERIAL_N], policy="serial", **sim7),
         "static": run(wl7, policy="static", max_num_seqs=MAX_SEQS7, **sim7),
         "dynamic": run(wl7, policy="dynamic", max_num_seqs=MAX_SEQS7, max_wait_ms=WAIT7_MS, **sim7),
         "continuous": run(wl7, policy="continuous", max_num_seqs=MAX_SEQS7, **sim7)}


def saturated_tok_s(r):
    """Output tokens per second while requests were waiting (the run's saturated phase, drain excluded)."""
    busy = [st for st in r.steps if st.num_waiting > 0]
    t0, t1 = busy[0].start_time, busy[-1].start_time + busy[-1].duration
    return sum(1 for q in r.requests for t in q.token_times if t0 <= t <= t1) / (t1 - t0)


sum7 = {p: r.summary() for p, r in runs7.items()}
for p in ("static", "dynamic", "continuous"):
    sum7[p]["throughput_tok_s"] = saturated_tok_s(runs7[p])
print(text_table(["policy", "tok/s", "x serial", "mean batch", "padding waste", "TTFT mean (s)", "TPOT mean (ms)"],
                 [[p, f"{s['throughput_tok_s']:.0f}", f"{s['throughput_tok_s'] / sum7['serial']['throughput_tok_s']:.1f}",
                   f"{s['mean_batch_size']:.1f}", f"{s['padding_waste']:.0%}", f"{s['ttft_mean']:.2f}",
                   f"{s['tpot_mean'] * 1e3:.1f}"] for p, s in sum7.items()]))

# %%
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
names = list(sum7)
vals = [sum7[p]["throughput_tok_s"] for p in names]
bars = ax.bar(names, vals, color=["#bdbdbd", "#f28e2b", "#edc948", "#4e79a7"])
ax.bar_label(bars, labels=[f"{v:.0f}" for v in vals], fontsize=8)
ax.axhline(200, color="r", ls=":", lw=1.2, label="seed claim: serial ~200 tok/s")
ax.axhline(3000, color="r", ls="--", lw=1.2, label="seed claim: batched 3000+ tok/s")
ax.axhline(bound_tok_s, color="k", ls="-.", lw=1, label=f"HBM bound, 1 fp16 stream ({bound_tok_s:.0f} tok/s)")
ax.set_yscale("log")
ax.set_ylabel("output tokens/s (log)")
ax.set_title("llama-2-7b on A100-80G (simulated): throughput by batching policy", fontsize=10)
ax.set_ylim(50, 40000)
ax.legend(fontsize=7, loc="upper left", ncols=2)
ax.grid(axis="y", alpha=0.3, which="both")
plt.show()

# %%
s = sum7
ratio7 = s["continuous"]["throughput_tok_s"] / s["serial"]["throughput_tok_s"]

# %% tags=["check"]
assert s["continuous"]["throughput_tok_s"] > 3000, "the prose says continuous batching reaches the seed's 3000+"
assert s["serial"]["throughput_tok_s"] < 200 and s["serial"]["throughput_tok_s"] < bound_tok_s, \
    "the prose says serial stays below the seed's ~200 and below the bound"
assert ratio7 > 20, "the prose says the ratio exceeds the seed's 5-20x"
assert s["continuous"]["tpot_mean"] > s["serial"]["tpot_mean"], "the prose says bigger batches make each step slower"
assert s["serial"]["throughput_tok_s"] < s["static"]["throughput_tok_s"] < s["continuous"]["throughput_tok_s"]
assert s["serial"]["throughput_tok_s"] < s["dynamic"]["throughput_tok_s"] < s["continuous"]["throughput_tok_s"]

# %% [markdown]
# 模拟结果：连续批处理达到 **{{s['continuous']['throughput_tok_s']:.0f}} Tokens/s**，与种子章节的“3000+”一致；
# 串行只有 **{{s['serial']['throughput_tok_s']:.0f}} Tokens/s**，低于种子章节的“约 200”，也低于
# {{bound_tok_s:.0f}} Tokens/s 的物理上限——因为代价模型假定内核只能跑到约 {{a100.bandwidth_efficiency:.0%}} 的显存带宽，
# 每一步还有 {{cm7.step_overhead_s * 1e3:.0f}} ms 左右的调度与启动开销。两者之比是 **{{ratio7:.0f}} 倍**，
# 比种子章节说的 5–20 倍还大：这是“队列里永远有活”的满负荷情形，真实流量有波谷、SLO 也限制批大小，收益会小一些。
# 静态与动态批处理介于两者之间（{{s['static']['throughput_tok_s']:.0f}} 与 {{s['dynamic']['throughput_tok_s']:.0f}}
# Tokens/s），损失来自请求级批处理：静态批处理有 {{s['static']['padding_waste']:.0%}} 的槽位·步在等批里最长的请求，
# 新请求也要等整批跑完才能进来（第 4 章）。

# %% [markdown]
# **成本。** 种子章节说，以每天 1 亿 Token 的业务为例，动态批处理可减少 60%–70% 的 GPU 采购与运维成本。用上面的
# 模拟吞吐粗算“平均负载下要几张卡”（不考虑峰值与 SLO，第 30 章会做完整的容量规划）：

# %% tags=["nbval-check-output"]
tokens_per_day = 100e6
avg_rate = tokens_per_day / 86400
gpus = {p: int(np.ceil(avg_rate / sum7[p]["throughput_tok_s"])) for p in ("serial", "continuous")}
print(f"average load: {avg_rate:.0f} output tokens/s")
print(f"A100s needed at the simulated throughput: serial {gpus['serial']}, continuous {gpus['continuous']} "
      f"({1 - gpus['continuous'] / gpus['serial']:.0%} fewer)")
saving = 1 - gpus["continuous"] / gpus["serial"]
assert saving > 0.7, "the prose says the average-load saving exceeds the seed's 60-70%"

# %% [markdown]
# 只按平均吞吐算，节省比例是 {{saving:.0%}}，比种子章节的 60%–70% 更高；但现实中要按**峰值**流量留余量，
# 还要让 TTFT/TPOT 满足 SLO（批不能无限大），并且要算上 Prefill 的开销，所以 60%–70% 是更稳妥的工程估计。
#
# **延迟—吞吐可配置。** 种子章节还指出，调整 `max_wait` 可以在“多等一会儿凑更大的批”与“尽快响应”之间取舍。这个旋钮
# 只对“批处理窗口”类的策略有意义；第 1.6 节会看到它在不同框架、以及在 minibatch 里到底指什么，第 4 章会系统地扫描它。

# %% [markdown]
# ## 1.5 动态批处理面临的核心挑战
#
# ### 1.5.1 调度延迟与吞吐的权衡
#
# 批处理需要等待请求聚合，这会引入额外的排队延迟：`max_wait` 太大，TTFT 显著增加；太小，批不够大，吞吐提升有限。
# 更麻烦的是 Token 长度分布高度倾斜（有的请求只有 10 个 Token，有的长达 2000 个），最优的 `max_wait` 与
# `max_batch_size` 很难静态确定。上面的实验 2 已经给出了一个信号：连续批处理的吞吐最高，但它的 TPOT 也随批增大而变长
# ——更大的批意味着每一步更慢。第 3 章用排队论解释这个权衡，第 4、19 章在 SLO 约束下寻找最优参数。
#
# ### 1.5.2 显存管理的复杂性
#
# LLM 推理的显存主要由权重和 KV Cache 构成。每个 Token 都要在每一层存一份 Key 和 Value：
#
# $$\text{KV bytes per token} = 2 \times L \times n_{kv} \times d_{head} \times \text{dtype bytes}.$$
#
# 批处理意味着 KV Cache 的大小随请求数量与序列长度动态变化。下面算一算 LLaMA-7B 在 A100-80G 上放得下多少 KV：

# %% tags=["nbval-check-output"]
kv_tok = spec7.kv_bytes_per_token
cap = cm7.kv_capacity_tokens(gpu_memory_utilization=0.9)
print(f"KV per token: {kv_tok / 2**20:.2f} MiB; a 2048-token sequence: {kv_tok * 2048 / 2**30:.2f} GiB")
print(f"KV capacity at gpu_memory_utilization=0.9: {cap:,} tokens = {cap // 2048} sequences of 2048 tokens")

# %% [markdown]
# 几十个长序列就能把 80 GB 的显存占满，所以 KV Cache 才是批大小真正的上限。传统的“按最大长度预分配连续显存”
# 会造成大量碎片与浪费：vLLM 论文（Kwon et al., SOSP'23）报告，既有系统的 KV 显存中只有 20%–38% 真正存了 Token，
# 而分页注意力（PagedAttention）把浪费降到 4% 以下。第 6、7 章会按论文的定义（预留、内部碎片、外部碎片）在引擎里亲手测量它们。
#
# ### 1.5.3 长尾请求与队头阻塞
#
# 一个批里如果有一个特别长的请求，它的生成时间会远超其他请求。静态批处理里整个批都要等它（实验 1、2 中的填充浪费
# 正是如此）；连续批处理虽然能提前放走已完成的请求，但长请求仍持续占用显存与算力，影响后续请求的调度。如何实现
# 请求级抢占（Preemption）或优先级调度，是保障 QoS 的关键（第 12、21–23 章）。
#
# ### 1.5.4 多模型与多副本的全局优化
#
# 生产环境常常部署多个模型（不同尺寸）或多个副本（不同机房）。如果只在单个实例内做批处理调度，可能出现全局不均衡：
# 某个实例排长队，另一个却空闲。跨实例的全局调度（负载均衡、KV 感知路由、请求迁移）是更复杂的优化问题（第 25–27 章）。

# %% [markdown]
# ## 1.6 案例拆解：从串行到动态批处理的性能跃迁
#
# 种子章节用一个典型的 RAG（检索增强生成）应用展示批处理的效果，我们把它搬进模拟器复盘。
#
# **业务背景与约束（引自种子章节）。** 企业知识库问答系统，模型 LLaMA-13B，部署在 4 张 A10 上；要求平均 TTFT < 800 ms、
# TPOT < 50 ms，支持 200 并发用户；请求到达率约 30 QPS，请求长度相对均匀、平均约 200 Token。初始为串行推理，
# 种子章节给出的现象是：平均 TTFT 2.3 s，吞吐约 150 Tokens/s（单 GPU），GPU 利用率 25%–35%，每个请求处理约 1.5 s。
#
# **调优步骤（引自种子章节）。** 切换到 vLLM 并启用连续批处理；初始参数 `--max-num-seqs 8 --max-num-batched-tokens 4096
# --max-wait 30ms`；压测后把 `max-num-seqs` 提到 16、`max-wait` 降到 20 ms。
#
# **我们的复盘设定。** 13B 的 fp16 权重放不进一张 A10，所以 4 张卡按张量并行（Tensor Parallelism, TP=4）组成一个引擎
# （模拟器里写作 `hardware="4xa10"`）。Prompt 长度取均匀分布，均值为种子章节的“平均约 200 Token”。种子章节没给输出长度，
# 我们用它自己的“串行时每个请求约 1.5 s”反推：1.5 s 减去一次 200 Token 的 Prefill，再除以单步解码时间。

# %% tags=["nbval-check-output"]
SLO = {"ttft": 0.8, "tpot": 0.05}
cm13 = make_cost_model("llama-2-13b", "4xa10")
t_prefill = cm13.step_time([(200, 200)], [])
t_decode = cm13.step_time([], [250])
out_mean = int(round((1.5 - t_prefill) / t_decode, -1))
print(f"4xA10, TP=4: prefill of 200 tokens {t_prefill * 1e3:.0f} ms, one decode step (batch 1) {t_decode * 1e3:.1f} ms")
print(f"-> 1.5 s per request means about {(1.5 - t_prefill) / t_decode:.0f} output tokens; we use uniform "
      f"{out_mean // 2}..{out_mean * 3 // 2} (mean {out_mean})")
rag_wl = synthetic(300, rate=30.0, input_len=uniform(150, 250),
                   output_len=uniform(out_mean // 2, out_mean * 3 // 2), seed=3)
print(f"workload: {len(rag_wl)} requests over {rag_wl[-1].arrival_time:.1f} s (Poisson, 30 QPS)")

# %% [markdown]
# **`--max-wait` 是什么？** vLLM 没有 `--max-wait` 一类的参数（vLLM v0.10.2 `vllm/engine/arg_utils.py` 的 `EngineArgs`）：
# 它的连续批处理每一步都会接纳新请求，不设等待窗口。种子章节里的 `max-wait` 对应的是“批处理窗口”一类参数，例如
# Triton Inference Server 动态批处理器的 `max_queue_delay_microseconds`（凑不满 `max_batch_size` 时最多等这么久；
# Triton 用户指南 `docs/user_guide/batcher.md`）、TF Serving 的 `batch_timeout_micros`
# （`tensorflow_serving/batching/README.md`）。TGI 的 `--max-waiting-tokens`（TGI v3.x `launcher/src/main.rs`，默认 20）
# 含义又不同，它数的是“解码步数”而不是毫秒：运行中的批每跑这么多步，路由器才强制暂停一次、把等待的请求做 Prefill
# 并入批中。vLLM V0 引擎有一个相近的 `--scheduler-delay-factor`（vLLM v0.7 `vllm/engine/arg_utils.py`，默认 0.0：
# 按上一次 Prompt 延迟的倍数推迟调度下一个 Prompt）。
#
# 在 minibatch 里，`max_wait_ms` 是引擎配置项，由策略自己决定用不用。下面查一查哪些策略的代码读了它，并看看
# `dynamic` 策略的文档是怎么解释它的：

# %%
readers = [p for p in available() if "max_wait" in inspect.getsource(type(make_policy(p)))]
print("policies whose code reads max_wait:", readers)
print(inspect.getdoc(inspect.getmodule(type(make_policy("dynamic")))).split("\n\n")[1])

# %% [markdown]
# 所以：`continuous` 策略（vLLM 风格）**忽略** `max_wait_ms`，和 vLLM 一样每一步都接纳新请求；`dynamic` 策略
# （Triton 风格）在凑满 `max_num_seqs` 或最老请求等满 `max_wait_ms` 时发车，之后按请求级批处理跑完整批。
# 复盘时我们把种子章节的两组参数各用这两种解释跑一遍，再加上串行基线。为了看清“硬件极限”，最后一行是不限批大小
# （`max_num_seqs=256`）的连续批处理，作为参照。
#
# **SLO 是对均值还是对每个请求？** 种子章节写的是“**平均** TTFT < 800 ms，TPOT < 50 ms”——对均值的约束。下表两种都给：
# “TTFT mean / TPOT mean”对照种子章节的均值约束；“SLO met”是**每个请求**都满足 TTFT < 800 ms 且 TPOT < 50 ms 的比例
# （SLO 达成率，DistServe 的口径，也是后面测容量用的）。均值达标时，仍可能有相当一部分请求不达标。

# %% tags=["nbval-check-output"]
sim13 = dict(executor="sim", model="llama-2-13b", hardware="4xa10")
cfg_a = dict(max_num_seqs=8, max_num_batched_tokens=4096, max_wait_ms=30)
cfg_b = dict(max_num_seqs=16, max_num_batched_tokens=4096, max_wait_ms=20)
rag_cases = {"serial": dict(policy="serial"),
             "continuous 8/4096/30ms": dict(policy="continuous", **cfg_a),
             "continuous 16/4096/20ms": dict(policy="continuous", **cfg_b),
             "dynamic 8/4096/30ms": dict(policy="dynamic", **cfg_a),
             "dynamic 16/4096/20ms": dict(policy="dynamic", **cfg_b),
             "continuous 256 (reference)": dict(policy="continuous", max_num_seqs=256, max_num_batched_tokens=4096)}
rag_runs = {name: run(rag_wl, **sim13, **kw) for name, kw in rag_cases.items()}
rag_sum = {name: r.summary(slo=SLO) for name, r in rag_runs.items()}
served = {name: s["request_throughput"] for name, s in rag_sum.items()}
print(text_table(["configuration", "TTFT mean", "TPOT mean", "served", "tok/s", "goodput", "SLO met", "batch"],
                 [[n, f"{s['ttft_mean']:.2f} s", f"{s['tpot_mean'] * 1e3:.0f} ms", f"{served[n]:.1f} req/s",
                   f"{s['throughput_tok_s']:.0f}", f"{s['goodput']:.2f} req/s", f"{s['slo_attainment']:.0%}",
                   f"{s['mean_batch_size']:.1f}"] for n, s in rag_sum.items()]))

# %% [markdown]
# 表中 “served” 是整个回放里平均每秒完成的请求数（30 QPS 到达时，它若明显低于 30，队列就在增长）；goodput 是每秒满足
# SLO 的请求数。先看 TTFT 随到达时间的变化——它揭示了问题的本质：

# %%
fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
for i, (name, r) in enumerate(rag_runs.items()):
    recs = sorted((x for x in r.requests if x.ttft is not None), key=lambda x: x.arrival_time)
    ax.plot([x.arrival_time for x in recs], [x.ttft for x in recs], lw=1.2, color=f"C{i}", label=name)
ax.axhline(SLO["ttft"], color="r", ls=":", lw=1.2, label="SLO: TTFT 0.8 s")
ax.set_yscale("log")
ax.set_xlabel("arrival time (s)")
ax.set_ylabel("TTFT (s, log)")
ax.set_title("RAG case, llama-2-13b on 4xA10 at 30 QPS (simulated): TTFT by arrival time", fontsize=10)
ax.legend(fontsize=7, ncols=2)
ax.grid(alpha=0.3, which="both")
plt.show()

# %%
ref = rag_sum["continuous 256 (reference)"]
assert all(v < 30 * 0.8 for v in served.values()), "the prose says every configuration serves far less than 30 QPS"
assert ref["tpot_mean"] > SLO["tpot"], "the prose says the unbounded batch misses the TPOT SLO"

# %% [markdown]
# 串行、种子章节的两组参数、乃至参照行，TTFT 都随到达时间上涨：每种配置平均每秒只完成
# {{min(served.values()):.1f}}–{{max(served.values()):.1f}} 个请求，**到达率 30 QPS 超过了服务能力，队列无限增长**——这是排队问题，
# 不是单个请求算得慢。所以上表的 TTFT 均值取决于压测持续多久（这里只回放了 {{rag_wl[-1].arrival_time:.0f}} s 的流量），
# 没有稳态可言。参照行把批放开到 256，每一步要解码约 {{ref['mean_batch_size']:.0f}} 个序列，TPOT 均值
# {{ref['tpot_mean'] * 1e3:.0f}} ms，超过 50 ms 的 SLO。
#
# 那么每种配置到底能扛多少 QPS？在不同到达率下回放，这一次按稳态测：

# %%
RATES = [2, 4, 8, 12, 14, 16, 18, 20, 30]
SWEEP_S, MIN_REQUESTS = 60.0, 400     # seconds of Poisson traffic per point, and at least this many requests
TRIM, TARGET, GIVE_UP = 0.2, 0.9, 0.5  # warm-up/drain trimmed; capacity's attainment; below this, stop climbing
SEEDS = [3, 4]

# %% [markdown]
# 每个点回放 {{SWEEP_S:.0f}} s 的泊松流量（至少 {{MIN_REQUESTS}} 个请求），去掉到达时间
# 跨度最前与最后 {{TRIM:.0%}} 里到达的请求（预热与收尾，`RunResult.summary(trim={{TRIM}})`）；达标的点再用第二个随机种子复核，取较差的那个；
# 达成率跌破 {{GIVE_UP:.0%}} 之后的点不再测（过载时越跑越差，只会更低），{{RATES[-1]}} QPS 除外。**服务容量**取“SLO 达成率 ≥ {{TARGET:.0%}} 的最高到达率”
# （DistServe, OSDI'24 的口径）。回放要够长：到达率只比服务能力高一点时，队列要十几秒才积起来，回放太短会把容量测高
# （第 30 章 30.3 节）。到达率一直扫到种子章节的 30 QPS。

# %%
sweep_cases = {"continuous 8/4096": dict(policy="continuous", **cfg_a),
               "continuous 16/4096": dict(policy="continuous", **cfg_b),
               "continuous 64/4096": dict(policy="continuous", max_num_seqs=64, max_num_batched_tokens=4096)}


def rag_stream(rate, seed, n=None):
    return synthetic(n or max(MIN_REQUESTS, int(rate * SWEEP_S)), rate=rate, input_len=uniform(150, 250),
                     output_len=uniform(out_mean // 2, out_mean * 3 // 2), seed=seed)


def attainment(rate, seed=SEEDS[0], hardware="4xa10", **kw):
    """Steady-state SLO attainment (per request) at ``rate``, warm-up and drain dropped."""
    r = run(rag_stream(rate, seed), executor="sim", model="llama-2-13b", hardware=hardware, **kw)
    return r.summary(slo=SLO, trim=TRIM)["slo_attainment"]


def attainment_curve(kw):
    """{rate: attainment}: a pass is checked with the second seed (the worse counts); once a
    rate falls below 50%, higher rates are skipped except the last (30 QPS)."""
    pts = {}
    for q in RATES:
        if q != RATES[-1] and pts and min(pts.values()) < GIVE_UP:
            continue
        a = attainment(q, **kw)
        pts[q] = min(a, attainment(q, SEEDS[1], **kw)) if a >= TARGET else a
    return pts


# %%
sweep = {name: attainment_curve(kw) for name, kw in sweep_cases.items()}
caps = {name: capacity(pts, target=TARGET) for name, pts in sweep.items()}
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
for name, pts in sweep.items():
    ax.plot(list(pts), [a * 100 for a in pts.values()], marker="o", label=f"{name} (capacity {caps[name]} QPS)")
ax.axvline(30, color="r", ls=":", lw=1.2, label="seed: ~30 QPS")
ax.axhline(90, color="k", ls="--", lw=0.8, label="90% of requests meet the SLO")
ax.set_xlabel("request rate (QPS)")
ax.set_ylabel("SLO attainment (%, steady state)")
ax.set_title("llama-2-13b on 4xA10 (simulated): SLO attainment vs load", fontsize=10)
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
plt.show()
print("capacity (highest rate with >= 90% of requests meeting TTFT < 0.8 s and TPOT < 50 ms):", caps)
print("attainment at 30 QPS:", {name: f"{pts[30]:.0%}" for name, pts in sweep.items()})

# %% [markdown]
# **有没有哪种配置能在 4×A10 上扛住 30 QPS？** 扫描只试了几组参数；下面给一个与参数无关的论证。设引擎每一步耗时 $t$，
# 稳态下这一步里至少要完成这段时间内到达的工作：$30t$ 个请求的 Prefill（每个约 200 Token），以及正在解码的
# $30 \cdot \bar{N} \cdot t$ 个序列各一个 Token（Little 定律，$\bar{N}$ 是平均输出长度）。把这些工作全塞进同一步是最省的做法
# （权重只读一遍、固定开销只付一次）。如果对任何 $t$，代价模型给出的这一步耗时都大于 $t$，那么无论怎样调度，
# 每一步都追不上到达的工作，队列必然增长。下面在从几毫秒到几秒的网格上逐一检查 $t$，并对“同样 4 张卡拆成两个 TP=2 副本、
# 各承担一半流量”也做同样的检查：

# %% tags=["nbval-check-output"]
def keeps_up(cm, rate, prompt=200, out=out_mean):
    """Step lengths t at which one step can hold the work arriving in t (rate*t prefills of
    `prompt` tokens and rate*out*t decodes): if none, no schedule keeps up with `rate`."""
    ok = []
    for t in np.geomspace(0.005, 2.0, 60):
        prefills = [(prompt, prompt)] * max(1, round(rate * t))
        decodes = [prompt + out // 2] * max(1, round(rate * out * t))
        if cm.step_time(prefills, decodes) <= t:
            ok.append(t)
    return ok


layouts = {"4xA10, one TP=4 engine at 30 QPS": (make_cost_model("llama-2-13b", "4xa10"), 30.0),
           "4xA10 as two TP=2 replicas, 15 QPS each": (make_cost_model("llama-2-13b", "2xa10"), 15.0),
           "one H100 at 30 QPS": (make_cost_model("llama-2-13b", "h100"), 30.0)}
feasible = {name: keeps_up(cm, rate) for name, (cm, rate) in layouts.items()}
for name, ok in feasible.items():
    print(f"{name:<42} " + (f"keeps up with steps of {min(ok) * 1e3:.0f} ms or longer" if ok else "never keeps up"))
h100 = {seed: run(rag_stream(30, seed), executor="sim", model="llama-2-13b", hardware="h100",
                  max_num_seqs=128, max_num_batched_tokens=4096).summary(slo=SLO, trim=TRIM) for seed in SEEDS}
print("one H100, max_num_seqs=128, 30 QPS: " + "; ".join(
    f"seed {k}: SLO met {v['slo_attainment']:.0%}, TTFT mean {v['ttft_mean'] * 1e3:.0f} ms, "
    f"TPOT mean {v['tpot_mean'] * 1e3:.1f} ms" for k, v in h100.items()))

# %% tags=["check"]
assert not feasible["4xA10, one TP=4 engine at 30 QPS"] and not feasible["4xA10 as two TP=2 replicas, 15 QPS each"], \
    "the prose says no schedule on 4xA10 keeps up with 30 QPS"
assert all(pts[30] < 0.9 for pts in sweep.values()), "the prose says no swept configuration meets the SLO at 30 QPS"
best_pts = sweep[max(caps, key=caps.get)]
above = min(q for q in best_pts if q > max(caps.values()))
assert best_pts[above] < 0.5, "the prose says one step above the best capacity is far from the SLO"
assert all(v["slo_attainment"] >= 0.9 for v in h100.values()), "the prose says one H100 meets the SLO at 30 QPS"

# %% [markdown]
# 结论：在模拟器的代价模型下，**4×A10 上没有任何配置能在这个 SLO 下扛住 30 QPS**——不论是一个 TP=4 的引擎，还是拆成两个
# TP=2 的副本，都不存在一个步长能装下这段时间里到达的工作（TP=4 时，每层两次跨 PCIe 的 All-Reduce 占了一步的很大一块，
# 见第 2 章的耗时分解）。扫描到的最好配置的服务容量是 {{max(c for c in caps.values() if c is not None)}} QPS，再高一级就远远不达标：
# 容量附近，达成率对到达率与随机种子都很敏感（第 30 章 30.3 节用三个种子、1 QPS 的步长复核同一个副本）。
# 换一张 H100，`max_num_seqs=128`，30 QPS 下两个种子的 SLO 达成率都不低于 {{TARGET:.0%}}（上一格）。要留在 A10 上，就只能加卡
# （多副本，第 26 章）、缩短输出，或接受更宽松的 SLO。
#
# **模拟与种子章节的数字为什么对不上？** 下面这个单元格把几处分歧逐条算出来，最后两行检查种子章节的“200 并发用户”
# 和“GPU 利用率稳定在 80% 以上”。

# %% tags=["nbval-check-output"]
ser = rag_runs["serial"]
service = np.array([x.finish_time - x.first_scheduled_time for x in ser.requests])
es, es2 = service.mean(), (service ** 2).mean()
wait_target = 2.3 - t_prefill                    # the seed's 2.3 s TTFT, minus the prefill itself
lam_23 = wait_target / (es2 / 2 + wait_target * es)   # M/G/1 (Pollaczek-Khinchine) solved for the rate
a10 = get_hardware("a10")
spec13 = get_model_spec("llama-2-13b")
bound13 = 4 * a10.memory_bandwidth / spec13.weight_bytes
ser_tok_s = rag_sum["serial"]["throughput_tok_s"]


def utilisation(r):
    """nvidia-smi style busy time, MBU and MFU of a run on 4xA10 (weights and decode KV read per step)."""
    busy_s = sum(st.duration for st in r.steps)
    bytes_read = sum(spec13.weight_bytes + st.num_decode_tokens * 250 * spec13.kv_bytes_per_token
                     for st in r.steps)           # each decode reads ~250 tokens of KV
    flops = sum(2 * spec13.num_params * (st.num_decode_tokens + st.num_prefill_tokens) for st in r.steps)
    return (busy_s / r.summary()["duration_s"], bytes_read / busy_s / (4 * a10.memory_bandwidth),
            flops / busy_s / (4 * a10.peak_flops))


busy, mbu, mfu = utilisation(ser)
busy_c, mbu_c, mfu_c = utilisation(rag_runs["continuous 16/4096/20ms"])
e2e_sla = SLO["ttft"] + (out_mean - 1) * SLO["tpot"]       # the longest E2E of a mean request that meets the SLO
kv_200 = 200 * (200 + out_mean)
print(f"serial service time: mean {es:.2f} s -> capacity {1 / es:.2f} QPS (offered: 30 QPS)")
print(f"M/G/1: a mean TTFT of 2.3 s under serial serving means about {lam_23:.2f} QPS, not 30")
print(f"serial tokens/s: simulated {ser_tok_s / 4:.0f} per GPU; HBM bound {bound13 / 4:.0f} per GPU (seed: ~150)")
print(f"serial GPU use: busy {busy:.0%}, bandwidth (MBU) {mbu:.0%}, FLOPs (MFU) {mfu:.1%}")
print(f"continuous 16/4096 GPU use: busy {busy_c:.0%}, MBU {mbu_c:.0%}, MFU {mfu_c:.1%}")
print(f"200 users closed loop at 30 QPS: E2E + think time = 200 / 30 = {200 / 30:.1f} s per user; "
      f"an SLO-meeting request takes at most {e2e_sla:.1f} s")
print(f"200 requests in flight hold {kv_200:,} KV tokens; 4xA10 holds {cm13.kv_capacity_tokens():,}")

# %% [markdown]
# 1. **TTFT 2.3 s。** 串行时每个请求平均占用 GPU {{es:.2f}} s，一台 4×A10 引擎每秒最多服务 {{1 / es:.2f}} 个请求；
#    到达率 30 QPS 远超这个能力，队列无限增长：仅 {{rag_wl[-1].arrival_time:.0f}} s 的流量，平均 TTFT 就达到
#    {{rag_sum['serial']['ttft_mean']:.0f}} s，且越压越大（见上表与上图）。按 M/G/1 排队公式（Pollaczek–Khinchine，第 3 章）反推，
#    平均 TTFT 为 2.3 s 对应的到达率只有约 {{lam_23:.2f}} QPS。种子章节的数字更像是客户端超时、限流之后“活下来”的请求的统计，
#    而不是 30 QPS 下的稳态。
# 2. **单 GPU 约 150 Tokens/s。** 串行解码受显存带宽约束：4 张 A10 合起来每秒最多把 13B 的权重读 {{bound13:.0f}} 遍，
#    折合每卡 {{bound13 / 4:.0f}} Tokens/s；模拟值是每卡 {{ser_tok_s / 4:.0f}} Tokens/s（还要扣掉张量并行的通信与每步开销）。
#    “单卡 150 Tokens/s”超出了串行 fp16 的物理上限，只能来自批处理、量化或把 Prompt Token 计入吞吐。
# 3. **GPU 利用率 25%–35%，以及“稳定维持在 80% 以上”。** “利用率”有三种含义：`nvidia-smi` 的 GPU-Util 是“有内核在跑的时间
#    比例”，串行且队列不空时是 {{busy:.0%}}；显存带宽利用率（MBU）约 {{mbu:.0%}}——带宽并没有闲着，它几乎全花在每个 Token
#    重读一遍权重上；算力利用率（MFU）只有 {{mfu:.1%}}。种子章节说的“计算资源大量空闲”指的是算力：串行解码是访存受限的，
#    批处理让读一次权重服务多个 Token，这才是它“白捡”吞吐的原因（第 2 章）。换成连续批处理后，GPU-Util 是
#    {{busy_c:.0%}}，MFU 升到 {{mfu_c:.1%}}：“80% 以上”只对“有内核在跑的时间”成立，算力利用率远达不到。
# 4. **“支持 200 并发用户”。** 如果这是 200 个闭环（Closed-loop）用户（每人等上一个回答结束才发下一个，第 8 章），
#    由 Little 定律，30 QPS 意味着每个用户每 {{200 / 30:.1f}} s 发一个请求；一个达标的请求最多用时
#    {{e2e_sla:.1f}} s（TTFT 0.8 s 加上 {{out_mean - 1}} 个 50 ms），所以用户还要有约 {{200 / 30 - e2e_sla:.1f}} s 以上的
#    “思考时间”，否则 200 个用户发不出 30 QPS——“并发用户数”和“到达率”必须一起说清楚。200 个请求同时在飞需要
#    {{kv_200:,}} 个 Token 的 KV，4×A10 放得下（{{cm13.kv_capacity_tokens():,}}）：这个瓶颈不在显存，而在算力与通信。
#
# 这一节的要点不在于种子章节的哪个数字“错了”，而在于方法：**先算物理上限与服务能力，再看排队**。同样的现象
# （TTFT 过高）既可能是“每个请求算得慢”（计算问题，靠批处理、量化、更快的卡解决），也可能是“请求来得比处理得快”
# （排队问题，靠扩容、限流解决），两者的对策完全不同。表里还有两个值得注意的细节：
#
# - **`max_wait` 的两种解释差别巨大。** 同样的参数，`dynamic`（Triton 式窗口 + 请求级批处理）的 TTFT 比 `continuous`
#   差得多：新请求不但要等窗口，还要等当前整批跑完；而连续批处理下一步就能让它加入。对 LLM 这种输出长度不一的负载，
#   请求级批处理的“等整批”远比窗口本身伤人——这就是 Orca 提出迭代级调度的动机（第 4、5 章）。
# - **批越大，TPOT 越长。** 参照行把批放开后吞吐最高，但 TPOT 超过了 50 ms 的 SLO。吞吐与延迟之间没有免费的午餐，
#   要在 SLO 约束下找 Goodput 最大的配置（第 19 章）。
#
# **风险与代价（种子章节）。** 切换框架后需要适配原有的 Prompt 模板与采样参数；vLLM 的显存管理与自研实现不同，
# 初期出现显存占用偏高，通过调整 `gpu-memory-utilization` 解决（它决定了 KV Cache 的块数，第 10 章）。
#
# **复盘经验。** 动态批处理的收益不是“免费午餐”，它需要精细的参数调优与业务特征匹配。本案例的请求长度相对均匀，
# 简单的连续批处理即可获得显著收益——但前提是硬件的服务能力高于到达率；如果长度差异极大，就要考虑更高级的调度策略
# （如基于长度的优先级队列，第 21 章）。

# %% [markdown]
# ## 1.7 本章小结
#
# - 动态批处理通过运行时聚合请求，让多个请求共享一次权重读取，从而显著提升吞吐。实验 2 在 LLaMA-7B/A100 的模拟中看到了
#   数量级以上的差距；实验 1 在 CPU 上的真实小模型上只有几倍（CPU 的算力小，批一大每步就接近算力受限）。连续批处理没有填充浪费，
#   批始终是满的；批更满能换来多少吞吐，取决于 $t_{\text{step}}(B)$ 随 $B$ 涨得多快：GPU 上几乎不涨（实验 2），CPU 上小模型涨得很快（实验 1）。
# - 单请求解码速度有物理上限：权重字节数 ÷ 显存带宽。串行解码把带宽花在重复读权重上、让算力闲置；任何“串行吞吐”的说法都应先用
#   这个上限检验。
# - 批处理的代价是 TPOT 变长、调度变复杂；挑战集中在延迟—吞吐权衡、KV Cache 显存管理、长尾与队头阻塞、全局调度四个方面。
# - 案例复盘表明：先区分**计算问题**与**排队问题**，在稳态下测容量（SLO 达成率 ≥ {{TARGET:.0%}} 的最高到达率），并写明 SLO 是对均值还是
#   对每个请求。到达率超过服务能力时，任何参数都救不了 TTFT：在模拟器里 4×A10 扛不住 30 QPS，一张 H100 可以。
# - 不同框架里“等待窗口”的含义不同：vLLM 没有 `--max-wait`；Triton 的 `max_queue_delay_microseconds` 是微秒级窗口；
#   TGI 的 `max_waiting_tokens` 数的是解码步数；minibatch 的 `max_wait_ms` 只被 `dynamic` 策略使用。
#
# **学习路径。** 下一章从一次生成的两个阶段——Prefill 与 Decode——出发，用 Roofline 模型量化“批处理为什么几乎免费”；
# 第 3 章进入排队论，解释本章案例里 TTFT 为什么会爆炸。
#
# ### 预告：实时仪表盘
#
# 后续章节会经常用到 minibatch 的实时仪表盘（`minibatch.widgets.Dashboard`）：选择工作负载、执行器、模型与硬件，
# 点击 Start 开始回放；运行中可以随时切换策略、调整 `max_num_seqs`、`max_wait_ms` 和到达率，图上会标出每次改动。
# 下面构建一个模拟 LLaMA-7B/A100 的仪表盘；`preview()` 以最快速度回放开头的几十个请求，把结果画进图里，
# 控件保持原来的设置。

# %% tags=["nbval-ignore-output"]
from minibatch.widgets import Dashboard
from minibatch.widgets.controls import make_workload

dash = Dashboard("chat", executor="sim", model="llama-2-7b", hardware="a100-80g", policy="continuous", speed=5)
dash_preview = dash.preview(num_requests=40)      # the picture: the first 40 requests, as fast as possible
dash

# %%
start_workload = make_workload(dash.controls)     # what Start replays: the controls' settings
start_span_s = max(r.arrival_time for r in start_workload)
start_speed = dash.controls["speed"].value          # virtual seconds per wall second
start_wall_s = start_span_s / start_speed
preview_n = dash_preview.summary()["num_requests"]

# %% tags=["check"]
assert preview_n < len(start_workload), "the preview is the start of the workload"
assert start_wall_s > 5, "the prose says Start's run lasts long enough to switch policy mid-run"

# %% [markdown]
# 上图是预览：开头 {{preview_n}} 个请求。点击 Start 则按控件的设置回放全部
# {{len(start_workload)}} 个请求：它们在 {{start_span_s:.0f}} 秒的虚拟时间里陆续到达，速度（speed）为
# {{start_speed:g}}× 时至少要 {{start_wall_s:.0f}} 秒墙钟时间才能跑完——足够在中途切换策略、拖动到达率，
# 看曲线如何跟着变。把速度调成 `as fast as possible` 则一眨眼就跑完。
#
# 没有运行中的内核时（静态网页版的书、刚打开还没运行的 Notebook），这里显示的是仪表盘当时的一张静态图；
# 在 JupyterLab 中运行这个单元格，就会得到可以操作的实时仪表盘。

# %% [markdown]
# ## 练习
#
# 1. **物理上限。** 仿照实验 2 的第一个单元格，算出 LLaMA-2-13B 在 H100 上、LLaMA-2-70B 在 8×H100（`"8xh100"`）上
#    单请求 fp16 解码的上限 Tokens/s。如果权重量化到 INT4（每参数 0.5 字节），上限变成多少？
# 2. **填充浪费。** 在实验 1 中把输出长度改为固定值（`output_len=24`），静态批处理的 `padding_waste` 和吞吐会怎样变化？
#    为什么长度越均匀，静态批处理越接近连续批处理？
# 3. **窗口的代价。** 用实验 2 的模拟设定，把到达率降到 2 req/s，对 `dynamic` 策略扫描 `max_wait_ms ∈ {0, 50, 200, 1000}`，
#    画出平均 TTFT 与平均批大小。低负载下窗口让 TTFT 增加了多少？（阅读 `minibatch/policies/dynamic.py` 的文档字符串。）
# 4. **案例再设计。** 用 1.6 节的 `attainment` 函数，找出让 30 QPS 下 SLO 达成率超过 90% 的最小改动：
#    (a) 只改 `max_num_seqs`；(b) 把输出长度减半；(c) 换成 `"4xa100-80g"`。哪一种可行？用模拟结果说明。
# 5. **仪表盘。** 在仪表盘里选 `chat` 负载、`executor=sim`，运行中把策略从 `continuous` 切到 `static` 再切回来，
#    观察吞吐曲线和 TTFT 曲线的变化，并用本章的概念解释。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 上限 = HBM 带宽 ÷ 权重字节数（张量并行时带宽按卡数相加、权重按卡数切分）：`get_hardware("h100").memory_bandwidth /
#    get_model_spec("llama-2-13b").weight_bytes`；70B 在 8×H100 上用 `8 * ...`。INT4 时权重字节数约为 fp16 的 1/4，
#    上限约变为 4 倍（KV 仍按 fp16 读，长上下文时收益更小）。
# 2. 输出长度相同、同时到达时，一批里的请求同时结束，`padding_waste` 接近 0，静态与连续批处理的吞吐几乎相同；
#    长度越分散，$\max_i o_i$ 比平均值大得越多，空转的槽位越多（第 4 章的公式）。
# 3. 低负载下 $\lambda w \ll 1$，窗口几乎原样加到 TTFT 上（200 ms 窗口约让 TTFT 增加 200 ms），平均批大小却几乎不变：
#    见第 4 章 4.4 节的同一个实验。
# 4. (a) 不可行：1.6 节的论证说明 4×A10 上任何调度都追不上 30 QPS；(b) 输出减半后解码工作量减半，用 `keeps_up` 与
#    `attainment`（把 `out_mean` 减半后重新生成负载）检查；(c) `attainment(30, hardware="4xa100-80g", max_num_seqs=64,
#    max_num_batched_tokens=4096)`：A100 的算力与 NVLink 互联都强得多。
# 5. 切到 `static` 后批出现锯齿、吞吐下降、TTFT 上升（新请求要等整批结束）；切回 `continuous` 后队列被迅速消化。
#
# </details>
