"""``python -m minibatch router`` in front of two ``minibatch serve`` processes.

Two tiny-model servers (fault injection on) serve the whole module; routers with different
policies and limits run in front of them. The last test kills one server during a run of
concurrent requests and restarts it on the same port. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest
from serving_utils import ServerProcess, metric

openai = pytest.importorskip("openai")

WAIT_S = 60
PROMPTS = ["Once upon a time", "The little cat", "Tom found a box", "In the forest there was",
           "The rain fell on", "小明和他的狗"]


def wait_for(cond, timeout: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory):
    d = tmp_path_factory.mktemp("upstreams")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:     # start both at once
        futures = [pool.submit(ServerProcess, d / f"{name}.log", "--max-num-seqs", "8", "--enable-fault-injection")
                   for name in ("a", "b")]
    servers = [f.result() for f in futures if f.exception() is None]
    try:
        if len(servers) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield servers
    finally:
        for s in servers:
            s.stop()


def start_router(tmp_path_factory, upstreams, *args: str) -> ServerProcess:
    d = tmp_path_factory.mktemp("router")
    return ServerProcess(d / "router.log", "--upstream", *(u.url for u in upstreams), "--poll-interval", "0.2",
                         *args, command="router")


@pytest.fixture(scope="module")
def rr(tmp_path_factory, upstreams):
    r = start_router(tmp_path_factory, upstreams, "--policy", "round_robin")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def lr(tmp_path_factory, upstreams):
    r = start_router(tmp_path_factory, upstreams, "--policy", "least_requests")
    yield r
    r.stop()


def set_fault(server, **fault) -> None:
    r = httpx.post(f"{server.url}/admin/fault", json=fault, timeout=10)
    assert r.status_code == 200, r.text


@pytest.fixture
def no_faults(upstreams):
    yield
    for s in upstreams:
        if s.proc.poll() is None:
            set_fault(s, kind="none")


def router_metrics(router) -> str:
    return httpx.get(f"{router.url}/metrics", timeout=10).text


def routed(router, upstream) -> float:
    try:
        return metric(router_metrics(router), "minibatch_router_requests_routed_total", upstream=upstream.url)
    except KeyError:
        return 0.0


def complete(url: str, prompt, max_tokens: int = 12, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(url: str, path: str, body: dict) -> list:
    """Every ``data:`` payload of a streamed answer (JSON-decoded, ``[DONE]`` as a string)."""
    out = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def reference(upstreams):
    """Greedy answers straight from one server (text and token ids), the routers' yardstick."""
    return {p: complete(upstreams[0].url, p, 24, return_token_ids=True)["choices"][0] for p in PROMPTS}


# -- the router's parts, in process (no servers) ---------------------------------------------------
def test_parse_metrics_sums_vllm_gauges_over_labels():
    from minibatch.serving.router import parse_metrics

    page = ("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:num_requests_running_other{engine="0"} 100.0\n'
            'vllm:e2e_request_latency_seconds_bucket{le="0.3"} 7.0\n')
    assert parse_metrics(page) == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 4.0,
                                   "vllm:kv_cache_usage_perc": 0.25}


def test_view_counts_the_routers_own_requests_when_the_poll_lags():
    from minibatch.serving.router import Upstream

    u = Upstream(0, "http://x", healthy=True, num_running=1, num_waiting=0, kv_usage=0.5)
    assert u.view(16).num_requests == 1
    u.in_flight = 4                      # sent since the last poll
    v = u.view(16)
    assert v.num_requests == 4 and v.num_running == 1 and v.kv_usage == 0.5


def test_prefix_aware_keeps_a_shared_prefix_on_one_upstream():
    from minibatch.serving.router import Proxied, RouterState, Tokens

    state = RouterState(["http://a", "http://b", "http://c"], "prefix_aware", tokenizer="tiny")
    state.tokens = Tokens.for_model("tiny")
    assert state.tokens.tokenizer is not None
    for u in state.upstreams:
        u.healthy, u.models = True, ["tiny"]
    system = "You are a helpful assistant who tells short stories about cats. " * 4

    def pick(prompt: str) -> int:
        body = {"model": "tiny", "prompt": prompt}
        req = Proxied("/v1/completions", False, body, {}, asyncio.run(state.routed_request(body, False)), False)
        u = state.choose(req)
        return u.index

    first = pick(system + "Tom")
    assert [pick(system + q) for q in ("Anna", "Ben", "Cleo")] == [first] * 3
    assert pick("Something else entirely, with nothing in common") != first


def test_bytes_stand_in_for_tokens_without_a_local_tokenizer():
    from minibatch.serving.router import Tokens

    t = Tokens.for_model("some-org/some-remote-model")
    assert t.tokenizer is None and t.encode("hé") == list("hé".encode())


def test_admission_queues_then_refuses_with_retry_after():
    from minibatch.serving.protocol import APIError
    from minibatch.serving.router import Admission

    async def run():
        adm = Admission(max_concurrent=1, max_queue=1, queue_timeout=30)
        await adm.acquire()
        queued = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.waiting == 1 and not queued.done()
        with pytest.raises(APIError) as e:
            await adm.acquire()
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        await adm.release()
        await asyncio.wait_for(queued, 5)
        assert adm.in_flight == 1 and adm.waiting == 0
        short = Admission(max_concurrent=1, max_queue=1, queue_timeout=0.05)
        await short.acquire()
        with pytest.raises(APIError) as e:
            await short.acquire()            # nothing frees a slot: 429 after the queue timeout
        assert e.value.status == 429 and short.waiting == 0

    asyncio.run(run())


def test_fault_bodies_are_checked():
    from minibatch.serving.faults import FaultInjector, parse_fault
    from minibatch.serving.protocol import APIError

    with pytest.raises(APIError, match="'kind'"):
        parse_fault({"kind": "explode"})
    with pytest.raises(APIError, match="'rate'"):
        parse_fault({"kind": "error", "rate": 2})
    f = FaultInjector()
    f.set(parse_fault({"kind": "cut_stream", "after_tokens": 5, "count": 2}))
    assert [f.cut_after() for _ in range(3)] == [5, 5, None]
    f.set(parse_fault({"kind": "error", "rate": 0.5, "seed": 1}))
    outcomes = []
    for _ in range(200):
        try:
            f.maybe_fail()
            outcomes.append(0)
        except APIError as e:
            assert e.status == 500
            outcomes.append(1)
    assert 60 < sum(outcomes) < 140


# -- serving through the router ---------------------------------------------------------------
def test_health_and_models(rr, upstreams):
    h = httpx.get(f"{rr.url}/health", timeout=10)
    assert h.status_code == 200
    assert [u["healthy"] for u in h.json()["upstreams"]] == [True, True]
    models = httpx.get(f"{rr.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_openai_client_outputs_equal_a_single_server(rr, upstreams, reference):
    client = openai.OpenAI(base_url=f"{rr.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    direct = openai.OpenAI(base_url=f"{upstreams[0].url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    for p in PROMPTS[:4]:
        want = reference[p]["text"]
        got = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
        assert got.choices[0].text == want
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True))
        assert text == want
    msgs = [{"role": "user", "content": "Tell me about the cat."}]
    want = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert text == want.choices[0].message.content


def test_round_robin_alternates(rr, upstreams):
    seen = []
    for i in range(6):
        before = [routed(rr, u) for u in upstreams]
        complete(rr.url, PROMPTS[i], 2)
        after = [routed(rr, u) for u in upstreams]
        diff = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(diff) == [0, 1], diff
        seen.append(diff.index(1))
    assert all(seen[i] != seen[i + 1] for i in range(5)), seen


def test_least_requests_avoids_a_busy_upstream(lr, upstreams):
    a = upstreams[0]

    async def occupy():               # three long generations sent to a directly, not via the router
        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            body = {"model": "tiny", "prompt": "busy", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{a.url}/v1/completions", json=body) for _ in range(3)))

    pool = concurrent.futures.ThreadPoolExecutor(1)
    task = pool.submit(lambda: asyncio.run(occupy()))
    try:
        wait_for(lambda: httpx.get(f"{lr.url}/health", timeout=10).json()["upstreams"][0]["num_requests_running"]
                 >= 3, what="upstream a to be busy (polled by the router)")
        before = [routed(lr, u) for u in upstreams]
        for p in PROMPTS[:4]:
            complete(lr.url, p, 2)
        after = [routed(lr, u) for u in upstreams]
        assert after[0] == before[0] and after[1] == before[1] + 4
    finally:
        assert [r.status_code for r in task.result(WAIT_S)] == [200] * 3
        pool.shutdown()


# -- faults ---------------------------------------------------------------------------------------
def test_cut_stream_is_resumed_with_the_same_tokens(rr, upstreams, reference, no_faults):
    for s in upstreams:      # each cuts its next stream: the answer is cut twice, resumed twice
        set_fault(s, kind="cut_stream", after_tokens=5, count=1)
    before = metric(router_metrics(rr), "minibatch_router_retries_total", kind="resume") \
        if "kind=\"resume\"" in router_metrics(rr) else 0.0
    p = PROMPTS[0]
    body = {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    events = stream_events(rr.url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert not any("error" in e for e in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference[p]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[p]["token_ids"]
    assert len({e["id"] for e in events[:-1]}) == 1        # one id, as from one upstream
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] == len(reference[p]["prompt_token_ids"])
    after = metric(router_metrics(rr), "minibatch_router_retries_total", kind="resume")
    assert after == before + 2


def test_cut_chat_stream_ends_with_an_error_event(rr, upstreams, no_faults):
    for s in upstreams:
        set_fault(s, kind="cut_stream", after_tokens=3, count=1)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events = stream_events(rr.url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "cannot be resumed" in events[-2]["error"]["message"]


def test_error_fault_is_retried_on_the_other_upstream(rr, upstreams, no_faults):
    a = upstreams[0]
    set_fault(a, kind="error", rate=1.0)
    for p in PROMPTS[:4]:               # round robin sends half of them to a first
        assert complete(rr.url, p, 4)["choices"][0]["finish_reason"] == "length"
    text = router_metrics(rr)
    assert metric(text, "minibatch_router_upstream_errors_total", upstream=a.url, kind="status") >= 2
    assert metric(text, "minibatch_router_retries_total", kind="retry") >= 2


def test_bad_requests_get_4xx_and_do_not_disturb_others(rr):
    good = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    bad = [(b"{not json", "application/json", 400, None),
           (json.dumps(good).encode(), "text/plain", 415, None),
           (json.dumps({"prompt": "x"}).encode(), "application/json", 400, "model"),
           (json.dumps(dict(good, model="nope")).encode(), "application/json", 404, "model"),
           (b"[1, 2]", "application/json", 400, None),
           (json.dumps(dict(good, max_tokens=-1)).encode(), "application/json", 400, "max_tokens")]

    async def run():
        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            goods = [c.post(f"{rr.url}/v1/completions", json=good) for _ in range(4)]
            bads = [c.post(f"{rr.url}/v1/completions", content=raw, headers={"Content-Type": ct})
                    for raw, ct, _, _ in bad]
            return await asyncio.gather(*goods, *bads)

    answers = asyncio.run(run())
    goods, bads = answers[:4], answers[4:]
    assert {r.status_code for r in goods} == {200}
    assert len({r.json()["choices"][0]["text"] for r in goods}) == 1
    for r, (_, _, status, param) in zip(bads, bad, strict=True):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["param"] == param


def test_backpressure_answers_429_with_retry_after(tmp_path_factory, upstreams, no_faults):
    tight = start_router(tmp_path_factory, upstreams, "--max-concurrent-requests", "1", "--max-queue", "1")
    try:
        for s in upstreams:
            set_fault(s, kind="slow", delay_s=2.0)      # each request waits 2 s before its engine
        body = {"model": "tiny", "prompt": "slow", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=WAIT_S) as c:
                held = [asyncio.ensure_future(c.post(f"{tight.url}/v1/completions", json=body)) for _ in range(2)]

                def full():
                    text = router_metrics(tight)
                    return (metric(text, "minibatch_router_requests_in_flight") == 1
                            and metric(text, "minibatch_router_queue_length") == 1)

                await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(full, what="a full queue"))
                third = await c.post(f"{tight.url}/v1/completions", json=body)
                return third, await asyncio.gather(*held)

        third, held = asyncio.run(run())
        assert third.status_code == 429
        assert third.headers["Retry-After"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert [r.status_code for r in held] == [200, 200]       # the queued one got its turn
    finally:
        tight.stop()


# -- a replica dies -----------------------------------------------------------------------------------
def test_killed_upstream_loses_no_request_and_comes_back(rr, upstreams, reference, tmp_path_factory):
    """50 concurrent requests (streams and not); one upstream is killed once streams are under
    way. Every completion ends with the reference tokens; chat streams may end with an error
    event instead; none hangs. The dead upstream is marked unhealthy, and used again once
    restarted on its port."""
    b = upstreams[1]
    n = 50
    done_tokens = {"n": 0}
    killed = asyncio.Event()

    async def one(c: httpx.AsyncClient, i: int):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 10 == 9:                  # a chat stream: may not be resumable
            body = {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 24,
                    "temperature": 0, "stream": True}
            path = "/v1/chat/completions"
        else:
            body = {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 0}
            path = "/v1/completions"
        if not body["stream"]:
            r = await c.post(f"{rr.url}{path}", json=body)
            return i, "whole", r.status_code, r.json()
        events = []
        async with c.stream("POST", f"{rr.url}{path}", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    done_tokens["n"] += 1
        return i, "chat" if "messages" in body else "stream", r.status_code, events

    async def killer():
        while done_tokens["n"] < 40:
            await asyncio.sleep(0.01)
        b.proc.kill()
        killed.set()

    async def run():
        async with httpx.AsyncClient(timeout=WAIT_S, limits=httpx.Limits(max_connections=n)) as c:
            k = asyncio.ensure_future(killer())
            results = await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n))), 2 * WAIT_S)
            await asyncio.wait_for(k, 5)
            return results

    def sent_again() -> float:      # retries and resumptions so far
        text = router_metrics(rr)
        return sum(metric(text, "minibatch_router_retries_total", kind=k) for k in ("retry", "resume")
                   if f'kind="{k}"' in text)

    before = sent_again()
    results = asyncio.run(run())
    assert killed.is_set()
    for i, kind, status, payload in results:
        want = reference[PROMPTS[i % len(PROMPTS)]]
        assert status == 200, (i, payload)
        if kind == "whole":
            assert payload["choices"][0]["text"] == want["text"]
            continue
        assert payload[-1] == "[DONE]", (i, payload[-3:])
        if kind == "chat":
            continue                     # content, or an error event: either ends cleanly
        assert not any("error" in e for e in payload[:-1]), (i, payload)
        # the ids the router asks its upstreams for are not shown to a client that did not ask
        assert not any("token_ids" in e["choices"][0] for e in payload[:-1] if e["choices"])
        assert "".join(e["choices"][0]["text"] for e in payload[:-1] if e["choices"]) == want["text"]
    b.proc.wait(10)
    assert sent_again() > before     # b had requests in flight when it died: they went to a

    def b_state():
        return httpx.get(f"{rr.url}/health", timeout=10).json()["upstreams"][1]

    assert b_state()["healthy"] is False
    assert metric(router_metrics(rr), "minibatch_router_upstream_healthy", upstream=b.url) == 0
    errors = sum(metric(router_metrics(rr), "minibatch_router_upstream_errors_total", upstream=b.url, kind=k)
                 for k in ("connect", "stream_cut") if f'kind="{k}",upstream="{b.url}"' in router_metrics(rr))
    assert errors >= 1

    restarted = ServerProcess(tmp_path_factory.mktemp("restart") / "b.log", "--max-num-seqs", "8",
                              "--enable-fault-injection", port=b.port)
    upstreams[1] = restarted
    b.stop()
    wait_for(lambda: b_state()["healthy"], what="the restarted upstream to be healthy again")
    before = routed(rr, restarted)
    for p in PROMPTS[:4]:
        assert complete(rr.url, p, 24)["choices"][0]["text"] == reference[p]["text"]
    assert routed(rr, restarted) >= before + 2
