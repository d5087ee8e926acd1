"""Serving: the engine behind an OpenAI-compatible HTTP API.

- :mod:`.server`: ``python -m minibatch serve`` (FastAPI + uvicorn): endpoints, flow
  control, authentication, graceful shutdown;
- :mod:`.async_engine`: one background thread runs the engine loop; asyncio streams
  read each request's tokens;
- :mod:`.protocol`: request checks and response shapes of the OpenAI API;
- :mod:`.metrics`: the ``/metrics`` page (``prometheus_client``, vLLM's metric names).

Nothing is imported here, so ``import minibatch.serving.protocol`` does not pull in
FastAPI.
"""
