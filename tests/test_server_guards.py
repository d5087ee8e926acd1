"""``minibatch serve``'s guards, through real sockets: the Host allow-list, JSON-only API
routes, the API key over every route (``--api-key-scope all``), the body-size limit and
the read timeouts (slow headers, slow bodies, clients that leave mid-upload), the limit on
open connections, and the tokenizer routes behind the key.

One server (tiny model, short limits) serves the module. Timeouts are asserted with
deadlines far above the server's (2 s): the test only fails if a connection is never cut.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from serving_utils import ServerProcess, metric

KEY = "sk-guards"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 100_000
READ_TIMEOUT_S = 2
MAX_CONNECTIONS = 16
DEADLINE_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("guards") / "server.log", "--api-key", KEY, "--api-key-scope", "all",
                        "--allowed-hosts", "127.0.0.1", "api.internal", "--max-request-body-bytes", str(BODY_LIMIT),
                        "--read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                        "--max-num-seqs", "4")
    yield srv
    srv.stop()


def rejected(server, reason: str) -> float:
    page = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    return metric(page, "minibatch:request_rejected_total", reason=reason)


def completion(server, body=None, headers=None, **kw) -> httpx.Response:
    body = {"prompt": [5, 6, 7], "max_tokens": 2} if body is None else body
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/completions", content=content, timeout=DEADLINE_S,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})}, **kw)


def raw_connection(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while True:
        data = s.recv(65536)
        if not data:
            return out
        out += data


# -- Host ------------------------------------------------------------------------------------
def test_only_allowed_host_names_are_answered(server):
    before = rejected(server, "host")
    for host in ("evil.example", "localhost", "127.0.0.1.evil.example"):
        r = httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        assert "--allowed-hosts" in r.json()["error"]["message"]
        assert completion(server, headers={"Host": host}).status_code == 400
    for host in ("api.internal", "API.internal:8000", f"127.0.0.1:{server.port}"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=10).status_code == 200, host
    assert completion(server, headers={"Host": "api.internal"}).status_code == 200
    assert rejected(server, "host") == before + 6


# -- JSON only -------------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "", "application/jsonp"])
def test_api_routes_refuse_what_is_not_json(server, ctype):
    """A cross-site form or fetch() without a preflight can only send these: no generation."""
    before = rejected(server, "media_type")
    r = completion(server, headers={"Content-Type": ctype})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    assert rejected(server, "media_type") == before + 1
    assert completion(server, headers={"Content-Type": "Application/JSON; charset=utf-8"}).status_code == 200


# -- the API key on every route but /health ------------------------------------------------------
@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models", "/nowhere",
                                  "/tokenize", "/detokenize"])
def test_api_key_scope_all_covers_every_route_but_health(server, path):
    r = httpx.get(f"{server.url}{path}", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10).status_code == {
        "/nowhere": 404, "/tokenize": 405, "/detokenize": 405}.get(path, 200)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# -- body size --------------------------------------------------------------------------------
def test_bodies_over_the_limit_get_413(server):
    before = rejected(server, "too_large")
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    r = completion(server, big)
    assert r.status_code == 413 and str(BODY_LIMIT) in r.json()["error"]["message"]

    def chunked():                 # no Content-Length: the limit applies to what arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=DEADLINE_S,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert rejected(server, "too_large") == before + 2
    just_under = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2, "user": "y" * (BODY_LIMIT - 100)}).encode()
    assert len(just_under) <= BODY_LIMIT and completion(server, just_under).status_code == 200


# -- read timeouts and clients that leave ------------------------------------------------------
def test_a_connection_that_sends_nothing_or_slow_headers_is_closed(server):
    t0 = time.monotonic()
    with raw_connection(server) as idle, raw_connection(server) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")    # and never the rest
        assert read_until_closed(idle) == b"" and read_until_closed(slow) == b""
    assert time.monotonic() - t0 < DEADLINE_S
    assert completion(server).status_code == 200


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    before = rejected(server, "timeout")
    with raw_connection(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert rejected(server, "timeout") == before + 1


def test_clients_that_leave_mid_upload_leave_no_trace(server):
    before = rejected(server, "disconnected")
    for _ in range(8):
        with raw_connection(server) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 50000\r\n\r\n" + b" " * 1000)
    deadline = time.monotonic() + DEADLINE_S
    while rejected(server, "disconnected") < before + 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rejected(server, "disconnected") == before + 8
    assert completion(server).status_code == 200
    log = server.log()
    assert "Traceback" not in log and "Exception" not in log, log


# -- open connections -------------------------------------------------------------------------------
def test_idle_connections_make_room_for_a_request(server):
    """Twice --max-connections idle connections (the issue's 1,100 exhausted the file
    descriptors): the oldest idle ones are closed, and a new client is still served."""
    before = rejected(server, "connections")
    idle = [raw_connection(server) for _ in range(2 * MAX_CONNECTIONS)]
    try:
        assert completion(server).status_code == 200
        idle[0].settimeout(DEADLINE_S)
        assert idle[0].recv(1) == b""                 # the oldest went first
        assert rejected(server, "connections") >= MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()

