# %% [markdown]
# # L03 · 迭代级调度：连续批处理的一步
#
# 对应章节：第 5 章《迭代级调度：连续批处理》（另见第 10、11 章）。
#
# Orca（OSDI'22）提出迭代级调度（Iteration-level Scheduling）：调度的单位不再是“一批请求”，而是“一步（step）”——
# 每生成一个 Token 就重新决定一次批次，新请求随时加入、完成的请求立即离开。这就是连续批处理（Continuous Batching），
# vLLM、SGLang、TensorRT-LLM（In-flight Batching）和 TGI 的共同基础。
#
# 本实验中你将亲手写出调度一步的核心逻辑：在 Token 预算（`max_num_batched_tokens`）和序列数上限（`max_num_seqs`）
# 之下，决定哪些请求、各算多少个新 Token；必要时把放不下的预填充（Prefill）切块（Chunked Prefill）。
# 然后在 500 个随机状态上与 minibatch 的 `Scheduler` 逐一对比，最后把它作为策略插进引擎，先在模拟器里、
# 再在真实的 tiny 模型上跑起来。
#
# **学习目标**
#
# - 理解 vLLM V1 的统一视角：预填充、分块预填充、解码、抢占后的重算，都是“把 `num_computed_tokens` 追到 `num_tokens`”；
# - 掌握一步调度的规则：运行中的请求优先，等待的请求按先来先服务（FCFS），预算不够时切块；
# - 能读懂并复现一个真实调度器的行为，并用随机测试验证“行为一致”。
#
# **怎么做**：只修改带 `task:N` 标签的任务单元格。完成后评分：
#
# ```bash
# python -m minibatch.labs check L03 labs/L03_continuous.ipynb
# ```

# %%
from __future__ import annotations

import copy
import inspect
import random

import matplotlib.pyplot as plt

from minibatch import EngineConfig, SamplingParams
from minibatch.kv_cache import KVCacheManager
from minibatch.policies import Policy, SchedulerState, make_policy, register
from minibatch.request import Request, RequestStatus
from minibatch.runner import run
from minibatch.scheduler import Scheduler
from minibatch.workload import lognormal, synthetic

# %% [markdown]
# ## 1. 两个计数器
#
# minibatch 的 `Request` 与 vLLM V1 一样，只用两个计数器描述进度：
#
# - `num_tokens`：目前已知的全部 Token 数 = Prompt 长度 + 已生成的 Token 数；
# - `num_computed_tokens`：KV 已经写进缓存的 Token 数。
#
# 一步里，一个请求要计算的新 Token 数就是两者之差：刚到达的请求差整个 Prompt（预填充），
# 解码中的请求差 1 个（上一步刚采样出的 Token），被切块的预填充差剩下的部分，被抢占（Recompute 模式）
# 的请求 KV 已被清空，差 Prompt 加上已生成的全部 Token。当两个计数器相等时，请求就采样出下一个 Token。

# %%
print(inspect.getdoc(Request))

# %% [markdown]
# ## 任务 1 · 本步要算多少个新 Token（num_new_tokens）

# %% tags=["task:1"]
def num_new_tokens(req: Request) -> int:
    """Tokens of ``req`` whose K/V are not in the cache yet."""
    ### BEGIN SOLUTION
    return req.num_tokens - req.num_computed_tokens
    ### END SOLUTION

# %%
def make_request(rid, prompt_len, output_len=0, computed=0, running=False, arrival=0.0) -> Request:
    """A request with ``output_len`` generated tokens and ``computed`` tokens in the KV cache."""
    req = Request(rid, [7] * prompt_len, SamplingParams(max_tokens=1000), arrival_time=arrival)
    req.output_token_ids = [1] * output_len
    req.num_computed_tokens = computed
    req.status = RequestStatus.RUNNING if running else RequestStatus.WAITING
    return req

# %% tags=["check:1"]
cases = {
    "new request (prefill)": make_request("a", 100),
    "decoding": make_request("b", 100, output_len=5, computed=104, running=True),
    "prefill cut after 64": make_request("c", 100, computed=64, running=True),
    "preempted (recompute)": make_request("d", 100, output_len=5),
}
want = {"new request (prefill)": 100, "decoding": 1, "prefill cut after 64": 36, "preempted (recompute)": 105}
for name, req in cases.items():
    assert num_new_tokens(req) == want[name], f"{name}: yours {num_new_tokens(req)}, want {want[name]}"
    print(f"{name:24s} {num_new_tokens(req)}")

# %% [markdown]
# ## 任务 2 · 调度一步（schedule_step）
#
# 实现 `schedule_step(running, waiting, budget, max_num_seqs, chunked)`，返回本步的 `[(request, num_new_tokens), ...]`。
# 规则与 minibatch 的 `Scheduler`（continuous 策略、KV 充足时）完全一致：
#
# 1. 依次考察 `running + waiting`（运行中的优先；等待的按队列顺序，即 FCFS）；
# 2. 若预算已用完（`budget <= 0`）或批里已有 `max_num_seqs` 个请求，停止；
# 3. 该请求要算 `n = num_new_tokens(req)` 个 Token。若 `n > budget`：
#    - `chunked=True`：只算 `budget` 个（切块，剩下的下一步继续）；
#    - `chunked=False` 且批次目前为空：仍然整段计算（否则这个请求永远无法被调度）；
#    - `chunked=False` 且批次非空：运行中的请求跳过它、继续看下一个；**等待中的请求则停止**——
#      FCFS 不允许后来的请求越过排在前面、放不下的请求；
# 4. 把 `(req, n)` 加入结果，`budget -= n`。
#
# （真实的调度器还要为这些 Token 分配 KV 块、在块不够时抢占，那是 L04 与 L07 的内容；这里假定 KV 充足。）

# %% tags=["task:2"]
def schedule_step(running: list[Request], waiting: list[Request], budget: int, max_num_seqs: int,
                  chunked: bool) -> list[tuple[Request, int]]:
    """One step of iteration-level FCFS scheduling under a token budget."""
    ### BEGIN SOLUTION
    batch: list[tuple[Request, int]] = []
    for req in running + waiting:
        if budget <= 0 or len(batch) >= max_num_seqs:
            break
        n = num_new_tokens(req)
        if n > budget:
            if chunked:
                n = budget
            elif batch:
                if req in waiting:
                    break
                continue
        batch.append((req, n))
        budget -= n
    return batch
    ### END SOLUTION

# %% [markdown]
# 为了与引擎对比，下面的 `engine_step` 把同一个状态交给 minibatch 真正的 `Scheduler`（continuous 策略，KV 块充足），
# 返回它调度的 `(request_id, num_new_tokens)`；`random_state` 随机生成调度状态：解码中的、预填充切到一半的运行请求，
# 新到达的和被抢占过的等待请求，以及随机的预算、序列上限和是否切块。

# %%
def engine_step(running, waiting, budget, max_num_seqs, chunked):
    """What minibatch's Scheduler schedules from this state (on copies; the state is not changed)."""
    config = EngineConfig.from_kwargs(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      enable_chunked_prefill=chunked)
    sched = Scheduler(config, KVCacheManager(num_blocks=512, block_size=16), make_policy("continuous"))
    running, waiting = copy.deepcopy((running, waiting))
    sched.running = running
    sched.waiting.extend(waiting)
    return [(req.request_id, n) for req, n in sched.schedule(now=0.0).items]


def random_state(rng: random.Random):
    chunked = rng.random() < 0.6
    running = []
    for i in range(rng.randint(0, 6)):
        prompt = rng.randint(1, 400)
        if chunked and rng.random() < 0.3:          # a prefill cut in an earlier step
            running.append(make_request(f"run{i}", prompt, computed=rng.randint(1, prompt - 1) if prompt > 1 else 0,
                                        running=True))
        else:                                        # decoding
            out = rng.randint(1, 30)
            running.append(make_request(f"run{i}", prompt, output_len=out, computed=prompt + out - 1, running=True))
    waiting = []
    for i in range(rng.randint(0, 6)):
        out = rng.randint(1, 10) if rng.random() < 0.2 else 0    # preempted earlier: recompute all
        waiting.append(make_request(f"wait{i}", rng.randint(1, 600), output_len=out))
    budget = rng.choice([8, 32, 100, 256, 512, 2048])
    return running, waiting, budget, rng.randint(1, 8), chunked


example = random_state(random.Random(3))
print("running:", [(q.request_id, num_tokens_left) for q, num_tokens_left in
                   [(q, q.num_tokens - q.num_computed_tokens) for q in example[0]]])
print("waiting:", [(q.request_id, q.num_tokens) for q in example[1]], " budget, max_num_seqs, chunked:", example[2:])
print("engine schedules:", engine_step(*example))

# %% tags=["check:2", "needs:1"]
r = [make_request(f"run{i}", 50, output_len=3, computed=52, running=True) for i in range(3)]
w = [make_request("w0", 300), make_request("w1", 40), make_request("w2", 10)]
ids = lambda step: [(req.request_id, n) for req, n in step]


def expect(args, want, why):
    got = ids(schedule_step(*args))
    assert got == want, f"{why}\n  wanted {want}\n  yours  {got}"


expect((r, w, 100, 8, True), [("run0", 1), ("run1", 1), ("run2", 1), ("w0", 97)],
       "budget 100, chunked: the 3 decodes, then w0 cut to the 97 tokens left")
expect((r, w, 100, 8, False), [("run0", 1), ("run1", 1), ("run2", 1)],
       "budget 100, not chunked: w0 (300) does not fit, and FCFS does not let w1 pass it")
expect(([], w, 100, 8, False), [("w0", 300)], "an empty batch, not chunked: a long prompt runs whole")
expect((r, w, 2048, 4, True), [("run0", 1), ("run1", 1), ("run2", 1), ("w0", 300)],
       "max_num_seqs 4: the 3 decodes and w0, then the batch is full")

rng = random.Random(0)
num_chunked = num_full = 0
for trial in range(500):
    state = random_state(rng)
    mine = ids(schedule_step(*state))
    theirs = engine_step(*state)
    assert mine == theirs, f"random state {trial} (budget {state[2]}, max_num_seqs {state[3]}, chunked {state[4]}):\n  wanted {theirs} (the engine)\n  yours  {mine}"
    num_chunked += any(n < num_new_tokens(req) for req, n in schedule_step(*state))
    num_full += len(mine) == state[3]
print("500 random states: identical to minibatch's Scheduler")
print(f"({num_chunked} of them cut a prefill, {num_full} filled all max_num_seqs slots)")

# %% tags=["check:2", "needs:1", "hidden"]
from minibatch.labs.forbid import forbid_calls

rng = random.Random(2323)
for trial in range(300):
    state = random_state(rng)
    theirs = engine_step(*state)
    with forbid_calls((Scheduler, "schedule"), what="write the step yourself (engine_step is for comparing)"):
        mine = ids(schedule_step(*state))
    assert mine == theirs, f"unseen random state {trial} (budget {state[2]}, max_num_seqs {state[3]}, chunked {state[4]}):\n  wanted {theirs}\n  yours  {mine}"
print("300 unseen random states: identical, with the engine's Scheduler unavailable")

# %% [markdown]
# 引擎的 `Scheduler.schedule` 做的正是同一件事，外加 KV 块分配与抢占（第 9、12 章细讲）：

# %%
src = inspect.getsource(Scheduler.schedule)
cut = src.find("# KV blocks")
print(src[:cut].rstrip() if cut > 0 else src)

# %% [markdown]
# ## 任务 3 · 把你的调度步插进引擎（StepPolicy）
#
# minibatch 的策略只决定“顺序”，预算与 KV 由调度器负责。把 `schedule_step` 选中的请求按顺序返回，
# 调度器沿着这个顺序分配 Token，结果就与你的 `schedule_step` 相同。实现 `StepPolicy.schedule_order`：
# 用 `state.running`、`state.waiting`、`state.max_num_batched_tokens`、`state.max_num_seqs` 和 `self.chunked`
# 调用 `schedule_step`，返回其中的请求（不含 Token 数）。

# %% tags=["task:3"]
@register(name="l03_step")
class StepPolicy(Policy):
    """Iteration-level FCFS, with the step decided by your schedule_step."""

    chunked = True          # run it with enable_chunked_prefill=True

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        ### BEGIN SOLUTION
        step = schedule_step(state.running, state.waiting, state.max_num_batched_tokens, state.max_num_seqs,
                             self.chunked)
        return [req for req, _ in step]
        ### END SOLUTION

# %% [markdown]
# 在模拟器中（LLaMA-2-7B、A100-80G）跑 100 个请求，Prompt 长度服从对数正态分布，Token 预算 512 使长 Prompt 被切块。
# 你的策略与引擎自带的 `continuous` 策略应当**逐步**一致：每一步的请求数、预填充 Token 数、解码 Token 数都相同，
# 因而每个请求的 TTFT 也相同。

# %% tags=["check:3", "needs:1", "needs:2"]
wl = synthetic(100, rate=20, input_len=lognormal(median=300, sigma=1.0, max=3000), output_len=48, seed=2)
kw = dict(executor="sim", model="llama-2-7b", hardware="a100-80g", max_num_seqs=16,
          max_num_batched_tokens=512, enable_chunked_prefill=True)
mine, ref = run(wl, policy="l03_step", **kw), run(wl, policy="continuous", **kw)
shape = lambda res: [(s.num_seqs, s.num_prefill_tokens, s.num_decode_tokens) for s in res.steps]
first = next((i for i, (a, b) in enumerate(zip(shape(mine), shape(ref))) if a != b), min(len(mine.steps), len(ref.steps)))
assert shape(mine) == shape(ref), \
    (f"step-by-step the same batches as the engine's continuous policy: step {first} differs "
     f"(requests, prefill tokens, decode tokens)\n  wanted {shape(ref)[first:first + 1]}\n  yours  {shape(mine)[first:first + 1]}")
assert [r.ttft for r in mine.requests] == [r.ttft for r in ref.requests], "the same TTFT for every request as 'continuous'"
mixed = sum(1 for s in mine.steps if s.num_prefill_tokens and s.num_decode_tokens)
print(f"{len(mine.steps)} steps, identical to 'continuous'; {mixed} mixed prefill+decode steps")
print(f"TTFT p50 {1000 * mine.summary()['ttft_p50']:.1f} ms, TPOT p50 {1000 * mine.summary()['tpot_p50']:.1f} ms")

steps = mine.steps[:150]
x = range(len(steps))
prefill = [s.num_prefill_tokens for s in steps]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4), sharex=True)
ax1.bar(x, prefill, width=1.0, label="prefill tokens", color="#f2a65a")
ax1.bar(x, [s.num_decode_tokens for s in steps], width=1.0, bottom=prefill, label="decode tokens", color="#5a8fd6")
ax1.axhline(512, color="k", ls="--", lw=1, label="token budget")
ax1.set_ylabel("tokens / step")
ax1.legend(fontsize=8, loc="upper right")
ax2.step(x, [s.num_seqs for s in steps], where="post", label="in the batch")
ax2.step(x, [s.num_waiting for s in steps], where="post", label="waiting")
ax2.set_ylabel("requests")
ax2.set_xlabel("step")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% tags=["check:3", "needs:1", "needs:2", "hidden"]
from minibatch.kv_cache import KVCacheManager as _KV
from minibatch.policies import SchedulerState as _State

_yours = schedule_step
_calls = []


def schedule_step(*args, **kwargs):          # noqa: F811  (a stand-in that picks only the LAST candidate)
    a = inspect.signature(_yours).bind(*args, **kwargs).arguments
    _calls.append((a["running"], a["waiting"], a["budget"], a["max_num_seqs"]))
    everyone = list(a["running"]) + list(a["waiting"])
    return [(everyone[-1], 1)] if everyone else []


try:
    rng = random.Random(3131)
    for trial in range(50):
        running, waiting, budget, seqs, chunked = random_state(rng)
        if not running + waiting:
            continue
        st = _State(now=0.0, running=running, waiting=waiting, max_num_seqs=seqs, max_num_batched_tokens=budget,
                    max_wait_s=0.0, kv=_KV(num_blocks=512, block_size=16))
        n = len(_calls)
        got = [q.request_id for q in StepPolicy().schedule_order(st)]
        assert len(_calls) == n + 1, "StepPolicy.schedule_order must call schedule_step once per step"
        assert _calls[-1] == (running, waiting, budget, seqs), \
            "pass state.running, state.waiting, state.max_num_batched_tokens and state.max_num_seqs to schedule_step"
        assert got == [(running + waiting)[-1].request_id], \
            f"return the requests schedule_step chose, in its order: it chose {[(running + waiting)[-1].request_id]}, yours {got}"
finally:
    schedule_step = _yours
print("StepPolicy returns what schedule_step decides")

# %% [markdown]
# ## 2. 在真实模型上运行
#
# 最后用内置的 tiny 模型在 CPU 上真正生成 Token：4 个请求同时到达，Prompt 24 个 Token，Token 预算 32，
# 所以预填充会被切块、与解码混在同一步里。贪心解码（Greedy）下，调度方式不影响每个请求生成的 Token——
# 你的策略与 `continuous` 应当产生完全相同的输出。（耗时取决于机器，这里只打印与时间无关的结果。）

# %% tags=["check:3", "needs:1", "needs:2"]
tiny_wl = synthetic(4, rate=float("inf"), input_len=24, output_len=6, seed=0)
tiny_kw = dict(executor="model", model="tiny", max_num_seqs=4, max_num_batched_tokens=32,
               enable_chunked_prefill=True, num_kv_blocks=32, keep_tokens=True)
mine_t, ref_t = run(tiny_wl, policy="l03_step", **tiny_kw), run(tiny_wl, policy="continuous", **tiny_kw)
assert shape(mine_t) == shape(ref_t), f"tiny model: the same batches as 'continuous'\n  wanted {shape(ref_t)}\n  yours  {shape(mine_t)}"
assert [r.output_token_ids for r in mine_t.requests] == [r.output_token_ids for r in ref_t.requests], \
    "greedy decoding: your policy must generate the same tokens as 'continuous'"
print(f"tiny model: {len(mine_t.steps)} steps, the same batches and tokens as 'continuous'")

# %% [markdown]
# ## 小结
#
# - 迭代级调度每一步都重新组批：运行中的请求先拿预算，等待的请求按 FCFS 补位，预算不够就切块；
# - 一个统一的量 `num_tokens - num_computed_tokens` 同时描述了预填充、分块、解码与重算，调度器因此非常短；
# - 图中橙色的预填充块插进蓝色的解码步，就是 ITL 尾部的来源（L01）；Token 预算越小，切块越细，
#   解码被打断得越轻，但长 Prompt 的 TTFT 越长——第 11 章会定量分析这个权衡。
#
# **思考题**：把 `max_num_batched_tokens` 改为 128 或 2048，混合步的数量与 TTFT p50 如何变化？
