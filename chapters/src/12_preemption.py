# %% [markdown]
# # 第 12 章 抢占：Recompute 与 Swap
#
# 连续批处理（第 5 章）让批“始终是满的”，分页 KV（第 7 章）让每个请求只占它真正写入的块。两者合在一起有一个代价：
# 调度器在接纳（Admit）一个请求时，只知道它的提示词有多长，**不知道它会生成多少 Token**。请求被接纳之后还会一块一块地长大，
# 一旦池里所有块都被占满，而运行中的请求还要再写一个 Token，调度器就只剩一个办法：挑一个运行中的请求让出它的 KV——
# 这就是**抢占**（Preemption）。被抢占的请求要么丢掉 KV、以后从头**重算**（Recompute），要么把 KV 复制到主机内存、
# 以后再拷回来，即**换出**（Swap）。
#
# 本章回答四个问题：KV 为什么会耗尽、抢占时选谁（**抢占对象**，Victim）、抢占太频繁时系统怎样陷入**抖动**（Thrashing），
# 以及各框架怎样用**准入控制**（Admission Control）从源头上少抢占：TensorRT-LLM 的 `GUARANTEED_NO_EVICT` 与 `MAX_UTILIZATION`、
# SGLang 按新 Token 比例（New Token Ratio）估算的保守准入。vLLM 是另一条路线：V1 引擎只保留了重算，不再支持换出。
#
# ## 学习目标
#
# - 写出 KV 耗尽的条件：接纳时只检查提示词占的块，而运行中请求的块数随解码不断增长；
# - 读懂 minibatch 选抢占对象的规则（`Scheduler._pick_victim`），并与 vLLM V1、vLLM V0、TensorRT-LLM、SGLang 的做法对照；
# - 用代价模型比较重算（提示词加已生成 Token 的预填充 FLOPs）与换出（KV 字节数经主机链路来回）的开销；
# - 在过载的 KV 池里观察抖动：同一个请求被反复抢占，量出被**重复计算的 Token**（Recomputed Tokens）；
# - 用引擎自己的计数器（`recompute_waste`）比较三种选抢占对象的规则，复现 vLLM RFC #54644 的结论：
#   **最少计算优先**（Least-Computed-First）比“最后接纳者”少浪费重算；
# - 在模拟的 Llama-2-7B / A100 上、稳态下比较三种准入模式 × 两种抢占方式的抢占次数、重算 Token、吞吐与 p99 TPOT（多个种子）；
# - 在真实的 tiny 模型上验证：无论是否被抢占、用重算还是换出，贪心解码的输出逐 Token 相同。

# %%
import collections
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.admission import Conservative, GuaranteedNoEvict
from minibatch.kv_cache import KVCacheManager
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.request import Request, RequestStatus
from minibatch.results import RunResult
from minibatch.runner import run
from minibatch.scheduler import Scheduler
from minibatch.sim import make_cost_model
from minibatch.swap import HOST_LINK_BYTES_PER_S
from minibatch.viz import EventLog, gantt, md_table
from minibatch.workload import lognormal, synthetic
from minibatch.workload.lengths import Uniform

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 12.1 KV 为什么会耗尽
#
# 设块大小为 $B$，池里共有 $N$ 个块。请求 $i$ 的提示词长 $p_i$，到第 $t$ 步已生成 $g_i(t)$ 个 Token，它占用
# $\lceil (p_i + g_i(t)) / B \rceil$ 个块。乐观的准入（vLLM 的做法，也是 minibatch 的默认 `admission="max_utilization"`）
# 只要求**这一步**的块放得下：
#
# $$
# \text{接纳 } j \iff \Big\lceil \tfrac{p_j}{B} \Big\rceil + \sum_{i \in \text{running}} \Big\lceil \tfrac{p_i + g_i(t)}{B} \Big\rceil \le N ,
# $$
#
# 可此后每一步，每个运行中的请求都多写一个 Token，平均每 $B$ 步就要多要一个块；到请求 $i$ 结束时它要
# $\lceil (p_i + o_i)/B \rceil$ 个块（$o_i$ 是它的输出长度，接纳时未知）。只要
# $\sum_i \lceil (p_i + g_i(t))/B \rceil$ 在某一步超过 $N$，就有请求长不动了——必须抢占。
#
# 先在模拟器里看一个最小的例子：

# %%
N_DEMO, P_DEMO, O_DEMO = 6, 40, 80           # requests, prompt and output tokens each
POOL_DEMO, BS = 24, 16                       # KV blocks, tokens per block
blocks = lambda tokens: -(-tokens // BS)     # noqa: E731  blocks that hold this many tokens

# %% [markdown]
# {{N_DEMO}} 个请求同时到达，每个提示词 {{P_DEMO}} Token、生成 {{O_DEMO}} Token，池里只有 {{POOL_DEMO}} 个块（每块 {{BS}} Token）。
# 开始时每个请求只占 {{blocks(P_DEMO)}} 个块，{{N_DEMO}} 个请求都被接纳（{{N_DEMO * blocks(P_DEMO)}} 个块）；
# 但每个请求最终要 {{blocks(P_DEMO + O_DEMO)}} 个块，合计要 {{N_DEMO * blocks(P_DEMO + O_DEMO)}} 个。`EventLog` 记下每一次抢占：

# %%
demo = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=POOL_DEMO, block_size=BS), clock="virtual")
demo_log = EventLog(demo)
for i in range(N_DEMO):
    demo.add_request([7 + i] * P_DEMO, SamplingParams(max_tokens=O_DEMO, ignore_eos=True), request_id=f"q{i}")
while demo.has_unfinished_requests():
    demo.step()
first = next(st for st in demo.steps if st.num_preempted)
victims_first = [rid for t, ev, rid in demo_log.events if abs(t - first.start_time) < 1e-12]
tokens_at = P_DEMO + first.step              # step s writes token position P_DEMO + s - 1 of every request
demand = N_DEMO * blocks(tokens_at)
print(f"{len(demo.steps)} steps; first preemption at step {first.step}: {tokens_at} tokens per request need "
      f"{demand} blocks > {POOL_DEMO}; victims {victims_first}")
print("all preemptions (time, request):", [(round(t, 3), rid) for t, ev, rid in demo_log.events])

# %% tags=["check"]
assert victims_first == [f"q{N_DEMO - 1}", f"q{N_DEMO - 2}"], "the prose below says the two last-admitted requests go first"
assert first.kv_blocks_used == (N_DEMO - 2) * blocks(tokens_at), "the other requests grew into the freed blocks"

# %% [markdown]
# {{N_DEMO}} 个请求长度相同、同步增长。第 {{first.step}} 步，每个请求都要写第 {{tokens_at}} 个 Token，各需
# {{blocks(tokens_at)}} 个块、合计 {{demand}} 个，而池里只有 {{POOL_DEMO}} 个：调度器依次抢占了 {{victims_first[0]}} 与 {{victims_first[1]}}——
# **最后被接纳的两个请求**（后一个是自己长不动、又没有排在它后面的请求可抢，只好抢占自己），其余 {{N_DEMO - 2}} 个请求接着解码。下图画出每一步占用的块数、运行中与等待中的请求数，红色竖线是发生抢占的步：

# %%
steps = demo.steps
x = [st.step for st in steps]
fig, ax = plt.subplots(figsize=(9, 3))
ax.step(x, [st.kv_blocks_used for st in steps], where="post", color="C0", label="KV blocks used")
ax.axhline(POOL_DEMO, color="k", ls=":", lw=1, label=f"pool ({POOL_DEMO} blocks)")
ax2 = ax.twinx()
ax2.step(x, [st.num_running for st in steps], where="post", color="C2", label="running")
ax2.step(x, [st.num_waiting for st in steps], where="post", color="0.5", ls="--", label="waiting")
for st in steps:
    if st.num_preempted:
        ax.axvline(st.step, color="C3", alpha=0.6, lw=1.5)
ax.set(xlabel="step", ylabel="blocks", ylim=(0, POOL_DEMO + 2),
       title=f"{N_DEMO} requests x ({P_DEMO} + {O_DEMO}) tokens in a {POOL_DEMO}-block pool")
ax2.set(ylabel="requests", ylim=(0, N_DEMO + 1))
ax.legend(loc="lower left", fontsize=7)
ax2.legend(loc="lower right", fontsize=7)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## 12.2 选谁：抢占对象
#
# 抢占发生在调度器给一个请求分配块失败的时候。minibatch 的规则写在 `Scheduler._pick_victim` 里（所有策略共用）：
# **先挑策略排序中被省略的运行中请求**（它们的排名低于一切），**再从策略顺序的末尾往前挑**，跳过本步已经调度过的请求。
# 对默认的 `continuous` 策略，顺序是“运行中的请求按接纳先后，然后是等待队列”，所以被抢占的总是最后接纳的那个——上面的例子正是如此。

# %%
print(inspect.getsource(Scheduler._pick_victim))
print(inspect.getsource(Scheduler._preempt))

# %% [markdown]
# `_preempt` 给出两种处理：**重算**时释放全部块、把 `num_computed_tokens` 清零、状态改回 `WAITING`，并放到等待队列的**最前面**
# （`appendleft`），下次调度它要重新计算 $p_i + g_i$ 个 Token（已生成的 Token 保留，只是 KV 没了）；**换出**时先把
# 带数据的块复制到主机的换出池（`minibatch.swap.Swapper`），状态为 `SWAPPED`，恢复时重新分配块并拷回，从中断处继续。
# 主机池满了就退回重算。如果一个运行中的请求要长大、却没有排在它后面的请求可抢，它就抢占自己。
#
# 各框架的选法大同小异，都是“让排在最后的让路”：
#
# | 框架（版本，源文件） | 选谁 | 被抢占之后 |
# |---|---|---|
# | vLLM V1（v0.8.0 起为默认引擎；`vllm/v1/core/sched/scheduler.py`，`Scheduler.schedule` / `_preempt_request`） | FCFS：`self.running.pop()`，即运行队列最后一个；`priority` 策略：`max(running, key=(priority, arrival_time))` | 只有重算：释放块、`num_computed_tokens = 0`、状态 `PREEMPTED`、放回等待队列队首；这一步有抢占时**不再调度任何等待中的请求**（`if not preempted_reqs`） |
# | vLLM V0（`vllm/core/scheduler.py`，v0.11.0 随 V0 引擎一起删除，PR #25321） | 运行队列按策略排序后的最后一个 | `PreemptionMode.RECOMPUTE` 或 `SWAP`；未指定 `preemption_mode` 时，单序列请求重算，多序列（束搜索、并行采样）换出 |
# | TensorRT-LLM `MAX_UTILIZATION`（`cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`，`MaxUtilizationScheduler`） | 放不下时，从活动请求列表末尾往前找最后一个已开始的请求，把它暂停（Pause） | 暂停的请求释放 KV，以后重新计算上下文 |
# | SGLang（v0.5.3，`python/sglang/srt/managers/schedule_batch.py`，`retract_decode`） | 解码显存不足时，按（已生成 Token 数，−提示词长度）排序，先**撤回**（Retract）已生成最少、提示词最长的请求 | 放回等待队列；同时把 `new_token_ratio` 调高（12.5 节） |
# | minibatch（`minibatch/scheduler.py`，`_pick_victim`） | 策略顺序之外的运行中请求优先，然后从顺序末尾往前（默认 `preemption_victim="last"`；另两种规则见 12.6 节） | `preemption_mode="recompute"`（默认）或 `"swap"` |
#
# 有一处细节 minibatch 与 vLLM V1 不同：vLLM V1 在一步里只要抢占过，就不再接纳新请求；minibatch 只在等待中的请求**被拒绝**之后才停止接纳，
# 所以被抢占者释放出来、而抢占者没用完的块，可能在同一步就被一个新到的请求拿走。下面用调度器本身复现：一个很小的池，
# 三个请求 `a`、`b`、`d` 在运行，新请求 `late` 在等待：

# %%
def tiny_scheduler(num_blocks, block_size=4, **cfg):
    config = EngineConfig.from_kwargs(num_kv_blocks=num_blocks, block_size=block_size, max_model_len=64, **cfg)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len=64)


def make_req(rid, n, max_tokens=8):
    return Request(rid, [100 + 10 * len(rid) + i for i in range(n)],
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0.0)


def apply_step(sched, batch):
    """What the engine does after a step: count computed tokens; a request that caught up gets a token."""
    for r, n in batch.items:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)


S4_POOL, S4_BS = 4, 4                                  # blocks, tokens per block
S4_LENS, LATE_LEN = {"a": 4, "b": 2, "d": 8}, 2        # prompt tokens of the running requests and of late
s4 = tiny_scheduler(S4_POOL, block_size=S4_BS)
for rid, n in S4_LENS.items():
    s4.add(make_req(rid, n))
apply_step(s4, s4.schedule(0.0))                       # all three prefill and fill the pool
s4.add(make_req("late", LATE_LEN))
b4 = s4.schedule(0.0)
scheduled_ids = [(r.request_id, n) for r, n in b4.items]
print("scheduled:", scheduled_ids, "| preempted:", [r.request_id for r in b4.preempted],
      "| waiting now:", [r.request_id for r in s4.waiting])

# %% tags=["check"]
s4_blocks = {rid: -(-n // S4_BS) for rid, n in S4_LENS.items()}
assert sum(s4_blocks.values()) == S4_POOL and S4_LENS["a"] % S4_BS == 0, "the prose: a full pool, a needs a block"
assert [r.request_id for r in b4.preempted] == ["d"] and ("late", LATE_LEN) in scheduled_ids, \
    "the prose says d is preempted and late is admitted in the same step"

# %% [markdown]
# 池里 {{S4_POOL}} 个块（每块 {{S4_BS}} Token）：`a`（{{S4_LENS['a']}} Token，{{s4_blocks['a']}} 块，下一个 Token 要第 {{s4_blocks['a'] + 1}} 块）、
# `b`（{{S4_LENS['b']}} Token，{{s4_blocks['b']}} 块）、`d`（{{S4_LENS['d']}} Token，{{s4_blocks['d']}} 块）正好占满，`late` 有 {{LATE_LEN}} 个 Token。
# `a` 要一个新块，`d` 被抢占、放回等待队首，它的 {{s4_blocks['d']}} 个块里 `a` 只用了 1 个，剩下的在同一步给了 `late`。
# 在 vLLM V1 里 `late` 要等到下一步——这个差别会加重 12.4 节的抖动，练习 4 请你量一量。
#
# ## 12.3 重算还是换出：代价模型
#
# 被抢占的请求已有 $n = p_i + g_i$ 个 Token 的 KV。两种方式的代价：
#
# - **重算**：恢复时把这 $n$ 个 Token 当作一段预填充重新计算，运算量约为
#   $F_\text{recompute}(n) \approx 2 P n + 4 L H d \cdot \tfrac{n(n+1)}{2}$（$P$ 为参数量，后一项是因果注意力），
#   在 GPU 上是算力受限的，时间约为 $F / \text{有效算力}$——代价模型 `RooflineCostModel.step_time([(n, n)], [])` 正是算这个；
# - **换出**：KV 的字节数是 $S(n) = 2 L K d \cdot b \cdot n$（$K$ 为 KV 头数、$b$ 为每个元素的字节数），
#   出去一次、回来一次，时间约为 $2 S(n) / \text{主机链路带宽}$。minibatch 按 PCIe Gen4 x16 实际能达到的
#   `HOST_LINK_BYTES_PER_S` = {{HOST_LINK_BYTES_PER_S / 1e9:.0f}} GB/s 计（`minibatch/swap.py`），拷贝时间加在这一步上。
#
# 在 A100-80G 上比较 MHA 的 Llama-2-7B（{{make_cost_model('llama-2-7b', 'a100-80g').model.num_kv_heads}} 个 KV 头）与
# GQA 的 Llama-3-8B（{{make_cost_model('llama-3-8b', 'a100-80g').model.num_kv_heads}} 个 KV 头）：

# %%
ctx = np.array([128, 256, 512, 1024, 2048, 4096])
cost = {}
for model in ("llama-2-7b", "llama-3-8b"):
    cm = make_cost_model(model, "a100-80g")
    recompute = np.array([cm.step_time([(int(n), int(n))], []) - cm.step_overhead_s for n in ctx])
    swap = 2 * ctx * cm.kv_bytes_per_token_per_gpu / HOST_LINK_BYTES_PER_S
    cost[model] = dict(recompute=recompute, swap=swap, kv_kib=cm.kv_bytes_per_token_per_gpu / 1024)
    print(f"{model}: KV {cost[model]['kv_kib']:.0f} KiB/token; recompute/swap time ratio at n=128..4096: "
          + " ".join(f"{a / b:.1f}" for a, b in zip(recompute, swap)))

fig, ax = plt.subplots(figsize=(7, 3.2))
for (model, c), col in zip(cost.items(), ("C0", "C1")):
    ax.plot(ctx, c["recompute"] * 1e3, "o-", color=col, label=f"{model}: recompute (prefill of n tokens)")
    ax.plot(ctx, c["swap"] * 1e3, "s--", color=col, label=f"{model}: swap out + in over {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s")
ax.set(xscale="log", yscale="log", xlabel="tokens in the victim's KV (prompt + generated)", ylabel="ms",
       title="Cost of resuming a preempted request, A100-80G (roofline model)")
ax.set_xticks(ctx, [str(n) for n in ctx])
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=7)
plt.show()
ratio7 = cost["llama-2-7b"]["recompute"] / cost["llama-2-7b"]["swap"]
ratio8 = cost["llama-3-8b"]["recompute"] / cost["llama-3-8b"]["swap"]

# %% tags=["check"]
assert (ratio7 > 1).all() and (ratio8 > ratio7).all(), "the prose says swap is cheaper on paper, more so with GQA"

# %% [markdown]
# 按这个模型，换出在纸面上**总是更便宜**：Llama-2-7B 上重算要 {{ratio7.min():.1f}}–{{ratio7.max():.1f}} 倍于换出的时间；
# GQA 让每个 Token 的 KV 小到 {{cost["llama-3-8b"]["kv_kib"]:.0f}} KiB，差距扩大到 {{ratio8.min():.1f}}–{{ratio8.max():.1f}} 倍。
# 那为什么 vLLM 反而放弃了换出？
#
# - vLLM V0（`vllm/core/scheduler.py` 的 `PreemptionMode`）两种都有，默认也优先重算：源码注释说重算的开销低于换出，
#   只有多序列请求（束搜索）因为重算不支持才换出；用户可以用 `--preemption-mode` 强制指定。
# - vLLM V1 的调度器（v0.8.0 起默认）只实现了重算。V1 用户指南（`docs/source/getting_started/v1_user_guide.md`，随 v0.8 发布）
#   写明：“GPU <> CPU KV Cache Swapping：在新的简化核心架构下，vLLM V1 不再需要 KV 缓存换出来处理请求抢占”；
#   在 V0 还没被删除的版本里（例如 v0.8、v0.9），传入 `--preemption-mode` 会让引擎退回 V0（vLLM issue #18115）；V0 在 v0.11.0 被整体删除（PR #25321）。
#   CPU 上的 KV 从此只以“卸载”（Offload）的形式出现（KV Connector），不再是抢占机制的一部分。
# - 上面的模型没有算的东西偏向重算：换出要占主机内存与 PCIe 带宽（与别的传输争用），在 minibatch 里拷贝时间直接加到这一步上，
#   整批请求都等它；开启前缀缓存（第 13 章）时，被抢占请求释放的**写满的块**会留在缓存里，恢复时如果还没被驱逐，就能直接命中。
#
# 下面在过载的 7B / A100 上实测这三种做法。先定义两个测量工具：`Metered` 是一个只多了计数功能的连续批处理策略，
# 它在每步结束时（`on_step`）累加每个请求实际计算的 Token 数，减去“不被抢占时必须算的”
# $p_i + o_i - 1 - \text{命中数}_i$，就是这个请求被**重复计算**的 Token；`steady` 只统计到达时间落在中间的请求，
# 吞吐则数这段时间窗内产出的 Token，以排除预热与收尾。

# %%
class Metered(ContinuousPolicy):
    """Continuous batching (FCFS) that also counts the tokens computed for each request."""

    def __init__(self):
        self.computed = collections.Counter()

    def on_step(self, scheduled, now):
        for req, n in scheduled:
            self.computed[req.request_id] += n


def run_metered(workload, **kw):
    engine = LLMEngine(EngineConfig.from_kwargs(**kw), clock="virtual")
    meter = engine.scheduler.policy = Metered()
    result = run(workload, engine=engine)
    result.extra["computed"] = dict(meter.computed)
    result.extra["evictions"] = engine.kv.pool.num_evictions
    return result


def recomputed(result, rec):
    """Tokens of ``rec`` computed more than once (preemption), beyond prompt + output - 1 - cached."""
    return result.extra["computed"].get(rec.request_id, 0) - (rec.prompt_len + rec.output_len - 1 - rec.num_cached_tokens)

# %%
STEADY = (0.1, 0.9)                  # arrival quantiles that bound the steady-state window


def steady(result, lo=STEADY[0], hi=STEADY[1]):
    """Steady-state metrics: requests that arrived in the middle 80% of arrivals; tokens made in that window."""
    t0, t1 = np.quantile([q.arrival_time for q in result.requests], [lo, hi])
    mid = [q for q in result.requests if t0 <= q.arrival_time <= t1]
    assert all(q.completed for q in mid), "every request completes (none can never fit)"
    made = sum(int(np.count_nonzero((np.asarray(q.token_times) >= t0) & (np.asarray(q.token_times) < t1)))
               for q in result.requests)
    work = sum(result.extra["computed"].get(q.request_id, 0) for q in mid)
    redo = sum(recomputed(result, q) for q in mid)
    tpots = [q.tpot for q in mid if q.tpot is not None]
    return dict(n=len(mid), tok_s=made / (t1 - t0), tpot_p99=float(np.percentile(tpots, 99)),
                preemptions=sum(q.num_preemptions for q in mid), recomputed=redo, recomputed_share=redo / work,
                max_preempt=max(q.num_preemptions for q in mid))

# %%
OVERLOAD = dict(input_len=lognormal(median=256, sigma=0.6, max=2048),
                output_len=lognormal(median=192, sigma=0.8, max=1024))
N_OVER, RATE_OVER = 300, 10.0
POOL, TIGHT, POOLS = 800, 300, [300, 400, 600, 800, 1200, 2000]    # KV blocks: 12.3, 12.4 and 12.4's sweep
wl = synthetic(N_OVER, RATE_OVER, **OVERLOAD, seed=1)
cm7 = make_cost_model("llama-2-7b", "a100-80g")
full_pool = cm7.kv_capacity_tokens() // BS
need = blocks(wl.prompt_lens + wl.output_lens)
assert need.max() <= TIGHT, "every request fits even the tightest pool on its own"
offered = wl.stats()["rate"] * float(np.mean(wl.output_lens))
print(f"{len(wl)} requests at {wl.stats()['rate']:.1f} req/s, offered {offered:.0f} output tok/s; "
      f"largest request needs {need.max()} of {POOL} blocks (the full A100-80G pool would be {full_pool})")

# %% [markdown]
# `steady` 取到达时间落在 {{STEADY[0]:.0%}}–{{STEADY[1]:.0%}} 分位之间的请求。
# 负载是 {{len(wl)}} 个请求、{{wl.stats()["rate"]:.1f}} req/s，提示词中位数 {{OVERLOAD['input_len'].median:.0f}}、
# 输出中位数 {{OVERLOAD['output_len'].median:.0f}}（对数正态），
# 每秒要求生成约 {{offered:.0f}} 个输出 Token——超过这台模拟服务器能给的，所以它是过载的。为了让 KV 成为瓶颈，
# 池里只给 {{POOL}} 个块（{{POOL * BS}} 个 Token 槽位），约为 A100-80G 上 7B 默认池（{{full_pool}} 块）的
# {{POOL / full_pool:.0%}}，相当于显存被更大的模型或别的副本挤占；单个请求最多要 {{need.max()}} 个块，放得下。

# %%
three = {}
three["recompute"] = run_metered(wl, **SIM, num_kv_blocks=POOL)
three["recompute + prefix cache"] = run_metered(wl, **SIM, num_kv_blocks=POOL, enable_prefix_caching=True)
three["swap"] = run_metered(wl, **SIM, num_kv_blocks=POOL, preemption_mode="swap")
rows = []
for name, r in three.items():
    s = steady(r)
    rows.append([name, s["preemptions"], f"{s['recomputed']:,}", f"{s['recomputed_share']:.1%}",
                 f"{r.summary()['num_swapped_blocks']:,}", f"{s['tok_s']:.0f}", f"{s['tpot_p99'] * 1e3:.1f}"])
md_table(["preemption (max_utilization)", "preemptions", "recomputed tokens", "share of compute",
          "blocks swapped out", "output tok/s", "TPOT p99 (ms)"], rows)
st3 = {k: steady(r) for k, r in three.items()}
CLOSE = 0.05                         # "about the same" throughput
N_WORST = 12                         # requests drawn in 12.4's Gantt chart

# %% tags=["check"]
assert st3["swap"]["recomputed"] == 0 < st3["recompute + prefix cache"]["recomputed"] < st3["recompute"]["recomputed"], \
    "the prose says swap recomputes nothing and the prefix cache saves part of the recompute"

# %% [markdown]
# 三种做法的抢占次数相近（抢占是 KV 不够引起的，与恢复方式无关）。纯重算把稳态计算量的
# {{st3["recompute"]["recomputed_share"]:.1%}} 花在了重复计算上。开启前缀缓存只把重复计算的 Token 从
# {{st3["recompute"]["recomputed"]:,}} 降到 {{st3["recompute + prefix cache"]["recomputed"]:,}}
# （{{1 - st3["recompute + prefix cache"]["recomputed"] / st3["recompute"]["recomputed"]:.0%}}）：池一紧，被抢占者释放的块
# 正是抢占者要用的，它们马上被分配出去，缓存的内容随之被驱逐（本次运行驱逐了 {{three["recompute + prefix cache"].extra["evictions"]:,}} 个缓存块）。
# 换出一个 Token 也不重算，代价是 {{three["swap"].summary()["num_swapped_blocks"]:,}} 个块在 PCIe 上往返。
# 三者的吞吐相差{{"不到" if max(s["tok_s"] for s in st3.values()) / min(s["tok_s"] for s in st3.values()) < 1 + CLOSE else "超过"}} {{CLOSE:.0%}}：
# 一个可能的解释是：解码受访存限制（第 2 章），重算的 Token 以预填充块的形式混进解码步里（第 11 章），多半只占用了空闲的算力。
#
# ## 12.4 抖动：同一个请求被反复抢占
#
# 抢占本身不可怕，可怕的是**反复**抢占：一个请求刚重算完、又长了几块，就又成了顺序末尾的那个；池越紧，它被赶出去的次数越多，
# 每次都要把越来越长的 KV 再算一遍。这就是操作系统里所说的抖动（Thrashing）——系统忙着把工作搬进搬出，有用的进展越来越少。
# 把池缩到 {{TIGHT}} 块，同一个负载下每个请求被抢占的次数分布如下，下面的甘特图是被抢占最多的 {{N_WORST}} 个请求的时间线
# （红色为被抢占、等待恢复的时段）：

# %%
tight_engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=TIGHT), clock="virtual")
tight_meter = tight_engine.scheduler.policy = Metered()
tight_log = EventLog(tight_engine)
tight = run(wl, engine=tight_engine)
tight.extra["computed"] = dict(tight_meter.computed)
tight.extra["events"] = tight_log.events
counts = collections.Counter(q.num_preemptions for q in tight.requests)
worst = sorted(tight.requests, key=lambda q: (-q.num_preemptions, q.arrival_time))[:N_WORST]
fig, ax = plt.subplots(figsize=(4.5, 2.8))
ks = sorted(counts)
ax.bar(ks, [counts[k] for k in ks], color="C3")
ax.set(xlabel="times preempted", ylabel="requests",
       title=f"{TIGHT}-block pool: {sum(q.num_preemptions for q in tight.requests)} preemptions in all")
ax.grid(alpha=0.3, axis="y")
plt.show()
g = gantt(RunResult(worst, tight.steps, tight.config), max_requests=N_WORST, events=tight.extra["events"], figsize=(9, 3.4))
g.axes[0].set_title(f"the {N_WORST} most-preempted requests (red: preempted, waiting to resume)", fontsize=9)
display(g)
print(f"most-preempted request: {worst[0].request_id}, {worst[0].num_preemptions} times; "
      f"recomputed {recomputed(tight, worst[0]):,} tokens for a {worst[0].prompt_len}+{worst[0].output_len}-token request")

# %% [markdown]
# 被抢占最多的请求 {{worst[0].request_id}} 被赶出去 {{worst[0].num_preemptions}} 次，为一个
# {{worst[0].prompt_len}} + {{worst[0].output_len}} Token 的请求重复计算了 {{recomputed(tight, worst[0]):,}} 个 Token。
# 池的大小决定了抖动的程度。下面固定负载，把池从 {{POOLS[0]}} 块放大到 {{POOLS[-1]}} 块（`max_utilization` + 重算）：

# %%
sweep = {p: steady(run_metered(wl, **SIM, num_kv_blocks=p)) for p in POOLS}
fig, ax = plt.subplots(figsize=(7.5, 3.2))
ax.plot(POOLS, [sweep[p]["recomputed_share"] * 100 for p in POOLS], "o-", color="C3", label="recomputed share of compute (%)")
ax.set(xlabel=f"KV pool (blocks of {BS} tokens)", ylabel="% of computed tokens", xscale="log")
ax.set_xticks(POOLS, [str(p) for p in POOLS])
ax2 = ax.twinx()
ax2.plot(POOLS, [sweep[p]["tok_s"] for p in POOLS], "s--", color="C0", label="steady output tok/s")
ax2.set_ylabel("output tok/s", color="C0")
ax.set_title(f"Thrashing shrinks as the pool grows (llama-2-7b, A100-80G, {RATE_OVER:g} req/s)", fontsize=10)
ax.grid(alpha=0.3)
ax.legend(loc="upper center", fontsize=7)
plt.show()
print(" ".join(f"{p}: {sweep[p]['preemptions']} preemptions, {sweep[p]['recomputed_share']:.1%} recomputed;" for p in POOLS))
assert sweep[TIGHT]["recomputed_share"] > sweep[POOL]["recomputed_share"] > sweep[POOLS[-1]]["recomputed_share"] == 0, \
    "the prose says the recomputed share falls as the pool grows, to none at the largest pool"

# %% [markdown]
# {{TIGHT}} 块时，稳态下 {{sweep[TIGHT]["recomputed_share"]:.1%}} 的计算是重复的；到 {{POOLS[-1]}} 块，负载里的请求再也挤不满池，
# 抢占消失。吞吐随池变大而上升，这里同时有两个原因——能同时解码的请求更多（批更大）与重复计算更少——这张图无法把它们分开。
#
# ## 12.5 准入控制：从源头少抢占
#
# 抢占的根源是接纳时的乐观。另一条路是接纳时就为请求的**将来**留出空间，minibatch 的 `admission` 选项实现了三种（`minibatch/admission.py`）：
#
# - `max_utilization`（默认）：只看这一步放不放得下，对应 vLLM 的做法与 TensorRT-LLM 的 `MAX_UTILIZATION`；
# - `guaranteed_no_evict`：对应 TensorRT-LLM 的默认策略 `GUARANTEED_NO_EVICT`（TensorRT-LLM 1.4.0rc4 文档
#   `SchedulerConfig.capacity_scheduler_policy` 的默认值；C++ 实现 `GuaranteedNoEvictScheduler` 在
#   `cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`，为每个运行中请求预留“跑到结束”所需的块）。新请求 $j$ 被接纳当且仅当
#
# $$
# \Big\lceil \tfrac{\min(p_j + m_j,\ L_\max)}{B} \Big\rceil - h_j + \sum_{i \in \text{running}} \Big( \Big\lceil \tfrac{\min(p_i + m_i,\ L_\max)}{B} \Big\rceil - \text{held}_i \Big) \le N_\text{free},
# $$
#
#   其中 $m$ 是 `max_tokens`、$h_j$ 是前缀缓存命中的块：最坏情况全部预留，运行中的请求永远长得动，**从不抢占**，代价是批更小；
# - `conservative`：SGLang 的做法（`python/sglang/srt/managers/schedule_policy.py` 的 `PrefillAdder`，v0.5.3）。
#   不按最坏情况，而按**估计**预留：运行中请求 $i$ 还会生成 $r \cdot \min(m_i - g_i,\ 4096)$ 个 Token，其中 4096 是
#   `CLIP_MAX_NEW_TOKENS`（环境变量 `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`），$r$ 是**新 Token 比例**。SGLang v0.5.3 的
#   `python/sglang/global_config.py` 给出它的动态：初值 `default_init_new_token_ratio` = 0.7（乘以 `--schedule-conservativeness`，默认 1.0），
#   每步减去 (0.7 − 0.7 × 0.14) / 600（`default_min_new_token_ratio_factor` = 0.14，`default_new_token_ratio_decay_steps` = 600），
#   降到 0.7 × 0.14 ≈ 0.1 为止；一旦显存不够、要撤回请求（`scheduler.py` 调用 `retract_decode`），$r$ 被重设为
#   $\min\big(1, (\sum g + 20 \cdot n_\text{running}) / \sum m\big)$（20 是 `retract_decode_steps`）。
#   minibatch 的 `Conservative` 按同样的动态维护 $r$（重设时不低于初值 {{inspect.signature(Conservative).parameters['init_ratio'].default}}），但有一处简化：它对**新请求**也只预留 $r$ 倍的估计，
#   而 SGLang v0.5.3 的 `PrefillAdder.add_one_req` 对新请求预留完整的 $\min(m_j, 4096)$，只对已在运行的请求乘以 $r$。

# %%
print(inspect.getsource(GuaranteedNoEvict.can_admit))
print(inspect.getsource(Conservative.can_admit))
print(inspect.getsource(Conservative.on_step))

# %% [markdown]
# 在 12.3 节的过载负载上（{{POOL}} 块），三种准入 × 两种抢占方式，各跑几个负载种子，报告稳态指标的均值 ± 标准差：

# %%
SEEDS = [1, 2, 3]
ADMISSIONS = ["max_utilization", "conservative", "guaranteed_no_evict"]
MODES = ["recompute", "swap"]
grid = {}
for seed in SEEDS:
    wl_s = wl if seed == 1 else synthetic(N_OVER, RATE_OVER, **OVERLOAD, seed=seed)
    for adm in ADMISSIONS:
        for mode in MODES:
            grid[adm, mode, seed] = steady(run_metered(wl_s, **SIM, num_kv_blocks=POOL, admission=adm, preemption_mode=mode))


def stat(adm, mode, key):
    v = np.array([grid[adm, mode, s][key] for s in SEEDS], dtype=float)
    return v.mean(), v.std()


def fmt(adm, mode, key, scale=1.0, spec=".0f"):
    m, sd = stat(adm, mode, key)
    return f"{m * scale:{spec}} ± {sd * scale:{spec}}"


md_table(["admission", "preemption", "preemptions", "recomputed tokens", "output tok/s", "TPOT p99 (ms)"],
         [[adm, mode, fmt(adm, mode, "preemptions"), fmt(adm, mode, "recomputed"), fmt(adm, mode, "tok_s"),
           fmt(adm, mode, "tpot_p99", 1e3, ".1f")] for adm in ADMISSIONS for mode in MODES])

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3))
xpos = np.arange(len(ADMISSIONS))
for ax, (key, label, scale) in zip(axes, [("preemptions", "preemptions", 1), ("tok_s", "output tok/s", 1),
                                          ("tpot_p99", "TPOT p99 (ms)", 1e3)]):
    for k, (mode, col) in enumerate(zip(MODES, ("C3", "C0"))):
        means = [stat(a, mode, key)[0] * scale for a in ADMISSIONS]
        sds = [stat(a, mode, key)[1] * scale for a in ADMISSIONS]
        ax.bar(xpos + (k - 0.5) * 0.38, means, 0.38, yerr=sds, color=col, alpha=0.8, label=mode, capsize=3)
    ax.set_xticks(xpos, ["max_util", "conservative", "no_evict"], fontsize=8)
    ax.set_title(label, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
axes[0].legend(fontsize=7)
fig.suptitle(f"Admission x preemption mode, llama-2-7b on A100-80G, {POOL}-block pool, {len(SEEDS)} seeds (mean ± sd)",
             fontsize=10)
fig.tight_layout()
plt.show()

# %%
mu_pre, cons_pre = stat("max_utilization", "recompute", "preemptions")[0], stat("conservative", "recompute", "preemptions")[0]
gne = {m: stat("guaranteed_no_evict", m, "preemptions")[0] for m in MODES}
mu_tok, cons_tok, gne_tok = (stat(a, "recompute", "tok_s")[0] for a in ADMISSIONS)
mu_tpot, cons_tpot, gne_tpot = (stat(a, "recompute", "tpot_p99")[0] for a in ADMISSIONS)
n_mid = stat("max_utilization", "recompute", "n")[0]

# %% tags=["check"]
assert gne["recompute"] == gne["swap"] == 0, "the prose says guaranteed_no_evict never preempts"
assert cons_pre < mu_pre / 5, "the prose says conservative preempts far less than max_utilization"
assert gne_tok < min(mu_tok, cons_tok), "the prose says guaranteed_no_evict gives up throughput"
assert gne_tpot < cons_tpot < mu_tpot, "the prose orders the TPOT tails this way"

# %% [markdown]
# 结论都来自上面 {{len(SEEDS)}} 个种子的均值：
#
# - `guaranteed_no_evict` 一次也不抢占，p99 TPOT 最低（{{gne_tpot * 1e3:.1f}} ms），但按最坏情况预留让批变小，稳态吞吐只有
#   {{gne_tok:.0f}} tok/s，是 `max_utilization`（{{mu_tok:.0f}} tok/s）的 {{gne_tok / mu_tok:.0%}}；
# - `max_utilization` 吞吐高，但稳态的 {{n_mid:.0f}} 个请求共被抢占 {{mu_pre:.0f}} 次（平均每个请求 {{mu_pre / n_mid:.2f}} 次），
#   p99 TPOT 达到 {{mu_tpot * 1e3:.1f}} ms——被抢占的请求要排队、重算，中间一个 Token 也不出；
# - `conservative` 的抢占次数只有 `max_utilization` 的 {{cons_pre / mu_pre:.0%}}，吞吐为它的 {{cons_tok / mu_tok:.0%}}，
#   p99 TPOT 为 {{cons_tpot * 1e3:.1f}} ms：估计得不太准也没关系，偶尔估少了就抢占一次、把 $r$ 调高。
#
# 这里的 TPOT 是**每个请求**的 TPOT 的 p99，不是均值。换出对 `guaranteed_no_evict` 毫无影响（从不抢占），
# 对另外两种则把“重算 Token”换成了 PCIe 拷贝。`conservative` 的 $r$ 怎样随时间变化？把它逐步记下来：

# %%
ratio_trace = []
cons_engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=POOL, admission="conservative"), clock="virtual")
cons_run = run(wl, engine=cons_engine,
               on_step=lambda eng, st: ratio_trace.append((st.start_time, eng.scheduler.admission.new_token_ratio,
                                                           st.num_preempted)))
t_r, r_r, p_r = map(np.array, zip(*ratio_trace))
fig, ax = plt.subplots(figsize=(9, 2.6))
ax.plot(t_r, r_r, lw=1)
ax.scatter(t_r[p_r > 0], r_r[p_r > 0], color="C3", s=12, zorder=3, label="step with a preemption")
ax.axhline(0.7 * 0.14, color="k", ls=":", lw=1, label="floor 0.7 x 0.14")
ax.set(xlabel="time (s)", ylabel="new_token_ratio", title="conservative admission: the estimate decays, and jumps after a preemption")
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## 12.6 选谁更省：最少计算优先（vLLM RFC #54644）
#
# 12.2 节的各家规则都不看“被抢占者已经算了多少”。可重算抢占扔掉的正是这部分：被抢占者的 `num_computed_tokens` 清零，
# 恢复时要全部重算。抢占对象选得不同，同样多的抢占浪费的算力可以差很多。
#
# - vLLM 今天的规则（vLLM main 分支，本课程读到的快照提交 `00024d3`，`vllm/v1/core/sched/scheduler.py` 的 `Scheduler.schedule`）
#   与 12.2 节的表相同：FCFS 抢占 `self.running.pop()`（最后接纳者），`priority` 策略抢占
#   `max(self.running, key=lambda r: (r.priority, r.arrival_time))`。
# - vLLM issue #54644（RFC “Preemption victim-selection extension point (least-computed-first as the first built-in)”，2026 年，未合入）
#   把重算浪费的 Token 占全部 Token 计算的比例叫作**重算税**（Recompute Tax），并量了它：在线服务 7B、800 个提示词、
#   长度异构（`vllm bench serve --random-range-ratio 0.5`）、KV 紧张时重算税为 10%–23%；改用**最少计算优先**
#   （`min(running, key=num_computed_tokens)`）后，浪费的 Token 总数减少 24%–30%，每次抢占浪费的减少 35%–41%，吞吐与延迟不变；
#   14B、32B（张量并行）上重算税 15%–22%，减少 20%–29%；离线 0.5B、KV 为 1600 块时重算税 32.2%，减少 59%。
#   RFC 的消融实验给出的排序是：最少计算优先 > 后进先出（LIFO）> 随机 > 最多计算优先。
#   对应的 PR #53723（未合入）加了一个与调度策略正交的选项 `preemption_victim`：`"fcfs"`（默认，行为不变）或 `"lcf"`。
#
# minibatch 的同名选项 `EngineConfig.preemption_victim` 有三个取值：`"last"`（默认，12.2 节的规则）、`"least_computed"`
# （RFC 的最少计算优先）、`"lowest_priority"`（vLLM `priority` 策略的 `max(priority, arrival_time)`）。它与策略的顺序这样组合：
# **策略决定谁可以被抢占**（排在要块的请求之后的运行中请求，以及策略顺序之外的），**规则决定其中哪一个**；后两种规则下，
# 要块的运行中请求自己也是候选（与 vLLM 一样，它的候选是整个运行队列），只有它严格地最便宜时才抢占自己。
# 与 vLLM 的 PR 有一处不同：vLLM 会把本步已经调度过的请求撤回来当抢占对象，minibatch 不撤回已经排进本步的请求。
# 在 12.2 节的小池上看三种规则各选谁：

# %%
VICTIM_RULES = ("last", "least_computed", "lowest_priority")
V_LENS, V_PRIO = {"a": 4, "b": 6, "c": 2, "d": 7}, {"a": 0, "b": 2, "c": 1, "d": 1}   # prompt tokens, classes
V_POOL = sum(-(-n // S4_BS) for n in V_LENS.values())                                  # exactly full after one step
# The simulated comparison below: requests, req/s, KV blocks, seeds; prompt and output lengths (uniform, mean +- 50 %)
V_N, V_RATE, V_POOL_SIM, V_SEEDS = 200, 3.0, 500, [0, 1, 2]
V_IN, V_OUT = Uniform(256, 768), Uniform(128, 384)
victim_rows, victim_of = [], {}
for rule in VICTIM_RULES:
    sv = tiny_scheduler(V_POOL, block_size=S4_BS, preemption_victim=rule)
    for rid, n in V_LENS.items():
        r = make_req(rid, n)
        r.priority = V_PRIO[rid]
        sv.add(r)
    apply_step(sv, sv.schedule(0.0))                 # all prefill; the pool is full, a needs a new block
    thrown = {r.request_id: r.num_computed_tokens for r in sv.running}
    bv = sv.schedule(0.0)
    victim_of[rule] = [r.request_id for r in bv.preempted]
    victim_rows.append([f"`{rule}`", ", ".join(victim_of[rule]), sum(thrown[v] for v in victim_of[rule])])
md_table(["preemption_victim", "victim", "computed tokens thrown away"], victim_rows)

# %% tags=["check"]
assert victim_of == {"last": ["d"], "least_computed": ["c"], "lowest_priority": ["b"]}, "the prose names these victims"

# %% [markdown]
# 池里 {{V_POOL}} 个块（每块 {{S4_BS}} Token）被 `a`、`b`、`c`、`d`（提示词 {{V_LENS['a']}}、{{V_LENS['b']}}、{{V_LENS['c']}}、{{V_LENS['d']}} Token，
# 类别 {{V_PRIO['a']}}、{{V_PRIO['b']}}、{{V_PRIO['c']}}、{{V_PRIO['d']}}）占满，`a` 要一个新块：`last` 赶走最后接纳的 `d`，
# 扔掉它算好的 {{V_LENS['d']}} 个 Token；`least_computed` 赶走只算了 {{V_LENS['c']}} 个 Token 的 `c`；`lowest_priority` 赶走类别最大的 `b`。
#
# 引擎自己记账：每一步给请求的每个 Token 都计入 `num_computed_tokens`，其中落在“重算抢占扔掉过的范围”之内的计入
# `num_recomputed_tokens`（恢复时被前缀缓存命中的不算，因为没有算），`RunResult.summary()` 给出两者与比值 `recompute_waste`，
# 服务器的 `/metrics` 上是 `minibatch:recomputed_tokens_total`。它与 12.3 节 `Metered` 从外面数出来的重复计算应当一致：

# %%
r3 = three["recompute"]
engine_count = r3.summary()["num_recomputed_tokens"]
metered_count = sum(recomputed(r3, q) for q in r3.requests)
print(f"12.3's recompute run: engine counter {engine_count:,} recomputed tokens, Metered {metered_count:,}; "
      f"recompute_waste {r3.summary()['recompute_waste']:.1%}")

# %% tags=["check"]
assert engine_count == metered_count > 0, "the engine's counter equals the count from outside"

# %% [markdown]
# 两种数法都是 {{engine_count:,}} 个 Token。下面按 RFC 的设置在模拟器上比较 `last` 与 `least_computed`：{{V_N}} 个请求、
# {{V_RATE:g}} req/s 泊松到达，提示词在 {{V_IN.lo}}–{{V_IN.hi}}、输出在 {{V_OUT.lo}}–{{V_OUT.hi}} Token 间均匀分布（各为均值上下 50%，
# 即 `--random-range-ratio 0.5` 的形状），池 {{V_POOL_SIM}} 块；{{len(V_SEEDS)}} 个种子，只统计稳态（到达时间在中间 80% 的请求，`summary(trim=0.1)`）：

# %%
lcf = {rule: [] for rule in ("last", "least_computed")}
lcf_rows = []
for seed in V_SEEDS:
    v_wl = synthetic(V_N, V_RATE, input_len=V_IN, output_len=V_OUT, seed=seed)
    for rule in lcf:
        sm = run(v_wl, **SIM, num_kv_blocks=V_POOL_SIM, preemption_victim=rule).summary(trim=0.1)
        lcf[rule].append(sm)
        lcf_rows.append([seed, f"`{rule}`", sm["num_preemptions"], f"{sm['num_recomputed_tokens']:,}",
                         f"{sm['recompute_waste']:.1%}", f"{sm['num_recomputed_tokens'] / max(sm['num_preemptions'], 1):.0f}",
                         f"{sm['ttft_p50']:.2f}", f"{sm['throughput_tok_s']:.0f}"])
md_table(["seed", "preemption_victim", "preemptions", "recomputed tokens", "recompute_waste", "tokens per preemption",
          "TTFT p50 (s)", "output tok/s"], lcf_rows)

# %%
def lcf_ratio(key):
    """Median over seeds of least_computed / last for a summary key."""
    return float(np.median([b[key] / a[key] for a, b in zip(lcf["last"], lcf["least_computed"])]))


tax_last = float(np.median([s_["recompute_waste"] for s_ in lcf["last"]]))
tax_lcf = float(np.median([s_["recompute_waste"] for s_ in lcf["least_computed"]]))
waste_ratio, tput_ratio = lcf_ratio("recompute_waste"), lcf_ratio("throughput_tok_s")
per_pre = float(np.median([(b["num_recomputed_tokens"] / b["num_preemptions"]) / (a["num_recomputed_tokens"] / a["num_preemptions"])
                           for a, b in zip(lcf["last"], lcf["least_computed"])]))
per_seed_ratios = [b["recompute_waste"] / a["recompute_waste"] for a, b in zip(lcf["last"], lcf["least_computed"])]
print(f"recompute tax: last {tax_last:.1%}, least_computed {tax_lcf:.1%}; least_computed / last x{waste_ratio:.2f} "
      f"(per seed {', '.join(f'{x:.2f}' for x in per_seed_ratios)}), per preemption x{per_pre:.2f}, tok/s x{tput_ratio:.2f}")

# %% tags=["check"]
assert all(x < 1 for x in per_seed_ratios) and per_pre < 1, "the prose says least_computed wastes less on every seed"
assert 0.05 < tax_last < 0.3 and abs(tput_ratio - 1) < 0.05, "the prose: a 5-30 % tax, throughput about unchanged"

# %% [markdown]
# 在这个设置下，`last` 的重算税是 {{tax_last:.1%}}（中位数），落在 RFC 报告的 10%–23% 附近；`least_computed` 把它降到
# {{tax_lcf:.1%}}，比值 {{waste_ratio:.2f}}（各种子 {{", ".join(f"{x:.2f}" for x in per_seed_ratios)}}），即少浪费 {{1 - waste_ratio:.0%}}，
# 与 RFC 在线 7B 的“减少 24%–30%”同向、大小相近；每次抢占扔掉的 Token 是 `last` 的 {{per_pre:.2f}} 倍（RFC：减少 35%–41%），
# 吞吐是 {{tput_ratio:.2f}} 倍，几乎不变。“把浪费减半”只在 RFC 的离线 0.5B 实验里接近（减少 40%–59%）；
# 在线的异构负载上 RFC 报告的是减少 24%–30%。`benchmarks/preemption.py` 在 400 个请求、两个池大小上重复这一比较。
#
# 最少计算优先也可能有代价：按定义，被挑中的是算得最少的请求，常常是刚接纳的；它们可能被反复抢占，长请求则更少被打断——
# 这是一条偏向已投入工作的规则，上表只量了浪费与吞吐，公平性要另外量（练习 6）。

# %% [markdown]
# ## 12.7 在真实的 tiny 模型上：抢占不改变输出
#
# 重算之所以可行，是因为它算出的 KV 与原来的一样：同样的 Token、同样的位置，贪心解码下一步的 Token 就一样。
# 换出更直接：拷回来的就是原来的 KV。用嵌入的 tiny 模型验证：一组请求同时到达，池很小时必然抢占；
# 再给一个大池跑一遍作对照（不抢占）：

# %%
TINY_N, TINY_P, TINY_O, SMALL, LARGE = 8, 24, 40, 12, 64     # requests, prompt and output tokens; KV blocks
torch.set_num_threads(1)
tiny_wl = synthetic(TINY_N, float("inf"), input_len=TINY_P, output_len=TINY_O, seed=0)
TINY = dict(model="tiny", block_size=BS, max_num_seqs=TINY_N)

# %% [markdown]
# {{TINY_N}} 个请求（提示词 {{TINY_P}} Token、各生成 {{TINY_O}} Token），池只有 {{SMALL}} 个块（每块 {{BS}} Token）时必然抢占，
# {{LARGE}} 个块时不抢占。这几次运行（重算、换出，以及 12.6 节的 `least_computed`）的输出必须逐 Token 相同：

# %% tags=["nbval-check-output"]
tiny_runs = {f"{LARGE} blocks (no preemption)": run(tiny_wl, **TINY, num_kv_blocks=LARGE),
             f"{SMALL} blocks, recompute": run(tiny_wl, **TINY, num_kv_blocks=SMALL),
             f"{SMALL} blocks, swap": run(tiny_wl, **TINY, num_kv_blocks=SMALL, preemption_mode="swap"),
             f"{SMALL} blocks, least_computed": run(tiny_wl, **TINY, num_kv_blocks=SMALL, preemption_victim="least_computed")}
ref_tokens = [q.output_token_ids for q in tiny_runs[f"{LARGE} blocks (no preemption)"].requests]
same = {}
for name, r in tiny_runs.items():
    same[name] = [q.output_token_ids for q in r.requests] == ref_tokens
    print(f"{name:<26} preemptions {r.summary()['num_preemptions']:>2}, swapped blocks {r.summary()['num_swapped_blocks']:>2}, "
          f"outputs identical to the no-preemption run: {same[name]}")

# %% tags=["check"]
assert all(same.values()), "greedy outputs must not depend on preemption"
assert all(tiny_runs[k].summary()["num_preemptions"] > 0 for k in list(tiny_runs)[1:])
assert tiny_runs[f"{LARGE} blocks (no preemption)"].summary()["num_preemptions"] == 0

# %% [markdown]
# ## 12.8 动手：池大小 × 准入 × 抢占方式
#
# 下面的控件在 12.3 节的负载上运行一次，画出每一步占用的块数与发生抢占的时刻，并打印稳态指标。建议试试：
# 把池从 {{POOLS[-1]}} 块慢慢缩到 {{TIGHT}} 块，看 `max_utilization` 的抢占从无到有、红线越来越密；在同一个池大小下切换到
# `conservative` 和 `guaranteed_no_evict`，比较吞吐与 p99 TPOT 的取舍。

# %% tags=["nbval-ignore-output"]
def explore(pool=POOL, admission="max_utilization", preemption_mode="recompute"):
    r = run_metered(wl, **SIM, num_kv_blocks=pool, admission=admission, preemption_mode=preemption_mode)
    s = steady(r)
    t = np.array([st.start_time for st in r.steps])
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ax.plot(t, [st.kv_blocks_used for st in r.steps], lw=0.8, label="KV blocks used")
    ax.axhline(pool, color="k", ls=":", lw=1)
    for st in r.steps:
        if st.num_preempted:
            ax.axvline(st.start_time, color="C3", alpha=0.25, lw=0.6)
    ax.set(xlabel="time (s)", ylabel="blocks", title=f"{admission}, {preemption_mode}, {pool}-block pool")
    ax.grid(alpha=0.3)
    plt.show()
    print(f"steady state ({s['n']} requests): {s['preemptions']} preemptions (max {s['max_preempt']} per request), "
          f"{s['recomputed']:,} recomputed tokens ({s['recomputed_share']:.1%}), {s['tok_s']:.0f} tok/s, "
          f"TPOT p99 {s['tpot_p99'] * 1e3:.1f} ms")


W.interact(explore,
           pool=W.IntSlider(value=POOL, min=TIGHT, max=2400, step=100, continuous_update=False, description="pool (blocks)"),
           admission=W.Dropdown(options=ADMISSIONS, value="max_utilization"),
           preemption_mode=W.Dropdown(options=MODES, value="recompute"));

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX_RATIOS, EX_SWAP = [0.3, 1.0], [50, 200, 800]
ex_kv = cost["llama-3-8b"]["kv_kib"] / cost["llama-2-7b"]["kv_kib"]

# %% [markdown]
# ## 本章小结
#
# - 乐观准入只检查这一步的块，运行中请求的块数却随解码增长；总需求超过池的那一步，调度器必须抢占。
# - minibatch 从策略顺序的末尾挑抢占对象（顺序之外的运行中请求最先），默认策略下就是最后接纳的请求——与 vLLM V1 的
#   `self.running.pop()`、TensorRT-LLM `MAX_UTILIZATION` 暂停“最后一个已开始的请求”一致；SGLang 则先撤回已生成最少的请求。
# - 重算的代价是 $p + g$ 个 Token 的预填充 FLOPs，换出的代价是 KV 字节数经主机链路往返；纸面上换出更便宜（GQA 时更明显），
#   但 vLLM V1 只保留了重算，换出要主机内存与 PCIe；前缀缓存能省下一部分重算，可池越紧，被释放的块越快被驱逐，省得越少。
# - 池太紧时抢占演变为抖动：同一个请求被反复赶出、反复重算，重复计算占到可观的比例。
# - 选谁让路决定每次抢占浪费多少：`preemption_victim="least_computed"`（vLLM RFC #54644 的最少计算优先）在异构负载上
#   把引擎记下的重算税从 {{tax_last:.1%}} 降到 {{tax_lcf:.1%}}（{{len(V_SEEDS)}} 个种子的中位数），吞吐不变；策略决定谁可以被抢占，规则只在其中挑。
# - 准入控制是源头上的解法：`guaranteed_no_evict`（TensorRT-LLM 默认）从不抢占但批小、吞吐低；`conservative`（SGLang 的新 Token 比例）
#   用估计预留，抢占少、吞吐接近乐观准入；稳态指标要在多个种子上看均值与离散程度。
# - 无论抢占与否、重算还是换出，贪心解码的输出不变——抢占只改变什么时候算，不改变算出什么。
#
# 实验 **L07**（`labs/L07_preemption.ipynb`）请你写出选抢占对象的规则与重算的簿记，再设计一个在过载负载上胜过默认策略、又不抖动的策略。
# 下一章（第 13 章）讲前缀缓存：它让被释放的块继续有用。
#
# ## 练习
#
# 1. **保守程度。** SGLang 的 `--schedule-conservativeness` 把初始比例 0.7 乘上一个系数。在 12.5 节的负载上，
#    把引擎的准入换成 `Conservative(init_ratio={{EX_RATIOS[0]}})`、`Conservative(init_ratio={{EX_RATIOS[1]}})`（`engine.scheduler.admission = ...`，
#    再 `run(wl, engine=engine)`），比较抢占次数、吞吐与 p99 TPOT。比例越高越接近哪一种准入？
# 2. **换出池的大小。** 把 `swap_space_blocks` 设为 {{'、'.join(map(str, EX_SWAP))}}，重跑 12.3 节的 `swap`。主机池放不下时 minibatch 退回重算，
#    重算 Token 怎样随之变化？
# 3. **GQA 与抢占方式。** 把 12.3 节的实验换成 `model="llama-3-8b"`（注意 KV 容量不同，池大小要按块数给出）。重算与换出的吞吐差别变大还是变小？用 12.3 节的代价模型解释。
# 4. **同一步里的接纳。** 12.2 节说 minibatch 会把被抢占者释放的块在同一步交给新请求，而 vLLM V1 不会。写一个策略（`ContinuousPolicy` 的子类），
#    当池里空闲块少于运行中请求数时把等待中的请求排除在顺序之外，近似 vLLM V1 的行为；在 {{TIGHT}} 块的池上比较重算 Token 与 p99 TPOT。
# 5. **SGLang 的撤回顺序。** 写一个策略，让调度顺序的末尾是“已生成 Token 最少、提示词最长”的运行中请求（SGLang `retract_decode` 的顺序），
#    与默认（最后接纳者）比较抖动程度。
# 6. **最少计算优先的公平性。** 在 12.6 节的负载（种子 {{V_SEEDS[0]}}）上，按提示词长度把请求分成两半，分别比较 `last` 与 `least_computed`
#    下两半的抢占次数与 p90 E2E。谁为更少的浪费付了代价？再把池从 {{V_POOL_SIM}} 块放大到 {{V_POOL_SIM + 100}} 块，比值 `recompute_waste` 怎样变？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 比例越高，为运行中请求预留的越多，越接近 `guaranteed_no_evict`（抢占更少、批更小）；比例越低越接近 `max_utilization`。
#    注意 $r$ 每步都在衰减，初值只决定开头与每次抢占之后的一段时间，所以差别比初值的差别小；12.5 节的比例曲线说明了这一点。
# 2. `run_metered(wl, **SIM, num_kv_blocks=POOL, preemption_mode="swap", swap_space_blocks={{EX_SWAP[0]}})`；主机池越小，越多的抢占退回重算，
#    `steady(...)["recomputed"]` 从 0 逐渐回到纯重算的水平。
# 3. Llama-3-8B 每 Token 的 KV 是 Llama-2-7B 的 {{ex_kv:.0%}}，换出更便宜；但同样的池（按块计）能放的 Token 数相同，抢占次数相近，
#    吞吐差别仍然不大——在这个模拟器里，瓶颈是池能容纳的批大小，而不是恢复的代价。
# 4. 在 `schedule_order` 里：`free = state.kv.num_free_blocks`；若 `free < len(state.running)` 就只返回 `state.running`，
#    否则返回 `state.running + state.waiting`。把它装进 `run_metered` 的引擎（`engine.scheduler.policy = ...`，计数要自己加上，
#    或者继承 `Metered`），用 `steady(...)` 比较。这和 L07 任务 3 的思路相同：给运行中的请求留出生长的余地。
# 5. `sorted(state.running, key=lambda r: (-r.num_output_tokens, r.num_prompt_tokens))` 作为运行中请求的顺序（末尾即撤回对象），
#    再接上 `state.waiting`。已生成最少的请求重算最便宜，但它们也往往是刚被恢复的请求——观察是否有请求被反复抢占。
# 6. `run(v_wl, **SIM, num_kv_blocks=V_POOL_SIM, preemption_victim=rule).requests` 给出每个请求的 `num_preemptions`、`prompt_len`、`e2e`
#    与 `recomputed_tokens`；按 `prompt_len` 的中位数分组。预期短提示词的请求更常被最少计算优先挑中（它们算得少），
#    长请求少被打断；池放大后抢占变少，两种规则的重算税的绝对差距变小，比值却不一定变
#    （`benchmarks/preemption.py --pools 500 600` 给出两个池上的比值）。
#    用数据确认，不要凭预期下结论。
#
# </details>
