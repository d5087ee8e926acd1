"""``python -m minibatch serve`` through the official ``openai`` client and raw HTTP.

One server process (tiny model, API key, at most MAX_CONCURRENT requests in flight) serves
the whole module; the last test shuts it down with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
import torch

from minibatch import LLM, SamplingParams
from serving_utils import ServerProcess, metric

openai = pytest.importorskip("openai")

API_KEY = "sk-minibatch-test"
MAX_CONCURRENT = 40
GRACE_S = 3
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"{s} {i}" for i, s in enumerate(
    ["Once upon a time", "The little cat", "今天天气很好", "Tom found a box", "小明和他的狗",
     "In the forest there was", "The rain fell on", "我们一起去公园"] * 4)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY,
                        "--max-concurrent-requests", str(MAX_CONCURRENT), "--max-num-seqs", "32",
                        "--graceful-shutdown-timeout", str(GRACE_S))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    """The offline reference, on one CPU thread like the server (two busy processes, few cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM("tiny")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def post(server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers}, **kw)


# -- AsyncEngine in process (no HTTP) ------------------------------------------------------------
def test_async_engine_streams_aborts_and_survives_a_failed_step(llm):
    from minibatch.serving.async_engine import AsyncEngine

    engine = llm.engine
    step, calls = engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return step()

    engine.step = flaky_step
    ae = AsyncEngine(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run():
        failed = await ae.add_request([5, 6, 7], greedy, "a")
        await failed.wait()
        ok = await ae.add_request([5, 6, 7], greedy, "b")
        deltas = [d async for d in ok]
        with pytest.raises(ValueError, match="empty prompt"):
            await ae.add_request([], greedy, "c")
        long = await ae.add_request([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "d")
        await long.next_delta()
        ae.abort("d")
        await long.wait()
        return failed, ok, deltas, long

    try:
        failed, ok, deltas, long = asyncio.run(run())
    finally:
        ae.shutdown()
        engine.step, engine.stream_text = step, False
    assert failed.finish_reason == "abort" and "boom" in failed.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8 and ok.error is None
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 8
    assert long.finish_reason == "abort" and len(long.token_ids) < 500
    assert engine.kv.num_used_blocks == 0 and ae.num_in_flight == 0 and not engine.requests
    assert not ae.is_alive


# -- HTTP ------------------------------------------------------------------------------------
def test_completion(client):
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert isinstance(choice.text, str) and choice.finish_reason == "length"
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streamed_chat_equals_unstreamed(client):
    kw = dict(model="tiny", messages=[{"role": "system", "content": "You are kind."},
                                      {"role": "user", "content": "Tell me a story"}],
              max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert len([c for c in chunks if c.choices]) >= 3          # streamed, not one blob (one per token)


def test_concurrent_streams_match_offline_generate(server, llm):
    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, n = [], None
        async for c in stream:
            text += [c.choices[0].text] if c.choices else []
            n = c.usage.completion_tokens if c.usage else n
        return "".join(text), n

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    served = asyncio.run(run_all())
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [n for _, n in served] == [16] * len(PROMPTS)
    assert [t for t, _ in served] == [o.outputs[0].text for o in offline]


def test_stop_string_streamed_equals_offline(client, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS[:8], greedy)]
    prompt, text = next(((p, t) for p, t in zip(PROMPTS, texts) if len(t) >= 8), (None, None))
    if prompt is None:
        pytest.skip("the tiny model's greedy texts are too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                 stop=[stop]))[0].outputs[0]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text and stop not in want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


BAD_INPUTS = [  # (path, body, status, words in the message)
    ("/v1/completions", b'{"prompt": "hi", ', 400, "JSON"),
    ("/v1/completions", [1, 2], 400, "object"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one per request"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "'n'"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": list(range(5, 2005))}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, words", BAD_INPUTS,
                         ids=[f"{i}-{w}" for i, (_, _, _, w) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_openai_error(server, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"]


def test_still_serves_after_bad_input(client, server):
    for path, body, _, _ in BAD_INPUTS[:4]:
        post(server, path, body)
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.usage.prompt_tokens == 3
    assert metric(metrics(server), "minibatch:request_rejected_total", reason="overload") == 0


def test_metrics_page_has_vllms_names_and_parses(client, server):
    """The page parses with prometheus_client's own parser and carries vLLM's metric names
    (types and labels), counted from a request whose numbers we know."""
    from prometheus_client.parser import text_string_to_metric_families

    before = metrics(server)
    out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    page = metrics(server)
    families = {f.name: f for f in text_string_to_metric_families(page)}
    expected = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
                "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
                "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter",
                "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
                "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
                "vllm:request_prompt_tokens": "histogram", "vllm:iteration_tokens_total": "histogram"}
    for name, kind in expected.items():
        assert families[name].type == kind, (name, families[name].type)
    for fam in families.values():
        for s in fam.samples:
            assert s.labels.get("model_name") == "tiny", (s.name, s.labels)

    def delta(name, **labels):
        return metric(page, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == 4
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_per_output_token_seconds_count") == 4      # one per gap between 5 tokens
    assert delta("vllm:request_generation_tokens_sum") == 5


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    aborted = metric(metrics(server), "vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(8)) if line.startswith("data:")]
        assert got
        assert metric(metrics(server), "minibatch:kv_cache_used_blocks") > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        page = metrics(server)
        if metric(page, "minibatch:kv_cache_used_blocks") == 0 and metric(page, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert metric(page, "minibatch:kv_cache_used_blocks") == 0
    assert metric(page, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(page, "minibatch:num_requests_in_flight") == 0
    assert metric(page, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_overload_gets_429_while_admitted_requests_complete(server):
    n = MAX_CONCURRENT + 24

    async def one(client, i):
        body = {"prompt": [10 + i, 11, 12], "max_tokens": 64, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            events = [line async for line in r.aiter_lines() if line.startswith("data:")]
            return 200, events

    async def run_all():
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(run_all())
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429}
    assert codes.count(200) >= 1 and codes.count(429) >= 1
    for code, payload in results:
        if code == 429:
            assert payload["error"]["code"] == "rate_limit_exceeded" and "retry" in payload["error"]["message"]
        else:
            assert payload[-1] == "data: [DONE]"
            assert json.loads(payload[-2][5:])["usage"]["completion_tokens"] == 64
    assert metric(metrics(server), "minibatch:request_rejected_total", reason="overload") == codes.count(429)
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_requests_and_exits_0(server):
    """Last test: it shuts the module's server down. A short request finishes; one too long
    for the grace period is aborted at its end; both streams end cleanly; exit code 0."""
    events = {16: [], 1000: []}
    started = threading.Barrier(3)

    def reader(max_tokens):
        body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    if not events[max_tokens]:
                        started.wait(30)
                    events[max_tokens].append(line)

    threads = [threading.Thread(target=reader, args=(n,)) for n in events]
    for t in threads:
        t.start()
    started.wait(30)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0, server.log()
    for n, lines in events.items():
        assert lines[-1] == "data: [DONE]"
        reason = next(json.loads(x[5:])["choices"][0]["finish_reason"] for x in reversed(lines)
                      if '"finish_reason":"' in x)
        usage = json.loads(lines[-2][5:])["usage"]
        if n == 16:
            assert reason == "length" and usage["completion_tokens"] == 16      # finished, not cut off
        else:
            assert reason in ("abort", "length") and time.monotonic() - t0 < GRACE_S + 20
            assert reason == "length" or usage["completion_tokens"] < n
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)

