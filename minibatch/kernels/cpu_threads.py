"""Threads sized to the step: a CPU step of few tokens runs on one OpenMP thread.

Each parallel region of a step (a C matrix-vector product, the attention kernel, a
oneDNN GEMM) hands part of its work to the team's other threads and waits for them at
its end. Its cost is ``work / threads + wake``: the wake-up of the sleeping threads
(``OMP_WAIT_POLICY=PASSIVE``, ``import minibatch``'s default: a futex wake and a trip
through the OS scheduler) and, on a busy machine, the wait for a thread that is not
running at all. A decode step of ``tiny`` at one sequence has about 21 regions (four
projections per layer, attention, the LM head) of a few microseconds of work each, so
the wake-ups cost more than a second thread saves. With a team of one thread, no region
wakes or waits for anyone: the step is serial and runs wherever the OS puts it.

Off by default (``MINIBATCH_ONE_THREAD_TOKENS=0``): measured on this project's 2-core
machine while it was heavily loaded (load average 10-20), it did not hold up. Separate
engine processes alternating round by round (``benchmarks/decode_sweep.py``) put a
one-thread batch-1 step at 12-16 ms against 16-19 ms on two passive threads, but one
process alternating the two settings every few steps put it at 12.5 ms against 8.4 ms
alone and ~20 ms against ~3.5 ms with a second engine beside it: with the memory system
that contended, a batch-1 projection took ~0.3 ms instead of ~0.02 ms, long enough for
a second thread to pay for its wake-up. Set it (e.g. 8) to try it on another machine.

When set, steps of at most that many tokens (the decode batch plus prefill tokens) run
on one thread and larger steps keep torch's thread count. The setting is per calling thread
(OpenMP's ``nthreads-var`` is a per-thread ICV, and ``torch.get_num_threads()``, which the
C kernels read, reads it), so a server's engine thread changes nothing for the rest of
the process, and the count is restored after the step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from minibatch.config import env

#: Steps of at most this many tokens run on one thread (0, the default: never).
ONE_THREAD_TOKENS = int(env("MINIBATCH_ONE_THREAD_TOKENS", "0"))


def step_threads(num_tokens: int, available: int, limit: int | None = None) -> int:
    """Threads for a step of ``num_tokens`` tokens when ``available`` are configured."""
    limit = ONE_THREAD_TOKENS if limit is None else limit
    return 1 if 0 < num_tokens <= limit else available


@contextmanager
def threads_for_step(num_tokens: int, limit: int | None = None):
    """Run the body with :func:`step_threads` OpenMP threads (this thread only), then restore."""
    before = torch.get_num_threads()
    n = step_threads(num_tokens, before, limit)
    if n == before:
        yield n
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
