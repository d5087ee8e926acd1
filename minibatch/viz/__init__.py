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
``md_table(header, rows)`` a Markdown table of numbers computed in the cell
``diagrams.*``             drawn diagrams: request pipeline, block tables, a scheduler step
``radix_tree(tree)``       a radix tree (the prefix cache's, or any node with ``children``)
``cluster.*``              a cluster run: load per replica, routing, replicas vs rate, goodput
``metrics_dashboard(s)``   Grafana-style panels of scraped ``/metrics`` series (vLLM's names)
=========================  ==========================================================

No function calls ``pyplot``: figures are ``matplotlib.figure.Figure`` objects, which
Jupyter displays inline and which render in any thread (``fig.savefig``).
``EventLog(engine)`` records preemptions so ``gantt`` can draw them exactly.
"""

from minibatch.viz import cluster, diagrams
from minibatch.viz.compare import compare_bars, latency_throughput, metric_title, summary_table
from minibatch.viz.events import EventLog
from minibatch.viz.kv import kv_block_map, kv_snapshot
from minibatch.viz.metrics import metrics_dashboard
from minibatch.viz.radix import radix_tree
from minibatch.viz.requests import gantt, latency_cdf, preemption_spans
from minibatch.viz.steps import batch_composition, timeline
from minibatch.viz.tables import markdown_table, md_table

__all__ = ["gantt", "batch_composition", "kv_block_map", "kv_snapshot", "latency_cdf", "timeline",
           "latency_throughput", "compare_bars", "summary_table", "metric_title", "preemption_spans",
           "EventLog", "figure_png", "md_table", "markdown_table", "diagrams", "radix_tree", "cluster",
           "metrics_dashboard"]


def figure_png(fig, dpi: int = 80) -> bytes:
    """PNG bytes of a figure (for ``ipywidgets.Image`` or files)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _show_figures_inline() -> None:
    """In IPython, display a bare ``Figure`` as a PNG even when no pyplot backend is active.

    Our figures never touch pyplot, so without this a notebook shows ``<Figure ...>`` text
    until someone runs ``%matplotlib inline``. An existing formatter (the inline backend's)
    is left alone.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    from matplotlib.figure import Figure

    png = ip.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(Figure)
    except KeyError:
        png.for_type(Figure, lambda fig: _png_tight(fig))


def _png_tight(fig) -> bytes:
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


_show_figures_inline()
