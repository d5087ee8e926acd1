"""Name -> class registries, one per pluggable kind: scheduling policies here, routers in ``minibatch.cluster``.

    POLICIES = Registry(Policy, "scheduling policy", "policies")

    @POLICIES.register                     # under the class's ``name``
    class MyPolicy(Policy):
        name = "mine"

    POLICIES.available()                   # sorted names
    POLICIES.make("mine", **kwargs)        # an instance (a class or an instance also work)
"""

from __future__ import annotations

from collections.abc import Callable


class Registry:
    """Classes derived from ``base``, by name. ``kind`` and ``plural`` word the errors."""

    def __init__(self, base: type, kind: str, plural: str):
        self.base, self.kind, self.plural = base, kind, plural
        self.classes: dict[str, type] = {}

    def register(self, cls: type | None = None, *, name: str | None = None) -> Callable:
        """Class decorator: ``@register`` adds a class under its ``name`` (or ``name=``)."""

        def wrap(c: type) -> type:
            key = name or c.name
            if not key:
                raise ValueError(f"{self.kind} class {c.__name__} has no name")
            c.name = key
            self.classes[key] = c
            return c

        return wrap(cls) if cls is not None else wrap

    def available(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self.classes)

    def make(self, obj, **kwargs):
        """An instance from a name, a class (built with ``kwargs``) or an instance (returned as is)."""
        if isinstance(obj, self.base):
            return obj
        if isinstance(obj, type) and issubclass(obj, self.base):
            return obj(**kwargs)
        if obj not in self.classes:
            raise ValueError(f"unknown {self.kind} {obj!r}; available {self.plural}: {self.available()}")
        return self.classes[obj](**kwargs)
