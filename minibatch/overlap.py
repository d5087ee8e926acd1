"""Async (overlap) scheduling: plan step N+1 while step N's forward runs.

vLLM's ``--async-scheduling`` (``vllm/v1/core/sched/async_scheduler.py``), SGLang's overlap
scheduler and TensorRT-LLM's overlap scheduler all do the same thing: the CPU work between
two forwards (scheduling, KV allocation, input preparation, output bookkeeping) runs while
the accelerator computes, instead of between its steps. One ``engine.step()`` here:

    plan N+1       scheduler.schedule() on the state *after* step N, each request that
                   samples in N holding an output placeholder (a negative token id; it
                   exists only inside ``step()``, never in an output a caller reads)
    prepare N+1    flatten N+1's inputs; a placeholder id stays in the input ids
    wait N         step N's forward (a worker thread) finishes
    sample N       its tokens; they replace the placeholders in N+1's input ids
    launch N+1     N+1's forward starts on the worker thread
    apply N        append N's tokens, stop checks, finishes, events   (while N+1 runs)
    advance N+1    num_computed_tokens of N+1's requests; placeholders for its samplers

What it costs: N+1 was fixed before N's tokens were known, so a request that finishes in
N (EOS, stop, length, abort) still holds its slot in N+1; that token is computed and thrown
away (``num_discarded_tokens``). A request that arrives while N runs can only be scheduled in
N+2: one more step before its first token.

Two ways to run it, with the same scheduling (and the same tokens):
* threaded: the real model (``ModelExecutor``), forward on one worker thread while the main
  thread plans (torch and minibatch's C kernels release the GIL). Under the virtual clock a
  step lasts ``max(forward, prepare) + sampling``: the executor's own prepare overlaps.
* inline: any other executor (the simulator, test executors) runs each step when launched,
  after step N's tokens are applied; a request that finished in N leaves N+1 unexecuted
  (its slot still counted as wasted). The simulator models the overlap itself
  (``SimExecutor``: ``max(forward, step_overhead_s)`` instead of their sum).

Limits: not with swap preemption or speculative decoding (``EngineConfig`` refuses both). A
sampling error fails only its request, as in the synchronous engine; a forward that raises on
the worker thread fails every request of that step (the synchronous engine retries each alone).
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from minibatch.request import Request, RequestStatus
from minibatch.scheduler import ScheduledBatch


@dataclass
class _Step:
    """A launched step, until its output has been applied."""
    batch: ScheduledBatch
    start: float                     # engine clock when the step was launched
    num_padded: int
    stranded: int
    swap_time: float = 0.0
    lead_time: float = 0.0           # CPU time before the launch that nothing overlapped
    prepared: tuple | None = None    # threaded: executor.prepare's output
    sample_reqs: list[Request] = field(default_factory=list)
    future: Future | None = None     # threaded: the forward -> (sampling rows' logits, seconds)
    out: object | None = None        # inline: the executor's StepOutput
    prepare_time: float = 0.0


def placeholder(k: int) -> int:
    """The output placeholder of the ``k``-th sampling request of the step in flight."""
    return -(k + 1)


class OverlapScheduler:
    """Runs ``LLMEngine.step`` one step ahead (``EngineConfig.async_scheduling``)."""

    def __init__(self, engine):
        from minibatch.executor import ModelExecutor

        self.engine = engine
        ex = engine.executor
        self.threaded = (type(ex) is ModelExecutor and getattr(ex, "lora", None) is None
                         and engine.kv.host is None)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minibatch-forward") if self.threaded else None
        # Whether a finished request's slot in the next step is computed (and its token thrown
        # away), as on a GPU: the real model on the worker thread and the simulator's pricing.
        from minibatch.sim.executor import SimExecutor
        self.computes_wasted = self.threaded or type(ex) is SimExecutor
        self.inflight: _Step | None = None
        self._pending: list[tuple[Request, int]] = []   # (request, k): placeholder(k) is in flight
        self.num_discarded_tokens = 0    # tokens computed for requests that had finished (wasted slots)
        if self._pool is not None:       # the worker thread ends with the engine
            weakref.finalize(self, self._pool.shutdown, wait=False)
        self.num_wasted_slots = 0        # scheduled (request, step) pairs whose request had finished

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def drop_placeholder(self, req: Request) -> None:
        """Take the placeholder of a request whose token has arrived off its output."""
        while req.output_token_ids and req.output_token_ids[-1] < 0:
            req.output_token_ids.pop()

    # -- one engine step -----------------------------------------------------------------
    def step(self) -> list[Request]:
        if self.inflight is None:           # idle: plan and launch a first step
            first = self._plan()
            if first is None:
                return []
            self._launch(first, {})
            first.lead_time = first.prepare_time     # nothing ran while it was prepared
            self._advance(first)
            self.inflight = first
        cur = self.inflight
        for req, k in self._pending:        # step N's tokens, as placeholders, while N+1 is planned
            if not req.is_finished:
                req.output_token_ids.append(placeholder(k))
        self._pending = []
        nxt = self._plan()                  # step N+1, while step N runs
        if self.threaded:
            return self._finish_threaded(cur, nxt)
        return self._finish_inline(cur, nxt)

    def _finish_threaded(self, cur: _Step, nxt: _Step | None) -> list[Request]:
        from minibatch.executor import describe_error
        from minibatch.sampler import sample

        e = self.engine
        if nxt is not None:
            self._prepare(nxt)
        prepare_next = nxt.prepare_time if nxt is not None else 0.0
        try:
            logits, forward_time = cur.future.result()
            error = None
        except Exception as exc:           # the whole step failed: its requests end with the error
            logits, forward_time, error = None, 0.0, describe_error(exc)
        t0 = time.perf_counter()
        for req in cur.sample_reqs:
            self.drop_placeholder(req)
        sampled, failed, logprobs = [], [], {}
        if logits is not None and cur.sample_reqs:
            errors, row_lp = {}, {}
            with torch.inference_mode():
                tokens = sample(logits, cur.sample_reqs, errors, row_lp)
            sampled = [(r, t) for i, (r, t) in enumerate(zip(cur.sample_reqs, tokens)) if i not in errors]
            failed = [(cur.sample_reqs[i], describe_error(x)) for i, x in errors.items()]
            logprobs = {cur.sample_reqs[i].request_id: lp for i, lp in row_lp.items()}
        sample_time = time.perf_counter() - t0
        # Virtual clock: the parts the synchronous step charges too (prepare, forward, sampling),
        # the next step's prepare overlapping the forward (the wall clock measures itself).
        e.clock.advance(cur.lead_time + max(forward_time, prepare_next) + sample_time + cur.swap_time)
        if nxt is not None:
            by_req = {id(r): t for r, t in sampled}
            self._launch(nxt, {k: by_req.get(id(r), 0) for k, r in enumerate(cur.sample_reqs)})
        if error is not None:
            failed = [(r, error) for r, _ in cur.batch.items]
        touched = self._apply(cur, sampled, failed, logprobs, forward_time + sample_time)
        if nxt is not None:
            self._advance(nxt)
        self.inflight = nxt
        return touched

    def _finish_inline(self, cur: _Step, nxt: _Step | None) -> list[Request]:
        e = self.engine
        out = cur.out
        e.clock.advance(cur.lead_time + out.duration + cur.swap_time)
        for req, _ in out.sampled:
            self.drop_placeholder(req)
        touched = self._apply(cur, out.sampled, out.failed, out.logprobs, out.forward_time)
        if nxt is not None:
            # A request that finished in step N keeps its slot in N+1 (planned before N's tokens
            # were known). The simulator prices it; another executor cannot compute it (its KV
            # blocks are free), so it is left out and counted here.
            live = None
            if not self.computes_wasted:
                live = [(r, n) for r, n in nxt.batch.items if not r.is_finished]
                self._count_wasted(len(nxt.batch.items) - len(live),
                                   sum(1 for r, n in nxt.batch.items if r.is_finished
                                       and r.num_computed_tokens + n >= r.num_tokens))
            self._launch(nxt, {}, live)
            self._advance(nxt)
        self.inflight = nxt
        return touched

    # -- the pieces ------------------------------------------------------------------------
    def _plan(self) -> _Step | None:
        """Schedule the next step on the current state (placeholders count as tokens)."""
        e = self.engine
        sched = e.scheduler
        batch = sched.schedule(e.clock.now())
        stranded = e.kv.take_stranded_blocks()
        for req in batch.preempted:
            e._emit("preempt", req)
        if not batch:
            return None
        for req, _ in batch.items:
            if req.policy_state.get("_scheduled_once") is None:
                req.policy_state["_scheduled_once"] = True
                e._emit("schedule", req)
        swapper = sched.swapper
        swap_time = (swapper.take_time() if swapper is not None else 0.0) + e.kv.take_offload_time()
        return _Step(batch, e.clock.now(), sched.policy.num_padded_slots, stranded, swap_time)

    def _prepare(self, step: _Step) -> None:
        t0 = time.perf_counter()
        step.prepared = self.engine.executor.prepare(step.batch, self.engine.kv)
        step.sample_reqs = step.prepared[4]
        step.prepare_time = time.perf_counter() - t0

    def _launch(self, step: _Step, tokens: dict[int, int], live=None) -> None:
        """Start ``step``'s forward; ``tokens[k]`` is the token behind ``placeholder(k)``."""
        e = self.engine
        step.start = e.clock.now()
        if self.threaded:
            if step.prepared is None:
                self._prepare(step)
            input_ids = step.prepared[0]
            if tokens:
                holes = input_ids < 0
                if bool(holes.any()):
                    k = (-input_ids[holes] - 1).tolist()
                    input_ids[holes] = torch.tensor([tokens.get(i, 0) for i in k], dtype=input_ids.dtype)
            step.future = self._pool.submit(_forward, e.executor, step.prepared)
            return
        from minibatch.executor import StepOutput
        batch = step.batch if live is None else ScheduledBatch(items=live)
        if not batch.items:
            step.out = StepOutput([], 0.0, 0.0)
            return
        try:
            step.out = e.executor.execute(batch, e.kv)
        except Exception as exc:            # as the synchronous step: isolate the failing request(s)
            step.out = e._execute_isolated(batch, exc)
        step.sample_reqs = [r for r, _ in step.out.sampled]

    def _advance(self, step: _Step) -> None:
        """The launched step's tokens count as computed; its sampling requests will hold a
        placeholder while the next step is planned."""
        kv = self.engine.kv
        samplers = {id(r): k for k, r in enumerate(step.sample_reqs)}
        for req, n in step.batch.items:
            if req.is_finished:
                continue
            req.num_computed_tokens += n
            kv.cache_full_blocks(req)
            k = samplers.get(id(req))
            if k is not None:
                self._pending.append((req, k))

    def _apply(self, step: _Step, sampled, failed, logprobs, forward_time: float) -> list[Request]:
        """Step N's tokens: appended, stop checks, finishes (while N+1 runs), its StepRecord."""
        e = self.engine
        now = e.clock.now()
        touched: list[Request] = []
        done = {id(r) for r, _ in step.batch.items if r.is_finished}
        if self.computes_wasted:            # otherwise counted when the step was launched
            self._count_wasted(len(done), sum(1 for r, _ in sampled if id(r) in done))
        for req, token in sampled:
            if req.is_finished:
                continue
            e._append_token(req, token, now, logprobs.get(req.request_id))
            touched.append(req)
        for req, error in failed:
            if not req.is_finished:
                req.error = f"engine error in this request's step: {error}"
                e._finish(req, RequestStatus.FINISHED_ABORTED)
                touched.append(req)
        failed_ids = {id(r) for r, _ in failed}
        items = [(r, n) for r, n in step.batch.items if id(r) not in done and id(r) not in failed_ids]
        e.scheduler.policy.on_step(items, now)
        e._record_step(step.batch, step.start, now, forward_time, step.num_padded, step.stranded)
        return touched

    def _count_wasted(self, slots: int, tokens: int) -> None:
        self.num_wasted_slots += slots
        self.num_discarded_tokens += tokens


def _forward(executor, prepared) -> tuple[torch.Tensor | None, float]:
    """The model forward of one prepared step, on the worker thread: the logits of the rows
    that sample (``None`` when none does) and the seconds it took."""
    from contextlib import nullcontext

    from minibatch.kernels.cpu_threads import threads_for_step

    t0 = time.perf_counter()
    input_ids, positions, meta, sample_idx, sample_reqs = prepared
    cpu = executor.device.type == "cpu"
    with torch.inference_mode(), threads_for_step(input_ids.numel()) if cpu else nullcontext():
        hidden = executor.model(input_ids, positions, meta, executor.kv_caches)
        logits = None
        if sample_reqs:
            rows = hidden if len(sample_idx) == hidden.shape[0] else hidden[sample_idx]
            logits = executor.model.compute_logits(rows)
    if executor.device.type == "cuda":
        torch.cuda.synchronize(executor.device)
    return logits, time.perf_counter() - t0


__all__ = ["OverlapScheduler", "placeholder"]
