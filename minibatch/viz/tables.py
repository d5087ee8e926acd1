"""Markdown tables for notebooks: numbers computed in a cell, shown as a table."""

from __future__ import annotations

from typing import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Rows (already formatted values) as a Markdown table, columns right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Display the table in Jupyter (rendered Markdown); print it anywhere else."""
    text = markdown_table(header, rows)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))
