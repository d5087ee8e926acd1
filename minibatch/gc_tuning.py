"""Fewer garbage-collector passes while a run replays a workload.

A simulated run allocates hundreds of thousands of short-lived objects (requests, step records,
block-table entries) and almost no reference cycles. With CPython's default thresholds
(700, 10, 10) the cyclic collector runs every 700 net allocations and, every hundred of those,
walks every object the kernel holds, including the results of all earlier runs in a notebook:
a quarter of a simulated cluster run's time went to it (chapter 27's runs: 21.3 s with the
defaults against 17.1 s with these thresholds, ``benchmarks/``-style A/B in one process). Inside
:func:`fewer_gc_passes` the young generation is collected every 100,000 allocations instead;
nothing is disabled, and the old thresholds come back when the outermost run ends (runs may
nest, e.g. a cluster run's replicas, or run in threads).
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from functools import wraps

RUN_THRESHOLDS = (100_000, 50, 100)

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_gc_passes():
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(*RUN_THRESHOLDS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None


def with_fewer_gc_passes(fn):
    """Decorator: ``fn`` runs inside :func:`fewer_gc_passes`."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        with fewer_gc_passes():
            return fn(*args, **kwargs)
    return wrapper
