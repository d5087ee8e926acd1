"""``Dashboard``: turn the knobs of a run while it runs, and watch its metrics move."""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import io
import threading
import time
import traceback

import ipywidgets as W

from minibatch.widgets import controls as C
from minibatch.widgets.live import LiveRun
from minibatch.widgets.plot import DASHBOARD_PANELS, LivePlot


STATIC_HINT = ("[minibatch {what}: a picture of it as it was displayed. Run this cell in JupyterLab "
               "(make course) to get the live dashboard.]")


def static_bundle(widget, frames: list[bytes], what: str, **kwargs) -> dict:
    """``widget``'s display bundle plus a still picture and a one-line hint.

    A stored notebook shows a widget only where a kernel has made it: the book, GitHub and a
    JupyterLab that has not run the cell (an untrusted notebook shows safe types only) fall
    back to the bundle's other types, which for an ipywidget is ``VBox(children=...)`` text.
    With ``image/png`` (``frames`` side by side: JPEG frames of :class:`LivePlot`) and a hint
    as ``text/plain`` they show the dashboard's picture instead; a live kernel still renders
    the widget view, the richest type.
    """
    from PIL import Image

    imgs = [Image.open(io.BytesIO(f)).convert("RGB") for f in frames]
    still = Image.new("RGB", (sum(i.width for i in imgs), max(i.height for i in imgs)), "white")
    x = 0
    for i in imgs:
        still.paste(i, (x, 0))
        x += i.width
    buf = io.BytesIO()
    still.save(buf, format="png", optimize=True)
    bundle = dict(widget._repr_mimebundle_(**kwargs))
    bundle["image/png"] = base64.b64encode(buf.getvalue()).decode("ascii")
    bundle["text/plain"] = STATIC_HINT.format(what=what)
    return bundle


class ErrorArea:
    """An HTML area that lists errors raised in callbacks and threads (newest last)."""

    def __init__(self):
        self.widget = W.HTML(value="", layout=W.Layout(width="100%"))
        self.errors: list[str] = []

    def show(self, where: str, text: str) -> None:
        self.errors.append(f"{where}: {text}")
        items = "".join(f"<pre style='white-space:pre-wrap;margin:2px 0'>{html.escape(e)}</pre>"
                        for e in self.errors[-5:])
        self.widget.value = (f"<div style='border:1px solid #d62728;background:#fdecea;color:#a00;"
                             f"padding:4px 8px;font-size:12px'><b>Error</b>{items}</div>")

    def clear(self) -> None:
        self.errors = []
        self.widget.value = ""


def guarded(where: str):
    """Decorator for callbacks: an exception goes to ``self.error_area`` instead of the log."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:   # noqa: BLE001  (shown to the user)
                self.error_area.show(where, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        return inner
    return wrap


class Refresher:
    """Calls ``tick()`` about ``fps`` times a second in a daemon thread until ``tick`` returns False."""

    def __init__(self, tick, fps: float, on_error):
        self.tick, self.interval, self.on_error = tick, 1.0 / fps, on_error
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="minibatch-dashboard-refresh", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        nxt = time.perf_counter()
        while not self._stop.is_set():
            try:
                if self.tick() is False:
                    return
            except Exception as e:   # noqa: BLE001
                self.on_error("refresh", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
                return
            nxt = max(nxt + self.interval, time.perf_counter())
            self._stop.wait(nxt - time.perf_counter())

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


class Dashboard:
    """Controls, a live figure and run buttons around :func:`minibatch.run`.

    ``Dashboard(workload=None, **engine_kwargs)``: ``workload`` is a preset name, a
    ``Workload`` (or list of ``RequestSpec``) or None (the ``workload`` control picks a
    preset); engine keywords set the initial controls (``policy``, ``max_num_seqs``,
    ``executor="sim"``, ``model``, ``hardware`` ...) and pass through to the engine.
    Keyword-only: ``speed`` (virtual seconds per wall second, 0 = as fast as possible),
    ``num_requests``, ``request_rate``, ``window`` (rolling window, virtual s), ``fps``.

    ``start()`` runs in a background thread; changing a live control (``policy``,
    ``request_rate``, ``max_num_seqs``, ``max_wait_ms``, ``max_num_batched_tokens``)
    reconfigures the engine at its next step and marks the plots; ``speed`` changes the
    pace at once. ``pause()``/``resume()``, ``stop()``, ``reset()``, ``wait(timeout)``;
    ``preview()`` fills the figure with a quick replay of the first requests. Displayed, it also
    carries a still picture of its figure (:func:`static_bundle`) for viewers without a kernel.
    """

    def __init__(self, workload=None, *, speed=None, num_requests=None, request_rate=None,
                 window: float | None = None, fps: float = 8.0, **engine_kwargs):
        self.engine_kwargs = engine_kwargs
        self.custom_workload = None if workload is None or isinstance(workload, str) else workload
        self.window = window
        self.fps = fps
        self.error_area = ErrorArea()
        self.controls = C.build_controls(engine_kwargs, workload=workload, speed=speed,
                                         num_requests=num_requests, request_rate=request_rate)
        self.buttons = {"start": W.Button(description="Start", button_style="success", icon="play"),
                        "pause": W.Button(description="Pause", icon="pause", disabled=True),
                        "reset": W.Button(description="Reset", icon="refresh")}
        self.buttons["start"].on_click(lambda _: self.start())
        self.buttons["pause"].on_click(lambda _: self.toggle_pause())
        self.buttons["reset"].on_click(lambda _: self.reset())
        self.status = W.HTML(value="ready")
        self.image = W.Image(format=LivePlot.FORMAT, layout=W.Layout(width="100%", max_width="960px"))
        self.summary = W.HTML(value="")
        self.plot = LivePlot(DASHBOARD_PANELS)
        self.live: LiveRun | None = None
        self.result = None
        self.renders = 0
        self.render_times: list[float] = []
        self._refresher: Refresher | None = None
        self._render_lock = threading.Lock()
        self._render_failed = False
        for name, w in self.controls.items():
            w.observe(functools.partial(self._on_control, name), names="value")
        self.widget = self._layout()
        self._reset_plot()
        self.image.value = self.plot.frame()

    # -- layout ----------------------------------------------------------------------------
    def _layout(self) -> W.VBox:
        c = self.controls
        row = lambda *ws: W.HBox(list(ws), layout=W.Layout(flex_flow="row wrap"))  # noqa: E731
        return W.VBox([
            W.HTML("<b>minibatch live dashboard</b>"),
            row(c["workload"], c["num_requests"], c["request_rate"], c["speed"]),
            row(c["executor"], c["model"], c["hardware"]),
            row(c["policy"], c["max_num_seqs"], c["max_wait_ms"], c["max_num_batched_tokens"]),
            row(self.buttons["start"], self.buttons["pause"], self.buttons["reset"], self.status),
            self.image, self.summary, self.error_area.widget,
        ])

    def _ipython_display_(self):
        from IPython.display import display
        display(self._repr_mimebundle_(), raw=True)

    def _repr_mimebundle_(self, **kwargs):
        with self._render_lock:
            frame = self.image.value
        return static_bundle(self.widget, [frame], "dashboard", **kwargs)

    @property
    def errors(self) -> list[str]:
        return self.error_area.errors

    # -- control callbacks -----------------------------------------------------------------
    @guarded("control")
    def _on_control(self, name: str, change) -> None:
        self._control_changed(name, change["new"])

    def _control_changed(self, name: str, value) -> None:
        running = self.live is not None and not self.live.finished
        if name == "speed":
            if self.live is not None:
                self.live.speed = value
        elif name in C.LIVE:
            if running:
                self.live.set(name, C.validate_live(name, value))
        elif name == "executor" and not running:
            C.sync_executor(self.controls)
            self._apply_defaults()
        elif name == "workload" and not running and value != C.CUSTOM and self.controls["executor"].value == "sim":
            self.controls["request_rate"].value = C.preset_rate(value)

    def _apply_defaults(self) -> None:
        c = self.controls
        ex = c["executor"].value
        c["speed"].value = C.DEFAULT_SPEED[ex]
        if c["workload"].value != C.CUSTOM:
            c["num_requests"].value = C.DEFAULT_REQUESTS[ex]
            c["request_rate"].value = C.preset_rate(c["workload"].value) if ex == "sim" else C.TINY_DEFAULT_RATE

    def set(self, name: str, value) -> None:
        """Set a control; a live knob set to its current value is still sent to the running engine."""
        w = self.controls[name]
        if w.value == value:
            with self._errors_shown("control"):
                self._control_changed(name, value)
        else:
            w.value = value

    @contextlib.contextmanager
    def _errors_shown(self, where: str):
        try:
            yield
        except Exception as e:   # noqa: BLE001  (shown to the user)
            self.error_area.show(where, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")

    # -- run control -------------------------------------------------------------------------
    def start(self) -> None:
        """Start a new run with the current settings (a finished run is replaced)."""
        with self._errors_shown("start"):
            if self.live is not None and not self.live.finished:
                raise RuntimeError("a run is in progress; reset() it first")
            self._stop_refresher()
            self.error_area.clear()
            workload = C.make_workload(self.controls, self.custom_workload)
            kwargs = C.engine_options(self.controls, self.engine_kwargs)
            self.result = None
            self.live = LiveRun(workload, kwargs, speed=self.controls["speed"].value)
            horizon = max(s.arrival_time for s in workload) if len(workload) else 1.0
            self._reset_plot(horizon, len(workload), sum(r.max_tokens for r in workload))
            self._lock_setup(True)
            self.renders = 0
            self.render_times = []
            self._render_failed = False
            # The refresher draws the first frame (a full draw, the slowest), then starts the run.
            self._refresher = Refresher(self._tick, self.fps, self.error_area.show)

    def preview(self, num_requests: int = 40, timeout: float | None = 60.0):
        """Replay the first ``num_requests`` requests of the current settings as fast as possible
        and return the ``RunResult``, so that the figure shows a finished run; the controls keep
        their values, so Start then runs the whole workload at the chosen ``speed``."""
        c = self.controls
        kept = c["num_requests"].value, c["speed"].value
        c["num_requests"].value, c["speed"].value = min(num_requests, kept[0]), 0.0
        try:
            self.start()
            return self.wait(timeout)
        finally:
            c["num_requests"].value, c["speed"].value = kept

    def toggle_pause(self) -> None:
        if self.live is None:
            return
        self.resume() if self.live.state == "paused" else self.pause()

    def pause(self) -> None:
        if self.live is not None:
            self.live.pause()
            self.buttons["pause"].description = "Resume"
            self.buttons["pause"].icon = "play"

    def resume(self) -> None:
        if self.live is not None:
            self.live.resume()
            self.buttons["pause"].description = "Pause"
            self.buttons["pause"].icon = "pause"

    def stop(self) -> None:
        """End the run early; requests not finished stay unfinished in the result."""
        if self.live is not None:
            self.live.stop()

    def reset(self) -> None:
        """Stop any run and clear the plots; the controls keep their values."""
        if self.live is not None:
            self.live.stop()
            self.live._done.wait(10)
        self._stop_refresher()
        self.live = None
        self.result = None
        self._lock_setup(False)
        self.summary.value = ""
        self.error_area.clear()
        self._reset_plot()
        self.image.value = self.plot.frame()
        self.status.value = "ready"

    def wait(self, timeout: float | None = None):
        """Block until the run ends and the last frame is drawn; return its ``RunResult``."""
        if self.live is None:
            raise RuntimeError("no run: call start() first")
        t0 = time.perf_counter()
        live = self.live
        while live._thread is None and not live.finished:          # not started by the refresher yet
            if self._refresher is None or not self._refresher.thread.is_alive():
                raise RuntimeError("the run was not started (see the dashboard's errors)")
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"the run did not start within {timeout} s")
            time.sleep(0.01)
        left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - t0))
        result = live.wait(left)
        if self._refresher is not None:
            left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - t0))
            self._refresher.thread.join(left)
        return result

    # -- drawing -------------------------------------------------------------------------------
    def _lock_setup(self, running: bool) -> None:
        for name in C.SETUP:
            w = self.controls[name]
            w.disabled = running or (name == "num_requests" and self.controls["workload"].value == C.CUSTOM)
        if not running:
            C.sync_executor(self.controls)
        self.buttons["start"].disabled = running
        self.buttons["pause"].disabled = not running
        self.buttons["pause"].description, self.buttons["pause"].icon = "Pause", "pause"

    def _reset_plot(self, horizon: float | None = None, total: int | None = None, tokens: int | None = None) -> None:
        with self._render_lock:
            self.plot.reset(horizon or 1.0, self.window, total, tokens)

    def _stop_refresher(self) -> None:
        if self._refresher is not None:
            self._refresher.stop()
            self._refresher = None

    def _tick(self) -> bool:
        live = self.live
        if live is None:
            return False
        final = live.finished
        if live.state == "ready":                        # first frame, then the run
            with self._render_lock:
                self.image.value = self.plot.frame()
            live.start()
            return True
        if not self._render_failed:
            try:
                with self._render_lock:
                    if self.plot.update(live.data, final=final):
                        self.image.value = self.plot.frame()
                        self.renders += 1
                        self.render_times.append(time.perf_counter())
            except Exception as e:   # noqa: BLE001  (shown once; the run goes on without a plot)
                self._render_failed = True
                self.error_area.show("plot", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        self.status.value = self._status_text(live)
        if final:
            self._finish(live)
            return False
        return True

    def _status_text(self, live: LiveRun) -> str:
        d = live.data
        with d.lock:
            now, done, arrived = d.now, len(d.done_t), len(d.arr_t)
            kv = d.kv[-1] * 100 if d.kv else 0.0
            seqs = d.seqs[-1] if d.seqs else 0
            waiting = d.waiting[-1] if d.waiting else 0
            last = d.marks[-1] if d.marks else None
        total = len(live.workload)
        wall = (live.wall_end or time.perf_counter()) - live.wall_start
        return (f"<b>{live.state}</b> &middot; t = {now:.2f} s virtual, {wall:.1f} s wall &middot; "
                f"{done}/{total} finished, {arrived - done} in engine &middot; queue {waiting} &middot; "
                f"batch {seqs} &middot; KV {kv:.0f}% &middot; {self.refresh_rate():.1f} frames/s"
                + (f" &middot; last change: {html.escape(f'{last[1]}={last[2]}')} at {last[0]:.2f} s" if last else ""))

    def refresh_rate(self) -> float:
        """Frames drawn per wall second while the run was in flight."""
        ts = self.render_times
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else 0.0

    def _finish(self, live: LiveRun) -> None:
        self._lock_setup(False)
        if live.error is not None:
            self.error_area.show("run", live.error_text)
            return
        self.result = live.result
        self.summary.value = summary_html(self.result)

    def figure(self, kind: str = "timeline", **kwargs):
        """A static figure of the last result: ``timeline``, ``gantt``, ``batch_composition``,
        ``latency_cdf`` or ``kv_block_map`` (the peak-KV snapshot)."""
        from minibatch import viz
        if self.result is None:
            raise RuntimeError("no finished run yet")
        if kind == "kv_block_map":
            return viz.kv_block_map(self.result.extra["kv_snapshot"], **kwargs)
        return getattr(viz, kind)(self.result, **kwargs)


def summary_html(result, keys=("completed", "throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50",
                                "tpot_p99", "num_preemptions", "kv_util_max")) -> str:
    from minibatch.viz import metric_title
    s = result.summary()
    cells = []
    for k in keys:
        title, unit, scale = metric_title(k)
        v = s.get(k, float("nan")) * scale
        cells.append(f"<td style='padding:0 8px'>{title}<br><b>{v:.4g}</b> {unit}</td>")
    n_re = len(result.reconfigurations)
    return (f"<table style='font-size:12px'><tr>{''.join(cells)}</tr></table>"
            f"<small>{s['num_requests']} requests, {n_re} live change(s), "
            f"{result.wall_time_s:.1f} s wall</small>")
