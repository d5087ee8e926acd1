"""Package data: the embedded "tiny" default model (``LLM(model="tiny")``)."""

import pathlib

TINY_MODEL_PATH = pathlib.Path(__file__).parent / "tiny"

__all__ = ["TINY_MODEL_PATH"]
