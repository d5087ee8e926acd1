"""With the real (tiny) model and greedy sampling, every router gives every request the tokens
a single engine gives it: where a request runs changes when, never what."""

from __future__ import annotations

import dataclasses

import pytest

from minibatch import cluster, run
from minibatch.cluster import routers
from minibatch.workload import shared_prefix, uniform
from tests.cluster.helpers import tiny_engine

ENGINE = {"max_num_seqs": 4, "enable_prefix_caching": True, "block_size": 8, "num_kv_blocks": 128}


@pytest.fixture(scope="module")
def workload_and_reference():
    # Three tenants' system prompts; ids are made for the tiny model's vocabulary by the run.
    wl = shared_prefix(10, rate=30.0, num_prefixes=3, prefix_len=40, suffix_len=uniform(4, 16),
                       output_len=uniform(2, 8), seed=5, tenants=["a", "b", "c"])
    wl = type(wl)([dataclasses.replace(r, prompt_token_ids=None) for r in wl], name=wl.name)
    single = run(wl, engine=tiny_engine(**ENGINE))
    return wl, {r.request_id: r.output_token_ids for r in single.requests}


@pytest.mark.parametrize("name", routers.available())
def test_every_router_gives_a_single_engines_tokens(name, workload_and_reference):
    wl, reference = workload_and_reference
    res = cluster.run(wl, engines=[tiny_engine(**ENGINE) for _ in range(2)], router=name)
    assert {r.request_id: r.output_token_ids for r in res.requests} == reference
    assert all(r.finish_reason == "length" for r in res.requests)
    assert sum(res.summary()["routed"]) == len(wl)
