# %% [markdown]
# # 第 9 章 minibatch 源码导读：一次 step 的生命周期
#
# 第 5–8 章从外面看引擎：批占用率、KV 块、延迟分布。本章打开引擎，跟着**一个请求**走完它的一生：
# 进入队列（Queue），被调度器（Scheduler）选中并分到 Token 预算，KV 管理器（KV Cache Manager）为它分配块，
# 执行器（Executor）把整个批压平成一次模型前向，采样器（Sampler）选出下一个 Token，引擎检查停止条件、发出事件，
# 最后把结果包装成 `RequestOutput` 交还给调用者。这一圈就是一个 **step**（一步、一次迭代），
# 连续批处理（Continuous Batching）就是一步接一步地重复它。
#
# 本章展示的每一段代码都是用 `inspect` 从正在运行的 minibatch 里取出的（不是抄写的副本），
# 所以你读到的就是下面实验里真正执行的代码。每一部分都对照 vLLM V1 的对应组件，给出版本与源文件，
# 读完本章再去读 vLLM 的源码，会发现骨架是一样的。
#
# ## 学习目标
#
# - 能说出一个 step 的五个阶段（调度 → KV 分配 → 执行 → 采样 → 更新）各由哪个类、哪个函数负责，输入输出是什么；
# - 读懂 `Scheduler.schedule` 的一次循环：策略给出的顺序、Token 预算、`max_num_seqs`、分块预填充（Chunked Prefill）、
#   KV 块分配与抢占（Preemption）分别在哪几行；
# - 读懂执行器如何把一个混合批（解码 + 预填充块）压平成 `input_ids`、`positions` 与 `slot_mapping`，为什么解码行排在前面；
# - 会用 `engine.subscribe` 订阅事件、用 `StepRecord` 逐步复盘一次真实运行（嵌入的 tiny 模型，CPU）；
# - 能把 minibatch 的每个部件对应到 vLLM V1（v0.11.0）的 `EngineCore.step`、`Scheduler.schedule`、`KVCacheManager`、
#   `GPUModelRunner`、`Sampler` 与 `OutputProcessor`。

# %%
import inspect
import time
from pathlib import Path

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyBboxPatch

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.executor import ModelExecutor
from minibatch.kv_cache import KVCacheManager
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.request import Request
from minibatch.sampler import sample
from minibatch.scheduler import Scheduler

torch.set_num_threads(1)   # the tiny model's matrices are small: one thread avoids oversubscribing a shared CPU
PKG = Path(minibatch.__file__).parent.parent


def excerpt(obj, first: str, last: str | None = None, before: int = 0) -> None:
    """Print the source lines of ``obj`` from the one containing ``first`` (and ``before`` lines above it)
    to the one containing ``last``."""
    obj = inspect.unwrap(obj)                 # a decorated method (torch.inference_mode) shows its own source
    lines, start = inspect.getsourcelines(obj)
    i = next(k for k, line in enumerate(lines) if first in line) - before
    j = i if last is None else next(k for k in range(i, len(lines)) if last in lines[k])
    print(f"# {Path(inspect.getsourcefile(obj)).relative_to(PKG)}, lines {start + i}-{start + j}")
    for k in range(i, j + 1):
        print(f"{start + k:4d} {lines[k].rstrip()}")


print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 9.1 全景：一个 step 经过哪些部件
#
# 先看一张图。箭头是一个请求在一步里经过的路径：上排从入队到调度出一个批，下排从执行到产出结果，虚线回到下一步的调度；
# 每个方框外侧的灰字是 vLLM V1
# （v0.11.0）里做同一件事的类与源文件（9.9 节逐一核对）。

# %%
BOXES = [  # (x, y, title, minibatch code, vLLM V1 counterpart)
    (0.0, 1.0, "queue", "LLMEngine.add_request\nScheduler.waiting", "LLMEngine.add_request\nEngineCore.add_request"),
    (2.6, 1.0, "scheduler", "Scheduler.schedule\n(policy order, budget)", "Scheduler.schedule\nv1/core/sched/scheduler.py"),
    (5.2, 1.0, "KV manager", "KVCacheManager\n.allocate_slots", "KVCacheManager\nv1/core/kv_cache_manager.py"),
    (7.8, 1.0, "batch", "ScheduledBatch\n(request, n) pairs", "SchedulerOutput\nv1/core/sched/output.py"),
    (7.8, -0.6, "executor", "ModelExecutor\n.prepare / .execute", "GPUModelRunner\nv1/worker/gpu_model_runner.py"),
    (5.2, -0.6, "sampler", "sampler.sample", "Sampler\nv1/sample/sampler.py"),
    (2.6, -0.6, "update", "LLMEngine._append_token\nstop checks, events", "update_from_output, check_stop\nv1/core/sched/"),
    (0.0, -0.6, "output", "RequestOutput\nStepRecord", "OutputProcessor\nv1/engine/output_processor.py"),
]
fig, ax = plt.subplots(figsize=(11, 3.6))
W_, H_ = 2.1, 0.9
for x, y, title, ours, theirs in BOXES:
    ax.add_patch(FancyBboxPatch((x, y), W_, H_, boxstyle="round,pad=0.04", fc="#eef3fb", ec="#2b5797"))
    ax.text(x + W_ / 2, y + H_ - 0.17, title, ha="center", va="center", fontsize=9, weight="bold")
    ax.text(x + W_ / 2, y + 0.36, ours, ha="center", va="center", fontsize=7.5, family="monospace")
    ax.text(x + W_ / 2, y + H_ + 0.25 if y > 0 else y - 0.25, theirs, ha="center", va="center", fontsize=6.5,
            color="0.45")
arrow = dict(arrowstyle="-|>", color="#2b5797", lw=1.2)
for (x0, y0, *_), (x1, y1, *_) in zip(BOXES, BOXES[1:]):
    if y0 == y1:
        sx, ex = (x0 + W_, x1) if x1 > x0 else (x0, x1 + W_)
        ax.annotate("", (ex, y1 + H_ / 2), (sx, y0 + H_ / 2), arrowprops=arrow)
    else:
        ax.annotate("", (x1 + W_ / 2, y1 + H_ + 0.04), (x0 + W_ / 2, y0 - 0.04), arrowprops=arrow)
ax.annotate("", (2.6 + W_ / 2, 1.0 - 0.04), (2.6 + W_ / 2, -0.6 + H_ + 0.04),
            arrowprops=dict(arrowstyle="-|>", color="0.5", lw=1, ls="--"))
ax.text(2.6 + W_ / 2 + 0.08, 0.62, "next step", fontsize=7, color="0.4")
ax.set(xlim=(-0.2, 10.1), ylim=(-1.15, 2.45))
ax.axis("off")
ax.set_title("One engine step in minibatch (black) and its counterpart in vLLM V1 v0.11.0 (grey)", fontsize=10)
plt.show()

# %% [markdown]
# 引擎的主循环 `LLMEngine.step` 就是这张图的下排：调度、执行、把新 Token 写回请求、记一条 `StepRecord`。
# 它只有几十行，先通读一遍（中间的簿记略去）：

# %%
excerpt(LLMEngine.step, "def step", "policy.on_step(")

# %% [markdown]
# ## 9.2 一个可以逐步复盘的实验
#
# 为了每一步都看得清，实验刻意做得很小：嵌入的 tiny 模型（CPU）、虚拟时钟（Virtual Clock）、一个很小的 KV 池、
# 很少的序列数与很小的 Token 预算，再加几个各有特点的请求：

# %%
CONFIG = dict(model="tiny", max_num_seqs=3, max_num_batched_tokens=32, block_size=8, num_kv_blocks=12)
PROMPTS = {
    "A": ("Once upon a time, a happy boy named Adam lived near the garden. It was a cloudy day.",
          SamplingParams(temperature=0.0, max_tokens=12, stop=["."])),
    "B": ("从前，有一只小猫，名叫花花。有一天，天气很好，花花去河边玩。在花丛中，花花听到一个小小的声音。",
          SamplingParams(temperature=0.0, max_tokens=8)),
    "C": ("What is your name?", SamplingParams(temperature=0.0, max_tokens=10)),
    "D": ("Tom had a red ball.", SamplingParams(temperature=0.0, max_tokens=5)),
}
LATE = {"D": 3}            # D arrives once three steps have run (just before step 3)

# %% [markdown]
# KV 池只有 {{CONFIG['num_kv_blocks']}} 个块（每块 {{CONFIG['block_size']}} 个 Token）、每步最多 {{CONFIG['max_num_seqs']}} 个序列、
# Token 预算只有 {{CONFIG['max_num_batched_tokens']}}。{{len(PROMPTS)}} 个请求：A 带停止字符串 `"."`，B 的提示很长（要被切块），
# C 很短，D 在前 {{LATE['D']}} 步跑完之后才到达。
# 调度决策只取决于“第几步”和生成的 Token，与机器快慢无关，所以下面的复盘每次运行都相同；
# 只有时间戳（每步的实测耗时）会变，因此表格里只写步号。
#
# 我们不改引擎的任何逻辑，只在三个地方“旁听”：`engine.subscribe` 订阅请求事件；
# 把 `scheduler.schedule` 与 `executor.prepare` 各包一层记录函数，保存每一步的批与压平后的输入。

# %%
def traced_run(**overrides):
    """Run the four requests step by step; record events, each step's batch and its flattened inputs."""
    eng = LLMEngine(EngineConfig.from_kwargs(**{**CONFIG, **overrides}), clock="virtual")
    trace = {"events": [], "batches": [], "inputs": []}
    eng.subscribe(lambda event, t, req, info: trace["events"].append((len(eng.steps), event, req.request_id, info)))
    schedule, prepare = eng.scheduler.schedule, eng.executor.prepare

    def schedule_spy(now):
        batch = schedule(now)
        trace["batches"].append(([(r.request_id, r.num_computed_tokens, n) for r, n in batch.items],
                                 [r.request_id for r in batch.preempted]))
        return batch

    def prepare_spy(batch, kv):
        out = prepare(batch, kv)
        ids, pos, meta, sample_idx, sample_reqs = out
        trace["inputs"].append(dict(ids=ids.tolist(), pos=pos.tolist(), slots=meta.slot_mapping.tolist(),
                                    num_decode=meta.num_decode_tokens, sample_idx=list(sample_idx),
                                    samplers=[r.request_id for r in sample_reqs]))
        return out

    eng.scheduler.schedule, eng.executor.prepare = schedule_spy, prepare_spy
    pending = dict(PROMPTS)
    while pending or eng.has_unfinished_requests():
        due = [r for r in pending if LATE.get(r, 0) <= len(eng.steps)]
        if not due and not eng.has_unfinished_requests():
            due = [min(pending, key=lambda r: LATE.get(r, 0))]      # the engine ran dry before a late arrival
        for rid in due:
            prompt, params = pending.pop(rid)
            eng.add_request(prompt, params, request_id=rid)
        n = len(eng.steps)
        eng.step()
        if len(eng.steps) == n:
            raise RuntimeError("a step scheduled nothing")   # cannot happen with these requests
    return eng, trace


t_run = time.perf_counter()
eng, trace = traced_run()
t_run = time.perf_counter() - t_run
req = {rid: eng.requests[rid] for rid in PROMPTS}
print("prompt tokens:", {rid: r.num_prompt_tokens for rid, r in req.items()})
print(f"{len(eng.steps)} steps; KV pool {eng.kv.num_blocks} blocks x {eng.kv.block_size} tokens")

# %% [markdown]
# ## 9.3 入口：`add_request` 与等待队列
#
# `LLM.generate`（vLLM 的离线 API）与 `run()`、HTTP 服务最终都调用 `LLMEngine.add_request`。它做三件事：
# 把提示分词（Tokenize）、检查请求能否被服务（空提示、超过 `max_model_len`、整个 KV 池都放不下——这些请求当场报错，
# 永远不会进入队列），然后创建 `Request`、放进调度器的等待队列 `Scheduler.waiting`（一个 `deque`）并发出 `arrival` 事件：

# %%
excerpt(LLMEngine.add_request, "text, ids = self.tokenize(prompt)", 'self._emit("arrival"')

# %% [markdown]
# `Request` 贯穿整条路径，不会被重新打包。调度器只看它的两个计数器（与 vLLM V1 相同）：
# `num_tokens`（提示 + 已生成的 Token 数）与 `num_computed_tokens`（K/V 已写进缓存的 Token 数）。

# %%
print(inspect.getdoc(Request))

# %% [markdown]
# ## 9.4 调度器：在预算之内走一遍策略给出的顺序
#
# 每一步，调度器先问策略（Policy）要一个顺序。默认的 `continuous` 策略（第 5 章）只有一行：运行中的请求在前，
# 等待的请求按到达顺序在后：

# %%
excerpt(ContinuousPolicy.schedule_order, "def schedule_order", "return")

# %% [markdown]
# 然后 `Scheduler.schedule` 沿着这个顺序走（循环体在 `Scheduler._build` 里），给每个请求分配本步的新 Token 数 $n = \texttt{num\_tokens} - \texttt{num\_computed\_tokens}$。
# 下面分四段读它。**① 两个上限。** 预算用完或批里已有 `max_num_seqs` 个请求就停；新请求先查前缀缓存（第 13 章），
# 命中的部分直接算作“已计算”：

# %%
excerpt(Scheduler._build, "for pos, req in enumerate(order):", "num_new = req.num_tokens - req.num_computed_tokens")

# %% [markdown]
# **② 分块。** 放不下的请求：开启分块预填充时只拿剩下的预算（下一步接着算）；关闭时整段计算，
# 除非批里已经有别人——那它就等一个有空位的步（等待中的请求还会挡住后来者，保持先来先服务）：

# %%
excerpt(Scheduler._build, "if num_new > room:", "continue")

# %% [markdown]
# **③ KV 块与抢占。** 为这 $n$ 个 Token 分配块；池子不够时，从顺序的**末尾**挑一个还没排进本步的运行中请求抢占
# （默认 `recompute`：释放它的块、计数器清零、放回等待队列的最前面），再试一次；实在没有可抢的，这个请求自己被抢占：

# %%
excerpt(Scheduler._build, "ok = self._allocate(req, num_new, computed_blocks)", "batch.preempted.append(req)")

# %% [markdown]
# **④ 入批。** 新请求转入运行队列，`(request, n)` 追加进 `ScheduledBatch`，预算减去 $n$：

# %%
excerpt(Scheduler._build, "self._admit(req, now)", "budget -= num_new", before=1)

# %% [markdown]
# 把实验里每一步的批打印出来，`(请求, 调度前已计算的 Token 数, 本步的 n)`，后面是本步被抢占的请求：

# %%
for k, (items, preempted) in enumerate(trace["batches"][:8]):
    used = sum(n for _, _, n in items)
    extra = f"  preempted: {preempted}" if preempted else ""
    print(f"step {k}: {items}  tokens {used}/{CONFIG['max_num_batched_tokens']}{extra}")

# %%
steps = eng.steps
budget = CONFIG["max_num_batched_tokens"]
tokens = [s.num_prefill_tokens + s.num_decode_tokens for s in steps]
chunks_B = [n for items, _ in trace["batches"] for rid, c, n in items if rid == "B" and c < req["B"].num_prompt_tokens]
first_D = next(k for k, (items, _) in enumerate(trace["batches"]) if any(r == "D" for r, _, _ in items))
arrive_D = next(k for k, e, r, _ in trace["events"] if e == "arrival" and r == "D")
preempt_step, victim = next((k, p[0]) for k, (_, p) in enumerate(trace["batches"]) if p)
recompute = next(n for items, _ in trace["batches"][preempt_step + 1:] for r, c, n in items if r == victim)
print(f"B's prompt in chunks of {chunks_B}; D arrives before step {arrive_D}, first scheduled in step {first_D}")
print(f"step {preempt_step}: {victim} preempted, then recomputes {recompute} tokens at once")

# %% tags=["check"]
assert max(tokens) <= budget, "the prose says no step exceeds the token budget"
assert max(s.num_seqs for s in steps) <= CONFIG["max_num_seqs"], "the prose says no step exceeds max_num_seqs"
assert len(chunks_B) >= 2 and sum(chunks_B) == req["B"].num_prompt_tokens, "B's prefill is chunked"
b0, b1 = (dict((r, (c, n)) for r, c, n in items) for items, _ in trace["batches"][:2])
assert b0["A"] == (0, req["A"].num_prompt_tokens) and b0["B"][1] == budget - req["A"].num_prompt_tokens, \
    "the prose says: step 0 runs A's whole prompt and gives B what is left"
assert b1["A"][1] == 1 and b1["B"][1] == budget - 1, "the prose says: step 1 decodes A and gives B the rest"
assert first_D > arrive_D, "D waits for a sequence slot"
assert all(s.num_running == CONFIG["max_num_seqs"] for s in steps[arrive_D - 1:first_D]), \
    "the prose says: until D is scheduled, every step holds max_num_seqs requests"
items_p = [r for r, _, _ in trace["batches"][preempt_step][0]]
assert victim == "C" and first_D == preempt_step and "D" in items_p, \
    "the prose says: C preempts itself (only the waiting D is behind it) and D is admitted in that step"
assert eng.steps[preempt_step - 1].kv_blocks_used == eng.kv.num_blocks, "the pool was full before the preemption"

# %% [markdown]
# 对照打印出来的批读一遍调度规则：
#
# - **预算与分块。** B 的提示有 {{req["B"].num_prompt_tokens}} 个 Token，超过预算 {{budget}}，
#   于是被切成 {{len(chunks_B)}} 块（{{", ".join(map(str, chunks_B))}}）：第 0 步 A 的整段提示先占了预算，B 只拿到剩下的；
#   第 1 步 A 已在解码（{{b1['A'][1]}} 个 Token），B 拿到其余的预算。没有一步超过预算，也没有一步超过 `max_num_seqs`
#   （上面折叠的检查单元格断言了这两点）。
# - **序列数上限。** D 在第 {{arrive_D}} 步之前到达，可直到第 {{first_D}} 步才被调度：在那之前每一步都已有
#   {{CONFIG["max_num_seqs"]}} 个请求（`max_num_seqs`），它只能等。
# - **抢占与重算。** 第 {{preempt_step}} 步，{{victim}} 的下一个 Token 需要一个新块，而 {{eng.kv.num_blocks}} 个块已全部被占用；
#   排在它后面的只有等待中的 D（不能当牺牲者），于是 {{victim}} 自己被抢占（Recompute）：块被释放、计数器清零、回到等待队列最前面。
#   它之后重新入批时一次算回 {{recompute}} 个 Token——提示加上已经生成的 Token。这正是“追上 `num_computed_tokens`”的统一视角（第 10 章）：
#   预填充、分块、解码和重算是同一个操作，只是 $n$ 不同。
#
# ## 9.5 KV 管理器：为本步的 Token 分配块
#
# `KVCacheManager.allocate_slots` 只做账：算出 `num_computed_tokens + n` 个 Token 需要几个块，不够就返回 `False`
# （调度器据此抢占），够就从空闲队列（Free Queue）的前端取块追加到请求的块表（Block Table）。KV 张量本身在执行器里（第 7 章）。
# 下面第一段是请求的第一次分配（前缀缓存命中的块不必新分配），第二段是已有请求的增长：

# %%
excerpt(KVCacheManager.allocate_slots, "need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(computed_blocks)",
        "return False")
excerpt(KVCacheManager.allocate_slots, "        else:", "return True")

# %% [markdown]
# ## 9.6 执行器：把批压平成一次前向
#
# `ModelExecutor.prepare` 把 `ScheduledBatch` 压平成三个一维数组：`input_ids`（本步要算的 Token）、`positions`
# （它们在各自序列中的位置）与 `slot_mapping`（它们的 K/V 写进缓存的哪个槽位，
# $\text{slot}(p) = \text{table}[\lfloor p/B \rfloor]\cdot B + p \bmod B$，第 7 章）。
# **解码行排在前面**：每个解码只有一个查询 Token，前 `num_decode_tokens` 行交给分页解码注意力（Paged Decode）内核，
# 其余的预填充块交给变长（Varlen）预填充注意力内核；线性层对所有行一起做矩阵乘（Orca 的选择性批处理，第 5 章）。

# %%
excerpt(ModelExecutor.prepare, "decodes = [(r, n) for r, n in batch.items if is_decode(n)]",
        "chunks = [(r, n) for r, n in batch.items if not is_decode(n)]")
excerpt(ModelExecutor.prepare, "for r, n in chunks:", "sample_reqs.append(r)")

# %% [markdown]
# 看第一个“一个解码 + 两段预填充”的混合步的实际输入。调度器给出的顺序是 A（解码）、B（提示的最后一块）、C（整段提示）；压平后 A 的 1 行在最前，
# 之后是 B 与 C 的预填充行。只有“本步之后计数器追平”的请求才采样：A 采样下一个 Token，
# B 的最后一块与 C 的整段提示算完后，各自采样第一个 Token。

# %%
k = next(i for i, (b, _) in enumerate(trace["batches"]) if sum(n == 1 for *_, n in b) == 1
         and sum(n > 1 for *_, n in b) == 2)
items, _ = trace["batches"][k]
inp = trace["inputs"][k]
assert [(r, n == 1) for r, _, n in items] == [("A", True), ("B", False), ("C", False)], "the prose describes step 2"
assert inp["samplers"] == ["A", "B", "C"] and inp["num_decode"] == 1
print(f"step {k}, scheduled (request, computed, n):", items)
print(f"{len(inp['ids'])} rows, the first {inp['num_decode']} are decodes")
print("positions   :", inp["pos"][:8], "...", inp["pos"][-3:])
print("slot_mapping:", inp["slots"][:8], "...", inp["slots"][-3:])
print("rows that sample:", inp["sample_idx"], "->", inp["samplers"])

# %% tags=["check"]
dec_first = all(inp["num_decode"] == sum(1 for _, _, n in b if n == 1) for b, inp in
                zip((b for b, _ in trace["batches"]), trace["inputs"]))
rows_ok = all(len(inp["ids"]) == sum(n for _, _, n in b) for (b, _), inp in zip(trace["batches"], trace["inputs"]))
assert dec_first and rows_ok, "the prose says: one row per new token, the decode rows first"
n_rows = len(trace["inputs"][k]["ids"])

# %% [markdown]
# 第 {{k}} 步一共 {{n_rows}} 行（每个新 Token 一行；全部步都如此，上面折叠的检查单元格断言了“行数 = 本步 Token 数、解码行在前”）。
# 模型每一层先按 `slot_mapping` 把新 K/V 写进缓存，再做注意力；`execute` 只在需要采样的行上算 LM Head 的 logits，
# 再交给采样器。某一行的采样若出错（例如一个请求的参数让采样器溢出），只有这一行的请求记入 `failed`，
# 引擎中止它并附上错误，其余请求照常拿到 Token（“一个坏请求不拖垮别人”）：

# %%
excerpt(ModelExecutor.execute, "input_ids, positions, meta, sample_idx, sample_reqs = self.prepare(batch, kv)",
        "failed = [(sample_reqs[i], describe_error(e)) for i, e in errors.items()]")

# %% [markdown]
# ## 9.7 采样与更新：Token、停止条件、事件
#
# 采样器 `sample` 对贪心行（`temperature=0`）取 `argmax`，其余行依次做温度缩放、top-k、top-p，再按逆 CDF 抽样
# （第 18 章细讲）。本实验全是贪心解码：

# %%
excerpt(sample, "def sample", "return greedy.tolist()")

# %% [markdown]
# 回到引擎：本步算过的请求 `num_computed_tokens += n`，写满的块登记进前缀缓存；每个采样出的 Token 交给
# `LLMEngine._append_token`。它追加 Token、记下时间、发出 `first_token` / `token` 事件，然后按顺序检查停止条件：
# EOS、停止 Token、停止字符串（在增量反分词（Incremental Detokenization）后的文本里找）、`max_tokens` 与 `max_model_len`。
# 命中任何一个，`_finish` 把请求移出队列、释放它的块、发出 `finish` 事件：

# %%
excerpt(LLMEngine._append_token, "p = req.sampling_params", "self._finish(req, status)")

# %% [markdown]
# 实验里的全部事件（`token` 事件太多，只数个数），按步号排列：

# %%
by_step: dict[int, list[str]] = {}
for k_, event, rid, info in trace["events"]:
    if event != "token":
        by_step.setdefault(k_, []).append(f"{event}:{rid}" + (f"({info['reason']})" if "reason" in info else ""))
for k_, evs in sorted(by_step.items()):
    print(f"before/at step {k_:>2}: " + ", ".join(evs))
print("token events:", sum(1 for e in trace["events"] if e[1] == "token"))

# %% [markdown]
# 最后，`LLMEngine.output`（`LLM.generate` 也一样）把 `Request` 包装成 vLLM 形状的 `RequestOutput`：
# 生成的 Token 与文本、结束原因，以及一条 `RequestRecord` 形式的指标（TTFT、TPOT、E2E、抢占次数……，第 8 章的定义）。

# %%
for rid in PROMPTS:
    o = eng.output(rid)
    c = o.outputs[0]
    print(f"{rid}: {len(c.token_ids):>2} tokens, finish_reason={c.finish_reason!r:<9} stop_reason={c.stop_reason!r:<5} "
          f"preemptions={o.metrics.num_preemptions}  text={c.text[:34]!r}")

# %%
oa = eng.output("A").outputs[0]
n_A = len(oa.token_ids)
victim_preemptions = eng.output(victim).metrics.num_preemptions

# %% tags=["check"]
assert oa.finish_reason == "stop" and oa.stop_reason == "." and "." not in oa.text, "A stops on its stop string"
assert all(eng.output(r).outputs[0].finish_reason == "length" for r in "BCD")
assert victim_preemptions == 1, "the prose says the victim was preempted once"

# %% [markdown]
# A 在生成第 {{n_A}} 个 Token 时文本里出现了停止字符串 `"."`：结束原因是 `stop`，`stop_reason` 记下命中的字符串，
# 返回的文本截在它之前（vLLM 的默认行为，`include_stop_str_in_output=False`）；B、C、D 都是生成满 `max_tokens` 后以 `length` 结束；
# {{victim}} 的记录里有 {{victim_preemptions}} 次抢占。请求结束时它的块全部还回池子，运行结束后池子又是满的：

# %%
eng.kv.check_invariants()
print(f"free blocks after the run: {eng.kv.num_free_blocks}/{eng.kv.num_blocks}")

# %% [markdown]
# ## 9.8 把整次运行画成一张图
#
# 每一行是一个请求，每一列是一步；格子里的数字是这一步给它的 $n$（橙色：预填充或重算的块，蓝色：解码），
# 灰色表示已到达但在等待，红叉表示在这一步被抢占。下方的柱子是每步的 Token 数，虚线是 Token 预算，
# 标注的是每步用掉的 KV 块数（`StepRecord.kv_blocks_used`）。

# %%
def draw_trace(eng, trace, budget, ax_grid=None, ax_bar=None):
    rids = list(PROMPTS)
    n_steps = len(trace["batches"])
    if ax_grid is None:
        fig, (ax_grid, ax_bar) = plt.subplots(2, 1, figsize=(11, 3.8), sharex=True,
                                              gridspec_kw=dict(height_ratios=[2.2, 1]))
    arrival = {r: k for k, e, r, _ in trace["events"] if e == "arrival"}
    finish = {r: k for k, e, r, _ in trace["events"] if e in ("finish", "abort")}
    for k, (items, preempted) in enumerate(trace["batches"]):
        got = {r: n for r, _, n in items}
        for y, rid in enumerate(rids):
            if rid in got:
                n = got[rid]
                ax_grid.add_patch(plt.Rectangle((k, y), 0.94, 0.9, fc="#5a8fd6" if n == 1 else "#f2a65a"))
                ax_grid.text(k + 0.47, y + 0.45, str(n), ha="center", va="center", fontsize=7)
            elif arrival.get(rid, 1e9) <= k < finish.get(rid, 1e9):
                ax_grid.add_patch(plt.Rectangle((k, y), 0.94, 0.9, fc="0.88"))
            if rid in preempted:
                ax_grid.text(k + 0.47, y + 0.45, "x", ha="center", va="center", color="red", fontsize=14)
    ax_grid.set(yticks=np.arange(len(rids)) + 0.45, yticklabels=rids, ylim=(len(rids), -0.1), xlim=(0, n_steps))
    ax_grid.set_ylabel("request")
    tok = [sum(n for _, _, n in items) for items, _ in trace["batches"]]
    ax_bar.bar(np.arange(n_steps) + 0.47, tok, width=0.9, color="0.6")
    ax_bar.axhline(budget, color="k", ls="--", lw=1)
    for k, st in enumerate(eng.steps):
        ax_bar.text(k + 0.47, tok[k] + 1, str(st.kv_blocks_used), ha="center", fontsize=6.5, color="C3")
    ax_bar.set(ylabel="tokens", xlabel="step", ylim=(0, budget * 1.35))
    ax_bar.set_xticks(np.arange(n_steps) + 0.47, [str(i) for i in range(n_steps)])
    return ax_grid


ax = draw_trace(eng, trace, budget)
ax.set_title(f"The traced run: budget {budget} tokens (dashed), max_num_seqs {CONFIG['max_num_seqs']}, "
             f"{CONFIG['num_kv_blocks']} KV blocks (red: blocks used after the step)", fontsize=9)
plt.show()

# %% [markdown]
# **动手**：换一组引擎参数重跑同一个实验。把预算调大，B 就不再被切块；把 `max_num_seqs` 调到 {{CONFIG['max_num_seqs'] + 1}}，
# D 一到就能入批；把 KV 块调多，抢占就消失。（每次重跑都是真实的 tiny 模型，9.2 节那一次连同创建引擎用了 {{t_run:.1f}} s。）

# %% tags=["nbval-ignore-output"]
def explore(max_num_batched_tokens=CONFIG["max_num_batched_tokens"], max_num_seqs=CONFIG["max_num_seqs"],
            num_kv_blocks=CONFIG["num_kv_blocks"]):
    e, t = traced_run(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      num_kv_blocks=num_kv_blocks)
    ax = draw_trace(e, t, max_num_batched_tokens)
    ax.set_title(f"budget {max_num_batched_tokens}, max_num_seqs {max_num_seqs}, {num_kv_blocks} blocks: "
                 f"{len(e.steps)} steps, {sum(s.num_preempted for s in e.steps)} preemptions", fontsize=9)
    plt.show()


W.interact(explore,
           max_num_batched_tokens=W.IntSlider(value=budget, min=8, max=96, step=8, continuous_update=False),
           max_num_seqs=W.IntSlider(value=CONFIG["max_num_seqs"], min=1, max=CONFIG["max_num_seqs"] + 1,
                                    continuous_update=False),
           num_kv_blocks=W.IntSlider(value=CONFIG["num_kv_blocks"], min=CONFIG["num_kv_blocks"], max=32, step=2,
                                     continuous_update=False));

# %% tags=["check"]
# The exercises' settings, and what their hints claim about them.
EX_BUDGET, EX_SEQS = 48, CONFIG["max_num_seqs"] + 1
e48, t48 = traced_run(max_num_batched_tokens=EX_BUDGET)
chunks48 = [n for items, _ in t48["batches"] for rid, c, n in items if rid == "B" and c < req["B"].num_prompt_tokens]
c_first48 = next(k for k, (items, _) in enumerate(t48["batches"]) if any(r == "C" for r, _, _ in items))
assert len(chunks48) == 2 and c_first48 == 1, "hint 1: B in two chunks, C admitted in step 1"
assert sum(n for *_, n in t48["batches"][1][0]) < EX_BUDGET, "hint 1: step 1 leaves budget over"
e4, t4 = traced_run(max_num_seqs=EX_SEQS)
victims4 = [v for _, pre in t4["batches"] for v in pre]
assert victims4[0] == "D" and "C" in victims4, "hint 2: D is preempted first, C later"


# %% [markdown]
# ## 9.9 对照 vLLM V1
#
# 下表把本章读过的每个部件对应到 vLLM V1。版本是 **vLLM v0.11.0**（PyPI 上的 `vllm==0.11.0`，`vllm/_version.py` 记为 0.11.0），
# 每个路径与名字都在这一版的源码里核对过；更新的版本可能移动文件。
#
# | 阶段 | minibatch | vLLM v0.11.0 |
# |---|---|---|
# | 提交请求 | `LLM.generate` → `LLMEngine.add_request`（`llm.py`、`engine.py`） | `LLM.generate` → `_validate_and_add_requests`（`vllm/entrypoints/llm.py`）→ `LLMEngine.add_request`（`vllm/v1/engine/llm_engine.py`）：`Processor.process_inputs` 分词校验（`vllm/v1/engine/processor.py`），再 `EngineCore.add_request`（`vllm/v1/engine/core.py`）→ `Scheduler.add_request` |
# | 请求与计数器 | `Request.num_tokens` / `num_computed_tokens`（`request.py`） | `Request.num_tokens` / `num_computed_tokens`（`vllm/v1/request.py`） |
# | 队列 | `Scheduler.waiting`（`deque`）、`Scheduler.running`（`list`） | `Scheduler.waiting`（`create_request_queue`：`FCFSRequestQueue` 或 `PriorityRequestQueue`，`vllm/v1/core/sched/request_queue.py`）、`Scheduler.running`（`list`） |
# | 一步的循环 | `LLMEngine.step`：`schedule` → `execute` → `_append_token` | `EngineCore.step`：`scheduler.schedule()` → `model_executor.execute_model` → `scheduler.update_from_output`（`vllm/v1/engine/core.py`） |
# | 调度 | `Scheduler.schedule`：策略顺序、预算、`max_num_seqs`、分块、抢占（`scheduler.py`） | `Scheduler.schedule`（`vllm/v1/core/sched/scheduler.py`）：先走 `running`，再走 `waiting`；`token_budget`、`max_num_running_reqs`（= `max_num_seqs`）、`long_prefill_token_threshold` |
# | 一步的批 | `ScheduledBatch`：`(request, n)` 列表 | `SchedulerOutput`：`num_scheduled_tokens`（请求 → Token 数）、`scheduled_new_reqs`、`scheduled_cached_reqs`（`vllm/v1/core/sched/output.py`） |
# | KV 块 | `KVCacheManager.get_computed_blocks` / `allocate_slots` / `free`，`BlockPool`（`kv_cache.py`） | `KVCacheManager.get_computed_blocks` / `allocate_slots` / `free`（`vllm/v1/core/kv_cache_manager.py`），`BlockPool`（`vllm/v1/core/block_pool.py`） |
# | 抢占 | 从顺序末尾选牺牲者；`recompute`（默认）或 `swap` | 从 `running` 末尾 `pop()`（`priority` 策略取优先级最低者）；释放块、`num_computed_tokens = 0`、`waiting.prepend_request`——只有重算 |
# | 压平输入 | `ModelExecutor.prepare`：`input_ids`、`positions`、`slot_mapping`，解码行在前（`executor.py`） | `GPUModelRunner._prepare_inputs`（`vllm/v1/worker/gpu_model_runner.py`），槽位由 `BlockTable.compute_slot_mapping` 算（`vllm/v1/worker/block_table.py`）；注意力后端需要时，`_may_reorder_batch` 调 `reorder_batch_to_split_decodes_and_prefills`（`vllm/v1/attention/backends/utils.py`）把解码请求排到前面 |
# | 前向 | `ModelExecutor.execute` | `GPUModelRunner.execute_model` |
# | 采样 | `sampler.sample`：贪心、温度、top-k、top-p | `Sampler.forward`（`vllm/v1/sample/sampler.py`），top-k/top-p 在 `vllm/v1/sample/ops/topk_topp_sampler.py` |
# | 停止条件 | `LLMEngine._append_token`：EOS、停止 Token、停止字符串、`max_tokens`、`max_model_len` | 长度、EOS、停止 Token：`check_stop`（`vllm/v1/core/sched/utils.py`，由 `update_from_output` 调用）；停止字符串：前端进程的反分词器（`vllm/v1/engine/detokenizer.py`），命中后 `LLMEngine.step` 再 abort 该请求 |
# | 输出与统计 | `RequestOutput.of`、事件、`StepRecord` | `OutputProcessor.process_outputs`（`vllm/v1/engine/output_processor.py`）生成 `RequestOutput`（`vllm/outputs.py`）；`EngineCoreEventType`（QUEUED/SCHEDULED/PREEMPTED）与 `Scheduler.make_stats` |
#
# 结构相同，细节有几处不同，读 vLLM 源码时值得留意：
#
# 1. **进程划分。** vLLM V1 把 `EngineCore`（调度 + 执行）放在单独的进程里，分词、反分词、停止字符串在前端进程；
#    minibatch 全在一个进程、一个循环里，便于逐行阅读。
# 2. **计数器何时前进。** vLLM 在调度之后立即 `num_computed_tokens += n`（`Scheduler._update_after_schedule`），
#    以便异步调度时下一步马上能排这个请求；minibatch 在执行之后才加（`LLMEngine.step`）。两者对同步执行是等价的。
# 3. **等待队列与抢占。** vLLM 只要本步发生过抢占，就不再接纳等待中的请求（`if not preempted_reqs:`）；
#    不分块时放不下的等待请求被跳过、后面的请求可以先行。minibatch 在抢占之后仍会接纳（9.4 节的 D 就是这样入批的），
#    而等待请求被拒绝后就不再接纳后来者（严格的先来先服务）。
# 4. **V1 没有 Swap。** vLLM V1 的抢占只有重算（上表“抢占”一行）；minibatch 保留了 V0 的 `swap` 模式供第 12 章对比。
#
# ## 本章小结
#
# - 一个 step 是一条固定的流水线：`Scheduler.schedule`（策略顺序 → Token 预算与 `max_num_seqs` → 分块 → KV 分配与抢占）
#   产出 `ScheduledBatch`；`ModelExecutor` 把它压平成一次前向（解码行在前、按 `slot_mapping` 写 KV）；`sample` 选出 Token；
#   `LLMEngine._append_token` 检查停止条件、发出事件；最后是 `RequestOutput` 与一条 `StepRecord`。
# - 调度器只需要两个计数器：本步的 $n = \texttt{num\_tokens} - \texttt{num\_computed\_tokens}$。预填充、分块、解码与重算都是它。
# - 事件（`engine.subscribe`）与 `StepRecord` 足以逐步复盘一次运行；本章的复盘展示了分块、序列数上限、抢占与停止字符串各自在哪一步起作用。
# - vLLM V1（v0.11.0）的 `EngineCore.step` 与 minibatch 的 `LLMEngine.step` 一一对应；差别在进程划分、计数器前进的时机、
#   抢占后的接纳规则，以及 V1 只有重算。
#
# 下一章（第 10 章）用同样的视角读 vLLM 的关键参数：Token 预算、`max_num_seqs` 与 `gpu_memory_utilization`。
#
# ## 练习
#
# 1. **预算与块。** 用 9.8 节的控件把预算调到 {{EX_BUDGET}}。B 被切成几块？第 0 步和第 1 步各算了哪些 Token？先推理，再运行验证。
# 2. **牺牲者是谁。** 抢占发生时，为什么被抢占的是 9.4 节复盘里的那个请求、而不是 A 或 B？如果把 `CONFIG` 里的 `max_num_seqs` 改成 {{EX_SEQS}}，
#    抢占会在哪一步发生、谁是牺牲者？
# 3. **停止字符串的代价。** A 的停止字符串要在反分词后的文本里查找。若停止字符串横跨两个 Token（例如 `"cloudy day"`），
#    引擎在哪一步发现它？返回的文本包含这两个 Token 中的哪些？
# 4. **对照 vLLM。** 打开 vLLM v0.11.0 的 `vllm/v1/core/sched/scheduler.py`，找到 `Scheduler.schedule` 里处理运行中请求的 `while` 循环，
#    指出与 9.4 节 ①–④ 对应的代码。vLLM 为什么在这里用 `continue` 而不是 `break` 跳过 `num_new_tokens == 0` 的请求？
# 5. **旁听采样器。** 仿照 `traced_run` 里的写法，把 `eng.executor.execute` 包一层，记录每一步 `StepOutput.sampled` 里的
#    `(请求, Token)`，验证“采样的请求 = 本步之后计数器追平的请求”。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 第 0 步 A 的整段提示先拿预算，B 拿剩下的；第 1 步 A 只解码一个 Token，B 剩下的提示比余下的预算少，一次算完，
#    于是 B 只被切成 {{len(chunks48)}} 块（{{'、'.join(map(str, chunks48))}}），而且预算还有剩余，C 也在第 {{c_first48}} 步就入批。用控件验证：格子里的数字就是每步的 $n$。
# 2. 牺牲者从顺序的末尾、且“本步还没排进批”的运行中请求里选；那一步顺序是 `[A, B, C] + [D]`，需要新块的是 C 自己，
#    它后面只有等待中的 D，所以 C 抢占了自己。`max_num_seqs={{EX_SEQS}}` 时 D 一到就入批，它排在运行队列的最末，
#    块一用完，最先被抢占的就是它；之后 C 也会被抢占。用 `traced_run(max_num_seqs={{EX_SEQS}})` 打印 `trace["batches"]` 看具体步号。
# 3. 引擎每追加一个 Token 就检查一次完整文本，所以在第二个 Token 到来的那一步发现；返回的文本截在停止字符串开始处，两个 Token 都不包含。
# 4. 循环从 `while req_index < len(self.running) and token_budget > 0:` 开始；`num_new_tokens = min(num_new_tokens, token_budget)`
#    是分块，`allocate_slots` 失败后的 `self.running.pop()` 是抢占。`continue` 是为了让排在后面的请求在前一个请求暂时不能调度
#    （例如编码器预算用尽）时仍能被调度，源码注释明确说这“并不严格遵守 FCFS”。
# 5. 在 `traced_run` 里加一个 `execute_spy`，把 `[(r.request_id, tok) for r, tok in out.sampled]` 存起来，再与 `trace["inputs"][k]["samplers"]` 比较。
#
# </details>
