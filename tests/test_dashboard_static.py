"""Dashboards stored in notebooks show a picture, not ``VBox(children=...)`` text, where no
kernel runs them (the book, a JupyterLab that has not run the cell); chapter 01's dashboard
runs long enough that a learner can change a knob mid-run."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("ipywidgets")

ROOT = Path(__file__).resolve().parents[1]
WIDGET = "application/vnd.jupyter.widget-view+json"
PNG = b"\x89PNG\r\n\x1a\n"
SIM = dict(executor="sim", model="llama-2-7b", hardware="a100-80g")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


@pytest.mark.parametrize("kind", ["dashboard", "compare"])
def test_display_bundle_has_a_picture_and_a_hint(kind):
    from minibatch.widgets import Compare, Dashboard

    w = Dashboard("chat", **SIM) if kind == "dashboard" else Compare(workload="chat", **SIM)
    bundle = w._repr_mimebundle_()
    assert WIDGET in bundle                                            # a live kernel renders the widget
    assert base64.b64decode(bundle["image/png"]).startswith(PNG)       # elsewhere: its picture
    assert not bundle["text/plain"].startswith("VBox(") and "run this cell" in bundle["text/plain"].lower()


def test_stored_chapters_show_no_bare_widget_text():
    bare = []
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                text = _text(data.get("text/plain", ""))
                if text.startswith(("VBox(", "interactive(")) and "image/png" not in data:
                    bare.append(f"{path.name} cell {i}")
    assert not bare, (f"widget outputs stored as VBox(...) / interactive(...) text with no picture: {bare} "
                      "(python tools/build_notebooks.py --stills)")


def _interact_notebook(area_outputs: list, text: str) -> tuple[dict, dict]:
    """A stored notebook with one ``interact`` widget view (a VBox of a slider and an Output area
    that produced ``area_outputs``), and that view's output: what nbclient saves."""
    state = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_slider", "IPY_MODEL_out"]}},
             "slider": {"model_name": "IntSliderModel", "state": {}},
             "out": {"model_name": "OutputModel", "state": {"outputs": area_outputs}}}
    view = {"output_type": "display_data", "metadata": {},
            "data": {WIDGET: {"model_id": "box", "version_major": 2, "version_minor": 0}, "text/plain": text}}
    nb = {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": state}}},
          "cells": [{"cell_type": "code", "outputs": [view]}]}
    return nb, view


def test_interact_widgets_get_the_figure_their_output_area_drew():
    """builder.add_widget_stills: an ``interactive`` VBox whose child Output area drew a PNG."""
    from minibatch.labs.builder import WIDGET_HINT, add_widget_stills

    png = base64.b64encode(PNG + b"rest").decode()
    nb, view = _interact_notebook([{"output_type": "stream", "name": "stdout", "text": "x"},
                                   {"output_type": "display_data", "data": {"image/png": png, "text/plain": "<Figure>"}}],
                                  "interactive(children=(IntSlider(value=1),))")
    assert add_widget_stills(nb) == 1
    assert view["data"]["image/png"] == png and view["data"]["text/plain"] == WIDGET_HINT
    assert WIDGET in view["data"]                       # a live kernel still renders the widget
    assert add_widget_stills(nb) == 0                   # already has its picture
    no_state = {"metadata": {}, "cells": [{"cell_type": "code", "outputs": [
        {"output_type": "display_data", "data": {WIDGET: {"model_id": "gone"}, "text/plain": "interactive()"}}]}]}
    assert add_widget_stills(no_state) == 0


def _chapter01_dashboard_call() -> str:
    """The ``dash = Dashboard(...)`` statement of chapter 01's source, as written."""
    src = (ROOT / "chapters" / "src" / "01_intro.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "Dashboard"):
            return ast.get_source_segment(src, node)
    raise AssertionError("chapter 01 builds no Dashboard")


def test_chapter01_dashboard_start_lasts_long_enough_to_switch_mid_run():
    from minibatch.widgets import Dashboard
    from minibatch.widgets.controls import make_workload

    ns = {"Dashboard": Dashboard}
    exec(_chapter01_dashboard_call(), ns)
    dash = ns["dash"]
    workload = make_workload(dash.controls)                 # what Start replays
    span = max(r.arrival_time for r in workload)            # virtual seconds of arrivals
    speed = dash.controls["speed"].value                    # virtual s per wall s; 0: as fast as possible
    paced_s = span / speed if speed else 0.0
    assert paced_s >= 5, (f"Start replays {len(workload)} requests over {span:.1f} virtual s at speed {speed}: "
                          f"{paced_s:.1f} s, too short to switch a policy mid-run")


def test_preview_keeps_the_controls():
    from minibatch.widgets import Dashboard

    dash = Dashboard("chat", speed=5, **SIM)
    result = dash.preview(num_requests=12, timeout=120)
    assert result.summary()["num_requests"] == 12 and not dash.errors
    assert dash.controls["num_requests"].value == 300 and dash.controls["speed"].value == 5
    assert dash.live.finished and not dash.buttons["start"].disabled


def test_an_explorer_that_prints_keeps_what_it_printed_first():
    """builder.add_widget_stills: an ``interact`` whose Output area printed text and drew nothing
    stores that text (and a hint) instead of ``VBox(children=...)``; running it again changes nothing."""
    from minibatch.labs.builder import WIDGET_TEXT_HINT, add_widget_stills

    nb, view = _interact_notebook([{"output_type": "stream", "name": "stdout", "text": "KV capacity: 61,284 tokens\n"}],
                                  "VBox(children=(IntSlider(value=1),))")
    assert add_widget_stills(nb) == 1
    assert view["data"]["text/plain"] == "KV capacity: 61,284 tokens\n" + WIDGET_TEXT_HINT
    assert "image/png" not in view["data"] and add_widget_stills(nb) == 0
