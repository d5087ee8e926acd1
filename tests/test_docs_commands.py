"""The learner's pages give commands that work as written: the project's interpreter
(``.venv/bin/python``), never a bare ``python`` or ``pip`` that may be the system's; the README
puts the learner's path first and keeps the engine's internals in docs/engine.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "COURSE.md", "labs/README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                          for p in (ROOT / "docs").glob("*.md"))]
BARE = re.compile(r"(?<![\w./-])python3?(?= (?:-m|-c|\S+\.py))|(?<![\w./-])(?<!-m )pip3? install")


@pytest.mark.parametrize("page", PAGES)
def test_commands_use_the_projects_interpreter(page):
    bad = [f"{page}:{i}: {line.strip()[:120]}" for i, line in
           enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1) if BARE.search(line)]
    assert not bad, "write .venv/bin/python (a bare python may lack torch):\n" + "\n".join(bad)


def test_readme_puts_the_learner_first():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[0] == "## 中文快速上手", heads                       # the Chinese quick start comes first
    assert lines.index("## 中文快速上手") < 25
    assert heads.index("## Working through the course") < heads.index("## The course") < heads.index("## The engine")
    assert "make test" in text and "make course" in text and "make book" in text
    assert "](docs/engine.md)" in text and len(lines) < 220, "engine internals belong in docs/engine.md"
    engine = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    for topic in ("## At a glance", "## On a GPU, and with a real checkpoint", "## Benchmarks"):
        assert topic in engine, topic
    for link in re.findall(r"\]\(([^)\s#]+)\)", text):
        assert link.startswith("http") or (ROOT / link).exists(), link
