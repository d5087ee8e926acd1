"""Guard against delegation in lab tasks: fail when a learner's code calls a reference implementation.

Usage in a check cell::

    with forbid_calls(LeastRequests.choose, owner=LeastRequests):
        result = run_learner_code()

Any call of a forbidden method while the block runs is recorded; on exit an AssertionError names it.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def forbid_calls(*targets: tuple[type, str], what: str = "write your own rule"):
    """Patch each (class, method name) in targets to record calls; raise AssertionError if any ran."""
    calls: list[str] = []
    saved = []
    for cls, name in targets:
        original = cls.__dict__[name]
        saved.append((cls, name, original))

        def spy(self, *a, __orig=original, __label=f"{cls.__name__}.{name}", **k):
            calls.append(__label)
            return __orig(self, *a, **k)

        setattr(cls, name, spy)
    try:
        yield calls
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
    assert not calls, f"{what}: {', '.join(sorted(set(calls)))} ran inside yours"


def router_methods() -> list[tuple[type, str]]:
    """(class, "choose") for every router minibatch ships: what lab L10's tasks must not delegate to.

    The learner's classes live in their notebook, not in ``minibatch.routing.routers``, so they are
    never among these.
    """
    from minibatch.routing import routers

    return [(c, "choose") for c in vars(routers).values()
            if isinstance(c, type) and issubclass(c, routers.Router) and c is not routers.Router and "choose" in c.__dict__]
