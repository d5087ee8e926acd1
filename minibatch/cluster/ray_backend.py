"""Ray Serve backend: minibatch engines as one Ray Serve deployment, behind an OpenAI ingress.

    python -m minibatch serve --backend ray --num-replicas 2 --router least_requests --port 8000
    python -m minibatch serve --backend ray --autoscale min=1,max=4,target_ongoing_requests=8

::

    HTTP ─► Ray Serve proxy ─► Ingress (FastAPI, 1 replica) ─handle─► EngineReplica × N
                                 │ parse + tokenize (openai.prepare_request)   (each an AsyncEngine)
                                 │ MinibatchRequestRouter picks the replica (minibatch.cluster.routers)
                                 └ retries / resumes a request whose replica died

Ray Serve is the distributed engine here (placement, replica restarts, autoscaling, the
HTTP proxy); minibatch adds only the engine in each replica, the router and the ingress.

- ``EngineReplica``: one :class:`~minibatch.serving.async_engine.AsyncEngine` over an
  ``LLMEngine`` of the given model and engine options, ``num_cpus`` (fractional) each.
  ``generate(payload)`` streams deltas (a Ray Serve streaming call);
  ``record_routing_stats()`` reports running / waiting requests and KV blocks for the router.
  Every streamed message is a Ray object, so a replica sends a stream's new tokens at most
  every ``stream_interval_s`` (20 ms; the first token and the end at once).
- ``Ingress``: completions and chat, streaming and not, through the same checks as
  ``minibatch serve`` (``minibatch.serving.openai.prepare_request``, ``protocol.py``'s
  shapes); the engine-side checks (prompt length, vocabulary, KV room) run in the replica
  and come back as a 400. Handle methods ``completions(body)`` / ``chat(body)`` return the
  same JSON as HTTP, plus ``"minibatch": {"replica": id, "attempts": n}``; over HTTP the
  replica is in the ``X-Minibatch-Replica`` header.
- Routing: :class:`~minibatch.cluster.ray_router.MinibatchRequestRouter`, a Ray Serve
  ``RequestRouter`` (Ray >= 2.49) asking a minibatch router by name, class or instance.
- Autoscaling: Ray Serve's own (``autoscaling_config``); ``--autoscale`` takes its field
  names (``min``/``max`` short for ``min_replicas``/``max_replicas``).
- No request is lost when a replica dies: Ray does not retry a call already sent to a
  replica, so the ingress does. A request that fails with a dead or unreachable replica
  is sent again (the router then picks among the live replicas) with the prompt plus the
  tokens it has already produced and ``max_tokens`` reduced by as many: a greedy answer is
  unchanged, and a stream continues where it stopped. After ``max_retries`` failures the
  request ends with an error (an error event in a stream), never a hang. Known limits of the
  resume: a ``stop`` string that straddles the cut is not seen, and a seeded sampled request
  draws its continuation afresh.

Ray is an optional dependency (``pip install -e ".[ray]"``), imported only when this
module's functions run. Source read: Ray 2.60.0 ``ray/serve/api.py`` (``serve.run``,
``serve.ingress``), ``ray/serve/config.py`` (``AutoscalingConfig``, ``RequestRouterConfig``).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid

from minibatch.config import add_engine_args, engine_kwargs

RAY_HINT = 'the Ray backend needs Ray Serve >= 2.49: pip install -e ".[ray]"  (or pip install "ray[serve]>=2.49")'
AUTOSCALE_ALIASES = {"min": "min_replicas", "max": "max_replicas", "target": "target_ongoing_requests"}
AUTOSCALE_FIELDS = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
                    "upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s",
                    "upscaling_factor", "downscaling_factor")
DEFAULT_APP = "minibatch"
DEFAULT_MAX_RETRIES = 3
DEFAULT_MAX_ONGOING_REQUESTS = 64     # per engine replica; Ray Serve's default is 5
# A replica sends the tokens of a stream at most this often (each send is a Ray object), like
# vLLM's --stream-interval but in seconds; the first token and the end are never held back.
DEFAULT_STREAM_INTERVAL_S = 0.02
# The environment of a local Ray instance that minibatch starts (a value already set wins):
# - RAY_worker_niceness=0: Ray 2.60.0 runs every worker process (the engine replicas, the Serve
#   controller and proxy) at nice 15 (src/ray/common/ray_config_def.h, worker_niceness) so that
#   the raylet and the driver come first. Here the replicas are the work; at nice 15, next to
#   two busy processes on this 2-core machine, an engine replica took 237 s to start (10 s
#   with the cores free) and the tests timed out.
# - The Serve controller gives a starting HTTP proxy 5 s for its first readiness check and
#   kills it after 3 failures in a row (ray/serve/_private/constants.py:
#   RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, PROXY_HEALTH_CHECK_UNHEALTHY_THRESHOLD), and then
#   serve.start fails; with the cores shared, a proxy needed more than those 15 s to start.
LOCAL_RAY_ENV = {"RAY_worker_niceness": "0",
                 "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
                 "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def require_ray():
    """``(ray, serve)``, or ``ImportError`` saying how to install them."""
    try:
        import ray
        from ray import serve
        from ray.serve import request_router  # noqa: F401  (Ray >= 2.49)
    except ImportError as e:
        raise ImportError(f"{RAY_HINT} ({e})") from None
    return ray, serve


def parse_autoscale(text: str | dict | None) -> dict | None:
    """``"min=1,max=4,target_ongoing_requests=8"`` -> Ray Serve's ``autoscaling_config`` dict."""
    if text is None or isinstance(text, dict):
        return None if text is None else {AUTOSCALE_ALIASES.get(k, k): v for k, v in text.items()}
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = AUTOSCALE_ALIASES.get(key.strip(), key.strip())
        if not eq or key not in AUTOSCALE_FIELDS:
            raise ValueError(f"--autoscale: {part!r} is not NAME=VALUE with NAME one of "
                             f"{sorted(AUTOSCALE_ALIASES) + list(AUTOSCALE_FIELDS)}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--autoscale: {key}={value!r} is not a number") from None
        out[key] = int(number) if key.endswith("replicas") and number.is_integer() else number
    if "min_replicas" in out and "max_replicas" in out and out["min_replicas"] > out["max_replicas"]:
        raise ValueError(f"--autoscale: min_replicas={out['min_replicas']} > max_replicas={out['max_replicas']}")
    return out


# -- the engine replica ---------------------------------------------------------------------
class EngineReplica:
    """One minibatch engine in a Ray Serve replica (wrapped by ``serve.deployment`` in :func:`build_app`)."""

    def __init__(self, engine_kwargs: dict, stream_interval_s: float = 0.0):
        from ray import serve

        from minibatch.config import EngineConfig
        from minibatch.engine import LLMEngine
        from minibatch.serving.async_engine import AsyncEngine

        self.engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**engine_kwargs)))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.stream_interval_s = stream_interval_s

    def info(self) -> dict:
        llm = self.engine.engine
        return {"tokenizer": llm.tokenizer, "max_model_len": llm.max_model_len, "model": llm.config.model,
                "block_size": llm.config.block_size, "replica": self.replica_id}

    def whoami(self) -> str:
        return self.replica_id

    async def generate(self, payload: dict):
        """Stream a request's deltas as dicts; a bad request yields one ``{"status": 400, ...}``."""
        stream = None
        try:
            try:
                stream = await self.engine.add_request(payload["prompt_token_ids"], payload["params"],
                                                       payload["request_id"])
            except ValueError as e:
                yield {"status": 400, "error": str(e), "replica": self.replica_id}
                return
            except RuntimeError as e:
                yield {"status": 503, "error": str(e), "replica": self.replica_id}
                return
            yield {"started": True, "num_prompt_tokens": stream.num_prompt_tokens, "replica": self.replica_id}
            # Each yield is one Ray object: tokens that arrive within stream_interval_s of the
            # last yield are sent together (the first token and the end go out at once).
            pending, last = None, None
            async for d in stream:
                if pending is None:
                    pending = {"text": d.text, "token_ids": list(d.token_ids)}
                else:
                    pending["text"] += d.text
                    pending["token_ids"] += d.token_ids
                pending.update(finished=d.finished, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                               error=d.error)
                now = time.monotonic()
                if last is None or d.finished or now - last >= self.stream_interval_s:
                    yield pending
                    pending, last = None, now
        finally:
            if stream is not None and not stream.finished:
                self.engine.abort(stream.request_id)     # the caller went away: free the KV blocks

    def record_routing_stats(self) -> dict:
        g = self.engine.gauges
        return {"num_running": g["running"], "num_waiting": g["waiting"], "kv_blocks_used": g["kv_used_blocks"],
                "kv_blocks_total": g["kv_total_blocks"], "block_size": self.engine.engine.config.block_size}

    def check_health(self) -> None:
        failure = self.engine.failure
        if failure is not None:
            raise RuntimeError(failure)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


# -- the ingress ---------------------------------------------------------------------------
class _Front:
    """What ``prepare_request`` needs of an engine, on the ingress side: the replica's
    tokenizer and limits. ``validate`` is left to the replica (it knows its KV pool)."""

    def __init__(self, info: dict):
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]

    def tokenize(self, prompt):
        from minibatch.engine import LLMEngine

        return LLMEngine.tokenize(self, prompt)        # the engine's own rule, on this tokenizer

    def validate(self, ids, params) -> None:
        pass


class _Failed(Exception):
    """A request that could not be served (status + OpenAI error)."""

    def __init__(self, status: int, message: str, replica: str | None = None):
        super().__init__(message)
        self.status, self.message, self.replica = status, message, replica


def _ray_errors():
    import ray.exceptions as rex

    return tuple(getattr(rex, n) for n in ("RayActorError", "ActorUnavailableError", "ActorDiedError")
                 if hasattr(rex, n))


def make_ingress_class():
    """The ``Ingress`` class, built on first use (it needs FastAPI and Ray Serve's ``ingress``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    from minibatch.serving.protocol import (
        APIError,
        bad,
        chunk,
        max_prompt_chars,
        response,
        usage,
    )
    from minibatch.serving.openai import prepare_request, sse_event

    app = FastAPI(title="minibatch (Ray Serve)")

    @serve.ingress(app)
    class Ingress:
        """The OpenAI HTTP API in front of the engine deployment (module docstring)."""

        def __init__(self, engine_handle, served_names: list[str], max_retries: int = DEFAULT_MAX_RETRIES):
            self.engine = engine_handle
            self.served_names = served_names
            self.max_retries = max_retries
            self._front: _Front | None = None
            self._chars: int | None = None
            self.retried = 0                      # requests sent again after a replica failed

        async def front(self) -> _Front:
            if self._front is None:
                info = await self.engine.info.remote()
                self._front = _Front(info)
                self._chars = max_prompt_chars(self._front.tokenizer, self._front.max_model_len)
            return self._front

        async def prepare(self, raw: bytes, chat: bool):
            front = await self.front()
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(None, prepare_request, raw, chat, front, self.served_names, self._chars)
            # One choice per request here: what the local server fans out is refused, not ignored.
            for field, asked in (("n", req.n > 1), ("prompt", len(req.all_prompts()) > 1),
                                 ("logprobs", req.logprobs is not None), ("echo", req.echo),
                                 ("return_token_ids", req.return_token_ids),
                                 ("stream_options", req.continuous_usage)):
                if asked:
                    raise bad(field, f"'{field}' as given is not supported by the Ray backend "
                                     "(one choice per request, no logprobs); use minibatch serve without --backend ray")
            return req

        async def deltas(self, req, rid: str):
            """The request's deltas from the replicas, resumed on another one if its replica dies.
            The first item is ``{"started", "num_prompt_tokens", "replica"}``; ``_Failed`` on error."""
            produced: list[int] = []
            attempts = 0
            started = False
            errors = _ray_errors()
            while True:
                params = req.params
                if produced:
                    params = dataclasses.replace(params, max_tokens=params.max_tokens - len(produced))
                payload = {"prompt_token_ids": list(req.prompt) + produced, "params": params,
                           "request_id": f"{rid}-{attempts}", "tenant": getattr(req, "tenant", None)}
                try:
                    async for d in self.engine.options(stream=True).generate.remote(payload):
                        if "status" in d:
                            raise _Failed(d["status"], d["error"], d.get("replica"))
                        if "started" in d:
                            if not started:
                                started = True
                                yield {**d, "attempts": attempts + 1}
                            continue
                        produced += d["token_ids"]
                        yield d
                        if d["finished"]:
                            return
                    raise _Failed(500, "the replica's stream ended before the request finished")
                except errors as e:
                    attempts += 1
                    if attempts > self.max_retries:
                        raise _Failed(503, f"the request failed on {attempts} replicas; last error: "
                                           f"{type(e).__name__}: {str(e)[:300]}") from None
                    self.retried += 1

        async def run(self, req, rid: str) -> dict:
            """Serve a checked request whole: the OpenAI JSON plus ``minibatch`` (replica, attempts)."""
            text, ids, first, end = [], [], None, None
            async for d in self.deltas(req, rid):
                if "started" in d:
                    first = d
                    continue
                if d["error"]:
                    raise _Failed(500, d["error"], first and first["replica"])
                text.append(d["text"])
                ids += d["token_ids"]
                end = d
            out = response(rid, req.model, req.chat, "".join(text), end["finish_reason"], end["stop_reason"],
                           usage(first["num_prompt_tokens"], len(ids)))
            out["minibatch"] = {"replica": first["replica"], "attempts": first["attempts"]}
            return out

        async def _events(self, gen, first: dict, req, rid: str):
            created, n = int(time.time()), 0
            role_due = req.chat          # the role chunk goes out with the first token, as vLLM (server.py)
            try:
                async for d in gen:
                    if d.get("error"):
                        yield sse_event(APIError(500, d["error"], type="server_error").body())
                        break
                    if role_due:
                        yield sse_event(chunk(rid, req.model, created, True, "", role=True))
                        role_due = False
                    n += len(d["token_ids"])
                    yield sse_event(chunk(rid, req.model, created, req.chat, d["text"], d["finish_reason"]))
            except _Failed as e:
                yield sse_event(APIError(e.status, e.message, type="server_error").body())
            if req.include_usage:
                yield sse_event(chunk(rid, req.model, created, req.chat, None,
                                      usage_=usage(first["num_prompt_tokens"], n)))
            yield "data: [DONE]\n\n"

        async def handle_http(self, request: Request, chat: bool):
            raw = await request.body()
            try:
                req = await self.prepare(raw, chat)
            except APIError as e:
                return JSONResponse(e.body(), status_code=e.status)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                if not req.stream:
                    out = await self.run(req, rid)
                    info = out.pop("minibatch")
                    return JSONResponse(out, headers={"X-Minibatch-Replica": info["replica"],
                                                      "X-Minibatch-Attempts": str(info["attempts"])})
                gen = self.deltas(req, rid)
                first = await gen.__anext__()          # a bad request is still a 400, not an event
            except _Failed as e:
                err = APIError(e.status, e.message, param="messages" if chat else "prompt") if e.status == 400 \
                    else APIError(e.status, e.message, type="server_error")
                return JSONResponse(err.body(), status_code=e.status)
            return StreamingResponse(self._events(gen, first, req, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Minibatch-Replica": first["replica"]})

        @app.post("/v1/completions")
        async def http_completions(self, request: Request):
            return await self.handle_http(request, chat=False)

        @app.post("/v1/chat/completions")
        async def http_chat(self, request: Request):
            return await self.handle_http(request, chat=True)

        @app.get("/v1/models")
        async def http_models(self):
            front = await self.front()
            return {"object": "list", "data": [
                {"id": n, "object": "model", "created": int(time.time()), "owned_by": "minibatch",
                 "max_model_len": front.max_model_len} for n in self.served_names]}

        @app.get("/health")
        async def http_health(self):
            return JSONResponse({}, status_code=200)

        # -- the handle API (what deploy() returns) ---------------------------------------
        async def completions(self, body: dict) -> dict:
            return await self.call(body, chat=False)

        async def chat(self, body: dict) -> dict:
            return await self.call(body, chat=True)

        async def call(self, body: dict, chat: bool) -> dict:
            """A non-streaming request through the handle: the OpenAI JSON, or its error shape."""
            try:
                req = await self.prepare(json.dumps({**body, "stream": False}).encode(), chat)
                return await self.run(req, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")
            except APIError as e:
                return {**e.body(), "status": e.status}
            except _Failed as e:
                return {**APIError(e.status, e.message).body(), "status": e.status}

        async def stats(self) -> dict:
            return {"retried": self.retried}

    return Ingress


def start_local_ray(num_cpus: float | None = 2, attempts: int = 4, **init_kwargs) -> None:
    """``ray.init`` of a new local Ray instance, tried again when a busy machine makes it time out.

    Ray 2.60.0's raylet waits a fixed time for its dashboard agent (a Python process, slow to
    import when the cores are shared) to write its port files
    (``NodeManager::WaitForDashboardAgentPorts``, not configurable in this version) and
    aborts after it; the driver then gives up after a fixed 30 s (``ray/_private/node.py``,
    ``raylet_start_wait_time_s = 30``). A start that timed out is shut down and tried again.
    The raylet and its workers get ``LOCAL_RAY_ENV`` (worker niceness 0, patient proxy checks)."""
    ray, _ = require_ray()
    with local_ray_environment():
        for attempt in range(attempts):
            try:
                ray.init(num_cpus=num_cpus, **init_kwargs)
                return
            except Exception as e:       # Ray raises a bare Exception here
                if "timed out during startup" not in str(e) or attempt == attempts - 1:
                    raise
                ray.shutdown()


@contextlib.contextmanager
def local_ray_environment():
    """``LOCAL_RAY_ENV`` in ``os.environ`` (names not already set) while a ``ray.init`` inside
    starts a local instance: the raylet, and so every worker, inherits it. Removed after."""
    added = {name: value for name, value in LOCAL_RAY_ENV.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


# -- deployment ----------------------------------------------------------------------------
def build_app(model: str = "tiny", num_replicas: int | None = 2, router="round_robin", router_kwargs=None,
              autoscale=None, num_cpus: float = 0.5, ingress_num_cpus: float = 0.25,
              max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS, routing_stats_period_s: float = 1.0,
              served_model_name: list[str] | None = None, max_retries: int = DEFAULT_MAX_RETRIES,
              stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S, **engine_kw):
    """The Ray Serve application (not yet running): ingress + engine deployment."""
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from minibatch.cluster import routers
    from minibatch.cluster.ray_router import MinibatchRequestRouter, encode_router
    from minibatch.config import EngineConfig

    engine_kw = {"model": model, **engine_kw}
    config = EngineConfig.from_kwargs(**engine_kw)          # bad options fail here, not in a replica
    if isinstance(router, str):
        routers.get(router, **(router_kwargs or {}))          # an unknown name fails here too
    scaling = parse_autoscale(autoscale)
    options: dict = {"ray_actor_options": {"num_cpus": num_cpus}, "max_ongoing_requests": max_ongoing_requests,
                     "request_router_config": RequestRouterConfig(
                         request_router_class=MinibatchRequestRouter,
                         request_router_kwargs={**encode_router(router), "router_kwargs": router_kwargs or {},
                                                "model": config.model, "block_size": config.block_size},
                         request_routing_stats_period_s=routing_stats_period_s)}
    if scaling is not None:
        options["autoscaling_config"] = scaling
    else:
        options["num_replicas"] = num_replicas or 1
    engine = serve.deployment(EngineReplica, name="MinibatchEngine").options(**options)
    ingress = serve.deployment(make_ingress_class(), name="MinibatchIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": ingress_num_cpus}, max_ongoing_requests=1000)
    names = served_model_name or [config.model]
    return ingress.bind(engine.bind(engine_kw, stream_interval_s), names, max_retries)


def deploy(model: str = "tiny", num_replicas: int | None = 2, router="round_robin", autoscale=None,
           num_cpus: float = 0.5, *, name: str = DEFAULT_APP, route_prefix: str = "/", blocking: bool = False,
           **kwargs):
    """Deploy on the Ray cluster this process is connected to (``ray.init`` first, or let
    Serve start a local one) and return the ingress's ``DeploymentHandle``: call
    ``handle.completions.remote({"prompt": ..., "max_tokens": ...}).result()``.
    ``router``: a registered name, a ``Router`` class or instance; ``autoscale``: a string
    as ``--autoscale`` takes or a dict of Ray Serve ``autoscaling_config`` fields (then
    ``num_replicas`` is ignored). Other keywords: :func:`build_app`'s and engine options."""
    _, serve = require_ray()
    app = build_app(model, num_replicas, router, autoscale=autoscale, num_cpus=num_cpus, **kwargs)
    return serve.run(app, name=name, route_prefix=route_prefix, blocking=blocking)


def replica_counts(app: str = DEFAULT_APP, deployment: str = "MinibatchEngine") -> dict[str, int]:
    """The engine deployment's replicas by state (``{"RUNNING": 2, "STARTING": 1}``, from
    ``serve.status()``; states with no replica left out)."""
    _, serve = require_ray()
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return {}
    states = status.deployments[deployment].replica_states
    return {getattr(k, "value", str(k)): int(v) for k, v in states.items() if v}


def num_running_replicas(app: str = DEFAULT_APP, deployment: str = "MinibatchEngine") -> int:
    """Replicas of the engine deployment in state RUNNING."""
    return replica_counts(app, deployment).get("RUNNING", 0)


def replica_actor_handles(app: str = DEFAULT_APP, deployment: str = "MinibatchEngine") -> list:
    """The Ray actor handles of the engine deployment's live replicas (fault injection: ``ray.kill``)."""
    ray, _ = require_ray()
    from ray.util import list_named_actors

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and a["name"].startswith(prefix))
    return [ray.get_actor(n, namespace="serve") for n in names]


# -- command line --------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch serve --backend ray",
                                description="Serve a model over the OpenAI HTTP API on Ray Serve.")
    add_engine_args(p)
    p.add_argument("--backend", choices=["ray"], default="ray")
    p.add_argument("--num-replicas", type=int, default=1, help="engine replicas (without --autoscale)")
    p.add_argument("--address", default=None,
                   help="the Ray cluster to join (ray://HOST:10001, HOST:6379 or auto); default: a local one")
    p.add_argument("--autoscale", default=None, metavar="min=1,max=4,target_ongoing_requests=8",
                   help="Ray Serve autoscaling_config fields (also upscale_delay_s, downscale_delay_s, "
                        "look_back_period_s ...); replaces --num-replicas")
    p.add_argument("--router", default="round_robin",
                   help="minibatch router choosing each request's replica (minibatch.cluster.routers; "
                        "--policy is the engine's scheduling policy)")
    p.add_argument("--num-cpus", type=float, default=0.5, help="CPUs reserved per engine replica (fractional)")
    p.add_argument("--max-ongoing-requests", type=int, default=DEFAULT_MAX_ONGOING_REQUESTS)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p


def main(argv: list[str] | None = None) -> int:
    """``serve --backend ray``: deploy, print where, serve until Ctrl-C or SIGTERM, then take the
    application down (and the local Ray instance, if this command started it)."""
    import signal

    args = make_parser().parse_args(argv)
    try:
        scaling = parse_autoscale(args.autoscale)
        from minibatch.cluster import routers
        routers.get(args.router)
        if args.num_replicas < 1 or args.num_cpus <= 0:
            raise ValueError("--num-replicas must be >= 1 and --num-cpus > 0")
        ray, serve = require_ray()
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    own_cluster = args.address is None
    if own_cluster:
        start_local_ray(num_cpus=None)
    else:
        ray.init(address=args.address)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        kw = engine_kwargs(args)
        app = build_app(kw.pop("model", "tiny"), num_replicas=args.num_replicas, router=args.router,
                        autoscale=scaling, num_cpus=args.num_cpus, max_ongoing_requests=args.max_ongoing_requests,
                        served_model_name=args.served_model_name, **kw)
        serve.run(app, name=DEFAULT_APP, route_prefix="/")
        print(f"minibatch: serving on Ray Serve (router={args.router}, "
              f"{'autoscale ' + str(scaling) if scaling else f'{args.num_replicas} replicas'}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if own_cluster:
            serve.shutdown()
        else:                 # a shared cluster: remove this application only
            serve.delete(DEFAULT_APP)
        ray.shutdown()        # only disconnects from a cluster this process did not start
    return 0
