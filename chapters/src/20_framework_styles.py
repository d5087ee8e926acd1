# %% [markdown]
# # 第 20 章 框架横评：同一负载下的四种风格
#
# 第 10–16 章把 vLLM、SGLang、TensorRT-LLM、TGI 的调度器一个个拆开看过。本章把它们放到**同一台机器、同一个负载**上比较。
# 发表的框架对比通常比较的是整套系统：SGLang 的论文（Zheng et al., *SGLang: Efficient Execution of Structured Language Model
# Programs*, NeurIPS'24, arXiv:2312.07104）报告比当时最好的推理系统吞吐最高提高 6.4 倍，其中有 RadixAttention 的前缀复用、
# 压缩有限状态机的结构化解码，也有内核与运行时的差别——调度策略只是其中一部分，而且这些数字不能搬到别的负载上。
# 本章反过来，只比较**调度风格**：同一个引擎、同一个代价模型（模拟的 Llama-2-13B / A100-80G），每个框架只贡献它的默认调度旋钮——
# minibatch 的**框架预设**（Framework Preset，`LLM(..., preset="tgi")`、`EngineConfig.from_kwargs(preset=...)`、
# `python -m minibatch.presets`）。内核快慢、CUDA Graph、推测解码、分离式部署等都不在比较之内。
#
# 问题是：同样的负载下，四种风格的吞吐、TTFT、TPOT、抢占与服务容量（Capacity）差多少？差别来自哪个旋钮？
#
# ## 学习目标
#
# - 说出四个框架默认设置的调度旋钮（准入、分块、Token 预算、序列上限、路由器参数），每一项的版本与源文件；
# - 在模拟的 Llama-2-13B / A100-80G 上，用聊天（chat）与长提示词的 RAG 两个负载、稳态、3 个种子的中位数，比较吞吐、TTFT 与 TPOT 的
#   p50/p99、抢占次数、SLO 达成率（SLO Attainment）与服务容量，并画在同一张图上；
# - 把每一处差别追溯到旋钮：乐观准入、按估计预留、按最坏情况预留，以及 TGI 路由器自己的预留；
# - 在同一个引擎里一次只改一个旋钮，找出四个预设的差别各来自哪个旋钮；把旋钮拉平后四者完全相同（这只说明预设，不说明真实框架）；
# - 在真实的 tiny 模型上验证：四种预设下贪心输出逐 Token 相同。

# %%
import inspect
import math

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import LLM, EngineConfig, SamplingParams, presets, tune
from minibatch.config import PRESET_NAMES
from minibatch.presets import tgi as tgi_launcher
from minibatch.results import capacity
from minibatch.sim import get_model_spec, make_cost_model
from minibatch.viz import md_table
from minibatch.workload import load_workload

SIM = {"executor": "sim", "model": "llama-2-13b", "hardware": "a100-80g"}     # the one server of this chapter
COLORS = {"vllm": "C0", "sglang": "C2", "trtllm": "C3", "tgi": "C1"}
N_SECONDS, SEEDS = 60, [1, 2, 3]                    # seconds of arrivals per run, workload seeds
# Each framework as its OpenAI server: `vllm serve` takes a smaller token budget than vLLM's LLM class.
CONFIG = {p: {"preset": p, **presets.serve_settings(p)} for p in PRESET_NAMES}


def n_req(rate):
    """Requests of one run: N_SECONDS of arrivals at ``rate``."""
    return int(round(N_SECONDS * rate))

SLO, TARGET = {"ttft": 2.0, "tpot": 0.15}, 0.9       # per request, seconds; attainment target of the capacity
POOL_TOKENS = make_cost_model(SIM["model"], SIM["hardware"]).kv_capacity_tokens()
print("minibatch", minibatch.__version__, "| presets:", PRESET_NAMES)

# %% [markdown]
# ## 20.1 四个预设：每个框架默认设了什么
#
# 每个预设只是一组 `EngineConfig` 字段（`minibatch/presets/__init__.py`）。下表是四个预设设置的值；“—”表示该框架没有这个旋钮
# 或由显存推算，minibatch 用自己的默认值（括号里）：

# %%
knobs = list(dict.fromkeys(k.name for p in PRESET_NAMES for k in presets.get(p).knobs))
default = EngineConfig()
md_table(["knob", *[f"{presets.get(p).framework} {presets.get(p).version}" for p in PRESET_NAMES]],
         [[k, *[repr(presets.settings(p)[k]) if k in presets.settings(p) else f"— ({getattr(default, k)!r})"
                for p in PRESET_NAMES]] for k in knobs])

# %% [markdown]
# 每个值都有出处。下表就是 `python -m minibatch.presets` 打印的内容（`presets.rows(name)`）：

# %%
md_table(["preset", "knob", "value", "source (file and name in the framework's repository)"],
         [[p if i == 0 else "", k, repr(v), s] for p in PRESET_NAMES for i, (k, v, s) in enumerate(presets.rows(p))])

# %% [markdown]
# 这些出处是编写本章时在各框架仓库的源码里逐一核对过的，并据此修正了预设里几处出处的写法（vLLM 的函数名与块大小的出处、
# SGLang 按显存分档的说明、TGI 预填充预算的来历；`tests/test_presets.py` 的 `test_sources_name_what_the_cited_version_has` 固定了它们）：
#
# - **vLLM v0.11.0**：`max_num_seqs` 与 `max_num_batched_tokens` 的默认值由 `vllm/engine/arg_utils.py` 的
#   `EngineArgs._set_default_args` 按使用场景与 GPU 决定（第 10 章的表）：`LLM` 类在 A100（设备名含 `a100`，无论显存多大）上是
#   256 与 8192，`vllm serve` 是 256 与 2048（`UsageContext.OPENAI_API_SERVER`；预设把它记在 `presets.serve_settings("vllm")`，
#   本章比较的是**服务器**，所以 vLLM 用 {{CONFIG["vllm"]["max_num_batched_tokens"]}} 的预算）；同一函数对生成模型打开分块预填充与前缀缓存。块大小 16 由
#   `vllm/platforms/cuda.py` 的 `check_and_update_config` 在 `CacheConfig.block_size` 为 `None` 时设置。较新的 vLLM 把查表拆进了
#   `get_batch_defaults`，v0.11.0 里还没有这个名字。
# - **SGLang v0.5.3**：`python/sglang/srt/server_args.py` 的 `schedule_policy = "fcfs"`、`schedule_conservativeness = 1.0`、
#   `disable_radix_cache = False`、`max_prefill_tokens = 16384`、`enable_mixed_chunk = False`；`chunked_prefill_size` 默认 `None`，按 GPU 显存推算：
#   60–160 GiB（A100-80GB、H100、H200）为 8192，35 GiB 以下为 2048，35–60 GiB 依版本为 8192 或 4096。
#   `max_running_requests` 未给时由 KV 池推算：`min(max_total_num_tokens // 2, req_to_token_pool.size)`
#   （运行时计算，依版本在 `managers/scheduler.py` 或 `model_executor/model_runner.py`）。
#   一步怎么组成：`managers/scheduler.py` 的 `Scheduler.get_next_batch_to_run` 先调 `get_new_batch_prefill`，找得到可以接纳的预填充
#   （含正在分块的那个请求的下一块）就**只跑预填充**（注释 “Run prefill first if possible”），找不到才跑解码；只有打开
#   `--enable-mixed-chunk` 才把运行中请求的解码并进预填充的一步（`mix_with_running`）。所以 SGLang 的默认步要么全是预填充、要么全是解码，
#   这是 minibatch 的 `sglang` 策略（`minibatch/policies/sglang.py`，第 13 章讲过 SGLang 的准入）。
# - **TensorRT-LLM 1.x**：`tensorrt_llm/llmapi/llm_args.py` 的 `SchedulerConfig.capacity_scheduler_policy = GUARANTEED_NO_EVICT`、
#   `BaseLlmArgs.max_batch_size = 2048`、`max_num_tokens = 8192`、`enable_chunked_prefill = False`、
#   `KvCacheConfig.enable_block_reuse = True`、`KvCacheConfig.tokens_per_block = 32`（PyTorch 后端的上下文分块也以它为单位）。
# - **TGI v3.3.7**：`launcher/src/main.rs` 的 `max_concurrent_requests = 128`、`max_waiting_tokens = 20`、`waiting_served_ratio = 0.3`；
#   `max_batch_prefill_tokens` 未给时取“GPU 的 FP16 峰值算力 ÷ 模型每 Token 的 FLOP”（`compute_optimal`），GPU 未知时取 4096，
#   再截到 `max_position_embeddings` 与显存允许的值；`PREFILL_CHUNKING` 默认为 1
#   （`server/text_generation_server/models/globals.py`），此时 `backends/v3/src/backend.rs` 忽略 `max_waiting_tokens` 与
#   `waiting_served_ratio`；`backends/v3/src/queue.rs` 的 `next_batch` 为每个请求预留 `input + max_new_tokens − 1`（加投机解码的 Token 数）个 Token 的块，TGI 从不抢占。
#   TGI 自 2025-12 起处于维护模式（Maintenance Mode）：README 开头的 CAUTION 写道 “text-generation-inference is now in
#   maintenance mode”（commit `55f7f7cb`，PR #3344，2025-12-11），只接受小修复与文档改进，并推荐改用 vLLM、SGLang；
#   本章仍把它作为“路由器按 Token 预算组批、按最坏情况预留”这一风格的代表（第 16 章）。
#
# TGI 的预填充预算是按公式算出来的（第 16 章 16.1 节）。`Config::flop` 每层数 Q、注意力、O 三个 $2Hd\,h_\text{model}$ 项与
# K、V 两个 $2H_{kv}d\,h_\text{model}$ 项，加上 MLP 的 $2 \cdot 3 \cdot h_\text{model} \cdot i$，乘以层数；`minibatch.presets.tgi` 照这段代码实现：

# %%
print(inspect.getsource(tgi_launcher.flop_per_token))
A100_F16 = tgi_launcher.F16_FLOPS["a100"]                 # launcher/src/main.rs ComputeType::f16_flop
tgi_budget = {name: (tgi_launcher.flop_per_token(name), tgi_launcher.default_max_batch_prefill_tokens(name, "a100"))
              for name in ("llama-2-13b", "llama-3-8b")}
for name, (flop, budget) in tgi_budget.items():
    print(f"{name}: {flop / 1e9:.1f} GFLOP/token -> A100 compute-optimal {A100_F16 // flop:,.0f} tokens, "
          f"context {get_model_spec(name).max_model_len} -> max_batch_prefill_tokens {budget}")
assert tgi_budget["llama-2-13b"][1] == presets.settings("tgi")["max_num_batched_tokens"] == \
    get_model_spec("llama-2-13b").max_model_len < A100_F16 // tgi_budget["llama-2-13b"][0], "capped by the context"
assert tgi_budget["llama-3-8b"][1] == 8192, "the prose says an 8k-context model gets a larger TGI default"

# %% [markdown]
# 对本章的 Llama-2-13B，A100 上的“最优”是 {{A100_F16 // tgi_budget["llama-2-13b"][0]:,.0f}} 个 Token，被 {{get_model_spec("llama-2-13b").max_model_len:,}} 的上下文截断，所以预设的 {{presets.settings("tgi")["max_num_batched_tokens"]}} 成立；
# 换成 8k 上下文的 Llama-3-8B，TGI 的默认值会是 {{tgi_budget["llama-3-8b"][1]}}。预设是**参考配置**（Llama-2、A100-80GB）下的默认值，
# 换模型或 GPU 时要回到源码重新核对（练习 4）。
#
# 四个预设的差别归结为三类旋钮：
#
# | | 准入：接纳新请求时为将来预留多少 KV | 分块与预算 | 其他 |
# |---|---|---|---|
# | vLLM | 乐观：这一步放得下就接纳，KV 不够再抢占（`max_utilization`） | 分块，2048（`vllm serve`；`LLM` 类 8192） | `max_num_seqs` 256；预填充与解码混在一步 |
# | SGLang | 按估计预留：运行中请求 $r \cdot \min(m - g, 4096)$，$r$ 从 0.7 衰减（`conservative`，第 12 章） | 分块，8192 | **先预填充**：有预填充的一步不解码（`sglang` 策略） |
# | TensorRT-LLM | 按最坏情况预留：每个请求到结束所需的块（`guaranteed_no_evict`） | **不分块**，8192 | 先解码后上下文（`trtllm` 策略）；块大小 **32**（`tokens_per_block`，其余三者 16） |
# | TGI | 按最坏情况预留（路由器 `next_batch` 的 `input + max_new_tokens`，写在 `tgi` 策略里） | 分块，**4096** | 并发上限 128（背压） |
#
# 用第 12 章的记号（块大小 $B$，请求 $j$ 的提示词 $p_j$、`max_tokens` $m_j$、已生成 $g_j$），三种准入的条件是
#
# $$
# \underbrace{\Big\lceil\tfrac{p_j}{B}\Big\rceil \le N_\text{free}}_{\text{乐观}},\qquad
# \underbrace{\Big\lceil\tfrac{p_j + r\,\min(m_j,4096)}{B}\Big\rceil + \sum_{i} \Big\lceil\tfrac{r\,\min(m_i - g_i,4096)}{B}\Big\rceil \le N_\text{free}}_{\text{按估计（minibatch 对新请求也乘 } r\text{）}},\qquad
# \underbrace{\Big\lceil\tfrac{p_j + m_j}{B}\Big\rceil + \sum_{i} \Big(\Big\lceil\tfrac{p_i + m_i}{B}\Big\rceil - \text{held}_i\Big) \le N_\text{free}}_{\text{最坏情况}} .
# $$
#
# 预留得越多，同时运行的请求越少；由 Little 定律 $L = \lambda W$，到达率不变时在系统里的请求数不变，运行的少了，等待的就多了——
# TTFT 变长；换来的是从不抢占、批更小因而 TPOT 更低。注意：模拟的负载里 `max_tokens` 就是真实的输出长度（`ignore_eos=True`），
# 最坏情况预留恰好等于真实需要，这是它**最有利**的情形；真实客户端常把 `max_tokens` 设得远大于实际输出，预留会多出
# $\lceil (m_j - o_j)/B \rceil$ 个块（练习 5）。
#
# ## 20.2 实验设置
#
# 服务器：模拟的 Llama-2-13B / A100-80G（KV 池约 {{POOL_TOKENS:,}} 个 Token）。
# 两个负载（`minibatch/workload/named.py`）：**chat**（按 Azure 2023 对话数据拟合，提示词中位数约 1,020、输出中位数约 129 Token，
# 输出长、KV 随解码持续增长）与 **rag**（提示词 1k–4k、中位数 2,048，输出中位数 64，预填充为主）。每次运行 {{N_SECONDS}} s 的到达（请求数 = 到达率 × {{N_SECONDS}}），{{len(SEEDS)}} 个种子，
# 每个到达率各跑一次；指标只统计稳态（到达时间落在中间 80% 的请求，`trim=0.1`），报告 {{len(SEEDS)}} 个种子的**中位数**。
# SLO 对每个请求判断：TTFT ≤ {{SLO["ttft"]:g}} s 且 TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms。服务容量是达成率 ≥ {{TARGET:.0%}} 的最高到达率，
# 每个种子用二分法（`tune.capacities`，每次探测 {{N_SECONDS}} s 的到达，相对精度 5%）各求一次，报告中位数与最小–最大值。
# 所有运行经 `tune.summaries` / `tune.capacities` 在 2 个进程里并行。

# %%
RATES = {"chat": [2.0, 2.5, 3.0, 3.5, 4.0], "rag": [1.5, 2.0, 2.5, 3.0]}
AT = {"chat": 3.0, "rag": 2.0}                         # the rate of the comparison table: near capacity
BRACKET = {"chat": (1.5, 5.0), "rag": (1.0, 4.0)}     # where the bisection looks for each workload's capacity
keys = [(w, r, p, s) for w in RATES for r in RATES[w] for p in PRESET_NAMES for s in SEEDS]
out = tune.summaries([(load_workload(w, n=n_req(r), rate=r, seed=s), {**SIM, **CONFIG[p]}) for w, r, p, s in keys],
                     slo=SLO, trim=0.1, processes=2)
res = dict(zip(keys, out))


def med(w, r, p, key):
    """Median over the seeds of one summary field."""
    return float(np.median([res[w, r, p, s][key] for s in SEEDS]))


rejected = {reason for s in out for reason in s["rejected_reasons"]}
print(f"{len(out)} simulated runs; rejections in any run: {sorted(rejected)}")
assert rejected <= {"prompt longer than max_model_len"}, "the prose says only over-long prompts are rejected"

# %%
cap, cap_runs = {}, 0
for w, (lo, hi) in BRACKET.items():
    wls = {s: load_workload(w, n=math.ceil(hi * N_SECONDS) + 1, rate=hi, seed=s) for s in SEEDS}
    found = tune.capacities(wls, [CONFIG[p] for p in PRESET_NAMES], slo=SLO, target=TARGET, lo=lo, hi=hi, tol=0.05,
                            duration_s=N_SECONDS, processes=2, **SIM)
    for p, f in zip(PRESET_NAMES, found):
        cap[w, p] = f.estimate
        cap_runs += f.runs
print(f"capacity by bisection: {cap_runs} more runs;",
      {f"{w}/{p}": f"{c:.2f}" for (w, p), c in cap.items()})

# %% [markdown]
# 共 {{len(out) + cap_runs}} 次模拟。少数请求的提示词超过 Llama-2 的 4,096 Token 上下文，四种预设都拒绝它们（vLLM 也会返回错误），
# 计为未满足 SLO；TGI 的 128 并发上限在这些运行里从未触发。
#
# ## 20.3 同一张图上的四种风格
#
# 每一行是一个负载，三列分别是 p99 TTFT、p99 TPOT 与 SLO 达成率随到达率的变化（3 个种子的中位数）：

# %%
fig, axes = plt.subplots(2, 3, figsize=(12, 6))
for row, w in zip(axes, RATES):
    for p in PRESET_NAMES:
        kw = dict(color=COLORS[p], label=p, marker="o", ms=3, lw=1.5 if p in ("vllm", "trtllm") else 1,
                  ls="-" if p in ("vllm", "trtllm") else "--")
        row[0].plot(RATES[w], [med(w, r, p, "ttft_p99") for r in RATES[w]], **kw)
        row[1].plot(RATES[w], [med(w, r, p, "tpot_p99") * 1e3 for r in RATES[w]], **kw)
        row[2].plot(RATES[w], [med(w, r, p, "slo_attainment") * 100 for r in RATES[w]], **kw)
    row[0].axhline(SLO["ttft"], color="k", ls=":", lw=1)
    row[1].axhline(SLO["tpot"] * 1e3, color="k", ls=":", lw=1)
    row[2].axhline(TARGET * 100, color="k", ls=":", lw=1)
    row[0].set(ylabel=f"{w}\np99 TTFT (s)", yscale="log")
    row[1].set(ylabel="p99 TPOT (ms)")
    row[2].set(ylabel="SLO attainment (%)")
    for ax in row:
        ax.grid(alpha=0.3, which="both")
for ax in axes[1]:
    ax.set_xlabel("request rate (req/s)")
axes[0][2].legend(fontsize=8)
fig.suptitle("llama-2-13b on A100-80G, four framework presets (median of 3 seeds, steady state); dotted: the SLO",
             fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 20.4 对比表
#
# 在两个负载各取一个容量附近的到达率（chat {{AT["chat"]}} req/s，rag {{AT["rag"]}} req/s），列出全部指标
# （3 个种子的中位数；抢占是 3 个种子的合计；容量是每个种子二分所得的中位数与最小–最大值）：

# %% tags=["nbval-check-output"]
COLS = [("throughput_tok_s", "out tok/s", 1, ".0f"), ("ttft_p50", "TTFT p50 (s)", 1, ".2f"),
        ("ttft_p99", "TTFT p99 (s)", 1, ".2f"), ("tpot_p50", "TPOT p50 (ms)", 1e3, ".0f"),
        ("tpot_p99", "TPOT p99 (ms)", 1e3, ".0f"), ("slo_attainment", "SLO met", 100, ".0f")]
rows = []
for w in RATES:
    for p in PRESET_NAMES:
        pre = sum(res[w, AT[w], p, s]["num_preemptions"] for s in SEEDS)
        rows.append([f"{w} @ {AT[w]:g}", p, *[format(med(w, AT[w], p, k) * sc, f) + ("%" if k == "slo_attainment" else "")
                                             for k, _, sc, f in COLS], str(pre), f"{cap[w, p]:.2f}"])
md_table(["workload @ req/s", "preset", *[c[1] for c in COLS], "preemptions", "capacity (req/s)"], rows)

# %% [markdown]
# ## 20.5 为什么不同：追溯到旋钮
#
# **chat：准入把四者分成两组，但只在尾部。** 先看同时运行的请求数、KV 占用与排队（chat {{AT["chat"]}} req/s，中位数）：

# %%
w, r = "chat", AT["chat"]
print({p: f"{med(w, r, p, 'mean_batch_size'):.1f} running, KV {med(w, r, p, 'kv_util_mean'):.0%}, "
          f"queue delay p99 {med(w, r, p, 'queue_delay_p99'):.2f} s" for p in PRESET_NAMES})
chat = {p: {k: med(w, r, p, k) for k in ("ttft_p99", "tpot_p99", "slo_attainment", "mean_batch_size",
                                           "throughput_tok_s", "queue_delay_p99")} for p in PRESET_NAMES}
pre = {p: sum(res[w, r, p, s]["num_preemptions"] for s in SEEDS) for p in PRESET_NAMES}
optimistic, reserving = ("vllm", "sglang"), ("trtllm", "tgi")
ttft_ratio = min(chat[p]["ttft_p99"] for p in reserving) / max(chat[p]["ttft_p99"] for p in optimistic)
cap_verdict = {(a, b): tune.verdict(cap["chat", a], cap["chat", b]) for a in optimistic for b in reserving}
print(f"reserving / optimistic TTFT p99 >= {ttft_ratio:.1f}x; capacity, optimistic vs reserving over the seeds: "
      f"{sorted(set(cap_verdict.values()))}")

# %% tags=["check"]
assert ttft_ratio > 1.5, "the prose: the reserving pair's TTFT tail is well above the optimistic pair's"
assert max(chat[p]["tpot_p99"] for p in reserving) < min(chat[p]["tpot_p99"] for p in optimistic)
assert min(chat[p]["queue_delay_p99"] for p in reserving) > 2 * max(chat[p]["queue_delay_p99"] for p in optimistic)
assert pre["vllm"] > 0 and pre["sglang"] == pre["trtllm"] == pre["tgi"] == 0
assert max(abs(chat[p]["throughput_tok_s"] / chat["vllm"]["throughput_tok_s"] - 1) for p in PRESET_NAMES) < 0.05
assert set(cap_verdict.values()) == {"overlap"}, "the prose: the seeds do not separate the capacities"
assert min(cap["chat", p].median for p in optimistic) >= max(cap["chat", p].median for p in reserving)

# %% [markdown]
# - **预留的一组（TensorRT-LLM、TGI）**：每个请求一进来就占下到结束所需的块，KV 满得早，新请求在队列里等：排队延迟的 p99 是
#   {{chat["trtllm"]["queue_delay_p99"]:.1f}} s，乐观的一组只有 {{chat["vllm"]["queue_delay_p99"]:.1f}} s；p99 TTFT 至少高
#   {{ttft_ratio:.1f}} 倍（{{chat["trtllm"]["ttft_p99"]:.2f}} 对 {{chat["vllm"]["ttft_p99"]:.2f}} s），达成率 {{chat["trtllm"]["slo_attainment"]:.0%}}
#   对 {{chat["vllm"]["slo_attainment"]:.0%}}。换来的是零抢占和更低的 p99 TPOT（{{chat["trtllm"]["tpot_p99"] * 1e3:.0f}} 对
#   {{chat["vllm"]["tpot_p99"] * 1e3:.0f}} ms）。这是容量附近的“曲棍球棒”（第 3 章）：利用率 $\rho$ 接近 1 时等待按 $\rho/(1-\rho)$ 放大，
#   服务能力少一点，队列的尾部就长很多。
# - **乐观的一组（vLLM、SGLang）**：vLLM 在 KV 紧的瞬间抢占（3 个种子共 {{pre["vllm"]}} 次），SGLang 的按估计预留一次也没有抢占；
#   SGLang 的“先预填充”让有预填充的步不带解码，p99 TPOT 仍是 {{chat["sglang"]["tpot_p99"] * 1e3:.0f}} ms（vLLM {{chat["vllm"]["tpot_p99"] * 1e3:.0f}} ms）：
#   这个负载的提示词多数一步就能算完，解码被打断的次数不多。
# - **吞吐与容量分不开两组。** 四者的吞吐相差不到 5%：差别不在“做了多少”，而在“先做谁”。按种子二分的容量，乐观一组的中位数
#   （{{cap["chat", "vllm"]:.2f}} req/s）不低于预留一组（{{cap["chat", "trtllm"]:.2f}} req/s），但三个种子的区间重叠：
#   在 {{N_SECONDS}} s 的稳态运行里，**不能**说哪一组的容量更高：两组的差别在 TTFT 的尾部，不在容量。
#
# **rag：四者相差不大。**

# %%
w, r = "rag", AT["rag"]
rag = {p: {k: med(w, r, p, k) for k in ("ttft_p99", "tpot_p99", "slo_attainment", "throughput_tok_s")} for p in PRESET_NAMES}
spread = {k: max(rag[p][k] for p in PRESET_NAMES) / min(rag[p][k] for p in PRESET_NAMES) - 1
          for k in ("ttft_p99", "tpot_p99", "throughput_tok_s")}
print("rag @", r, "req/s, largest relative difference between presets:", {k: f"{v:.0%}" for k, v in spread.items()},
      "| capacity:", {p: f"{cap['rag', p]:.2f}" for p in PRESET_NAMES})
assert max(spread.values()) < 0.25 and len({cap["rag", p].median for p in PRESET_NAMES}) == 1, "the prose: rag looks alike"

# %% [markdown]
# RAG 的提示词长、输出短：每个请求的工作主要是预填充，GPU 算力是瓶颈；输出短意味着“到结束所需的块”比当下占用的多不了多少，
# 预留与乐观准入几乎做出同样的决定。四种预设的 p99 TTFT、p99 TPOT 与吞吐最多相差 {{max(spread.values()):.0%}}，容量的中位数都是
# {{cap["rag", "vllm"].median:.2f}} req/s。**哪个框架“更快”取决于负载**：两组只在解码为主、KV 会紧的负载上、只在尾部分得开。
#
# ## 20.6 在一个引擎里：差别来自哪个旋钮
#
# 这一节能说明的只是 **minibatch 的四个预设**为什么不同：它们跑在同一个引擎、同一个代价模型上，除了旋钮什么都一样。
# 真实的框架之间还有内核、CUDA Graph、调度与分词的开销、前缀缓存的实现等差别，这里一概不涉及，所以下面的结论不能当作
# “SGLang 就是 vLLM 加某个开关”来读。做法：在 chat {{AT["chat"]}} req/s、{{len(SEEDS)}} 个种子上，从 vLLM（`vllm serve` 的设置）出发，
# 一次只加一个别人的旋钮（显式给出的选项总是覆盖预设）：

# %%
V = CONFIG["vllm"]                                   # vllm serve: the preset with a 2048-token budget
VARIANTS = {
    "vllm + max_num_batched_tokens=8192": {**V, "max_num_batched_tokens": 8192},
    "vllm + admission=conservative": {**V, "admission": "conservative"},
    "vllm + policy=sglang": {**V, "policy": "sglang"},
    "vllm + admission=conservative, policy=sglang, max_num_batched_tokens=8192": {
        **V, "admission": "conservative", "policy": "sglang", "max_num_batched_tokens": 8192},
    "vllm + admission=guaranteed_no_evict": {**V, "admission": "guaranteed_no_evict"},
    "vllm + policy=tgi (TGI's router)": {**V, "policy": "tgi"},
    "trtllm + admission=max_utilization": {**CONFIG["trtllm"], "admission": "max_utilization"},
}
vkeys = [(name, s) for name in VARIANTS for s in SEEDS]
vout = tune.summaries([(load_workload("chat", n=n_req(AT["chat"]), rate=AT["chat"], seed=s), {**SIM, **VARIANTS[name]})
                       for name, s in vkeys], slo=SLO, trim=0.1, processes=2)
vres = dict(zip(vkeys, vout))
vres.update({(p, s): res["chat", AT["chat"], p, s] for p in PRESET_NAMES for s in SEEDS})
KEYS = ("slo_attainment", "ttft_p99", "tpot_p99", "num_preemptions")


def vmed(name):
    return {k: float(np.median([vres[name, s][k] for s in SEEDS])) if k != "num_preemptions"
            else sum(vres[name, s][k] for s in SEEDS) for k in KEYS}


def same(a, b):
    """Equal medians of every compared metric."""
    return vmed(a) == vmed(b)


order = ["vllm", "vllm + max_num_batched_tokens=8192", "vllm + admission=conservative", "vllm + policy=sglang",
         "vllm + admission=conservative, policy=sglang, max_num_batched_tokens=8192", "sglang",
         "vllm + admission=guaranteed_no_evict", "trtllm", "vllm + policy=tgi (TGI's router)", "tgi",
         "trtllm + admission=max_utilization"]
md_table(["configuration", "SLO met", "TTFT p99 (s)", "TPOT p99 (ms)", "preemptions (3 seeds)", "same metrics as"],
         [[n, f"{vmed(n)['slo_attainment']:.0%}", f"{vmed(n)['ttft_p99']:.2f}", f"{vmed(n)['tpot_p99'] * 1e3:.0f}",
           f"{vmed(n)['num_preemptions']:.0f}", "; ".join(m for m in order if m != n and same(n, m)) or "—"]
          for n in order])
gne, trt, tgi_like = vmed("vllm + admission=guaranteed_no_evict"), vmed("trtllm"), vmed("vllm + policy=tgi (TGI's router)")
trt_mu = vmed("trtllm + admission=max_utilization")

sg_full = "vllm + admission=conservative, policy=sglang, max_num_batched_tokens=8192"
v8k = vmed("vllm + max_num_batched_tokens=8192")

# %% tags=["check"]
assert same(sg_full, "sglang"), "the SGLang preset = vLLM's + its admission, its step and its budget"
assert not any(same(n, "sglang") for n in ("vllm + admission=conservative", "vllm + policy=sglang",
                                             "vllm + max_num_batched_tokens=8192")), "no single knob is enough"
assert vmed("vllm + policy=sglang")["num_preemptions"] > 5 * max(1, vmed("vllm")["num_preemptions"])
assert vmed("vllm + admission=conservative")["num_preemptions"] == 0 == vmed("sglang")["num_preemptions"]
assert gne["slo_attainment"] == trt["slo_attainment"] and gne["num_preemptions"] == 0 \
    and abs(gne["ttft_p99"] / trt["ttft_p99"] - 1) < 0.1 and gne["ttft_p99"] > 2 * vmed("vllm")["ttft_p99"]
assert tgi_like["slo_attainment"] == vmed("tgi")["slo_attainment"] and tgi_like["num_preemptions"] == 0 \
    and abs(tgi_like["ttft_p99"] / vmed("tgi")["ttft_p99"] - 1) < 0.15
assert trt_mu["slo_attainment"] > trt["slo_attainment"] and trt_mu["num_preemptions"] > 0 \
    and abs(trt_mu["ttft_p99"] / v8k["ttft_p99"] - 1) < 0.1

# %% [markdown]
# - **SGLang 的预设 = vLLM 的设置 + 三个旋钮**：按估计预留（`admission="conservative"`）、先预填充的步（`policy="sglang"`）和
#   8192 的预算，三个一起加上，每一项指标都与 SGLang 预设相同；只加其中任何一个都不够。单独加“先预填充”反而更糟：
#   乐观准入下一步接纳的预填充更多，KV 紧时就要抢占（3 个种子共 {{vmed("vllm + policy=sglang")["num_preemptions"]:.0f}} 次，
#   vLLM 原本 {{vmed("vllm")["num_preemptions"]:.0f}} 次）；按估计预留恰好把它压回 0——SGLang 的两个默认值是配套的。
# - **最坏情况预留是 TensorRT-LLM 与 TGI 的主要旋钮**：vLLM 只改 `admission="guaranteed_no_evict"`，达成率（{{gne["slo_attainment"]:.0%}}）与
#   零抢占已与 TensorRT-LLM 预设相同，p99 TTFT {{gne["ttft_p99"]:.2f}} 对 {{trt["ttft_p99"]:.2f}} s；剩下的差别来自它的 32 Token 的块、
#   不分块、8192 的预算与 `trtllm` 策略。vLLM 只把策略换成 TGI 的路由器（`policy="tgi"`，它的 `next_batch` 自带最坏情况预留），
#   达成率与零抢占也与 TGI 相同（p99 TTFT {{tgi_like["ttft_p99"]:.2f}} 对 {{vmed("tgi")["ttft_p99"]:.2f}} s，余下的是 TGI 的 4096 预算）。
# - 反过来，给 TensorRT-LLM 换上乐观准入（`max_utilization`），达成率从 {{trt["slo_attainment"]:.0%}} 回到 {{trt_mu["slo_attainment"]:.0%}}，
#   也开始抢占（{{trt_mu["num_preemptions"]:.0f}} 次），p99 TTFT {{trt_mu["ttft_p99"]:.2f}} s，与同样 8192 预算的 vLLM（{{v8k["ttft_p99"]:.2f}} s）相近。
#
# 再强调一次范围：这些等式只说明 minibatch 的预设是由这些旋钮组成的；真实框架之间的差别要在真实的 GPU 上、用各自的服务器测。
#
# 最后把旋钮全部拉平：以 vLLM 的全部设置（`presets.settings("vllm", serve=True)`）覆盖另外三个预设（显式选项优先），结果应当与 vLLM
# **逐项相同**——minibatch 的预设里除了旋钮什么也没有：

# %%
vllm_knobs = presets.settings("vllm", serve=True)
wl1 = load_workload("chat", n=n_req(AT["chat"]), rate=AT["chat"], seed=SEEDS[0])
flat = tune.summaries([(wl1, {**SIM, "preset": p, **vllm_knobs}) for p in PRESET_NAMES], slo=SLO, trim=0.1, processes=2)
print({p: f"SLO met {s['slo_attainment']:.0%}, TTFT p99 {s['ttft_p99']:.2f} s" for p, s in zip(PRESET_NAMES, flat)})
assert all(s == res["chat", AT["chat"], "vllm", SEEDS[0]] for s in flat), "equal knobs, equal results"

# %% [markdown]
# 四个“品牌”、同一组旋钮，四份结果的每一个字段都相同。横评一个框架，比较的其实是它的默认值；默认值可以改，
# 所以“vLLM 比 TensorRT-LLM 的 TTFT 尾部低”的准确说法是“乐观准入比最坏情况预留的 TTFT 尾部低，代价是抢占”。
#
# ## 20.7 在真实的 tiny 模型上：四种预设，同样的 Token
#
# 预设只改变**什么时候**算，不改变**算出什么**。用嵌入的 tiny 模型生成 6 个长度不同的提示词，四种预设各跑一次；
# 再把 KV 池压到 14 个块（每块 8 Token）、预算 24 Token，让分块、块取整和（乐观准入下的）抢占都发生，再各跑一次。
# 贪心输出必须与默认引擎逐 Token 相同：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
rng = np.random.default_rng(20)
prompts = [[int(t) for t in rng.integers(3, 1000, n)] for n in (1, 15, 16, 17, 45, 100)]
greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SQUEEZE = {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 24, "enable_chunked_prefill": True,
           "max_num_seqs": 6}
reference = [o.outputs[0].token_ids for o in LLM("tiny").generate(prompts, greedy)]
tiny_pre = {}
for p in PRESET_NAMES:
    for variant, extra in (("as is", {}), ("squeezed", SQUEEZE)):
        outs = LLM("tiny", preset=p, **extra).generate(prompts, greedy)
        same_tokens = [o.outputs[0].token_ids for o in outs] == reference
        tiny_pre[p, variant] = sum(o.metrics.num_preemptions for o in outs)
        print(f"{p:<7} {variant:<9} identical to the default engine: {same_tokens}; preemptions: {tiny_pre[p, variant]}")
        assert same_tokens, "greedy outputs must not depend on the preset"
assert tiny_pre["vllm", "squeezed"] > 0 and sum(tiny_pre.values()) == tiny_pre["vllm", "squeezed"], \
    "the prose says only the optimistic vLLM preset preempts in the squeezed pool"

# %% [markdown]
# 八次运行的输出都与默认引擎逐 Token 相同。压缩 KV 池之后只有 vLLM 预设抢占了（{{tiny_pre["vllm", "squeezed"]}} 次）：
# 它的准入是乐观的；SGLang 的估计预留、TensorRT-LLM 与 TGI 的最坏情况预留在这个小池里都没有抢占——与 20.5 节的准入规则一致。
# 被抢占的请求重算之后，Token 一个也没变。
#
# ## 20.8 动手：换负载、换到达率
#
# 控件对选定的负载与到达率（种子 1）把四个预设各跑一次，画出 TTFT 与 TPOT 的分布（每个请求一个点，按大小排序），并打印达成率。
# 试试 chat 从 2.5 到 4.5 req/s：两组在哪个到达率开始分开？rag 上它们何时分开？

# %% tags=["nbval-ignore-output"]
_cache = {}


def explore(workload="chat", rate=3.0):
    key = (workload, rate)
    if key not in _cache:
        wl = load_workload(workload, n=n_req(rate), rate=rate, seed=SEEDS[0])
        _cache[key] = tune.summaries([(wl, {**SIM, **CONFIG[p]}) for p in PRESET_NAMES], slo=SLO, processes=2)
    sums = dict(zip(PRESET_NAMES, _cache[key]))
    _fig, axes = plt.subplots(1, 3, figsize=(11, 2.8))
    xs = np.arange(len(PRESET_NAMES))
    for ax, (k, name, sc) in zip(axes, (("ttft_p99", "p99 TTFT (s)", 1), ("tpot_p99", "p99 TPOT (ms)", 1e3),
                                         ("slo_attainment", "SLO met (%)", 100))):
        ax.bar(xs, [sums[p][k] * sc for p in PRESET_NAMES], color=[COLORS[p] for p in PRESET_NAMES])
        ax.set_xticks(xs, PRESET_NAMES)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel(f"{workload} @ {rate:g} req/s")
    plt.show()
    print({p: f"{sums[p]['num_preemptions']} preemptions, {sums[p]['mean_batch_size']:.1f} running" for p in PRESET_NAMES})


W.interact(explore, workload=W.Dropdown(options=["chat", "rag"], value="chat"),
           rate=W.SelectionSlider(options=[1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5], value=3.0, continuous_update=False,
                                  description="req/s"));

# %% [markdown]
# ## 小结
#
# - 四个框架的调度默认值，归结为准入（乐观 / 按估计预留 / 按最坏情况预留）、分块与 Token 预算、路由器与并发上限几类旋钮；
#   每一项都有版本与源文件（vLLM v0.11.0、SGLang v0.5.3、TensorRT-LLM 1.x、TGI v3.3.7），换模型或 GPU 时默认值会变。
# - 在 Llama-2-13B / A100-80G 的 chat 负载上（每次 60 s 的稳态、3 个种子），准入把四者分成两组：vLLM 与 SGLang 的 TTFT 尾部低，
#   vLLM 会抢占，SGLang 的估计预留不抢占；TensorRT-LLM 与 TGI 预留到结束，从不抢占、TPOT 尾部低，但排队让 TTFT 尾部高。
#   吞吐几乎相同，按种子二分的容量区间重叠：分不出高低。在预填充为主的 rag 负载上四者相差不大。
# - SGLang 的默认步先预填充后解码（`enable_mixed_chunk=False`），与按估计预留配套：单独用它，乐观准入会频繁抢占。
# - 在 minibatch 里，预设之间的差别可以逐个追溯到旋钮，旋钮全部拉平后结果逐项相同；真实框架之间的比较还要算上这里没有模拟的一切。
# - 预设只改变计算的先后：tiny 模型上四种预设的贪心输出逐 Token 相同。
#
# 第三阶段从第 21 章开始：长尾请求与队头阻塞。
#
# ## 练习
#
# 1. **`vllm serve` 与 `LLM` 类。** 本章的 vLLM 用 `vllm serve` 在 A100 上的 2048 Token 预算（20.1 节）；离线的 `LLM` 类是 8192。用
#    `{"preset": "vllm"}`（8192）重做 rag 一行，p99 TTFT 与 TPOT 怎样变？为什么对 rag 比对 chat 更明显？
# 2. **TGI 不分块时。** `{"preset": "tgi", "enable_chunked_prefill": False}` 让 `max_waiting_tokens` 与 `waiting_served_ratio` 生效
#    （第 16 章）。在 chat 3.5 req/s 上比较 p99 TPOT 与 TTFT；再把 `waiting_served_ratio` 改成 1.2 看看。
# 3. **TensorRT-LLM 的 `MAX_UTILIZATION`。** `capacity_scheduler_policy="MAX_UTILIZATION"`（TensorRT-LLM 的名字，minibatch 接受为
#    `admission` 的别名）下，TensorRT-LLM 预设的抢占次数与 vLLM 相比如何？`trtllm` 策略从运行顺序的哪一端挑被暂停的请求？
# 4. **换一块 GPU。** 把 `SIM` 的 `hardware` 改成 `"a100-40g"`（KV 池只有约三分之一）。按 20.1 节的出处，哪些框架的默认值会跟着变？
#    预设没有跟着变（它固定在 A100-80GB 的档位），你需要显式改哪些选项才能代表 A100-40GB 上的 SGLang？两组的差距变大还是变小？
# 5. **`max_tokens` 大于真实输出。** 设一个请求提示词 $p$ = 1,000、真实输出 $o$ = 200、客户端给的 `max_tokens` $m$ = 1,024，块大小 16。
#    最坏情况预留占多少块？比按真实输出预留多多少？池里有 {{POOL_TOKENS // 16:,}} 块（A100-80G 上 13B 的池，每块 16 Token），最坏情况预留最多能同时运行多少个这样的请求，
#    按真实长度预留又是多少？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 预算 8192 时，rag 的一个 2k–4k 提示词一步就能算完，TTFT 变短；同一步里夹带的预填充多了，正在解码的请求的 TPOT 尾部变高。
#    chat 的提示词大多小于 2048，两种预算下都一步算完，影响小。
# 2. 不分块时 TGI 每次预填充单独成一步（正在运行的批暂停），凑不够 `waiting_served_ratio` × 运行数时新请求要等
#    `max_waiting_tokens` 步；ratio 越大越倾向于攒一批再预填充，TTFT 变长、生成停顿变少。
# 3. `MAX_UTILIZATION` 时 TensorRT-LLM 预设与 vLLM 一样乐观，也会抢占（暂停）；`trtllm` 策略按到达顺序排列，从末尾（最晚到达、
#    已开始的请求）挑暂停对象，与 vLLM 的 `self.running.pop()` 相同（第 12、15 章）。
# 4. SGLang 的 `chunked_prefill_size`（35–60 GiB 依版本 4096 或 8192）会变；vLLM 不变（A100 不论显存都取小的默认值）；
#    TGI 的预填充预算还可能被它按显存算出的上限截小（`vram_maximum`）；
#    要代表 A100-40GB 上较新的 SGLang，显式给 `max_num_batched_tokens=4096`。池小了，预留的代价更大，两组的差距一般变大。
# 5. $\lceil (1000+1024)/16 \rceil = 127$ 块，按真实输出 $\lceil 1200/16 \rceil = 75$ 块，多 52 块（69%）；{{POOL_TOKENS // 16:,}} 块能同时放
#    $\lfloor {{POOL_TOKENS // 16}}/127 \rfloor = {{POOL_TOKENS // 16 // 127}}$ 个，按真实长度是 $\lfloor {{POOL_TOKENS // 16}}/75 \rfloor = {{POOL_TOKENS // 16 // 75}}$ 个。本章的模拟用的是后者（`max_tokens` 等于真实输出），
#    所以它低估了最坏情况预留在真实部署里的代价。
#
# </details>
#
# **本章引用**：vLLM v0.11.0（`vllm/engine/arg_utils.py`、`vllm/platforms/cuda.py`、`vllm/v1/core/sched/scheduler.py`）；
# SGLang v0.5.3（`python/sglang/srt/server_args.py`、`managers/schedule_policy.py`、`managers/scheduler.py`）与
# SGLang 论文（Zheng et al., NeurIPS'24, arXiv:2312.07104）；TensorRT-LLM 1.x（`tensorrt_llm/llmapi/llm_args.py`、
# `cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`、`microBatchScheduler.cpp`）；TGI v3.3.7（`launcher/src/main.rs`、
# `backends/v3/src/backend.rs`、`backends/v3/src/queue.rs`、`server/text_generation_server/models/globals.py`）。
