"""Speculative decoding inside the batch: an n-gram (prompt-lookup) drafter and greedy verification.

A decode step computes one token per sequence; with speculation a running sequence also
carries ``k`` *draft* tokens guessed by a cheap proposer, and the step computes all
``1 + k`` positions in one forward, as a short chunk on top of the sequence's KV (the
same operation as a chunk of a prompt). Position ``i`` yields the target model's own
next token after ``draft[:i]``:

* **greedy verification** (temperature 0): the longest prefix of the drafts equal to the
  target's argmax is accepted, plus one more token from the target (the *bonus* token
  when every draft was accepted, else the target's token at the first mismatch). The
  tokens appended are exactly the ones plain decoding would have produced, one step or
  ``1 + a`` steps at a time, so greedy outputs stay equal token for token;
* the K/V written for rejected drafts is garbage: the request's computed tokens stop at
  the accepted ones, and blocks that now hold none of its tokens go back to the pool
  (:func:`release_rejected_blocks`);
* draft tokens are scheduled with the decode and count against the step's token budget
  (``max_num_batched_tokens``), as in vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``,
  v0.11.0: ``num_new_tokens`` of a running request includes its ``spec_token_ids``).

The proposer is vLLM's ``ngram`` method (``vllm/v1/spec_decode/ngram_proposer.py``,
v0.11.0, ``_find_longest_matched_ngram_and_propose_tokens``): the longest n-gram with
``prompt_lookup_min <= n <= prompt_lookup_max`` that ends the sequence and occurred
before, at its *earliest* occurrence; the (up to ``k``) tokens that followed it are the
drafts. Only greedy requests speculate here (a request with ``temperature > 0``,
``logprobs`` or a pending ``min_tokens`` decodes one token a step): standard rejection
sampling for sampled requests is not implemented.
"""

from __future__ import annotations

from minibatch.request import Request


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (vLLM's n-gram rule).

    For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens occurred earlier
    (the occurrence may overlap the suffix, never be the suffix itself), the tokens after
    their earliest occurrence are proposed, at most ``k`` of them and never past the end
    of ``tokens``. No match: no drafts.
    """
    total = len(tokens)
    if k <= 0 or total < min_n + 1:
        return []
    first = tokens[-1]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = tokens[total - n:]
        head = pattern[0]
        i = -1
        last_start = total - n - 1          # a match must end before the sequence's last token
        while True:
            try:
                i = tokens.index(head, i + 1, last_start + 1)
            except ValueError:
                break
            if tokens[i + n - 1] == first and tokens[i:i + n] == pattern:
                start = i + n
                return tokens[start:start + k]
    return []


class NgramProposer:
    """vLLM's ``method="ngram"`` drafter over a request's prompt and output tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> list[int]:
        return propose_ngram(req.all_token_ids, self.min_n, self.max_n, k)


def lookup_range(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    """``(min_n, max_n)`` as vLLM resolves them (``vllm/config/speculative.py``, v0.11.0):
    both unset -> 5 and 5; one unset -> equal to the other."""
    lo, hi = prompt_lookup_min, prompt_lookup_max
    if lo is None and hi is None:
        return 5, 5
    if lo is None:
        lo = hi
    if hi is None:
        hi = lo
    return lo, hi


def draft_length(num_speculative_tokens: int, per_batch_size, batch_size: int) -> int:
    """Draft tokens per sequence at ``batch_size`` running requests.

    ``per_batch_size``: ``[[lo, hi, k], ...]``, vLLM's ``num_speculative_tokens_per_batch_size``
    (dynamic speculative decoding, vLLM PR #32374): ``k`` drafts while ``lo <= batch_size <= hi``
    (inclusive); a batch size between ranges (or above the last) inherits the ``k`` of the
    range below it; the result is clamped to ``num_speculative_tokens`` (the maximum), as
    vLLM 0.34.0's ``build_dynamic_sd_schedule_lookup`` (``vllm/v1/spec_decode/dynamic/utils.py``).
    ``None``: ``num_speculative_tokens``. (vLLM requires the first range to start at 1;
    :class:`~minibatch.config.EngineConfig` checks it; below it this returns
    ``num_speculative_tokens``.)"""
    k = num_speculative_tokens
    if per_batch_size:
        for lo, hi, kk in sorted(per_batch_size):
            if lo > batch_size:
                break
            k = min(num_speculative_tokens, kk)
    return k


def accepted_tokens(draft: list[int], target: list[int]) -> list[int]:
    """Greedy verification: ``target[i]`` is the model's argmax after the context plus
    ``draft[:i]`` (``len(target) == len(draft) + 1``). Returns the tokens to append: the
    longest prefix of ``draft`` that equals ``target``, then the target's next token."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"verification needs one target token more than the {len(draft)} drafts, "
                         f"got {len(target)}")
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return list(target[:a + 1])


def can_speculate(req: Request) -> bool:
    """Whether ``req`` may carry drafts: greedy, no logprobs, no ``min_tokens`` still pending."""
    p = req.sampling_params
    return p.greedy and p.logprobs is None and not (p.min_tokens and req.num_output_tokens < p.min_tokens)


def max_drafts(req: Request, max_model_len: int | None) -> int:
    """Drafts beyond this many could never be kept: the step appends at most ``1 + k`` tokens,
    and the request ends at ``max_tokens`` outputs or ``max_model_len`` tokens."""
    k = req.sampling_params.max_tokens - req.num_output_tokens - 1
    if max_model_len is not None:
        k = min(k, max_model_len - req.num_tokens - 1)
    return max(0, k)


def release_rejected_blocks(kv, req: Request) -> int:
    """After verification: free the blocks of ``req`` past those its tokens need (they held
    only rejected drafts' K/V). Returns the number freed. Only the paged allocator grows
    tables on demand; a contiguous reservation is kept whole. Rejected slots inside a kept
    block are simply overwritten by the next step."""
    if kv.allocator != "paged":
        return 0
    blocks = kv.req_blocks.get(req.request_id)
    if not blocks:
        return 0
    keep = kv.blocks_for(req.num_tokens)
    extra = blocks[keep:]
    if extra:
        del blocks[keep:]
        kv.pool.release(list(reversed(extra)))
    return len(extra)


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Tokens a sequence gains per verification step when each draft is accepted with
    probability ``acceptance_rate`` independently (until the first rejection):
    ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)`` (Leviathan et al., ICML 2023, eq. 1)."""
    a = acceptance_rate
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)
