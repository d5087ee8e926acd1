"""Figures of minibatch.viz on small real (tiny model) and simulated runs."""

from __future__ import annotations

import json
import threading

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.image import AxesImage

from minibatch import viz
from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.runner import RunController, run
from minibatch.workload import load_workload, synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")


@pytest.fixture(scope="module")
def tiny():
    """A real tiny-model run of 10 requests in a KV pool small enough to force preemptions,
    with its preemption events and a KV snapshot taken mid-run. All arrive at once: with
    arrivals spread in time, whether requests overlap (and so preempt) would depend on how
    long each measured step takes, and a quiet machine once finished them without one."""
    wl = synthetic(10, rate=float("inf"), input_len=64, output_len=16, seed=0, name="t")
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=18, max_num_seqs=8), clock="virtual")
    log = viz.EventLog(engine)
    snaps = []

    def on_step(eng, rec):
        if not snaps and rec.kv_usage > 0.7:
            snaps.append(viz.kv_snapshot(eng))
    # In a worker thread, as the dashboard runs it: on an oversubscribed CPU, torch's OpenMP
    # spin-waiting makes the main thread several times slower (OMP_WAIT_POLICY=PASSIVE fixes it).
    out = []
    th = threading.Thread(target=lambda: out.append(run(wl, engine=engine, on_step=on_step)))
    th.start()
    th.join()
    result = out[0]
    result.extra["events"] = log.events
    return result, snaps[0], engine


@pytest.fixture(scope="module")
def sim():
    """A simulated run of 200 chat requests with a change of max_num_seqs halfway."""
    ctl = RunController()

    def on_step(eng, rec):
        if rec.step == 300:
            ctl.set("max_num_seqs", 32)
    wl = load_workload("chat", n=200, rate=8, max_len=4096)
    return run(wl, controller=ctl, on_step=on_step, **SIM)


def _collections(ax, cls):
    return [c for c in ax.collections if isinstance(c, cls)]


def test_gantt_phases_and_exact_preemptions(tiny):
    result, _, _ = tiny
    assert sum(r.num_preemptions for r in result.requests) > 0, "the test run should preempt"
    fig = viz.gantt(result)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    colls = {c.get_label(): c for c in _collections(ax, PolyCollection)}
    assert set(colls) == {"queued", "prefill", "decode", "preempted"}
    assert len(colls["queued"].get_paths()) == 10
    assert len(colls["decode"].get_paths()) == 10
    assert len(colls["preempted"].get_paths()) == len(result.extra["events"]) > 0
    assert "Request timeline" in ax.get_title() and ax.get_xlabel() == "time (s)"
    assert "preempted" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(ax.get_yticklabels()) == 10


def test_gantt_limits_rows_and_infers_preemptions(sim):
    fig = viz.gantt(sim, max_requests=25)
    ax = fig.axes[0]
    colls = {c.get_label(): c for c in _collections(ax, PolyCollection)}
    assert len(colls["decode"].get_paths()) == 25
    assert "first 25 of 200" in ax.get_title()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "preempted (inferred)" in labels or "preempted" in labels
    spans, exact = viz.preemption_spans(sim.requests[0])
    assert not exact


def test_batch_composition_bars_per_step(tiny, sim):
    result, _, _ = tiny
    fig = viz.batch_composition(result)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == ["decode tokens", "prefill tokens"]
    assert all(len(b) == len(result.steps) for b in bars)
    heights = np.array([p.get_height() for p in bars[0]]) + np.array([p.get_height() for p in bars[1]])
    expected = [s.num_prefill_tokens + s.num_decode_tokens for s in result.steps]
    assert heights.tolist() == expected
    twin = fig.axes[1]
    assert twin.get_ylabel() == "sequences in batch" and len(twin.get_lines()) == 1
    # A long run is binned to at most max_bars bars.
    fig = viz.batch_composition(sim, max_bars=100)
    bars = [c for c in fig.axes[0].containers if isinstance(c, BarContainer)]
    assert len(sim.steps) > 100 and all(0 < len(b) <= 100 for b in bars)
    assert "mean per bin" in fig.axes[0].get_ylabel()


def test_kv_snapshot_and_block_map(tiny):
    result, snap, engine = tiny
    json.dumps(snap)                                   # plain data
    assert snap["num_blocks"] == 18 and len(snap["owner"]) == 18
    owned = {b for blocks in snap["requests"].values() for b in blocks}
    assert {i for i, o in enumerate(snap["owner"]) if o is not None} == owned
    assert all(0 < snap["filled"][b] <= snap["block_size"] for b in owned)
    fig = viz.kv_block_map(snap, columns=5)
    ax = fig.axes[0]
    (img,) = [a for a in ax.get_images() if isinstance(a, AxesImage)]
    assert img.get_array().shape == (4, 5 * snap["block_size"])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:4] == ["free", "cached (free, hashed)", "wasted slots", "shared"]
    assert f"{len(owned)}/18 used" in ax.get_title()
    # After the run every block is free: the live engine draws an all-free map.
    fig = viz.kv_block_map(engine)
    assert "0/18 used" in fig.axes[0].get_title()


@pytest.mark.parametrize("metric", ["ttft", "tpot", "e2e"])
def test_latency_cdf_one_line_per_run(tiny, sim, metric):
    fig = viz.latency_cdf({"tiny": tiny[0], "sim": sim}, metric)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(("tiny", "sim"))]
    assert len(lines) == 2
    assert all(ln.get_ydata()[-1] == pytest.approx(1.0) for ln in lines)
    assert ax.get_xlabel().endswith("(ms)") and "CDF" in ax.get_title()
    with pytest.raises(ValueError):
        viz.latency_cdf(sim, "nope")


def test_timeline_panels_and_reconfiguration_marks(sim):
    (t_change, name, value), = sim.reconfigurations
    fig = viz.timeline(sim)
    main = [ax for ax in fig.axes if ax.get_ylabel() in ("tokens/s", "TTFT (ms)", "requests")]
    assert len(main) == 3
    for ax in main:
        assert any(len(ln.get_xdata()) == 2 and np.allclose(ln.get_xdata(), t_change) for ln in ax.get_lines())
    assert any(t.get_text().strip() == "max_num_seqs=32" for t in main[0].texts)
    tp = main[0].get_lines()[0].get_ydata()
    assert np.nanmax(tp) > 0


def test_latency_throughput_curves():
    runs = {}
    for seqs in (256, 8):
        runs[f"seqs={seqs}"] = {rate: run(load_workload("chat", n=40, rate=rate, max_len=4096), max_num_seqs=seqs,
                                          **SIM) for rate in (2.0, 8.0, 32.0)}
    fig = viz.latency_throughput(runs, metrics=("ttft", "tpot"), stat="p50")
    assert len(fig.axes) == 2
    for ax in fig.axes:
        lines = [ln for ln in ax.get_lines() if ln.get_label().startswith("seqs=")]
        assert len(lines) == 2 and all(len(ln.get_xdata()) == 3 for ln in lines)
        assert ax.get_xlabel() == "output throughput (tok/s)"
    fig = viz.latency_throughput([r for d in runs.values() for r in d.values()], metrics="e2e", x="rate",
                                 slo={"e2e": 5.0})
    ax = fig.axes[0]
    assert ax.get_xlabel() == "request rate (req/s)"
    assert len([ln for ln in ax.get_lines() if ln.get_marker() == "o"]) == 1   # grouped by policy name


def test_compare_bars(tiny, sim):
    fig = viz.compare_bars({"tiny": tiny[0], "sim": sim}, metrics=["throughput_tok_s", "ttft_p99", "num_preemptions"])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 3
    assert [ax.get_title() for ax in visible] == ["Output throughput (tok/s)", "TTFT p99 (ms)",
                                                  "Preemptions (count)"]
    for ax in visible:
        (bars,) = ax.containers
        assert len(bars) == 2
    assert visible[1].containers[0][1].get_height() == pytest.approx(sim.summary()["ttft_p99"] * 1e3)
    rows = viz.summary_table({"a": tiny[0], "b": sim}, metrics=["ttft_p50"])
    assert rows[0] == ["metric", "a", "b", "change"] and len(rows) == 2


def test_figures_render_without_pyplot(tiny):
    fig = viz.gantt(tiny[0])
    png = viz.figure_png(fig)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # A bare Figure: pyplot never manages it, so no backend (GUI or not) is involved and no
    # figure accumulates in pyplot's registry.
    assert fig.canvas.manager is None


def test_figures_display_as_png_in_ipython_without_a_pyplot_backend():
    """A bare Figure gets a PNG formatter when minibatch.viz is imported under IPython."""
    from IPython.core.interactiveshell import InteractiveShell
    from matplotlib.figure import Figure

    import minibatch.viz as viz

    shell = InteractiveShell.instance()
    try:
        png = shell.display_formatter.formatters["image/png"]
        png.type_printers.pop(Figure, None)
        viz._show_figures_inline()
        fig = Figure(figsize=(2, 2))
        fig.subplots().plot([0, 1], [1, 0])
        data, _ = shell.display_formatter.format(fig)
        assert data["image/png"][:4] == b"\x89PNG"
    finally:
        InteractiveShell.clear_instance()


def test_md_table_renders_markdown_and_prints_outside_jupyter(capsys):
    from minibatch.viz import markdown_table, md_table

    text = markdown_table(["policy", "tok/s"], [("fcfs", "1,256"), ("sjf", 1271)])
    assert text.splitlines() == ["| policy | tok/s |", "|---:|---:|", "| fcfs | 1,256 |", "| sjf | 1271 |"]
    assert md_table(["a"], [(1,)]) is None
    assert capsys.readouterr().out.strip() == "| a |\n|---:|\n| 1 |"


def test_diagrams_draw():
    from matplotlib.figure import Figure

    from minibatch.viz import diagrams

    assert isinstance(diagrams.request_pipeline(), Figure)
    fig = diagrams.block_tables({"A": [3, 0, 5], "B": [1, 4]}, {"A": 19, "B": 9}, 8, 16)
    assert isinstance(fig, Figure) and len(fig.axes[0].patches) > 16
    fig = diagrams.scheduler_step([("r0", 1), ("r1", 1)], [("w0", 300), ("w1", 40)], 256, 8)
    assert isinstance(fig, Figure)


def test_radix_tree_draws_one_box_per_node_with_block_labels():
    from minibatch.radix import RadixTree
    tree = RadixTree(block_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    tree.insert([1, 2, 3, 4, 9, 9], [10, 11, 13])     # splits the edge after block 11
    tree.insert([7, 7], [14])
    fig = viz.radix_tree(tree, title="t")
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == sorted(["root", "[10,11]", "[12]", "[13]", "[14]"])
    hot = viz.radix_tree(tree, highlight=lambda n: 11 in n.blocks)
    faces = {t.get_text(): t.get_bbox_patch().get_facecolor() for t in hot.axes[0].texts}
    assert faces["[10,11]"] != faces["[12]"]


def test_radix_tree_takes_any_node_with_children_and_a_label():
    class Node:
        def __init__(self, key, *kids):
            self.key, self.children = key, {k.key[0]: k for k in kids}
    root = Node((), Node((1, 2), Node((3,)), Node((4, 5, 6))))
    fig = viz.radix_tree(root, label=lambda n: "".join(map(str, n.key)))
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["12", "3", "456", "root"]
