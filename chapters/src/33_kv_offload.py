# %% [markdown]
# # 第 33 章 KV 卸载分层：扩展前缀缓存（KV Offload）
#
# 第 13 章在 Mooncake 轨迹上看到：前缀缓存（Prefix Caching）只能留住显存池里放得下的块。池满时空闲队列把最久没用的块交给新请求，
# 它的前缀就此作废，后来的请求只好重算。而 Mooncake 的复用跨度很长——一段前缀可能几百秒后才再次出现，远远超出一张卡的 KV 池。
# 2025–2026 年，主流引擎都在显存池下面加了一层**主机内存**：vLLM 的 `OffloadingConnector`（`--kv-offloading-size`）、
# SGLang 的分层缓存（Hierarchical Cache, HiCache，`--enable-hierarchical-cache`）。被驱逐的前缀块不再丢掉，而是留在更大、更便宜的主机内存里，
# 再次命中时经 PCIe 拷回显存，代价是拷贝时间而不是重算时间。
#
# 本章在 minibatch 里实现这一层（`minibatch/kv_offload.py`），用同一套调度器与 KV 管理器在模拟器与真实 tiny 模型上测量它：
# 主机层存什么、什么时候存，Mooncake 轨迹上命中率与 TTFT 变了多少，以及什么时候拷回反而不如重算。
#
# ## 学习目标
#
# - 区分显存里的 KV 池与主机层（Host Tier），以及主机层与第 12、24 章的换出（Swap）：前者为了**复用前缀**，后者为了**暂停运行中的请求**；
# - 说清两种写入策略：写穿（Write-Through，块一算完就拷到主机）与写回（Write-Back，块被驱逐时才拷），以及主机层的 LRU 与“钉住”（Pin）；
# - 用 LRU 栈距离（Stack Distance）从轨迹的 `hash_ids` 直接算出任意容量的命中率，并用它解释引擎测得的命中率；
# - 在 Mooncake 轨迹上测量开关主机层的命中率与 TTFT（稳态，分几个轨迹窗口统计）；
# - 比较“拷回”与“重算”的代价：为什么短前缀在快 GPU 上重算更便宜；
# - 读懂 vLLM 0.34.0 与 SGLang 0.5.19 的对应选项与默认值，并在真实 tiny 模型上验证主机层命中不改变贪心输出。

# %%
import inspect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import EngineConfig, LLMEngine, SamplingParams
from minibatch.kv_cache import KVCacheManager
from minibatch.kv_offload import HostKVTier
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.sim.offload import HOST_LINK_BYTES_PER_S, load_time, lru_hit_rate, recompute_time, stack_distances
from minibatch.viz import md_table
from minibatch.workload import load_shipped_trace

print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 33.1 两层缓存：显存池与主机层
#
# 主机层是一个按**块哈希**索引的有界池。哈希沿用第 13 章的哈希链 $h_i = H(h_{i-1}, \text{tokens}_i)$，所以主机里的一个条目代表一整段前缀，
# 与显存里的缓存块一一对应。一个请求查前缀时：
#
# 1. 先在显存里沿哈希链逐块查（第 13 章的 `get_computed_blocks`），直到第一个未命中的块；
# 2. 再从这一块起在主机层里接着查，直到主机也未命中；主机命中的块**钉住**（Pin），保证在拷回之前不会被主机的 LRU 挤掉；
# 3. 接纳这个请求时，为主机命中的部分分配新的显存块，把数据拷回（Load），重新登记进显存缓存；这些 Token 与显存命中一样算作命中，
#    不必重算。
#
# 拷回之后主机仍保留副本（两层是“包含”关系），同一块以后再被显存驱逐时就不必再拷一次。主机满了按 LRU 丢条目，
# 同一条链上**先动链尾再动链头**，于是链头（更多请求共享的前缀）更晚被丢——与第 13 章空闲队列的顺序一致。
# 拷回发生在调度时，由 `KVCacheManager._load_host_hits` 完成：

# %%
print(inspect.getsource(KVCacheManager._load_host_hits))

# %%
POOL, BLOCK, PROMPT, OUT, HOST = 10, 16, 80, 4, 16     # a toy pool and toy requests (33.1, 33.2)
HOST_SIZES = (4, 8, 16)


def serve_one(engine, prompt, max_tokens=OUT):
    """Add one greedy request and step the engine until it finishes; return the request."""
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.requests[rid]


def small_engine(**kw):
    return LLMEngine(EngineConfig.from_kwargs(executor="sim", model="llama-3.1-8b", hardware="h100", block_size=BLOCK,
                                              num_kv_blocks=POOL, enable_prefix_caching=True, **kw), clock="virtual")


rng = np.random.default_rng(0)
A, B, C = (rng.integers(3, 30000, PROMPT).tolist() for _ in range(3))

# %% [markdown]
# 用一个只有 {{POOL}} 块（每块 {{BLOCK}} Token）的显存池走一遍：A、B、C 三个请求各有 {{PROMPT}} 个 Token 的提示词，彼此不同，各生成 {{OUT}} 个 Token；
# 然后 D 重复 A 的提示词。模拟的 Llama-3.1-8B / H100 上，先不开主机层、再开一个 {{HOST}} 块的写回（Write-Back）主机层：

# %%
walk = {}
for name, kw in (("no host tier", {}), ("host tier, write_back", dict(kv_offload_blocks=HOST, kv_offload_policy="write_back"))):
    eng = small_engine(**kw)
    reqs = [serve_one(eng, p) for p in (A, B, C, A)]
    walk[name] = dict(cached=[r.num_cached_tokens for r in reqs], evictions=eng.kv.pool.num_evictions,
                      host=eng.kv.host, host_hits=eng.kv.prefix_host_hits)
    print(f"{name}: cached tokens of A, B, C, D = {walk[name]['cached']}, device evictions {eng.kv.pool.num_evictions}")
host = walk["host tier, write_back"]["host"]
print(f"host tier: stored {host.num_stored} blocks (at eviction), loaded {host.num_loaded} back, holds {len(host)}")

# %% tags=["check"]
assert walk["no host tier"]["cached"] == [0, 0, 0, 0], "the prose says D recomputes everything without the tier"
assert walk["host tier, write_back"]["cached"] == [0, 0, 0, 64]
assert walk["host tier, write_back"]["host_hits"] == 64 and host.num_loaded == 4

# %% [markdown]
# 每个请求 {{PROMPT}} + {{OUT}} 个 Token 要 {{-(-(PROMPT + OUT) // BLOCK)}} 块，{{POOL}} 块的池放不下 A 与 B、C 的全部：B、C 到来时 A 的块被驱逐（共 {{walk["no host tier"]["evictions"]}} 次驱逐），
# 没有主机层时 D 只能从头算。有了主机层，A 的块在被驱逐的那一刻被拷到主机，D 查前缀时显存全部未命中、主机命中
# {{walk["host tier, write_back"]["cached"][3] // BLOCK}} 块（{{walk["host tier, write_back"]["cached"][3]}} 个 Token；
# 最后一块要留给这一步重算，与第 13 章相同），它们被拷回 {{host.num_loaded}} 个新的显存块。
# 计数器分开记：`kv.prefix_hits` 是两层命中的总和（与第 13 章的命中率同一个定义），`kv.prefix_host_hits` 是其中来自主机层的部分，
# 都在请求**第一次**被接纳时计一次。
#
# 这与换出（Swap，第 12、24 章的 `preemption_mode="swap"`）是两回事：换出搬走的是**运行中**请求私有的 KV，
# 为的是让它恢复时从中断处继续，数据只属于它自己；主机层保存的是**已算好的前缀**，为的是让别的请求复用。
# 两者各有自己的主机内存池（`swap_space_blocks` 与 `kv_offload_blocks`），可以同时开启。
#
# ## 33.2 什么时候写到主机：写穿与写回
#
# 块在什么时刻被拷到主机，有两种做法，SGLang 用 `--hicache-write-policy` 选择（`python/sglang/srt/server_args.py`，0.5.19）：
#
# - **写穿**（Write-Through，SGLang 的默认值 `write_through`）：块一写满、登记进显存缓存，就同时拷到主机。被显存驱逐时主机已经有了，
#   什么也不用做。拷贝量最大（每个块都拷），但拷贝可以与计算重叠、不在关键路径上。SGLang 还有 `write_through_selective`：
#   `hiradix_cache.py` 里 `write_through_threshold` 在 `write_through` 时为 1、否则为 2，即一个节点被命中两次才拷（`write_back` 下不按命中拷）；
# - **写回**（Write-Back）：块只在被显存驱逐时才拷。只拷那些本来要丢掉的块，但拷贝正好发生在“有请求急着要这个块”的时刻。
#   `hiradix_cache.py` 的 `_evict_write_back` 注释写着这条路径“将来会被弃用”。
#
# vLLM 0.34.0 的 `OffloadingConnector` 也是写穿：调度器侧每一步为新算完的块生成存储任务
# （`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py` 的 `_build_store_jobs`），由工作进程异步拷贝。
# minibatch 两种都实现了（`kv_offload_policy`，默认 `write_through`）。在模拟器里，写回的拷贝与拷回都按
# 块数 × 每块字节数 ÷ 带宽（`kv_offload_bandwidth`，默认 {{HOST_LINK_BYTES_PER_S / 1e9:.0f}} GB/s，PCIe Gen4 x16 的实际值）算进这一步的时长；写穿的拷贝视为与计算重叠，
# 只计字节不计时间。真实模型上所有拷贝都是实测的 `index_select`/`index_copy_`，时间全部计入。
#
# 写穿让主机成为显存内容的**副本**，所以主机层至少要比显存池大才有用；写回的主机只接收显存丢掉的块，两层加起来才是缓存的容量。
# 把 33.1 节的例子再跑一遍，这次 A、B、C 之后 A 的提示词来两次（D、E），主机层大小取 {{", ".join(map(str, HOST_SIZES))}} 块：

# %%
policy_rows, policy_runs = [], {}
for blocks in HOST_SIZES:
    for policy in ("write_through", "write_back"):
        eng = small_engine(kv_offload_blocks=blocks, kv_offload_policy=policy)
        reqs = [serve_one(eng, p) for p in (A, B, C, A, A)]
        h = eng.kv.host
        policy_runs[blocks, policy] = dict(stored=h.num_stored, loaded=h.num_loaded, host_hits=eng.kv.prefix_host_hits)
        policy_rows.append([blocks, policy, h.num_stored, h.num_loaded, eng.kv.prefix_host_hits,
                            f"{h.store_seconds * 1e3:.2f}", f"{h.load_seconds * 1e3:.2f}"])
md_table(["host blocks", "policy", "blocks stored", "blocks loaded", "host-hit tokens", "store ms (critical path)",
          "load ms"], policy_rows)

# %% tags=["check"]
assert policy_runs[HOST_SIZES[0], "write_through"]["host_hits"] == 0 < policy_runs[HOST_SIZES[0], "write_back"]["host_hits"], \
    "the prose says a write-through host smaller than a request's chain holds nothing useful"
assert all(policy_runs[b, "write_through"]["stored"] > policy_runs[b, "write_back"]["stored"] for b in HOST_SIZES)
assert policy_runs[HOST, "write_through"]["host_hits"] == policy_runs[HOST, "write_back"]["host_hits"] == 4 * BLOCK

# %% [markdown]
# 主机层 {{HOST_SIZES[-1]}} 块时，写穿每块都拷（{{policy_runs[HOST_SIZES[-1], "write_through"]["stored"]}} 块），写回只拷被驱逐的
# （{{policy_runs[HOST_SIZES[-1], "write_back"]["stored"]}} 块）；可写穿的拷贝不在关键路径上（表中为 0），写回的在。主机只有 {{HOST_SIZES[0]}} 块时，
# 写穿的主机里永远是最近算完的那几块——正是显存里也还有的，主机命中为 {{policy_runs[HOST_SIZES[0], "write_through"]["host_hits"]}}；
# 写回的主机里则是刚被驱逐的块，仍能命中 {{policy_runs[HOST_SIZES[0], "write_back"]["host_hits"]}} 个 Token。这就是 SGLang 把 `--hicache-ratio`（主机池 / 显存池）默认设为 2 的原因
# （0.5.19 的 `python/sglang/srt/arg_groups/hicache_hook.py`：未给出时在 `cache` 模式下取 2.0）：写穿的主机必须比显存大，多出来的部分才是新增的容量。
#
# ## 33.3 Mooncake 轨迹：需要多大的缓存
#
# 在跑引擎之前，先从轨迹本身回答“多大的缓存能命中多少”。一个 LRU 缓存的命中与否只取决于**栈距离**（Stack Distance）：
# 两次引用同一块之间，引用过多少个**别的**块。容量为 $C$ 块的 LRU 缓存恰好命中栈距离小于 $C$ 的那些引用（Mattson et al., 1970），
# 所以把每次引用的栈距离算一遍，就得到任意容量的命中率。Mooncake 轨迹的 `hash_ids` 正是 512 Token 一块的块标识，
# `minibatch.sim.offload.stack_distances` 用一棵树状数组（Fenwick Tree）一遍算完全部引用：

# %%
moon = load_shipped_trace("mooncake", materialize=False)
MAX_LEN = 32768                                  # as chapter 13: longer prompts are rejected
dist = stack_distances(moon, max_prompt=MAX_LEN)
cm = make_cost_model("llama-3.1-8b", "h100")
SIM = dict(executor="sim", model="llama-3.1-8b", hardware="h100", block_size=64, max_model_len=MAX_LEN,
           enable_prefix_caching=True)
DEVICE_TOKENS = cm.kv_capacity_tokens() // SIM["block_size"] * SIM["block_size"]     # the engine's default pool
caps = np.geomspace(1e5, 3e7, 40)
T_START, WARM, WINDOW = 660, 40, 100
WINDOWS = [(T_START + WARM + i * WINDOW, T_START + WARM + (i + 1) * WINDOW) for i in range(3)]
SLOW, HOST_RATIO = 2.0, 2                          # replay speed (2: half speed); host tier / device pool
PROMPT_RATE = moon.prompt_lens.sum() / moon.stats()["duration"]
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(caps, [lru_hit_rate(dist, c) for c in caps], color="k", label="whole trace")
for (t0, t1), col in zip(WINDOWS, ("C0", "C1", "C2")):
    ax.plot(caps, [lru_hit_rate(dist, c, t0, t1) for c in caps], color=col, label=f"requests arriving in [{t0}, {t1}) s")
for mult, ls, y in ((1, "--", 0.93), (2, ":", 0.85), (3, "-.", 0.77)):
    ax.axvline(mult * DEVICE_TOKENS, color="gray", ls=ls, lw=1)
    ax.text(mult * DEVICE_TOKENS * 1.05, y, f"{mult}x pool", fontsize=7, color="gray")
ax.set(xscale="log", xlabel="LRU cache capacity (tokens)", ylabel="prompt-token hit rate", ylim=(0, 1),
       title="Mooncake trace: hit rate of an LRU cache of every size (stack distances)")
ax.legend(fontsize=7, loc="center left")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# 轨迹里共有 {{len(dist[0]):,}} 次块引用。横轴是缓存容量（Token，对数坐标），竖线是一张 H100 上 Llama-3.1-8B 的 KV 池
# （{{DEVICE_TOKENS:,}} 个 Token，引擎默认的显存利用率）的 1、2、3 倍。
# 整份轨迹上，池大小的 LRU 缓存只命中 {{lru_hit_rate(dist, DEVICE_TOKENS):.1%}}，3 倍也只有 {{lru_hit_rate(dist, 3 * DEVICE_TOKENS):.1%}}，
# 曲线要到千万 Token 量级才走平：这份轨迹的工作集远大于一张卡。复用在轨迹后段才多起来（越晚到达的请求，前面可复用的历史越长），
# 所以下面重放轨迹第 {{T_START}} 秒之后的部分，前 {{WARM}} 秒只用来把两层缓存填满（预热，不计入），之后取 3 个 {{WINDOW}} 秒的窗口分别统计，
# 第 {{WINDOWS[-1][1]}} 秒之后到达的请求照常运行但不计入（排空）。
#
# 配置：模拟的 Llama-3.1-8B 放在一张 H100 上，块大小 {{SIM["block_size"]}}、`max_model_len={{MAX_LEN}}`（与第 13 章相同，更长的提示词被拒绝），显存池取默认大小；
# 主机层取显存池的 {{HOST_RATIO}} 倍（SGLang 的默认比例），写穿与写回各跑一次。一张 H100 跟不上这份轨迹原速的提示词流量
# （平均每秒 {{PROMPT_RATE:,.0f}} 个 Token），不开主机层时队列会无限增长、测不到稳态，所以按 {{SLOW:g}} 倍的时间重放
# （`scale_time({{SLOW:g}})`，请求的相对次序不变，LRU 的命中不受影响）：

# %%
segment = moon.time_window(T_START, moon[-1].arrival_time + 1).scale_time(SLOW).materialize(32000, seed=0)
pool_blocks = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual").kv.num_blocks
CONFIGS = {"off": {}, "write_through": dict(kv_offload_blocks=HOST_RATIO * pool_blocks),
           "write_back": dict(kv_offload_blocks=HOST_RATIO * pool_blocks, kv_offload_policy="write_back")}
moon_runs = {}
for name, kw in CONFIGS.items():
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM, **kw), clock="virtual")
    moon_runs[name] = (run(segment, engine=engine), engine)
print(f"{len(segment)} requests replayed 3 times; device pool {pool_blocks} blocks, host tier {HOST_RATIO * pool_blocks} blocks")
for name in ("write_through", "write_back"):
    h = moon_runs[name][1].kv.host
    print(f"{name}: {h.num_stored:,} blocks stored ({h.store_seconds:.0f} s on the critical path), "
          f"{h.num_loaded:,} loaded back ({h.load_seconds:.1f} s)")

# %%
def window_stats(name, t0, t1):
    """Hit rate (and its host part) and TTFT percentiles of completed requests arriving in trace seconds [t0, t1)."""
    result, engine = moon_runs[name]
    lo, hi = (t0 - T_START) * SLOW, (t1 - T_START) * SLOW
    recs = [q for q in result.requests if q.completed and lo <= q.arrival_time < hi]
    prompt = sum(q.prompt_len for q in recs)
    ttft = [q.ttft for q in recs]
    host = sum(engine.kv.host_hit_tokens.get(q.request_id, 0) for q in recs) if engine.kv.host else 0
    return dict(n=len(recs), hit=sum(q.num_cached_tokens for q in recs) / prompt, host=host / prompt,
                p50=float(np.percentile(ttft, 50)), p90=float(np.percentile(ttft, 90)))


ws = {(name, w): window_stats(name, *w) for name in CONFIGS for w in WINDOWS}
rows = []
for w in WINDOWS:
    for name in CONFIGS:
        s = ws[name, w]
        rows.append([f"[{w[0]}, {w[1]})", name, s["n"], f"{s['hit']:.1%}", f"{s['host']:.1%}", f"{s['p50']:.2f}",
                     f"{s['p90']:.2f}", f"{s['p50'] / ws['off', w]['p50']:.2f}", f"{s['p90'] / ws['off', w]['p90']:.2f}"])
md_table(["trace window (s)", "host tier", "requests", "hit rate", "of it from host", "TTFT p50 (s)", "TTFT p90 (s)",
          "p50 / off", "p90 / off"], rows)

# %%
def median_ratio(name, key):
    return float(np.median([ws[name, w][key] / ws["off", w][key] for w in WINDOWS]))


lru = {w: (lru_hit_rate(dist, DEVICE_TOKENS, *w), lru_hit_rate(dist, 2 * DEVICE_TOKENS, *w),
           lru_hit_rate(dist, 3 * DEVICE_TOKENS, *w)) for w in WINDOWS}
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
x = np.arange(len(WINDOWS))
for k, (name, col) in enumerate(zip(CONFIGS, ("C3", "C0", "C2"))):
    axes[0].bar(x + (k - 1) * 0.27, [ws[name, w]["hit"] for w in WINDOWS], 0.27, color=col, label=name)
    axes[1].bar(x + (k - 1) * 0.27, [ws[name, w]["p90"] for w in WINDOWS], 0.27, color=col, label=name)
for j, mult in enumerate((1, 2, 3)):
    axes[0].scatter(x + (j - 1) * 0.27, [lru[w][j] for w in WINDOWS], marker="_", s=200, color="k", zorder=3,
                    label="LRU model (1x, 2x, 3x pool)" if j == 0 else None)
for ax, label in zip(axes, ("prompt-token hit rate", "TTFT p90 (s)")):
    ax.set_xticks(x, [f"[{a}, {b})" for a, b in WINDOWS], fontsize=7)
    ax.set(ylabel=label, xlabel="trace window (s)")
    ax.grid(alpha=0.3, axis="y")
axes[0].legend(fontsize=7)
fig.suptitle(f"Mooncake, Llama-3.1-8B / H100, {SLOW:g}x slower: with and without a {HOST_RATIO}x host tier", fontsize=9)
plt.tight_layout()
plt.show()

# %% tags=["check"]
for w in WINDOWS:
    assert ws["write_through", w]["hit"] > ws["off", w]["hit"] and ws["write_back", w]["hit"] > ws["off", w]["hit"]
    assert ws["write_through", w]["n"] == ws["off", w]["n"] == ws["write_back", w]["n"]
assert median_ratio("write_through", "p50") < 1 and median_ratio("write_through", "p90") < 1
# the engine behaves like the LRU model of its capacity (within 5 points): off 1x, write-through 2x, write-back 3x
for w in WINDOWS:
    for name, j in (("off", 0), ("write_through", 1), ("write_back", 2)):
        assert abs(ws[name, w]["hit"] - lru[w][j]) < 0.05, (name, w)
assert median_ratio("write_back", "p90") > median_ratio("write_through", "p90"), "the prose says write-back gains less"

# %% [markdown]
# 三个窗口里，主机层都把命中率提高了：不开时中位数 {{np.median([ws["off", w]["hit"] for w in WINDOWS]):.1%}}，
# 写穿 {{np.median([ws["write_through", w]["hit"] for w in WINDOWS]):.1%}}，写回 {{np.median([ws["write_back", w]["hit"] for w in WINDOWS]):.1%}}。
# 短横线是 LRU 模型的预测：不开主机层的引擎命中率贴着“1 倍池”的 LRU 曲线，写穿贴着“{{HOST_RATIO}} 倍”（主机是显存的副本，容量就是主机的
# {{HOST_RATIO}} 倍池），写回贴着“{{1 + HOST_RATIO}} 倍”（两层相加），三个窗口里最多相差 {{max(abs(ws[n, w]["hit"] - lru[w][j]) for w in WINDOWS for n, j in (("off", 0), ("write_through", 1), ("write_back", 2))) * 100:.1f}} 个百分点——
# 引擎的行为与一个同容量的 LRU 缓存几乎一样，
# 33.3 节开头那条曲线足以估计加多大的主机层能换来多少命中。
#
# 写穿的命中转化成了更短的 TTFT：p50 的比值（开 / 关，三个窗口的中位数）为 {{median_ratio("write_through", "p50"):.2f}}，
# p90 为 {{median_ratio("write_through", "p90"):.2f}}；复用最多的最后一个窗口里 p50 降到原来的
# {{ws["write_through", WINDOWS[-1]]["p50"] / ws["off", WINDOWS[-1]]["p50"]:.2f}}。写回命中更多，p50 比值 {{median_ratio("write_back", "p50"):.2f}}，
# p90 却几乎没有改善（{{median_ratio("write_back", "p90"):.2f}}）：它把每个被驱逐的块都在驱逐的那一刻拷出去
# （{{moon_runs["write_back"][1].kv.host.num_stored:,}} 块，关键路径上共 {{moon_runs["write_back"][1].kv.host.store_seconds:.0f}} s），
# 一个上万 Token 的新提示词要腾出几百块，整个批都等这些拷贝。写穿拷得更多（{{moon_runs["write_through"][1].kv.host.num_stored:,}} 块），
# 但与计算重叠。这也是两个框架都默认写穿、SGLang 把写回路径标为将来弃用的原因。
#
# 改进的幅度受轨迹限制：这份轨迹的复用大多远在 {{1 + HOST_RATIO}} 倍池之外，Mooncake 的设计因此把 KV 放进整个集群的 CPU 内存与 SSD 组成的分布式池
# （Qin et al., FAST'25）。整份轨迹在 `benchmarks/kv_offload.py` 里：越往后复用越多，主机层的收益越大；
# 用 `--policy write_back` 运行，前段窗口里写回的 TTFT 比不开主机层还差。
#
# ## 33.4 拷回还是重算
#
# 主机命中并不总是划算。拷回 $p$ 个 Token 的 KV 要经过主机链路：
#
# $$ t_\text{load} = \frac{p \cdot \text{KV bytes/token}}{\text{PCIe 带宽}} , $$
#
# Llama-3.1-8B（GQA，{{cm.model.num_kv_heads}} 个 KV 头）每个 Token 的 KV 是 {{cm.kv_bytes_per_token_per_gpu // 1024}} KiB，
# {{HOST_LINK_BYTES_PER_S / 1e9:.0f}} GB/s 下每个 Token 约 {{load_time(cm, 1) * 1e6:.1f}} µs。
# 重算的代价则是**边际**预填充时间：请求本来就要算它自己独有的那部分（至少最后一个 Token），前缀只是把这一步变宽：
#
# $$ t_\text{recompute} = T_\text{step}(p + m) - T_\text{step}(m) . $$
#
# 第 2 章讲过，一步的 GEMM 在 Token 数低于硬件的脊点（Ridge Point，H100 上约 {{cm.hardware.ridge_point:.0f}} FLOP/B，bf16 下约等于一步的 Token 数）
# 时受内存带宽限制：权重反正要读一遍，多算几十个 Token 几乎不花时间。所以**短前缀在快 GPU 上重算更便宜**，长前缀则拷回便宜得多。
# 用成本模型把两条曲线画出来（请求自己还要算的 $m$ 个 Token 取 `REST`）：

# %%
REST = 64
PREFIX = np.unique(np.geomspace(16, 32768, 40).astype(int))
CASES = {"llama-3.1-8b / h100": ("llama-3.1-8b", "h100", "C0", "-"),
         "llama-3.1-8b / a100-80g": ("llama-3.1-8b", "a100-80g", "C1", "-"),
         "llama-2-7b (MHA) / h100": ("llama-2-7b", "h100", "C2", "-.")}
fig, ax = plt.subplots(figsize=(7, 3))
crossover, last_ratio = {}, {}
for label, (model, hw, col, ls) in CASES.items():
    c = make_cost_model(model, hw)
    prefixes = PREFIX[PREFIX < c.model.max_model_len - REST]
    rec = np.array([recompute_time(c, int(p), rest=REST) for p in prefixes])
    ld = np.array([load_time(c, int(p)) for p in prefixes])
    crossover[label] = int(prefixes[np.argmax(ld < rec)]) if (ld < rec).any() else None
    last_ratio[label] = (int(prefixes[-1]), float(ld[-1] / rec[-1]))
    ax.plot(prefixes, rec * 1e3, color=col, ls=ls, label=f"recompute: {label}")
for model, col in (("llama-3.1-8b", "k"), ("llama-2-7b", "gray")):
    c = make_cost_model(model, "h100")
    prefixes = PREFIX[PREFIX < c.model.max_model_len - REST]
    ax.plot(prefixes, [load_time(c, int(p)) * 1e3 for p in prefixes], color=col, ls="--",
            label=f"load at {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s: {c.kv_bytes_per_token_per_gpu // 1024} KiB/token ({model})")
ax.set(xscale="log", yscale="log", xlabel="cached prefix (tokens)", ylabel="ms",
       title="Bringing a prefix back: recompute (marginal) vs load from the host tier")
ax.legend(fontsize=6)
ax.grid(alpha=0.3)
plt.show()
print("shortest prefix that is cheaper to load than to recompute:", crossover)
print("load / recompute at the longest prefix:", {k: f"{n} tokens: {r:.2f}" for k, (n, r) in last_ratio.items()})

# %% [markdown]
# $m$ = {{REST}} 时，在 H100 上，Llama-3.1-8B 的前缀短于 {{crossover["llama-3.1-8b / h100"]}} 个 Token 时重算更便宜，更长时拷回更便宜，
# 到 {{last_ratio["llama-3.1-8b / h100"][0]:,}} 个 Token 时拷回只要重算的 {{last_ratio["llama-3.1-8b / h100"][1]:.0%}}；
# A100 算得慢，交叉点提前到 {{crossover["llama-3.1-8b / a100-80g"]}}。Llama-2-7B 没有 GQA，每个 Token 的 KV 是 Llama-3.1-8B 的
# {{make_cost_model("llama-2-7b", "h100").kv_bytes_per_token_per_gpu // cm.kv_bytes_per_token_per_gpu}} 倍，拷回也贵这么多：
# 在它 {{make_cost_model("llama-2-7b", "h100").model.max_model_len}} 的上下文之内，拷回始终不比 H100 上的重算便宜（{{last_ratio["llama-2-7b (MHA) / h100"][0]:,}} 个 Token 时
# 拷回是重算的 {{last_ratio["llama-2-7b (MHA) / h100"][1]:.2f}} 倍）——主机层要靠 GQA 这样的“小 KV”、或者更快的链路才划算。
# Mooncake 的前缀动辄上万 Token，用的又是 GQA 模型，远在交叉点之后。
# 两个细节：其一，这里的重算是“单独一步”的边际时间，批里已经有别的预填充时 GEMM 早已受算力限制，重算更贵；
# 其二，minibatch 把拷回算进这一步的时长（整个批都等它），这是上界——vLLM 0.34.0 的拷回是异步的，请求在
# `WAITING_FOR_REMOTE_KVS` 状态（`vllm/v1/request.py`）等数据到齐，别的请求照常运行。SGLang 0.5.19 则在 `hiradix_cache.py` 的
# `load_back` 里设了一个下限 `load_back_threshold = 10`：要拷回的 Token 少于 10 个就不拷、直接重算。
# minibatch 的主机命中总是拷回；练习 3 请你加上这条规则。
#
# ## 33.5 真实的 tiny 模型：主机层命中不改变输出
#
# 主机层拷回的必须**逐字节**是当初算出的 K/V，否则后面的 Token 就会变。用嵌入的 tiny 模型：几段系统提示词各带不同的后缀，
# 按提示词轮流来三遍，每次一个请求；显存池很小，同一段提示词再来时早已被驱逐。开不开主机层各跑一次，比较贪心输出，
# 并看拷回的实测时间：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
N_HEADS, HEAD_LEN, SUFFIX, TINY_POOL, TINY_HOST = 8, 160, 8, 24, 96
trng = np.random.default_rng(1)
heads = [trng.integers(3, 4096, HEAD_LEN).tolist() for _ in range(N_HEADS)]
tiny_prompts = [heads[g] + trng.integers(3, 4096, SUFFIX).tolist() for _ in range(3) for g in range(N_HEADS)]
tiny = {}
for blocks in (0, TINY_HOST):
    eng = LLMEngine(EngineConfig.from_kwargs(model="tiny", block_size=16, num_kv_blocks=TINY_POOL, enable_prefix_caching=True,
                                             kv_offload_blocks=blocks), clock="virtual")
    reqs = [serve_one(eng, p, max_tokens=8) for p in tiny_prompts]
    tiny[blocks] = dict(out=[r.output_token_ids for r in reqs], ttft=[r.first_token_time - r.arrival_time for r in reqs],
                        hits=eng.kv.prefix_hits, host=eng.kv.host)
on = tiny[TINY_HOST]
same = tiny[0]["out"] == on["out"]
print("greedy outputs identical with and without the host tier:", same)
print(f"prompt tokens from the cache: {tiny[0]['hits']} without, {on['hits']} with the host tier")

# %% tags=["check"]
assert same and tiny[0]["hits"] == 0 and on["hits"] == 2 * N_HEADS * HEAD_LEN and on["host"].num_loaded == 2 * N_HEADS * HEAD_LEN // 16

# %% [markdown]
# {{N_HEADS}} 段 {{HEAD_LEN}} Token 的系统提示词，每个请求再加 {{SUFFIX}} 个 Token 的后缀；显存池 {{TINY_POOL}} 块（{{TINY_POOL * 16}} 个 Token），
# 主机层 {{TINY_HOST}} 块。没有主机层时，{{len(tiny_prompts)}} 个请求一个 Token 也没命中（同一段提示词再来时已被驱逐）；有主机层时，
# 后两轮的 {{2 * N_HEADS}} 个请求各从主机拷回 {{on["host"].num_loaded // (2 * N_HEADS)}} 块、共命中 {{on["hits"]}} 个 Token，贪心输出与不开时逐 Token 相同。
# 拷回的实测时间是每块 {{on["host"].load_seconds / on["host"].num_loaded * 1e6:.0f}} µs（CPU 上两块内存之间的 `index_copy_`，
# 逐层逐个张量地拷，小块的固定开销占了大头）；后两轮请求的 TTFT 中位数从 {{np.median(tiny[0]["ttft"][N_HEADS:]) * 1e3:.1f}} ms
# 降到 {{np.median(on["ttft"][N_HEADS:]) * 1e3:.1f}} ms。`tests/test_kv_offload.py` 还在随机的 Llama 检查点上对照了 transformers 的
# `generate`，并用一个逐位置校验 K/V 的执行器检查随机负载下两层的块守恒。
#
# ## 33.6 框架里的 KV 卸载
#
# | 框架（版本，源文件） | 怎样打开 | 默认值与行为 |
# |---|---|---|
# | vLLM 0.34.0（`vllm/config/cache.py`，`vllm/config/vllm.py`） | `--kv-offloading-size GiB`（可选 `--kv-offloading-backend native\|lmcache`） | `kv_offloading_size` 默认 `None`，即关闭；它是所有张量并行 GPU 加起来的大小。`native` 后端把 KV Connector 设为 `OffloadingConnector`（环境变量 `VLLM_USE_SIMPLE_KV_OFFLOAD` 时为 `SimpleCPUOffloadConnector`），`cpu_bytes_to_use = size × 2^30`，`kv_role="kv_both"`；`lmcache` 后端用 `LMCacheMPConnector`，容量由独立的 LMCache 服务进程管理 |
# | vLLM 0.34.0（`vllm/v1/kv_offload/cpu/spec.py`，`.../cpu/policies/lru.py`） | `kv_connector_extra_config` 的 `eviction_policy` | 默认 `"lru"`；同一个请求的块按位置排序，**链尾先于链头**被淘汰；正在传输的块被“保护”，淘汰时跳过 |
# | vLLM 0.34.0（`.../kv_connector/v1/offloading/scheduler.py`，`vllm/v1/core/sched/scheduler.py`，`vllm/v1/request.py`） | — | 写穿：每步为新算完的块生成存储任务，工作进程在单独的 CUDA 流上异步拷贝（`vllm/v1/kv_offload/cpu/gpu_worker.py`）；主机命中默认异步加载，请求进入 `WAITING_FOR_REMOTE_KVS`，拷完再调度 |
# | vLLM 0.34.0 指标（`vllm/v1/metrics/loggers.py`，`.../offloading/metrics.py`） | `/metrics` | `vllm:prefix_cache_hits`（显存）与 `vllm:external_prefix_cache_hits`（KV Connector）分开计数，`vllm:prompt_tokens_cached_by_source{source="device"\|"host"\|...}` 按层拆分；拷贝量 `vllm:kv_offload_load_bytes`、`vllm:kv_offload_store_bytes` |
# | SGLang 0.5.19（`python/sglang/srt/server_args.py`，`arg_groups/hicache_hook.py`） | `--enable-hierarchical-cache` | 默认关；`--hicache-ratio` 未给出时在 `cache` 模式下取 2.0（主机池 / 显存池）；`--hicache-size` 默认 0（GB，给出时覆盖比例）；`--hicache-write-policy` 默认 `write_through`，可选 `write_back`、`write_through_selective`；`--hicache-io-backend` 默认 `kernel` |
# | SGLang 0.5.19（`python/sglang/srt/mem_cache/hiradix_cache.py`） | — | `write_through_threshold`：写穿为 1，否则为 2（被命中两次才拷）；`load_back_threshold = 10`（少于 10 个 Token 不拷回）；写回在驱逐时拷（`_evict_write_back`，注释称将来弃用）；主机满时按淘汰策略从主机叶子节点删起（`evict_host`） |
# | minibatch（`minibatch/kv_offload.py`，`minibatch/kv_cache.py`） | `kv_offloading_size`（GiB）或 `kv_offload_blocks`，需 `enable_prefix_caching=True` | 默认关；`kv_offload_policy` 默认 `write_through`；主机 LRU，链尾先动、钉住的块不淘汰；主机命中总是拷回，计入 `kv.prefix_hits` 与 `kv.prefix_host_hits`；模拟器按 `kv_offload_bandwidth`（默认 {{HOST_LINK_BYTES_PER_S / 1e9:.0f}} GB/s）计拷贝时间 |
#
# ## 33.7 动手：主机层多大才够
#
# 拖动主机层与显存池的比例、选择写入策略，用 33.3 节的 LRU 模型估计三个窗口的命中率（写穿：容量 = 主机；写回：容量 = 显存 + 主机），
# 并看主机要占多少内存（每个 Token {{cm.kv_bytes_per_token_per_gpu // 1024}} KiB）：

# %% tags=["nbval-ignore-output"]
def explore(ratio=float(HOST_RATIO), policy="write_through"):
    host_tokens = ratio * DEVICE_TOKENS
    capacity = host_tokens if policy == "write_through" else DEVICE_TOKENS + host_tokens
    hits = [lru_hit_rate(dist, max(capacity, DEVICE_TOKENS), *w) for w in WINDOWS]
    base = [lru_hit_rate(dist, DEVICE_TOKENS, *w) for w in WINDOWS]
    fig, ax = plt.subplots(figsize=(6, 2.6))
    x = np.arange(len(WINDOWS))
    ax.bar(x - 0.2, base, 0.4, color="C3", label="device pool only")
    ax.bar(x + 0.2, hits, 0.4, color="C0", label=f"{policy}, host = {ratio:g}x pool")
    ax.set_xticks(x, [f"[{a}, {b})" for a, b in WINDOWS], fontsize=7)
    ax.set(ylim=(0, 1), ylabel="LRU hit rate", title=f"host memory {host_tokens * cm.kv_bytes_per_token_per_gpu / 2**30:.0f} GiB")
    ax.legend(fontsize=7)
    plt.show()


W.interact(explore, ratio=W.FloatLogSlider(value=HOST_RATIO, base=2, min=-1, max=5, step=0.5, continuous_update=False),
           policy=W.ToggleButtons(options=["write_through", "write_back"]));

# %% [markdown]
# ## 本章小结
#
# - 主机层按哈希链保存前缀块：显存未命中时接着在主机里查，命中的块钉住、拷回新的显存块并重新登记，算作命中；两层是包含关系，主机按 LRU 淘汰，链尾先走。
# - 主机层为复用前缀，换出为暂停运行中的请求：两者各有自己的主机池，可以同时开启。
# - 写穿（vLLM 与 SGLang 的默认）每块都拷、与计算重叠，主机必须比显存大才有新增容量；写回只拷被驱逐的块，容量是两层之和，但拷贝在关键路径上。
# - LRU 栈距离从轨迹直接给出任意容量的命中率；minibatch 引擎的命中率与同容量的 LRU 模型相差无几。Mooncake 的工作集远大于一张卡，
#   {{HOST_RATIO}} 倍主机层在稳态窗口里提高了命中率、写穿降低了 TTFT，但大部分复用仍在够不着的地方；写回命中更多，拷贝却在关键路径上。
# - 拷回按字节付费，重算按边际计算付费：短前缀在快 GPU 上重算更便宜（SGLang 少于 10 个 Token 不拷回），长前缀拷回便宜得多；GQA 让拷回更划算。
# - 主机层命中拷回的是原样的 K/V：tiny 模型上开不开主机层，贪心输出逐 Token 相同。
#
# ## 练习
#
# 1. **主机层的比例。** 在 33.3 节的配置里把主机层设为显存池的 1 倍与 8 倍（`kv_offload_blocks`），写穿与写回各跑一次。
#    命中率与 33.7 节 LRU 模型的估计相差多少？1 倍的写穿为什么几乎没有用？
# 2. **带宽。** 把 `kv_offload_bandwidth` 降到 5e9（共享的 PCIe 链路）或升到 5e10（PCIe Gen5），写回的 TTFT p90 怎样变化？写穿呢？
# 3. **拷回的下限。** 仿照 SGLang 的 `load_back_threshold`，在 `KVCacheManager.get_computed_blocks` 里加一条规则：主机命中少于 $k$ 块时不用它。
#    用 33.4 节的曲线选 $k$，并说明为什么在 CPU 上的 tiny 模型与 H100 上的 8B 模型应该取不同的值。
# 4. **与换出同时开启。** 在第 24 章的换出实验里再打开主机层（`enable_prefix_caching=True, kv_offload_blocks=...`），两个主机池各用了多少？
#    一个被换出的请求的块，会不会也出现在主机层里？
#
# <details><summary>提示与参考答案</summary>
#
# 1. `CONFIGS` 里换成 `kv_offload_blocks=pool_blocks` 或 `8 * pool_blocks` 重跑，再用 `window_stats` 统计；LRU 估计见 `explore(1)`、`explore(8)`。
#    1 倍的写穿主机与显存里的内容基本相同（包含关系），新增容量接近 0；写回的 1 倍则让总容量翻倍。
# 2. 写回的拷贝与拷回都按 `块数 × 字节 ÷ 带宽` 计入步长，带宽降 5 倍，关键路径上的拷贝时间升 5 倍，长提示词的拷回（1 万个 Token 在 5e9 下要
#    {{load_time(cm, 10000, 5e9) * 1e3:.0f}} ms）
#    开始与重算相当；写穿的存储不计时间，只有拷回变慢。
# 3. 在主机命中的循环结束后，若 `len(host_hits) < k` 就清空 `host_hits`（并且不钉住）。H100 上 Llama-3.1-8B 的交叉点约为
#    {{crossover["llama-3.1-8b / h100"]}} 个 Token，即 $k \approx$ {{-(-crossover["llama-3.1-8b / h100"] // SIM["block_size"])}} 个 {{SIM["block_size"]}} Token 的块；CPU 上 tiny 模型算得慢、拷得相对快，
#    重算几乎从不更便宜，$k$ 应取 1。
# 4. 换出的块在 `swap_out` 时被 `kv.free` 释放回空闲队列，若它们已写满并登记过，就还是前缀缓存的一部分：写穿时它们已在主机层里，
#    写回时被驱逐才进去。两个池的计数分别看 `engine.scheduler.swapper.num_swapped_out` 与 `engine.kv.host.num_stored`。
#
# </details>
