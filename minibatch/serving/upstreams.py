"""The HTTP router's upstreams: their health, their polled load, and one attempt on one of them.

Each :class:`Upstream` is one OpenAI-compatible server. :class:`UpstreamSet` (which the
router's ``RouterState`` extends) checks every upstream's ``/health`` each
``--poll-interval`` seconds under ``--health-timeout`` and reads its Prometheus
``/metrics`` (vLLM's names, :data:`POLLED`) and, until known, its ``/v1/models``, sending
``Authorization: Bearer KEY`` when it has the upstreams' key (``--upstream-api-key``; an
upstream with ``--api-key-scope all`` answers ``/metrics`` only with it). A failed check, or
a connection error or stall on a request, marks the upstream unhealthy: it gets no requests
until a check succeeds again. :meth:`UpstreamSet.stalled`: an unhealthy upstream whose last
successful check is older than ``--inter-token-timeout`` (a frozen process, for example),
which the router treats as having dropped the requests it holds.

:class:`Admission` bounds the router's own requests in flight and queued (429 beyond);
:class:`RouterMetrics` is the router's ``/metrics`` page.

The stall timeouts (``--first-token-timeout``, ``--inter-token-timeout``). A healthy upstream
sends a stream's first event after the prompt's prefill and its wait in the queue, and the
next ones a decode step apart (milliseconds to a second); the defaults,
:data:`DEFAULT_FIRST_TOKEN_TIMEOUT_S` and :data:`DEFAULT_INTER_TOKEN_TIMEOUT_S`, are far
above both and well below ``--upstream-timeout`` (which bounds a whole non-streamed answer),
so that only an upstream that has stopped (frozen, partitioned, deadlocked) reaches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from minibatch.routing.view import ReplicaView
from minibatch.serving.protocol import APIError

DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_UPSTREAM_TIMEOUT_S = 300.0   # a silent gap (a whole answer, when not streamed)
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 120.0  # a stream's first event (queue + prefill)
DEFAULT_INTER_TOKEN_TIMEOUT_S = 30.0   # between a stream's events; health checks of a non-streamed answer's upstream
DEFAULT_CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1
POLLED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "minibatch:kv_cache_used_blocks", "minibatch:kv_cache_total_blocks")


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
                              "(connect, status, timeout, stall, stream_cut)", ["upstream", "kind"], registry=r)
        self.retries = Counter("minibatch_router_retries", "Requests sent again elsewhere: retry (before the "
                               "first token) or resume (a stream cut mid-way)", ["kind"], registry=r)
        self.stream_errors = Counter("minibatch_router_stream_errors", "Streams ended with an error event "
                                     "(could not resume)", registry=r)
        self.rejected = Counter("minibatch_router_rejected", "Requests answered by the router itself, by "
                                "reason (overload, invalid, no_upstream, upstream_failed; at the edge: host, "
                                "unauthorized, media_type, too_large, timeout, connections)", ["reason"], registry=r)
        self.abandoned = Counter("minibatch_router_abandoned", "Requests whose client went away before the "
                                 "answer; their upstream request was cancelled", registry=r)
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
        self.flow_held = Gauge("minibatch_router_flow_held", "Requests held by flow control (--flow-control) "
                               "until an upstream has room", registry=r)
        self.flow_released = Gauge("minibatch_router_flow_released", "Requests flow control has released",
                                   registry=r)

    def render(self, state) -> bytes:
        for u in state.upstreams:
            self.healthy.labels(u.url).set(1 if u.healthy else 0)
            self.up_in_flight.labels(u.url).set(u.in_flight)
            self.up_running.labels(u.url).set(u.num_running)
            self.up_waiting.labels(u.url).set(u.num_waiting)
            self.up_kv.labels(u.url).set(u.kv_usage)
        self.in_flight.set(state.admission.in_flight)
        self.queue.set(state.admission.waiting)
        flow = getattr(state, "flow", None)
        if flow is not None:
            self.flow_held.set(len(flow.queue))
            self.flow_released.set(flow.queue.released)
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


class UpstreamSet:
    """The upstreams, their health and load, and the HTTP client that reaches them."""

    def __init__(self, urls: list[str], *, poll_interval: float = DEFAULT_POLL_INTERVAL_S,
                 health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S, upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 first_token_timeout: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S,
                 inter_token_timeout: float = DEFAULT_INTER_TOKEN_TIMEOUT_S, upstream_api_key: str | None = None):
        if not urls:
            raise ValueError("the router needs at least one --upstream URL")
        self.upstreams = [Upstream(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.poll_interval, self.health_timeout = poll_interval, health_timeout
        self.upstream_timeout, self.connect_timeout = upstream_timeout, connect_timeout
        self.first_token_timeout, self.inter_token_timeout = first_token_timeout, inter_token_timeout
        self.upstream_api_key = upstream_api_key
        self.poll_headers = {"Authorization": f"Bearer {upstream_api_key}"} if upstream_api_key else {}
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    # -- life -----------------------------------------------------------------------
    
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        await self.poll_all()
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
            self.after_poll()

    def after_poll(self) -> None:
        """Called after each periodic poll of every upstream (flow control looks at its queue again)."""

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(u) for u in self.upstreams))

    async def poll(self, u: Upstream) -> None:
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)
        try:
            h = self.poll_headers
            async with self.session.get(f"{u.url}/health", timeout=timeout, headers=h) as r:
                if r.status != 200:
                    raise UpstreamFailed("health", f"/health answered {r.status}")
            async with self.session.get(f"{u.url}/metrics", timeout=timeout, headers=h) as r:
                if r.status == 200:
                    self.apply_metrics(u, parse_metrics(await r.text()))
            if u.models is None or not u.healthy:
                async with self.session.get(f"{u.url}/v1/models", timeout=timeout, headers=h) as r:
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

    def stalled(self, u: Upstream) -> bool:
        """Has ``u`` failed every health check for longer than ``inter_token_timeout``?"""
        return not u.healthy and time.monotonic() - u.last_poll > self.inter_token_timeout

    def failed(self, u: Upstream, e: UpstreamFailed) -> None:
        self.metrics.errors.labels(u.url, e.kind).inc()
        if e.kind in ("connect", "timeout", "stall"):
            self.mark_unhealthy(u, str(e))

    # -- one attempt ------------------------------------------------------------------------
    async def open(self, u: Upstream, req, body: dict) -> aiohttp.ClientResponse:
        """Send ``body`` to ``u`` (at ``req.path``, with ``req.headers``); the response if its status
        is < 500 and not 429, else raise :class:`UpstreamFailed`."""
        # A stream's reads are bounded by the stall timeouts (its headers come before its first token).
        read = (max(self.first_token_timeout, self.inter_token_timeout) if body.get("stream") is True
                else self.upstream_timeout)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=read)
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
