import pytest

from minibatch.labs.forbid import forbid_calls


class Ref:
    def choose(self, x):
        return x + 1


class Cheat:
    def choose(self, x):
        return Ref().choose(x)


class Own:
    def choose(self, x):
        return x + 1


def test_delegating_solution_is_caught_and_method_restored():
    with pytest.raises(AssertionError, match=r"Ref\.choose ran inside yours"):
        with forbid_calls((Ref, "choose")):
            Cheat().choose(1)
    assert Ref.__dict__["choose"].__name__ == "choose"


def test_own_solution_passes():
    with forbid_calls((Ref, "choose")):
        assert Own().choose(1) == 2


def test_router_methods_cover_every_shipped_router_and_no_learner_class():
    from minibatch.labs.forbid import router_methods
    from minibatch.routing import routers

    names = {cls.__name__ for cls, _ in router_methods()}
    assert {"RoundRobin", "Random", "LeastRequests", "LeastKV", "PowerOfTwo", "Session", "PrefixAware",
            "KVAware"} <= names
    assert "Router" not in names

    class Mine(routers.Session):            # a learner's subclass: its inherited choose is caught
        pass

    with pytest.raises(AssertionError, match=r"Session\.choose ran inside yours"):
        with forbid_calls(*router_methods()):
            _call_session(Mine())
    assert _call_session(Mine()) == 0          # restored afterwards


def _call_session(router):
    from minibatch.routing.view import ReplicaView
    from minibatch.workload import RequestSpec

    view = ReplicaView(0, "m", 0, 0, 0, 100, 16, 0, 0, 0)
    return router.choose(RequestSpec(0.0, 4, 4, tenant="t"), [view], 0.0)
