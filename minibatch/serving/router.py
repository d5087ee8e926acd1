"""``python -m minibatch router``: an OpenAI-compatible HTTP router in front of OpenAI servers.

    python -m minibatch router --upstream http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --policy least_requests --port 8000

The upstreams are any OpenAI-compatible servers (``minibatch serve``, ``vllm serve``). The
router proxies ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed
server-sent events pass through, event by event), answers ``GET /v1/models`` with the union
of its upstreams' models, ``GET /health`` (200 while one upstream is healthy, with every
upstream's state in the body) and ``GET /metrics`` (its own ``minibatch_router_*`` series).

Routing. Each request goes to the upstream that the cluster layer's router class picks
(``minibatch.cluster.routers``, ``--policy``; the same classes route in the simulator and on
Ray), among the healthy upstreams that serve the request's model. The class sees one
:class:`~minibatch.cluster.ReplicaView` per upstream, built from

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
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from minibatch.cluster import routers
from minibatch.cluster.replica import ReplicaView
from minibatch.serving.metrics import CONTENT_TYPE_LATEST
from minibatch.serving.protocol import APIError, add_error_handlers

DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_UPSTREAM_TIMEOUT_S = 300.0   # a silent gap (a whole answer, when not streamed)
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
RETRY_AFTER_S = 1
POLLED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "minibatch:kv_cache_used_blocks", "minibatch:kv_cache_total_blocks")
# What a resumed stream's client should not see unless it asked: the ids the router requests.
ID_FIELDS = ("token_ids", "prompt_token_ids")
IDS_RE = re.compile(r',\s*"token_ids"\s*:\s*\[([0-9,\s]*)\]')


class UpstreamFailed(Exception):
    """One attempt on one upstream failed in a way another upstream may not (retry elsewhere)."""

    def __init__(self, kind: str, message: str, status: int | None = None, body: bytes | None = None):
        super().__init__(message)
        self.kind, self.status, self.body = kind, status, body


@dataclass
class Upstream:
    """One upstream server: its health, its polled load and what this router has sent it."""

    index: int
    url: str
    healthy: bool = False
    error: str | None = "not checked yet"
    models: list[str] | None = None    # ids from its /v1/models (None: not known yet)
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    in_flight: int = 0                 # this router's requests there, not finished
    in_flight_tokens: int = 0
    active_blocks: int = 0
    routed: int = 0
    last_poll: float = 0.0

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def view(self, block_size: int, cached: int = 0) -> ReplicaView:
        # The polled counts lag by up to a poll interval; this router's own requests do not.
        unseen = max(self.in_flight - (self.num_running + self.num_waiting), 0)
        total = self.kv_blocks_total or 1000
        used = self.kv_blocks_used if self.kv_blocks_used is not None else round(self.kv_usage * total)
        return ReplicaView(index=self.index, model=(self.models or [""])[0], num_running=self.num_running,
                           num_waiting=self.num_waiting + unseen,
                           kv_blocks_used=used, kv_blocks_total=total, block_size=block_size,
                           in_flight_tokens=self.in_flight_tokens, active_blocks=self.active_blocks,
                           cached_prefix_tokens=cached, num_routed=self.routed)

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "error": self.error, "models": self.models,
                "in_flight": self.in_flight, "routed": self.routed,
                "num_requests_running": self.num_running, "num_requests_waiting": self.num_waiting,
                "kv_cache_usage_perc": self.kv_usage}


@dataclass
class RoutedRequest:
    """What a router class reads of a request (the attributes of ``RequestSpec`` it uses)."""

    prompt_len: int
    max_tokens: int
    prompt_token_ids: list[int] | None
    model: str
    tenant: str | None = None
    request_id: str | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """The :data:`POLLED` samples of a ``/metrics`` page, summed over their labels. Only those
    lines go through ``prometheus_client``'s parser (a vLLM page holds hundreds of others)."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = [ln for ln in text.splitlines() if ln.startswith(POLLED)]
    out: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in family.samples:
            if s.name in POLLED and math.isfinite(s.value):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class RouterMetrics:
    """The router's own Prometheus series, in a registry of their own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.routed = Counter("minibatch_router_requests_routed", "Attempts sent to each upstream",
                              ["upstream"], registry=r)
        self.errors = Counter("minibatch_router_upstream_errors", "Failed attempts on each upstream, by kind "
                              "(connect, status, timeout, stream_cut)", ["upstream", "kind"], registry=r)
        self.retries = Counter("minibatch_router_retries", "Requests sent again elsewhere: retry (before the "
                               "first token) or resume (a stream cut mid-way)", ["kind"], registry=r)
        self.stream_errors = Counter("minibatch_router_stream_errors", "Streams ended with an error event "
                                     "(could not resume)", registry=r)
        self.rejected = Counter("minibatch_router_rejected", "Requests answered by the router itself, by "
                                "reason (overload, invalid, no_upstream, upstream_failed)", ["reason"], registry=r)
        self.healthy = Gauge("minibatch_router_upstream_healthy", "1 if the upstream is healthy",
                             ["upstream"], registry=r)
        self.up_in_flight = Gauge("minibatch_router_upstream_in_flight", "This router's requests in flight "
                                  "on each upstream", ["upstream"], registry=r)
        self.up_running = Gauge("minibatch_router_upstream_num_requests_running", "Polled "
                                "vllm:num_requests_running of each upstream", ["upstream"], registry=r)
        self.up_waiting = Gauge("minibatch_router_upstream_num_requests_waiting", "Polled "
                                "vllm:num_requests_waiting of each upstream", ["upstream"], registry=r)
        self.up_kv = Gauge("minibatch_router_upstream_kv_cache_usage_perc", "Polled vllm:kv_cache_usage_perc "
                           "of each upstream", ["upstream"], registry=r)
        self.in_flight = Gauge("minibatch_router_requests_in_flight", "Requests holding a slot", registry=r)
        self.queue = Gauge("minibatch_router_queue_length", "Requests waiting for a slot", registry=r)

    def render(self, state: RouterState) -> bytes:
        for u in state.upstreams:
            self.healthy.labels(u.url).set(1 if u.healthy else 0)
            self.up_in_flight.labels(u.url).set(u.in_flight)
            self.up_running.labels(u.url).set(u.num_running)
            self.up_waiting.labels(u.url).set(u.num_waiting)
            self.up_kv.labels(u.url).set(u.kv_usage)
        self.in_flight.set(state.admission.in_flight)
        self.queue.set(state.admission.waiting)
        return generate_latest(self.registry)


class Admission:
    """At most ``max_concurrent`` requests in flight, ``max_queue`` more waiting; 429 beyond."""

    def __init__(self, max_concurrent: int, max_queue: int, queue_timeout: float):
        self.max_concurrent, self.max_queue, self.queue_timeout = max_concurrent, max_queue, queue_timeout
        self.in_flight = 0
        self.waiting = 0
        self._cond: asyncio.Condition | None = None

    def _overloaded(self, why: str) -> APIError:
        return APIError(429, f"the router is at its limit ({why}); retry later", type="rate_limit_error",
                        code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def acquire(self) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self.in_flight < self.max_concurrent and self.waiting == 0:
            self.in_flight += 1
            return
        if self.waiting >= self.max_queue:
            raise self._overloaded(f"{self.max_concurrent} requests in flight and {self.waiting} queued, "
                                   f"--max-queue {self.max_queue}")
        self.waiting += 1
        try:
            async with self._cond:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.in_flight < self.max_concurrent),
                                       self.queue_timeout)
                self.in_flight += 1
        except asyncio.TimeoutError:
            raise self._overloaded(f"no slot freed within --queue-timeout {self.queue_timeout:g} s") from None
        finally:
            self.waiting -= 1

    async def release(self) -> None:
        self.in_flight -= 1
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()       # (one waiter may have timed out meanwhile)


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


class RouterState:
    """Upstreams, policy, limits and the HTTP client the endpoints share."""

    def __init__(self, urls: list[str], policy: str = "round_robin", *, max_concurrent: int = 256,
                 max_queue: int = 256, queue_timeout: float = 30.0, max_attempts: int = 3,
                 poll_interval: float = DEFAULT_POLL_INTERVAL_S, health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
                 upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, block_size: int = 16,
                 tokenizer: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if not urls:
            raise ValueError("the router needs at least one --upstream URL")
        self.upstreams = [Upstream(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.policy = routers.get(policy)
        self.policy_name = policy
        self.needs_tokens = self.policy.uses_prompt_tokens or policy == "kv_aware"
        self.admission = Admission(max_concurrent, max_queue, queue_timeout)
        self.max_attempts = max_attempts
        self.poll_interval, self.health_timeout = poll_interval, health_timeout
        self.upstream_timeout, self.connect_timeout = upstream_timeout, connect_timeout
        self.block_size = block_size
        self.tokenizer_name = tokenizer
        self.tokens: Tokens | None = None
        self.max_body_bytes = max_body_bytes
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.started = time.monotonic()
        self._poller: asyncio.Task | None = None
        # kv_aware: what was sent where, to estimate each upstream's prefix-cache hit.
        self._sent = {u.index: routers.TokenTree() for u in self.upstreams} if policy == "kv_aware" else {}

    # -- life -----------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        await self.poll_all()
        if self.tokens is None:
            self.tokens = Tokens.for_model(self.tokenizer_name or self.first_model())
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.session is not None:
            await self.session.close()

    def first_model(self) -> str | None:
        for u in self.upstreams:
            if u.models:
                return u.models[0]
        return None

    def known_models(self, healthy_only: bool = True) -> list[str]:
        """Model ids the upstreams serve (``healthy_only=False``: also those of upstreams now down)."""
        return list(dict.fromkeys(m for u in self.upstreams if (u.healthy or not healthy_only) and u.models
                                  for m in u.models))

    # -- health and load --------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(u) for u in self.upstreams))

    async def poll(self, u: Upstream) -> None:
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)
        try:
            async with self.session.get(f"{u.url}/health", timeout=timeout) as r:
                if r.status != 200:
                    raise UpstreamFailed("health", f"/health answered {r.status}")
            async with self.session.get(f"{u.url}/metrics", timeout=timeout) as r:
                if r.status == 200:
                    self.apply_metrics(u, parse_metrics(await r.text()))
            if u.models is None or not u.healthy:
                async with self.session.get(f"{u.url}/v1/models", timeout=timeout) as r:
                    if r.status == 200:
                        data = await r.json()
                        u.models = [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UpstreamFailed, ValueError) as e:
            self.mark_unhealthy(u, f"health check failed: {type(e).__name__}: {e}")
            return
        u.healthy, u.error, u.last_poll = True, None, time.monotonic()

    @staticmethod
    def apply_metrics(u: Upstream, m: dict[str, float]) -> None:
        u.num_running = int(m.get("vllm:num_requests_running", 0))
        u.num_waiting = int(m.get("vllm:num_requests_waiting", 0))
        u.kv_usage = float(m.get("vllm:kv_cache_usage_perc", 0.0))
        if "minibatch:kv_cache_total_blocks" in m:
            u.kv_blocks_total = int(m["minibatch:kv_cache_total_blocks"])
            u.kv_blocks_used = int(m.get("minibatch:kv_cache_used_blocks", 0))

    def mark_unhealthy(self, u: Upstream, why: str) -> None:
        u.healthy, u.error = False, why

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

    def failed(self, u: Upstream, e: UpstreamFailed) -> None:
        self.metrics.errors.labels(u.url, e.kind).inc()
        if e.kind in ("connect", "timeout"):
            self.mark_unhealthy(u, str(e))

    # -- one attempt ------------------------------------------------------------------------
    async def open(self, u: Upstream, req: Proxied, body: dict) -> aiohttp.ClientResponse:
        """Send ``body`` to ``u``; the response if its status is < 500 and not 429, else raise."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout,
                                        sock_read=self.upstream_timeout)
        try:
            resp = await self.session.post(f"{u.url}{req.path}", json=body, headers=req.headers, timeout=timeout)
        except asyncio.TimeoutError:
            raise UpstreamFailed("timeout", f"{u.url} did not answer within the timeout") from None
        except (aiohttp.ClientError, OSError) as e:
            raise UpstreamFailed("connect", f"{u.url}: {type(e).__name__}: {e}") from None
        if resp.status >= 500 or resp.status == 429:
            try:
                data = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                data = b""
            finally:
                resp.release()
            raise UpstreamFailed("status", f"{u.url} answered {resp.status}", resp.status, data)
        return resp

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


# -- streams ------------------------------------------------------------------------------
def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def sse_data(resp: aiohttp.ClientResponse):
    """The ``data:`` payloads of a server-sent event stream, as strings, one per event."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])     # one leading space is dropped


class StreamRelay:
    """Relays one streamed answer to the client, resuming it elsewhere if its upstream fails."""

    def __init__(self, state: RouterState, req: Proxied, u: Upstream, resp: aiohttp.ClientResponse):
        self.state, self.req, self.u, self.resp = state, req, u, resp
        body = req.body
        self.want_ids = bool(body.get("return_token_ids"))
        temperature = body.get("temperature", 1.0)
        self.greedy = isinstance(temperature, (int, float)) and temperature == 0
        self.prompt_ids: list[int] | None = None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], list):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            self.prompt_ids = list(p)
        self.produced: list[int] = []       # token ids relayed so far
        self.ids_known = True               # every relayed chunk carried its token ids
        self._texts: list[str] = []         # text relayed so far, in pieces
        self._raw: list[str] = []           # chunks relayed by the fast path, text not yet read
        self.detok = None                   # after a resume: the router's own detokenizer
        self.rid: str | None = None
        self.finish_seen = False
        self.segment = 0

    def _fix(self, obj: dict) -> dict:
        """A chunk as the client should see it (ids, usage and text of a resumed stream fixed)."""
        self._flush_raw()                    # keep the text pieces in order
        if self.rid is None:
            self.rid = obj.get("id")
        elif "id" in obj:
            obj["id"] = self.rid
        usage = obj.get("usage")
        if usage and self.segment and self.prompt_ids is not None:
            done = len(self.produced)
            usage.update(prompt_tokens=len(self.prompt_ids), completion_tokens=done,
                         total_tokens=len(self.prompt_ids) + done)
        for c in obj.get("choices") or []:
            ids = c.get("token_ids")
            if self.segment == 0 and c.get("prompt_token_ids") is not None and self.prompt_ids is None:
                self.prompt_ids = list(c["prompt_token_ids"])
            if ids is None:
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    self.ids_known = False
            else:
                self.produced += ids
                if self.detok is not None:
                    for t in ids:
                        self.detok.push(t)
                    sent = self.text
                    if self.detok.text.startswith(sent) and "text" in c:
                        c["text"] = self.detok.text[len(sent):]
            if "text" in c:
                self._texts.append(c["text"] or "")
            if c.get("finish_reason") is not None:
                self.finish_seen = True
            if self.segment and "prompt_token_ids" in c:
                del c["prompt_token_ids"]
            if not self.want_ids:
                for k in ID_FIELDS:
                    c.pop(k, None)
        return obj

    @property
    def text(self) -> str:
        """The text relayed so far (the fast path's chunks are parsed only when this is read)."""
        self._flush_raw()
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def _flush_raw(self) -> None:
        for data in self._raw:
            for c in json.loads(data).get("choices") or []:
                self._texts.append(c.get("text") or "")
        self._raw = []

    def fast(self, data: str) -> bytes | None:
        """An ordinary chunk of the first upstream, relayed without a JSON round trip: its token
        ids are read (and cut out if the client did not ask for them) with a regex. None: the
        chunk needs :meth:`_fix` (the first one, the last, usage, errors, or another layout)."""
        if (self.segment or self.rid is None or '"finish_reason":null' not in data or '"usage"' in data
                or '"prompt_token_ids"' in data or '"error"' in data):
            return None
        m = IDS_RE.search(data)
        if m is None or IDS_RE.search(data, m.end()) is not None:
            return None
        self.produced += [int(x) for x in m.group(1).split(",") if x.strip()]
        self._raw.append(data)
        out = data if self.want_ids else data[:m.start()] + data[m.end():]
        return b"data: " + out.encode() + b"\n\n"

    def resume_body(self) -> dict | None:
        """The request that continues this stream on another upstream, or None if it cannot."""
        body = dict(self.req.body)
        if not self.produced and self.ids_known and not self.text:
            return body                      # nothing relayed yet: send it again as it was
        if self.req.chat or not self.greedy or not self.ids_known or self.prompt_ids is None:
            return None
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else max_tokens
        left = max_tokens - len(self.produced)
        if left <= 0:
            return None
        body.update(prompt=self.prompt_ids + self.produced, max_tokens=left, return_token_ids=True)
        return body

    def why_not(self) -> str:
        if self.req.chat:
            return "a chat stream cannot be resumed on another upstream"
        if not self.greedy:
            return "only a greedy (temperature 0) completion stream can be resumed with the same tokens"
        if not self.ids_known or self.prompt_ids is None:
            return "the upstream did not return token ids (return_token_ids), so the stream cannot be resumed"
        return "no tokens left to generate"

    async def events(self):
        state, req = self.state, self.req
        try:
            while True:
                cut: UpstreamFailed | None = None
                try:
                    async for data in sse_data(self.resp):
                        if data.strip() == "[DONE]":
                            yield b"data: [DONE]\n\n"
                            return
                        quick = self.fast(data)
                        if quick is not None:
                            yield quick
                            continue
                        try:
                            obj = json.loads(data)
                        except ValueError:
                            yield f"data: {data}\n\n".encode()
                            continue
                        yield sse(self._fix(obj) if isinstance(obj, dict) else obj)
                    cut = UpstreamFailed("stream_cut", f"{self.u.url} ended the stream without [DONE]")
                except asyncio.TimeoutError:
                    cut = UpstreamFailed("timeout", f"{self.u.url} sent nothing for {state.upstream_timeout:g} s")
                except (aiohttp.ClientError, OSError, ValueError) as e:     # ValueError: a line over 64 KiB
                    cut = UpstreamFailed("stream_cut", f"{self.u.url} cut the stream: {type(e).__name__}: {e}")
                self.close_attempt()
                state.failed(self.u, cut)
                if self.finish_seen:          # every token arrived; only the end was lost
                    yield b"data: [DONE]\n\n"
                    return
                body = self.resume_body()
                if body is None:
                    yield self.error_event(f"the upstream stream failed ({cut}) and {self.why_not()}")
                    return
                kind = "resume" if self.produced else "retry"
                try:
                    self.u, self.resp = await state.send(req, body, lambda: None)
                except APIError as e:
                    yield self.error_event(f"the upstream stream failed ({cut}) and could not be resumed: "
                                           f"{e.message}")
                    return
                state.metrics.retries.labels(kind).inc()
                if self.resp.status != 200:
                    status = self.resp.status
                    text = (await self.resp.read()).decode("utf-8", "replace")
                    self.close_attempt()
                    yield self.error_event(f"resuming the stream failed: {status} {text[:300]}")
                    return
                if self.produced:
                    self.segment += 1
                    if self.detok is None and state.tokens is not None:
                        self.detok = state.tokens.detokenizer()
                        if self.detok is not None:
                            for t in self.produced:
                                self.detok.push(t)
        finally:
            self.close_attempt()

    def error_event(self, message: str) -> bytes:
        self.state.metrics.stream_errors.inc()
        err = APIError(502, message, type="server_error", code="upstream_stream_failed")
        return sse(err.body()) + b"data: [DONE]\n\n"

    def close_attempt(self) -> None:
        if self.resp is not None:
            self.resp.close()
            self.state.end(self.u, self.req)
            self.resp = None


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` (also if the client left before the
    first byte, when the body's generator never starts)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


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
                   help="router class from minibatch.cluster.routers (default: least_requests)")
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
