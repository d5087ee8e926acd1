"""``python -m minibatch serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

    python -m minibatch serve --model tiny --port 8000 --max-num-seqs 64
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "Once upon a time", "max_tokens": 32}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with
``"stream": true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). One :class:`AsyncEngine` thread
batches every connection's requests together; each token reaches its client as soon as
the step that made it ends.

Flow control: at most ``--max-concurrent-requests`` generations are in flight; the next
one gets 429 at once instead of waiting in an unbounded queue. A client that disconnects
is aborted and its KV blocks are freed. On SIGTERM (or Ctrl-C) the server stops
accepting connections, lets in-flight requests finish for up to
``--graceful-shutdown-timeout`` seconds, then aborts the rest (their streams end with
``finish_reason: "abort"`` and ``[DONE]``), and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import signal
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minibatch.config import add_engine_args, engine_kwargs, env
from minibatch.serving.async_engine import AsyncEngine, RequestStream
from minibatch.serving.protocol import APIError, GenerationRequest, chunk, parse_request, response, usage
from minibatch.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics

DISCONNECT_POLL_S = 0.5    # how often a non-streaming request checks that its client is still there
HARD_SHUTDOWN_MARGIN_S = 5.0   # after the graceful timeout and the aborts, uvicorn cuts what is left


class ServerState:
    """What the endpoints share: the engine, the served names, the limits, the draining flag."""

    def __init__(self, engine: AsyncEngine, served_names: list[str], max_concurrent_requests: int,
                 api_key: str | None):
        self.engine = engine
        self.metrics: ServingMetrics = engine.metrics
        self.served_names = served_names
        self.max_concurrent_requests = max_concurrent_requests
        self.api_key = api_key
        self.draining = False


def build_app(state: ServerState):
    """The FastAPI app serving ``state.engine``; shutting the app down stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.engine.shutdown()

    app = FastAPI(title="minibatch", lifespan=lifespan)
    app.state.minibatch = state
    engine = state.engine

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {state.api_key}".encode()):
            state.metrics.count_http_rejection("unauthorized")
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if state.draining or not engine.is_alive:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(engine.gauges, engine.num_in_flight)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "minibatch",
             "root": engine.engine.config.model, "max_model_len": engine.engine.max_model_len}
            for name in state.served_names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool):
        check_auth(request)
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error")
        try:
            body = json.loads(await request.body())
            req = parse_request(body, chat, engine.engine.tokenizer, engine.engine.max_model_len)
        except (ValueError, APIError) as e:
            state.metrics.count_http_rejection("invalid")
            if isinstance(e, APIError):
                raise
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        model = req.model or state.served_names[0]
        if model not in state.served_names:
            state.metrics.count_http_rejection("invalid")
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{state.served_names}", param="model", code="model_not_found")
        if engine.num_in_flight >= state.max_concurrent_requests:
            state.metrics.count_http_rejection("overload")
            raise APIError(429, f"the server is at its limit of {state.max_concurrent_requests} "
                                "concurrent requests; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = await engine.add_request(req.prompt, req.params, rid)
        except ValueError as e:
            state.metrics.count_http_rejection("invalid")
            msg = str(e)
            raise APIError(400, msg, param="prompt" if "prompt" in msg else None) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if req.stream:
            return StreamingResponse(sse(stream, req, model), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await wait_or_abort(stream, request)
        if stream.error:
            raise APIError(500, stream.error, type="server_error")
        return response(rid, model, chat, stream.text, stream.finish_reason, stream.stop_reason,
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

    async def sse(stream: RequestStream, req: GenerationRequest, model: str):
        """Server-sent events: one OpenAI chunk per engine update, then ``[DONE]``."""
        rid, created, chat = stream.request_id, int(time.time()), req.chat

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

        try:
            if chat:
                yield event(chunk(rid, model, created, chat, "", role=True))
            async for delta in stream:
                if delta.error:
                    yield event(APIError(500, delta.error, type="server_error").body())
                    break
                yield event(chunk(rid, model, created, chat, delta.text, delta.finish_reason))
            if req.include_usage:
                yield event(chunk(rid, model, created, chat, None,
                                  usage_=usage(stream.num_prompt_tokens, len(stream.token_ids))))
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:     # the client went away (or shutdown): free its blocks now
                engine.abort(rid)

    return app


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

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout + HARD_SHUTDOWN_MARGIN_S,
                            timeout_keep_alive=5)
    return Server(config)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch serve",
                                description="Serve a model over the OpenAI HTTP API.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: --model)")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="requests in flight before answering 429 (default: max(256, 4 x max_num_seqs))")
    p.add_argument("--api-key", default=env("MINIBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MINIBATCH_API_KEY)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from minibatch.config import EngineConfig
    from minibatch.engine import LLMEngine

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
    metrics = ServingMetrics(names[0], llm_engine.max_model_len)
    state = ServerState(AsyncEngine(llm_engine, metrics), names, limit, args.api_key)
    server = _make_server(build_app(state), args.host, args.port, state,
                          args.graceful_shutdown_timeout, args.uvicorn_log_level)
    print(f"minibatch: serving {names[0]!r} on http://{args.host}:{args.port} "
          f"(max_num_seqs={config.max_num_seqs}, policy={config.policy}, "
          f"max_concurrent_requests={limit})", file=sys.stderr, flush=True)
    server.run()
    state.engine.shutdown()      # idempotent; covers a failed startup where lifespan never ran
    return 0
