"""The HTTP router's streams after a cut, per choice; abandoned requests; stalled upstreams.

Set-up (the issue's): two ``serve --enable-fault-injection`` upstreams and a router; CUT =
``POST /admin/fault {"kind": "cut_stream", "after_tokens": 5, "count": 1}`` to both, so a
stream is cut once on each upstream. A stream through the router must then equal the same
request answered by one uninterrupted server: per choice, the same token ids and text, the
same finish_reason, the same usage; or end with an OpenAI error event, never silently short.

A stalled upstream is a ``serve`` process stopped with SIGSTOP (always resumed with SIGCONT
in a ``finally``). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from serving_utils import ServerProcess, by_choice, metric, set_fault, sse_events, start_servers

WAIT_S = 120
CUT = {"kind": "cut_stream", "after_tokens": 5, "count": 1}
TWO = ["Once upon a time", "The little cat"]


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
    servers = start_servers(tmp_path_factory.mktemp("upstreams"), 2, "--max-num-seqs", "8",
                            "--enable-fault-injection")
    yield servers
    for s in servers:
        s.stop()


def start_router(tmp_path_factory, upstreams, *args: str) -> ServerProcess:
    d = tmp_path_factory.mktemp("router")
    return ServerProcess(d / "router.log", "--upstream", *(u.url for u in upstreams), "--poll-interval", "0.2",
                         *args, command="router")


@pytest.fixture(scope="module")
def router(tmp_path_factory, upstreams):
    r = start_router(tmp_path_factory, upstreams, "--policy", "round_robin")
    yield r
    r.stop()


@pytest.fixture
def no_faults(upstreams):
    yield
    for s in upstreams:
        if s.proc.poll() is None:
            set_fault(s, kind="none")


def cut_both(upstreams) -> None:
    for s in upstreams:
        set_fault(s, **CUT)


def direct(upstreams, body: dict, path: str = "/v1/completions") -> list:
    """The same stream from one server, uninterrupted (the yardstick)."""
    set_fault(upstreams[0], kind="none")
    return sse_events(upstreams[0].url, path, body)


def counter(router, name: str, **labels) -> float:
    page = httpx.get(f"{router.url}/metrics", timeout=30).text
    try:
        return metric(page, name, **labels)
    except KeyError:
        return 0.0


def assert_same_answer(got: list, want: list, ids: bool = True) -> None:
    assert got[-1] == "[DONE]" and want[-1] == "[DONE]"
    assert not [e for e in got[:-1] if "error" in e], got
    g, w = by_choice(got), by_choice(want)
    assert sorted(g) == sorted(w)
    for k in w:
        assert g[k]["text"] == w[k]["text"], (k, g[k]["text"], w[k]["text"])
        assert g[k]["finish_reason"] == w[k]["finish_reason"], k
        if ids:
            assert g[k]["token_ids"] == w[k]["token_ids"], k
    usage = [e["usage"] for e in got[:-1] if not e["choices"] and "usage" in e]
    want_usage = [e["usage"] for e in want[:-1] if not e["choices"] and "usage" in e]
    assert usage == want_usage
    assert len({e["id"] for e in got[:-1]}) == 1          # one id, as from one upstream


# -- a cut stream resumes per choice -----------------------------------------------------------------
@pytest.mark.parametrize("ids", [True, False], ids=["client_asks_ids", "no_ids"])
def test_multi_prompt_greedy_stream_resumes_each_choice(router, upstreams, no_faults, ids):
    """The issue's reproduction: two prompts, 40 tokens each, cut after 5 on each upstream."""
    body = {"model": "tiny", "prompt": TWO, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": ids}
    want = direct(upstreams, body)
    before = counter(router, "minibatch_router_retries_total", kind="resume")
    cut_both(upstreams)
    got = sse_events(router.url, "/v1/completions", body)
    assert_same_answer(got, want, ids)
    assert [c["finish_reason"] for c in by_choice(got).values()] == ["length", "length"]
    if not ids:                                            # the ids the router asked for stay hidden
        assert not any("token_ids" in c for e in got[:-1] for c in e["choices"])
    assert counter(router, "minibatch_router_retries_total", kind="resume") >= before + 2


@pytest.mark.parametrize("prompt", ["Once upon a time", TWO], ids=["one_prompt", "two_prompts"])
def test_echo_with_resume_does_not_repeat_the_prompt(router, upstreams, no_faults, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "stream": True, "echo": True, "return_token_ids": True}
    want = direct(upstreams, body)
    cut_both(upstreams)
    got = sse_events(router.url, "/v1/completions", body)
    assert_same_answer(got, want)
    for k, text in by_choice(got).items():
        p = prompt if isinstance(prompt, str) else prompt[k]
        assert text["text"].startswith(p) and text["text"].count(p) == 1


def test_a_finished_choice_does_not_end_the_others(router, upstreams, no_faults):
    """Choice 0 stops early (a stop string found only in its text); choice 1 is cut later:
    choice 1 still gets all its 40 tokens, and the usage counts both."""
    plain = by_choice(direct(upstreams, {"model": "tiny", "prompt": TWO, "max_tokens": 40, "ignore_eos": True,
                                         "temperature": 0, "stream": True, "return_token_ids": True}))
    words = [w for w in re.findall(r"[A-Za-z]{3,}", plain[0]["text"][:30]) if w not in plain[1]["text"]]
    assert words, plain
    body = {"model": "tiny", "prompt": TWO, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True,
            "stop": [words[0]], "stream_options": {"include_usage": True}, "return_token_ids": True}
    want = direct(upstreams, body)
    w = by_choice(want)
    assert w[0]["finish_reason"] == "stop" and len(w[0]["token_ids"]) < CUT["after_tokens"]
    assert w[1]["finish_reason"] == "length" and len(w[1]["token_ids"]) == 40
    cut_both(upstreams)
    got = sse_events(router.url, "/v1/completions", body)
    assert_same_answer(got, want)


def test_a_sampled_multi_choice_stream_that_cannot_resume_ends_with_an_error_event(router, upstreams, no_faults):
    body = {"model": "tiny", "prompt": "Once upon a time", "n": 2, "max_tokens": 40, "ignore_eos": True,
            "temperature": 0.8, "seed": 3, "stream": True}
    cut_both(upstreams)
    got = sse_events(router.url, "/v1/completions", body)
    assert got[-1] == "[DONE]"
    assert "error" in got[-2] and "greedy" in got[-2]["error"]["message"]
    assert not all(c["finish_reason"] for c in by_choice(got).values())     # short, and said so


# -- a client that leaves ------------------------------------------------------------------------------
def test_abandoned_non_streamed_requests_are_cancelled_upstream(router, upstreams, no_faults):
    """20 clients give up after 0.3 s: the router closes their upstream requests, and the
    servers abort all 20 (``vllm:request_success_total{finished_reason="abort"}``)."""
    def ends(reason: str) -> float:
        total = 0.0
        for s in upstreams:
            page = httpx.get(f"{s.url}/metrics", timeout=30).text
            total += metric(page, "vllm:request_success_total", finished_reason=reason)
        return total

    aborts, lengths = ends("abort"), ends("length")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def give_up(c: httpx.AsyncClient):
        with pytest.raises(httpx.ReadTimeout):      # sent in full, then no patience for the answer
            await c.post(f"{router.url}/v1/completions", json=body, timeout=httpx.Timeout(WAIT_S, read=0.3))

    async def run():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20)) as c:
            await asyncio.gather(*(give_up(c) for _ in range(20)))

    asyncio.run(run())
    # Each request ends once upstream, aborted or run to its length: wait for all 20.
    wait_for(lambda: ends("abort") + ends("length") >= aborts + lengths + 20, what="the 20 requests to end upstream")
    assert ends("abort") - aborts == 20
    assert counter(router, "minibatch_router_abandoned_total") >= 20


# -- a stalled upstream (SIGSTOP) ----------------------------------------------------------------------
@pytest.fixture
def stall_router(tmp_path_factory, upstreams):
    r = start_router(tmp_path_factory, upstreams, "--policy", "round_robin", "--first-token-timeout", "4",
                     "--inter-token-timeout", "4", "--health-timeout", "1")
    yield r
    r.stop()


def upstream_holding(router, upstreams):
    """The upstream the router has a request in flight on (from its /health details)."""
    def find():
        states = httpx.get(f"{router.url}/health", timeout=30).json()["upstreams"]
        busy = [i for i, u in enumerate(states) if u["in_flight"] > 0]
        return busy[0] + 1 if busy else None

    return upstreams[wait_for(find, what="a request in flight upstream") - 1]


class Stopped:
    """SIGSTOP a server for the duration of a ``with`` block; SIGCONT on the way out, always."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        os.kill(self.server.proc.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        os.kill(self.server.proc.pid, signal.SIGCONT)


def healthy_again(router, upstreams) -> None:
    wait_for(lambda: all(u["healthy"] for u in httpx.get(f"{router.url}/health", timeout=30).json()["upstreams"]),
             what="both upstreams healthy again")


def stream_until_stopped(router, upstreams, path: str, body: dict) -> list:
    """Stream ``body`` through the router; after three events, SIGSTOP the upstream serving it."""
    import json

    events: list = []
    stopped = None
    try:
        with httpx.stream("POST", f"{router.url}{path}", json=body, timeout=WAIT_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                if len(events) == 3 and stopped is None:
                    stopped = upstream_holding(router, upstreams)
                    os.kill(stopped.proc.pid, signal.SIGSTOP)
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
    assert stopped is not None, events
    return events


def test_a_stream_stalled_mid_way_resumes_on_another_upstream(stall_router, upstreams, no_faults):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    want = direct(upstreams, body)
    for s in upstreams:                    # pace the events, so that the stream is still going when stopped
        set_fault(s, kind="slow", delay_s=0.02)
    got = stream_until_stopped(stall_router, upstreams, "/v1/completions", body)
    assert_same_answer(got, want)
    stalls = [counter(stall_router, "minibatch_router_upstream_errors_total", kind="stall", upstream=u.url)
              for u in upstreams]
    assert sorted(stalls) == [0, 1]                # the stopped one, marked unhealthy
    healthy_again(stall_router, upstreams)


def test_a_stalled_chat_stream_ends_with_an_error_event(stall_router, upstreams, no_faults):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300,
            "ignore_eos": True, "temperature": 0, "stream": True}
    for s in upstreams:
        set_fault(s, kind="slow", delay_s=0.02)
    got = stream_until_stopped(stall_router, upstreams, "/v1/chat/completions", body)
    assert got[-1] == "[DONE]"
    assert "error" in got[-2] and "cannot be resumed" in got[-2]["error"]["message"]
    healthy_again(stall_router, upstreams)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream_before_its_first_token"])
def test_a_request_on_a_stalled_upstream_is_retried_elsewhere(stall_router, upstreams, no_faults, stream):
    """The upstream is stopped while the request waits there (an injected 2 s delay before its
    engine): nothing reached the client, so the request goes to the other upstream."""
    body = {"model": "tiny", "prompt": "The little cat", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    want = httpx.post(f"{upstreams[0].url}/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]["text"]
    for s in upstreams:
        set_fault(s, kind="slow", delay_s=2.0)

    async def run():
        async with httpx.AsyncClient(timeout=WAIT_S) as c:
            if stream:
                task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                    None, sse_events, stall_router.url, "/v1/completions", dict(body, stream=True)))
            else:
                task = asyncio.ensure_future(c.post(f"{stall_router.url}/v1/completions", json=body))
            held = await asyncio.get_running_loop().run_in_executor(None, upstream_holding, stall_router, upstreams)
            with Stopped(held):
                return await asyncio.wait_for(task, WAIT_S)

    got = asyncio.run(run())
    if stream:
        assert got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
        assert by_choice(got)[0]["text"] == want
    else:
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want
    healthy_again(stall_router, upstreams)
