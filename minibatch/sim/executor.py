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
        # Speculative decoding: drafts are placeholders, each accepted with spec_acceptance_rate
        # (minibatch.sim.spec_decode); a verify step is priced as a chunk of 1 + k tokens.
        self.spec_proposer = None
        if config.speculative_method is not None:
            from minibatch.sim.spec_decode import SimDrafter
            self.spec_proposer = SimDrafter(config.spec_acceptance_rate, config.seed, PLACEHOLDER_TOKEN)

        # LoRA (enable_lora): adapter slots, their load time and their GEMMs (minibatch.sim.lora).
        self.lora = None
        self.lora_names: dict[int, str] = {}
        if config.enable_lora:
            from minibatch.lora import AdapterSlots
            if not hasattr(self.cost_model, "roofline"):
                raise ValueError(f"enable_lora in the simulator needs a roofline hardware model (e.g. a100-80g), "
                                 f"not {self.hardware!r}")
            self.lora = AdapterSlots(config.max_loras)

    def add_lora(self, lora_request) -> None:
        """Accept a request's adapter: the simulator needs its id only (every adapter is priced at
        ``max_lora_rank`` on every target module, as vLLM pads its slots)."""
        from minibatch.lora import LoRARequest

        if self.lora is None:
            raise ValueError("lora_request given but the engine was built without enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        lid, name = lora_request.lora_int_id, lora_request.lora_name
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(f"LoRA adapter {name!r}: lora_int_id must be an integer >= 1, got {lid!r}")
        if self.lora_names.setdefault(lid, name) != name:
            raise ValueError(f"lora_int_id {lid} is already adapter {self.lora_names[lid]!r}, not {name!r}")

    def _lora_time(self, batch: ScheduledBatch) -> float:
        from minibatch.lora import lora_id
        from minibatch.sim.lora import load_time, lora_step_time

        ids = {lora_id(r) for r, _ in batch.items} - {0}
        if not ids:
            return 0.0
        loads = len(self.lora.activate(ids))
        rank = self.config.max_lora_rank
        rows = sum(n for r, n in batch.items if lora_id(r))
        return loads * load_time(self.cost_model, rank) + lora_step_time(self.cost_model, rows, len(ids), rank)

    def execute(self, batch: ScheduledBatch, kv) -> StepOutput:
        prefill, decode = batch.shape()
        sampled = [(req, PLACEHOLDER_TOKEN) for req, n in batch.items
                   if req.num_computed_tokens + n == req.num_tokens]
        if self.spec_proposer is not None:
            sampled += self.spec_proposer.verify(batch)
        if isinstance(self.cost_model, FittedCostModel):
            t = self.cost_model.step_time(prefill, decode, recency=self._recency)
            self._recency = next_recency(self._recency, prefill, decode)
        elif self.config.async_scheduling and hasattr(self.cost_model, "breakdown"):
            # Async scheduling (minibatch.overlap): the CPU overhead of planning the next step
            # runs during this step's forward, so the step lasts the longer of the two.
            parts = self.cost_model.breakdown(prefill, decode)
            overhead = parts.pop("overhead")
            forward = sum(parts.values())
            if self.lora is not None:
                forward += self._lora_time(batch)
            return StepOutput(sampled, max(forward, overhead), forward)
        else:
            t = self.cost_model.step_time(prefill, decode)
        if self.lora is not None:
            t += self._lora_time(batch)
        return StepOutput(sampled, t, t)
