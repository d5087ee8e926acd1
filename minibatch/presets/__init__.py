"""Framework presets: the scheduling defaults of vLLM, SGLang, TensorRT-LLM and TGI.

``LLM(model, preset="tgi")`` (or ``--preset tgi`` on any command, or
``EngineConfig.from_kwargs(preset=...)``) fills every engine option that was not given
with that framework's default: its policy, admission rule, chunking, prefix caching,
preemption and limits. An option given explicitly always beats the preset::

    LLM("tiny", preset="trtllm", max_num_seqs=8)     # TensorRT-LLM's rules, 8 sequences

``describe("tgi")`` prints which knobs a preset sets, to what, and where each default
comes from (framework version and source file, read in the framework's repository).
Knobs a framework sizes from the GPU's free memory (vLLM's and TGI's KV pool, SGLang's
``max_running_requests``) are not set: minibatch sizes them from its own KV budget. Where
a framework's default depends on the GPU or the model, the preset takes the branch of the
course's reference setup, a Llama-2 model (4,096-token context) on an A100-80GB, and the
knob's source says what other GPUs and models get (vLLM: the A100 keeps the small
defaults whatever its memory; SGLang: 8,192 chunked-prefill tokens from 60 GiB; TGI: the
prefill budget is capped by the model's context).

Mapping to minibatch's names: vLLM's ``max_num_seqs`` / TensorRT-LLM's ``max_batch_size`` /
TGI's ``max_batch_size`` -> ``max_num_seqs``; vLLM's ``max_num_batched_tokens`` /
TensorRT-LLM's ``max_num_tokens`` / SGLang's ``chunked_prefill_size`` / TGI's
``max_batch_prefill_tokens`` -> ``max_num_batched_tokens`` (the step's token budget); TGI's
``max_concurrent_requests`` -> ``max_inflight_requests``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.config import PRESET_NAMES


@dataclass(frozen=True)
class Knob:
    """One setting of a preset: the ``EngineConfig`` field, its value, and where it comes from."""

    name: str
    value: object
    source: str


@dataclass(frozen=True)
class Preset:
    name: str
    framework: str
    version: str
    knobs: tuple[Knob, ...]
    notes: tuple[str, ...] = ()
    serve: tuple[Knob, ...] = ()      # knobs that differ when the framework runs as its OpenAI server

    def settings(self, serve: bool = False) -> dict:
        out = {k.name: k.value for k in self.knobs}
        if serve:
            out.update({k.name: k.value for k in self.serve})
        return out


_VLLM_ARGS = ("vllm/engine/arg_utils.py EngineArgs._set_default_args (LLM class; GPU < 70 GiB or an A100: "
              "'a100' in the device name keeps these)")
_SGL_ARGS = "python/sglang/srt/server_args.py ServerArgs"
_TRT_ARGS = "tensorrt_llm/llmapi/llm_args.py BaseLlmArgs"
_TGI_MAIN = "launcher/src/main.rs Args"

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("vllm", "vLLM", "v0.11.0 (V1 engine)", (
        Knob("policy", "continuous", "vllm/config/scheduler.py SchedulerConfig.policy = 'fcfs' "
                                     "(v1/core/sched/scheduler.py: running first, then waiting)"),
        Knob("admission", "max_utilization", "vllm/v1/core/sched/scheduler.py: admit while "
                                             "kv_cache_manager.allocate_slots succeeds; preempt the last running"),
        Knob("max_num_seqs", 256, _VLLM_ARGS),
        Knob("max_num_batched_tokens", 8192, _VLLM_ARGS),
        Knob("enable_chunked_prefill", True, "vllm/config/scheduler.py SchedulerConfig.enable_chunked_prefill"),
        Knob("enable_prefix_caching", True, "vllm/engine/arg_utils.py: on by default for generative models (V1)"),
        Knob("preemption_mode", "recompute", "vllm/v1/core/sched/scheduler.py _preempt_request (V1 recomputes)"),
        Knob("block_size", 16, "vllm/platforms/cuda.py check_and_update_config: CacheConfig.block_size "
                               "None -> 16"),
        Knob("max_wait_ms", 0.0, "vLLM has no batching window"),
    ), ("on GPUs of >= 70 GiB other than the A100 (H100, H200) the LLM class gets 1024 sequences and 16384 "
        "tokens; `vllm serve` gets 256 and 2048 on the A100 (1024 and 8192 on an H100)",),
        serve=(Knob("max_num_batched_tokens", 2048, f"{_VLLM_ARGS}: UsageContext.OPENAI_API_SERVER gets 2048 "
                                                    "(`vllm serve`; 8192 on an H100 or H200)"),)),
    Preset("sglang", "SGLang", "v0.5.3 (python/sglang/srt)", (
        Knob("policy", "sglang", f"{_SGL_ARGS}.schedule_policy = 'fcfs', enable_mixed_chunk = False; "
                                 "managers/scheduler.py Scheduler.get_next_batch_to_run (a prefill batch if "
                                 "get_new_batch_prefill finds one, else decode: prefill-only or decode-only steps)"),
        Knob("admission", "conservative", f"{_SGL_ARGS}.schedule_conservativeness = 1.0; "
                                          "managers/schedule_policy.py PrefillAdder (new_token_ratio)"),
        Knob("max_num_batched_tokens", 8192, f"{_SGL_ARGS}.chunked_prefill_size (None -> by GPU memory: "
                                             "8192 on 60-160 GiB GPUs such as the A100-80GB and H100, 2048 "
                                             "under 35 GiB; 35-60 GiB get 8192 or 4096 by release)"),
        Knob("enable_chunked_prefill", True, f"{_SGL_ARGS}.chunked_prefill_size > 0"),
        Knob("enable_prefix_caching", True, f"{_SGL_ARGS}.disable_radix_cache = False"),
        Knob("preemption_mode", "recompute", "managers/schedule_batch.py retract_decode (retracted requests "
                                             "are recomputed)"),
        Knob("max_wait_ms", 0.0, "SGLang has no batching window"),
    ), (("max_running_requests is derived from the KV pool (not set here); page_size is 1 in SGLang, "
         "minibatch keeps its block_size"),
        ("max_prefill_tokens (16384) bounds a prefill batch; minibatch's one token budget is "
         "chunked_prefill_size"))),
    Preset("trtllm", "TensorRT-LLM", "1.x (llmapi, PyTorch backend; C++ batch_manager)", (
        Knob("policy", "trtllm", "cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp (generation "
                                 "first, then context chunks FCFS); capacityScheduler.cpp (arrival order)"),
        Knob("admission", "guaranteed_no_evict", f"{_TRT_ARGS}.scheduler_config: SchedulerConfig."
                                                 "capacity_scheduler_policy = GUARANTEED_NO_EVICT"),
        Knob("max_num_seqs", 2048, f"{_TRT_ARGS}.max_batch_size = 2048 (older 0.x: None -> tensorrt_llm/"
                                   "builder.py BuildConfig.max_batch_size = 2048)"),
        Knob("max_num_batched_tokens", 8192, f"{_TRT_ARGS}.max_num_tokens = 8192"),
        Knob("enable_chunked_prefill", False, f"{_TRT_ARGS}.enable_chunked_prefill = False"),
        Knob("enable_prefix_caching", True, f"{_TRT_ARGS}.kv_cache_config: KvCacheConfig.enable_block_reuse"),
        Knob("block_size", 32, f"{_TRT_ARGS}.kv_cache_config: KvCacheConfig.tokens_per_block = 32 (also the "
                               "context chunk unit, _torch/pyexecutor/py_executor_creator.py)"),
        Knob("preemption_mode", "recompute", "capacityScheduler.cpp MaxUtilizationScheduler pauses a request: "
                                             "its KV is freed and its context rerun"),
        Knob("max_wait_ms", 0.0, "TensorRT-LLM's executor has no batching window"),
    ), ("capacity_scheduler_policy='MAX_UTILIZATION' or 'STATIC_BATCH' switches the admission rule",)),
    Preset("tgi", "Text Generation Inference", "v3.3.7", (
        Knob("policy", "tgi", "backends/v3/src/backend.rs batching_task; backends/v3/src/queue.rs next_batch"),
        Knob("admission", "guaranteed_no_evict", "backends/v3/src/queue.rs: each request reserves blocks for "
                                                 "input + max_new_tokens; TGI never preempts"),
        Knob("max_num_batched_tokens", 4096, f"{_TGI_MAIN}.max_batch_prefill_tokens (None -> main(): the GPU's "
                                             "f16 FLOP/s / the model's FLOP per token (4096 if either is unknown), "
                                             "at most max_position_embeddings and the VRAM limit: 4096 for Llama-2)"),
        Knob("enable_chunked_prefill", True, "server/text_generation_server/models/globals.py PREFILL_CHUNKING "
                                             "= 1 (flashinfer/flashdecoding attention)"),
        Knob("enable_prefix_caching", True, "launcher/src/main.rs resolve_attention: PREFIX_CACHING = true"),
        Knob("max_waiting_tokens", 20, f"{_TGI_MAIN}.max_waiting_tokens"),
        Knob("waiting_served_ratio", 0.3, f"{_TGI_MAIN}.waiting_served_ratio"),
        Knob("max_inflight_requests", 128, f"{_TGI_MAIN}.max_concurrent_requests (router/src/infer/mod.rs "
                                           "semaphore: beyond it, 'overloaded')"),
        Knob("max_wait_ms", 0.0, "TGI's router has no time window (it counts decode steps)"),
    ), (("with prefill chunking (TGI's default) backend.rs ignores max_waiting_tokens and "
         "waiting_served_ratio; pass enable_chunked_prefill=False to see them act"),
        ("max_batch_total_tokens is inferred from free GPU memory (here: the KV pool); max_batch_size has "
         "no default (minibatch keeps max_num_seqs)"))),
)}

assert tuple(PRESETS) == PRESET_NAMES


def get(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` naming the choices if there is none."""
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        raise ValueError(f"unknown preset {name!r}; expected one of {PRESET_NAMES}")
    return preset


def settings(name: str, serve: bool = False) -> dict:
    """``{EngineConfig field: value}`` that preset ``name`` sets; ``serve=True``: as the framework's
    OpenAI-compatible server sets them (``vllm serve``'s smaller token budget on an A100)."""
    return get(name).settings(serve)


def serve_settings(name: str) -> dict:
    """Only the knobs where preset ``name``'s OpenAI server differs from its library entry point
    (``{}`` for SGLang, TensorRT-LLM and TGI, whose servers take the same defaults)."""
    return {k.name: k.value for k in get(name).serve}


def rows(name: str) -> list[tuple[str, object, str]]:
    """``(knob, value, source)`` for every knob of preset ``name``."""
    return [(k.name, k.value, k.source) for k in get(name).knobs]


def describe(name: str) -> str:
    """A printable table of the knobs preset ``name`` sets: knob, value, source."""
    preset = get(name)
    table = [("knob", "value", "source")] + [(k, repr(v), s) for k, v, s in rows(name)]
    w0 = max(len(r[0]) for r in table)
    w1 = max(len(r[1]) for r in table)
    lines = [f"preset {preset.name!r}: {preset.framework} {preset.version}", ""]
    for i, (k, v, s) in enumerate(table):
        lines.append(f"{k:<{w0}}  {v:<{w1}}  {s}")
        if i == 0:
            lines.append(f"{'-' * w0}  {'-' * w1}  {'-' * 6}")
    if preset.serve:
        lines.append("")
        lines += [f"as a server: {k.name} = {k.value!r}  ({k.source})" for k in preset.serve]
    if preset.notes:
        lines.append("")
        lines += [f"note: {n}" for n in preset.notes]
    return "\n".join(lines)
