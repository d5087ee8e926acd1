# %% [markdown]
# # L10 · 多副本路由器（Router）
#
# 对应章节：第 26 章《多副本全局调度与负载均衡》。
#
# 一个模型部署成多个副本（Replica）之后，每个到达的请求都要先由**路由器**（Router）决定去哪个副本。路由器看不到副本内部，
# 只能看到每个副本的几个数：运行中与排队的请求数、KV Cache 用量、这个请求的前缀在那个副本的缓存里能命中多少。
# 本实验请你写出四个经典的路由规则——**最少请求**（Least Requests，即加入最短队列 JSQ）、**二选一**（Power of Two Choices）、
# **会话粘滞**（Session Affinity）与 SGLang 的**缓存感知路由**（Cache-aware Routing）——每一个都由检查单元格插进 minibatch 的模拟集群
# （`minibatch.cluster.run`，N 个引擎副本共用一个虚拟时钟）里运行；评分器还会在随机生成的副本状态上检验它们的**不变量**
# （属性测试，Property-based Testing）。最后一道开放题：在一个共享前缀、热度不均的负载上，让 TTFT 的 p90 明显胜过 `least_requests`。
#
# **学习目标**
#
# - 会写一个路由器：`choose(request, replicas, now)` 返回候选列表里的**位置**，只读 `ReplicaView`；
# - 理解二选一为什么几乎和“看遍所有副本”一样均衡，以及它的选择概率 $P(\text{第 } k \text{ 轻}) = (n-k)/\binom{n}{2}$；
# - 写出会话粘滞与 SGLang 的缓存感知规则（先看是否失衡，再看最长前缀匹配是否超过阈值），并说清楚它们各自用均衡换了什么；
# - 在负载均衡与缓存命中之间找到平衡，用稳态的 TTFT p90 评价。
#
# **怎么做**：只修改带 `task:N` 标签的任务单元格。完成后评分：
#
# ```bash
# python -m minibatch.labs check L10 labs/L10_router.ipynb
# ```

# %%
from __future__ import annotations

import collections
import inspect
import math
import random

import matplotlib.pyplot as plt
import numpy as np

from minibatch import EngineConfig, LLMEngine, cluster
from minibatch.cluster import ReplicaView
from minibatch.cluster.routers import KVAware, LeastRequests, PrefixAware, Router, Session, TokenTree, register
from minibatch.workload import RequestSpec, lognormal, multi_tenant, shared_prefix, synthetic

SIMC = dict(replicas=4, executor="sim", model="llama-3-8b", hardware="a10", max_num_seqs=16)   # 4 simulated A10s

# %% [markdown]
# ## 1. 路由器看到什么
#
# 请求到达时，集群为每个候选副本做一个只读的 `ReplicaView`，连同请求（`RequestSpec`：`prompt_len`、`prompt_token_ids`、`max_tokens`、
# `tenant`、`model`）交给路由器的 `choose(request, replicas, now)`；它返回被选副本在 `replicas` 这个列表里的**位置**（0 到 `len(replicas) - 1`），
# 而不是 `ReplicaView.index`（副本在集群里的编号；一个模型只由部分副本服务时，两者不同）。

# %%
print(inspect.getsource(ReplicaView))

# %% [markdown]
# 先看两个不看负载的路由器：轮转（`round_robin`）与随机（`random`）。集群是 4 个模拟的 A10（Llama-3-8B，`max_num_seqs=16`），
# 300 个请求以每秒 8 个的速度到达。下面的 `Recording` 包住一个路由器，记下每次路由时各副本的未完成请求数的**极差**
# （最多减最少）；图中是每个副本随时间的未完成请求数：

# %%
class Recording(Router):
    """Wraps a router; records the spread (max - min) of the replicas' loads at every decision."""

    name = "l10_recording"

    def __init__(self, inner):
        self.inner, self.spread = inner, []
        self.uses_prompt_tokens = getattr(inner, "uses_prompt_tokens", False)

    def choose(self, request, replicas, now):
        loads = [v.num_requests for v in replicas]
        self.spread.append(max(loads) - min(loads))
        return self.inner.choose(request, replicas, now)


def load_over_time(result, grid):
    """Unfinished requests per replica at each time of ``grid``."""
    out = np.zeros((SIMC["replicas"], len(grid)))
    for q in result.requests:
        out[q.replica] += (grid >= q.arrival_time) & (grid < q.finish_time)
    return out


BALANCE_WL = synthetic(300, 8.0, input_len=lognormal(median=512, sigma=0.8, max=4096),
                       output_len=lognormal(median=128, sigma=0.8, max=1024), seed=5)
spread, balance_runs = {}, {}
for name in ("round_robin", "random"):
    rec = Recording(cluster.routers.get(name))
    balance_runs[name] = cluster.run(BALANCE_WL, router=rec, **SIMC)
    spread[name] = float(np.mean(rec.spread))
grid = np.linspace(0, max(q.finish_time for q in balance_runs["random"].requests), 300)
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
for ax, (name, res) in zip(axes, balance_runs.items()):
    for i, row in enumerate(load_over_time(res, grid)):
        ax.plot(grid, row, lw=0.8, label=f"replica {i}")
    ax.set(xlabel="time (s)", title=f"{name}: mean spread {spread[name]:.1f}, TTFT p90 {res.summary(trim=0.1)['ttft_p90']:.2f} s")
axes[0].set_ylabel("unfinished requests")
axes[0].legend(fontsize=7)
plt.tight_layout()
plt.show()
print({name: round(s, 1) for name, s in spread.items()})
assert spread["random"] > spread["round_robin"], "the prose says random spreads the load worse than taking turns"

# %% [markdown]
# 轮转与随机都不看负载：请求的长度不同，同样多的请求在不同副本上积下不同的工作量；随机还会连续几次选中同一个副本，
# 负载的平均极差（{{spread['random']:.1f}}）比轮转（{{spread['round_robin']:.1f}}）更大。
#
# ## 任务 1 · 最少请求（ShortestQueue）
#
# 实现 `choose`：返回 `num_requests`（运行中 + 排队）最少的副本的**位置**；有几个一样少时，取位置最小的那个。
# 这就是 sgl-router 的负载（worker 上未完成的请求数）上的“加入最短队列”（Join the Shortest Queue）。

# %% tags=["task:1"]
@register
class ShortestQueue(Router):
    """Fewest unfinished requests (running + waiting); ties to the lowest position."""

    name = "l10_least"

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        ### BEGIN SOLUTION
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_requests, i))
        ### END SOLUTION

# %% [markdown]
# 检查单元格用 `V(index, running, waiting, ...)` 手工造副本视图，用 `random_views(rng)` 随机造一组（副本编号随机、不连续，负载常有平局），
# 用 `req(...)` 造请求：

# %%
def V(index, running=0, waiting=0, used=0, total=100, bs=16, tokens=0, active=0, cached=0, model="m") -> ReplicaView:
    return ReplicaView(index, model, running, waiting, used, total, bs, tokens, active, cached)


def req(n=32, ids=None, tenant=None, model=None) -> RequestSpec:
    return RequestSpec(0.0, n if ids is None else len(ids), 4, prompt_token_ids=ids, tenant=tenant, model=model)


def random_views(rng: random.Random, n: int | None = None, max_load: int = 12) -> list[ReplicaView]:
    n = n or rng.randint(1, 8)
    return [V(i, running=rng.randint(0, max_load), waiting=rng.choice([0, 0, rng.randint(0, max_load)]))
            for i in rng.sample(range(16), n)]


def hit(result) -> float:
    """Prefix-cache hit rate of a cluster run: cached prompt tokens / prompt tokens."""
    return sum(q.num_cached_tokens for q in result.requests) / sum(q.prompt_len for q in result.requests)


print([(v.index, v.num_requests) for v in random_views(random.Random(1))])

# %% tags=["check:1"]
r = ShortestQueue()
assert r.choose(req(), [V(0, 2, 1), V(1, 0, 1), V(2, 1)], 0.0) == 1, "loads 3, 1, 1: the first of the two least loaded"
assert r.choose(req(), [V(5, 4), V(2, 1, 2), V(9, 0, 3)], 0.0) == 1, \
    "loads 4, 3, 3: position 1 (its ReplicaView.index is 2): return the position in the list, not the index"
assert r.choose(req(), [V(7, 9, 9)], 0.0) == 0, "one candidate: position 0"
assert r.choose(req(), [V(0, 3), V(1, 0, 3), V(2, 2, 2)], 0.0) == 0, "running + waiting: 3, 3, 4"
mine = cluster.run(BALANCE_WL, router="l10_least", **SIMC)
ref = cluster.run(BALANCE_WL, router="least_requests", **SIMC)
assert [q.replica for q in mine.requests] == [q.replica for q in ref.requests], \
    "in the cluster: every request goes where minibatch's least_requests sends it"
print(f"routed per replica {mine.summary()['routed']}; TTFT p90 {mine.summary(trim=0.1)['ttft_p90']:.2f} s "
      f"(round_robin {balance_runs['round_robin'].summary(trim=0.1)['ttft_p90']:.2f} s)")

# %% tags=["check:1", "hidden"]
from minibatch.labs.forbid import forbid_calls, router_methods

rng = random.Random(1010)
ref = LeastRequests()
for trial in range(500):
    views = random_views(rng)
    with forbid_calls(*router_methods()):
        pos = ShortestQueue().choose(req(), views, 0.0)
    loads = [v.num_requests for v in views]
    assert isinstance(pos, int) and 0 <= pos < len(views), f"loads {loads}: {pos!r} is not a position in the list"
    assert loads[pos] == min(loads), f"loads {loads}: position {pos} has load {loads[pos]}, the least is {min(loads)}"
    assert pos == loads.index(min(loads)) == ref.choose(req(), views, 0.0), \
        f"loads {loads}: ties go to the lowest position ({loads.index(min(loads))}), yours {pos}"
print("500 random replica states: a valid position, least loaded, ties to the lowest position")

# %% [markdown]
# ## 任务 2 · 二选一（PowerOfTwoChoices）
#
# 看遍所有副本要每次读到每个副本的负载；二选一只看两个：从 `self.rng`（构造时用 `seed` 建的
# `random.Random`，**不要**用模块级的 `random`）里均匀地抽两个**不同**的位置，返回未完成请求少的那个；一样多时返回**先抽到**的那个；
# 只有一个候选时返回 0。
#
# 它为什么有效：$n$ 个副本按负载从轻到重排第 $k$ 的那个被选中，当且仅当它被抽中、而另一个比它重，概率是
# $P_k = (n-k)/\binom{n}{2}$。最重的那个永远不会被选中，最轻的那个以 $2/n$ 的概率被选中。把 $n$ 个球依次放进 $n$ 个箱子时，
# 最满的箱子从随机放的 $\Theta(\log n / \log\log n)$ 个降到 $\Theta(\log\log n)$ 个（Azar, Broder, Karlin, Upfal, STOC'94）；
# Mitzenmacher（*The Power of Two Choices in Randomized Load Balancing*, IEEE TPDS 2001）证明了排队模型里同样指数级的改进。

# %% tags=["task:2"]
@register
class PowerOfTwoChoices(Router):
    """Two distinct replicas drawn at random from a seeded RNG; the one with fewer unfinished requests."""

    name = "l10_p2c"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        ### BEGIN SOLUTION
        if len(replicas) == 1:
            return 0
        a, b = self.rng.sample(range(len(replicas)), 2)
        return a if replicas[a].num_requests <= replicas[b].num_requests else b
        ### END SOLUTION

# %% [markdown]
# 不同的正确实现抽样的方式可以不同（先抽 `a` 再抽不等于 `a` 的 `b`，或者 `rng.sample`），所以检查不比较具体的选择，而检查**性质**：
# 位置合法、最重的副本从不被选中、同一个种子给出同样的选择序列、选择的频率符合 $P_k$。

# %% tags=["check:2"]
assert PowerOfTwoChoices(seed=0).choose(req(), [V(3, 5)], 0.0) == 0, "one candidate: position 0"
heavy = [V(0, 1), V(1, 1), V(2, 50), V(3, 1)]
p2c = PowerOfTwoChoices(seed=0)
picks = [p2c.choose(req(), heavy, 0.0) for _ in range(300)]
assert set(picks) <= {0, 1, 3} and 2 not in picks, \
    "the unique most loaded replica (position 2) is never chosen: it loses to any other, if the two draws are distinct"
states = [random_views(random.Random(s), n=5) for s in range(60)]
p3, q3, p4 = PowerOfTwoChoices(seed=3), PowerOfTwoChoices(seed=3), PowerOfTwoChoices(seed=4)
first = [p3.choose(req(), v, 0.0) for v in states]
assert [q3.choose(req(), v, 0.0) for v in states] == first, "two routers with the same seed make the same choices"
assert [p4.choose(req(), v, 0.0) for v in states] != first, "another seed, other choices: draw from self.rng"
loads4 = [V(0, 5), V(1, 1), V(2, 9), V(3, 3)]                 # by load: position 1, 3, 0, 2
p2c, N = PowerOfTwoChoices(seed=11), 6000
freq = collections.Counter(p2c.choose(req(), loads4, 0.0) for _ in range(N))
want = {1: 3 / 6, 3: 2 / 6, 0: 1 / 6, 2: 0.0}
for pos, p in want.items():
    assert abs(freq[pos] / N - p) < 0.03, \
        (f"loads 5, 1, 9, 3: position {pos} should be chosen with probability {p:.3f} = (n - k) / C(n, 2), "
         f"yours {freq[pos] / N:.3f} (draw two DISTINCT positions uniformly)")
print("one candidate, never the most loaded, seeded, frequencies (n - k) / C(n, 2) = 1/2, 1/3, 1/6, 0")
rec = Recording(PowerOfTwoChoices(seed=0))
cluster.run(BALANCE_WL, router=rec, **SIMC)
assert np.mean(rec.spread) < 0.5 * spread["random"], \
    f"in the cluster: mean spread of the loads {np.mean(rec.spread):.1f}, random's {spread['random']:.1f}: should be under half"
print("in the cluster: the loads' mean spread is under half of random's")

# %% tags=["check:2", "hidden"]
from minibatch.labs.forbid import forbid_calls, router_methods

rng = random.Random(2020)
for trial in range(40):
    n = rng.randint(2, 8)
    loads = rng.sample(range(40), n)                     # distinct: rank k is well defined
    views = [V(i, running=x) for i, x in zip(rng.sample(range(16), n), loads)]
    router, draws = PowerOfTwoChoices(seed=rng.randint(0, 10**6)), 3000
    with forbid_calls(*router_methods()):            # your own rule: minibatch's routers may not run inside it
        freq = collections.Counter(router.choose(req(), views, 0.0) for _ in range(draws))
    assert set(freq) <= set(range(n)), f"loads {loads}: positions {sorted(freq)} are not all in range({n})"
    for rank, pos in enumerate(sorted(range(n), key=lambda i: loads[i]), start=1):
        p = (n - rank) / math.comb(n, 2)
        assert abs(freq[pos] / draws - p) < 0.035, \
            (f"loads {loads}: position {pos} (rank {rank} of {n} by load) chosen {freq[pos] / draws:.3f} of the time, "
             f"want (n - k) / C(n, 2) = {p:.3f}: two distinct positions, uniformly, the less loaded wins")
for n in (2, 3, 5):
    equal = [V(i, running=4) for i in range(n)]
    router = PowerOfTwoChoices(seed=n)
    freq = collections.Counter(router.choose(req(), equal, 0.0) for _ in range(3000))
    assert all(abs(freq[i] / 3000 - 1 / n) < 0.035 for i in range(n)), \
        f"{n} equally loaded replicas: each should be chosen 1/{n} of the time (a tie goes to the first DRAWN), yours {dict(freq)}"
r1, r2 = PowerOfTwoChoices(seed=5), PowerOfTwoChoices(seed=5)
for step in range(50):
    views = random_views(rng, n=6)
    random.seed(step)
    c1 = r1.choose(req(), views, 0.0)
    random.random()
    c2 = r2.choose(req(), views, 0.0)
    assert c1 == c2, "two routers with the same seed disagree when the module-level random is used in between: draw from self.rng"
print("40 random load vectors: choice frequencies (n - k) / C(n, 2); ties uniform; draws only from self.rng")

# %% [markdown]
# ## 任务 3 · 会话粘滞（StickySession）
#
# 多轮对话的后几轮带着前几轮的全部上下文。把同一个会话（这里用 `request.tenant` 表示用户或会话）的请求都送到同一个副本，
# 它的前缀缓存就能命中前几轮的 KV。规则（与 minibatch 的 `session` 路由器相同）：
#
# 1. `request.tenant` 为 `None`：返回未完成请求最少的位置（平局取位置最小），什么也不记；
# 2. 键是 `(request.tenant, request.model)`。这个键有“家”（`self.home[key]`，一个**副本编号** `ReplicaView.index`），
#    而且这个编号在候选里：返回它的位置（即使它现在最忙）；
# 3. 否则（第一次见到，或者家不在候选里）：选未完成请求最少的位置（平局取位置最小），把那个副本的**编号**记为新家，返回位置。
#
# 记编号而不是位置：候选列表只含服务这个模型的副本，而且副本可能增减，位置会变，编号不会。

# %% tags=["task:3"]
@register
class StickySession(Router):
    """Sticky by tenant: a tenant's first request to the least loaded replica, later ones to the same replica."""

    name = "l10_session"

    def __init__(self):
        self.home: dict[tuple, int] = {}          # (tenant, model) -> ReplicaView.index

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        ### BEGIN SOLUTION
        least = min(range(len(replicas)), key=lambda i: (replicas[i].num_requests, i))
        if request.tenant is None:
            return least
        key = (request.tenant, request.model)
        where = {v.index: i for i, v in enumerate(replicas)}
        if key in self.home and self.home[key] in where:
            return where[self.home[key]]
        self.home[key] = replicas[least].index
        return least
        ### END SOLUTION

# %% tags=["check:3"]
r = StickySession()
assert r.choose(req(tenant="alice"), [V(0, 3), V(1, 1), V(2, 2)], 0.0) == 1, "alice's first request: the least loaded"
assert r.choose(req(tenant="alice"), [V(0), V(1, 9), V(2)], 0.0) == 1, "alice stays on replica 1 though it is now the busiest"
assert r.choose(req(tenant="bob"), [V(0, 2), V(1, 9), V(2, 1)], 0.0) == 2
assert r.choose(req(tenant="bob"), [V(0), V(1), V(2, 7)], 0.0) == 2, "bob stays on replica 2"
assert r.choose(req(), [V(0, 2), V(1, 9), V(2, 1)], 0.0) == 2, "no tenant: the least loaded"
assert r.choose(req(tenant="alice"), [V(1, 5), V(2), V(0)], 0.0) == 0, \
    "alice's home is replica index 1, now at position 0 of the candidates: return its position"
print("hand-made sequences: sticky by tenant, a home is a replica index")
TENANT_WL = multi_tenant(240, 10.0, num_tenants=12, system_prompt_len=1024, question_len=lognormal(median=96, sigma=0.6, max=512),
                         output_len=lognormal(median=64, sigma=0.6, max=256), seed=2)
mine = cluster.run(TENANT_WL, router="l10_session", enable_prefix_caching=True, **SIMC)
ref = cluster.run(TENANT_WL, router="session", enable_prefix_caching=True, **SIMC)
assert [q.replica for q in mine.requests] == [q.replica for q in ref.requests], "in the cluster: the same routing as minibatch's session"
homes = collections.defaultdict(set)
for q in mine.requests:
    homes[q.tenant].add(q.replica)
assert all(len(h) == 1 for h in homes.values()), f"every tenant on one replica: {dict(homes)}"
least = cluster.run(TENANT_WL, router="least_requests", enable_prefix_caching=True, **SIMC)
print(f"12 tenants, each on one replica; prefix-cache hit rate {hit(mine):.1%} (least_requests {hit(least):.1%}), "
      f"routed {mine.summary()['routed']}")

# %% tags=["check:3", "hidden"]
from minibatch.labs.forbid import forbid_calls, router_methods

rng = random.Random(3030)
for trial in range(200):
    mine, ref = StickySession(), Session()
    for step in range(30):
        views = [V(i, running=rng.randint(0, 9)) for i in sorted(rng.sample(range(6), rng.randint(1, 6)))]
        rng.shuffle(views)
        spec = req(tenant=rng.choice(["a", "b", "c", "d", None]), model=rng.choice([None, None, "m2"]))
        home = ref.home.get((spec.tenant, spec.model))
        want = ref.choose(spec, views, 0.0)
        with forbid_calls(*router_methods()):        # your own rule: minibatch's routers may not run inside it
            got = mine.choose(spec, views, 0.0)
        assert got == want, (f"sequence {trial}, step {step}: tenant {spec.tenant!r}, model {spec.model!r}, its home "
                             f"{home} (a replica index), candidates (index, load) {[(v.index, v.num_requests) for v in views]}: "
                             f"want position {want}, yours {got}")
        if home is not None and home in [v.index for v in views]:
            assert views[got].index == home, "sticky: a tenant stays on its home replica while it is a candidate"
print("200 random sequences with changing candidate lists: the same choices as minibatch's session; homes are stable")

# %% [markdown]
# ## 任务 4 · 缓存感知路由（CacheAware，SGLang 的规则）
#
# SGLang 的路由器（sgl-router 的 `cache_aware` 策略）为每个副本维护一棵基数树，记下**路由器自己**送到那里的提示词（它不去问引擎），
# 用它估计一个新请求在每个副本上能命中多少前缀。设负载 = 未完成请求数 `num_requests`：
#
# 1. **失衡**：若 `max(负载) - min(负载) > balance_abs_threshold` **且** `max(负载) > balance_rel_threshold * min(负载)`，
#    选负载最小的位置（平局取位置最小）；
# 2. 否则，对每个候选算**匹配长度** `self.tree(v.index).match(tokens)`，取匹配最长的（平局取负载小的，再平局取位置小的）；
#    若它的匹配比例 `匹配长度 / len(tokens)` **大于** `cache_threshold`（提示词为空时比例算 0），选它（缓存命中）；
# 3. 否则选**树最小**的位置（`len(self.tree(v.index))`：空间最多，平局取位置最小）；
#
# 无论哪种情况，最后都把 `tokens` 插入被选副本的树（`tokens` 非空时）。`tokens = list(request.prompt_token_ids or [])`。
# 树用 minibatch 的 `TokenTree`（`match(tokens)` 返回最长前缀长度，`insert(tokens)` 插入，`len(tree)` 是树里的 Token 数）。
# 默认参数是 SGLang 启动器的（`sglang-router` 0.2.1，`router_args.py`）：`cache_threshold=0.3`、`balance_abs_threshold=64`、`balance_rel_threshold=1.5`。

# %%
t = TokenTree()
t.insert([1, 2, 3, 4])
t.insert([1, 2, 9])
print("match [1, 2, 3, 7]:", t.match([1, 2, 3, 7]), "| tokens in the tree:", len(t))

# %% tags=["task:4"]
@register
class CacheAware(Router):
    """SGLang's cache-aware routing: balance when the load is skewed, else the longest prefix match above a threshold."""

    name = "l10_cache_aware"
    uses_prompt_tokens = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees: dict[int, TokenTree] = {}

    def tree(self, index: int) -> TokenTree:
        """The tree of what this router sent to replica ``index`` (made on first use)."""
        if index not in self.trees:
            self.trees[index] = TokenTree()
        return self.trees[index]

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        ### BEGIN SOLUTION
        tokens = list(request.prompt_token_ids or [])
        loads = [v.num_requests for v in replicas]
        positions = range(len(replicas))
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            pos = min(positions, key=lambda i: (loads[i], i))
        else:
            matches = [self.tree(v.index).match(tokens) for v in replicas]
            best = max(positions, key=lambda i: (matches[i], -loads[i], -i))
            rate = matches[best] / len(tokens) if tokens else 0.0
            if rate > self.cache_threshold:
                pos = best
            else:
                pos = min(positions, key=lambda i: (len(self.tree(replicas[i].index)), i))
        if tokens:
            self.tree(replicas[pos].index).insert(tokens)
        return pos
        ### END SOLUTION

# %% tags=["check:4"]
PROMPT = list(range(1000, 1100))                                   # 100 tokens


def seeded(**kw):
    r = CacheAware(**kw)
    r.tree(0).insert(PROMPT)                                        # replica 0 was sent PROMPT before
    return r


near = PROMPT[:90] + list(range(10))                                # a 90% match on replica 0
r = seeded()
assert r.choose(req(ids=near), [V(0, 100), V(1, 10)], 0.0) == 1, \
    "loads 100 vs 10: 90 > 64 and 100 > 1.5 x 10: imbalanced, so the least loaded despite the 90% match"
assert r.tree(1).match(near) == 100, "the prompt goes into the chosen replica's tree, also when balancing"
assert seeded().choose(req(ids=near), [V(0, 300), V(1, 230)], 0.0) == 0, \
    "loads 300 vs 230: 70 > 64 but 300 < 1.5 x 230: balanced (both conditions must hold), so the 90% match"
assert seeded().choose(req(ids=near), [V(0, 60), V(1)], 0.0) == 0, "loads 60 vs 0: 60 - 0 is not > 64: balanced"
others = list(range(5000, 5100))
assert seeded().choose(req(ids=PROMPT[:31] + others[:69]), [V(0), V(1)], 0.0) == 0, "31% > 30%: a cache hit"
assert seeded().choose(req(ids=PROMPT[:30] + others[:70]), [V(0), V(1)], 0.0) == 1, \
    "30% is not > 30%: a miss, so the smallest tree (replica 1's is empty)"
r = seeded()
r.tree(1).insert(list(range(7000, 7100)))
r.tree(2).insert(list(range(8000, 8040)))
assert r.choose(req(ids=others), [V(0), V(1), V(2, 5)], 0.0) == 2, "a miss: the smallest tree (40 tokens), not the least loaded"
assert len(r.tree(2)) == 140, "the new prompt is in replica 2's tree"
tie = CacheAware()
tie.tree(3).insert(PROMPT)
tie.tree(8).insert(PROMPT)
assert tie.choose(req(ids=PROMPT), [V(8, 4), V(3, 2), V(5)], 0.0) == 1, "equal matches: the less loaded (trees by ReplicaView.index)"
empty = seeded()
assert empty.choose(req(), [V(0), V(1, 3)], 0.0) == 1, \
    "no prompt_token_ids (tokens = []): the match rate counts as 0 (a miss), so the smallest tree (replica 1's is empty)"
assert len(empty.tree(0)) == 100 and len(empty.tree(1)) == 0, "no tokens: nothing is inserted"
print("hand-made cases: balance thresholds, the cache threshold, the smallest tree, ties")
PREFIX_WL = shared_prefix(300, 10.0, num_prefixes=8, prefix_len=1024, suffix_len=lognormal(median=128, sigma=0.6, max=1024),
                          output_len=lognormal(median=96, sigma=0.6, max=512), seed=6)
mine = cluster.run(PREFIX_WL, router="l10_cache_aware", enable_prefix_caching=True, **SIMC)
ref = cluster.run(PREFIX_WL, router="prefix_aware", enable_prefix_caching=True, **SIMC)
assert [q.replica for q in mine.requests] == [q.replica for q in ref.requests], \
    "in the cluster: the same routing as minibatch's prefix_aware"
least = cluster.run(PREFIX_WL, router="least_requests", enable_prefix_caching=True, **SIMC)
print(f"8 shared prefixes: hit rate {hit(mine):.1%} (least_requests {hit(least):.1%}); TTFT p90 "
      f"{mine.summary(trim=0.1)['ttft_p90']:.2f} s (least_requests {least.summary(trim=0.1)['ttft_p90']:.2f} s)")

# %% tags=["check:4", "hidden"]
from minibatch.labs.forbid import forbid_calls, router_methods

rng = random.Random(4040)
balanced_seen = hits = misses = 0
for trial in range(150):
    params = dict(cache_threshold=rng.choice([0.1, 0.3, 0.5]), balance_abs_threshold=rng.choice([4, 8, 64]),
                  balance_rel_threshold=rng.choice([1.1, 1.5, 3.0]))
    mine, ref = CacheAware(**params), PrefixAware(**params)
    family = [[rng.randrange(50) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    for step in range(25):
        base_ids = rng.choice(family)
        ids = base_ids[:rng.randint(0, len(base_ids))] + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
        ids = ids or [rng.randrange(50)]
        spec = req(ids=ids) if rng.random() > 0.05 else req()       # now and then no token ids: rate 0, no insert
        ids = list(spec.prompt_token_ids or [])
        top = rng.choice([4, 4, 12, 150])                          # mostly even loads, sometimes a skew
        views = [V(i, running=rng.randint(0, top)) for i in sorted(rng.sample(range(6), rng.randint(1, 6)))]
        rng.shuffle(views)
        loads = [v.num_requests for v in views]
        imbalanced = ref.is_imbalanced(loads)
        matches = [ref.tree(v.index).match(ids) for v in views]
        sizes = [len(ref.tree(v.index)) for v in views]
        want = ref.choose(spec, views, 0.0)
        with forbid_calls(*router_methods()):        # your own rule: minibatch's routers may not run inside it
            got = mine.choose(spec, views, 0.0)
        assert isinstance(got, int) and 0 <= got < len(views), f"{got!r} is not a position in a list of {len(views)}"
        if imbalanced:
            assert loads[got] == min(loads), \
                (f"{params}: loads {loads} are imbalanced (spread > {params['balance_abs_threshold']} and max > "
                 f"{params['balance_rel_threshold']} x min): the least loaded position, yours {got} (load {loads[got]})")
        assert got == want, (f"{params}, sequence {trial} step {step}: loads {loads}, prefix matches {matches} of "
                             f"{len(ids)} tokens, tree sizes {sizes}: SGLang's rule ({ref.last_decision}) picks position "
                             f"{want}, yours {got}")
        balanced_seen += imbalanced
        hits += ref.last_decision == "cache_hit"
        misses += ref.last_decision == "cache_miss"
print(f"150 random sequences ({balanced_seen} balancing, {hits} cache-hit, {misses} cache-miss decisions): "
      "the same choices as minibatch's prefix_aware")

# %% [markdown]
# ## 2. 热门前缀：均衡与命中的冲突
#
# 开放题的负载：24 段系统提示词（长度中位数 1536 Token），热度按 Zipf 分布（`popularity=1.3`），
# 400 个请求以每秒 12 个的速度突发到达（`burstiness=0.7`）；4 个 A10 副本（Llama-3-8B），`max_num_seqs=32`，前缀缓存开启。
# 下面比较 `least_requests` 与默认参数的 SGLang 规则（`prefix_aware`），指标是稳态（到达时间落在中间 80% 的请求）的 TTFT p90：

# %%
SKEW = dict(replicas=4, executor="sim", model="llama-3-8b", hardware="a10", max_num_seqs=32, enable_prefix_caching=True)


def skewed(seed, n=400):
    return shared_prefix(n, 12.0, num_prefixes=24, prefix_len=lognormal(median=1536, sigma=0.5, max=6144),
                         suffix_len=lognormal(median=128, sigma=0.7, max=1024),
                         output_len=lognormal(median=96, sigma=0.6, max=512), popularity=1.3, burstiness=0.7, seed=seed)


def evaluate(router, workload):
    """Steady-state TTFT p90, prefix-cache hit rate and requests per replica of one cluster run."""
    res = cluster.run(workload, router=router, **SKEW)
    assert all(q.completed for q in res.requests), "every request completes"
    return dict(ttft_p90=res.summary(trim=0.1)["ttft_p90"], hit=hit(res), routed=res.summary()["routed"], result=res)


WORKLOAD = skewed(5)
prefix_lens = {r.prefix_id: r.prefix_len for r in WORKLOAD}
top_share = float(np.mean([r.prefix_id == 0 for r in WORKLOAD]))
one = LLMEngine(EngineConfig.from_kwargs(**{k: v for k, v in SKEW.items() if k != "replicas"}), clock="virtual").config
kv_tokens = one.num_kv_blocks * one.block_size
lr = evaluate("least_requests", WORKLOAD)
sg = evaluate("prefix_aware", WORKLOAD)
for name, m in (("least_requests", lr), ("prefix_aware", sg)):
    print(f"{name:<15} TTFT p90 {m['ttft_p90']:.2f} s, hit rate {m['hit']:.1%}, routed {m['routed']}")
print(f"the hottest prefix: {top_share:.0%} of the requests; all 24 prefixes: {sum(prefix_lens.values()):,} tokens, "
      f"a replica's KV pool: {kv_tokens:,} tokens")
print(f"to pass: TTFT p90 <= {0.65 * lr['ttft_p90']:.2f} s")
assert sg["hit"] > lr["hit"] and sg["ttft_p90"] > lr["ttft_p90"], \
    "the prose says SGLang's defaults hit more but lose on the TTFT tail here"
assert max(sg["routed"]) > 1.4 * max(lr["routed"]), "the prose says prefix_aware overloads one replica"
assert sum(prefix_lens.values()) > kv_tokens, "the prose says a replica's KV pool cannot hold all the prefixes"

# %% [markdown]
# 最热的一段提示词占了 {{top_share:.0%}} 的请求；24 段提示词共 {{sum(prefix_lens.values()):,}} Token，而一个副本的 KV 池只有
# {{kv_tokens:,}} 个 Token 的槽位，还要装下运行中请求自己的 KV。
# `least_requests` 把每段提示词散到所有副本上，每个副本都要缓存（放不下时反复重算）全部 24 段；SGLang 的规则命中率更高
# （{{sg['hit']:.1%}} 对 {{lr['hit']:.1%}}），TTFT p90 却更差（{{sg['ttft_p90']:.2f}} s 对 {{lr['ttft_p90']:.2f}} s）：最热的提示词把它的副本压垮了
# （最忙的副本收到 {{max(sg['routed'])}} 个请求，`least_requests` 下最多 {{max(lr['routed'])}} 个），
# 而它的失衡条件（差超过 64 **且** 超过 1.5 倍）在每个副本最多 32 个运行中请求的集群里来得太晚。
#
# ## 任务 5 · 又均衡又命中（开放题，按阈值评分）
#
# 写一个路由器 `MyRouter`（`Router` 的子类；不许继承或调用 minibatch 的 `PrefixAware`、`KVAware`，任务 1–4 里你自己的类可以用），
# 使这个负载的稳态 TTFT p90 **不超过 `least_requests` 的 65%**：在上面这个负载上就是 ≤ {{0.65 * lr['ttft_p90']:.2f}} s。
#
# 阈值的来由：它定在参考答案与 `least_requests` 之间，离参考答案有余量（答案文件里检查单元格打印了参考答案的数）；默认参数的 SGLang 规则
# 在上面这个负载上比 `least_requests` 还慢，过不了。评分器会在一个**没给你看过**的种子上重新生成同样形状的负载、再检查一次
# （相对那个种子上的 `least_requests`），所以不要按这一个负载调参数。
#
# 可以用的信息：`ReplicaView` 的全部字段——包括 `cached_prefix_tokens`（这个请求的提示词在那个副本的前缀缓存里**现在**能命中多少 Token，
# 引擎告诉路由器的真实值）——以及请求的 `prompt_len`、`prompt_token_ids`。想一想：一个请求的 TTFT 由什么组成？排在它前面的请求，
# 加上它自己要算的、没被缓存的那部分提示词。

# %% tags=["task:5"]
@register
class MyRouter(Router):
    """Your router for shared prefixes with skewed popularity."""

    name = "l10_mine"

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        ### BEGIN SOLUTION
        # Estimated cost of joining a replica, in "queued request" units: the requests waiting there (each
        # delays this one's first token by a prefill), a little for the running ones (they slow every step),
        # and this request's own prefill, the prompt tokens the replica's cache does not hold, at 512
        # tokens per unit. The cheapest replica wins; ties to the lowest position.
        wait_weight, run_weight, tokens_per_unit = 2.0, 0.1, 512

        def cost(v: ReplicaView) -> float:
            uncached = request.prompt_len - min(v.cached_prefix_tokens, request.prompt_len)
            return wait_weight * v.num_waiting + run_weight * v.num_running + uncached / tokens_per_unit

        return min(range(len(replicas)), key=lambda i: (cost(replicas[i]), i))
        ### END SOLUTION

# %% tags=["check:5", "nbval-ignore-output"]
FORBIDDEN = (PrefixAware, KVAware)


def evaluate_mine(workload):
    router = MyRouter()
    assert not isinstance(router, FORBIDDEN), "write your own rule: do not subclass PrefixAware or KVAware"
    calls, saved = [], {cls: cls.choose for cls in FORBIDDEN}
    for cls in FORBIDDEN:
        cls.choose = lambda self, *a, cls=cls: calls.append(cls.__name__) or saved[cls](self, *a)
    try:
        out = evaluate(router, workload)
    finally:
        for cls in FORBIDDEN:
            cls.choose = saved[cls]
    assert not calls, f"write your own rule: {sorted(set(calls))}.choose ran inside yours"
    return out


mine = evaluate_mine(WORKLOAD)
print(f"yours: TTFT p90 {mine['ttft_p90']:.2f} s (need <= {0.65 * lr['ttft_p90']:.2f} s), hit rate {mine['hit']:.1%}, "
      f"routed {mine['routed']}")
assert mine["ttft_p90"] <= 0.65 * lr["ttft_p90"], \
    f"TTFT p90 must be <= 65% of least_requests' {lr['ttft_p90']:.2f} s; yours {mine['ttft_p90']:.2f} s"
fig, ax = plt.subplots(figsize=(7, 2.8))
for m, col, label in ((lr, "0.4", "least_requests"), (sg, "C3", "prefix_aware (defaults)"), (mine, "C0", "yours")):
    v = np.sort([q.ttft for q in m["result"].requests])
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=col, label=label)
ax.axhline(0.9, color="k", ls=":", lw=1)
ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT on the skewed shared-prefix workload")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% tags=["check:5", "hidden"]
other = skewed(8)
lr8, mine8 = evaluate("least_requests", other), evaluate_mine(other)
assert mine8["ttft_p90"] <= 0.65 * lr8["ttft_p90"], \
    (f"unseen seed: TTFT p90 must be <= 65% of least_requests' on the same seed; yours is "
     f"{mine8['ttft_p90'] / lr8['ttft_p90']:.0%} of it")          # a ratio: the hidden seed's figures stay hidden
print("unseen workload seed: the threshold is met")

# %% [markdown]
# ## 小结
#
# - 路由器只看 `ReplicaView`，返回候选列表里的位置；它能做的决定很少，却决定了每个副本的队列与缓存。
# - 最少请求看遍所有副本；二选一只看两个，最重的永远不被选中，均衡程度已接近前者——这是大规模路由器常用它的原因。
# - 会话粘滞与缓存感知路由用均衡换命中：同一会话、同一前缀的请求留在一个副本上。SGLang 的规则在失衡超过两个阈值时回到均衡；
#   阈值太松时，热门前缀会压垮它的副本。
# - 一个好的代价函数把“前面排着多少”与“自己要算多少（未命中的提示词）”放在同一个单位里比较，比分成两步的规则更容易兼顾两边。
#
# **思考题**：把开放题负载的 `popularity` 改为 0（各段提示词一样热），默认参数的 `prefix_aware` 与你的路由器谁更好？
# 副本数从 4 增加到 8 时呢？
