"""docs/glossary.md is the course's one glossary: every term is defined once."""

from __future__ import annotations

import collections
from pathlib import Path

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "glossary.md"


def rows():
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cols) >= 3 and not set(cols[0]) <= set("-: ") and cols[0] != "中文":
            yield cols


def test_every_term_is_defined_once():
    table = list(rows())
    assert len(table) > 100
    for col, name in ((0, "Chinese"), (1, "English")):
        seen = collections.Counter(r[col] for r in table)
        twice = sorted(t for t, n in seen.items() if n > 1)
        assert not twice, f"{name} terms defined more than once in docs/glossary.md: {twice}"


def test_every_row_has_a_definition():
    assert all(r[2] for r in rows()), "a glossary row without a definition"
