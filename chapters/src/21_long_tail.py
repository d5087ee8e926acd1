# %% [markdown]
# # 第 21 章 长尾请求与队头阻塞
#
# 生产流量里请求的长度相差悬殊：Azure 的对话轨迹里，有的回答只有十几个 Token，有的上千个。连续批处理（第 5 章）让请求每一步都能
# 加入与离开，可一步里能容纳的请求数（`max_num_seqs`）与 KV Cache 都有上限；一旦它们被几个**长请求**占满，后到的短请求只能在队列里
# 等——短请求本身只要零点几秒，却要等长请求生成完几百个 Token。这就是**队头阻塞**（Head-of-line Blocking）。
#
# 操作系统与排队论早有对策：**最短作业优先**（SJF, Shortest Job First）。可 LLM 服务有一个麻烦：调度时**不知道**一个请求会生成多少 Token。
# 本章在 minibatch 里回答四个问题：SJF 该按什么“长度”排序；输出长度能不能从轨迹里学出来；预测不准要付出什么代价；
# 以及 SJF 让长请求**饥饿**（Starvation）时，怎样用**老化**（Aging）与**长度分桶优先级队列**（Length-bucketed Priority Queues）把尾部拉回来。
#
# ## 学习目标
#
# - 用一个服务台上的例子写出队头阻塞的代价，并说明 SJF 为什么使平均完成时间最小（交换论证，Smith 规则）；
# - 在真实的 tiny 模型上看到：两个长请求占满槽位时，FCFS 让 6 个短请求等上百步，SJF 让它们先走，而贪心输出逐 Token 不变；
# - 理解在槽位受限的连续批处理里，一个请求“占用资源的时间”由**输出长度**决定，而不是提示词长度（`SJFPolicy(prefill_weight=0)`）；
# - 在 Azure 对话轨迹的前一半上拟合一个**按提示词长度分桶**的输出长度预测器（`minibatch.workload.predict`），在后一半上评估它的误差与秩相关；
# - 在模拟的 Llama-3-8B / A100-80G 上、稳态下、多个种子比较 FCFS、先知 SJF、预测 SJF 与长度分桶队列的延迟分布，
#   用可控误差的预测器量出“预测误差的代价”；
# - 量出 SJF 的饥饿（p99 与最长排队时间），用老化把它限制住，并用服务容量（TTFT SLO 达成率 ≥ 80% 的最高到达率）比较各策略。

# %%
import bisect

import ipywidgets as W
import matplotlib.pyplot as plt
import numpy as np
import torch

import minibatch
from minibatch import EngineConfig, LLMEngine, presets, tune
from minibatch.policies.base import Policy
from minibatch.policies.sjf import SJFPolicy
from minibatch.results import steady_state
from minibatch.runner import run
from minibatch.sim import make_cost_model
from minibatch.viz import md_table
from minibatch.workload import (
    RequestSpec,
    Workload,
    load_shipped_trace,
    poisson_arrivals,
)
from minibatch.workload.predict import (
    BucketedLengthPredictor,
    NoisyOracle,
    prediction_errors,
)

print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 21.1 队头阻塞与 SJF 的数学
#
# 先看最简单的情形：一个服务台，$n$ 个作业同时到达，作业 $i$ 要服务 $s_i$ 秒，一次只做一个、做完再换（非抢占）。
# 按某个顺序 $\pi$ 做完，第 $k$ 个作业的完成时间是前 $k$ 个作业服务时间之和，所以
#
# $$
# \sum_{k=1}^{n} C_{\pi(k)} = \sum_{k=1}^{n} (n - k + 1)\, s_{\pi(k)} .
# $$
#
# 排在第 $k$ 位的作业的服务时间被计入 $n-k+1$ 次：越靠前，权重越大。交换任意一对相邻的“长在前、短在后”的作业，总和严格减小，
# 所以**按服务时间从短到长**排列使平均完成时间最小——这就是 SJF 的最优性（Smith 规则，1956；等权重的特例）。
# 队头阻塞正是反面：一个长度 $L$ 的作业排在 $m$ 个长度 $s \ll L$ 的作业前面，每个短作业都多等 $L$。

# %%
L_long, s_short, m_short = 96, 8, 6
jobs = [L_long] + [s_short] * m_short


def mean_completion(order):
    return float(np.mean(np.cumsum(order)))


fcfs_c, sjf_c = mean_completion(jobs), mean_completion(sorted(jobs))
print(f"one job of {L_long} then {m_short} jobs of {s_short}: mean completion FCFS {fcfs_c:.1f}, SJF {sjf_c:.1f} "
      f"({fcfs_c / sjf_c:.1f}x)")
assert sjf_c < fcfs_c

# %% [markdown]
# 一个 {{L_long}} 步的作业后面跟着 {{m_short}} 个 {{s_short}} 步的作业：FCFS 的平均完成时间是 {{fcfs_c:.1f}} 步，SJF 是 {{sjf_c:.1f}} 步，
# 相差 {{fcfs_c / sjf_c:.1f}} 倍。代价由长作业承担：它在 SJF 下晚完成 {{m_short * s_short}} 步。
#
# 连续批处理不是一个服务台，而是 `max_num_seqs` 个“槽位”（Slot）：每步每个运行中的请求生成一个 Token。一个请求占用槽位的时间约为
# 它的**输出长度**乘以步长（预填充通常一两步就完成，第 11 章的分块预填充把它摊进解码步里）。所以当槽位是瓶颈时，
# SJF 该比较的“作业长度”是输出长度 $o_i$，而不是 $p_i + o_i$。`minibatch/policies/sjf.py` 的 `SJFPolicy` 按剩余工作量排序：
#
# $$
# \text{key}_i = w_p \cdot (\text{待计算的 Token 数}) + \max(0,\ \hat o_i - g_i) - a \cdot (\text{已等待秒数}),
# $$
#
# 其中 $\hat o_i$ 是预测的输出长度（`predictor`，默认读 `max_tokens`）、$g_i$ 是已生成的 Token 数、$w_p$ 是 `prefill_weight`
# （默认 1，即按 $p_i + o_i$ 排；本章加入的参数，0 表示只看输出）、$a$ 是老化速率 `aging_tokens_per_s`（21.5 节）。
#
# 先在真实的 tiny 模型上看队头阻塞：2 个长请求（生成 96 个 Token）先到，紧接着 6 个短请求（各 8 个 Token），`max_num_seqs=2`。
# 下面数的是每个请求产出第一个 Token 与完成之前引擎走过的**步数**（步数与机器快慢无关）：

# %% tags=["nbval-check-output"]
torch.set_num_threads(1)
hol = Workload([RequestSpec(0.0, 16, 96, request_id=f"long{i}") for i in range(2)]
               + [RequestSpec(0.0, 16, 8, request_id=f"short{i}") for i in range(6)], name="hol")
tiny_runs = {}
for name in ("FCFS", "SJF"):
    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny", max_num_seqs=2, block_size=16, num_kv_blocks=64))
    if name == "SJF":
        engine.scheduler.policy = SJFPolicy(aging_tokens_per_s=0, prefill_weight=0)
    tiny_runs[name] = run(hol, engine=engine)


def steps_until(result):
    """Per request: how many engine steps started before its first token, and before it finished."""
    starts = np.array([st.start_time for st in result.steps])
    return {q.request_id: (int(np.sum(starts < q.first_token_time)), int(np.sum(starts < q.finish_time)))
            for q in result.requests}


tiny_steps = {name: steps_until(r) for name, r in tiny_runs.items()}
for name, st in tiny_steps.items():
    print(f"{name}: steps to finish  " + "  ".join(f"{rid} {st[rid][1]}" for rid in sorted(st)))
short_done = {name: float(np.mean([v[1] for k, v in st.items() if k.startswith("short")])) for name, st in tiny_steps.items()}
long_done = {name: float(np.mean([v[1] for k, v in st.items() if k.startswith("long")])) for name, st in tiny_steps.items()}
same = all(a.output_token_ids == b.output_token_ids for a, b in
           zip(sorted(tiny_runs["FCFS"].requests, key=lambda q: q.request_id),
               sorted(tiny_runs["SJF"].requests, key=lambda q: q.request_id)))
print(f"short requests finish after {short_done['FCFS']:.0f} steps (FCFS) vs {short_done['SJF']:.0f} (SJF) on average; "
      f"long ones after {long_done['FCFS']:.0f} vs {long_done['SJF']:.0f}; greedy outputs identical: {same}")
assert same, "the order of service must not change what greedy decoding produces"
assert short_done["SJF"] < short_done["FCFS"] / 4 and long_done["SJF"] > long_done["FCFS"]

# %% [markdown]
# FCFS 下两个长请求占满两个槽位，6 个短请求平均要等到第 {{short_done["FCFS"]:.0f}} 步才完成；SJF 让它们先走，平均第
# {{short_done["SJF"]:.0f}} 步就完成，代价是长请求从第 {{long_done["FCFS"]:.0f}} 步推迟到第 {{long_done["SJF"]:.0f}} 步。
# 两种顺序下每个请求的贪心输出逐 Token 相同：调度只改变**什么时候**算，不改变算出什么。
#
# 这里 SJF 用的是真实的 `max_tokens`：tiny 模型的运行与模拟器一样用 `ignore_eos=True`，`max_tokens` 就是真实输出长度，
# 相当于一个**先知**（Oracle）预测器。真实服务里没有先知，这是 21.3 节的问题。
#
# ## 21.2 轨迹上的实验：按什么长度排序
#
# 负载来自随课程发布的 Azure LLM 推理对话轨迹（`datasets/traces/AzureLLMInferenceTrace_conv.csv`，Splitwise, ISCA'24，CC-BY-4.0）。
# 把它按时间切成两半：**前一半用来训练**预测器（21.3 节），**后一半用来测试**；测试负载从后一半里随机抽取请求
# （提示词与输出长度成对保留），配上 Poisson 到达，每个种子抽一次。模型是 Llama-3-8B（上下文 8192），轨迹里
# 提示词加输出超过 8192 的请求放不下，先去掉。服务器是模拟的 A100-80G，`max_num_seqs` 设得很小，让槽位成为瓶颈
# （这个设置是否真实，21.2 节末尾专门讨论）。

# %%
SIM = dict(executor="sim", model="llama-3-8b", hardware="a100-80g", max_num_seqs=16)   # a slot-limited server
conv_all = load_shipped_trace("azure_conv")
conv = Workload([r for r in conv_all if r.prompt_len + r.max_tokens <= 8192], name="azure_conv")
dropped = len(conv_all) - len(conv)
half = len(conv) // 2
train, test = conv.slice(0, half), conv.slice(half)
DUR, RATE, SEEDS, TRIM = 90.0, 4.4, (1, 2, 3), 0.2      # seconds of arrivals per run; req/s; seeds; steady state
SLO = {"ttft": 2.0}                                     # per request: first token within 2 s
CAP21 = dict(lo=3.2, hi=6.4, tol=0.1, target=0.8, trim=TRIM, duration_s=DUR, processes=2)   # 21.5: capacity search


def sample(seed, rate=RATE, n=None):
    """DUR seconds of requests (n if given) drawn from the test half, lengths kept in pairs, Poisson arrivals."""
    n = n or int(rate * DUR) + 1
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(test), n, replace=False)
    times = poisson_arrivals(n, rate, seed=seed)
    return Workload([RequestSpec(float(t), test[int(i)].prompt_len, test[int(i)].max_tokens, request_id=f"s{seed}-{j}")
                     for j, (t, i) in enumerate(zip(times, idx))], name=f"conv-test-s{seed}")


# %%
def measure(wl, policy=None, sim=None):
    """Steady-state metrics (arrivals in the middle 60%: summary(trim=TRIM)) of one simulated run."""
    engine = LLMEngine(EngineConfig.from_kwargs(**(sim or SIM)), clock="virtual")
    if policy is not None:
        engine.scheduler.policy = policy
    r = run(wl, engine=engine)
    s = r.summary(slo=SLO, trim=TRIM)
    st = steady_state(r.requests, TRIM)
    assert all(q.completed for q in st), "every steady-state request completes"
    longest = [q for q in st if q.output_len >= np.quantile([x.output_len for x in st], 0.9)]
    return dict(e2e_mean=s["e2e_mean"], e2e_p50=s["e2e_p50"], e2e_p99=s["e2e_p99"], ttft_p50=s["ttft_p50"],
                ttft_p99=s["ttft_p99"], qd_max=max(q.queue_delay for q in st), att=s["slo_attainment"],
                long_e2e=float(np.mean([q.e2e for q in longest])), tok_s=s["throughput_tok_s"],
                service=float(np.mean([q.e2e - q.queue_delay for q in st])))


def med(rows, key):
    return float(np.median([r[key] for r in rows]))


def sjf(predictor=None, aging=0.0, prefill_weight=0.0):
    return SJFPolicy(predictor=predictor, aging_tokens_per_s=aging, prefill_weight=prefill_weight)


WL_FULL = {s: sample(s, rate=CAP21["hi"]) for s in SEEDS}        # enough requests for DUR seconds at the top rate
WL = {s: tune.workload_at(WL_FULL[s], RATE, DUR) for s in SEEDS}   # their first DUR seconds, at RATE
print(f"{len(conv_all)} requests in the trace, {dropped} longer than 8192 tokens dropped; train {len(train)}, test {len(test)}; "
      f"test means: prompt {test.prompt_lens.mean():.0f}, output {test.output_lens.mean():.0f} tokens; "
      f"{len(WL[SEEDS[0]])} requests per run")

# %% [markdown]
# 轨迹共 {{len(conv_all)}} 个请求，去掉 {{dropped}} 个放不下的，训练集 {{len(train)}} 个、测试集 {{len(test)}} 个；测试集的平均提示词
# {{test.prompt_lens.mean():.0f}} Token、平均输出 {{test.output_lens.mean():.0f}} Token。到达率 {{RATE}} req/s 接近这台配置在 FCFS 下的服务容量
# （21.5 节的扫描），队列会时有时无地形成——队头阻塞只在这种时候才有代价；负载轻时谁先谁后都一样。
#
# 每个数字都是 {{len(SEEDS)}} 个种子的中位数，每次运行 {{DUR:.0f}} s 的到达（{{len(WL[SEEDS[0]])}} 个请求），每个种子只统计到达时间落在中间
# {{1 - 2 * TRIM:.0%}} 的请求（去掉预热与收尾）。先比较 FCFS 与两种先知 SJF：
# 按 $p+o$ 排序（`prefill_weight=1`，默认）与只按输出 $o$ 排序（`prefill_weight=0`）：

# %%
POLICIES = {"FCFS": lambda: None,
            "SJF by prompt + output (oracle)": lambda: sjf(prefill_weight=1.0),
            "SJF by output (oracle)": lambda: sjf()}
main = {name: [measure(WL[s], make()) for s in SEEDS] for name, make in POLICIES.items()}
COLS = [("e2e_mean", "E2E mean (s)"), ("e2e_p50", "E2E p50 (s)"), ("e2e_p99", "E2E p99 (s)"),
        ("att", "TTFT ≤ 2 s"), ("qd_max", "max queue delay (s)")]


def spread(rows, key):
    """Median over the seeds, with their min-max: how the tables print a metric."""
    v = [r[key] for r in rows]
    fmt = ".0%" if key == "att" else ".2f"
    return f"{np.median(v):{fmt}} ({min(v):{fmt}}–{max(v):{fmt}})"


def table(results):
    md_table(["policy"] + [c for _, c in COLS], [[name] + [spread(rows, k) for k, _ in COLS] for name, rows in results.items()])


table(main)
fc, pw1, pw0 = (main[k] for k in POLICIES)
key_gap = abs(med(pw1, "e2e_mean") / med(pw0, "e2e_mean") - 1)      # the two SJF keys' mean E2E, relative gap
loaded = int(np.argmin([r["att"] for r in fc]))      # the seed where FCFS queues most (lowest TTFT attainment)
light = int(np.argmax([r["att"] for r in fc]))       # the seed where it queues least
att_per_seed = "、".join(f"{r['att']:.0%}" for r in fc)
print(f"FCFS TTFT attainment per seed {[round(r['att'], 2) for r in fc]}: most loaded seed {SEEDS[loaded]}, "
      f"least loaded seed {SEEDS[light]}")

# %% tags=["check"]
for rows in (pw1, pw0):
    assert all(r["e2e_p50"] <= f["e2e_p50"] + 0.02 and r["att"] >= f["att"] - 0.01 for r, f in zip(rows, fc)), \
        "the prose: on every seed SJF's median is no higher and its TTFT attainment no lower"
    assert rows[loaded]["e2e_p99"] > 2 * fc[loaded]["e2e_p99"] and rows[loaded]["qd_max"] > 3 * fc[loaded]["qd_max"], \
        "the prose: on the loaded seed SJF's tail and longest wait are far worse than FCFS's"
assert fc[light]["att"] == 1.0 and abs(pw0[light]["e2e_p50"] / fc[light]["e2e_p50"] - 1) < 0.02, "the light seed: no queue"
assert key_gap < 0.02 and med(pw0, "e2e_mean") < med(fc, "e2e_mean")
p99 = {k: [r["e2e_p99"] for r in rows] for k, rows in (("p+o", pw1), ("o", pw0))}
assert max(p99["p+o"]) >= min(p99["o"]) and max(p99["o"]) >= min(p99["p+o"]), "the prose: the p99 ranges overlap"

# %% [markdown]
# 先看种子之间的差别：同样的分布、同样的到达率，FCFS 的 TTFT ≤ 2 s 达成率在三个种子上是 {{att_per_seed}}。
# 种子 {{SEEDS[light]}} 上几乎不排队，谁先谁后都一样（E2E 中位数 FCFS {{fc[light]["e2e_p50"]:.2f}} s，SJF {{pw0[light]["e2e_p50"]:.2f}} s）；
# 种子 {{SEEDS[loaded]}} 上队列排得最长。这正是接近容量时的排队：Little 定律给出的平均在服务请求数（下面算）已经逼近槽位数，
# 队列长短取决于这一次抽到的长请求与到达的疏密。所以下面的每个结论都按**同一个种子上的成对比较**来说：
#
# - **中位数与达成率**：在每个种子上，两种先知 SJF 的 E2E 中位数都不高于 FCFS、TTFT 达成率都不低于 FCFS；差别集中在排队的种子上——
#   种子 {{SEEDS[loaded]}} 的中位数从 {{fc[loaded]["e2e_p50"]:.2f}} s 降到 {{pw0[loaded]["e2e_p50"]:.2f}} s（按 $o$），达成率从 {{fc[loaded]["att"]:.0%}} 升到 {{pw0[loaded]["att"]:.0%}}。
# - **尾部**：同一个种子上，p99 E2E 从 {{fc[loaded]["e2e_p99"]:.2f}} s 涨到 {{pw1[loaded]["e2e_p99"]:.2f}} s（按 $p+o$）与 {{pw0[loaded]["e2e_p99"]:.2f}} s（按 $o$），
#   最长的排队时间从 {{fc[loaded]["qd_max"]:.1f}} s 涨到 {{pw0[loaded]["qd_max"]:.1f}} s——等待从短请求身上转移到了长请求身上。
# - **均值**几乎不动（中位数 {{med(fc, "e2e_mean"):.2f}} s 对 {{med(pw0, "e2e_mean"):.2f}} s）：一个请求的 E2E 大部分是它自己的解码时间
#   （平均 {{test.output_lens.mean():.0f}} 个 Token），排队只占一小部分，SJF 能重新分配的只是排队那部分。
#
# 表里的中位数把三个种子混在一起，会把“排队时的大差别”与“不排队时的零差别”平均掉；范围（括号里的最小–最大）比中位数更能说明这一点。
#
# 两种键在这个负载上的均值几乎一样（相差 {{key_gap:.1%}}）：21.1 节的推理说占用槽位的是输出，但在这里按 $p+o$ 排序并没有因此变差。
# 差别在 p99 上：按 $p+o$ 是 {{spread(pw1, "e2e_p99")}} s，按 $o$ 是 {{spread(pw0, "e2e_p99")}} s（中位数与 {{len(SEEDS)}} 个种子的最小–最大），
# 两者的范围重叠，这张表不足以断定谁的尾部更好。
# 本章其余部分用 `prefill_weight=0`（只看输出），因为预测器要预测的正是输出。
#
# **这个服务器真实吗？** `max_num_seqs` = {{SIM["max_num_seqs"]}} 不是任何框架的默认值：vLLM v0.11.0 的 `LLM` 在 A100 上默认
# {{presets.settings("vllm")["max_num_seqs"]}} 个序列（`vllm/engine/arg_utils.py` 的 `EngineArgs._set_default_args`，见 `minibatch/presets`），
# TensorRT-LLM 1.x 的 `max_batch_size` 默认 {{presets.settings("trtllm")["max_num_seqs"]}}（`tensorrt_llm/llmapi/llm_args.py`）；本章也没有找到把 8B 模型
# 在 A100-80GB 上压到 {{SIM["max_num_seqs"]}} 个序列的公开配置。它是刻意构造的**槽位受限**的服务器，为的是让队头阻塞稳定地出现。
# 用默认配置会怎样？由 Little 定律，系统里的平均请求数 ≈ 到达率 × 每个请求的服务时间（不含排队）：

# %%
service = med(fc, "service")                       # mean E2E minus queue delay, steady state (FCFS)
in_system = RATE * service                         # Little's law: requests being served at once, on average
kv_fit = make_cost_model(SIM["model"], SIM["hardware"]).kv_capacity_tokens() / (test.prompt_lens.mean() + test.output_lens.mean())
print(f"service time {service:.2f} s -> about {in_system:.0f} requests in service at {RATE} req/s; "
      f"slots: {SIM['max_num_seqs']} here, {presets.settings('vllm')['max_num_seqs']} by vLLM's default; "
      f"the A100-80G KV pool holds about {kv_fit:.0f} requests of mean length")

# %% [markdown]
# 在 {{RATE}} req/s 下平均约有 {{in_system:.1f}} 个请求同时在服务，槽位的利用率约 {{in_system / SIM["max_num_seqs"]:.0%}}：
# 接近满载，到达稍一密集就排队——这也是上面种子之间差别那么大的原因。可是这远少于 vLLM 默认的
# {{presets.settings("vllm")["max_num_seqs"]}} 个序列与 KV 池能装下的约 {{kv_fit:.0f}} 个请求——**用默认配置，这个负载在这台机器上不会因槽位或 KV 而排队**，
# 谁先谁后都一样。所以本章的结论说的是“并发受限、接近容量”时的调度：槽位少（只开少数并发槽位的部署），或者 KV 池小（显存小的 GPU、长上下文），
# 都会让队列形成。后一种情形里稀缺的是 KV，一个请求占的 KV 随 $p + g$ 增长，按 $p+o$ 排序更合理——练习 6 请你在 24 GB 的 A10 上用 vLLM 的默认配置验证。
#
# ## 21.3 从轨迹学输出长度
#
# 最简单、可以从轨迹里学的预测器只看提示词长度：把训练集的提示词长度按分位数切成 16 个等频的桶，
# 每个桶预测它里面训练请求输出长度的中位数（`BucketedLengthPredictor.fit`，`minibatch/workload/predict.py`）。
# 它能学到非单调的关系，但看不到提示词的内容。评价它用三个数：平均绝对误差（MAE）、误差倍数的中位数
# $\operatorname{median}|\log(\hat o / o)|$ 取指数（1.0 为精确），以及 SJF 真正在意的**秩相关**（Spearman Rank Correlation）——
# SJF 只用预测来**排序**，预测值整体偏大偏小都无所谓，排错先后才有代价。

# %%
pred = BucketedLengthPredictor.fit_workload(train, num_buckets=16)
BAND = (1000, 1400)                                   # the prompt lengths of the step in the figure below
in_band = (test.prompt_lens >= BAND[0]) & (test.prompt_lens <= BAND[1])
band_out, rest_out = np.median(test.output_lens[in_band]), np.median(test.output_lens[~in_band])
const = int(np.median(train.output_lens))
err_pred = prediction_errors(pred.predict(test.prompt_lens), test.output_lens)
err_const = prediction_errors(np.full(len(test), const), test.output_lens)
code = load_shipped_trace("azure_code")
half_code = len(code) // 2
code_pred = BucketedLengthPredictor.fit(code.prompt_lens[:half_code], code.output_lens[:half_code], num_buckets=16)
err_code = prediction_errors(code_pred.predict(code.prompt_lens[half_code:]), code.output_lens[half_code:])
md_table(["predictor (fitted on the first half, scored on the second)", "MAE (tokens)", "median error factor", "Spearman"],
         [[f"conversation trace, constant {const} (train median)", f"{err_const['mae']:.0f}",
           f"{err_const['median_factor']:.2f}", f"{err_const['spearman']:.2f}"],
          ["conversation trace, 16 prompt-length buckets", f"{err_pred['mae']:.0f}", f"{err_pred['median_factor']:.2f}",
           f"{err_pred['spearman']:.2f}"],
          ["code trace, 16 prompt-length buckets", f"{err_code['mae']:.0f}", f"{err_code['median_factor']:.2f}",
           f"{err_code['spearman']:.2f}"]])

fig, ax = plt.subplots(figsize=(8, 3.2))
sub = np.random.default_rng(0).choice(len(test), 3000, replace=False)
ax.scatter(test.prompt_lens[sub], test.output_lens[sub], s=3, alpha=0.25, color="0.4", label="test requests")
grid = np.unique(np.geomspace(2, 8192, 400).astype(int))
ax.step(grid, pred.predict(grid), where="post", color="C3", lw=2, label="bucketed prediction (train median)")
ax.axhline(const, color="C0", ls=":", label=f"constant {const}")
ax.set(xscale="log", xlabel="prompt tokens", ylabel="output tokens",
       title="Azure conversation trace: output length by prompt length (fitted on the first half)")
ax.legend(fontsize=7, loc="upper right")
ax.grid(alpha=0.3)
plt.show()
print(f"test half: median output {band_out:.0f} tokens for prompts of {BAND[0]}-{BAND[1]} tokens, {rest_out:.0f} for the rest")
assert err_pred["spearman"] > 0.5 and err_pred["mae"] < err_const["mae"] and abs(err_code["spearman"]) < 0.1

# %% [markdown]
# 这条对话轨迹里，提示词长度竟然能相当好地预测输出：分桶预测器在**没见过的后一半**上秩相关为 {{err_pred["spearman"]:.2f}}，
# 误差倍数的中位数 {{err_pred["median_factor"]:.2f}}，MAE {{err_pred["mae"]:.0f}} Token，而常数预测（训练集中位数 {{const}}）的 MAE 是
# {{err_const["mae"]:.0f}}。上图的阶梯说明了原因：提示词在 {{BAND[0]}}–{{BAND[1]}} Token 之间的请求，输出的中位数是 {{band_out:.0f}} Token，其余的只有 {{rest_out:.0f}}——
# 关系不是单调的，线性回归学不到，分桶可以。这多半反映了轨迹里某类模板化的请求，而不是普遍规律：同样的方法用在代码轨迹上，
# 秩相关只有 {{err_code["spearman"]:.2f}}，几乎等于乱猜（代码轨迹的输出本来就普遍很短）。论文里的预测器读提示词的**内容**：
# *S^3*（Jin et al., NeurIPS'23）用微调的 DistilBERT 把输出长度分到若干个桶；Qiu et al. 2024 用小的代理模型回归长度；
# Fu et al. 2024（*Efficient LLM Scheduling by Learning to Rank*）只学**排序**，用 Kendall's tau 衡量——这正是 SJF 需要的那部分信息。
#
# 把分桶预测器交给 SJF（`SJFPolicy(predictor=pred, prefill_weight=0)`）：

# %%
main["SJF by output (predicted)"] = [measure(WL[s], sjf(pred)) for s in SEEDS]
table(main)
pp = main["SJF by output (predicted)"]

# %% tags=["check"]
assert all(r["e2e_p50"] <= f["e2e_p50"] + 0.02 for r, f in zip(pp, fc)), "the prose: no higher median on any seed"
assert pp[loaded]["e2e_p99"] > 1.5 * fc[loaded]["e2e_p99"] and pp[loaded]["att"] > fc[loaded]["att"] + 0.05

# %% [markdown]
# 预测 SJF 的表现与先知 SJF 相近：每个种子上 E2E 中位数都不高于 FCFS；在排队最多的种子 {{SEEDS[loaded]}} 上，中位数
# {{pp[loaded]["e2e_p50"]:.2f}} s（先知 {{pw0[loaded]["e2e_p50"]:.2f}} s，FCFS {{fc[loaded]["e2e_p50"]:.2f}} s），TTFT ≤ 2 s 的比例 {{pp[loaded]["att"]:.0%}}
# （FCFS {{fc[loaded]["att"]:.0%}}），p99 同样变差（{{pp[loaded]["e2e_p99"]:.2f}} s，FCFS {{fc[loaded]["e2e_p99"]:.2f}} s）。
#
# ## 21.4 预测误差的代价
#
# 预测器的误差有多大代价？用一个误差可控的预测器来量：`NoisyOracle(sigma)` 把真实长度乘以 $e^{\sigma z}$，$z \sim N(0,1)$，
# 每个请求固定一个 $z$。$\sigma=0$ 就是先知；$\sigma$ 越大，排错先后的请求对越多，秩相关越低。

# %%
SIGMAS = (1.0, 8.0)
noisy = {sg: [measure(WL[s], sjf(NoisyOracle(sg, seed=s))) for s in SEEDS] for sg in SIGMAS}
noisy[0.0] = main["SJF by output (oracle)"]


def rank_corr(sigma):
    return float(np.median([prediction_errors([NoisyOracle(sigma, seed=s).predict(r.request_id, r.max_tokens)
                                               for r in WL[s]], WL[s].output_lens)["spearman"] for s in SEEDS]))


rho = {sg: rank_corr(sg) for sg in sorted(noisy)}
rho_pred = float(np.median([prediction_errors(pred.predict(WL[s].prompt_lens), WL[s].output_lens)["spearman"]
                            for s in SEEDS]))
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, (key, label) in zip(axes, [("e2e_mean", "E2E mean (s)"), ("e2e_p50", "E2E p50 (s)"),
                                   ("att", "share with TTFT ≤ 2 s")]):
    xs = [rho[sg] for sg in sorted(noisy)]
    ax.plot(xs, [med(noisy[sg], key) for sg in sorted(noisy)], "o-", color="C3", label="SJF, noisy oracle")
    for sg in sorted(noisy):
        ax.annotate(f"σ={sg:g}", (rho[sg], med(noisy[sg], key)), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot([rho_pred], [med(pp, key)], "s", color="C2", ms=8, label="SJF, bucketed predictor")
    ax.axhline(med(fc, key), color="k", ls=":", label="FCFS")
    ax.set(xlabel="Spearman rank correlation of prediction and truth", ylabel=label)
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=7)
fig.suptitle(f"What prediction error costs (llama-3-8b, A100-80G, {SIM['max_num_seqs']} slots, median of {len(SEEDS)} seeds)", fontsize=10)
fig.tight_layout()
plt.show()
print(" | ".join(f"sigma {sg:g}: rank corr {rho[sg]:.2f}, E2E mean {med(noisy[sg], 'e2e_mean'):.2f} s, "
                 f"p50 {med(noisy[sg], 'e2e_p50'):.2f} s, p99 {med(noisy[sg], 'e2e_p99'):.2f} s, "
                 f"TTFT<=2s {med(noisy[sg], 'att'):.0%}" for sg in sorted(noisy)))
d8 = [a["e2e_mean"] - b["e2e_mean"] for a, b in zip(noisy[8.0], fc)]     # sigma=8 minus FCFS, paired by seed
print(f"bucketed predictor's Spearman: {rho_pred:.2f} (median over the {len(SEEDS)} test samples), "
      f"{err_pred['spearman']:.2f} (whole test half); sigma=8 minus FCFS, mean E2E per seed: {[round(x, 2) for x in d8]} s")
means = [med(noisy[0.0], "e2e_mean"), med(pp, "e2e_mean"), med(noisy[1.0], "e2e_mean"), med(noisy[8.0], "e2e_mean")]

# %% tags=["check"]
assert all(b >= a - 0.01 for a, b in zip(means, means[1:])) and means[-1] > med(fc, "e2e_mean"), \
    "the prose orders the means by prediction quality"
assert min(d8) > -0.05 and max(d8) == d8[loaded] and sorted(d8)[1] < 0.2, "the prose: worse only on the loaded seed"
assert med(noisy[8.0], "e2e_mean") - med(fc, "e2e_mean") < max(r["e2e_mean"] for r in fc) - min(r["e2e_mean"] for r in fc)
assert noisy[8.0][loaded]["att"] > fc[loaded]["att"] + 0.05 and \
    abs(noisy[8.0][loaded]["att"] - noisy[0.0][loaded]["att"]) < 0.05, "the prose: attainment hardly depends on the prediction"

# %% [markdown]
# 先说秩相关：分桶预测器在整个测试集上的秩相关是 {{err_pred["spearman"]:.2f}}（21.3 节的表），在本章三次抽样的请求上（中位数）是
# {{rho_pred:.2f}}：两个数都由上面的单元格打印；若有出入，只来自抽样（三次抽样各几百个请求，测试集有近万个）。结果要分两面看：
#
# - **均值**的中位数按预测质量排序：先知 {{med(noisy[0.0], "e2e_mean"):.2f}} s、分桶预测器 {{med(pp, "e2e_mean"):.2f}} s、
#   σ=1（秩相关 {{rho[1.0]:.2f}}）{{med(noisy[1.0], "e2e_mean"):.2f}} s、σ=8（{{rho[8.0]:.2f}}，几乎是随机顺序）{{med(noisy[8.0], "e2e_mean"):.2f}} s，
#   FCFS 是 {{med(fc, "e2e_mean"):.2f}} s。但能不能说 σ=8 **比 FCFS 差**？这两个中位数只差 {{med(noisy[8.0], "e2e_mean") - med(fc, "e2e_mean"):.2f}} s，
#   而 FCFS 自己在三个种子之间的均值就从 {{min(r["e2e_mean"] for r in fc):.2f}} 变到 {{max(r["e2e_mean"] for r in fc):.2f}} s；逐个种子相减，
#   σ=8 减 FCFS 是 {{[round(x, 2) for x in d8]}} s：只在排队最多的种子 {{SEEDS[loaded]}} 上差出约 {{max(d8):.1f}} s，另外两个种子上差别在
#   {{sorted(d8)[1]:.2f}} s 以内。所以能说的是：**随机顺序不比 FCFS 好，在排队严重时更差**；“更差”只在一个种子上站得住，三个种子的中位数之差落在波动之内，不能单独拿来下结论。
# - **TTFT ≤ 2 s 的比例**在排队的种子上几乎不随预测质量变化：种子 {{SEEDS[loaded]}} 上 σ=8 有 {{noisy[8.0][loaded]["att"]:.0%}}，先知 {{noisy[0.0][loaded]["att"]:.0%}}，
#   都高于 FCFS 的 {{fc[loaded]["att"]:.0%}}。这不是长度预测的功劳：拥塞的时候，FCFS 让队列里**每个**请求都等差不多一样久，一个阈值型的 SLO 就整段失守；
#   任何“有人插队”的顺序（哪怕随机）都让多数请求很快拿到首 Token，少数请求等很久。所以用 SLO 达成率比较调度策略时，
#   一定要同时看尾部与最长等待，否则会把“不公平”误当成“聪明”。
#
# ## 21.5 饥饿、老化与长度分桶队列
#
# SJF 的代价在尾部：只要短请求源源不断，长请求就一直排在后面。`SJFPolicy` 的老化规则让键值每等一秒减少 $a$ 个 Token：
# 剩余工作量为 $S$ 的请求等待 $(S-1)/a$ 秒之后，所有**新到**的请求（键值 $\ge 1$）都排不到它前面——它的等待时间有了上界，
# 只剩下比它早到、或在这段时间里到达的更短请求。$a$ 越大越接近 FCFS。
#
# 另一种常见做法不需要精确的长度，只要一个**类别**：把预测长度分成短（< 128）、中（< 384）、长三个桶，按桶的优先级服务，
# 同一个桶里先来先服务（FCFS），老化则让请求每等 `aging_s` 秒升一级。下面的 `LengthBuckets` 是它的一个实现（非抢占，十几行）：

# %%
class LengthBuckets(Policy):
    """Length-bucketed priority queues: waiting requests by (bucket of the predicted output - waited / aging_s,
    arrival), running ones first in admission order. Non-preemptive."""

    name = "length_buckets"

    def __init__(self, predictor, edges=(128, 384), aging_s=None):
        self.predictor, self.edges, self.aging_s = predictor, tuple(edges), aging_s

    def bucket(self, req):
        if "bucket" not in req.policy_state:                      # predict once per request
            req.policy_state["bucket"] = bisect.bisect_right(self.edges, self.predictor(req))
        return req.policy_state["bucket"]

    def key(self, req, now):
        boost = self.waited(req, now) / self.aging_s if self.aging_s else 0.0
        return (self.bucket(req) - boost, req.arrival_time)

    def schedule_order(self, state):
        return state.running + sorted(state.waiting, key=lambda r: self.key(r, state.now))


# %%
AGING = (20.0, 100.0)
aged = {f"SJF predicted, aging {a:g} tok/s": [measure(WL[s], sjf(pred, aging=a)) for s in SEEDS] for a in AGING}
aged["3 buckets (predicted)"] = [measure(WL[s], LengthBuckets(pred)) for s in SEEDS]
trade = {"FCFS": fc, "SJF predicted, no aging": pp, **aged}
table(trade)
a20, a100, b3 = aged["SJF predicted, aging 20 tok/s"], aged["SJF predicted, aging 100 tok/s"], aged["3 buckets (predicted)"]

# %% tags=["check"]
L = loaded
assert a20[L]["e2e_p99"] < 0.85 * pp[L]["e2e_p99"] and a20[L]["qd_max"] < 0.6 * pp[L]["qd_max"], "aging cuts the tail"
assert a100[L]["e2e_p99"] < a20[L]["e2e_p99"] and a100[L]["e2e_p50"] > a20[L]["e2e_p50"] > pp[L]["e2e_p50"]
assert a100[L]["att"] < a20[L]["att"] < pp[L]["att"], "the prose: aging costs TTFT attainment on the loaded seed"
assert b3[L]["e2e_p99"] < 0.85 * pp[L]["e2e_p99"] and b3[L]["e2e_p50"] < fc[L]["e2e_p50"]

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for k, (name, rows) in enumerate(trade.items()):
    ax.scatter(med(rows, "e2e_p99"), med(rows, "e2e_p50"), s=40, color=f"C{k}", label=name)
ax.set(xlabel="E2E p99 (s): the tail", ylabel="E2E p50 (s): the typical request",
       title=f"Starvation vs typical latency (median of {len(SEEDS)} seeds)")
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# 同样看排队最多的种子 {{SEEDS[loaded]}}（其余种子上差别小得多，见表中的范围）：老化 20 tok/s 把 p99 从 {{pp[loaded]["e2e_p99"]:.2f}} s 拉回到
# {{a20[loaded]["e2e_p99"]:.2f}} s，最长排队从 {{pp[loaded]["qd_max"]:.1f}} s 降到 {{a20[loaded]["qd_max"]:.1f}} s，中位数只从 {{pp[loaded]["e2e_p50"]:.2f}} 升到
# {{a20[loaded]["e2e_p50"]:.2f}} s；老化 100 tok/s 让尾部更接近 FCFS（p99 {{a100[loaded]["e2e_p99"]:.2f}} s，最长排队 {{a100[loaded]["qd_max"]:.1f}} s，
# FCFS 是 {{fc[loaded]["e2e_p99"]:.2f}} s 与 {{fc[loaded]["qd_max"]:.1f}} s），中位数升到 {{a100[loaded]["e2e_p50"]:.2f}} s。代价也体现在 TTFT 达成率上：
# 从 {{pp[loaded]["att"]:.0%}} 降到 {{a20[loaded]["att"]:.0%}} 与 {{a100[loaded]["att"]:.0%}}——等久了的长请求被提前，占去了槽位。
# 三个桶的分桶队列**不加老化**就有 {{b3[loaded]["e2e_p99"]:.2f}} s 的 p99 与 {{b3[loaded]["e2e_p50"]:.2f}} s 的中位数：桶内 FCFS 让同一类请求不会互相饿死，
# 只需要预测器分对“短、中、长”，不必排对每一对请求。它仍可能让“长”桶在持续的短请求流下饥饿，所以实用的实现也加老化
# （`aging_s`，练习 3）。
#
# 最后用服务容量比较：对每个策略、每个种子，在 {{CAP21["lo"]:g}}–{{CAP21["hi"]:g}} req/s 之间二分“每个请求的 TTFT ≤ {{SLO["ttft"]:g}} s 的比例
# 不低于 {{CAP21["target"]:.0%}}”的最高到达率（`tune.capacities`：每次 {{DUR:.0f}} s 的到达、稳态统计，区间两端相差不到 {{CAP21["tol"]:.0%}} 为止；
# 底层是 `minibatch.results.capacity`）。策略是对象（带预测器的 `SJFPolicy`），`tune.capacities` 给每次运行一个新的副本：

# %%
CAP_POLICIES = {"FCFS": {}, "SJF predicted": {"policy": sjf(pred)}, "SJF predicted, aging 20 tok/s": {"policy": sjf(pred, aging=20.0)}}
found = tune.capacities(WL_FULL, list(CAP_POLICIES.values()), SLO, **CAP21, **SIM)
cap = {name: f.estimate for name, f in zip(CAP_POLICIES, found)}
fig, ax = plt.subplots(figsize=(7, 2.6))
for i, (name, e) in enumerate(cap.items()):
    ax.plot([e.lo, e.hi], [i, i], color="C0", lw=3, alpha=0.5)
    ax.plot(e.per_seed, [i] * len(SEEDS), "k.", ms=5)
    ax.plot(e.median, i, "o", color="C3", ms=7)
ax.set_yticks(range(len(cap)), list(cap), fontsize=8)
ax.invert_yaxis()
ax.set(xlabel="capacity (req/s): red median, black seeds, bar min-max",
       title=f"TTFT <= {SLO['ttft']:g} s for {CAP21['target']:.0%} of requests, {DUR:.0f} s per run")
ax.grid(alpha=0.3, axis="x")
plt.show()
md_table(["policy", "capacity (req/s): median (min–max)", "per seed", "vs FCFS (tune.verdict)"],
         [[name, f"{e:.2f}", " / ".join(f"{c:.2f}" for c in e.per_seed),
           "-" if name == "FCFS" else tune.verdict(e, cap["FCFS"])] for name, e in cap.items()])
print(f"{sum(f.runs for f in found)} simulated runs")

# %% tags=["check"]
paired = {name: all(c >= f for c, f in zip(e.per_seed, cap["FCFS"].per_seed)) for name, e in cap.items()}
assert all(paired.values()), "the prose: no policy has a lower capacity than FCFS on any seed"
assert all(tune.verdict(e, cap["FCFS"]) == "overlap" for name, e in cap.items() if name != "FCFS"), "the prose: ranges overlap"
assert cap["SJF predicted"].median > cap["FCFS"].median

# %% [markdown]
# 达成率 ≥ {{CAP21["target"]:.0%}}（每个请求的 TTFT ≤ {{SLO["ttft"]:g}} s）的服务容量：FCFS {{cap["FCFS"]:.2f}} req/s，预测 SJF {{cap["SJF predicted"]:.2f}}，
# 加老化 20 tok/s 的预测 SJF {{cap["SJF predicted, aging 20 tok/s"]:.2f}}（中位数与最小–最大）。在每个种子上，两种 SJF 的容量都不低于 FCFS；
# 但三者的范围重叠，以 {{len(SEEDS)}} 个种子、{{CAP21["tol"]:.0%}} 的二分精度，**不能说 SJF 提高了容量**，只能说它没有降低容量。
# 21.4 节提醒过，达成率上的提高有多少来自长度信息、多少来自“不公平”，要另看尾部。
#
# ## 21.6 框架里的长度感知调度
#
# 主流框架都没有内置“预测输出长度的 SJF”：
#
# | 框架（版本，源文件） | 可选的等待队列顺序 | 与本章的关系 |
# |---|---|---|
# | vLLM（`vllm/config/scheduler.py`，读的是 commit 01230b4，v0.11 之后） | `SchedulerPolicy = Literal["fcfs", "priority"]`，默认 `fcfs`；`priority` 按请求给定的 `priority` 值（小者先）、同值按到达时间 | 没有按长度的策略；`scheduler_cls` 可以换成自定义调度器类（源码会警告这个接口“不公开、不保证兼容”），长度感知调度只能从这里接入 |
# | SGLang（v0.5.3，`python/sglang/srt/managers/schedule_policy.py`） | `--schedule-policy`：`lpm`、`dfs-weight`（缓存感知，第 14 章）与 `fcfs`、`lof`、`random`、`priority` | `lof`（Longest Output First，`SchedulePolicy._sort_by_longest_output`）按请求的 `max_new_tokens` 从大到小排，方向与 SJF 相反，用的也是用户给的上限而不是预测 |
# | minibatch（`minibatch/policies/sjf.py`） | `policy="sjf"`：按 $w_p \cdot$ 待计算 Token + 预测剩余输出 − 老化 排序，`preemptive=True` 为 SRPT | 预测器可插拔（`minibatch/workload/predict.py`），本章的实验 |
#
# 注意 `max_tokens`（`max_new_tokens`）只是用户给的上限，真实服务里它未必接近真实的输出长度；
# 本章的模拟里它等于真实长度（`ignore_eos=True`），所以默认的 `SJFPolicy()` 才是先知。
#
# ## 21.7 动手：预测器 × 老化 × 到达率
#
# 下面的控件在 21.2 节的种子 1 上跑一次，打印稳态指标，并画出每个请求的 E2E 与它的输出长度。建议试试：把预测器从先知换成
# 分桶预测器和 `σ=1` 的噪声先知，看短请求（左下角）的延迟怎样变化；把老化从 0 调到 100，看右上角的长请求怎样被拉回来；
# 把到达率降到 3.5 或升到 4.8，与 FCFS 比较，看负载怎样改变调度顺序的影响。

# %% tags=["nbval-ignore-output"]
PREDICTORS = {"oracle": None, "bucketed (prompt length)": pred, "noisy oracle, sigma=1": NoisyOracle(1.0, seed=1),
              "FCFS (no SJF)": "fcfs"}


def explore(predictor="bucketed (prompt length)", aging=0.0, rate=RATE):
    choice = PREDICTORS[predictor]
    wl = sample(1, rate=rate)
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual")
    if choice != "fcfs":
        engine.scheduler.policy = sjf(choice, aging=aging)
    r = run(wl, engine=engine)
    st = steady_state(r.requests, 0.2)
    s = r.summary(slo=SLO, trim=0.2)
    _, ax = plt.subplots(figsize=(7, 3))
    ax.scatter([q.output_len for q in st], [q.e2e for q in st], s=6, alpha=0.6)
    ax.set(xlabel="output tokens", ylabel="E2E (s)", yscale="log", title=f"{predictor}, aging {aging:g}, {rate:g} req/s")
    ax.grid(alpha=0.3)
    plt.show()
    print(f"steady state ({len(st)} requests): E2E mean {s['e2e_mean']:.2f} s, p50 {s['e2e_p50']:.2f} s, "
          f"p99 {s['e2e_p99']:.2f} s; TTFT <= 2 s: {s['slo_attainment']:.0%}; "
          f"max queue delay {max(q.queue_delay for q in st):.1f} s")


W.interact(explore,
           predictor=W.Dropdown(options=list(PREDICTORS), value="bucketed (prompt length)"),
           aging=W.FloatSlider(value=0.0, min=0.0, max=200.0, step=10.0, continuous_update=False,
                               description="aging tok/s"),
           rate=W.FloatSlider(value=RATE, min=3.0, max=4.8, step=0.2, continuous_update=False, description="req/s"));

# %% [markdown]
# ## 本章小结
#
# - 队头阻塞：长请求占满槽位（`max_num_seqs`）或 KV 时，后到的短请求要等长请求生成完。在一个服务台上，按服务时间从短到长排列
#   使平均完成时间最小（交换论证）；在真实的 tiny 模型上，SJF 让 6 个短请求平均提前 {{short_done["FCFS"] - short_done["SJF"]:.0f}} 步完成，而贪心输出不变。
# - 槽位受限时，请求占用资源的时间由输出长度决定；`SJFPolicy(prefill_weight=0)` 只按输出排序。在 Azure 对话轨迹上，
#   按 $p+o$ 与按 $o$ 排序的均值几乎相同。本章的 {{SIM["max_num_seqs"]}} 个槽位是刻意构造的瓶颈（vLLM 默认 {{presets.settings("vllm")["max_num_seqs"]}}）；
#   用默认配置，这个负载在 A100-80GB 上不会排队。
# - 输出长度可以从轨迹里学一部分：按提示词长度分桶、取桶内中位数的预测器在对话轨迹的后一半上秩相关 {{err_pred["spearman"]:.2f}}，在代码轨迹上只有 {{err_code["spearman"]:.2f}}——
#   预测器好不好取决于负载，要在留出的数据上评估。
# - 预测误差的代价主要体现在均值上：排序越准，均值越低，近似随机的顺序不比 FCFS 好（排队严重时更差）；TTFT 阈值达成率却对预测质量不敏感，
#   因为任何插队都能让多数请求快速开始——比较策略时要同时看尾部与最长等待。
# - SJF 的代价是饥饿：在排队的种子上，p99 与最长排队时间成倍增长。老化（每等一秒键值减少 $a$）给等待设了上界，以少量中位数与达成率换回尾部；
#   长度分桶队列只需分类正确，桶内 FCFS 本身就限制了尾部。
# - 度量要在稳态、多个种子下做，并按种子成对比较：调度顺序只在队列形成时才有影响（种子 {{SEEDS[light]}} 几乎不排队，
#   FCFS 与 SJF 的中位数相同），同样的到达率下三个种子的排队程度相差很大；容量的差别（{{cap["FCFS"]:.2f}} 对 {{cap["SJF predicted"]:.2f}} req/s）落在种子的波动之内。
#
# 实验 **L09**（SJF 与 MLFQ 策略，见课程地图）请你实现 SJF 与 MLFQ 策略，并设计一个在留出负载上 p99 E2E 胜过 FCFS、又不让长请求饥饿的策略。
# 下一章（第 22 章）讲优先级调度与优先级反转。
#
# ## 练习
#
# 1. **更细或更粗的桶。** 把 `BucketedLengthPredictor.fit_workload(train, num_buckets=...)` 的桶数改为 2、4、64，比较测试集上的秩相关与 MAE。
#    桶太多时会发生什么？
# 2. **预测分位数。** 用 `quantile=0.9`（每个桶预测第 90 百分位）重新拟合。秩相关变不变？对 SJF 的结果呢？什么时候高估比低估好？
# 3. **分桶队列加老化。** 给 `LengthBuckets` 设 `aging_s=2`、`5`、`20`，在 21.5 节的三个种子上比较 p99 与最长排队时间。
# 4. **SRPT。** `SJFPolicy(preemptive=True)` 按剩余工作量对运行中与等待中的请求一起排序，会抢占运行中的长请求。
#    在 21.2 节的负载上比较它与非抢占 SJF 的中位数、p99 与抢占次数（`summary()["num_preemptions"]`）。
# 5. **代码轨迹。** 把 21.2–21.5 节的实验换成 `load_shipped_trace("azure_code")`（注意它的到达非常突发，输出很短），
#    分桶预测器秩相关约为 0 时，预测 SJF 与 FCFS 比如何？
# 6. **KV 受限的真实配置。** 用 vLLM 的默认配置（`preset="vllm"`）把同一个模型放到 24 GB 的 A10 上
#    （`SIM = dict(executor="sim", model="llama-3-8b", hardware="a10", preset="vllm")`），KV 池成了瓶颈。找一个 FCFS 刚好跟得上的到达率，
#    比较 FCFS、按 $p+o$ 与按 $o$ 的先知 SJF。哪个键更好？种子之间的波动有多大？
#
# <details><summary>提示与参考答案</summary>
#
# 1. 桶数是偏差与方差的权衡：2 个桶分不出 1000–1400 Token 那一段；64 个桶时每个桶的样本变少，中位数更嘈杂，但本轨迹训练集有近万个请求，
#    秩相关多半变化不大。看 `prediction_errors(pred.predict(test.prompt_lens), test.output_lens)`。
# 2. 每个桶都换成更高的分位数，桶之间的相对大小通常不变，秩相关变化很小；SJF 只用排序，所以结果也接近。高估在**准入与 KV 预留**时更安全
#    （第 12 章：低估会导致抢占），排序时则无所谓。
# 3. `[measure(WL[s], LengthBuckets(pred, aging_s=a)) for s in SEEDS]`，再用 `med(rows, "e2e_p99")`。`aging_s` 越小越接近 FCFS。
# 4. `measure(WL[s], SJFPolicy(prefill_weight=0, aging_tokens_per_s=0, preemptive=True))`；`measure` 只返回部分指标，
#    抢占次数要自己从 `run(...).summary(trim=0.2)` 里取。被抢占的请求要重算（第 12 章），在槽位受限而 KV 充足时，抢占能让短请求不必等任何长请求。
# 5. 代码轨迹的中位数输出只有 13 Token、持续时间里有长达数分钟的空档；先用 `Workload.with_rate` 或只取一段 `time_window`，
#    并确认稳态里有排队。秩相关接近 0 的预测近似随机顺序，按 21.4 节的结果，均值不会比 FCFS 好。
# 6. A10 的 KV 池只有 {{make_cost_model("llama-3-8b", "a10").kv_capacity_tokens():,}} 个 Token，按平均长度只能同时容纳约
#    {{make_cost_model("llama-3-8b", "a10").kv_capacity_tokens() / (test.prompt_lens.mean() + test.output_lens.mean()):.0f}} 个请求。
#    一个请求占的 KV 随提示词加已生成的 Token 增长，可以预期按 $p+o$ 排序比只按 $o$ 更能把请求塞进池里；
#    这台机器上到达率稍高就过载（TTFT 随压测时长增长），稍低又不排队，而且抽到哪几个上千 Token 的长请求决定了结果——
#    每个到达率都要用较长的运行（几分钟）和多个种子，并确认延迟不随运行时长增长。
#
# </details>
