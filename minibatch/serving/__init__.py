"""Serving: the engine behind an OpenAI-compatible HTTP API, and the HTTP router in front.

- :mod:`.server`: ``python -m minibatch serve`` (FastAPI + uvicorn): endpoints, flow
  control, graceful shutdown;
- :mod:`.async_engine`: one background thread runs the engine loop; asyncio streams
  read each request's tokens;
- :mod:`.protocol`: request checks and response shapes of the OpenAI API;
- :mod:`.openai`: request preparation (parse, check, tokenize) and server-sent events,
  shared by the server, the router and the Ray Serve ingress;
- :mod:`.edge`: what every request meets first, in the server and the router: the Host
  allow-list, the API key, body and header limits, the connection limit;
- :mod:`.metrics`: the ``/metrics`` page (``prometheus_client``, vLLM's metric names);
- :mod:`.router`: ``python -m minibatch router``, the app and its command line;
  :mod:`.upstreams` (health, polled load, admission, stall timeouts), :mod:`.relay` (streams
  passed through and resumed per choice) and :mod:`.routed` (what a router class reads of a
  request) are its parts; the routing classes are ``minibatch.routing``;
- :mod:`.replicas`: ``serve --replicas N``; :mod:`.faults`: fault injection;
  :mod:`.scrape`: an in-process engine's ``/metrics`` on its clock.

Nothing is imported here, so ``import minibatch.serving.protocol`` does not pull in
FastAPI.
"""
