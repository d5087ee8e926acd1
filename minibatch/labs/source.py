"""A lab's one source of truth: a percent-format Python file with solution markers.

The file is read by jupytext (its ``py:percent`` format, as the chapters' sources are);
what is the labs' own is the meaning of the tags and the solution markers.
Format (``labs/src/L01_metrics.py``)::

    # %% [markdown]
    # # L01 · 标题
    # 说明文字 (each markdown line starts with "# ")
    # %%
    from minibatch.results import summarize            # a plain code cell
    # %% tags=["task:1"]
    def ttft(tl):
        ### BEGIN SOLUTION
        return tl.token_times[0] - tl.arrival
        ### END SOLUTION
    # %% tags=["check:1"]
    assert ttft(...) == ...

Tags (JSON list after ``tags=``):

* ``task:N``: a cell the learner edits. Code between ``### BEGIN SOLUTION`` and
  ``### END SOLUTION`` is the reference solution; the learner notebook gets
  ``raise NotImplementedError("L01 · task N")`` at the marker's indentation instead.
  A cell may hold several tasks; then each marker names its own:
  ``### BEGIN SOLUTION task 3``.
* ``check:N``: a graded cell for task N (asserts, deterministic printed output that
  the grader compares with the answer key). ``needs:M`` says it also calls task M.
* ``hidden`` (on a check cell): the cell is in the answer key only, not in the learner
  notebook; the grader runs it like any check (randomized checks, so that a solution
  cannot be fitted to the visible cases).
* ``nbval-ignore-output``: the cell's output is not compared (wall-clock numbers).

Any other cell is context (explanations, setup, engine demos) and must not call the
learner's code, so that a fresh learner notebook fails exactly at its check cells.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

BEGIN_RE = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?:\s+task\s+(?P<task>\d+))?\s*$")
END_RE = re.compile(r"^\s*### END SOLUTION\s*$")
TASK_TITLE_RE = re.compile(r"任务\s*(\d+)\s*[·:：]\s*(.+)")


# A line break between two Chinese characters (or Chinese punctuation) renders as a stray space in
# Markdown; the sources wrap long Chinese lines, so notebooks (chapters, labs, the book) join them.
CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"
CJK_BREAK_RE = re.compile(f"(?<=[{CJK}])\n[ \t]*(?=[{CJK}])")


def join_cjk_lines(text: str) -> str:
    """``text`` with the line breaks (and the indent after them) between two CJK characters removed."""
    return CJK_BREAK_RE.sub("", text)


class LabSourceError(ValueError):
    """A lab source file that the builder cannot turn into notebooks."""


@dataclass
class SourceCell:
    kind: str                      # "markdown" | "code"
    lines: list[str]
    tags: list[str] = field(default_factory=list)
    index: int = 0               # 1-based position of the cell in the source
    cell_id: str = ""

    @property
    def tasks(self) -> list[int]:
        return sorted(int(t.split(":", 1)[1]) for t in self.tags if t.startswith("task:"))

    @property
    def check(self) -> int | None:
        checks = [int(t.split(":", 1)[1]) for t in self.tags if t.startswith("check:")]
        return checks[0] if checks else None

    @property
    def hidden(self) -> bool:
        """A check cell that only the key holds (``hidden`` tag): the learner never sees it,
        the grader runs it (randomized checks a solution cannot be tuned to)."""
        return "hidden" in self.tags

    @property
    def needs(self) -> list[int]:
        return sorted(int(t.split(":", 1)[1]) for t in self.tags if t.startswith("needs:"))


@dataclass
class LabSource:
    lab_id: str                    # "L01"
    path: Path
    cells: list[SourceCell]

    @property
    def tasks(self) -> list[int]:
        return sorted({t for c in self.cells for t in c.tasks})

    @property
    def title(self) -> str:
        for c in self.cells:
            if c.kind == "markdown":
                for line in c.lines:
                    if line.startswith("# "):
                        return line[2:].strip()
        return self.lab_id

    def task_titles(self) -> dict[int, str]:
        """``{N: title}`` from markdown headings like ``## 任务 2 · 批处理窗口策略``."""
        out: dict[int, str] = {}
        for c in self.cells:
            if c.kind != "markdown":
                continue
            for line in c.lines:
                if line.lstrip().startswith("#"):
                    m = TASK_TITLE_RE.search(line)
                    if m and int(m.group(1)) not in out:
                        out[int(m.group(1))] = m.group(2).strip()
        return out

    def reference_source(self, cell: SourceCell) -> str:
        """The cell with the reference solution (markers dropped)."""
        if cell.kind == "markdown":
            return "\n".join(cell.lines)
        return "\n".join(l for l in cell.lines if not (BEGIN_RE.match(l) or END_RE.match(l)))

    def stub_source(self, cell: SourceCell) -> str:
        """The cell as the learner gets it: each solution replaced by a NotImplementedError."""
        if cell.kind == "markdown" or not cell.tasks:
            return self.reference_source(cell)
        out: list[str] = []
        inside = False
        for line in cell.lines:
            m = BEGIN_RE.match(line)
            if m:
                task = int(m.group("task")) if m.group("task") else cell.tasks[0]
                out.append(f'{m.group("indent")}raise NotImplementedError("{self.lab_id} · task {task}")')
                inside = True
            elif END_RE.match(line):
                inside = False
            elif not inside:
                out.append(line)
        return "\n".join(out)


def parse(path: str | Path, lab_id: str | None = None) -> LabSource:
    """Read a lab source file (jupytext's percent format) and validate its tags and markers."""
    import jupytext

    path = Path(path)
    lab_id = lab_id or path.stem.split("_", 1)[0]
    try:
        nb = jupytext.read(path, fmt="py:percent")
    except Exception as e:  # jupytext refuses some malformed headers with a plain error
        raise LabSourceError(f"{path}: jupytext cannot read it: {type(e).__name__}: {e}") from None
    cells: list[SourceCell] = []
    for no, c in enumerate(nb.cells, start=1):
        bad = c.metadata.get("incorrectly_encoded_metadata")
        if bad is not None:
            raise LabSourceError(f"{path}, cell {no}: cannot read cell header options {bad!r} "
                                 "(expected '# %%', '# %% [markdown]' or '# %% tags=[...]')")
        tags = c.metadata.get("tags", [])
        if not (isinstance(tags, list) and all(isinstance(x, str) for x in tags)):
            raise LabSourceError(f"{path}, cell {no}: tags must be a JSON list of strings, got {tags!r}")
        text = join_cjk_lines(c.source) if c.cell_type == "markdown" else c.source
        cells.append(SourceCell(c.cell_type, text.split("\n") if text else [], list(tags), no))
    src = LabSource(lab_id, path, cells)
    _validate(src)
    _assign_ids(src)
    return src


def _validate(src: LabSource) -> None:
    where = src.path
    tasks = set(src.tasks)
    if not tasks:
        raise LabSourceError(f"{where}: no task cells (tag a cell 'task:1')")
    checked: set[int] = set()
    for cell in src.cells:
        at = f"{where}, cell {cell.index}"
        known = [t for t in cell.tags if t.split(":", 1)[0] in ("task", "check", "needs")]
        for t in known:
            if not re.fullmatch(r"(task|check|needs):\d+", t):
                raise LabSourceError(f"{at}: bad tag {t!r} (write e.g. 'task:2')")
        if cell.kind == "markdown" and known:
            raise LabSourceError(f"{at}: a markdown cell cannot carry {known}")
        if cell.tasks and cell.check is not None:
            raise LabSourceError(f"{at}: a cell is either a task cell or a check cell")
        if sum(t.startswith("check:") for t in cell.tags) > 1:
            raise LabSourceError(f"{at}: a check cell checks one task (add 'needs:M' for others it uses)")
        if cell.needs and cell.check is None:
            raise LabSourceError(f"{at}: 'needs:' only goes on check cells")
        if cell.hidden and cell.check is None:
            raise LabSourceError(f"{at}: 'hidden' only goes on check cells")
        if cell.check is not None:
            if cell.check not in tasks:
                raise LabSourceError(f"{at}: check:{cell.check} but there is no task {cell.check}")
            for n in cell.needs:
                if n not in tasks:
                    raise LabSourceError(f"{at}: needs:{n} but there is no task {n}")
            checked.add(cell.check)
        # Markers: balanced, inside task cells only, naming one of the cell's tasks.
        inside = False
        marked: set[int] = set()
        for i, line in enumerate(cell.lines):
            m = BEGIN_RE.match(line)
            if m:
                if inside or not cell.tasks:
                    raise LabSourceError(f"{at}: unexpected '### BEGIN SOLUTION' (line {i + 1} of the cell)")
                task = int(m.group("task")) if m.group("task") else None
                if task is None:
                    if len(cell.tasks) > 1:
                        raise LabSourceError(f"{at}: this cell holds tasks {cell.tasks}; "
                                             "write '### BEGIN SOLUTION task N'")
                    task = cell.tasks[0]
                if task not in cell.tasks:
                    raise LabSourceError(f"{at}: marker names task {task}, cell is tagged {cell.tasks}")
                marked.add(task)
                inside = True
            elif END_RE.match(line):
                if not inside:
                    raise LabSourceError(f"{at}: '### END SOLUTION' without a BEGIN")
                inside = False
        if inside:
            raise LabSourceError(f"{at}: '### BEGIN SOLUTION' is never closed")
        if set(cell.tasks) - marked:
            raise LabSourceError(f"{at}: task cell has no solution markers for tasks {sorted(set(cell.tasks) - marked)}")
    if tasks - checked:
        raise LabSourceError(f"{where}: tasks {sorted(tasks - checked)} have no check cell")
    owners: dict[int, int] = {}
    for cell in src.cells:
        for t in cell.tasks:
            if t in owners:
                raise LabSourceError(f"{where}, cell {cell.index}: task {t} is already in cell {owners[t]}")
            owners[t] = cell.index


def _assign_ids(src: LabSource) -> None:
    """Stable cell ids: ``task-2``, ``check-2``, ``check-2-b``, ``cell-07`` ..."""
    used: set[str] = set()
    for i, cell in enumerate(src.cells):
        if cell.tasks:
            base = "task-" + "-".join(map(str, cell.tasks))
        elif cell.check is not None:
            base = f"check-{cell.check}"
        else:
            base = f"{'md' if cell.kind == 'markdown' else 'cell'}-{i:02d}"
        cid, k = base, 0
        while cid in used:
            k += 1
            cid = f"{base}-{chr(ord('a') + k)}"
        used.add(cid)
        cell.cell_id = cid
