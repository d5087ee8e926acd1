"""Per-request records and the run summary, with ``vllm bench serve``'s metric definitions.

For a request with arrival ``a``, first token at ``f``, token times ``t_1..t_n`` and
finish ``e``: TTFT = f - a; E2E = e - a; TPOT = (t_n - t_1) / (n - 1) (the first
token excluded); ITL = every gap t_{i+1} - t_i; queue delay = first scheduled - a.
Throughput counts output tokens over the run's duration (first arrival to last
finish).

``failed`` counts aborted and rejected requests; ``rejected`` the rejected ones alone (never
admitted: a prompt longer than ``max_model_len``, say) and ``rejected_reasons`` maps each
short reason (:func:`reject_reason`) to its count, e.g. ``{"prompt longer than
max_model_len": 812}``.

Wasted compute (vllm#54644's "recompute tax"): ``num_computed_tokens`` (every token the engine
computed for the requests, recomputed ones included), ``num_recomputed_tokens`` (those computed
again because a recompute preemption had thrown their KV away; ``Scheduler._count_computed``) and
``recompute_waste``, the second over the first.

Engine-side keys, from the step timeline: ``num_preemptions`` (recompute + swap),
``num_swapped_blocks`` (KV blocks copied to host), ``padding_waste`` (request-level
batching: padded slot-steps / (padded + computing slot-steps); 0 for iteration-level
policies), ``kv_reserved_unused_mean`` and ``kv_internal_waste_mean`` (fractions of the
pool's slots: whole blocks reserved beyond requests' last tokens, and empty slots in
last blocks; time-weighted over steps), ``kv_reserved_mean``, ``kv_internal_frag_mean`` and
``kv_external_frag_mean`` (the vLLM paper's reserved slots, internal and external
fragmentation, same weighting; see ``minibatch.kv_cache``), ``prefix_cache_hit_rate`` (prompt tokens served
from the prefix cache at each request's first admission / prompt tokens of admitted
requests). Goodput counts, per second, the requests that meet every bound of an SLO such
as ``{"ttft": 0.8, "tpot": 0.05}`` (seconds); ``slo_attainment`` is the share of requests
that meet it, each request on its own (not a bound on the mean).

Steady state: ``summarize(..., trim=0.1)`` keeps only the requests that arrived in the
middle 80% of the arrival span (:func:`steady_state`), so that the warm-up (an empty
engine) and the drain (no more arrivals) do not count; throughput and goodput then count
what happened inside that window (output tokens whose token time falls in it; requests,
and those of them that met the SLO, that finished in it) per second of the window
(``window_s``). :func:`capacity` is DistServe's: the highest request rate at which at least
``target`` of the requests meet the SLO, by bisection or over a sweep.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from minibatch.timeline import StepRecord

if TYPE_CHECKING:
    from minibatch.request import Request

PERCENTILES = (50, 90, 99)
# SLO bounds are seconds in Python: {"ttft": 0.8, "tpot": 0.05, "e2e": 5.0}. On the command line
# they are vLLM bench's milliseconds, ``--goodput ttft:800 tpot:50 e2el:5000`` (parse_goodput).
SLO_METRICS = ("ttft", "tpot", "e2e")
_SLO_CLI_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e", "e2e": "e2e"}


def tpot(first_token_time: float | None, last_token_time: float | None, num_output_tokens: int) -> float | None:
    """Time per output token after the first: ``(t_n - t_1) / (n - 1)``; ``None`` below two tokens.

    The one definition, shared by the engine's records and the load generator's (where
    ``t_1`` and ``t_n`` are the first and last streamed chunk)."""
    if num_output_tokens < 2 or first_token_time is None or last_token_time is None:
        return None
    return (last_token_time - first_token_time) / (num_output_tokens - 1)


def percentiles(values, ps=PERCENTILES) -> dict:
    """``{p: value}``, linear interpolation between order statistics (numpy's default, as
    ``vllm bench serve``); ``nan`` for no values."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return {p: float(np.percentile(arr, p)) if arr.size else float("nan") for p in ps}


def parse_goodput(goodput) -> dict[str, float]:
    """SLO bounds in seconds from vLLM bench's form, milliseconds: ``["ttft:800", "tpot:50",
    "e2el:5000"]`` (or ``"ttft:800 tpot:50"``) -> ``{"ttft": 0.8, "tpot": 0.05, "e2e": 5.0}``.

    A dict is taken as seconds already (the Python form) and only checked."""
    if not goodput:
        return {}
    if isinstance(goodput, dict):
        items, scale = goodput.items(), 1.0
    else:
        if isinstance(goodput, str):
            goodput = goodput.replace(",", " ").split()
        items, scale = [], 1e-3
        for term in goodput:
            name, sep, value = str(term).partition(":")
            if not sep:
                raise ValueError(f"cannot read SLO term {term!r}; write e.g. ttft:800 tpot:50 (milliseconds)")
            items.append((name.strip(), value))
    slo = {}
    for name, value in items:
        key = _SLO_CLI_NAMES.get(name) if scale != 1.0 else (name if name in SLO_METRICS else None)
        if key is None:
            known = "ttft, tpot, e2el (milliseconds)" if scale != 1.0 else ", ".join(SLO_METRICS) + " (seconds)"
            raise ValueError(f"unknown SLO metric {name!r}; use {known}")
        try:
            bound = float(value) * scale
        except (TypeError, ValueError):
            raise ValueError(f"SLO {name} must be a number, got {value!r}") from None
        if not 0 < bound < float("inf"):
            raise ValueError(f"SLO {name} must be a positive, finite bound, got {value!r}")
        slo[key] = bound
    return slo


@dataclass
class RequestRecord:
    """The one record of a request's life and latencies (``RunResult.requests``,
    ``RequestOutput.metrics``), with ``vllm bench serve``'s definitions (module docstring)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    tenant: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache (first admission)
    finish_reason: str | None = None
    error: str | None = None
    output_token_ids: list[int] | None = None
    replica: int | None = None            # which replica served it (minibatch.cluster); None for one engine
    model: str | None = None              # the model the request asked for (minibatch.cluster), if any
    computed_tokens: int = 0              # tokens the engine computed for it (recomputed ones included)
    recomputed_tokens: int = 0            # of those, computed again after a recompute preemption

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        return tpot(self.first_token_time, self.token_times[-1] if self.token_times else None, self.output_len)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queue_delay(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @classmethod
    def of(cls, req: "Request", keep_tokens: bool = True) -> "RequestRecord":
        return cls(req.request_id, req.arrival_time, req.num_prompt_tokens, req.num_output_tokens,
                   req.priority, req.tenant, req.first_scheduled_time, req.first_token_time, req.finish_time,
                   list(req.token_times), req.num_preemptions, req.num_cached_tokens,
                   req.status.value if req.status.finished else None, req.error,
                   list(req.output_token_ids) if keep_tokens else None,
                   computed_tokens=req.num_computed_total, recomputed_tokens=req.num_recomputed_tokens)


def records_from_events(events) -> list[RequestRecord]:
    """Rebuild request records from an event log of ``(time, event, request_id, info)``.

    Events: ``arrival`` (info: ``prompt_len``, optional ``priority``/``tenant``),
    ``schedule``, ``token`` (one per generated token), ``preempt``, ``finish``
    (info: ``reason``, default ``"length"``), ``abort``, ``reject`` (info: ``error``).
    The engine emits the same events, so records built this way equal the engine's.
    """
    recs: dict[str, RequestRecord] = {}
    for time, event, rid, info in sorted(events, key=lambda e: e[0]):
        info = info or {}
        if event == "arrival":
            recs[rid] = RequestRecord(rid, time, info.get("prompt_len", 0), 0,
                                      info.get("priority", 0), info.get("tenant"))
            continue
        rec = recs[rid]
        if event == "schedule" and rec.first_scheduled_time is None:
            rec.first_scheduled_time = time
        elif event == "token":
            rec.token_times.append(time)
            rec.output_len += 1
            if rec.first_token_time is None:
                rec.first_token_time = time
        elif event == "preempt":
            rec.num_preemptions += 1
        elif event in ("finish", "abort", "reject"):
            rec.finish_time = time
            rec.finish_reason = {"finish": info.get("reason", "length"), "abort": "abort",
                                 "reject": "rejected"}[event]
            rec.error = info.get("error")
    return list(recs.values())


# The engine's reasons to refuse a request (LLMEngine.validate), by a phrase of its message,
# as the short names the summary counts them under.
REJECT_REASONS = (
    ("max_model_len", "prompt longer than max_model_len"),
    ("max_num_batched_tokens", "prompt over max_num_batched_tokens"),
    ("can never be served", "more KV blocks than the cache holds"),
    ("outside the vocabulary", "token id outside the vocabulary"),
    ("empty prompt", "empty prompt"),
    ("invalid sampling parameter", "invalid sampling parameter"),
    ("no replica serves model", "no replica serves the model"),      # minibatch.cluster
    ("max_inflight_requests", "over max_inflight_requests"),         # backpressure (TGI)
    ("max_batch_prefill_tokens", "prompt over max_batch_prefill_tokens"),
    ("max_batch_total_tokens", "request over max_batch_total_tokens"),
)


def reject_reason(error: str | None) -> str:
    """A short, stable name for why a request was rejected (summary ``rejected_reasons``):
    one of :data:`REJECT_REASONS`, else the message's first clause with numbers as ``N``."""
    if not error:
        return "unknown"
    for phrase, reason in REJECT_REASONS:
        if phrase in error:
            return reason
    head = re.split(r"[:;(]", error, maxsplit=1)[0]
    return re.sub(r"\d+(\.\d+)?", "N", " ".join(head.split()))[:80] or "unknown"


def _stats(prefix: str, values: list[float], out: dict) -> None:
    arr = [v for v in values if v is not None]
    out[f"{prefix}_mean"] = float(np.mean(arr)) if arr else float("nan")
    for p, v in percentiles(arr).items():
        out[f"{prefix}_p{p}"] = v


def meets_slo(rec, slo: dict[str, float]) -> bool:
    """Did a completed request meet every bound of ``slo`` (seconds; keys of SLO_METRICS)?
    Works on anything with ``completed`` and the latency properties (the load generator's
    results too)."""
    if not rec.completed:
        return False
    for key, bound in slo.items():
        if key not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {key!r}; use {', '.join(SLO_METRICS)} (seconds)")
        value = getattr(rec, key)
        if key == "tpot" and value is None:      # a one-token output has no TPOT
            continue
        if value is None or value > bound:
            return False
    return True


def steady_window(records, trim: float = 0.1) -> tuple[float, float]:
    """``(t_lo, t_hi)``: the middle ``1 - 2 * trim`` of the span of the requests' arrival times."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    times = [r.arrival_time for r in records]
    if not times:
        return 0.0, 0.0
    t0, t1 = min(times), max(times)
    return t0 + trim * (t1 - t0), t1 - trim * (t1 - t0)


def steady_state(records, trim: float = 0.1) -> list:
    """The requests that arrived in the middle ``1 - 2 * trim`` of the arrival span (default:
    the middle 80%): what a steady-state measurement keeps, leaving out the warm-up (the
    first arrivals meet an empty engine) and the drain (the last ones meet no competition)."""
    lo, hi = steady_window(records, trim)
    return [r for r in records if lo <= r.arrival_time <= hi]


def capacity(attainment, target: float = 0.9, lo: float = 0.5, hi: float = 16.0,
             tol: float = 0.05) -> float:
    """The highest request rate (req/s) at which at least ``target`` of the requests meet the
    SLO: DistServe's capacity.

    ``attainment`` is either a function ``rate -> attainment`` (it runs the workload at that
    rate and returns the fraction of steady-state requests that met the SLO; it is assumed
    to fall as the rate grows), searched by bisection between ``lo`` and ``hi`` to a
    relative tolerance ``tol``; or a sweep already run, a mapping ``{rate: attainment}``,
    whose answer is the highest rate up to which every rate tried meets the target.
    Returns 0.0 if even the lowest rate misses the target, and ``hi`` if ``hi`` meets it.
    """
    if not callable(attainment):
        best = 0.0
        for rate, att in sorted(attainment.items()):
            if att < target:
                break
            best = rate
        return best
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo!r}, hi={hi!r}")
    if attainment(lo) < target:
        return 0.0
    if attainment(hi) >= target:
        return hi
    while hi - lo > tol * lo:
        mid = (lo * hi) ** 0.5          # geometric: the same relative step at any scale
        if attainment(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class CapacityEstimate:
    """Capacity measured once per seed: the median is the figure to quote, ``lo``/``hi`` its spread."""

    per_seed: tuple[float, ...]
    seeds: tuple

    @property
    def median(self) -> float:
        return float(np.median(self.per_seed))

    @property
    def lo(self) -> float:
        return float(min(self.per_seed))

    @property
    def hi(self) -> float:
        return float(max(self.per_seed))

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the seeds disagree, relative to the figure."""
        return (self.hi - self.lo) / self.median if self.median > 0 else float("inf")

    def __format__(self, spec: str) -> str:
        spec = spec or ".2f"
        return f"{self.median:{spec}} ({self.lo:{spec}}–{self.hi:{spec}})"


def capacity_over_seeds(attainment, seeds, target: float = 0.9, lo: float = 0.5, hi: float = 16.0,
                        tol: float = 0.05) -> CapacityEstimate:
    """:func:`capacity` by bisection once per seed: ``attainment(rate, seed)`` runs the workload of
    that seed at that rate and returns its steady-state SLO attainment. A capacity from one seed
    is one draw of the arrivals; quote the median and show the spread."""
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("capacity_over_seeds needs at least one seed")
    per = tuple(capacity(lambda r, s=s: attainment(r, s), target=target, lo=lo, hi=hi, tol=tol) for s in seeds)
    return CapacityEstimate(per, seeds)


def summarize(records: list[RequestRecord], steps: list[StepRecord] | None = None,
              slo: dict[str, float] | None = None, trim: float = 0.0) -> dict:
    """The flat summary dict of a run (see module docstring for the definitions).

    ``trim > 0`` summarizes the steady state only: the latencies and attainment of the
    requests of :func:`steady_state`, the steps that started in their arrival window, and
    throughput and goodput counted inside that window (tokens whose token time falls in it;
    requests, of all, that finished in it) per second of it. In overload the latencies
    still grow with the run's length (there is no steady state); the throughput is then
    the saturation throughput.
    """
    steps = steps or []
    window = None
    everyone = records
    if trim:
        window = steady_window(records, trim)
        records = steady_state(records, trim)
        steps = [s for s in steps if window[0] <= s.start_time <= window[1]]
    done = [r for r in records if r.completed]
    out: dict = {"num_requests": len(records), "completed": len(done),
                 "failed": sum(1 for r in records if r.finish_reason in ("abort", "rejected"))}
    reasons: dict[str, int] = {}
    for r in records:
        if r.finish_reason == "rejected":
            key = reject_reason(r.error)
            reasons[key] = reasons.get(key, 0) + 1
    out["rejected"] = sum(reasons.values())
    out["rejected_reasons"] = dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    starts = [r.arrival_time for r in records]
    ends = [r.finish_time for r in done if r.finish_time is not None]
    duration = (max(ends) - min(starts)) if ends else 0.0
    out["duration_s"] = duration
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    out["total_input_tokens"] = in_tokens
    out["total_output_tokens"] = out_tokens
    out["request_throughput"] = len(done) / duration if duration > 0 else 0.0
    out["throughput_tok_s"] = out_tokens / duration if duration > 0 else 0.0
    out["total_throughput_tok_s"] = (out_tokens + in_tokens) / duration if duration > 0 else 0.0
    _stats("ttft", [r.ttft for r in done], out)
    _stats("tpot", [r.tpot for r in done], out)
    _stats("itl", [g for r in done for g in r.itl], out)
    _stats("e2e", [r.e2e for r in done], out)
    _stats("queue_delay", [r.queue_delay for r in done], out)
    if window is not None:
        t0, t1 = window
        span = t1 - t0
        out["window_s"] = span
        finished = [r for r in everyone if r.completed and r.finish_time is not None and t0 <= r.finish_time <= t1]
        out_in = sum(1 for r in everyone for t in r.token_times if t0 <= t <= t1)
        in_in = sum(r.prompt_len for r in everyone if r.first_token_time is not None and t0 <= r.first_token_time <= t1)
        out["request_throughput"] = len(finished) / span if span > 0 else 0.0
        out["throughput_tok_s"] = out_in / span if span > 0 else 0.0
        out["total_throughput_tok_s"] = (out_in + in_in) / span if span > 0 else 0.0
    if slo:
        good = sum(1 for r in done if meets_slo(r, slo))
        out["slo_attainment"] = good / len(records) if records else 0.0
        if window is None:
            out["goodput"] = good / duration if duration > 0 else 0.0
        else:
            good_in = sum(1 for r in finished if meets_slo(r, slo))
            out["goodput"] = good_in / span if span > 0 else 0.0
    prompt_total = sum(r.prompt_len for r in records if r.first_scheduled_time is not None)
    out["prefix_cache_hit_rate"] = (sum(r.num_cached_tokens for r in records) / prompt_total
                                    if prompt_total else 0.0)
    out["num_preemptions"] = sum(r.num_preemptions for r in records)
    computed = sum(r.computed_tokens for r in records)
    out["num_computed_tokens"] = computed
    out["num_recomputed_tokens"] = sum(r.recomputed_tokens for r in records)
    out["recompute_waste"] = out["num_recomputed_tokens"] / computed if computed else 0.0
    out["num_swapped_blocks"] = sum(s.num_swapped_out_blocks for s in steps)
    if steps:
        w = np.asarray([s.duration for s in steps], dtype=float)

        def time_mean(values) -> float:
            v = np.asarray(values, dtype=float)
            return float((w * v).sum() / w.sum()) if w.sum() > 0 else float(v.mean())

        u = [s.kv_usage for s in steps]
        out["kv_util_mean"] = time_mean(u)
        out["kv_util_max"] = float(max(u))
        out["kv_reserved_unused_mean"] = time_mean([s.kv_reserved_unused for s in steps])
        out["kv_internal_waste_mean"] = time_mean([s.kv_internal_waste for s in steps])
        out["kv_reserved_mean"] = time_mean([s.kv_reserved for s in steps])
        out["kv_internal_frag_mean"] = time_mean([s.kv_internal_frag for s in steps])
        out["kv_external_frag_mean"] = time_mean([s.kv_external_frag for s in steps])
        out["num_steps"] = len(steps)
        out["mean_batch_size"] = float(np.mean([s.num_seqs for s in steps]))
        padded = sum(s.num_padded_slots for s in steps)
        out["padding_waste"] = padded / (padded + sum(s.num_seqs for s in steps))
    else:
        out["kv_util_mean"] = out["kv_util_max"] = 0.0
        out["kv_reserved_unused_mean"] = out["kv_internal_waste_mean"] = out["padding_waste"] = 0.0
        out["kv_reserved_mean"] = out["kv_internal_frag_mean"] = out["kv_external_frag_mean"] = 0.0
    return out


@dataclass
class RunResult:
    """What :func:`minibatch.run` returns: per-request records, the step timeline, the setup."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    config: dict
    reconfigurations: list[tuple[float, str, object]] = field(default_factory=list)
    kv_blocks_total: int = 0
    wall_time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def summary(self, slo: dict[str, float] | None = None, trim: float = 0.0) -> dict:
        """:func:`summarize` of this run; ``trim=0.1`` for the steady state (middle 80% of arrivals)."""
        return summarize(self.requests, self.steps, slo, trim)

    def to_json(self, path=None, slo=None) -> str:
        data = {"summary": self.summary(slo), "config": self.config,
                "reconfigurations": [list(r) for r in self.reconfigurations],
                "requests": [{k: v for k, v in asdict(r).items() if k not in ("token_times", "output_token_ids")}
                             for r in self.requests]}
        text = json.dumps(data, indent=1, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
