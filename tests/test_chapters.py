"""Chapter notebooks: in sync with their sources, stored with outputs, well-formed.

The notebooks themselves are executed top to bottom by nbval (``pytest --nbval-lax
chapters/``, part of the test command); these checks guard what nbval does not.
"""

from __future__ import annotations

import ast
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


def _bound_names(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def field_problems(cells) -> list[str]:
    """``{{expr:spec}}`` fields of Markdown cells that cannot evaluate: not a valid f-string field
    (e.g. mixed quotes, which the builder's ``f + repr(...)`` cannot carry on Python 3.11), or a
    name no earlier code cell binds. A build finds these only when it reaches the cell."""
    import builtins

    from minibatch.labs.builder import FIELD_RE

    bound, problems = set(dir(builtins)), []
    for i, c in enumerate(cells):
        if c.cell_type == "code":
            try:
                bound |= _bound_names(ast.parse(c.source))
            except SyntaxError:
                pass
            continue
        for field in FIELD_RE.findall(c.source):
            text = field.strip()
            try:
                compile("f" + repr("{" + text + "}"), "<field>", "eval")
            except SyntaxError as e:
                problems.append(f"cell {i}: {{{{{text}}}}} is not a valid field ({e.msg})")
                continue
            tree = None
            for j in range(len(text), 0, -1):        # the expression: the longest prefix that parses
                try:
                    tree = ast.parse(text[:j], mode="eval")
                    break
                except SyntaxError:
                    continue
            if tree is None:
                problems.append(f"cell {i}: {{{{{text}}}}} does not parse")
                continue
            local = _bound_names(tree) | {a.arg for n in ast.walk(tree) if isinstance(n, ast.Lambda)
                                          for a in n.args.args}
            unbound = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                              and n.id not in bound and n.id not in local})
            if unbound:
                problems.append(f"cell {i}: {{{{{text}}}}} uses {unbound}, bound by no earlier code cell")
    return problems


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_prose_fields_compile_and_use_names_bound_above(src):
    problems = field_problems(read_notebook(src).cells)
    assert not problems, f"{src.name}: " + "; ".join(problems)


def test_field_problems_catches_unbound_names_and_bad_fields():
    from nbformat.v4 import new_code_cell, new_markdown_cell

    cells = [new_code_cell("x = 1\nimport numpy as np\ndef f(a):\n    return a"),
             new_markdown_cell("ok {{x:.1f}} {{np.mean([x, 2]):.2f}} {{f(x)}} {{[k for k in range(x)]}} {{y}}"),
             new_markdown_cell("""bad {{f'{x}' + "a"}}""")]
    problems = field_problems(cells)
    assert len(problems) == 2, problems
    assert "['y']" in problems[0] and "cell 2" in problems[1]
