"""Faults to inject into an in-process engine, for chapter 29's drills: a slow replica and a KV leak.

Each one wraps a single engine (simulated or real) and changes nothing else:

* :func:`slow_down` (a *straggler*): from ``start_s`` on, every step of the engine takes
  ``factor`` times as long, :math:`d' = f \\cdot d`: a GPU throttled by heat or its power
  cap, a noisy neighbour on the host, a link renegotiated to fewer PCIe lanes. The tokens are
  the same; they come later.
* :func:`leak_kv` (a *KV leak*): from ``start_s`` on, every ``every``-th request that ends
  (finished or aborted) keeps its KV blocks: they are dropped from the request's block table
  but never released, so they leave the free queue for good. The pool shrinks by the leaked
  blocks, :math:`N_\\text{free}(t) = N - N_\\text{held}(t) - N_\\text{leaked}(t)`; vLLM's
  ``vllm:kv_cache_usage_perc`` stays above zero on an idle engine and, once the leak eats the
  room the batch needs, preemptions begin. The block-conservation check
  (:meth:`minibatch.kv_cache.KVCacheManager.check_invariants`: every reference has one owner)
  fails on the first leaked block. A real case of the kind: vLLM issue #46283 (decode-side
  blocks of an aborted remote-KV load held until a completion that never comes).

Elsewhere: the server's faults (slow answers, errors, cut streams) are
``minibatch.serving.faults``; a dead replica, whose requests are re-dispatched, is
``minibatch.cluster.failures``; a preemption storm needs no hook, only a KV pool too small for
the batch (``gpu_memory_utilization`` or ``num_kv_blocks``).
"""

from __future__ import annotations


class SlowExecutor:
    """An executor whose steps take ``factor`` times as long from ``start_s`` on (the engine's clock)."""

    def __init__(self, inner, clock, factor: float, start_s: float = 0.0):
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        self.inner = inner
        self.clock = clock
        self.factor = float(factor)
        self.start_s = float(start_s)
        self.num_slowed_steps = 0

    def __getattr__(self, name):            # num_kv_blocks, cost_model, model_config, ...
        return getattr(self.inner, name)

    def execute(self, batch, kv):
        out = self.inner.execute(batch, kv)
        if self.clock.now() >= self.start_s:
            out.duration *= self.factor
            out.forward_time *= self.factor
            self.num_slowed_steps += 1
        return out


def slow_down(engine, factor: float, start_s: float = 0.0) -> SlowExecutor:
    """Make ``engine``'s steps ``factor`` times slower from ``start_s`` (seconds of its clock) on."""
    slow = SlowExecutor(engine.executor, engine.clock, factor, start_s)
    engine.executor = slow
    return slow


class KVLeak:
    """Every ``every``-th request ending from ``start_s`` on keeps its KV blocks referenced forever."""

    def __init__(self, engine, every: int = 10, start_s: float = 0.0):
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.kv = engine.kv
        self.clock = engine.clock
        self.every = every
        self.start_s = float(start_s)
        self.leaked_blocks: list[int] = []
        self.leaked_requests: list[str] = []
        self._ended = 0
        self._free = self.kv.free               # the manager's own method, bound
        self.kv.free = self._maybe_leak

    @property
    def num_leaked_blocks(self) -> int:
        return len(self.leaked_blocks)

    def _maybe_leak(self, req) -> None:
        if req.is_finished and self.clock.now() >= self.start_s:
            self._ended += 1
            if self._ended % self.every == 0 and self.kv.req_blocks.get(req.request_id):
                # The bug: the table entry goes, the references stay (no pool.release).
                self.leaked_blocks += self.kv.req_blocks.pop(req.request_id)
                self.kv.req_hashes.pop(req.request_id, None)
                self.leaked_requests.append(req.request_id)
                return
        self._free(req)

    def remove(self) -> None:
        """Stop leaking (what is leaked stays leaked: only a restart gets it back)."""
        del self.kv.free                        # the class's method again


def leak_kv(engine, every: int = 10, start_s: float = 0.0) -> KVLeak:
    """Make every ``every``-th request that ends on ``engine`` from ``start_s`` on leak its KV blocks."""
    return KVLeak(engine, every, start_s)


__all__ = ["KVLeak", "SlowExecutor", "leak_kv", "slow_down"]
