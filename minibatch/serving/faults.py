"""Fault injection for ``minibatch serve`` (off by default): slow replies, errors, cut streams.

Chapter 29 and the router's tests need replicas that misbehave on demand. A server started
with ``--enable-fault-injection`` answers ``POST /admin/fault`` (from a loopback client
only: anyone else gets 403) with one of these bodies, which replaces the fault in force:

=====================================================  ==========================================
``{"kind": "none"}``                                   behave normally again
``{"kind": "slow", "delay_s": 0.05}``                  wait ``delay_s`` before a generation
                                                       enters the engine, and again before every
                                                       streamed event
``{"kind": "error", "rate": 1.0, "status": 500}``      answer that fraction of generation requests
                                                       with ``status`` (5xx, OpenAI error shape)
                                                       before any work; draws from
                                                       ``random.Random(seed)`` (``"seed"``, 0)
``{"kind": "cut_stream", "after_tokens": 5}``          drop the connection of a streamed answer
                                                       once it has sent ``after_tokens`` tokens
                                                       (no ``[DONE]``: what a crash looks like to
                                                       a client); ``"count": N`` cuts only the
                                                       next N streams
=====================================================  ==========================================

``GET /admin/fault`` shows the fault in force. Killing a replica is done by killing its
process. The fault touches only ``/v1`` generations; ``/health`` and ``/metrics`` answer as
usual, as they would on a real replica that is slow or failing requests.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from minibatch.serving.protocol import APIError

KINDS = ("none", "slow", "error", "cut_stream")


class StreamCut(Exception):
    """Raised inside a streamed answer to drop its connection (the ASGI server closes it)."""


@dataclass
class Fault:
    kind: str = "none"
    delay_s: float = 0.0
    rate: float = 1.0
    status: int = 500
    after_tokens: int = 0
    count: int | None = None          # cut_stream: how many more streams to cut (None: all)
    seed: int = 0


def _number(body: dict, name: str, default, lo: float, hi: float | None = None, integer: bool = False):
    value = body.get(name, default)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'} {rng}, got {value!r}",
                       param=name)
    return value


def parse_fault(body) -> Fault:
    """A :class:`Fault` from an ``/admin/fault`` body; a 400 naming the bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "the fault must be a JSON object with a 'kind'")
    kind = body.get("kind")
    if kind not in KINDS:
        raise APIError(400, f"'kind' must be one of {list(KINDS)}, got {kind!r}", param="kind")
    f = Fault(kind=kind, seed=_number(body, "seed", 0, 0, integer=True))
    if kind == "slow":
        f.delay_s = float(_number(body, "delay_s", 0.05, 0, 60))
    elif kind == "error":
        f.rate = float(_number(body, "rate", 1.0, 0, 1))
        f.status = _number(body, "status", 500, 500, 599, integer=True)
    elif kind == "cut_stream":
        f.after_tokens = _number(body, "after_tokens", 1, 0, integer=True)
        if body.get("count") is not None:
            f.count = _number(body, "count", None, 1, integer=True)
    return f


class FaultInjector:
    """The fault in force and the decisions it makes, one call per request or event."""

    def __init__(self):
        self.fault = Fault()
        self._rng = random.Random(0)

    def set(self, fault: Fault) -> None:
        self.fault = fault
        self._rng = random.Random(fault.seed)

    def describe(self) -> dict:
        return asdict(self.fault)

    def delay_s(self) -> float:
        return self.fault.delay_s if self.fault.kind == "slow" else 0.0

    def maybe_fail(self) -> None:
        """Raise the injected error for this request, if it is drawn."""
        f = self.fault
        if f.kind == "error" and self._rng.random() < f.rate:
            raise APIError(f.status, f"injected fault: this replica answers {f.status} "
                                     "(POST /admin/fault {\"kind\": \"none\"} to stop)",
                           type="server_error", code="injected_fault")

    def cut_after(self) -> int | None:
        """For a new stream: the number of tokens after which to cut it, or None."""
        f = self.fault
        if f.kind != "cut_stream" or f.count == 0:
            return None
        if f.count is not None:
            f.count -= 1
        return f.after_tokens
