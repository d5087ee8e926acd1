"""``python -m minibatch router``: an OpenAI-compatible HTTP router in front of OpenAI servers.

    python -m minibatch router --upstream http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --policy least_requests --port 8000

The upstreams are any OpenAI-compatible servers (``minibatch serve``, ``vllm serve``). The
router proxies ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed
server-sent events pass through, event by event), answers ``GET /v1/models`` with the union
of its upstreams' models, ``GET /health`` (200 while one upstream is healthy, with every
upstream's state in the body) and ``GET /metrics`` (its own ``minibatch_router_*`` series).

Routing. Each request goes to the upstream that a router class picks
(``minibatch.routing.routers``, ``--policy``; the same classes route in the simulator and on
Ray), among the healthy upstreams that serve the request's model. The class sees one
:class:`~minibatch.routing.ReplicaView` per upstream, built from

- what the router polls from the upstream's Prometheus ``/metrics`` every
  ``--poll-interval`` seconds, under vLLM's names: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (and minibatch's
  ``minibatch:kv_cache_used_blocks`` / ``minibatch:kv_cache_total_blocks`` where present);
- what the router itself has sent: its requests in flight there (the polled numbers lag
  by up to one interval, so a view counts ``max(running + waiting, in flight)`` requests),
  their prompt tokens and blocks, and for ``kv_aware`` the prompt prefixes sent there.

Prompt tokens (for ``prefix_aware`` and ``kv_aware``): a prompt of token ids is used as is.
A text prompt is tokenized with the upstream model's tokenizer when the router can load
it without a download: the embedded ``tiny`` model, a local checkpoint directory, or
``--tokenizer PATH``; otherwise its UTF-8 bytes stand in for tokens (prefix matches then
count bytes, which still finds shared prefixes, only on another scale). A chat request's
"prompt" for routing is its messages as ``role: content`` lines: the upstream's chat
template is not known here, and the same conversation always gives the same text. Other
policies need only a length, which is the UTF-8 byte count of a text prompt (no tokenizing).

Health. A background task checks every upstream's ``/health`` (and reads ``/metrics``) each
interval, under ``--health-timeout``. A failed check, or a connection error on a request,
marks the upstream unhealthy: it gets no requests until a check succeeds again.

Retries and resumption. A request whose upstream fails before the answer's first byte
(connection refused or reset, a 5xx, a 429, or a read timeout) is sent to another healthy
upstream (one not tried by this request if there is one), at most ``--max-attempts``
attempts per request in all, resumptions included. A stream cut after some tokens is
resumed on another upstream: for a completion with ``temperature: 0`` (greedy), the router
asks its upstreams for token ids (vLLM's ``return_token_ids``, vLLM >= 0.10.2, which
minibatch's server speaks too) and re-sends ``prompt`` = the prompt's token ids + the tokens
already produced, ``max_tokens`` reduced by their number, so the client receives exactly the
tokens an uninterrupted stream would have given; when the router has the tokenizer it
detokenizes the resumed part itself, so that a character split across the cut is not lost.
Where that cannot be done (a chat stream, sampling with temperature > 0, an upstream without
token ids) the stream ends with an error event in OpenAI's shape and ``data: [DONE]``,
never a hang. Every upstream read waits at most ``--upstream-timeout`` seconds. Known limit:
a ``stop`` string that spans the cut is not seen by the resuming upstream.

Backpressure. At most ``--max-concurrent-requests`` requests are in flight upstream; up to
``--max-queue`` more wait (at most ``--queue-timeout`` s) for a slot; beyond that the answer
is 429 with ``Retry-After``, in OpenAI's error shape. Bad input (not JSON, a body that is not
an object, ``Content-Type`` not JSON, no ``model``, an unknown model) gets a 4xx naming the
problem and never reaches an upstream.
"""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minibatch.routing import routers
from minibatch.serving.metrics import CONTENT_TYPE_LATEST
from minibatch.serving.protocol import APIError, add_error_handlers
from minibatch.serving.relay import RelayResponse, StreamRelay
from minibatch.serving.upstreams import (  # noqa: F401  (also importable from here)
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_UPSTREAM_TIMEOUT_S,
    RETRY_AFTER_S,
    Admission,
    RouterMetrics,
    Upstream,
    UpstreamFailed,
    UpstreamSet,
    parse_metrics,
)

DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20


@dataclass
class RoutedRequest:
    """What a router class reads of a request (the attributes of ``RequestSpec`` it uses)."""

    prompt_len: int
    max_tokens: int
    prompt_token_ids: list[int] | None
    model: str
    tenant: str | None = None
    request_id: str | None = None

class Tokens:
    """Prompt token ids for routing: a tokenizer the router can load locally, or UTF-8 bytes."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, name: str | None) -> Tokens:
        """The tokenizer of ``name`` if it is ``tiny`` or a local directory, else bytes."""
        if not name:
            return cls(None)
        from minibatch.model.loader import TINY_NAMES, tiny_model_path
        from minibatch.tokenizer import load_tokenizer

        path = tiny_model_path() if name in TINY_NAMES else Path(name).expanduser()
        try:
            return cls(load_tokenizer(path) if path.is_dir() else None)
        except (OSError, ValueError):
            return cls(None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenizer(self):
        if self.tokenizer is None:
            return None
        from minibatch.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer)

@dataclass
class Proxied:
    """One client request as the router handles it."""

    path: str
    chat: bool
    body: dict
    headers: dict
    routed: RoutedRequest
    stream: bool
    tried: set[int] = field(default_factory=set)
    attempts: int = 0                  # upstream attempts so far, retries and resumptions included


class RouterState(UpstreamSet):
    """Upstreams (``upstreams.py``), policy, limits and the HTTP client the endpoints share."""

    def __init__(self, urls: list[str], policy: str = "round_robin", *, max_concurrent: int = 256,
                 max_queue: int = 256, queue_timeout: float = 30.0, max_attempts: int = 3,
                 poll_interval: float = DEFAULT_POLL_INTERVAL_S, health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
                 upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, block_size: int = 16,
                 tokenizer: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        super().__init__(urls, poll_interval=poll_interval, health_timeout=health_timeout,
                         upstream_timeout=upstream_timeout, connect_timeout=connect_timeout)
        self.policy = routers.get(policy)
        self.policy_name = policy
        self.needs_tokens = self.policy.uses_prompt_tokens or policy == "kv_aware"
        self.admission = Admission(max_concurrent, max_queue, queue_timeout)
        self.max_attempts = max_attempts
        self.block_size = block_size
        self.tokenizer_name = tokenizer
        self.tokens: Tokens | None = None
        self.max_body_bytes = max_body_bytes
        self.started = time.monotonic()
        # kv_aware: what was sent where, to estimate each upstream's prefix-cache hit.
        self._sent = {u.index: routers.TokenTree() for u in self.upstreams} if policy == "kv_aware" else {}

    async def start(self) -> None:
        await super().start()
        if self.tokens is None:
            self.tokens = Tokens.for_model(self.tokenizer_name or self.first_model())

    # -- routing ------------------------------------------------------------------------
    def choose(self, req: Proxied) -> Upstream | None:
        """The upstream the policy picks among the healthy ones serving the model that this
        request has not tried yet (if it tried them all: among all the healthy ones)."""
        model = req.routed.model
        healthy = [u for u in self.upstreams if u.healthy and u.serves(model)]
        cands = [u for u in healthy if u.index not in req.tried] or healthy
        if not cands:
            return None
        tokens = req.routed.prompt_token_ids or []
        views = [u.view(self.block_size, self._sent[u.index].match(tokens) if self._sent else 0) for u in cands]
        pos = self.policy.choose(req.routed, views, time.monotonic() - self.started)
        return cands[pos]

    def routed_request(self, body: dict, chat: bool) -> RoutedRequest:
        prompt = body.get("messages") if chat else body.get("prompt")
        if not chat and isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        ids: list[int] | None = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            length = len(ids)
        else:
            if chat and isinstance(prompt, list):
                text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in prompt if isinstance(m, dict))
            else:
                text = prompt if isinstance(prompt, str) else json.dumps(prompt)
            if self.needs_tokens:
                ids = (self.tokens or Tokens()).encode(text)
                length = len(ids)
            else:
                length = len(text.encode("utf-8", "replace"))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        user = body.get("user")
        return RoutedRequest(prompt_len=max(length, 1), max_tokens=max_tokens if isinstance(max_tokens, int) else 16,
                             prompt_token_ids=ids if self.needs_tokens else None, model=body["model"],
                             tenant=user if isinstance(user, str) else None)

    def begin(self, u: Upstream, req: Proxied) -> None:
        n = req.routed.prompt_len
        u.in_flight += 1
        u.routed += 1
        u.in_flight_tokens += n
        u.active_blocks += -(-n // self.block_size)
        if self._sent and req.routed.prompt_token_ids:
            self._sent[u.index].insert(req.routed.prompt_token_ids)
        self.metrics.routed.labels(u.url).inc()

    def end(self, u: Upstream, req: Proxied) -> None:
        n = req.routed.prompt_len
        u.in_flight -= 1
        u.in_flight_tokens -= n
        u.active_blocks -= -(-n // self.block_size)

    async def send(self, req: Proxied, body: dict, on_attempt=None):
        """Open ``body`` on the upstreams the policy picks until one answers (< 500, not 429), at
        most ``max_attempts`` tries. Returns ``(upstream, response)``; raises an APIError if none does."""
        last: UpstreamFailed | None = None
        first = True
        while req.attempts < self.max_attempts:
            u = self.choose(req)
            if u is None:
                break
            req.tried.add(u.index)
            req.attempts += 1
            if not first and on_attempt is not None:
                on_attempt()
            first = False
            self.begin(u, req)
            try:
                return u, await self.open(u, req, body)
            except UpstreamFailed as e:
                self.end(u, req)
                self.failed(u, e)
                last = e
        raise self.no_upstream(req, last)

    def no_upstream(self, req: Proxied, last: UpstreamFailed | None) -> APIError:
        if last is None:
            self.metrics.rejected.labels("no_upstream").inc()
            return APIError(503, f"no healthy upstream serves the model {req.routed.model!r}; retry later",
                            type="server_error",
                            code="no_healthy_upstream", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.metrics.rejected.labels("upstream_failed").inc()
        if last.status == 429 and last.body:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return APIError(429, json.loads(last.body)["error"]["message"], type="rate_limit_error",
                                code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        return APIError(502, f"every attempt failed ({req.attempts} on {len(req.tried)} upstreams, "
                             f"--max-attempts {self.max_attempts}); the last: {last}",
                        type="server_error", code="upstream_failed")


# -- the app ---------------------------------------------------------------------------------
def build_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        yield
        await state.stop()

    app = FastAPI(title="minibatch router", lifespan=lifespan)
    app.state.router = state

    add_error_handlers(app, "router")

    @app.get("/health")
    async def health():
        ok = any(u.healthy for u in state.upstreams)
        return JSONResponse({"status": "ok" if ok else "unavailable", "policy": state.policy_name,
                             "upstreams": [u.describe() for u in state.upstreams]}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(state), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                            "owned_by": "minibatch-router"} for m in state.known_models()]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await proxy(request, chat=True)

    def invalid(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> APIError:
        state.metrics.rejected.labels("invalid").inc()
        return APIError(status, message, param=param, code=code)

    async def read_json(request: Request) -> dict:
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise invalid(f"Content-Type must be application/json, got {ctype[:100]!r}", 415,
                          code="unsupported_media_type")
        raw = b""
        async for piece in request.stream():
            raw += piece
            if len(raw) > state.max_body_bytes:
                raise invalid(f"the request body is larger than the router's limit of {state.max_body_bytes} "
                              "bytes", 413, code="request_too_large")
        try:
            body = json.loads(raw)
        except RecursionError:
            raise invalid("the request body is nested too deeply to parse") from None
        except ValueError as e:
            raise invalid(f"the request body is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise invalid("'model' is required", param="model")
        if not isinstance(model, str):
            raise invalid(f"'model' must be a string, got {type(model).__name__}", param="model")
        known = state.known_models(healthy_only=False)     # a model whose upstreams are down: 503 later
        if known and model not in known:
            raise invalid(f"the model {model!r} does not exist; the upstreams serve {known}", 404,
                          param="model", code="model_not_found")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise invalid(f"'stream' must be a boolean, got {type(body['stream']).__name__}", param="stream")
        return body

    async def proxy(request: Request, chat: bool):
        body = await read_json(request)
        headers = {"Content-Type": "application/json"}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        req = Proxied(path=request.url.path, chat=chat, body=body, headers=headers,
                      routed=state.routed_request(body, chat), stream=bool(body.get("stream")))
        try:
            await state.admission.acquire()
        except APIError:
            state.metrics.rejected.labels("overload").inc()
            raise
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await state.admission.release()

        try:
            if req.stream:
                return await proxy_stream(req, release)
            return await proxy_whole(req)
        finally:
            if not req.stream:
                await release()

    async def proxy_whole(req: Proxied):
        """A non-streamed answer: retried elsewhere until one upstream gives a whole response."""
        def retried():
            state.metrics.retries.labels("retry").inc()

        while True:
            u, resp = await state.send(req, req.body, retried)
            try:
                data = await resp.read()
            except asyncio.TimeoutError:
                state.failed(u, UpstreamFailed("timeout", f"{u.url} did not finish its answer in time"))
                continue
            except (aiohttp.ClientError, OSError) as e:
                state.failed(u, UpstreamFailed("stream_cut", f"{u.url} cut its answer: {e}"))
                continue
            finally:
                resp.release()
                state.end(u, req)
            ctype = resp.headers.get("Content-Type", "application/json")
            return Response(data, status_code=resp.status, media_type=ctype.split(";")[0])

    async def proxy_stream(req: Proxied, release):
        client_wants_ids = bool(req.body.get("return_token_ids"))
        if not req.chat and not client_wants_ids:         # ask for token ids: a cut stream can resume
            req.body = dict(req.body, return_token_ids=True)

        def retried():
            state.metrics.retries.labels("retry").inc()

        try:
            u, resp = await state.send(req, req.body, retried)
        except APIError:
            await release()
            raise
        if resp.status != 200:                       # a 4xx: the client's mistake, passed through
            try:
                data = await resp.read()
            finally:
                resp.release()
                state.end(u, req)
                await release()
            return Response(data, status_code=resp.status, media_type="application/json")
        relay = StreamRelay(state, req, u, resp)
        relay.want_ids = client_wants_ids

        async def on_close():
            relay.close_attempt()
            await release()

        return RelayResponse(relay.events(), on_close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    return app


# -- command line -----------------------------------------------------------------------------
def add_router_args(p: argparse.ArgumentParser, upstreams: bool = True) -> None:
    if upstreams:
        p.add_argument("--upstream", nargs="+", required=True, metavar="URL",
                       help="base URLs of the OpenAI-compatible servers (http://host:port)")
    p.add_argument("--policy", default="least_requests", choices=routers.available(),
                   help="router class from minibatch.routing.routers (default: least_requests)")
    p.add_argument("--max-concurrent-requests", type=int, default=256,
                   help="requests in flight upstream before queueing (default: 256)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 429")
    p.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait for a slot")
    p.add_argument("--max-attempts", type=int, default=3, help="upstream attempts per request, retries and resumptions included (default: 3)")
    p.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S,
                   help="seconds between health and /metrics polls of each upstream")
    p.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S)
    p.add_argument("--upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT_S,
                   help="seconds an upstream may stay silent during an answer")
    p.add_argument("--tokenizer", default=None,
                   help="'tiny' or a local tokenizer directory for prompt tokens (default: the upstreams' "
                        "model if it is 'tiny' or a local directory, else UTF-8 bytes)")
    p.add_argument("--router-block-size", type=int, default=16, help="KV block size assumed for kv_aware")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch router",
                                description="An OpenAI-compatible HTTP router in front of OpenAI servers.")
    add_router_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def state_from_args(args: argparse.Namespace, upstreams: list[str]) -> RouterState:
    for name in ("max_concurrent_requests", "max_attempts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    for name in ("poll_interval", "health_timeout", "upstream_timeout", "queue_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    return RouterState(upstreams, args.policy, max_concurrent=args.max_concurrent_requests,
                       max_queue=args.max_queue, queue_timeout=args.queue_timeout, max_attempts=args.max_attempts,
                       poll_interval=args.poll_interval, health_timeout=args.health_timeout,
                       upstream_timeout=args.upstream_timeout, block_size=args.router_block_size,
                       tokenizer=args.tokenizer)


def make_server(state: RouterState, host: str, port: int, log_level: str = "warning"):
    import uvicorn

    config = uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                            timeout_graceful_shutdown=10)
    return uvicorn.Server(config)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        state = state_from_args(args, args.upstream)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"minibatch router: {args.policy} over {' '.join(u.url for u in state.upstreams)} on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    make_server(state, args.host, args.port, args.uvicorn_log_level).run()
    return 0
