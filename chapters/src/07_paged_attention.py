# %% [markdown]
# # 第 7 章 PagedAttention：分页 KV 与块管理器
#
# 第 6 章量出了连续预分配（Contiguous Pre-allocation）的代价：按 vLLM 论文的定义，大部分 KV 显存是内部碎片（为请求占下、
# 却直到它结束都用不上的槽位）与预留，预留大小不一时还有外部碎片，
# 批大小和吞吐量随之缩水。vLLM 的 PagedAttention（Kwon et al., *Efficient Memory Management for Large Language
# Model Serving with PagedAttention*, SOSP'23）借用操作系统的虚拟内存分页（Paging）思想解决了这个问题：
# 把每条序列的 KV Cache 切成固定大小的**块**（Block），块在物理上可以散落在显存的任意位置，
# 由一张**块表**（Block Table）记录逻辑顺序。本章逐层打开这个设计：块管理器（Block Manager）的数据结构、
# 块大小的取舍、块的共享，以及从不连续的块里读 KV 的注意力算子——我们会逐行阅读 minibatch 的 Triton
# 分页解码（Paged Decode）内核，并在 CPU 上的 Triton 解释器里真正运行它。
#
# ## 学习目标
#
# - 理解块表与槽位映射（Slot Mapping）：逻辑 Token $t$ 存在物理块 `table[t // B]` 的第 `t % B` 个槽位；
# - 会用模拟器扫描块大小（`block_size`），说清末块浪费与块表大小、算子效率之间的取舍；
# - 理解基于引用计数的块共享：前缀缓存（Prefix Caching）的哈希链（Hash Chain），以及写时复制（Copy-on-Write）何时才需要；
# - 能逐行读懂分页解码注意力内核：按块表寻址、在线 Softmax（Online Softmax）、GQA 分组与 Split-KV；
# - 能把引擎实测的 KV 浪费与 vLLM 论文报告的数字对照起来。

# %%
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any Triton kernel module is imported: run kernels on the CPU

import inspect
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython import get_ipython
from IPython.display import display

from minibatch import LLMEngine, SamplingParams
import minibatch.kernels
from minibatch.executor import ModelExecutor
from minibatch.kernels import triton_decode
from minibatch.kernels.reference import paged_decode_attention_ref
from minibatch.kv_cache import KVCacheManager, hash_block
from minibatch.runner import run
from minibatch.viz import diagrams, kv_block_map
from minibatch.workload import load_workload, lognormal, synthetic

print("Triton interpreter:", triton_decode.interpreting())

# %% [markdown]
# ## 7.1 从操作系统分页到 PagedAttention
#
# | 操作系统虚拟内存 | PagedAttention |
# |---|---|
# | 进程（Process） | 请求 / 序列（Sequence） |
# | 页（Page），固定大小 | KV 块（Block），每块 $B$ 个 Token（`block_size`） |
# | 虚拟页号 → 物理页框 | 逻辑块号 → 物理块号 |
# | 页表（Page Table） | 块表（Block Table） |
# | 按需调页（Demand Paging） | 生成到块满时才分配下一块 |
# | 共享页 + 写时复制（fork） | 共享块 + 引用计数，必要时写时复制 |
# | 换出到磁盘（Swap） | 抢占时换出到 CPU 内存或重算（第 12 章） |
#
# 两个关键后果：其一，块是按需分配的，一条序列最多浪费最后一块中的 $B-1$ 个槽位（内部碎片）；
# 其二，所有块大小相同，任何空闲块都能满足任何请求，外部碎片不复存在。代价是注意力算子不能再假设 KV 连续，
# 它必须先查块表，再去对应的物理块里取数据。
#
# ## 7.2 块表与槽位映射
#
# 设块大小为 $B$，序列的块表为 $\text{table}$。序列中第 $t$ 个 Token（从 0 计）：
#
# $$
# \text{逻辑块号} = \lfloor t / B \rfloor, \qquad \text{块内偏移} = t \bmod B, \qquad
# \text{slot}(t) = \text{table}[\lfloor t / B \rfloor] \cdot B + (t \bmod B)
# $$
#
# KV 张量的形状是 `[num_blocks, block_size, num_kv_heads, head_dim]`，把前两维压平后，`slot` 就是这个 Token 的 K/V
# 在缓存里的行号。每个 step，执行器为本步要写入的每个新 Token 算出 `slot_mapping`，模型每一层先把新的 K/V
# 按它写进缓存（`store_kv`），再做注意力。下面是 `ModelExecutor.prepare` 中计算槽位的两行：

# %%
src = inspect.getsource(ModelExecutor.prepare)
print("\n".join(line for line in src.splitlines() if "slots.append" in line or "slots.extend" in line))

# %% [markdown]
# 用真实的 tiny 模型跑一个小实验：一个很小的 KV 池，先放入几个长度不同的请求，跑几步之后
# 让其中一个结束、再来一个新请求，观察块表如何变得“不连续”。（引擎开启了前缀缓存，7.4 节会用到。）

# %%
NUM_BLOCKS, BLOCK, FIRST_STEPS = 32, 8, 7
eng = LLMEngine(model="tiny", clock="virtual", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, enable_prefix_caching=True)
rng = np.random.default_rng(0)
prompts = {f"R{i}": rng.integers(5, 4000, n).tolist() for i, n in enumerate([13, 30, 9, 21])}
max_tokens = {"R0": 6, "R1": 24, "R2": 30, "R3": 12}
for rid, ids in prompts.items():
    eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens[rid], ignore_eos=True), request_id=rid)
for _ in range(FIRST_STEPS):
    eng.step()
prompts["R4"] = rng.integers(5, 4000, 27).tolist()          # R0 has finished: its blocks are free again
eng.add_request(prompts["R4"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), request_id="R4")
for _ in range(2):
    eng.step()


def show_tables(eng, rids):
    for rid in rids:
        r = eng.requests[rid]
        table = eng.kv.block_table(rid)
        state = "finished" if r.is_finished else f"{r.num_computed_tokens:>2} tokens in cache"
        print(f"{rid}: {state:<20} block table {table}")
    print("free queue (next to hand out first):", list(eng.kv.pool.free_queue)[:8], "...")


show_tables(eng, ["R0", "R1", "R2", "R3", "R4"])

# %%
def contiguous(table):
    return all(b - a == 1 for a, b in zip(table, table[1:]))


scattered = ", ".join(rid for rid in prompts if eng.kv.block_table(rid) and not contiguous(eng.kv.block_table(rid)))
live = {rid: eng.kv.block_table(rid) for rid in prompts if eng.kv.block_table(rid)}
display(diagrams.block_tables(live, {rid: eng.requests[rid].num_computed_tokens for rid in live},
                              eng.kv.block_size, eng.kv.num_blocks, figsize=(10, 3.6)))

# %% tags=["check"]
assert scattered, "the prose says some block tables are not contiguous"
assert eng.requests["R0"].is_finished and not eng.kv.block_table("R0"), "the prose says R0 has finished"

# %% [markdown]
# 这个 KV 池只有 {{NUM_BLOCKS}} 个块、每块 {{BLOCK}} 个 Token；先放入的 {{len(max_tokens)}} 个请求跑了 {{FIRST_STEPS}} 步之后，
# R0 已经结束，这时 R4 到达。上图左边是每个请求的逻辑块（按块表顺序，浅色填充的部分是已写入的槽位），右边是它们在物理 KV 池里的位置。
# 块表 {{scattered}} 在物理上都不连续：每条序列写满一块才申请下一块，几条序列交替增长，
# 它们的块自然交错在一起。已结束的 R0 的块回到了空闲队列的**末尾**（它们写满的块还留在前缀缓存里，
# 后面的图中标为 cached），所以空闲队列先交出从未用过的块——R4 拿到的是 {{eng.kv.block_table('R4')}}。
# 无论物理位置如何，对每条序列来说，它的 Token 依然按块表的逻辑顺序排列。

# %% [markdown]
# 下面在下一个 step 里“旁听”执行器算出的 `slot_mapping`（只包一层记录函数，不改引擎逻辑），
# 再用上面的公式从块表手算一遍，两者应当完全一致：

# %%
seen = {}
prepare = eng.executor.prepare


def spy(batch, kv):
    out = prepare(batch, kv)
    seen["items"] = [(r.request_id, r.num_computed_tokens, n) for r, n in batch.items]
    seen["tables"] = {r.request_id: list(kv.block_table(r.request_id)) for r, _ in batch.items}
    seen["slots"] = out[2].slot_mapping.tolist()
    return out


eng.executor.prepare = spy
eng.step()
eng.executor.prepare = prepare

B = eng.kv.block_size
by_hand = []
decodes = [it for it in seen["items"] if it[2] == 1] + [it for it in seen["items"] if it[2] != 1]  # decodes first
for rid, p0, n in decodes:
    table = seen["tables"][rid]
    by_hand += [table[t // B] * B + t % B for t in range(p0, p0 + n)]
for rid, p0, n in decodes[:3]:
    t = p0
    table = seen["tables"][rid]
    print(f"{rid}: token t={t} -> block table[{t}//{B}]={table[t // B]}, offset {t % B} -> slot {table[t // B] * B + t % B}")
print("executor's slot_mapping:", seen["slots"])
print("computed by hand equal :", by_hand == seen["slots"])

# %% [markdown]
# 把 KV 池画出来：每个格子是一个块，块内的 {{B}} 个小格是槽位，颜色表示属于哪个请求，浅红色是末块里尚未写入的槽位
# （内部碎片），灰白是空闲块，浅蓝是已释放、但内容仍登记在前缀缓存里的块（cached）。`minibatch.viz.kv_block_map` 直接读取引擎的块表：

# %%
display(kv_block_map(eng, columns=16, figsize=(9, 2.4)))

# %% [markdown]
# ## 7.3 块大小的取舍
#
# 块大小 $B$ 是 PagedAttention 最重要的参数，它在两头之间取舍：
#
# - **$B$ 越大**：末块浪费越多（每条序列平均约 $B/2$ 个槽位，最坏 $B-1$）；前缀共享的粒度越粗（只有整块相同才能共享）。
# - **$B$ 越小**：块表越长（每条序列 $\lceil n/B \rceil$ 项），调度器要管理的块越多；注意力算子每次只能从一个块里
#   连续读 $B$ 个 Token，访存更零碎，GPU 上的内核效率下降。
#
# vLLM 论文的消融实验（Kwon et al., SOSP'23, §7.2）发现块太小会让内核无法充分利用 GPU 并行，块太大则增加内部碎片，
# 在 ShareGPT 负载上 16–128 的块大小表现最好。vLLM 不设 `--block-size` 时在 CUDA 上取 16（vLLM v0.9.2：
# `vllm/config.py` 中 `CacheConfig.block_size` 默认为空，由 `vllm/platforms/cuda.py` 的 `check_and_update_config` 设为 16）。
#
# 在模拟器里扫一遍块大小：Llama-2-7B 跑在 A10 上（KV 紧张，浪费的每个槽位都会挤掉并发），一批短请求一次性到达。
# 注意模拟器的代价模型（Cost Model）**不**模拟块大小对内核效率的影响（它按读写的字节数计时），
# 所以这里的吞吐变化只来自显存浪费；小块在真实 GPU 上的内核开销需要第 17 章的基准测试来测。

# %%
short = synthetic(400, float("inf"), input_len=lognormal(median=100, sigma=0.8, max=1024),
                  output_len=lognormal(median=100, sigma=0.8, max=1024), seed=7)
lengths = short.prompt_lens + short.output_lens
BLOCK_SIZES = [1, 8, 16, 32, 64, 128, 256]
VLLM_DEFAULT = 16                    # vLLM's default block size on CUDA (cited above)
sweep = {}
for bs in BLOCK_SIZES:
    s = run(short, executor="sim", model="llama-2-7b", hardware="a10", block_size=bs).summary()
    sweep[bs] = dict(waste=s["kv_internal_waste_mean"], batch=s["mean_batch_size"], tok_s=s["throughput_tok_s"],
                     preempt=s["num_preemptions"], entries=float(np.mean(np.ceil(lengths / bs))))

# %% tags=["nbval-check-output"]
print(f"{len(short)} requests, mean length {lengths.mean():.0f} tokens (prompt + output)")
print(f"{'block_size':>10} {'last-block waste':>17} {'table entries/seq':>18} {'mean batch':>11} {'out tok/s':>10}")
for bs, row in sweep.items():
    print(f"{bs:>10} {row['waste']:>17.1%} {row['entries']:>18.1f} {row['batch']:>11.1f} {row['tok_s']:>10.1f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2), layout="constrained")
xs = BLOCK_SIZES
ax1.plot(xs, [sweep[b]["waste"] * 100 for b in xs], "o-", color="C3", label="last-block waste (% of pool)")
ax1.set_xscale("log", base=2)
ax1.set_xticks(xs, [str(b) for b in xs])
ax1.set_xlabel("block_size (tokens)")
ax1.set_ylabel("% of KV pool", color="C3")
ax1b = ax1.twinx()
ax1b.plot(xs, [sweep[b]["entries"] for b in xs], "s--", color="C0")
ax1b.set_yscale("log")
ax1b.set_ylabel("block-table entries per sequence", color="C0")
ax1.set_title("Waste vs table size", fontsize=10)
ax1.grid(alpha=0.3)
ax2.plot(xs, [sweep[b]["tok_s"] for b in xs], "o-", color="C2")
ax2.set_xscale("log", base=2)
ax2.set_xticks(xs, [str(b) for b in xs])
ax2.set_xlabel("block_size (tokens)")
ax2.set_ylabel("output tokens/s (simulated)")
ax2.set_title("llama-2-7b on A10: throughput vs block size", fontsize=10)
ax2.grid(alpha=0.3)
plt.show()

# %% tags=["check"]
w16, w256 = sweep[VLLM_DEFAULT], sweep[BLOCK_SIZES[-1]]
assert w256["waste"] > w16["waste"] and w256["batch"] < w16["batch"] and w256["tok_s"] < w16["tok_s"], \
    "the prose says big blocks waste more, shrink the batch and the throughput"
assert sweep[BLOCK_SIZES[0]]["waste"] == 0, "the prose says the smallest block size wastes nothing"

# %% [markdown]
# {{len(short)}} 个请求一次性到达。块大小 {{VLLM_DEFAULT}} 时，末块浪费只占池子的 {{w16['waste']:.1%}}，每条序列的块表平均
# {{w16['entries']:.0f}} 项；块大小 {{BLOCK_SIZES[-1]}} 时浪费升到 {{w256['waste']:.0%}}，平均批大小从 {{w16['batch']:.1f}}
# 降到 {{w256['batch']:.1f}}，吞吐从 {{w16['tok_s']:.0f}} 降到 {{w256['tok_s']:.0f}} tokens/s。而块大小 {{BLOCK_SIZES[0]}}
# 虽然没有任何浪费，块表却长到每条序列 {{sweep[BLOCK_SIZES[0]]['entries']:.0f}} 项——在真实 GPU 上，这会让内核每次只读一个 Token 的 KV。
# （“末块浪费”按块表位置统计运行中最后一块里尚未写入的槽位，其中大部分随后会被写入；请求结束时仍空着的那部分，
# 才是论文所说的内部碎片。）

# %% [markdown]
# **动手**：下面的函数在模拟器里把几个长度各异的请求一起运行，画出 KV 池，其中前几个请求以同一段前缀开头：

# %% tags=["nbval-ignore-output"]
import ipywidgets as widgets
from minibatch import EngineConfig

POOL_SLOTS, N_DEMO, N_SHARED, PREFIX = 768, 8, 4, 24     # KV slots; requests; of which share a prefix; its tokens


def block_map_demo(block_size=16, steps=12, prefix_caching=False):
    cfg = EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a10", block_size=block_size,
                                   num_kv_blocks=POOL_SLOTS // block_size, enable_prefix_caching=prefix_caching)
    demo = LLMEngine(cfg, clock="virtual")
    g = np.random.default_rng(1)
    system_prompt = g.integers(5, 30000, PREFIX).tolist()
    for i in range(N_DEMO):
        own = g.integers(5, 30000, int(g.integers(6, 50))).tolist()
        ids = system_prompt + own if i < N_SHARED else own
        demo.add_request(ids, SamplingParams(temperature=0.0, max_tokens=int(g.integers(10, 60)), ignore_eos=True),
                         request_id=f"q{i}")
        if i == 0:
            demo.step()     # q0's prefix is computed (and cached) before the others arrive
    for _ in range(steps):
        if demo.has_unfinished_requests():
            demo.step()
    reserved, internal = demo.kv.waste_slots(demo.scheduler.running)
    print(f"block_size {block_size}: {demo.kv.num_used_blocks}/{demo.kv.num_blocks} blocks used, "
          f"{internal} empty slots in last blocks, {demo.num_running} running, {demo.num_waiting} waiting")
    display(kv_block_map(demo, figsize=(9, 3), max_legend=10))

# %% [markdown]
# KV 池固定为 {{POOL_SLOTS}} 个槽位，块大小可调（块数 = {{POOL_SLOTS}} / 块大小）。{{N_DEMO}} 个请求一起运行，
# 拖动 `steps` 看块表如何随解码增长，换一个块大小看浅红色的末块浪费如何变化；打开 `prefix_caching`，
# 前 {{N_SHARED}} 个请求以同一段 {{PREFIX}} Token 的前缀开头（q0 先到一步），观察绿色的共享块
# （块越大，{{PREFIX}} Token 里能整块共享的越少）。

# %% tags=["nbval-ignore-output"]
widgets.interact(block_map_demo, block_size=widgets.SelectionSlider(options=[4, 8, 16, 32, 64], value=16),
                 steps=widgets.IntSlider(value=12, min=0, max=70), prefix_caching=False);

# %% [markdown]
# ## 7.4 块的共享：引用计数、前缀缓存与写时复制
#
# 分页之后，“两条序列共享一段 KV”变得很自然：让它们的块表指向同一批物理块，并给每个块记一个**引用计数**
# （Reference Count），最后一个持有者释放时块才回到空闲队列。vLLM 用它支持三种场景：
# 并行采样（Parallel Sampling，同一 Prompt 生成多条输出）、束搜索（Beam Search），以及前缀缓存。
#
# **前缀缓存**。minibatch 与 vLLM 的自动前缀缓存（Automatic Prefix Caching；vLLM v0.10.2 V1 引擎的
# `vllm/v1/core/kv_cache_utils.py`，`hash_block_tokens`）一样，给每个**写满**的块算一个哈希，
# 哈希链接了它之前的全部 Token：$h_i = \text{hash}(h_{i-1}, \text{tokens}_i)$。两个哈希相等，意味着从序列开头到这一块为止的
# 所有 Token 都相同，这一块就可以直接复用：

# %%
print(inspect.getsource(hash_block))
print(inspect.getsource(KVCacheManager.get_computed_blocks))

# %% [markdown]
# 回到 7.2 的引擎。新请求 R5 的开头与 R1 的 Prompt 相同（比如同一段系统提示词，System Prompt），之后接上自己的问题。
# R1 写满的块已经登记在前缀缓存里，所以 R5 的块表会直接指向它们：

# %%
SHARE = 24                           # R5's first tokens, copied from R1's prompt
prompts["R5"] = prompts["R1"][:SHARE] + rng.integers(5, 4000, 7).tolist()
eng.add_request(prompts["R5"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), request_id="R5")
eng.step()
t1, t5 = eng.kv.block_table("R1"), eng.kv.block_table("R5")
print("R1 block table:", t1)
print("R5 block table:", t5)
print("R5 prompt tokens served from the cache:", eng.requests["R5"].num_cached_tokens,
      "| ref_cnt of R5's blocks:", [eng.kv.pool.blocks[b].ref_cnt for b in t5])
eng.kv.check_invariants()      # free + used = total, every reference accounted for
display(kv_block_map(eng, columns=16, figsize=(9, 2.4)))

# %% tags=["check"]
n_shared = SHARE // B
assert t5[:n_shared] == t1[:n_shared] and t5[n_shared] != t1[n_shared], "the prose: R5 shares R1's full blocks only"
assert [eng.kv.pool.blocks[b].ref_cnt for b in t5[:n_shared]] == [2] * n_shared, "the prose: two holders each"

# %% [markdown]
# R5 的前 {{SHARE}} 个 Token 与 R1 相同，正好是 {{n_shared}} 个写满的块（每块 {{B}} 个 Token）：R5 的块表前
# {{n_shared}} 项就是 R1 的前 {{n_shared}} 项，这些块的引用计数是 {{eng.kv.pool.blocks[t5[0]].ref_cnt}}。
# 图中绿色的块被两个请求共享。注意 minibatch 只共享**写满**的块：写满的块内容不再改变，谁也不会往里写，
# 所以共享它是安全的。R5 的 Prompt 最后不满一块的部分（以及它之后生成的 Token）写在 R5 自己的新块里。
#
# **写时复制（Copy-on-Write, CoW）** 什么时候才需要？当共享的是一个**未写满**的块，而某个持有者要往里追加 Token 时。
# 典型场景是并行采样：同一个 Prompt 要生成 $n$ 条不同的输出，vLLM V0 引擎的块管理器（vLLM v0.9.2
# `vllm/core/block_manager.py`，`SelfAttnBlockSpaceManager`）让 $n$ 条序列 fork 出同一张块表，
# Prompt 的最后一个未满块也被共享；当其中一条序列要写入它时，块管理器先分配一个新块、复制原块内容、
# 把这条序列的块表指向新块，并把原块引用计数减一——正是操作系统 fork 之后的写时复制。
# 实验 **L04**（分页块管理器）会让你亲手实现 `allocate`、`append`、`free` 与 `fork` / `copy_on_write`，
# 并与 minibatch 的 `KVCacheManager` 逐块对账。
#
# 共享对吞吐的影响在模拟器里一目了然：用 `load_workload("shared_prefix")`（几个系统提示词按 Zipf 分布复用）
# 对比前缀缓存的开与关。第 13、14 章会深入前缀缓存与 RadixAttention。

# %% tags=["nbval-check-output"]
shared = load_workload("shared_prefix", n=200)
print(f"{'prefix caching':<15} {'hit rate':>9} {'mean batch':>11} {'out tok/s':>10} {'TTFT p50 (s)':>13}")
for on in (False, True):
    s = run(shared, executor="sim", model="llama-2-7b", hardware="a10", enable_prefix_caching=on).summary()
    print(f"{str(on):<15} {s['prefix_cache_hit_rate']:>9.1%} {s['mean_batch_size']:>11.1f} "
          f"{s['throughput_tok_s']:>10.1f} {s['ttft_p50']:>13.2f}")

# %% [markdown]
# ## 7.5 逐行阅读 Triton 分页解码内核
#
# 解码（Decode）阶段每条序列只有 1 个新的查询 Token，它要和自己的全部 $n$ 个历史 Token 做注意力：
#
# $$
# o = \sum_{t<n} \operatorname{softmax}_t\!\left(\frac{q \cdot k_t}{\sqrt d}\right) v_t,
# \qquad k_t, v_t \text{ 位于物理块 } \text{table}[\lfloor t/B \rfloor] \text{ 的第 } t \bmod B \text{ 个槽位。}
# $$
#
# 这一步每读一个字节的 KV 只做约 1 次浮点运算，是典型的访存受限（第 2 章）。minibatch 的 Triton 内核
# `minibatch/kernels/triton_decode.py` 把它写成一个程序（Program，相当于 CUDA 的一个线程块）处理
# **一条序列的一个 KV 头**，并一次算完共享这个 KV 头的全部 $G$ 个查询头（GQA 分组），这样每个 K/V 块只读一次。
#
# 在 CPU 上，引擎默认用同样思路的 C 内核。它们的几个常数直接从源码里读出来：

# %%
KERNEL_DIR = Path(minibatch.kernels.__file__).parent


def c_define(file: str, name: str) -> int:
    """The value of ``#define name <int>`` in one of the C kernels' sources."""
    return int(re.search(rf"#define {name} (\d+)", (KERNEL_DIR / file).read_text()).group(1))


LANES = 512 // 32                    # float32 lanes of an AVX-512 register
PREFETCH_AHEAD, TILE_Q = c_define("cpu_paged.c", "PREFETCH_AHEAD"), c_define("cpu_prefill.c", "TQ")

# %% [markdown]
# 解码用 `minibatch/kernels/cpu_paged.c`：一个 OpenMP 任务处理一条序列的全部头，
# 按块表逐 Token 读 K、V 各一遍，不把分页的 KV 复制成连续张量。它有两条路径：可移植的 C 循环，和 AVX-512 版本
# （{{LANES}} 个点积一起做一次转置归约（Transpose Reduction），提前 {{PREFETCH_AHEAD}} 行预取 K/V；两者从内存读 KV 的实测带宽
# 可在仓库根目录用 `.venv/bin/python benchmarks/cpu_attention.py` 对比）。预填充（Prefill）的注意力由另一个 C 内核
# `minibatch/kernels/cpu_prefill.c` 计算：它把 {{TILE_Q}} 个查询 Token 分成一块（Tile），每读一行 K/V 就供整块的
# 全部查询头使用，而不是把每个查询 Token 当作一次“上下文为自身位置 + 1”的解码、各读一遍；同一脚本的第二张表
# 比较了这两种做法与 torch 路径的耗时。
#
# 回到 Triton 内核，模块文档说明了整体算法：

# %%
print(inspect.getdoc(triton_decode)[:1400])

# %% [markdown]
# 下面按内核源码的顺序分段阅读（直接从 `inspect.getsource` 取出，带行号，所以永远与引擎里运行的代码一致）。

# %%
KERNEL = inspect.getsource(triton_decode._paged_decode_kernel.fn).splitlines()


def show(first: str, last: str) -> None:
    """Print the kernel's lines from the one containing ``first`` to the one containing ``last``."""
    i = next(k for k, line in enumerate(KERNEL) if first in line)
    j = next(k for k in range(i, len(KERNEL)) if last in KERNEL[k])
    for k in range(i, j + 1):
        print(f"{k + 1:3d} {KERNEL[k]}")


show("seq = tl.program_id(0)", "hi = ctx_len")

# %% [markdown]
# **① 我是谁、负责哪一段。** 网格（Grid）是 `(num_seqs, num_kv_heads, num_partitions)`：`program_id(0)` 是序列号，
# `program_id(1)` 是 KV 头号。`context_lens[seq]` 是这条序列在缓存里的 Token 数（含本步新写入的那个）。
# 不分段时，程序负责整段上下文 `[0, ctx_len)`；Split-KV 时只负责自己那一段（见 ⑤）。

# %%
show("offs_g = tl.arange(0, BLOCK_G)", "q = q.to(")

# %% [markdown]
# **② 读入一组查询。** 第 `kv_head` 个 KV 头服务查询头 `kv_head*G … kv_head*G+G-1`。`tl.arange` 生成一个向量化的下标；
# Triton 的块尺寸必须是 2 的幂，`tl.dot` 还要求每维至少 16，所以 $G$ 和 `head_dim` 都被补齐到 `BLOCK_G`、`BLOCK_D`，
# 补出来的行和列用掩码（mask）读成 0、最后也不写回。

# %%
show("m = tl.full([BLOCK_G]", "acc = tl.zeros")

# %% [markdown]
# **③ 在线 Softmax 的状态。** 每个查询行保留三样东西：目前见过的最大分数 $m$、Softmax 分母 $l$、未归一化的输出 $\text{acc}$，
# 全部用 fp32。这样上下文只需从头到尾读一遍，不必先存下全部分数。

# %%
show("table_row = block_tables_ptr", "k = tl.load(k_cache_ptr")

# %% [markdown]
# **④ 分页寻址——PagedAttention 的核心只有这几行。** 每次循环处理 `BLOCK_N` 个连续的逻辑位置 `offs_n`：
#
# - `offs_n // BLOCK_SIZE` 是逻辑块号，用它去块表这一行里取出**物理块号** `block`；
# - `offs_n % BLOCK_SIZE` 是块内偏移 `slot_in_block`；
# - 于是 K 的地址是 `block * stride_k_b + slot_in_block * stride_k_t + kv_head * stride_k_h + d`——
#   与 7.2 节的 $\text{slot}(t)$ 是同一个公式，只是按张量步长（Stride）展开。
#
# 超出上下文的位置被 `mask_n` 屏蔽，所以块表里多余的填充项（0、-1 或任意值）不会被读取。

# %%
show("s = tl.dot(q, tl.trans(k)", "m = m_new")

# %% [markdown]
# **⑤ 打分与在线 Softmax 更新。** 对一块新的分数 $s_j$，先求新的最大值 $m' = \max(m, \max_j s_j)$，再用
# $\alpha = e^{m - m'}$ 把之前累加的 $l$ 和 $\text{acc}$ 缩放到新的基准上：
#
# $$
# l \leftarrow \alpha\, l + \sum_j e^{s_j - m'}, \qquad
# \text{acc} \leftarrow \alpha\,\text{acc} + \sum_j e^{s_j - m'}\, v_j, \qquad m \leftarrow m'.
# $$
#
# 每个 $e^{(\cdot)}$ 的指数都不大于 0，不会溢出；读完所有块后 $\text{acc}/l$ 恰好等于整段上下文上的 Softmax 加权和。
# V 的读取用的是与 K 完全相同的分页地址。

# %%
show("store_mask = ", "out.to(out_ptr.dtype.element_ty), mask=store_mask)")

# %% [markdown]
# **⑥ 写回。** 不分段时直接写 $\text{acc}/l$（空上下文输出 0 而不是 0/0）。**Split-KV**（Flash-Decoding 的做法）时，
# 序列很少而上下文很长，一条序列一个程序会让 GPU 的大部分 SM 闲着，于是把上下文再切成若干分区（Partition），
# 每个分区一个程序，各自写出部分结果 $(m_p, l_p, \text{acc}_p)$，再由第二个小内核 `_split_kv_reduce_kernel`
# 按同样的缩放规则合并：$M=\max_p m_p$，$o = \sum_p \text{acc}_p e^{m_p-M} / \sum_p l_p e^{m_p-M}$。
#
# ### 在 CPU 上运行内核并与 torch 参考实现对照
#
# Triton 解释器（`TRITON_INTERPRET=1`，本 notebook 第一个代码单元已设置）在 CPU 上用 NumPy 逐程序执行内核，
# 慢但结果可以检查。构造一个小例子：几条序列，几个查询头共享一个 KV 头（GQA），块表从一个打乱的物理块列表里取，
# 上下文长度各不相同。参考实现
# `minibatch.kernels.reference.paged_decode_attention_ref` 用最直白的 torch 代码先把分页的 KV 收集成连续张量，再做普通注意力。
# 注意解释器不支持 bf16 的 `tl.dot`（结果错误），minibatch 会直接拒绝，所以这里用 float32。

# %%
torch.manual_seed(1)
num_blocks, block_size, num_kv_heads, head_dim, num_heads = 40, 16, 2, 32, 8
k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
context_lens = torch.tensor([5, 37, 130], dtype=torch.int32)
physical = torch.randperm(num_blocks).tolist()                 # blocks scattered anywhere in the pool
width = math.ceil(int(context_lens.max()) / block_size)
block_tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
for s, n in enumerate(context_lens.tolist()):
    need = math.ceil(n / block_size)
    block_tables[s, :need] = torch.tensor([physical.pop() for _ in range(need)])
q = torch.randn(len(context_lens), num_heads, head_dim)

out = triton_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens)
split = triton_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                             split_kv=True, partition_size=32)
print("block tables:\n", block_tables)
print(f"max |triton - ref| = {(out - ref).abs().max().item():.1e}, split-KV: {(split - ref).abs().max().item():.1e}")
assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(split, ref, atol=1e-5)

# %% [markdown]
# 这个例子有 {{len(context_lens)}} 条序列（上下文 {{'、'.join(map(str, context_lens.tolist()))}}）、{{num_heads}} 个查询头共享
# {{num_kv_heads}} 个 KV 头（GQA，$G={{num_heads // num_kv_heads}}$）、`head_dim={{head_dim}}`、块大小 {{block_size}}。
# 两个小实验验证“分页只是一层间接寻址”：把**没有被任何块表引用**的块全部填成 NaN，输出不变（内核只读块表指向的块）；
# 把物理块整体换个位置、同步改写块表，输出也不变（逻辑顺序只由块表决定）。

# %%
used = {int(b) for s, n in enumerate(context_lens.tolist()) for b in block_tables[s, :math.ceil(n / block_size)]}
poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
unused = [b for b in range(num_blocks) if b not in used]
poisoned_k[unused] = float("nan")
poisoned_v[unused] = float("nan")
out_poisoned = triton_decode.paged_decode_attention(q, poisoned_k, poisoned_v, block_tables, context_lens)

perm = torch.randperm(num_blocks)                              # new home of block b: perm[b]
moved_k, moved_v = torch.empty_like(k_cache), torch.empty_like(v_cache)
moved_k[perm], moved_v[perm] = k_cache, v_cache
out_moved = triton_decode.paged_decode_attention(q, moved_k, moved_v, perm[block_tables.long()].int(), context_lens)
print(f"{len(unused)} unused blocks set to NaN -> output unchanged: {torch.allclose(out_poisoned, out, atol=1e-6)}")
print(f"all blocks moved, tables rewritten     -> output unchanged: {torch.allclose(out_moved, out, atol=1e-6)}")
try:
    triton_decode.paged_decode_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), block_tables, context_lens)
except RuntimeError as e:
    print("bf16 in the interpreter:", e)

# %% [markdown]
# 实验 **L05**（课程地图中已列出，随后发布）会让你在解释器里自己写出这个内核（先写不分段的版本，再加 GQA 分组），
# 用同一个参考实现检查；第 17 章再把它放到 GPU 上，测量它的带宽利用率。
#
# ## 7.6 KV 浪费：论文的数字与引擎的实测
#
# vLLM 论文测得，在它之前的系统中 KV Cache 显存只有 20.4%–38.2% 真正存放了 Token 状态（Kwon et al., SOSP'23, §2.3 与
# Figure 2），其余是预留、内部碎片与外部碎片（定义见第 6 章 6.4 节与 `docs/glossary.md`）；vLLM 的博客
# （*vLLM: Easy, Fast, and Cheap LLM Serving with PagedAttention*, 2023-06-20）把它概括为“现有系统因碎片和过度预留浪费了
# 60%–80% 的显存”，而 vLLM 的浪费**不到 4%**，只发生在每条序列的最后一块。

# %%
BLOG_WASTE, PAPER_WASTE = (0.6, 0.8), 0.04       # the blog's range for earlier systems; the paper's bound for vLLM
N_CHAT, CHAT_LEN = 120, 4096                      # chapter 6's experiment
chat = load_workload("chat", n=N_CHAT, max_len=CHAT_LEN)
CHAT_SETUP = dict(executor="sim", model="llama-2-7b", hardware="a10", max_model_len=CHAT_LEN)

# %% [markdown]
# 用第 6 章的实验设置（Llama-2-7B、A10、`max_model_len = {{CHAT_LEN}}`、`chat` 负载的前 {{N_CHAT}} 个请求）按同样的口径在引擎里测一遍：
# 只看有请求排队的满负荷阶段，按时长加权，给出 KV 池里没有存放 Token 状态的比例，以及其中预留与碎片各占多少。

# %% tags=["nbval-check-output"]


def saturated_shares(r):
    """Time-weighted pool shares over the steps with a queue: (tokens, reserved + fragmentation, free)."""
    steps = [st for st in r.steps if st.num_waiting > 0]
    w = np.array([st.duration for st in steps])
    mean = lambda xs: float((w * np.array(xs)).sum() / w.sum())      # noqa: E731
    used = mean([st.kv_usage for st in steps])
    waste = mean([st.kv_reserved + st.kv_internal_frag + st.kv_external_frag for st in steps])
    external = mean([st.kv_external_frag for st in steps])
    return {"tokens": used - waste + external, "waste": waste, "free": 1 - used - external}


shares = {}
for name, kw in {"contiguous (max_model_len)": dict(kv_allocator="contiguous"),
                 "contiguous (per request)": dict(kv_allocator="contiguous", contiguous_reserve="request"),
                 "paged": {}}.items():
    shares[name] = saturated_shares(run(chat, **CHAT_SETUP, **kw))
    sh = shares[name]
    print(f"{name:<27} not token states {1 - sh['tokens']:6.1%}  (reserved + fragmentation {sh['waste']:5.1%}, "
          f"other free {sh['free']:5.1%})")

# %%
cmax, creq, pg = shares["contiguous (max_model_len)"], shares["contiguous (per request)"], shares["paged"]

# %% tags=["check"]
assert BLOG_WASTE[0] <= 1 - cmax["tokens"] <= BLOG_WASTE[1], "the prose: the max_model_len reservation is in the blog's range"
assert pg["waste"] < PAPER_WASTE < 1 - pg["tokens"], "the prose says paged waste is under 4%, free blocks aside"

# %% [markdown]
# 按 `max_model_len` 连续预留时，满负荷下 {{1 - cmax['tokens']:.0%}} 的 KV 池没有存放 Token 状态，落在博客所说的
# {{BLOG_WASTE[0]:.0%}}–{{BLOG_WASTE[1]:.0%}} 之内；按各自的长度预留时是 {{1 - creq['tokens']:.0%}}（其中有外部碎片，见第 6 章）。
# 分页分配的预留与碎片合计只有 {{pg['waste']:.1%}}，低于论文的 {{PAPER_WASTE:.0%}}；它的池子另有 {{pg['free']:.0%}} 是空闲的，但那不是碎片：任何请求都能用
# 这些块，它们暂时空着，是因为排在队首的请求下一步要预填充的那段提示词需要的块比空闲块多，要等正在解码的请求结束。
# 具体数值取决于负载的长度分布、`max_model_len` 和块大小（7.3 节）：请求越短、`max_model_len` 越大，连续预留的浪费越大；
# 块越大，分页的末块浪费越大。

# %% tags=["check"]
# The exercises' settings, and the figures their hints quote.
EX_SHARE = 20                                    # exercise 3: a common prefix that is not a whole number of blocks
ex_hit = EX_SHARE // B
assert EX_SHARE % B, "exercise 3's prefix must end inside a block"
ex_fp16 = triton_decode.paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), block_tables, context_lens)
ex_err16 = (ex_fp16.float() - ref).abs().max().item()
empty = context_lens.clone()
empty[0] = 0
ex_empty_kernel = triton_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, empty)[0]
ex_empty_ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, empty)[0]
assert (ex_empty_kernel == 0).all() and torch.isnan(ex_empty_ref).all(), "hint 4: the kernel writes 0, the reference NaN"

# %% [markdown]
# ## 本章小结
#
# - PagedAttention 把 KV Cache 切成固定大小的块，用块表记录逻辑顺序；Token $t$ 的槽位是
#   $\text{table}[\lfloor t/B \rfloor]\cdot B + t \bmod B$，执行器每步据此生成 `slot_mapping`。
# - 按需分块之后，外部碎片消失，内部碎片被限制在每条序列最后一块；按论文的口径，预留与碎片从连续预留时的大半
#   降到几个百分点以内（7.6 节）。
# - 块大小是一对取舍：大块浪费多、共享粒度粗；小块块表长、内核访存零碎。vLLM 在 CUDA 上默认 16（v0.9.2）。
# - 引用计数让多个序列安全地共享块：前缀缓存只共享写满的块（哈希链保证整个前缀相同）；
#   共享未写满的块（并行采样、束搜索）时需要写时复制。
# - 分页解码内核的核心只是“先查块表、再按偏移取数”，配合在线 Softmax 一次读完上下文；Split-KV 在序列少、上下文长时把一条序列拆给多个程序。
#
# 下一章（第 8 章）转向评估：TTFT、TPOT、吞吐、Goodput 等指标的精确定义，以及如何正确地压测一个推理服务。
#
# ## 练习
#
# 1. 在 7.2 的引擎上再加几个请求，直到 KV 池用尽，观察 `eng.steps[-1].num_preempted` 与块表的变化；被抢占的请求重新被调度时，
#    它的块表和之前一样吗？为什么？
# 2. 7.3 节的扫描用的是短请求。换成 `load_workload("chat", n={{N_CHAT}}, max_len={{CHAT_LEN}})`（长 Prompt），重新扫描块大小。
#    末块浪费的曲线变陡还是变缓？用“每条序列平均浪费约 $B/2$ 个槽位”解释。
# 3. 把 7.4 中 R5 的公共前缀改成 {{EX_SHARE}} 个 Token（不是 {{B}} 的倍数），R5 能命中几个块？为什么前缀缓存只共享写满的块？
# 4. 在 7.5 的内核对照实验里改用 `float16`，误差变成多少？再把一条序列的 `context_lens` 设成 0，两个实现的输出分别是什么？
# 5. （思考）`choose_split` 只在“上下文超过一个分区 **且** 序列数 × KV 头数少于 SM 数”时才启用 Split-KV。
#    为什么序列很多时拆分反而不划算？
# 6. （选做）设置 `attention_backend="triton"`，用 `LLM(model="tiny", ...)` 在解释器里生成几个 Token，
#    与 CPU 上默认的 C 内核后端（`attention_backend="cpu"`）以及纯 torch 后端（`"torch"`，先收集分页再做注意力）
#    比较输出是否一致（解释器会很慢）。
#
# <details><summary>提示与参考答案</summary>
#
# 1. 默认的抢占方式是重算（Recompute）：被抢占的请求释放全部块，重新调度时按空闲队列的顺序重新分配，
#    块表一般与之前不同；只要块表随之更新，逻辑顺序不变，输出就不变。开启前缀缓存时，它写满的块若还在缓存里，
#    会被直接命中（块号相同）。
# 2. 变缓：末块浪费每条序列约 $B/2$ 个槽位，与序列长度无关；序列越长，它占序列的比例 $\approx B/(2n)$ 越小。
# 3. 命中 {{ex_hit}} 个块（{{ex_hit * B}} 个 Token）：下一块只有 {{EX_SHARE % B}} 个 Token 相同，哈希不同。写满的块内容不再改变，共享它不需要写时复制；
#    未满的块还要被持有者继续写入。
# 4. float16 的最大误差约 {{ex_err16:.0e}}（输入与累加的舍入）；上下文为 0 时 Triton 内核输出 0（⑥ 中的特判），
#    参考实现对空序列做 softmax 得到 NaN（对零个分数求 softmax）——对照两者的代码即可确认。
# 5. 序列数 × KV 头数已经多于 SM 数时，每个 SM 都有活干，拆分只会多写一次部分结果、多跑一个归约内核。
# 6. 三者的贪心输出应逐 Token 相同（minibatch 的测试保证）；差别只在速度。
#
# </details>
