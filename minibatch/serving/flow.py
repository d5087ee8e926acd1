"""Gateway flow control in the HTTP router (``python -m minibatch router --flow-control ...``).

The same rules as the simulated cluster's (``minibatch.cluster.flow_control``, llm-d's flow
controller): a request waits at the router, in its priority **band** and its **flow** (tenant),
until an upstream serving its model **has room**; then the router's policy chooses among the
upstreams with room, and the request goes there.

* band: the ``X-Minibatch-Priority`` header (an int, lower = more urgent, as vLLM's ``priority``),
  else the body's ``priority`` field, else 0. The header is not forwarded in the body: use it to
  band requests without asking the engine to schedule by priority (``minibatch serve`` refuses a
  non-zero ``priority``; vLLM wants ``--scheduling-policy priority`` for one);
* flow: the ``X-Gateway-Inference-Fairness-Id`` header (llm-d's name, ``pkg/epp/metadata/consts.go``
  in gateway-api-inference-extension v1.5.0), else the body's ``user``, else one default flow;
* room: the upstream's :class:`~minibatch.routing.ReplicaView` (its polled running + waiting, or
  this router's requests in flight there if more, see ``upstreams.py``), plus the requests
  released to it that have not been sent yet, is below ``--flow-max-requests-per-upstream``
  (and its polled KV usage below ``--flow-max-kv-usage`` if set). An upstream with nothing at
  all has room.

The queue is looked at again whenever something may have made room: a request of this router
ends, a poll of the upstreams' ``/metrics`` completes, a request joins or leaves the queue.
A request held longer than ``--flow-queue-timeout`` s, or arriving when ``--flow-max-queued``
requests are held, gets a 429 in OpenAI's error shape with ``Retry-After``; a client that
leaves while held is dropped from the queue. Known limit: the queue is one for all models, so a
held request of a model with no room holds back the requests behind it (as in the simulator,
where flow control goes with one model).
"""

from __future__ import annotations

import asyncio
import time

from minibatch.cluster.flow_control import FlowControl, FlowQueue
from minibatch.serving.protocol import APIError

PRIORITY_HEADER = "x-minibatch-priority"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


def band_and_flow(headers, body: dict) -> tuple[int, str | None]:
    """The request's band and flow (module docstring); ``APIError`` 400 naming a bad priority."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            band = int(raw)
        except ValueError:
            raise APIError(400, f"the {PRIORITY_HEADER} header must be an integer, got {raw!r}",
                           param=PRIORITY_HEADER, code="invalid_priority") from None
    else:
        band = body.get("priority", 0)
        if isinstance(band, bool) or not isinstance(band, int):
            raise APIError(400, f"'priority' must be an integer, got {band!r}", param="priority",
                           code="invalid_priority")
    flow = headers.get(FAIRNESS_HEADER)
    if flow is None:
        user = body.get("user")
        flow = user if isinstance(user, str) else None
    return band, flow


class _Held:
    __slots__ = ("req", "future", "gone")

    def __init__(self, req, future):
        self.req, self.future, self.gone = req, future, False


class FlowGate:
    """The router's flow-control queue over a :class:`~minibatch.serving.router.RouterState`."""

    def __init__(self, state, control: FlowControl):
        self.state = state
        self.control = control
        self.queue = FlowQueue(control)
        self.reserved: dict[int, int] = {u.index: 0 for u in state.upstreams}   # released, not sent yet
        self.held_total = 0
        self.timed_out = 0
        self.rejected_full = 0

    # -- room ------------------------------------------------------------------------
    def has_room(self, u) -> bool:
        v = u.view(self.state.block_size)
        r = self.reserved[u.index]
        if r:
            from dataclasses import replace

            v = replace(v, num_waiting=v.num_waiting + r)
        return self.control.has_room(v)

    def _can_go(self, req) -> bool:
        """Would ``req`` be released at once (an upstream serving it has room, or none serves it)?"""
        serving = [u for u in self.state.upstreams if u.healthy and u.serves(req.routed.model)]
        return not serving or any(self.has_room(u) for u in serving)

    def unreserve(self, u) -> None:
        """A released request was sent (or given up): its place on ``u`` is no longer held for it."""
        if self.reserved.get(u.index, 0) > 0:
            self.reserved[u.index] -= 1

    # -- the queue -------------------------------------------------------------------
    async def wait(self, req, band: int, flow) -> None:
        """Hold ``req`` until an upstream has room; pin it there (``req.pinned``). Raises a 429
        ``APIError`` if the queue is full or the request waits past the timeout."""
        if self.queue.full() and not (len(self.queue) == 0 and self._can_go(req)):
            self.rejected_full += 1
            self.state.metrics.rejected.labels("flow_queue_full").inc()
            raise APIError(429, f"flow control: {self.control.max_queued} requests already wait at the router "
                                "(--flow-max-queued); retry later", type="rate_limit_error",
                           code="flow_control_queue_full", headers={"Retry-After": "1"})
        held = _Held(req, asyncio.get_running_loop().create_future())
        self.queue.push(held, band, flow, time.monotonic())
        self.held_total += 1
        self.pump()
        try:
            if held.future.done():
                return
            await asyncio.wait_for(asyncio.shield(held.future), self.control.queue_timeout_s)
        except asyncio.TimeoutError:
            if held.future.done():             # released just as its time ran out: it goes
                return
            held.gone = True
            self.timed_out += 1
            self.state.metrics.rejected.labels("flow_timeout").inc()
            raise APIError(429, f"flow control: held at the router for {self.control.queue_timeout_s:g} s "
                                "(--flow-queue-timeout) and no upstream had room; retry later",
                           type="rate_limit_error", code="flow_control_timeout",
                           headers={"Retry-After": "1"}) from None
        except BaseException:                  # the client left while held
            held.gone = True
            if held.future.done() and not held.future.cancelled() and held.future.result() is not None:
                self.unreserve(held.future.result())
            raise
        finally:
            self._drop_gone()

    def _drop_gone(self) -> None:
        while len(self.queue) and self.queue.peek().gone:
            self.queue.pop()
        self.pump()

    def pump(self) -> None:
        """Release held requests, next first (band, then fairness, then FCFS), while an upstream
        serving the next one has room; each is pinned to the upstream the policy picks."""
        while len(self.queue):
            held = self.queue.peek()
            if held.gone:
                self.queue.pop()
                continue
            req = held.req
            serving = [u for u in self.state.upstreams if u.healthy and u.serves(req.routed.model)]
            if serving:
                room = [u for u in serving if self.has_room(u)]
                if not room:
                    return
                u = self.state.choose(req, among=room)
                self.reserved[u.index] += 1
            else:
                u = None                       # no healthy upstream serves it: send() answers 503
            self.queue.pop()
            req.pinned = u
            held.future.set_result(u)

    def describe(self) -> dict:
        return {"held": len(self.queue), "held_total": self.held_total, "released": self.queue.released,
                "timed_out": self.timed_out, "rejected_full": self.rejected_full,
                "reserved": dict(self.reserved)}
