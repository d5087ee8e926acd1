"""The load generator: ``python -m minibatch bench serve`` against any OpenAI-compatible server.

- :mod:`.client`: sends the requests, times every streamed chunk, computes ``vllm bench
  serve``'s metrics and prints its result table;
- :mod:`.datasets`: the requests to send (random, a named workload, or a trace);
- :mod:`.plot`: latency CDFs and throughput over time of a result.

None of it imports torch: a load generator runs beside the server it measures.
"""

from minibatch.bench.client import (RequestResult, benchmark, compute_metrics, format_result, main,
                                    parse_goodput, run_benchmark, send_request)
from minibatch.bench.datasets import BenchRequest, make_requests

__all__ = ["benchmark", "run_benchmark", "compute_metrics", "format_result", "parse_goodput",
           "RequestResult", "BenchRequest", "make_requests", "send_request", "main"]
