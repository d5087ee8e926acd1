# %% [markdown]
# # 第 14 章 RadixAttention 与缓存感知调度
#
# 第 13 章的前缀缓存回答的是“这个请求有多少前缀已经算过”。SGLang（Zheng et al., *SGLang: Efficient Execution of Structured
# Language Model Programs*, NeurIPS'24）把同样的缓存组织成一棵**基数树**（Radix Tree），并把这种复用叫作 RadixAttention；
# 有了树，调度器还能问第二个问题：**等待中的请求里，哪些共享同一段缓存**？按这个答案排队就是**缓存感知调度**（Cache-aware Scheduling）——
# SGLang 的 LPM（最长前缀匹配，Longest Prefix Match）与 DFS-weight 策略。论文报告，在它评测的多种工作负载上，SGLang 的吞吐最高可达
# 当时最先进系统的 6.4 倍（论文摘要）。
#
# 缓存感知调度有一个代价：总让“缓存热”的请求先走，**缓存冷**（Cache-cold）的请求就可能一直排在后面——饥饿（Starvation）。
# 本章在模拟器里把饥饿量出来，再用老化（Aging）把它修好。
#
# ## 学习目标
#
# - 理解 RadixAttention 的基数树：边上是 Token 序列，匹配是从根往下走，插入时在分叉处**分裂边**（Edge Split），驱逐时按 LRU 删除叶子；
#   能说清它与块哈希链（vLLM APC）的异同；
# - 读懂 minibatch 的 `minibatch/radix.py`（与哈希链同步的块粒度基数树），并把引擎里的树画出来；
# - 掌握 SGLang 的 LPM 与 DFS-weight 排序规则，以及队列过长时 LPM 退回 FCFS 的阈值（查源码得到）；
# - 在模拟器里测量 LPM 对缓存冷请求 TTFT p99 的影响，理解 minibatch `lpm` 策略的老化规则，并扫描老化参数找到折中。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.policies.lpm import LPMPolicy
from minibatch.radix import RadixTree
from minibatch.runner import run
from minibatch.viz import md_table, radix_tree
from minibatch.workload import lognormal, shared_prefix, synthetic

LPM_DEFAULTS = {k: q.default for k, q in inspect.signature(LPMPolicy).parameters.items()}   # minibatch's lpm
print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 14.1 从哈希链到基数树
#
# 把所有缓存过的前缀放进一棵树：根代表空序列，每条边上是一段 Token，从根到一个节点的路径就是一段缓存过的前缀，
# 一个节点的各个孩子以**不同的** Token 开头。没有分叉的一串节点合并成一条边（路径压缩，Path Compression）——这就是基数树与普通字典树（Trie）的区别。
# 三个操作都从根往下走：
#
# - **匹配**（`match_prefix`）：沿着与请求 Token 相同的边往下走，走不动时停下，走过的长度就是命中长度；
# - **插入**（`insert`）：先匹配，再把剩下的 Token 挂成新的边；如果新路径在一条边的**中间**离开它，先在离开处把边一分为二；
# - **驱逐**（`evict`）：池满时删叶子。SGLang 的 `RadixCache.evict` 把所有叶子按 `last_access_time` 放进一个堆（LRU），
#   跳过正被请求使用的节点（`lock_ref > 0`），删掉一个叶子后，若父节点变成了叶子，就把父节点放回堆里。
#
# 论文 Figure 3 用九个时刻演示了这些操作（多轮对话、few-shot、自洽性采样共享前缀，以及 LRU 驱逐叶子）。对照 SGLang v0.5.3 的源码
# `python/sglang/srt/mem_cache/radix_cache.py`：`TreeNode` 有 `children`、`key`（Token）、`value`（KV 在池里的下标）、`lock_ref` 与
# `last_access_time`；`match_prefix` 在部分匹配一条边时就把它分裂（`_split_node`），`evict(num_tokens)` 用 `heapq` 按
# `eviction_strategy` 的优先级出堆，默认 LRU（`--radix-eviction-policy`，可选 `lfu`）。
#
# 哈希链与基数树其实是同一个东西的两种索引：一条哈希链就是树上从根出发的一条路径，按块展开；哈希表里的全部条目就是树的全部节点。区别在于：
#
# | | vLLM APC（V1） | SGLang RadixAttention（v0.5.3） | minibatch |
# |---|---|---|---|
# | 索引 | 每个写满的块一个哈希 → 块（字典） | 基数树，边上是 Token | 哈希字典，加一棵块粒度的基数树（两者同步） |
# | 命中粒度 | 整块（默认 16 Token） | 默认逐 Token（`page_size=1`），或整页 | 整块 |
# | 查找 | 逐块算哈希、查字典 | 从根沿边比较 Token | 接纳时查哈希（`get_computed_blocks`），`lpm` 排序时走树（`cached_prefix_len`） |
# | 驱逐 | 空闲队列 LRU，链尾先于链头 | 叶子按 LRU（或 LFU），正在用的节点不动 | 空闲队列 LRU；树上删掉该块及其下方的块 |
# | 调度能问的 | 命中多长 | 命中多长，子树下有多少等待请求 | 命中多长（`lpm`） |
#
# ## 14.2 minibatch 的基数树
#
# `minibatch/radix.py` 的树是块粒度的：边的 `key` 是整数块的 Token，`blocks` 是存这些 Token 的 KV 块号。引擎每注册一个写满的块，
# 就用 `add(parent_block, tokens, block_id)` 把它挂到树上（父块在边的中间时先分裂），所以树与哈希索引始终一致
# （`KVCacheManager.check_invariants` 会检查）。下面是 `add` 与 `_split`：

# %%
print(inspect.getsource(RadixTree.add))
print(inspect.getsource(RadixTree._split))

# %% [markdown]
# 在模拟器里跑几组请求，再把引擎里的树画出来：系统提示词 A 后面接三个不同的问题，
# 系统提示词 B 开始一段两轮对话——第二轮的提示词是第一轮的提示词、第一轮的回答，再加一个新问题：

# %%
BS = 16                              # tokens per KV block
eng = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g", block_size=BS,
                                         enable_prefix_caching=True), clock="virtual")
sys_a, sys_b = list(range(1000, 1000 + 3 * BS)), list(range(2000, 2000 + 2 * BS))   # whole blocks


def serve(prompts, max_tokens=4):
    """Add the prompts, run the engine until they finish, return their requests."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{len(eng.requests)}")
           for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
    return [eng.requests[i] for i in ids]


(q1,) = serve([sys_a + list(range(3000, 3020))])
q2, q3 = serve([sys_a + list(range(3100, 3120)), sys_a + list(range(3200, 3220))])
(turn1,) = serve([sys_b + list(range(4000, 4024))], max_tokens=8)
(turn2,) = serve([turn1.all_token_ids + list(range(4100, 4120))], max_tokens=8)
eng.kv.check_invariants()
hits = {r.request_id: r.num_cached_tokens for r in (q1, q2, q3, turn1, turn2)}
print("prompt tokens served from the cache:", hits)
print(f"{len(eng.kv.radix)} blocks in the tree, {len(eng.kv.pool.cached)} in the hash index")
turn1_computed = turn1.num_tokens - 1        # the last sampled token is never fed back

# %% tags=["check"]
assert hits == {"r0": 0, "r1": len(sys_a), "r2": len(sys_a), "r3": 0, "r4": turn1_computed // BS * BS}, \
    "the prose below quotes these hits"

# %%
probe = sys_a + list(range(3100, 3120)) + [9, 9, 9, 9]
matched = eng.kv.radix.match_prefix(probe)
fig = radix_tree(eng.kv.radix, figsize=(8, 3.2), highlight=lambda node: any(b in matched for b in node.blocks),
                 title="minibatch's radix tree (KV block ids per edge); green: the path that a new request "
                       "'system prompt A + question 2 + ...' matches")
display(fig)
print(f"new request of {len(probe)} tokens: {len(matched)} cached blocks = {len(matched) * BS} tokens, blocks {matched}")

# %% [markdown]
# 块大小 {{BS}}；系统提示词 A 有 {{len(sys_a)}} 个 Token（{{len(sys_a) // BS}} 块），B 有 {{len(sys_b)}} 个（{{len(sys_b) // BS}} 块）。
# 第一个问题之后，系统提示词 A 的 {{len(sys_a) // BS}} 个块成了一条边；后两个问题各命中 {{hits["r1"]}} 个 Token，树在 A 的末尾分叉。
# 两轮对话的第二轮命中了第一轮的 {{hits["r4"]}} 个 Token：第一轮共有 {{turn1.num_tokens}} 个 Token，但它最后生成的那个 Token 从没被
# 送回模型计算过，KV 里只有 {{turn1_computed}} 个，所以只有 {{turn1_computed // BS}} 个写满的块进了缓存。第二轮自己的块接在后面，
# 树上那条边直接**延长**——没有分叉时不新建节点，这就是路径压缩。绿色是一个新请求从根往下走能匹配到的路径：{{len(matched)}} 个块。
#
# ## 14.3 SGLang 的缓存感知调度：LPM 与 DFS-weight
#
# SGLang 每次组建预填充批之前，先对等待队列排序（`python/sglang/srt/managers/schedule_policy.py` 的 `SchedulePolicy.calc_priority`，
# 下面读的是 v0.5.3）。`--schedule-policy` 可选 `lpm`、`dfs-weight`（缓存感知）与 `fcfs`、`lof`、`random`、`priority`（与缓存无关）：
#
# - **LPM**（`_sort_by_longest_prefix`）：对每个等待请求在基数树上做一次 `match_prefix`，按命中长度从长到短排序。
#   另有一个“批内前缀”细节：命中不超过 32 Token（`IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`）、却与队列里别的请求共享至少 32 Token
#   （`IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`）的请求被暂时排到最后，让同一组里只有一个先去把共享前缀算出来。
# - **DFS-weight**（`_sort_by_dfs_weight`）：一个节点的权重是“匹配终点落在它子树里的等待请求数”；从根做深度优先遍历，
#   先走权重大的孩子，按遍历顺序把请求排出来——共享同一子树的请求挨在一起，缓存一次、连续用完。
#   论文 §3 给出了离线情形下的最优性（定理 3.1）：对一批请求，按基数树的深度优先顺序处理，在缓存不小于最长请求时命中率最优；
#   最长共享前缀优先的顺序等价于深度优先顺序。
# - **退回 FCFS**：`_determine_active_policy` 中，策略为 LPM 且 `len(waiting_queue) > 128` 时改用 FCFS，注释说队列大时前缀匹配与排序太贵。
#   这条规则来自 PR #1896（2024 年 11 月，“Do not use longest prefix matching when #queue-req is large”），v0.3.6、v0.4.3、v0.5.3 的源码里都是 128；
#   只有 LPM 会退回，DFS-weight 不会。关闭基数树（`--disable-radix-cache`）时两种缓存感知策略都变成 FCFS（`_validate_and_adjust_policy`）。
# - **默认值**：`python/sglang/srt/server_args.py` 里 `schedule_policy` 在 v0.3.6 与 v0.4.3 默认是 `"lpm"`，在 v0.4.6 与 v0.5.3 默认是 `"fcfs"`。
#
# minibatch 的 `lpm` 策略实现的是 LPM 加上老化，也在等待队列超过 `max_queue`（默认 {{LPM_DEFAULTS['max_queue']}}）时退回 FCFS：

# %%
print(inspect.getsource(LPMPolicy))

# %% [markdown]
# 它给每个等待请求打分：
#
# $$
# \text{score}(r) = \text{cached\_prefix\_tokens}(r) + a \cdot (t_\text{now} - t_\text{arrival}(r)),
# $$
#
# 分高的先走，运行中的请求始终排在最前。$a$ 是 `aging_tokens_per_s`（默认 {{LPM_DEFAULTS['aging_tokens_per_s']:g}}）：等待每多一秒，相当于多命中 $a$ 个 Token。
# 于是同时到达的两个请求，一个命中 $p$ 个 Token、一个完全冷，冷的那个最多再等 $p / a$ 秒就会排到前面；$a = 0$ 就是纯 LPM，
# $a \to \infty$ 退化为 FCFS。饥饿因此有了上界：**一个冷请求最多被同时到达的热请求超越 $p_\max / a$ 秒**（$p_\max$ 是可能的最长命中）。
#
# ## 14.4 饥饿：缓存冷请求的 TTFT
#
# 构造一个负载：大部分请求是“热”的——以几段系统提示词之一开头（Zipf 分布），后面是各自的问题；其余是“冷”的——
# 与谁都不共享的长提示词（比如一次性上传的文档）。到达是突发的（Gamma 分布）：

# %%
MAX_SEQS, N_MIX, RATE_MIX, BURST, COLD_SHARE = 8, 320, 2.2, 0.25, 0.15
N_PREFIX, PREFIX_LEN, COLD_LEN = 8, 1024, 1100        # hot system prompts and their tokens; a cold prompt's median
STEADY = (0.1, 0.9)                                    # arrival quantiles of the steady-state window
SIM = dict(executor="sim", model="llama-2-7b", hardware="a10", enable_prefix_caching=True, max_num_seqs=MAX_SEQS)


def mixed(seed, n=N_MIX, rate=RATE_MIX, burstiness=BURST, cold_share=COLD_SHARE):
    n_cold = int(n * cold_share)
    hot = shared_prefix(n - n_cold, rate * (1 - cold_share), num_prefixes=N_PREFIX, prefix_len=PREFIX_LEN,
                        suffix_len=lognormal(median=96, sigma=0.5, max=512), output_len=lognormal(median=64, sigma=0.6, max=256),
                        popularity=1.0, burstiness=burstiness, seed=seed, name="hot")
    cold = synthetic(n_cold, rate * cold_share, burstiness=burstiness, input_len=lognormal(median=COLD_LEN, sigma=0.2, max=2048),
                     output_len=lognormal(median=64, sigma=0.6, max=256), seed=seed + 100, name="cold")
    return hot.merge(cold)


def measure(result, lo=STEADY[0], hi=STEADY[1]):
    """Steady state (arrivals between the lo and hi quantiles): TTFT per class, hit rate, output tok/s in the window."""
    t0, t1 = np.quantile([q.arrival_time for q in result.requests], [lo, hi])
    mid = [q for q in result.requests if t0 <= q.arrival_time <= t1 and q.completed]
    cold = [q.ttft for q in mid if q.request_id.startswith("cold")]
    hot = [q.ttft for q in mid if q.request_id.startswith("hot")]
    made = sum(int(np.count_nonzero((np.asarray(q.token_times) >= t0) & (np.asarray(q.token_times) < t1)))
               for q in result.requests)
    return dict(cold_p99=float(np.percentile(cold, 99)), cold_p50=float(np.percentile(cold, 50)),
                hot_p99=float(np.percentile(hot, 99)), hot_p50=float(np.percentile(hot, 50)), n_cold=len(cold),
                hit=sum(q.num_cached_tokens for q in mid) / sum(q.prompt_len for q in mid), tok_s=made / (t1 - t0),
                max_waiting=max(st.num_waiting for st in result.steps))


def run_policy(workload, policy):
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual")
    engine.scheduler.policy = policy
    return run(workload, engine=engine)


SEEDS = [1, 2]
AGING = [0.0, 30.0, 100.0, 300.0, 1000.0]

# %% [markdown]
# {{1 - COLD_SHARE:.0%}} 的请求是热的，以 {{N_PREFIX}} 段 {{PREFIX_LEN}} Token 的系统提示词之一开头；{{COLD_SHARE:.0%}} 是冷的，
# 提示词约 {{COLD_LEN}} Token。到达的 Gamma 分布取 `burstiness={{BURST}}`（名义上间隔的变异系数为 {{1 / BURST ** 0.5:g}}）、
# 速率 {{RATE_MIX:g}} req/s，一共 {{N_MIX}} 个请求（实际抽到的样本见下面的输出）；模拟的 Llama-2-7B 跑在 A10 上，KV 池用满这张卡，
# `max_num_seqs={{MAX_SEQS}}`。突发时队列会变长，排序才有意义。比较 FCFS（`continuous`）、纯 LPM（$a = 0$）与几个老化参数，
# 每个配置 {{len(SEEDS)}} 个负载种子，只统计到达时刻在 {{STEADY[0]:.0%}}–{{STEADY[1]:.0%}} 分位之间的请求：

# %%
workloads = {seed: mixed(seed) for seed in SEEDS}
a10_blocks = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual").kv.num_blocks
runs = {}
for seed, wl in workloads.items():
    runs["fcfs", seed] = run_policy(wl, "continuous")
    for a in AGING:
        runs[a, seed] = run_policy(wl, LPMPolicy(aging_tokens_per_s=a))
res = {key: measure(r) for key, r in runs.items()}


def avg(cfg, key):
    return float(np.mean([res[cfg, s][key] for s in SEEDS]))


ws = workloads[1].stats()
print(f"{len(workloads[1])} requests ({sum(r.request_id.startswith('cold') for r in workloads[1])} cold), "
      f"{ws['rate']:.2f} req/s, inter-arrival CV {ws['cv']:.2f}; KV pool {a10_blocks} blocks; "
      f"most requests waiting at once: {max(res[c, s]['max_waiting'] for c in ['fcfs'] + AGING for s in SEEDS)}")
md_table(["policy", "cold TTFT p50 (s)", "cold TTFT p99 (s)", "hot TTFT p50 (s)", "hot TTFT p99 (s)", "hit rate", "output tok/s"],
         [[name, f"{avg(c, 'cold_p50'):.2f}", f"{avg(c, 'cold_p99'):.2f}", f"{avg(c, 'hot_p50'):.2f}", f"{avg(c, 'hot_p99'):.2f}",
           f"{avg(c, 'hit'):.1%}", f"{avg(c, 'tok_s'):.0f}"]
          for name, c in [("fcfs", "fcfs"), ("lpm, a = 0 (pure LPM)", 0.0), ("lpm, a = 100 (default)", 100.0),
                          ("lpm, a = 300", 300.0)]])

# %% tags=["check"]
assert max(res[c, s]["max_waiting"] for c in ["fcfs"] + AGING for s in SEEDS) <= LPM_DEFAULTS["max_queue"], \
    "no run falls back to FCFS"
assert avg(0.0, "cold_p99") > 2 * avg("fcfs", "cold_p99"), "the prose says pure LPM starves cold requests"
assert avg(0.0, "hit") > avg("fcfs", "hit") and avg(0.0, "hot_p50") < avg("fcfs", "hot_p50")

# %% [markdown]
# 这份负载实际到达 {{ws['rate']:.2f}} req/s、间隔变异系数 {{ws['cv']:.2f}}：突发让有限样本的速率高于名义值。纯 LPM 的好处是真实的：命中率从 {{avg("fcfs", "hit"):.1%}} 升到 {{avg(0.0, "hit"):.1%}}，热请求的 TTFT 中位数从
# {{avg("fcfs", "hot_p50"):.2f}} s 降到 {{avg(0.0, "hot_p50"):.2f}} s（它们本来就便宜，先做便宜的活，平均等待就短）。
# 代价落在冷请求身上：它们的 TTFT p99 从 FCFS 的 {{avg("fcfs", "cold_p99"):.1f}} s 涨到 {{avg(0.0, "cold_p99"):.1f}} s，
# 是原来的 {{avg(0.0, "cold_p99") / avg("fcfs", "cold_p99"):.1f}} 倍——突发期间每来一个热请求都插到它前面。
# 热请求的 p99 也变差了（{{avg(0.0, "hot_p99"):.1f}} s 对 {{avg("fcfs", "hot_p99"):.1f}} s），一个可能的原因是：系统提示词被驱逐了的热请求，
# 在 LPM 眼里也是冷的。这些 TTFT 是每个请求的值的分位数，不是均值；队列最长时也没有超过 {{LPM_DEFAULTS['max_queue']}}，所以没有触发退回 FCFS。
# 下面把两种策略下冷请求 TTFT 的分布画出来（两个种子合在一起）：

# %%
runs_cdf = {name: [] for name in ("fcfs", "lpm a=0", "lpm a=300")}
for seed in SEEDS:
    for name, cfg in (("fcfs", "fcfs"), ("lpm a=0", 0.0), ("lpm a=300", 300.0)):
        r = runs[cfg, seed]
        t0, t1 = np.quantile([q.arrival_time for q in r.requests], STEADY)
        runs_cdf[name] += [q.ttft for q in r.requests if q.request_id.startswith("cold") and t0 <= q.arrival_time <= t1]
fig, ax = plt.subplots(figsize=(7, 3))
for (name, v), col in zip(runs_cdf.items(), ("0.3", "C3", "C0")):
    v = np.sort(v)
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=col, label=name)
ax.set(xlabel="TTFT of cache-cold requests (s)", ylabel="fraction of cold requests", xscale="log",
       title=f"Cache-cold requests under FCFS, pure LPM and LPM with aging (steady state, {len(SEEDS)} seeds)")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 14.5 老化：扫描 $a$
#
# 老化参数 $a$ 的含义是“一秒的等待值多少个命中 Token”。热请求最多命中 {{PREFIX_LEN}} 个 Token（系统提示词恰好是
# {{PREFIX_LEN // EngineConfig().block_size}} 个整块），所以 $a = {{AGING[2]:g}}$ 时冷请求最多被同时到达的热请求超越约
# {{PREFIX_LEN / AGING[2]:.0f}} s，$a = {{AGING[-1]:g}}$ 时约 {{PREFIX_LEN / AGING[-1]:.0f}} s。扫一遍 $a$，看冷请求 TTFT p99、热请求 TTFT p50 与命中率怎样在 FCFS 与纯 LPM 之间移动：

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
xa = [1.0] + AGING[1:]                                      # a = 0 drawn at x = 1 on the log axis
ax1.plot(xa, [avg(a, "cold_p99") for a in AGING], "o-", color="C3", label="cold TTFT p99")
ax1.plot(xa, [avg(a, "hot_p50") for a in AGING], "s-", color="C0", label="hot TTFT p50")
ax1.axhline(avg("fcfs", "cold_p99"), color="C3", ls=":", lw=1, label="fcfs: cold p99")
ax1.axhline(avg("fcfs", "hot_p50"), color="C0", ls=":", lw=1, label="fcfs: hot p50")
ax2.plot(xa, [avg(a, "hit") * 100 for a in AGING], "o-", color="C2", label="hit rate (%)")
ax2.axhline(avg("fcfs", "hit") * 100, color="C2", ls=":", lw=1, label="fcfs")
for ax in (ax1, ax2):
    ax.set_xscale("log")
    ax.set_xticks(xa, ["0"] + [f"{a:g}" for a in AGING[1:]])
    ax.set_xlabel("aging_tokens_per_s (a)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
ax1.set_ylabel("TTFT (s)")
ax2.set_ylabel("% of prompt tokens")
fig.suptitle(f"LPM with aging between pure LPM (a = 0) and FCFS (a -> inf), mean of {len(SEEDS)} seeds", fontsize=10)
fig.tight_layout()
plt.show()
SLACK = 1.25                         # how much worse than FCFS the cold tail may get
best = min(AGING, key=lambda a: (avg(a, "cold_p99") > SLACK * avg("fcfs", "cold_p99"), avg(a, "hot_p50")))
assert avg(best, "cold_p99") <= SLACK * avg("fcfs", "cold_p99") and avg(best, "hot_p50") < avg("fcfs", "hot_p50"), \
    "the prose says one aging value keeps cold p99 near FCFS and hot p50 below it"
print(" | ".join(f"a={a:g}: cold p99 {avg(a, 'cold_p99'):.1f} s, hot p50 {avg(a, 'hot_p50'):.2f} s, hit {avg(a, 'hit'):.1%}"
                 for a in AGING))

# %% [markdown]
# $a$ 越大，冷请求的尾部越接近 FCFS，热请求的中位数与命中率也越接近 FCFS。在这个负载上，$a = {{best:g}}$ 是一个折中：
# 冷请求 TTFT p99 为 {{avg(best, "cold_p99"):.1f}} s（FCFS 为 {{avg("fcfs", "cold_p99"):.1f}} s，不超过它的 {{SLACK:g}} 倍），
# 热请求 TTFT 中位数为 {{avg(best, "hot_p50"):.2f}} s（FCFS 为 {{avg("fcfs", "hot_p50"):.2f}} s）。最合适的 $a$ 取决于命中长度的分布与突发的长短：
# 它把“最长等待”定在 $p_\max / a$ 附近，应当与你的 TTFT SLO 对齐。SGLang 自己没有老化项（v0.5.3 的 `_sort_by_longest_prefix`
# 只按命中长度排序）；它靠的是“队列超过 128 就退回 FCFS”，而那是为排序的开销设的，并不限制饥饿。
#
# ## 14.6 动手：老化参数与到达率
#
# 下面的函数在 14.4 节的负载上运行 `lpm`，画出热、冷两类请求的 TTFT 分布：

# %% tags=["nbval-ignore-output"]
AGING_CHOICES = [0.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0]


def explore(aging=LPM_DEFAULTS["aging_tokens_per_s"], rate=RATE_MIX):
    wl = mixed(SEEDS[0], rate=rate)
    r_lpm, r_fcfs = run_policy(wl, LPMPolicy(aging_tokens_per_s=aging)), run_policy(wl, "continuous")
    fig, ax = plt.subplots(figsize=(7, 3))
    for r, ls, tag in ((r_lpm, "-", f"lpm a={aging:g}"), (r_fcfs, ":", "fcfs")):
        for cls, col in (("hot", "C0"), ("cold", "C3")):
            v = np.sort([q.ttft for q in r.requests if q.completed and q.request_id.startswith(cls)])
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", ls=ls, color=col, label=f"{tag}: {cls}")
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title=f"{rate:g} req/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    plt.show()
    m_lpm, m_fcfs = measure(r_lpm), measure(r_fcfs)
    print(f"lpm a={aging:g}: cold p99 {m_lpm['cold_p99']:.1f} s, hot p50 {m_lpm['hot_p50']:.2f} s, hit {m_lpm['hit']:.1%} | "
          f"fcfs: cold p99 {m_fcfs['cold_p99']:.1f} s, hot p50 {m_fcfs['hot_p50']:.2f} s, hit {m_fcfs['hit']:.1%}; "
          f"longest queue {m_lpm['max_waiting']} (above {LPM_DEFAULTS['max_queue']} lpm falls back to FCFS)")

# %% [markdown]
# 控件用种子 {{SEEDS[0]}} 的负载。调大到达率会让突发更严重、队列更长；把 $a$ 从 {{AGING_CHOICES[0]:g}} 调到 {{AGING_CHOICES[-1]:g}}，
# 看冷请求的尾部怎样回到 FCFS（虚线）附近。

# %% tags=["nbval-ignore-output"]
W.interact(explore,
           aging=W.SelectionSlider(options=AGING_CHOICES, value=LPM_DEFAULTS["aging_tokens_per_s"],
                                   continuous_update=False, description="aging a"),
           rate=W.FloatSlider(value=RATE_MIX, min=1.0, max=3.0, step=0.2, continuous_update=False,
                              description="rate (req/s)"));

# %% tags=["check"]
# The exercises' settings, and the figures hint 3 quotes.
EX_RATE, EX_QUEUE, EX_PROMPT, EX_BLOCKS = 3.0, 32, 1000, [16, 64]
ex_hit = {b: EX_PROMPT // b * b for b in EX_BLOCKS}
assert EX_BLOCKS[0] == EngineConfig().block_size, "exercise 3 compares against minibatch's default block size"


# %% [markdown]
# ## 本章小结
#
# - RadixAttention 把缓存的前缀组织成基数树：匹配从根往下走，插入在分叉处分裂边，驱逐按 LRU 删除没人在用的叶子（SGLang v0.5.3 `radix_cache.py`）。
#   块哈希链是同一棵树按块展开的索引；minibatch 两种都有，并让它们保持一致。
# - 有了树，调度器能按缓存排序：LPM 按命中长度，DFS-weight 按子树里的等待请求数深度优先；离线时深度优先顺序命中率最优（SGLang 论文定理 3.1）。
#   SGLang 在等待队列超过 128 时让 LPM 退回 FCFS（PR #1896），`--schedule-policy` 的默认值在 v0.4.3 是 `lpm`、在 v0.4.6 起是 `fcfs`。
# - 纯 LPM 提高命中率、降低热请求的中位延迟，却让缓存冷的请求在突发时饥饿，冷请求的 TTFT p99 成倍增长。
# - 老化给等待时间记分：$\text{score} = \text{命中} + a \cdot \text{等待}$，冷请求被超越的时间不超过 $p_\max / a$；扫描 $a$ 可以在 LPM 与 FCFS 之间找到折中。
#
# 实验 **L08**（`labs/L08_radix_tree.ipynb`）请你实现一棵 Token 粒度的基数树（匹配、带边分裂的插入、LRU 叶子驱逐），
# 用随机化的性质测试与一个“前缀字典”对照，再设计一个缓存感知、又不让冷请求饿死的调度策略。
#
# ## 练习
#
# 1. **DFS-weight。** 为 minibatch 写一个 `dfs-weight` 策略：用 `state.kv.radix.match_prefix(req.all_token_ids)` 找到每个等待请求的匹配终点
#    （最后一个命中块所在的节点），按 14.3 节的规则计算权重并深度优先排序。在 14.4 节的负载上与 LPM 比较命中率与冷请求的 TTFT。
# 2. **退回 FCFS 的阈值。** 把 14.4 节的到达率提高到 {{EX_RATE:g}} req/s，队列最长会超过 {{LPM_DEFAULTS['max_queue']}} 吗？
#    `LPMPolicy(max_queue={{EX_QUEUE}})` 与默认值相比，冷请求的 TTFT p99 怎样变化？
# 3. **按块还是按 Token。** SGLang 默认逐 Token 匹配，minibatch 按块（{{EX_BLOCKS[0]}} Token）。如果系统提示词长 {{EX_PROMPT}} Token，
#    按块能命中多少？块大小为 {{EX_BLOCKS[1]}} 呢？
#    什么样的负载里逐 Token 匹配的优势最大？
# 4. **老化的单位。** minibatch 的老化按秒计，SGLang 社区提出的方案（issue #31954）按“调度轮次”计。两种单位在负载变化时各有什么问题？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 对每个等待请求取 `matched = radix.match_prefix(...)`，终点节点是 `radix._where[matched[-1]]`（没有命中时是根）；
#    自底向上累加每个节点的请求数，然后从根开始，按权重从大到小访问孩子，把落在每个节点上的请求按访问顺序输出（SGLang 是后序：先孩子、后本节点）。
#    运行中的请求仍排在最前。
# 2. 队列越长，LPM 越可能因为超过阈值而临时退回 FCFS；阈值调小，LPM 起作用的时间变少，冷请求的尾部更接近 FCFS，命中率的收益也随之变小。
#    用 `measure(...)["max_waiting"]` 看队列有多长。
# 3. 按块只能命中 $\lfloor {{EX_PROMPT}}/{{EX_BLOCKS[0]}} \rfloor \cdot {{EX_BLOCKS[0]}} = {{ex_hit[EX_BLOCKS[0]]}}$ 个 Token
#    （块大小 {{EX_BLOCKS[1]}} 时 {{ex_hit[EX_BLOCKS[1]]}}）；逐 Token 匹配在前缀很短、或前缀长度远不是块大小倍数、
#    且共享段之后紧跟差异的负载（例如大量短提示词共享开头几个词）里优势最大。
# 4. 按秒计时，负载高、每步慢时，同样的等待秒数对应更少的调度机会，老化的“力度”取决于系统快慢；按轮次计时，空闲时轮次多而等待短，
#    会过快地把冷请求提到前面。两者都需要按负载重新调参，所以最好把 $a$ 与 TTFT SLO 联系起来设定。
#
# </details>
