"""Synthetic workloads: arrival process + length distributions + request classes.

Each generator draws arrivals, input lengths, output lengths and classes from
four independent random streams spawned from ``seed``, so changing e.g. the
output distribution leaves the arrival times unchanged.

    synthetic(1000, rate=4, burstiness=0.5, input_len=lognormal(median=512, sigma=0.8, max=4096),
              output_len=lognormal(median=37, sigma=1.0, max=512), priorities=[0, 1])
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from .arrivals import gamma_arrivals
from .lengths import as_length_dist
from .spec import RequestSpec, Workload

__all__ = ["synthetic", "from_arrivals", "shared_prefix", "multi_tenant"]

# `vllm bench serve --dataset-name random` defaults: 1024 input, 128 output tokens.
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128


def _streams(seed: int, k: int = 4) -> list[np.random.Generator]:
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(k)]


def _assign(classes, n: int, rng: np.random.Generator, what: str) -> list:
    """``n`` draws from ``classes``: a sequence (uniform) or a {class: weight} mapping."""
    if classes is None:
        return [None] * n
    if isinstance(classes, Mapping):
        values = list(classes)
        w = np.asarray([classes[v] for v in values], dtype=np.float64)
        if w.size == 0 or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"{what}: weights must be >= 0 and not all 0")
        p = w / w.sum()
    else:
        values, p = list(classes), None
        if not values:
            raise ValueError(f"{what}: need at least one class")
    idx = rng.choice(len(values), size=n, p=p)
    return [values[i] for i in idx]


def from_arrivals(arrival_times: Sequence[float] | np.ndarray, input_len=DEFAULT_INPUT_LEN,
                  output_len=DEFAULT_OUTPUT_LEN, seed: int = 0, priorities=None, tenants=None,
                  name: str | None = None) -> Workload:
    """A workload with the given arrival times and lengths drawn from distributions
    (an int means a fixed length). Request ids are ``"{name}-{i}"``."""
    times = np.asarray(arrival_times, dtype=np.float64)
    n = times.size
    name = name or "synthetic"
    _, r_in, r_out, r_cls = _streams(seed)
    ins = as_length_dist(input_len).sample(n, r_in)
    outs = as_length_dist(output_len).sample(n, r_out)
    prios = _assign(priorities, n, r_cls, "priorities")
    tens = _assign(tenants, n, r_cls, "tenants")
    reqs = [RequestSpec(arrival_time=float(times[i]), prompt_len=int(ins[i]),
                        max_tokens=int(outs[i]), priority=int(prios[i] or 0),
                        tenant=tens[i], request_id=f"{name}-{i}")
            for i in range(n)]
    return Workload(reqs, name=name)


def synthetic(n: int, rate: float, burstiness: float = 1.0, input_len=DEFAULT_INPUT_LEN,
              output_len=DEFAULT_OUTPUT_LEN, seed: int = 0, priorities=None, tenants=None,
              name: str | None = None) -> Workload:
    """``n`` requests with gamma arrivals (see ``arrivals.gamma_arrivals``: first at 0,
    mean gap 1/rate, CV 1/sqrt(burstiness); ``rate=inf`` sends all at 0).

    ``priorities=[0, 1]`` / ``tenants=["a", "b"]`` assign classes uniformly at
    random; a dict ``{class: weight}`` gives weighted classes.
    """
    arrivals_rng = _streams(seed)[0]
    times = gamma_arrivals(n, rate, burstiness, arrivals_rng)
    return from_arrivals(times, input_len, output_len, seed, priorities, tenants, name)


def shared_prefix(n: int, rate: float, num_prefixes: int = 4, prefix_len=512,
                  suffix_len=128, output_len=DEFAULT_OUTPUT_LEN, seed: int = 0,
                  burstiness: float = 1.0, popularity: float = 0.0, vocab_size: int = 32000,
                  reserved_ids: Iterable[int] = (), priorities=None, tenants=None,
                  name: str | None = None) -> Workload:
    """Requests that start with one of ``num_prefixes`` shared system prompts.

    Each prefix group has one length (``prefix_len``: an int, or a distribution
    sampled once per group); each request adds its own ``suffix_len`` tokens.
    Groups are picked uniformly, or Zipf-like with ``popularity`` = s > 0 (group
    k has weight 1/(k+1)^s). Token ids are materialized (``vocab_size``,
    ``reserved_ids``, token seed = ``seed``), so all requests of a group start with
    the same ids; ``prefix_id``/``prefix_len`` record the grouping.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    name = name or "shared_prefix"
    r_arr, r_in, r_out, r_cls = _streams(seed)
    times = gamma_arrivals(n, rate, burstiness, r_arr)
    group_lens = as_length_dist(prefix_len).sample(num_prefixes, r_in)
    suffixes = as_length_dist(suffix_len).sample(n, r_in)
    outs = as_length_dist(output_len).sample(n, r_out)
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** popularity
    groups = r_cls.choice(num_prefixes, size=n, p=weights / weights.sum())
    prios = _assign(priorities, n, r_cls, "priorities")
    tens = _assign(tenants, n, r_cls, "tenants")
    reqs = [RequestSpec(arrival_time=float(times[i]),
                        prompt_len=int(group_lens[groups[i]] + suffixes[i]),
                        max_tokens=int(outs[i]), priority=int(prios[i] or 0), tenant=tens[i],
                        request_id=f"{name}-{i}", prefix_id=int(groups[i]),
                        prefix_len=int(group_lens[groups[i]]))
            for i in range(n)]
    wl = Workload(reqs, name=name, meta={"token_seed": seed, "vocab_size": vocab_size})
    return wl.materialize(vocab_size, seed=seed, reserved_ids=reserved_ids)


def multi_tenant(n: int, rate: float, num_tenants: int = 16, system_prompt_len=2048, question_len=128,
                 output_len=DEFAULT_OUTPUT_LEN, seed: int = 0, burstiness: float = 1.0,
                 popularity: float = 0.0, vocab_size: int = 32000, reserved_ids: Iterable[int] = (),
                 name: str | None = None) -> Workload:
    """Tenants with long system prompts: request ``i`` belongs to tenant ``tenant-k`` and starts
    with that tenant's system prompt (``system_prompt_len`` tokens: an int, or a distribution
    sampled once per tenant), then its own question (``question_len``).

    A :func:`shared_prefix` workload with one prefix group per tenant and ``tenant`` set to
    the group, so that a session router (sticky by tenant) and a prefix-aware router (by the
    prompt's tokens) can both find what a replica has cached. ``popularity`` > 0 makes some
    tenants busier (Zipf-like, as in ``shared_prefix``).
    """
    wl = shared_prefix(n, rate, num_prefixes=num_tenants, prefix_len=system_prompt_len, suffix_len=question_len,
                       output_len=output_len, seed=seed, burstiness=burstiness, popularity=popularity,
                       vocab_size=vocab_size, reserved_ids=reserved_ids, name=name or "multi_tenant")
    reqs = [dataclasses.replace(r, tenant=f"tenant-{r.prefix_id}") for r in wl]
    return Workload(reqs, name=wl.name, meta={**wl.meta, "num_tenants": num_tenants})
