"""``Compare``: two configurations on the same workload, side by side, and their difference."""

from __future__ import annotations

import functools
import threading

import ipywidgets as W

from minibatch import viz
from minibatch.widgets import controls as C
from minibatch.widgets.dashboard import ErrorArea, Refresher, guarded, static_bundle
from minibatch.widgets.live import LiveRun
from minibatch.widgets.plot import COMPACT_PANELS, LivePlot

SIDES = ("A", "B")


class Compare:
    """Run configuration ``a`` and configuration ``b`` on one workload and compare them.

    ``Compare(a={"policy": ...}, b={"max_num_seqs": 16}, workload=None, **engine_kwargs)``:
    ``engine_kwargs`` are common to both sides, ``a``/``b`` override them. Each side has
    its own policy and batching controls (live during the run, like the dashboard's);
    workload, executor, model, hardware, rate and speed are shared. With the simulator
    both sides run at once; with the real model they run one after the other so they do
    not compete for the CPU. When both end, bars of the summary metrics, TTFT and TPOT
    CDFs and a table with the relative change (B vs A) appear. ``results`` maps each
    side's label to its ``RunResult``.
    """

    def __init__(self, a: dict | None = None, b: dict | None = None, workload=None, *, speed=0.0,
                 num_requests=None, request_rate=None, window: float | None = None, fps: float = 6.0,
                 **engine_kwargs):
        self.engine_kwargs = engine_kwargs
        self.custom_workload = None if workload is None or isinstance(workload, str) else workload
        self.window = window
        self.fps = fps
        self.error_area = ErrorArea()
        self.controls = C.build_controls(engine_kwargs, workload=workload, speed=speed,
                                         num_requests=num_requests, request_rate=request_rate)
        for name in ("policy", "max_num_seqs", "max_wait_ms", "max_num_batched_tokens"):
            del self.controls[name]
        overrides = {"A": a or {}, "B": b or {}}
        self.sides = {s: C.build_controls({**engine_kwargs, **overrides[s]}, side=True) for s in SIDES}
        self.plots = {s: LivePlot(COMPACT_PANELS, ncols=2, figsize=(5.6, 4.2), title=f"run {s}") for s in SIDES}
        self.images = {s: W.Image(format=LivePlot.FORMAT, layout=W.Layout(width="50%", max_width="560px"))
                       for s in SIDES}
        self.runs: dict[str, LiveRun] = {}
        self.results: dict = {}
        self.button = W.Button(description="Run both", button_style="success", icon="play")
        self.button.on_click(lambda _: self.start())
        self.status = W.HTML("ready")
        self.bars = W.Image(format="png", layout=W.Layout(width="100%", max_width="960px"))
        self.cdfs = {m: W.Image(format="png", layout=W.Layout(width="50%", max_width="480px"))
                     for m in ("ttft", "tpot")}
        self.table = W.HTML("")
        self._refresher: Refresher | None = None
        self._done = threading.Event()
        self._done.set()
        self.controls["speed"].observe(self._on_speed, names="value")
        self.controls["request_rate"].observe(functools.partial(self._on_live, None, "request_rate"), names="value")
        self.controls["executor"].observe(lambda ch: C.sync_executor(self.controls), names="value")
        for s, ctl in self.sides.items():
            for name, w in ctl.items():
                w.observe(functools.partial(self._on_live, s, name), names="value")
        self.widget = self._layout()
        for s in SIDES:
            self.plots[s].reset(1.0, window)
            self.images[s].value = self.plots[s].frame()

    def _layout(self) -> W.VBox:
        c = self.controls
        row = lambda *ws: W.HBox(list(ws), layout=W.Layout(flex_flow="row wrap"))  # noqa: E731
        side = lambda s: W.VBox([W.HTML(f"<b>configuration {s}</b>"), *self.sides[s].values()])  # noqa: E731
        return W.VBox([
            W.HTML("<b>minibatch: compare two configurations</b>"),
            row(c["workload"], c["num_requests"], c["request_rate"], c["speed"]),
            row(c["executor"], c["model"], c["hardware"]),
            row(side("A"), side("B")),
            row(self.button, self.status),
            W.HBox([self.images["A"], self.images["B"]]),
            self.bars, W.HBox([self.cdfs["ttft"], self.cdfs["tpot"]]), self.table, self.error_area.widget,
        ])

    def _ipython_display_(self):
        from IPython.display import display
        display(self._repr_mimebundle_(), raw=True)

    def _repr_mimebundle_(self, **kwargs):
        return static_bundle(self.widget, [self.images[s].value for s in SIDES], "comparison", **kwargs)

    @property
    def errors(self) -> list[str]:
        return self.error_area.errors

    # -- callbacks -------------------------------------------------------------------------
    @guarded("control")
    def _on_speed(self, change) -> None:
        for r in self.runs.values():
            r.speed = change["new"]

    @guarded("control")
    def _on_live(self, side, name, change) -> None:
        for s, r in self.runs.items():
            if (side is None or s == side) and r.state in ("running", "paused", "starting"):
                r.set(name, C.validate_live(name, change["new"]))

    def labels(self) -> dict[str, str]:
        """``{"A": "A: policy, knob=value", ...}``: each side's policy and the knobs that differ."""
        vals = {s: {k: w.value for k, w in self.sides[s].items()} for s in SIDES}
        out = {}
        for s in SIDES:
            diff = [f"{k}={v}" for k, v in vals[s].items() if k != "policy" and v != vals["B" if s == "A" else "A"][k]]
            out[s] = f"{s}: " + ", ".join([vals[s]["policy"], *diff])
        return out

    # -- runs ------------------------------------------------------------------------------
    @guarded("start")
    def start(self) -> None:
        if not self._done.is_set():
            raise RuntimeError("a comparison is in progress")
        if self._refresher is not None:
            self._refresher.stop()
        self.error_area.clear()
        self.results = {}
        self.bars.value = b""
        self.table.value = ""
        workload = C.make_workload(self.controls, self.custom_workload)
        horizon = max(s.arrival_time for s in workload) if len(workload) else 1.0
        speed = self.controls["speed"].value
        self.runs = {s: LiveRun(workload, C.engine_options({**self.controls, **self.sides[s]}, self.engine_kwargs),
                                speed=speed, on_finish=self._on_run_finished) for s in SIDES}
        for s in SIDES:
            self.plots[s].reset(horizon, self.window, len(workload), sum(r.max_tokens for r in workload))
        self._done.clear()
        self.button.disabled = True
        self._sequential = self.controls["executor"].value == "model"
        self._started = False        # the refresher draws the first frames, then starts the runs
        self._refresher = Refresher(self._tick, self.fps, self.error_area.show)

    def _on_run_finished(self, run: LiveRun) -> None:
        if self._sequential and run is self.runs["A"]:
            self.runs["B"].start()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until both runs end and the comparison is drawn; ``{label: RunResult}``."""
        if not self.runs:
            raise RuntimeError("no comparison: call start() first")
        if not self._done.wait(timeout):
            raise TimeoutError(f"the comparison did not finish within {timeout} s")
        for s in SIDES:
            if self.runs[s].error is not None:
                raise RuntimeError(f"run {s} failed: {self.runs[s].error!r}") from self.runs[s].error
        return self.results

    def _tick(self) -> bool:
        runs = self.runs
        if not self._started:
            for s in SIDES:
                self.images[s].value = self.plots[s].frame()
            self._started = True
            runs["A"].start()
            if not self._sequential:
                runs["B"].start()
            return True
        for s in SIDES:
            r = runs[s]
            if r.wall_start is None:
                continue
            if self.plots[s].update(r.data, final=r.finished):
                self.images[s].value = self.plots[s].frame()
        self.status.value = " &middot; ".join(f"{s}: <b>{runs[s].state}</b>, {len(runs[s].data.done_t)}/"
                                              f"{len(runs[s].workload)} finished" for s in SIDES)
        if all(r.finished for r in runs.values()):
            try:
                self._draw_comparison()
            finally:
                self.button.disabled = False
                self._done.set()
            return False
        return True

    def _draw_comparison(self) -> None:
        failed = [s for s in SIDES if self.runs[s].error is not None]
        for s in failed:
            self.error_area.show(f"run {s}", self.runs[s].error_text)
        if failed:
            return
        labels = self.labels()
        self.results = {labels[s]: self.runs[s].result for s in SIDES}
        self.bars.value = viz.figure_png(viz.compare_bars(self.results))
        for m, img in self.cdfs.items():
            img.value = viz.figure_png(viz.latency_cdf(self.results, m, figsize=(5, 3.2)))
        rows = viz.summary_table(self.results)
        head = "".join(f"<th style='padding:0 8px'>{h}</th>" for h in [*rows[0][:-1], "B vs A"])
        body = "".join("<tr>" + f"<td>{r[0]}</td>" + "".join(f"<td style='padding:0 8px'>{v:.4g}</td>" for v in r[1:-1])
                       + f"<td style='padding:0 8px'><b>{r[-1]:+.1f}%</b></td></tr>" for r in rows[1:])
        self.table.value = f"<table style='font-size:12px'><tr>{head}</tr>{body}</table>"
