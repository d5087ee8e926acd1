"""Figures of a run (matplotlib): each function takes run results and returns a ``Figure``.

=========================  ==========================================================
``gantt(result)``          queued / prefill / decode / preempted spans per request
``batch_composition(r)``   prefill vs decode tokens per step, batch size on a twin axis
``kv_block_map(engine)``   KV blocks coloured by owner; free, cached, wasted slots
``kv_snapshot(engine)``    the block map as plain data, to draw after the run
``latency_cdf(results)``   CDF of TTFT / TPOT / E2E / ITL per run
``timeline(result)``       rolling throughput, TTFT/TPOT, queue and KV over time
``latency_throughput(d)``  latency vs throughput across request rates, per policy
``compare_bars(results)``  summary metrics side by side
=========================  ==========================================================

No function calls ``pyplot``: figures are ``matplotlib.figure.Figure`` objects, which
Jupyter displays inline and which render in any thread (``fig.savefig``).
``EventLog(engine)`` records preemptions so ``gantt`` can draw them exactly.
"""

from minibatch.viz.compare import compare_bars, latency_throughput, metric_title, summary_table
from minibatch.viz.events import EventLog
from minibatch.viz.kv import kv_block_map, kv_snapshot
from minibatch.viz.requests import gantt, latency_cdf, preemption_spans
from minibatch.viz.steps import batch_composition, timeline

__all__ = ["gantt", "batch_composition", "kv_block_map", "kv_snapshot", "latency_cdf", "timeline",
           "latency_throughput", "compare_bars", "summary_table", "metric_title", "preemption_spans",
           "EventLog", "figure_png"]


def figure_png(fig, dpi: int = 80) -> bytes:
    """PNG bytes of a figure (for ``ipywidgets.Image`` or files)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
