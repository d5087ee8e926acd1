"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *defined*, i.e. when
``minibatch.kernels.triton_kernels`` is first imported, which happens later, inside
the tests. pytest imports this file while collecting, before any test runs, so a plain
``pytest`` call needs no environment variable. With a GPU (and no explicit setting) the
same tests run the compiled kernels on CUDA instead.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the float32 kernel tests run: CPU under the interpreter, else CUDA."""
    from minibatch.kernels._triton_utils import interpreting

    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET is off and there is no CUDA device: the kernels cannot run")
    return torch.device("cuda")
