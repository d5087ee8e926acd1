"""The project's named workloads, generated in code from fixed seeds.

``load_workload("chat")`` needs no data files: each preset is a function in
``presets`` with fixed seeds, and ``datasets/make_workloads.py`` writes the same
workloads to ``datasets/workloads/*.jsonl`` for inspection and other tools (one
source of truth). Shapes are fitted to the published statistics of real traces
(see ``datasets/traces/SOURCES.md`` and ``datasets/README.md``):

- lengths are ``lognormal`` with the trace's **median and mean** matched exactly
  (median = the typical request, mean = the total token load) and clipped to
  the trace's min and max. Real length histograms are multi-modal, so p90/p99
  are only approximate; ``datasets/README.md`` lists published vs generated;
- every preset is rescaled with ``with_rate`` so its mean rate is ``rate``, and its
  arrival times are rounded to the microsecond (compact files, exact round trips).

| name          | like                          | arrivals                  | input tokens      | output tokens        |
|---------------|-------------------------------|---------------------------|-------------------|----------------------|
| chat          | Azure conv 2023 (Splitwise)   | gamma, CV 1.09, 5.53/s    | median 1020, mean 1155 | median 129, mean 211 |
| rag           | retrieval-augmented QA        | Poisson, 2/s              | 1k-4k, median 2048 | median 64           |
| code_bursty   | Azure code 2023 (Splitwise)   | on/off bursts, 2.57/s     | median 1469, mean 2048 | median 13, mean 28 |
| long_tail     | heavy-tailed outputs          | Poisson, 2/s              | median 512         | median 64, p99 ~2100 |
| shared_prefix | 8 system prompts, Zipf reuse  | Poisson, 4/s              | prefix 256-1024 + suffix ~128 | median 128 |

``load_workload(name, n=..., rate=..., max_len=...)`` gives smaller or faster
variants; ``max_len`` shrinks all lengths by one factor so each request fits a
small model's context (``Workload.fit_lengths``), e.g. ``max_len=1024`` for the
tiny model.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from .arrivals import as_rng, onoff_arrivals
from .lengths import lognormal, uniform
from .spec import Workload
from .synthetic import from_arrivals, shared_prefix as _shared_prefix, synthetic

__all__ = ["presets", "load_workload"]


def _finish(wl: Workload, rate: float) -> Workload:
    """Rescale to the mean rate ``rate`` and round arrival times to 1 us."""
    wl = wl.with_rate(rate)
    reqs = [dataclasses.replace(r, arrival_time=round(r.arrival_time, 6)) for r in wl]
    return Workload(reqs, name=wl.name, meta=wl.meta)


def chat(n: int = 1000, rate: float = 5.53, seed: int = 1001) -> Workload:
    """Conversation serving, like the Azure LLM inference trace 2023, conv
    (Splitwise, ISCA'24): 19,366 requests in 3,502 s, 5.53 req/s, gap CV 1.09;
    input mean 1,154.7, p50 1,020, min 2, max 14,050; output mean 211.1, p50 129,
    min 7, max 1,000. Gamma arrivals with burstiness 1/1.09^2 = 0.84."""
    wl = synthetic(n, rate, burstiness=1 / 1.09 ** 2,
                   input_len=lognormal(median=1020, mean=1154.7, min=2, max=14050),
                   output_len=lognormal(median=129, mean=211.1, min=7, max=1000),
                   seed=seed, name="chat")
    return _finish(wl, rate)


def rag(n: int = 500, rate: float = 2.0, seed: int = 1002) -> Workload:
    """Retrieval-augmented generation: long prompts (a question plus retrieved
    passages, 1k-4k tokens, median 2,048) and short answers (median 64, max 512).
    No public RAG trace is in SOURCES.md; these are design values. Poisson arrivals."""
    wl = synthetic(n, rate, burstiness=1.0,
                   input_len=lognormal(median=2048, sigma=0.35, min=1024, max=4096),
                   output_len=lognormal(median=64, sigma=0.6, min=8, max=512),
                   seed=seed, name="rag")
    return _finish(wl, rate)


# On/off fit of the Azure code 2023 trace (datasets/make_workloads.py --fit): gaps
# over 5 s are OFF periods (57 of them, mean 43.2 s, CV 1.09 ~ exponential); the
# 58 ON periods last 16.7 s on average and their gaps have mean 0.111 s, CV 2.21.
CODE_RATE_ON = 1 / 0.1108       # req/s inside a burst
CODE_BURSTINESS_ON = 1 / 2.21 ** 2
CODE_MEAN_ON = 16.74            # s
CODE_MEAN_OFF = 43.25           # s


def code_bursty(n: int = 2000, rate: float = 2.57, seed: int = 1003) -> Workload:
    """Code completion, like the Azure LLM inference trace 2023, code (Splitwise,
    ISCA'24): 8,819 requests in 3,436 s, 2.57 req/s, gap CV 13.15 (on/off bursts,
    silent gaps up to 217 s, median gap 0.064 s); input mean 2,047.8, p50 1,469,
    min 3, max 7,437; output mean 27.9, p50 13, min 6, max 1,899. Arrivals: the
    fitted on/off process (CV about 11-13 at this size)."""
    times = onoff_arrivals(n, CODE_RATE_ON, CODE_MEAN_ON, CODE_MEAN_OFF,
                           CODE_BURSTINESS_ON, as_rng(seed))
    wl = from_arrivals(times, input_len=lognormal(median=1469, mean=2047.8, min=3, max=7437),
                       output_len=lognormal(median=13, mean=27.9, min=6, max=1899),
                       seed=seed, name="code_bursty")
    return _finish(wl, rate)


def long_tail(n: int = 1000, rate: float = 2.0, seed: int = 1004) -> Workload:
    """Heavy-tailed outputs: most answers are short (median 64) but 1% run past
    ~2,000 tokens (lognormal sigma 1.5, max 4,096), the regime where static
    batching wastes most and preemption matters. The tail is stretched from Azure
    code 2023's outputs (p99/p50 = 251.5/13 ~ 19, i.e. sigma ~ 1.27). Poisson arrivals."""
    wl = synthetic(n, rate, burstiness=1.0,
                   input_len=lognormal(median=512, sigma=0.8, max=4096),
                   output_len=lognormal(median=64, sigma=1.5, max=4096),
                   seed=seed, name="long_tail")
    return _finish(wl, rate)


def shared_prefix(n: int = 1000, rate: float = 4.0, seed: int = 1005) -> Workload:
    """Prefix caching: 8 system prompts of 256-1,024 tokens, reused with Zipf
    popularity (s = 1: the top prompt serves ~37% of requests), each followed by
    a user turn (median 128) and an answer (median 128). Poisson arrivals. Token
    ids are materialized for a 32,000-token vocabulary (token seed = ``seed``)."""
    wl = _shared_prefix(n, rate, num_prefixes=8, prefix_len=uniform(256, 1024),
                        suffix_len=lognormal(median=128, sigma=0.8, max=1024),
                        output_len=lognormal(median=128, sigma=0.8, max=1024),
                        popularity=1.0, seed=seed, name="shared_prefix")
    return _finish(wl, rate)


presets: dict[str, Callable[..., Workload]] = {
    "chat": chat, "rag": rag, "code_bursty": code_bursty,
    "long_tail": long_tail, "shared_prefix": shared_prefix,
}


def load_workload(name: str, *, n: int | None = None, rate: float | None = None,
                  max_len: int | None = None, seed: int | None = None,
                  vocab_size: int | None = None, reserved_ids: Iterable[int] = (),
                  **overrides) -> Workload:
    """A named workload, generated deterministically (no files needed).

    n, rate, seed: override the preset's size, mean rate (exact) and seed.
    max_len: shrink lengths so every prompt_len + max_tokens <= max_len.
    vocab_size, reserved_ids: (re)materialize prompt token ids for this vocabulary.
    """
    if name not in presets:
        raise KeyError(f"unknown workload {name!r}; named workloads: {', '.join(presets)}")
    kwargs = {k: v for k, v in (("n", n), ("rate", rate), ("seed", seed)) if v is not None}
    wl = presets[name](**kwargs, **overrides)
    if max_len is not None:
        wl = wl.fit_lengths(max_len)
    if vocab_size is not None:
        token_seed = wl.meta.get("token_seed", 0)
        wl = wl.materialize(vocab_size, seed=token_seed, reserved_ids=reserved_ids, overwrite=True)
    return wl
