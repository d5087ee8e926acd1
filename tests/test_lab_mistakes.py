"""The labs' graders reject wrong-but-plausible solutions, and say what was expected.

Each case is one mistake a learner makes in one task: the reference solution with that
mistake, written out below. It is graded (``minibatch.labs.grader.grade``) in a learner
notebook whose other task cells hold the reference solutions (the answer key's task cells).
Each case checks that

* the mistaken task fails, and its failing check says what was expected (a distinctive
  piece of the AssertionError text or of the output diff);
* a mistake marked ``hidden_only`` is right on the visible checks and caught only by the
  key's hidden (randomized) checks;
* the tasks whose checks ``needs:`` it (directly or through another task) fail or do not
  run: a later task's checks must not pass while an earlier task is wrong; the tasks those
  need in turn, which do not depend on it, still pass.

Only those tasks are graded (``grade(..., tasks=...)``): the other tasks' checks are not run.
tests/test_labs.py grades every task of every lab with the reference solutions.

The cases of one lab share one kernel (imports are paid once; a new kernel for each lab).
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from dataclasses import dataclass

import nbformat
import pytest

from minibatch.labs import find_lab, labs_dir
from minibatch.labs.builder import shared_kernel
from minibatch.labs.grader import grade


@pytest.fixture(scope="module")
def kernels():
    """One kernel per lab, shared by that lab's cases (the cases run lab by lab): a lab's set-up may
    depend on what is imported first (L05 turns on Triton's interpreter before importing triton)."""
    with contextlib.ExitStack() as stack:
        current: dict = {}

        def get(lab_id: str):
            if lab_id not in current:
                stack.close()
                current.clear()
                current[lab_id] = stack.enter_context(shared_kernel(labs_dir()))
            return current[lab_id]

        yield get


def _key(lab_id: str):
    return nbformat.read(str(find_lab(lab_id).key_path), as_version=4)


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _numbers(tags, prefix) -> set[int]:
    return {int(t.split(":", 1)[1]) for t in tags if re.fullmatch(prefix + r":\d+", t)}


def reference(lab_id: str, cell_id: str) -> str:
    """The reference solution of a task cell, as the answer key holds it."""
    return next(c.source for c in _key(lab_id).cells if c.get("id") == cell_id)


def with_method(lab_id: str, cell_id: str, method: str) -> str:
    """The reference class of ``cell_id`` with one method (``def name(...)``) replaced by ``method``."""
    src = reference(lab_id, cell_id)
    method = textwrap.indent(textwrap.dedent(method).strip("\n"), "    ")
    name = re.match(r"\s*def (\w+)\(", method).group(1)
    pattern = re.compile(rf"^    def {name}\(.*?(?=\n\n    # --|\n\n\S|\Z)", re.S | re.M)
    assert len(pattern.findall(src)) == 1, f"{cell_id}: no single method {name}"
    return pattern.sub(lambda _: method, src)


def dependents(lab_id: str, task: int) -> set[int]:
    """The tasks with a check cell that needs ``task``, directly or through another task."""
    needs: dict[int, set[int]] = {}
    for c in _key(lab_id).cells:
        for t in _numbers(_tags(c), "check"):
            needs.setdefault(t, set()).update(_numbers(_tags(c), "needs"))
    out, grew = set(), True
    while grew:
        grew = False
        for t, ns in needs.items():
            if t not in out and t != task and (task in ns or ns & out):
                out.add(t)
                grew = True
    return out


@dataclass(frozen=True)
class Mistake:
    lab: str
    name: str
    task: int            # the task the mistake is in
    cell: str            # its task cell (id)
    source: str          # that cell with the mistake
    says: str            # what the failing check says (a distinctive substring)
    hidden_only: bool = False

    def __str__(self):
        return f"{self.lab}-{self.name}"


def edit(lab_id: str, cell: str, old: str, new: str) -> str:
    """The key's solution of ``cell`` with ``old`` (found once) replaced by ``new``."""
    src = reference(lab_id, cell)
    assert src.count(old) == 1, old
    return src.replace(old, new)


# -- L03 · continuous batching ---------------------------------------------------------
MISTAKES = [
    # Right on every visible check: engine_step is the engine's own answer.
    Mistake("L03", "asks-the-engine", 2, "task-2", '''\
def schedule_step(running: list[Request], waiting: list[Request], budget: int, max_num_seqs: int,
                  chunked: bool) -> list[tuple[Request, int]]:
    """One step of iteration-level FCFS scheduling under a token budget."""
    by_id = {req.request_id: req for req in running + waiting}
    return [(by_id[rid], n) for rid, n in engine_step(running, waiting, budget, max_num_seqs, chunked)]
''', says="Scheduler.schedule ran inside yours", hidden_only=True),
    # Right on every visible check: the scheduler walks running + waiting under the budget itself.
    Mistake("L03", "order-without-schedule_step", 3, "task-3", '''\
@register(name="l03_step")
class StepPolicy(Policy):
    """Iteration-level FCFS, with the step decided by your schedule_step."""

    chunked = True          # run it with enable_chunked_prefill=True

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        return list(state.running) + list(state.waiting)       # the scheduler applies the budget anyway
''', says="must call schedule_step once per step", hidden_only=True),
]

# -- L06 · chunked prefill ------------------------------------------------------------
L06_PLAN = '''\
def plan_step(running: list[Request], waiting: list[Request], budget: int, max_num_seqs: int,
              free_blocks: int, block_size: int) -> list[tuple[str, int, bool]]:
    """One step of chunked-prefill scheduling: (request_id, new tokens, samples) per scheduled request."""
    def blocks(tokens: int) -> int:
        return math.ceil(tokens / block_size)

    plan: list[tuple[str, int, bool]] = []
    for i, req in enumerate(running + waiting):
        if budget <= 0 or len(plan) >= max_num_seqs:
            break
        gap = req.num_tokens - req.num_computed_tokens
        n = min(gap, budget)
        need = blocks(req.num_computed_tokens + n) - blocks(req.num_computed_tokens)
        if need > free_blocks and i >= len(running):
            break                      # a waiting request that does not fit stops admission (FCFS)
        plan.append((req.request_id, n, n == gap))
        budget -= n
        free_blocks = max(0, free_blocks - need)
    return plan
'''


def l06_plan(old: str, new: str) -> str:
    assert L06_PLAN.count(old) == 1, old
    return L06_PLAN.replace(old, new)


MISTAKES += [
    Mistake("L06", "blocks-for-the-whole-prompt", 1, "task-1", l06_plan(
        "need = blocks(req.num_computed_tokens + n) - blocks(req.num_computed_tokens)",
        "need = blocks(req.num_tokens) - blocks(req.num_computed_tokens)       # KV for the whole prompt"),
        says="needs 4 blocks of 16, not the 19 blocks of its whole prompt"),
    Mistake("L06", "skips-a-request-that-does-not-fit", 1, "task-1", l06_plan(
        "break                      # a waiting request that does not fit stops admission (FCFS)",
        "continue                   # a waiting request that does not fit: try the next one"),
        says="w1 may not pass w0 (FCFS)"),
    # Right on every visible state: a preempted request whose chunk ends among its generated
    # tokens is rare in random_state (3 in 5000); the hidden check builds such states.
    Mistake("L06", "samples-once-the-prompt-is-done", 1, "task-1", l06_plan(
        "plan.append((req.request_id, n, n == gap))",
        "plan.append((req.request_id, n, req.num_computed_tokens + n >= req.num_prompt_tokens))"),
        says="samples only once all", hidden_only=True),
    Mistake("L06", "policy-returns-only-the-admitted", 2, "task-2", '''\
@register(name="l06_chunk_plan")
class ChunkPlanPolicy(Policy):
    """Chunked-prefill scheduling whose step is decided by plan_step."""

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        plan = plan_step(state.running, state.waiting, state.max_num_batched_tokens, state.max_num_seqs,
                         state.kv.num_free_blocks, state.kv.block_size)
        admitted = {rid for rid, _, _ in plan}
        return [r for r in state.waiting if r.request_id in admitted]   # running ones run anyway
''', says="schedule_order should return the planned requests"),
    Mistake("L06", "keeps-the-default-budget", 3, "task-3", '''\
def choose_config() -> dict:
    """The engine limits for this workload and SLO."""
    # Fewer sequences a step should keep TPOT down; keep vLLM's budget.
    return {"max_num_batched_tokens": 8192, "max_num_seqs": 64}
''', says="is below the pass mark"),
]

# -- L05 · Triton paged decode ---------------------------------------------------------
def l05(cell: str, old: str, new: str) -> str:
    """The key's solution of ``cell`` with ``old`` (found once) replaced by ``new``."""
    src = reference("L05", cell)
    assert src.count(old) == 1, old
    return src.replace(old, new)


L05_RULE = """\
def choose_partition(batch: int, num_kv_heads: int, context: int) -> int:
    \"\"\"Split-KV partition size (tokens, a multiple of 16) for a decode batch on an H100.\"\"\"
    %s
"""

MISTAKES += [
    Mistake("L05", "scale-1-over-d", 2, "task-2", l05(
        "task-2", "s = tl.sum(k * q[None, :], axis=1) * scale",
        "s = tl.sum(k * q[None, :], axis=1) / HEAD_DIM          # 1/d"),
        says="GQA, group 2, lens [1, 8, 13, 40]: Tensor-likes are not close"),
    Mistake("L05", "acc-not-rescaled", 2, "task-2", l05(
        "task-2", "acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)", "acc = acc + tl.sum(p[:, None] * v, axis=0)"),
        says="GQA, group 2, lens [1, 8, 13, 40]: Tensor-likes are not close"),
    # The engine's cache holds zeros or stale numbers past a context, never NaN: only this lab's
    # NaN-filled caches show the missing mask.
    Mistake("L05", "tokens-past-the-end-not-masked", 2, "task-2", l05(
        "task-2", "mask = mask_t[:, None] & mask_d[None, :]",
        "mask = mask_d[None, :]                   # the scores of the tokens past the end are -inf anyway"),
        says="GQA, group 2: NaN for the sequences of length [1, 13]"),
    # Query head h on KV head h % num_kv_heads (interleaved) instead of h // GROUP (vLLM's, HF's repeat_kv).
    Mistake("L05", "group-is-head-mod-num-kv-heads", 3, "task-3", l05(
        "task-3", "heads = kv_head * GROUP + offs_g", "heads = kv_head + offs_g * tl.num_programs(1)"),
        says="GQA, group 2, lens [1, 8, 13, 40]: Tensor-likes are not close"),
    Mistake("L05", "merge-without-the-max-shift", 5, "task-5", l05(
        "task-5", "w = torch.exp(part_m - big_m)                       # 0 for the empty partitions",
        "w = (part_m > float(\"-inf\")).float()            # every non-empty partition counts once"),
        says="GQA, group 2, partition_size 4, lens"),
    Mistake("L05", "always-the-largest-partition", 6, "task-6", L05_RULE % "return 32768             # never split: one program per (sequence, KV head)",
            says="expected within 1.10x"),
    Mistake("L05", "engine-default-512", 6, "task-6", L05_RULE % "return 512               # vLLM's _PARTITION_SIZE",
            says="expected within 1.10x"),
    Mistake("L05", "enumerates-the-model", 6, "task-6", L05_RULE % "return min(PARTITION_CANDIDATES, key=lambda p: split_decode_time(batch, num_kv_heads, context, p))",
            says="must not call split_decode_time"),
    # Right on every shown case (all Llama-3-8B, 8 KV heads); the hidden cases vary num_kv_heads.
    Mistake("L05", "assumes-8-kv-heads", 6, "task-6", l05(
        "task-6", "waves = -(-batch * num_kv_heads * parts // NUM_SMS)", "waves = -(-batch * 8 * parts // NUM_SMS)"),
        says="hidden: (batch, KV heads, context)", hidden_only=True),
]

# -- L07 · preemption -------------------------------------------------------------------
L07_VICTIM = '''\
def pick_victim(running: list[Request], order: list[Request], pos: int, preempted: set[str],
                scheduled: set[str]) -> Request | None:
    """The running request to preempt so that order[pos] can get its blocks (None: nobody)."""
    in_order = {r.request_id for r in order}
    candidates = [r for r in reversed(running) if r.request_id not in in_order]
    candidates += list(reversed(order[pos + 1:]))
    for r in candidates:
        if r.status is RequestStatus.RUNNING and r.request_id not in preempted and r.request_id not in scheduled:
            return r
    return None
'''
L07_PREEMPT = '''\
def preempt_recompute(req: Request, running: list[Request], waiting: collections.deque, kv: KVCacheManager) -> int:
    """Preempt ``req`` by recompute; return how many tokens of KV it lost."""
    lost = req.num_computed_tokens
    running.remove(req)
    kv.free(req)
    req.num_computed_tokens = 0
    req.status = RequestStatus.WAITING
    req.num_preemptions += 1
    waiting.appendleft(req)
    return lost
'''


def l07(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, old
    return src.replace(old, new)


MISTAKES += [
    Mistake("L07", "victim-from-the-front", 1, "task-1", l07(
        L07_VICTIM, "list(reversed(order[pos + 1:]))", "list(order[pos + 1:])"),
        says="continuous order: the last running request in the order"),
    Mistake("L07", "takes-a-scheduled-request", 1, "task-1", l07(
        L07_VICTIM, " and r.request_id not in scheduled", ""),
        says="a is scheduled already this step: skip it"),
    # Right on every hand-made state (none has a left-out request that was preempted already).
    Mistake("L07", "left-out-requests-not-checked-against-preempted", 1, "task-1", l07(
        L07_VICTIM, "    candidates = [r for r in reversed(running) if r.request_id not in in_order]\n",
        "    for r in reversed(running):        # left out of the order: not scheduled, take it\n"
        "        if r.request_id not in in_order and r.status is RequestStatus.RUNNING:\n"
        "            return r\n    candidates = []\n"),
        says="preempted ['", hidden_only=True),
    Mistake("L07", "keeps-num_computed_tokens", 2, "task-2", l07(
        L07_PREEMPT, "    req.num_computed_tokens = 0\n", ""),
        says="num_computed_tokens 0, status WAITING, one more preemption"),
    Mistake("L07", "blocks-not-freed", 2, "task-2", l07(L07_PREEMPT, "    kv.free(req)\n", ""),
            says="all 4 of its blocks are free again"),
    Mistake("L07", "back-of-the-queue", 2, "task-2", l07(L07_PREEMPT, "waiting.appendleft(req)", "waiting.append(req)"),
            says="the victim goes to the front of the waiting queue"),
    # Right wherever the victim is decoding (its KV then holds all its tokens but the last).
    Mistake("L07", "lost-is-all-tokens-but-the-last", 2, "task-2", l07(
        L07_PREEMPT, "    lost = req.num_computed_tokens\n", "    lost = req.num_tokens - 1               # the KV of every token but the new one\n"),
        says="it lost its num_computed_tokens", hidden_only=True),
    Mistake("L07", "reserves-max_tokens-for-everyone", 3, "task-3", '''\
class MyPolicy(Policy):
    """Your policy: the order in which running and waiting requests compete this step."""

    name = "l07_mine"

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # Never preempt: admit a request only if the pool holds every running request at its
        # max_tokens, and this one too (TensorRT-LLM's GUARANTEED_NO_EVICT).
        kv = state.kv
        full = lambda r: kv.blocks_for(r.num_prompt_tokens + r.sampling_params.max_tokens)
        held = lambda r: kv.blocks_for(r.num_computed_tokens)
        free = kv.num_free_blocks - sum(full(r) - held(r) for r in state.running)
        order = list(state.running)
        for req in state.waiting:
            if full(req) > free:
                break
            free -= full(req)
            order.append(req)
        return order
''', says="throughput must be >= 97% of the default's"),
]

# -- L08 · radix tree -------------------------------------------------------------------
MISTAKES += [
    Mistake("L08", "match-counts-whole-edges-only", 1, "task-1-2-3", with_method("L08", "task-1-2-3", '''\
        def match_prefix(self, tokens) -> int:
            t = self.tick()
            node, i = self.root, 0
            while i < len(tokens):
                child = node.children.get(tokens[i])
                if child is None:
                    break
                child.last_access = t
                n = common_prefix_len(child.key, tokens[i:])
                if n < len(child.key):
                    break                        # a partly matched edge holds no cached prefix
                i += n
                node = child
            return i
        '''), says="the match may end inside an edge"),
    # Wrong only where a child of the partly matched edge starts with the next token.
    Mistake("L08", "match-goes-on-after-a-partial-edge", 1, "task-1-2-3", with_method("L08", "task-1-2-3", '''\
        def match_prefix(self, tokens) -> int:
            t = self.tick()
            node, i = self.root, 0
            while i < len(tokens):
                child = node.children.get(tokens[i])
                if child is None:
                    break
                child.last_access = t
                i += common_prefix_len(child.key, tokens[i:])
                node = child
            return i
        '''), says="then stop: the child '3' comes after the whole edge '1 2'"),
    Mistake("L08", "insert-without-a-split", 2, "task-1-2-3", with_method("L08", "task-1-2-3", '''\
        def insert(self, tokens) -> int:
            t = self.tick()
            tokens = tuple(tokens)
            node, i = self.root, 0
            while i < len(tokens):
                child = node.children.get(tokens[i])
                if child is None:
                    break
                child.last_access = t
                n = common_prefix_len(child.key, tokens[i:])
                if n < len(child.key):
                    break                        # leaves the edge: hang the rest next to it
                i += n
                node = child
            if i < len(tokens):
                leaf = Node(tokens[i:], node)
                leaf.last_access = t
                node.children[tokens[i]] = leaf
            return len(tokens) - i
        '''), says="only 5 is new"),
    Mistake("L08", "evicts-any-node", 3, "task-1-2-3", with_method("L08", "task-1-2-3", '''\
        def evict(self, num_tokens: int) -> int:
            freed = 0
            while freed < num_tokens:
                nodes = self.nodes()
                if not nodes:
                    break
                node = min(nodes, key=lambda n: (n.last_access, self.path(n)))   # inner nodes too
                del node.parent.children[node.key[0]]
                freed += len(node.key)
            return freed
        '''), says="everything: '3 4' then '1 2'"),
    # Right on the hand-made tie (edge keys order those leaves as their paths do), and on any tree
    # that inserts and matches build (leaves touched by the same call are siblings).
    Mistake("L08", "ties-broken-by-edge-not-path", 3, "task-1-2-3", with_method("L08", "task-1-2-3", '''\
        def evict(self, num_tokens: int) -> int:
            freed = 0
            while freed < num_tokens:
                leaves = self.leaves()
                if not leaves:
                    break
                leaf = min(leaves, key=lambda n: (n.last_access, n.key))
                del leaf.parent.children[leaf.key[0]]
                freed += len(leaf.key)
            return freed
        '''), says="ties to the smallest path", hidden_only=True),
    Mistake("L08", "pure-lpm-by-hand", 4, "task-4", '''\
class MyCachePolicy(Policy):
    """Your cache-aware order with a guard against starving cache-cold requests."""

    name = "l08_mine"

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # Longest cached prefix first, oldest first among equals: the hit rate is what counts.
        kv = state.kv
        return list(state.running) + sorted(state.waiting, key=lambda r: (-kv.cached_prefix_len(r), r.arrival_time))
''', says="(starvation)"),
    Mistake("L08", "delegates-to-LPMPolicy", 4, "task-4", '''\
class MyCachePolicy(Policy):
    """Your cache-aware order with a guard against starving cache-cold requests."""

    name = "l08_mine"

    def __init__(self):
        self.lpm = LPMPolicy(aging_tokens_per_s=300.0)      # the engine's own, with aging

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        return self.lpm.schedule_order(state)
''', says="do not call LPMPolicy"),
]


# -- L09 · SJF and MLFQ -----------------------------------------------------------------
MISTAKES += [
    Mistake("L09", "remaining-ignores-generated", 1, "task-1", edit(
        "L09", "task-1", "return (max(0, predicted(req) - req.num_output_tokens), req.arrival_time)",
        "return (predicted(req), req.arrival_time)              # the predicted length is the job's length"),
        says="has 0 left"),
    Mistake("L09", "predictor-called-every-step", 1, "task-1", edit(
        "L09", "task-1", '            if "l09_pred" not in req.policy_state:\n'
                         '                req.policy_state["l09_pred"] = int(self.predictor(req))\n'
                         '            return req.policy_state["l09_pred"]',
        "            return int(self.predictor(req))"),
        says="called once per request"),
    Mistake("L09", "aging-counts-time-before-arrival", 2, "task-2", edit(
        "L09", "task-2", "max(0.0, now - req.arrival_time)", "(now - req.arrival_time)"),
        says="now before the arrival counts as 0 s waited"),
    Mistake("L09", "skip-join-cost-rounded-down", 3, "task-3-4", edit(
        "L09", "task-3-4", "math.ceil(req.num_prompt_tokens / self.prompt_tokens_per_iteration)",
        "req.num_prompt_tokens // self.prompt_tokens_per_iteration"),
        says="513 -> 5 needs q_1"),
    # Right on the visible run (no request waits 10 s there); the hidden runs use short starve limits.
    Mistake("L09", "promotes-requests-at-level-0", 4, "task-3-4", edit(
        "L09", "task-3-4", 'elif st["l09_level"] > 0 and state.now - st["l09_served"] > self.starve_limit_s:',
        'elif state.now - st["l09_served"] > self.starve_limit_s:'),
        says="MLFQPolicy's", hidden_only=True),
    Mistake("L09", "non-preemptive-sjf", 5, "task-5", '''\
class MyPolicy(Policy):
    """Your policy for chat traffic with a batch job of long requests."""

    name = "l09_mine"

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # Shortest job first: the chat requests are short, so they go first.
        key = lambda r: (r.sampling_params.max_tokens - r.num_output_tokens, r.arrival_time)
        return sorted(state.running, key=key) + sorted(state.waiting, key=key)
''', says="p99 E2E over all requests must be <= 50%"),
    Mistake("L09", "one-batch-request-at-a-time", 5, "task-5", '''\
class MyPolicy(Policy):
    """Your policy for chat traffic with a batch job of long requests."""

    name = "l09_mine"
    preemptive = True

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # Chat first; the batch gets one slot, so it can never crowd the chat out.
        is_long = lambda r: r.sampling_params.max_tokens > 1024
        short = sorted((r for r in state.running + state.waiting if not is_long(r)), key=lambda r: r.arrival_time)
        batch = [r for r in state.running if is_long(r)] or [r for r in state.waiting if is_long(r)][:1]
        return short + batch
''', says="(starvation)"),
    Mistake("L09", "never-serves-the-long-requests", 5, "task-5", '''\
class MyPolicy(Policy):
    """Your policy for chat traffic with a batch job of long requests."""

    name = "l09_mine"
    preemptive = True

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # The p99 only counts 99% of the requests: leave the 3 long ones out, they never block anyone.
        return sorted((r for r in state.running + state.waiting if r.sampling_params.max_tokens <= 1024),
                      key=lambda r: r.arrival_time)
''', says="never lets them run (starvation)"),
    # Issue 34: passed task 5 before the rush-hour workload (its long requests never starve on the chat one).
    Mistake("L09", "pure-preemptive-sjf", 5, "task-5", '''\
class MyPolicy(Policy):
    """Your policy for chat traffic with a batch job of long requests."""

    name = "l09_mine"
    preemptive = True

    def schedule_order(self, state: SchedulerState) -> list[Request]:
        # Shortest remaining output first, and preemptive: a short request never waits behind a long one.
        key = lambda r: (r.sampling_params.max_tokens - r.num_output_tokens, r.arrival_time)
        return sorted(state.running + state.waiting, key=key)
''', says="rush hour: the slowest request must finish within"),
    Mistake("L09", "subclasses-MLFQPolicy", 5, "task-5", '''\
class MyPolicy(MLFQPolicy):
    """Your policy for chat traffic with a batch job of long requests."""

    name = "l09_mine"
''', says="do not subclass SJFPolicy or MLFQPolicy"),
]

# -- L10 · routers ----------------------------------------------------------------------
MISTAKES += [
    Mistake("L10", "delegates-to-LeastRequests", 1, "task-1", '''\
@register
class ShortestQueue(Router):
    """Fewest unfinished requests (running + waiting); ties to the lowest position."""

    name = "l10_least"

    def choose(self, request, replicas: list[ReplicaView], now: float) -> int:
        return LeastRequests().choose(request, replicas, now)
''', says="LeastRequests.choose ran inside yours", hidden_only=True),
    Mistake("L10", "subclasses-LeastRequests", 1, "task-1", '''\
@register
class ShortestQueue(LeastRequests):
    """Fewest unfinished requests (running + waiting); ties to the lowest position."""

    name = "l10_least"
''', says="LeastRequests.choose ran inside yours", hidden_only=True),
    Mistake("L10", "returns-the-replica-index", 1, "task-1", edit(
        "L10", "task-1", "return min(range(len(replicas)), key=lambda i: (replicas[i].num_requests, i))",
        "return min(replicas, key=lambda v: v.num_requests).index"),
        says="return the position in the list, not the index"),
    Mistake("L10", "two-draws-with-replacement", 2, "task-2", edit(
        "L10", "task-2", "a, b = self.rng.sample(range(len(replicas)), 2)",
        "a, b = self.rng.randrange(len(replicas)), self.rng.randrange(len(replicas))"),
        says="if the two draws are distinct"),
    Mistake("L10", "module-level-random", 2, "task-2", edit(
        "L10", "task-2", "a, b = self.rng.sample(range(len(replicas)), 2)",
        "a, b = random.sample(range(len(replicas)), 2)"),
        says="the same seed make the same choices"),
    # Right on every visible check (none counts the choices among equally loaded replicas);
    # the hidden check does.
    Mistake("L10", "tie-to-the-lower-position", 2, "task-2", edit(
        "L10", "task-2", "return a if replicas[a].num_requests <= replicas[b].num_requests else b",
        "return min((a, b), key=lambda i: (replicas[i].num_requests, i))"),
        says="a tie goes to the first DRAWN", hidden_only=True),
    Mistake("L10", "subclasses-PowerOfTwo", 2, "task-2", '''\
from minibatch.cluster.routers import PowerOfTwo


@register
class PowerOfTwoChoices(PowerOfTwo):
    """Two distinct replicas drawn at random from a seeded RNG; the one with fewer unfinished requests."""

    name = "l10_p2c"
''', says="PowerOfTwo.choose ran inside yours", hidden_only=True),
    Mistake("L10", "subclasses-Session", 3, "task-3", '''\
@register
class StickySession(Session):
    """Sticky by tenant: a tenant's first request to the least loaded replica, later ones to the same replica."""

    name = "l10_session"
''', says="Session.choose ran inside yours", hidden_only=True),
    Mistake("L10", "delegates-to-PrefixAware-in-task-4", 4, "task-4", edit(
        "L10", "task-4", "        tokens = list(request.prompt_token_ids or [])\n",
        "        inner = PrefixAware(self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold)\n"
        "        inner.trees = self.trees\n"
        "        return inner.choose(request, replicas, now)        # the engine's rule, on my trees\n"
        "        tokens = list(request.prompt_token_ids or [])\n"),
        says="PrefixAware.choose ran inside yours", hidden_only=True),
    Mistake("L10", "home-is-a-position", 3, "task-3", edit(
        "L10", "task-3", "        where = {v.index: i for i, v in enumerate(replicas)}\n"
                         "        if key in self.home and self.home[key] in where:\n"
                         "            return where[self.home[key]]\n"
                         "        self.home[key] = replicas[least].index",
        "        if key in self.home and self.home[key] < len(replicas):\n"
        "            return self.home[key]\n"
        "        self.home[key] = least"),
        says="return its position"),
    # The text: an empty prompt's match rate counts as 0. Before this was graded, dividing by zero passed.
    Mistake("L10", "empty-prompt-divides-by-zero", 4, "task-4", edit(
        "L10", "task-4", "rate = matches[best] / len(tokens) if tokens else 0.0", "rate = matches[best] / len(tokens)"),
        says="division by zero"),
    Mistake("L10", "imbalanced-if-either-threshold", 4, "task-4", edit(
        "L10", "task-4", "if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:",
        "if hi - lo > self.balance_abs_threshold or hi > self.balance_rel_threshold * lo:"),
        says="both conditions must hold"),
    Mistake("L10", "sglang-defaults", 5, "task-5", '''\
@register
class MyRouter(CacheAware):
    """Your router for shared prefixes with skewed popularity."""

    name = "l10_mine"
''', says="must be <= 65% of least_requests'"),
    Mistake("L10", "delegates-to-PrefixAware", 5, "task-5", '''\
@register
class MyRouter(Router):
    """Your router for shared prefixes with skewed popularity."""

    name = "l10_mine"
    uses_prompt_tokens = True

    def __init__(self):
        self.inner = PrefixAware(balance_abs_threshold=8, balance_rel_threshold=1.2)   # tighter balance

    def choose(self, request, replicas, now):
        return self.inner.choose(request, replicas, now)
''', says="choose ran inside yours"),
]


def test_the_cases_start_from_the_reference_solutions():
    """The mistakes above edit copies of the reference solutions: those copies are the key's."""
    assert L06_PLAN.rstrip() == reference("L06", "task-1").rstrip()
    assert L07_VICTIM.rstrip() == reference("L07", "task-1").rstrip()
    assert L07_PREEMPT.rstrip() == reference("L07", "task-2").rstrip()


def test_each_lab_has_mistakes_and_one_only_hidden_checks_catch():
    for lab in ("L03", "L05", "L06", "L07", "L08", "L09", "L10"):
        cases = [c for c in MISTAKES if c.lab == lab]
        assert len(cases) >= 2 and any(c.hidden_only for c in cases), lab
    assert len({str(c) for c in MISTAKES}) == len(MISTAKES)


def _learner(case: Mistake, tmp_path):
    """The lab's learner notebook with every task cell solved (the key's), except the mistaken one."""
    lab = find_lab(case.lab)
    solved = {c.id: c.source for c in _key(case.lab).cells if c.cell_type == "code" and _numbers(_tags(c), "task")}
    assert case.cell in solved, f"{case.lab} has no task cell {case.cell}"
    solved[case.cell] = case.source
    nb = nbformat.read(str(lab.notebook_path), as_version=4)
    for cell in nb.cells:
        if cell.get("id") in solved:
            cell.source = solved[cell.id]
    path = tmp_path / f"{lab.name}.ipynb"
    nbformat.write(nb, str(path))
    return lab, path


@pytest.mark.parametrize("case", MISTAKES, ids=str)
def test_the_grader_rejects_the_mistake(case: Mistake, kernels, tmp_path):
    lab, path = _learner(case, tmp_path)
    # Only the mistaken task, the tasks whose checks need it, and what those need are graded: the
    # other tasks' checks (each lab's simulations) do not run, which keeps this file's time down.
    report = grade(lab, path, km=kernels(case.lab), tasks={case.task} | dependents(case.lab, case.task))
    text = report.format()
    print(text)
    tasks = {t.task: t for t in report.tasks}
    wrong = tasks[case.task]
    assert not wrong.passed, f"{case}: the grader accepts the mistake\n{text}"
    assert any(case.says in f for f in wrong.failures), f"{case}: no failure says {case.says!r}\n{text}"

    hidden = {c.get("id") for c in _key(case.lab).cells if "hidden" in _tags(c)}
    checks = [c for c in report.cells if c.role == "check" and c.tasks == [case.task]]
    if case.hidden_only:
        shown = [c for c in checks if c.cell_id not in hidden]
        assert shown and all(c.ok for c in shown), \
            f"{case}: meant to be right on the visible checks\n{text}"
        assert any(not c.ok for c in checks if c.cell_id in hidden), text

    # A hidden check's message may say how far off the learner is (a ratio, a difference), never the
    # baseline's own figure on the unseen seed: that would let a learner tune to it.
    for c in checks:
        if c.cell_id in hidden and not c.ok:
            leak = re.search(r"(FCFS|default|least_requests|continuous)(['’]s)?( goodput| TTFT p\d+| hit rate)? "
                             r"[\d.]+ ?(s|ms|req/s|%)?\b", c.describe())
            assert not leak, f"{case}: the hidden check reveals a baseline figure: {leak.group(0)!r}\n{text}"

    later = dependents(case.lab, case.task)
    for t, res in tasks.items():
        if t == case.task:
            continue
        if t in later:          # its checks need the mistaken task: they must not pass
            assert not res.passed, f"{case}: task {t} needs task {case.task} but passes\n{text}"
        else:
            assert res.passed, f"{case}: task {t} does not depend on task {case.task} but fails\n{text}"
