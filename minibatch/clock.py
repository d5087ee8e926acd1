"""Two clocks, one set of metric definitions.

``WallClock`` is real time (the server, live dashboards). ``VirtualClock`` only moves
when told: each step advances it by the step's measured or modelled duration and idle
gaps jump straight to the next arrival, so a replay is deterministic and runs as fast
as the machine allows.
"""

from __future__ import annotations

import time


class WallClock:
    virtual = False

    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, seconds: float) -> None:
        """Real time advances by itself."""

    def advance_to(self, t: float) -> None:
        """Sleep until ``t`` (used when a replay waits for the next arrival)."""
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    virtual = True

    def __init__(self, start: float = 0.0):
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._t += seconds

    def advance_to(self, t: float) -> None:
        if t > self._t:
            self._t = t


def make_clock(clock) -> WallClock | VirtualClock:
    if isinstance(clock, (WallClock, VirtualClock)):
        return clock
    if clock in ("wall", "real"):
        return WallClock()
    if clock == "virtual":
        return VirtualClock()
    raise ValueError(f"unknown clock {clock!r}; expected 'wall' or 'virtual'")
