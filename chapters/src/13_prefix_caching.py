# %% [markdown]
# # 第 13 章 前缀缓存（Prefix Caching）
#
# 生产中的请求常常以同样的内容开头：同一段系统提示词（System Prompt）、同一组 few-shot 示例、RAG 应用里同一份说明与工具描述、
# 多轮对话里上一轮的全部历史。它们的 KV 完全相同，每个请求却都要从头预填充一遍。**前缀缓存**（Prefix Caching）
# 把算好的 KV 块留下来，后来的请求只要开头相同，就直接复用这些块，只计算自己独有的部分。
#
# 第 7 章已经看到了前缀缓存的骨架：写满的块按哈希链登记、用引用计数共享。本章把它讲完整：哈希链为什么能代表“整个前缀”、
# 块被释放之后怎样继续留在缓存里、池满时按什么顺序驱逐（Eviction），以及它在 RAG 负载与真实轨迹（Mooncake）上能省下多少。
#
# ## 学习目标
#
# - 写出块哈希链 $h_i = H(h_{i-1}, \text{tokens}_i)$，说清它与 vLLM 自动前缀缓存（Automatic Prefix Caching, APC）的 `hash_block_tokens` 的对应；
# - 理解引用计数与空闲队列的关系：引用计数为 0 的块仍可被命中，空闲队列的顺序就是 LRU 驱逐顺序，链的尾块先于头块被驱逐；
# - 解释为什么提示词的最后一个 Token 总要重新计算，以及这为什么会让整块重算；
# - 在模拟器里测量命中率（Hit Rate）与 TTFT、吞吐的关系，以及池大小与命中率的关系（LRU 驱逐）；
# - 在随课程分发的 Mooncake 合成轨迹上做一次完整的实验：先检查哪些请求放不下并统计被拒绝的原因，再比较开关前缀缓存；
# - 在真实的 tiny 模型上验证：开不开前缀缓存，贪心输出逐 Token 相同。

# %%
import collections
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.kv_cache import BlockPool, KVCacheManager, hash_block
from minibatch.request import Request
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import load_shipped_trace, load_workload, lognormal, shared_prefix

print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 13.1 哈希链、引用计数与空闲队列
#
# 设块大小为 $B$。请求的第 $i$ 个**写满的**块（Token $iB \ldots iB+B-1$）的哈希定义为
#
# $$
# h_0 = H(\varnothing, t_{0:B}), \qquad h_i = H(h_{i-1},\ t_{iB:(i+1)B}) .
# $$
#
# 因为 $h_i$ 把前一块的哈希也算了进去，$h_i$ 相等就意味着（除哈希碰撞外）**从序列开头到第 $i$ 块为止的全部 Token 相同**——
# 一个哈希值代表一整段前缀，查缓存只需一次字典查找。vLLM V1 的实现是 `vllm/v1/core/kv_cache_utils.py` 里的
# `hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)`：哈希 `(父块哈希, 本块 Token 元组, 额外键)`，
# 额外键区分 LoRA、多模态输入与 `cache_salt`，第一块的“父哈希”是一个随机种子 `NONE_HASH`（设置了 `PYTHONHASHSEED` 时由它导出）。
# 设计见 vLLM v0.8.0 的文档 `docs/source/design/v1/prefix_caching.md`（“Automatic Prefix Caching”）；源码读的是 2026 年的主分支。
# minibatch 的 `hash_block` 只有前两项：

# %%
print(inspect.getsource(hash_block))
print(inspect.getsource(KVCacheManager.get_computed_blocks))

# %% [markdown]
# `get_computed_blocks` 从第一块开始逐块查，遇到第一个查不到的块就停——哈希链保证了命中的一定是一段**连续的前缀**。
# 注意它最多查 $\lfloor (n-1)/B \rfloor$ 块（$n$ 是请求的 Token 数）：**至少要留一个 Token 给这一步计算**，因为产生下一个 Token 的 logits
# 的正是这一步的前向计算；缓存里只有 K/V，没有 logits。vLLM V1 的 `vllm/v1/core/kv_cache_manager.py`（`get_computed_blocks`）也是如此：
# `max_cache_hit_length = request.num_tokens - 1`，注释说明全部命中时必须重算最后一个 Token 以得到 logits，
# 而且因为已计算的 Token 数要按块对齐，这会让**整块**重算而不只是一个 Token。
#
# 用一个很小的池子把这些规则走一遍：请求 A；请求 B 与 A 开头相同、后面不同；请求 C 恰好是 A 的开头：

# %%
def computed(kv, req, n=None):
    """Allocate and 'compute' the first n tokens of req (what the engine does), caching full blocks."""
    hit, cached = kv.get_computed_blocks(req)
    req.num_computed_tokens = cached
    n = req.num_tokens if n is None else n
    assert kv.allocate_slots(req, n - cached, hit)
    req.num_computed_tokens = n
    kv.cache_full_blocks(req)
    return cached


def short(h):
    return f"{h & 0xFFFF:04x}"


NB, BS, A_LEN, SHARED = 10, 4, 10, 8        # pool blocks, tokens per block; A's prompt; tokens B and C share with A
kv = KVCacheManager(NB, BS, enable_prefix_caching=True)
params = SamplingParams(max_tokens=4)
A = Request("A", list(range(100, 100 + A_LEN)), params, 0.0)
B = Request("B", list(range(100, 100 + SHARED)) + [7, 7, 7], params, 0.0)
C = Request("C", list(range(100, 100 + SHARED)), params, 0.0)
hits = {r.request_id: computed(kv, r) for r in (A, B, C)}
for r in (A, B, C):
    table = kv.block_table(r.request_id)
    print(f"{r.request_id}: {r.num_prompt_tokens:>2} tokens, {hits[r.request_id]} from the cache, block table {table}, "
          f"hashes {[short(h) for h in kv.req_hashes[r.request_id]]}, ref_cnt {[kv.pool.blocks[b].ref_cnt for b in table]}")
a_table = kv.block_table("A")

# %% tags=["check"]
assert SHARED % BS == 0 and hits == {"A": 0, "B": SHARED, "C": SHARED - BS}, \
    "the prose says B hits both shared blocks and C only the first of its two"

# %% [markdown]
# 池里 {{NB}} 个块、每块 {{BS}} Token；A 的提示词 {{A_LEN}} 个 Token，B 与 A 的前 {{SHARED}} 个 Token 相同，C 恰好是 A 的前 {{SHARED}} 个 Token。
# B 的前 {{SHARED // BS}} 块与 A 的哈希相同，直接复用了 A 的块 {{a_table[0]}}、{{a_table[1]}}；C 又复用了块 {{a_table[0]}}，于是块 {{a_table[0]}} 的引用计数是
# {{kv.pool.blocks[a_table[0]].ref_cnt}}、块 {{a_table[1]}} 是 {{kv.pool.blocks[a_table[1]].ref_cnt}}。C 的 {{SHARED}} 个 Token 恰好是
# {{SHARED // BS}} 块，都在缓存里，却只命中了 {{hits["C"] // BS}} 块：最后一块要留给这一步重新计算，C 为它分配了一个新块。
# 画出来看（每个方框是一个块，上面是物理块号与哈希的末 4 位，下面是引用计数；箭头从父块指向子块）：

# %%
def draw_chains(kv, requests, ax, title):
    y = {r.request_id: len(requests) - 1 - k for k, r in enumerate(requests)}
    colors = {"A": "#4e79a7", "B": "#f28e2b", "C": "#59a14f"}
    for r in requests:
        table, hashes = kv.block_table(r.request_id), kv.req_hashes.get(r.request_id, [])
        for i, b in enumerate(table):
            shared = kv.pool.blocks[b].ref_cnt > 1
            ax.add_patch(Rectangle((i * 1.6, y[r.request_id]), 1.3, 0.7, facecolor="#d9f0d3" if shared else "white",
                                   edgecolor=colors[r.request_id], lw=2))
            label = f"#{b}" + (f"\nh={short(hashes[i])}" if i < len(hashes) else "\n(not full)")
            ax.text(i * 1.6 + 0.65, y[r.request_id] + 0.45, label, ha="center", va="center", fontsize=7)
            ax.text(i * 1.6 + 0.65, y[r.request_id] + 0.1, f"ref {kv.pool.blocks[b].ref_cnt}", ha="center", fontsize=6)
            if i:
                ax.add_patch(FancyArrowPatch(((i - 1) * 1.6 + 1.3, y[r.request_id] + 0.35), (i * 1.6, y[r.request_id] + 0.35),
                                             arrowstyle="->", mutation_scale=8))
        ax.text(-0.3, y[r.request_id] + 0.35, r.request_id, ha="right", va="center", fontsize=10, color=colors[r.request_id])
    ax.set(xlim=(-1, 5), ylim=(-0.3, len(requests)), title=title)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(6, 2.6))
draw_chains(kv, [A, B, C], ax, "Block tables after A, B, C (green: shared, ref_cnt > 1)")
plt.show()

# %% [markdown]
# 请求结束时，它的块引用计数减一；降到 0 的块回到**空闲队列**（Free Queue），但块里的 KV 和它的哈希都还在——
# 它仍然可以被后来的请求命中。只有当空闲队列把这个块**交出去**给别的请求写入时，它的缓存内容才被驱逐。
# 所以空闲队列的顺序就是驱逐顺序：队首最先被交出。minibatch 的 `BlockPool` 用一个 `OrderedDict` 做这个队列，
# 从队首分配（`allocate`）、归还到队尾（`release`）；请求释放时**从尾块开始**归还（`KVCacheManager.free`），于是同一条链上，
# 尾块排在头块前面、先被驱逐——头块是更多请求共有的前缀，应该活得更久。vLLM V1 的 `FreeKVCacheBlockQueue`
# （`vllm/v1/core/kv_cache_utils.py`，由 `vllm/v1/core/block_pool.py` 的 `BlockPool` 使用）是一个双向链表，
# 文档字符串写明同样的顺序：最久未用的块在队首（LRU）；同一时刻释放的块里，哈希链更长的（链尾）在前。

# %%
print(inspect.getsource(BlockPool.release))
print(inspect.getsource(KVCacheManager.free))
a_hashes = list(kv.req_hashes["A"])               # A's two full blocks: h0 (block 0), h1 (block 1)
for r in (A, B, C):
    kv.free(r)
free_before = list(kv.pool.free_queue)
print("free queue after A, B, C finish (front first):", free_before)
print("still cached (block -> hash):", {b: short(kv.pool.blocks[b].block_hash) for b in free_before if kv.pool.blocks[b].block_hash})
D = Request("D", list(range(500, 500 + (NB - 2) * BS)), params, 0.0)   # unrelated tokens: all but two blocks
evicted_before = kv.pool.num_evictions
computed(kv, D)
a_left = [short(h) for h in a_hashes if h in kv.pool.cached]
print(f"D takes {kv.block_table('D')}; evictions {kv.pool.num_evictions - evicted_before}; "
      f"A's prefix blocks still cached: {a_left} of {[short(h) for h in a_hashes]}")
assert a_hashes[0] in kv.pool.cached and a_hashes[1] not in kv.pool.cached, \
    "the prose says the chain's tail (block 1) goes before its head (block 0)"
E = Request("E", list(range(100, 100 + BS + 1)), params, 0.0)           # A's first block and one token more
e_hit = kv.get_computed_blocks(E)[1]
print(f"a new request with A's first {E.num_prompt_tokens} tokens hits", e_hit, "tokens")

# %% [markdown]
# D 与谁都不相同，它要 {{len(kv.block_table('D'))}} 个块：先拿走从未用过的块，再从队首拿走释放过的块（驱逐了 {{kv.pool.num_evictions - evicted_before}} 个缓存块）。
# A 的链是 {{a_table[0]}} → {{a_table[1]}}，块 {{a_table[1]}} 先被驱逐，块 {{a_table[0]}} 活了下来，
# 后来以 A 的前 {{E.num_prompt_tokens}} 个 Token 开头的请求仍能命中它（{{e_hit}} 个 Token）。第 7 章的实验 L04 实现过同样的空闲队列；第 14 章会看到，
# 同样的缓存内容也可以组织成一棵基数树（Radix Tree）。
#
# ## 13.2 RAG：共享系统提示词的命中率、TTFT 与吞吐
#
# 一个 RAG 应用的每个请求都以同一段系统提示词（说明、工具、格式要求，长度 $S$）开头，后面接检索到的段落与问题（各不相同），
# 再生成回答。实验的设定：

# %%
SIM = dict(executor="sim", model="llama-3-8b", hardware="a100-80g")
N_RAG, RAG_RATE, SUFFIX, ANSWER = 240, 8.0, 512, 128     # requests, req/s; median suffix and answer tokens
SYSTEM = [256, 1024, 2048, 4096]
RAG_SEEDS = [1, 2]

# %% [markdown]
# 段落与问题的长度中位数 {{SUFFIX}} Token，回答中位数 {{ANSWER}} Token。理想情况下命中率约为 $S / (S + {{SUFFIX}})$。
# 在模拟的 Llama-3-8B / A100-80G 上，{{N_RAG}} 个请求以 {{RAG_RATE:g}} req/s 到达（泊松），系统提示词
# $S$ 取 {{'、'.join(map(str, SYSTEM))}}，前缀缓存开与关，各 {{len(RAG_SEEDS)}} 个负载种子：

# %%


def steady(result, lo=0.1, hi=0.9):
    """Requests that arrived between the lo and hi quantiles of arrivals (warm-up and drain dropped); tokens made
    in that window."""
    t0, t1 = np.quantile([q.arrival_time for q in result.requests], [lo, hi])
    mid = [q for q in result.requests if t0 <= q.arrival_time <= t1 and q.completed]
    made = sum(int(np.count_nonzero((np.asarray(q.token_times) >= t0) & (np.asarray(q.token_times) < t1)))
               for q in result.requests)
    ttft = [q.ttft for q in mid]
    return dict(n=len(mid), hit=sum(q.num_cached_tokens for q in mid) / sum(q.prompt_len for q in mid),
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                tok_s=made / (t1 - t0))


rag = {}
for S in SYSTEM:
    for seed in RAG_SEEDS:
        wl = shared_prefix(N_RAG, RAG_RATE, num_prefixes=1, prefix_len=S,
                           suffix_len=lognormal(median=SUFFIX, sigma=0.5, max=2048),
                           output_len=lognormal(median=ANSWER, sigma=0.6, max=512), seed=seed)
        for on in (False, True):
            rag[S, seed, on] = steady(run(wl, **SIM, enable_prefix_caching=on))


def m(S, on, key):
    v = [rag[S, s, on][key] for s in RAG_SEEDS]
    return float(np.mean(v)), float(np.std(v))


md_table(["system prompt S", "prefix caching", "hit rate", "TTFT p50 (s)", "TTFT p99 (s)", "output tok/s"],
         [[S, "on" if on else "off", f"{m(S, on, 'hit')[0]:.1%}",
           f"{m(S, on, 'ttft_p50')[0]:.3f} ± {m(S, on, 'ttft_p50')[1]:.3f}",
           f"{m(S, on, 'ttft_p99')[0]:.2f} ± {m(S, on, 'ttft_p99')[1]:.2f}",
           f"{m(S, on, 'tok_s')[0]:.0f} ± {m(S, on, 'tok_s')[1]:.0f}"] for S in SYSTEM for on in (False, True)])

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
for on, mk, col in ((False, "s--", "C3"), (True, "o-", "C0")):
    ax1.plot(SYSTEM, [m(S, on, "ttft_p99")[0] for S in SYSTEM], mk, color=col, label=f"caching {'on' if on else 'off'}")
    ax2.plot(SYSTEM, [m(S, on, "tok_s")[0] for S in SYSTEM], mk, color=col, label=f"caching {'on' if on else 'off'}")
for S in SYSTEM:
    ax1.annotate(f"hit {m(S, True, 'hit')[0]:.0%}", (S, m(S, True, "ttft_p99")[0]), textcoords="offset points",
                 xytext=(0, 6), fontsize=7, ha="center", color="C0")
ax1.set(xscale="log", yscale="log", xlabel="shared system prompt S (tokens)", ylabel="TTFT p99 (s)")
ax2.set(xscale="log", xlabel="shared system prompt S (tokens)", ylabel="steady output tok/s")
for ax in (ax1, ax2):
    ax.set_xticks(SYSTEM, [str(S) for S in SYSTEM])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
fig.suptitle(f"RAG with a shared system prompt, llama-3-8b on A100-80G, {RAG_RATE:g} req/s (mean of {len(RAG_SEEDS)} seeds)",
             fontsize=10)
fig.tight_layout()
plt.show()
offered = wl.stats()["rate"] * float(np.mean(wl.output_lens))
first_short = next(S for S in SYSTEM if m(S, False, "tok_s")[0] < 0.9 * m(S, True, "tok_s")[0])
S_MAX = SYSTEM[-1]

# %% tags=["check"]
assert all(m(S, True, "ttft_p99")[0] < m(S, False, "ttft_p99")[0] for S in SYSTEM), "caching lowers TTFT p99 at every S"
assert m(S_MAX, False, "tok_s")[0] < 0.5 * m(S_MAX, True, "tok_s")[0], "the prose says without caching S=4096 is overloaded"

# %% [markdown]
# 前缀缓存在每个 $S$ 上都降低了 TTFT。$S$ 越长差别越大：不开缓存时每个请求要预填充 $S + {{SUFFIX}}$ 个 Token（中位数），从 $S = {{first_short}}$ 起
# 稳态吞吐就明显低于开缓存时（这张卡的预填充算力不够了），队列越排越长——$S = {{S_MAX}}$ 时 TTFT p99 达到 {{m(S_MAX, False, "ttft_p99")[0]:.0f}} s，
# 稳态吞吐只剩 {{m(S_MAX, False, "tok_s")[0]:.0f}} tok/s；开启缓存后命中率 {{m(S_MAX, True, "hit")[0]:.0%}}，每个请求只算自己的几百个 Token，
# TTFT p99 为 {{m(S_MAX, True, "ttft_p99")[0]:.2f}} s，吞吐 {{m(S_MAX, True, "tok_s")[0]:.0f}} tok/s，接近到达的负载（约 {{offered:.0f}} tok/s）。
# 换句话说，在同一个到达率下，缓存把一张过载的卡变回了不过载：它提高的是**服务容量**（第 8 章的 Capacity）。
#
# ## 13.3 池的大小与命中率：LRU 驱逐
#
# 缓存活在 KV 池的空闲部分里：运行中的请求占得越多、池越小，缓存的块越早被驱逐。用课程的 `shared_prefix` 负载
# （几段系统提示词按 Zipf 分布复用）在模拟的 Llama-2-7B / A10 上扫一遍池的大小：

# %%
N_SP, BS16 = 300, EngineConfig().block_size
sp = load_workload("shared_prefix", n=N_SP)
prefix_tokens = {r.prefix_id: r.prefix_len for r in sp}
ideal_sp = sum(r.prefix_len for r in sp) / sum(r.prompt_len for r in sp)
largest = int(max(-(-(r.prompt_len + r.max_tokens) // BS16) for r in sp))
POOLS = [300, 600, 1200, 2400]
pool_runs = {}
for pool in POOLS:
    assert largest <= pool, "every request fits the pool on its own"
    eng = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a10",
                                             enable_prefix_caching=True, num_kv_blocks=pool), clock="virtual")
    res = run(sp, engine=eng)
    pool_runs[pool] = dict(steady(res), evictions=eng.kv.pool.num_evictions, preemptions=res.summary()["num_preemptions"])
a10_pool = make_cost_model("llama-2-7b", "a10").kv_capacity_tokens() // BS16
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(POOLS, [pool_runs[p]["hit"] * 100 for p in POOLS], "o-", label="hit rate (steady state)")
ax.axhline(ideal_sp * 100, color="k", ls=":", lw=1, label=f"all shared prefixes hit ({ideal_sp:.0%})")
ax.set(xscale="log", xlabel=f"KV pool (blocks of {BS16} tokens)", ylabel="% of prompt tokens", ylim=(0, 100),
       title=f"shared_prefix on llama-2-7b / A10 (the full pool would be {a10_pool} blocks)")
ax.set_xticks(POOLS, [str(p) for p in POOLS])
ax2 = ax.twinx()
ax2.plot(POOLS, [pool_runs[p]["ttft_p99"] for p in POOLS], "s--", color="C3", label="TTFT p99")
ax2.set(ylabel="TTFT p99 (s)", yscale="log")
ax.legend(loc="lower right", fontsize=7)
ax2.legend(loc="center right", fontsize=7)
ax.grid(alpha=0.3)
plt.show()
md_table(["pool (blocks)", "hit rate", "evictions", "preemptions", "TTFT p99 (s)", "output tok/s"],
         [[p, f"{pool_runs[p]['hit']:.1%}", f"{pool_runs[p]['evictions']:,}", pool_runs[p]["preemptions"],
           f"{pool_runs[p]['ttft_p99']:.2f}", f"{pool_runs[p]['tok_s']:.0f}"] for p in POOLS])
hits_by_pool = [pool_runs[p]["hit"] for p in POOLS]
assert all(a < b for a, b in zip(hits_by_pool, hits_by_pool[1:])), "the prose says the hit rate rises with the pool"

# %% [markdown]
# 这 {{N_SP}} 个请求以约 {{sp.stats()['rate']:.0f}} req/s 到达，复用 {{len(prefix_tokens)}} 段
# {{min(prefix_tokens.values())}}–{{max(prefix_tokens.values())}} Token 的系统提示词。
# {{len(prefix_tokens)}} 段系统提示词一共只有 {{sum(prefix_tokens.values()):,}} 个 Token（{{-(-sum(prefix_tokens.values()) // BS16)}} 块），
# 可 {{POOLS[0]}} 块的池里它们仍然留不住：运行中的请求占满了池，空闲队列很短，一个系统提示词的块刚被释放就被交给下一个请求，
# 命中率只有 {{pool_runs[POOLS[0]]["hit"]:.0%}}；池越大，空闲块在队列里停留得越久，命中率升到 {{pool_runs[POOLS[-1]]["hit"]:.0%}}，
# 接近“所有共享前缀都命中”的上限 {{ideal_sp:.0%}}。小池的 TTFT 同时被两件事拖垮：命中少、要算的多，池小、批也小——
# 这两个效应在这里无法分开，练习 2 请你用固定的批大小把它们拆开。
#
# ## 13.4 Mooncake 轨迹：先检查能否放下
#
# Mooncake（Qin et al., *Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving*, FAST'25）公开了一份合成轨迹
# （`datasets/traces/mooncake_synthetic_trace.jsonl`，来源与许可证见 `datasets/traces/SOURCES.md`）：每个请求有到达时间、输入与输出长度，
# 以及 `hash_ids`——提示词每 512 个 Token 一块，**同一位置的 `hash_ids` 相同就表示这 512 个 Token 相同**。
# `load_shipped_trace("mooncake")` 按 `hash_ids` 生成 Token，让共享在 Token 层面也成立。先看它的规模：

# %%
moon = load_shipped_trace("mooncake", materialize=False)
ms = moon.stats()
T0, T1 = 900, 1023             # the window replayed in this chapter (trace seconds)
max_len, MOON_BS = 32768, 64   # the replay's max_model_len (as Qwen2.5-7B-Instruct's config) and block size


def ideal_hit(workload, max_prompt=None):
    """Hit rate of an infinite cache that has seen every earlier request of ``workload`` (512-token hash blocks)."""
    seen, hit, total = set(), 0, 0
    for r in workload:
        if max_prompt is not None and r.prompt_len >= max_prompt:
            continue
        for j, h in enumerate(r.hash_ids or []):
            if h in seen:
                hit += min(512, r.prompt_len - 512 * j)
        total += r.prompt_len
        seen.update(r.hash_ids or [])
    return hit / total


print(f"{ms['n']:,} requests over {ms['duration']:.0f} s ({ms['rate']:.2f} req/s); input mean {ms['input_mean']:,.0f}, "
      f"p50 {ms['input_p50']:,.0f}, max {ms['input_max']:,.0f} tokens; output mean {ms['output_mean']:.0f}")
print(f"hit rate of an infinite cache over the whole trace: {ideal_hit(moon):.1%}")

# %% [markdown]
# 提示词平均 {{ms["input_mean"]:,.0f}} Token，最长 {{ms["input_max"]:,.0f}}——**先检查放不放得下**。minibatch 在 `add_request` 时拒绝两类请求：
# 提示词不短于模型的 `max_model_len`（至少要能再生成一个 Token），以及即使独占整个 KV 池也放不下的请求；被拒绝的请求记为
# `rejected` 并带上原因，不会悄悄消失。选一个上下文够长的模型：Qwen2.5-7B（GQA {{make_cost_model('qwen2.5-7b', 'h100').model.num_kv_heads}} 个 KV 头；
# 基座模型的 `config.json` 写 131072 个位置，这里像 Qwen2.5-7B-Instruct 的配置那样设 `max_model_len={{max_len}}`）放在一张模拟的 H100 上。
# 整份轨迹的时长与请求量超出本章的时间预算，下面只重放第 {{T0}} 秒之后的最后一段（时间从 0 重新计起；轨迹到这时复用已经很多），
# 块大小取 {{MOON_BS}} 以减少模拟时的哈希次数：

# %%
MOON = dict(executor="sim", model="qwen2.5-7b", hardware="h100", block_size=MOON_BS, max_model_len=max_len)
qcm = make_cost_model("qwen2.5-7b", "h100")
window = moon.time_window(T0, T1)
too_long = int((window.prompt_lens >= max_len).sum())
kv_tokens = qcm.kv_capacity_tokens()
print(f"window: {len(window)} requests; KV pool {kv_tokens:,} tokens; "
      f"prompts >= max_model_len {max_len}: {too_long}; larger than the pool: "
      f"{int((np.minimum(window.prompt_lens + window.output_lens, max_len) > kv_tokens).sum())}")
wm = window.materialize(32000, seed=0)
moon_runs = {False: run(wm, **MOON)}
moon_engine = LLMEngine(EngineConfig.from_kwargs(**MOON, enable_prefix_caching=True), clock="virtual")
moon_runs[True] = run(wm, engine=moon_engine)
moon_evictions = moon_engine.kv.pool.num_evictions
reasons = collections.Counter()
for q in moon_runs[True].requests:
    if q.finish_reason == "rejected":
        reasons["prompt >= max_model_len" if "too long" in q.error else q.error.split(";")[0]] += 1
spec = {r.request_id: r for r in window}
truncated = sum(1 for q in moon_runs[True].requests if q.completed and q.output_len < spec[q.request_id].max_tokens)
print("rejected, by reason:", dict(reasons), "| cut short at max_model_len:", truncated)

# %% tags=["check"]
assert sum(reasons.values()) == too_long, "every rejection here is a prompt that is too long"
assert [q.finish_reason for q in moon_runs[True].requests] == [q.finish_reason for q in moon_runs[False].requests]

# %%
ms_on, ms_off = (steady(moon_runs[on]) for on in (True, False))
ideal_win = ideal_hit(window, max_prompt=max_len)
md_table(["Mooncake window, qwen2.5-7b / H100", "requests (steady)", "hit rate", "TTFT p50 (s)", "TTFT p99 (s)", "output tok/s"],
         [["prefix caching off", ms_off["n"], f"{ms_off['hit']:.1%}", f"{ms_off['ttft_p50']:.2f}", f"{ms_off['ttft_p99']:.2f}",
           f"{ms_off['tok_s']:.0f}"],
          ["prefix caching on", ms_on["n"], f"{ms_on['hit']:.1%}", f"{ms_on['ttft_p50']:.2f}", f"{ms_on['ttft_p99']:.2f}",
           f"{ms_on['tok_s']:.0f}"],
          ["infinite cache, this window only", "", f"{ideal_win:.1%}", "", "", ""]])
fig, ax = plt.subplots(figsize=(7, 2.8))
for on, col in ((False, "C3"), (True, "C0")):
    recs = [q for q in moon_runs[on].requests if q.completed]
    ax.scatter([q.arrival_time for q in recs], [q.ttft for q in recs], s=4, color=col, label=f"caching {'on' if on else 'off'}")
ax.set(yscale="log", xlabel=f"arrival time in the window (s; trace time - {T0})", ylabel="TTFT (s)",
       title=f"Mooncake trace from {T0} s on: TTFT per request")
ax.legend(fontsize=7, markerscale=3)
ax.grid(alpha=0.3)
plt.show()

# %% tags=["check"]
assert ms_on["ttft_p50"] < ms_off["ttft_p50"] / 5 and ms_on["hit"] <= ideal_win

# %% [markdown]
# 窗口里 {{len(window)}} 个请求中有 {{too_long}} 个的提示词不短于 {{max_len}} Token，被拒绝（原因全部是提示词过长；KV 池有
# {{kv_tokens:,}} 个 Token，单个请求不会超出）；另有 {{truncated}} 个请求生成到 `max_model_len` 就停止了。其余请求上：
# 不开缓存时预填充排起了队，TTFT p50 为 {{ms_off["ttft_p50"]:.1f}} s；开启后命中率 {{ms_on["hit"]:.1%}}，
# TTFT p50 降到 {{ms_on["ttft_p50"]:.2f}} s（是不开缓存时的 {{ms_on["ttft_p50"] / ms_off["ttft_p50"]:.1%}}）。只看窗口内历史的“无限缓存”命中率是 {{ideal_win:.1%}}，引擎比它低，可能的原因有三：
# 池是有限的（本次运行驱逐了 {{moon_evictions:,}} 个缓存块）；只有写满的块才能命中，且最后一块总要重算；前缀还没算完时到达的请求命中不了它。
# 整份轨迹上无限缓存的命中率是 {{ideal_hit(moon):.1%}}：Mooncake 的复用跨度很长，它的设计正是把 KV 缓存放进由集群的 CPU 内存与 SSD
# 组成的分布式 KV 池（Qin et al., FAST'25）。
#
# ## 13.5 在真实的 tiny 模型上：缓存不改变输出
#
# 前缀缓存复用的是同样的 Token 在同样位置上的 K/V，贪心解码的结果不应有任何变化。用嵌入的 tiny 模型跑一个小的共享前缀负载：

# %%
TINY_N, TINY_LEN, TINY_VOCAB = 8, 256, 4096     # requests; longest request; tokens drawn below the tiny vocabulary

# %% [markdown]
# {{TINY_N}} 个请求同时到达，按 tiny 的词表（取前 {{TINY_VOCAB}} 个 Token）重新生成 Token、长度缩到 {{TINY_LEN}} 以内，
# 开关前缀缓存各跑一次：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
tiny_wl = load_workload("shared_prefix", n=TINY_N, max_len=TINY_LEN, vocab_size=TINY_VOCAB, rate=float("inf"))
tiny_runs = {on: run(tiny_wl, model="tiny", enable_prefix_caching=on, max_num_seqs=4, num_kv_blocks=256)
             for on in (False, True)}
same = [q.output_token_ids for q in tiny_runs[True].requests] == [q.output_token_ids for q in tiny_runs[False].requests]
print(f"prefix cache hit rate: off {tiny_runs[False].summary()['prefix_cache_hit_rate']:.1%}, "
      f"on {tiny_runs[True].summary()['prefix_cache_hit_rate']:.1%}")
print("greedy outputs identical with and without prefix caching:", same)
assert same and tiny_runs[True].summary()["prefix_cache_hit_rate"] > 0

# %% [markdown]
# ## 13.6 动手：池大小与系统提示词的数量
#
# 下面的函数在模拟的 Llama-2-7B / A10 上运行一个共享前缀负载，系统提示词按 Zipf 复用：

# %% tags=["nbval-ignore-output"]
EX_N, EX_RATE, EX_PREFIX = 300, 4.0, 512        # requests, req/s, system prompt tokens


def explore(prompts=8, pool=1200):
    wl = shared_prefix(EX_N, EX_RATE, num_prefixes=prompts, prefix_len=EX_PREFIX,
                       suffix_len=lognormal(median=128, sigma=0.8, max=1024),
                       output_len=lognormal(median=128, sigma=0.8, max=1024), popularity=1.0, seed=5)
    eng = LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a10",
                                             enable_prefix_caching=True, num_kv_blocks=pool), clock="virtual")
    s = steady(run(wl, engine=eng))
    print(f"{prompts} system prompts, {pool}-block pool: hit rate {s['hit']:.1%} (all shared prefixes: "
          f"{sum(r.prefix_len for r in wl) / sum(r.prompt_len for r in wl):.1%}), {eng.kv.pool.num_evictions:,} evictions, "
          f"TTFT p50/p99 {s['ttft_p50']:.2f}/{s['ttft_p99']:.2f} s, {s['tok_s']:.0f} tok/s")

# %% [markdown]
# 每次 {{EX_N}} 个请求、{{EX_RATE:g}} req/s，系统提示词 {{EX_PREFIX}} Token。拖动 `prompts`（不同的系统提示词有几段）与
# `pool`（KV 块数），看命中率、驱逐次数与 TTFT 怎样变化：提示词种类越多、池越小，缓存越留不住。

# %% tags=["nbval-ignore-output"]
W.interact(explore, prompts=W.IntSlider(value=8, min=1, max=64, continuous_update=False, description="prompts"),
           pool=W.IntSlider(value=1200, min=300, max=4800, step=100, continuous_update=False, description="pool (blocks)"));

# %% tags=["check"]
# The exercises' settings, and what hint 3 claims.
EX_S, EX_S2, EX_BLOCKS, EX_SEQS = 1024, 1000, [16, 64, 256], 16
assert all(EX_S % b == 0 for b in EX_BLOCKS) and EX_S2 % EX_BLOCKS[-1], "hint 1: S divides, S2 does not"
EX3_LEN, EX3_BS = 32, 16
kv3 = KVCacheManager(4, EX3_BS, enable_prefix_caching=True)
computed(kv3, Request("first", list(range(EX3_LEN)), params, 0.0))
ex3_hit = kv3.get_computed_blocks(Request("again", list(range(EX3_LEN)), params, 0.0))[1]
assert ex3_hit == (EX3_LEN - 1) // EX3_BS * EX3_BS, "hint 3: the last block is recomputed"

# %% [markdown]
# ## 本章小结
#
# - 写满的块按哈希链登记：$h_i = H(h_{i-1}, \text{tokens}_i)$，一个哈希代表整段前缀，查找是逐块的字典查询，命中的一定是连续前缀；
#   vLLM V1 的 `hash_block_tokens` 再加上 LoRA、多模态与 `cache_salt` 等额外键。
# - 提示词的最后一个 Token 总要重新计算（要它的 logits），按块对齐时这会让最后一整块重算。
# - 引用计数为 0 的块仍留在缓存里，直到空闲队列把它交出；空闲队列就是 LRU 驱逐顺序，请求从尾块开始释放，链尾先于链头被驱逐。
# - 在 RAG 负载上，命中率越高，TTFT 越低、容量越大；没有缓存时长系统提示词会让同一张卡过载。
# - 池越小，缓存越早被驱逐，命中率越低；运行中的请求与缓存争用同一个池。
# - 真实轨迹要先检查能否放下：Mooncake 的长提示词中有一部分超出 {{max_len // 1024}}k 上下文，被拒绝并记下原因；
#   其余请求上前缀缓存把 TTFT p50 降到不开缓存时的 {{ms_on["ttft_p50"] / ms_off["ttft_p50"]:.1%}}。
#
# 下一章（第 14 章）把同样的缓存组织成基数树，并让调度器利用它：SGLang 的 RadixAttention 与缓存感知调度。
#
# ## 练习
#
# 1. **块大小与命中粒度。** 在 13.2 节 $S = {{EX_S}}$ 的负载上把 `block_size` 设为 {{'、'.join(map(str, EX_BLOCKS))}}，命中率怎样变化？为什么块越大，
#    命中的越少？（提示：只有整块相同才命中，而系统提示词的长度不是 {{EX_BLOCKS[-1]}} 的倍数时最后一块不完整。）
# 2. **把两个效应分开。** 13.3 节小池的 TTFT 差既因为命中少，也因为批小。固定 `max_num_seqs={{EX_SEQS}}`，重做池大小扫描，
#    再与关闭前缀缓存的同样扫描比较，哪个效应更大？
# 3. **最后一个 Token。** 构造一个提示词恰好为 {{EX3_LEN}} 个 Token（块大小 {{EX3_BS}}）、且 {{EX3_LEN // EX3_BS}} 块都已缓存的请求，调用 `kv.get_computed_blocks`，
#    命中几个 Token？如果允许命中 {{EX3_LEN - 1}} 个 Token（只重算 1 个），要改引擎的哪些地方？
# 4. **Mooncake 全量。** 用 `moon.time_window(0, {{T1}})` 重放整份轨迹（在这台机器上要几分钟），命中率与窗口内的有何不同？
#    与“无限缓存”的 {{ideal_hit(moon):.1%}} 相比差在哪里？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 命中的 Token 数是 $\lfloor S / B \rfloor \cdot B$（在前缀内），$B$ 越大，被截掉的尾巴越长；$S = {{EX_S}}$ 恰好是
#    {{'、'.join(map(str, EX_BLOCKS))}} 的倍数，所以差别主要来自提示词末尾：每个请求最后那个不满的块不会被缓存。换一个 $S = {{EX_S2}}$ 再试，
#    块越大损失越明显（{{EX_BLOCKS[-1]}} Token 的块会截掉 {{EX_S2 % EX_BLOCKS[-1]}} 个 Token）。
# 2. `run(wl, engine=eng)` 之前把 `EngineConfig.from_kwargs(..., max_num_seqs={{EX_SEQS}})` 传给引擎；关闭缓存的扫描里命中率为 0，
#    TTFT 随池变化的部分只来自批大小，两者之差就是缓存的贡献。
# 3. 命中 {{ex3_hit}} 个 Token：`max_blocks = ({{EX3_LEN}} - 1) // {{EX3_BS}} = {{(EX3_LEN - 1) // EX3_BS}}`。要命中 {{EX3_LEN - 1}} 个，需要允许 `num_computed_tokens` 不按块对齐，
#    并让第二块在被“部分重算”时不破坏共享——写时复制（第 7 章）或者只重算最后一个 Token 的 Q、不写 K/V。vLLM 的注释把这列为将来的优化。
# 4. 窗口之外的历史让更多前缀命中；与无限缓存的差距来自池的容量（LRU 驱逐）与以块为单位的命中。
#
# </details>
