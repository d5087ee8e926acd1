# %% [markdown]
# # L02 · 动态批处理窗口策略（max_batch_size, max_wait）
#
# 对应章节：第 4 章《批聚合策略：静态批处理与动态批处理窗口》。
#
# 动态批处理（Dynamic Batching）最经典的形态是一个“批处理窗口”：请求到达后先排队，满足以下任一条件就“发车”——
#
# - 排队的请求数达到 `max_batch_size`（凑满一批）；
# - 队列里最老的请求已经等待了 `max_wait`（窗口到期）。
#
# 发车后这一批跑到**全部完成**才接纳下一批，这叫请求级（Request-level）批处理，是连续批处理（Continuous Batching）
# 出现之前通用推理服务的做法（例如 Triton Inference Server 的动态批处理器 Dynamic Batcher 的
# `max_queue_delay_microseconds`）。本实验中你将把它写成 minibatch 的一个调度策略（Policy），
# 插进真实的引擎里，在模拟器中观察：低负载时 TTFT 几乎正好增加一个窗口；高负载时窗口不再是问题，“等整批跑完”才是。
#
# **学习目标**
#
# - 理解 `max_batch_size` 与 `max_wait` 两个旋钮各自控制什么；
# - 会写一个 minibatch 调度策略：`schedule_order`（本步的调度顺序）与 `next_wakeup`（没有新请求时何时再醒来）；
# - 能用模拟器量化窗口对 TTFT 的影响，并解释请求级批处理在高负载下的排队问题。
#
# **怎么做**：只修改带 `task:N` 标签的任务单元格；检查单元格（`check:N`）会断言你的结果。完成后评分：
#
# ```bash
# python -m minibatch.labs check L02 labs/L02_window.ipynb
# ```

# %%
from __future__ import annotations

import inspect

import matplotlib.pyplot as plt

from minibatch import SamplingParams
from minibatch.policies import Policy, SchedulerState, register
from minibatch.policies.continuous import ContinuousPolicy
from minibatch.request import Request, RequestStatus
from minibatch.runner import run
from minibatch.workload import synthetic

# %% [markdown]
# ## 1. 策略（Policy）在引擎里的位置
#
# 引擎每一步（step）都问一次策略：这一步里，哪些请求、按什么顺序去争抢本步的 Token 预算
# （`max_num_batched_tokens`）、序列槽位（`max_num_seqs`）和 KV 块？调度器（`minibatch.scheduler.Scheduler`）
# 沿着策略给出的顺序分配资源；**不在顺序里的请求这一步就继续等待**。策略看到的状态是 `SchedulerState`：

# %%
print(inspect.getsource(SchedulerState))

# %% [markdown]
# 连续批处理（iteration-level）的策略只有一行：运行中的请求在前，等待的请求按到达顺序在后，每一步都可以有新请求加入。

# %%
print(inspect.getsource(ContinuousPolicy.schedule_order))

# %% [markdown]
# 窗口策略的两个参数直接取自引擎配置：`max_batch_size` 就是 `state.max_num_seqs`，`max_wait` 就是
# `state.max_wait_s`（配置项 `max_wait_ms` 换算成秒）。下面的 `make_request` 用来手工构造请求。

# %%
def make_request(rid: str, arrival: float, prompt_len: int = 16, max_tokens: int = 4) -> Request:
    """A bare engine request (for hand-made scheduler states)."""
    return Request(rid, [0] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def make_state(now, running=(), waiting=(), max_num_seqs=4, max_wait_s=0.05) -> SchedulerState:
    return SchedulerState(now=now, running=list(running), waiting=list(waiting), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=2048, max_wait_s=max_wait_s, kv=None)

# %% [markdown]
# ## 任务 1 · 发车条件（should_dispatch）
#
# 写出窗口的发车条件：`waiting` 非空，并且满足其一——
#
# - `len(waiting) >= max_batch_size`；
# - `now >= oldest + max_wait`，其中 `oldest` 是 `waiting` 中最早的到达时刻（`min(r.arrival_time ...)`，
#   被抢占的请求会回到队首，所以不要假设 `waiting[0]` 一定最老）。
#
# 注意第二个条件写成 `now >= oldest + max_wait`，而不是 `now - oldest >= max_wait`：任务 3 会让引擎恰好在
# `oldest + max_wait` 这一时刻醒来，用同一个表达式比较才不会被浮点误差（如 `0.1 + 0.05 - 0.1 < 0.05`）卡住。

# %% tags=["task:1"]
def should_dispatch(waiting: list[Request], now: float, max_batch_size: int, max_wait: float) -> bool:
    """True when a batch should start: enough requests wait, or the oldest has waited max_wait."""
    ### BEGIN SOLUTION
    if not waiting:
        return False
    if len(waiting) >= max_batch_size:
        return True
    return now >= min(r.arrival_time for r in waiting) + max_wait
    ### END SOLUTION

# %% tags=["check:1"]
reqs = [make_request(f"r{i}", 0.1 + 0.01 * i) for i in range(8)]
assert should_dispatch([], 9.0, 4, 0.05) is False, "nothing to send"
assert should_dispatch(reqs[:3], 0.12, 4, 0.05) is False, "3 < 4 requests and the oldest waited only 20 ms"
assert should_dispatch(reqs[:4], 0.13, 4, 0.05) is True, "4 requests fill a batch"
assert should_dispatch(reqs[:1], 0.1 + 0.05, 4, 0.05) is True, "the window closes exactly at arrival + max_wait"
assert should_dispatch(reqs[:1], 0.149, 4, 0.05) is False
assert should_dispatch([reqs[5], reqs[0]], 0.151, 4, 0.05) is True, "the oldest request need not be first"
print([should_dispatch(reqs[:k], 0.13, 4, 0.05) for k in range(6)])

# %% [markdown]
# ## 任务 2 · 请求级批处理的调度顺序（schedule_order）
#
# 实现 `WindowPolicy.schedule_order(state)`，返回本步参与调度的请求列表：
#
# 1. 先从 `self.batch`（正在执行的那一批）中去掉已经结束的请求（`r.is_finished`）；
# 2. 如果这一批还有未完成的请求，就**只**返回它们（保持原顺序）——新来的请求不能插队，这就是“请求级”；
# 3. 否则，若 `should_dispatch(state.waiting, state.now, state.max_num_seqs, state.max_wait_s)` 成立，
#    取 `state.waiting` 的前 `state.max_num_seqs` 个作为新的一批，记入 `self.batch` 并返回；
# 4. 否则返回空列表：这一步什么也不做，继续等窗口。
#
# 用 `@register(name="l02_window")` 注册后，`run(..., policy="l02_window")` 就会用你的策略驱动引擎。

# %% tags=["task:2", "task:3"]
@register(name="l02_window")
class WindowPolicy(Policy):
    """Request-level dynamic batching: wait for a full batch or max_wait, run the batch to completion."""

    def __init__(self):
        self.batch: list[Request] = []      # the batch in flight

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        ### BEGIN SOLUTION task 2
        self.batch = [r for r in self.batch if not r.is_finished]
        if not self.batch and should_dispatch(state.waiting, state.now, state.max_num_seqs, state.max_wait_s):
            self.batch = state.waiting[:state.max_num_seqs]
        return list(self.batch)
        ### END SOLUTION

    def next_wakeup(self, state: SchedulerState) -> float | None:
        ### BEGIN SOLUTION task 3
        if self.batch or not state.waiting:
            return None
        return min(r.arrival_time for r in state.waiting) + state.max_wait_s
        ### END SOLUTION

# %% tags=["check:2", "needs:1"]
policy = WindowPolicy()
r = [make_request(f"r{i}", 0.01 * i) for i in range(10)]
assert policy.schedule_order(make_state(0.02, waiting=r[:3])) == [], "window still open, 3 < 4 requests"
assert policy.schedule_order(make_state(0.05, waiting=r[:3])) == r[:3], "the window closed at 0.00 + 0.05"
for q in r[:3]:
    q.status = RequestStatus.RUNNING            # what the scheduler does when it admits them
order = policy.schedule_order(make_state(0.06, running=r[:3], waiting=r[3:9]))
assert order == r[:3], "6 requests wait, but the batch in flight runs to completion first"
r[0].status = RequestStatus.FINISHED_LENGTH
assert policy.schedule_order(make_state(0.07, running=r[1:3], waiting=r[3:9])) == r[1:3]
for q in r[1:3]:
    q.status = RequestStatus.FINISHED_LENGTH
order = policy.schedule_order(make_state(0.08, waiting=r[3:9]))
assert order == r[3:7], "next batch: the first max_num_seqs=4 waiting requests"
print([q.request_id for q in order])

# %% [markdown]
# ## 任务 3 · 窗口到期时叫醒引擎（next_wakeup）
#
# 任务 2 的策略在窗口未到期时返回空列表，这一步就什么也没执行。在虚拟时钟下，引擎接着会跳到“下一件要发生的事”：
# 下一个请求到达，或策略通过 `next_wakeup` 报告的时刻——取较早者。下面是接口的说明：

# %%
print(inspect.getsource(Policy.next_wakeup))

# %% [markdown]
# 实现 `WindowPolicy.next_wakeup(state)`（在任务 2 的同一个单元格里）：
#
# - 如果有一批正在执行（`self.batch` 非空），返回 `None`：引擎本来就会一步步执行下去；
# - 如果没有请求在等，返回 `None`；
# - 否则返回窗口关闭的时刻：最早到达时刻 + `state.max_wait_s`（与任务 1 完全相同的表达式）。
#
# 如果没有 `next_wakeup`，一个在低负载下独自到达的请求要等到**下一个请求到达**才会被发车；若它是最后一个请求，
# 引擎就永远等下去——minibatch 在虚拟时钟下会检测到这种“无进展”并报错。下面的检查会演示这一点。

# %% tags=["check:3", "needs:1", "needs:2"]
policy = WindowPolicy()
q = make_request("q", 0.1)
assert policy.next_wakeup(make_state(0.1, waiting=[q])) == 0.1 + 0.05, "the window of q closes at 0.15"
assert policy.next_wakeup(make_state(0.1)) is None, "nobody waits"
policy.batch = [make_request("p", 0.0)]
assert policy.next_wakeup(make_state(0.1, waiting=[q])) is None, "a batch is running"

one = synthetic(1, rate=1.0, input_len=256, output_len=16, seed=0)
kw = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=8, max_wait_ms=50)
win = run(one, policy="l02_window", **kw).requests[0]
cont = run(one, policy="continuous", **kw).requests[0]
assert abs((win.ttft - cont.ttft) - 0.050) < 1e-9, "alone, a request waits exactly one window"
print(f"single request: TTFT {1000 * cont.ttft:.1f} ms (continuous) -> {1000 * win.ttft:.1f} ms (window)")


@register(name="l02_no_wakeup")
class NoWakeup(WindowPolicy):
    def next_wakeup(self, state):
        return None


try:
    run(one, policy="l02_no_wakeup", **kw)
    raise AssertionError("without next_wakeup the last request should never be sent")
except RuntimeError as e:
    print("without next_wakeup the run stops with", type(e).__name__)

# %% [markdown]
# ## 2. 低负载与高负载
#
# 现在把两种策略放到同一个负载上：LLaMA-2-7B、A100-80G（模拟器），每个请求 256 个输入 Token、32 个输出 Token，
# 泊松到达（Poisson Arrival），`max_num_seqs=8`（即 `max_batch_size`），`max_wait=50 ms`。逐步提高到达率：
#
# - **低负载**：请求几乎总是独自到达，凑不满一批，每个请求都要等满窗口——TTFT 的中位数正好多出约 50 ms；
# - **高负载**：窗口很快被凑满，窗口本身不再是瓶颈；但请求级批处理要等整批跑完才接纳新请求，
#   新来的请求在队列里等待上一批的全部解码，TTFT 迅速上升；连续批处理则在每一步都接纳新请求。
#
# 再在低负载（1 req/s）下扫描 `max_wait`，验证 TTFT 的增量与窗口长度成正比。

# %% tags=["check:3", "needs:1", "needs:2"]
RATES = [0.5, 1, 2, 4, 8, 16, 32]
kw = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=8)
ttft_p50 = {"continuous": [], "l02_window": []}
for rate in RATES:
    wl = synthetic(100, rate=rate, input_len=256, output_len=32, seed=0)
    for name in ttft_p50:
        ttft_p50[name].append(run(wl, policy=name, max_wait_ms=50, **kw).summary()["ttft_p50"])
extra = [w - c for w, c in zip(ttft_p50["l02_window"], ttft_p50["continuous"])]
assert all(abs(x - 0.050) < 0.005 for x in extra[:3]), f"low load: about one window extra, got {extra[:3]}"
assert extra[-1] > 0.2, "high load: queueing behind whole batches dominates"

wl = synthetic(100, rate=1, input_len=256, output_len=32, seed=0)
base = run(wl, policy="continuous", **kw).summary()["ttft_p50"]
waits = [10, 25, 50, 100]
sweep = [run(wl, policy="l02_window", max_wait_ms=w, **kw).summary()["ttft_p50"] - base for w in waits]
assert all(abs(s - w / 1000) < 0.005 for s, w in zip(sweep, waits)), sweep
print("rate (req/s):      ", RATES)
print("extra TTFT p50 (ms):", [round(1000 * x, 1) for x in extra])
print("max_wait (ms):", waits, "-> extra TTFT p50 (ms):", [round(1000 * s, 1) for s in sweep])

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
for name, label in (("continuous", "continuous"), ("l02_window", "window, max_wait=50 ms")):
    ax1.plot(RATES, [1000 * v for v in ttft_p50[name]], "o-", label=label)
ax1.set_xscale("log")
ax1.set_yscale("log")
ax1.set_xlabel("request rate (req/s)")
ax1.set_ylabel("TTFT p50 (ms)")
ax1.legend()
ax2.plot(waits, [1000 * s for s in sweep], "o-", label="measured")
ax2.plot(waits, waits, "k--", lw=1, label="y = max_wait")
ax2.set_xlabel("max_wait (ms)")
ax2.set_ylabel("extra TTFT p50 at 1 req/s (ms)")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. 看一眼批次的形状
#
# 在中等负载（8 req/s）下，把每一步的批大小画出来：窗口策略的批是“一块一块”的——一批发车后大小只减不增，
# 跑完才开始下一批；连续批处理的批大小随到达和完成随时变化。

# %% tags=["check:3", "needs:1", "needs:2"]
wl = synthetic(40, rate=8, input_len=256, output_len=32, seed=1)
fig, ax = plt.subplots(figsize=(8, 2.6))
for name in ("continuous", "l02_window"):
    res = run(wl, policy=name, max_wait_ms=50, **kw)
    steps = [s for s in res.steps if s.start_time < 2.0]
    ax.step([s.start_time for s in steps], [s.num_seqs for s in steps], where="post", label=name)
    # A step larger than the one before it means new requests joined; count the joins that
    # happened while earlier requests were still running.
    joins = sum(1 for a, b in zip(res.steps, res.steps[1:]) if b.num_seqs > a.num_seqs and a.num_running > 0)
    sizes = [s.num_seqs for s in res.steps]
    print(f"{name:11s} steps={len(sizes):4d}  mean batch size={sum(sizes) / len(sizes):.2f}  "
          f"joins into a running batch={joins}")
    if name == "l02_window":
        assert joins == 0, "request-level: nobody joins a batch in flight"
ax.set_xlabel("time (s)")
ax.set_ylabel("requests in the step")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 小结
#
# - 批处理窗口用“等待”换“批大小”：低负载时每个请求白等一个 `max_wait`，TTFT 增量 ≈ `max_wait`；
# - 请求级批处理的真正代价在高负载：新请求要等整批完成，队头阻塞（Head-of-Line Blocking）使 TTFT 远超窗口本身；
# - 连续批处理（下一个实验 L03）在每一步接纳新请求，既不必等窗口，也不必等整批。
#
# **思考题**：第 1 章的 RAG 案例把 `max_wait` 从 30 ms 调到 20 ms、`max_num_seqs` 从 8 调到 16。
# 用本实验的代码，在 30 req/s 附近比较这两组参数的 TTFT p50，结果符合你的预期吗？
