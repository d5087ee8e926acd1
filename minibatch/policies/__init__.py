"""Scheduling policies, registered by name.

``available()`` lists them; ``make_policy(name)`` builds one; ``@register`` adds your own.

==============  ================================================================
``serial``      one request at a time, FCFS
``static``      fixed request-level batches of ``max_num_seqs``; the batch ends with its last member
``dynamic``     a batching window (``max_num_seqs`` or ``max_wait_ms``), then request-level batches
``continuous``  iteration-level FCFS (Orca, vLLM)
``sjf``         shortest (estimated) remaining job first, with aging
``priority``    by ``req.priority`` (lower = more urgent), preemptive or not, aging, per-class limits
``mlfq``        FastServe's skip-join multi-level feedback queue, preemptive
``fair``        per-tenant Virtual Token Counter (VTC)
``lpm``         SGLang's longest prefix match (cache-aware), with aging
``sglang``      SGLang's default step: prefill-only while a prompt can start or continue, else decode
``trtllm``      TensorRT-LLM's in-flight batching: arrival order, decodes before context chunks
``tgi``         TGI's router: pause decoding to prefill when enough wait or after max_waiting_tokens
==============  ================================================================
"""

from minibatch.policies import (  # noqa: F401  (each module registers its policy)
    continuous,
    dynamic,
    fair,
    lpm,
    mlfq,
    priority,
    serial,
    sglang,
    sjf,
    static,
    tgi,
    trtllm,
)
from minibatch.policies.base import (
    Policy,
    SchedulerState,
    available,
    make_policy,
    register,
)

__all__ = ["Policy", "SchedulerState", "available", "make_policy", "register"]
