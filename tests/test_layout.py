"""The test tree's own packages must not shadow installed packages.

pytest puts ``tests/`` on ``sys.path`` for the test packages inside it (``tests/cluster``,
``tests/kernel_tests``), so a test package named like an installed distribution's top-level
module hides it from everything in the process. ``tests/kernels`` did exactly that to Hugging
Face's ``kernels`` package, which ``transformers`` imports: the tiny-model dashboard test
failed with "cannot import name 'CUDAProperties' from 'kernels'" whenever a kernel test ran
in the same worker.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_package_shadows_an_installed_top_level_module():
    installed = packages_distributions()
    ours = sorted(p.parent.name for p in TESTS.glob("*/__init__.py"))
    assert ours, "expected test packages under tests/"
    clashes = {name: installed[name] for name in ours if name in installed}
    assert not clashes, f"test packages named like installed modules (rename them): {clashes}"


def test_no_benchmark_script_shadows_an_installed_top_level_module():
    """``python benchmarks/x.py`` puts benchmarks/ first on sys.path: ``benchmarks/kernels.py``
    hid Hugging Face's ``kernels`` from transformers, and ``python benchmarks/router.py`` failed."""
    installed = packages_distributions()
    scripts = sorted(p.stem for p in (TESTS.parent / "benchmarks").glob("*.py"))
    clashes = {name: installed[name] for name in scripts if name in installed}
    assert not clashes, f"benchmark scripts named like installed modules (rename them): {clashes}"
