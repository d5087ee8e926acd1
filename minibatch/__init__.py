"""minibatch: a compact LLM inference engine and a course on dynamic batching.

The offline API follows vLLM's::

    from minibatch import LLM, SamplingParams
    llm = LLM(model="tiny", max_num_seqs=16, policy="continuous")
    outs = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=32))

The names below are imported on first use (PEP 562), so ``import minibatch`` (and the
torch-free parts: the load generator, workloads, the tiny corpus) does not import torch.
"""

import importlib
import importlib.util
import os
import sys

# OpenMP threads that spin while waiting make every torch op dozens of times slower as
# soon as another busy process shares the cores (a notebook kernel beside a server, a
# test run beside a build). Passive waiting costs little when the machine is idle.
# It only takes effect if torch has not been imported yet; set it yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Whether torch's OpenMP threads sleep between parallel regions (as far as we can tell:
# the policy torch's runtime read when it loaded, now or earlier). The fused CPU decode's
# helper thread (minibatch/kernels/cpu_decode.c) runs only then: beside OpenMP threads
# that spin for milliseconds after every region it would fight them for the cores.
OMP_THREADS_SLEEP = (os.environ["OMP_WAIT_POLICY"].strip().upper() == "PASSIVE"
                     and os.environ.get("GOMP_SPINCOUNT", "0").strip() in ("0", ""))

__version__ = "0.1.0"


# -- A Python without the project's dependencies ---------------------------------------------------
# `python -m minibatch ...` with a Python other than the project's .venv (the system one, from the
# checkout) used to end in a traceback, "No module named 'torch'". The import itself needs none of
# them (the load generator and workloads work without torch), so nothing fails here; when one is
# missing, its import fails with a message that says what to run, and an uncaught one ends the
# program with that message alone (exit status 1) instead of a traceback.
REQUIRED = ("torch", "numpy", "transformers", "safetensors", "tokenizers")   # pyproject's dependencies


def missing_dependency_message(name: str) -> str:
    return (f"minibatch needs the Python package {name!r}, which this Python ({sys.executable}) does not have. "
            "Use the project's virtual environment: run `make setup` once in the checkout, then "
            "`.venv/bin/python -m minibatch ...` (or `source .venv/bin/activate` first).")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _MissingDependencyFinder:
    """Last on ``sys.meta_path``: reached only for a module no other finder found."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            raise ModuleNotFoundError(missing_dependency_message(fullname), name=fullname)
        return None


def _excepthook(kind, value, tb, _previous=sys.excepthook):
    if isinstance(value, ModuleNotFoundError) and value.name in REQUIRED:
        print(f"error: {missing_dependency_message(value.name)}", file=sys.stderr)
        return
    _previous(kind, value, tb)


_MISSING = [name for name in REQUIRED if not _importable(name)]
if _MISSING:
    sys.meta_path.append(_MissingDependencyFinder(_MISSING))
    sys.excepthook = _excepthook

# name -> module that defines it
_EXPORTS = {
    "LLM": "minibatch.llm",
    "LLMEngine": "minibatch.engine",
    "EngineConfig": "minibatch.config",
    "SamplingParams": "minibatch.sampling_params",
    "RequestOutput": "minibatch.request",
    "CompletionOutput": "minibatch.request",
    "RequestStatus": "minibatch.request",
    "RequestRecord": "minibatch.results",
    "RunResult": "minibatch.results",
    "run": "minibatch.runner",
    "RunController": "minibatch.runner",
}
# subpackages that ``minibatch.NAME`` imports on first use
_SUBPACKAGES = ("presets", "tune")
__all__ = [*_EXPORTS, "TINY_MODEL_PATH"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name == "TINY_MODEL_PATH":           # the embedded model's files
        from minibatch.assets import TINY_MODEL_PATH as value
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"minibatch.{name}")
    else:
        raise AttributeError(f"module 'minibatch' has no attribute {name!r}")
    globals()[name] = value          # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
