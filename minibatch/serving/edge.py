"""The HTTP edge shared by ``minibatch serve`` and ``minibatch router``: what every request
meets before a route, and the limits of the connections themselves.

- The ``Host`` allow-list (``--allowed-hosts``; default: the loopback names and the bind
  host; with a wildcard bind also this machine's name and any IP address; ``*`` turns the
  check off), which defeats DNS rebinding: a page on ``evil.example`` that resolves its
  name to 127.0.0.1 still sends ``Host: evil.example``. 400 otherwise.
- The API key (``--api-key``; ``Authorization: Bearer KEY``): with ``--api-key-scope v1``
  (the default) the ``/v1`` routes and the tokenizer routes (``/tokenize``, ``/detokenize``)
  need it; with ``all`` every route but ``/health`` does. 401 otherwise. The tokenizer routes
  are inside the key in both scopes, unlike vLLM, whose key guards only the paths under
  ``/v1`` (and ``/v2``, ``/inference``, ``/cohere``: ``GUARDED_PREFIX`` in
  ``vllm/entrypoints/serve/utils/server_utils.py``, ``AuthenticationMiddleware``; vLLM main,
  commit 0753ceeb): tokenizing is work done on demand, and a key that leaves it open lets
  anyone load the server.
- ``POST /v1/...`` (and the tokenizer routes) must be ``Content-Type: application/json``,
  so that a cross-site "simple" request (a form, ``text/plain``) cannot start a
  generation. 415 otherwise.
- A request body is read under a size limit (``--max-request-body-bytes``, 413) and a time
  limit (``--read-timeout``, 408); the request headers too must arrive within
  ``--read-timeout`` seconds of the connection (or of the previous request on it), else
  the connection is closed.
- At most ``--max-connections`` connections are open at once. When one more arrives, the
  oldest *idle* connection (no request in progress: still sending its headers, or a
  keep-alive connection between requests) is closed to make room; if every connection has
  a request in progress, the new one is closed at once. Idle connections therefore cannot
  exhaust the process's file descriptors, and they never push out a request being
  served. The process's soft limit on open files is raised (to 65,535 or its hard limit)
  at start, as vLLM's API server does (``set_ulimit()`` in ``setup_server``,
  ``vllm/entrypoints/openai/api_server.py``; vLLM main, commit 0001948b).

:class:`Edge` holds these settings; :class:`Guard` is the ASGI middleware that applies the
per-request checks (a plain middleware, so that streaming is untouched);
:func:`uvicorn_config` builds a uvicorn config with the connection limits.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from minibatch.serving.protocol import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
OPEN_PATHS = ("/health",)          # never behind the API key (load balancers probe it)
TOKENIZER_PATHS = ("/tokenize", "/detokenize")   # vLLM's paths, outside /v1
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1024
KEEP_ALIVE_S = 5                    # uvicorn's timeout_keep_alive (its default is 5 s too)
# A body over the limit is still read (and dropped) up to this size, so that a client that
# writes its whole body before reading gets the 413 instead of a reset connection.
MAX_DRAIN_BYTES = 64 * 2 ** 20


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


def default_allowed_hosts(bind_host: str) -> tuple[list[str], bool]:
    """The Host names a server bound to ``bind_host`` answers to by default, and whether any
    IP-literal Host is fine too (a wildcard bind: clients may use any of the machine's
    addresses; an IP literal cannot be a DNS-rebinding name)."""
    names = [*LOOPBACK_HOSTS, bind_host.strip("[]")]
    wildcard = bind_host.strip("[]") in WILDCARD_HOSTS
    if wildcard:
        names += [socket.gethostname(), socket.getfqdn()]
    return [n for n in dict.fromkeys(n.lower() for n in names) if n], wildcard


@dataclass
class Edge:
    """The edge's settings. ``what`` names the process in messages ("server", "router");
    ``count(reason)`` counts a refused request (a metrics hook)."""

    allowed_hosts: set[str] = field(default_factory=lambda: {"*"})
    any_ip_host: bool = False
    api_key: str | None = None
    api_key_scope: str = "v1"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    what: str = "server"
    count: Callable[[str], None] = lambda reason: None

    def __post_init__(self):
        self.allowed_hosts = {h.lower() for h in self.allowed_hosts}
        if self.api_key_scope not in ("v1", "all"):
            raise ValueError(f"--api-key-scope must be 'v1' or 'all', got {self.api_key_scope!r}")

    def host_allowed(self, host: str | None) -> bool:
        return host_allowed(host, self.allowed_hosts, self.any_ip_host)

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path in OPEN_PATHS:
            return False
        return (path == "/v1" or path.startswith("/v1/") or path in TOKENIZER_PATHS
                or self.api_key_scope == "all")

    def authenticated(self, authorization: str | None) -> bool:
        """Does this ``Authorization`` header carry the key (always, when there is no key)?"""
        if self.api_key is None:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.api_key}".encode())

    def check(self, scope) -> APIError | None:
        """The per-request checks, before any route: Host (400), API key (401), JSON (415)."""
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        path = scope["path"]
        host = headers.get("host")
        if not self.host_allowed(host):
            self.count("host")
            return APIError(400, f"the Host header {host[:100]!r} is not one this {self.what} answers to; "
                                 "start it with --allowed-hosts NAME ... (or '*')", code="invalid_host")
        if self.needs_key(path) and not self.authenticated(headers.get("authorization")):
            self.count("unauthorized")
            return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        if scope["method"] == "POST" and (path.startswith("/v1/") or path in TOKENIZER_PATHS):
            ctype = headers.get("content-type", "")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                self.count("media_type")
                return APIError(415, f"Content-Type must be application/json, got {ctype[:100]!r}",
                                code="unsupported_media_type")
        return None

    async def read_body(self, request) -> bytes:
        """A request's body, under ``max_body_bytes`` (413) and ``read_timeout`` (408)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > MAX_DRAIN_BYTES:
            self.count("too_large")
            raise self.too_large()
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
            await asyncio.wait_for(read(), self.read_timeout)
        except asyncio.TimeoutError:
            self.count("timeout")
            raise APIError(408, f"the request body did not arrive within {self.read_timeout:g} s "
                                "(--read-timeout)", code="request_timeout", headers={"Connection": "close"}) from None
        if size > limit:
            self.count("too_large")
            raise self.too_large()
        return b"".join(chunks)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this {self.what}'s limit of {self.max_body_bytes} "
                             "bytes (--max-request-body-bytes)", code="request_too_large",
                        headers={"Connection": "close"})


class Guard:
    """ASGI middleware: :meth:`Edge.check` before any route (a plain middleware, so that
    streamed answers pass untouched)."""

    def __init__(self, app, edge: Edge):
        self.app = app
        self.edge = edge

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.edge.check(scope)
            if err is not None:
                resp = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def add_edge_args(p, what: str = "server") -> None:
    """The edge's command-line options (the same names on ``serve`` and ``router``)."""
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header values to answer (DNS-rebinding guard); '*' accepts any (default: "
                        "localhost, 127.0.0.1, ::1 and --host; with a wildcard --host also this machine's "
                        "name and any IP address)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers, and again its body "
                        f"(default: {DEFAULT_READ_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open connections at most; the oldest idle one is closed to make room for a new one "
                        f"(default: {DEFAULT_MAX_CONNECTIONS})")


def check_edge_args(args) -> None:
    """``ValueError`` naming a bad edge option."""
    for name in ("max_request_body_bytes", "read_timeout", "max_connections"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")


def edge_from_args(args, api_key: str | None, api_key_scope: str, what: str, count=None) -> Edge:
    hosts, any_ip = (args.allowed_hosts, False) if args.allowed_hosts else default_allowed_hosts(args.host)
    return Edge(set(hosts), any_ip, api_key or None, api_key_scope, args.max_request_body_bytes, args.read_timeout,
                args.max_connections, what, count or (lambda reason: None))


# -- connections ---------------------------------------------------------------------------------
def timed_protocol(edge: Edge):
    """uvicorn's httptools protocol, plus (1) a deadline on the request headers: a connection
    that opens and sends nothing, or sends its headers slowly, is closed after
    ``edge.read_timeout`` seconds (uvicorn itself only times out idle keep-alive connections);
    (2) the connection limit: beyond ``edge.max_connections`` open connections the oldest
    idle one is closed (or, if none is idle, the new one). ``None`` when httptools is not
    installed (uvicorn then uses h11, without these limits)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    read_timeout = edge.read_timeout
    # Open connections, oldest first (dicts keep insertion order); True while a request is
    # in progress on it (from its headers' end until its response is sent).
    open_: dict = {}

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
            if len(open_) >= edge.max_connections:
                edge.count("connections")
                if not _evict_idle(open_):      # every connection is serving a request
                    transport.close()
                    return
            open_[self] = False
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            if self in open_:
                open_[self] = True
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            if self in open_:
                open_[self] = False
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            open_.pop(self, None)
            super().connection_lost(exc)

    TimedHttpToolsProtocol.open_connections = open_
    return TimedHttpToolsProtocol


def _evict_idle(open_: dict) -> bool:
    """Close the oldest idle connection in ``open_``; False if every one is busy."""
    for proto, busy in open_.items():
        if not busy:
            del open_[proto]
            if proto.transport is not None and not proto.transport.is_closing():
                proto.transport.close()
            return True
    return False


def raise_open_files_limit(target: int = 65535) -> None:
    """Raise this process's soft limit on open files to ``target`` (at most its hard limit),
    as vLLM's ``set_ulimit`` does; nothing on a platform without ``resource``."""
    try:
        import resource
    except ImportError:
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = target if hard == resource.RLIM_INFINITY else min(target, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass


def uvicorn_config(app, host: str, port: int, edge: Edge, **kw):
    """A ``uvicorn.Config`` for ``app`` with the edge's connection limits (:func:`timed_protocol`)."""
    import uvicorn

    protocol = timed_protocol(edge)
    return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=KEEP_ALIVE_S,
                          **({"http": protocol} if protocol is not None else {}), **kw)
