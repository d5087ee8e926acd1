"""``python -m minibatch`` with a Python that lacks the project's packages (the system Python
instead of ``.venv/bin/python``) says what to run instead of ending in a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bare_python(*args: str) -> subprocess.CompletedProcess:
    """This interpreter without its site-packages (``-S``): no torch, numpy, transformers ...,
    as a system Python is; ``minibatch`` itself is found in the checkout (the working folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    return subprocess.run([sys.executable, "-S", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_without_dependencies_says_what_to_run():
    r = _bare_python("-m", "minibatch", "generate", "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: minibatch needs the Python package"), r.stderr
    assert "make setup" in r.stderr and ".venv/bin/python -m minibatch" in r.stderr


def test_import_works_and_a_missing_dependency_names_the_fix():
    code = ("import minibatch\n"
            "try:\n    import torch\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)\n")
    r = _bare_python("-c", code)
    assert r.returncode == 0, r.stderr
    name, _, message = r.stdout.partition(" | ")
    assert name == "torch" and "make setup" in message and ".venv/bin/python" in message, r.stdout


def test_with_the_dependencies_nothing_is_hooked():
    r = subprocess.run([sys.executable, "-c", "import sys, minibatch; print(minibatch._MISSING, "
                        "sys.excepthook is sys.__excepthook__)"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split() == ["[]", "True"], r
