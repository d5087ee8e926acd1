"""Scheduling policies, registered by name.

``available()`` lists them; ``make_policy(name)`` builds one; ``@register`` adds your own.
"""

from minibatch.policies.base import Policy, SchedulerState, available, make_policy, register
from minibatch.policies import continuous  # noqa: F401  (registers)

__all__ = ["Policy", "SchedulerState", "available", "make_policy", "register"]
