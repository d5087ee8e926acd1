"""``minibatch.bench`` (``python -m minibatch bench serve``) against a live ``minibatch serve``."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys

import pytest

from minibatch.bench import RequestResult, compute_metrics, format_result, parse_goodput, run_benchmark
from minibatch.bench.datasets import make_requests
from serving_utils import ServerProcess

TABLE_LINES = ["============ Serving Benchmark Result ============", "Successful requests:",
               "Failed requests:", "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
               "Request throughput (req/s):", "Output token throughput (tok/s):",
               "Total Token throughput (tok/s):", "Time to First Token", "Mean TTFT (ms):", "Median TTFT (ms):",
               "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 ITL (ms):",
               "Mean E2EL (ms):", "P99 E2EL (ms):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("bench") / "server.log", "--max-num-seqs", "16")
    yield srv
    srv.stop()


@contextlib.asynccontextmanager
async def stub_server(routes):
    """An aiohttp app with ``routes`` [(method, path, handler)] on a free loopback port; yields its URL."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


# -- without a server ---------------------------------------------------------------------------
def test_metrics_follow_vllm_definitions():
    a = RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1])
    b = RequestResult(success=True, prompt_len=20, output_tokens=3, ttft=0.3, latency=0.5, itl=[0.1, 0.1])
    failed = RequestResult(success=False, error="HTTP 400: too long", prompt_len=7)
    res = compute_metrics([a, b, failed], duration=2.0, slos=parse_goodput(["ttft:200", "tpot:150"]))
    assert res["completed"] == 2 and res["failed"] == 1 and res["errors"][2].startswith("HTTP 400")
    assert res["total_input_tokens"] == 30 and res["total_output_tokens"] == 8
    assert res["request_throughput"] == 1.0 and res["output_throughput"] == 4.0
    assert res["total_token_throughput"] == 19.0
    assert res["mean_tpot_ms"] == pytest.approx((100 + 100) / 2)       # (0.5-0.1)/4 and (0.5-0.3)/2
    assert res["mean_ttft_ms"] == pytest.approx(200) and res["median_e2el_ms"] == pytest.approx(500)
    assert res["request_goodput"] == 0.5                                 # only a meets ttft <= 200 ms
    table = format_result(res)
    for line in TABLE_LINES + ["Request goodput (req/s):", "HTTP 400: too long"]:
        assert line in table


def test_bad_goodput_is_named():
    with pytest.raises(ValueError, match="latency"):
        parse_goodput(["latency:5"])


def test_random_dataset_lengths_and_rate():
    reqs = make_requests("random", 200, "tiny", input_len=20, output_len=8, range_ratio=0.5,
                         request_rate=10.0, seed=1)
    assert all(10 <= r.prompt_len <= 30 and 4 <= r.output_len <= 12 for r in reqs)
    assert all(r.prompt == make_requests("random", 200, "tiny", input_len=20, output_len=8,
                                         range_ratio=0.5, request_rate=10.0, seed=1)[i].prompt
               for i, r in enumerate(reqs[:3]))
    assert (len(reqs) - 1) / reqs[-1].arrival_time == pytest.approx(10.0, rel=0.25)
    assert {r.arrival_time for r in make_requests("random", 5, "tiny", input_len=4, output_len=2)} == {0.0}


def test_the_client_counts_one_chunk_per_event_even_when_they_arrive_together():
    """The client's side of the stream contract: events are never merged by the reader.
    A fake server writes 5 events (one merged event holding 3 tokens) in one write."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from minibatch.bench.client import send_request

    def event(text, finish=None):
        return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"

    payload = (event("a") + event("bcd") + event("e") + event("f", "length")
               + "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}})
               + "\n\ndata: [DONE]\n\n").encode()

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(payload)                  # everything at once
        await resp.write_eof()
        return resp

    async def run():
        async with stub_server([("POST", "/v1/completions", handler)]) as url:
            async with aiohttp.ClientSession() as session:
                return await send_request(session, f"{url}/v1/completions",
                                          {"prompt": "x", "stream": True}, {}, 3, 0.0)

    res = asyncio.run(run())
    assert res.success and res.generated_text == "abcdef" and res.output_tokens == 6
    assert len(res.chunk_times) == 4 and len(res.itl) == 3



def test_force_close_opens_one_connection_per_request():
    """``force_close``: no connection is reused (llama-server closes one after a streamed
    response though it answers Keep-Alive); by default one connection carries them all."""
    import asyncio

    from aiohttp import web

    from minibatch.bench.client import benchmark

    peers = []
    done = ("data: " + json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
            + "\n\ndata: [DONE]\n\n").encode()

    async def models(request):
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 64}]})

    async def completions(request):
        peers.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(done)
        await resp.write_eof()
        return resp

    async def run(force_close):
        async with stub_server([("GET", "/v1/models", models), ("POST", "/v1/completions", completions)]) as url:
            reqs = make_requests("random", 4, "tiny", input_len=4, output_len=1)
            return await benchmark(base_url=url, model="tiny", requests=reqs, max_concurrency=1,
                                   force_close=force_close)

    assert asyncio.run(run(False))["completed"] == 4 and len(set(peers)) == 1
    peers.clear()
    assert asyncio.run(run(True))["completed"] == 4 and len(set(peers)) == 4

# -- against the server -------------------------------------------------------------------------
def test_python_api_counts_every_request(server):
    res = run_benchmark(base_url=server.url, num_prompts=24, random_input_len=32, random_output_len=12,
                        request_rate=math.inf)
    assert res["completed"] == 24 and res["failed"] == 0, res["errors"]
    assert res["model"] == "tiny"                                        # from /v1/models
    assert res["output_lens"] == [12] * 24 and res["input_lens"] == [32] * 24
    assert res["total_output_tokens"] == 288 and res["total_input_tokens"] == 768
    # The stream's contract (vLLM's too): an event carries every token made since the last one,
    # so a reader that falls behind gets fewer, larger events; never more events than tokens.
    # ITL has one gap per event after the first, as in vllm bench serve.
    assert all(len(itl) + 1 == len(chunks) <= 12 for itl, chunks in zip(res["itls"], res["chunk_times"]))
    assert 0 < res["mean_ttft_ms"] < res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0


def test_chat_endpoint_rate_and_concurrency(server):
    res = run_benchmark(base_url=server.url, endpoint="chat", num_prompts=8, random_input_len=16,
                        random_output_len=6, request_rate=50.0, burstiness=0.5, max_concurrency=3,
                        goodput={"e2e": 60.0})
    assert res["completed"] == 8 and res["failed"] == 0, res["errors"]
    assert res["output_lens"] == [6] * 8 and res["request_goodput"] > 0


def test_failed_requests_are_counted_with_their_errors(server):
    res = run_benchmark(base_url=server.url, num_prompts=3, random_input_len=2000, random_output_len=4)
    assert res["completed"] == 0 and res["failed"] == 3
    assert all("HTTP 400" in e and "max_model_len" in e for e in res["errors"])


def test_named_workload_and_trace(server, tmp_path):
    res = run_benchmark(base_url=server.url, dataset="code_bursty", num_prompts=4, request_rate=math.inf)
    assert res["completed"] == 4 and res["failed"] == 0, res["errors"]
    assert all(i + o <= 1024 for i, o in zip(res["input_lens"], res["output_lens"]))
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,40,5\n2023-11-16 18:15:46.7805900,30,3\n"
                     "2023-11-16 18:15:46.8805900,20,4\n")
    res = run_benchmark(base_url=server.url, dataset=f"trace:{trace}", num_prompts=3)
    assert res["request_rate"] == "trace" and res["completed"] == 3, res["errors"]
    assert res["input_lens"] == [40, 30, 20] and res["output_lens"] == [5, 3, 4]
    # The recorded arrival times are the plan (exactly); a busy client may send late, never early.
    plan = [r.arrival_time for r in make_requests(f"trace:{trace}", 3, "tiny")]
    assert plan == pytest.approx([0.0, 0.1, 0.2], abs=1e-9)
    assert all(start >= planned - 1e-3 for start, planned in zip(res["start_times"], plan))


def test_cli(server, tmp_path):
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    proc = subprocess.run([sys.executable, "-m", "minibatch", "bench", "serve", "--base-url", server.url,
                           "--model", "tiny", "--num-prompts", "8", "--random-input-len", "16",
                           "--random-output-len", "8", "--request-rate", "inf", "--goodput", "ttft:60000",
                           "--save-result", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in TABLE_LINES + ["Request goodput (req/s):"]:
        assert line in proc.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["total_output_tokens"] == 64, res["errors"]
    assert png.read_bytes()[:4] == b"\x89PNG"
