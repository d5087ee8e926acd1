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
from minibatch import EngineConfig, LLMEngine
from minibatch.policies.base import Policy
from minibatch.policies.sjf import SJFPolicy
from minibatch.results import capacity, steady_state
from minibatch.runner import run
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
# 把它按时间切成两半：**前一半用来训练**预测器（21.3 节），**后一半用来测试**；测试负载从后一半里随机抽取 400 个请求
# （提示词与输出长度成对保留），配上 Poisson 到达，每个种子抽一次。模型是 Llama-3-8B（上下文 8192），轨迹里
# 提示词加输出超过 8192 的请求放不下，先去掉。`max_num_seqs=16` 让槽位成为瓶颈。

# %%
SIM = dict(executor="sim", model="llama-3-8b", hardware="a100-80g", max_num_seqs=16)
conv_all = load_shipped_trace("azure_conv")
conv = Workload([r for r in conv_all if r.prompt_len + r.max_tokens <= 8192], name="azure_conv")
dropped = len(conv_all) - len(conv)
half = len(conv) // 2
train, test = conv.slice(0, half), conv.slice(half)
N, RATE, SEEDS = 400, 4.4, (1, 2, 3)
SLO = {"ttft": 2.0}                       # per request: first token within 2 s


def sample(seed, rate=RATE, n=N):
    """n requests drawn from the test half (prompt and output lengths kept in pairs), Poisson arrivals."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(test), n, replace=False)
    times = poisson_arrivals(n, rate, seed=seed)
    return Workload([RequestSpec(float(t), test[int(i)].prompt_len, test[int(i)].max_tokens, request_id=f"s{seed}-{j}")
                     for j, (t, i) in enumerate(zip(times, idx))], name=f"conv-test-s{seed}")


def measure(wl, policy=None):
    """Steady-state metrics (arrivals in the middle 60%: summary(trim=0.2)) of one simulated run."""
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM), clock="virtual")
    if policy is not None:
        engine.scheduler.policy = policy
    r = run(wl, engine=engine)
    s = r.summary(slo=SLO, trim=0.2)
    st = steady_state(r.requests, 0.2)
    assert all(q.completed for q in st), "every steady-state request completes"
    longest = [q for q in st if q.output_len >= np.quantile([x.output_len for x in st], 0.9)]
    return dict(e2e_mean=s["e2e_mean"], e2e_p50=s["e2e_p50"], e2e_p99=s["e2e_p99"], ttft_p50=s["ttft_p50"],
                ttft_p99=s["ttft_p99"], qd_max=max(q.queue_delay for q in st), att=s["slo_attainment"],
                long_e2e=float(np.mean([q.e2e for q in longest])), tok_s=s["throughput_tok_s"])


def med(rows, key):
    return float(np.median([r[key] for r in rows]))


def sjf(predictor=None, aging=0.0, prefill_weight=0.0):
    return SJFPolicy(predictor=predictor, aging_tokens_per_s=aging, prefill_weight=prefill_weight)


WL = {s: sample(s) for s in SEEDS}
print(f"{len(conv_all)} requests in the trace, {dropped} longer than 8192 tokens dropped; train {len(train)}, test {len(test)}; "
      f"test means: prompt {test.prompt_lens.mean():.0f}, output {test.output_lens.mean():.0f} tokens")

# %% [markdown]
# 轨迹共 {{len(conv_all)}} 个请求，去掉 {{dropped}} 个放不下的，训练集 {{len(train)}} 个、测试集 {{len(test)}} 个；测试集的平均提示词
# {{test.prompt_lens.mean():.0f}} Token、平均输出 {{test.output_lens.mean():.0f}} Token。到达率 {{RATE}} req/s 接近这台配置在 FCFS 下的服务容量
# （21.5 节的扫描），队列会时有时无地形成——队头阻塞只在这种时候才有代价；负载轻时谁先谁后都一样。
#
# 每个数字都是 3 个种子的中位数，每个种子只统计到达时间落在中间 60% 的请求（去掉预热与收尾）。先比较 FCFS 与两种先知 SJF：
# 按 $p+o$ 排序（`prefill_weight=1`，默认）与只按输出 $o$ 排序（`prefill_weight=0`）：

# %%
POLICIES = {"FCFS": lambda: None,
            "SJF by prompt + output (oracle)": lambda: sjf(prefill_weight=1.0),
            "SJF by output (oracle)": lambda: sjf()}
main = {name: [measure(WL[s], make()) for s in SEEDS] for name, make in POLICIES.items()}
COLS = [("e2e_mean", "E2E mean (s)"), ("e2e_p50", "E2E p50 (s)"), ("e2e_p99", "E2E p99 (s)"),
        ("att", "TTFT ≤ 2 s"), ("qd_max", "max queue delay (s)")]


def table(results):
    md_table(["policy"] + [c for _, c in COLS],
             [[name] + [f"{med(rows, k):.0%}" if k == "att" else f"{med(rows, k):.2f}" for k, _ in COLS]
              for name, rows in results.items()])


table(main)
fc, pw1, pw0 = (main[k] for k in POLICIES)
for rows in (pw1, pw0):
    assert med(rows, "e2e_p50") < 0.8 * med(fc, "e2e_p50") and med(rows, "att") > med(fc, "att") + 0.1, \
        "the prose says SJF cuts the median and raises TTFT attainment"
    assert med(rows, "e2e_p99") > 1.5 * med(fc, "e2e_p99") and med(rows, "qd_max") > 3 * med(fc, "qd_max"), \
        "the prose says SJF's tail and longest wait are far worse than FCFS's"
assert abs(med(pw1, "e2e_mean") / med(pw0, "e2e_mean") - 1) < 0.02 and med(pw0, "e2e_mean") < med(fc, "e2e_mean")

# %% [markdown]
# 两种先知 SJF 都把 E2E 的中位数从 FCFS 的 {{med(fc, "e2e_p50"):.2f}} s 降到 {{med(pw0, "e2e_p50"):.2f}} s 左右，TTFT ≤ 2 s 的请求比例
# 从 {{med(fc, "att"):.0%}} 升到 {{med(pw0, "att"):.0%}}；可 p99 E2E 从 {{med(fc, "e2e_p99"):.2f}} s 涨到 {{med(pw1, "e2e_p99"):.2f}} s
# （按 $p+o$）与 {{med(pw0, "e2e_p99"):.2f}} s（按 $o$），最长的排队时间从 {{med(fc, "qd_max"):.1f}} s 涨到 {{med(pw0, "qd_max"):.1f}} s——
# 等待从短请求身上转移到了长请求身上。**均值**只从 {{med(fc, "e2e_mean"):.2f}} s 降到 {{med(pw0, "e2e_mean"):.2f}} s：
# 在这个负载下，一个请求的 E2E 大部分是它自己的解码时间（平均 {{test.output_lens.mean():.0f}} 个 Token），排队只占一小部分，
# SJF 能重新分配的只是排队那部分。
#
# 两种键在这个负载上的均值几乎一样（相差不到 2%）：21.1 节的推理说占用槽位的是输出，但在这里按 $p+o$ 排序并没有因此变差。
# 差别在 p99 上，而 3 个种子的 p99 本身就有较大的波动，这张表不足以断定谁更好。
# 本章其余部分用 `prefill_weight=0`（只看输出），因为预测器要预测的正是输出。
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
assert err_pred["spearman"] > 0.5 and err_pred["mae"] < err_const["mae"] and abs(err_code["spearman"]) < 0.1

# %% [markdown]
# 这条对话轨迹里，提示词长度竟然能相当好地预测输出：分桶预测器在**没见过的后一半**上秩相关为 {{err_pred["spearman"]:.2f}}，
# 误差倍数的中位数 {{err_pred["median_factor"]:.2f}}，MAE {{err_pred["mae"]:.0f}} Token，而常数预测（训练集中位数 {{const}}）的 MAE 是
# {{err_const["mae"]:.0f}}。上图的阶梯说明了原因：提示词大约 1000–1400 Token 的请求几乎都输出约 400 Token，其余的多在 100 左右——
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
assert med(pw0, "e2e_mean") < med(pp, "e2e_mean") < med(fc, "e2e_mean"), "the prose orders the means this way"
assert med(pp, "e2e_p50") < 0.8 * med(fc, "e2e_p50") and med(pp, "e2e_p99") > 1.5 * med(fc, "e2e_p99")

# %% [markdown]
# 预测 SJF 保住了先知 SJF 的大部分好处：E2E 中位数 {{med(pp, "e2e_p50"):.2f}} s（先知 {{med(pw0, "e2e_p50"):.2f}} s），
# TTFT ≤ 2 s 的比例 {{med(pp, "att"):.0%}}，均值 {{med(pp, "e2e_mean"):.2f}} s 介于先知（{{med(pw0, "e2e_mean"):.2f}} s）与
# FCFS（{{med(fc, "e2e_mean"):.2f}} s）之间；p99 同样变差（{{med(pp, "e2e_p99"):.2f}} s）。
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
fig.suptitle("What prediction error costs (llama-3-8b, A100-80G, 16 slots, median of 3 seeds)", fontsize=10)
fig.tight_layout()
plt.show()
print(" | ".join(f"sigma {sg:g}: rank corr {rho[sg]:.2f}, E2E mean {med(noisy[sg], 'e2e_mean'):.2f} s, "
                 f"p50 {med(noisy[sg], 'e2e_p50'):.2f} s, p99 {med(noisy[sg], 'e2e_p99'):.2f} s, "
                 f"TTFT<=2s {med(noisy[sg], 'att'):.0%}" for sg in sorted(noisy)))
means = [med(noisy[0.0], "e2e_mean"), med(pp, "e2e_mean"), med(noisy[1.0], "e2e_mean"), med(noisy[8.0], "e2e_mean")]
assert means == sorted(means) and means[-1] > med(fc, "e2e_mean"), "the prose orders the means by prediction quality"
assert med(noisy[8.0], "att") > med(fc, "att") + 0.1 and abs(med(noisy[8.0], "att") - med(noisy[0.0], "att")) < 0.05, \
    "the prose says TTFT attainment hardly depends on the prediction"

# %% [markdown]
# 结果分两面（3 个种子的中位数）：
#
# - **均值**按预测质量排序：先知 {{med(noisy[0.0], "e2e_mean"):.2f}} s、分桶预测器（秩相关 {{rho_pred:.2f}}）{{med(pp, "e2e_mean"):.2f}} s、
#   σ=1（{{rho[1.0]:.2f}}）{{med(noisy[1.0], "e2e_mean"):.2f}} s、σ=8（{{rho[8.0]:.2f}}，几乎是随机顺序）{{med(noisy[8.0], "e2e_mean"):.2f}} s——
#   最后一个比 FCFS（{{med(fc, "e2e_mean"):.2f}} s）还差。长度信息买到的就是这部分：SJF 的最优性说的是平均完成时间。
# - **TTFT ≤ 2 s 的比例**却几乎不随预测质量变化：σ=8 时仍有 {{med(noisy[8.0], "att"):.0%}}，远高于 FCFS 的 {{med(fc, "att"):.0%}}。
#   这不是长度预测的功劳：拥塞的时候，FCFS 让队列里**每个**请求都等差不多一样久，一个阈值型的 SLO 就整段失守；
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


AGING = (20.0, 100.0)
aged = {f"SJF predicted, aging {a:g} tok/s": [measure(WL[s], sjf(pred, aging=a)) for s in SEEDS] for a in AGING}
aged["3 buckets (predicted)"] = [measure(WL[s], LengthBuckets(pred)) for s in SEEDS]
trade = {"FCFS": fc, "SJF predicted, no aging": pp, **aged}
table(trade)
a20, a100, b3 = aged["SJF predicted, aging 20 tok/s"], aged["SJF predicted, aging 100 tok/s"], aged["3 buckets (predicted)"]
assert med(a20, "e2e_p99") < 0.75 * med(pp, "e2e_p99") and med(a20, "qd_max") < 0.6 * med(pp, "qd_max"), \
    "the prose says aging cuts the tail and the longest wait"
assert abs(med(a20, "e2e_p50") / med(pp, "e2e_p50") - 1) < 0.05 and med(a100, "e2e_p50") > med(a20, "e2e_p50")
assert med(b3, "e2e_p99") < 0.75 * med(pp, "e2e_p99") and med(b3, "e2e_p50") < 0.8 * med(fc, "e2e_p50")

fig, ax = plt.subplots(figsize=(6.5, 3.4))
for k, (name, rows) in enumerate(trade.items()):
    ax.scatter(med(rows, "e2e_p99"), med(rows, "e2e_p50"), s=40, color=f"C{k}", label=name)
ax.set(xlabel="E2E p99 (s): the tail", ylabel="E2E p50 (s): the typical request",
       title="Starvation vs typical latency (median of 3 seeds)")
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# 老化 20 tok/s 把 p99 从 {{med(pp, "e2e_p99"):.2f}} s 拉回到 {{med(a20, "e2e_p99"):.2f}} s，最长排队从 {{med(pp, "qd_max"):.1f}} s 降到
# {{med(a20, "qd_max"):.1f}} s，中位数不变（{{med(a20, "e2e_p50"):.2f}} s）；老化 100 tok/s 让尾部更接近 FCFS（p99 {{med(a100, "e2e_p99"):.2f}} s，
# 最长排队 {{med(a100, "qd_max"):.1f}} s），中位数开始上升（{{med(a100, "e2e_p50"):.2f}} s）。代价也体现在 TTFT 达成率上：
# 从 {{med(pp, "att"):.0%}} 降到 {{med(a20, "att"):.0%}}——等久了的长请求被提前，占去了槽位。
# 三个桶的分桶队列**不加老化**就有 {{med(b3, "e2e_p99"):.2f}} s 的 p99 与 {{med(b3, "e2e_p50"):.2f}} s 的中位数：桶内 FCFS 让同一类请求不会互相饿死，
# 只需要预测器分对“短、中、长”，不必排对每一对请求。它仍可能让“长”桶在持续的短请求流下饥饿，所以实用的实现也加老化
# （`aging_s`，练习 3）。
#
# 最后用服务容量比较：对同一个种子把到达率从 4.0 扫到 4.8 req/s，求“每个请求的 TTFT ≤ 2 s 的比例不低于 90%”的最高到达率
# （`minibatch.results.capacity`，对扫描结果取“从最低速率起连续达标的最高速率”）：

# %%
RATES = (4.0, 4.4, 4.8)
CAP = {"FCFS": lambda: None, "SJF predicted": lambda: sjf(pred), "SJF predicted, aging 20 tok/s": lambda: sjf(pred, aging=20.0)}
att = {name: {rate: (measure(sample(1, rate=rate), make()) if rate != RATE else row)["att"]
              for rate in RATES}
       for (name, make), row in zip(CAP.items(), (fc[0], pp[0], aged["SJF predicted, aging 20 tok/s"][0]))}
cap = {name: capacity(a, target=0.8) for name, a in att.items()}
fig, ax = plt.subplots(figsize=(6.5, 3.2))
for name, a in att.items():
    ax.plot(list(a), list(a.values()), "o-", label=f"{name}: capacity {cap[name]:g} req/s")
ax.axhline(0.8, color="k", ls=":", lw=1)
ax.set(xlabel="arrival rate (req/s)", ylabel="share with TTFT ≤ 2 s", title="SLO attainment vs rate (seed 1, steady state)")
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
plt.show()
print({name: {r: round(v, 3) for r, v in a.items()} for name, a in att.items()}, cap)
assert cap["SJF predicted"] > cap["FCFS"], "the prose says SJF raises the capacity on this grid"

# %% [markdown]
# 在这个扫描网格上，达成率 ≥ 80%（每个请求的 TTFT ≤ 2 s）的服务容量：FCFS {{cap["FCFS"]:g}} req/s，预测 SJF {{cap["SJF predicted"]:g}} req/s，
# 加老化 20 tok/s 的预测 SJF {{cap["SJF predicted, aging 20 tok/s"]:g}} req/s。网格只有 0.4 req/s 的分辨率、只用了一个种子，
# 它只说明方向；21.4 节提醒过，这个提高有多少来自长度信息、多少来自“不公平”，要另看尾部。
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
#   按 $p+o$ 与按 $o$ 排序的均值几乎相同。
# - 输出长度可以从轨迹里学一部分：按提示词长度分桶、取桶内中位数的预测器在对话轨迹的后一半上秩相关 {{err_pred["spearman"]:.2f}}，在代码轨迹上只有 {{err_code["spearman"]:.2f}}——
#   预测器好不好取决于负载，要在留出的数据上评估。
# - 预测误差的代价主要体现在均值上：排序越准，均值越低，近似随机的顺序比 FCFS 还差；TTFT 阈值达成率却对预测质量不敏感，
#   因为任何插队都能让多数请求快速开始——比较策略时要同时看尾部与最长等待。
# - SJF 的代价是饥饿：p99 与最长排队时间成倍增长。老化（每等一秒键值减少 $a$）给等待设了上界，以少量中位数与达成率换回尾部；
#   长度分桶队列只需分类正确，桶内 FCFS 本身就限制了尾部。
# - 度量要在稳态、多个种子下做；调度顺序只在接近服务容量、队列形成时才有影响（21.5 节的扫描里，4.0 req/s 时
#   三种策略的达成率都不低于 {{min(a[4.0] for a in att.values()):.0%}}）。
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
#
# </details>
