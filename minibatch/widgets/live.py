"""A run in a background thread, observable and steerable while it runs.

``LiveRun`` calls :func:`minibatch.run` under the virtual clock with a
:class:`~minibatch.runner.RunController`, paces it to ``speed`` virtual seconds per
wall second (changeable mid-run; 0 = as fast as possible) and fills a
:class:`LiveData` from the engine's event stream and step records, which
:class:`~minibatch.widgets.plot.LivePlot` draws.
"""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np

from minibatch.runner import RunController, run
from minibatch.viz import EventLog, kv_snapshot


class LiveData:
    """What the run thread records for the plot; read it under ``lock``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.version = 0
        self.step_t: list[float] = []       # step end times (virtual s)
        self.cum_tokens: list[int] = []     # output tokens generated up to each step
        self.waiting: list[int] = []
        self.seqs: list[int] = []
        self.kv: list[float] = []           # KV usage after each step, 0..1
        self.ft_t: list[float] = []         # first-token times and TTFTs (s)
        self.ttft: list[float] = []
        self.fin_t: list[float] = []        # finish times and TPOTs (s)
        self.tpot: list[float] = []
        self.arr_t: list[float] = []        # arrival times
        self.done_t: list[float] = []       # finish / abort / reject times
        self.marks: list[tuple[float, str, object]] = []
        self.tokens = 0

    def arrays(self) -> dict:
        with self.lock:
            return {k: np.asarray(getattr(self, k), dtype=float) for k in
                    ("step_t", "cum_tokens", "waiting", "seqs", "kv", "ft_t", "ttft", "fin_t", "tpot",
                     "arr_t", "done_t")} | {"marks": list(self.marks), "version": self.version}

    @property
    def now(self) -> float:
        return self.step_t[-1] if self.step_t else 0.0


class _MarkingController(RunController):
    """Records each change with the engine time at which the runner applies it."""

    def __init__(self, data: LiveData):
        super().__init__()
        self.data = data
        self.clock = None

    def take(self):
        out = super().take()
        if out and self.clock is not None:
            now = self.clock.now()
            with self.data.lock:
                self.data.marks.extend((now, n, v) for n, v in out)
                self.data.version += 1
        return out


class LiveRun:
    """``minibatch.run(workload, **engine_kwargs)`` in a daemon thread, observable and steerable."""

    def __init__(self, workload, engine_kwargs: dict, speed: float = 0.0, on_finish=None):
        self.workload = workload
        self.engine_kwargs = dict(engine_kwargs)
        self.data = LiveData()
        self.controller = _MarkingController(self.data)
        self.state = "ready"
        self.result = None
        self.error: BaseException | None = None
        self.error_text = ""
        self.engine = None
        self.wall_start = self.wall_end = None
        self.kv_peak: dict | None = None
        self._speed = float(speed or 0.0)
        self._rebase = True
        self._anchor = (0.0, 0.0)
        self._on_finish = on_finish
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    # -- control -----------------------------------------------------------------------
    def start(self) -> "LiveRun":
        if self._thread is not None:
            raise RuntimeError("a LiveRun runs once; make a new one")
        self.state = "starting"
        self.wall_start = time.perf_counter()
        self._thread = threading.Thread(target=self._main, name="minibatch-live-run", daemon=True)
        self._thread.start()
        return self

    @property
    def speed(self) -> float:
        return self._speed

    @speed.setter
    def speed(self, value: float) -> None:
        self._speed = float(value or 0.0)
        self._rebase = True

    def set(self, name: str, value) -> None:
        self.controller.set(name, value)

    def pause(self) -> None:
        if self.state in ("running", "starting"):
            self.controller.paused = True
            self.state = "paused"

    def resume(self) -> None:
        if self.state == "paused":
            self._rebase = True
            self.controller.paused = False
            self.state = "running"

    def stop(self) -> None:
        self.controller.stop()
        self.controller.paused = False

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        """The ``RunResult``; raises ``TimeoutError``, or ``RuntimeError`` if the run failed."""
        if self._thread is None:
            raise RuntimeError("the run has not been started")
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"the run failed: {self.error!r}") from self.error
        return self.result

    # -- the run thread ------------------------------------------------------------------
    def _main(self) -> None:
        from minibatch.config import EngineConfig
        from minibatch.engine import LLMEngine
        try:
            engine = LLMEngine(EngineConfig.from_kwargs(**self.engine_kwargs), clock="virtual")
            self.engine = engine
            self.controller.clock = engine.clock
            events = EventLog(engine)
            engine.subscribe(self._on_event)
            if self.state == "starting":
                self.state = "running"
            self._rebase = True
            result = run(self.workload, engine=engine, controller=self.controller, on_step=self._on_step)
            result.extra["events"] = events.events
            result.extra["kv_snapshot"] = self.kv_peak
            self.result = result
            self.state = "stopped" if self.controller.stop_requested else "done"
        except BaseException as e:     # shown by the dashboard, re-raised by wait()
            self.error = e
            self.error_text = traceback.format_exc()
            self.state = "error"
        finally:
            self.wall_end = time.perf_counter()
            self._done.set()
            if self._on_finish is not None:
                self._on_finish(self)

    def _on_event(self, event: str, t: float, req, info: dict) -> None:
        d = self.data
        if event == "token":
            d.tokens += 1
        elif event == "first_token":
            with d.lock:
                d.ft_t.append(t)
                d.ttft.append(t - req.arrival_time)
        elif event == "arrival":
            with d.lock:
                d.arr_t.append(req.arrival_time)
        elif event in ("finish", "abort", "reject"):
            with d.lock:
                if event == "reject":        # rejected requests never emit "arrival"
                    d.arr_t.append(req.arrival_time)
                d.done_t.append(t)
                n = req.num_output_tokens
                if event == "finish" and n >= 2 and req.first_token_time is not None:
                    d.fin_t.append(t)
                    d.tpot.append((req.token_times[-1] - req.first_token_time) / (n - 1))

    def _on_step(self, engine, rec) -> None:
        d = self.data
        with d.lock:
            d.step_t.append(rec.start_time + rec.duration)
            d.cum_tokens.append(d.tokens)
            d.waiting.append(rec.num_waiting)
            d.seqs.append(rec.num_seqs)
            d.kv.append(rec.kv_usage)
            d.version += 1
        peak = self.kv_peak["usage"] if self.kv_peak else -1.0
        if rec.kv_usage > peak + 0.02 or (rec.kv_usage >= 1.0 > peak):
            snap = kv_snapshot(engine)
            snap["usage"] = rec.kv_usage
            self.kv_peak = snap
        self._pace(rec.start_time + rec.duration)

    def _pace(self, now_v: float) -> None:
        """Sleep so virtual time advances ``speed`` times as fast as wall time."""
        while not self.controller.stop_requested:
            speed = self._speed
            if speed <= 0:
                return
            if self._rebase:
                self._anchor = (now_v, time.perf_counter())
                self._rebase = False
                return
            v0, w0 = self._anchor
            lag = (now_v - v0) / speed - (time.perf_counter() - w0)
            if lag <= 0:
                return
            time.sleep(min(lag, 0.05))
