"""``python -m minibatch serve`` through the official ``openai`` client and raw HTTP.

One server process (tiny model, API key, at most MAX_CONCURRENT requests in flight) serves
the whole module; the last test shuts it down with SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import threading
import time

import httpx
import pytest
from serving_utils import ServerProcess, metric, one_thread_llm

from minibatch import SamplingParams

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
    yield from one_thread_llm()


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
    # The opening role chunk, then content: how many content events carry the 12 tokens depends
    # on how fast this client reads (the stream contract, minibatch/serving/server.py); one
    # event per step while the reader keeps up is shown deterministically in
    # tests/test_server_inprocess.py.
    assert chunks[0].choices[0].delta.content == "" and len([c for c in chunks[1:] if c.choices]) >= 1


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


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [  # (path, body, status, words in the message, param); one or more per class of input
    # not JSON, not an object, not UTF-8, too deep, numbers Python cannot hold
    ("/v1/completions", b'{"prompt": "hi", ', 400, "JSON", None),
    ("/v1/completions", [1, 2], 400, "object", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "JSON", None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply", None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "JSON", None),
    # the prompt and the messages
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "empty", "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "empty", "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1] is empty", "prompt"),
    ("/v1/completions", {"prompt": list(range(5, 2005))}, 400, "max_model_len", "prompt"),
    ("/v1/completions", {"prompt": "a b " * 10_000}, 400, "max_model_len", "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "vocabulary", "prompt"),
    ("/v1/completions", {"prompt": [5, 2 ** 70]}, 400, "vocabulary", "prompt"),
    ("/v1/completions", {"prompt": [5, -1]}, 400, "vocabulary", "prompt"),
    ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400, "surrogate", "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogate", "messages"),
    (CHAT, {"messages": HI, "stop": ["\ud800"]}, 400, "surrogate", "stop"),
    (CHAT, {"model": "tiny"}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text parts", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 40_000}]}, 400, "max_model_len", "messages"),
    # sampling values: type, range, finiteness (NaN and Infinity are what Python's JSON accepts)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens", "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 10 ** 400}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 64}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": "1"}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}, 400, "at most", "stop"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", "ignore_eos"),
    # request fields
    ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "greedy", "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "'n'", "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": 1}}, 400, "include_usage",
     "include_usage"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist", "model"),
    ("/v1/completions", {"prompt": "hi", "model": ""}, 404, "does not exist", "model"),
    ("/v1/completions", {"prompt": "hi", "model": 7}, 400, "model", "model"),
    # what is not implemented is refused, not ignored
    (CHAT, {"messages": HI, "response_format": {"type": "json_object"}}, 400, "json_object", "response_format"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format", "response_format"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tools"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "`logprobs` must be set to true", "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty", "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", "echo"),
]


@pytest.mark.parametrize("path, body, status, words, param", BAD_INPUTS,
                         ids=[f"{i}-{w}" for i, (_, _, _, w, _) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_openai_error(server, path, body, status, words, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_openai_clients_defaults_are_accepted(client, server):
    """What the openai client (and others) send to mean "off" is served, not refused."""
    out = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=0,
                                         logprobs=False, tools=[], tool_choice="none", n=1,
                                         response_format={"type": "text"}, frequency_penalty=0,
                                         presence_penalty=0.0, top_logprobs=0, user="someone",
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": None, "echo": False,
                                         "best_of": 1, "logit_bias": {}, "suffix": None, "top_k": 2 ** 70,
                                         "seed": 2 ** 64 - 1, "temperature": 0.7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_still_serves_after_bad_input(client, server):
    for path, body, *_ in BAD_INPUTS[:4]:
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
                "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
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
    assert delta("vllm:inter_token_latency_seconds_count") == 4        # vLLM's newer name for the same
    assert metric(page, "vllm:inter_token_latency_seconds_sum") == metric(page, "vllm:time_per_output_token_seconds_sum")
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
                return r.status_code, (json.loads(await r.aread()), r.headers.get("retry-after"))
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
            body, retry_after = payload
            assert body["error"]["code"] == "rate_limit_exceeded" and "retry" in body["error"]["message"]
            assert retry_after is not None and int(retry_after) >= 1
        else:
            assert payload[-1] == "data: [DONE]"
            assert json.loads(payload[-2][5:])["usage"]["completion_tokens"] == 64
    assert metric(metrics(server), "minibatch:request_rejected_total", reason="overload") == codes.count(429)
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


POISON = [  # (body, headers, status): requests sent while other requests stream
    (b'{"prompt": "hi", "temperature": NaN, "max_tokens": 4}', {}, 400),
    (b'{"prompt": "hi", "top_p": Infinity}', {}, 400),
    (b'{"prompt": "hi", "temperature": 1e400}', {}, 400),
    (json.dumps({"prompt": "hi", "temperature": 10 ** 400}).encode(), {}, 400),
    (json.dumps({"prompt": "hi", "seed": 2 ** 64}).encode(), {}, 400),
    (json.dumps({"prompt": [5, 6], "top_k": 2 ** 70, "max_tokens": 4, "temperature": 1.0}).encode(), {}, 200),
    (b'{"prompt": "\\ud800"}', {}, 400),
    (b"[" * 50_000 + b"]" * 50_000, {}, 400),
    (json.dumps({"prompt": "x" * 3_000_000}).encode(), {}, 400),             # under the body limit
    (json.dumps({"prompt": list(range(5, 400_000))}).encode(), {}, 400),    # ~2.9 MB of token ids
    (b"x" * (5 * 2 ** 20), {}, 413),                                        # over the limit
    (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415),
    (json.dumps({"prompt": "hi", "model": ""}).encode(), {}, 404),
]


def test_poison_requests_while_others_stream_leave_their_tokens_unchanged(server, llm):
    """Streams run; once each has its first token, every poison request above is sent at
    once. Each gets its own answer, and every stream ends with the tokens of a clean run."""
    prompts, n = PROMPTS[:6], 40
    first, texts, errors = [threading.Event() for _ in prompts], [[] for _ in prompts], []

    def reader(i):
        body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        texts[i].append(json.loads(line[5:])["choices"][0]["text"])
                        first[i].set()
        except Exception as e:  # reported below
            errors.append(e)
        finally:
            first[i].set()

    streams = [threading.Thread(target=reader, args=(i,)) for i in range(len(prompts))]
    for t in streams:
        t.start()
    assert all(e.wait(120) for e in first)
    with concurrent.futures.ThreadPoolExecutor(len(POISON)) as pool:
        codes = list(pool.map(lambda p: post(server, "/v1/completions", p[0], headers={**AUTH, **p[1]}).status_code,
                              POISON))
    for t in streams:
        t.join(120)
    assert not errors and codes == [status for _, _, status in POISON]
    clean = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert ["".join(t) for t in texts] == [o.outputs[0].text for o in clean]


def test_many_clients_disconnect_streaming_and_not(server):
    """16 streaming clients leave after two events, 16 waiting clients give up after a
    moment: every request ends, every KV block comes back, and the server serves on."""
    before = metrics(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}

    def streaming(i):
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True, "prompt": [5, 6, i]},
                          headers=AUTH, timeout=60) as r:
            for _ in zip(r.iter_lines(), range(2)):
                pass

    def waiting(i):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [9, 8, i]}, headers=AUTH, timeout=0.5)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for f in [pool.submit(streaming, i) for i in range(16)] + [pool.submit(waiting, i) for i in range(16)]:
            f.result()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        page = metrics(server)
        if metric(page, "minibatch:num_requests_in_flight") == 0 and metric(page, "minibatch:kv_cache_used_blocks") == 0:
            break
        time.sleep(0.1)
    assert metric(page, "minibatch:num_requests_in_flight") == 0
    assert metric(page, "minibatch:kv_cache_used_blocks") == 0 and metric(page, "vllm:num_requests_running") == 0

    def ended(reason):
        name = "vllm:request_success_total"
        return metric(page, name, finished_reason=reason) - metric(before, name, finished_reason=reason)

    assert ended("abort") >= 16 and ended("abort") + ended("length") == 32
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_api_key(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    # The default --api-key-scope (v1) leaves the monitoring and documentation routes open.
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/openapi.json", timeout=10).status_code == 200


def test_default_host_names_are_loopback_and_the_bind_host(server):
    for host in ("localhost", f"localhost:{server.port}", "127.0.0.1", "[::1]:80"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={**AUTH, "Host": "rebound.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


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

