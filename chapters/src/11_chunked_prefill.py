# %% [markdown]
# # 第 11 章 分块预填充（Chunked Prefill）与混合批
#
# 连续批处理（第 5 章）让新请求随时加入批次，可“加入”本身有代价：新请求的预填充（Prefill）要一次算完整个提示，
# 几千个 Token 的一步，算力受限（Compute-bound，第 2 章），耗时是一个解码步的许多倍（11.1 节量给你看）。这一步里，批中正在解码的请求都在等——
# 它们的 Token 间延迟（ITL）出现一次长长的停顿。Sarathi-Serve（Agrawal et al., *Taming Throughput-Latency Tradeoff in LLM
# Inference with Sarathi-Serve*, OSDI'24）把这种停顿叫作**生成停顿**（Generation Stall），并提出两件事来消除它：
# **分块预填充**——把长提示切成若干块，分几步算；**无停顿批处理**（Stall-free Batching）——每一步先放下所有正在解码的请求，
# 再用剩下的 Token 预算装预填充块，组成预填充与解码混在一起的**混合批**（Hybrid Batch）。
#
# 本章先在模拟器里复现一次生成停顿，再读 Sarathi-Serve 的设计与关键数据，然后在稳态下测量分块大小（即 Token 预算）
# 对 TTFT 与 ITL 尾部、对服务容量的影响，最后在真实的 tiny 模型上验证：分块只改变**什么时候**算，不改变**算出什么**。
#
# ## 学习目标
#
# - 能解释长预填充如何造成生成停顿，并在一次运行的逐步记录里找到它；
# - 理解 Sarathi-Serve 的无停顿批处理：解码优先、再续上进行中的预填充、最后接纳新请求，每步不超过 Token 预算；
#   知道 minibatch 的 `continuous` 策略加分块预填充为什么恰好是这个顺序；
# - 会在稳态、多个随机种子下测量分块大小与 TTFT、TPOT/ITL 尾部、服务容量的关系，并说明最优分块大小为何随 SLO 而变；
# - 知道 vLLM V1 在哪里默认打开分块预填充（v0.11.0，`vllm/engine/arg_utils.py`），以及 `long_prefill_token_threshold` 的作用。

# %%
import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

from minibatch import EngineConfig, LLMEngine
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.viz import batch_composition, md_table
from minibatch.workload import RequestSpec, Workload, load_workload, lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter
OFF = dict(enable_chunked_prefill=False, max_num_batched_tokens=4096)  # whole prompts (4096 = max_model_len)
STALL = dict(long_prompt=4000, num_decoders=32, at=2.0)                # the stall experiment of 11.1
DECODER_PROMPT, DECODER_OUTPUT, CHUNK = 256, 400, 512
torch.set_num_threads(1)

# %% [markdown]
# ## 11.1 长预填充让解码停顿
#
# 实验：{{STALL["num_decoders"]}} 个请求同时到达（提示 {{DECODER_PROMPT}} Token、各生成 {{DECODER_OUTPUT}} 个 Token），
# 它们很快进入稳定的解码；{{STALL["at"]:g}} 秒后来了一个 {{STALL["long_prompt"]}} Token 的长提示。
# 分别用两种方式运行模拟的 Llama-2-7B / A100-80G：**不分块**（`enable_chunked_prefill=False`，预算 {{OFF["max_num_batched_tokens"]}}
# 足以一步放下整段提示）与**分块**（预算 {{CHUNK}}：每步最多 {{CHUNK}} 个新 Token）。

# %% tags=["nbval-check-output"]
def stall_workload(long_prompt=STALL["long_prompt"], num_decoders=STALL["num_decoders"], at=STALL["at"]):
    specs = [RequestSpec(0.0, DECODER_PROMPT, DECODER_OUTPUT, request_id=f"d{i}") for i in range(num_decoders)]
    return Workload(specs + [RequestSpec(at, long_prompt, 16, request_id="long")], name="stall")


def stall_run(chunk=CHUNK, **kw):
    """The stall experiment with chunk=None (no chunking) or a token budget; the run and its key numbers."""
    cfg = OFF if chunk is None else dict(max_num_batched_tokens=chunk)
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, **cfg), clock="virtual")
    stalls = []                        # running decodes left out of a step without being preempted
    schedule = engine.scheduler.schedule

    def spy(now):
        decoding = {r.request_id for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1}
        batch = schedule(now)
        got = {r.request_id for r, _ in batch.items} | {r.request_id for r in batch.preempted}
        stalls.extend(decoding - got)
        return batch

    engine.scheduler.schedule = spy
    res = run(stall_workload(**kw), engine=engine)
    recs = {r.request_id: r for r in res.requests}
    at = recs["long"].arrival_time
    itl = [g for r in res.requests if r.request_id != "long" for g, t in zip(r.itl, r.token_times[1:]) if t > at]
    return res, dict(ttft_long=recs["long"].ttft, max_itl=max(itl), median_itl=float(np.median(itl)), stalls=len(stalls))


stall = {"no chunking": stall_run(None), f"chunked, budget {CHUNK}": stall_run(CHUNK)}
for name, (res, m) in stall.items():
    print(f"{name:<20} long prompt TTFT {m['ttft_long'] * 1e3:4.0f} ms | decoders after it: max ITL "
          f"{m['max_itl'] * 1e3:4.0f} ms, median ITL {m['median_itl'] * 1e3:.1f} ms")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
for ax, (name, (res, m)) in zip(axes, stall.items()):
    at = next(r.arrival_time for r in res.requests if r.request_id == "long")
    steps = [s for s in res.steps if at - 0.15 <= s.start_time <= at + 0.5]
    t = np.array([s.start_time for s in steps])
    d = np.array([s.duration for s in steps]) * 1e3
    pre = np.array([s.num_prefill_tokens > 0 for s in steps])
    ax.bar(t, d, width=[s.duration for s in steps], align="edge", color=np.where(pre, "#f2a65a", "#5a8fd6"),
           edgecolor="white", linewidth=0.3)
    d0 = next(r for r in res.requests if r.request_id == "d0")
    pts = [(tt, g * 1e3) for tt, g in zip(d0.token_times[1:], d0.itl) if at - 0.15 <= tt <= at + 0.5]
    ax.plot(*zip(*pts), "k.", ms=3, label="ITL of request d0")
    ax.axvline(at, color="C3", ls=":", lw=1)
    ax.text(at + 0.005, ax.get_ylim()[1] * 0.02 + 250, "long prompt arrives", color="C3", fontsize=7)
    ax.set(title=f"{name}: max ITL {m['max_itl'] * 1e3:.0f} ms", xlabel="time (s)")
    ax.grid(alpha=0.3, axis="y")
axes[0].set_ylabel("step duration (ms)\norange = step with prefill")
axes[0].legend(fontsize=7, loc="upper right")
fig.suptitle(f"A {STALL['long_prompt']}-token prompt joins {STALL['num_decoders']} decoding requests "
             "(llama-2-7b, A100-80G, simulated)", fontsize=10)
fig.tight_layout()
plt.show()

# %%
off, on = stall["no chunking"][1], stall[f"chunked, budget {CHUNK}"][1]

# %% tags=["check"]
assert off["max_itl"] > 4 * on["max_itl"], "the prose says chunking cuts the stall several-fold"
assert on["ttft_long"] > off["ttft_long"], "the prose says chunking delays the long prompt's first token"
assert off["stalls"] == on["stalls"] == 0, "the prose says no running decode is ever left out of a step"

# %% [markdown]
# 不分块时，长提示到达后的那一步要算完 {{STALL["long_prompt"]}} 个 Token；{{STALL["num_decoders"]}} 个解码请求在这一步里各自只前进一个 Token，
# 它们的 ITL 从中位数 {{off["median_itl"] * 1e3:.1f}} ms 一下跳到 {{off["max_itl"] * 1e3:.0f}} ms——这就是生成停顿。
# 预算 {{CHUNK}} 时，同一段提示被切成若干块，每步只带一块，最长的 ITL 只有 {{on["max_itl"] * 1e3:.0f}} ms，是不分块时的
# {{on["max_itl"] / off["max_itl"]:.0%}}。代价落在长提示自己身上：它的 TTFT 从 {{off["ttft_long"] * 1e3:.0f}} ms 变成
# {{on["ttft_long"] * 1e3:.0f}} ms——块越小，算完整个提示需要的步数越多，每一步还要再读一遍前面各块的 KV。
#
# 注意两种方式**都没有**把解码请求踢出批次（上面折叠的检查单元格检查了每一步：正在解码的请求不是被调度就是被抢占，从不被跳过）；
# 不分块时的停顿来自“同一步里有一个很长的预填充”，而不是解码被暂停。Sarathi-Serve 的消融实验（见下节表 4）把这种做法叫作
# hybrid-batching-only：混合批本身不够，必须同时限制每步的预填充 Token 数。
#
# 拿整段运行来看：`minibatch.viz.batch_composition` 把每步的 Token 数画成柱子（蓝色解码、橙色预填充）。

# %%
for name, (res, _) in stall.items():
    fig = batch_composition(res, figsize=(10, 2.6))
    fig.axes[0].set_title(f"{name}: tokens per step over the whole run ({len(res.steps)} steps)", fontsize=9)
    display(fig)

# %% [markdown]
# ## 11.2 Sarathi-Serve：分块预填充与无停顿批处理
#
# Sarathi-Serve（OSDI'24）从一个观察出发：解码步是访存受限的，一个解码 Token 的线性层开销几乎与 128 个预填充 Token 相同
# （§3.1，Figure 4），所以在解码批里“捎带”一段预填充几乎不增加这一步的时间——只要这一段不太长。论文的要点：
#
# - **问题。** 以 vLLM 与 Orca 为代表的“预填充优先”（Prefill-prioritizing）调度，一有显存就立即调度新请求的预填充，
#   吞吐高，却会让正在解码的请求停顿；论文 Figure 1a 显示 vLLM 中的一次生成停顿可持续数秒，Figure 1b 显示负载升高时
#   vLLM 的尾延迟显著上升。“解码优先”的请求级批处理（FasterTransformer）没有停顿，但批越跑越小，吞吐低（§2.5、Figure 2、Figure 7）。
# - **分块预填充（§4.1）。** 提示被切成近似等大的块，每块仍大到足以让 GPU 算力饱和（Figure 4 中预填充吞吐在约 512 Token 时趋于饱和）。
# - **无停顿批处理（§4.2，Algorithm 3）。** 每一步先放入所有正在解码的请求，再放入部分完成的预填充，最后才接纳新请求；
#   预填充块的大小取 Token 预算剩下的部分。Figure 9 中，把整段预填充直接混进解码批（Orca 的做法）会让 TBT 比纯解码批高出
#   最多 28.3 倍，分块后则紧得多。（论文的 TBT，Time Between Tokens，即本课程的 ITL。）
# - **预算怎么定（§4.3）。** 预算小，每步短、TBT 低，但分块过细：GPU 利用率下降，且每块都要重读前面各块的 KV。
#   还要对齐 GEMM 的 Tile：论文观察到块大小 257 比 256 的预填充时间最多长 32%（Tile Quantization）。
#   论文用 Vidur 模拟器为每种部署选预算；评测中严格 SLO 用 512、宽松 SLO 用 2048（LLaMA2-70B 宽松时用 1536，以减少流水线气泡；§5.1）。§5.4.1（Figure 14）测得
#   块大小 512 时分块的额外开销至多约 25%，2048 时几乎可以忽略。
# - **效果。** 在 P99 TBT 的 SLO 下，服务容量相对 vLLM 提高：Mistral-7B（1×A100）2.6 倍，Yi-34B（2×A100）最多 3.7 倍（摘要、§5.1 Figure 10）；
#   严格 SLO（100 ms，Mistral-7B）下用预算 512 比 vLLM 高 3.5 倍，宽松 SLO（1 s，Yi-34B）下用 2048 高 1.65 倍（§5.2，Figure 12）。
#   消融（§5.4.2，表 4，Yi-34B，预算 1024）：只做混合批，openchat_sharegpt4 上 P99 TBT 为 0.68 s；只做分块，P50 TTFT 升到 1.04 s；
#   两者结合，TTFT 0.76 s、P99 TBT 0.14 s，两项都好。
#
# **minibatch 里的无停顿批处理。** `continuous` 策略把运行中的请求按进入批次的先后排在前面、等待的请求排在后面（第 5、9 章）；
# 调度器沿这个顺序分预算，放不下的预填充只拿剩下的预算（分块）。在先来先服务下，进行中的那一段预填充就是运行队列里最后进入的请求
# （它拿走了剩下的全部预算，同一步里不会再有别的请求进入），所以每一步的顺序就是 Algorithm 3 的顺序：解码、进行中的预填充、新请求。
# 11.1 节的两次运行里，没有一个正在解码的请求被跳过（单元格里的 `stalls` 为 0）。
#
# ## 11.3 分块大小的取舍：稳态下的 TTFT 与 ITL 尾部
#
# 下面换一个提示更长的负载：`load_workload("rag")`（检索增强生成：提示较长、输出较短）。在固定的到达率下，
# 逐个尝试不同的 Token 预算（即分块大小），外加不分块；每个配置用几个随机种子，只统计稳态。

# %%
RATE, N_REQ, SEEDS, TRIM, MAX_LEN = 3.5, 200, (1, 2, 3), 0.1, 4096   # TRIM: share dropped at each end
BUDGETS = [256, 512, 1024, 2048, 4096]
CONFIGS = {"off": OFF, **{b: dict(max_num_batched_tokens=b) for b in BUDGETS}}
KEYS = ("ttft_p50", "ttft_p99", "tpot_p99", "itl_p99")
rag_stats = load_workload("rag", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=SEEDS[0]).stats()
print(f"rag: prompt p50 {rag_stats['input_p50']:.0f} (max {rag_stats['input_max']:.0f}), output p50 "
      f"{rag_stats['output_p50']:.0f} tokens; {N_REQ} requests at {RATE:g} req/s, seeds {SEEDS}")

# %%
sweep = {}
for name, cfg in CONFIGS.items():
    ss = [run(load_workload("rag", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=s), **SIM, **cfg).summary(trim=TRIM)
          for s in SEEDS]
    sweep[name] = {k: (float(np.mean([s[k] for s in ss])), float(np.min([s[k] for s in ss])),
                       float(np.max([s[k] for s in ss]))) for k in KEYS}
md_table(["chunk (token budget)"] + [f"{k} (ms)" for k in KEYS],
         [[name] + [f"{1e3 * v[0]:.0f} [{1e3 * v[1]:.0f}–{1e3 * v[2]:.0f}]" for v in (row[k] for k in KEYS)]
          for name, row in sweep.items()])

# %%
fig, ax1 = plt.subplots(figsize=(8.5, 3.4), layout="constrained")
x = np.arange(len(BUDGETS))
for key, color, ax, label in (("ttft_p50", "C0", ax1, "TTFT p50"), ("ttft_p99", "C0", ax1, "TTFT p99")):
    m = np.array([sweep[b][key] for b in BUDGETS]) * 1e3
    ax.errorbar(x, m[:, 0], yerr=[m[:, 0] - m[:, 1], m[:, 2] - m[:, 0]], fmt="o-" if key.endswith("50") else "s--",
                color=color, capsize=3, label=label)
ax1.set_ylabel("TTFT (ms)", color="C0")
ax2 = ax1.twinx()
for key, fmt, label in (("itl_p99", "o-", "ITL p99"), ("tpot_p99", "s--", "TPOT p99")):
    m = np.array([sweep[b][key] for b in BUDGETS]) * 1e3
    ax2.errorbar(x, m[:, 0], yerr=[m[:, 0] - m[:, 1], m[:, 2] - m[:, 0]], fmt=fmt, color="C1", capsize=3, label=label)
ax2.axhline(sweep["off"]["itl_p99"][0] * 1e3, color="C1", ls=":", lw=1)
ax2.text(x[2], sweep["off"]["itl_p99"][0] * 1e3 * 1.03, "ITL p99 without chunking", color="C1", fontsize=7)
ax2.set_ylabel("ITL / TPOT (ms)", color="C1")
ax1.set_xticks(x, BUDGETS)
ax1.set_xlabel("chunk size = max_num_batched_tokens")
h1, l1 = ax1.get_legend_handles_labels()
h2, l2 = ax2.get_legend_handles_labels()
ax1.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(1.13, 1.0))
ax1.set_title(f"rag workload at {RATE:g} req/s, steady state, mean and range over {len(SEEDS)} seeds", fontsize=9)
ax1.grid(alpha=0.3)
plt.show()

# %%
itl = {b: sweep[b]["itl_p99"][0] for b in CONFIGS}
ttft = {b: sweep[b]["ttft_p50"][0] for b in CONFIGS}
B256, B512, B1024, B2048, B4096 = BUDGETS
SLOS = {"strict TPOT": {"ttft": 2.0, "tpot": 0.05}, "strict TTFT": {"ttft": 1.0, "tpot": 0.10}}
CAP_SEEDS, CAP_N, CAP_TARGET = (1, 2), 160, 0.9

# %% tags=["check"]
assert all(itl[a] < itl[b] for a, b in zip(BUDGETS, BUDGETS[1:])), "the prose says the ITL tail grows with the chunk"
assert ttft[B256] > ttft[B512] > ttft[B2048], "the prose says small chunks lengthen TTFT"
assert itl[B256] < itl["off"] / 5, "the prose says small chunks cut the ITL tail several-fold"
assert max(sweep[b]["tpot_p99"][0] for b in (B256, B512)) < sweep["off"]["tpot_p99"][0], \
    "exercise 3 says chunks of 256 and 512 have a lower TPOT p99 than no chunking"

# %% [markdown]
# （{{N_REQ}} 个请求、{{RATE:g}} req/s、{{len(SEEDS)}} 个种子，只统计到达时刻在中间 {{1 - 2 * TRIM:.0%}} 的请求；
# 这份样本的提示中位数 {{rag_stats["input_p50"]:.0f}} Token，输出中位数 {{rag_stats["output_p50"]:.0f}} Token。）两条曲线方向相反：
#
# - **ITL 尾部随分块变大而增长。** 分块 {{B256}} 时 ITL p99 为 {{itl[B256] * 1e3:.0f}} ms，{{B4096}} 时 {{itl[B4096] * 1e3:.0f}} ms，
#   不分块 {{itl["off"] * 1e3:.0f}} ms。每一步的时长大致正比于它带的预填充 Token 数，而 p99 正是那些带着大块预填充的步。
# - **TTFT 随分块变小而增长。** 分块 {{B2048}} 时 TTFT 中位数 {{ttft[B2048] * 1e3:.0f}} ms，{{B512}} 时 {{ttft[B512] * 1e3:.0f}} ms，
#   {{B256}} 时 {{ttft[B256] * 1e3:.0f}} ms：一个长提示要分更多步算完，而每一步都要先让所有解码请求各算一个 Token。
#
# 哪个分块最好，取决于 SLO 更在乎哪一头。下面用两组按请求计的 SLO 测服务容量（达成率 ≥ {{CAP_TARGET:.0%}} 的最高到达率，
# {{len(CAP_SEEDS)}} 个种子、每次 {{CAP_N}} 个请求，`minibatch.results.capacity`）：
# **严格 TPOT**（TTFT ≤ {{SLOS["strict TPOT"]["ttft"]:g}} s、TPOT ≤ {{SLOS["strict TPOT"]["tpot"] * 1e3:.0f}} ms，像聊天界面）与
# **严格 TTFT**（TTFT ≤ {{SLOS["strict TTFT"]["ttft"]:g}} s、TPOT ≤ {{SLOS["strict TTFT"]["tpot"] * 1e3:.0f}} ms，像要尽快出第一个字、之后读得慢的应用）。

# %% tags=["nbval-check-output"]
CAP_CONFIGS = {k: CONFIGS[k] for k in ("off", B256, B512, B1024, B2048)}


def cap_of(cfg, slo):
    def att(rate, seed):
        wl = load_workload("rag", n=CAP_N, rate=rate, max_len=MAX_LEN, seed=seed)
        return run(wl, **SIM, **cfg).summary(slo=slo, trim=TRIM)["slo_attainment"]
    return [capacity(lambda r: att(r, s), target=CAP_TARGET, lo=1.0, hi=8.0, tol=0.06) for s in CAP_SEEDS]


caps = {slo_name: {k: cap_of(cfg, slo) for k, cfg in CAP_CONFIGS.items()} for slo_name, slo in SLOS.items()}
for slo_name, row in caps.items():
    print(f"{slo_name:<12}", "  ".join(f"{k}: {np.mean(c):.2f} [{min(c):.2f}, {max(c):.2f}]" for k, c in row.items()))

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, (slo_name, row) in zip(axes, caps.items()):
    names = list(row)
    mean = np.array([np.mean(row[k]) for k in names])
    err = [mean - [min(row[k]) for k in names], [max(row[k]) for k in names] - mean]
    best_k = names[int(np.argmax(mean))]
    ax.bar(range(len(names)), mean, yerr=err, capsize=3, color=["C7" if k == "off" else "C2" if k == best_k else "C0"
                                                               for k in names])
    ax.set_xticks(range(len(names)), [str(k) for k in names])
    s = SLOS[slo_name]
    ax.set(title=f"{slo_name}: TTFT <= {s['ttft']:g} s, TPOT <= {s['tpot'] * 1e3:.0f} ms", xlabel="chunk size (off = no chunking)")
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel(f"capacity (req/s)\nat >= {CAP_TARGET:.0%} attainment")
fig.suptitle(f"rag workload on llama-2-7b / A100-80G (simulated): capacity vs chunk size, mean and range over "
             f"{len(CAP_SEEDS)} seeds", fontsize=9)
fig.tight_layout()
plt.show()

# %%
cm = {slo: {k: float(np.mean(c)) for k, c in row.items()} for slo, row in caps.items()}
best = {slo: max((k for k in row if k != "off"), key=row.get) for slo, row in cm.items()}
gain = cm["strict TPOT"][best["strict TPOT"]] / cm["strict TPOT"]["off"]

# %% tags=["check"]
assert best["strict TPOT"] < best["strict TTFT"], "the prose says the best chunk grows when the TPOT bound relaxes"
assert cm["strict TPOT"][best["strict TPOT"]] > 1.3 * cm["strict TPOT"]["off"], "chunking raises capacity there"

# %% [markdown]
# 严格 TPOT 时，分块 {{best["strict TPOT"]}} 的容量最高（{{cm["strict TPOT"][best["strict TPOT"]]:.2f}} req/s），
# 是不分块（{{cm["strict TPOT"]["off"]:.2f}} req/s）的 {{gain:.1f}} 倍；严格 TTFT 时，最优分块变大到 {{best["strict TTFT"]}}
# （{{cm["strict TTFT"][best["strict TTFT"]]:.2f}} req/s），而分块 {{B256}} 只有 {{cm["strict TTFT"][B256]:.2f}} req/s。
# 这与 Sarathi-Serve 评测中的选择方向一致：严格的 TBT SLO 用小预算，宽松时用大预算（§5.1）。
# 模拟器的代价模型含每步的固定开销，但不含 Tile 量化，也不含小形状下内核效率的下降（`minibatch.sim.cost_model` 模块文档的
# “Not modelled”），真实 GPU 上小分块的代价会更大一些；
# 第 19 章会在更大的参数空间里搜索最优配置。
#
# **动手**：用下面的控件改变 11.1 节实验的分块大小与长提示的长度，观察最长 ITL 与长提示 TTFT 的此消彼长。

# %% tags=["nbval-ignore-output"]
def explore(chunk=CHUNK, long_prompt=STALL["long_prompt"], num_decoders=STALL["num_decoders"]):
    res, m = stall_run(None if chunk == 0 else chunk, long_prompt=long_prompt, num_decoders=num_decoders)
    at = next(r.arrival_time for r in res.requests if r.request_id == "long")
    steps = [s for s in res.steps if at - 0.1 <= s.start_time <= at + 0.8]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ax.bar([s.start_time for s in steps], [s.duration * 1e3 for s in steps], width=[s.duration for s in steps],
           align="edge", color=["#f2a65a" if s.num_prefill_tokens else "#5a8fd6" for s in steps], edgecolor="white",
           linewidth=0.3)
    ax.axvline(at, color="C3", ls=":", lw=1)
    ax.set(xlabel="time (s)", ylabel="step duration (ms)",
           title=f"chunk {'off' if chunk == 0 else chunk}: long prompt TTFT {m['ttft_long'] * 1e3:.0f} ms, "
                 f"max ITL of the decoders {m['max_itl'] * 1e3:.0f} ms")
    ax.grid(alpha=0.3, axis="y")
    plt.show()


W.interact(explore,
           chunk=W.SelectionSlider(options=[0, 128, 256, 512, 1024, 2048, 4096], value=CHUNK, continuous_update=False,
                                   description="chunk (0=off)"),
           long_prompt=W.IntSlider(value=STALL["long_prompt"], min=500, max=4000, step=500, continuous_update=False),
           num_decoders=W.IntSlider(value=STALL["num_decoders"], min=1, max=128, continuous_update=False));

# %% [markdown]
# ## 11.4 在真实模型上：分块不改变输出
#
# 分块改变的是“哪一步算哪些 Token”，每个 Token 的 K/V 与注意力结果都不变，所以贪心解码的输出必须逐 Token 相同。
# 在嵌入的 tiny 模型（CPU）上验证：一组请求同时到达，提示长度不一；一次不分块（整段提示一步算完），
# 一次 Token 预算很小（长提示要切成很多块，与解码混在同一步里）。

# %%
TINY_N, TINY_BUDGET = 8, 32
tiny_wl = synthetic(TINY_N, float("inf"), input_len=lognormal(median=150, sigma=0.6, max=600), output_len=12, seed=4)
TINY = dict(model="tiny", max_num_seqs=TINY_N, num_kv_blocks=256, keep_tokens=True)
tiny = {"no chunking": run(tiny_wl, **TINY, enable_chunked_prefill=False, max_num_batched_tokens=1024),
        f"chunked, budget {TINY_BUDGET}": run(tiny_wl, **TINY, max_num_batched_tokens=TINY_BUDGET)}
outs = {k: [r.output_token_ids for r in res.requests] for k, res in tiny.items()}
assert outs["no chunking"] == outs[f"chunked, budget {TINY_BUDGET}"], "greedy outputs must not depend on chunking"
for k, res in tiny.items():
    print(f"{k:<20} {len(res.steps):>3} steps, at most {max(s.num_prefill_tokens + s.num_decode_tokens for s in res.steps):>4} "
          f"tokens a step, {sum(1 for s in res.steps if s.num_prefill_tokens and s.num_decode_tokens):>3} mixed steps")
print("prompt lengths:", tiny_wl.prompt_lens.tolist(), "| greedy outputs identical:", True)

# %% [markdown]
# {{TINY_N}} 个请求，第二次的 Token 预算只有 {{TINY_BUDGET}}。两次运行的每个请求生成了完全相同的
# {{len(outs["no chunking"][0])}} 个 Token（单元格断言了这一点；minibatch 的
# `tests/test_correctness.py` 还把它们与 Hugging Face `transformers` 单独生成的结果对照）。
# 墙钟时间随机器而变，下表只作直观参考（每次运行的读数不同）：通常分块后最长的一步明显变短，这正是 ITL 尾部下降的原因。

# %% tags=["nbval-ignore-output"]
md_table(["tiny on this CPU", "steps", "longest step (ms)", "median step (ms)", "E2E mean (ms)"],
         [[k, len(r.steps), f"{1e3 * max(s.duration for s in r.steps):.1f}",
           f"{1e3 * float(np.median([s.duration for s in r.steps])):.1f}", f"{1e3 * r.summary()['e2e_mean']:.0f}"]
          for k, r in tiny.items()])

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX1_PROMPTS, EX2_DECODERS, EX3_PROMPT, EX3_CHUNK = [2000, 4000], 128, 4096, 512
cost = make_cost_model("llama-2-7b", "a100-80g")
b1 = cost.breakdown([(EX1_PROMPTS[-1], EX1_PROMPTS[-1])], [])
ex1_att = b1["attention_prefill"] / sum(b1.values())
once = cost.step_time([(EX3_PROMPT, EX3_PROMPT)], [])
chunked = sum(cost.step_time([(EX3_CHUNK, c)], []) for c in range(EX3_CHUNK, EX3_PROMPT + 1, EX3_CHUNK))
ex3_extra = chunked / once - 1
assert ex1_att < 0.2 and ex3_extra > 0, "hints 1 and 3: attention is a small share; chunking costs extra"

# %% [markdown]
# ## 11.5 vLLM V1 中的分块预填充
#
# 以下均核对自 **vLLM v0.11.0** 的源码：
#
# - **默认打开。** `EngineArgs._set_default_args`（`vllm/engine/arg_utils.py`）对所有非 Pooling 模型（即生成模型）
#   直接设 `self.enable_chunked_prefill = True`，注释写明 “V1 always uses chunked prefills”；只有 Pooling 模型按池化方式决定。
#   因此 V1 的 `--max-num-batched-tokens` 就是分块大小，10.3 节的默认值表同时也是默认分块大小的表
#   （例如 A100 上 `vllm serve` 为 2048，H100 上为 8192）。
# - **分块发生在哪里。** `Scheduler.schedule`（`vllm/v1/core/sched/scheduler.py`）先遍历 `running`、再遍历 `waiting`，
#   两处都是 `num_new_tokens = min(num_new_tokens, token_budget)`：运行中的请求（解码与进行中的预填充）先拿预算，新请求后拿，
#   与 Sarathi-Serve 的顺序一致。若关闭分块，等待中放不下的请求被跳过（`if not self.scheduler_config.chunked_prefill_enabled and num_new_tokens > token_budget`）。
# - **单个请求的上限。** `SchedulerConfig.long_prefill_token_threshold`（`vllm/config/scheduler.py`，默认 0 即不限）
#   若大于 0，调度器在两处循环里都先把一个请求本步的 Token 数截到它，从而让一步里能容纳多个较短的预填充块。
#   `max_num_partial_prefills` 的说明是“可以同时部分预填充的序列数”，但 v0.11.0 的 V1 引擎不支持把它设成 1 以外的值
#   （`EngineArgs._is_v1_supported_oracle` 中的 “Concurrent Partial Prefill” 检查）。
#
# minibatch 没有 `long_prefill_token_threshold`：一步里的预填充块只受 Token 预算与 `max_num_seqs` 限制，这与 v0.11.0 的默认行为相同。
#
# ## 本章小结
#
# - 不分块时，长提示的预填充让同一步里所有解码请求等它算完：模拟的 7B/A100 上，一个 {{STALL["long_prompt"]}} Token 的提示让
#   {{STALL["num_decoders"]}} 个解码请求的 ITL 从 {{off["median_itl"] * 1e3:.0f}} ms 跳到 {{off["max_itl"] * 1e3:.0f}} ms（生成停顿）。
#   分块（预算 {{CHUNK}}）把它切成多步，最长 ITL 降到 {{on["max_itl"] * 1e3:.0f}} ms，代价是长提示自己的 TTFT 变长。
# - Sarathi-Serve（OSDI'24）的无停顿批处理：解码优先、再续进行中的预填充、最后接纳新请求，每步不超过 Token 预算；
#   预算由 TBT SLO 与分块开销共同决定（§4.3），评测中严格 SLO 用 512、宽松用 2048，容量相对 vLLM 提高 2.6–3.7 倍。
#   minibatch 的 `continuous` 策略加分块预填充就是这个顺序。
# - 稳态测量显示，分块越小 ITL 尾部越低、TTFT 越高；最优分块随 SLO 移动：严格的 TPOT 要小分块，严格的 TTFT 要大分块。
# - 分块不改变贪心解码的输出（tiny 模型上逐 Token 相同）。vLLM V1（v0.11.0）对生成模型总是打开分块预填充，
#   `max_num_batched_tokens` 即分块大小。
#
# 下一章（第 12 章）讨论 KV 不够时的另一种“停顿”：抢占与重算。
#
# ## 练习
#
# 1. **停顿有多长。** 用 11.3 节控件把长提示设为 {{'、'.join(map(str, EX1_PROMPTS))}} Token，分块关闭（0）。最长 ITL 与提示长度大致成什么关系？
#    用第 2 章的屋顶线模型估计一个 $n$ Token 预填充的耗时，与控件的读数比较。
# 2. **解码越多，停顿越贵。** 把 `num_decoders` 从 1 调到 {{EX2_DECODERS}}（分块关闭）。最长 ITL 变化不大，受停顿影响的 Token 数却成倍增加。
#    为什么？在 Goodput 里这意味着什么？再看 {{EX2_DECODERS}} 个解码时长提示的 TTFT，发生了什么？
# 3. **分块的额外开销。** 在 11.3 节的表中，分块 {{B256}} 与 {{B512}} 的 TPOT p99 比不分块还低，但 TTFT 更高。
#    用 `minibatch.sim.make_cost_model("llama-2-7b", "a100-80g").step_time([(n, c)], [])` 比较一段 {{EX3_PROMPT}} Token 的提示一次算完与分成
#    {{EX3_PROMPT // EX3_CHUNK}} 块（每块 {{EX3_CHUNK}}，上下文 `c` 依次增长）的总耗时，额外开销是多少？它来自哪一项（`breakdown`）？
# 4. **Tile 量化。** Sarathi-Serve 观察到块大小 257 比 256 慢至多 32%。minibatch 的代价模型会显示这种差别吗？
#    如果要在模拟器里体现它，应该改哪一个函数？
# 5. **动手实现。** 完成实验 L06：写出“解码优先、再切块”的预算分配，在随机状态上与 `Scheduler` 逐一对比，
#    插进引擎验证输出不变，最后为一个给定的负载与 SLO 选出 Goodput 最高的 `max_num_batched_tokens` 与 `max_num_seqs`。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 大致线性：预填充是算力受限的，时间 ≈ $2 P n / F_\text{eff}$（$P$ 为参数量，$F_\text{eff}$ 为有效算力），注意力的二次项占比不大
#    （{{EX1_PROMPTS[-1]}} Token 时只占这一步的 {{ex1_att:.0%}}）。
#    `make_cost_model(...).step_time([(n, n)], [])` 可以直接给出模型的估计。
# 2. 停顿步的时长主要由预填充决定，与批里有多少解码关系不大；但每个解码请求都被拖住一次，受影响的 Token 数等于解码请求数。
#    若 SLO 约束的是每个请求的 TPOT 或 ITL，一次停顿可能让整批请求同时违约，Goodput 随之下降。
#    {{EX2_DECODERS}} 个解码时长提示的 TTFT 会暴涨：不分块时，它必须与所有解码挤进同一个预算（{{OFF["max_num_batched_tokens"]}}），解码占掉一部分之后整段提示就放不下了，
#    它只能等到解码请求陆续结束——这是不分块的另一种代价（队头阻塞，Head-of-line Blocking）。
# 3. 分块后每一块都要读前面所有块的 KV（注意力的访存项），还要多付几次每步的固定开销（`overhead`）；用 `breakdown` 分项相加即可看出。
#    这个代价模型里，分块的总耗时比一次算完多 {{ex3_extra:.0%}}。
# 4. 不会：代价模型按 FLOP 与字节数计时，与形状是否对齐无关。要体现它，需要在 `RooflineCostModel._gemm` 里把行数向上取整到 Tile 的倍数。
# 5. 见 `labs/L06_chunked_prefill.ipynb`。
#
# </details>
