"""``python -m minibatch serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m minibatch serve --model tiny --port 8000 --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "Once upon a time", "max_tokens": 32}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with
``"stream": true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (503 once the engine has failed, or while shutting down), ``GET /metrics``
(Prometheus text). One :class:`AsyncEngine` thread batches every connection's requests
together; each token reaches its client as soon as the step that made it ends.

The stream contract (vLLM V1's too). An SSE event carries every token the engine
produced for that request since the previous event was handed to the connection: the
engine thread appends each step's new text and tokens to the request's stream, and the
event generator takes all that is pending whenever it runs. While a reader keeps up,
that is one event per step (one token); a reader that falls behind (its socket buffer
full, or the event loop busy) gets fewer, larger events, never a lost, duplicated or
reordered token. Counting tokens means counting ``usage.completion_tokens``
(``stream_options.include_usage``), not events; the last content event carries the
``finish_reason``. A client that measures inter-token latency per event (``vllm bench
serve``, ``minibatch bench serve``) sees one gap per event.

Bad input never reaches the engine and never fails another request: every malformed
request gets a 4xx in OpenAI's error shape naming the problem (see ``protocol.py``), a
body is read under a size limit (``--max-request-body-bytes``, 413) and a time limit
(``--read-timeout`` for the headers and for the body, 408), and JSON parsing, chat
templating and tokenization run in a small thread pool, off the event loop and off the
engine thread, after a length check on characters that refuses a prompt certainly too
long for ``max_model_len`` without tokenizing it. A request whose part of an engine step
fails is aborted with its own error (``LLMEngine`` isolates it); the others go on.

Guards, on every route: the ``Host`` header must be in ``--allowed-hosts`` (default: the
loopback names and the bind host; with a wildcard bind also this machine's name and any
IP address; ``*`` turns the check off), which defeats DNS rebinding; ``POST /v1/...``
must be ``Content-Type: application/json`` (415 otherwise), so that a cross-site
"simple" request (a form, or ``text/plain``) cannot start a generation; with
``--api-key`` the ``/v1`` routes need ``Authorization: Bearer KEY``, and with
``--api-key-scope all`` so do ``/metrics``, ``/docs``, ``/redoc`` and ``/openapi.json``
(every route but ``/health``).

Flow control: at most ``--max-concurrent-requests`` generations are in flight; the next
one gets 429 at once, with ``Retry-After``, instead of waiting in an unbounded queue. A
client that disconnects is aborted and its KV blocks are freed. On SIGTERM (or Ctrl-C)
the server stops accepting connections, lets in-flight requests finish for up to
``--graceful-shutdown-timeout`` seconds, then aborts the rest (their streams end with
``finish_reason: "abort"`` and ``[DONE]``), and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hmac
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from minibatch.config import add_engine_args, engine_kwargs, env
from minibatch.serving.async_engine import AsyncEngine, RequestStream
from minibatch.serving.protocol import (APIError, GenerationRequest, bad, chunk, find_lone_surrogate,
                                        max_prompt_chars, parse_request, render_chat, response, usage)
from minibatch.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics

DISCONNECT_POLL_S = 0.5    # how often a non-streaming request checks that its client is still there
HARD_SHUTDOWN_MARGIN_S = 5.0   # after the graceful timeout and the aborts, uvicorn cuts what is left
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
DEFAULT_READ_TIMEOUT_S = 30.0
# A body over the limit is still read (and dropped) up to this size, so that a client that
# writes its whole body before reading gets the 413 instead of a reset connection.
MAX_DRAIN_BYTES = 64 * 2 ** 20
RETRY_AFTER_S = 1
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
OPEN_PATHS = ("/health",)          # never behind the API key (load balancers probe it)


class ServerState:
    """What the endpoints share: the engine, the served names, the limits, the draining flag."""

    def __init__(self, engine: AsyncEngine, served_names: list[str], max_concurrent_requests: int,
                 api_key: str | None, api_key_scope: str = "v1", allowed_hosts=("*",),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
                 prepare_threads: int | None = None):
        self.engine = engine
        self.metrics: ServingMetrics = engine.metrics
        self.served_names = served_names
        self.max_concurrent_requests = max_concurrent_requests
        self.api_key = api_key
        self.api_key_scope = api_key_scope
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.any_ip_host = False            # a wildcard bind: any IP-literal Host is fine too
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        llm = engine.engine
        self.max_prompt_chars = max_prompt_chars(llm.tokenizer, llm.max_model_len)
        # JSON parsing, chat templates and tokenization: off the event loop and the engine thread.
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prepare_threads or min(4, os.cpu_count() or 1), thread_name_prefix="minibatch-prepare")
        self.draining = False

    def host_allowed(self, host: str | None) -> bool:
        return host_allowed(host, self.allowed_hosts, self.any_ip_host)

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path in OPEN_PATHS:
            return False
        return path == "/v1" or path.startswith("/v1/") or self.api_key_scope == "all"


def host_allowed(host: str | None, allowed: set[str], any_ip: bool = False) -> bool:
    """Is ``host`` (a ``Host`` header: ``name``, ``name:port``, ``[v6]:port``) in ``allowed``
    (lower-case names; ``*`` allows all)? ``any_ip``: any IP literal is fine too. A request
    without a Host header (HTTP/1.0) passes: browsers always send one."""
    if host is None or "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):                       # [::1]:8000
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:                     # example.com:8000 (one colon: not IPv6)
        name = name.split(":", 1)[0]
    if name in allowed:
        return True
    if any_ip:
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False
    return False


class Guard:
    """Checks that come before any route (a plain ASGI middleware, so streaming is untouched):
    the Host allow-list (400), the API key (401), and JSON content for ``POST /v1/...`` (415)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.check(scope)
            if err is not None:
                resp = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        state = self.state
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        path = scope["path"]
        host = headers.get("host")
        if not state.host_allowed(host):
            state.metrics.count_http_rejection("host")
            return APIError(400, f"the Host header {host[:100]!r} is not one this server answers to; "
                                 "start it with --allowed-hosts NAME ... (or '*')", code="invalid_host")
        if state.needs_key(path):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                state.metrics.count_http_rejection("unauthorized")
                return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        if scope["method"] == "POST" and path.startswith("/v1/"):
            ctype = headers.get("content-type", "")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                state.metrics.count_http_rejection("media_type")
                return APIError(415, f"Content-Type must be application/json, got {ctype[:100]!r}",
                                code="unsupported_media_type")
        return None


def build_app(state: ServerState):
    """The FastAPI app serving ``state.engine``; shutting the app down stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.engine.shutdown()
        state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minibatch", lifespan=lifespan)
    app.state.minibatch = state
    app.add_middleware(Guard, state=state)
    engine = state.engine
    llm = engine.engine

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(APIError(503, "the server is shutting down", type="server_error").body(), 503)
        failure = engine.failure
        if failure is not None:
            return JSONResponse(APIError(503, failure, type="server_error", code="engine_error").body(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(engine.gauges, engine.num_in_flight)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "minibatch",
             "root": llm.config.model, "max_model_len": llm.max_model_len}
            for name in state.served_names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    def check_overload() -> None:
        if engine.num_in_flight >= state.max_concurrent_requests:
            state.metrics.count_http_rejection("overload")
            raise APIError(429, f"the server is at its limit of {state.max_concurrent_requests} "
                                "concurrent requests; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def read_body(request: Request) -> bytes:
        """The body, under ``max_body_bytes`` (413) and ``read_timeout`` (408)."""
        limit = state.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > MAX_DRAIN_BYTES:
            state.metrics.count_http_rejection("too_large")
            raise too_large(limit)
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for piece in request.stream():
                size += len(piece)
                if size <= limit:
                    chunks.append(piece)
                elif size > MAX_DRAIN_BYTES:
                    return

        try:
            await asyncio.wait_for(read(), state.read_timeout)
        except asyncio.TimeoutError:
            state.metrics.count_http_rejection("timeout")
            raise APIError(408, f"the request body did not arrive within {state.read_timeout:g} s "
                                "(--read-timeout)", code="request_timeout", headers={"Connection": "close"}) from None
        if size > limit:
            state.metrics.count_http_rejection("too_large")
            raise too_large(limit)
        return b"".join(chunks)

    def too_large(limit: int) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                             "(--max-request-body-bytes)", code="request_too_large", headers={"Connection": "close"})

    def prepare(raw: bytes, chat: bool) -> GenerationRequest:
        """Parse, check, render and tokenize a request (in the thread pool)."""
        return prepare_request(raw, chat, llm, state.served_names, state.max_prompt_chars)

    async def generate(request: Request, chat: bool):
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error")
        if not engine.is_alive:
            raise APIError(503, engine.failure or "the engine has stopped", type="server_error")
        try:
            raw = await read_body(request)
        except ClientDisconnect:            # the client left mid-upload: nobody to answer
            state.metrics.count_http_rejection("disconnected")
            return Response(status_code=400)
        check_overload()                    # before any parsing (after the body: no reset upload)
        try:
            req = await asyncio.get_running_loop().run_in_executor(state.pool, prepare, raw, chat)
        except APIError:
            state.metrics.count_http_rejection("invalid")
            raise
        check_overload()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = await engine.add_request(req.prompt, req.params, rid)
        except ValueError as e:
            state.metrics.count_http_rejection("invalid")
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if req.stream:
            return StreamingResponse(sse_events(engine, stream, req), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await wait_or_abort(stream, request)
        if stream.error:
            raise APIError(500, stream.error, type="server_error")
        return response(rid, req.model, chat, stream.text, stream.finish_reason, stream.stop_reason,
                        usage(stream.num_prompt_tokens, len(stream.token_ids)))

    async def wait_or_abort(stream: RequestStream, request: Request) -> None:
        """Wait for the whole answer; abort it if the client goes away meanwhile."""
        task = asyncio.ensure_future(stream.wait())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    engine.abort(stream.request_id)
        finally:
            if not task.done():      # cancelled (e.g. at shutdown): free the request's blocks
                task.cancel()
                engine.abort(stream.request_id)

    return app


def prepare_request(raw: bytes, chat: bool, llm, served_names: list[str],
                    prompt_chars_limit: int | None) -> GenerationRequest:
    """Parse, check, render and tokenize a request body (``APIError`` on bad input).

    ``llm`` is anything with ``tokenizer``, ``max_model_len``, ``tokenize(text)`` and
    ``validate(ids, params)`` (an ``LLMEngine``; the Ray backend's ingress passes a front
    that leaves the engine-side checks to the replica). Shared by this server and
    ``minibatch.cluster.ray_backend``."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(None, "the request body is nested too deeply to parse") from None
    except ValueError as e:        # not JSON, not UTF-8, or an integer of over 4300 digits
        raise bad(None, f"the request body is not valid JSON: {str(e)[:200]}") from None
    where = find_lone_surrogate(body)
    if where is not None:
        raise bad(where, f"'{where}' holds a lone UTF-16 surrogate (such as \\ud800 without its pair), "
                         "which is not valid Unicode text")
    req = parse_request(body, chat, llm.tokenizer, llm.max_model_len, render=False)
    model = served_names[0] if req.model is None else req.model
    if model not in served_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{served_names}", param="model", code="model_not_found")
    req.model = model
    param = "messages" if chat else "prompt"
    text = req.prompt
    if chat:
        chars = sum(len(m["content"]) for m in req.messages)
    else:
        chars = len(text) if isinstance(text, str) else 0
    limit = prompt_chars_limit
    if limit is not None and chars > limit:
        raise bad(param, f"the prompt of {chars} characters is too long: that many characters make "
                         f"more than max_model_len={llm.max_model_len} tokens with this tokenizer")
    if chat:
        text = render_chat(req.messages, llm.tokenizer)
    try:
        _, ids = llm.tokenize(text)
        llm.validate(ids, req.params)
    except ValueError as e:
        raise bad(param, str(e)) from None
    req.prompt = ids
    return req


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_events(engine: AsyncEngine, stream: RequestStream, req: GenerationRequest):
    """Server-sent events: one OpenAI chunk per delta the stream has pending (every token
    since the previous event, the module's stream contract), then ``[DONE]``."""
    rid, created, chat, model = stream.request_id, int(time.time()), req.chat, req.model
    try:
        if chat:
            yield sse_event(chunk(rid, model, created, chat, "", role=True))
        async for delta in stream:
            if delta.error:
                yield sse_event(APIError(500, delta.error, type="server_error").body())
                break
            yield sse_event(chunk(rid, model, created, chat, delta.text, delta.finish_reason))
        if req.include_usage:
            yield sse_event(chunk(rid, model, created, chat, None,
                                  usage_=usage(stream.num_prompt_tokens, len(stream.token_ids))))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:     # the client went away (or shutdown): free its blocks now
            engine.abort(rid)


def _timed_protocol(read_timeout: float):
    """uvicorn's httptools protocol, plus a deadline on the request headers: a connection
    that opens and sends nothing, or sends its headers slowly, is closed after
    ``read_timeout`` seconds (uvicorn itself only times out idle keep-alive connections).
    ``None`` when httptools is not installed (uvicorn then uses h11, without this deadline)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedHttpToolsProtocol


def _make_server(app, host: str, port: int, state: ServerState, graceful_timeout: float, log_level: str):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, but a signal marks the app as draining, requests still running after
        ``graceful_timeout`` are aborted (so their streams end cleanly, with
        ``finish_reason: "abort"``), and the process then exits 0 (plain uvicorn re-raises
        the signal after its graceful shutdown)."""

        def handle_exit(self, sig, frame):
            if not state.draining:
                state.draining = True
                timer = threading.Timer(graceful_timeout, state.engine.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    protocol = _timed_protocol(state.read_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout + HARD_SHUTDOWN_MARGIN_S,
                            timeout_keep_alive=5, **({"http": protocol} if protocol is not None else {}))
    return Server(config)


def default_allowed_hosts(bind_host: str) -> tuple[list[str], bool]:
    """The Host names a server bound to ``bind_host`` answers to by default, and whether any
    IP-literal Host is fine too (a wildcard bind: clients may use any of the machine's
    addresses; an IP literal cannot be a DNS-rebinding name)."""
    names = [*LOOPBACK_HOSTS, bind_host.strip("[]")]
    wildcard = bind_host.strip("[]") in WILDCARD_HOSTS
    if wildcard:
        names += [socket.gethostname(), socket.getfqdn()]
    return [n for n in dict.fromkeys(n.lower() for n in names) if n], wildcard


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch serve",
                                description="Serve a model over the OpenAI HTTP API.")
    add_engine_args(p)
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: this process (default); ray: a Ray Serve deployment of engines, see "
                        "python -m minibatch serve --backend ray --help")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: --model)")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="requests in flight before answering 429 (default: max(256, 4 x max_num_seqs))")
    p.add_argument("--api-key", default=env("MINIBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MINIBATCH_API_KEY)")
    p.add_argument("--api-key-scope", choices=["v1", "all"], default="v1",
                   help="routes the API key covers: v1 (the /v1 API) or all (also /metrics, /docs, /redoc, "
                        "/openapi.json; /health stays open) (default: v1)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header values to answer (DNS-rebinding guard); '*' accepts any (default: "
                        "localhost, 127.0.0.1, ::1 and --host; with a wildcard --host also this machine's "
                        "name and any IP address)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers, and again its body "
                        f"(default: {DEFAULT_READ_TIMEOUT_S:g})")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=["local", "ray"], default="local")
    backend = pre.parse_known_args(argv)[0].backend
    if backend == "ray":             # one Ray Serve deployment of engines (minibatch.cluster.ray_backend)
        from minibatch.cluster import ray_backend
        return ray_backend.main(argv)
    args = make_parser().parse_args(argv)
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine

    for name in ("max_request_body_bytes", "read_timeout"):
        if not getattr(args, name) > 0:
            print(f"error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    try:
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        llm_engine = LLMEngine(config)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = args.served_model_name or [config.model]
    limit = args.max_concurrent_requests
    limit = max(256, 4 * config.max_num_seqs) if limit is None else limit
    if limit < 1:
        print("error: --max-concurrent-requests must be at least 1", file=sys.stderr)
        return 2
    hosts, any_ip = (args.allowed_hosts, False) if args.allowed_hosts else default_allowed_hosts(args.host)
    metrics = ServingMetrics(names[0], llm_engine.max_model_len)
    state = ServerState(AsyncEngine(llm_engine, metrics), names, limit, args.api_key, args.api_key_scope,
                        hosts, args.max_request_body_bytes, args.read_timeout)
    state.any_ip_host = any_ip
    server = _make_server(build_app(state), args.host, args.port, state,
                          args.graceful_shutdown_timeout, args.uvicorn_log_level)
    print(f"minibatch: serving {names[0]!r} on http://{args.host}:{args.port} "
          f"(max_num_seqs={config.max_num_seqs}, policy={config.policy}, "
          f"max_concurrent_requests={limit}, allowed hosts: {' '.join(hosts)}"
          f"{' and any IP address' if any_ip else ''})", file=sys.stderr, flush=True)
    server.run()
    state.engine.shutdown()      # idempotent; covers a failed startup where lifespan never ran
    state.pool.shutdown(wait=False, cancel_futures=True)
    return 0
