"""Chapter notebooks: in sync with their sources, stored with outputs, well-formed.

The notebooks themselves are executed top to bottom by nbval (``pytest --nbval-lax
chapters/``, part of the test command); these checks guard what nbval does not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minibatch.labs.builder import read_notebook, template_of

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
SOURCES = sorted((CHAPTERS / "src").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_matches_its_source_and_has_outputs(src):
    nb_path = CHAPTERS / (src.stem + ".ipynb")
    assert nb_path.exists(), f"{nb_path.name} not built: run tools/build_notebooks.py {src.stem[:2]}"
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    built = read_notebook(src).cells
    stored = [(c["cell_type"], "".join(template_of({**c, "source": "".join(c["source"])})),
               c.get("metadata", {}).get("tags", [])) for c in nb["cells"]]
    assert stored == [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in built], \
        f"{nb_path.name} is out of date with {src.name}: run python tools/build_notebooks.py {src.stem[:2]}"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code), "stored without (complete) execution"
    assert any(o.get("data", {}).get("image/png") for c in code for o in c.get("outputs", [])), "no figure"
    assert not any("image/svg+xml" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_chapter_structure_and_language(src):
    text = src.read_text(encoding="utf-8")
    md = "\n".join(l for l in text.split("\n") if l.startswith("# "))
    for heading in ("学习目标", "小结", "练习"):
        assert heading in md, f"{src.name} lacks a {heading} section"
    assert len(re.findall(r"[\u4e00-\u9fff]", md)) > 500, "chapter prose should be in Simplified Chinese"
    assert "sys.path" not in text, "notebooks import the package, no sys.path tricks"
    assert "import minibatch" in text or "from minibatch" in text


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_prose_lives_in_markdown_and_exercises_have_hints(src):
    """Conventions learned from reviewing stage 1 (shared COURSE.md): prose is a Markdown cell whose
    numbers come in as {{expr:spec}} fields, never a paragraph built in code; exercises end with
    collapsed hints or worked solutions."""
    text = src.read_text(encoding="utf-8")
    assert "display(Markdown(" not in text, \
        f"{src.name}: write prose as a Markdown cell with {{{{expr:spec}}}} fields, not display(Markdown(...))"
    exercises = text[text.rindex("# ## 练习"):]
    assert "<details>" in exercises and "</details>" in exercises, \
        f"{src.name}: the exercises need hints or worked solutions in a <details> block"


# What a learner reads of a code cell: at most this many assert lines and this many lines in all.
# Longer guards go into a cell tagged "check" (collapsed in JupyterLab, folded in the book).
VISIBLE_ASSERTS, VISIBLE_LINES = 2, 45


def visible_cell_problems(cells) -> list[str]:
    """Code cells a learner sees (not tagged "check") that hold too many asserts or lines."""
    problems = []
    for i, c in enumerate(cells):
        if c.cell_type != "code" or "check" in c.metadata.get("tags", []):
            continue
        lines = c.source.split("\n")
        asserts = sum(1 for ln in lines if ln.lstrip().startswith("assert"))
        if asserts > VISIBLE_ASSERTS or len(lines) > VISIBLE_LINES:
            problems.append(f"cell {i}: {asserts} asserts, {len(lines)} lines ({lines[0][:60]!r})")
    return problems


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_guards_live_in_check_cells_and_cells_stay_short(src):
    problems = visible_cell_problems(read_notebook(src).cells)
    assert not problems, (f"{src.name}: move the guards into a cell tagged \"check\" "
                          f"(# %% tags=[\"check\"]) and split long cells: " + "; ".join(problems))


def test_check_cells_are_collapsed_and_folded():
    from nbformat.v4 import new_code_cell

    from minibatch.labs.builder import hide_check_cell

    cell = new_code_cell("assert 1 == 1")
    cell.metadata["tags"] = ["check"]
    hide_check_cell(cell)
    assert cell.metadata["jupyter"]["source_hidden"] is True
    assert cell.metadata["tags"] == ["check", "hide-input"]
    assert visible_cell_problems([cell]) == []
    shown = new_code_cell("\n".join(["assert True"] * 3))
    assert visible_cell_problems([shown]) and "3 asserts" in visible_cell_problems([shown])[0]
