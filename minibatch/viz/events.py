"""A small event log on an engine's event stream, for figures that need event times."""

from __future__ import annotations


class EventLog:
    """Records ``(time, event, request_id)`` for the chosen event kinds of an engine.

    ``EventLog(engine)`` keeps preemptions (what ``gantt`` needs and ``RunResult`` lacks);
    pass it to a run as ``result.extra["events"] = log.events`` or to ``gantt(events=...)``.
    """

    def __init__(self, engine=None, kinds=("preempt",)):
        self.kinds = frozenset(kinds)
        self.events: list[tuple[float, str, str]] = []
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> "EventLog":
        engine.subscribe(self)
        return self

    def __call__(self, event: str, time: float, req, info: dict) -> None:
        if event in self.kinds:
            self.events.append((float(time), event, req.request_id))
