"""Figure labels do not print over each other (chapter 05's scheduler-step diagram)."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")


def _overlapping_labels(fig) -> list[tuple[str, str]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [t for ax in fig.axes for t in ax.texts if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def test_scheduler_step_labels_do_not_overlap():
    from minibatch.viz import diagrams

    # Chapter 05's example: three decodes of one token each, a prompt chunked, one left waiting.
    fig = diagrams.scheduler_step([("run0", 1), ("run1", 1), ("run2", 1)], [("wait0", 700), ("wait1", 120)],
                                  budget=512, max_num_seqs=8)
    assert _overlapping_labels(fig) == []
    shown = " ".join(t.get_text() for t in fig.axes[0].texts)
    for rid in ("run0", "run1", "run2", "wait0", "wait1"):
        assert rid in shown, f"{rid} lost its label"


def test_scheduler_step_labels_do_not_overlap_with_many_decodes():
    from minibatch.viz import diagrams

    fig = diagrams.scheduler_step([(f"r{i}", 1) for i in range(12)], [("w0", 300)], budget=256, max_num_seqs=16)
    assert _overlapping_labels(fig) == []
