# %% [markdown]
# # 第 15 章 TensorRT-LLM 的 In-flight Batching
#
# TensorRT-LLM 把连续批处理（Continuous Batching，第 5 章）叫作**飞行中批处理**（In-flight Batching, IFB）：
# 每一次迭代（一次前向）都重新决定哪些请求参加，处于上下文阶段（Context，即预填充）的请求与处于生成阶段
# （Generation，即解码）的请求可以同批。与 vLLM 一遍走完的调度（第 10 章）不同，TensorRT-LLM 每次迭代分**两遍**：
# 先由**容量调度器**（Capacity Scheduler）按 KV 缓存决定哪些请求可以占用（或继续占用）资源，再由**微批调度器**
# （Micro-batch Scheduler）在 `max_batch_size` 与 `max_num_tokens` 之内挑出这一步真正计算的请求，必要时把上下文切块。
#
# 本章读 TensorRT-LLM 的源码，把两遍调度的每条规则对到 minibatch 里跑实验的代码上：`trtllm` 策略
# （`minibatch/policies/trtllm.py`）、三种准入模式（`minibatch/admission.py`）与 `trtllm` 预设（`minibatch/presets/`）。
# 源码出处：TensorRT-LLM 1.x 的 `cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`（读的是存储快照 commit cf6abc4，
# 以及较新的 02a10fe——后者多了一种 `PREFILL_FIRST` 策略，本章不涉及）与 `microBatchScheduler.cpp`（commit 0a949d3）；
# PyTorch 后端（1.x 的默认后端）用 `tensorrt_llm/_torch/pyexecutor/scheduler.py` 的 `BindCapacityScheduler`、
# `BindMicroBatchScheduler` 直接调用这两个 C++ 类（1.3.0rc27 与 1.4.0rc4 的文档里另有一个纯 Python 实现，`SchedulerConfig.use_python_scheduler`，默认关闭）。默认值出自 `tensorrt_llm/llmapi/llm_args.py` 与 1.4.0rc4 的 API 文档，逐条注明。
#
# ## 学习目标
#
# - 说清一次迭代的两遍调度：容量调度器管 KV（谁能占资源），微批调度器管算力（这一步算多少 Token），以及它们的默认参数从哪里来；
# - 写出三种容量策略 `GUARANTEED_NO_EVICT`、`MAX_UTILIZATION`、`STATIC_BATCH` 的准入条件，在手工构造的调度器状态上预言并验证每条规则的决定，
#   包括 `MAX_UTILIZATION` 的**暂停**（Pause）：暂停最后开始的请求，本次迭代在它的位置结束；
# - 写出微批调度器的 Token 预算：生成请求先占，上下文按先来先服务（FCFS）分块，切短的块向下取整到 `tokens_per_block` 的整数倍；
# - 在模拟的 Llama-2-7B / A10 上、稳态、多个种子下比较三种容量策略的抢占、吞吐、TTFT/TPOT 尾部、KV 占用与预留，以及 SLO 下的服务容量（Capacity）；
# - 量出 `max_num_tokens` 与上下文分块（Context Chunking）对 TTFT、生成停顿（ITL 尾部）的影响；
# - 在真实的 tiny 模型上验证：`trtllm` 预设下（含暂停与重算），贪心输出逐 Token 不变。

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
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

import minibatch
from minibatch import EngineConfig, presets, tune
from minibatch.admission import GuaranteedNoEvict, StaticBatch
from minibatch.kv_cache import KVCacheManager
from minibatch.policies.trtllm import TRTLLMPolicy
from minibatch.request import Request, RequestStatus
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a10", preset="trtllm")   # this chapter's server
TRT = presets.settings("trtllm")                                             # what the preset sets
POLICIES = {"GUARANTEED_NO_EVICT": "GNE", "MAX_UTILIZATION": "MU", "STATIC_BATCH": "STATIC"}
N_REQ, RATES, SEEDS = 360, [1.0, 1.3, 1.6, 1.9], [1, 2, 3]                # 15.4: requests per run, rates, seeds
SLO, TARGET = {"ttft": 1.0, "tpot": 0.060}, 0.9                              # per request, seconds; attainment target
CHAT_P = dict(prompt=192, output=256, sigma=0.6, max=1024)                   # 15.4: chat lengths (lognormal medians)
CHAT = dict(input_len=lognormal(median=CHAT_P["prompt"], sigma=CHAT_P["sigma"], max=CHAT_P["max"]),
            output_len=lognormal(median=CHAT_P["output"], sigma=CHAT_P["sigma"], max=CHAT_P["max"]))
RAG_P = dict(prompt=1500, prompt_max=3500, output=128, rate=0.4, n=160)      # 15.5: long prompts, 400 s of arrivals
RAG_CAP = dict(lo=0.3, hi=1.0, tol=0.1, target=0.9, trim=0.2, duration_s=240.0, processes=2)   # 15.5: capacity, bisection
CAP_PAIR = {"no chunking, 8192": dict(max_num_batched_tokens=8192, enable_chunked_prefill=False),   # 15.5: compared
            "chunked, 512": dict(max_num_batched_tokens=512, enable_chunked_prefill=True)}
CM = make_cost_model("llama-2-7b", "a10")                                    # the server's cost model
TRIM, FULL = 0.2, 0.95                 # steady state: drop the first and last 20% of arrivals; "pool full" threshold
MICRO = [("no chunking", 8192), ("chunked", 2048), ("chunked", 1024), ("chunked", 512), ("chunked", 256)]   # 15.5
torch.set_num_threads(1)
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 15.1 一次迭代，两遍调度
#
# TensorRT-LLM 的调度器把所有**活动请求**（Active Requests，已到达、未结束的请求）按到达顺序排成一列；被暂停的请求保留它的位置。
# 每次迭代：
#
# 1. **容量调度器**（`CapacityScheduler`，策略由 `SchedulerConfig.capacity_scheduler_policy` 选择）沿这一列走一遍，
#    决定哪些请求这一步可以占用 KV：输出 `fitting_requests`（获准的请求）与 `paused_requests`（被暂停、释放 KV 的请求）。
#    它同时限制请求数不超过 `max_batch_size`。
# 2. **微批调度器**（`MicroBatchScheduler`）在获准的请求里挑出这一步要算的：生成请求每个 1 个 Token，上下文请求算整段提示
#    或其中一块，合计不超过 `max_num_tokens`、请求数不超过 `max_batch_size`。输出 `context_requests` 与 `generation_requests`。
#
# 下图是这两遍的数据流；后面两节分别拆开。

# %%
fig, ax = plt.subplots(figsize=(10, 2.6))
boxes = [(0.0, "active requests\n(arrival order;\npaused keep their place)", "#eeeeee"),
         (2.55, "capacity scheduler\nGUARANTEED_NO_EVICT |\nMAX_UTILIZATION | STATIC_BATCH\n(KV blocks, max_batch_size)", "#e8eef7"),
         (5.35, "micro-batch scheduler\nmax_batch_size, max_num_tokens\ngeneration first, then\ncontext chunks (FCFS)", "#e8f4ea"),
         (8.1, "one forward:\ncontext chunks +\ngeneration tokens", "#fdf0e0")]
for x, text, color in boxes:
    ax.add_patch(FancyBboxPatch((x, 0.2), 2.1, 1.6, boxstyle="round,pad=0.05", fc=color, ec="0.4"))
    ax.text(x + 1.05, 1.0, text, ha="center", va="center", fontsize=8)
for x0, label in [(2.1, ""), (4.65, "fitting_requests"), (7.45, "context_requests,\ngeneration_requests")]:
    ax.add_patch(FancyArrowPatch((x0 + 0.02, 1.0), (x0 + 0.43, 1.0), arrowstyle="-|>", mutation_scale=12, color="0.3"))
    ax.text(x0 + 0.22, 1.55, label, ha="center", fontsize=7)
ax.annotate("paused_requests\n(KV freed, context rerun later)", xy=(3.6, 0.2), xytext=(3.6, -0.55), ha="center", fontsize=7,
            arrowprops=dict(arrowstyle="-|>", color="C3"), color="C3")
ax.set(xlim=(-0.1, 10.3), ylim=(-0.8, 2.0))
ax.axis("off")
ax.set_title("One TensorRT-LLM iteration: two passes over the active requests", fontsize=10)
plt.show()

# %% [markdown]
# minibatch 用一个策略加三种准入模式复现这两遍。策略 `trtllm` 给出顺序（所有请求按到达时间），并打开调度器的三个开关：
# `decode_budget_first`（分块时先为解码留出预算）、`chunk_to_block`（切短的块取整到整块）、`stop_at_refusal`
# （第一个被拒绝的请求之后不再接纳，被暂停的请求之后本步什么也不排）。`preemptive = True` 让 `MAX_UTILIZATION`
# 下排在前面的请求可以挤掉后开始的请求：

# %%
print(inspect.getsource(TRTLLMPolicy).split('"""')[0] + "...")
print(inspect.getsource(TRTLLMPolicy).split("@register")[1])

# %% [markdown]
# 预设 `trtllm` 把 TensorRT-LLM 的默认值填进 minibatch 的 `EngineConfig`（显式给出的选项优先）。下表每一行都注明了默认值的出处；
# 其中 `BaseLlmArgs` 在 `tensorrt_llm/llmapi/llm_args.py`，`capacity_scheduler_policy` 的默认值 `GUARANTEED_NO_EVICT`
# 也写在 1.4.0rc4 的 `SchedulerConfig` 文档里，`KvCacheConfig.tokens_per_block` 默认 {{TRT["block_size"]}}（同一文件），而 PyTorch 后端把它当作分块的单位
# （`tensorrt_llm/_torch/pyexecutor/py_executor_creator.py`：`chunk_unit_size = tokens_per_block`，未指定 `context_chunking_policy` 时用
# `FIRST_COME_FIRST_SERVED`）。

# %% tags=["nbval-check-output"]
print(presets.describe("trtllm"))
assert (TRT["admission"], TRT["enable_chunked_prefill"], TRT["max_num_batched_tokens"], TRT["max_num_seqs"],
        TRT["block_size"]) == ("guaranteed_no_evict", False, 8192, 2048, 32), "the prose quotes these defaults"

# %% [markdown]
# 名字的对应：TensorRT-LLM 的 `max_batch_size` 是 minibatch 的 `max_num_seqs`（默认 {{TRT["max_num_seqs"]}}），
# `max_num_tokens` 是 `max_num_batched_tokens`（默认 {{TRT["max_num_batched_tokens"]}}），`enable_chunked_prefill`
# 默认关闭（{{TRT["enable_chunked_prefill"]}}），容量策略默认 `GUARANTEED_NO_EVICT`。
# `capacity_scheduler_policy=` 在 minibatch 里是 `admission=` 的别名，接受 TensorRT-LLM 的三个名字。
#
# ## 15.2 容量调度器：三种策略
#
# 记块大小为 $B$（`tokens_per_block`），空闲块数为 $N_\text{free}$，请求 $i$ 的提示词长 $p_i$、`max_tokens` 为 $m_i$、
# 已生成 $g_i$ 个 Token、已持有 $h_i$ 个块，最大长度为 $L_\max$。请求“跑到结束”还需要的块数是
#
# $$
# r_i = \Big\lceil \frac{\min(p_i + m_i,\ L_\max)}{B} \Big\rceil - h_i .
# $$
#
# **`GUARANTEED_NO_EVICT`**（`GuaranteedNoEvictScheduler`，默认）：先把所有生成中的请求放进来，并从空闲块里扣掉它们的 $r_i$
# （`NoEvictScheduledBlocksManager::decrementReservedBlocks`）；再按到达顺序看等待中的请求 $j$，
#
# $$
# \text{接纳 } j \iff r_j \le N_\text{free} - \sum_{i \in \text{running}} r_i - \sum_{k \text{ 已在本步接纳}} r_k ,
# $$
#
# 第一个放不下的请求处 `break`——后面的即使更小也不看。运行中的请求总能长到结束，所以**从不暂停**。
#
# **`MAX_UTILIZATION`**（`MaxUtilizationScheduler`）：只看**这一步**要的块 $\Delta_i$（生成请求多写一个 Token 时是否跨进新块；
# 新上下文的整段提示），按到达顺序累加 $\sum \Delta \le N_\text{free}$ 就接纳。放不下时，从列尾往前找**最后一个已开始的请求**，
# 模拟释放它的块（`schedulingRemoveSequence`），记入 `pausedRequests`，并把本次遍历的终点 `reqItEnd` 移到它的位置，再重试；
# 找不到可暂停的请求就 `break`。被暂停的请求丢掉 KV，以后重新计算上下文（第 12 章的“重算”）。
#
# **`STATIC_BATCH`**（`StaticBatchScheduler`，即 `impl<true>`）：与 `GUARANTEED_NO_EVICT` 相同的预留规则，但只有**没有任何请求在进行中**时
# 才看等待中的请求：一批一起开始、跑完，再接下一批。TensorRT-LLM 的性能调优文档（*Useful Runtime Options*）说它是遗留模式，不建议用于生产。
#
# minibatch 里这三条规则是三种准入模式，`GuaranteedNoEvict.can_admit` 就是上面的不等式（`max_utilization` 的准入总是放行，
# 由分配块与抢占来体现）：

# %%
print(inspect.getsource(GuaranteedNoEvict.can_admit))
print(inspect.getsource(StaticBatch.can_admit))

# %% [markdown]
# 在一个手工构造的状态上看三条规则各自怎么决定。池里 10 个块、每块 4 个 Token。运行中的 `r`：提示 8 Token、已生成 1 个、`max_tokens=8`，
# 持有 2 块，下一个 Token 要第 3 块，跑到结束要 4 块；等待中的 `w1`（提示 8、`max_tokens=12`，共 5 块）先到，`w2`（提示 4、`max_tokens=4`，共 2 块）后到：

# %% tags=["nbval-check-output"]
def hand_scheduler(num_blocks, policy_name, block_size=4, **cfg):
    """A bare scheduler with the trtllm order and TensorRT-LLM's capacity policy ``policy_name``."""
    config = EngineConfig.from_kwargs(policy="trtllm", capacity_scheduler_policy=policy_name, block_size=block_size,
                                      num_kv_blocks=num_blocks, max_model_len=1000, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len=1000)


def add_waiting(s, rid, prompt, max_tokens, arrival):
    s.add(Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), arrival))


def add_running(s, rid, prompt, max_tokens, arrival, out=1, computed=None):
    """A request admitted earlier: ``computed`` tokens in its KV (default: all but the last sampled one)."""
    r = Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), arrival)
    r.output_token_ids = [9] * out
    n = r.num_tokens - 1 if computed is None else computed
    assert s.kv.allocate_slots(r, n)
    r.num_computed_tokens = n
    r.status, r.first_scheduled_time = RequestStatus.RUNNING, arrival
    s.running.append(r)


def decide(s, now=10.0):
    batch = s.schedule(now)
    return [(r.request_id, n) for r, n in batch.items], [r.request_id for r in batch.preempted]


decisions = {}
for name in POLICIES:
    s = hand_scheduler(10, name)
    add_running(s, "r", 8, 8, arrival=0.0)
    add_waiting(s, "w1", 8, 12, arrival=1.0)
    add_waiting(s, "w2", 4, 4, arrival=2.0)
    decisions[name] = decide(s) + (s.kv.num_free_blocks,)
    print(f"{name:<20} runs {decisions[name][0]}, free blocks after: {decisions[name][2]}")

# %% tags=["check"]
assert decisions["GUARANTEED_NO_EVICT"][0] == [("r", 1), ("w1", 8)], "GNE: w1 fits its whole future, w2 does not"
assert decisions["MAX_UTILIZATION"][0] == [("r", 1), ("w1", 8), ("w2", 4)], "MU: this step's blocks fit for both"
assert decisions["STATIC_BATCH"][0] == [("r", 1)], "STATIC: r is in progress, nobody joins"

# %% [markdown]
# - `GUARANTEED_NO_EVICT`：空闲 8 块，先为 `r` 留出 $r_r = 4 - 2 = 2$ 块，剩 6 块；`w1` 要 5 块，接纳，剩 1 块；`w2` 要 2 块，放不下，停。
# - `MAX_UTILIZATION`：`r` 这一步要 1 块（第 3 块），`w1` 要 2 块（8 个提示 Token），`w2` 要 1 块，都放得下，全部接纳，
#   这一步之后还空着 {{decisions["MAX_UTILIZATION"][2]}} 块——将来 `w1` 与 `r` 长大时可能不够，那时就要暂停。
# - `STATIC_BATCH`：`r` 还在进行中，谁也不接纳。
#
# 再看 `MAX_UTILIZATION` 的暂停。池里 5 块，全被占着：`a`（最早到达）下一个 Token 要第 2 块；`b`、`c` 各持 2 块，下一个 Token 放得下；
# 等待中的 `w` 只要 1 块，最晚到达：

# %% tags=["nbval-check-output"]
s = hand_scheduler(5, "MAX_UTILIZATION")
add_running(s, "a", 4, 8, arrival=0.0)
add_running(s, "b", 7, 8, arrival=1.0)
add_running(s, "c", 7, 8, arrival=2.0)
add_waiting(s, "w", 2, 4, arrival=3.0)
pause_items, pause_victims = decide(s)
pause_waiting, pause_free = [r.request_id for r in s.waiting], s.kv.num_free_blocks
print("runs", pause_items, "| paused", pause_victims, "| waiting", pause_waiting, "| free blocks", pause_free)
assert pause_victims == ["c"] and pause_items == [("a", 1), ("b", 1)], "the last started request is paused"
assert pause_waiting == ["c", "w"] and pause_free == 1, "the walk ends at c: w stays waiting though a block is free"
s = hand_scheduler(5, "MAX_UTILIZATION")                # exercise 1's answer (b arrives after w)
add_running(s, "a", 4, 8, arrival=0.0)
add_running(s, "b", 7, 8, arrival=3.5)
add_running(s, "c", 7, 8, arrival=2.0)
add_waiting(s, "w", 2, 4, arrival=3.0)
ex1 = decide(s)

# %% [markdown]
# `a` 要一块而池已满，于是最后开始的 `c` 被暂停（它的 2 块被释放），`a` 拿到其中 1 块，`b` 照常解码。还空着 {{pause_free}} 块，
# `w` 只要 1 块——但 `MaxUtilizationScheduler` 已把遍历的终点 `reqItEnd` 移到 `c` 的位置，排在 `c` 之后的 `w` 这一步不会被考虑。
# 下一步，`c`（到达更早）排在 `w` 前面，先拿回它的位置；如果这一步就把空出的块给了 `w`，下一步 `c` 要拿回 KV 时，
# 排在它后面、刚开始的 `w` 就成了被暂停的对象。
# minibatch 的 `stop_at_refusal` 开关复现了这条规则：调度器在被抢占请求的位置结束这一步（`minibatch/scheduler.py`，`end`）。
# 编写本章时发现 minibatch 原先在这里会把空块交给 `w`，已按 TensorRT-LLM 的源码修正，并在 `tests/test_trtllm_rules.py` 中加了两个单元测试。
#
# ## 15.3 微批调度器：`max_batch_size`、`max_num_tokens` 与上下文分块
#
# 微批调度器（`MicroBatchScheduler::operator()`）沿获准的请求走一遍：
#
# - 生成请求每个占 1 个 Token（束搜索时是束宽）；上下文请求在**不分块**时要整段提示 $p_j$，放不下就 `break`；
# - **分块**时（`enable_chunked_prefill=True`，即 `ctxChunkConfig`），上下文请求先被记下，等所有生成请求占完预算后，
#   再按 `FIRST_COME_FIRST_SERVED` 分配剩下的 $T_\text{ctx} = T - n_\text{gen}$（$T$ 为 `max_num_tokens`）：
#
# $$
# c_j = \min(\text{剩余提示}_j,\ T_\text{ctx} - \textstyle\sum_{k<j} c_k),\qquad
# c_j \leftarrow \Big\lfloor \frac{c_j}{B} \Big\rfloor B \quad \text{若 } c_j < \text{剩余提示}_j ,
# $$
#
#   即被预算切短的块向下取整到块大小 $B$ 的整数倍（`setCtxRequestsChunkSize<kFIRST_COME_FIRST_SERVED>`，整段剩余的最后一块不取整），
#   块长为 0 的请求这一步不算；
# - 请求数（包括上下文请求）到 `max_batch_size` 就停。
#
# 一处差别：不分块时 TensorRT-LLM 在放不下的上下文处 `break`，排在它后面的生成请求这一步也不算；minibatch 跳过它、照常算后面的
# 运行中请求。`GUARANTEED_NO_EVICT` 的输出先列生成请求、再列上下文请求，这时两者一致。
#
# 不分块时，提示词超过 `max_num_tokens` 的请求永远排不进去，所以 TensorRT-LLM 的 `LLM._check_arguments`（`tensorrt_llm/llmapi/llm.py`）
# 直接拒绝它（“should not exceed max_num_tokens”）；minibatch 的 `LLMEngine.validate` 也一样拒绝。
#
# 同一个状态分别交给 `trtllm` 和 vLLM 式的 `continuous` 策略：块大小 8，预算 37，两个解码 `d1`、`d2`，一个做到一半的上下文 `p`
# （还剩 30 个 Token），一个新请求 `n`（提示 20）：

# %% tags=["nbval-check-output"]
def micro_state(policy, budget=37, max_num_seqs=8):
    config = EngineConfig.from_kwargs(policy=policy, block_size=8, num_kv_blocks=64, max_num_batched_tokens=budget,
                                      max_num_seqs=max_num_seqs, enable_chunked_prefill=True, max_model_len=1000)
    s = Scheduler(config, KVCacheManager(64, 8), max_model_len=1000)
    add_running(s, "p", 40, 8, arrival=0.0, out=0, computed=10)     # a context request, 30 tokens to go
    add_running(s, "d1", 8, 8, arrival=1.0)
    add_running(s, "d2", 8, 8, arrival=2.0)
    add_waiting(s, "n", 20, 8, arrival=3.0)
    return s


micro = {name: decide(micro_state(name))[0] for name in ("trtllm", "continuous")}
micro_seqs = decide(micro_state("trtllm", max_num_seqs=3))[0]
for name, items in micro.items():
    print(f"{name:<11} {items}  ({sum(n for _, n in items)} of 37 tokens)")
print(f"trtllm with max_batch_size=3: {micro_seqs}")
ex4 = {b: dict(decide(micro_state("trtllm", budget=b))[0]).get("n", 0) for b in (40, 41)}    # exercise 4's answer

# %% tags=["check"]
assert micro["trtllm"] == [("p", 30), ("d1", 1), ("d2", 1)], "n's chunk of 5 rounds down to 0 (blocks of 8)"
assert micro["continuous"] == [("p", 30), ("d1", 1), ("d2", 1), ("n", 5)], "vLLM-style: n gets the 5 left"
assert micro_seqs == [("p", 30), ("d1", 1), ("d2", 1)]

# %% [markdown]
# 两个解码先占 2 个 Token，`p` 拿走它剩下的全部 30 个（这是整段剩余，不取整），还剩 5 个：`trtllm` 把 `n` 的块 5 向下取整到
# 8 的倍数，得 0，这一步不算 `n`（预算有 {{37 - sum(n for _, n in micro["trtllm"])}} 个 Token 空着）；`continuous` 则把这 5 个 Token 给了 `n`。
# 取整让每块恰好写满整数个 KV 块（下一块从块边界开始），代价是每步可能空出不到一个块的预算。
# 上面的 `p` 排在解码前面，是因为顺序按到达时间；minibatch 的 `decode_budget_first` 开关复现 TensorRT-LLM 的做法，
# 解码无论排在哪里都先拿到 Token：

# %%
src = inspect.getsource(Scheduler._build)
print("\n".join(line for line in src.splitlines() if "decodes_ahead" in line or "room =" in line))
print(inspect.getsource(Scheduler._chunk))

# %% [markdown]
# ## 15.4 三种容量策略，同一负载
#
# 模拟的服务器是 Llama-2-7B（FP16）跑在一张 A10 上（{{CM.hardware.memory_bytes / 2**30:.1f}} GiB 可用显存），`trtllm` 预设。
# 权重占 {{CM.weight_bytes_per_gpu / 2**30:.1f}} GiB，剩下的显存放得下的 KV 不多，正是容量策略起作用的场景。
# 负载是聊天式的：提示词中位数 {{CHAT_P["prompt"]}}、输出中位数 {{CHAT_P["output"]}}（对数正态，$\sigma$ = {{CHAT_P["sigma"]}}，
# 最长 {{CHAT_P["max"]}}），泊松到达。
# 每次运行 {{N_REQ}} 个请求，稳态指标用 `summary(trim={{TRIM}})`（只统计到达时间落在中间 {{1 - 2 * TRIM:.0%}} 的请求），
# 每个到达率 {{len(SEEDS)}} 个负载种子、取中位数。
# SLO 对**每个请求**判断：TTFT ≤ {{SLO["ttft"]:g}} s 且 TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms；服务容量是 SLO 达成率（SLO Attainment）不低于 {{TARGET:.0%}} 的最高到达率。

# %%
pool_tokens = CM.kv_capacity_tokens()
pool_blocks = pool_tokens // TRT["block_size"]
wl_probe = synthetic(N_REQ, 1.0, **CHAT, seed=1)
mean_len = float(np.mean(wl_probe.prompt_lens + wl_probe.output_lens))
mean_p, mean_o = float(np.mean(wl_probe.prompt_lens)), float(np.mean(wl_probe.output_lens))
over_ask = (mean_p + mean_o) / (mean_p + 2 * mean_o)     # exercise 2: GNE's reservation if max_tokens = 2 x output
assert (wl_probe.prompt_lens + wl_probe.output_lens).max() <= pool_tokens, "every request fits the pool on its own"


def kv_trace(trace):
    """An on_step callback: after each step, (time, blocks used, blocks the running requests reserve to finish)."""
    def on_step(engine, step):
        sch, kv = engine.scheduler, engine.kv
        reserved = sum(max(kv.blocks_for_request(sch.final_len(r)), len(kv.block_table(r.request_id))) for r in sch.running)
        trace.append((step.start_time + step.duration, step.kv_blocks_used, reserved))
    return on_step


runs, traces = {}, {}
for rate in RATES:
    for seed in SEEDS:
        wl = synthetic(N_REQ, rate, **CHAT, seed=seed)
        for name in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"):
            traced = rate == RATES[-1] and seed == 1            # the KV figure below
            on_step = kv_trace(traces.setdefault(name, [])) if traced else None
            runs[name, rate, seed] = run(wl, **SIM, capacity_scheduler_policy=name, on_step=on_step)
print(f"pool: {pool_tokens:,} tokens = {pool_blocks} blocks of {TRT['block_size']}; mean prompt + output {mean_len:.0f} tokens")
print(f"exercise 2 (seed 1): mean prompt {mean_p:.0f}, mean output {mean_o:.0f}; GNE reserves ~{mean_p + mean_o:.0f} tokens a "
      f"request, ~{mean_p + 2 * mean_o:.0f} if max_tokens is twice the output: {over_ask:.0%} as many requests fit")

# %% [markdown]
# 池里能放 {{pool_tokens:,}} 个 Token（{{pool_blocks}} 块），每个请求的提示加输出平均 {{mean_len:.0f}} 个 Token，
# 按平均长度算，池里同时只能有约 {{pool_tokens / mean_len:.0f}} 个请求跑到结束。下图与下表是 {{len(SEEDS)}} 个种子的中位数随到达率的变化：

# %%
KEYS = ["slo_attainment", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "num_preemptions", "throughput_tok_s", "kv_util_mean"]
BOTH = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION")
summ = {k: r.summary(slo=SLO, trim=TRIM) for k, r in runs.items()}
sweep = {(name, rate, key): float(np.median([summ[name, rate, s][key] for s in SEEDS]))
         for name in BOTH for rate in RATES for key in KEYS}
cap = {name: capacity({r: sweep[name, r, "slo_attainment"] for r in RATES}, target=TARGET) for name in BOTH}
fig, axes = plt.subplots(1, 4, figsize=(13, 3))
for ax, (key, label, scale) in zip(axes, [("slo_attainment", "SLO attainment (%)", 100), ("ttft_p99", "TTFT p99 (s)", 1),
                                          ("tpot_p99", "TPOT p99 (ms)", 1e3), ("num_preemptions", "pauses (preemptions)", 1)]):
    for name, color in zip(BOTH, ("C0", "C3")):
        ax.plot(RATES, [sweep[name, r, key] * scale for r in RATES], "o-", color=color, label=name)
    ax.set(xlabel="request rate (req/s)", title=label)
    ax.grid(alpha=0.3)
axes[0].axhline(TARGET * 100, color="k", ls=":", lw=1)
axes[1].set_yscale("log")
axes[0].legend(fontsize=7)
fig.suptitle(f"Llama-2-7B on A10, trtllm preset: median of {len(SEEDS)} seeds, steady state "
             f"(middle {1 - 2 * TRIM:.0%} of arrivals)", fontsize=10)
fig.tight_layout()
plt.show()
md_table(["req/s", "GNE: attainment", "GNE: TTFT p99 (s)", "GNE: TPOT p99 (ms)", "MU: attainment", "MU: TTFT p99 (s)",
          "MU: TPOT p99 (ms)", "MU: pauses"],
         [[r, f"{sweep[BOTH[0], r, 'slo_attainment']:.0%}", f"{sweep[BOTH[0], r, 'ttft_p99']:.2f}",
           f"{sweep[BOTH[0], r, 'tpot_p99'] * 1e3:.0f}", f"{sweep[BOTH[1], r, 'slo_attainment']:.0%}",
           f"{sweep[BOTH[1], r, 'ttft_p99']:.2f}", f"{sweep[BOTH[1], r, 'tpot_p99'] * 1e3:.0f}",
           f"{sweep[BOTH[1], r, 'num_preemptions']:.0f}"] for r in RATES])

# %% tags=["nbval-check-output"]
gne_cap, mu_cap = cap["GUARANTEED_NO_EVICT"], cap["MAX_UTILIZATION"]
mu_first_pause = min(r for r in RATES if sweep[BOTH[1], r, "num_preemptions"] > 0)
print("capacity (req/s):", cap, "| MU pauses from", mu_first_pause, "req/s")

# %% tags=["check"]
assert mu_cap > gne_cap, "the prose says MAX_UTILIZATION serves a higher rate under this SLO"
assert all(sweep[BOTH[0], r, "num_preemptions"] == 0 for r in RATES), "GNE never pauses"
assert sweep[BOTH[1], RATES[0], "num_preemptions"] == 0 < sweep[BOTH[1], RATES[-1], "num_preemptions"], \
    "MU pauses only at the highest rate"
assert all(sweep[BOTH[0], r, "tpot_p99"] <= sweep[BOTH[1], r, "tpot_p99"] for r in RATES), "GNE has the steadier TPOT"
assert all(sweep[BOTH[0], r, "ttft_p99"] >= sweep[BOTH[1], r, "ttft_p99"] for r in RATES), "GNE queues more"
assert sweep[BOTH[0], RATES[-1], "ttft_p99"] > 10, "the prose says GNE is far past its limit at the highest rate"

# %% [markdown]
# 在这个 SLO 下，`MAX_UTILIZATION` 的服务容量是 {{mu_cap:.1f}} req/s，`GUARANTEED_NO_EVICT` 是 {{gne_cap:.1f}} req/s（扫描的到达率为
# {{RATES}}，按每个到达率 {{len(SEEDS)}} 个种子的达成率中位数取值）。`GUARANTEED_NO_EVICT` 一次也不暂停，每个到达率下 TPOT 的 p99 都不高于
# `MAX_UTILIZATION`；它输在 TTFT：到达率升高后，新请求要等运行中的请求**跑完**、把预留的块还回来，排队时间先越过 SLO
# （{{RATES[1]}} req/s 时 TTFT 的 p99 已是 {{sweep[BOTH[0], RATES[1], "ttft_p99"]:.1f}} s）。`MAX_UTILIZATION` 从 {{mu_first_pause}} req/s 起开始暂停请求
# （{{RATES[-1]}} req/s 时中位数 {{sweep[BOTH[1], RATES[-1], "num_preemptions"]:.0f}} 次），被暂停的请求要重算，TPOT 的尾部随之变长。
# 在 {{RATES[-1]}} req/s，`GUARANTEED_NO_EVICT` 已远超它能承受的负载（TTFT 的 p99 为 {{sweep[BOTH[0], RATES[-1], "ttft_p99"]:.0f}} s），
# 它在这里没有稳态，延迟随运行时长还会再涨，这一点只用来看趋势。
#
# 为什么差这么多？看到达率 {{RATES[-1]}} req/s、种子 1 的运行里，每一步**实际占用**的块与运行中的请求**预留到结束**的块：

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3), sharey=True)
for ax, name in zip(axes, BOTH):
    t, used, reserved = map(np.array, zip(*traces[name]))
    ax.plot(t, used, lw=0.8, label="blocks used")
    ax.plot(t, reserved, lw=0.8, color="C1", label="blocks reserved to finish (final lengths)")
    ax.axhline(pool_blocks, color="k", ls=":", lw=1, label=f"pool ({pool_blocks} blocks)")
    ax.set(xlabel="time (s)", title=f"{name}, {RATES[-1]} req/s, seed 1")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("KV blocks")
axes[0].legend(fontsize=7, loc="lower right")
fig.tight_layout()
plt.show()

# %% tags=["nbval-check-output"]
t, used, reserved = map(np.array, zip(*traces["GUARANTEED_NO_EVICT"]))
full = reserved >= FULL * pool_blocks
gne_full, gne_used_full = float(full.mean()), float(used[full].mean() / pool_blocks)
mu_used_max = max(u for _, u, _ in traces["MAX_UTILIZATION"]) / pool_blocks
print(f"GNE: {gne_full:.0%} of steps reserve >= {FULL:.0%} of the pool, and use {gne_used_full:.0%} of it on average then; "
      f"MU's peak use: {mu_used_max:.0%}")
assert reserved.max() <= pool_blocks, "GNE never reserves more than the pool"
assert gne_used_full < 0.8 and mu_used_max > 0.95, "the prose contrasts GNE's idle reservation with MU's full pool"

# %% [markdown]
# `GUARANTEED_NO_EVICT` 的预留（橙线）在 {{gne_full:.0%}} 的步里顶到池的 {{FULL:.0%}} 以上，这些步里实际占用（蓝线）平均只有池的
# {{gne_used_full:.0%}}：每个请求从接纳起就占着“跑到结束”的全部块，可任一时刻它只写了其中一部分。于是池还空着一大块，新请求却进不来。
# `MAX_UTILIZATION` 把池用到了 {{mu_used_max:.0%}}，代价是池满时要暂停请求。
# 这里的 `max_tokens` 恰好等于真实的输出长度（模拟器总是生成满 `max_tokens`），是 `GUARANTEED_NO_EVICT` 最有利的情形；
# 用户把 `max_tokens` 设得比实际输出大时，预留还会更多（练习 2）。
#
# 把第三种策略也放进来，在两者的吞吐都跟得上到达负载的 {{RATES[1]}} req/s 下比较（`GUARANTEED_NO_EVICT` 的 TTFT 尾部在这里已经变长）。`STATIC_BATCH` 在这个到达率下严重过载（一批请求要等最慢的成员结束，
# 批的大小还被第一步的 `max_num_tokens` 与预留限制住），它没有稳态：排队越来越长，TTFT 随运行时长增长。所以它只跑一个种子、
# 较少的请求，报告的吞吐是它的饱和吞吐，延迟只说明“过载”，不可与另外两行直接比较：

# %% tags=["nbval-check-output"]
static = run(synthetic(150, RATES[1], **CHAT, seed=1), **SIM, capacity_scheduler_policy="STATIC_BATCH")
s_static = static.summary(slo=SLO, trim=TRIM)
R = RATES[1]
rows = [[name, "median of 3", f"{sweep[name, R, 'throughput_tok_s']:.0f}", f"{sweep[name, R, 'ttft_p50']:.2f}",
         f"{sweep[name, R, 'ttft_p99']:.2f}", f"{sweep[name, R, 'tpot_p50'] * 1e3:.0f}", f"{sweep[name, R, 'tpot_p99'] * 1e3:.0f}",
         f"{sweep[name, R, 'kv_util_mean']:.0%}", f"{sweep[name, R, 'num_preemptions']:.0f}",
         f"{sweep[name, R, 'slo_attainment']:.0%}"] for name in BOTH]
rows.append(["STATIC_BATCH", "seed 1, overloaded", f"{s_static['throughput_tok_s']:.0f}", f"{s_static['ttft_p50']:.1f}",
             f"{s_static['ttft_p99']:.1f}", f"{s_static['tpot_p50'] * 1e3:.0f}", f"{s_static['tpot_p99'] * 1e3:.0f}",
             f"{s_static['kv_util_mean']:.0%}", f"{s_static['num_preemptions']}", f"{s_static['slo_attainment']:.0%}"])
md_table(["capacity policy", "runs", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)",
          "KV used (mean)", "pauses", "SLO attainment"], rows)

# %% tags=["nbval-check-output"]
static_batch = float(np.mean([st.num_seqs for st in static.steps]))
gne_tok, mu_tok = sweep[BOTH[0], R, "throughput_tok_s"], sweep[BOTH[1], R, "throughput_tok_s"]
print(f"STATIC_BATCH: mean batch {static_batch:.1f} requests, throughput {s_static['throughput_tok_s']:.0f} tok/s "
      f"(GNE {gne_tok:.0f}, MU {mu_tok:.0f}), TTFT p50 {s_static['ttft_p50']:.0f} s")
assert s_static["throughput_tok_s"] < 0.8 * min(gne_tok, mu_tok) and s_static["ttft_p50"] > 10, "static is far behind"
assert abs(gne_tok - mu_tok) / mu_tok < 0.05, "below saturation both serve the offered load"

# %% [markdown]
# 在 {{R}} req/s 下，`GUARANTEED_NO_EVICT` 与 `MAX_UTILIZATION` 的吞吐几乎相同（{{gne_tok:.0f}} 与 {{mu_tok:.0f}} tok/s）——两者都跟得上到达的负载，
# 差别全在延迟的分布上。`STATIC_BATCH` 的饱和吞吐只有 {{s_static["throughput_tok_s"]:.0f}} tok/s，平均每步只有 {{static_batch:.1f}} 个请求：
# 一批请求在第一步就定下来（之后有请求在进行中，谁也不能加入），先结束的请求留下的空位一直空到最慢的成员结束——这正是第 4 章的静态批处理，
# 也是 in-flight batching 要解决的问题。
#
# 小结这一节的取舍：
#
# | | `GUARANTEED_NO_EVICT` | `MAX_UTILIZATION` | `STATIC_BATCH` |
# |---|---|---|---|
# | 接纳时检查 | 请求跑到结束的全部块 | 这一步要的块 | 同 GNE，且没有请求在进行中 |
# | 暂停（抢占） | 从不 | 放不下时暂停最后开始的请求 | 从不 |
# | 代价 | 预留多于实际占用，TTFT 先变差 | 暂停与重算，TPOT 尾部变长 | 批被最慢的成员拖住 |
#
# ## 15.5 微批调度器：`max_num_tokens` 与分块
#
# 容量调度器决定“谁能占 KV”，微批调度器决定“这一步算多少”。长提示在不分块时要一步算完：它所在的那一步，
# 正在解码的请求都得等这次长预填充——第 11 章的**生成停顿**。下面换一个 RAG 式负载（提示词中位数 {{RAG_P["prompt"]}}、最长 {{RAG_P["prompt_max"]}}；
# 输出中位数 {{RAG_P["output"]}}），到达率 {{RAG_P["rate"]}} req/s、每次 {{RAG_P["n"]}} 个请求（约 {{RAG_P["n"] / RAG_P["rate"]:.0f}} s 的到达），
# {{len(SEEDS)}} 个种子，在同一台 A10 上、`GUARANTEED_NO_EVICT` 下比较：不分块
# （默认的 `max_num_tokens` = {{TRT["max_num_batched_tokens"]}}）与分块（`max_num_tokens` 取 {{[T for m, T in MICRO if m == "chunked"]}}）。
# 生成停顿看**每个 Token 间隔**（ITL）的 p99；每格是 {{len(SEEDS)}} 个种子的中位数与最小–最大：

# %%
RAG = dict(input_len=lognormal(median=RAG_P["prompt"], sigma=0.4, max=RAG_P["prompt_max"]),
           output_len=lognormal(median=RAG_P["output"], sigma=0.5, max=512))
rag = {seed: synthetic(RAG_P["n"], RAG_P["rate"], **RAG, seed=seed) for seed in SEEDS}
assert all((w.prompt_lens + w.output_lens).max() <= pool_tokens for w in rag.values()), "every RAG request fits the pool"
keys = [(mode, T, seed) for seed in SEEDS for mode, T in MICRO]
msd = dict(zip(keys, tune.summaries([(rag[seed], {**SIM, "max_num_batched_tokens": T, "enable_chunked_prefill": mode == "chunked"})
                                     for mode, T, seed in keys], trim=TRIM)))
ms = {(mode, T): {k: float(np.median([msd[mode, T, seed][k] for seed in SEEDS])) for k in ("ttft_p50", "ttft_p99", "itl_p99",
                                                                                         "tpot_p50", "throughput_tok_s")}
      for mode, T in MICRO}


def mm(mode, T, key, scale=1.0, fmt=".2f"):
    """Median (min-max) over the seeds of one summary key, as the table prints it."""
    v = [msd[mode, T, seed][key] * scale for seed in SEEDS]
    return f"{np.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


fig, ax = plt.subplots(figsize=(6.5, 3.2))
for mode, T in MICRO:
    xs = [msd[mode, T, seed]["ttft_p50"] for seed in SEEDS]
    ys = [msd[mode, T, seed]["itl_p99"] * 1e3 for seed in SEEDS]
    ax.scatter(xs, ys, s=12, color="C3" if mode != "chunked" else "C0", alpha=0.6)
    ax.annotate(f"{mode}, {T}", (np.median(xs), np.median(ys)), fontsize=7, xytext=(4, 2), textcoords="offset points")
ax.set(xlabel="TTFT p50 (s)", ylabel="ITL p99 (ms)", title=f"max_num_tokens and chunking, RAG-like load on A10 (GNE), "
       f"{len(SEEDS)} seeds")
ax.grid(alpha=0.3)
plt.show()
md_table(["config", "max_num_tokens", "TTFT p50 (s)", "TTFT p99 (s)", "ITL p99 (ms)", "TPOT p50 (ms)", "output tok/s"],
         [[mode, T, mm(mode, T, "ttft_p50"), mm(mode, T, "ttft_p99"), mm(mode, T, "itl_p99", 1e3, ".0f"),
           mm(mode, T, "tpot_p50", 1e3, ".0f"), mm(mode, T, "throughput_tok_s", 1, ".0f")] for mode, T in MICRO])

# %% tags=["nbval-check-output"]
stall_off, stall_256 = ms["no chunking", 8192]["itl_p99"], ms["chunked", 256]["itl_p99"]
ttft_off, ttft_256 = ms["no chunking", 8192]["ttft_p50"], ms["chunked", 256]["ttft_p50"]
cut = [msd["chunked", 256, seed]["itl_p99"] / msd["no chunking", 8192, seed]["itl_p99"] for seed in SEEDS]
print(f"medians: ITL p99 {stall_off * 1e3:.0f} -> {stall_256 * 1e3:.0f} ms, TTFT p50 {ttft_off:.2f} -> {ttft_256:.2f} s; "
      f"ITL p99 ratio per seed {[round(c, 2) for c in cut]}")

# %% tags=["check"]
assert max(cut) < 0.5, "the prose says small chunks cut the decode stall by more than half, on every seed"
assert all(msd["chunked", 256, seed]["ttft_p50"] > msd["no chunking", 8192, seed]["ttft_p50"] for seed in SEEDS), \
    "the prose says small chunks cost TTFT, on every seed"

# %% [markdown]
# 不分块时 ITL 的 p99 是 {{stall_off * 1e3:.0f}} ms（中位数）——一个上千 Token 的预填充在 A10 上要这么久，这一步里所有解码都停着；
# 分块、`max_num_tokens` = {{MICRO[-1][1]}} 时降到 {{stall_256 * 1e3:.0f}} ms，代价是 TTFT 的中位数从 {{ttft_off:.2f}} s 升到 {{ttft_256:.2f}} s：
# 一段长提示要分好几步才算完。两个方向在**每个种子上**都成立（ITL p99 之比 {{min(cut):.2f}}–{{max(cut):.2f}}），种子之间的差别远小于配置之间的差别。
# 这与第 11 章 vLLM 上的结论相同；TensorRT-LLM 的特殊之处只在于生成请求先占预算、切短的块取整到 `tokens_per_block`。
#
# 换挡换来的是不是更多的服务容量？以本章的 SLO（TTFT ≤ {{SLO["ttft"]:g}} s、TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms）对不分块与分块
# `max_num_tokens` = {{CAP_PAIR["chunked, 512"]["max_num_batched_tokens"]}} 各在每个种子上二分容量（`tune.capacities`，{{RAG_CAP["lo"]:g}}–{{RAG_CAP["hi"]:g}} req/s，
# 每次 {{RAG_CAP["duration_s"]:.0f}} s 的到达，区间两端相差不到 {{RAG_CAP["tol"]:.0%}} 为止）：

# %% tags=["nbval-check-output"]
cap_rag_wl = {seed: synthetic(int(RAG_CAP["hi"] * RAG_CAP["duration_s"]) + 1, RAG_P["rate"], **RAG, seed=seed) for seed in SEEDS}
rag_cap = dict(zip(CAP_PAIR, (f.estimate for f in tune.capacities(cap_rag_wl, list(CAP_PAIR.values()), SLO, **RAG_CAP, **SIM))))
md_table(["config", "capacity (req/s): median (min–max)", "per seed"],
         [[name, f"{e:.2f}", " / ".join(f"{c:.2f}" for c in e.per_seed)] for name, e in rag_cap.items()])
chunk_gain = rag_cap["chunked, 512"].median / rag_cap["no chunking, 8192"].median - 1
chunk_paired = all(c >= n for n, c in zip(rag_cap["no chunking, 8192"].per_seed, rag_cap["chunked, 512"].per_seed))
print(f"chunked vs not: {tune.verdict(rag_cap['chunked, 512'], rag_cap['no chunking, 8192'])}, median {chunk_gain:+.0%}; "
      f"chunked >= not on every seed: {chunk_paired}")

# %% tags=["check"]
assert chunk_paired and tune.verdict(rag_cap["chunked, 512"], rag_cap["no chunking, 8192"]) == "overlap", \
    "the prose: chunking never lowers the capacity on a seed, but the seeds do not separate the two"

# %% [markdown]
# 分块后容量的中位数是 {{rag_cap["chunked, 512"]:.2f}} req/s，不分块是 {{rag_cap["no chunking, 8192"]:.2f}} req/s（中位数与最小–最大）。
# 在每个种子上，分块的容量都不低于不分块（同一个种子上的成对比较），中位数高 {{chunk_gain:.0%}}；但两者的范围重叠（`tune.verdict`：
# {{tune.verdict(rag_cap["chunked, 512"], rag_cap["no chunking, 8192"])}}），以 {{len(SEEDS)}} 个种子、{{RAG_CAP["tol"]:.0%}} 的二分精度，
# **不能说分块提高了容量**。站得住的是：分块没有降低容量，却把 ITL 的 p99 降到了不分块时的
# {{ms["chunked", 512]["itl_p99"] / ms["no chunking", 8192]["itl_p99"]:.0%}}（{{CAP_PAIR["chunked, 512"]["max_num_batched_tokens"]}}）到
# {{ms["chunked", 256]["itl_p99"] / ms["no chunking", 8192]["itl_p99"]:.0%}}（{{MICRO[-1][1]}}）。
# TensorRT-LLM 默认**不分块**、`max_num_tokens` = {{TRT["max_num_batched_tokens"]}}：对长提示的 RAG 负载，打开 `enable_chunked_prefill`
# 并调小 `max_num_tokens`，是在 TTFT 与解码平稳之间换挡。
#
# ## 15.6 在真实的 tiny 模型上：贪心输出不变
#
# 容量策略与微批规则只决定**什么时候**算，不改变**算出什么**。用嵌入的 tiny 模型验证：一组请求同时到达，
# 在默认引擎与 `trtllm` 预设的几种变体下各跑一遍——包括池很小、`MAX_UTILIZATION` 必然暂停与重算的情形，
# 以及分块、`STATIC_BATCH`。所有运行的贪心输出必须逐 Token 相同：

# %% tags=["nbval-check-output"]
tiny_wl = synthetic(8, float("inf"), input_len=24, output_len=40, seed=0)
TINY_VARIANTS = {
    "default engine (continuous)": dict(),
    "trtllm preset (GNE)": dict(preset="trtllm"),
    "trtllm, MU, 12 blocks of 16": dict(preset="trtllm", capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=12,
                                        block_size=16),
    "trtllm, GNE, 12 blocks of 16": dict(preset="trtllm", num_kv_blocks=12, block_size=16),
    "trtllm, chunked, 64 tokens": dict(preset="trtllm", enable_chunked_prefill=True, max_num_batched_tokens=64),
    "trtllm, STATIC_BATCH, 4 seqs": dict(preset="trtllm", capacity_scheduler_policy="STATIC_BATCH", max_num_seqs=4),
}
tiny_runs = {name: run(tiny_wl, model="tiny", **kw) for name, kw in TINY_VARIANTS.items()}
ref_tokens = [q.output_token_ids for q in tiny_runs["default engine (continuous)"].requests]
for name, r in tiny_runs.items():
    same = [q.output_token_ids for q in r.requests] == ref_tokens
    print(f"{name:<30} steps {len(r.steps):>3}, pauses {r.summary()['num_preemptions']:>2}, identical to default: {same}")
    assert same, "greedy outputs must not depend on the scheduling rules"
tiny_pauses = tiny_runs["trtllm, MU, 12 blocks of 16"].summary()["num_preemptions"]
assert tiny_pauses > 0 and tiny_runs["trtllm, GNE, 12 blocks of 16"].summary()["num_preemptions"] == 0

# %% [markdown]
# {{len(tiny_wl)}} 个请求（提示 {{tiny_wl.prompt_lens[0]}} Token、各生成 {{tiny_wl.output_lens[0]}} 个）挤在
# {{TINY_VARIANTS["trtllm, MU, 12 blocks of 16"]["num_kv_blocks"]}} 块的池里，`MAX_UTILIZATION` 暂停了 {{tiny_pauses}} 次，
# 被暂停的请求重算上下文后接着生成，输出与默认引擎逐 Token 相同；同样的池，`GUARANTEED_NO_EVICT` 一次也不暂停，只是让后来的请求多等。
# `STATIC_BATCH` 限 {{TINY_VARIANTS["trtllm, STATIC_BATCH, 4 seqs"]["max_num_seqs"]}} 个请求时步数最多
# （{{len(tiny_runs["trtllm, STATIC_BATCH, 4 seqs"].steps)}} 步）：一批跑到最慢的成员结束，下一批才开始。
#
# ## 15.7 动手：容量策略 × `max_num_tokens` × 分块
#
# 下面的控件在 15.4 节的聊天负载上（种子 1）运行一次，画出 KV 的占用与预留，并打印稳态指标。建议试试：到达率 1.6 时在
# `GUARANTEED_NO_EVICT` 与 `MAX_UTILIZATION` 之间切换，看橙线（预留）与蓝线（占用）的差距；把到达率推到 2.2，看暂停变多、TPOT 尾部变长；
# 打开分块并把 `max_num_tokens` 调到 256，看 TTFT 与 ITL 怎样变化。

# %% tags=["nbval-ignore-output"]
def explore(policy="GUARANTEED_NO_EVICT", rate=1.6, max_num_tokens=8192, chunked=False):
    trace = []
    r = run(synthetic(240, rate, **CHAT, seed=1), **SIM, capacity_scheduler_policy=policy,
            max_num_batched_tokens=max_num_tokens, enable_chunked_prefill=chunked, on_step=kv_trace(trace))
    s = r.summary(slo=SLO, trim=TRIM)
    t, used, reserved = map(np.array, zip(*trace))
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.plot(t, used, lw=0.8, label="blocks used")
    ax.plot(t, reserved, lw=0.8, color="C1", label="blocks reserved to finish")
    ax.axhline(pool_blocks, color="k", ls=":", lw=1)
    ax.set(xlabel="time (s)", ylabel="KV blocks", title=f"{policy}, {rate:g} req/s, max_num_tokens {max_num_tokens}, "
                                                       f"{'chunked' if chunked else 'no chunking'}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    plt.show()
    print(f"steady state: {s['throughput_tok_s']:.0f} tok/s, TTFT p50/p99 {s['ttft_p50']:.2f}/{s['ttft_p99']:.2f} s, "
          f"TPOT p99 {s['tpot_p99'] * 1e3:.0f} ms, ITL p99 {s['itl_p99'] * 1e3:.0f} ms, pauses {s['num_preemptions']}, "
          f"KV used {s['kv_util_mean']:.0%}, SLO attainment {s['slo_attainment']:.0%}")


W.interact(explore,
           policy=W.Dropdown(options=list(POLICIES), value="GUARANTEED_NO_EVICT", description="policy"),
           rate=W.FloatSlider(value=1.6, min=0.4, max=2.6, step=0.2, continuous_update=False, description="req/s"),
           max_num_tokens=W.Dropdown(options=[256, 512, 1024, 2048, 4096, 8192], value=8192, description="max_num_tokens"),
           chunked=W.Checkbox(value=False, description="enable_chunked_prefill"));

# %% [markdown]
# ## 15.8 可选：压测一个真实的 TensorRT-LLM 服务
#
# 如果你有一台装好 TensorRT-LLM 的 GPU 机器，用 `trtllm-serve <model>` 起一个 OpenAI 兼容的服务，
# 把它的地址写进环境变量 `TRTLLM_BASE_URL`（例如 `http://127.0.0.1:8000`）再运行下一格：它用 `.venv/bin/python -m minibatch bench serve`（即内核所用的解释器，`sys.executable`）
# 发一组与 15.4 节长度相近的随机请求，打印与 `vllm bench serve` 格式相同的结果表。没有配置或连不上时，这一格只打印一句说明，不会出错。
# `TRTLLM_BENCH_ARGS` 可以追加 `bench serve` 的参数（例如 `--request-rate 4 --num-prompts 200`）。

# %% tags=["nbval-ignore-output"]
def bench_real_server(env_var, name, extra_env):
    """Benchmark the server at $env_var with `python -m minibatch bench serve`, if one is configured and answers."""
    url = os.environ.get(env_var, "").rstrip("/")
    if not url:
        print(f"skipped: no {name} server configured (set {env_var}=http://HOST:PORT to benchmark one)")
        return None
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=3) as resp:
            resp.read()
    except Exception as e:   # any failure to connect: say so and move on
        print(f"skipped: {name} server at {url} did not answer ({type(e).__name__}: {e})")
        return None
    cmd = [sys.executable, "-m", "minibatch", "bench", "serve", "--base-url", url, "--dataset", "random",
           "--random-input-len", "192", "--random-output-len", "256", "--num-prompts", "100", "--request-rate", "2",
           "--tokenizer", "tiny", "--metric-percentiles", "50,90,99", "--goodput", "ttft:1000", "tpot:60",
           *os.environ.get(extra_env, "").split()]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        print(out.stdout[-4000:] or out.stderr[-2000:])
    except Exception as e:
        print(f"benchmark did not complete: {type(e).__name__}: {e}")
    return None


bench_real_server("TRTLLM_BASE_URL", "TensorRT-LLM", "TRTLLM_BENCH_ARGS")

# %% [markdown]
# 对照真实服务时记得：`trtllm-serve` 的默认值与本章的预设相同（`GUARANTEED_NO_EVICT`、不分块、`max_num_tokens` {{TRT["max_num_batched_tokens"]}}），
# KV 池的大小由 `KvCacheConfig.free_gpu_memory_fraction` 决定；模拟器的步长来自屋顶线代价模型，绝对数值会与真实 GPU 有出入，
# 要比较的是策略之间的相对变化。
#
# ## 小结
#
# - TensorRT-LLM 每次迭代调度两遍：容量调度器按 KV 决定谁能占资源（可能暂停请求），微批调度器在 `max_batch_size` 与
#   `max_num_tokens` 之内决定这一步算什么。1.x 的默认值：`GUARANTEED_NO_EVICT`、不分块、`max_num_tokens` {{TRT["max_num_batched_tokens"]}}、
#   `max_batch_size` {{TRT["max_num_seqs"]}}、`tokens_per_block` {{TRT["block_size"]}}。
# - `GUARANTEED_NO_EVICT` 为每个请求预留跑到结束的全部块，从不暂停，TPOT 稳定，但预留远多于实际占用，负载升高时 TTFT 先越过 SLO；
#   `MAX_UTILIZATION` 只看这一步的块，KV 用得更满、服务容量更高，代价是暂停与重算；它暂停最后开始的请求，并在那里结束本次迭代的遍历。
#   `STATIC_BATCH` 是请求级批处理，只作对照。
# - 微批调度器让生成请求先占预算，上下文按 FCFS 分块，切短的块取整到 `tokens_per_block`；不分块时长提示造成生成停顿，
#   分块加小的 `max_num_tokens` 换来平稳的 ITL，代价是 TTFT。
# - minibatch 用 `trtllm` 策略（到达顺序 + 三个调度器开关）和三种准入模式复现这些规则；编写本章时按源码修正了暂停后的遍历终点。
# - 调度只改变先后，不改变结果：贪心输出在所有变体下逐 Token 相同。
#
# 下一章（第 16 章）看另一种路由式的设计：TGI 的路由器怎样决定何时暂停解码、插入预填充（TGI 自 2025-12 起处于维护模式，
# 仓库 `README.md` 顶部的说明由 commit 55f7f7cb 加入，第 16 章开头有出处）。
#
# ## 练习
#
# 1. **预测暂停。** 在 15.2 节的暂停例子里，把 `b` 的到达时间改为 3.5（晚于 `w`），再运行 `decide`。谁被暂停？`w` 能不能进来？先用规则推，再运行验证。
# 2. **`max_tokens` 设大了。** 模拟器总是生成满 `max_tokens`，所以 15.4 节的预留恰好等于实际需要。假设用户把 `max_tokens` 设成实际输出的 2 倍，
#    用 $r_i$ 的公式估算 `GUARANTEED_NO_EVICT` 同时能容纳的请求数会变成多少（提示：池 {{pool_blocks}} 块、平均提示与输出见 15.4 节）。
#    它对 `MAX_UTILIZATION` 有没有影响？
# 3. **两步前瞻。** `MaxUtilizationScheduler` 的 `twoStepsLookAhead`（较新版本叫 `manyMicroBatches`）让生成请求按两步的增长预留块。
#    写一个 `Admission` 子类近似它（提示：在 `minibatch.admission` 里看 `Admission.can_admit` 的签名），比较暂停次数。
# 4. **分块单位。** 把 15.3 节的预算从 37 改成 40、41，`n` 各拿到几个 Token？`block_size` 改为 1 时 `trtllm` 与 `continuous` 的结果还有区别吗？
# 5. **真实服务。** 如果有 GPU，分别以 `GUARANTEED_NO_EVICT` 与 `MAX_UTILIZATION` 起服务（`trtllm-serve --extra_llm_api_options`
#    指向的 YAML 里写 `scheduler_config: {capacity_scheduler_policy: MAX_UTILIZATION}`），用 15.8 节的单元格在几个到达率下压测，
#    与 15.4 节的趋势对照。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 顺序变成 `a, c, w, b`（按到达时间）。`a` 要一块，最后开始的请求是 `b`（它在列尾），`b` 被暂停、释放 2 块，`a` 拿 1 块；
#    遍历终点移到 `b`，`c` 与 `w` 都在它前面：`c` 照常解码，`w` 拿剩下的 1 块。`decide` 给出 {{ex1[0]}}，暂停 {{ex1[1]}}。
# 2. 每个请求的预留变成 $\lceil (p + 2o)/B \rceil$。种子 1 的负载平均提示 {{mean_p:.0f}}、输出 {{mean_o:.0f}} Token，预留从约 {{mean_p + mean_o:.0f}}
#    增到约 {{mean_p + 2 * mean_o:.0f}} Token，同时容纳的请求数变为原来的 {{over_ask:.0%}} 左右，TTFT 会更早越过 SLO。`MAX_UTILIZATION` 只看当前的块，不受影响（`max_tokens` 只决定何时停止）。
# 3. 一个简单的近似：子类化 `Admission`（保持 `evicts = True`），在 `can_admit` 里要求接纳新请求后空闲块仍不少于运行中的请求数
#    （`sched.kv.num_free_blocks - 新请求这一步要的块 >= len(sched.running)`），即为每个生成请求的下一步增长多留一块；
#    用 `engine.scheduler.admission = ...` 换上它。暂停次数应下降，KV 占用略降。
# 4. 预算 40：解码 2、`p` 30，剩 8，`n` 得 {{ex4[40]}}（恰好一块）；41：剩 9，取整后 `n` 得 {{ex4[41]}}。`block_size=1` 时取整不起作用，两者相同。
# 5. 真实服务的 KV 池与步长不同，绝对数值不可比；应能看到 `MAX_UTILIZATION` 在高负载下 TTFT 更低、偶有请求被暂停（服务端日志或
#    `/metrics` 里的统计），`GUARANTEED_NO_EVICT` 的 TPOT 更平稳。
#
# </details>
