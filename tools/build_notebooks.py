"""Build chapter notebooks from their percent-format sources and execute them.

A source ``chapters/src/NN_slug.py`` is a plain Python file cut into cells:

    # %% [markdown]
    # # 标题 ...            (markdown lines, each starting with "# ")
    # %%
    x = 1                   (a code cell)
    # %% tags=["nbval-ignore-output"]
    dashboard               (a code cell with tags)

``python tools/build_notebooks.py [NN ...]`` writes ``chapters/NN_slug.ipynb`` and runs
it top to bottom (nbclient), storing the outputs, so that the stored notebook is what a
learner sees and what the tests re-execute (nbval). The source stays reviewable as
plain text, and the notebook is always in sync with it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "chapters" / "src"
OUT = ROOT / "chapters"
CELL = re.compile(r"^# %%(?P<md> \[markdown\])?(?P<rest>.*)$")


def parse(source: str) -> list[nbformat.NotebookNode]:
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in text.split("\n"))
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell(text)
        if tags:
            cell.metadata["tags"] = tags
        cells.append(cell)

    for line in source.split("\n"):
        m = CELL.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            rest = m.group("rest").strip()
            tags = ast.literal_eval(rest.split("=", 1)[1]) if rest.startswith("tags=") else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build(src: Path, execute: bool = True, timeout: int = 600) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = parse(src.read_text(encoding="utf-8"))
    out = OUT / (src.stem + ".ipynb")
    if execute:
        t = time.perf_counter()
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(OUT)}}).execute()
        print(f"{out.name}: executed in {time.perf_counter() - t:.1f} s")
    nbformat.write(nb, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapters", nargs="*", help="chapter numbers (default: all)")
    ap.add_argument("--no-execute", action="store_true")
    args = ap.parse_args(argv)
    sources = sorted(SRC.glob("*.py"))
    if args.chapters:
        sources = [s for s in sources if s.name.split("_")[0] in {c.zfill(2) for c in args.chapters}]
    for src in sources:
        build(src, execute=not args.no_execute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
