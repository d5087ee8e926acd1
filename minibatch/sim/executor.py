"""``SimExecutor``: run the real scheduler and KV manager with no model.

Each step's duration comes from a cost model (``minibatch.sim``): a roofline model of a
named model on named GPUs (``hardware="a100-80g"``, ``"4xa10"``), or a fit of step
times measured on this machine (``hardware="profile:FILE"``). Generated tokens are
placeholders; prompt token ids are kept, so prefix caching behaves as with a model.
The KV pool is sized from the GPU memory left after the weights, unless
``num_kv_blocks`` is given.
"""

from __future__ import annotations

from minibatch.config import EngineConfig
from minibatch.executor import StepOutput
from minibatch.scheduler import ScheduledBatch
from minibatch.sim.fitted import FittedCostModel, next_recency

PLACEHOLDER_TOKEN = 1
DEFAULT_HARDWARE = "a100-80g"


class SimExecutor:
    model_config = None

    def __init__(self, config: EngineConfig):
        from minibatch.sim import get_model_spec, make_cost_model

        self.config = config
        model = "tiny" if config.model == "tiny-random" else config.model
        self.model_spec = get_model_spec(model)
        self.hardware = config.hardware or DEFAULT_HARDWARE
        self.cost_model = make_cost_model(self.model_spec, self.hardware)
        self._recency = 0.0      # a fitted model's after-big-step term (minibatch.sim.fitted)
        self.max_model_len = self.model_spec.max_model_len
        self.vocab_size = self.model_spec.vocab_size
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            tokens = self.cost_model.kv_capacity_tokens(config.gpu_memory_utilization)
            if tokens is None:
                raise ValueError(f"hardware {self.hardware!r} does not say how much KV fits; pass num_kv_blocks")
            self.num_kv_blocks = max(1, int(tokens) // config.block_size)

    def execute(self, batch: ScheduledBatch, kv) -> StepOutput:
        prefill, decode = batch.shape()
        sampled = [(req, PLACEHOLDER_TOKEN) for req, n in batch.items
                   if req.num_computed_tokens + n == req.num_tokens]
        if isinstance(self.cost_model, FittedCostModel):
            t = self.cost_model.step_time(prefill, decode, recency=self._recency)
            self._recency = next_recency(self._recency, prefill, decode)
        else:
            t = self.cost_model.step_time(prefill, decode)
        return StepOutput(sampled, t, t)
