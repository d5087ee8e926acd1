"""Grade a learner's notebook against the lab's answer key.

Only the learner's *task cells* are taken from their notebook (matched by cell id,
else by their ``task:N`` tags). Everything else (explanations, setup, the check cells
and the outputs those must print) comes from the protected key, so neither an edited
check cell nor outputs saved in the learner's file can change the grade. The grading
notebook runs top to bottom in a fresh kernel; a check cell passes when it raises
nothing and prints what the key's copy printed (standard output and plain-text
results; figures and ``nbval-ignore-output`` cells are not compared), which is what
``pytest --nbval`` would check. Task N passes when every ``check:N`` cell passes.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from minibatch.labs import Lab
from minibatch.labs.builder import execute
from minibatch.labs.source import TASK_TITLE_RE

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
ADDR_RE = re.compile(r"0x[0-9a-fA-F]{6,}")
IGNORE_OUTPUT_TAGS = ("nbval-ignore-output",)


@dataclass
class CellResult:
    index: int
    cell_id: str
    role: str                      # "task" | "check" | "context"
    tasks: list[int]               # task cells: their tasks; check cells: [checked task]
    needs: list[int] = field(default_factory=list)
    status: str = "pass"           # "pass" | "error" | "mismatch" | "not run" | "skipped"
    ename: str | None = None
    evalue: str | None = None
    where: str | None = None       # the source line that raised, from the traceback
    diff: str | None = None        # first difference from the key's output

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def describe(self) -> str:
        if self.status == "error":
            msg = f"{self.ename}: {self.evalue}" if self.evalue else f"{self.ename}"
            if self.where and "NotImplementedError" not in self.where:
                msg += f"\n    at: {self.where}"
            return msg
        if self.status == "mismatch":
            return f"output differs from the answer key:\n{self.diff}"
        if self.status == "not run":
            return "did not run" + (f" ({self.evalue})" if self.evalue else "")
        if self.status == "skipped":
            return "hidden check not run: a visible check of this task fails; fix that first"
        return "ok"


@dataclass
class TaskResult:
    task: int
    title: str
    passed: bool
    failures: list[str] = field(default_factory=list)


@dataclass
class GradeReport:
    lab_id: str
    title: str
    notebook: str
    tasks: list[TaskResult]
    cells: list[CellResult]
    notes: list[str] = field(default_factory=list)
    aborted: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.tasks) and all(t.passed for t in self.tasks)

    def format(self) -> str:
        lines = [f"{self.title}  ({self.notebook})"]
        for t in self.tasks:
            mark = "✓" if t.passed else "✗"
            lines.append(f"  {mark} task {t.task}  {t.title}".rstrip())
            for f in t.failures[:3]:
                lines.extend("      " + l for l in f.splitlines())
            if len(t.failures) > 3:
                lines.append(f"      ... and {len(t.failures) - 3} more failing check cells")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.aborted:
            lines.append(f"  run stopped early: {self.aborted}")
        good = sum(t.passed for t in self.tasks)
        lines.append(f"{good}/{len(self.tasks)} tasks pass")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)


# -- the cells of a key -------------------------------------------------------------
def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _numbers(tags: list[str], prefix: str) -> list[int]:
    return sorted(int(t.split(":", 1)[1]) for t in tags if re.fullmatch(prefix + r":\d+", t))


def _role(cell) -> str:
    tags = _tags(cell)
    if cell.cell_type != "code":
        return "markdown"
    if _numbers(tags, "task"):
        return "task"
    if _numbers(tags, "check"):
        return "check"
    return "context"


def _task_titles(nb) -> dict[int, str]:
    out: dict[int, str] = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = TASK_TITLE_RE.search(line) if line.lstrip().startswith("#") else None
                if m and int(m.group(1)) not in out:
                    out[int(m.group(1))] = m.group(2).strip()
    return out


def _title(nb, lab_id: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return lab_id


# -- outputs ------------------------------------------------------------------------
def sanitize(text: str) -> str:
    text = ANSI_RE.sub("", text)
    text = ADDR_RE.sub("0x…", text)
    return "\n".join(l.rstrip() for l in text.strip("\n").splitlines())


def comparable_output(outputs) -> str:
    """What of a cell's outputs is compared: stdout and plain-text results, not figures."""
    parts: list[str] = []
    stdout = ""
    for o in outputs:
        if o.output_type == "stream":
            if o.name == "stdout":
                stdout += o.text
            continue
        if stdout:
            parts.append(stdout)
            stdout = ""
        if o.output_type in ("execute_result", "display_data"):
            data = o.get("data", {})
            if any(k.startswith("image/") for k in data):
                continue
            if "text/plain" in data:
                parts.append(data["text/plain"])
    if stdout:
        parts.append(stdout)
    return sanitize("\n".join(parts))


def _first_difference(want: str, got: str) -> str:
    wl, gl = want.splitlines(), got.splitlines()
    for i in range(max(len(wl), len(gl))):
        w = wl[i] if i < len(wl) else "<nothing>"
        g = gl[i] if i < len(gl) else "<nothing>"
        if w != g:
            return f"  line {i + 1}\n  expected: {w}\n  got:      {g}"
    return "\n".join(difflib.unified_diff(wl, gl, "key", "yours", lineterm=""))


def _error_of(outputs):
    for o in outputs:
        if o.output_type == "error":
            return o
    return None


def _raising_line(traceback: list[str]) -> str | None:
    """The last ``---->`` line of an IPython traceback: where the error was raised."""
    found = None
    for chunk in traceback:
        for line in ANSI_RE.sub("", chunk).splitlines():
            s = line.strip()
            if s.startswith("---->") or s.startswith("->"):
                found = re.sub(r"^-+>\s*\d*\s*", "", s)
    return found


# -- grading --------------------------------------------------------------------------
def grading_notebook(key, learner, lab_id: str) -> tuple[nbformat.NotebookNode, list[str]]:
    """The key with its task cells' sources taken from the learner's notebook."""
    nb = copy.deepcopy(key)
    notes: list[str] = []
    mine = [c for c in learner.cells if c.cell_type == "code"]
    by_id = {c.get("id"): c for c in mine if c.get("id")}
    by_tasks: dict[tuple, list] = {}
    for c in mine:
        t = tuple(_numbers(_tags(c), "task"))
        if t:
            by_tasks.setdefault(t, []).append(c)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        tasks = _numbers(_tags(cell), "task")
        if not tasks:
            continue
        theirs = by_id.get(cell.get("id"))
        if theirs is None and by_tasks.get(tuple(tasks)):
            theirs = by_tasks[tuple(tasks)][-1]
        if theirs is None:
            names = ", ".join(f"task:{t}" for t in tasks)
            notes.append(f"no task cell for {names} in your notebook (keep the cell and its tag)")
            cell.source = "\n".join(f'raise NotImplementedError("{lab_id} · task {t} (cell missing)")'
                                    for t in tasks[:1])
        else:
            cell.source = theirs.source
    return nb, notes


def grade(lab: Lab, notebook: str | Path, timeout: int = 300, key_path: str | Path | None = None,
          km=None, tasks=None) -> GradeReport:
    """Run ``notebook``'s task cells against ``lab``'s key; return the per-task report.

    ``km``: a kernel from :func:`minibatch.labs.builder.shared_kernel` to reuse (tests);
    by default a fresh kernel runs the notebook. ``tasks``: grade only these tasks and the
    tasks their checks need (``needs:M``, transitively); the other tasks' check cells are not
    run (every task cell and set-up cell still is), and the report lists only the graded tasks.
    """
    key = nbformat.read(str(key_path or lab.key_path), as_version=4)
    learner = nbformat.read(str(notebook), as_version=4)
    nb, notes = grading_notebook(key, learner, lab.lab_id)
    selected = None if tasks is None else with_needs(key, tasks)
    if selected is not None:
        known = {t for c in key.cells for t in _numbers(_tags(c), "task")}
        if not set(tasks) <= known:
            raise ValueError(f"{lab.lab_id} has no task {sorted(set(tasks) - known)}; its tasks are {sorted(known)}")
        for cell in nb.cells:
            if _role(cell) == "check" and not set(_numbers(_tags(cell), "check")) & selected:
                cell.source = ""                   # not graded this time
    aborted = execute(nb, cwd=lab.root, timeout=timeout, allow_errors=True, km=km, skip=_skip_hidden(nb))
    return _report(lab, key, nb, str(notebook), notes, aborted, timeout, selected)


def _skip_hidden(nb):
    """A hidden check of a task whose visible check already raised is not run: the learner
    fixes what the visible check says first, and grading a wrong answer stays quick."""
    def skip(cell) -> bool:
        tags = _tags(cell)
        tasks = set(_numbers(tags, "check"))
        if "hidden" not in tags or not tasks:
            return False
        for c in nb.cells:
            if c is cell:
                return False
            ctags = _tags(c)
            if ("hidden" not in ctags and set(_numbers(ctags, "check")) & tasks
                    and _error_of(c.get("outputs", [])) is not None):
                return True
        return False

    return skip


def with_needs(key, tasks) -> set[int]:
    """``tasks`` and every task their check cells need (``needs:M`` tags), transitively."""
    needs: dict[int, set[int]] = {}
    for c in key.cells:
        for t in _numbers(_tags(c), "check"):
            needs.setdefault(t, set()).update(_numbers(_tags(c), "needs"))
    out, todo = set(), list(tasks)
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo.extend(needs.get(t, ()))
    return out


def _message(text: str, max_lines: int = 12) -> str:
    """An error's message as the learner should read it: a multi-line assertion message (what
    was expected, then yours) is kept whole up to ``max_lines`` lines, continuation lines indented."""
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n      ".join(lines)


def _report(lab: Lab, key, ran, notebook: str, notes: list[str], aborted, timeout: int,
            selected: set[int] | None = None) -> GradeReport:
    cells: list[CellResult] = []
    for i, (kc, rc) in enumerate(zip(key.cells, ran.cells)):
        role = _role(kc)
        if role == "markdown":
            continue
        tags = _tags(kc)
        tasks = _numbers(tags, "task") if role == "task" else _numbers(tags, "check")
        if selected is not None and role == "check" and not set(tasks) & selected:
            continue                                   # not graded this time
        res = CellResult(i, kc.get("id", f"#{i}"), role, tasks, _numbers(tags, "needs"))
        err = _error_of(rc.outputs)
        if rc.get("metadata", {}).get("minibatch", {}).get("skipped"):
            res.status = "skipped"
        elif err is not None:
            res.status, res.ename = "error", err.ename
            res.evalue = _message(sanitize(err.evalue))
            res.where = _raising_line(err.get("traceback", []))
            if err.ename == "KeyboardInterrupt":           # nbclient interrupted a cell past the timeout
                res.ename, res.evalue = "TimeoutError", f"the cell ran longer than {timeout} s and was interrupted"
        elif rc.execution_count is None and not rc.outputs and kc.source.strip():
            res.status, res.evalue = "not run", aborted and str(aborted)
        elif role == "check" and not any(t in tags for t in IGNORE_OUTPUT_TAGS):
            want, got = comparable_output(kc.outputs), comparable_output(rc.outputs)
            if want != got:
                res.status, res.diff = "mismatch", _first_difference(want, got)
        cells.append(res)
    titles = _task_titles(key)
    all_tasks = sorted({t for c in cells if c.role == "task" for t in c.tasks
                        if selected is None or t in selected})
    results = []
    failed: set[int] = set()
    for t in all_tasks:                    # in order: a check's ``needs:M`` names an earlier task
        failures = []
        for c in cells:
            if c.role == "task" and t in c.tasks and c.status == "error":
                failures.append(f"your task cell raised {c.describe()}")
            if c.role == "check" and c.tasks == [t] and not c.ok:
                before = [m for m in c.needs if m in failed]
                own_stub = c.ename == "NotImplementedError" and (c.evalue or "").startswith(f"{lab.lab_id} · task {t}")
                if before and not own_stub:   # the real cause is the earlier task, not this one's code
                    names = ", ".join(f"task {m}" + (f" ({titles[m]})" if titles.get(m) else "") for m in before)
                    failures.append(f"[{c.cell_id}] this check uses {names}, which does not pass yet: "
                                    f"fix that first (here: {c.describe()})")
                else:
                    failures.append(f"[{c.cell_id}] {c.describe()}")
        checks = [c for c in cells if c.role == "check" and c.tasks == [t]]
        passed = not failures and bool(checks)
        if not passed:
            failed.add(t)
        results.append(TaskResult(t, titles.get(t, ""), passed, failures))
    for c in cells:
        if c.role == "context" and c.status == "error":
            notes.append(f"setup cell {c.cell_id} failed: {c.describe()}")
    return GradeReport(lab.lab_id, _title(key, lab.lab_id), notebook, results, cells, notes,
                       str(aborted) if aborted else None)
