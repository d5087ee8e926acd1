"""Real-browser smoke test: a dashboard in JupyterLab, driven from headless Chromium.

Starts JupyterLab on 127.0.0.1 (token, temporary config, settings and notebook dirs),
opens a notebook whose cell shows a simulated ``Dashboard``, runs it, clicks Start,
changes the policy from the page, and checks that the kernel applied the change (the
status line names it) and that the live image keeps changing. A screenshot goes to
``artifacts/browser/`` (or ``$MINIBATCH_ARTIFACTS``). Skipped when Debian's chromium or
the ``playwright`` package is missing. Takes ~30-60 s.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _requirements():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                        "(pip install playwright; the browser is Debian's chromium, not a download)")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NOTEBOOK_CELL = """\
from minibatch.widgets import Dashboard
dash = Dashboard(workload="chat", num_requests=400, request_rate=8.0, speed=4,
                 executor="sim", model="llama-2-7b", hardware="a100-80g")
dash
"""


@pytest.fixture()
def jupyterlab(tmp_path):
    _requirements()
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "dash", "metadata": {}, "outputs": [],
                     "source": NOTEBOOK_CELL}],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    (nbdir / "dash.ipynb").write_text(json.dumps(nb))
    config = tmp_path / "config"
    (config / "labconfig").mkdir(parents=True)
    # Expose the app object (to run cells by command) and skip the news pop-up.
    (config / "labconfig" / "page_config.json").write_text(json.dumps({
        "exposeAppInBrowser": True,
        "disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.root_dir={nbdir}", f"--IdentityProvider.token={token}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
         "--ServerApp.open_browser=False", "--allow-root"],
        cwd=nbdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 60:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text())
                time.sleep(0.3)
        yield f"{base}/lab/tree/dash.ipynb?token={token}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _other_policy() -> str:
    from minibatch.policies import available
    names = [p for p in available() if p != "continuous"]
    for p in ("sjf", "priority", "fair", "mlfq", "lpm"):
        if p in names:
            return p
    return names[0] if names else "continuous"


def _wait(page, predicate_js: str, arg=None, timeout_s: float = 60.0):
    page.wait_for_function(predicate_js, arg=arg, timeout=timeout_s * 1000)


def test_dashboard_in_jupyterlab(jupyterlab):
    from playwright.sync_api import sync_playwright

    artifacts = Path(os.environ.get("MINIBATCH_ARTIFACTS", ROOT / "artifacts")) / "browser"
    artifacts.mkdir(parents=True, exist_ok=True)
    other = _other_policy()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(jupyterlab, wait_until="domcontentloaded", timeout=90_000)
            _wait(page, "() => window.jupyterapp && document.querySelector('.jp-Notebook')", timeout_s=90)
            # Wait for the kernel, then run the cell.
            _wait(page, "() => { const s = window.jupyterapp.shell.currentWidget; "
                        "return s && s.sessionContext && s.sessionContext.session && "
                        "s.sessionContext.session.kernel && "
                        "s.sessionContext.session.kernel.status === 'idle'; }", timeout_s=90)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            img = page.locator(".jp-OutputArea img").first
            img.wait_for(timeout=90_000)
            src0 = img.get_attribute("src")
            page.locator(".jp-OutputArea .widget-button", has_text="Start").click()
            _wait(page, "([s]) => { const i = document.querySelector('.jp-OutputArea img'); "
                        "return i && i.src !== s; }", arg=[src0])
            _wait(page, "() => document.querySelector('.jp-OutputArea').innerText.includes('running')")
            select = page.locator(".widget-dropdown", has=page.locator("label", has_text="policy")).locator("select")
            select.select_option(other)
            _wait(page, "([p]) => document.querySelector('.jp-OutputArea').innerText"
                        ".includes('last change: policy=' + p)", arg=[other])
            src1 = img.get_attribute("src")
            _wait(page, "([s]) => document.querySelector('.jp-OutputArea img').src !== s", arg=[src1])
            page.wait_for_timeout(3000)                       # a few more seconds of the run on screen
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
            text = page.locator(".jp-OutputArea").first.inner_text()
            assert f"last change: policy={other}" in text
            assert "Error" not in text
        finally:
            browser.close()
