"""``python -m minibatch.labs check`` prints the report and nothing from the kernel's start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_labs_check_stderr_has_no_kernel_transport_warning():
    pytest.importorskip("ipykernel")
    r = subprocess.run([sys.executable, "-m", "minibatch.labs", "check", "L01", "labs/L01_metrics.ipynb"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "0/4 tasks pass" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    # ipykernel >= 7 warns at every start over TCP ("Kernel is running over TCP without encryption").
    assert "TCP" not in r.stderr and "WARNING" not in r.stderr, r.stderr
