"""The one notebook builder of the course: chapters and labs, read by jupytext, run alike.

Every source (``chapters/src/NN_slug.py``, ``labs/src/LNN_slug.py``) is a plain Python file
in jupytext's percent format::

    # %% [markdown]
    # # 标题 ...            (markdown lines, each starting with "# ")
    # %%
    x = 1                   (a code cell)
    # %% tags=["nbval-ignore-output"]
    dashboard               (a code cell with tags)
    # %% tags=["check"]
    assert x == 1           (a guard: runs, shown collapsed; see CHECK_TAG)

:func:`read_notebook` turns it into cells; :func:`execute` runs a notebook top to bottom
in a kernel that is this very interpreter, with the same environment settings for
chapters and labs; :func:`build_chapter` stores an executed chapter, and
:func:`build_lab` a lab's two notebooks: the executed reference is the answer key
(``labs/keys/L01_metrics.key.ipynb``), and the learner notebook (``labs/L01_metrics.ipynb``)
is the same notebook with each solution replaced by a ``NotImplementedError`` stub,
keeping the reference outputs. The only lab-specific step is that stub
(:mod:`minibatch.labs.source`).
"""

from __future__ import annotations

import copy
import os
import re
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from minibatch.labs.source import LabSource, join_cjk_lines, parse

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


# A chapter's guards (the asserts that keep its claims true when it is re-run) live in code cells
# tagged "check": they run like any other cell, but JupyterLab shows them collapsed
# (``source_hidden``) and the book folds their input away (MyST-NB's ``hide-input``), so the
# learner's view holds the experiment, not its test (tests/test_chapters.py keeps visible cells short).
CHECK_TAG = "check"


def hide_check_cell(cell) -> None:
    """Mark a ``check`` cell collapsed in JupyterLab and folded in the book."""
    cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
    if "hide-input" not in cell.metadata["tags"]:
        cell.metadata["tags"].append("hide-input")


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """The unexecuted notebook of a percent-format source: its cells, each with its tags (and
    JupyterLab's ``jupyter`` display flags, e.g. a collapsed ``source_hidden`` cell) only;
    in Markdown cells, lines wrapped between two Chinese characters are joined."""
    import jupytext

    nb = jupytext.read(path, fmt="py:percent")
    cells = []
    for c in nb.cells:
        if c.cell_type == "markdown":
            cell = new_markdown_cell(join_cjk_lines(c.source))
        else:
            cell = new_code_cell(c.source)
        if c.metadata.get("tags"):
            cell.metadata["tags"] = list(c.metadata["tags"])
        if c.metadata.get("jupyter"):
            cell.metadata["jupyter"] = dict(c.metadata["jupyter"])
        if CHECK_TAG in cell.metadata.get("tags", []):
            hide_check_cell(cell)
        cells.append(cell)
    out = new_notebook(cells=cells)
    out.metadata["kernelspec"] = dict(KERNELSPEC)
    out.metadata["language_info"] = {"name": "python"}
    return out


def build_chapter(src: str | Path, out_dir: str | Path | None = None, timeout: int = 600,
                  execute_cells: bool = True, log=print) -> Path:
    """Execute a chapter source top to bottom and store it, with its outputs, as
    ``chapters/NN_slug.ipynb`` (``out_dir``: default, the source's parent's parent)."""
    import time

    src = Path(src)
    out_dir = Path(out_dir) if out_dir is not None else src.resolve().parent.parent
    nb = read_notebook(src)
    if execute_cells:
        t = time.perf_counter()
        aborted = execute(nb, cwd=out_dir, timeout=timeout)
        if aborted is not None:
            raise aborted
        clean_outputs(nb)
        add_widget_stills(nb)
        log(f"{src.stem}.ipynb: executed in {time.perf_counter() - t:.1f} s")
    out = out_dir / f"{src.stem}.ipynb"
    nbformat.validate(nb)
    nbformat.write(nb, str(out))
    return out


def make_notebook(src: LabSource, role: str) -> nbformat.NotebookNode:
    """The unexecuted notebook of ``role`` ``"reference"`` (solutions) or ``"learner"`` (stubs)."""
    cells = []
    for c in src.cells:
        if role == "learner" and c.hidden:
            continue                      # hidden checks live in the key only
        text = src.reference_source(c) if role == "reference" else src.stub_source(c)
        cell = new_markdown_cell(text) if c.kind == "markdown" else new_code_cell(text)
        cell.id = c.cell_id
        if c.tags:
            cell.metadata["tags"] = list(c.tags)
        cells.append(cell)
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["minibatch_lab"] = {"lab": src.lab_id, "role": role,
                                    "source": f"labs/src/{src.path.name}"}
    return nb


class _ThisPython(KernelSpecManager):
    """The "python3" kernel is this very interpreter, so it imports the same minibatch."""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="Python 3", language="python",
                          env={"PYDEVD_DISABLE_FILE_VALIDATION": "1",
                               # torch's OpenMP threads spin while they wait; on a busy CPU that
                               # slows a tiny-model run down several times over.
                               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})


class LabKernelManager(AsyncKernelManager):
    """A kernel of this interpreter that talks over Unix sockets where there are any.

    Over TCP (jupyter_client's default transport) ipykernel >= 7 warns on every start, "Kernel is
    running over TCP without encryption" (ipykernel/kernelapp.py, init_sockets), which every
    ``labs check`` printed. IPC sockets are files on this machine, not ports; their path is
    absolute (the kernel runs in the notebook's folder, the client in the caller's) and short
    (a Unix socket path has about 100 bytes), and jupyter_client removes them at shutdown.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("kernel_spec_manager", _ThisPython())
        kwargs.setdefault("kernel_name", "python3")
        if os.name == "posix":
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", os.path.join(tempfile.gettempdir(), f"minibatch-kernel-{uuid.uuid4().hex[:12]}"))
        super().__init__(**kwargs)


class ExecutionAborted(RuntimeError):
    """The kernel died; later cells did not run."""


# Run first in a reused kernel, so each notebook starts from an empty namespace.
_RESET = ("get_ipython().run_line_magic('reset', '-f')\n"
          "import matplotlib.pyplot as _plt\n_plt.close('all')\ndel _plt")


@contextmanager
def shared_kernel(cwd: str | Path):
    """One kernel for several notebooks (tests): imports are paid once, names are reset."""
    km = LabKernelManager()
    run_sync(km.start_kernel)(cwd=str(cwd))
    try:
        yield km
    finally:
        run_sync(km.shutdown_kernel)(now=True)


POLL_SLICE_S = 0.5


def sliced_get_msg(get_msg, slice_s: float = POLL_SLICE_S):
    """A channel's ``get_msg`` that waits in slices of ``slice_s`` seconds.

    The asyncio kernel client waits for a reply with one long ``poll(timeout)``. Under CPU
    load we saw that wait miss the socket's wake-up (an edge-triggered ZMQ descriptor): the
    execute reply sat in the socket while the client slept for the whole cell timeout (a
    chapter "took" 615 s instead of 15, with an idle kernel), then found it on the final
    check. Short polls look at the socket again every ``slice_s`` seconds, so a missed
    wake-up costs at most that much.
    """
    import time
    from queue import Empty

    async def get(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = slice_s if left is None else max(0.0, min(slice_s, left))
            try:
                return await get_msg(timeout=step)
            except Empty:
                if left is not None and left <= slice_s:
                    raise

    return get


# -- numbers in prose -------------------------------------------------------------------------
# A Markdown cell may hold replacement fields like an f-string's, in double braces:
# "连续批处理的吞吐是串行的 {{speedup:.1f}} 倍". The builder evaluates each field in the kernel
# at that point of the notebook (after the code cells above it) and stores the cell with the
# numbers filled in; the cell's source with its fields is kept in the cell's metadata
# (``minibatch.template``). So prose stays in Markdown cells, and every number in it comes
# from a cell: a field that fails to evaluate fails the build.
FIELD_RE = re.compile(r"\{\{(.+?)\}\}", re.S)


class ProseFieldError(ValueError):
    """A ``{{...}}`` field of a Markdown cell that could not be evaluated."""


def template_of(cell) -> str:
    """The source a stored Markdown cell was built from (its fields unfilled)."""
    return cell.get("metadata", {}).get("minibatch", {}).get("template", cell["source"]) \
        if cell.get("cell_type") == "markdown" else cell["source"]


def _client_class():
    import ast

    from nbclient import NotebookClient

    class Client(NotebookClient):
        """nbclient's client, with its shell and IOPub waits in short slices (sliced_get_msg)
        and the ``{{...}}`` fields of Markdown cells filled from the kernel."""

        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = sliced_get_msg(channel.get_msg)
            return kc

        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            skip = getattr(self, "skip_cell", None)
            if skip is not None and cell.cell_type == "code" and skip(cell):
                cell.outputs, cell.execution_count = [], None
                cell.metadata.setdefault("minibatch", {})["skipped"] = True
                return cell
            if cell.cell_type != "markdown" or "{{" not in cell.source:
                return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
            template = template_of(cell)
            fields = FIELD_RE.findall(template)
            if not fields:
                return cell
            exprs = {f"f{i}": "f" + repr("{" + field.strip() + "}") for i, field in enumerate(fields)}
            from jupyter_core.utils import ensure_async

            msg_id = await ensure_async(self.kc.execute("", silent=True, store_history=False,
                                                        user_expressions=exprs))
            reply = await self.async_wait_for_reply(msg_id, cell)
            results = (reply or {}).get("content", {}).get("user_expressions", {})
            values = []
            for i, field in enumerate(fields):
                res = results.get(f"f{i}", {})
                if res.get("status") != "ok":
                    raise ProseFieldError(f"cell {cell_index}: the prose field {{{{{field}}}}} failed: "
                                          f"{res.get('ename', 'no reply')}: {res.get('evalue', '')}")
                values.append(ast.literal_eval(res["data"]["text/plain"]))
            it = iter(values)
            cell.source = FIELD_RE.sub(lambda m: next(it), template)
            cell.metadata.setdefault("minibatch", {})["template"] = template
            return cell

    return Client


def execute(nb: nbformat.NotebookNode, cwd: str | Path, timeout: int = 300,
            allow_errors: bool = False, km: LabKernelManager | None = None,
            skip=None) -> ExecutionAborted | None:
    """Run ``nb`` in place; return the reason if the kernel died before the end.

    A fresh kernel runs it unless ``km`` (from :func:`shared_kernel`) is given. Building
    (``allow_errors=False``): the first error or timeout raises. Grading
    (``allow_errors=True``): every cell runs; a cell that runs past ``timeout`` seconds
    is interrupted and shows a ``KeyboardInterrupt`` error, and the next cell runs.
    ``skip(cell)``, asked before each code cell: True leaves it unrun (no outputs, its
    metadata ``minibatch.skipped`` set).
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    NotebookClient = _client_class()

    # shutdown_kernel="immediate": once the last cell is done the kernel is killed (SIGKILL to its
    # process group, a bounded wait), never asked to exit: a kernel's Python exits only after every
    # non-daemon thread a notebook left running has ended, which may be never
    # (tests/test_notebook_shutdown.py; nbval stops its kernels the same way).
    run_nb = nb
    reset = new_code_cell(_RESET)
    if km is not None:
        run_nb = copy.copy(nb)
        run_nb.cells = [reset] + list(nb.cells)
    client = NotebookClient(run_nb, km=km, kernel_manager_class=LabKernelManager, kernel_name="python3",
                            timeout=timeout, timeout_func=lambda cell: 600 if cell is reset else timeout,
                            allow_errors=allow_errors, interrupt_on_timeout=allow_errors,
                            shutdown_kernel="immediate", record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.skip_cell = skip
    aborted = None
    try:
        client.execute(cwd=str(cwd))
    except (CellExecutionError, CellTimeoutError):
        raise
    except (DeadKernelError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        aborted = ExecutionAborted(f"{type(e).__name__}: {first}")
    finally:
        if km is not None:
            if client.kc is not None:
                client.kc.stop_channels()
            if aborted is not None:
                run_sync(km.restart_kernel)(now=True)
            elif any(o.output_type == "error" for o in reset.outputs):
                raise RuntimeError(f"could not reset the shared kernel: {reset.outputs}")
    return aborted


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_HINT = ("[an interactive figure: the picture shows it as it was first drawn. Run the cells above and this "
               "one in JupyterLab (make course) to move its controls.]")


WIDGET_TEXT_HINT = ("[an interactive explorer: above is what it printed when it was first run. Run the cells above "
                    "and this one in JupyterLab (make course) to move its controls.]")


def add_widget_stills(nb) -> int:
    """Give every stored widget output that has no picture the first figure its ``Output`` area
    drew (``ipywidgets.interact``), from the widget state nbclient saved in the notebook, and a
    one-line hint as ``text/plain``, so that the book, GitHub and a JupyterLab that has not run
    the cell show the figure instead of ``interactive(children=...)`` text; a live kernel still
    renders the widget, the richest type. An explorer that prints instead of drawing gets what it
    printed first as its ``text/plain``, with a hint. Returns the number of outputs changed."""
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def first_output(model_id: str, seen: set, kind: str) -> str | None:
        model = state.get(model_id)
        if model is None or model_id in seen:
            return None
        seen.add(model_id)
        outs = model.get("state", {}).get("outputs", []) or []
        if kind == "png":
            for out in outs:
                png = out.get("data", {}).get("image/png")
                if png:
                    return png
        else:
            text = "".join(_text(out.get("text", "")) for out in outs if out.get("output_type") == "stream")
            text += "".join(_text(out.get("data", {}).get("text/plain", "")) for out in outs
                            if out.get("output_type") in ("display_data", "execute_result"))
            if text.strip():
                return text
        for child in model.get("state", {}).get("children", []) or []:
            if isinstance(child, str) and child.startswith("IPY_MODEL_"):
                found = first_output(child[len("IPY_MODEL_"):], seen, kind)
                if found:
                    return found
        return None

    added = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data", {})
            if WIDGET_VIEW not in data or "image/png" in data:
                continue
            if _text(data.get("text/plain", "")).endswith(WIDGET_TEXT_HINT):
                continue                                        # already given its still
            model_id = data[WIDGET_VIEW].get("model_id", "")
            png = first_output(model_id, set(), "png")
            if png:
                data["image/png"] = png
                data["text/plain"] = WIDGET_HINT
                added += 1
                continue
            text = first_output(model_id, set(), "text")
            if text:
                data["text/plain"] = text.rstrip("\n") + "\n" + WIDGET_TEXT_HINT
                added += 1
    return added


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def clean_outputs(nb: nbformat.NotebookNode) -> None:
    """Drop what differs from run to run and means nothing: cell execution metadata, and
    where the kernel happened to split a cell's printed text into several stream messages."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        merged = []
        for out in cell.outputs:
            prev = merged[-1] if merged else None
            if (out.output_type == "stream" and prev is not None and prev.output_type == "stream"
                    and prev.name == out.name):
                prev.text += out.text
            else:
                merged.append(out)
        cell.outputs = merged
    nb.metadata["language_info"] = {"name": "python"}


def learner_from_key(src: LabSource, key: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The learner notebook: the key's cells and outputs, task cells replaced by stubs, and the
    key's hidden check cells left out."""
    nb = copy.deepcopy(key)
    by_id = {c.cell_id: c for c in src.cells}
    nb.cells = [cell for cell in nb.cells if not by_id[cell.id].hidden]
    for cell in nb.cells:
        scell = by_id[cell.id]
        if scell.tasks:
            cell.source = src.stub_source(scell)
    nb.metadata["minibatch_lab"] = dict(key.metadata["minibatch_lab"], role="learner")
    return nb


def build_lab(lab, timeout: int = 300, log=print, km=None) -> tuple[Path, Path]:
    """Execute the reference and write the key and the learner notebook; return their paths.

    The reference runs top to bottom in a fresh kernel (or in ``km``, see :func:`shared_kernel`);
    any error stops the build.
    """
    src = parse(lab.source_path, lab.lab_id)
    nb = make_notebook(src, "reference")
    log(f"{lab.lab_id}: executing the reference solution ...")
    aborted = execute(nb, cwd=lab.root, timeout=timeout, km=km)
    if aborted is not None:
        raise aborted
    clean_outputs(nb)
    add_widget_stills(nb)
    nb.metadata["minibatch_lab"]["role"] = "key"
    lab.key_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.validate(nb)
    nbformat.write(nb, str(lab.key_path))
    learner = learner_from_key(src, nb)
    nbformat.write(learner, str(lab.notebook_path))
    log(f"{lab.lab_id}: wrote {lab.notebook_path.name} and keys/{lab.key_path.name}")
    return lab.notebook_path, lab.key_path
