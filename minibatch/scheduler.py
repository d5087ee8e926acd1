"""The scheduler: turns a policy's order into one step's batch under the engine's budgets.

One step hands out at most ``max_num_batched_tokens`` new tokens over at most
``max_num_seqs`` requests. Walking the policy's order, each request asks for
``num_tokens - num_computed_tokens`` new tokens (1 for a decode, the prompt for a
prefill, all tokens again after a recompute preemption); with chunked prefill a long
prompt takes what is left of the budget and continues next step. The KV blocks for
those tokens are allocated now; when the pool is short, running requests at the end
of the order are preempted (``recompute``: their blocks are freed and they go back to
the front of the waiting queue; ``swap``: their blocks are copied to CPU first, see
``minibatch.swap``).

Victims are taken from the end of the order (running requests the policy left out of
the order come first: they rank below everything). ``EngineConfig.preemption_victim`` chooses
among the running requests ranked below the one that needs blocks (the policy's order decides
who may be evicted, the rule decides which of them goes): ``last`` (default) the lowest ranked;
``least_computed`` the one with the fewest computed tokens, so that a recompute throws away the
least work (vllm#54644's least-computed-first); ``lowest_priority`` the largest ``(priority,
arrival_time)`` (vLLM V1's victim under ``--scheduling-policy priority``). Under the last two a
running request that needs a block is a candidate itself, as in vLLM, whose victim is taken from
the whole running queue. A *waiting* request may only evict
running ones if the policy is ``preemptive`` and the admission mode allows it
(``minibatch.admission``); otherwise, once a waiting request is refused (no blocks, or
admission control says no), no later waiting request is admitted this step, so the
policy's order is respected, but running requests later in the order still run.

A policy's switches (``minibatch.policies.base.Policy``) adapt the step to TensorRT-LLM's
micro-batch scheduler: decodes' tokens set aside before prompt chunks are cut
(``decode_budget_first``), chunks cut short rounded down to whole blocks
(``chunk_to_block``), and no admission after a refusal nor anything after a preempted request's
place in the order (``stop_at_refusal``). When nothing
of a policy's order can run, the scheduler asks it once for another order for the same
step (``Policy.fallback_order``; TGI's policy decodes when its planned prefill is refused).

With ``enable_lora``, a step holds at most ``max_loras`` distinct LoRA adapters (vLLM V1's
``scheduled_loras`` rule): a request whose adapter would be one too many is skipped for this
step, waiting or running, and the walk goes on (``minibatch.lora``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minibatch.admission import make_admission
from minibatch.config import EngineConfig
from minibatch.kv_cache import KVCacheManager
from minibatch.lora import lora_id
from minibatch.policies import Policy, SchedulerState, make_policy
from minibatch.request import Request, RequestStatus
from minibatch.spec_decode import NgramProposer, can_speculate, draft_length, lookup_range, max_drafts


def is_decode(num_new_tokens: int) -> bool:
    """The one definition of a decode: a step item of exactly one new token (query length 1).

    That is what the kernels (a decode row), the cost models and the timeline all count,
    whatever the request's phase: the last token of a prompt whose other tokens were
    cached or chunked is computed, and counted, as a decode."""
    return num_new_tokens == 1


@dataclass
class ScheduledBatch:
    """The work of one step: ``(request, num_new_tokens)`` pairs, in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def token_counts(self) -> tuple[int, int]:
        """``(decode tokens, prefill tokens)`` (see :func:`is_decode`)."""
        decode = total = 0
        for _, n in self.items:
            total += n
            decode += is_decode(n)
        return decode, total - decode

    def shape(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What a cost model prices: ``([(new tokens, context after) per prefill chunk],
        [context after, per decode])``."""
        prefill, decode = [], []
        for req, n in self.items:
            ctx = req.num_computed_tokens + n
            if is_decode(n):
                decode.append(ctx)
            else:
                prefill.append((n, ctx))
        return prefill, decode

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Holds the waiting and running queues and builds each step's batch."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, policy: Policy | None = None,
                 max_model_len: int | None = None):
        self.config = config
        self.kv = kv
        self.policy = policy or config.policy
        self.admission = make_admission(config.admission)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapper = None                  # set by the engine when preemption_mode == "swap"
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0       # cumulative (the server's minibatch:recomputed_tokens_total)
        self.admitted_this_step: set[str] = set()
        # Speculative decoding (minibatch.spec_decode): the drafter, or None when off. The engine
        # may replace it (the simulator's executor drafts placeholders).
        self.proposer = None
        if config.speculative_method == "ngram":
            self.proposer = NgramProposer(*lookup_range(config.prompt_lookup_min, config.prompt_lookup_max))

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        """Switch policies (also mid-run): a name or an instance. The new policy meets
        requests it has never seen and must cope (see ``minibatch.policies.base``)."""
        self._policy = make_policy(policy)

    # -- queues --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def state(self, now: float) -> SchedulerState:
        c = self.config
        return SchedulerState(now, list(self.running), list(self.waiting), c.max_num_seqs,
                              c.max_num_batched_tokens, c.max_wait_ms / 1000.0, self.kv, c)

    def final_len(self, req: Request) -> int:
        """Tokens ``req`` holds at most: ``min(prompt + max_tokens, max_model_len)``."""
        n = req.num_prompt_tokens + req.sampling_params.max_tokens
        return n if self.max_model_len is None else min(n, self.max_model_len)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.swapper is not None:
            self.swapper.discard(req)
        self.kv.free(req)
        self.policy.on_finished(req)

    # -- one step ------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        policy = self.policy
        state = self.state(now)
        batch = self._build(self._checked(policy.schedule_order(state)), now)
        if not batch.items:
            # Nothing in the policy's order could run (e.g. admission refused a planned prefill):
            # the policy may offer another order for this step (``Policy.fallback_order``).
            fallback = policy.fallback_order(self.state(now))
            if fallback:
                first = batch.preempted
                batch = self._build(self._checked(fallback), now)
                batch.preempted = first + batch.preempted
        self.num_preemptions += len(batch.preempted)
        if batch.items:
            self.admission.on_step(self, len(batch.preempted))
        return batch

    def _build(self, order: list[Request], now: float) -> ScheduledBatch:
        """One step's batch from ``order`` under the budgets, admission and KV."""
        c = self.config
        policy = self.policy
        batch = ScheduledBatch()
        budget = c.max_num_batched_tokens
        preempted: set[str] = set()
        scheduled: set[str] = set()
        self.admitted_this_step = set()
        spec_k = self._draft_length()
        # Drafts never take a token a later decode of this step needs: running decodes after each place.
        decodes_after = self._decodes_after(order) if spec_k else None
        admitting = True         # False once a waiting request was refused (non-evicting)
        evicting = policy.preemptive and self.admission.evicts
        keep_admitting = evicting and not policy.stop_at_refusal
        # decode_budget_first: the decodes still ahead in the order, one token each.
        decodes_ahead: set[str] = set()
        if policy.decode_budget_first and c.enable_chunked_prefill:
            decodes_ahead = {r.request_id for r in order[:c.max_num_seqs]
                             if r.status is RequestStatus.RUNNING and is_decode(r.num_tokens - r.num_computed_tokens)}

        # stop_at_refusal: the walk also ends at the place of a preempted request (TensorRT-LLM's
        # MaxUtilizationScheduler moves its end, reqItEnd, to each request it pauses).
        end = len(order)
        place = {r.request_id: i for i, r in enumerate(order)} if policy.stop_at_refusal else {}
        # LoRA adapter slots (vLLM's max_loras): the distinct adapters this step holds.
        max_loras = c.max_loras if c.enable_lora else 0
        loras: set[int] = set()

        for pos, req in enumerate(order):
            if pos >= end or budget <= 0 or len(batch.items) >= c.max_num_seqs:
                break
            decodes_ahead.discard(req.request_id)
            if req.request_id in preempted:
                continue
            waiting = req.status is not RequestStatus.RUNNING
            if waiting and not admitting:
                continue
            lid = lora_id(req) if max_loras else 0
            if lid and lid not in loras and len(loras) >= max_loras:
                continue      # every adapter slot is taken this step: it waits, the walk goes on (vLLM)
            computed_blocks: list[int] = []
            if req.status is RequestStatus.WAITING:
                computed_blocks, req.num_computed_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens
            room = budget if is_decode(num_new) else budget - len(decodes_ahead)
            if num_new > room:
                if c.enable_chunked_prefill:
                    num_new = self._chunk(room)
                    if num_new <= 0:           # no room left for a chunk of this prompt
                        if waiting:
                            admitting = self._refuse(req, keep_admitting)
                        continue
                elif batch.items:
                    # Without chunking a prompt runs whole; it waits for a step with room.
                    if waiting:
                        admitting = self._refuse(req, keep_admitting)
                    continue
            if waiting and not self.admission.can_admit(self, req, computed_blocks):
                admitting = self._refuse(req, keep_admitting)
                continue
            # KV blocks, preempting from the end of the order when the pool is short.
            drafts = self._drafts(req, spec_k, budget - 1 - decodes_after[pos]) \
                if spec_k and not waiting and is_decode(num_new) else []
            if drafts and self._allocate(req, 1 + len(drafts), computed_blocks):
                req.spec_token_ids = drafts            # (no blocks for them: the decode alone)
                num_new += len(drafts)
                ok = True
            else:
                ok = self._allocate(req, num_new, computed_blocks)
            while not ok and (evicting or not waiting):
                victim = self._pick_victim(order, pos, preempted, scheduled, req)
                if victim is None:
                    break
                self._preempt(victim, now)
                preempted.add(victim.request_id)
                decodes_ahead.discard(victim.request_id)
                batch.preempted.append(victim)
                end = min(end, place.get(victim.request_id, end))
                if victim is req:              # the rule chose the request that needs the blocks
                    break
                ok = self._allocate(req, num_new, computed_blocks)
            if req.request_id in preempted:
                continue
            if not ok:
                if waiting:
                    admitting = self._refuse(req, keep_admitting)
                    continue
                # A running request that cannot grow and has nobody left to evict.
                self._preempt(req, now)
                preempted.add(req.request_id)
                batch.preempted.append(req)
                end = min(end, place.get(req.request_id, end))
                continue
            if waiting:
                self._admit(req, now)
            self.num_recomputed_tokens += self._count_computed(req, num_new)
            batch.items.append((req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
            if lid:
                loras.add(lid)
        return batch

    def _draft_length(self) -> int:
        """Drafts per speculating sequence this step (0: speculation off), chosen by the number
        of running requests (``num_speculative_tokens_per_batch_size``). Clears last step's drafts."""
        if self.proposer is None:       # no drafts to clear: none were ever set
            return 0
        for r in self.running:
            r.spec_token_ids = []
        c = self.config
        return draft_length(c.num_speculative_tokens, c.num_speculative_tokens_per_batch_size, len(self.running))

    def _decodes_after(self, order: list[Request]) -> list[int]:
        """For each place in ``order``: the running decodes after it among the first
        ``max_num_seqs`` (the tokens drafts must leave in the budget for them)."""
        limit = self.config.max_num_seqs
        after = [0] * (len(order) + 1)
        for i in range(len(order) - 1, -1, -1):
            after[i] = after[i + 1]
            if i + 1 < len(order) and i + 1 < limit:
                nxt = order[i + 1]
                if nxt.status is RequestStatus.RUNNING and is_decode(nxt.num_tokens - nxt.num_computed_tokens):
                    after[i] += 1
        return after

    def _drafts(self, req: Request, k: int, room: int) -> list[int]:
        """The proposer's drafts for a running decode: at most ``k``, what the budget has room
        for, and what the request can still keep (:func:`minibatch.spec_decode.max_drafts`)."""
        k = min(k, room, max_drafts(req, self.max_model_len))
        if k <= 0 or not can_speculate(req):
            return []
        return self.proposer.propose(req, k)[:k]

    def _checked(self, order: list[Request]) -> list[Request]:
        """The policy's order, keeping only queued requests, each once."""
        queued = {r.request_id for r in self.running}
        queued.update(r.request_id for r in self.waiting)
        out, seen = [], set()
        for req in order:
            rid = req.request_id
            if rid in queued and rid not in seen:
                seen.add(rid)
                out.append(req)
        return out

    def _chunk(self, room: int) -> int:
        """The new tokens of a prompt chunk cut short by ``room`` (whole blocks under ``chunk_to_block``;
        not when the whole token budget is under one block, where a rounded chunk could never start)."""
        size = self.kv.block_size
        if self.policy.chunk_to_block and self.config.max_num_batched_tokens >= size:
            return room // size * size
        return room

    def _allocate(self, req: Request, num_new: int, computed_blocks: list[int]) -> bool:
        if req.status is RequestStatus.SWAPPED:
            return self.swapper.swap_in(req, num_new)
        return self.kv.allocate_slots(req, num_new, computed_blocks)

    def _pick_victim(self, order, pos, preempted, scheduled, req: Request | None = None) -> Request | None:
        """The running request to preempt so that ``req`` (``order[pos]``) gets its blocks, or None.

        Candidates: running requests not scheduled nor preempted this step, ranked below ``req``,
        lowest ranked first: those the policy left out of its order, then from the end of the
        order. ``config.preemption_victim`` picks one: ``last`` the first candidate;
        ``least_computed`` the fewest ``num_computed_tokens``; ``lowest_priority`` the largest
        ``(priority, arrival_time)``. Under those two, a running ``req`` is a candidate too, chosen
        only if strictly the fewest computed / the lowest priority. Ties go to the lowest ranked."""
        in_order = {r.request_id for r in order}
        candidates = [r for r in reversed(self.running) if r.request_id not in in_order]
        candidates += reversed(order[pos + 1:])
        rule = self.config.preemption_victim
        if rule == "last":
            for victim in candidates:
                if (victim.status is RequestStatus.RUNNING and victim.request_id not in preempted
                        and victim.request_id not in scheduled):
                    return victim
            return None
        eligible = [v for v in candidates if v.status is RequestStatus.RUNNING and v.request_id not in preempted
                    and v.request_id not in scheduled]
        if req is not None and req.status is RequestStatus.RUNNING and req.request_id not in preempted:
            eligible.append(req)
        if not eligible:
            return None
        if rule == "least_computed":
            return min(eligible, key=lambda r: r.num_computed_tokens)
        return max(eligible, key=lambda r: (r.priority, r.arrival_time))

    @staticmethod
    def _count_computed(req: Request, num_new: int) -> int:
        """The engine's own count of token compute: ``num_new`` tokens computed for ``req`` this
        step, of which those below ``req.recompute_until`` (the most tokens a recompute
        preemption ever threw away) are computed again: wasted work (prefix-cache hits on
        resume are not computed, so not counted). Returns the tokens computed again."""
        start = req.num_computed_tokens
        again = max(0, min(start + num_new, req.recompute_until) - start)
        req.num_computed_total += num_new
        req.num_recomputed_tokens += again
        return again

    def _admit(self, req: Request, now: float) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        self.admitted_this_step.add(req.request_id)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = req.num_computed_tokens
            self.kv.prefix_queries += req.num_prompt_tokens
            self.kv.prefix_hits += req.num_cached_tokens

    def _refuse(self, req: Request, evicting: bool) -> bool:
        """A waiting request stays waiting; returns whether later waiting ones may still
        be admitted this step (only under a preemptive, evicting policy without
        ``stop_at_refusal``)."""
        if req.status is RequestStatus.WAITING:
            req.num_computed_tokens = 0
        return evicting

    def _preempt(self, req: Request, now: float) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.swapper is not None and self.swapper.swap_out(req):
            req.status = RequestStatus.SWAPPED
        else:
            self.kv.free(req)
            req.recompute_until = max(req.recompute_until, req.num_computed_tokens)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
