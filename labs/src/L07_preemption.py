# %% [markdown]
# # L07 · 抢占与抢占对象的选择
#
# 对应章节：第 12 章《抢占：Recompute 与 Swap》。
#
# 连续批处理在接纳请求时只看它这一步要的块；请求越长越大，池满的那一步调度器就必须**抢占**（Preemption）一个运行中的请求。
# 本实验分三步：先写出 minibatch 选**抢占对象**（Victim）的规则，在随机状态上与引擎的 `Scheduler` 逐一对比；再写出**重算**（Recompute）
# 抢占的簿记——块、计数器、队列位置；最后设计一个策略，在一个过载的模拟负载上胜过默认策略的 p99 TPOT，同时不**抖动**（Thrashing）。
#
# **学习目标**
#
# - 能按规则选出抢占对象：策略顺序之外的运行中请求优先，再从策略顺序的末尾往前；
# - 清楚重算抢占之后请求的状态：块全部释放、`num_computed_tokens` 清零、排到等待队列最前，恢复时要重新计算多少 Token；
# - 会用稳态指标（p99 TPOT、重复计算的 Token、吞吐）评价一个调度策略，并理解为什么只看 TPOT 是不够的。
#
# **怎么做**：只修改带 `task:N` 标签的任务单元格。完成后评分：
#
# ```bash
# python -m minibatch.labs check L07 labs/L07_preemption.ipynb
# ```

# %%
from __future__ import annotations

import collections
import copy
import inspect
import random

import matplotlib.pyplot as plt
import numpy as np

from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.kv_cache import KVCacheManager
from minibatch.policies import Policy, SchedulerState
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.request import Request, RequestStatus
from minibatch.runner import run
from minibatch.scheduler import Scheduler
from minibatch.workload import lognormal, synthetic

# %% [markdown]
# ## 1. 调度器在哪里抢占
#
# `Scheduler.schedule` 沿着策略给出的顺序 `order` 逐个给请求分配本步的块。排在位置 `pos` 的请求分不到块时，调度器反复调用
# `_pick_victim(order, pos, preempted, scheduled)` 选一个运行中的请求抢占，直到分得到为止；没人可抢时，运行中的请求抢占自己：

# %%
src = inspect.getsource(Scheduler.schedule)
start = src.find("# KV blocks")
print(src[start:src.find("if waiting:\n                self._admit")].rstrip())

# %% [markdown]
# ## 任务 1 · 选抢占对象（pick_victim）
#
# 实现 `pick_victim(running, order, pos, preempted, scheduled)`，返回要抢占的请求，没人可抢时返回 `None`。规则与 minibatch 完全一致：
#
# 1. 候选名单先是**策略顺序里没有的**运行中请求（它们的排名低于一切），按 `running` 的**倒序**（最后接纳的在前）；
# 2. 然后是 `order[pos + 1:]` 的**倒序**（从顺序末尾往前）；
# 3. 按名单顺序取第一个满足条件的：状态是 `RUNNING`、不在 `preempted`（本步已被抢占的 id）里、也不在 `scheduled`（本步已调度的 id）里。
#
# `running` 是运行中请求的列表（按接纳先后），`order` 是本步策略给出的顺序（可能包含等待中的请求，也可能漏掉一些运行中的请求），
# `preempted` 与 `scheduled` 是请求 id 的集合。注意第 2 步的名单里也会有等待中的请求——它们不是 `RUNNING`，要跳过。

# %% tags=["task:1"]
def pick_victim(running: list[Request], order: list[Request], pos: int, preempted: set[str],
                scheduled: set[str]) -> Request | None:
    """The running request to preempt so that order[pos] can get its blocks (None: nobody)."""
    ### BEGIN SOLUTION
    in_order = {r.request_id for r in order}
    candidates = [r for r in reversed(running) if r.request_id not in in_order]
    candidates += list(reversed(order[pos + 1:]))
    for r in candidates:
        if r.status is RequestStatus.RUNNING and r.request_id not in preempted and r.request_id not in scheduled:
            return r
    return None
    ### END SOLUTION

# %%
def make_request(rid, prompt_len=8, output_len=0, running=True, arrival=0.0) -> Request:
    req = Request(rid, [11] * prompt_len, SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=arrival)
    req.output_token_ids = [3] * output_len
    req.status = RequestStatus.RUNNING if running else RequestStatus.WAITING
    req.num_computed_tokens = req.num_tokens - 1 if running else 0
    return req


def engine_victim(running, order, pos, preempted, scheduled):
    """What minibatch's Scheduler picks in the same state (its _pick_victim reads only its running list)."""
    sched = Scheduler(EngineConfig.from_kwargs(num_kv_blocks=64, block_size=16), KVCacheManager(64, 16))
    sched.running = list(running)
    victim = sched._pick_victim(order, pos, preempted, scheduled)
    return None if victim is None else victim.request_id


ids = lambda rs: [r.request_id for r in rs]
a, b, c, d = (make_request(x) for x in "abcd")
w = make_request("w", running=False)
print("engine, continuous order, d needs a block:", engine_victim([a, b, c, d], [a, b, c, d, w], 3, set(), set()))
print("engine, a needs a block:", engine_victim([a, b, c, d], [a, b, c, d, w], 0, set(), set()))

# %% tags=["check:1"]
vid = lambda v: None if v is None else v.request_id
running4, order4 = [a, b, c, d], [a, b, c, d, w]
assert vid(pick_victim(running4, order4, 0, set(), set())) == "d", "continuous order: the last running request in the order"
assert vid(pick_victim(running4, order4, 0, {"d"}, set())) == "c", "d was preempted already this step: next from the end"
assert vid(pick_victim(running4, order4, 1, {"d", "c"}, set())) is None, \
    "b needs a block; only a (ranked above b) and the waiting w are left: nobody to preempt"
assert vid(pick_victim(running4, [a, b, d, w], 0, set(), set())) == "c", "c is left out of the order: it goes first"
assert vid(pick_victim(running4, [d, c, b, a], 0, set(), {"a"})) == "b", "a is scheduled already this step: skip it"
assert vid(pick_victim([a, b, c, d], [a, b], 0, set(), set())) == "d", \
    "left-out running requests go first, the last admitted (d) first"
print("hand-made states: the same victims as Scheduler._pick_victim")

# %% tags=["check:1", "hidden"]
def random_victim_state(rng: random.Random):
    running = [make_request(f"r{i}") for i in range(rng.randint(0, 7))]
    waiting = [make_request(f"w{i}", running=False) for i in range(rng.randint(0, 4))]
    pool = running + waiting
    rng.shuffle(pool)
    order = [r for r in pool if rng.random() < 0.8]            # the policy may leave some out
    pos = rng.randrange(len(order)) if order else 0
    preempted = {r.request_id for r in running if rng.random() < 0.2}
    scheduled = {r.request_id for r in order[:pos] if r.status is RequestStatus.RUNNING and rng.random() < 0.7}
    return running, order, pos, preempted, scheduled


rng = random.Random(707)
for trial in range(400):
    state = random_victim_state(rng)
    mine, theirs = vid(pick_victim(*state)), engine_victim(*state)
    assert mine == theirs, (f"random state {trial}: running {ids(state[0])}, order {ids(state[1])}, pos {state[2]}, "
                            f"preempted {sorted(state[3])}, scheduled {sorted(state[4])}: yours {mine}, engine {theirs}")
print("400 random states: the same victim as Scheduler._pick_victim")

# %% [markdown]
# ## 任务 2 · 重算抢占的簿记（preempt_recompute）
#
# 选中抢占对象之后，重算模式要做五件事（minibatch 的 `Scheduler._preempt`，`preemption_mode="recompute"`）：
#
# 1. 把它从 `running` 里移除；
# 2. 释放它的全部 KV 块：`kv.free(req)`（从尾块开始归还，前缀块在空闲队列里留得更久）；
# 3. `req.num_computed_tokens = 0`，`req.status = RequestStatus.WAITING`，`req.num_preemptions += 1`；
# 4. 放到等待队列的**最前面**（`waiting` 是一个 `deque`）：它比所有还在排队的请求都到得早，下次应当最先恢复；
# 5. 返回被丢掉的 KV 的 Token 数（抢占前的 `num_computed_tokens`）——恢复时这些 Token 要**重新**计算一遍，这就是重复计算的量。
#
# 已生成的 Token（`output_token_ids`）保留：恢复时请求要计算 `num_tokens = 提示词 + 已生成` 个 Token，然后接着生成。

# %% tags=["task:2"]
def preempt_recompute(req: Request, running: list[Request], waiting: collections.deque, kv: KVCacheManager) -> int:
    """Preempt ``req`` by recompute; return how many tokens of KV it lost."""
    ### BEGIN SOLUTION
    lost = req.num_computed_tokens
    running.remove(req)
    kv.free(req)
    req.num_computed_tokens = 0
    req.status = RequestStatus.WAITING
    req.num_preemptions += 1
    waiting.appendleft(req)
    return lost
    ### END SOLUTION

# %%
def running_state(lengths, num_blocks=16, block_size=4, waiting=()):
    """A KV manager with running requests of the given (prompt, generated[, computed]) lengths, each holding
    its blocks; without ``computed`` a request is decoding (all its tokens but the last are in the cache)."""
    kv = KVCacheManager(num_blocks, block_size)
    running = []
    for i, (p, g, *c) in enumerate(lengths):
        r = make_request(f"r{i}", p, g)
        computed, r.num_computed_tokens = (c[0] if c else r.num_computed_tokens), 0
        assert kv.allocate_slots(r, computed)          # blocks for the tokens already in the cache
        r.num_computed_tokens = computed
        running.append(r)
    queue = collections.deque(make_request(f"w{i}", n, running=False) for i, n in enumerate(waiting))
    return kv, running, queue


def engine_preempt(kv, running, queue, victim_id):
    """The engine's own recompute preemption on the same state (on copies)."""
    kv, running, queue = copy.deepcopy((kv, running, queue))
    sched = Scheduler(EngineConfig.from_kwargs(num_kv_blocks=kv.num_blocks, block_size=kv.block_size), kv)
    sched.running, sched.waiting = running, queue
    victim = next(r for r in running if r.request_id == victim_id)
    lost = victim.num_computed_tokens
    sched._preempt(victim, 0.0)
    return kv, sched.running, sched.waiting, victim, lost


def snapshot(kv, running, queue, victim, lost):
    return dict(lost=lost, running=ids(running), waiting=ids(queue), free_queue=list(kv.pool.free_queue),
                tables={r.request_id: kv.block_table(r.request_id) for r in running},
                victim=(victim.num_computed_tokens, victim.status.value, victim.num_preemptions,
                        victim.num_output_tokens, kv.block_table(victim.request_id)))


kv0, run0, q0 = running_state([(6, 3), (10, 0), (5, 9)], waiting=[7])
print("before:", {r.request_id: kv0.block_table(r.request_id) for r in run0}, "free:", list(kv0.pool.free_queue))
print("engine:", snapshot(*engine_preempt(kv0, run0, q0, "r2")))

# %% tags=["check:2"]
kv1, run1, q1 = running_state([(6, 3), (10, 0), (5, 9)], waiting=[7])
victim = run1[2]                                  # 5 + 9 tokens, 13 computed: blocks [5, 6, 7, 8]
lost = preempt_recompute(victim, run1, q1, kv1)
assert lost == 13, f"the victim had 13 tokens of KV; you returned {lost}"
assert ids(run1) == ["r0", "r1"], f"the victim leaves running; running is now {ids(run1)}"
assert ids(q1) == ["r2", "w0"], f"the victim goes to the front of the waiting queue; waiting is {ids(q1)}"
assert kv1.block_table("r2") == [] and kv1.num_free_blocks == 16 - 2 - 3, "all 4 of its blocks are free again"
assert list(kv1.pool.free_queue)[-4:] == [8, 7, 6, 5], "blocks are returned tail first (KVCacheManager.free)"
assert (victim.num_computed_tokens, victim.status, victim.num_preemptions) == (0, RequestStatus.WAITING, 1), \
    "num_computed_tokens 0, status WAITING, one more preemption"
assert victim.num_output_tokens == 9 and victim.num_tokens - victim.num_computed_tokens == 14, \
    "its 9 generated tokens stay: on resume it computes prompt + generated = 14 tokens"
kv2, run2, q2 = running_state([(6, 3), (10, 0), (5, 9)], waiting=[7])
assert snapshot(kv2, run2, q2, run2[0], preempt_recompute(run2[0], run2, q2, kv2)) == \
    snapshot(*engine_preempt(*running_state([(6, 3), (10, 0), (5, 9)], waiting=[7]), "r0")), "same as Scheduler._preempt"
print("hand-made states: the same bookkeeping as Scheduler._preempt")

# %% tags=["check:2", "hidden"]
rng = random.Random(7007)
cut = 0
for trial in range(200):
    lengths = []
    for _ in range(rng.randint(1, 5)):
        p, g = rng.randint(1, 20), rng.randint(0, 12)
        # decoding, or in the middle of a (re)computation cut into chunks: fewer tokens in the cache
        lengths.append((p, g, p + g - 1 if rng.random() < 0.6 else rng.randint(min(1, p + g - 1), p + g - 1)))
    need = sum(-(-c // 4) for _, _, c in lengths)
    state = running_state(lengths, num_blocks=need + rng.randint(0, 6), waiting=[rng.randint(1, 9) for _ in range(rng.randint(0, 3))])
    victim_id = rng.choice(state[1]).request_id
    theirs = snapshot(*engine_preempt(*state, victim_id))
    kv3, run3, q3 = copy.deepcopy(state)
    v3 = next(r for r in run3 if r.request_id == victim_id)
    cut += v3.num_computed_tokens < v3.num_tokens - 1
    mine = snapshot(kv3, run3, q3, v3, preempt_recompute(v3, run3, q3, kv3))
    assert mine["lost"] == theirs["lost"], \
        (f"random state {trial}, (prompt, generated, computed) {lengths}, victim {victim_id}: it lost its "
         f"num_computed_tokens = {theirs['lost']} tokens of KV (fewer than num_tokens - 1 when a chunked prefill "
         f"was cut), you returned {mine['lost']}")
    assert mine == theirs, f"random state {trial}, lengths {lengths}, victim {victim_id}:\n yours  {mine}\n engine {theirs}"
print(f"200 random states ({cut} victims in the middle of a prefill): the same bookkeeping as Scheduler._preempt")

# %% [markdown]
# ## 2. 一个过载的负载
#
# 现在到模拟器里。Llama-2-7B 跑在 A100-80G 上，但 KV 池只给 400 个块（6400 个 Token 槽位）；300 个请求以 10 req/s 到达，
# 提示词中位数 256、输出中位数 192（对数正态）。下面的 `evaluate` 在稳态（到达时间落在中间 80% 的请求）上给出三个数：
# 每个请求的 TPOT 的 p99、整个运行中被**重复计算**的 Token 数（每个请求实际计算的 Token 减去 $p + o - 1 - \text{命中}$），
# 以及这段时间窗内的输出吞吐。先看默认的 `continuous` 策略（先来先服务，抢占最后接纳的请求）：

# %%
SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", num_kv_blocks=400)
WORKLOAD = synthetic(300, 10.0, input_len=lognormal(median=256, sigma=0.6, max=2048),
                     output_len=lognormal(median=192, sigma=0.8, max=1024), seed=7)


def evaluate(policy, workload=WORKLOAD):
    """Run ``policy`` on the overloaded workload; steady-state p99 TPOT, recomputed tokens, output tok/s."""
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual")
    engine.scheduler.policy = policy
    computed = collections.Counter()
    policy_on_step = policy.on_step

    def on_step(scheduled, now):
        for req, n in scheduled:
            computed[req.request_id] += n
        policy_on_step(scheduled, now)

    policy.on_step = on_step
    result = run(workload, engine=engine)
    assert all(q.completed for q in result.requests), "every request completes"
    t0, t1 = np.quantile([q.arrival_time for q in result.requests], [0.1, 0.9])
    mid = [q for q in result.requests if t0 <= q.arrival_time <= t1]
    made = sum(int(np.count_nonzero((np.asarray(q.token_times) >= t0) & (np.asarray(q.token_times) < t1)))
               for q in result.requests)
    redo = sum(computed[q.request_id] - (q.prompt_len + q.output_len - 1 - q.num_cached_tokens) for q in result.requests)
    return dict(tpot_p99=float(np.percentile([q.tpot for q in mid if q.tpot is not None], 99)), recomputed=redo,
                tok_s=made / (t1 - t0), preemptions=sum(q.num_preemptions for q in result.requests), result=result)


# The open task's three conditions: your number / the default policy's number on the same workload.
LIMITS = {"tpot_p99": ("<=", 0.75), "recomputed": ("<=", 0.50), "tok_s": (">=", 0.97)}


def ratios(mine, base) -> dict:
    """Yours / the default's, for each number the open task grades."""
    return {k: mine[k] / max(base[k], 1e-9) for k in LIMITS}


def unmet(r) -> list[str]:
    """The conditions that ratios ``r`` miss (empty: all three met)."""
    return [k for k, (op, x) in LIMITS.items() if not (r[k] <= x if op == "<=" else r[k] >= x)]


default = evaluate(ContinuousPolicy())
print(f"continuous: TPOT p99 {default['tpot_p99'] * 1e3:.1f} ms, recomputed {default['recomputed']:,} tokens, "
      f"{default['tok_s']:.0f} tok/s, {default['preemptions']} preemptions")
steps = default["result"].steps
fig, ax = plt.subplots(figsize=(8, 2.6))
ax.plot([s.start_time for s in steps], [s.kv_blocks_used for s in steps], lw=0.7, label="KV blocks used")
pre = [s.start_time for s in steps if s.num_preempted]
ax.vlines(pre, 0, 400, color="C3", alpha=0.2, lw=0.5, label="a step with preemptions")
ax.set(xlabel="time (s)", ylabel="blocks", title="continuous on a 400-block pool: preemptions all the way")
ax.legend(fontsize=7, loc="lower right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 任务 3 · 一个不抖动的策略（开放题，按阈值评分）
#
# 写一个策略 `MyPolicy`（`Policy` 的子类，实现 `schedule_order(state)`），在上面的负载上**同时**做到：
#
# | 指标 | 通过条件 | 为什么 |
# |---|---|---|
# | 每请求 TPOT 的 p99 | ≤ 默认策略的 75% | 这是目标：被抢占的请求在恢复之前一个 Token 也不出，它们撑起了 TPOT 的尾部 |
# | 重复计算的 Token | ≤ 默认策略的 50% | 不抖动：少抢占、少重算，而不是换个方式白算 |
# | 稳态输出吞吐 | ≥ 默认策略的 97% | 不许用“少接纳请求”换延迟：一次只跑一个请求 TPOT 最好，吞吐却会崩 |
#
# 阈值的来由：默认策略的三个数就是上一格打印的那三个（代码里的 `LIMITS`）；阈值定在参考答案与默认策略之间。
# 这类比值随负载种子起伏不小（参考答案在个别种子上也会越过 TPOT 的阈值），所以评分器不只看一个种子：
# 它在三个**没给你看过**的负载种子上各跑一次你的策略与默认策略，取每个比值的**中位数**，三个中位数都要满足条件。
# 持续集成里的测试检查参考答案在另外 10 个种子上逐个满足条件、朴素的基线（默认策略，以及按 `max_tokens` 预留的不抢占准入）逐个不满足。
# 所以不要按这一个负载去调参数。在上面这个负载上，三个条件就是：TPOT p99 ≤ {{0.75 * default['tpot_p99'] * 1e3:.1f}} ms，
# 重复计算 ≤ {{0.5 * default['recomputed']:,.0f}} 个 Token，吞吐 ≥ {{0.97 * default['tok_s']:.0f}} tok/s。
#
# 可以用的信息：`state.running`（运行中，按接纳先后）、`state.waiting`（等待中，队列顺序，被抢占的在最前）、
# `state.kv.num_free_blocks`、`state.kv.block_size`、`state.kv.blocks_for(n)`，以及每个请求的 `num_tokens`、`num_computed_tokens`、
# `num_prompt_tokens`、`sampling_params.max_tokens`。策略只决定顺序；被省略的等待请求这一步不会被接纳，
# 被省略的运行中请求这一步不计算（而且会最先被抢占）。
#
# **提示**：抖动来自“接纳得太满”——池刚好塞满，下一步每个运行中的请求都要再长，只能互相抢。想一想：接纳一个等待请求之前，
# 池里应当为运行中的请求留多少余地？

# %% tags=["task:3"]
class MyPolicy(Policy):
    """Your policy: the order in which running and waiting requests compete this step."""

    name = "l07_mine"

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        ### BEGIN SOLUTION
        # Continuous batching that leaves each running request room to grow before admitting new ones.
        headroom = 3.0                   # blocks kept free per running request
        kv = state.kv
        # Blocks the running requests take this step (a decode that starts a new block).
        free = kv.num_free_blocks - sum(1 for r in state.running if r.num_tokens % kv.block_size == 0)
        order = list(state.running)
        reserve = headroom * len(state.running)
        for req in state.waiting:
            need = kv.blocks_for(req.num_tokens)
            if free - need < reserve:
                break                    # FCFS: nobody behind it goes first
            free -= need
            reserve += headroom
            order.append(req)
        return order
        ### END SOLUTION

# %% tags=["check:3", "nbval-ignore-output"]
mine = evaluate(MyPolicy())
rows = [("TPOT p99 (ms)", mine["tpot_p99"] * 1e3, default["tpot_p99"] * 1e3, mine["tpot_p99"] <= 0.75 * default["tpot_p99"]),
        ("recomputed tokens", mine["recomputed"], default["recomputed"], mine["recomputed"] <= 0.5 * default["recomputed"]),
        ("output tok/s", mine["tok_s"], default["tok_s"], mine["tok_s"] >= 0.97 * default["tok_s"])]
for name, yours, base, ok in rows:
    print(f"{name:<18} yours {yours:>10,.1f}   default {base:>10,.1f}   {'pass' if ok else 'FAIL'}")
assert mine["tpot_p99"] <= 0.75 * default["tpot_p99"], \
    f"TPOT p99 must be <= 75% of the default's {default['tpot_p99'] * 1e3:.1f} ms; yours {mine['tpot_p99'] * 1e3:.1f} ms"
assert mine["recomputed"] <= 0.5 * default["recomputed"], \
    f"recomputed tokens must be <= 50% of the default's {default['recomputed']:,}; yours {mine['recomputed']:,} (thrashing)"
assert mine["tok_s"] >= 0.97 * default["tok_s"], \
    f"throughput must be >= 97% of the default's {default['tok_s']:.0f} tok/s; yours {mine['tok_s']:.0f}"
fig, ax = plt.subplots(figsize=(8, 2.6))
for res, col, label in ((default, "C3", "continuous"), (mine, "C0", "MyPolicy")):
    st = res["result"].steps
    ax.plot([s.start_time for s in st], [s.kv_blocks_used for s in st], lw=0.7, color=col, label=label)
ax.set(xlabel="time (s)", ylabel="KV blocks used", title="KV use: default vs yours")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% tags=["check:3", "hidden"]
per_seed = []
for seed in (8, 21, 24):                   # unseen workloads of the same shape
    other = synthetic(300, 10.0, input_len=lognormal(median=256, sigma=0.6, max=2048),
                      output_len=lognormal(median=192, sigma=0.8, max=1024), seed=seed)
    per_seed.append(ratios(evaluate(MyPolicy(), other), evaluate(ContinuousPolicy(), other)))
median = {k: float(np.median([r[k] for r in per_seed])) for k in LIMITS}
# Ratios only: the unseen seeds' own figures stay hidden.
assert not unmet(median), "3 unseen seeds, the median of yours / the default's: " + "; ".join(
    f"{k} {median[k]:.2f} (need {op} {x})" for k, (op, x) in LIMITS.items())
print("3 unseen workload seeds: the medians of the three ratios meet all three thresholds")

# %% [markdown]
# ## 小结
#
# - minibatch 从策略顺序的末尾挑抢占对象，策略顺序之外的运行中请求最先；默认策略下它就是最后接纳的请求（与 vLLM V1 的 `running.pop()` 相同）。
# - 重算抢占丢掉全部 KV、保留已生成的 Token、排到等待队列最前；恢复时要重新计算提示词加已生成的全部 Token——这就是重复计算的来源。
# - 过载时默认策略把池塞满，每一步都在抢占；给运行中请求留出生长的余地，可以同时降低 TPOT 尾部与重复计算，而几乎不损失吞吐——
#   这正是 TensorRT-LLM `GUARANTEED_NO_EVICT` 与 SGLang 新 Token 比例准入的思路（第 12 章），只是这里由策略来做。
#
# **思考题**：把你的策略换到 `num_kv_blocks=2000`（几乎不抢占）的池上，它还比默认策略好吗？为什么“留余地”在池宽裕时反而可能有害？
