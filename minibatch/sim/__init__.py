"""The simulator's cost models: how long an engine step takes without running a model.

``SimExecutor`` runs the real scheduler and KV manager and asks a cost model for each
step's duration:

* :class:`RooflineCostModel`: a named model (:mod:`.model_specs`) on a named GPU
  (:mod:`.hardware`), from FLOPs, bytes and the roofline ``t = max(F/P, B/W)``;
* :class:`FittedCostModel`: a linear fit of step times measured on the real engine.

>>> cm = make_cost_model("llama-2-7b", "a100-80g")
>>> round(cm.step_time(prefill=[(512, 512)], decode_context_lens=[300] * 31) * 1e3)  # ms
38
"""

from .cost_model import (CostModel, ModelDoesNotFitError, RooflineCostModel, load_cost_model,
                         make_cost_model)
from .fitted import FEATURES, FittedCostModel, nnls
from .hardware import HardwareSpec, available_hardware, get_hardware, parse_hardware
from .model_specs import ModelSpec, available_models, get_model_spec

__all__ = [
    "CostModel", "FEATURES", "FittedCostModel", "HardwareSpec", "ModelDoesNotFitError", "ModelSpec",
    "RooflineCostModel", "available_hardware", "available_models", "get_hardware", "get_model_spec",
    "load_cost_model", "make_cost_model", "nnls", "parse_hardware",
]
