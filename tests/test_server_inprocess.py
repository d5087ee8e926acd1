"""The server's app and async engine in this process (no socket): the stream contract, the
work kept off the event loop and the engine thread, isolation of failed requests, and
what ``/health`` says once the engine has failed. Deterministic: no test depends on how
fast the machine is; waits are on events or conditions, with generous deadlines."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from serving_utils import one_thread_llm, pace

from minibatch import SamplingParams
from minibatch.serving.async_engine import AsyncEngine
from minibatch.serving.metrics import ServingMetrics
from minibatch.serving.protocol import GenerationRequest
from minibatch.serving.server import (
    ServerState,
    build_app,
    default_allowed_hosts,
    host_allowed,
    sse_events,
)

DEADLINE_S = 120
JSON = {"Content-Type": "application/json"}
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    yield from one_thread_llm()


@pytest.fixture
def served(llm):
    """``(AsyncEngine, ServerState, app)`` over the module's engine; stopped afterwards."""
    engine = llm.engine
    metrics = ServingMetrics("tiny", engine.max_model_len)
    ae = AsyncEngine(engine, metrics)
    state = ServerState(ae, ["tiny"], 64, None, allowed_hosts=["127.0.0.1"], prepare_threads=2)
    yield ae, state, build_app(state)
    ae.shutdown()
    state.pool.shutdown(wait=True)
    engine._listeners.remove(metrics.on_event)
    engine.stream_text = False
    assert not engine.requests and engine.kv.num_used_blocks == 0


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                             headers=JSON, timeout=DEADLINE_S)


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def offline(llm, prompts, **kw) -> list:
    return llm.generate(prompts, SamplingParams(**{**GREEDY, **kw}))


# -- the stream contract ---------------------------------------------------------------------
def test_an_sse_event_carries_every_token_since_the_previous_one(served, llm):
    """A reader that reads nothing until the request has finished gets one content event
    with all 12 tokens (then usage and [DONE]); one that keeps up gets up to one per token.
    Either way the text and the token count are those of the request."""
    ae, _, _ = served
    want = offline(llm, [[5, 6, 7]])[0].outputs[0]
    req = GenerationRequest(chat=False, model="tiny", prompt=[5, 6, 7], params=SamplingParams(**GREEDY),
                            stream=True, include_usage=True)

    def parse(events):
        assert events[-1] == "data: [DONE]\n\n"
        data = [json.loads(e[len("data: "):]) for e in events[:-1]]
        return data[:-1], data[-1]["usage"]

    async def run():
        late = await ae.add_request([5, 6, 7], SamplingParams(**GREEDY), "late")
        await until(lambda: late.finished, "the request finished")
        late_events = [e async for e in sse_events(ae, late, req)]
        eager = await ae.add_request([5, 6, 7], SamplingParams(**GREEDY), "eager")
        eager_events = [e async for e in sse_events(ae, eager, req)]
        return late_events, eager_events

    late_events, eager_events = asyncio.run(run())
    content, use = parse(late_events)
    assert len(content) == 1 and content[0]["choices"][0]["text"] == want.text
    assert content[0]["choices"][0]["finish_reason"] == "length" and use["completion_tokens"] == 12
    content, use = parse(eager_events)
    assert 1 <= len(content) <= 12 and use["completion_tokens"] == 12
    assert "".join(c["choices"][0]["text"] for c in content) == want.text
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]


def test_a_reader_that_keeps_up_gets_one_event_per_step(served, llm):
    """The engine may take a step only when the test allows it: after each step the reader
    gets exactly that step's token, before the next step runs."""
    ae, _, _ = served
    want = offline(llm, [[5, 6, 7]], max_tokens=6)[0].outputs[0].token_ids
    allowed = pace(ae.engine, DEADLINE_S)

    async def run():
        stream = await ae.add_request([5, 6, 7], SamplingParams(**{**GREEDY, "max_tokens": 6}), "paced")
        deltas = []
        for _ in range(6):
            allowed.release()
            deltas.append(await asyncio.wait_for(stream.next_delta(), DEADLINE_S))
        assert await asyncio.wait_for(stream.next_delta(), DEADLINE_S) is None
        return deltas

    try:
        deltas = asyncio.run(run())
    finally:
        del ae.engine.step
    assert [d.token_ids for d in deltas] == [[t] for t in want]
    assert [d.finished for d in deltas] == [False] * 5 + [True]


# -- tokenization and chat templates never hold up other requests ------------------------------
class HeldTokenizer:
    """The engine's tokenizer, except that encoding (or templating) a text holding "HOLD"
    blocks until ``release`` is set: a request that is slow to tokenize, on purpose."""

    def __init__(self, inner):
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _hold(self) -> None:
        self.entered.set()
        self.release.wait(DEADLINE_S / 2)

    def encode(self, text, *args, **kw):
        if "HOLD" in text:
            self._hold()
        return self.inner.encode(text, *args, **kw)

    def apply_chat_template(self, messages, *args, **kw):
        if any("HOLD" in m["content"] for m in messages):
            self._hold()
        return self.inner.apply_chat_template(messages, *args, **kw)


@pytest.mark.parametrize("path, held_body", [
    ("/v1/completions", {"prompt": "HOLD the line", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "HOLD on"}], "max_tokens": 2}),
])
def test_a_request_being_tokenized_does_not_hold_up_another(served, llm, path, held_body):
    """While one request is stuck in its tokenizer (or chat template), another is parsed,
    generated and answered in full: neither the event loop nor the engine thread waits."""
    ae, _, app = served
    held = HeldTokenizer(llm.engine.tokenizer)
    llm.engine.tokenizer = held
    want = offline(llm, [[5, 6, 7]], max_tokens=24)[0].outputs[0].text
    body = {"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def run():
        async with client(app) as c:
            stuck = asyncio.ensure_future(c.post(path, json=held_body))
            assert await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, DEADLINE_S)
            other = await asyncio.wait_for(c.post("/v1/completions", json=body), DEADLINE_S / 4)
            still_stuck = not stuck.done()
            held.release.set()
            return other, still_stuck, await stuck

    try:
        other, still_stuck, stuck = asyncio.run(run())
    finally:
        held.release.set()
        llm.engine.tokenizer = held.inner
    assert other.status_code == 200 and other.json()["choices"][0]["text"] == want
    assert other.json()["usage"]["completion_tokens"] == 24
    assert still_stuck and stuck.status_code == 200, stuck.text


# -- isolation and health --------------------------------------------------------------------
def test_a_request_whose_step_fails_is_aborted_alone_while_others_stream(served, llm):
    ae, _, app = served
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    clean = [o.outputs[0].token_ids for o in offline(llm, prompts, max_tokens=16)]
    add = llm.engine.add_request

    def add_request(prompt, params=None, **kw):
        rid = add(prompt, params, **kw)
        if kw.get("request_id") == "poison":        # past the validator, as a sampler bug would be
            llm.engine.requests[rid].sampling_params.temperature = 10 ** 400
        return rid

    async def run():
        streams = [await ae.add_request(p, SamplingParams(**{**GREEDY, "max_tokens": 16}), f"ok{i}")
                   for i, p in enumerate(prompts)]
        await until(lambda: all(s.token_ids for s in streams), "every stream has a token")
        poison = await ae.add_request([20, 21], SamplingParams(temperature=0.5, max_tokens=16), "poison")
        for s in streams + [poison]:
            await s.wait()
        async with client(app) as c:
            health = await c.get("/health")
        return streams, poison, health

    llm.engine.add_request = add_request
    try:
        streams, poison, health = asyncio.run(run())
    finally:
        del llm.engine.add_request
    assert poison.finish_reason == "abort" and "OverflowError" in poison.error
    assert [s.token_ids for s in streams] == clean and all(s.error is None for s in streams)
    assert ae.failure is None and health.status_code == 200


def test_when_the_engine_thread_dies_streams_end_and_health_is_503(served):
    ae, _, app = served
    deliver, calls = ae._deliver, []

    def failing_deliver(touched):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("delivery broke")
        return deliver(touched)

    ae._deliver = failing_deliver

    async def run():
        stream = await ae.add_request([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "a")
        await stream.wait()
        async with client(app) as c:
            health = await c.get("/health")
            refused = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        with pytest.raises(RuntimeError, match="delivery broke"):
            await ae.add_request([5, 6, 7], SamplingParams(), "b")
        return stream, health, refused

    stream, health, refused = asyncio.run(run())
    assert stream.finish_reason == "abort" and "delivery broke" in stream.error
    assert not ae.is_alive and "delivery broke" in ae.failure
    assert health.status_code == 503 and "delivery broke" in health.json()["error"]["message"]
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    llm_engine = ae.engine
    for rid in list(llm_engine.requests):          # the dead thread left them: clean up for the fixture
        llm_engine.abort_request(rid)
    llm_engine.requests.clear()
    llm_engine.finished.clear()


def test_a_step_failure_no_request_explains_turns_health_503(served):
    ae, _, app = served
    step, calls = ae.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return step()

    ae.engine.step = failing_step

    async def run():
        async with client(app) as c:
            assert (await c.get("/health")).status_code == 200
            failed = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8})
            health = await c.get("/health")
            after = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        return failed, health, after

    try:
        failed, health, after = asyncio.run(run())
    finally:
        del ae.engine.step
    assert failed.status_code == 500 and "scheduler bug" in failed.json()["error"]["message"]
    assert health.status_code == 503 and "scheduler bug" in health.json()["error"]["message"]
    assert after.status_code == 200                # it still serves; the operator is told to restart


# -- host names ------------------------------------------------------------------------------
def test_host_allow_list():
    allowed = {"localhost", "127.0.0.1", "::1", "api.example"}
    for ok in ("localhost", "LOCALHOST:8000", "127.0.0.1:1", "[::1]:8000", "api.example:443", None):
        assert host_allowed(ok, allowed), ok
    for refused in ("evil.example", "localhost.evil.example", "10.0.0.1", "[::2]:80", "api.example.evil"):
        assert not host_allowed(refused, allowed), refused
    assert host_allowed("10.0.0.1:8000", allowed, any_ip=True) and not host_allowed("evil.example", allowed, True)
    assert host_allowed("anything", {"*"})
    names, any_ip = default_allowed_hosts("127.0.0.1")
    assert set(names) == {"localhost", "127.0.0.1", "::1"} and not any_ip
    names, any_ip = default_allowed_hosts("0.0.0.0")
    assert any_ip and "localhost" in names


# -- fault injection and return_token_ids (the HTTP router's needs) --------------------------------
def test_fault_injection_is_off_by_default_and_loopback_only(served):
    from minibatch.serving.faults import FaultInjector

    _, state, app = served

    async def run():
        async with client(app) as c:
            assert (await c.post("/admin/fault", json={"kind": "none"})).status_code == 404
        state.faults = FaultInjector()
        faulty = build_app(state)
        remote = httpx.AsyncClient(transport=httpx.ASGITransport(app=faulty, client=("10.1.2.3", 4000)),
                                   base_url="http://127.0.0.1", headers=JSON, timeout=DEADLINE_S)
        async with remote:
            r = await remote.post("/admin/fault", json={"kind": "error"})
            assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
        async with client(faulty) as c:
            r = await c.post("/admin/fault", json={"kind": "error", "rate": 1.0, "status": 503})
            assert r.status_code == 200 and r.json()["kind"] == "error"
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "injected_fault"
            assert (await c.post("/admin/fault", json={"kind": "none"})).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200

    asyncio.run(run())


def test_return_token_ids_gives_the_prompt_and_generated_ids(served, llm):
    _, _, app = served
    want = offline(llm, [[5, 6, 7]])[0].outputs[0]

    async def run():
        async with client(app) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": GREEDY["max_tokens"], "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            events = []
            async with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            plain = (await c.post("/v1/completions", json=dict(body, return_token_ids=False))).json()
            return whole, events, plain

    whole, events, plain = asyncio.run(run())
    assert whole["prompt_token_ids"] == [5, 6, 7] and whole["token_ids"] == list(want.token_ids)
    assert events[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == list(want.token_ids)
    assert "token_ids" not in plain["choices"][0]


# -- /tokenize and /detokenize: behind the key, checked, and in a pool of their own ----------------
def test_tokenizer_calls_cannot_hold_up_a_generation(served, llm):
    """The issue's: four 4 MiB /tokenize calls pushed a completion from 0.07 s to 25 s. Here six
    /tokenize calls are stuck in the tokenizer ("HOLD"): they fill their own thread and queue, a
    completion is still prepared and answered in full, and the call beyond the queue gets 429."""
    from minibatch.serving import server

    ae, state, app = served
    queue = getattr(server, "MAX_TOKENIZER_QUEUE", 4)
    held = HeldTokenizer(llm.engine.tokenizer)
    llm.engine.tokenizer = held
    want = offline(llm, ["Once upon a time"], max_tokens=8)[0].outputs[0].text
    n = queue + 2

    async def run():
        async with client(app) as c:
            stuck = [asyncio.ensure_future(c.post("/tokenize", json={"prompt": f"HOLD {i}"})) for i in range(n)]
            assert await asyncio.get_running_loop().run_in_executor(None, held.entered.wait, DEADLINE_S)
            other = await asyncio.wait_for(c.post("/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}), DEADLINE_S / 4)
            refused = [t.result().status_code for t in stuck if t.done()]
            held.release.set()
            return other, refused, [(await t).status_code for t in stuck]

    try:
        other, refused, statuses = asyncio.run(run())
    finally:
        held.release.set()
        llm.engine.tokenizer = held.inner
    assert other.status_code == 200 and other.json()["choices"][0]["text"] == want
    assert refused == [429]                              # at once, while the others waited
    assert sorted(statuses) == [200] * (n - 1) + [429]


def test_tokenize_refuses_a_text_certainly_too_long_without_tokenizing_it(served, llm):
    _, state, app = served
    limit = state.max_prompt_chars
    assert limit is not None and limit < 4 * 2 ** 20
    seen: list[int] = []
    inner = llm.engine.tokenizer

    class Counting(HeldTokenizer):
        def encode(self, text, *args, **kw):
            seen.append(len(text))
            return self.inner.encode(text, *args, **kw)

    llm.engine.tokenizer = Counting(inner)

    async def run():
        async with client(app) as c:
            return (await c.post("/tokenize", json={"prompt": "a" * (limit + 1)}),
                    await c.post("/tokenize", json={"prompt": "Once upon a time"}))

    try:
        long, short = asyncio.run(run())
    finally:
        llm.engine.tokenizer = inner
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert "too long" in long.json()["error"]["message"]
    assert short.status_code == 200 and seen == [len("Once upon a time")]


@pytest.mark.parametrize("scope", ["v1", "all"])
def test_the_tokenizer_routes_are_behind_the_api_key(served, scope):
    ae, _, _ = served
    keyed = ServerState(ae, ["tiny"], 64, "sk-t", scope, allowed_hosts=["127.0.0.1"], prepare_threads=1)
    app = build_app(keyed)

    async def run():
        async with client(app) as c:
            out = []
            for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
                out.append((await c.post(path, json=body)).status_code)
                out.append((await c.post(path, json=body, headers={"Authorization": "Bearer sk-t"})).status_code)
            return out

    try:
        assert asyncio.run(run()) == [401, 200, 401, 200]
    finally:
        keyed.pool.shutdown(wait=True)
        if hasattr(keyed, "tokenizer_pool"):
            keyed.tokenizer_pool.shutdown(wait=True)
