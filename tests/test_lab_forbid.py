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
