"""Every lab is solvable (its key passes), graded (its stubs fail exactly at the check
cells) and in sync with its one source; and the grader trusts only the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import nbformat
import pytest

from minibatch.labs import Lab, find_lab, labs_dir, list_labs
from minibatch.labs.__main__ import main as labs_main
from minibatch.labs.builder import build_lab, make_notebook, shared_kernel, template_of
from minibatch.labs.grader import grade
from minibatch.labs.source import LabSourceError, parse

LABS = list_labs()
IDS = [lab.lab_id for lab in LABS]


@pytest.fixture(scope="module")
def kernel():
    """One kernel for all notebook runs here: imports (torch, minibatch) are paid once.

    It starts with TRITON_INTERPRET=1, as the whole suite has it (tests/kernel_tests/conftest.py):
    L05 sets it before importing triton, which is too late in a kernel where an earlier lab
    imported triton already; this file alone then failed L05's reference ("Cannot call @triton.jit'd
    outside of the scope of a kernel")."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        manager = shared_kernel(labs_dir())
        km = manager.__enter__()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    try:
        yield km
    finally:
        manager.__exit__(None, None, None)


def _cells(nb):
    """Each cell as the source builds it: a Markdown cell with prose fields by its template (the key stores the
    filled text, with the template in its metadata)."""
    return [(c.cell_type, c.get("id"), template_of(c), list(c.get("metadata", {}).get("tags", []))) for c in nb.cells]


def test_the_course_labs_exist():
    assert IDS[:4] == ["L01", "L02", "L03", "L04"]
    assert find_lab("3") == find_lab("L03") == find_lab("l03_continuous")
    with pytest.raises(KeyError):
        find_lab("L99")


@pytest.mark.parametrize("lab", LABS, ids=IDS)
def test_notebooks_are_in_sync_with_the_source(lab: Lab):
    """Rebuilding from labs/src gives the stored cells; the learner keeps the key's outputs."""
    _assert_in_sync(lab)


def _assert_in_sync(lab: Lab) -> None:
    src = lab.source()
    key = nbformat.read(str(lab.key_path), as_version=4)
    learner = nbformat.read(str(lab.notebook_path), as_version=4)
    nbformat.validate(key)
    nbformat.validate(learner)
    assert _cells(key) == _cells(make_notebook(src, "reference")), \
        f"{lab.key_path.name} is stale: run `python -m minibatch.labs build {lab.lab_id}`"
    assert _cells(learner) == _cells(make_notebook(src, "learner")), \
        f"{lab.notebook_path.name} is stale: run `python -m minibatch.labs build {lab.lab_id}`"
    shown = {c.get("id"): c for c in learner.cells}             # the key's hidden check cells are not shown
    for k in key.cells:
        if k.cell_type == "code" and k.get("id") in shown:
            assert k.outputs == shown[k.id].outputs, f"cell {k.id}: the learner notebook must show the key's outputs"
    assert all(c.get("id") in {k.get("id") for k in key.cells} for c in learner.cells)
    assert key.metadata["minibatch_lab"]["role"] == "key"
    assert learner.metadata["minibatch_lab"]["role"] == "learner"
    assert key.metadata["kernelspec"]["name"] == "python3"
    stubs = [c.source for c in learner.cells if c.cell_type == "code" and "raise NotImplementedError" in c.source]
    assert len(stubs) == len({c.cell_id for c in src.cells if c.tasks})
    for c in key.cells:
        assert "sys.path" not in c.source, "notebooks import the installed package"


@pytest.mark.parametrize("lab", LABS, ids=IDS)
def test_every_lab_shows_a_figure(lab: Lab):
    key = nbformat.read(str(lab.key_path), as_version=4)
    figures = sum("image/png" in o.get("data", {}) for c in key.cells if c.cell_type == "code" for o in c.outputs)
    assert figures >= 1, "every lab shows at least one figure"


@pytest.mark.parametrize("lab", LABS, ids=IDS)
def test_the_reference_solution_passes(lab: Lab, kernel):
    report = grade(lab, lab.key_path, km=kernel)
    assert report.passed, report.format()
    bad = [(c.cell_id, c.describe()) for c in report.cells if not c.ok]
    assert not bad, bad


@pytest.mark.parametrize("lab", LABS, ids=IDS)
def test_the_stubs_fail_exactly_at_the_check_cells(lab: Lab, kernel):
    report = grade(lab, lab.notebook_path, km=kernel)
    assert not any(t.passed for t in report.tasks), report.format()
    key = nbformat.read(str(lab.key_path), as_version=4)
    hidden = {c.get("id") for c in key.cells if "hidden" in c.metadata.get("tags", [])}
    checks = 0
    for c in report.cells:
        if c.role in ("context", "task"):
            assert c.ok, f"{c.cell_id} must run without the solutions: {c.describe()}"
            continue
        checks += 1
        if c.status == "skipped":          # a hidden check, after its task's visible check failed
            assert c.cell_id in hidden and any(v.tasks == c.tasks and v.status == "error" for v in report.cells
                                               if v.role == "check" and v.cell_id not in hidden), c.cell_id
            continue
        assert c.status == "error", f"{c.cell_id} should fail without the solutions ({c.status})"
        allowed = {f"{lab.lab_id} · task {t}" for t in c.tasks + c.needs}
        assert (c.ename == "NotImplementedError" and c.evalue in allowed) or c.ename == "AssertionError", \
            f"{c.cell_id} failed with {c.ename}: {c.evalue} (expected one of {sorted(allowed)})"
    assert checks >= len(report.tasks)


# -- the machinery, on a small lab of its own -------------------------------------------
MINI = '''\
# %% [markdown]
# # L07 · mini
# ## 任务 1 · double
# %%
import math
# %% tags=["task:1"]
def double(x):
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION
# %% tags=["check:1"]
assert double(2) == 4
print("double(21) =", double(21))
# %% [markdown]
# ## 任务 2 · root
# %% tags=["task:2"]
def root(x):
    # hint: math.sqrt
    ### BEGIN SOLUTION
    return math.sqrt(x)
    ### END SOLUTION
# %% tags=["check:2", "needs:1"]
print(round(root(double(8)), 3))
# %% tags=["check:1", "hidden"]
import random
for x in random.Random(1).sample(range(1000), 5):
    assert double(x) == 2 * x, f"double({x}) should be {2 * x}, got {double(x)}"
# %% [markdown]
# double(21) = {{double(21)}}, pi = {{math.pi:.2f}}
'''


@pytest.fixture(scope="module")
def mini(tmp_path_factory, kernel):
    root = tmp_path_factory.mktemp("labs")
    (root / "src").mkdir()
    (root / "src" / "L07_mini.py").write_text(MINI, encoding="utf-8")
    lab = find_lab("L07", root)
    build_lab(lab, km=kernel, log=lambda *a: None)
    return lab


def _edit(lab, tmp_path, **sources):
    """The learner notebook with some cells (by id) given new sources."""
    nb = nbformat.read(str(lab.notebook_path), as_version=4)
    for cell in nb.cells:
        if cell.get("id") in sources:
            cell.source = sources[cell.id]
    path = tmp_path / "mine.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_build_writes_a_stubbed_learner_notebook_and_an_executed_key(mini):
    key = nbformat.read(str(mini.key_path), as_version=4)
    learner = nbformat.read(str(mini.notebook_path), as_version=4)
    assert [c.id for c in key.cells if c.cell_type == "code"] == ["cell-01", "task-1", "check-1", "task-2", "check-2",
                                                                  "check-1-b"]
    assert [c.id for c in learner.cells if c.cell_type == "code"] == ["cell-01", "task-1", "check-1", "task-2",
                                                                      "check-2"]
    task2 = next(c for c in learner.cells if c.id == "task-2").source
    assert task2 == 'def root(x):\n    # hint: math.sqrt\n    raise NotImplementedError("L07 · task 2")'
    check2 = next(c for c in learner.cells if c.id == "check-2")
    assert check2.outputs[0]["text"] == "4.0\n", "the learner sees the reference output"


def test_prose_fields_and_hidden_cells_keep_the_notebooks_in_sync(mini):
    """A Markdown cell with prose fields is stored filled (its template in the metadata), a hidden check
    cell is left out of the learner notebook: both still match the source."""
    key = nbformat.read(str(mini.key_path), as_version=4)
    assert key.cells[-1].source == "double(21) = 42, pi = 3.14"
    _assert_in_sync(mini)


def test_grader_reports_each_task(mini, kernel, tmp_path):
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return x + x"})
    report = grade(mini, path, km=kernel)
    assert [t.passed for t in report.tasks] == [True, False]
    assert "NotImplementedError: L07 · task 2" in report.tasks[1].failures[0]
    text = report.format()
    assert "✓ task 1  double" in text and "✗ task 2  root" in text and "1/2 tasks pass" in text


def test_a_check_that_needs_a_failed_task_names_that_task(mini, kernel, tmp_path):
    """Task 1's cell defines nothing (a NameError in task 2's check): the report sends the learner to task 1."""
    path = _edit(mini, tmp_path, **{"task-1": "# not written yet", "task-2": "import math\nroot = math.sqrt"})
    report = grade(mini, path, km=kernel)
    t1, t2 = report.tasks
    assert not t1.passed and not t2.passed
    assert "this check uses task 1 (double), which does not pass yet: fix that first" in t2.failures[0]
    assert "NameError" in t2.failures[0], "the original error is still shown"
    assert not any("does not pass yet" in f for f in t1.failures)
    # Task 1 wrong and task 2 not written: task 2's own stub is the cause, and the report says just that.
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return x + 1"})
    t2 = grade(mini, path, km=kernel).tasks[1]
    assert "NotImplementedError: L07 · task 2" in t2.failures[0] and "does not pass yet" not in t2.failures[0]


def test_grading_some_tasks_runs_only_their_checks_and_what_they_need(mini, kernel, tmp_path):
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return x + x", "task-2": "import math\nroot = math.sqrt"})
    only1 = grade(mini, path, km=kernel, tasks={1})
    assert [t.task for t in only1.tasks] == [1] and only1.passed
    assert not any(c.role == "check" and c.tasks == [2] for c in only1.cells), "task 2's check did not run"
    with_need = grade(mini, path, km=kernel, tasks={2})
    assert [t.task for t in with_need.tasks] == [1, 2], "task 2's check needs task 1: both are graded"
    assert with_need.passed
    with pytest.raises(ValueError, match="no task \\[7\\]"):
        grade(mini, path, km=kernel, tasks={7})


def test_grader_uses_the_key_not_the_learners_check_cells_or_outputs(mini, kernel, tmp_path):
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return 2 * x + 1",
                                    "check-1": "pass  # tampered", "task-2": "import math\nroot = math.sqrt"})
    report = grade(mini, path, km=kernel)
    t1, t2 = report.tasks
    assert not t1.passed and "AssertionError" in t1.failures[0] and "assert double(2) == 4" in t1.failures[0]
    # task 2's check runs the key's cell; double(8) = 17 prints 4.123 instead of 4.0
    assert not t2.passed and "expected: 4.0" in t2.failures[0] and "got:      4.123" in t2.failures[0]


def test_grader_matches_task_cells_by_tag_and_flags_missing_ones(mini, kernel, tmp_path):
    nb = nbformat.read(str(mini.notebook_path), as_version=4)
    for cell in nb.cells:
        if cell.get("id") == "task-1":
            cell.id, cell.source = "renamed", "def double(x):\n    return 2 * x"
    nb.cells = [c for c in nb.cells if c.get("id") != "task-2"]
    path = tmp_path / "mine.ipynb"
    nbformat.write(nb, str(path))
    report = grade(mini, path, km=kernel)
    assert [t.passed for t in report.tasks] == [True, False]
    assert any("task:2" in n for n in report.notes)


def test_a_cell_that_hangs_is_interrupted_and_grading_goes_on(mini, kernel, tmp_path):
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    while True:\n        pass",
                                    "task-2": "import math\nroot = math.sqrt"})
    # A healthy cell here takes milliseconds; 10 s leaves room for a machine shared with other jobs.
    report = grade(mini, path, km=kernel, timeout=10)
    t1, t2 = report.tasks
    assert not t1.passed and "TimeoutError" in t1.failures[0]
    assert not t2.passed            # its check calls double too
    assert report.aborted is None


def test_cli_solve_and_check(mini, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIBATCH_LABS_DIR", str(mini.root))
    solved = tmp_path / "solved.ipynb"
    assert labs_main(["solve", "L07", "--out", str(solved)]) == 0
    capsys.readouterr()
    assert labs_main(["check", "L07", str(solved), "--json"]) == 0      # a fresh kernel, as learners get
    assert [t["passed"] for t in json.loads(capsys.readouterr().out)["tasks"]] == [True, True]
    assert labs_main(["check", "L07", str(mini.notebook_path)]) == 1
    assert "0/2 tasks pass" in capsys.readouterr().out
    assert labs_main(["check", "L07", str(solved), "--task", "9"]) == 2          # checked before any kernel starts
    assert "L07 has no task [9]; its tasks are [1, 2]" in capsys.readouterr().err


def test_keys_are_plain_nbval_notebooks(mini):
    """``pytest --nbval`` reruns a key and finds the outputs it stores."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                          str(mini.key_path)], capture_output=True, text=True, cwd=str(mini.root))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_cli_list(capsys):
    assert labs_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "L03" in out and "task 2:" in out


@pytest.mark.parametrize("text, message", [
    ("# %% tags=[\"task:1\"]\nx = 1\n", "no solution markers"),
    ("# %% tags=[\"task:1\"]\n### BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("# %% tags=[\"task:1\"]\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "no check cell"),
    ("# %% tags=[\"task:1\"]\n### BEGIN SOLUTION\n### END SOLUTION\n# %% tags=[\"check:2\"]\n", "no task 2"),
    ("# %% tags=task:1\nx = 1\n", "cannot read cell header"),
    ("# %% tags=[1]\nx = 1\n", "cannot read"),
    ("# %% tags=[\"task:1\"]\n### BEGIN SOLUTION\n### END SOLUTION\n# %% tags=[\"hidden\"]\nx = 1\n", "only goes on check"),
    ("# %% tags=[\"task:1\", \"task:2\"]\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "BEGIN SOLUTION task N"),
])
def test_bad_sources_are_refused_with_a_reason(tmp_path, text, message):
    path = tmp_path / "L09_bad.py"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(LabSourceError, match=message.replace("(", r"\(")):
        parse(path)



def test_a_missed_wake_up_costs_a_poll_slice_not_the_cell_timeout():
    """A channel that only notices a waiting message when its poll times out (what a missed
    wake-up of the ZMQ socket looks like) answers within a slice, not after the full timeout;
    a message that never comes still times out."""
    import asyncio
    import time
    from queue import Empty

    from minibatch.labs.builder import sliced_get_msg

    def channel(arrives_after: float):
        arrives = time.monotonic() + arrives_after

        async def get_msg(timeout=None):
            await asyncio.sleep(timeout)        # sleeps through the arrival, like a missed wake-up
            if time.monotonic() >= arrives:
                return {"msg": "reply"}
            raise Empty
        return get_msg

    async def timed(get_msg, timeout):
        t0 = time.monotonic()
        return await sliced_get_msg(get_msg, slice_s=0.05)(timeout=timeout), time.monotonic() - t0

    msg, waited = asyncio.run(timed(channel(0.2), timeout=600))
    assert msg == {"msg": "reply"} and waited < 5.0
    with pytest.raises(Empty):
        asyncio.run(timed(channel(1e9), timeout=0.2))


def test_prose_fields_are_filled_from_the_kernel_where_they_stand(tmp_path):
    """{{...}} fields in Markdown take the values the code above them left; the template is
    kept; a field that fails stops the build."""
    from minibatch.labs.builder import ProseFieldError, build_chapter, template_of

    src = tmp_path / "src" / "99_fields.py"
    src.parent.mkdir()
    src.write_text(textwrap.dedent('''\
        # %%
        x = 2.345
        s = "abc"
        # %% [markdown]
        # x is {{x:.1f}}, s has {{len(s)}} letters, {{"无" if x < 1 else "有"}}
        # %%
        x = 10
        # %% [markdown]
        # now {{x}}
    '''), encoding="utf-8")
    nb = nbformat.read(str(build_chapter(src, tmp_path, log=lambda *a: None)), as_version=4)
    md = [c for c in nb.cells if c.cell_type == "markdown"]
    assert [c.source for c in md] == ["x is 2.3, s has 3 letters, 有", "now 10"]
    assert template_of(md[0]) == "x is {{x:.1f}}, s has {{len(s)}} letters, {{\"无\" if x < 1 else \"有\"}}"
    bad = tmp_path / "src" / "98_bad.py"
    bad.write_text("# %%\nx = 1\n# %% [markdown]\n# {{y + 1}}\n", encoding="utf-8")
    with pytest.raises(ProseFieldError, match="y \\+ 1.*NameError"):
        build_chapter(bad, tmp_path, log=lambda *a: None)


def test_hidden_checks_are_graded_but_not_shown(mini, kernel, tmp_path):
    key = nbformat.read(str(mini.key_path), as_version=4)
    learner = nbformat.read(str(mini.notebook_path), as_version=4)
    hidden = [c for c in key.cells if "hidden" in c.metadata.get("tags", [])]
    assert len(hidden) == 1 and hidden[0].id not in {c.id for c in learner.cells}
    # A double() that is right on the visible check (21 -> 42) but wrong elsewhere fails task 1.
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return {2: 4, 21: 42}.get(x, 2 * x + 1)",
                                    "task-2": "import math\nroot = math.sqrt"})
    report = grade(mini, path, km=kernel)
    t1 = report.tasks[0]
    assert not t1.passed and any("should be" in f for f in t1.failures), report.format()


def test_a_hidden_check_is_not_run_while_a_visible_check_of_its_task_fails(mini, kernel, tmp_path):
    """A wrong answer that fails the visible check of task 1 is told that first; the hidden check
    of task 1 does not run (it would cost the grading its time, and say nothing new)."""
    path = _edit(mini, tmp_path, **{"task-1": "def double(x):\n    return 2 * x + 1",
                                    "task-2": "import math\nroot = math.sqrt"})
    report = grade(mini, path, km=kernel)
    cells = {c.cell_id: c for c in report.cells}
    assert cells["check-1"].status == "error" and cells["check-1-b"].status == "skipped", report.format()
    assert any("[check-1-b] hidden check not run" in f for f in report.tasks[0].failures), report.format()
    assert cells["check-2"].status == "mismatch", "task 2's check still runs (and shows task 1's wrong double)"


def test_a_multi_line_assertion_message_reaches_the_learner_whole(mini, kernel, tmp_path):
    bad = ("def double(x):\n"
           "    assert False, 'double is wrong:\\nexpected 42\\ngot 41'\n")
    report = grade(mini, _edit(mini, tmp_path, **{"task-1": bad}), km=kernel)
    failing = [c for c in report.cells if c.role == "check" and 1 in c.tasks and not c.ok]
    assert failing and "expected 42" in failing[0].evalue and "got 41" in failing[0].evalue, report.format()
