"""The live figure of a run: rolling metrics drawn into JPEG frames with matplotlib's Agg.

A frame costs a few milliseconds: the layout is fixed, the data lines are drawn over
a saved background (blitting), a panel is redrawn alone when its y range grows, and the
whole figure only when the time axis grows. Frames are JPEG (quality 90): encoding one
takes a tenth of the time PNG does, which matters when plotting shares the CPU with a
real model.
"""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox, IdentityTransform

from minibatch.viz._common import COLORS, group_marks, interval_means, rolling_cum_rate, rolling_percentiles
from minibatch.widgets.live import LiveData

# -- panels -----------------------------------------------------------------------
# panel: (title, y label, [(series, label, colour, style)])
PANELS = {
    "throughput": ("Output throughput", "tokens/s", [("tput", "tok/s", COLORS["decode"], "-")]),
    "ttft": ("TTFT", "ms (log)", [("ttft50", "p50", COLORS["prefill"], "-"),
                                  ("ttft99", "p99", COLORS["prefill"], "--")]),
    "tpot": ("TPOT", "ms (log)", [("tpot50", "p50", COLORS["decode"], "-"),
                                  ("tpot99", "p99", COLORS["decode"], "--")]),
    "queue": ("Queue and batch", "requests", [("waiting", "queue length", "0.55", "-"),
                                              ("seqs", "batch size", "k", "-")]),
    "kv": ("KV cache usage", "%", [("kv", "KV usage", COLORS["shared"], "-")]),
    "requests": ("Requests", "count", [("arrived", "arrived", "0.55", "-"), ("done", "finished", "k", "-")]),
}
# Known y ranges: KV in %, latencies (ms, log scale) from 1 ms to 100 s; others grow by doubling.
FIXED_Y = {"kv": (0.0, 100.0), "ttft": (1.0, 1e5), "tpot": (1.0, 1e5)}
LOG_Y = ("ttft", "tpot")
DASHBOARD_PANELS = ("throughput", "ttft", "tpot", "queue", "kv", "requests")
COMPACT_PANELS = ("throughput", "ttft", "tpot", "kv")


def _nice_ceil(x: float) -> float:
    if not np.isfinite(x) or x <= 0:
        return 1.0
    e = 10 ** np.floor(np.log10(x))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * e >= x:
            return float(m * e)
    return float(10 * e)


class LivePlot:
    """Rolling metrics of a :class:`LiveData`, drawn incrementally; ``frame()`` gives an image.

    The layout is fixed (no layout engine), and only what changed is drawn: the data
    lines and change marks every frame over a saved background; a panel whose y range
    grew is redrawn alone into the background; everything only when the time axis grows.
    """

    def __init__(self, panels=DASHBOARD_PANELS, ncols: int = 3, figsize=(9.6, 5.0), dpi: int = 80,
                 title: str = ""):
        self.panels = list(panels)
        nrows = -(-len(self.panels) // ncols)
        w, h = figsize
        self.fig = Figure(figsize=figsize, dpi=dpi)
        # Fixed margins in inches, so that tick labels up to 5 digits fit and panels never move.
        self.fig.subplots_adjust(left=0.6 / w, right=1 - 0.12 / w, bottom=0.5 / h, top=1 - (0.55 if title else 0.3) / h,
                                 wspace=0.75 * ncols / (w - 0.72), hspace=0.55 * nrows / (h - 0.8))
        self.canvas = FigureCanvasAgg(self.fig)
        axes = self.fig.subplots(nrows, ncols, squeeze=False, sharex=True)
        self.axes = {}
        self.lines = {}
        for ax, key in zip(axes.flat, self.panels):
            name, unit, series = PANELS[key]
            ax.set_title(name, fontsize=9)
            ax.set_ylabel(unit, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(5))
            if key in LOG_Y:
                ax.set_yscale("log")
            else:
                ax.yaxis.set_major_locator(MaxNLocator(4))
            ax.grid(alpha=0.3)
            for sid, label, color, style in series:
                (self.lines[sid],) = ax.plot([], [], style, color=color, lw=1.3, label=label, animated=True)
            if len(series) > 1:
                ax.legend(fontsize=7, loc="upper left")
            self.axes[key] = ax
        for ax in list(axes.flat)[len(self.panels):]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("time (s, virtual)", fontsize=8)
        if title:
            self.fig.suptitle(title, fontsize=9)
        self._extent: dict = {}        # each panel's drawn extent (axes, ticks, labels, title)
        self._marks_drawn: list = []
        self._bg = None
        self._dirty: set[str] = set()
        self.full_draws = self.panel_draws = 0
        self.reset(1.0)

    def reset(self, horizon: float, window: float | None = None, total: int | None = None,
              total_tokens: int | None = None) -> None:
        """Forget all data; expect about ``horizon`` virtual seconds (the last arrival),
        ``total`` requests and ``total_tokens`` output tokens. Fixed ranges where they are
        known (KV 0-100 %, latencies on a log scale, requests 0-total) keep redraws rare."""
        horizon = max(float(horizon), 1e-3)
        self.fixed_window = window
        self._set_xmax(_nice_ceil(horizon * 2.0))
        self.ymax = {key: FIXED_Y.get(key, (0.0, 0.0))[1] for key in self.panels}
        self.total, self.total_tokens = total, total_tokens
        if total and "requests" in self.ymax:
            self.ymax["requests"] = float(total)
        if total and "queue" in self.ymax:          # small runs never outgrow this
            self.ymax["queue"] = _nice_ceil(min(total, 32))
        for ax in self.axes.values():
            ax.set_xlim(0, self.xmax)
        for key, ax in self.axes.items():
            lo = FIXED_Y.get(key, (0.0, 0.0))[0]
            ax.set_ylim(lo, max(self.ymax[key], lo + 1.0) * (1.05 if key in ("kv", "requests") else 1.0))
        for line in self.lines.values():
            line.set_data([], [])
        for a in self._marks_drawn:
            a.remove()
        self._marks_drawn = []
        self._nmarks = 0
        self._version = -1
        self._bg = None

    def _set_xmax(self, xmax: float) -> None:
        """A new time range: grid step and (unless fixed) rolling window scale with it, and
        the series are recomputed on the new grid."""
        self.xmax = xmax
        self.dt = xmax / 200.0
        self.window = self.fixed_window or xmax / 40.0
        self.grid: list[float] = []
        self.values: dict[str, list[float]] = {sid: [] for sid in self.lines}

    @property
    def num_marks(self) -> int:
        """Changes drawn so far."""
        return self._nmarks

    # -- data -> series ----------------------------------------------------------------------
    def _series_at(self, a: dict, t: np.ndarray) -> dict:
        w = self.window
        # Throughput over full windows only (a partial first window would spike).
        out = {"tput": np.where(t >= w, rolling_cum_rate(a["step_t"], a["cum_tokens"], t, w), np.nan)}
        for key, tt, v in (("ttft", a["ft_t"], a["ttft"]), ("tpot", a["fin_t"], a["tpot"])):
            p = rolling_percentiles(tt, v * 1e3, t, w)
            out[key + "50"], out[key + "99"] = p[:, 0], p[:, 1]
        dt = self.dt
        out["waiting"] = interval_means(a["step_t"], a["waiting"], t, dt)
        out["seqs"] = interval_means(a["step_t"], a["seqs"], t, dt)
        out["kv"] = interval_means(a["step_t"], a["kv"] * 100, t, dt)
        out["arrived"] = np.searchsorted(a["arr_t"], t, side="right").astype(float)
        out["done"] = np.searchsorted(np.sort(a["done_t"]), t, side="right").astype(float)
        return out

    def update(self, data: LiveData, final: bool = False) -> bool:
        """Bring the lines up to the data's present; False if nothing changed."""
        if data.version == self._version and not final:
            return False
        a = data.arrays()
        self._version = a["version"]
        now = float(a["step_t"][-1]) if a["step_t"].size else 0.0
        if final and a["done_t"].size:
            now = max(now, float(a["done_t"].max()))
        if now > self.xmax:
            # Past the expected end: extrapolate from the share of the work done so far.
            frac = max(a["done_t"].size / self.total if self.total else 0.0,
                       a["cum_tokens"][-1] / self.total_tokens if self.total_tokens and a["cum_tokens"].size else 0.0)
            est = now / frac if frac >= 0.02 else 0.0
            self._set_xmax(_nice_ceil(max(now * 2.0, min(est * 1.2, now * 10.0))))
            for ax in self.axes.values():
                ax.set_xlim(0, self.xmax)
            self._bg = None
        # Grid points behind "now" never change again: compute each once.
        k0 = len(self.grid)
        k1 = int(np.floor(now / self.dt)) + 1 if now > 0 else 0
        if k1 > k0:
            new = np.arange(k0, k1) * self.dt
            vals = self._series_at(a, new)
            self.grid.extend(new.tolist())
            for sid in self.values:
                self.values[sid].extend(vals[sid].tolist())
        head = self._series_at(a, np.asarray([now]))
        grid = np.asarray(self.grid + [now])
        for sid, line in self.lines.items():
            line.set_data(grid, np.asarray(self.values[sid] + [float(head[sid][0])]))
        for key, ax in self.axes.items():
            if key == "kv":
                continue
            top = max(np.nanmax(self.lines[sid].get_ydata(), initial=0.0) for sid, *_ in PANELS[key][2])
            if top > self.ymax[key]:
                log = key in LOG_Y
                self.ymax[key] = 10 ** np.ceil(np.log10(top) + 0.5) if log else _nice_ceil(top * 2.5)
                ax.set_ylim(ax.get_ylim()[0], self.ymax[key] * (1.05 if key == "requests" else 1.0))
                self._dirty.add(key)
        if len(a["marks"]) > self._nmarks:               # redraw all marks (changes at one time share a label)
            for art in self._marks_drawn:
                art.remove()
            self._marks_drawn = []
            for t, label in group_marks(a["marks"]):
                for i, ax in enumerate(self.axes.values()):
                    self._marks_drawn.append(ax.axvline(t, color=COLORS["mark"], ls="--", lw=1, animated=True))
                    if i == 0:
                        self._marks_drawn.append(ax.text(t, 0.98, f" {label}", rotation=90, va="top", ha="left",
                                                         fontsize=7, color=COLORS["mark"], animated=True,
                                                         transform=ax.get_xaxis_transform()))
        self._nmarks = len(a["marks"])
        return True

    def _redraw_panels(self) -> None:
        """Redraw only the panels whose y range changed, into the background.

        Each is erased over the union of its old and new extents (tick labels may widen).
        """
        renderer = self.canvas.get_renderer()
        self.canvas.restore_region(self._bg)
        for key in self._dirty:
            ax = self.axes[key]
            new = ax.get_tightbbox(renderer)
            box = Bbox.union([self._extent[key], new]).padded(2)
            erase = Rectangle((box.x0, box.y0), box.width, box.height, transform=IdentityTransform(),
                              facecolor=self.fig.get_facecolor(), edgecolor="none")
            erase.set_figure(self.fig)
            erase.draw(renderer)
            ax.draw(renderer)
            self._extent[key] = new
        self._bg = self.canvas.copy_from_bbox(self.fig.bbox)
        self.panel_draws += len(self._dirty)

    FORMAT = "jpeg"

    def frame(self) -> bytes:
        """The current frame as JPEG bytes (``ipywidgets.Image(format=LivePlot.FORMAT)``)."""
        from PIL import Image
        if self._bg is None:
            self.canvas.draw()
            self._bg = self.canvas.copy_from_bbox(self.fig.bbox)
            renderer = self.canvas.get_renderer()
            self._extent = {key: ax.get_tightbbox(renderer) for key, ax in self.axes.items()}
            self.full_draws += 1
        elif self._dirty:
            self._redraw_panels()
        else:
            self.canvas.restore_region(self._bg)
        self._dirty = set()
        for line in self.lines.values():
            line.axes.draw_artist(line)
        for a in self._marks_drawn:
            a.axes.draw_artist(a)
        w, h = self.canvas.get_width_height()
        img = Image.frombuffer("RGBA", (w, h), self.canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert("RGB")
        buf = io.BytesIO()
        img.save(buf, format="jpeg", quality=90)
        return buf.getvalue()
