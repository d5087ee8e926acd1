"""``run(workload, ...)``: replay requests with arrival times through the engine.

Under the virtual clock (the default) arrivals are injected when virtual time passes
them and every step advances the clock by its measured (real model) or modelled
(simulator) duration, so results are deterministic and a long trace replays as fast
as the machine allows. Under the wall clock the loop sleeps until each arrival.

A :class:`RunController` changes a run in flight from another thread (``policy``,
``max_num_seqs``, ``max_num_batched_tokens``, ``max_wait_ms``, ``request_rate``);
each change applies before the next step and is recorded in
``RunResult.reconfigurations`` as ``(time, name, value)``.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections import deque
from contextlib import contextmanager
from functools import wraps
from typing import Callable

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.results import RequestRecord, RunResult
from minibatch.sampling_params import SamplingParams

# Fewer garbage-collector passes while a run replays a workload.
#
# A simulated run allocates hundreds of thousands of short-lived objects (requests, step records,
# block-table entries) and almost no reference cycles. With CPython's default thresholds
# (700, 10, 10) the cyclic collector runs every 700 net allocations and, every hundred of those,
# walks every object the kernel holds, including the results of all earlier runs in a notebook:
# a quarter of a simulated cluster run's time went to it (chapter 27's runs: 21.3 s with the
# defaults against 17.1 s with these thresholds, ``benchmarks/``-style A/B in one process). Inside
# :func:`fewer_gc_passes` the young generation is collected every 100,000 allocations instead;
# nothing is disabled, and the old thresholds come back when the outermost run ends (runs may
# nest, e.g. a cluster run's replicas, or run in threads).
RUN_THRESHOLDS = (100_000, 50, 100)     # CPython's default: (700, 10, 10)

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_gc_passes():
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(*RUN_THRESHOLDS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None


def with_fewer_gc_passes(fn):
    """Decorator: ``fn`` runs inside :func:`fewer_gc_passes`."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        with fewer_gc_passes():
            return fn(*args, **kwargs)
    return wrapper


RECONFIGURABLE = ("policy", "max_num_seqs", "max_num_batched_tokens", "max_wait_ms", "request_rate")


class RunController:
    """Thread-safe handle on a run in flight: queue changes, or ask it to stop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[str, object]] = []
        self.stop_requested = False
        self.paused = False

    def set(self, name: str, value) -> None:
        if name not in RECONFIGURABLE:
            raise ValueError(f"cannot change {name!r} during a run; can change {RECONFIGURABLE}")
        with self._lock:
            self._pending.append((name, value))

    def stop(self) -> None:
        self.stop_requested = True

    def take(self) -> list[tuple[str, object]]:
        with self._lock:
            out, self._pending = self._pending, []
        return out


class _Arrivals:
    """The workload's pending requests, with arrival times that a rate change can rescale.

    Effective arrival = ``anchor_t + (t_orig - anchor_orig) * factor``; a new request
    rate ``r`` sets ``factor = base_rate / r`` from the current time on.
    """

    def __init__(self, specs, base_rate: float):
        self.pending = deque(specs)
        self.base_rate = base_rate
        self.anchor_t = 0.0
        self.anchor_orig = 0.0
        self.factor = 1.0

    def time_of(self, spec) -> float:
        return self.anchor_t + (spec.arrival_time - self.anchor_orig) * self.factor

    def next_time(self) -> float | None:
        return self.time_of(self.pending[0]) if self.pending else None

    def set_rate(self, rate: float, now: float) -> None:
        if not rate > 0:
            raise ValueError(f"request_rate must be > 0, got {rate!r}")
        self.anchor_orig = self.anchor_orig + (now - self.anchor_t) / self.factor
        self.anchor_t = now
        self.factor = self.base_rate / rate


def _prepare_workload(workload, engine: LLMEngine, seed: int):
    specs = list(workload)
    needs_ids = any(s.prompt_token_ids is None for s in specs)
    if not needs_ids:
        return specs
    from minibatch.workload import Workload

    wl = workload if isinstance(workload, Workload) else Workload(specs)
    if engine.vocab_size is not None:               # a real model: ids from its vocabulary
        reserved = set(engine.eos_token_ids)
        tok = engine.tokenizer
        if tok is not None:
            reserved |= set(getattr(tok, "all_special_ids", []) or [])
        return list(wl.materialize(engine.vocab_size, seed=seed, reserved_ids=sorted(reserved)))
    if engine.config.enable_prefix_caching:          # the simulator still needs ids to hash
        return list(wl.materialize(32000, seed=seed))
    return specs


@with_fewer_gc_passes
def run(workload, config: EngineConfig | None = None, clock: str = "virtual", *,
        controller: RunController | None = None, on_step: Callable | None = None,
        pace: float | None = None, max_steps: int | None = None, progress: bool = False,
        keep_tokens: bool | None = None, engine: LLMEngine | None = None, **engine_kwargs) -> RunResult:
    """Replay ``workload`` (a ``Workload`` or list of ``RequestSpec``) and return a :class:`RunResult`.

    ``config`` and keyword engine options combine (keywords win). ``pace`` (virtual
    seconds per wall second) slows a virtual-clock run down for live dashboards.
    ``on_step(engine, step_record)`` is called after every step.
    """
    if engine is None:
        if config is None:
            config = EngineConfig.from_kwargs(**engine_kwargs)
        elif engine_kwargs:
            config = config.replace(**engine_kwargs)
        engine = LLMEngine(config, clock=clock)
    config = engine.config
    clk = engine.clock
    specs = sorted(_prepare_workload(workload, engine, config.seed), key=lambda s: s.arrival_time)
    if specs:
        span = specs[-1].arrival_time - specs[0].arrival_time
        base_rate = (len(specs) - 1) / span if span > 0 else float("inf")
    else:
        base_rate = float("inf")
    arrivals = _Arrivals(specs, base_rate if base_rate != float("inf") else 1.0)
    if keep_tokens is None:
        keep_tokens = config.executor == "model"
    reconfigs: list[tuple[float, str, object]] = []
    ids: list[str] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(specs), desc="requests", unit="req")
    wall0 = time.perf_counter()
    t0 = clk.now()
    finished_before = 0

    def admit(now: float) -> None:
        while arrivals.pending and arrivals.next_time() <= now + 1e-12:
            spec = arrivals.pending.popleft()
            t_arr = t0 + arrivals.time_of(spec) if not clk.virtual else arrivals.time_of(spec)
            prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else [0] * spec.prompt_len
            params = SamplingParams(temperature=0.0, max_tokens=max(1, spec.max_tokens), ignore_eos=True)
            rid = spec.request_id if spec.request_id is not None else f"r{len(ids)}"
            try:
                engine.add_request(prompt, params, request_id=rid, arrival_time=t_arr,
                                   priority=spec.priority, tenant=spec.tenant)
            except ValueError as e:
                engine.requests[rid] = engine.reject(prompt, params, str(e), request_id=rid, arrival_time=t_arr)
            ids.append(rid)

    steps = 0
    while arrivals.pending or engine.has_unfinished_requests():
        if controller is not None:
            if controller.stop_requested:
                break
            while controller.paused and not controller.stop_requested:
                time.sleep(0.02)
            for name, value in controller.take():
                now = clk.now()
                rel = now - (0.0 if clk.virtual else t0)
                _apply(engine, arrivals, name, value, rel)
                reconfigs.append((rel, name, value))
        rel_now = clk.now() - (0.0 if clk.virtual else t0)
        admit(rel_now)
        if not engine.has_unfinished_requests():
            nxt = arrivals.next_time()
            if nxt is None:          # the last arrivals were all rejected
                break
            clk.advance_to(nxt if clk.virtual else t0 + nxt)
            continue
        n_steps = len(engine.steps)
        engine.step()
        steps += 1
        if len(engine.steps) == n_steps:
            # Nothing ran: the policy is holding requests back (a batching window) or
            # waiting for the next arrival. Jump to whichever comes first.
            wake = engine.scheduler.policy.next_wakeup(engine.scheduler.state(clk.now()))
            nxt = arrivals.next_time()
            nxt = None if nxt is None else (nxt if clk.virtual else t0 + nxt)
            candidates = [t for t in (wake, nxt) if t is not None and t > clk.now()]
            if not candidates:
                if clk.virtual:
                    raise RuntimeError("the engine made no progress and nothing is due: "
                                       f"policy {engine.scheduler.policy.name!r} holds "
                                       f"{engine.num_waiting} waiting requests forever")
                time.sleep(0.001)
                continue
            clk.advance_to(min(candidates))
            continue
        if on_step is not None:
            on_step(engine, engine.steps[-1])
        if pace and clk.virtual:
            lag = (clk.now() - t0) / pace - (time.perf_counter() - wall0)
            if lag > 0:
                time.sleep(min(lag, 1.0))
        if bar is not None:
            done = len(engine.finished)
            bar.update(done - finished_before)
            finished_before = done
        if max_steps is not None and steps >= max_steps:
            break
    if bar is not None:
        bar.close()
    for rid in ids:                  # a stopped run aborts what is in flight: nothing is lost
        if not engine.requests[rid].is_finished:
            engine.abort_request(rid)
    records = [RequestRecord.of(engine.requests[i], keep_tokens=keep_tokens) for i in ids]
    if not clk.virtual:
        for r in records:      # report wall-clock runs relative to the run's start
            _shift(r, -t0)
    cfg = config.to_dict()
    steps = list(engine.steps)
    if not clk.virtual:
        steps = [dataclasses.replace(st, start_time=st.start_time - t0) for st in steps]
    return RunResult(records, steps, cfg, reconfigs, engine.kv.num_blocks,
                     time.perf_counter() - wall0, extra={"not_submitted": len(arrivals.pending)})


def _shift(r: RequestRecord, dt: float) -> None:
    r.arrival_time += dt
    for name in ("first_scheduled_time", "first_token_time", "finish_time"):
        v = getattr(r, name)
        if v is not None:
            setattr(r, name, v + dt)
    r.token_times = [t + dt for t in r.token_times]


def _apply(engine: LLMEngine, arrivals: _Arrivals, name: str, value, now: float) -> None:
    from minibatch.policies import make_policy

    cfg = engine.config
    if name == "policy":
        engine.scheduler.policy = make_policy(value)
        cfg.policy = engine.scheduler.policy.name
    elif name == "request_rate":
        arrivals.set_rate(float(value), now)
    else:
        value = float(value) if name == "max_wait_ms" else int(value)
        setattr(cfg, name, value)
        cfg.validate()
