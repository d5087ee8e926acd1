# %% [markdown]
# # 第 10 章 vLLM 的连续批处理与关键参数
#
# 部署 vLLM 时，真正决定批处理行为的只有少数几个参数：一步最多算多少个新 Token（`max_num_batched_tokens`，Token 预算），
# 一步最多容纳多少个请求（`max_num_seqs`），以及拿多少显存给 KV Cache（`gpu_memory_utilization`，它决定 KV 块的个数）。
# 第 1 章 1.6 节的 RAG 案例调的正是前两个（`--max-num-seqs 8 --max-num-batched-tokens 4096`），并用第三个解决了显存占用偏高的问题。
#
# 本章先读 vLLM V1 调度器的核心思想——每个请求只是把 `num_computed_tokens` “追”到 `num_tokens`——并在 minibatch 里看到同一件事；
# 然后推导 `gpu_memory_utilization` 到 KV 块数的公式，查清 vLLM 的默认值从哪里来（它们因 `vllm serve` 与 `LLM` 类、因 GPU 型号而不同）；
# 最后在模拟器里，对 Llama-2-7B / A100-80G 在稳态（Steady State）下逐个扫描这三个参数，用 SLO 下的服务容量（Capacity）衡量它们的效果。
#
# 本章引用的 vLLM 源码版本均为 **vLLM v0.11.0**（PyPI 的 `vllm==0.11.0`），每个文件与名字都在该版本的源码中核对过。
#
# ## 学习目标
#
# - 理解 vLLM V1 统一的 step：没有“预填充阶段”和“解码阶段”，调度器只给每个请求分配 Token，让 `num_computed_tokens` 追上 `num_tokens`；
#   并能在 minibatch 的逐步记录中指认出预填充、分块、解码与重算；
# - 能从显存预算推导出 KV 块数：$N_\text{blocks} = \lfloor (M\cdot u - W - A) / (L \cdot \text{page}) \rfloor$，并算出 7B/13B 在 A100/H100 上的块数；
# - 知道 vLLM v0.11.0 的 `max_num_batched_tokens`、`max_num_seqs` 默认值写在哪里、如何随使用场景（`vllm serve` 与 `LLM` 类）和 GPU 变化；
# - 会在稳态下测量服务容量（达成率 ≥ 90% 时的最高到达率），并用它比较三个参数的不同取值。

# %%
import dataclasses
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np

from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.results import capacity
from minibatch.runner import run
from minibatch.sim import ModelDoesNotFitError, get_model_spec, make_cost_model
from minibatch.sim.cost_model import DEFAULT_ACTIVATION_RESERVE_BYTES, RooflineCostModel
from minibatch.sim.executor import SimExecutor
from minibatch.viz import md_table
from minibatch.workload import load_workload

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter
GiB = 2**30
ENGINE = EngineConfig()              # minibatch's defaults
MAX_LEN = 4096                       # max_model_len of this chapter's workloads
print("simulated server:", make_cost_model("llama-2-7b", "a100-80g"))

# %% [markdown]
# ## 10.1 统一的 step：把 `num_computed_tokens` 追到 `num_tokens`
#
# vLLM V1 的调度器 `Scheduler.schedule`（`vllm/v1/core/sched/scheduler.py`）开头有一段作者注释（NOTE(woosuk)），大意是：
# 调度器里**没有“解码阶段”，也没有“预填充阶段”**。每个请求只有 `num_computed_tokens` 和 `num_tokens_with_spec`
# （提示 + 已生成 + 投机解码的草稿 Token 数）；每一步，调度器给各个请求分配 Token，让它们的 `num_computed_tokens` 追上 `num_tokens_with_spec`。
# 注释说这足以统一表达分块预填充、前缀缓存、投机解码（Speculative Decoding），以及将来的 “jump decoding”。
#
# minibatch 的调度器是同样的设计（第 5、9 章）：一步给请求 $i$ 的新 Token 数是
#
# $$
# n_i = \min\bigl(\texttt{num\_tokens}_i - \texttt{num\_computed\_tokens}_i,\ \text{剩余预算}\bigr),
# $$
#
# 算完之后 `num_computed_tokens` 加上 $n_i$；两个计数器一旦相等，请求就采样出下一个 Token，`num_tokens` 随之加一，差值又回到 1。
# 用模拟器跑几个同时到达的请求，Token 预算很小、KV 池也故意给得很小（于是会切块、会抢占），逐步记下两个计数器：

# %% tags=["nbval-check-output"]
DEMO = dict(num_kv_blocks=60, block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
eng = LLMEngine(EngineConfig.from_kwargs(**SIM, **DEMO), clock="virtual")
SPECS = {"R0": (400, 60), "R1": (300, 120), "R2": (200, 80), "R3": (250, 40)}   # prompt tokens, output tokens
for rid, (p, o) in SPECS.items():
    eng.add_request([7] * p, SamplingParams(max_tokens=o, ignore_eos=True), request_id=rid)
hist = {rid: [(0, p)] for rid, (p, _) in SPECS.items()}     # (num_computed_tokens, num_tokens) after each step
grants = []                                                 # (step, request, n, gap before the step)
schedule = eng.scheduler.schedule


def spy(now):
    batch = schedule(now)
    grants.extend((len(eng.steps), r.request_id, n, r.num_tokens - r.num_computed_tokens) for r, n in batch.items)
    return batch


eng.scheduler.schedule = spy
while eng.has_unfinished_requests():
    eng.step()
    for rid, r in eng.requests.items():
        hist[rid].append((r.num_computed_tokens, r.num_tokens))
budget_used = [s.num_prefill_tokens + s.num_decode_tokens for s in eng.steps]
print(f"{len(eng.steps)} steps, {sum(s.num_preempted for s in eng.steps)} preemption(s), "
      f"max tokens in a step {max(budget_used)} (budget {DEMO['max_num_batched_tokens']})")

# %% tags=["check"]
# The rule, checked on every grant: n never exceeds the gap, and only the budget makes it smaller.
for k, rid, n, gap in grants:
    assert 1 <= n <= gap, (k, rid, n, gap)
    assert n == gap or budget_used[k] == DEMO["max_num_batched_tokens"], f"step {k}: {rid} got {n} of {gap}"

# %%
kinds = {"prefill chunk": sum(1 for *_, n, gap in grants if 1 < n < gap),
         "prefill (whole rest)": sum(1 for *_, n, gap in grants if 1 < n == gap),
         "decode": sum(1 for *_, n, gap in grants if n == 1)}
preempted = [rid for rid, h in hist.items() if any(b[0] < a[0] for a, b in zip(h, h[1:]))]
print("grants by kind:", kinds, "| preempted and recomputed:", preempted)

fig, axes = plt.subplots(1, 4, figsize=(12, 2.8), sharey=True)
for ax, (rid, h) in zip(axes, hist.items()):
    h = np.array(h)
    ax.plot(h[:, 1], "--", color="0.4", lw=1, label="num_tokens")
    ax.plot(h[:, 0], color="C1", lw=1.6, label="num_computed_tokens")
    ax.set(title=f"{rid}: prompt {SPECS[rid][0]}, output {SPECS[rid][1]}", xlabel="step")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("tokens")
axes[0].legend(fontsize=7, loc="lower right")
fig.suptitle(f"Every request just catches num_computed_tokens up to num_tokens (simulated 7B, budget "
             f"{DEMO['max_num_batched_tokens']}, {DEMO['num_kv_blocks']} KV blocks)", fontsize=10)
fig.tight_layout()
plt.show()
victim = preempted[0]

# %% [markdown]
# 预算是 {{DEMO["max_num_batched_tokens"]}} 个 Token，KV 池只有 {{DEMO["num_kv_blocks"]}} 个块（每块 {{DEMO["block_size"]}} 个 Token）。
# {{len(SPECS)}} 个请求同时到达，{{len(SPECS)}} 幅图里只有一种运动：橙线（`num_computed_tokens`）去追虚线（`num_tokens`）。陡峭的台阶是预填充——一步最多上升一个预算，
# 长提示要爬好几级（分块预填充，{{kinds["prefill chunk"]}} 次分配）；两线重合后一起每步上升 1，这是解码（{{kinds["decode"]}} 次分配）；
# {{victim}} 的橙线在 KV 池用尽时跌回 0——它被抢占、KV 被释放（Recompute）——随后以同样的台阶追回提示加已生成的全部 Token。
# 前面折叠的检查单元格对每一次分配检查了同一条规则：$n$ 从不超过差值，只有在预算用完的那一步才会小于差值。
# 调度器不需要知道请求处在哪个“阶段”。
#
# ## 10.2 `gpu_memory_utilization` 与 KV 块数
#
# vLLM 启动时先加载权重，再用一次“假”的前向（`GPUModelRunner.profile_run`，输入长度为 `max_num_batched_tokens`）测出激活的峰值，
# 剩下的显存全部切成 KV 块。v0.11.0 中的计算分三处：
#
# 1. `Worker.init_device`（`vllm/v1/worker/gpu_worker.py`）：`requested_memory = total_memory * gpu_memory_utilization`——
#    利用率乘的是**显卡总显存**，不是空闲显存；若启动时空闲显存少于它，直接报错。
# 2. `Worker.determine_available_memory`（同一文件）：可用于 KV 的字节数 = `requested_memory - non_kv_cache_memory`，
#    其中 `non_kv_cache_memory` = 权重 + 激活峰值（`torch_peak_increase`）+ 非 torch 分配的增量（NCCL 与某些注意力后端的缓冲区；
#    `memory_profiling`，`vllm/utils/__init__.py`）。
# 3. `get_num_blocks`（`vllm/v1/core/kv_cache_utils.py`）：`num_blocks = available_memory // page_size // num_layers`，
#    每层每块的字节数 `page_size = 2 * block_size * num_kv_heads * head_size * dtype_bytes`（`AttentionSpec.page_size_bytes`，
#    `vllm/v1/kv_cache_interface.py`；2 是 K 和 V）。
#
# 记总显存 $M$、利用率 $u$、权重 $W$、激活峰值与其他开销 $A$、层数 $L$、块大小 $B$、KV 头数 $H_{kv}$、头维度 $d$、每个元素 $b$ 字节：
#
# $$
# N_\text{blocks} = \left\lfloor \frac{M \cdot u - W - A}{L \cdot 2 B H_{kv} d\, b} \right\rfloor .
# $$
#
# minibatch 的模拟器用同一个公式（`RooflineCostModel.kv_capacity_tokens`），只是 $A$ 不靠实测，而是固定的
# `DEFAULT_ACTIVATION_RESERVE_BYTES`（{{DEFAULT_ACTIVATION_RESERVE_BYTES / GiB:.0f}} GiB），块数 = KV Token 数 // `block_size`（`SimExecutor`）：

# %%
print(inspect.getdoc(RooflineCostModel.kv_capacity_tokens))
print("reserve A =", DEFAULT_ACTIVATION_RESERVE_BYTES / GiB, "GiB")

# %% [markdown]
# 用公式手算 Llama-2-7B 与 13B（bf16）在 A100-40G、A100-80G、H100 上、`gpu_memory_utilization={{ENGINE.gpu_memory_utilization}}`、
# `block_size={{ENGINE.block_size}}`（minibatch 的默认值）的块数，
# 再与模拟器真正建出的 KV 池（`SimExecutor` 读取 `EngineConfig`）对照。放不下的组合（权重加预留超过预算）不进表：

# %%
def blocks_by_hand(model, gpu, util=ENGINE.gpu_memory_utilization, block_size=ENGINE.block_size,
                   reserve=DEFAULT_ACTIVATION_RESERVE_BYTES):
    m, hw = get_model_spec(model), make_cost_model(model, gpu).hardware
    page = 2 * block_size * m.num_kv_heads * m.head_dim * m.dtype_bytes          # bytes per block and layer
    free = hw.memory_bytes * util - m.weight_bytes - reserve
    return int(free // (page * m.num_layers)) if free > 0 else None


rows, BLOCKS, BS = [], {}, ENGINE.block_size
for model in ("llama-2-7b", "llama-2-13b"):
    for gpu in ("a100-40g", "a100-80g", "h100"):
        n = blocks_by_hand(model, gpu)
        if n is None:
            continue
        engine_blocks = SimExecutor(EngineConfig.from_kwargs(executor="sim", model=model, hardware=gpu)).num_kv_blocks
        assert engine_blocks == n, (model, gpu, engine_blocks, n)
        m = get_model_spec(model)
        per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes
        BLOCKS[model, gpu] = n
        rows.append([model, gpu, f"{make_cost_model(model, gpu).hardware.memory_bytes / GiB:.0f}",
                     f"{m.weight_bytes / GiB:.1f}", f"{per_token / 2**20:.2f}", f"{n:,}", f"{n * BS:,}",
                     f"{n * BS // MAX_LEN}"])
md_table(["model", "GPU", "memory (GiB)", "weights (GiB)", "KV per token (MiB)", f"blocks ({BS} tokens)", "KV tokens",
          f"{MAX_LEN}-token sequences"], rows)
M7, M13, M70 = (get_model_spec(m) for m in ("llama-2-7b", "llama-2-13b", "llama-2-70b"))
MEM = {g: make_cost_model("llama-2-7b", g).hardware.memory_bytes / GiB for g in ("a100-40g", "a100-80g", "h100")}

# %% tags=["check"]
assert MEM["a100-80g"] == MEM["h100"] and BLOCKS["llama-2-7b", "a100-80g"] == BLOCKS["llama-2-7b", "h100"], \
    "the prose says the same memory gives the same blocks"

# %% [markdown]
# 手算与模拟器建出的块数逐一相等（上面的单元格断言了这一点）。几个读数：
#
# - A100-80G 与 H100（SXM）显存一样大（都是 {{MEM["h100"]:.0f}} GiB），所以块数也一样：Llama-2-7B 有
#   {{BLOCKS["llama-2-7b", "a100-80g"]:,}} 个块，约能同时放下 {{BLOCKS["llama-2-7b", "a100-80g"] * BS // MAX_LEN}} 条 {{MAX_LEN}} Token 的满长序列；两者的差别在算力和带宽（第 2 章），不在 KV 容量。
# - 13B 每个 Token 的 KV 更大（层数 {{M13.num_layers}}、KV 头数 {{M13.num_kv_heads}}，对 7B 的 {{M7.num_layers}}、{{M7.num_kv_heads}}），
#   权重也大到 {{M13.weight_bytes / M7.weight_bytes:.1f}} 倍，同一张 A100-80G 上块数只有 7B 的
#   {{BLOCKS["llama-2-13b", "a100-80g"] / BLOCKS["llama-2-7b", "a100-80g"]:.0%}}；在 A100-40G 上只剩 {{BLOCKS["llama-2-13b", "a100-40g"]:,}} 个块。
#
# 块数对利用率是线性的，但起点是“权重 + 预留”占掉的那一截：

# %%
utils = np.linspace(0.2, 0.95, 31)
fig, ax = plt.subplots(figsize=(7, 3.2))
for (model, gpu), style in zip([("llama-2-7b", "a100-80g"), ("llama-2-13b", "a100-80g"), ("llama-2-7b", "a100-40g"),
                                ("llama-2-13b", "a100-40g")], ["-", "-", "--", "--"]):
    pts = [(u, blocks_by_hand(model, gpu, u)) for u in utils]
    pts = [(u, n) for u, n in pts if n]                       # a config that does not fit is not drawn
    ax.plot(*zip(*pts), style, label=f"{model} on {gpu}")
ax.axvline(ENGINE.gpu_memory_utilization, color="k", ls=":", lw=1)
ax.text(ENGINE.gpu_memory_utilization + 0.005, ax.get_ylim()[1] * 0.9, f"default {ENGINE.gpu_memory_utilization}",
        fontsize=7)
ax.set(xlabel="gpu_memory_utilization", ylabel=f"KV blocks ({BS} tokens each)",
       title="KV blocks vs gpu_memory_utilization (points that do not fit are left out)")
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
plt.show()
u_min_13b_40 = min(u for u in utils if blocks_by_hand("llama-2-13b", "a100-40g", u))

# %% [markdown]
# 13B 在 A100-40G 上要到 `gpu_memory_utilization` ≈ {{u_min_13b_40:.2f}} 才有第一块 KV（曲线从那里才开始）。
# 这也是第 1 章案例里“调整 `gpu-memory-utilization` 解决显存占用偏高”的含义：它只决定 vLLM **占用**多少显存，
# 其中权重与激活是固定的，调低它减少的全是 KV 块，也就是并发能力。
#
# ## 10.3 vLLM 的默认值：随使用场景与 GPU 而变
#
# `max_num_batched_tokens` 与 `max_num_seqs` 在 vLLM 里没有一个固定的默认值。v0.11.0 中它们由三处决定：
#
# - `SchedulerConfig`（`vllm/config/scheduler.py`）字段默认为 `None`；`__post_init__` 的兜底值是 `max_num_seqs = 128`、
#   `max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048`（`vllm/utils/__init__.py`），不分块时取 `max(max_model_len, 2048)`。
#   这是直接构造配置（例如测试）时才用到的值。
# - `EngineArgs._set_default_args`（`vllm/engine/arg_utils.py`）按**使用场景**（`UsageContext`）和 **GPU** 覆盖它们：
#   `vllm serve` 走 `UsageContext.OPENAI_API_SERVER`（`vllm/entrypoints/openai/api_server.py`），
#   离线的 `LLM` 类走 `UsageContext.LLM_CLASS`（`vllm/entrypoints/llm.py`）。GPU 的判断是“总显存 ≥ 70 GiB 且设备名里没有 `a100`”
#   （H100、H200、MI300X 一类）；源码注释说明对 A100 用大预算会降低吞吐（PR #17885），所以特意把 A100 排除在外。
#   最后 `max_num_seqs` 还要与 `max_num_batched_tokens` 取较小值。
# - 同一函数里，生成模型（非 Pooling 模型）一律 `enable_chunked_prefill = True`（“V1 always uses chunked prefills”），前缀缓存也默认打开。
#
# | v0.11.0 默认值 | `vllm serve` | `LLM` 类 |
# |---|---|---|
# | ≥ 70 GiB 且非 A100（H100、H200、MI300X） | `max_num_batched_tokens=8192`，`max_num_seqs=1024` | 16384，1024 |
# | 其他 GPU（含 A100-80G、A10、L4） | 2048，256 | 8192，256 |
# | CPU 后端（`world_size` = TP × PP） | 2048 × ws，128 × ws | 4096 × ws，256 × ws |
# | `gpu_memory_utilization`（`CacheConfig`，`vllm/config/cache.py`） | 0.9 | 0.9 |
# | `block_size`（CUDA，`vllm/platforms/cuda.py`） | 16 | 16 |
#
# 所以同一个模型、同一张 H100，`vllm serve` 每步最多算 8192 个新 Token，而在 Python 里 `LLM(...)` 是 16384；
# 换成 A100，两者分别降到 2048 与 8192。压测报告若不写明参数，这些差别就会被误读成“框架版本”或“硬件”的差别。
#
# minibatch 的 `EngineConfig` 默认值等于 **`vllm serve` 在 A100 上**的取值：

# %%
defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)
            if f.name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "block_size",
                          "enable_chunked_prefill")}
VLLM_SERVE_A100 = dict(max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.9, block_size=16,
                       enable_chunked_prefill=True)
assert defaults == VLLM_SERVE_A100, defaults
print("EngineConfig defaults:", defaults)

# %% [markdown]
# ## 10.4 三个参数的效果：稳态下的服务容量
#
# 现在在模拟器里看这三个参数如何影响 Llama-2-7B / A100-80G 的服务能力。实验的设定：

# %%
SLO = {"ttft": 1.0, "tpot": 0.05}                 # per request, seconds
N_REQ, SEEDS, TARGET, RATE_LO, RATE_HI, TOL = 160, (1, 2), 0.9, 2.0, 10.0, 0.08
TRIM = 0.1                                         # share of the arrival span dropped at each end
RATE, HEAT_RATE = 5.0, 6.0                         # fixed rates of the latency table and of the heat map
wl_stats = load_workload("chat", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=SEEDS[0]).stats()
print(f"chat workload: prompt p50 {wl_stats['input_p50']:.0f}, output p50 {wl_stats['output_p50']:.0f} tokens; "
      f"SLO {SLO}; capacity at >= {TARGET:.0%} attainment, seeds {SEEDS}")

# %% [markdown]
# 方法（第 8 章的方法论，这里严格执行）：
#
# - **负载**：`load_workload("chat")`（按 Azure 2023 对话 trace 拟合，gamma 到达；这份样本的提示中位数 {{wl_stats["input_p50"]:.0f}}、
#   输出中位数 {{wl_stats["output_p50"]:.0f}} 个 Token，长度截到 `max_model_len={{MAX_LEN}}` 以内），每次运行 {{N_REQ}} 个请求。
# - **SLO（对每个请求）**：TTFT ≤ {{SLO["ttft"]:g}} s 且 TPOT ≤ {{SLO["tpot"] * 1e3:.0f}} ms，两条都满足才算达标。
# - **稳态**：只统计到达时刻落在运行中间 {{1 - 2 * TRIM:.0%}} 的请求（`summary(trim={{TRIM}})`，`minibatch.results.steady_state`），
#   去掉开头空载与结尾排空的部分。
# - **服务容量**：达成率 ≥ {{TARGET:.0%}} 的最高到达率（DistServe 的定义），用 `minibatch.results.capacity` 在
#   {{RATE_LO:g}}–{{RATE_HI:g}} req/s 之间二分搜索（相对分辨率 {{TOL:.0%}}，所以不同种子常落在同一个值上）；
#   每个配置用 {{len(SEEDS)}} 个随机种子（不同的到达与长度）各搜一次，报告均值与范围。

# %% tags=["nbval-check-output"]


def attainment(rate, seed, **cfg):
    wl = load_workload("chat", n=N_REQ, rate=rate, max_len=MAX_LEN, seed=seed)
    return run(wl, **SIM, **cfg).summary(slo=SLO, trim=TRIM)["slo_attainment"]


_cap_cache = {}


def capacity_of(**cfg):
    """Steady-state capacity (req/s) per seed for one engine configuration."""
    key = tuple(sorted({**VLLM_SERVE_A100, **cfg}.items()))
    if key not in _cap_cache:
        _cap_cache[key] = [capacity(lambda r: attainment(r, s, **cfg), target=TARGET, lo=RATE_LO, hi=RATE_HI,
                                    tol=TOL) for s in SEEDS]
    return _cap_cache[key]


SWEEPS = {"max_num_batched_tokens": [256, 512, 2048, 8192], "max_num_seqs": [16, 32, 256],
          "gpu_memory_utilization": [0.3, 0.5, 0.9]}
caps = {name: {v: capacity_of(**{name: v}) for v in values} for name, values in SWEEPS.items()}
for name, row in caps.items():
    print(name.ljust(24), "  ".join(f"{v}: {np.mean(c):.2f} [{min(c):.2f}, {max(c):.2f}]" for v, c in row.items()))

# %%
BLOCKS_U = {u: blocks_by_hand("llama-2-7b", "a100-80g", u) for u in SWEEPS["gpu_memory_utilization"]}
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), sharey=True)
for ax, (name, row) in zip(axes, caps.items()):
    xs = list(row)
    mean = np.array([np.mean(row[v]) for v in xs])
    lo = mean - np.array([min(row[v]) for v in xs])
    hi = np.array([max(row[v]) for v in xs]) - mean
    colors = ["C3" if v == VLLM_SERVE_A100[name] else "C0" for v in xs]
    ax.bar(range(len(xs)), mean, yerr=[lo, hi], color=colors, capsize=3)
    labels = [f"{v}\n({BLOCKS_U[v]:,} blocks)" if name == "gpu_memory_utilization" else str(v) for v in xs]
    ax.set_xticks(range(len(xs)), labels, fontsize=8)
    ax.set(xlabel=name, title=f"capacity vs {name}")
    ax.grid(axis="y", alpha=0.3)
axes[0].set_ylabel(f"capacity (req/s)\nat >= {TARGET:.0%} SLO attainment")
fig.suptitle(f"llama-2-7b on A100-80G (simulated), chat workload, SLO TTFT <= {SLO['ttft']:g} s and TPOT <= "
             f"{SLO['tpot'] * 1e3:.0f} ms per request; red = vllm serve default on A100, bars = mean over "
             f"{len(SEEDS)} seeds, whiskers = range", fontsize=9)
fig.tight_layout()
plt.show()

# %%
cap = {name: {v: float(np.mean(c)) for v, c in row.items()} for name, row in caps.items()}
S_LO, S_MID, S_DEF = SWEEPS["max_num_seqs"]
U_LO, U_MID, U_DEF = SWEEPS["gpu_memory_utilization"]
B_1, B_2, B_DEF, B_BIG = SWEEPS["max_num_batched_tokens"]
c_def = cap["max_num_seqs"][S_DEF]
best_budget = max(cap["max_num_batched_tokens"], key=cap["max_num_batched_tokens"].get)
little = run(load_workload("chat", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=SEEDS[0]), **SIM).summary(trim=TRIM)
in_system = RATE * little["e2e_mean"]          # Little's law: L = lambda * W
low_kv = run(load_workload("chat", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=SEEDS[0]), **SIM,
             gpu_memory_utilization=U_LO).summary(trim=TRIM)
print(f"at {RATE:g} req/s: {in_system:.0f} requests in the system on average; preemptions with {U_LO}: "
      f"{low_kv['num_preemptions']}, with {U_DEF}: {little['num_preemptions']}")

# %% tags=["check"]
assert S_DEF == VLLM_SERVE_A100["max_num_seqs"] and U_DEF == VLLM_SERVE_A100["gpu_memory_utilization"] \
    and B_DEF == VLLM_SERVE_A100["max_num_batched_tokens"], "the prose's red bars are the defaults"
assert cap["max_num_seqs"][S_LO] < c_def and cap["gpu_memory_utilization"][U_LO] < c_def, \
    "the prose says: too few sequences or too little KV costs capacity"
assert cap["max_num_batched_tokens"][B_1] < cap["max_num_batched_tokens"][B_2], "the prose says 256 is too small"
assert cap["max_num_batched_tokens"][B_BIG] <= c_def * 1.02, "the prose says 8192 gains nothing over 2048"
assert abs(cap["max_num_seqs"][S_MID] - c_def) <= 0.15 * c_def, "the prose says 32 sequences are nearly enough"
assert low_kv["num_preemptions"] > 0 and little["num_preemptions"] == 0, "the prose says little KV means preemptions"

# %% [markdown]
# 读图（每根柱子是 {{len(SEEDS)}} 个种子的均值，须线是范围；红色是 `vllm serve` 在 A100 上的默认值，容量 {{c_def:.2f}} req/s）：
#
# - **`max_num_seqs`**：{{S_LO}} 个序列时容量只有 {{cap["max_num_seqs"][S_LO]:.2f}} req/s。由 Little 定律（第 3 章），这个负载在
#   {{RATE:g}} req/s 下系统里平均有 $\lambda \cdot \overline{E2E}$ = {{RATE:g}} × {{little["e2e_mean"]:.1f}} ≈ {{in_system:.0f}} 个请求；
#   序列上限低于它，多出来的请求只能排队，TTFT 随之爆炸。{{S_MID}} 时容量为 {{cap["max_num_seqs"][S_MID]:.2f}} req/s，已接近默认 {{S_DEF}} 的
#   {{c_def:.2f}} req/s：上限一旦高于系统里的平均请求数，再调大的收益就很小。
# - **`gpu_memory_utilization`**：{{U_LO}} 时 KV 只有 {{BLOCKS_U[U_LO]:,}} 个块，容量降到 {{cap["gpu_memory_utilization"][U_LO]:.2f}} req/s——
#   块不够时请求被抢占、重算（{{RATE:g}} req/s 时稳态窗口内有 {{low_kv["num_preemptions"]}} 次抢占，{{U_DEF}} 时为 {{little["num_preemptions"]}} 次），
#   序列数实际上被 KV 限制住了；{{U_MID}} 时 {{BLOCKS_U[U_MID]:,}} 个块，容量为 {{cap["gpu_memory_utilization"][U_MID]:.2f}} req/s。
# - **`max_num_batched_tokens`**：预算 {{B_1}} 时容量为 {{cap["max_num_batched_tokens"][B_1]:.2f}} req/s：提示要切成太多块，TTFT 变长；
#   {{B_2}} 时 {{cap["max_num_batched_tokens"][B_2]:.2f}} req/s，是这组里{{"最高" if best_budget == B_2 else "较高"}}的；
#   {{B_DEF}} 与 {{B_BIG}} 几乎相同（{{cap["max_num_batched_tokens"][B_DEF]:.2f}} 与 {{cap["max_num_batched_tokens"][B_BIG]:.2f}} req/s）——
#   这份样本里 90% 的提示短于 {{wl_stats["input_p90"]:.0f}} Token，更大的预算只是让少数长提示一步算完，而这一步会拖慢同批所有请求的解码，TPOT 超标。
#   这是第 11 章分块预填充的主题：预算就是分块大小，它在 TTFT 与 TPOT 之间取舍。
#
# 预算的取舍看一个固定到达率下的延迟分布更清楚（{{RATE:g}} req/s，稳态，{{len(SEEDS)}} 个种子的均值）：

# %%
rows, LAT = [], {}
for b in SWEEPS["max_num_batched_tokens"]:
    ss = [run(load_workload("chat", n=N_REQ, rate=RATE, max_len=MAX_LEN, seed=s), **SIM, max_num_batched_tokens=b)
          .summary(slo=SLO, trim=TRIM) for s in SEEDS]
    LAT[b] = {k: float(np.mean([s[k] for s in ss])) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                                                               "itl_p99", "slo_attainment")}
    rows.append([b] + [f"{LAT[b][k] * 1e3:.0f}" for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99")]
                + [f"{LAT[b]['slo_attainment']:.0%}"])
md_table(["max_num_batched_tokens", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL p99 (ms)",
          "SLO attainment"], rows)
assert LAT[B_1]["ttft_p50"] > LAT[B_DEF]["ttft_p50"] and LAT[B_1]["itl_p99"] < LAT[B_DEF]["itl_p99"], \
    "the prose says: a small budget lengthens TTFT and shortens the ITL tail"

# %% [markdown]
# 预算从 {{B_DEF}} 降到 {{B_1}}，TTFT 中位数从 {{LAT[B_DEF]["ttft_p50"] * 1e3:.0f}} ms 升到 {{LAT[B_1]["ttft_p50"] * 1e3:.0f}} ms，
# 而 ITL 的 p99 从 {{LAT[B_DEF]["itl_p99"] * 1e3:.0f}} ms 降到 {{LAT[B_1]["itl_p99"] * 1e3:.0f}} ms：小预算把长提示切碎，
# 每一步都短，解码的 Token 间隔稳定；代价是首 Token 要等更多步。
#
# ## 10.5 两个参数一起看：`max_num_seqs` × `max_num_batched_tokens`
#
# 两个上限共同决定一步的形状。下面的热力图是 {{HEAT_RATE:g}} req/s（接近容量）时稳态的 SLO 达成率（种子 {{SEEDS[0]}}，每格一次运行）：

# %%
GRID_SEQS, GRID_BUDGET = SWEEPS["max_num_seqs"], SWEEPS["max_num_batched_tokens"]
heat = np.array([[run(load_workload("chat", n=N_REQ, rate=HEAT_RATE, max_len=MAX_LEN, seed=SEEDS[0]), **SIM, max_num_seqs=m,
                      max_num_batched_tokens=b).summary(slo=SLO, trim=TRIM)["slo_attainment"]
                  for b in GRID_BUDGET] for m in GRID_SEQS])
fig, ax = plt.subplots(figsize=(5.4, 2.9))
im = ax.imshow(heat, cmap="RdYlGn", vmin=0, vmax=1)
for i in range(len(GRID_SEQS)):
    for j in range(len(GRID_BUDGET)):
        ax.text(j, i, f"{heat[i, j]:.0%}", ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(GRID_BUDGET)), GRID_BUDGET)
ax.set_yticks(range(len(GRID_SEQS)), GRID_SEQS)
ax.set(xlabel="max_num_batched_tokens", ylabel="max_num_seqs",
       title=f"SLO attainment at {HEAT_RATE:g} req/s (steady state, seed {SEEDS[0]})")
fig.colorbar(im, ax=ax, fraction=0.046)
plt.show()
best = np.unravel_index(heat.argmax(), heat.shape)
row16 = heat[GRID_SEQS.index(S_LO)]
big = heat[-1, -1]                   # both limits at their largest

# %% tags=["check"]
assert row16.max() < heat.max() - 0.2, "the prose says the max_num_seqs=16 row is low whatever the budget"
assert all(heat[i, GRID_BUDGET.index(B_BIG)] <= heat[i, GRID_BUDGET.index(B_2)] for i in range(len(GRID_SEQS))), \
    "the prose says no cell of the 8192 column beats the 512 cell of its row"
assert big < heat.max() - 0.1 and (heat == heat.max()).sum() == 1, "the prose says the largest limits are not best"

# %% [markdown]
# 在这个到达率下，达成率最高的格子是 `max_num_seqs={{GRID_SEQS[best[0]]}}`、`max_num_batched_tokens={{GRID_BUDGET[best[1]]}}`
# （{{heat[best]:.0%}}）；两个参数都取最大（{{GRID_SEQS[-1]}}、{{GRID_BUDGET[-1]}}）只有 {{big:.0%}}——都设得“够大”并不是最好的。
# `max_num_seqs={{S_LO}}` 一行无论预算多大都很低（至多 {{row16.max():.0%}}，排队），预算 {{B_BIG}} 一列的每一格都不高于同一行的 {{B_2}}。
# 用下面的控件在其他到达率、其他种子下试试。

# %% tags=["nbval-ignore-output"]
def explore(max_num_seqs=S_DEF, max_num_batched_tokens=B_DEF, rate=RATE, seed=SEEDS[0]):
    res = run(load_workload("chat", n=N_REQ, rate=rate, max_len=MAX_LEN, seed=seed), **SIM, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    s = res.summary(slo=SLO, trim=TRIM)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
    recs = [r for r in res.requests if r.completed]
    a1.scatter([r.arrival_time for r in recs], [r.ttft for r in recs], s=6, label="TTFT")
    a1.axhline(SLO["ttft"], color="C3", ls="--", lw=1)
    a1.set(xlabel="arrival time (s)", ylabel="TTFT (s)", yscale="log", title="TTFT per request")
    a2.scatter([r.arrival_time for r in recs], [1e3 * (r.tpot or 0) for r in recs], s=6, color="C2")
    a2.axhline(1e3 * SLO["tpot"], color="C3", ls="--", lw=1)
    a2.set(xlabel="arrival time (s)", ylabel="TPOT (ms)", title="TPOT per request")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    plt.show()
    print(f"steady-state SLO attainment {s['slo_attainment']:.0%} | TTFT p50/p99 {s['ttft_p50']:.2f}/{s['ttft_p99']:.2f} s"
          f" | TPOT p50/p99 {1e3 * s['tpot_p50']:.0f}/{1e3 * s['tpot_p99']:.0f} ms | preemptions {s['num_preemptions']}")


W.interact(explore,
           max_num_seqs=W.SelectionSlider(options=[8, 16, 32, 64, 128, 256, 512], value=S_DEF, continuous_update=False),
           max_num_batched_tokens=W.SelectionSlider(options=[128, 256, 512, 1024, 2048, 4096, 8192], value=B_DEF,
                                                    continuous_update=False),
           rate=W.FloatSlider(value=RATE, min=1.0, max=9.0, step=0.5, continuous_update=False),
           seed=W.IntSlider(value=SEEDS[0], min=1, max=5, continuous_update=False));

# %% tags=["check"]
# The exercises' settings.
EX_TP, EX_SLO, EX_SEEDS = 4, {"ttft": 3.0, "tpot": 0.1}, 5
ex_tokens_70b = make_cost_model("llama-2-70b", f"{EX_TP}xa100-80g").kv_capacity_tokens()


# %% [markdown]
# ## 本章小结
#
# - vLLM V1 的调度器没有阶段之分：每个请求的 `num_computed_tokens` 每一步追向 `num_tokens`，一步给多少由预算决定。
#   minibatch 的逐步记录显示了同一件事：预填充是陡峭的台阶，分块是多级台阶，解码是每步加一，重算是跌回 0 后再追上来。
# - KV 块数 $N = \lfloor (M u - W - A) / (L\cdot 2BH_{kv}d\,b) \rfloor$：`gpu_memory_utilization` 乘的是总显存，权重与激活峰值先扣掉，
#   剩下的全是 KV。A100-80G 与 H100 显存相同，块数也相同。
# - vLLM v0.11.0 的 `max_num_batched_tokens`/`max_num_seqs` 默认值由 `EngineArgs._set_default_args` 按使用场景与 GPU 决定：
#   H100 一类上 `vllm serve` 是 8192/1024、`LLM` 类是 16384/1024；A100 等其他 GPU 上是 2048/256 与 8192/256。
# - 在稳态、按请求计的 SLO 下：`max_num_seqs` 与 KV 块数太少会让容量大幅下降，够了之后不再有影响；
#   预算有一个最佳区间——太小 TTFT 变长，太大长提示拖慢整批解码。下一章专门研究它。
#
# ## 练习
#
# 1. **手算块数。** Llama-2-70B（{{M70.num_layers}} 层、{{M70.num_kv_heads}} 个 KV 头、`head_dim={{M70.head_dim}}`，
#    bf16 权重约 {{M70.weight_bytes / GiB:.0f}} GiB）用 {{EX_TP}} 张 A100-80G 做张量并行，
#    每张卡放 1/{{EX_TP}} 的权重和 1/{{EX_TP}} 的 KV 头。`gpu_memory_utilization={{ENGINE.gpu_memory_utilization}}` 时每张卡有多少个块？
#    用 `make_cost_model("llama-2-70b", "{{EX_TP}}xa100-80g")` 的 `kv_capacity_tokens()` 验证。
# 2. **激活峰值。** vLLM 的 `profile_run` 用 `max_num_batched_tokens` 个 Token 做一次假前向来测激活峰值。
#    把预算从 {{B_DEF}} 调到 16384（`LLM` 类在 H100 一类 GPU 上的默认值），KV 块数会怎样变化？为什么 `LLM` 类的大预算在显存紧张时可能得不偿失？
# 3. **默认值的陷阱。** 同一台 H100 上，用 `vllm serve` 压测得到的 TPOT p99 比用 `LLM(...)` 离线跑的低得多。
#    结合 10.3 节的表解释原因，并说出让两者可比的最少参数。
# 4. **SLO 换一换。** 把 10.4 节的 SLO 改成 TTFT ≤ {{EX_SLO["ttft"]:g}} s、TPOT ≤ {{EX_SLO["tpot"] * 1e3:.0f}} ms（宽松的交互场景），
#    重新扫描 `max_num_batched_tokens`。最优预算向哪边移动？为什么？（提示：可以只对 {{B_2}} 和 {{B_DEF}} 两个值调用 `capacity_of`。）
# 5. **容量的不确定性。** 把 `SEEDS` 换成 {{EX_SEEDS}} 个种子，`capacity_of(max_num_batched_tokens={{B_2}})` 的范围变宽还是变窄？
#    要让 {{B_2}} 与 {{B_DEF}} 的差别“显著”，你会怎样设计实验？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 每张卡的预算是 ${{ENGINE.gpu_memory_utilization}} M$，减去 1/{{EX_TP}} 的权重与预留；每个 Token 在每张卡上的 KV 是
#    2（K 与 V）× 层数 × 每卡的 KV 头数 × `head_dim` × {{M70.dtype_bytes}} 字节（KV 头平均分到 {{EX_TP}} 张卡），再除以 `block_size`
#    得块数。`kv_capacity_tokens()` 返回的是每张卡的 Token 数，这里是 {{ex_tokens_70b:,}}，即 {{ex_tokens_70b // BS:,}} 个块。
# 2. 激活峰值随一步的 Token 数线性增长，它从 $M u$ 里先扣掉，所以预算越大，KV 块越少；`LLM` 类默认的大预算换来的是更少的并发。
# 3. `vllm serve` 在 H100 上默认每步最多 8192 个新 Token，`LLM` 类是 16384：离线时长提示一步算完，同批解码被拖得更久。
#    两边都显式写上 `max_num_batched_tokens` 和 `max_num_seqs`（以及 `gpu_memory_utilization`）才可比。
# 4. 宽松的 TPOT 容忍更长的混合步，首 Token 的收益占上风，最优预算变大。
# 5. 种子越多，对均值的估计越准，但单次运行的范围未必变窄；要比较两个配置，应对同一组种子成对比较差值，并报告差值的分布。
#
# </details>
