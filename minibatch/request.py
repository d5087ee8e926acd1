"""A request's life: its tokens, its progress through the KV cache, and its outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from minibatch.results import RequestRecord
from minibatch.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.REJECTED)


class Request:
    """One generation request inside the engine.

    The scheduler only needs two counters, as in vLLM V1: ``num_tokens`` (prompt plus
    generated tokens known so far) and ``num_computed_tokens`` (tokens whose K/V are in
    the cache). A step computes ``num_tokens - num_computed_tokens`` new tokens of a
    request (or a chunk of them); a request whose counters meet samples its next token.
    A prefill, a chunked prefill, a decode and a recompute after preemption are all the
    same operation.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, eos_token_ids: tuple[int, ...] = (), priority: int = 0,
                 tenant: str | None = None, prompt: str | None = None, lora_request=None):
        self.request_id = request_id
        self.lora_request = lora_request    # minibatch.lora.LoRARequest, or None for the base model
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.tenant = tenant
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        # The engine's count of token compute (Scheduler._count_computed): every token scheduled
        # for computation, and those of them computed again after a recompute preemption threw
        # their KV away (below ``recompute_until``, the most tokens ever thrown away).
        self.num_computed_total = 0
        self.num_recomputed_tokens = 0
        self.recompute_until = 0
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.output_text = ""
        # Per output token when ``sampling_params.logprobs`` is set: (its log probability,
        # [(token id, log probability)] of the most likely tokens), the raw distribution's.
        self.output_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.stop_search_from = 0           # stop strings must end after this many characters
        # Timestamps (engine clock, seconds).
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.generator = None               # torch.Generator of a seeded request (the sampler's)
        if sampling_params.seed is not None:
            import torch
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.policy_state: dict = {}        # scratch space for scheduling policies
        # Draft tokens scheduled this step after the pending token (speculative decoding,
        # minibatch.spec_decode): the step computes 1 + len(spec_token_ids) positions.
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None   # see Request.output_logprobs


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestRecord             # arrival_time, first_token_time, ttft, tpot, e2e, num_preemptions ...
    error: str | None = None

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        reason = req.status.value if req.status.finished else None
        lp = list(req.output_logprobs) if req.sampling_params.logprobs is not None else None
        completion = CompletionOutput(0, req.output_text, list(req.output_token_ids), reason, req.stop_reason, lp)
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                   req.status.finished, RequestRecord.of(req, keep_tokens=False), req.error)
