"""minibatch.runner: runs collect the young generation less often, and put the thresholds back."""

import gc

import pytest

from minibatch import cluster
from minibatch.runner import RUN_THRESHOLDS, fewer_gc_passes
from minibatch.runner import run
from minibatch.workload import synthetic

SIM = dict(executor="sim", model="llama-2-7b", hardware="a10")


@pytest.fixture
def default_thresholds():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield (700, 10, 10)
    gc.set_threshold(*old)


def test_a_run_and_a_cluster_run_use_the_run_thresholds_and_restore_them(default_thresholds):
    seen = []
    wl = synthetic(6, 50.0, input_len=32, output_len=4, seed=0)
    run(wl, **SIM, on_step=lambda e, st: seen.append(gc.get_threshold()))
    assert seen and set(seen) == {RUN_THRESHOLDS}
    assert gc.get_threshold() == default_thresholds
    seen.clear()
    cluster.run(wl, replicas=2, **SIM, on_step=lambda i, e, st: seen.append(gc.get_threshold()))
    assert seen and set(seen) == {RUN_THRESHOLDS}
    assert gc.get_threshold() == default_thresholds


def test_nested_and_failing_runs_restore_the_outer_thresholds(default_thresholds):
    with fewer_gc_passes():
        with fewer_gc_passes():
            assert gc.get_threshold() == RUN_THRESHOLDS
        assert gc.get_threshold() == RUN_THRESHOLDS, "the inner exit must not restore while the outer runs"
    assert gc.get_threshold() == default_thresholds

    def boom(engine, step):
        raise RuntimeError("on_step failed")

    with pytest.raises(RuntimeError, match="on_step failed"):
        run(synthetic(3, 50.0, input_len=32, output_len=4, seed=0), **SIM, on_step=boom)
    assert gc.get_threshold() == default_thresholds
