"""``python -m minibatch bench serve``: a load generator for any OpenAI-compatible server.

It mirrors ``vllm bench serve``: the same flags where they exist, the same metric
definitions and the same result table, so numbers from minibatch and vLLM compare::

    python -m minibatch bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 64 --request-rate 8

Per request, measured on the client from the streamed chunks:

- TTFT = time of the first token chunk - send time; E2EL = time of the last chunk - send time;
- TPOT = (E2EL - TTFT) / (output_tokens - 1), the mean gap after the first token;
- ITL  = every gap between consecutive chunks (one chunk per SSE event).

An SSE event carries every token the server made since its previous event (the stream
contract of ``minibatch serve`` and vLLM, ``minibatch/serving/server.py``): a busy server
or a reader that falls behind sees fewer, larger events, so a request has at most as
many chunks as tokens, and ITL one gap per chunk after the first. This client never
merges events, even several that arrive in one read.

Output tokens are the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
else the number of token chunks. Goodput counts requests that meet every SLO given
with ``--goodput ttft:800 tpot:50 e2el:5000`` (milliseconds; in Python, ``goodput=`` takes
the same list, or a dict in seconds such as ``{"ttft": 0.8, "e2e": 5.0}``), per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from minibatch.bench.datasets import BenchRequest, make_requests
from minibatch.results import meets_slo, parse_goodput, percentiles as percentile_values, tpot
KEEPALIVE_S = 2.0
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}   # vLLM's spelling


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                                         # seconds
    latency: float = 0.0                                      # E2EL, seconds
    itl: list[float] = field(default_factory=list)            # seconds
    start_time: float = 0.0                                   # since the benchmark started
    chunk_times: list[float] = field(default_factory=list)    # since the benchmark started
    generated_text: str = ""

    @property
    def completed(self) -> bool:
        return self.success

    @property
    def e2e(self) -> float | None:
        return self.latency if self.success else None

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1): last chunk minus first chunk, over the tokens
        after the first (``minibatch.results.tpot``, the engine's definition too)."""
        if not self.success:
            return None
        return tpot(self.ttft, self.latency, self.output_tokens)


# -- one request -----------------------------------------------------------------------------
def _payload(req: BenchRequest, model: str, chat: bool, ignore_eos: bool, temperature: float) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(session, url: str, body: dict, headers: dict, prompt_len: int,
                       t0: float) -> RequestResult:
    """Send one streaming request and time its chunks (times relative to ``t0``)."""
    import aiohttp

    out = RequestResult(prompt_len=prompt_len)
    chat = "messages" in body
    num_chunks, text = 0, []
    st = time.perf_counter()
    out.start_time = st - t0
    last = st
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    out.error = f"stream error: {msg['error'].get('message', msg['error'])}"
                    return out
                if msg.get("usage"):
                    out.output_tokens = msg["usage"].get("completion_tokens") or 0
                    out.prompt_len = msg["usage"].get("prompt_tokens") or prompt_len
                choices = msg.get("choices")
                if not choices:
                    continue
                c = choices[0]
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if chat and "role" in (c.get("delta") or {}) and not piece and not c.get("finish_reason"):
                    continue                                      # the role-only opening chunk
                now = time.perf_counter()
                if num_chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                num_chunks += 1
                out.chunk_times.append(now - t0)
                text.append(piece or "")
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    out.output_tokens = out.output_tokens or num_chunks
    if num_chunks == 0:
        out.error = "the stream ended without any token"
        return out
    out.latency = last - st
    out.success = True
    return out


# -- the run --------------------------------------------------------------------------------
async def _get_json(session, url: str, headers: dict):
    try:
        async with session.get(url, headers={**headers, "Connection": "close"}) as resp:
            return await resp.json() if resp.status == 200 else None
    except Exception:
        return None


async def benchmark(base_url: str = "http://127.0.0.1:8000", model: str | None = None,
                    endpoint: str = "completions", dataset: str = "random", num_prompts: int = 100,
                    random_input_len: int = 256, random_output_len: int = 64,
                    random_range_ratio: float = 0.0, request_rate: float | None = None,
                    burstiness: float = 1.0, max_concurrency: int | None = None,
                    goodput: dict | list | None = None, seed: int = 0, ignore_eos: bool = True,
                    tokenizer: str | None = None, max_model_len: int | None = None,
                    temperature: float = 0.0, api_key: str | None = None,
                    percentiles: tuple = (99,), requests: list[BenchRequest] | None = None,
                    timeout_s: float = 6 * 3600, force_close: bool = False) -> dict:
    """Run the benchmark (async). Arguments as the CLI flags; returns the result dict.

    ``force_close``: one connection per request (no keep-alive), for servers that close a
    connection after a streamed response though they advertise ``Keep-Alive`` (llama-server,
    build 0c1e570: a reused connection then fails with "Server disconnected")."""
    import aiohttp

    endpoint = ENDPOINTS.get(endpoint, endpoint)
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    slos = parse_goodput(goodput)
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = endpoint == "chat"
    url = f"{base_url}/v1/{'chat/completions' if chat else 'completions'}"
    # Drop idle connections before a server would (uvicorn: 5 s), or a request may be written
    # into a connection that the server is closing at that moment.
    connector = (aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True) if force_close else
                 aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=KEEPALIVE_S))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     trust_env=False) as session:
        card = await _get_json(session, f"{base_url}/v1/models", headers)
        cards = (card or {}).get("data") or []
        if model is None:
            if not cards:
                raise RuntimeError(f"cannot list models at {base_url}/v1/models; pass --model")
            model = cards[0]["id"]
        if max_model_len is None:
            max_model_len = next((c.get("max_model_len") for c in cards if c.get("id") == model), None)
        if requests is None:
            requests = make_requests(dataset, num_prompts, tokenizer or model, as_text=chat,
                                     input_len=random_input_len, output_len=random_output_len,
                                     range_ratio=random_range_ratio, request_rate=request_rate,
                                     burstiness=burstiness, seed=seed, max_len=max_model_len)
        limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            delay = req.arrival_time - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = _payload(req, model, chat, ignore_eos, temperature)
            if limiter is None:
                return await send_request(session, url, body, headers, req.prompt_len, t0)
            async with limiter:
                return await send_request(session, url, body, headers, req.prompt_len, t0)

        results = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - t0
    info = {"base_url": base_url, "endpoint": endpoint, "model": model, "dataset": dataset,
            "num_prompts": len(requests), "request_rate": "trace" if request_rate is None and
            dataset != "random" else (request_rate if request_rate is not None else math.inf),
            "burstiness": burstiness, "max_concurrency": max_concurrency, "ignore_eos": ignore_eos}
    return {**info, **compute_metrics(results, duration, slos, percentiles)}


def run_benchmark(**kwargs) -> dict:
    """Synchronous :func:`benchmark` (also from a notebook, whose event loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(benchmark(**kwargs))
    box: dict = {}

    def target():
        try:
            box["result"] = asyncio.run(benchmark(**kwargs))
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    # A daemon: if the caller is interrupted (a notebook cell stopped), the run must not keep the
    # kernel from exiting at shutdown.
    t = threading.Thread(target=target, name="minibatch-bench", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


# -- metrics ----------------------------------------------------------------------------------
def _stats(name: str, values_s: list[float], ps) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)          # vllm bench serve reports 0 for a metric with no values
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p, v in percentile_values(ms, ps).items():
        out[f"p{p:g}_{name}_ms"] = v
    return out


def compute_metrics(results: list[RequestResult], duration: float, slos: dict,
                    percentiles=(99,)) -> dict:
    """``vllm bench serve``'s result dict; ``slos`` in seconds (:func:`minibatch.results.parse_goodput`)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slo(r, slos)]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    out = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": len(good) / duration if slos else None,
        "goodput_slos_ms": {k: v * 1000.0 for k, v in slos.items()} or None,
        "percentiles": list(percentiles),
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "tpots": [r.tpot for r in results],
        "e2els": [r.latency for r in results], "itls": [r.itl for r in results],
        "start_times": [r.start_time for r in results], "chunk_times": [r.chunk_times for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
    }
    out.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    out.update(_stats("tpot", tpots, percentiles))
    out.update(_stats("itl", [x for r in ok for x in r.itl], percentiles))
    out.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return out


def format_result(res: dict) -> str:
    """The ``vllm bench serve`` result table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="{:<10}"):
        lines.append(("{:<40} " + fmt).format(label, value))

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency"):
        row("Maximum request concurrency:", res["max_concurrency"])
    row("Benchmark duration (s):", res["duration"], "{:<10.2f}")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], "{:<10.2f}")
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", res["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", res["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], "{:<10.2f}")
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{key}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", res[f"median_{key}_ms"], "{:<10.2f}")
        for p in res["percentiles"]:
            row(f"P{p:g} {short} (ms):", res[f"p{p:g}_{key}_ms"], "{:<10.2f}")
    lines.append("=" * 50)
    errors = [e for e in res["errors"] if e]
    if errors:
        lines.append(f"Failed requests ({len(errors)}); first errors:")
        lines.extend(f"  {e}" for e in list(dict.fromkeys(errors))[:5])
    return "\n".join(lines)


# -- CLI ------------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for synthetic prompts: 'tiny' or a local directory (default: --model, else tiny)")
    p.add_argument("--endpoint", choices=["completions", "chat", *ENDPOINTS], default="completions")
    p.add_argument("--dataset", default="random",
                   help="'random', a named workload (chat, rag, code_bursty, long_tail, shared_prefix) or trace:PATH")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="fit workload lengths to this context (default: what the server's /v1/models says)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (inf = all at once; default: inf for random, the recorded times otherwise)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 smoother")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:800 tpot:50 e2el:5000 (milliseconds)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the requested output lengths (default: on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the result as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="latency CDFs and throughput over time (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print("usage: python -m minibatch bench serve [options]  (see --help)", file=sys.stderr)
        return 2
    args = make_parser().parse_args(argv[1:])
    kwargs = dict(base_url=args.base_url, model=args.model, endpoint=args.endpoint, dataset=args.dataset,
                  num_prompts=args.num_prompts, random_input_len=args.random_input_len,
                  random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
                  request_rate=args.request_rate, burstiness=args.burstiness,
                  max_concurrency=args.max_concurrency, goodput=args.goodput, seed=args.seed,
                  ignore_eos=args.ignore_eos, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
                  temperature=args.temperature, api_key=args.api_key,
                  percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")))
    rate = "trace" if args.request_rate is None and args.dataset != "random" else (args.request_rate or math.inf)
    print(f"Traffic request rate: {rate}")
    print(f"Burstiness factor: {args.burstiness}" + (" (Poisson process)" if args.burstiness == 1 else ""))
    print(f"Maximum request concurrency: {args.max_concurrency}")
    try:
        res = run_benchmark(**kwargs)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_result(res))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.plot:
        from minibatch.bench.plot import plot_result
        plot_result(res, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if res["completed"] > 0 else 1


__all__ = ["benchmark", "run_benchmark", "compute_metrics", "format_result", "parse_goodput",
           "RequestResult", "BenchRequest", "send_request"]
