"""The engine behind a server: one background thread runs the loop, asyncio tasks talk to it.

``LLMEngine`` is single-threaded. ``AsyncEngine`` owns it and runs this loop in a
thread of its own, so every connection of the server shares one batch::

    while running:
        apply queued commands (add, abort)       # from any thread, in order
        if the engine has work:   step()         # one batch for all requests
        else:                     sleep on a condition variable until a command arrives
        deliver each request's new text/tokens to its asyncio stream (one hop per step)

Callers never touch the engine: ``await add_request(...)`` queues a command and waits
for the engine thread to validate it (bad input raises ``ValueError``), then reads the
returned :class:`RequestStream`; ``abort(request_id)`` frees the request's KV blocks at
the next loop turn. Finished requests are removed from the engine once delivered, so
memory stays bounded however long the server runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from minibatch.engine import LLMEngine
from minibatch.request import Request, RequestStatus
from minibatch.results import RequestRecord
from minibatch.sampling_params import SamplingParams
from minibatch.serving.metrics import engine_gauges

logger = logging.getLogger("minibatch.serving.async_engine")

IDLE_POLL_S = 0.005          # sleep when requests wait but no batch could run (e.g. a batching window)
MAX_STEP_RECORDS = 2048      # the engine's step timeline is trimmed to this many records


@dataclass
class Delta:
    """What a request produced since the last read: text and token ids, maybe its end."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)     # one entry per token id when the request asked


class RequestStream:
    """The asyncio side of one request: ``async for delta in stream`` until it finishes.

    Updates from the engine thread are coalesced, so a slow reader gets fewer, larger
    deltas rather than an unbounded queue.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_done=None):
        self.request_id = request_id
        self.loop = loop
        self.num_prompt_tokens = 0
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []            # Request.output_logprobs, as delivered
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.metrics: RequestRecord | None = None
        self._pending_text: list[str] = []
        self._pending_ids: list[int] = []
        self._pending_logprobs: list = []
        self._delivered_end = False
        self.counted = False                # counts toward AsyncEngine.num_in_flight
        self._event = asyncio.Event()
        self._on_done = on_done

    # Called on the event loop (scheduled from the engine thread).
    def _update(self, text: str, ids: list[int], end: tuple | None, logprobs: list = ()) -> None:
        self.text += text
        self.token_ids += ids
        self.logprobs += logprobs
        self._pending_text.append(text)
        self._pending_ids += ids
        self._pending_logprobs += logprobs
        if end is not None and not self.finished:
            self.finished = True
            self.finish_reason, self.stop_reason, self.error, self.metrics = end
            if self._on_done is not None:
                self._on_done(self)
        self._event.set()

    async def next_delta(self) -> Delta | None:
        """The next coalesced delta, or ``None`` after the final one was returned."""
        while True:
            if self._delivered_end:
                return None
            if self._pending_ids or self._pending_text or self.finished:
                break
            self._event.clear()
            await self._event.wait()
        delta = Delta("".join(self._pending_text), self._pending_ids, self.finished,
                      self.finish_reason, self.stop_reason, self.error, self._pending_logprobs)
        self._pending_text, self._pending_ids, self._pending_logprobs = [], [], []
        self._delivered_end = self.finished
        return delta

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        delta = await self.next_delta()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def wait(self) -> None:
        """Wait until the request has finished (drains the deltas)."""
        async for _ in self:
            pass


@dataclass
class _Track:
    """Engine-thread bookkeeping of what a stream has already been sent."""

    stream: RequestStream
    max_stop_len: int
    sent_chars: int = 0
    sent_tokens: int = 0
    updates: list = field(default_factory=list)


class AsyncEngine:
    """Runs ``engine`` in a background thread; thread-safe ``add_request`` / ``abort``."""

    def __init__(self, engine: LLMEngine, metrics=None):
        engine.stream_text = True            # keep ``Request.output_text`` up to date per token
        self.engine = engine
        self.metrics = metrics
        if metrics is not None:
            engine.subscribe(metrics.on_event)
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._tracks: dict[str, _Track] = {}     # engine thread only
        self._stopping = False
        self.num_in_flight = 0                   # event-loop side: admitted, not yet finished
        self.gauges = self._gauges()             # snapshot published by the engine thread
        self.error: BaseException | None = None
        self._dead = False                       # the engine thread died
        self._thread = threading.Thread(target=self._run, name="minibatch-engine", daemon=True)
        self._thread.start()

    # -- API (any thread / the event loop) ------------------------------------------------
    async def add_request(self, prompt, params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; raises ``ValueError`` naming the problem if it is invalid, and
        ``RuntimeError`` if the engine is shutting down or has stopped."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        if not self.is_alive:
            raise RuntimeError(self.failure)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, on_done=self._on_stream_done)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.num_in_flight += 1
        stream.counted = True
        self._submit(("add", prompt, params, stream, fut))
        try:
            stream.num_prompt_tokens = await asyncio.wrap_future(fut)
        except BaseException:
            self._on_stream_done(stream)
            rejected = fut.done() and not fut.cancelled() and fut.exception() is not None
            if not rejected:
                self.abort(request_id)       # cancelled while queued: do not leave it running
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (e.g. its client went away); its KV blocks are freed at once."""
        self._submit(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (at a shutdown deadline); each stream ends cleanly."""
        self._submit(("abort_all",))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    @property
    def failure(self) -> str | None:
        """Why the engine is unhealthy, or ``None``: its thread has stopped, or a step failed
        in a way that could not be pinned on a request (every request then in flight was
        failed, and the engine's state is suspect: the process should be restarted)."""
        if self._dead or not self._thread.is_alive():
            if self._stopping and self.error is None:
                return "the engine has been shut down"
            return f"the engine thread has stopped: {_describe(self.error)}"
        if self.error is not None:
            return f"the engine failed a step: {_describe(self.error)}"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running, deliver the ends, and stop the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        with self._cv:                       # commands that came too late: fail them
            late, self._commands = list(self._commands), deque()
        for cmd in late:
            if cmd[0] == "add" and cmd[-1].set_running_or_notify_cancel():
                cmd[-1].set_exception(RuntimeError("the engine is shutting down"))

    def _on_stream_done(self, stream: RequestStream) -> None:
        if stream.counted:
            stream.counted = False
            self.num_in_flight -= 1

    def _submit(self, command: tuple) -> None:
        with self._cv:
            if self._dead:              # nobody will ever apply it
                if command[0] == "add" and command[-1].set_running_or_notify_cancel():
                    command[-1].set_exception(RuntimeError(self.failure))
                return
            self._commands.append(command)
            self._cv.notify()

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the thread dies: end every stream, refuse what comes next
            logger.exception("the engine thread died")
            self.error = e
            self._die(f"engine error: {_describe(e)}")

    def _die(self, error: str) -> None:
        with self._cv:
            self._dead = True
            late, self._commands = list(self._commands), deque()
        for cmd in late:
            if cmd[0] == "add" and cmd[-1].set_running_or_notify_cancel():
                cmd[-1].set_exception(RuntimeError(self.failure))
        tracks, self._tracks = list(self._tracks.values()), {}
        for track in tracks:
            try:
                track.stream.loop.call_soon_threadsafe(
                    _apply_updates, [(track.stream, "", [], ("abort", None, error, None))])
            except RuntimeError:    # that event loop is closed
                pass

    def _loop(self) -> None:
        engine = self.engine
        idle_wait = None
        while True:
            with self._cv:
                if not self._commands and not self._stopping:
                    if not engine.has_unfinished_requests():
                        self._cv.wait()
                    elif idle_wait is not None:
                        self._cv.wait(idle_wait)
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            idle_wait = None
            touched: list[Request] = []
            for cmd in commands:
                self._apply(cmd)
            if stopping:
                for rid in list(self._tracks):
                    engine.abort_request(rid)
            elif engine.has_unfinished_requests():
                num_steps = len(engine.steps)
                try:
                    touched = engine.step()
                except Exception as e:  # not pinned on a request (LLMEngine isolates those): fail
                    logger.exception("engine step failed")  # what is in flight, keep serving, go unhealthy
                    self.error = e
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
                if len(engine.steps) == num_steps:      # nothing could run this turn
                    idle_wait = self._idle_wait()
                elif self.metrics is not None:
                    s = engine.steps[-1]
                    self.metrics.on_step(s.num_prefill_tokens + s.num_decode_tokens)
                if len(engine.steps) > 2 * MAX_STEP_RECORDS:
                    del engine.steps[:-MAX_STEP_RECORDS]
            self._deliver(touched)
            self.gauges = self._gauges()
            if stopping:
                return

    def _fail_all(self, error: str) -> None:
        for rid in list(self._tracks):
            req = self.engine.requests.get(rid)
            if req is not None:
                req.error = error
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine is in a bad state; still end the client's stream
                logger.exception("abort after an engine error failed")
                if req is not None and not req.is_finished:
                    req.status = RequestStatus.FINISHED_ABORTED
                    self.engine.finished.append(req)

    def _apply(self, cmd: tuple) -> None:
        engine = self.engine
        if cmd[0] == "abort":
            engine.abort_request(cmd[1])
            return
        if cmd[0] == "abort_all":
            for rid in list(self._tracks):
                engine.abort_request(rid)
            return
        _, prompt, params, stream, fut = cmd
        if not fut.set_running_or_notify_cancel():
            return
        try:
            rid = engine.add_request(prompt, params, request_id=stream.request_id)
        except Exception as e:  # ValueError for bad input; anything else is reported too
            fut.set_exception(e)
            return
        req = engine.requests[rid]
        p = req.sampling_params
        # Text that may still turn out to begin a stop string is held back, unless the stop
        # string is kept in the output (then nothing sent is ever cut).
        hold = 0 if p.include_stop_str_in_output else max((len(s) for s in p.stop), default=0)
        self._tracks[rid] = _Track(stream, hold)
        fut.set_result(req.num_prompt_tokens)

    def _idle_wait(self) -> float:
        sched = self.engine.scheduler
        now = self.engine.clock.now()
        wake = sched.policy.next_wakeup(sched.state(now))
        if wake is None:
            return IDLE_POLL_S
        return min(max(wake - now, 0.0), 0.1)

    def _deliver(self, touched: list[Request]) -> None:
        """Send each touched or finished request its new text and tokens (one hop per loop)."""
        engine = self.engine
        finished, engine.finished = engine.finished, []     # the engine's list would grow forever
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req in touched + finished:
            track = self._tracks.get(req.request_id)
            if track is None:
                continue
            done = req.is_finished
            text = req.output_text
            if not done and track.max_stop_len > 1:     # hold back what may become a stop string
                text = text[:max(track.sent_chars, len(text) - track.max_stop_len + 1)]
            new_text = text[track.sent_chars:]
            new_ids = req.output_token_ids[track.sent_tokens:]
            new_lp = req.output_logprobs[track.sent_tokens:] if req.sampling_params.logprobs is not None else []
            track.sent_chars += len(new_text)
            track.sent_tokens += len(new_ids)
            end = None
            if done:
                end = (req.status.value, req.stop_reason, req.error, RequestRecord.of(req, keep_tokens=False))
                del self._tracks[req.request_id]
                engine.requests.pop(req.request_id, None)
            if new_text or new_ids or end is not None:
                by_loop.setdefault(track.stream.loop, []).append((track.stream, new_text, new_ids, end, new_lp))
        for loop, updates in by_loop.items():
            try:
                loop.call_soon_threadsafe(_apply_updates, updates)
            except RuntimeError:    # the event loop is closed: nobody is listening any more
                pass

    def _gauges(self) -> dict:
        return engine_gauges(self.engine)


def _describe(e: BaseException | None) -> str:
    return "no error recorded" if e is None else f"{type(e).__name__}: {e}"[:500]


def _apply_updates(updates: list) -> None:
    for stream, text, ids, end, *logprobs in updates:
        stream._update(text, ids, end, *logprobs)
