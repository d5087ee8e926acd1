"""The requests ``bench serve`` sends: a synthetic random set, a named workload or a trace.

Every dataset becomes a list of :class:`BenchRequest` (prompt, its length, the output
length to ask for, and when to send it). Prompt token ids come from the workload
machinery (``minibatch.workload``), uniform over the tokenizer's vocabulary minus its
special tokens; the chat endpoint gets them decoded to text.

Send times: ``request_rate`` (requests/s, ``inf`` = all at once) with gamma gaps of shape
``burstiness`` (1 = Poisson), as ``vllm bench serve``; ``request_rate=None`` replays a
workload's or trace's recorded arrival times (and means ``inf`` for ``random``).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

from minibatch.workload import Workload, fixed, gamma_arrivals, load_trace, load_workload, synthetic, uniform


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0     # seconds after the benchmark starts


@functools.lru_cache(maxsize=8)
def load_bench_tokenizer(name: str | None):
    """The tokenizer of ``name`` ('tiny' or a local checkpoint), else the tiny model's."""
    from minibatch.model.loader import resolve_model_path
    from minibatch.tokenizer import load_tokenizer

    for candidate in (name, "tiny"):
        try:
            tok = load_tokenizer(resolve_model_path(candidate)) if candidate else None
        except ValueError:
            tok = None
        if tok is not None:
            if candidate != name:
                warnings.warn(f"no local tokenizer for {name!r}: prompts use the tiny model's vocabulary "
                              "(pass --tokenizer DIR for the served model's own)", stacklevel=2)
            return tok
    raise ValueError("no tokenizer found; pass --tokenizer 'tiny' or a local checkpoint directory")


def make_workload(dataset: str, n: int, vocab_size: int, reserved_ids, input_len: int = 256,
                  output_len: int = 64, range_ratio: float = 0.0, seed: int = 0,
                  max_len: int | None = None) -> Workload:
    """``random``, a named workload (``load_workload``) or ``trace:PATH`` (``load_trace``)."""
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    if dataset == "random":
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")

        def lengths(x: int):
            lo, hi = max(1, math.floor(x * (1 - range_ratio))), max(1, math.ceil(x * (1 + range_ratio)))
            return fixed(x) if lo == hi else uniform(lo, hi)

        wl = synthetic(n, math.inf, input_len=lengths(input_len), output_len=lengths(output_len),
                       seed=seed, name="random")
    elif dataset.startswith("trace:"):
        wl = load_trace(dataset[len("trace:"):], vocab_size=vocab_size, reserved_ids=reserved_ids).slice(0, n)
        if max_len is not None:
            wl = wl.fit_lengths(max_len)
    else:
        wl = load_workload(dataset, n=n, max_len=max_len)
    return wl.materialize(vocab_size, seed=seed, reserved_ids=reserved_ids,
                          overwrite=not dataset.startswith("trace:"))


def make_requests(dataset: str, n: int, tokenizer: str | None = None, as_text: bool = False,
                  input_len: int = 256, output_len: int = 64, range_ratio: float = 0.0,
                  request_rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
                  max_len: int | None = None) -> list[BenchRequest]:
    """The benchmark's requests, in send order."""
    tok = load_bench_tokenizer(tokenizer)
    wl = make_workload(dataset, n, len(tok), tok.all_special_ids, input_len, output_len,
                       range_ratio, seed, max_len)
    if request_rate is None and dataset != "random":
        times = [r.arrival_time for r in wl]
    else:
        times = gamma_arrivals(len(wl), math.inf if request_rate is None else request_rate, burstiness, seed)
    out = []
    for spec, t in zip(wl, times):
        ids = list(spec.prompt_token_ids)
        prompt = tok.decode(ids) if as_text else ids
        out.append(BenchRequest(prompt, len(ids), spec.max_tokens, float(t)))
    return out
