# %% [markdown]
# # 第 18 章 采样、停止条件与流式输出
#
# 前面的章节关心的是“一步里算哪些 Token”。本章走到一个请求的出口：模型给出下一个 Token 的 Logits 之后，
# **采样器**（Sampler）按请求的参数选出一个 Token；引擎在每个新 Token 之后检查**停止条件**（Stop Conditions）；
# 新 Token 被**增量反分词**（Incremental Detokenization）成文字，经 **SSE**（Server-Sent Events）流式推给客户端；
# 客户端断开时，引擎要立刻**中止**（Abort）这个请求、释放它的 KV 块——否则一个关掉浏览器标签的用户会继续占着批里的一个位置。
#
# 这些都是“小事”，却直接决定用户看到什么：温度和 top-p 的顺序不同，同样的参数会给出不同的分布；停止字符串跨两个 Token 时，
# 流式输出可能先把半个停止字符串发给了用户；逐 Token 解码中文会吐出乱码 `�`。本章在真实的 tiny 模型上把每一件都做一遍，
# 最后用官方的 `openai` Python 客户端访问由本 notebook 启动的 `minibatch serve`。
#
# ## 学习目标
#
# - 写出温度、min-p、top-k、top-p 的定义，说清 minibatch 与 vLLM v0.11.0 采样器的应用顺序（以及 Hugging Face `transformers` 的不同顺序），在真实 Logits 上看每一步之后的分布；
# - 理解逆 CDF 抽样与逐请求的随机种子为什么让带 `seed` 的请求不受同批其他请求影响；
# - 掌握全部停止条件：EOS、停止字符串（最早匹配、跨 Token）、`stop_token_ids`、`max_tokens`、`min_tokens`、`include_stop_str_in_output`，并能对照 vLLM 的行为；
# - 说明逐 Token 解码为什么会把中文与 emoji 变成 `�`，以及 `minibatch/tokenizer.py` 的两个偏移量怎样解决；
# - 读懂 SSE 的线格式（Wire Format）、“一个事件携带上次以来的全部 Token”的流式约定、停止字符串的扣留（Hold-back），并测量每个事件的 Token 间延迟；
# - 验证客户端断开后引擎中止请求、释放 KV；用 `openai` 客户端访问 `minibatch serve`。

# %%
import asyncio
import atexit
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import openai
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import minibatch
from minibatch import LLM, EngineConfig, LLMEngine, SamplingParams
from minibatch.engine import _find_stop
from minibatch.request import Request
from minibatch.sampler import apply_min_p, apply_top_k_top_p, sample
from minibatch.serving import server as mb_server
from minibatch.serving.async_engine import AsyncEngine
from minibatch.tokenizer import IncrementalDetokenizer
from minibatch.viz import md_table

torch.set_num_threads(1)

# %%
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Start `minibatch serve` now, in the background: it loads while the offline sections run (18.5 waits for it).
PORT = free_port()
BASE = f"http://127.0.0.1:{PORT}"
server_log = tempfile.TemporaryFile()                      # a file, not a pipe: a full pipe would block the server
server = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--model", "tiny", "--host", "127.0.0.1",
                           "--port", str(PORT), "--max-num-seqs", "16", "--uvicorn-log-level", "warning"],
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
                          stdout=server_log, stderr=subprocess.STDOUT)
atexit.register(lambda: server.poll() is None and server.kill())

llm = LLM("tiny")
tok = llm.tokenizer
print("minibatch", minibatch.__version__, "| openai", openai.__version__, "| server starting on", BASE)

# %% [markdown]
# ## 18.1 采样参数与它们的顺序
#
# 模型对下一个 Token 给出一行 Logits $z \in \mathbb{R}^V$。带温度 $T$ 的分布是 $p_i = e^{z_i/T} / \sum_j e^{z_j/T}$：
# $T<1$ 让分布更尖，$T>1$ 更平，$T \to 0$ 就是贪心（argmax；minibatch 与 vLLM 都把 $T < 10^{-5}$ 当作贪心）。然后是三种截断，每一种都把一部分 Token 的 Logit 设成 $-\infty$：
#
# - **min-p**：保留 $p_i \ge p_\min \cdot \max_j p_j$ 的 Token（阈值随最可能 Token 的概率浮动）；
# - **top-k**：只保留概率最大的 $k$ 个；
# - **top-p**（核采样，Nucleus Sampling）：按概率从大到小，保留最小的前缀集合 $S$，使 $\sum_{i \in S} p_i \ge p$——
#   等价地，一个 Token 被保留当且仅当**比它更可能的 Token 的总概率**小于 $p$。
#
# 截断之后对剩下的 Token 重新 Softmax，再抽一个。minibatch 的采样器（`minibatch/sampler.py`）按 vLLM V1 的顺序：
# 温度 → min-p → top-k → top-p → Softmax → 抽样；贪心行直接取 argmax；行与行之间互不影响：

# %%
print(inspect.getdoc(minibatch.sampler).split("\n\n")[0])
print(inspect.getsource(minibatch.sampler._draw))

# %% [markdown]
# 顺序是有后果的，因为 top-p 的累计概率是在**前面的截断之后重新归一化**的分布上算的。各家的顺序（均核对自源码）：
#
# | 实现（版本，源文件） | 顺序 |
# |---|---|
# | vLLM v0.11.0（`vllm/v1/sample/sampler.py` 的 `Sampler` 文档与 `sample`；top-k/top-p 在 `vllm/v1/sample/ops/topk_topp_sampler.py` 的 `apply_top_k_top_p`） | 先对**不保持 argmax** 的处理器（min_tokens、logit_bias）与惩罚项作用于原始 Logits；贪心行取 argmax；采样行：温度 → 保持 argmax 的处理器（默认即 min-p，`MinPLogitsProcessor`）→ top-k → top-p → 抽样 |
# | minibatch（`minibatch/sampler.py`） | min_tokens 掩码 → 贪心行 argmax；采样行：温度 → min-p → top-k → top-p → 逆 CDF 抽样（不支持惩罚项与 logit_bias，服务端收到非零值会拒绝） |
# | Hugging Face `transformers` 5.24.0（`generation/utils.py` 的 `_get_logits_processor`） | 温度 → top-k → top-p → min-p |
#
# 用 tiny 模型的真实 Logits 看一看。提示词是 “Once upon a time, there was a little”，下一个 Token 是一个名词，分布比较宽。
# 给模型的 `compute_logits` 包一层“旁听”（不改任何逻辑），取到采样器收到的那一行：

# %%
PROMPT = "Once upon a time, there was a little"
model = llm.engine.executor.model
seen_logits = []
compute_logits = model.compute_logits
model.compute_logits = lambda hidden: seen_logits.append(compute_logits(hidden)) or seen_logits[-1]
llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))
model.compute_logits = compute_logits                      # stop listening
z = seen_logits[-1][-1:].float()                            # the last row: the prompt's next token
vocab = z.shape[-1]

T, MIN_P, TOP_K, TOP_P = 1.5, 0.05, 8, 0.8
stages = {"raw (T=1)": z, f"T={T}": z / T}
stages[f"+ min_p={MIN_P}"] = apply_min_p(stages[f"T={T}"], [MIN_P])
stages[f"+ top_k={TOP_K}"] = apply_top_k_top_p(stages[f"+ min_p={MIN_P}"], [TOP_K], [1.0])
stages[f"+ top_p={TOP_P}"] = apply_top_k_top_p(stages[f"+ top_k={TOP_K}"], [-1], [TOP_P])
probs = {name: torch.softmax(v, dim=-1)[0] for name, v in stages.items()}
support = {name: int(torch.isfinite(v).sum()) for name, v in stages.items()}
order = probs["raw (T=1)"].argsort(descending=True)[:14]
labels = [repr(tok.decode([int(i)]))[1:-1] for i in order]

fig, axes = plt.subplots(1, len(stages), figsize=(13, 2.9), sharey=True)
for ax, (name, p) in zip(axes, probs.items()):
    ax.bar(range(len(order)), p[order].numpy(), color=["C0" if p[i] > 0 else "0.85" for i in order])
    ax.set_title(f"{name}\n{support[name]} tokens left", fontsize=8)
    ax.set_xticks(range(len(order)), labels, rotation=90, fontsize=7)
axes[0].set_ylabel("probability")
fig.suptitle(f"Next token after {PROMPT!r}: each filter in the sampler's order (14 most likely tokens shown)", fontsize=9)
plt.tight_layout()
plt.show()
sizes = list(support.values())
assert sizes[0] == sizes[1] == vocab and sizes[1] > sizes[2] > sizes[3] > sizes[4] > 1, "each filter cuts some tokens"

# %% [markdown]
# 原始分布里最可能的是 {{labels[0]!r}}（{{probs["raw (T=1)"][order[0]].item():.0%}}），词表共 {{vocab}} 个 Token，每一个的概率都大于 0。
# 温度 {{T}} 把分布压平，{{labels[0]!r}} 降到 {{probs[f"T={T}"][order[0]].item():.0%}}（温度不截断任何 Token）；min-p 只留下
# {{support[f"+ min_p={MIN_P}"]}} 个 Token，top-k 再留下 {{support[f"+ top_k={TOP_K}"]}} 个，top-p 最后留下 {{support[f"+ top_p={TOP_P}"]}} 个。
#
# 图上的分布是采样器自己的函数一步一步算出来的；它真的是 `sample` 抽样时用的分布吗？用同一行 Logits 抽 4000 次（每行一个请求，
# 全局随机数先设种子），比较经验频率与最后一幅图的概率：

# %% tags=["nbval-check-output"]
N_DRAWS = 4000
params = SamplingParams(temperature=T, min_p=MIN_P, top_k=TOP_K, top_p=TOP_P)
rows = [Request(str(i), [1], params, 0.0) for i in range(N_DRAWS)]
torch.manual_seed(0)
draws = torch.tensor(sample(z.repeat(N_DRAWS, 1), rows))
freq = torch.bincount(draws, minlength=vocab).float() / N_DRAWS
final = probs[f"+ top_p={TOP_P}"]
tv = 0.5 * (freq - final).abs().sum().item()
outside = int((final[draws] == 0).sum())
print(f"{N_DRAWS} draws: {len(draws.unique())} distinct tokens, {outside} outside the kept set; "
      f"total variation distance to the filtered distribution below 0.03: {tv < 0.03}")
assert outside == 0 and tv < 0.03, "the prose says the draws follow the filtered distribution"

# %% [markdown]
# {{N_DRAWS}} 次抽样只出现了 {{len(draws.unique())}} 个不同的 Token，没有一个落在被截掉的集合里；经验分布与过滤后的分布的
# 总变差距离（Total Variation Distance）是 {{tv:.3f}}，在 {{N_DRAWS}} 次抽样的统计误差之内。
#
# 抽样本身是**逆 CDF 抽样**（Inverse-CDF Sampling）：每行一个均匀随机数 $u \in [0, 1)$，取累计概率第一个超过 $u$ 的 Token
# （`draw_inverse_cdf`，累加在 float64 里做）。被截掉的 Token 概率为 0，在 CDF 上占一段空区间，永远抽不到。
#
# 换一种顺序会怎样？把同样的参数（这里用更宽的 top-k = 50、top-p = 0.9）按 `transformers` 的顺序（min-p 放在最后）应用，
# 用的仍是 minibatch 自己的两个函数，只是调用顺序不同：

# %% tags=["nbval-check-output"]
zt = z / 0.8
vllm_order = apply_top_k_top_p(apply_min_p(zt, [0.05]), [50], [0.9])       # min-p first (vLLM, minibatch)
hf_order = apply_min_p(apply_top_k_top_p(zt, [50], [0.9]), [0.05])         # min-p last (transformers 5.24.0)
kept_v, kept_h = set(torch.isfinite(vllm_order)[0].nonzero().flatten().tolist()), \
    set(torch.isfinite(hf_order)[0].nonzero().flatten().tolist())
extra = sorted(kept_h - kept_v)
print(f"T=0.8, min_p=0.05, top_k=50, top_p=0.9: vLLM order keeps {len(kept_v)} tokens, transformers order {len(kept_h)}; "
      f"only in the latter: {[tok.decode([t]) for t in extra]}")
assert kept_v < kept_h, "the prose says min-p first keeps a strict subset here"

# %% [markdown]
# 先做 min-p，剩下的 Token 重新归一化后每个都“更重”，top-p 的累计概率更快达到 0.9，于是少留了 {{len(extra)}} 个 Token
# （{{[tok.decode([t]) for t in extra]}}）。同样的 `min_p`、`top_p`，在 vLLM 与 `transformers` 上不是同一个分布——
# 迁移采样参数时要记住这一点。
#
# ## 18.2 种子与可复现
#
# 带 `seed` 的请求有**自己的**随机数生成器（`Request.generator`，一个 `torch.Generator`），每生成一个 Token 从中取一个 float64 的 $u$；
# 不带种子的行共用全局生成器。所以一个带种子的请求，无论和谁同批、排在第几行，抽到的 Token 序列都一样：

# %% tags=["nbval-check-output"]
def seeded(seed):
    return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=seed)


alone = llm.generate([PROMPT], seeded(7))[0].outputs[0].token_ids
crowd = llm.generate([PROMPT] * 4 + ["Tom found a box", "小明和他的狗"],
                     [seeded(1), seeded(2), seeded(7), seeded(3), seeded(4), seeded(5)])
in_crowd = crowd[2].outputs[0].token_ids
torch.manual_seed(0)
unseeded = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 2, SamplingParams(temperature=1.0, top_p=0.9,
                                                                                      max_tokens=12))]
print("seed 7 alone      :", tok.decode(alone))
print("seed 7 in a batch :", tok.decode(in_crowd), "| identical:", alone == in_crowd)
print("two unseeded requests in one batch differ:", unseeded[0] != unseeded[1])
assert alone == in_crowd and unseeded[0] != unseeded[1], "the prose says seeded draws ignore the batch"

# %% [markdown]
# 注意“同一个种子”只在同一个实现里可复现。vLLM v0.11.0 不用逆 CDF：它的 `random_sample`（`vllm/v1/sample/ops/topk_topp_sampler.py`）
# 给每个 Token 抽一个指数分布的 $q_i$，取 $\arg\max_i p_i / q_i$（与按 $p$ 抽样同分布，但不需要 CPU 与 GPU 同步），
# 同样的种子在 vLLM 与 minibatch 上给出不同的 Token；换 GPU 型号、换批大小导致的浮点差异也可能改变 Logits 的末位，从而改变抽样结果。
#
# ## 18.3 停止条件
#
# 每个新 Token 追加到请求上之后，引擎（`LLMEngine._append_token`）依次检查：

# %%
src = inspect.getsource(LLMEngine._append_token).splitlines()
i = next(k for k, line in enumerate(src) if "status = None" in line)
print("\n".join(src[i:]))
print(inspect.getsource(_find_stop))

# %% [markdown]
# | 条件 | 参数 | 结束原因 `finish_reason` / `stop_reason` | 输出文本 |
# |---|---|---|---|
# | EOS（模型的结束 Token） | `ignore_eos=False`（默认） | `stop` / `None` | 不含 EOS |
# | 停止 Token | `stop_token_ids` | `stop` / 那个 Token 的 id | 不含它，除非 `include_stop_str_in_output` |
# | 停止字符串 | `stop` | `stop` / 命中的字符串 | 截在它之前，除非 `include_stop_str_in_output` |
# | 长度 | `max_tokens`；提示词 + 输出达到 `max_model_len` | `length` / `None` | 全部 |
# | 最少 Token 数 | `min_tokens` | 之前不允许停：采样器把 EOS 与 `stop_token_ids` 的 Logit 设为 $-\infty$（贪心行也是），停止字符串要结束在第 `min_tokens` 个 Token 之后 | |
#
# 这些都是 vLLM 的参数名与语义（`vllm/sampling_params.py`，v0.11.0；停止字符串在 `vllm/v1/engine/detokenizer.py`，
# `min_tokens` 对停止字符串的规则见同一文件的 `update`）。在 tiny 模型上用贪心解码把每一条走一遍。
# 提示词是“从前，有一只小猫”，不加任何停止条件时的输出是第一行：

# %% tags=["nbval-check-output"]
STORY = "从前，有一只小猫"
PERIOD = tok.encode("。", add_special_tokens=False)[0]


def greedy(**kw):
    kw.setdefault("max_tokens", 24)
    return SamplingParams(temperature=0.0, **kw)


STOP_CASES = {
    "no stop condition": greedy(),
    "max_tokens=5": greedy(max_tokens=5),
    f"stop_token_ids=[{PERIOD}] ('。')": greedy(stop_token_ids=[PERIOD]),
    "... + include_stop_str_in_output": greedy(stop_token_ids=[PERIOD], include_stop_str_in_output=True),
    "... + min_tokens=10": greedy(stop_token_ids=[PERIOD], min_tokens=10),
    "stop=['花花。']": greedy(stop=["花花。"]),
    "stop=['花花。'] + include_stop_str_in_output": greedy(stop=["花花。"], include_stop_str_in_output=True),
    "stop=['。'] + min_tokens=8": greedy(stop=["。"], min_tokens=8),
    "stop=['一天', '有一天']": greedy(stop=["一天", "有一天"]),
}
stop_out = {name: o.outputs[0] for name, o in zip(STOP_CASES, llm.generate([STORY] * len(STOP_CASES),
                                                                          list(STOP_CASES.values())))}
for name, c in stop_out.items():
    print(f"{name:<46} {c.finish_reason:<6} {str(c.stop_reason):<6} {len(c.token_ids):>2} tokens  {c.text!r}")

# %%
base_ids = stop_out["no stop condition"].token_ids
first_period = base_ids.index(PERIOD) + 1                       # 1-based position of the first '。'
min10 = stop_out["... + min_tokens=10"]
earliest = stop_out["stop=['一天', '有一天']"]
full_text = stop_out["no stop condition"].text
list_order_cut = full_text[:full_text.find("一天")]        # vLLM's rule: the first string of the list that is found

# %% tags=["check"]
assert stop_out[f"stop_token_ids=[{PERIOD}] ('。')"].token_ids == base_ids[:first_period]
assert min10.token_ids[:5] == base_ids[:5] and min10.token_ids[5] != PERIOD and len(min10.token_ids) > 10
assert stop_out["stop=['花花。']"].text == "，名叫" and stop_out["stop=['一天', '有一天']"].stop_reason == "有一天"
assert earliest.text == full_text[:full_text.find("有一天")] != list_order_cut, "the two rules cut differently here"

# %% [markdown]
# 逐行看：
#
# - 停止 Token `。`（id {{PERIOD}}）是第 {{first_period}} 个 Token，请求在那里结束，文本里不含它；加上 `include_stop_str_in_output` 就含它。
# - `min_tokens=10` 时，前 10 个 Token 里**不可能**出现 `。`：采样器把它的 Logit 设成 $-\infty$，贪心于是在第 {{first_period}} 个位置选了别的 Token，
#   输出从那里开始与原来分岔，直到第 {{len(min10.token_ids)}} 个 Token 才遇到 `。`。这与“先生成、再忽略”不同——它改变了生成的内容。
# - 停止字符串 `花花。` 跨了三个 Token（`花`、`花`、`。`），直到 `。` 生成的那一刻才完整出现；文本截在它之前。
# - 停止字符串 `。` 配 `min_tokens=8`：第一个 `。` 在第 {{first_period}} 个 Token，不到 8 个，不算；停在下一个 `。`。
#
# **最早匹配**（Earliest Match）。最后一行给了两个停止字符串 `["一天", "有一天"]`。Token `天` 到来时，两个字符串**同时**第一次完整出现，
# 而且互相重叠。minibatch 的 `_find_stop` 取**起点最早**的那个（`有一天`），文本截成 {{earliest.text!r}}；
# vLLM v0.11.0 的 `check_stop_strings`（`vllm/v1/engine/detokenizer.py`）按**列表顺序**找、返回第一个找到的（`一天`），
# 按这段代码，同样的请求在 vLLM 上会截成 `{{list_order_cut!r}}`。两条规则只在多个停止字符串在同一步里完成时才有差别；最早匹配的结果不依赖你把停止字符串按什么顺序写。
#
# **EOS。** tiny 模型的对话模板是 ChatML，模型答完会生成 `<|im_end|>`（它在模型的 EOS 列表里）。`ignore_eos=True` 让生成越过它一直到 `max_tokens`：

# %% tags=["nbval-check-output"]
chat_prompt = tok.apply_chat_template([{"role": "user", "content": "What is your name?"}], tokenize=False,
                                      add_generation_prompt=True)
eos_ids = llm.engine.eos_token_ids
for ignore in (False, True):
    c = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=ignore))[0].outputs[0]
    print(f"ignore_eos={ignore!s:<5}: {c.finish_reason}, {len(c.token_ids)} tokens, EOS among them: "
          f"{any(t in eos_ids for t in c.token_ids)}, text {c.text[:70]!r}")
    if not ignore:
        assert c.finish_reason == "stop" and c.stop_reason is None and c.token_ids[-1] in eos_ids

# %% [markdown]
# ## 18.4 增量反分词：为什么逐 Token 解码会出乱码
#
# tiny 模型的分词器是字节级 BPE（Byte-level BPE）：词表的基础是 256 个**字节**，常见的汉字合并成了一个 Token，
# 不常见的字（以及 emoji）则被拆成几个 Token，每个 Token 只是某个字的 UTF-8 编码的**一部分字节**。
# 单独解码这样一个 Token，得到的是一段不完整的 UTF-8，解码器只能输出替换字符 U+FFFD（`�`）。下表逐个 Token 列出：
# Token 携带的字节、单独解码的结果、以及 `IncrementalDetokenizer.push` 返回的新文本：

# %%
def token_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level BPE token string (GPT-2's bytes_to_unicode table, inverted)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    table = dict(zip(map(chr, printable + [256 + i for i in range(len(others))]), printable + others))
    return bytes(table[ch] for ch in token)


TEXT = "小猫喝咖啡，说：喵！😀"
ids = tok.encode(TEXT, add_special_tokens=False)
detok = IncrementalDetokenizer(tok)
table, naive = [], []
for t in ids:
    piece = detok.push(t)
    naive.append(tok.decode([t]))
    table.append([t, token_bytes(tok.convert_ids_to_tokens(t)).hex(" "), repr(naive[-1]), repr(piece)])
md_table(["token id", "bytes (hex)", "decode([id]) alone", "push(id) returns"], table)

# %%
print("token by token :", "".join(naive))
print("incremental    :", detok.text)
assert detok.text == TEXT and "\ufffd" in "".join(naive), "the prose says naive decoding breaks and push does not"
split_chars = {ch: len(tok.encode(ch, add_special_tokens=False)) for ch in ("咖", "😀")}
assert split_chars == {"咖": 2, "😀": 4}, "the prose says how many tokens these characters take"
print(inspect.getsource(IncrementalDetokenizer.push))

# %% [markdown]
# {{len(TEXT)}} 个字符编码成 {{len(ids)}} 个 Token：`咖` 的三个字节 `{{"咖".encode().hex(" ")}}` 分在 {{split_chars["咖"]}} 个 Token 里，
# emoji `😀` 的四个字节 `{{"😀".encode().hex(" ")}}` 分在 {{split_chars["😀"]}} 个 Token 里。
# 逐个解码拼起来是乱码；`IncrementalDetokenizer`（`minibatch/tokenizer.py`）保留两个偏移量：`prefix_offset` 之前的 Token 已经定稿，
# 每次把 `[prefix_offset, read_offset)` 与 `[prefix_offset, 末尾)` 各解码一次，后者比前者多出来的部分就是新文本；
# 如果新文本以 `�` 结尾，说明最后一个字还没凑齐，先**扣住**不发，等下一个 Token。vLLM 的“慢速”反分词器
# （`detokenize_incrementally`，`vllm/transformers_utils/detokenizer_utils.py`）用的是同样的两个偏移量；v0.11.0 对快速分词器改用
# `tokenizers` 库的 `DecodeStream`（`FastIncrementalDetokenizer`，`vllm/v1/engine/detokenizer.py`）。
#
# 两者还有一个共同点：解码从**提示词末尾的几个 Token** 开始（vLLM 取 4 到 23 个里最短的、能完整解码的一段）。原因是 SentencePiece 类的分词器
# （Llama-2、Mistral）单独解码时会去掉第一个词的前导空格：输出的第一个 Token 是 `▁world` 时，单独解码得到 `world`，接在提示词 `hello` 后面才是 ` world`。
# 写作本章时发现 minibatch 原来只解码输出，会丢掉这个空格；现在 `IncrementalDetokenizer` 与引擎的 `final_text` 都先用 `prompt_context`
# 取出这段上下文（`tests/test_tokenizer.py` 用一个这样的分词器检查）。tiny 的字节级 BPE 把空格编码进 Token 本身（`Ġ`），不受影响：
#
# %%
print(inspect.getsource(minibatch.tokenizer.prompt_context))

# %% [markdown]
# 每次 `push` 只解码从 `prefix_offset` 开始的几个 Token，代价不随输出变长而增长。它的正确性是一条可以在很多文本上检查的性质：
# **对任何文本，逐个 `push` 得到的文字拼起来等于整段解码，而且中途从不发出 `�`。** 让 `hypothesis` 从中英文、生僻字与 emoji 的字母表里生成文本来检查：

# %%
ALPHABET = "从前有一只小猫名叫花Once upon a time,.!? 咖啡喵鹦鹉蝴蝶龘é😀🐱"
detok_cases = []


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.text(alphabet=ALPHABET, min_size=1, max_size=24))
def detok_property(text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces), text
    detok_cases.append(sum(p == "" for p in pieces))


detok_property()
print(f"{len(detok_cases)} texts: pieces always join to the full decode; {sum(n > 0 for n in detok_cases)} of them "
      f"had tokens held back ({sum(detok_cases)} held-back tokens in all)")
assert len(detok_cases) >= 50 and sum(detok_cases) > 0

# %% [markdown]
# 引擎只在需要文字时才反分词：请求有停止字符串（要在文字上找），或者引擎在服务端运行（`AsyncEngine` 打开 `stream_text`）。
# 请求结束时引擎再整段解码一次（`final_text`），把可能还扣着的半个字补上。
#
# ## 18.5 SSE：流式输出的线格式
#
# `minibatch serve`（与 OpenAI、vLLM 一样）用 **SSE** 推流：响应头是 `Content-Type: text/event-stream`，
# 每个事件是一行 `data: <JSON>` 加一个空行（WHATWG HTML Living Standard 的 *Server-sent events* 一节规定：空行结束一个事件），
# 最后一个事件是 `data: [DONE]`（OpenAI 的约定；vLLM v0.11.0 的 `vllm/entrypoints/openai/serving_completion.py` 也这样收尾）。
# 服务已经在后台启动了，等它就绪（有时限），然后看一个真实响应的原始字节：

# %% tags=["nbval-ignore-output"]
def wait_healthy(timeout_s=120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if server.poll() is not None:
            server_log.seek(0)
            raise RuntimeError(f"server exited with {server.returncode}: {server_log.read().decode()[-2000:]}")
        try:
            if httpx.get(BASE + "/health", timeout=1.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"minibatch serve not healthy after {timeout_s} s")


print(f"server healthy (waited {wait_healthy():.1f} s more)")
body = {"model": "tiny", "prompt": STORY, "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
with httpx.stream("POST", BASE + "/v1/completions", json=body, timeout=30) as resp:
    content_type = resp.headers["content-type"]
    raw = b"".join(resp.iter_raw()).decode()
print("Content-Type:", content_type)
print(raw)

# %%
events = [e for e in raw.split("\n\n") if e]
chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
streamed_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

# %% tags=["check"]
assert content_type.startswith("text/event-stream") and events[-1] == "data: [DONE]"
assert all(e.startswith("data: ") for e in events) and streamed_text == stop_out["max_tokens=5"].text
assert chunks[-1]["usage"]["completion_tokens"] == 5

# %% [markdown]
# 每个内容事件是一个 `text_completion` 块（对话接口是 `chat.completion.chunk`，文字在 `delta.content` 里），
# 拼起来正是 18.3 节离线得到的 {{streamed_text!r}}；最后一个内容块带上 `finish_reason`，
# `stream_options.include_usage` 让服务在 `[DONE]` 之前再发一个只有 `usage` 的块。
#
# **流式约定：一个事件携带上次事件以来的全部 Token。** 引擎线程每步把新文本追加到请求的流上，发事件的协程每次运行时取走积攒的全部内容
# （`minibatch/serving/server.py` 模块文档；vLLM V1 的 `RequestOutputCollector` 在 `vllm/v1/engine/output_processor.py` 里也这样合并增量）。
# 读得及时，一步一个事件；读得慢，事件更少、更大，但不丢、不重、不乱序。在进程内用 `AsyncEngine`（服务端用的同一个类）演示：
# 同一个请求读两遍，一个读者每拿到一个增量就立刻要下一个，另一个每次停 50 ms：

# %% tags=["nbval-ignore-output"]
def run_async(coro, timeout_s=60.0):
    """Run ``coro`` on its own event loop in a thread (the notebook's loop is busy), with a deadline."""
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("result", asyncio.run(asyncio.wait_for(coro, timeout_s))),
                          daemon=True)
    th.start()
    th.join(timeout_s + 5)
    if "result" not in box:
        raise TimeoutError("the asyncio run did not finish in time")
    return box["result"]


ae = AsyncEngine(LLM("tiny").engine)


async def read_stream(request_id, params, pause_s=0.0, prompt=STORY):
    stream = await ae.add_request(prompt, params, request_id)
    deltas = []
    async for d in stream:
        deltas.append((time.perf_counter(), d.text, list(d.token_ids), d.finish_reason))
        if pause_s:
            await asyncio.sleep(pause_s)
    return deltas


LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
fast = run_async(read_stream("fast", LONG))
slow = run_async(read_stream("slow", LONG, pause_s=0.05))
per_event = {name: [len(d[2]) for d in ds] for name, ds in (("prompt reader", fast), ("50 ms reader", slow))}
for name, sizes in per_event.items():
    print(f"{name}: {len(sizes)} deltas, tokens per delta {sizes}")
same = "".join(d[1] for d in fast) == "".join(d[1] for d in slow) and sum(per_event["50 ms reader"]) == 40
print("same text and 40 tokens either way:", same)
assert same and len(slow) < len(fast), "the prose says a slow reader gets fewer, larger deltas and the same tokens"

# %% [markdown]
# 慢的读者拿到的增量更少、每个更大，文字与 Token 一个不差（具体的分组取决于机器当时的快慢，上面的输出不做比对）。
# 这对测量有直接影响：按事件计时的 Token 间延迟（ITL）测的是**事件**之间的间隔；数 Token 要看 `usage.completion_tokens`，不要数事件。
#
# **停止字符串的扣留。** 流式输出里还有一个陷阱：停止字符串可能跨几个 Token 才完整，而文字已经先发出去了。服务端因此扣住文本末尾
# 最长停止字符串长度减 1 个字符，确认它们不会成为停止字符串的开头才发（`AsyncEngine._deliver`；vLLM v0.11.0 的 `stop_buffer_length`
# 也是 `max(len(s)) - 1`，在 `vllm/v1/engine/detokenizer.py`）：

# %%
src = inspect.getsource(AsyncEngine._deliver).splitlines()
i = next(k for k, line in enumerate(src) if "hold back what may become a stop string" in line)
print("\n".join(src[i:i + 3]))
held = run_async(read_stream("held", SamplingParams(temperature=0.0, max_tokens=24, stop=["花花。"])))
print("deltas (text, token ids, finish_reason):", [(d[1], d[2], d[3]) for d in held])
assert "花" not in "".join(d[1] for d in held) and held[-1][3] == "stop", "no part of the stop string was sent"
ae.shutdown()

# %% [markdown]
# 停止字符串 `花花。` 长 3 个字符，所以每次扣住最后 2 个。读得及时时（一步一个增量）：第一个 `花` 生成时文本是 `，名叫花`，只发出了 `，名`；
# 第二个 `花` 之后发出 `叫`；`。` 到来时整串命中，文本被截成 `，名叫`，扣着的 `花花` 从未离开服务器。没有扣留的话，客户端会先看到 `花花`，再无从撤回。
#
# ### 流式时间线：每个事件的 Token 间延迟
#
# 用官方 `openai` 客户端流式请求。先单独一个请求，再 8 个请求同时发（每个一个线程），记下每个事件到达的时刻。
# 这里是墙钟时间，取决于机器负载（输出不做比对），但结构是确定的：每个请求的事件数、每个事件的 Token 数、最后的 `usage`。

# %% tags=["nbval-ignore-output"]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=60)


def timed_stream(prompt, max_tokens=48, seed=None):
    """(send time, [(arrival time, text, tokens in the event)], usage) of one streamed completion; ``logprobs=0``
    makes each event list its tokens (``logprobs.tokens``), so an event that carries several can be counted."""
    t0 = time.perf_counter()
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed,
                                       stream=True, stream_options={"include_usage": True}, logprobs=0,
                                       extra_body={"ignore_eos": True})
    arrivals, usage = [], None
    for chunk in stream:
        if chunk.choices:
            c = chunk.choices[0]
            arrivals.append((time.perf_counter(), c.text, len(c.logprobs.tokens)))
        if chunk.usage is not None:
            usage = chunk.usage
    return t0, arrivals, usage

# %%
solo = timed_stream(PROMPT, seed=1)
results = [None] * 8
threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, timed_stream(PROMPT, seed=10 + k)))
           for k in range(8)]
for th in threads:
    th.start()
for th in threads:
    th.join(120)
assert all(r is not None and r[2].completion_tokens == 48 for r in [solo, *results]), "every stream got its 48 tokens"

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
for k, (t0, arr, usage) in enumerate([solo] + results):
    ts = np.array([a for a, *_ in arr]) - t0
    ax1.step(ts, np.arange(1, len(ts) + 1), where="post", color="k" if k == 0 else "C1", lw=1.5 if k == 0 else 0.8,
             label="alone" if k == 0 else ("8 at once" if k == 1 else None))
itl_solo = np.diff([a for a, *_ in solo[1]]) * 1e3
itl_crowd = np.concatenate([np.diff([a for a, *_ in r[1]]) * 1e3 for r in results])
ax1.set(xlabel="seconds since the request was sent", ylabel="events received", title="Streaming timeline (SSE events)")
ax1.legend(fontsize=8)
ax2.hist(itl_solo, bins=30, alpha=0.7, density=True, label=f"alone: p50 {np.median(itl_solo):.1f} ms")
ax2.hist(itl_crowd, bins=30, alpha=0.6, density=True, label=f"8 at once: p50 {np.median(itl_crowd):.1f} ms")
ax2.set(xlabel="gap between consecutive events (ms)", ylabel="density", title="Inter-token latency per SSE event")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()
events_per_stream = [len(r[1]) for r in [solo, *results]]
print(f"events per stream: {events_per_stream} (48 tokens each); TTFT alone {(solo[1][0][0] - solo[0]) * 1e3:.0f} ms; "
      f"ITL p50/p90 alone {np.median(itl_solo):.1f}/{np.percentile(itl_solo, 90):.1f} ms, "
      f"8 at once {np.median(itl_crowd):.1f}/{np.percentile(itl_crowd, 90):.1f} ms")

# %% [markdown]
# 8 个请求同时流式时，它们在引擎里同批解码：每一步更长一点（批更大），每个请求的事件间隔随之变长——这就是第 5 章连续批处理在客户端看到的样子。
# 事件数可能略少于 48：读得慢的那一刻，几个 Token 并进了一个事件。
#
# **按事件的 ITL 与按 Token 的 ITL。** 一个携带 $k$ 个 Token、与上一个事件相隔 $g$ 的事件，按事件算是一个间隔 $g$，
# 按 Token 算是 $k$ 个间隔 $g/k$（把事件的间隔平分给它带来的 Token）。事件合并的地方，前者偏大、后者把合并摊开；
# 合并可能出现在任何事件上，包括**第一个事件**：第一个 Token 由预填充步产生，响应头、第一次写出要等发事件的协程被调度，
# 冷启动或机器繁忙时这段时间里引擎已经又解码了一两步，它们就一起出现在第一个事件里（18.5 节的“一个事件携带上次以来的全部 Token”）。
# 每个事件的 `logprobs.tokens` 列出它带的 Token（请求里设 `logprobs=0`），下面据此把两种 ITL 都算出来：

# %%
def per_token_itl(arrivals):
    """Each event's gap to the previous one, split evenly over the tokens the event carries."""
    return np.concatenate([[(b - a) / k * 1e3] * k for (a, *_), (b, _, k) in zip(arrivals, arrivals[1:])])


streams = [solo, *results]
first_tokens = [r[1][0][2] for r in streams]
merged = sum(1 for r in streams for _, _, k in r[1] if k > 1)
tok_crowd = np.concatenate([per_token_itl(r[1]) for r in results])
md_table(["8 at once (ms)", "p50", "p90", "p99", "gaps"],
         [["per event", f"{np.median(itl_crowd):.1f}", f"{np.percentile(itl_crowd, 90):.1f}",
           f"{np.percentile(itl_crowd, 99):.1f}", len(itl_crowd)],
          ["per token", f"{np.median(tok_crowd):.1f}", f"{np.percentile(tok_crowd, 90):.1f}",
           f"{np.percentile(tok_crowd, 99):.1f}", len(tok_crowd)]])
print(f"tokens in the first event of each stream: {first_tokens}; events carrying more than one token: {merged}")

# %% tags=["check"]
assert all(sum(k for *_, k in r[1]) == 48 for r in streams), "the events' token lists add up to the 48 tokens"
assert len(tok_crowd) == sum(48 - r[1][0][2] for r in results), "one per-token gap per token after the first event"

# %% [markdown]
# 这一次，{{len(streams)}} 个流的第一个事件分别带了 {{first_tokens}} 个 Token，全部事件中有 {{merged}} 个带了不止一个 Token。
# 数 Token 的间隔时，事件合并不会让 p99 虚高；数事件的间隔时，一个合并的事件既是一个长间隔、又“吃掉”了几个短间隔。
# 压测工具报告 ITL 时要说明是哪一种（第 8 章）：vLLM v0.11.0 的 `vllm bench serve` 在 `vllm/benchmarks/lib/endpoint_request_func.py` 里每收到一个流式事件记一个 `output.itl`（按事件），而 `vllm/benchmarks/serve.py` 的 TPOT 是 `(latency - ttft) / (output_len - 1)`（按 Token 平均）；
# `vllm:inter_token_latency_seconds` 在服务端按**每次输出**记录，
# 一次输出带多个 Token（例如投机解码）时同样会比逐 Token 的间隔大（vLLM 的 PR #52853 提议为此改写它的说明文字，2026-08 提出，尚未合并）。
#
# ## 18.6 客户端断开：中止请求、释放 KV
#
# 先在引擎层面看“中止”做了什么。虚拟时钟下的引擎，一个请求解码几步后被中止：

# %% tags=["nbval-check-output"]
eng = LLMEngine(EngineConfig.from_kwargs(model="tiny", block_size=16, num_kv_blocks=64), clock="virtual")
eng.add_request(STORY, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), request_id="gone")
for _ in range(40):
    eng.step()
used_before = eng.kv.num_used_blocks
aborted = eng.abort_request("gone")
req = eng.requests["gone"]
print(f"after 40 steps: {req.num_output_tokens} tokens, {used_before} KV blocks in use")
print(f"abort_request -> {aborted}; status {req.status.value}; KV blocks in use now: {eng.kv.num_used_blocks}; "
      f"unfinished requests: {eng.has_unfinished_requests()}")
assert aborted and eng.kv.num_used_blocks == 0 and req.status.value == "abort"
eng.kv.check_invariants()

# %% [markdown]
# `abort_request` 把请求标成 `abort`，从调度器里移除并释放它的全部 {{used_before}} 个块（`LLMEngine._finish` → `Scheduler.remove`）。
# 服务端要做的，是**发现**客户端已经走了。minibatch 在两处做这件事（`minibatch/serving/server.py`）：流式响应的事件生成器结束时
# （客户端断开，Starlette 取消这个生成器），`finally` 里对还没结束的请求调用 `engine.abort`；非流式请求则每隔一小段时间检查
# `request.is_disconnected()`。vLLM v0.11.0 的做法类似：`AsyncLLM.generate`（`vllm/v1/engine/async_llm.py`）在被取消时
# （`asyncio.CancelledError`）调用 `abort`，非流式的路由用 `with_cancellation`（`vllm/entrypoints/utils.py`）监听 `http.disconnect`。

# %%
src = inspect.getsource(mb_server.sse_events).splitlines()
i = next(k for k, line in enumerate(src) if line.strip() == "finally:")
print("\n".join(src[i:]))

# %% [markdown]
# 在真实的服务上验证：发一个要生成 900 个 Token 的流式请求，读 5 个事件后关掉连接，然后（有时限地）轮询 `/metrics`，
# 直到 KV 块归零。`minibatch:kv_cache_used_blocks` 是 minibatch 的指标，`vllm:request_success_total{finished_reason="abort"}` 与 vLLM 同名：

# %% tags=["nbval-ignore-output"]
def metric(name, **labels):
    """One sample of the server's /metrics page, read with prometheus_client's parser."""
    page = httpx.get(BASE + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(page):
        for sample_ in family.samples:
            if sample_.name == name and all(sample_.labels.get(k) == v for k, v in labels.items()):
                return sample_.value
    raise KeyError(name)


aborts_before = metric("vllm:request_success_total", finished_reason="abort")
body = {"model": "tiny", "prompt": STORY, "max_tokens": 900, "ignore_eos": True, "stream": True}
with httpx.stream("POST", BASE + "/v1/completions", json=body, timeout=30) as resp:
    lines = resp.iter_lines()              # keep the iterator: dropping it would already close the connection
    got = []
    while len(got) < 5:
        line = next(lines)
        if line.startswith("data:"):
            got.append(line)
    blocks_streaming = metric("minibatch:kv_cache_used_blocks")
t_close = time.monotonic()                      # leaving the with-block closed the connection
while time.monotonic() - t_close < 10 and metric("minibatch:kv_cache_used_blocks") > 0:
    time.sleep(0.05)
freed_after = time.monotonic() - t_close
blocks_after = metric("minibatch:kv_cache_used_blocks")
aborts_after = metric("vllm:request_success_total", finished_reason="abort")
print(f"read {len(got)} events; KV blocks in use while streaming: {blocks_streaming:.0f}; after closing: {blocks_after:.0f} "
      f"(within {freed_after * 1e3:.0f} ms); aborted requests +{aborts_after - aborts_before:.0f}")
assert blocks_streaming > 0 and blocks_after == 0 and aborts_after == aborts_before + 1, "the disconnect freed the KV"

# %% [markdown]
# ## 18.7 官方 `openai` 客户端
#
# `minibatch serve` 说 OpenAI 的 HTTP 协议，所以官方客户端只要换一个 `base_url`。OpenAI 协议之外的参数（vLLM 的扩展：
# `top_k`、`min_p`、`min_tokens`、`stop_token_ids`、`ignore_eos`、`include_stop_str_in_output`……）放在 `extra_body` 里，
# 与访问 vLLM 时完全一样。贪心解码的结果必须与离线的 `LLM.generate` 相同：

# %% tags=["nbval-check-output"]
completion = client.completions.create(model="tiny", prompt=STORY, max_tokens=24, temperature=0, stop=["一天", "有一天"])
chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is your name?"}],
                                      max_tokens=30, temperature=0)
offline_chat = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
with_ext = client.completions.create(model="tiny", prompt=STORY, max_tokens=24, temperature=0,
                                     extra_body={"stop_token_ids": [PERIOD], "min_tokens": 10})
c0 = completion.choices[0]
print(f"completion: {c0.text!r}, finish_reason={c0.finish_reason}, stop_reason={c0.model_extra.get('stop_reason')!r}")
print(f"chat      : {chat.choices[0].message.content!r}, finish_reason={chat.choices[0].finish_reason}")
print(f"extra_body: {with_ext.choices[0].text!r}")
assert c0.text == earliest.text and chat.choices[0].message.content == offline_chat.text
assert with_ext.choices[0].text == min10.text, "the server and the offline engine agree"

# %% [markdown]
# 三个结果与离线引擎逐字相同：服务端与 `LLM` 用的是同一个引擎、同一个采样器、同一套停止规则。带种子的采样请求也一样——
# 同一个 `seed` 经 HTTP 发两次，得到同一段文字：

# %% tags=["nbval-check-output"]
twice = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=42)
         .choices[0].text for _ in range(2)]
offline_seeded = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42))[0]
print(twice[0])
print("same text twice over HTTP, and equal to the offline run:", twice[0] == twice[1] == offline_seeded.outputs[0].text)
assert twice[0] == twice[1] == offline_seeded.outputs[0].text

# %%
server.terminate()
try:
    server_rc = server.wait(timeout=30)
except subprocess.TimeoutExpired:
    server.kill()
    server_rc = server.wait(timeout=10)
print("server stopped, exit code", server_rc)
assert server_rc == 0, "SIGTERM shuts minibatch serve down cleanly (exit code 0)"

# %% [markdown]
# 服务收到 SIGTERM 后停止接受新连接、让进行中的请求在 `--graceful-shutdown-timeout` 内结束，然后以退出码 0 退出（`minibatch/serving/server.py` 模块文档）。
#
# ## 18.8 动手：温度与 top-p
#
# 控件用 18.1 节那一行真实的 Logits 画出过滤后的分布，并用 3 个种子各续写一句（离线引擎，几十毫秒）。建议：把温度从 0.3 拉到 1.5，
# 看分布怎样摊平、续写怎样从重复变得发散；固定温度 1.2，把 top-p 从 1.0 降到 0.5，看被截掉的长尾；再打开 min-p，比较它与 top-p 截掉的是哪些 Token。

# %% tags=["nbval-ignore-output"]
def explore(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0):
    zz = apply_top_k_top_p(apply_min_p(z / max(temperature, 1e-5), [min_p]), [top_k], [top_p])
    p = torch.softmax(zz, dim=-1)[0]
    top = p.argsort(descending=True)[:20]
    fig, ax = plt.subplots(figsize=(9, 2.4))
    ax.bar(range(len(top)), p[top].numpy(), color=["C0" if p[i] > 0 else "0.85" for i in top])
    ax.set_xticks(range(len(top)), [repr(tok.decode([int(i)]))[1:-1] for i in top], rotation=90, fontsize=7)
    ax.set(ylabel="probability", title=f"{int((p > 0).sum())} tokens can be drawn")
    plt.show()
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=16, seed=s)
              for s in range(3)]
    for o in llm.generate([PROMPT] * 3, params):
        print(repr(PROMPT + o.outputs[0].text))


W.interact(explore, temperature=W.FloatSlider(value=0.7, min=0.1, max=2.0, step=0.1, continuous_update=False),
           top_p=W.FloatSlider(value=0.9, min=0.05, max=1.0, step=0.05, continuous_update=False),
           top_k=W.IntSlider(value=-1, min=-1, max=50, continuous_update=False),
           min_p=W.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, continuous_update=False));

# %% [markdown]
# ## 小结
#
# - 采样器按 温度 → min-p → top-k → top-p → 抽样 的顺序工作（minibatch 与 vLLM v0.11.0 相同，`transformers` 5.24.0 把 min-p 放在最后）；
#   每一步之后重新归一化，所以顺序改变结果。抽样是逆 CDF，被截掉的 Token 永远抽不到。
# - 带 `seed` 的请求用自己的随机数生成器，结果不受同批请求影响；同一个种子只在同一个实现里可复现。
# - 停止条件有五类：EOS、停止 Token、停止字符串、长度、`min_tokens`；停止字符串在文字上匹配，可以跨 Token，多个同时命中时 minibatch 取最早的
#   （vLLM 取列表里第一个）；`min_tokens` 在采样时就屏蔽停止 Token，会改变生成的内容。
# - 字节级 BPE 会把一个字拆进几个 Token，逐 Token 解码得到 `�`；增量反分词用两个偏移量，扣住未完成的字，拼起来总等于整段解码。
# - SSE 每个事件一行 `data: <JSON>`，以 `data: [DONE]` 结束；一个事件携带上次以来的全部 Token，读得慢就合并；停止字符串的前缀要扣住不发。
# - 客户端断开时，服务端中止请求，KV 块立刻回到池里；`openai` 客户端换一个 `base_url` 就能访问 `minibatch serve`。
#
# 下一章（第 19 章）回到调度参数，在 SLO 下寻找帕累托前沿。
#
# ## 练习
#
# 1. **顺序的反例。** 在 18.1 节的 Logits 上找一组 `(temperature, top_k, top_p)`，使“先 top-p 再 top-k”与“先 top-k 再 top-p”留下的 Token 集合不同。
#    哪一种顺序留下的集合总是更小？为什么？
# 2. **min-p 与温度。** min-p 的阈值是相对最可能 Token 的概率。温度升高时，min-p 留下的 Token 数怎样变化？与 top-p 比较，为什么有人说 min-p
#    “在高温下更稳”？用 `apply_min_p` 在 `T` = 0.5、1.0、1.5、2.0 下数一数。
# 3. **停止字符串的代价。** `_find_stop` 每个新 Token 都在文字上查找全部停止字符串。`SamplingParams` 为什么限制最多 64 个停止字符串
#    （`MAX_STOP_STRINGS`）？一个有 64 个停止字符串、输出 4000 个 Token 的请求，大约要做多少次查找？
# 4. **扣留的代价。** 停止字符串越长，流式输出扣住的字符越多。给 18.5 节的 `read_stream` 一个 20 个字符长的停止字符串，
#    比较第一个非空增量到达的时间。用户会感到什么？
# 5. **断开与非流式。** 18.6 节断开的是流式请求。对一个非流式的 900 Token 请求，在客户端设 `timeout=0.5` 让它超时断开，KV 块多久被释放？
#    读 `server.py` 的 `wait_or_abort`，说出这个时间由哪个常量决定。
# 6. **SentencePiece 与前导空格。** 仿照 `tests/test_tokenizer.py` 的 `sentencepiece_like`，用 `tokenizers` 库造一个 SentencePiece 风格的小分词器，
#    比较 `IncrementalDetokenizer(tok)` 与 `IncrementalDetokenizer(tok, prompt_ids=...)` 对同一段输出给出的文字。如果提示词以半个汉字结尾
#    （字节级 BPE），`prompt_context` 为什么不取任何上下文？
#
# <details><summary>提示与参考答案</summary>
#
# 1. top-k 保留的是概率最大的前 k 个，top-p 保留的也是按概率排序的一个前缀；两者都是“前缀”，但 top-p 的长度取决于它看到的分布是否已被截断并重新归一化。
#    先 top-k 再 top-p 时，top-p 在重新归一化后的分布上累计，每个 Token 更“重”，前缀更短，所以这个顺序留下的集合不会更大。
# 2. 温度升高，最可能 Token 的概率下降，阈值 $p_\min \cdot \max p$ 随之下降，同时其余 Token 的概率上升：min-p 留下的 Token 变多。
#    top-p 要凑够固定的总概率，分布越平需要的 Token 也越多。两者增长得快慢取决于分布的形状，以你在这行 Logits 上数出的为准；
#    要点是 min-p 的阈值随模型的“把握”（最大概率）浮动，而 top-p 只看累计概率。
# 3. 每个 Token 最多 64 次 `str.find`，每次在整段文字上查找：4000 个 Token 共约 25.6 万次，且每次的文字越来越长。限制数量，
#    才能保证一个请求的参数不会拖慢整个批的每一步。
# 4. 扣留 19 个字符：前 19 个字符不会立刻发出，用户看到的首字延迟变长（TTFT 在服务端没变，客户端看到的“首字”却晚了）。
# 5. 非流式请求靠 `wait_or_abort` 每隔 `DISCONNECT_POLL_S` 秒检查一次 `request.is_disconnected()`，释放时间最多再晚这么久。
# 6. 不带提示词时第一个输出词的前导空格丢失（`world`），带上时是 ` world`。提示词以半个字结尾时，`decode(context)` 以 `�` 结尾，
#    而 `decode(context + 输出)` 会把这个字补完，两次解码的长度差不再等于输出的文字，切出来的文本会错位；不取上下文就退回单独解码输出。
#
# </details>
