"""``python -m minibatch serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m minibatch serve --model tiny --port 8000 --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "Once upon a time", "max_tokens": 32}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with
``"stream": true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's paths and shapes; behind the API key
when there is one, unlike vLLM: ``edge.py``), ``GET /health`` (503
once the engine has failed, or while shutting down), ``GET /metrics`` (Prometheus text).
One :class:`AsyncEngine` thread batches every connection's requests together; each token
reaches its client as soon as the step that made it ends. The options each endpoint
implements, and what it refuses, are listed in ``protocol.py``; a request with several
prompts or ``n > 1`` becomes one engine request per choice (choice ``prompt * n + i``),
streamed side by side under their choice index.

A chat stream's first event (the assistant's role, empty content) goes out together with
the first token's event, as in vLLM, not before the first token exists: a client that
times its first chunk as the first token measures the real time to first token.

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
long for ``max_model_len`` without tokenizing it. ``/tokenize`` and ``/detokenize`` run in
a pool of their own (one thread, at most :data:`MAX_TOKENIZER_QUEUE` calls waiting, 429
beyond), after the same length check, so that they cannot hold up a generation's
preparation. A request whose part of an engine step
fails is aborted with its own error (``LLMEngine`` isolates it); the others go on.

Guards, on every route (``edge.py``, shared with the HTTP router): the ``Host`` header must
be in ``--allowed-hosts`` (default: the loopback names and the bind host; with a wildcard
bind also this machine's name and any IP address; ``*`` turns the check off), which
defeats DNS rebinding; ``POST /v1/...`` must be ``Content-Type: application/json`` (415
otherwise), so that a cross-site "simple" request (a form, or ``text/plain``) cannot start
a generation; with ``--api-key`` the ``/v1`` and tokenizer routes need ``Authorization:
Bearer KEY``, and with ``--api-key-scope all`` so do ``/metrics``, ``/docs``, ``/redoc`` and
``/openapi.json`` (every route but ``/health``). At most ``--max-connections`` connections
are open; the oldest idle one makes room for a new one.

Flow control: at most ``--max-concurrent-requests`` generations are in flight; the next
one gets 429 at once, with ``Retry-After``, instead of waiting in an unbounded queue. A
client that disconnects is aborted and its KV blocks are freed. On SIGTERM (or Ctrl-C)
the server stops accepting connections, lets in-flight requests finish for up to
``--graceful-shutdown-timeout`` seconds, then aborts the rest (their streams end with
``finish_reason: "abort"`` and ``[DONE]``), and exits 0.

Fault injection (``--enable-fault-injection``, off by default; ``minibatch.serving.faults``):
``POST /admin/fault`` from a loopback client makes this replica slow, failing, or cut its
streams, for chapter 29 and the HTTP router's tests.

``--replicas N`` starts N of these servers and the HTTP router in front of them instead
(``minibatch.serving.replicas``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from minibatch.config import add_engine_args, engine_kwargs, env
from minibatch.sampling_params import show
from minibatch.serving.async_engine import AsyncEngine, RequestStream
from minibatch.serving.edge import (  # noqa: F401  (host_allowed, default_allowed_hosts: also importable here)
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    Edge,
    Guard,
    add_edge_args,
    check_edge_args,
    default_allowed_hosts,
    host_allowed,
    raise_open_files_limit,
    uvicorn_config,
)
from minibatch.serving.faults import FaultInjector, StreamCut, parse_fault
from minibatch.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from minibatch.serving.openai import load_body, prepare_request, served_model, sse_event
from minibatch.serving.protocol import (
    APIError,
    Choice,
    GenerationRequest,
    add_error_handlers,
    bad,
    chat_logprobs,
    chunk,
    completion_logprobs,
    max_prompt_chars,
    parse_detokenize,
    parse_tokenize,
    render_chat,
    response,
    usage,
)

DISCONNECT_POLL_S = 0.5    # how often a non-streaming request checks that its client is still there
HARD_SHUTDOWN_MARGIN_S = 5.0   # after the graceful timeout and the aborts, uvicorn cuts what is left
RETRY_AFTER_S = 1
MAX_TOKENIZER_QUEUE = 4        # /tokenize and /detokenize calls waiting for their thread; 429 beyond


class ServerState:
    """What the endpoints share: the engine, the served names, the limits, the draining flag."""

    def __init__(self, engine: AsyncEngine, served_names: list[str], max_concurrent_requests: int,
                 api_key: str | None, api_key_scope: str = "v1", allowed_hosts=("*",),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
                 prepare_threads: int | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.engine = engine
        self.metrics: ServingMetrics = engine.metrics
        self.served_names = served_names
        self.max_concurrent_requests = max_concurrent_requests
        # Host allow-list, API key, body limits (edge.py); any_ip_host: set for a wildcard bind.
        self.edge = Edge(set(allowed_hosts), False, api_key, api_key_scope, max_body_bytes, read_timeout,
                         max_connections, "server", self.metrics.count_http_rejection)
        llm = engine.engine
        self.max_prompt_chars = max_prompt_chars(llm.tokenizer, llm.max_model_len)
        # JSON parsing, chat templates and tokenization: off the event loop and the engine thread.
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prepare_threads or min(4, os.cpu_count() or 1), thread_name_prefix="minibatch-prepare")
        # /tokenize and /detokenize: a thread of their own, so they never hold up a generation.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minibatch-tokenize")
        self.tokenizer_calls = 0            # /tokenize and /detokenize calls waiting or running
        self.draining = False
        self.faults: FaultInjector | None = None    # set by --enable-fault-injection


def build_app(state: ServerState):
    """The FastAPI app serving ``state.engine``; shutting the app down stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.engine.shutdown()
        state.pool.shutdown(wait=False, cancel_futures=True)
        state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minibatch", lifespan=lifespan)
    app.state.minibatch = state
    app.add_middleware(Guard, edge=state.edge)
    engine = state.engine
    llm = engine.engine

    add_error_handlers(app, "server")

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

    if state.faults is not None:
        faults = state.faults

        def loopback_only(request: Request) -> None:
            host = request.client.host if request.client else ""
            if host not in ("127.0.0.1", "::1", "localhost"):
                raise APIError(403, "fault injection is only open to loopback clients", code="forbidden")

        @app.get("/admin/fault")
        async def get_fault(request: Request):
            loopback_only(request)
            return faults.describe()

        @app.post("/admin/fault")
        async def set_fault(request: Request):
            loopback_only(request)
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise bad(None, f"the request body is not valid JSON: {str(e)[:200]}") from None
            faults.set(parse_fault(body))
            return faults.describe()

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

    def check_overload(need: int = 1) -> None:
        if need > state.max_concurrent_requests:
            raise bad("n", f"this request asks for {need} choices, more than this server's limit of "
                           f"{state.max_concurrent_requests} concurrent requests (--max-concurrent-requests)")
        if engine.num_in_flight + need > state.max_concurrent_requests:
            state.metrics.count_http_rejection("overload")
            raise APIError(429, f"the server is at its limit of {state.max_concurrent_requests} "
                                "concurrent requests; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def read_body(request: Request) -> bytes:
        """The body, under the edge's size (413) and time (408) limits."""
        return await state.edge.read_body(request)

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
        check_overload(len(req.prompts) * req.n)
        if state.faults is not None:
            state.faults.maybe_fail()
            if state.faults.delay_s():
                await asyncio.sleep(state.faults.delay_s())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for ids in req.prompts:         # choice index = prompt index * n + i, as in vLLM
                for i in range(req.n):
                    sub = rid if len(req.prompts) * req.n == 1 else f"{rid}-{len(streams)}"
                    streams.append(await engine.add_request(ids, req.choice_params(i), sub))
        except (ValueError, RuntimeError, asyncio.CancelledError) as e:
            for st in streams:
                engine.abort(st.request_id)
            if isinstance(e, ValueError):
                state.metrics.count_http_rejection("invalid")
                raise APIError(400, str(e), param="messages" if chat else "prompt") from None
            if isinstance(e, RuntimeError):
                raise APIError(503, str(e), type="server_error") from None
            raise
        if req.stream:
            return StreamingResponse(sse_events(engine, streams, req, rid, state.faults),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await wait_or_abort(streams, request)
        failed = next((s.error for s in streams if s.error), None)
        if failed:
            raise APIError(500, failed, type="server_error")
        choices = []
        for j, st in enumerate(streams):
            text = req.prompt_texts[j // req.n] + st.text if req.echo else st.text
            ids = ((list(req.all_prompts()[j // req.n]), list(st.token_ids)) if req.return_token_ids else None)
            choices.append(Choice(j, text, st.finish_reason, st.stop_reason,
                                  format_logprobs(llm, req, st.token_ids, st.logprobs), ids))
        prompt_tokens = sum(streams[k * req.n].num_prompt_tokens for k in range(len(req.prompts)))
        return response(rid, req.model, chat, None, choices=choices,
                        usage_=usage(prompt_tokens, sum(len(st.token_ids) for st in streams)))

    async def wait_or_abort(streams: list[RequestStream], request: Request) -> None:
        """Wait for the whole answer; abort it if the client goes away meanwhile."""
        task = asyncio.ensure_future(asyncio.gather(*(st.wait() for st in streams)))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    for st in streams:
                        engine.abort(st.request_id)
        finally:
            if not task.done():      # cancelled (e.g. at shutdown): free the requests' blocks
                task.cancel()
                for st in streams:
                    engine.abort(st.request_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenizer_call(request, tokenize_body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenizer_call(request, detokenize_body)

    async def tokenizer_call(request: Request, work):
        """Run ``work(body)`` in the tokenizer pool: 429 when :data:`MAX_TOKENIZER_QUEUE` calls wait."""
        raw = await read_body(request)
        if state.tokenizer_calls >= MAX_TOKENIZER_QUEUE + 1:
            state.metrics.count_http_rejection("overload")
            raise APIError(429, f"{state.tokenizer_calls} tokenizer calls are waiting or running, this server's "
                                "limit; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        state.tokenizer_calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, work, raw)
        finally:
            state.tokenizer_calls -= 1

    def tokenize_body(raw: bytes) -> dict:
        """vLLM's ``/tokenize``: ``{count, max_model_len, tokens, token_strs}``. A text certainly
        longer than ``max_model_len`` tokens (by its characters) is refused before tokenizing."""
        t = parse_tokenize(load_body(raw))
        served_model(t.model, state.served_names)
        tok = needs_tokenizer()
        chars = len(t.text) if t.messages is None else sum(len(m["content"]) for m in t.messages)
        limit = state.max_prompt_chars
        if limit is not None and chars > limit:
            raise bad("messages" if t.messages is not None else "prompt",
                      f"the text of {chars} characters is too long to tokenize: that many characters make more "
                      f"than max_model_len={llm.max_model_len} tokens with this tokenizer")
        text = t.text if t.messages is None else render_chat(t.messages, tok, t.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=t.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if t.return_token_strs else None}

    def detokenize_body(raw: bytes) -> dict:
        """vLLM's ``/detokenize``: ``{tokens}`` -> ``{prompt}``."""
        model, ids = parse_detokenize(load_body(raw))
        served_model(model, state.served_names)
        tok = needs_tokenizer()
        if llm.vocab_size is not None:
            out = next((t for t in ids if not 0 <= t < llm.vocab_size), None)
            if out is not None:
                raise bad("tokens", f"token id {show(out)} is outside the vocabulary [0, {llm.vocab_size})")
        return {"prompt": tok.decode(ids)}

    def needs_tokenizer():
        if llm.tokenizer is None:
            raise bad(None, "this model has no tokenizer")
        return llm.tokenizer

    return app


def format_logprobs(llm, req: GenerationRequest, token_ids: list[int], entries: list,
                    text_offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` object for these tokens (``None`` when not asked for)."""
    if req.logprobs is None:
        return None
    tok = llm.tokenizer

    def decode(t: int) -> str:
        return tok.decode([t]) if tok is not None else f"token_id:{t}"

    if req.chat:
        return chat_logprobs(token_ids, entries, req.logprobs, decode)
    return completion_logprobs(token_ids, entries, req.logprobs, decode, text_offset)


async def merged(streams: list[RequestStream]):
    """``(index, delta)`` from every stream, as each delta comes (in index order when
    several are ready at once)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    tasks = {asyncio.ensure_future(st.next_delta()): j for j, st in enumerate(streams)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.get):
                j = tasks.pop(task)
                delta = task.result()
                if delta is not None:
                    tasks[asyncio.ensure_future(streams[j].next_delta())] = j
                    yield j, delta
    finally:
        for task in tasks:
            task.cancel()


async def sse_events(engine: AsyncEngine, streams, req: GenerationRequest, rid: str | None = None,
                     faults: FaultInjector | None = None):
    """Server-sent events: one OpenAI chunk per delta a stream has pending (every token
    since the previous event, the module's stream contract), then ``[DONE]``. With
    ``return_token_ids`` each chunk carries its ``token_ids``, a choice's first chunk also the
    ``prompt_token_ids``. ``faults``: an injected delay per event, or a cut connection.

    A chat's first event, the assistant's role with empty content, is sent only once the
    first token exists, immediately before that token's event, as vLLM does
    (``serving_chat.py``, ``chat_completion_stream_generator``, v0.11.0: the role chunk of
    every choice goes out on the first output of the engine, which V1 makes when the
    first token is sampled). So a client that takes its first chunk as the first token
    (``vllm bench serve --backend openai-chat``) measures the real time to first token."""
    streams = [streams] if isinstance(streams, RequestStream) else list(streams)
    rid = rid or streams[0].request_id
    created, chat, model = int(time.time()), req.chat, req.model
    llm = engine.engine
    n = max(req.n, 1)
    sent_chars = [0] * len(streams)
    sent_tokens = [0] * len(streams)
    ids_wanted = req.return_token_ids
    prompt_ids = [list(req.all_prompts()[j // n]) if ids_wanted else None for j in range(len(streams))]
    cut_after = faults.cut_after() if faults is not None else None

    def first_ids(j: int) -> list[int] | None:
        """The prompt's ids, once per choice (in its first chunk)."""
        ids, prompt_ids[j] = prompt_ids[j], None
        return ids

    def prompt_tokens(j: int) -> int:
        return streams[j].num_prompt_tokens

    def running_usage(j: int) -> dict | None:
        return usage(prompt_tokens(j), sent_tokens[j]) if req.continuous_usage else None

    try:
        first = True
        async for j, delta in merged(streams):
            if delta.error:
                yield sse_event(APIError(500, delta.error, type="server_error").body())
                break
            if first and chat:
                for i in range(len(streams)):
                    yield sse_event(chunk(rid, model, created, chat, "", role=True, index=i,
                                          usage_=running_usage(i), prompt_token_ids=first_ids(i),
                                          token_ids=[] if ids_wanted else None))
            first = False
            text = delta.text
            if req.echo and sent_tokens[j] == 0 and sent_chars[j] == 0:
                text = req.prompt_texts[j // n] + text
            lp = format_logprobs(llm, req, delta.token_ids, delta.logprobs, sent_chars[j])
            sent_chars[j] += len(delta.text)
            sent_tokens[j] += len(delta.token_ids)
            if faults is not None and faults.delay_s():
                await asyncio.sleep(faults.delay_s())
            yield sse_event(chunk(rid, model, created, chat, text, delta.finish_reason, index=j, logprobs=lp,
                                  stop_reason=delta.stop_reason, usage_=running_usage(j),
                                  token_ids=list(delta.token_ids) if ids_wanted else None,
                                  prompt_token_ids=first_ids(j)))
            if cut_after is not None and sent_tokens[j] >= cut_after and not delta.finished:
                raise StreamCut(f"injected fault: stream {rid} cut after {sent_tokens[j]} tokens")
        if req.include_usage:
            total_prompt = sum(prompt_tokens(k * n) for k in range(len(streams) // n))
            yield sse_event(chunk(rid, model, created, chat, None,
                                  usage_=usage(total_prompt, sum(len(st.token_ids) for st in streams))))
        yield "data: [DONE]\n\n"
    finally:
        for st in streams:
            if not st.finished:     # the client went away (or shutdown): free its blocks now
                engine.abort(st.request_id)


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

    config = uvicorn_config(app, host, port, state.edge, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout + HARD_SHUTDOWN_MARGIN_S)
    return Server(config)


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
                   help="routes the API key covers: v1 (the /v1 API, /tokenize, /detokenize) or all (also "
                        "/metrics, /docs, /redoc, /openapi.json; /health stays open) (default: v1)")
    add_edge_args(p)
    p.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="answer POST /admin/fault from loopback clients: make this server slow, fail "
                        "requests or cut streams (tests, chapter 29; see minibatch.serving.faults)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--replicas" or a.startswith("--replicas=") for a in argv):
        from minibatch.serving.replicas import main as replicas_main

        return replicas_main(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=["local", "ray"], default="local")
    backend = pre.parse_known_args(argv)[0].backend
    if backend == "ray":             # one Ray Serve deployment of engines (minibatch.cluster.ray_backend)
        from minibatch.cluster import ray_backend
        return ray_backend.main(argv)
    args = make_parser().parse_args(argv)
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine

    try:
        check_edge_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
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
                        hosts, args.max_request_body_bytes, args.read_timeout, max_connections=args.max_connections)
    state.edge.any_ip_host = any_ip
    if args.enable_fault_injection:
        state.faults = FaultInjector()
    raise_open_files_limit()
    server = _make_server(build_app(state), args.host, args.port, state,
                          args.graceful_shutdown_timeout, args.uvicorn_log_level)
    print(f"minibatch: serving {names[0]!r} on http://{args.host}:{args.port} "
          f"(max_num_seqs={config.max_num_seqs}, policy={config.policy}, "
          f"max_concurrent_requests={limit}, allowed hosts: {' '.join(hosts)}"
          f"{' and any IP address' if any_ip else ''})", file=sys.stderr, flush=True)
    server.run()
    state.engine.shutdown()      # idempotent; covers a failed startup where lifespan never ran
    state.pool.shutdown(wait=False, cancel_futures=True)
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
    return 0
