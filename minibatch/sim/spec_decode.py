"""The simulator's model of speculative decoding inside the batch.

Two parts, kept apart from the cost model proper:

* :class:`SimDrafter`: what the ``SimExecutor`` drafts and accepts. It proposes ``k``
  placeholder drafts for every speculating sequence and accepts each with probability
  ``acceptance_rate`` until the first rejection (drafts independent, the assumption of
  Leviathan et al., ICML 2023, §3.5); the scheduler, the token budget, the KV blocks and
  the engine's counters run as with the real model, and the step is priced by the cost
  model as a chunk of ``1 + k`` new tokens per speculating sequence.
* :func:`spec_step_speedup`: the same model in closed form for a steady batch of ``B``
  decoding sequences of context ``c``: a plain step emits ``B`` tokens in ``t_decode(B)``;
  a verify step emits ``B * E[tokens]`` in ``t_verify(B, k)``, ``E = (1 - a^(k+1)) / (1 - a)``.
  While the step is memory-bound (small ``B``: the weights are read once whatever the
  number of rows), ``t_verify`` is close to ``t_decode`` and the speed-up is close to
  ``E``; once the ``B * (1 + k)`` rows make the GEMMs compute-bound, ``t_verify`` grows
  about ``(1 + k)``-fold and speculation costs more than it gains.
"""

from __future__ import annotations

import random

from minibatch.spec_decode import expected_tokens_per_step


class SimDrafter:
    """Placeholder drafts, accepted at random with ``acceptance_rate`` (seeded: reproducible)."""

    def __init__(self, acceptance_rate: float, seed: int = 0, token: int = 1):
        self.acceptance_rate = acceptance_rate
        self.rng = random.Random(seed)
        self.token = token

    def propose(self, req, k: int) -> list[int]:
        return [self.token] * k

    def verify(self, batch) -> list[tuple[object, int]]:
        """``(request, token)`` pairs for each speculating request of ``batch``: the accepted
        drafts, then one more token (as ``minibatch.spec_decode.accepted_tokens``)."""
        out = []
        for req, _ in batch.items:
            k = len(req.spec_token_ids)
            if not k:
                continue
            a = 0
            while a < k and self.rng.random() < self.acceptance_rate:
                a += 1
            out += [(req, self.token)] * (a + 1)
        return out


def spec_step_speedup(cost_model, batch_size: int, context_len: int, k: int, acceptance_rate: float) -> dict:
    """Decode throughput with ``k`` drafts per sequence over plain decoding, for ``batch_size``
    sequences of ``context_len`` tokens on ``cost_model`` (a roofline or fitted cost model).

    Returns ``{"t_decode", "t_verify", "tokens_per_step", "speedup"}``: seconds of one plain
    decode step and of one verify step (``batch_size`` chunks of ``1 + k`` tokens), the
    expected tokens per sequence and verify step, and ``tokens_per_step * t_decode / t_verify``.
    """
    if batch_size < 1 or context_len < 1 or k < 0:
        raise ValueError(f"need batch_size >= 1, context_len >= 1, k >= 0; got {batch_size}, {context_len}, {k}")
    t_decode = cost_model.step_time([], [context_len] * batch_size)
    if k == 0:
        return {"t_decode": t_decode, "t_verify": t_decode, "tokens_per_step": 1.0, "speedup": 1.0}
    t_verify = cost_model.step_time([(1 + k, context_len + k)] * batch_size, [])
    e = expected_tokens_per_step(acceptance_rate, k)
    return {"t_decode": t_decode, "t_verify": t_verify, "tokens_per_step": e, "speedup": e * t_decode / t_verify}


def best_draft_length(cost_model, batch_size: int, context_len: int, acceptance_rate: float,
                      max_k: int = 8) -> int:
    """The ``k`` in ``0..max_k`` with the highest :func:`spec_step_speedup` (0: do not speculate):
    the rule ``num_speculative_tokens_per_batch_size`` writes down as a table."""
    return max(range(max_k + 1),
               key=lambda k: (spec_step_speedup(cost_model, batch_size, context_len, k, acceptance_rate)["speedup"],
                              -k))
