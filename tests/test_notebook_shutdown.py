"""Executing a notebook ends when its cells end: neither the course's builder nor nbval can
stall at kernel shutdown, even when a notebook leaves threads running (the kernel is
killed, not asked to exit, and a Python that would wait for its non-daemon threads never
gets the chance). The threads the course itself starts are daemons."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from minibatch.labs.builder import KERNELSPEC, execute

BOUND_S = 240      # far above the few seconds it takes; only a stall reaches it

LEFT_RUNNING = """\
import os, threading, time
open({pid_file!r}, "w").write(str(os.getpid()))
stuck = threading.Thread(target=time.sleep, args=(10 ** 6,), name="non-daemon, never ends")
stuck.start()
threading.Thread(target=time.sleep, args=(10 ** 6,), daemon=True).start()
print("cells done")
"""


def notebook(pid_file) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_code_cell(LEFT_RUNNING.format(pid_file=str(pid_file)))])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    return nb


def assert_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:                                        # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"kernel {pid} still alive")


def test_the_builder_ends_and_kills_the_kernel_though_threads_are_left_running(tmp_path):
    pid_file = tmp_path / "kernel.pid"
    nb = notebook(pid_file)
    t0 = time.monotonic()
    execute(nb, cwd=tmp_path, timeout=120)
    assert time.monotonic() - t0 < BOUND_S
    assert "cells done" in nb.cells[0].outputs[0]["text"]
    assert_gone(int(pid_file.read_text()))


def test_nbval_ends_and_kills_the_kernel_though_threads_are_left_running(tmp_path):
    pid_file = tmp_path / "kernel.pid"
    path = tmp_path / "left_running.ipynb"
    nbformat.write(notebook(pid_file), str(path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                           "--nbval-current-env", str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=BOUND_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    assert_gone(int(pid_file.read_text()))


def test_threads_the_course_starts_are_daemons(monkeypatch):
    """run_benchmark from a running event loop (as in a notebook) runs in a thread of its own;
    the live runs and dashboards of the widgets run in daemon threads too."""
    import minibatch.bench.client as client

    started = []

    class Recording(threading.Thread):
        def start(self):
            started.append(self)
            super().start()

    async def fake_benchmark(**kw):
        return {"ok": True}

    monkeypatch.setattr(client.threading, "Thread", Recording)
    monkeypatch.setattr(client, "benchmark", fake_benchmark)

    async def in_a_notebook():
        return client.run_benchmark(base_url="http://127.0.0.1:9")

    assert asyncio.run(in_a_notebook()) == {"ok": True}
    assert started and all(t.daemon for t in started)

    pytest.importorskip("ipywidgets")
    from minibatch.widgets.dashboard import Refresher
    from minibatch.widgets.live import LiveRun
    from minibatch.workload import RequestSpec, Workload

    refresher = Refresher(lambda: False, fps=10, on_error=print)
    assert refresher.thread.daemon
    refresher.stop()
    run = LiveRun(Workload([RequestSpec(0.0, 16, 4)]), dict(executor="sim", model="llama-2-7b")).start()
    assert run._thread.daemon
    run.stop()
    run._thread.join(60)
    assert not run._thread.is_alive()
