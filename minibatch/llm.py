"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from typing import Sequence

from minibatch.config import EngineConfig
from minibatch.engine import LLMEngine
from minibatch.request import RequestOutput
from minibatch.sampling_params import SamplingParams


class LLM:
    """An engine plus a loop that runs it until every submitted prompt is done.

    ``LLM(model="tiny")`` is the embedded default model; any other engine option is an
    :class:`~minibatch.config.EngineConfig` field passed as a keyword, e.g.
    ``LLM(model="tiny", max_num_seqs=16, policy="continuous")``. ``preset="vllm" | "sglang" |
    "trtllm" | "tgi"`` fills the options not given with that framework's defaults
    (``minibatch.presets.describe(name)`` lists them).
    """

    def __init__(self, model: str = "tiny", **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def config(self) -> EngineConfig:
        """The engine's config, with ``max_model_len`` and ``num_kv_blocks`` resolved."""
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids), in input order.

        A prompt that fails validation does not stop the others: its output has
        ``finish_reason == "rejected"`` and ``error`` naming the problem. A request whose
        part of a step fails is aborted with its own error (``finish_reason == "abort"``)
        and the others are unaffected. ``lora_request`` (one
        :class:`~minibatch.lora.LoRARequest` for every prompt, or a list with one per prompt,
        None for the base model; needs ``enable_lora=True``) runs prompts with adapters; a
        prompt whose adapter is bad is rejected with an error naming it. If anything else goes wrong (or the call is
        interrupted), every request of this call is aborted and removed before the error
        propagates, so the object is as it was and the next call starts clean.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        else:
            loras = [lora_request] * len(prompts)
        engine = self.engine
        ids: list[str] = []
        bar = None
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                try:
                    ids.append(engine.add_request(prompt, p, lora_request=lora))
                except ValueError as e:     # recorded with params that can be built (a bad seed cannot)
                    ids.append(engine.reject(prompt, p if _valid(p) else None, str(e)).request_id)
                    engine.requests[ids[-1]] = engine.finished[-1]
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(prompts), desc="generate", unit="req")
            done = 0
            while engine.has_unfinished_requests():
                engine.step()
                if bar is not None:
                    now_done = sum(1 for i in ids if engine.requests[i].is_finished)
                    bar.update(now_done - done)
                    done = now_done
            if bar is not None:
                bar.update(len(prompts) - done)
            outputs = [engine.output(i) for i in ids]
        except BaseException:
            for i in ids:
                try:
                    engine.abort_request(i)
                except Exception:  # the engine is in a bad state; still drop the request
                    engine.scheduler.remove(engine.requests[i])
            raise
        finally:
            if bar is not None:
                bar.close()
            mine = set(ids)
            for i in ids:
                engine.requests.pop(i, None)
            engine.finished = [r for r in engine.finished if r.request_id not in mine]
        return outputs


def _valid(params) -> bool:
    """Do ``params`` pass validation now (a field may have been changed after construction)?"""
    try:
        params.validate()
    except (ValueError, TypeError, AttributeError):
        return False
    return True
