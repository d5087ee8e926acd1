"""What LoRA adapters cost a simulated step: their GEMMs, and loading them into a slot.

A step whose rows use ``a`` distinct adapters (at most ``max_loras``, the scheduler's
rule, :mod:`minibatch.lora`) runs, per layer and per adapted projection ``(k -> n)``, two
thin GEMMs per adapter over that adapter's rows (Punica's SGMV runs them as one kernel
over segments of rows). Summed over the adapters, with ``T`` rows in the step and rank
``r`` (slots are padded to ``max_lora_rank``, as vLLM's are, so ``r = max_lora_rank``)::

    F = 2 * T * r * (k + n)                       (shrink x A^T, then expand (xA^T) B^T)
    B = a * r * (k + n) * w + T * (k + 2r + n) * w   (each adapter's A and B read once)

per projection and layer, timed with the same roofline as the base GEMMs
(:class:`~minibatch.sim.cost_model.RooflineCostModel`). At decode sizes this is
memory-bound: each extra adapter in a step adds the bytes of its weights. Loading an adapter
that is not in a slot copies ``adapter_bytes`` over the host link before the step
(``HOST_LINK_BYTES_PER_S``, 25 GB/s, the figure :mod:`minibatch.sim.offload` uses); vLLM
loads LoRA weights from its CPU cache the same way, inside the step that needs them.

Not modelled: the kernels' lower efficiency at rank 8-64 (thin GEMMs run far from the
roofline; S-LoRA and Punica report their kernels' overheads separately), the bookkeeping
of mapping rows to adapters, and reading an adapter from disk the first time.
"""

from __future__ import annotations

from minibatch.sim.offload import HOST_LINK_BYTES_PER_S

# The adapted projections of a Llama layer (PEFT's target modules), as (in, out) of the model spec.


def _projections(spec, tp: int = 1) -> list[tuple[int, int]]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    # q/k/v, gate/up column-parallel (out split by tp), o/down row-parallel (in split by tp)
    return [(h, q // tp), (h, max(1, kv // tp)), (h, max(1, kv // tp)), (q // tp, h),
            (h, i // tp), (h, i // tp), (i // tp, h)]


def adapter_bytes(spec, rank: int, tp: int = 1) -> int:
    """Bytes of one adapter of rank ``rank`` on every target module, on one GPU."""
    return spec.num_layers * sum(rank * (k + n) for k, n in _projections(spec, tp)) * spec.dtype_bytes


def lora_step_time(cost_model, num_tokens: int, num_adapters: int, rank: int) -> float:
    """Seconds the LoRA GEMMs add to a step of ``num_tokens`` rows using ``num_adapters`` adapters."""
    if num_adapters <= 0 or num_tokens <= 0:
        return 0.0
    spec, w = cost_model.model, cost_model.model.dtype_bytes
    T, r, a = num_tokens, rank, num_adapters
    per_layer = 0.0
    for k, n in _projections(spec, cost_model.tp):
        flops = 2.0 * T * r * (k + n)
        nbytes = a * r * (k + n) * w + T * (k + 2 * r + n) * w
        per_layer += cost_model.roofline(flops, nbytes)
    return spec.num_layers * per_layer


def load_time(cost_model, rank: int, bandwidth: float = HOST_LINK_BYTES_PER_S) -> float:
    """Seconds to copy one adapter into a device slot over the host link."""
    return adapter_bytes(cost_model.model, rank, cost_model.tp) / bandwidth


def tenant_adapter_engine(**engine_kwargs):
    """A virtual-clock engine (``enable_lora=True``) that runs every request with its tenant's
    adapter: tenant ``t`` -> ``LoRARequest(t, id)``, ids in order of first appearance.

    For replaying a workload on :func:`minibatch.cluster.run` (``engines=[...]``) where each
    tenant is a customer with its own fine-tuned adapter (the setting of S-LoRA's evaluation):
    ``RequestSpec`` has no adapter field, its ``tenant`` names the adapter.
    """
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine
    from minibatch.lora import LoRARequest

    class TenantAdapterEngine(LLMEngine):
        def add_request(self, prompt, params=None, request_id=None, arrival_time=None, priority=0,
                        tenant=None, lora_request=None):
            if lora_request is None and tenant is not None:
                ids = self.__dict__.setdefault("_tenant_ids", {})
                lora_request = LoRARequest(str(tenant), ids.setdefault(tenant, len(ids) + 1))
            return super().add_request(prompt, params, request_id=request_id, arrival_time=arrival_time,
                                       priority=priority, tenant=tenant, lora_request=lora_request)

    config = EngineConfig.from_kwargs(**{"executor": "sim", "enable_lora": True, **engine_kwargs})
    return TenantAdapterEngine(config, clock="virtual")
