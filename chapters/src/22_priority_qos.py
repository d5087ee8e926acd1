# %% [markdown]
# # 第 22 章 优先级调度、QoS 与优先级反转
#
# 生产中的一台推理服务器很少只服务一种请求：在线对话要求首 Token 快（交互类），离线摘要、批量评测只要求吞吐（批处理类）。
# 把请求分成**优先级类别**（Priority Class），让紧急的类别先被调度，是保证**服务质量**（QoS, Quality of Service）最直接的办法。
# 但“先调度”并不等于“先运行”：调度器可以把紧急请求排在等待队列的最前面，可如果 KV 池已经被低优先级请求占满，
# 它仍然要等——高优先级任务等待低优先级任务持有的资源，这就是操作系统里的**优先级反转**（Priority Inversion）
# （Sha, Rajkumar, Lehoczky, *Priority Inheritance Protocols*, IEEE Trans. Computers 1990；1997 年火星探路者号的复位故障是它最著名的例子）。
#
# 本章先写出优先级调度的排序规则，对照 vLLM 与 SGLang 的实现；然后在模拟器里**复现**由被持有的 KV 造成的反转，
# 再比较三种修复：抢占式优先级（Preemptive Priority）、为高优先级类别预留 KV（KV 配额，KV Quota），以及按类别并发上限（Per-class Concurrency Limit）。
#
# ## 学习目标
#
# - 写出带老化的优先级排序键，区分非抢占式与抢占式两种顺序，读懂 minibatch 的 `PriorityPolicy`；
# - 说清 vLLM V1（v0.11.0）的 `--scheduling-policy priority` 只在运行中的请求长不动时才抢占最低优先级者、
#   等待中的紧急请求不会抢占任何人，以及 SGLang v0.5.3 的优先级抢占阈值；
# - 在模拟的 Llama-2-7B / A100-80G 上复现优先级反转：紧急请求排在队首，却要等低优先级请求释放 KV；
# - 用“反转延迟”与“被抢占者要重算的 Token”两个量比较修复的收益与代价；
# - 在交互类 + 批处理类的混合负载上、稳态下（多个种子，取中位数）比较 FCFS、非抢占式、抢占式、KV 配额与并发上限；
# - 在真实的 tiny 模型上验证：换哪种优先级规则，贪心输出都逐 Token 不变；
# - 复现 vLLM issue #40004：序列槽位（`max_num_seqs`）占满时，vLLM V1 的优先级调度让紧急请求排队，抢占式规则让它立即运行。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.policies.priority import PriorityPolicy
from minibatch.results import steady_state, steady_window
from minibatch.runner import run
from minibatch.viz import md_table
from minibatch.workload import RequestSpec, Workload, lognormal, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")   # the simulated server of this chapter
# 22.2: the pool's blocks and tokens per block (the engine's default block_size); blocks kept for class 0 by the KV quota
POOL, BLOCK, RESERVE_BURST = 400, 16, 130
BURST = dict(n=30, prompt=512, out_min=256, out_step=16, t_hi=4.0, hi_prompt=2048, hi_out=32, max_lo_running=4)
need_hi = -(-BURST["hi_prompt"] // BLOCK)                             # blocks the urgent prompt needs
# 22.3: the mixed load's pool, class-0 reserve (KV quota), class-1 concurrency cap; class-0 SLO and the share to meet it;
# lognormal length medians; seconds of arrivals, class rates (req/s), seeds and the steady-state trim
MIX_POOL, RESERVE, MAX_RUN_LO = 300, 64, 6
SLO_TTFT, ATT_TARGET = 0.2, 0.9
LEN = dict(prompt=512, hi_out=32, lo_out=192)
MIX_DUR, HI_RATE, LO_RATE, SEEDS, TRIM22 = 60.0, 1.0, 2.0, [1, 2, 3], 0.2
# 22.5: the sequence slots (max_num_seqs) of the slot-bound runs, and the pool, large enough for everyone
SLOTS, SLOT_POOL = 8, 4000
# 22.4: the tiny model's case (class-1 requests, their prompt and output, the pool, the step class 0 arrives at, ...)
TINY = dict(n_lo=6, prompt_lo=40, out_lo=40, pool=20, ref_pool=64, at_step=8, prompt_hi=64, out_hi=8, quota=14)
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 22.1 优先级类别与排序键
#
# 每个请求带一个整数类别 $c_i$，**越小越紧急**（vLLM 的约定）。minibatch 的 `priority` 策略按下面的键从小到大排序：
#
# $$
# k_i(t) = \Big( c_i - \frac{t - a_i}{A},\ a_i \Big),
# $$
#
# 其中 $a_i$ 是到达时间，$A$ 是老化（Aging）的时间常数 `aging_s`：每等 $A$ 秒升一级，所以类别 $c$ 的请求最多等 $c \cdot A$ 秒
# 就排到新来的 0 类请求前面，饥饿（Starvation）有上界；`aging_s=None` 是严格优先级（vLLM 的行为）。本章的实验都用严格优先级，
# 让类别的作用单独显现。键的第一项 $\ell_i = c_i - (t-a_i)/A$ 叫作请求的**级别**。有了键，还要决定运行中与等待中的请求怎样比较：
#
# - **非抢占式**（`preemptive=False`）：先是全部运行中的请求，再是等待队列，各自按键排序。等待中的请求永远不会挤掉运行中的；
#   运行中的请求长不动时，抢占对象是顺序末尾、即级别最低的运行中请求。
# - **抢占式**（`preemptive=True`，默认）：两组合并成一个顺序。等待中的请求 $w$ 排到运行中的请求 $r$ 前面，当且仅当
#   $\ell_w + \delta < \ell_r$（$\delta$ 是 `margin`，默认 0）；排在前面的等待请求在块不够时可以抢占排在它后面的运行中请求
#   （第 12 章的 `Scheduler._pick_victim`）。$\delta = 0$ 时同一类别的请求之间从不互相抢占——否则同类请求只会把 KV 来回倒手。

# %%
print(inspect.getsource(PriorityPolicy.schedule_order))
print(inspect.getsource(PriorityPolicy._merge))

# %% [markdown]
# 各框架的优先级调度并不相同，差别恰好落在“等待中的紧急请求能不能抢占”上：
#
# | 框架（版本，源文件） | 排序 | 等待中的紧急请求 | 运行中的请求长不动时 |
# |---|---|---|---|
# | vLLM V1（v0.11.0；`vllm/v1/core/sched/scheduler.py` 的 `Scheduler.schedule`，`vllm/v1/core/sched/request_queue.py` 的 `PriorityRequestQueue`） | `--scheduling-policy priority`：等待队列是按 `(priority, arrival_time)` 的堆，值小者先；运行中的请求按进入 `self.running` 的顺序先调度 | **不抢占**：`allocate_slots` 失败就 `break`，这一步不再接纳任何等待请求；这一步发生过抢占时也不接纳（`if not preempted_reqs`） | 抢占 `max(self.running, key=lambda r: (r.priority, r.arrival_time))`，即优先级最低、到达最晚者 |
# | vLLM V0（PR #5958 “[Core] Adding Priority Scheduling”，2024-09 合入；V0 在 v0.11.0 删除） | 运行与等待队列都按优先级排序 | 强制抢占：运行队列里优先级低于等待请求的请求被赶回等待队列 | 同上 |
# | SGLang（v0.5.3；`python/sglang/srt/managers/schedule_policy.py` 的 `PrefillAdder.preempt_to_schedule`，`scheduler.py` 的 `get_new_batch_prefill`） | `--enable-priority-scheduling`（默认关）；默认**值大者先**，`--schedule-low-priority-values-first` 反过来；同优先级按进入等待队列的时间 | 只抢占优先级差**大于** `--priority-scheduling-preemption-threshold`（默认 10）的运行中请求，且要释放的 Token 足够新请求的输入加 $\min(m, 4096)$ 才抢占；只在 `running_batch.batch_is_full` 时尝试 | 撤回（第 12 章的 `retract_decode`） |
# | minibatch（`minibatch/policies/priority.py`） | 上面的键 $k_i(t)$ | `preemptive=False`：不抢占（vLLM V1）；`preemptive=True`：抢占级别低出 `margin` 以上的（vLLM V0；`margin` 对应 SGLang 的阈值） | 抢占顺序末尾的运行中请求（级别最低者） |
#
# 注意 SGLang 的默认阈值是 10：类别 0 与类别 1 之间**不会**发生抢占，要么把类别的数值拉开，要么调低阈值。
# minibatch 与 vLLM V1 还有一处小差别：vLLM V1 在有抢占的一步里不接纳任何等待请求，minibatch 只在等待请求被拒绝后才停止接纳（第 12 章 12.2 节）。
#
# ## 22.2 复现：被持有的 KV 造成的优先级反转
#
# 设池里有 $N$ 个块、块大小 $B$。一个紧急请求 $h$ 在 $t_0$ 到达，开始预填充需要 $b_h = \lceil p_h / B \rceil$ 个块，而此刻只有 $F(t_0)$ 个空闲块。
# 非抢占式调度下，它排在等待队列的最前面，却要等到空闲块攒够 $b_h$ 个；而在非抢占式规则下，队首请求被拒绝后不会再接纳它后面的低优先级请求，
# 所以块只会随低优先级请求结束（或彼此抢占）而增加。若运行中的低优先级请求 $j$ 还要生成 $r_j$ 个 Token、结束时释放 $s_j$ 个块，
# 每步耗时约 $\tau$，则**反转延迟**（Inversion Delay）约为
#
# $$
# W_\text{inv} \approx \tau \cdot \min\Big\{ r_{(m)} \;:\; \sum_{k \le m} s_{(k)} \ge b_h - F(t_0) \Big\},
# $$
#
# 其中 $r_{(1)} \le r_{(2)} \le \dots$ 按剩余长度排序。它与紧急请求自己的工作量无关，只取决于**别人**还要跑多久、占了多少块。
# 抢占式调度把这段等待换成被抢占者的重算：挑出的抢占对象集合 $V$ 要满足 $\sum_{v \in V} s_v \ge b_h - F(t_0)$，
# 它们恢复时要把 $\sum_{v \in V} (p_v + g_v)$ 个 Token 重新算一遍（第 12 章）。
#
# 实验：一个批处理作业在 $t = 0$ 一次提交 {{BURST["n"]}} 个 1 类请求（提示词 {{BURST["prompt"]}} Token，输出 {{BURST["out_min"]}}–{{BURST["out_min"] + BURST["out_step"] * (BURST["n"] - 1)}} Token），
# 池只有 {{POOL}} 个块（每块 {{BLOCK}} Token，相当于显存被别的模型挤占后剩下的一小块）；$t$ = {{BURST["t_hi"]:g}} s 时来了一个 0 类的紧急请求：RAG 场景，
# 提示词 {{BURST["hi_prompt"]}} Token（{{need_hi}} 个块），只生成 {{BURST["hi_out"]}} 个 Token。

# %%
burst_specs = [RequestSpec(0.0, BURST["prompt"], BURST["out_min"] + BURST["out_step"] * i, priority=1, request_id=f"lo{i}")
               for i in range(BURST["n"])]
burst = Workload(burst_specs + [RequestSpec(BURST["t_hi"], BURST["hi_prompt"], BURST["hi_out"], priority=0, request_id="hi")],
                 name="burst")
assert max(-(-(r.prompt_len + r.max_tokens) // 16) for r in burst) <= POOL, "every request fits the pool on its own"


def run_policy(workload, policy, pool=POOL):
    """Run under ``policy`` (an instance); record each step's blocks held per class."""
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=pool), clock="virtual")
    engine.scheduler.policy = policy
    trace = []

    def on_step(eng, st):
        held = {0: 0, 1: 0}
        for r in eng.scheduler.running:
            held[r.priority] += len(eng.kv.block_table(r.request_id))
        trace.append((st.start_time, held[0], held[1]))

    result = run(workload, engine=engine, on_step=on_step)
    result.extra["held"] = np.array(trace)
    assert all(q.completed for q in result.requests), "no request is lost"
    return result


POLICIES = {
    "FCFS (continuous)": lambda: ContinuousPolicy(),
    "priority, non-preemptive (vLLM V1)": lambda: PriorityPolicy(aging_s=None, preemptive=False),
    "priority, preemptive": lambda: PriorityPolicy(aging_s=None),
    "non-preemptive + KV quota": lambda: PriorityPolicy(aging_s=None, preemptive=False,
                                                        kv_quota={1: POOL - RESERVE_BURST}),
    f"non-preemptive + max {BURST['max_lo_running']} running": lambda: PriorityPolicy(
        aging_s=None, preemptive=False, max_running={1: BURST["max_lo_running"]}),
}
bursts = {name: run_policy(burst, make()) for name, make in POLICIES.items()}


# %%
def burst_row(r):
    q = {x.request_id: x for x in r.requests}
    lo = [x for x in r.requests if x.priority == 1]
    end = max(x.finish_time for x in lo)
    return dict(queue=q["hi"].queue_delay, ttft=q["hi"].ttft, lo_end=end, lo_tok_s=sum(x.output_len for x in lo) / end,
                preempt=sum(x.num_preemptions for x in lo),
                held_at_arrival=int(r.extra["held"][np.searchsorted(r.extra["held"][:, 0], BURST["t_hi"]) - 1, 2]))


b = {name: burst_row(r) for name, r in bursts.items()}
md_table(["policy", "hi: queue delay (s)", "hi: TTFT (s)", "class-1 blocks held at t=4 s", "low preemptions",
          "batch job done at (s)", "batch output tok/s"],
         [[n, f"{v['queue']:.3f}", f"{v['ttft']:.3f}", v["held_at_arrival"], v["preempt"], f"{v['lo_end']:.1f}",
           f"{v['lo_tok_s']:.0f}"] for n, v in b.items()])
NP, PR, QU, MR = list(POLICIES)[1:]
inversion = b[NP]["queue"] - b[PR]["queue"]
print(f"hi needs {need_hi} blocks; inversion delay (non-preemptive minus preemptive queue delay): {inversion:.3f} s")

# %% tags=["check"]
assert b[NP]["queue"] > 5 * b[PR]["queue"] and b[NP]["held_at_arrival"] > POOL - need_hi, \
    "the prose says the urgent request waits because class 1 holds the pool"
assert b[list(POLICIES)[0]]["ttft"] > 10 * b[NP]["ttft"], "the prose says FCFS makes hi wait for the batch job"
assert b[PR]["preempt"] > b[NP]["preempt"] and b[QU]["preempt"] == 0
assert b[QU]["lo_tok_s"] < 0.8 * b[NP]["lo_tok_s"] and b[QU]["queue"] < b[NP]["queue"] / 5
assert b[PR]["lo_end"] < 1.05 * b[NP]["lo_end"], "the prose says the batch job does not take longer"
assert b[MR]["queue"] < b[NP]["queue"] / 5 and b[MR]["preempt"] == 0, "the prose says the cap works on this job"

# %% [markdown]
# 四点观察，数字都来自上表：
#
# - **FCFS** 根本不区分类别，紧急请求排在整个批处理作业后面，TTFT 达到 {{b[list(POLICIES)[0]]["ttft"]:.1f}} s——这是排队，还不是反转。
# - **非抢占式优先级**（vLLM V1 的规则）把它排到了队首，可 $t$ = {{BURST["t_hi"]:g}} s 时 1 类请求占着 {{b[NP]["held_at_arrival"]}} 个块，
#   空闲块不到它要的 {{need_hi}} 个。它的排队延迟是 {{b[NP]["queue"]:.3f}} s，抢占式下只有 {{b[PR]["queue"]:.3f}} s：
#   多出来的 {{inversion:.3f}} s 就是反转延迟，完全由别人占着的 KV 决定。
# - **抢占式优先级**让它立即开始，代价是 1 类请求的抢占从 {{b[NP]["preempt"]}} 次增加到 {{b[PR]["preempt"]}} 次（被抢占者要重算）；
#   批处理作业的总用时并没有变长（非抢占式 {{b[NP]["lo_end"]:.1f}} s，抢占式 {{b[PR]["lo_end"]:.1f}} s）。
# - **KV 配额**：1 类请求按最终长度累计最多占 {{POOL - RESERVE_BURST}} 个块，剩下的 {{RESERVE_BURST}} 个块永远留给 0 类。紧急请求不必抢占任何人就立即开始，
#   一次抢占也没有；代价是批处理作业的并发被压低，吞吐从 {{b[NP]["lo_tok_s"]:.0f}} 降到 {{b[QU]["lo_tok_s"]:.0f}} tok/s——
#   预留的块在紧急请求不来的时候也空着。**并发上限**（1 类最多 {{BURST["max_lo_running"]}} 个同时运行）在这个作业上效果相同、吞吐为 {{b[MR]["lo_tok_s"]:.0f}} tok/s，
#   但它限制的是请求**个数**而不是块数，能不能保护紧急请求取决于请求有多长（22.3 节会看到它失效的情形）。
#
# 下图画出三种规则下每一步两类请求各占的块数（紫色竖线是紧急请求到达，绿色竖线是它的第一个 Token）：

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3), sharey=True)
for ax, name in zip(axes, (NP, PR, QU)):
    h = bursts[name].extra["held"]
    ax.stackplot(h[:, 0], h[:, 2], h[:, 1], labels=["class 1 (batch)", "class 0 (urgent)"], colors=["0.7", "C3"], step="post")
    ax.axhline(POOL, color="k", ls=":", lw=1)
    hi = next(q for q in bursts[name].requests if q.request_id == "hi")
    ax.axvline(hi.arrival_time, color="C4", lw=1.2)
    ax.axvline(hi.first_token_time, color="C2", lw=1.2)
    ax.set(xlim=(3.0, 7.0), xlabel="time (s)", title=name, ylim=(0, POOL * 1.05))
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("KV blocks held")
axes[0].legend(loc="lower left", fontsize=7)
fig.suptitle(f"An urgent {BURST['hi_prompt']}-token request meets a {POOL}-block pool held by a batch job (llama-2-7b, A100-80G)",
             fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# 左图里紧急请求到达后，空闲块一直少于它要的 {{need_hi}} 个，直到 1 类请求结束（或彼此抢占）空出的块攒够为止；中图里它一到就挤掉了几个 1 类请求；
# 右图里 1 类请求从来不超过配额线，紧急请求用的是一直空着的预留块。
#
# 为什么不用操作系统的**优先级继承**（Priority Inheritance）？它让持有资源的低优先级任务临时继承高优先级，尽快跑完、释放资源。
# 可在连续批处理里，持有 KV 的低优先级请求本来就在每一步都解码一个 Token（Token 预算够的时候），提高它们的优先级并不能让它们更快结束；
# 它们释放 KV 的时刻由还要生成多少 Token 决定。能缩短等待的只有三条路：收回资源（抢占）、事先划分资源（预留/配额）、限制低优先级的占用（准入上限）。
#
# ## 22.3 稳态：交互类与批处理类的混合负载
#
# 单个例子说明机制，比较规则要看稳态。负载由两类请求混合而成（都是泊松到达）：
#
# - 0 类（交互）：{{HI_RATE:g}} req/s，提示词中位数 {{LEN["prompt"]}}（对数正态），输出中位数 {{LEN["hi_out"]}}；SLO 是**每个请求**的 TTFT ≤ {{SLO_TTFT * 1e3:.0f}} ms，
#   要求至少 {{ATT_TARGET:.0%}} 满足；
# - 1 类（批处理）：{{LO_RATE:g}} req/s，提示词中位数 {{LEN["prompt"]}}，输出中位数 {{LEN["lo_out"]}}；关心稳态窗口内的输出吞吐与 E2E。
#
# 池 {{MIX_POOL}} 个块，0 类的 KV 配额规则预留 {{RESERVE}} 个块（1 类配额 {{MIX_POOL - RESERVE}}），并发上限规则让 1 类最多 {{MAX_RUN_LO}} 个同时运行。
# 每种规则跑 {{len(SEEDS)}} 个负载种子，每个 {{MIX_DUR:.0f}} s 的到达，去掉最先与最后 {{TRIM22:.0%}} 到达的请求（`steady_state(..., trim={{TRIM22}})`），
# 报告中位数：

# %%
MIX_POLICIES = {
    "FCFS": lambda: ContinuousPolicy(),
    "non-preemptive": lambda: PriorityPolicy(aging_s=None, preemptive=False),
    "preemptive": lambda: PriorityPolicy(aging_s=None),
    f"KV quota (reserve {RESERVE})": lambda: PriorityPolicy(aging_s=None, preemptive=False,
                                                            kv_quota={1: MIX_POOL - RESERVE}),
    f"max {MAX_RUN_LO} class-1 running": lambda: PriorityPolicy(aging_s=None, preemptive=False, max_running={1: MAX_RUN_LO}),
}


def mixed(seed, n_hi=int(HI_RATE * MIX_DUR) + 1, n_lo=int(LO_RATE * MIX_DUR) + 1):
    hi = synthetic(n_hi, HI_RATE, input_len=lognormal(median=LEN["prompt"], sigma=0.4, max=1024),
                   output_len=lognormal(median=LEN["hi_out"], sigma=0.5, max=128), seed=seed, priorities=[0], name="hi")
    lo = synthetic(n_lo, LO_RATE, input_len=lognormal(median=LEN["prompt"], sigma=0.4, max=1024),
                   output_len=lognormal(median=LEN["lo_out"], sigma=0.5, max=512), seed=seed + 100, priorities=[1], name="lo")
    return hi.merge(lo, name="mixed")


# %%
def steady_classes(result):
    """Steady-state metrics per class: the middle 60% of arrivals; class-1 tokens made in that window."""
    t0, t1 = steady_window(result.requests, TRIM22)
    mid = steady_state(result.requests, TRIM22)
    hi = [q for q in mid if q.priority == 0]
    lo = [q for q in mid if q.priority == 1]
    made = sum(int(np.count_nonzero((np.asarray(q.token_times) >= t0) & (np.asarray(q.token_times) < t1)))
               for q in result.requests if q.priority == 1)
    ttft = [q.ttft for q in hi]
    return dict(n_hi=len(hi), hi_p50=float(np.median(ttft)), hi_p90=float(np.percentile(ttft, 90)),
                attain=float(np.mean([t <= SLO_TTFT for t in ttft])), lo_e2e=float(np.median([q.e2e for q in lo])),
                lo_tok_s=made / (t1 - t0), preempt=sum(q.num_preemptions for q in mid))


# %%
largest = max(-(-(r.prompt_len + r.max_tokens) // 16) for s in SEEDS for r in mixed(s))
assert largest <= MIX_POOL - RESERVE, "every request fits the pool, and every class-1 request fits its quota"
grid = {(name, s): steady_classes(run_policy(mixed(s), make(), pool=MIX_POOL))
        for s in SEEDS for name, make in MIX_POLICIES.items()}


def med(name, key):
    return float(np.median([grid[name, s][key] for s in SEEDS]))


md_table(["policy", "class 0: TTFT p50 (ms)", "TTFT p90 (ms)", f"TTFT ≤ {SLO_TTFT * 1e3:.0f} ms", "class 1: E2E p50 (s)",
          "class 1 output tok/s", "preemptions"],
         [[n, f"{med(n, 'hi_p50') * 1e3:.0f}", f"{med(n, 'hi_p90') * 1e3:.0f}", f"{med(n, 'attain'):.0%}",
           f"{med(n, 'lo_e2e'):.2f}", f"{med(n, 'lo_tok_s'):.0f}", f"{med(n, 'preempt'):.0f}"] for n in MIX_POLICIES])
print("steady-state class-0 requests per seed:", [grid["FCFS", s]["n_hi"] for s in SEEDS],
      "| attainment per seed:", {n: [round(grid[n, s]["attain"], 2) for s in SEEDS] for n in MIX_POLICIES})
lo_max_blocks = max(-(-(r.prompt_len + r.max_tokens) // 16) for s in SEEDS for r in mixed(s) if r.priority == 1)
print(f"largest class-1 request: {lo_max_blocks} blocks; {MAX_RUN_LO} of them: {MAX_RUN_LO * lo_max_blocks} blocks; pool {MIX_POOL}")

# %%
names = list(MIX_POLICIES)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
xs = np.arange(len(names))
for k, s in enumerate(SEEDS):
    ax1.scatter(xs + (k - 1) * 0.12, [grid[n, s]["attain"] * 100 for n in names], s=12, color="0.4", zorder=3)
    ax2.scatter(xs + (k - 1) * 0.12, [grid[n, s]["lo_tok_s"] for n in names], s=12, color="0.4", zorder=3)
ax1.bar(xs, [med(n, "attain") * 100 for n in names], color="C3", alpha=0.7)
ax2.bar(xs, [med(n, "lo_tok_s") for n in names], color="C0", alpha=0.7)
ax1.axhline(ATT_TARGET * 100, color="k", ls=":", lw=1)
ax1.set(ylabel=f"% class-0 with TTFT ≤ {SLO_TTFT * 1e3:.0f} ms", ylim=(0, 105))
ax2.set(ylabel="class-1 output tok/s (steady)")
for ax in (ax1, ax2):
    ax.set_xticks(xs, ["FCFS", "non-preempt.", "preemptive", "KV quota", "max running"], fontsize=8)
    ax.grid(alpha=0.3, axis="y")
fig.suptitle(f"Interactive + batch on llama-2-7b / A100-80G, {MIX_POOL}-block pool (bars: median of 3 seeds; dots: seeds)",
             fontsize=10)
fig.tight_layout()
plt.show()
FC, NPm, PRm, QUm, MRm = names
quota_loss = [1 - grid[QUm, s]["lo_tok_s"] / grid[NPm, s]["lo_tok_s"] for s in SEEDS]
print("class-1 steady output lost to the quota, per seed:", [f"{x:.0%}" for x in quota_loss])

# %% tags=["check"]
assert med(FC, "attain") < med(NPm, "attain") < ATT_TARGET <= min(med(PRm, "attain"), med(QUm, "attain")), \
    "the prose orders the attainments this way"
assert med(QUm, "lo_tok_s") < 0.9 * med(NPm, "lo_tok_s") and med(PRm, "lo_tok_s") > 0.95 * med(NPm, "lo_tok_s")
assert med(MRm, "attain") < ATT_TARGET and med(PRm, "preempt") > med(NPm, "preempt")
assert med(QUm, "preempt") < med(NPm, "preempt") / 5, "the prose says the quota hardly ever preempts"
assert min(quota_loss) > 0.1, "the prose says the quota costs class 1 throughput on every seed"
assert MAX_RUN_LO * lo_max_blocks > MIX_POOL

# %% [markdown]
# 每个种子的稳态窗口里只有 {{min(grid['FCFS', s]['n_hi'] for s in SEEDS)}}–{{max(grid['FCFS', s]['n_hi'] for s in SEEDS)}} 个 0 类请求，
# 所以尾部只报 p90（再往上就只是最大值）。中位数（{{len(SEEDS)}} 个种子）给出的排序很清楚：
#
# - 不分类别的 FCFS 下，只有 {{med(FC, "attain"):.0%}} 的交互请求满足 TTFT ≤ {{SLO_TTFT * 1e3:.0f}} ms；
# - 非抢占式优先级把它提高到 {{med(NPm, "attain"):.0%}}，p50 只有 {{med(NPm, "hi_p50") * 1e3:.0f}} ms，
#   可 p90 仍有 {{med(NPm, "hi_p90") * 1e3:.0f}} ms——排在队首却拿不到块的那些请求，就是反转留下的尾巴；
# - 抢占式优先级让达成率到 {{med(PRm, "attain"):.0%}}、p90 降到 {{med(PRm, "hi_p90") * 1e3:.0f}} ms，抢占次数从
#   {{med(NPm, "preempt"):.0f}} 增加到 {{med(PRm, "preempt"):.0f}}，批处理类的稳态吞吐仍是 {{med(PRm, "lo_tok_s"):.0f}} tok/s
#   （非抢占式 {{med(NPm, "lo_tok_s"):.0f}}）：在这个负载上，重算的代价很小；
# - 预留 {{RESERVE}} 个块的 KV 配额同样达到 {{med(QUm, "attain"):.0%}}，几乎不抢占，但批处理类的吞吐降到
#   {{med(QUm, "lo_tok_s"):.0f}} tok/s：到达完全相同，稳态窗口里却少产出了 {{min(quota_loss):.0%}}–{{max(quota_loss):.0%}}（各种子），
#   说明批处理类的请求在排队积压——配额把它的服务能力压到了负载以下；E2E 中位数从 {{med(NPm, "lo_e2e"):.2f}} s 变成
#   {{med(QUm, "lo_e2e"):.2f}} s（积压时这个数随压测时长增长，不是稳态值）；
# - 1 类最多 {{MAX_RUN_LO}} 个同时运行的并发上限只到 {{med(MRm, "attain"):.0%}}：负载里最长的 1 类请求要 {{lo_max_blocks}} 个块（上面的单元格打印了它），
#   {{MAX_RUN_LO}} 个这样的请求可占 {{MAX_RUN_LO * lo_max_blocks}} 个块，比整个池（{{MIX_POOL}} 块）还大，个数上限保护不了 KV。
#
# 选哪一种取决于代价落在谁身上：抢占把代价给被抢占者（重算，在 KV 昂贵、提示词很长时更贵）；配额把代价给低优先级类别的吞吐
# （预留的块在紧急请求少的时候闲着）；对交互类，两者都比非抢占式好。这里的结论只对这个负载、这个池成立：练习 1、2 请你改变它们。
#
# ## 22.4 在真实的 tiny 模型上：规则不改变输出
#
# 抢占只改变**什么时候**算、不改变算出什么（第 12 章）。用嵌入的 tiny 模型手动驱动引擎：{{TINY["n_lo"]}} 个 1 类请求（提示词 {{TINY["prompt_lo"]}} Token、
# 各生成 {{TINY["out_lo"]}} 个 Token）先开始，池只有 {{TINY["pool"]}} 个块（每块 {{BLOCK}} Token）；第 {{TINY["at_step"]}} 步时来一个 0 类请求
# （提示词 {{TINY["prompt_hi"]}} Token、生成 {{TINY["out_hi"]}} 个 Token）。用步数而不是时间计量，结果与机器快慢无关。
# 三种规则的输出都要与 {{TINY["ref_pool"]}} 个块、FCFS（不抢占）的对照运行逐 Token 相同：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
greedy = dict(temperature=0.0, ignore_eos=True)


def tiny_case(policy, pool):
    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", num_kv_blocks=pool, block_size=16, max_num_seqs=8),
                       clock="virtual")
    engine.scheduler.policy = policy
    for i in range(TINY["n_lo"]):
        engine.add_request([10 + (7 * i + j) % 90 for j in range(TINY["prompt_lo"])],
                           SamplingParams(max_tokens=TINY["out_lo"], **greedy),
                           request_id=f"lo{i}", priority=1)
    outs, reqs, step, first = {}, {}, 0, None
    while engine.has_unfinished_requests():
        if step == TINY["at_step"]:
            engine.add_request([200 + j for j in range(TINY["prompt_hi"])], SamplingParams(max_tokens=TINY["out_hi"], **greedy),
                               request_id="hi", priority=0)
            reqs["hi"] = engine.requests["hi"]
        for r in engine.step():
            if r.status.finished:
                outs[r.request_id] = list(r.output_token_ids)
        step += 1
        if first is None and "hi" in reqs and reqs["hi"].num_output_tokens > 0:
            first = step - TINY["at_step"]
    return outs, first, engine.scheduler.num_preemptions


reference, _, _ = tiny_case(ContinuousPolicy(), TINY["ref_pool"])
tiny = {"non-preemptive": PriorityPolicy(aging_s=None, preemptive=False), "preemptive": PriorityPolicy(aging_s=None),
        f"KV quota (class 1: {TINY['quota']} blocks)": PriorityPolicy(aging_s=None, preemptive=False, kv_quota={1: TINY["quota"]})}
tiny_first = {}
for name, pol in tiny.items():
    outs, first, npre = tiny_case(pol, TINY["pool"])
    tiny_first[name] = first
    same = outs == reference
    print(f"{name:<30} hi's first token {first:>2} steps after it arrived; preemptions {npre:>2}; "
          f"outputs identical to the reference: {same}")
    assert same, "greedy outputs must not depend on the priority rule"
assert tiny_first["preemptive"] < tiny_first["non-preemptive"]

# %% [markdown]
# 在真实模型上也是同样的图景：非抢占式下 0 类请求在到达后第 {{tiny_first["non-preemptive"]}} 步才出第一个 Token，
# 抢占式下第 {{tiny_first["preemptive"]}} 步，而所有请求的输出与不抢占的对照运行完全相同。

# %% [markdown]
# ## 22.5 槽位造成的反转：等待中的请求能否挤掉运行中的（vLLM issue #40004）
#
# 22.2 节的反转来自被持有的 **KV**。还有一种更简单的资源也会被持有：**序列槽位**（`max_num_seqs`，一步里最多的请求数）。
# vLLM issue #40004（“[Feature]: Priority scheduling supports preemption of requests in the running queue by requests in the waiting queue”，
# 2026-04-16 提出，标签 feature request / help wanted，至今未关闭）描述的正是它：现在的优先级调度只在资源不够时从运行队列里赶走低优先级请求；
# 而调度等待队列时，如果等待的请求排不进去（例如运行队列已达 `max_num_seqs`），**即使是高优先级请求也不能抢占运行队列里的请求**。
# 维护者的回复是“this seems like a serious issue”。原因在 `vllm/v1/core/sched/scheduler.py` 的 `Scheduler.schedule`
# （main 分支快照提交 `00024d3`）：等待队列的循环一开头就是 `if len(self.running) == self.max_num_running_reqs: break`，
# 不看优先级。修复它的 PR #45558、#45561（2026-06）与 #54530（2026-08）都还开着，做法相同：槽位满时，若等待请求的 `priority`
# **严格**小于运行队列里 `max(running, key=(priority, arrival_time))` 的那个，就抢占它（只比 `priority`，不用到达时间打破平局，
# 以免同级请求来回抢占）；KV 不够时的等待队列抢占留作后续。
#
# minibatch 的抢占式 `priority` 策略本来就这样做：紧急的等待请求在顺序里排到低优先级的运行中请求前面，`max_num_seqs`
# 从顺序的前面数，被挤出这一步的是级别最低的运行中请求。差别在于 minibatch 的 `max_num_seqs` 限制的是**一步的批**而不是运行集合，
# 被挤出的请求**暂停**、保留它的 KV，下一步有空位就接着算，不必重算；只有 KV 也不够时才真的抢占（22.2 节），
# 抢占哪个由第 12 章的 `preemption_victim` 决定——在优先级策略下，默认的 `"last"` 就是级别最低者。
#
# 实验：22.3 节的混合负载，池放大到 {{SLOT_POOL}} 块（KV 永远够用），`max_num_seqs` = {{SLOTS}}，让槽位成为唯一的瓶颈；
# 比较非抢占式（vLLM V1 的规则）与抢占式，{{len(SEEDS)}} 个种子取中位数：

# %%
def run_slots(workload, policy):
    """22.3's load with KV to spare: only the sequence slots (max_num_seqs) are short."""
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, num_kv_blocks=SLOT_POOL, max_num_seqs=SLOTS), clock="virtual")
    engine.scheduler.policy = policy
    result = run(workload, engine=engine)
    assert all(q.completed for q in result.requests), "no request is lost"
    return result


slot_grid = {(name, s): steady_classes(run_slots(mixed(s), MIX_POLICIES[name]()))
             for s in SEEDS for name in ("non-preemptive", "preemptive")}
slot_rows = []
for name in ("non-preemptive", "preemptive"):
    m = {k: float(np.median([slot_grid[name, s][k] for s in SEEDS])) for k in ("hi_p50", "hi_p90", "attain", "lo_tok_s", "preempt")}
    slot_rows.append([name, f"{m['hi_p50'] * 1e3:.0f}", f"{m['hi_p90'] * 1e3:.0f}", f"{m['attain']:.0%}", f"{m['lo_tok_s']:.0f}",
                      f"{m['preempt']:.0f}"])
md_table(["rule", "class-0 TTFT p50 (ms)", "class-0 TTFT p90 (ms)", f"class 0 within {SLO_TTFT * 1e3:.0f} ms",
          "class-1 tok/s", "preemptions"], slot_rows)

# %%
def slot_med(name, key):
    return float(np.median([slot_grid[name, s][key] for s in SEEDS]))


slot_p90 = slot_med("preemptive", "hi_p90") / slot_med("non-preemptive", "hi_p90")
slot_tput = slot_med("preemptive", "lo_tok_s") / slot_med("non-preemptive", "lo_tok_s")
slot_att = {name: slot_med(name, "attain") for name in ("non-preemptive", "preemptive")}
print(f"class-0 TTFT p90 preemptive / non-preemptive x{slot_p90:.3f}; class-1 tok/s x{slot_tput:.2f}; "
      f"attainment {slot_att['non-preemptive']:.0%} -> {slot_att['preemptive']:.0%}")

# %% tags=["check"]
assert slot_p90 < 0.5 and slot_att["preemptive"] >= ATT_TARGET > slot_att["non-preemptive"], "the prose: slots invert"
assert abs(slot_tput - 1) < 0.05 and slot_med("preemptive", "preempt") == 0, "pausing costs no recompute here"

# %% [markdown]
# 槽位满时，非抢占式规则下 0 类请求的 TTFT p90 是抢占式的 {{1 / slot_p90:.0f}} 倍，只有 {{slot_att["non-preemptive"]:.0%}}
# 的请求在 {{SLO_TTFT * 1e3:.0f}} ms 内拿到首 Token；抢占式下是 {{slot_att["preemptive"]:.0%}}，达到 {{ATT_TARGET:.0%}} 的目标。
# 这里的代价几乎为零：KV 够用，被挤出的 1 类请求只是暂停一步、不重算（稳态抢占 {{slot_med("preemptive", "preempt"):.0f}} 次），
# 1 类的吞吐是非抢占式的 {{slot_tput:.2f}} 倍。vLLM 的修复 PR 则会真的抢占（释放 KV、以后重算），代价是第 12 章的重算税；
# `benchmarks/preemption.py` 在另一个两类负载上给出同方向的比值。
#
# ## 22.6 动手：预留多少块
#
# 下面的控件在 22.3 节的负载（种子 1）上运行一次：`reserve` 是留给 0 类的块数（1 类配额 = 池 − reserve，0 表示不设配额），
# `preemptive` 切换抢占式，`max_running` 是 1 类的并发上限（0 表示不设）。试试：不抢占时，reserve 从 0 增加到多少，0 类的达成率才超过 90%？
# 此时 1 类的吞吐损失多少？打开抢占之后，还需要预留吗？

# %% tags=["nbval-ignore-output"]
def explore(reserve=64, preemptive=False, max_running=0):
    pol = PriorityPolicy(aging_s=None, preemptive=preemptive,
                         kv_quota={1: MIX_POOL - reserve} if reserve else None,
                         max_running={1: max_running} if max_running else None)
    r = run_policy(mixed(1), pol, pool=MIX_POOL)
    s = steady_classes(r)
    h = r.extra["held"]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.stackplot(h[:, 0], h[:, 2], h[:, 1], labels=["class 1", "class 0"], colors=["0.7", "C3"], step="post")
    ax.axhline(MIX_POOL, color="k", ls=":", lw=1)
    if reserve:
        ax.axhline(MIX_POOL - reserve, color="C0", ls="--", lw=1, label="class-1 quota")
    ax.set(xlabel="time (s)", ylabel="KV blocks held", title=f"reserve {reserve}, preemptive={preemptive}, "
                                                                f"max_running={max_running or 'none'}")
    ax.legend(fontsize=7, loc="lower right")
    plt.show()
    print(f"class 0: TTFT p50 {s['hi_p50'] * 1e3:.0f} ms, p90 {s['hi_p90'] * 1e3:.0f} ms, {s['attain']:.0%} within "
          f"{SLO_TTFT * 1e3:.0f} ms | class 1: E2E p50 {s['lo_e2e']:.2f} s, {s['lo_tok_s']:.0f} tok/s | "
          f"{s['preempt']} preemptions")


W.interact(explore,
           reserve=W.IntSlider(value=64, min=0, max=192, step=16, continuous_update=False, description="reserve"),
           preemptive=W.Checkbox(value=False, description="preemptive"),
           max_running=W.IntSlider(value=0, min=0, max=16, continuous_update=False, description="max_running"));

# %% [markdown]
# ## 本章小结
#
# - 优先级调度按键 $k_i(t) = (c_i - (t - a_i)/A,\ a_i)$ 排序；老化让饥饿有上界，严格优先级（`aging_s=None`）可能让低类别饿死。
# - “排在前面”不等于“能运行”：非抢占式优先级下，紧急请求要等低优先级请求释放它们持有的 KV——由被持有的 KV 造成的优先级反转，
#   反转延迟由别人的剩余长度与占用的块数决定。vLLM V1 的 `priority` 正是非抢占式的：等待中的请求不会抢占，
#   只有运行中的请求长不动时才抢占优先级最低者；SGLang 只在优先级差大于阈值（默认 10）时抢占。
# - 修复有三条路：抢占（代价是被抢占者的重算）、KV 配额/预留（代价是低优先级类别的并发与吞吐）、按类别的并发上限
#   （只有当个数上限乘以最长请求的块数不超过预留时才真正保护 KV）。优先级继承在这里无效：持有者本来就在每一步运行。
# - 在交互 + 批处理的混合负载上，抢占式与 KV 配额都让交互类的 TTFT 达成率超过 {{ATT_TARGET:.0%}}，抢占几乎不损失批处理吞吐，配额损失明显；
#   这些结论依负载与池的大小而变，要在稳态、多个种子上量。
# - 序列槽位也会造成反转（vLLM issue #40004）：vLLM V1 在运行队列满 `max_num_seqs` 时不看优先级；抢占式规则让紧急请求先占槽位，
#   在 22.5 节的负载上把 0 类的 TTFT p90 降到 {{slot_p90:.2f}} 倍，KV 够用时不需要重算。
# - 无论哪种规则，贪心输出不变。
#
# 下一章（第 23 章）讲另一种“抢占式”：FastServe 的多级反馈队列，以及按租户的公平性（VTC）。
#
# ## 练习
#
# 1. **长提示词让抢占变贵。** 把 22.3 节 1 类请求的提示词中位数改成 2048（池相应放大到 600 块，先检查放得下），
#    抢占式与 KV 配额的批处理吞吐差距怎样变化？用 22.2 节的重算代价 $\sum_{v}(p_v + g_v)$ 解释。
# 2. **容量。** 固定 0 类 1 req/s，把 1 类的到达率从 1 扫到 4 req/s，对每种规则求“0 类 TTFT ≤ 200 ms 的达成率不低于 90% 时，
#    1 类的最高到达率”（`minibatch.results.capacity` 接受 `{rate: attainment}`）。哪种规则的容量最高？
# 3. **同类抢占。** 把 `PriorityPolicy(aging_s=None)` 的 `margin` 设为 −0.5：这时同一类别里先到达的等待请求也能抢占后到达的运行中请求。
#    在 22.3 节的负载上比较抢占次数与批处理的 E2E，解释为什么默认的 `margin=0` 更好。
# 4. **SGLang 的阈值。** 用 `margin` 模拟 SGLang 默认的阈值 10：给三个类别 0、5、20，哪些类别之间会发生抢占？
# 5. **老化与反转。** 打开老化（`aging_s=2.0`），在 22.2 节的例子里，老化会让等久了的 1 类请求排到紧急请求前面吗？
#    对抢占式规则，这意味着什么？
# 6. **槽位与 KV 同时紧张。** 在 22.5 节的 `run_slots` 里把池缩到 {{MIX_POOL}} 块，再比较非抢占式与抢占式：抢占次数与 1 类吞吐怎样变？
#    再加上 `preemption_victim="least_computed"`（第 12 章 12.6 节），被抢占的是谁，重算税（`summary()["recompute_waste"]`）怎样变？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 被抢占者恢复时要重算提示词加已生成的 Token，提示词越长，每次抢占越贵；而配额的代价（闲置的预留块）与提示词长度关系不大。
#    预期抢占式的吞吐优势缩小，甚至反过来；用 `sum(q.num_preemptions ...)` 和 `mixed(...)` 改参数后的表格来验证，不要凭预期下结论。
# 2. 每个到达率用 `synthetic(n_lo, rate, ...)` 重新生成 1 类请求（0 类不变），`steady_classes(...)["attain"]` 就是达成率；
#    `capacity({rate: attain})` 返回满足目标的最高到达率。容量要在多个种子上看中位数。
# 3. `margin=-0.5` 时，级别相同的等待请求 $\ell_w - 0.5 < \ell_r$ 成立，于是被抢占、回到等待队列的请求又会抢占比它晚到的运行中请求，
#    KV 在同类请求之间来回倒手（抖动，第 12 章）：预期抢占次数成数量级地增加，批处理类几乎停滞，交互类也因为每步都在重算而变慢——
#    用 `steady_classes(run_policy(mixed(1), PriorityPolicy(aging_s=None, margin=-0.5), pool=MIX_POOL))["preempt"]` 量出来再下结论。
# 4. 只有级别差大于 10 才抢占：20 类会被 0 类与 5 类抢占，0 与 5 之间不会。在 minibatch 里写 `PriorityPolicy(aging_s=None, margin=10)`，
#    并给请求设 `priority=0/5/20`。
# 5. 1 类请求在 $t=4$ s 时已经等了 4 s，级别是 $1 - 4/2 = -1$，比新到的 0 类请求（级别 0）更紧急：老化让它们排到前面，
#    抢占式规则下紧急请求不能抢占它们——限制饥饿与保护紧急类别是互相冲突的目标，老化的时间常数要按 SLO 来定。
# 6. 给 `EngineConfig.from_kwargs(...)` 换上 `num_kv_blocks=MIX_POOL`（以及 `preemption_victim=...`），`run(...).summary(trim=TRIM22)`
#    给出 `num_preemptions` 与 `recompute_waste`。KV 也紧张时，挤出的请求不再只是暂停，而要被真正抢占、以后重算；
#    最少计算优先挑的是级别低于紧急请求的运行中请求里算得最少的，不一定是类别最大的那个。先量，再解释。
#
# </details>
