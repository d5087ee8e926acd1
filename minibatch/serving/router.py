"""``python -m minibatch router``: an OpenAI-compatible HTTP router in front of OpenAI servers.

    python -m minibatch router --upstream http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --policy least_requests --port 8000

The upstreams are any OpenAI-compatible servers (``minibatch serve``, ``vllm serve``). The
router proxies ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed
server-sent events pass through, event by event), answers ``GET /v1/models`` with the union
of its upstreams' models, ``GET /health`` (200 while one upstream is healthy; every
upstream's state in the body only for a caller with the API key, or when there is none)
and ``GET /metrics`` (its own ``minibatch_router_*`` series). This module holds the app and
the command line; its parts are ``upstreams.py`` (health, polled load, admission),
``relay.py`` (streams passed through and resumed), ``routed.py`` (what a router class reads
of a request) and ``edge.py`` (the checks every request meets first, shared with the server).

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

Prompt tokens for ``prefix_aware`` and ``kv_aware``: ``routed.py`` (a text prompt is tokenized
off the event loop, at most its first ``--routing-prefix-chars`` characters).

Health. A background task checks every upstream's ``/health`` (and reads ``/metrics``) each
interval, under ``--health-timeout``, with ``--upstream-api-key`` if given. A failed check,
or a connection error or a stall on a request, marks the upstream unhealthy: it gets no
requests until a check succeeds again.

Retries and resumption. A request whose upstream fails before the answer's first byte
(connection refused or reset, a 5xx, a 429, or a read timeout) is sent to another healthy
upstream (one not tried by this request if there is one), at most ``--max-attempts``
attempts per request (per choice, once a stream's choices continue apart), resumptions
included. A stream cut after some tokens is resumed on other upstreams, choice by choice
(``relay.py``): for a completion with ``temperature: 0`` (greedy), the router asks its
upstreams for token ids (vLLM's ``return_token_ids``, vLLM >= 0.10.2, which minibatch's
server speaks too) and re-sends each unfinished choice with ``prompt`` = its prompt's token
ids + the tokens already produced, ``max_tokens`` reduced by their number and ``echo`` off,
so the client receives exactly the tokens an uninterrupted stream would have given. Where
that cannot be done (a chat stream, sampling with temperature > 0, an upstream without token
ids) the stream ends with an error event in OpenAI's shape and ``data: [DONE]``, never a
hang and never a silently short answer. Known limit: a ``stop`` string that spans the cut is
not seen by the resuming upstream.

Stalls. A stream whose upstream sends no event for ``--first-token-timeout`` seconds (before
its first event) or ``--inter-token-timeout`` seconds (after it) is cut, its upstream marked
unhealthy, and it is resumed or retried as above. A non-streamed request whose upstream has
failed every health check for ``--inter-token-timeout`` seconds is sent to another upstream
(nothing has reached the client yet); ``--upstream-timeout`` bounds a whole non-streamed
answer. Defaults and their reasons: ``upstreams.py``.

Clients that leave. A client that disconnects before its (non-streamed or streamed) answer
is complete has its upstream request cancelled: the router closes that connection, and the
upstream (``minibatch serve``, vLLM) aborts the request and frees its KV blocks.

Flow control (``--flow-control``, off by default; ``flow.py``). Requests wait at the router by
priority band (``X-Minibatch-Priority`` header or ``priority``) and tenant
(``X-Gateway-Inference-Fairness-Id`` header or ``user``), fair across tenants within a band,
until an upstream has room (fewer than ``--flow-max-requests-per-upstream`` requests running +
waiting, from its polled load and this router's own in-flight count); the policy then chooses
among the upstreams with room (llm-d's flow controller, ``minibatch.cluster.flow_control``).

Backpressure. At most ``--max-concurrent-requests`` requests are in flight upstream; up to
``--max-queue`` more wait (at most ``--queue-timeout`` s) for a slot; beyond that the answer
is 429 with ``Retry-After``, in OpenAI's error shape. Bad input (not JSON, a body that is not
an object, text that is not valid Unicode, ``Content-Type`` not JSON, no ``model``, an
unknown model) gets a 4xx naming the problem and never reaches an upstream.

The edge (``edge.py``, the server's rules and option names): ``--allowed-hosts`` (the Host
allow-list against DNS rebinding), ``--api-key`` / ``--api-key-scope`` (``v1``: the ``/v1``
routes; ``all``: every route but ``/health``), ``--max-request-body-bytes``,
``--read-timeout`` (request headers and body), ``--max-connections``. The router forwards the
client's ``Authorization`` header upstream unless ``--upstream-api-key`` is given, which then
replaces it (and authenticates the polls).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minibatch.config import env
from minibatch.routing import routers
from minibatch.serving.edge import (
    Edge,
    Guard,
    add_edge_args,
    check_edge_args,
    edge_from_args,
    raise_open_files_limit,
    uvicorn_config,
)
from minibatch.serving.metrics import CONTENT_TYPE_LATEST
from minibatch.serving.openai import load_body
from minibatch.serving.protocol import APIError, add_error_handlers
from minibatch.serving.relay import RelayResponse, StreamRelay
from minibatch.serving.routed import DEFAULT_ROUTING_PREFIX_CHARS, RoutedRequest, RoutingPrompts, Tokens
from minibatch.serving.upstreams import (  # noqa: F401  (also importable from here)
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_FIRST_TOKEN_TIMEOUT_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_INTER_TOKEN_TIMEOUT_S,
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

DISCONNECT_POLL_S = 0.25   # how often a non-streamed request checks its client and its upstream's health


class ClientGone(Exception):
    """The client of a non-streamed request disconnected before its answer."""


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
    current: Upstream | None = None    # the upstream of the latest attempt
    pinned: Upstream | None = None     # flow control released it to this upstream (its first attempt goes there)


class RouterState(UpstreamSet):
    """Upstreams (``upstreams.py``), policy, limits, the edge and the HTTP client the endpoints share."""

    def __init__(self, urls: list[str], policy: str = "round_robin", *, max_concurrent: int = 256,
                 max_queue: int = 256, queue_timeout: float = 30.0, max_attempts: int = 3,
                 poll_interval: float = DEFAULT_POLL_INTERVAL_S, health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
                 upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, block_size: int = 16,
                 tokenizer: str | None = None, edge: Edge | None = None,
                 first_token_timeout: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                 inter_token_timeout: float = DEFAULT_INTER_TOKEN_TIMEOUT_S, upstream_api_key: str | None = None,
                 routing_prefix_chars: int = DEFAULT_ROUTING_PREFIX_CHARS, flow_control=None):
        super().__init__(urls, poll_interval=poll_interval, health_timeout=health_timeout,
                         upstream_timeout=upstream_timeout, connect_timeout=connect_timeout,
                         first_token_timeout=first_token_timeout, inter_token_timeout=inter_token_timeout,
                         upstream_api_key=upstream_api_key)
        self.policy = routers.get(policy)
        self.policy_name = policy
        self.needs_tokens = self.policy.uses_prompt_tokens or policy == "kv_aware"
        self.prompts = RoutingPrompts(self.needs_tokens, routing_prefix_chars)
        self.admission = Admission(max_concurrent, max_queue, queue_timeout)
        self.max_attempts = max_attempts
        self.block_size = block_size
        self.tokenizer_name = tokenizer
        self.edge = edge if edge is not None else Edge(what="router")
        self.edge.what = "router"
        self.edge.count = lambda reason: self.metrics.rejected.labels(reason).inc()
        self.started = time.monotonic()
        # kv_aware: what was sent where, to estimate each upstream's prefix-cache hit.
        self._sent = {u.index: routers.TokenTree() for u in self.upstreams} if policy == "kv_aware" else {}
        # --flow-control: requests held here by band and tenant until an upstream has room (flow.py).
        self.flow = None
        if flow_control is not None:
            from minibatch.serving.flow import FlowGate
            self.flow = FlowGate(self, flow_control)

    @property
    def tokens(self) -> Tokens | None:
        """The routing tokenizer (:class:`~minibatch.serving.routed.Tokens`), once started."""
        return self.prompts.tokens

    @tokens.setter
    def tokens(self, value: Tokens | None) -> None:
        self.prompts.tokens = value

    async def start(self) -> None:
        await super().start()
        if self.tokens is None:
            self.tokens = Tokens.for_model(self.tokenizer_name or self.first_model())

    async def stop(self) -> None:
        await super().stop()
        self.prompts.close()

    async def routed_request(self, body: dict, chat: bool) -> RoutedRequest:
        """What the policy reads of this request (``routed.py``)."""
        return await self.prompts.routed(body, chat)

    # -- routing ------------------------------------------------------------------------
    def after_poll(self) -> None:
        if self.flow is not None:
            self.flow.pump()                 # fresh load: an upstream may have room now

    def choose(self, req: Proxied, among: list[Upstream] | None = None) -> Upstream | None:
        """The upstream the policy picks among the healthy ones serving the model that this
        request has not tried yet (if it tried them all: among all the healthy ones), or among
        ``among`` (flow control: the upstreams with room)."""
        model = req.routed.model
        healthy = [u for u in self.upstreams if u.healthy and u.serves(model)]
        cands = among if among is not None else [u for u in healthy if u.index not in req.tried] or healthy
        if not cands:
            return None
        tokens = req.routed.prompt_token_ids or []
        views = [u.view(self.block_size, self._sent[u.index].match(tokens) if self._sent else 0) for u in cands]
        pos = self.policy.choose(req.routed, views, time.monotonic() - self.started)
        return cands[pos]

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
        if self.flow is not None:
            self.flow.pump()                 # its place is free: a held request may go

    async def send(self, req: Proxied, body: dict, on_attempt=None):
        """Open ``body`` on the upstreams the policy picks until one answers (< 500, not 429), at
        most ``max_attempts`` tries. Returns ``(upstream, response)``; raises an APIError if none does."""
        last: UpstreamFailed | None = None
        first = True
        while req.attempts < self.max_attempts:
            pinned, req.pinned = req.pinned, None
            if pinned is not None and self.flow is not None:
                self.flow.unreserve(pinned)
            u = pinned if pinned is not None and pinned.healthy else self.choose(req)
            if u is None:
                break
            req.tried.add(u.index)
            req.attempts += 1
            if not first and on_attempt is not None:
                on_attempt()
            first = False
            self.begin(u, req)
            req.current = u
            try:
                resp = await self.open(u, req, body)
            except UpstreamFailed as e:
                self.end(u, req)
                self.failed(u, e)
                last = e
                continue
            except BaseException:            # cancelled (a client gone, a stall): not in flight any more
                self.end(u, req)
                raise
            return u, resp
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
    app.add_middleware(Guard, edge=state.edge)

    add_error_handlers(app, "router")

    @app.get("/health")
    async def health(request: Request):
        """200 while an upstream is healthy. The upstreams' URLs and states only for a caller
        with the API key (or when there is none): they name internal addresses."""
        ok = any(u.healthy for u in state.upstreams)
        body: dict = {"status": "ok" if ok else "unavailable"}
        if state.edge.authenticated(request.headers.get("authorization")):
            body.update(policy=state.policy_name, upstreams=[u.describe() for u in state.upstreams])
        return JSONResponse(body, status_code=200 if ok else 503)

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
        """The body (the edge's size and time limits; ``Content-Type`` was checked by the Guard),
        parsed and checked as far as routing needs: JSON, valid Unicode, an object, a known model."""
        raw = await state.edge.read_body(request)
        try:
            body = load_body(raw)
        except APIError:
            state.metrics.rejected.labels("invalid").inc()
            raise
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
        if state.upstream_api_key:
            headers["Authorization"] = f"Bearer {state.upstream_api_key}"
        elif "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        req = Proxied(path=request.url.path, chat=chat, body=body, headers=headers,
                      routed=await state.routed_request(body, chat), stream=bool(body.get("stream")))
        if state.flow is not None:
            from minibatch.serving.flow import band_and_flow
            band, flow = band_and_flow(request.headers, body)
            await state.flow.wait(req, band, flow)      # held here until an upstream has room
        try:
            await state.admission.acquire()
        except APIError:
            state.metrics.rejected.labels("overload").inc()
            if req.pinned is not None and state.flow is not None:
                state.flow.unreserve(req.pinned)
                req.pinned = None
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
            return await proxy_whole(req, request)
        finally:
            if not req.stream:
                await release()

    async def proxy_whole(req: Proxied, request: Request):
        """A non-streamed answer: retried elsewhere until one upstream gives a whole response;
        cancelled upstream if the client leaves; moved elsewhere if its upstream stalls."""
        def retried():
            state.metrics.retries.labels("retry").inc()

        while True:
            attempt = asyncio.ensure_future(whole_attempt(req, retried))
            try:
                status, ctype, data = await watch(attempt, req, request)
            except ClientGone:
                state.metrics.abandoned.inc()
                return Response(status_code=499)      # nobody reads it (nginx's "client closed request")
            except UpstreamFailed as e:
                state.failed(e.upstream, e)
                continue
            return Response(data, status_code=status, media_type=ctype.split(";")[0])

    async def whole_attempt(req: Proxied, retried) -> tuple[int, str, bytes]:
        u, resp = await state.send(req, req.body, retried)
        ok = False
        try:
            data = await resp.read()
            ok = True
        except asyncio.TimeoutError:
            raise _failed(u, "timeout", f"{u.url} did not finish its answer in time") from None
        except (aiohttp.ClientError, OSError) as e:
            raise _failed(u, "stream_cut", f"{u.url} cut its answer: {e}") from None
        finally:
            if ok:
                resp.release()
            else:
                resp.close()                 # also when cancelled: the upstream sees it and aborts
            state.end(u, req)
        return resp.status, resp.headers.get("Content-Type", "application/json"), data

    async def watch(attempt: asyncio.Future, req: Proxied, request: Request):
        """``attempt``'s result, unless the client leaves (:class:`ClientGone`) or the upstream it
        waits on stalls (:class:`UpstreamFailed`) first; then ``attempt`` is cancelled."""
        try:
            while True:
                await asyncio.wait({attempt}, timeout=DISCONNECT_POLL_S)
                if attempt.done():
                    return attempt.result()
                if await request.is_disconnected():
                    raise ClientGone
                u = req.current
                if u is not None and state.stalled(u):
                    raise _failed(u, "stall", f"{u.url} failed every health check for "
                                              f"{state.inter_token_timeout:g} s (--inter-token-timeout)")
        finally:
            if not attempt.done():
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await attempt

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
            relay.close()
            await release()

        return RelayResponse(relay.events(), on_close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    return app


def _failed(u: Upstream, kind: str, message: str) -> UpstreamFailed:
    e = UpstreamFailed(kind, message)
    e.upstream = u
    return e


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
    p.add_argument("--max-attempts", type=int, default=3,
                   help="upstream attempts per request (per choice once a stream's choices continue apart), "
                        "retries and resumptions included (default: 3)")
    p.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_INTERVAL_S,
                   help="seconds between health and /metrics polls of each upstream")
    p.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S)
    p.add_argument("--upstream-timeout", type=float, default=DEFAULT_UPSTREAM_TIMEOUT_S,
                   help="seconds a non-streamed answer may take upstream")
    p.add_argument("--first-token-timeout", type=float, default=DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                   help="seconds a stream may wait for its first event before it is retried elsewhere "
                        f"(default: {DEFAULT_FIRST_TOKEN_TIMEOUT_S:g})")
    p.add_argument("--inter-token-timeout", type=float, default=DEFAULT_INTER_TOKEN_TIMEOUT_S,
                   help="seconds a stream may wait between events, and a non-streamed request's upstream may "
                        f"fail its health checks, before the request moves elsewhere "
                        f"(default: {DEFAULT_INTER_TOKEN_TIMEOUT_S:g})")
    p.add_argument("--tokenizer", default=None,
                   help="'tiny' or a local tokenizer directory for prompt tokens (default: the upstreams' "
                        "model if it is 'tiny' or a local directory, else UTF-8 bytes)")
    p.add_argument("--routing-prefix-chars", type=int, default=DEFAULT_ROUTING_PREFIX_CHARS,
                   help="characters of a text prompt tokenized for prefix_aware / kv_aware "
                        f"(default: {DEFAULT_ROUTING_PREFIX_CHARS})")
    p.add_argument("--router-block-size", type=int, default=16, help="KV block size assumed for kv_aware")
    g = p.add_argument_group("flow control (minibatch/serving/flow.py; llm-d's flow controller)")
    g.add_argument("--flow-control", action="store_true",
                   help="hold requests at the router by priority band (X-Minibatch-Priority header or 'priority') "
                        "and tenant (X-Gateway-Inference-Fairness-Id header or 'user') until an upstream has room")
    g.add_argument("--flow-max-requests-per-upstream", type=int, default=8,
                   help="an upstream has room while its running + waiting requests are fewer (default: 8)")
    g.add_argument("--flow-max-kv-usage", type=float, default=None,
                   help="and while its polled KV cache usage is below this fraction (default: not used)")
    g.add_argument("--flow-fairness", choices=["round_robin", "fcfs"], default="round_robin",
                   help="between the tenants of one band: round_robin (turns) or fcfs (arrival order)")
    g.add_argument("--flow-queue-timeout", type=float, default=None,
                   help="seconds a request may be held before a 429 (default: no limit)")
    g.add_argument("--flow-max-queued", type=int, default=None,
                   help="requests held at once; beyond, a 429 (default: no limit)")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch router",
                                description="An OpenAI-compatible HTTP router in front of OpenAI servers.")
    add_router_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=env("MINIBATCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MINIBATCH_API_KEY)")
    p.add_argument("--api-key-scope", choices=["v1", "all"], default="v1",
                   help="routes the API key covers: v1 (the /v1 API) or all (also /metrics, /docs, /redoc, "
                        "/openapi.json; /health stays open, its details only with the key) (default: v1)")
    p.add_argument("--upstream-api-key", default=None,
                   help="the key sent to the upstreams, on polls and in place of the client's Authorization "
                        "(default: --api-key)")
    add_edge_args(p)
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    return p


def check_router_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming a bad router option."""
    for name in ("max_concurrent_requests", "max_attempts", "routing_prefix_chars"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if getattr(args, "flow_control", False):
        flow_control_from_args(args)
    for name in ("poll_interval", "health_timeout", "upstream_timeout", "queue_timeout", "first_token_timeout",
                 "inter_token_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")


def flow_control_from_args(args: argparse.Namespace):
    """The ``FlowControl`` of ``--flow-control`` (None without it); ``ValueError`` naming a bad option."""
    if not getattr(args, "flow_control", False):
        return None
    from minibatch.cluster.flow_control import FlowControl

    names = {"max_requests_per_replica": "--flow-max-requests-per-upstream", "max_kv_usage": "--flow-max-kv-usage",
             "fairness": "--flow-fairness", "queue_timeout_s": "--flow-queue-timeout",
             "max_queued": "--flow-max-queued"}
    try:
        return FlowControl(max_requests_per_replica=args.flow_max_requests_per_upstream,
                           max_kv_usage=args.flow_max_kv_usage, fairness=args.flow_fairness,
                           queue_timeout_s=args.flow_queue_timeout, max_queued=args.flow_max_queued)
    except ValueError as e:
        msg = str(e)
        for field, option in names.items():
            msg = msg.replace(f"FlowControl.{field}", option)
        raise ValueError(msg) from None


def state_from_args(args: argparse.Namespace, upstreams: list[str]) -> RouterState:
    check_router_args(args)
    check_edge_args(args)
    edge = edge_from_args(args, args.api_key, args.api_key_scope, "router")
    return RouterState(upstreams, args.policy, max_concurrent=args.max_concurrent_requests,
                       max_queue=args.max_queue, queue_timeout=args.queue_timeout, max_attempts=args.max_attempts,
                       poll_interval=args.poll_interval, health_timeout=args.health_timeout,
                       upstream_timeout=args.upstream_timeout, block_size=args.router_block_size,
                       tokenizer=args.tokenizer, edge=edge, first_token_timeout=args.first_token_timeout,
                       inter_token_timeout=args.inter_token_timeout,
                       upstream_api_key=args.upstream_api_key or args.api_key,
                       routing_prefix_chars=args.routing_prefix_chars, flow_control=flow_control_from_args(args))


def make_server(state: RouterState, host: str, port: int, log_level: str = "warning"):
    import uvicorn

    raise_open_files_limit()
    return uvicorn.Server(uvicorn_config(build_app(state), host, port, state.edge, log_level=log_level,
                                         timeout_graceful_shutdown=10))


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        state = state_from_args(args, args.upstream)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"minibatch router: {args.policy} over {' '.join(u.url for u in state.upstreams)} on "
          f"http://{args.host}:{args.port} (allowed hosts: {' '.join(sorted(state.edge.allowed_hosts))}"
          f"{' and any IP address' if state.edge.any_ip_host else ''})", file=sys.stderr, flush=True)
    make_server(state, args.host, args.port, args.uvicorn_log_level).run()
    return 0
