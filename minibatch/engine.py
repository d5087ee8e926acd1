"""The engine loop: admit requests, schedule a step, execute it, apply its tokens.

    step():  batch = scheduler.schedule(now)      # which tokens of which requests
             out   = executor.execute(batch)      # model forward + sampling
             update(batch, out)                   # counters, stop checks, finished requests

Every event (arrival, schedule, first token, token, preempt, finish, abort, reject)
goes to the listeners registered with :meth:`LLMEngine.subscribe`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

from minibatch.admission import Overloaded
from minibatch.clock import make_clock
from minibatch.config import EngineConfig
from minibatch.kv_cache import KVCacheManager
from minibatch.kv_offload import make_host_tier
from minibatch.timeline import StepRecord
from minibatch.request import Request, RequestOutput, RequestStatus
from minibatch.sampling_params import SamplingParams
from minibatch.scheduler import Scheduler
from minibatch.tokenizer import IncrementalDetokenizer, decode_output, load_tokenizer, prompt_context


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, clock="wall", executor=None, **kwargs):
        config = config or EngineConfig.from_kwargs(**kwargs)
        self.config = config
        self.clock = make_clock(clock)
        if executor is None:
            executor = self._make_executor()
        self.executor = executor
        mc = getattr(executor, "model_config", None)
        self.eos_token_ids: tuple[int, ...] = tuple(mc.eos_token_ids) if mc is not None else ()
        self.max_model_len = self._max_model_len()
        # The engine's own copy, with the values resolved from the model and the executor.
        self.config = dataclasses.replace(config, max_model_len=self.max_model_len,
                                          num_kv_blocks=executor.num_kv_blocks)
        self.tokenizer = None
        path = self.config.tokenizer or getattr(executor, "model_path", None)
        if path is not None:
            self.tokenizer = load_tokenizer(path)
        self.vocab_size = mc.vocab_size if mc is not None else None
        self.kv = KVCacheManager(self.config.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching,
                                 allocator=self.config.kv_allocator, max_model_len=self.max_model_len,
                                 contiguous_reserve=self.config.contiguous_reserve)
        self.kv.attach_host_tier(make_host_tier(self.config, executor))   # KV offloading; None when off
        self.scheduler = Scheduler(self.config, self.kv, max_model_len=self.max_model_len)
        if self.config.preemption_mode == "swap":
            from minibatch.swap import Swapper
            capacity = self.config.swap_space_blocks
            self.scheduler.swapper = Swapper(self.kv, executor, self.kv.num_blocks if capacity is None else capacity)
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.steps: list[StepRecord] = []
        self.stream_text = False
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._listeners: list[Callable] = []
        self._swap_recorded = (0, 0)    # swap counters at the last StepRecord
        # Async (overlap) scheduling (minibatch.overlap): None when off, the default.
        self.overlap = None
        if self.config.async_scheduling:
            from minibatch.overlap import OverlapScheduler
            self.overlap = OverlapScheduler(self)
        # Speculative decoding counters (spec_decode_metrics): sequences that drafted, draft
        # tokens verified, and drafts accepted.
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        proposer = getattr(executor, "spec_proposer", None)     # the simulator drafts placeholders
        if proposer is not None and self.scheduler.proposer is not None:
            self.scheduler.proposer = proposer

    def _make_executor(self):
        if self.config.executor == "model":
            from minibatch.executor import ModelExecutor
            return ModelExecutor(self.config)
        from minibatch.sim.executor import SimExecutor  # noqa: PLC0415  (issue: simulator)
        return SimExecutor(self.config)

    def _max_model_len(self) -> int:
        mc = getattr(self.executor, "model_config", None)
        limit = self.config.max_model_len
        model_max = getattr(mc, "max_position_embeddings", None) or getattr(self.executor, "max_model_len", None)
        if mc is not None and mc.sliding_window:
            model_max = min(model_max, mc.sliding_window)
        if limit is None:
            return int(model_max)
        if model_max is not None and limit > model_max:
            raise ValueError(f"max_model_len={limit} exceeds what the model supports ({model_max})")
        return limit

    # -- events ------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[str, float, Request, dict], None]) -> None:
        """Call ``fn(event, time, request, info)`` on every request event."""
        self._listeners.append(fn)

    def _emit(self, event: str, req: Request, at: float | None = None, **info) -> None:
        if not self._listeners:
            return
        t = self.clock.now() if at is None else at
        for fn in self._listeners:
            fn(event, t, req, info)

    # -- requests ----------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass the prompt as a list of token ids")
            if prompt == "":
                raise ValueError("empty prompt: a request needs at least one token")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple, range)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if not set(map(type, ids)) <= {int}:      # one C-speed pass; bools and floats fail
            raise ValueError("a token-id prompt must be a list of integers")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request can never be served."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        if self.vocab_size is not None and n and (min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size):
            bad = next(t for t in prompt_ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt of {n} tokens is too long: max_model_len is {self.max_model_len} "
                             f"(the prompt plus at least one generated token must fit)")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} and chunked prefill is off")
        c = self.config
        if not c.enable_chunked_prefill and c.max_batch_prefill_tokens is not None \
                and n > c.max_batch_prefill_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds max_batch_prefill_tokens={c.max_batch_prefill_tokens} "
                             f"and chunked prefill is off")
        need = min(n + params.max_tokens, self.max_model_len)
        if c.max_batch_total_tokens is not None and need > c.max_batch_total_tokens:
            raise ValueError(f"request needs {need} tokens (prompt + max_tokens) but max_batch_total_tokens is "
                             f"{c.max_batch_total_tokens} (the most the tgi policy lets the batch hold)")
        blocks = self.kv.blocks_for_request(need)
        if blocks > self.kv.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks ({need} tokens) but the whole cache has "
                             f"only {self.kv.num_blocks}; it can never be served")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0, tenant: str | None = None,
                    lora_request=None) -> str:
        """Queue a request; raises ``ValueError`` (and queues nothing) on bad input.

        ``lora_request`` (:class:`minibatch.lora.LoRARequest`, with ``enable_lora=True``) runs
        the request with that adapter; a bad adapter is a ``ValueError`` naming the problem."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        limit = self.config.max_inflight_requests
        if limit is not None and self.scheduler.num_unfinished >= limit:
            raise Overloaded(f"overloaded: max_inflight_requests={limit} requests are already waiting or "
                             f"running; retry later (backpressure, TGI's max_concurrent_requests)")
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if lora_request is not None:
            add_lora = getattr(self.executor, "add_lora", None)
            if add_lora is None:
                raise ValueError("lora_request given but this executor does not serve LoRA adapters")
            add_lora(lora_request)
        now = self.clock.now()
        req = Request(request_id, ids, params, now if arrival_time is None else arrival_time,
                      eos_token_ids=self.eos_token_ids, priority=priority, tenant=tenant, prompt=text,
                      lora_request=lora_request)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self._emit("arrival", req, at=req.arrival_time, prompt_len=req.num_prompt_tokens, priority=priority,
                   tenant=tenant)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        """Queued or running requests, or (async scheduling) a step still in flight."""
        return self.scheduler.has_unfinished() or (self.overlap is not None and self.overlap.busy)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; return the requests that got a token or finished in it."""
        if self.overlap is not None:       # async scheduling: plan the next step during this one
            return self.overlap.step()
        start = self.clock.now()
        batch = self.scheduler.schedule(start)
        stranded = self.kv.take_stranded_blocks()      # external fragmentation in this schedule
        for req in batch.preempted:
            self._emit("preempt", req)
        if not batch:
            return []
        policy = self.scheduler.policy
        num_padded = policy.num_padded_slots
        for req, n in batch.items:
            if req.policy_state.get("_scheduled_once") is None:
                req.policy_state["_scheduled_once"] = True
                self._emit("schedule", req)
        swapper = self.scheduler.swapper
        swap_time = (swapper.take_time() if swapper is not None else 0.0) + self.kv.take_offload_time()
        try:
            out = self.executor.execute(batch, self.kv)
        except Exception as e:  # find the request(s) responsible; the rest of the batch goes on
            out = self._execute_isolated(batch, e)
        self.clock.advance(out.duration + swap_time)
        now = self.clock.now()
        items = batch.items
        if out.failed:
            failed = {id(req) for req, _ in out.failed}
            items = [(req, n) for req, n in batch.items if id(req) not in failed]
        for req, n in items:
            req.num_computed_tokens += n - len(req.spec_token_ids)    # drafts count once accepted
            self.kv.cache_full_blocks(req)
        touched: list[Request] = []
        last = None
        for req, token in out.sampled:
            if req is last:          # the token before this one was an accepted draft: its KV stands
                self.spec_num_accepted_tokens += 1
                if req.is_finished:  # a stop inside the accepted run: the rest is dropped
                    continue
                req.num_computed_tokens += 1
                self.kv.cache_full_blocks(req)
            last = req
            self._append_token(req, token, now, out.logprobs.get(req.request_id))
            if not touched or touched[-1] is not req:
                touched.append(req)
        if self.scheduler.proposer is not None:
            self._end_speculation(batch)
        for req, error in out.failed:
            if not req.is_finished:
                req.error = f"engine error in this request's step: {error}"
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                touched.append(req)
        policy.on_step(items, now)
        self._record_step(batch, start, now, out.forward_time, num_padded, stranded)
        return touched

    def _record_step(self, batch, start: float, now: float, forward_time: float, num_padded: int,
                     stranded: int) -> None:
        """Append the StepRecord of ``batch``, which ran from ``start`` to ``now``."""
        num_decode_tokens, num_prefill_tokens = batch.token_counts()    # a decode is one sequence
        reserved, internal, frag_reserved, frag_internal = self.kv.slot_stats(self.scheduler.running)
        slots = self.kv.num_blocks * self.kv.block_size
        swapped_out, swapped_in = self._swap_counts_since_last_record()
        self.steps.append(StepRecord(
            step=len(self.steps), start_time=start, duration=now - start, forward_time=forward_time,
            num_seqs=batch.num_seqs,
            num_prefill_seqs=batch.num_seqs - num_decode_tokens, num_decode_seqs=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_preempted=len(batch.preempted), kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks, policy=self.scheduler.policy.name, num_padded_slots=num_padded,
            num_swapped_out_blocks=swapped_out, num_swapped_in_blocks=swapped_in,
            kv_reserved_unused=reserved / slots, kv_internal_waste=internal / slots,
            kv_reserved=frag_reserved / slots, kv_internal_frag=frag_internal / slots,
            kv_external_frag=stranded * self.kv.block_size / slots))

    def _end_speculation(self, batch) -> None:
        """Count this step's drafts (vLLM's spec_decode counters), give back the blocks that held
        only rejected drafts (``minibatch.spec_decode.release_rejected_blocks``), clear the drafts."""
        from minibatch.spec_decode import release_rejected_blocks
        for req, _ in batch.items:
            if req.spec_token_ids:
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += len(req.spec_token_ids)
                if not req.is_finished:
                    release_rejected_blocks(self.kv, req)
                req.spec_token_ids = []

    def spec_decode_metrics(self) -> dict[str, int]:
        """The speculative-decoding counters under vLLM's Prometheus names
        (``vllm/v1/spec_decode/metrics.py``, v0.11.0; ``_total`` is the exporter's suffix)."""
        return {"vllm:spec_decode_num_drafts": self.spec_num_drafts,
                "vllm:spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens}

    def _execute_isolated(self, batch, error: Exception):
        """The batch's step raised ``error``: run each request's part alone, so that only the
        request(s) whose own part fails are aborted (with their error) and every other
        request gets the token it would have got. A failure before the model's sampling
        consumed no random draw, so seeded requests stay reproducible."""
        from minibatch.executor import StepOutput, describe_error
        from minibatch.scheduler import ScheduledBatch

        if batch.num_seqs == 1:
            return StepOutput([], 0.0, 0.0, [(batch.items[0][0], describe_error(error))])
        merged = StepOutput([], 0.0, 0.0, [])
        for req, n in batch.items:
            try:
                out = self.executor.execute(ScheduledBatch(items=[(req, n)]), self.kv)
            except Exception as e:
                merged.failed.append((req, describe_error(e)))
                continue
            merged.sampled += out.sampled
            merged.failed += out.failed
            merged.logprobs.update(out.logprobs)
            merged.duration += out.duration
            merged.forward_time += out.forward_time
        return merged

    def _swap_counts_since_last_record(self) -> tuple[int, int]:
        swapper = self.scheduler.swapper
        if swapper is None:
            return 0, 0
        last_out, last_in = self._swap_recorded
        self._swap_recorded = (swapper.num_swapped_out, swapper.num_swapped_in)
        return swapper.num_swapped_out - last_out, swapper.num_swapped_in - last_in

    def _append_token(self, req: Request, token: int, now: float, logprobs: tuple | None = None) -> None:
        req.output_token_ids.append(token)
        req.token_times.append(now)
        p = req.sampling_params
        if logprobs is not None and p.logprobs is not None:
            req.output_logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
            self._emit("first_token", req)
        self._emit("token", req, token=token)
        status = None
        may_stop = req.num_output_tokens > p.min_tokens     # the sampler masks stop tokens before
        if may_stop and not p.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        if self.tokenizer is not None and (p.stop or self.stream_text):
            detok = self._detok.get(req.request_id)
            if detok is None:
                detok = self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens,
                                                                             req.prompt_token_ids)
            detok.push(token)
            req.output_text = detok.text
            if status is None and p.stop:
                # As vLLM's detokenizer (vllm/v1/engine/detokenizer.py, v0.11.0): a stop string
                # counts only once min_tokens tokens exist, and must end in the text made after.
                hit = _find_stop(req.output_text, p.stop, req.stop_search_from) if may_stop else None
                if not may_stop:
                    req.stop_search_from = len(req.output_text)
                if hit is not None:
                    cut, s = hit
                    req.output_text = req.output_text[:cut + len(s) if p.include_stop_str_in_output else cut]
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, s
        if status is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finish_time = self.clock.now()
        self.scheduler.remove(req)
        if self.tokenizer is not None and not isinstance(req.stop_reason, str):
            req.output_text = self.final_text(req)
        self._detok.pop(req.request_id, None)
        self.finished.append(req)
        self._emit("abort" if status is RequestStatus.FINISHED_ABORTED else "finish", req, reason=status.value)

    def final_text(self, req: Request) -> str:
        """A full decode of the output after the prompt's last tokens (the incremental one may
        still hold back a partial character; :func:`minibatch.tokenizer.decode_output`). A
        request stopped by EOS or a stop token id leaves that token out unless
        ``include_stop_str_in_output`` (vLLM's detokenizer does the same)."""
        p = req.sampling_params
        ids = req.output_token_ids
        if req.status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output:
            ids = ids[:-1]
        context = prompt_context(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
        return decode_output(self.tokenizer, ids, context, p.skip_special_tokens)

    def reject(self, prompt, params, error: str, request_id: str | None = None,
               arrival_time: float | None = None) -> Request:
        """Record a request that failed validation, so that none is lost silently."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
        if isinstance(params, SamplingParams):
            try:
                params.validate()
            except ValueError:               # the params are what was wrong (e.g. a seed set later)
                params = SamplingParams()
        else:
            params = SamplingParams()
        req = Request(request_id, ids, params,
                      self.clock.now() if arrival_time is None else arrival_time,
                      prompt=prompt if isinstance(prompt, str) else None)
        req.status = RequestStatus.REJECTED
        req.error = error
        req.finish_time = req.arrival_time
        self.finished.append(req)
        self._emit("arrival", req, at=req.arrival_time, prompt_len=req.num_prompt_tokens)
        self._emit("reject", req, at=req.arrival_time, error=error)
        return req

    def output(self, request_id: str) -> RequestOutput:
        return RequestOutput.of(self.requests[request_id])


def _find_stop(text: str, stops: list[str], end_after: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``end_after`` characters."""
    best = None
    for s in stops:
        i = text.find(s, max(0, end_after - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
