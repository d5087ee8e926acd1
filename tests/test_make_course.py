"""The README's first command, run the way a learner runs it.

``make course`` is ``setup`` and then ``$(COURSE)``; ``make open-course`` runs that same
``$(COURSE)`` without the setup step, so these tests run exactly the learner's command and
install nothing. Headless (no ``$DISPLAY``), as root where the suite runs as root, on a free
port, with its working copy in a temporary folder: wait for the ready line, read chapter 01
(the learner's copy) through JupyterLab's contents API, open the
landing page and chapter 01 in headless Chromium (screenshots in ``artifacts/course/`` or
``$MINIBATCH_ARTIFACTS``), then press Ctrl-C (SIGINT to the process group, as a terminal
does) and check that everything it started, kernels included, has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from minibatch.labs.launch import LANDING, READY

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
START_S = 240          # a busy 2-core machine can take a while to import JupyterLab
STOP_S = 60
CHAPTER_01_HEADING = "课程导入：动态批处理的价值与挑战"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _artifacts() -> Path:
    from minibatch.config import env
    out = Path(env("MINIBATCH_ARTIFACTS") or ROOT / "artifacts") / "course"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _descendants(pid: int) -> list:
    psutil = pytest.importorskip("psutil")
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@contextlib.contextmanager
def make_course(tmp_path: Path):
    """``make open-course`` on a free port; yields ``(url, base, token)``; on exit, Ctrl-C and
    check that make, the launcher, JupyterLab and its kernels are all gone."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "JUPYTER_TOKEN")}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), PYTHONUNBUFFERED="1")
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # BIN: the interpreter running the tests (the Makefile's is .venv/bin, the same one under `make test`).
    cmd = ["make", "--no-print-directory", "open-course", f"PORT={port}", f"BIN={Path(sys.executable).parent}",
           f"WORKDIR={tmp_path / 'work'}"]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    log = lambda: f"stdout:\n{out_path.read_text()}\nstderr:\n{err_path.read_text()[-4000:]}"  # noqa: E731
    started = []
    try:
        deadline = time.monotonic() + START_S
        url = None
        while url is None:
            m = re.search(re.escape(READY) + r"\s+(http://\S+)", out_path.read_text())
            if m:
                url = m.group(1)
            elif proc.poll() is not None:
                pytest.fail(f"make open-course exited with {proc.returncode} before it was ready\n{log()}")
            elif time.monotonic() > deadline:
                pytest.fail(f"no ready line within {START_S} s\n{log()}")
            else:
                time.sleep(0.5)
        token = re.search(r"token=([0-9a-f]+)", url).group(1)
        base = url.split("/lab/")[0]
        assert url == f"http://127.0.0.1:{port}/lab/tree/{LANDING}?token={token}"
        started = _descendants(proc.pid)
        yield url, base, token
        started = _descendants(proc.pid)             # the kernels opened meanwhile too
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)         # Ctrl-C in the terminal
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for p in _descendants(proc.pid):
                p.kill()
            pytest.fail(f"make open-course did not stop within {STOP_S} s of Ctrl-C\n{log()}")
    # It stopped: nothing it started may be left running (kernels run in sessions of their own).
    psutil = pytest.importorskip("psutil")
    gone, alive = psutil.wait_procs(started, timeout=STOP_S)
    assert not alive, f"left running after Ctrl-C: {[p.cmdline() for p in alive]}\n{log()}"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the port still answers after Ctrl-C"
    assert "stopping JupyterLab" in out_path.read_text()


def _get(base: str, path: str, token: str) -> bytes:
    req = urllib.request.Request(f"{base}{path}", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def test_make_course_serves_the_course(tmp_path):
    """Headless and as whoever runs the suite (root in CI): ready line, landing page, chapter 01."""
    with make_course(tmp_path) as (url, base, token):
        landing = json.loads(_get(base, f"/api/contents/{LANDING}?type=file&format=text&content=1", token))["content"]
        assert "chapters/01_intro.ipynb" in landing and "python -m minibatch.labs check L01" in landing
        nb = json.loads(_get(base, "/api/contents/chapters/01_intro.ipynb?content=1", token))["content"]
        headings = [line for c in nb["cells"] if c["cell_type"] == "markdown"
                    for line in c["source"].splitlines() if line.startswith("#")]
        assert any(CHAPTER_01_HEADING in h for h in headings), headings[:5]
        outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
        assert any("image/png" in o.get("data", {}) for o in outputs), "chapter 01 has no stored figure"
        assert b"JupyterLab" in _get(base, f"/lab/tree/{LANDING}", token)
        # It serves the learner's copies, not the checkout: running a chapter leaves chapters/ as it is.
        served = {item["name"] for item in json.loads(_get(base, "/api/contents/", token))["content"]}
        assert {"COURSE.md", "chapters", "labs"} <= served and "minibatch" not in served, served
        assert (tmp_path / "work" / "chapters" / "01_intro.ipynb").exists()


def test_make_course_in_a_browser(tmp_path):
    """What the learner sees: the landing page, then chapter 01 through its link."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    from playwright.sync_api import sync_playwright

    shots = _artifacts()
    with make_course(tmp_path) as (url, base, token), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="domcontentloaded", timeout=120_000)
            landing = page.locator(".jp-MarkdownViewer .jp-RenderedMarkdown")
            landing.locator("h1").first.wait_for(timeout=120_000)
            assert "动态批处理" in landing.locator("h1").first.inner_text()
            assert landing.locator("table").count() >= 4           # three stages and the labs
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots / "landing.png"))
            landing.locator("a", has_text=CHAPTER_01_HEADING).first.click()
            nb = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
            nb.locator("h1", has_text=CHAPTER_01_HEADING).first.wait_for(timeout=120_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots / "chapter01.png"))
            img = nb.locator(".jp-OutputArea-output img").first
            img.scroll_into_view_if_needed(timeout=60_000)
            page.wait_for_function("(el) => el.complete && el.naturalWidth > 0", arg=img.element_handle(),
                                   timeout=60_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(shots / "chapter01_figure.png"))
        finally:
            browser.close()


def test_course_and_open_course_run_the_same_command():
    """So the tests above run exactly the README's command, minus the install."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = lambda target: subprocess.run(["make", "-n", "--no-print-directory", target, "PORT=9999"], cwd=ROOT,  # noqa: E731
                                        capture_output=True, text=True, check=True).stdout.strip().splitlines()
    course, open_course = dry("course"), dry("open-course")
    assert open_course == course[-1:], (course, open_course)
    assert "-m minibatch.labs course" in open_course[0] and "--port 9999" in open_course[0]
    assert "--host 127.0.0.1" in open_course[0] and "--workdir workspace" in open_course[0]


def test_working_copy_is_made_once_and_never_overwritten(tmp_path):
    from minibatch.labs.course import chapter_files, lab_files
    from minibatch.labs.launch import notebooks, prepare_workspace

    work = tmp_path / "work"
    shipped = notebooks(ROOT)
    expected = len(chapter_files(ROOT)) + len(lab_files(ROOT))                 # every stored notebook
    assert len(shipped) == expected >= 40 and prepare_workspace(ROOT, work) == shipped
    assert (work / LANDING).read_text(encoding="utf-8") == (ROOT / LANDING).read_text(encoding="utf-8")
    mine = work / "chapters" / "05_continuous_batching.ipynb"
    mine.write_text("{}", encoding="utf-8")                                    # the learner ran and saved it
    (work / "labs" / "L03_continuous.ipynb").unlink()                          # or deleted one
    (work / LANDING).write_text("old", encoding="utf-8")
    assert prepare_workspace(ROOT, work) == ["labs/L03_continuous.ipynb"]      # only the missing one
    assert mine.read_text(encoding="utf-8") == "{}"
    assert (work / LANDING).read_text(encoding="utf-8") == (ROOT / LANDING).read_text(encoding="utf-8")
    for rel in ("labs/README.md", "datasets/README.md"):                       # pages the landing page links
        assert (work / rel).exists(), rel


def test_reset_puts_one_notebook_back_and_keeps_the_learners(tmp_path):
    from minibatch.labs.launch import prepare_workspace

    work = tmp_path / "work"
    prepare_workspace(ROOT, work)
    mine = work / "chapters" / "05_continuous_batching.ipynb"
    mine.write_text("{}", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "minibatch.labs", "reset", "5", "--workdir", str(work)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert mine.read_bytes() == (ROOT / "chapters" / "05_continuous_batching.ipynb").read_bytes()
    assert (work / "chapters" / "05_continuous_batching.ipynb.bak").read_text(encoding="utf-8") == "{}"
    bad = subprocess.run([sys.executable, "-m", "minibatch.labs", "reset", "L99", "--workdir", str(work)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no chapter or lab notebook 'L99'" in bad.stderr


@pytest.mark.parametrize("root,display,allow_root,no_browser", [
    (True, None, True, True), (False, None, False, True), (True, ":0", True, False), (False, ":0", False, False)])
def test_jupyter_flags_for_root_and_headless(monkeypatch, tmp_path, root, display, allow_root, no_browser):
    from minibatch.labs import launch

    monkeypatch.setattr(launch.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if display:
        monkeypatch.setenv("DISPLAY", display)
    else:
        monkeypatch.delenv("DISPLAY", raising=False)
    if sys.platform.startswith("linux"):
        assert launch.has_display() is bool(display)
    cmd = launch.jupyter_command(tmp_path, "127.0.0.1", 8888, browser=launch.has_display())
    assert ("--allow-root" in cmd) is allow_root
    if sys.platform.startswith("linux"):
        assert ("--no-browser" in cmd) is no_browser
    assert f"--LabApp.default_url=/lab/tree/{LANDING}" in cmd and "--ServerApp.port_retries=0" in cmd
    assert not any("token" in c.lower() for c in cmd), "the token goes by environment, not argv"


def test_a_taken_port_moves_to_the_next_free_one():
    from minibatch.labs.launch import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert free_port("127.0.0.1", port) > port
