"""Workloads: which requests arrive when, and how long they are.

A ``Workload`` is an arrival-ordered list of ``RequestSpec`` (arrival time,
prompt length, output length, optional token ids, priority, tenant, prefix
group). Make one from

- arrival processes and length distributions: ``synthetic``, ``shared_prefix``, ``multi_tenant``,
  ``from_arrivals`` (modules ``arrivals``, ``lengths``, ``synthetic``);
- real traces: ``load_trace`` (Azure CSV, Mooncake JSONL, BurstGPT CSV, our JSONL;
  module ``traces``); the ones the course uses ship in ``datasets/traces/``:
  ``load_shipped_trace("azure_conv")``;
- the project's named workloads: ``load_workload("chat")`` (module ``named``),

then reshape it (``slice``, ``time_window``, ``scale_time``, ``with_rate``,
``fit_lengths``), give it token ids (``materialize``, module ``tokens``) and
summarise it (``stats``, module ``stats``).
"""
from .arrivals import gamma_arrivals, onoff_arrivals, poisson_arrivals
from .lengths import (Empirical, Fixed, LengthDist, LogNormal, Uniform, as_length_dist,
                      empirical, fixed, lognormal, uniform)
from .named import load_workload, presets
from .spec import RequestSpec, Workload
from .stats import arrival_stats, format_stats_table, length_stats, workload_stats
from .synthetic import from_arrivals, multi_tenant, shared_prefix, synthetic
from .traces import (SHIPPED_TRACES, TRACE_FORMATS, TraceFormatError, load_shipped_trace, load_trace,
                     shipped_trace_path, sniff_format)

__all__ = [
    "RequestSpec", "Workload",
    "synthetic", "shared_prefix", "multi_tenant", "from_arrivals",
    "gamma_arrivals", "poisson_arrivals", "onoff_arrivals",
    "LengthDist", "Fixed", "Uniform", "LogNormal", "Empirical",
    "fixed", "uniform", "lognormal", "empirical", "as_length_dist",
    "load_trace", "sniff_format", "TraceFormatError", "TRACE_FORMATS",
    "SHIPPED_TRACES", "load_shipped_trace", "shipped_trace_path",
    "load_workload", "presets",
    "arrival_stats", "length_stats", "workload_stats", "format_stats_table",
]
