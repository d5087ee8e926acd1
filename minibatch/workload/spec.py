"""What a workload is: request specs with arrival times, and operations on them.

A ``RequestSpec`` says when a request arrives and how long its prompt and output
are; token ids are optional and can be filled in later (``materialize``). A
``Workload`` is an immutable, arrival-ordered sequence of specs with a name; each
operation (``slice``, ``scale_time``, ``with_rate`` ...) returns a new workload.

Runs use ``ignore_eos=True`` so each request generates exactly ``max_tokens``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from .stats import workload_stats
from .tokens import TokenSynth

__all__ = ["RequestSpec", "Workload"]


@dataclass
class RequestSpec:
    arrival_time: float            # seconds from the workload's start
    prompt_len: int
    max_tokens: int                # output length to generate (runs use ignore_eos=True)
    prompt_token_ids: list[int] | None = None
    priority: int = 0              # lower = more urgent, as in vLLM
    tenant: str | None = None
    request_id: str | None = None
    prefix_id: int | None = None   # shared-prefix group, if any
    prefix_len: int = 0            # leading prompt tokens shared by the prefix_id group
    hash_ids: list[int] | None = None  # Mooncake: ids of the prompt's 512-token blocks
    model: str | None = None       # the model it asks for (a cluster routes it to a replica serving it)

    def __post_init__(self):
        if not (isinstance(self.arrival_time, (int, float, np.floating, np.integer))
                and math.isfinite(self.arrival_time) and self.arrival_time >= 0):
            raise ValueError(f"arrival_time must be a finite number >= 0, got {self.arrival_time!r}")
        self.arrival_time = float(self.arrival_time)
        for name in ("prompt_len", "max_tokens", "prefix_len", "priority"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {v!r}")
            setattr(self, name, int(v))
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be in [0, prompt_len], got {self.prefix_len}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"prompt_token_ids has {len(self.prompt_token_ids)} ids "
                             f"but prompt_len is {self.prompt_len}")

    def to_dict(self, token_ids: bool = True) -> dict:
        """Fields that differ from their defaults (what ``to_jsonl`` writes)."""
        d = {"arrival_time": self.arrival_time, "prompt_len": self.prompt_len,
             "max_tokens": self.max_tokens}
        for f in dataclasses.fields(self)[3:]:
            v = getattr(self, f.name)
            if v != f.default and (token_ids or f.name != "prompt_token_ids"):
                d[f.name] = v
        return d


FIELDS = tuple(f.name for f in dataclasses.fields(RequestSpec))


class Workload(Sequence[RequestSpec]):
    """An arrival-ordered sequence of ``RequestSpec``.

    ``len(w)``, ``for r in w``, ``w[i]`` work as for a list; ``w[a:b]`` is a
    ``Workload`` with the same arrival times (use ``w.slice(a, b)`` to rebase them
    to 0). ``meta`` carries free-form facts, e.g. what a trace loader skipped.
    """

    def __init__(self, requests: Iterable[RequestSpec] = (), name: str = "workload",
                 meta: dict | None = None):
        reqs = list(requests)
        for r in reqs:
            if not isinstance(r, RequestSpec):
                raise TypeError(f"expected RequestSpec, got {type(r).__name__}")
        reqs.sort(key=lambda r: r.arrival_time)  # stable: ties keep their order
        self._requests: list[RequestSpec] = reqs
        self.name = name
        self.meta = dict(meta or {})

    # --- sequence protocol ---------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self._requests)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._derive(self._requests[i])
        return self._requests[i]

    def __eq__(self, other) -> bool:
        return (isinstance(other, Workload) and self.name == other.name
                and self._requests == other._requests)

    def __repr__(self) -> str:
        if not self._requests:
            return f"Workload({self.name!r}, n=0)"
        s = self.stats()
        return (f"Workload({self.name!r}, n={s['n']}, duration={s['duration']:.1f}s, "
                f"rate={s['rate']:.3g}/s, input_mean={s['input_mean']:.0f}, "
                f"output_mean={s['output_mean']:.0f})")

    def _derive(self, requests, name: str | None = None) -> "Workload":
        return Workload(requests, name=self.name if name is None else name, meta=self.meta)

    # --- columns ---------------------------------------------------------------
    @property
    def arrival_times(self) -> np.ndarray:
        return np.array([r.arrival_time for r in self._requests], dtype=np.float64)

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.array([r.prompt_len for r in self._requests], dtype=np.int64)

    @property
    def output_lens(self) -> np.ndarray:
        return np.array([r.max_tokens for r in self._requests], dtype=np.int64)

    # --- time ------------------------------------------------------------------
    def _shift(self, reqs, offset: float, factor: float = 1.0) -> list[RequestSpec]:
        return [dataclasses.replace(r, arrival_time=max(0.0, (r.arrival_time - offset) * factor))
                for r in reqs]

    def slice(self, start: int = 0, stop: int | None = None) -> "Workload":
        """Requests ``start:stop`` (by index), times rebased so the first arrives at 0."""
        reqs = self._requests[start:stop]
        return self._derive(self._shift(reqs, reqs[0].arrival_time if reqs else 0.0))

    def time_window(self, t0: float, t1: float) -> "Workload":
        """Requests arriving in ``[t0, t1)``, times rebased so that ``t0`` becomes 0
        (the gap before the first request in the window is kept)."""
        if t1 < t0:
            raise ValueError(f"time_window: t1 ({t1}) < t0 ({t0})")
        return self._derive(self._shift([r for r in self._requests if t0 <= r.arrival_time < t1], t0))

    def scale_time(self, factor: float) -> "Workload":
        """Multiply every arrival time by ``factor`` (2 = replay 2x slower, rate halves)."""
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"scale_time: factor must be finite and >= 0, got {factor}")
        return self._derive(self._shift(self._requests, 0.0, factor))

    def with_rate(self, rate: float) -> "Workload":
        """Rescale times so the mean rate ``(n-1)/duration`` is exactly ``rate`` req/s.
        The shape of the arrival process (CV, bursts) is kept. ``rate=inf``: all at 0."""
        if not rate > 0:
            raise ValueError(f"with_rate: rate must be > 0, got {rate}")
        if math.isinf(rate):
            return self.scale_time(0.0)
        s = self.stats()
        if s["n"] < 2 or s["duration"] == 0:
            raise ValueError("with_rate needs at least two requests that do not all arrive at once")
        return self.scale_time(s["rate"] / rate)

    def merge(self, *others: "Workload", name: str | None = None) -> "Workload":
        """All requests of this and the other workloads, interleaved by arrival time."""
        reqs = list(self._requests)
        for o in others:
            reqs.extend(o)
        return self._derive(reqs, name)

    # --- lengths and token ids ------------------------------------------------
    def materialize(self, vocab_size: int, seed: int = 0, reserved_ids: Iterable[int] = (),
                    *, overwrite: bool = False) -> "Workload":
        """Fill ``prompt_token_ids`` where they are None (all of them with ``overwrite``).

        Ids are deterministic in (vocab_size, seed, reserved_ids, request_id),
        lie in ``[0, vocab_size)`` and avoid ``reserved_ids``. Requests with the
        same ``prefix_id`` share their first ``prefix_len`` ids, and requests with
        equal leading ``hash_ids`` share those 512-token blocks (see ``tokens``).
        A request without ``request_id`` is keyed by its index in this workload.
        """
        synth = TokenSynth(vocab_size, seed, reserved_ids)
        out = []
        for i, r in enumerate(self._requests):
            if r.prompt_token_ids is None or overwrite:
                ids = synth.prompt(r.prompt_len, r.request_id if r.request_id is not None else i,
                                   r.prefix_id, r.prefix_len, r.hash_ids)
                r = dataclasses.replace(r, prompt_token_ids=ids)
            out.append(r)
        return self._derive(out)

    def fit_lengths(self, max_len: int, quantile: float = 0.99) -> "Workload":
        """Shrink lengths so that every ``prompt_len + max_tokens <= max_len``.

        All prompt, prefix and output lengths are first scaled by one factor
        ``max_len / (quantile of prompt_len + max_tokens)`` (only if > max_len), which
        keeps the shape of the distributions and the input/output ratio; the few
        requests still too long are then shrunk individually. Token ids are cut
        (group prefix kept, so shared prefixes stay shared).
        """
        if max_len < 2:
            raise ValueError(f"fit_lengths: max_len must be >= 2, got {max_len}")
        if not self._requests:
            return self
        total = self.prompt_lens + self.output_lens
        factor = min(1.0, max_len / float(np.quantile(total, quantile)))
        out = []
        for r in self._requests:
            p, o, k = (max(1, math.floor(x * factor)) for x in (r.prompt_len, r.max_tokens, r.prefix_len))
            if p + o > max_len:  # the tail beyond the quantile: shrink this one further
                s = max_len / (p + o)
                p, o = max(1, math.floor(p * s)), max(1, math.floor(o * s))
            k = min(k, p) if r.prefix_len else 0
            ids = r.prompt_token_ids
            if ids is not None:
                ids = list(ids[:k]) + list(ids[r.prefix_len: r.prefix_len + p - k])
            out.append(dataclasses.replace(r, prompt_len=p, max_tokens=o, prefix_len=k,
                                           prompt_token_ids=ids))
        return self._derive(out)

    # --- statistics and files -------------------------------------------------
    def stats(self) -> dict:
        """n, duration, rate, cv, iod_1s, peak_1s and input_/output_ mean, p50, p90,
        p99, max (definitions in ``minibatch.workload.stats``)."""
        return workload_stats(self.arrival_times, self.prompt_lens, self.output_lens)

    def to_jsonl(self, path, token_ids: bool = True) -> None:
        """Write a header line then one JSON object per request (default fields
        omitted). ``token_ids=False`` leaves prompt ids out (``materialize`` later)."""
        header = {"minibatch_workload": 1, "name": self.name, "meta": self.meta}
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for r in self._requests:
                f.write(json.dumps(r.to_dict(token_ids)) + "\n")

    @classmethod
    def from_jsonl(cls, path) -> "Workload":
        """Read a file written by ``to_jsonl`` (errors raise ``TraceFormatError``)."""
        from .traces import load_trace
        return load_trace(path, format="jsonl")
