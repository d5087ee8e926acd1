# %% [markdown]
# # 第 32 章 批内投机解码（Speculative Decoding）
#
# 第 2 章说过，解码（Decode）一步只为每个序列算一个 Token，却要把全部权重从显存读一遍：小批量时 GPU 的算力大半闲着，时间花在搬权重上。
# 投机解码（Speculative Decoding）利用这份闲置：先用一个便宜的起草器（Drafter）猜出后面 $k$ 个草稿 Token（Draft Tokens），
# 再让目标模型在**一次**前向里把这 $1 + k$ 个位置一起算完、逐个核对（Verify）。猜对几个就一步前进几个 Token，猜错的丢掉。
#
# 放进连续批处理（Continuous Batching）的引擎里，它不再是“一个请求自己的事”：草稿 Token 与别人的预填充块、解码共用同一步的 Token 预算
# （Token Budget）；批越大，一步越接近算力上限，多算的 $k$ 个位置就越不再免费。vLLM 因此在 2026 年加入了按批大小选草稿长度的
# `num_speculative_tokens_per_batch_size`，而它又在并发下出过吞吐骤降的问题（vllm#49548）。
#
# 本章在 minibatch 里实现最简单、也最常用于代码与“照抄”类任务的起草器——n-gram 提示词查找（Prompt Lookup，vLLM 的 `method="ngram"`），
# 在真实 tiny 模型上验证贪心输出逐 Token 不变，并用模拟器回答：批多大时投机不再划算。
#
# ## 学习目标
#
# - 说清起草—验证（Draft/Verify）的流程，以及为什么贪心验证（接受与目标模型 argmax 相同的最长前缀，再加一个 Token）保证输出与普通解码完全相同；
# - 读懂 n-gram 起草器的规则（最长匹配、`prompt_lookup_min/max`、匹配位置），并说出 vLLM 0.11.0 与 0.34.0 的差别；
# - 理解草稿 Token 如何计入一步的 Token 预算、被拒绝的草稿如何回滚 KV（Rollback）；
# - 在 tiny 模型上测量接受率（Acceptance Rate）与每步前进的 Token 数，并解释为什么在 CPU 上它反而更慢；
# - 用屋顶线（Roofline）成本模型画出 8B 模型在 H100 上加速比随批大小的曲线，找到“不再划算”的批大小，并据此写出按批大小选草稿长度的表；
# - 读懂 vllm#49548 报告的数字，分清“投机在大批量下不划算”与“动态切换引起的吞吐骤降”是两回事。

# %%
import inspect
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np

import minibatch
from minibatch import LLM, EngineConfig, LLMEngine, SamplingParams
from minibatch.sim import make_cost_model
from minibatch.sim.spec_decode import best_draft_length, spec_step_speedup
from minibatch.spec_decode import accepted_tokens, draft_length, expected_tokens_per_step, propose_ngram
from minibatch.viz import md_table

print("minibatch", minibatch.__version__)

# %% [markdown]
# ## 32.1 起草与验证
#
# **起草。** n-gram 提示词查找不需要任何模型：取序列（提示词加已生成的 Token）末尾的 $n$ 个 Token，在序列前面找同样的 $n$ 个 Token，
# 把紧跟在那次出现之后的（至多）$k$ 个 Token 当作草稿。$n$ 从 `prompt_lookup_max` 往下试到 `prompt_lookup_min`，先找到的（最长的）匹配胜出。
# 代码补全、改写文档、复述上下文这类任务里，模型常常在“抄”前文，这样的猜测很准；对自由生成的文字则几乎猜不中。
#
# vLLM 0.11.0 的 `vllm/v1/spec_decode/ngram_proposer.py`（`_find_longest_matched_ngram_and_propose_tokens`，用 KMP 的前缀函数一遍扫完）
# 在同样长的匹配里取**最早**的一次出现；`prompt_lookup_min/max` 都不给时取 5（`vllm/config/speculative.py`）。
# minibatch 的 `propose_ngram` 按同一规则实现（与移植的 vLLM 函数在两万个随机序列上逐一比对，结果相同）。用 vLLM 源码注释里的例子：

# %%
print(inspect.getsource(propose_ngram))
example = propose_ngram([1, 2, 3, 4, 2, 3], min_n=2, max_n=3, k=4)
print("drafts for [1, 2, 3, 4, 2, 3], n in [2, 3], k = 4:", example)

# %% tags=["check"]
assert example == [4, 2, 3]
assert propose_ngram([1, 2, 5, 1, 2, 6, 1, 2], 2, 2, 3) == [5, 1, 2], "the prose says: the earliest occurrence"

# %% [markdown]
# 末尾 3 个 Token `[4, 2, 3]` 在前面没有出现过；末尾 2 个 `[2, 3]` 出现在开头，它后面只剩 3 个 Token，于是草稿是 {{example}}（不足 $k$ 个就给多少算多少）。
# 到了 vLLM 0.34.0，CPU 上的 n-gram 起草器已被 GPU 上的 `ngram_gpu` 取代（`vllm/v1/worker/gpu/spec_decode/ngram/speculator.py`），
# 它把 $(n, \text{位置})$ 打包后取最大值，即同样长的匹配里取**最近**（最右）的一次出现——两个版本在重复多次的模式上会给出不同的草稿，练习 2 比较二者。
#
# **验证。** 一个带 $k$ 个草稿的序列在这一步算 $1 + k$ 个位置：待算的那个 Token（上一步采样出来、还没有 KV 的）加上 $k$ 个草稿，
# 对目标模型来说就是一个带已有 KV 的短预填充块（Chunk，第 11 章）。位置 $i$ 的输出是“上下文 + 前 $i$ 个草稿”之后目标模型自己的下一个 Token $t_i$。
# 贪心验证（温度 0）从头比较：草稿 $d_i = t_i$ 就接受，遇到第一个不等就停；最后再追加一个目标模型自己的 Token——
# 全部接受时是多出来的“奖励 Token”（Bonus Token），否则是第一个不匹配位置上目标模型的 $t_a$：

# %%
print(inspect.getsource(accepted_tokens))
for draft, target in (([4, 5, 6], [4, 5, 6, 7]), ([4, 5, 6], [4, 9, 6, 7]), ([4, 5, 6], [1, 5, 6, 7])):
    print(f"drafts {draft}, target argmax {target} -> append {accepted_tokens(draft, target)}")

# %% [markdown]
# 为什么输出与普通解码**逐 Token 相同**：被追加的每个 Token 都是目标模型在“它前面那些 Token 都正确”的上下文里的 argmax——
# 接受的草稿 $d_i$ 正因为等于 $t_i$ 才被接受，最后那个 Token 本来就是 $t_a$。普通解码一步一个地算，得到的恰好是同一串 $t_0, t_1, \dots$；
# 投机只是把其中几步合成了一步。被拒绝的草稿算出的 K/V 作废：请求的已算 Token 数（`num_computed_tokens`）只加到被接受的位置为止，
# 只装了作废 KV 的块退回块池（`release_rejected_blocks`），块内作废的槽位下一步直接覆盖。
#
# 这条论证只对贪心成立。温度大于 0 时要用 Leviathan 等（ICML 2023）的拒绝采样（Rejection Sampling）才能保持分布不变，vLLM 的
# `vllm/v1/sample/rejection_sampler.py` 正是这样做的；minibatch 没有实现它：带温度、要 `logprobs` 或 `min_tokens` 尚未满足的请求照常一步一个 Token，不带草稿。
#
# 在 tiny 模型上开关投机各跑一遍。提示词有的是重复的片段（起草器找得到），有的是不重复的随机 Token：

# %%
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(3, 2000, 16).tolist() * 4, rng.integers(3, 2000, 12).tolist() * 5,
           rng.integers(3, 2000, 64).tolist(), rng.integers(3, 2000, 48).tolist()]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
BUDGET = 6                                   # the token budget of 32.2's engine
off_llm, on_llm = LLM("tiny", max_num_seqs=8), LLM("tiny", max_num_seqs=8, **SPEC)
off_tokens = [o.outputs[0].token_ids for o in off_llm.generate(PROMPTS, GREEDY)]
on_tokens = [o.outputs[0].token_ids for o in on_llm.generate(PROMPTS, GREEDY)]
metrics = on_llm.engine.spec_decode_metrics()
acc_rate = metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_draft_tokens"]
print("identical tokens:", on_tokens == off_tokens)
for name, value in metrics.items():
    print(f"{name:40s} {value}")
print(f"steps: {len(off_llm.engine.steps)} without speculation, {len(on_llm.engine.steps)} with")

# %% tags=["check"]
assert on_tokens == off_tokens, "the prose says greedy outputs are identical"
assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
assert len(on_llm.engine.steps) < len(off_llm.engine.steps)

# %% [markdown]
# 四个请求的输出逐 Token 相同。计数器用的是 vLLM 的 Prometheus 名字（`vllm/v1/spec_decode/metrics.py`，0.11.0）：
# {{metrics["vllm:spec_decode_num_drafts"]}} 次起草（某个序列在某一步带了草稿）共 {{metrics["vllm:spec_decode_num_draft_tokens"]}} 个草稿 Token，
# 接受 {{metrics["vllm:spec_decode_num_accepted_tokens"]}} 个，接受率 {{acc_rate:.0%}}；同样的 Token 少用了
# {{len(off_llm.engine.steps) - len(on_llm.engine.steps)}} 步（{{len(off_llm.engine.steps)}} 步对 {{len(on_llm.engine.steps)}} 步）。
# `tests/test_spec_decode.py` 在每种调度策略、分块预填充、前缀缓存与抢占下，以及对照 Hugging Face `generate`，都检查了这一点。
#
# ## 32.2 草稿占用 Token 预算
#
# 草稿 Token 不是免费的附件：它们与解码一起排进这一步，计入 `max_num_batched_tokens`。vLLM 0.11.0 的调度器
# （`vllm/v1/core/sched/scheduler.py`）里，运行中请求的 `num_new_tokens` 就包含它的 `spec_token_ids`，
# 预算不够时从尾部截掉草稿；验证之后按被拒绝的个数把 `num_computed_tokens` 减回去（那些块留着，下一步覆盖）。
# minibatch 的调度器多一条规则：**草稿只用这一步其他解码用剩的预算**——按策略的顺序，排在后面的每个运行中解码先各留一个 Token，
# 所以开了投机也不会有解码被挤出这一步。
#
# 用一个只有 {{BUDGET}} 个 Token 预算的引擎看一步里的构成。包一层执行器（Executor），记下每一步每个请求算了几个 Token、其中几个是草稿：

# %%
class Recorder:
    """Wraps an executor; records each step's (request id, new tokens, drafts)."""

    def __init__(self, inner):
        self.inner, self.steps, self.running = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch, kv):
        self.steps.append([(r.request_id, n, len(r.spec_token_ids)) for r, n in batch.items])
        self.running.append(len(kv.req_blocks))          # requests holding KV blocks: those running
        return self.inner.execute(batch, kv)


def engine_with(budget, **kw):
    config = EngineConfig.from_kwargs(model="tiny", max_num_batched_tokens=budget, max_num_seqs=3, **kw)
    engine = LLMEngine(config, clock="virtual")
    engine.executor = rec = Recorder(engine.executor)
    return engine, rec


engine, rec = engine_with(BUDGET, **SPEC)
for p in PROMPTS[:3]:
    engine.add_request(p[:2], GREEDY)
while engine.has_unfinished_requests():
    engine.step()
budget_rows = [[i, " + ".join(f"{n - d}+{d}" if d else f"{n}" for _, n, d in s), sum(n for _, n, _ in s)]
               for i, s in enumerate(rec.steps) if any(d for _, _, d in s)][:6]
md_table(["step", "tokens per request (decode + drafts)", "tokens in the step"], budget_rows)

# %% tags=["check"]
assert all(sum(n for _, n, _ in s) <= BUDGET for s in rec.steps)
assert all(len(s) == n for s, n in zip(rec.steps, rec.running)), "every running request runs in every step"

# %% [markdown]
# 三个请求同时解码时，每一步都是三个序列；草稿只占预算里剩下的 {{BUDGET - 3}} 个 Token，由排在前面、找得到草稿的序列先拿。
# 真实部署的预算是几千个 Token（vLLM 0.11.0 的 `vllm serve` 在 A100 上默认 2048，见第 20 章），解码批很少把它用满；
# 真正的约束在后面：批大了以后，多算的这些位置开始花时间。
#
# ## 32.3 接受率：在 tiny 模型上测
#
# 一个序列一步前进的期望 Token 数，取决于每个草稿被接受的概率 $\alpha$。若各草稿独立、都以 $\alpha$ 被接受（直到第一次拒绝），
# 带 $k$ 个草稿的一步期望前进
#
# $$ E[\text{tokens}] = 1 + \alpha + \alpha^2 + \dots + \alpha^k = \frac{1 - \alpha^{k+1}}{1 - \alpha} $$
#
# 个 Token（Leviathan et al., ICML 2023, 式 1）。$\alpha = 0.6$、$k = 3$ 时是 {{expected_tokens_per_step(0.6, 3):.2f}}，$k$ 再大收益递减。
# 在 tiny 模型上按草稿长度测一遍（重复片段的提示词，每个长度一批 8 个请求）：

# %%
def spec_run(k, prompts, batch, max_tokens=48):
    """Greedy run with k drafts (0: off); returns (tokens, metrics, steps)."""
    kw = dict(SPEC, num_speculative_tokens=k) if k else {}
    llm = LLM("tiny", max_num_seqs=batch, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm.engine.spec_decode_metrics(), len(llm.engine.steps)


REPEAT = [rng.integers(3, 2000, int(n)).tolist() * 4 for n in rng.integers(12, 24, 8)]
acc_rows, acc_by_k = [], {}
for k in (1, 2, 4, 6):
    _, m, steps = spec_run(k, REPEAT, 8)
    drafted, accepted, drafts = (m[f"vllm:spec_decode_num_{x}"] for x in ("draft_tokens", "accepted_tokens", "drafts"))
    acc_by_k[k] = (accepted / drafted, 1 + accepted / drafts)
    acc_rows.append([k, drafts, drafted, accepted, f"{accepted / drafted:.2f}", f"{1 + accepted / drafts:.2f}", steps])
md_table(["k", "drafts", "draft tokens", "accepted", "acceptance rate", "tokens per verify step", "steps"], acc_rows)

# %% [markdown]
# 随机权重的 tiny 模型并不会去“抄”提示词里的片段：它很快进入自己的短循环，起草器在它**自己的输出**里找到的匹配才是被接受的那些。
# 接受率随 $k$ 下降（$k = 1$ 时 {{acc_by_k[1][0]:.2f}}，$k = 6$ 时 {{acc_by_k[6][0]:.2f}}）：越靠后的草稿越难猜中，
# 每步前进的 Token 数从 {{acc_by_k[1][1]:.2f}} 只涨到 {{acc_by_k[6][1]:.2f}}。真实模型在代码编辑等任务上的接受率高得多，
# 这里的数字只说明测量方法，下面的模拟器用 $\alpha$ 作参数。
#
# ## 32.4 加速比与批大小
#
# 一步的时间在小批量时几乎只取决于读权重（访存受限，Memory-bound），多算几个位置不加时间；批大到 GEMM 变成算力受限（Compute-bound，第 2 章的脊点）以后，
# 一步的时间与 Token 数成正比，验证 $1 + k$ 个位置就要花约 $1 + k$ 倍的时间，却只换来 $E[\text{tokens}] < 1 + k$ 个 Token。
# 加速比
#
# $$ \text{speedup}(B) = E[\text{tokens}] \cdot \frac{T_\text{decode}(B)}{T_\text{verify}(B, k)} $$
#
# 先在 tiny 模型上实测：批 1 与批 8，开关投机交替各跑 3 轮，比值取中位数，同时记下两种步的实测时长：

# %%
def timed(k, prompts, batch):
    """Throughput of one greedy run, and the forward times of its pure steps: decode-only steps
    (k = 0), or steps where every sequence verifies drafts (k > 0); the prompt's step excluded."""
    llm = LLM("tiny", max_num_seqs=batch, **(dict(SPEC, num_speculative_tokens=k) if k else {}))
    llm.generate(prompts[:2], GREEDY)                                   # warm-up
    n0 = len(llm.engine.steps)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, GREEDY)
    dt = time.perf_counter() - t0
    steps = llm.engine.steps[n0:]
    pure = [s.forward_time for s in steps if (s.num_prefill_tokens == 0 if not k else
            s.num_decode_tokens == 0 and 0 < s.num_prefill_tokens <= (1 + k) * s.num_seqs)]
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, pure


def ms(times):
    return f"{statistics.median(times) * 1e3:.2f} ({len(times)})" if times else "—"


tiny_mib = sum(p.numel() * p.element_size() for p in off_llm.engine.executor.model.parameters()) / 2**20
tiny_rows, tiny_ratio, tiny_rounds = [], {}, {}
for batch in (1, 8):
    ratios, f_off, f_on = [], [], []
    for r in range(3):
        order = (0, 2) if r % 2 == 0 else (2, 0)
        res = {k: timed(k, REPEAT[:batch], batch) for k in order}
        ratios.append(res[2][0] / res[0][0])
        f_off += res[0][1]
        f_on += res[2][1]
    step_ratio = statistics.median(f_on) / statistics.median(f_off) if f_on else float("nan")
    tiny_ratio[batch], tiny_rounds[batch] = (statistics.median(ratios), step_ratio), ratios
    tiny_rows.append([batch, ", ".join(f"{x:.2f}" for x in ratios), f"{tiny_ratio[batch][0]:.2f}", ms(f_off), ms(f_on)])
md_table(["batch", "on/off throughput per round (k = 2)", "median", "decode step ms (steps)",
          "verify step ms (steps)"], tiny_rows)

# %% tags=["check"]
assert all(statistics.median(rs) < 1.0 for rs in tiny_rounds.values()), "the prose says slower at both batch sizes"
assert tiny_ratio[1][1] > 1.5, "the prose says a verify step costs well over a decode step on this CPU"

# %% [markdown]
# 在这台 CPU 上投机**更慢**：批 1 时吞吐比为 {{tiny_ratio[1][0]:.2f}}，批 8 时 {{tiny_ratio[8][0]:.2f}}。原因有两个，都能从表里读出来：
# 一是 tiny 模型的接受率低（32.3 节），二是 CPU 上多算几个位置并不便宜——tiny 模型的权重只有 {{tiny_mib:.0f}} MiB，CPU 的算力与带宽之比
# 又远低于 GPU，一步很快就按 Token 数付费；再加上解码走的是专门为单 Token 查询优化的 C 路径（`MINIBATCH_FUSED_DECODE`），
# 而验证步走的是分块预填充的路径。批 1 时，
# 每个序列都带草稿的验证步，中位时长是纯解码步的 {{tiny_ratio[1][1]:.1f}} 倍（表中括号里是参与统计的步数）。投机解码要的前提——“多算几个位置几乎不花时间”——在这里不成立。
# （计时受这台机器上其他进程的干扰，比值在几轮之间有波动，两个批大小的中位数都低于 1。）
#
# 同样的问题换到 GPU 上，答案取决于批大小。用第 2 章的屋顶线成本模型算 Llama-3.1-8B 在一张 H100 上的加速比，$k = 3$，
# 上下文 256 / 1024 / 4096 个 Token，$\alpha$ 取 0.6 与 0.8：

# %%
cm = make_cost_model("llama-3.1-8b", "h100")
BATCHES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
curves = {(ctx, a): [spec_step_speedup(cm, b, ctx, 3, a)["speedup"] for b in BATCHES]
          for ctx in (256, 1024, 4096) for a in (0.6, 0.8)}
fig, ax = plt.subplots(figsize=(7, 3.2))
for (ctx, a), ys in curves.items():
    ax.plot(BATCHES, ys, color={256: "C0", 1024: "C1", 4096: "C2"}[ctx], ls="-" if a == 0.6 else "--",
            label=f"context {ctx}, acceptance {a}")
ax.axhline(1.0, color="k", lw=0.8)
ax.set(xscale="log", xlabel="decoding sequences in the batch", ylabel="speed-up with k = 3",
       title="Llama-3.1-8B on H100 (roofline): where speculation stops paying")
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
plt.show()
stop_at = {key: next((b for b, s in zip(BATCHES, ys) if s < 1.0), None) for key, ys in curves.items()}
stop_at

# %% tags=["check"]
assert curves[256, 0.6][0] > 2.0 and curves[256, 0.6][-1] < 1.0 and stop_at[256, 0.6] is not None
assert stop_at[4096, 0.6] is None and stop_at[1024, 0.8] is None, "the prose says long contexts keep paying"

# %% [markdown]
# 小批量时加速比接近 $E[\text{tokens}]$（$\alpha = 0.6$ 时批 1 为 {{curves[256, 0.6][0]:.2f}}，$E$ 为 {{expected_tokens_per_step(0.6, 3):.2f}}）：
# 验证步几乎与解码步一样快。过了 GEMM 的脊点，曲线迅速下跌：上下文 256、$\alpha = 0.6$ 时，批到 {{stop_at[256, 0.6]}} 就低于 1，
# 投机开始**亏**（批 1024 时 {{curves[256, 0.6][-1]:.2f}}）。上下文越长，解码步里读 KV 的注意力时间占比越大，而验证 $1 + k$ 个位置读的仍是同一份 KV，
# 这部分不随 $k$ 变贵：上下文 4096 时即使批 1024 加速比也还有 {{curves[4096, 0.6][-1]:.2f}}。这正是 vllm#48627 的论点——
# “批大了投机就不划算”只是短上下文下的结论，它因此提议给 `num_speculative_tokens_per_batch_size` 再加一个上下文长度的维度。
#
# 闭式公式假设批处于稳态、每一步都是同样的解码。用模拟器让引擎真跑一遍（`SimExecutor`：草稿是占位 Token，每个以 `spec_acceptance_rate` 被接受，
# 验证步按 $1 + k$ 个 Token 的块计价）：B 个请求同时到达，提示词 256 个 Token，各生成 128 个：

# %%
def sim_throughput(batch, **spec):
    """Output tokens per second (virtual time) of `batch` requests on the simulated 8B / H100."""
    engine = LLMEngine(EngineConfig.from_kwargs(model="llama-3.1-8b", executor="sim", hardware="h100",
                                                max_num_seqs=batch, max_num_batched_tokens=8192, **spec),
                       clock="virtual")
    for i in range(batch):
        engine.add_request([3 + i] * 256, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return batch * 128 / engine.clock.now()


SIM_SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, spec_acceptance_rate=0.6)
SIM_BATCHES = (1, 16, 64, 256)
sim_off = {b: sim_throughput(b) for b in SIM_BATCHES}
sim_on = {b: sim_throughput(b, **SIM_SPEC) for b in SIM_BATCHES}
md_table(["batch", "tok/s off", "tok/s on (k = 3, acceptance 0.6)", "on / off", "closed form (context 256)"],
         [[b, f"{sim_off[b]:,.0f}", f"{sim_on[b]:,.0f}", f"{sim_on[b] / sim_off[b]:.2f}",
           f"{spec_step_speedup(cm, b, 320, 3, 0.6)['speedup']:.2f}"] for b in SIM_BATCHES])

# %% tags=["check"]
assert sim_on[1] / sim_off[1] > 1.5 and sim_on[256] / sim_off[256] < 1.0, "the prose says it pays at 1, loses at 256"

# %% [markdown]
# 引擎跑出来的比值与闭式公式方向一致：批 1 时投机让吞吐变为 {{sim_on[1] / sim_off[1]:.2f}} 倍，批 256 时只剩 {{sim_on[256] / sim_off[256]:.2f}} 倍。
# 引擎的比值略低于公式，因为它还包含预填充步（那里没有草稿）和请求陆续结束时的尾部。
#
# ## 32.5 按批大小选草稿长度
#
# 既然最优的 $k$ 随批大小变，就让它随批大小变。vLLM 的动态投机解码（Dynamic SD，PR #32374 合入）加了 `num_speculative_tokens_per_batch_size`；
# 0.34.0 里它是 `vllm/config/speculative.py` 的一个字段，形如 `[[1, 16, 3], [17, 128, 1], [129, 512, 0]]`：每项是一个**闭区间**的批大小和这时用的 $k$。
# `vllm/v1/spec_decode/dynamic/utils.py` 的 `build_dynamic_sd_schedule_lookup` 把它展开成一张“批大小 → $k$”的表：第一个区间必须从 1 开始，
# 区间之间的空档沿用前一个区间的 $k$，最后一个区间之后也沿用它，所有值都截到 `num_speculative_tokens`（它仍是上限）。调度器按这一步排进的请求数查表。
# minibatch 的同名选项规则相同，按调度开始时运行中的请求数查表（`minibatch.spec_decode.draft_length`）：

# %%
print(inspect.getsource(draft_length))
best = {b: best_draft_length(cm, b, 256, 0.6, max_k=6) for b in BATCHES}
best

# %% [markdown]
# 上面是用成本模型对每个批大小挑出的最优 $k$（上下文 256、$\alpha = 0.6$，$k \le 6$）：批小时 {{best[1]}}，批 1024 时 {{best[1024]}}。
# 把它写成一张区间表，与固定 $k = 3$、不投机在模拟器里比一比：

# %%
def as_schedule(best_k):
    """Collapse {batch: k} into vLLM's [[lo, hi, k], ...] ranges."""
    rows, bs = [], sorted(best_k)
    for i, b in enumerate(bs):
        lo = 1 if i == 0 else bs[i - 1] + 1
        if rows and rows[-1][2] == best_k[b]:
            rows[-1][1] = b
        else:
            rows.append([lo, b, best_k[b]])
    return rows


SCHEDULE = as_schedule(best)
print("num_speculative_tokens_per_batch_size =", SCHEDULE)
DYN = dict(SIM_SPEC, num_speculative_tokens=max(best.values()), num_speculative_tokens_per_batch_size=SCHEDULE)
sim_dyn = {b: sim_throughput(b, **DYN) for b in SIM_BATCHES}
md_table(["batch", "k = 3 / off", "schedule / off"],
         [[b, f"{sim_on[b] / sim_off[b]:.2f}", f"{sim_dyn[b] / sim_off[b]:.2f}"] for b in SIM_BATCHES])

# %% tags=["check"]
assert all(sim_dyn[b] >= 0.97 * max(sim_on[b], sim_off[b]) for b in SIM_BATCHES), "the schedule is never worse"

# %% [markdown]
# 按表切换的 $k$ 在每个批大小上都不比“固定 $k = 3$”与“不投机”中较好的那个差：小批量时它用更长的草稿（批 1 时吞吐是不投机的
# {{sim_dyn[1] / sim_off[1]:.2f}} 倍），批 256 时几乎关掉投机（{{sim_dyn[256] / sim_off[256]:.2f}} 倍，而固定 $k = 3$ 只有 {{sim_on[256] / sim_off[256]:.2f}} 倍）。
# 这张表依赖硬件、模型、上下文长度和接受率，vLLM 因此不给默认值（PR #32374 的说明：区间随硬件与模型种类而变，稠密模型与 MoE 不同）。
#
# ## 32.6 vllm#49548：动态切换在并发下的吞吐骤降
#
# vllm#49548（2026-07-23，仍未关闭）报告：Qwen3.5-122B 用 MTP（$k = 2$）时，按表 `[[1,4,2],[5,512,0]]` 打开动态投机（批 ≤ 4 时 $k = 2$，批 ≥ 5 时关闭），
# 8 个并发、每个 180 个 Token 的请求，总吞吐从固定 $k = 2$ 时的约 232 tok/s 掉到 24–157 tok/s，墙钟时间从约 6.3 s 变成 40–60 s；
# 单请求时只有预期中的约 14% 损失（59.6 → 50.0 tok/s，来自动态投机迫使 CUDA 图从 `FULL_AND_PIECEWISE` 降级为 `PIECEWISE`）。
# 报告者的预期是：批 ≥ 5 时 $k = 0$，吞吐应回到不投机的水平；实际却像是一种病态的停顿，本章写作时根因尚未确认。
# 相关的 PR #53407（已合入）与 #56136（未合入）描述了同一机制里的问题：草稿长度决定验证的查询长度，解码批可能被派发到不匹配的
# CUDA 图，退回 `PIECEWISE`，注意力每步在主机的关键路径上即时执行。
#
# 这与 32.4 节的效应是两回事：32.4 节说的是**设计之内**的代价（批大了验证变贵），#49548 是**实现上**的代价（切换 $k$ 破坏了 CUDA 图的复用）。
# minibatch 没有 CUDA 图，模拟器也不模拟它们，所以无法复现那次骤降；它能回答的是报告者的预期是否合理——在同样的表与负载下，
# 动态投机应当落在“不投机”与“固定 $k$”之间：

# %%
def sim_case(batch, max_tokens=180, **spec):
    engine = LLMEngine(EngineConfig.from_kwargs(model="llama-3.1-8b", executor="sim", hardware="h100",
                                                max_num_seqs=64, **spec), clock="virtual")
    for i in range(batch):
        engine.add_request([5 + i] * 64, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return batch * max_tokens / engine.clock.now()


ISSUE = dict(speculative_method="ngram", num_speculative_tokens=2, spec_acceptance_rate=0.6)
# vllm#49548 as reported: tok/s at 8 concurrent requests, and the wall-clock seconds of the workload.
UPSTREAM = dict(static=232, dynamic=(24, 157), wall_static=6.3, wall_dynamic=(40, 60))
issue = {b: {"off": sim_case(b), "static k=2": sim_case(b, **ISSUE),
             "[[1,4,2],[5,512,0]]": sim_case(b, **ISSUE, num_speculative_tokens_per_batch_size=[[1, 4, 2], [5, 512, 0]])}
         for b in (1, 8)}
md_table(["concurrent requests", *issue[1]], [[b, *(f"{v:,.0f}" for v in issue[b].values())] for b in issue])

# %% tags=["check"]
assert abs(issue[8]["[[1,4,2],[5,512,0]]"] / issue[8]["off"] - 1) < 0.02, "the prose says batch 8 runs as no speculation"
assert issue[1]["[[1,4,2],[5,512,0]]"] == issue[1]["static k=2"]
ratio_49548 = issue[8]["[[1,4,2],[5,512,0]]"] / issue[8]["static k=2"]
assert UPSTREAM["dynamic"][0] / UPSTREAM["static"] < ratio_49548 < UPSTREAM["dynamic"][1] / UPSTREAM["static"]

# %% [markdown]
# 在模拟的 8B/H100 上，8 个并发请求时按表运行的吞吐是不投机的 {{issue[8]["[[1,4,2],[5,512,0]]"] / issue[8]["off"]:.2f}} 倍，
# 单请求时与固定 $k = 2$ 相同——这就是报告者预期的行为。在这个批大小上固定 $k = 2$ 仍然更快（{{issue[8]["static k=2"] / issue[8]["off"]:.2f}} 倍）。
# 按表运行相对固定 $k = 2$ 的比值是 {{issue[8]["[[1,4,2],[5,512,0]]"] / issue[8]["static k=2"]:.2f}}；报告里这个比值是
# {{UPSTREAM["dynamic"][0] / UPSTREAM["static"]:.2f}}–{{UPSTREAM["dynamic"][1] / UPSTREAM["static"]:.2f}}（{{UPSTREAM["dynamic"][0]}}–{{UPSTREAM["dynamic"][1]}} 对 {{UPSTREAM["static"]}} tok/s）。
# 方向相同（阈值以上关掉投机就比固定 $k$ 慢），模拟器的比值落在报告的区间之内；但报告的下沿远低于任何“不投机”所能解释的水平
# （墙钟时间是固定 $k$ 的 {{UPSTREAM["wall_dynamic"][0] / UPSTREAM["wall_static"]:.0f}}–{{UPSTREAM["wall_dynamic"][1] / UPSTREAM["wall_static"]:.0f}} 倍），那一段就是模拟器复现不了的骤降。
# 这也说明那张表把阈值定得太低：按 32.4 节的曲线，短上下文下 8B 模型在 H100 上直到批 {{stop_at[256, 0.6]}} 附近投机都还划算。
# 真实 GPU 上还要减去 CUDA 图降级的固定损失（报告中的 14%），阈值附近切换得越频繁，越要测了再定。
#
# ## 32.7 框架对照
#
# | 框架（版本与文件） | 选项 | 规则与默认值 |
# |---|---|---|
# | vLLM 0.11.0（`vllm/v1/spec_decode/ngram_proposer.py`，`vllm/config/speculative.py`） | `speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max": ..}` | CPU 上的 KMP 匹配：$[n_\min, n_\max]$ 里最长的匹配，同长取最早的一次；$n_\min, n_\max$ 都不给时为 5；草稿不超过 `max_model_len` |
# | vLLM 0.11.0（`vllm/v1/core/sched/scheduler.py`） | — | 运行中请求的 `num_new_tokens` 含 `spec_token_ids`，计入 Token 预算，不够时截掉草稿；验证后 `num_computed_tokens -= num_rejected`，块不退回 |
# | vLLM 0.11.0（`vllm/v1/sample/rejection_sampler.py`，`vllm/v1/spec_decode/metrics.py`） | — | 贪心验证与随机拒绝采样（Leviathan et al.）；计数器 `vllm:spec_decode_num_drafts`、`..._num_draft_tokens`、`..._num_accepted_tokens` |
# | vLLM 0.34.0（`vllm/v1/worker/gpu/spec_decode/ngram/speculator.py`） | `method="ngram_gpu"` | GPU 上的 Triton 扫描：最长匹配，同长取最近（最右）的一次 |
# | vLLM 0.34.0（`vllm/config/speculative.py`，`vllm/v1/spec_decode/dynamic/utils.py`） | `num_speculative_tokens_per_batch_size`（PR #32374） | 默认不开；闭区间 `[lo, hi, k]`，第一个区间从 1 开始，空档与尾部沿用前一个 $k$，截到 `num_speculative_tokens`；按这一步排进的请求数查表 |
# | minibatch（`minibatch/spec_decode.py`，`minibatch/scheduler.py`） | `speculative_method="ngram"`、`num_speculative_tokens`（默认 0）、`prompt_lookup_min/max`、`num_speculative_tokens_per_batch_size` | 只对贪心请求起草；草稿计入预算但不挤掉后面的解码；拒绝后退回只装作废 KV 的块；计数器同 vLLM 的名字；模拟器用 `spec_acceptance_rate`（默认 0.6） |
#
# `benchmarks/spec_decode.py` 把本章的测量放大：tiny 模型上批 1、4、16、64，重复与随机两种提示词各 3 轮交替；模拟器上三种上下文、两个接受率的整条曲线与引擎实测。
#
# ## 本章小结
#
# - 投机解码先起草 $k$ 个 Token、再用一次前向验证 $1 + k$ 个位置；贪心验证接受与 argmax 相同的最长前缀再加一个 Token，输出与普通解码逐 Token 相同——
#   tiny 模型上开关投机的 {{len(PROMPTS)}} 个请求完全一致，接受率 {{acc_rate:.0%}}。
# - n-gram 起草器在序列自身里找末尾 $n$ 个 Token 的上一次出现：vLLM 0.11.0 取最早的一次，0.34.0 的 `ngram_gpu` 取最近的一次。
# - 在批里，草稿 Token 计入 Token 预算；被拒绝的草稿让 `num_computed_tokens` 回退、KV 作废。
# - 加速比是 $E[\text{tokens}] \cdot T_\text{decode} / T_\text{verify}$：访存受限时接近 $E$，算力受限后跌破 1。8B/H100、上下文 256、$\alpha = 0.6$ 时，批 {{stop_at[256, 0.6]}} 起不再划算；
#   长上下文让验证一直便宜。CPU 上的 tiny 模型连批 1 都不划算（{{tiny_ratio[1][0]:.2f}} 倍）。
# - `num_speculative_tokens_per_batch_size` 把“最优 $k$ 随批大小下降”写成一张表；模拟器里按表运行在每个批大小上都不比固定 $k$ 与不投机差。
# - vllm#49548 的骤降来自动态 $k$ 与 CUDA 图的交互，不是投机本身的代价；按设计，阈值以上的吞吐应回到不投机的水平。
#
# ## 练习
#
# 1. **接受率与 $k$。** 在 32.3 节把 `prompt_lookup_min` 与 `prompt_lookup_max` 改成 2 和 4，接受率与每步前进的 Token 数怎样变化？为什么更长的最短匹配会让草稿更少、更准？
# 2. **最早还是最近。** 仿照 vLLM 0.34.0 的 `ngram_gpu`，写一个在同样长的匹配里取**最近**一次出现的 `propose_ngram_latest`，
#    在 `[1, 2, 5, 1, 2, 6, 1, 2]` 上与 `propose_ngram` 比较；再在 tiny 模型的输出上统计两种规则的接受率。
# 3. **长上下文。** 用 `spec_step_speedup` 画出上下文 16384 时的曲线，并用 `best_draft_length` 写出这时的 `num_speculative_tokens_per_batch_size`。
#    与 32.5 节的表相比，阈值移到了哪里？这与 vllm#48627 提议的“批大小 × 上下文长度”的二维表有什么关系？
# 4. **预算的另一面。** 把 32.2 节的预算降到 4，三个请求里还有谁能带草稿？如果让草稿与后面的解码**平等竞争**预算（去掉 minibatch 多出的那条规则），
#    哪个请求会被挤出这一步？用 `Recorder` 验证你的回答。
#
# <details><summary>提示与参考答案</summary>
#
# 1. `spec_run(k, REPEAT, 8)` 前把 `SPEC` 的两个值改掉。最短匹配更长时，只在更长的重复片段上才起草：起草次数（`vllm:spec_decode_num_drafts`）减少，
#    但每次的草稿来自更确定的上下文，接受率上升；每步前进的 Token 数取决于两者的乘积。
# 2. 在 `while True` 循环里不要在第一次匹配时返回，而是记下最后一次匹配的位置 `i`，循环结束后若有匹配再返回 `tokens[i + n:i + n + k]`。
#    在那个例子上最早的一次给出 `[5, 1, 2]`，最近的一次给出 `[6, 1, 2]`。模型在循环里时，最近的一次更可能延续当前的循环。
# 3. `[spec_step_speedup(cm, b, 16384, 3, 0.6)["speedup"] for b in BATCHES]`；上下文越长注意力占比越大，加速比在整个范围内都大于 1，
#    `as_schedule({b: best_draft_length(cm, b, 16384, 0.6, max_k=6) for b in BATCHES})` 里大批量也保留几个草稿。一维的表只能为一种上下文长度调好。
# 4. 预算 4、三个解码时只剩 1 个 Token 给草稿，只有排在最前面的请求能带 1 个。去掉规则（`_drafts` 的 `room` 用 `budget - 1`）后，
#    第一个请求拿走 $1 + 3$ 个 Token，第三个请求这一步就不会被调度——它的 TPOT 变长，投机的收益被别人付了钱。
#
# </details>
