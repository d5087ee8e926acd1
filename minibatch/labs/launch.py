"""Open the course in JupyterLab: what ``make course`` runs once ``.venv`` is set up.

    python -m minibatch.labs course [--host 127.0.0.1] [--port 8888] [--browser auto|yes|no]

JupyterLab serves the learner's working copy of the course, ``workspace/`` in the checkout
(``--workdir``; ignored by Git), and opens its landing page, ``COURSE.md``, first, as a
rendered page. Running a notebook writes its outputs into the notebook, so the learner works on
copies: the first start copies every chapter and lab notebook there, and no later start
overwrites one (a notebook added to the course since is copied in); the landing page and the
reference pages are refreshed every time. The tracked notebooks stay as they are, so
``git pull`` never meets a learner's edits; ``python -m minibatch.labs reset 05`` (or ``L03``)
puts one notebook back as shipped.  ``tools/jupyterlab/overrides.json`` (the app
settings directory JupyterLab is given) makes Markdown files open in the Markdown preview
and answers "never" to JupyterLab's offer of a news feed and update check (both would reach
the internet). A learner's own settings still win. The same command works for every learner:

* as root (containers, cloud VMs) it passes ``--allow-root``, which JupyterLab otherwise
  demands and exits without;
* on a machine without a display (Linux with neither ``$DISPLAY`` nor ``$WAYLAND_DISPLAY``,
  e.g. over SSH) it opens no browser; on a desktop JupyterLab opens one;
* it binds to 127.0.0.1 unless told otherwise, uses the next free port when the asked one is
  taken, and prints one ready line with the URL (token included) once the server answers.

Ctrl-C (or SIGTERM, SIGHUP) stops JupyterLab and its kernels; it then exits 0. If JupyterLab
exits by itself (a port taken meanwhile, a broken install), its exit status is passed on.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LANDING = "COURSE.md"
SETTINGS = Path("tools") / "jupyterlab"           # overrides.json, relative to the checkout
WORKDIR = "workspace"                             # the learner's copies, relative to the checkout
# Read-only pages the landing page links to: copied afresh at every start.
REFERENCE_PAGES = ("labs/README.md", "datasets/README.md", "datasets/traces/SOURCES.md", "docs/glossary.md")
READY = "The minibatch course is ready. Open this URL in a browser:"
PORT_TRIES = 50


def has_display() -> bool:
    """Whether a browser window could be opened here."""
    if sys.platform.startswith("linux") or "bsd" in sys.platform:
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True                                      # macOS and Windows always have one


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def free_port(host: str, first: int, tries: int = PORT_TRIES) -> int:
    """``first`` if nothing listens there, else the next port that is free (as JupyterLab would)."""
    bind_host = "" if host in ("0.0.0.0", "::") else host
    for port in range(first, first + tries):
        with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET) as s:
            try:
                s.bind((bind_host, port))
                return port
            except OSError:
                continue
    raise SystemExit(f"error: ports {first}-{first + tries - 1} are all in use; choose one with PORT=")


def course_root(root: str | None) -> Path:
    """The folder JupyterLab serves: ``--root``, else the current folder or this checkout,
    whichever holds the landing page."""
    candidates = [Path(root)] if root else [Path.cwd(), Path(__file__).resolve().parents[2]]
    for c in candidates:
        if (c / LANDING).exists():
            return c.resolve()
    raise SystemExit(f"error: no {LANDING} in {', '.join(map(str, candidates))}; run this from the checkout")


def notebooks(root: Path) -> list[str]:
    """The course's notebooks, relative to the checkout: chapters and the labs' learner versions."""
    found = sorted((root / "chapters").glob("[0-9][0-9]_*.ipynb")) + sorted((root / "labs").glob("L[0-9][0-9]_*.ipynb"))
    return [p.relative_to(root).as_posix() for p in found]


def prepare_workspace(root: Path, work: Path) -> list[str]:
    """Fill ``work`` with the learner's copies; return the notebooks copied now.

    A notebook is copied only when ``work`` has none of that name: a learner's copy is never
    overwritten. The landing page and the reference pages are copied every time."""
    copied = []
    for rel in notebooks(root):
        dest = work / rel
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest)
            copied.append(rel)
    for rel in (LANDING, *REFERENCE_PAGES):
        if (root / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, work / rel)
    return copied


def reset_notebook(root: Path, work: Path, name: str) -> tuple[Path, Path | None]:
    """Put notebook ``name`` (``05``, ``5``, ``L03``) in ``work`` back as shipped; the learner's copy
    is kept beside it as ``*.ipynb.bak``. Returns ``(notebook, backup or None)``."""
    key = name.strip().upper()
    key = f"{int(key):02d}" if key.isdigit() else key
    matches = [rel for rel in notebooks(root) if Path(rel).name.upper().startswith(key + "_")]
    if not matches:
        raise FileNotFoundError(f"no chapter or lab notebook {name!r} in {root}")
    dest = work / matches[0]
    backup = None
    if dest.exists():
        backup = dest.with_name(dest.name + ".bak")
        shutil.copyfile(dest, backup)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(root / matches[0], dest)
    return dest, backup


def jupyter_command(root: Path, host: str, port: int, browser: bool, settings: Path | None = None) -> list[str]:
    """JupyterLab serving ``root``; ``settings``: the app settings folder (the checkout's by default)."""
    settings = settings or Path(__file__).resolve().parents[2] / SETTINGS
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", f"--ServerApp.ip={host}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--LabApp.default_url=/lab/tree/{LANDING}", f"--LabApp.app_settings_dir={settings}"]
    if not browser:
        cmd.append("--no-browser")
    if is_root():
        cmd.append("--allow-root")
    return cmd


def wait_ready(proc: subprocess.Popen, url: str, token: str, timeout: float) -> bool:
    """Poll ``/api/status`` until it answers (True), the server exits or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.labs course", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8888, help="port (the next free one if taken)")
    ap.add_argument("--browser", choices=("auto", "yes", "no"), default="auto",
                    help="open a browser: auto = only where there is a display")
    ap.add_argument("--root", help="the checkout (default: this one)")
    ap.add_argument("--workdir", help=f"the learner's copies (default: {WORKDIR}/ in the checkout)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for JupyterLab to answer")
    args = ap.parse_args(argv)

    root = course_root(args.root)
    work = (Path(args.workdir) if args.workdir else root / WORKDIR).resolve()
    first = not work.exists()
    copied = prepare_workspace(root, work)
    if copied:
        print(f"{'made your working copy of the course' if first else 'copied new notebooks'} in {work} "
              f"({len(copied)} notebooks; later starts never overwrite them)", flush=True)
    port = free_port(args.host, args.port)
    if port != args.port:
        print(f"port {args.port} is in use; using {port}", flush=True)
    browser = {"yes": True, "no": False}.get(args.browser, has_display())
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    env = dict(os.environ, JUPYTER_TOKEN=token)      # not on the command line, where `ps` shows it
    local = "127.0.0.1" if args.host in ("0.0.0.0", "", "localhost") else args.host
    shown = socket.gethostname() if args.host in ("0.0.0.0", "::") else local
    base = f"http://{'[' + local + ']' if ':' in local else local}:{port}"

    # JupyterLab runs in a session of its own so that it gets one signal, from here: a Ctrl-C
    # that reached it too would be a second one during its shutdown, and could leave kernels.
    proc = subprocess.Popen(jupyter_command(work, args.host, port, browser, root / SETTINGS), cwd=work, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    stops: list[float] = []

    def stop(sig, frame):
        # The first signal asks JupyterLab to stop (it shuts its kernels down); a Ctrl-C pressed
        # again while it does is ignored, and only one 15 s later kills it.
        if proc.poll() is not None:
            return
        if not stops:
            print("stopping JupyterLab ...", flush=True)
            proc.send_signal(signal.SIGTERM)
        elif time.monotonic() - stops[0] > 15:
            proc.kill()
        stops.append(time.monotonic())

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    if wait_ready(proc, base, token, args.start_timeout):
        url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}/lab/tree/{LANDING}?token={token}"
        print(f"\n{READY}\n\n    {url}\n\n(Ctrl-C stops it.)\n", flush=True)
    elif proc.poll() is None and not stops:
        print(f"JupyterLab did not answer {base} within {args.start_timeout:.0f} s; still waiting", flush=True)
    code = proc.wait()
    return 0 if stops and code in (0, -signal.SIGTERM) else code
