"""The HTTP router's edge: the Host allow-list, the API key over its own routes, read
timeouts, the connection limit, bad text, and bounded routing work on huge prompts.

The first tests run the router's app in this process (no upstream is needed: every check
here comes before one is chosen); the last ones start a router process and talk to it
through raw sockets. Every wait has a deadline far above the router's own timeouts.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from serving_utils import ServerProcess, free_port

from minibatch.serving.router import build_app, make_parser, state_from_args

DEADLINE_S = 60
KEY = "sk-router"
DEAD = "http://127.0.0.1:9"          # an upstream that never answers: these tests stop before one


def app_for(*argv: str):
    """The router's app and state from command-line options, without its lifespan (no polls)."""
    state = state_from_args(make_parser().parse_args(["--upstream", DEAD, *argv]), [DEAD])
    return build_app(state), state


def call(app, method: str, path: str, host: str = "127.0.0.1", **kw) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}",
                                     timeout=DEADLINE_S) as c:
            return await c.request(method, path, **kw)

    return asyncio.run(run())


# -- in process ---------------------------------------------------------------------------------------
def test_host_allow_list_is_the_servers_rule():
    """Default: the loopback names and the bind host; another Host (a DNS-rebinding page) gets 400."""
    app, _ = app_for()
    evil = call(app, "GET", "/v1/models", host="evil.example:8000")
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
    assert call(app, "GET", "/v1/models", host="localhost:8000").status_code == 200
    app, _ = app_for("--allowed-hosts", "api.internal")
    assert call(app, "GET", "/v1/models", host="api.internal").status_code == 200
    assert call(app, "GET", "/v1/models", host="127.0.0.1").status_code == 400


def test_a_lone_surrogate_gets_400_with_prefix_aware():
    app, _ = app_for("--policy", "prefix_aware", "--tokenizer", "tiny")
    r = call(app, "POST", "/v1/completions", content=b'{"model": "tiny", "prompt": "a \\ud800 b"}',
             headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "surrogate" in r.json()["error"]["message"]


def test_cache_aware_routing_tokenizes_a_bounded_prefix_off_the_event_loop():
    """A 3.9 M-character prompt: the tokenizer sees at most --routing-prefix-chars characters,
    in a thread that is not the event loop's; the length still counts the whole prompt."""
    from minibatch.serving.routed import Tokens

    _, state = app_for("--policy", "prefix_aware", "--routing-prefix-chars", "4096")
    seen: list[tuple[int, str]] = []

    class Recording(Tokens):
        def encode(self, text):
            seen.append((len(text), threading.current_thread().name))
            return super().encode(text)

    state.tokens = Recording(Tokens.for_model("tiny").tokenizer)
    huge = "Once upon a time, a cat sat on a mat. " * 100_000
    short = "Once upon a time, a cat sat on a mat."

    async def run():
        loop_thread = threading.current_thread().name
        routed = [await state.routed_request({"model": "tiny", "prompt": p}, False) for p in (huge, short)]
        return loop_thread, routed

    loop_thread, (big, small) = asyncio.run(run())
    assert [n for n, _ in seen] == [4096, len(short)]
    assert all(name != loop_thread for _, name in seen)
    assert len(big.prompt_token_ids) == len(state.tokens.encode(huge[:4096]))
    ratio = len(huge) / 4096
    assert abs(big.prompt_len - len(big.prompt_token_ids) * ratio) <= ratio    # the rest at the prefix's rate
    assert small.prompt_len == len(small.prompt_token_ids)


@pytest.mark.parametrize("scope", ["v1", "all"])
def test_the_api_key_covers_the_routers_routes_and_health_hides_upstreams(scope):
    app, _ = app_for("--api-key", KEY, "--api-key-scope", scope)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(app, "GET", "/v1/models").status_code == 401
    assert call(app, "GET", "/v1/models", headers=auth).status_code == 200
    assert call(app, "GET", "/metrics").status_code == (401 if scope == "all" else 200)
    assert call(app, "GET", "/metrics", headers=auth).status_code == 200
    opened = call(app, "GET", "/health")                 # open (load balancers), without details
    assert opened.status_code == 503 and opened.json() == {"status": "unavailable"}
    assert DEAD not in opened.text
    detailed = call(app, "GET", "/health", headers=auth).json()
    assert [u["url"] for u in detailed["upstreams"]] == [DEAD]
    r = call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_stall_deadline_counts_the_upstreams_silence_not_a_slow_client():
    """``relay.sse_data``: an upstream event stream that pauses shorter than the inter-token
    timeout, read by a client slower than it, is not cut; one that then stops is, with
    ``asyncio.TimeoutError``, well before the test's deadline."""
    import aiohttp
    from aiohttp import web

    from minibatch.serving.relay import sse_data

    done = None

    async def events(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await asyncio.sleep(0.2)
            await resp.write(f"data: {i}\n\n".encode())
        await asyncio.wait_for(done.wait(), DEADLINE_S)     # then silence, until the test is over
        return resp

    async def run():
        nonlocal done
        done = asyncio.Event()
        app = web.Application()
        app.router.add_get("/", events)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        got: list[str] = []
        try:
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
                t0 = time.monotonic()
                with pytest.raises(asyncio.TimeoutError):
                    async for data in sse_data(resp, first_timeout=5, idle_timeout=1.0):
                        got.append(data)
                        await asyncio.sleep(1.5)            # a client slower than the idle timeout
                return got, time.monotonic() - t0
        finally:
            done.set()
            await runner.cleanup()

    got, took = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
    assert got == ["0", "1", "2"] and took < DEADLINE_S / 2


# -- a router process, raw sockets -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("router") / "router.log", "--upstream", f"http://127.0.0.1:{free_port()}",
                        "--read-timeout", "2", "--max-connections", "16", command="router", threads=None,
                        ready_status=503)
    yield srv
    srv.stop()


def raw(router) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=DEADLINE_S)


def closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the peer sent before closing ``s`` within ``seconds`` (None: still open)."""
    s.settimeout(seconds)
    out = b""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return out
            out += data
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        return out


def test_a_connection_that_sends_no_headers_is_closed(router):
    with raw(router) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")      # never finished
        assert closed_within(s, DEADLINE_S) is not None


def test_a_body_that_does_not_arrive_gets_408(router):
    with raw(router) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\":")
        answer = closed_within(s, DEADLINE_S)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer


def test_idle_connections_make_room_for_new_ones(router):
    """30 idle connections against --max-connections 16: the oldest idle ones are closed, and a
    new client is still served."""
    idle = [raw(router) for _ in range(30)]
    try:
        r = httpx.get(f"{router.url}/health", timeout=DEADLINE_S)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        closed = sum(closed_within(s, 0.5) is not None for s in idle[:14])
        assert closed >= 10, closed
        page = httpx.get(f"{router.url}/metrics", timeout=DEADLINE_S).text
        assert 'minibatch_router_rejected_total{reason="connections"}' in page
    finally:
        for s in idle:
            s.close()
