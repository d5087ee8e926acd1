"""Build the course as a static HTML book: what ``make book`` runs.

    python tools/build_book.py [--out _build/book] [--strict]

Stages the sources into ``_build/book-src/`` and runs Sphinx with MyST-NB on them
(configuration: ``book/conf.py``):

* ``index.md``: the landing page (the same text as ``COURSE.md``, from
  :mod:`minibatch.labs.course`) plus the hidden toctrees that make the sidebar: the three
  stages, the labs, and the reference pages. Chapters not written yet are listed on a
  "coming" page of their stage, so the sidebar always shows all three stages.
* ``chapters/*.ipynb`` and ``labs/*.ipynb`` as stored, with their outputs (nothing is
  executed); an interactive widget, which a static page cannot run, becomes a note that
  says to open the chapter in JupyterLab, after the still picture of it that a dashboard stores.
* ``labs/README.md`` (how labs are graded) and ``datasets/README.md`` (where the workloads
  and traces come from).

Prints the ``file://`` address of ``index.html`` when it is done; the site needs no network.
``--strict`` turns Sphinx warnings (a broken internal link, a missing image) into errors.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from minibatch.labs.course import COMING, LABS, STAGES, chapter_files, lab_files, landing_page, stage_table
from minibatch.labs.source import join_cjk_lines

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "book"
STAGE_DIR = ROOT / "_build" / "book-src"
REFERENCE = (("labs/README.md", "实验指南：怎么做、怎么评分"), ("datasets/README.md", "数据说明：负载与 Trace"),
             ("datasets/traces/SOURCES.md", "Trace 的来源、许可与统计"), ("docs/glossary.md", "术语表"))
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("*交互部件（Widget）：静态网页不能运行它。在 JupyterLab 中打开本章（`make course`），"
               "运行到这里即可拖动滑块、切换参数。*")


def _toctree(caption: str, entries: list[str]) -> str:
    return "\n".join(["```{toctree}", ":hidden:", f":caption: {caption}", "", *entries, "```"])


def index_page(chapters: dict[int, str], labs: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The book's root page and the "coming" pages it links (``{path: text}``)."""
    trees, pages = [], {}
    for i, stage in enumerate(STAGES, 1):
        entries = [chapters[n][:-len(".ipynb")] for n, _ in stage.chapters if n in chapters]
        coming = [n for n, _ in stage.chapters if n not in chapters]
        if coming:
            doc = f"coming/stage{i}"
            title = f"第 {coming[0]}–{coming[-1]} 章 · {COMING}" if len(coming) > 1 else f"第 {coming[0]} 章 · {COMING}"
            pages[f"{doc}.md"] = (f"# {title}\n\n{stage.title}：{stage.question}。这些章节还在写作中，"
                                  f"以下是它们在课程大纲中的位置。\n\n{stage_table(stage, {}, {})}\n")
            entries.append(doc)
        trees.append(_toctree(f"{stage.title}（{stage.span}）", entries))
    lab_entries = [labs[lab.lab_id][:-len(".ipynb")] for lab in LABS if lab.lab_id in labs]
    if any(lab.lab_id not in labs for lab in LABS):
        rows = ["| 实验 | 主题 | 对应章节 |", "|---|---|---|"]
        rows += [f"| {lab.lab_id} | {lab.title} | {'、'.join(f'第 {n} 章' for n in lab.chapters)} |"
                 for lab in LABS if lab.lab_id not in labs]
        pages["coming/labs.md"] = f"# 实验 · {COMING}\n\n" + "\n".join(rows) + "\n"
        lab_entries.append("coming/labs")
    trees.append(_toctree("实验（Labs）", lab_entries))
    trees.append(_toctree("参考", [f"{title} <{path[:-len('.md')]}>" for path, title in REFERENCE]))
    return landing_page(ROOT) + "\n" + "\n\n".join(trees) + "\n", pages


def static_notebook(nb: dict) -> dict:
    """``nb`` with each widget output replaced by its still picture, if it has one, and a note (a
    static page cannot run a widget), and
    the line breaks inside Chinese sentences of its Markdown cells removed."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = join_cjk_lines(text)
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET not in data:
                outputs.append(out)
                continue
            if "image/png" in data:             # a dashboard's still picture (minibatch.widgets.static_bundle)
                outputs.append({"output_type": "display_data", "metadata": {},
                                "data": {"image/png": data["image/png"]}})
            outputs.append({"output_type": "display_data", "metadata": {}, "data": {"text/markdown": WIDGET_NOTE}})
        if "outputs" in cell:
            cell["outputs"] = outputs
    return nb


def stage(dest: Path = STAGE_DIR) -> Path:
    """Write the book's sources into ``dest`` (emptied first)."""
    if dest.exists():
        shutil.rmtree(dest)
    chapters, labs = chapter_files(ROOT), lab_files(ROOT)
    index, pages = index_page(chapters, labs)
    for rel, text in {"index.md": index, **pages}.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text, encoding="utf-8")
    for rel in [*chapters.values(), *labs.values()]:
        nb = json.loads((ROOT / rel).read_text(encoding="utf-8"))
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(json.dumps(static_notebook(nb), ensure_ascii=False, indent=1), encoding="utf-8")
    for rel, _ in REFERENCE:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, dest / rel)
    return dest


def build(out: Path, strict: bool = False, quiet: bool = True, src: Path = STAGE_DIR) -> Path:
    """Stage into ``src`` and build into ``out``; return the path of the built ``index.html``."""
    stage(src)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(CONF), "-d", str(src.parent / "book-doctrees")]
    if quiet:
        cmd.append("-q")
    if strict:
        cmd += ["-W", "--keep-going"]
    subprocess.run(cmd + [str(src), str(out)], check=True)
    return out / "index.html"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "book", help="where the site goes")
    ap.add_argument("--strict", action="store_true", help="fail on any Sphinx warning")
    ap.add_argument("--verbose", action="store_true", help="show Sphinx's progress")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        index = build(args.out.resolve(), strict=args.strict, quiet=not args.verbose)
    except subprocess.CalledProcessError as e:
        print(f"error: sphinx-build failed ({e.returncode})", file=sys.stderr)
        return 1
    print(f"\nThe book is ready ({time.monotonic() - t0:.0f} s). Open it in a browser:\n\n"
          f"    {index.as_uri()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
