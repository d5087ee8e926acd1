"""Live dashboards (ipywidgets) on top of :func:`minibatch.run` and the engine's event stream.

``Dashboard``: one run with its knobs and a live figure; ``Compare``: two configurations
on the same workload, side by side, and their difference. ``LiveRun`` / ``LivePlot`` are
the building blocks (a steerable run in a thread; an Agg figure rendered to JPEG frames).
"""

from minibatch.widgets.compare import Compare
from minibatch.widgets.dashboard import Dashboard
from minibatch.widgets.live import LiveData, LiveRun
from minibatch.widgets.plot import LivePlot

__all__ = ["Dashboard", "Compare", "LiveRun", "LivePlot", "LiveData"]
