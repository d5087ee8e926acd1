"""Multi-model clusters: a request goes to a replica serving its model, or is rejected with a clear reason."""

from __future__ import annotations

import pytest

from minibatch import cluster
from minibatch.workload import RequestSpec, Workload

SIM = {"executor": "sim", "hardware": "a100-80g"}


def _workload():
    asks = ["llama-2-7b", "qwen3-0.6b", "llama-2-7b", None, "gpt-9", "llama-2-7b", "qwen3-0.6b", "llama-2-7b"]
    return Workload([RequestSpec(0.01 * i, 24, 4, request_id=f"q{i}", model=m) for i, m in enumerate(asks)])


def test_requests_go_to_replicas_serving_their_model():
    res = cluster.run(_workload(), models=["llama-2-7b", "qwen3-0.6b", "llama-2-7b"], router="round_robin", **SIM)
    assert res.models == ["llama-2-7b", "qwen3-0.6b", "llama-2-7b"]
    assert [r.config["model"] for r in res.replicas] == res.models
    where = {r.request_id: r.replica for r in res.requests}
    # llama requests take turns between replicas 0 and 2 (their own round-robin counter); qwen ones
    # always go to replica 1; the one with no model may go anywhere (the all-replica turn: 0).
    assert [where[f"q{i}"] for i in (0, 2, 5, 7)] == [0, 2, 0, 2]
    assert where["q1"] == where["q6"] == 1
    assert where["q3"] == 0
    for r in res.requests:
        assert r.model == _workload()[int(r.request_id[1:])].model


def test_a_model_no_replica_serves_is_rejected_with_a_clear_error():
    res = cluster.run(_workload(), models={"llama-2-7b": 2, "qwen3-0.6b": 1}, router="least_requests", **SIM)
    assert res.models == ["llama-2-7b", "llama-2-7b", "qwen3-0.6b"]
    bad = next(r for r in res.requests if r.request_id == "q4")
    assert bad.finish_reason == "rejected" and bad.replica is None and bad.model == "gpt-9"
    assert bad.error == "no replica serves model 'gpt-9'; the cluster serves ['llama-2-7b', 'qwen3-0.6b']"
    assert bad.finish_time == bad.arrival_time == pytest.approx(0.04)
    others = [r for r in res.requests if r.request_id != "q4"]
    assert all(r.finish_reason == "length" for r in others)     # the others are served as usual
    s = res.summary()
    assert s["num_requests"] == 8 and s["completed"] == 7 and s["rejected"] == 1
    assert s["rejected_reasons"] == {"no replica serves the model": 1}
    assert sum(s["routed"]) == 7
    for r in others:
        if r.model == "qwen3-0.6b":
            assert r.replica == 2
        elif r.model == "llama-2-7b":
            assert r.replica in (0, 1)


def test_models_must_match_the_number_of_replicas():
    with pytest.raises(ValueError, match="replicas=2 but models= names 3 replicas"):
        cluster.run(_workload(), replicas=2, models=["a", "b", "c"], **SIM)


def test_multi_tenant_workload_ties_each_tenant_to_its_system_prompt():
    from minibatch.workload import multi_tenant

    wl = multi_tenant(40, rate=10.0, num_tenants=4, system_prompt_len=64, question_len=8, output_len=4, seed=1)
    assert {r.tenant for r in wl} == {f"tenant-{r.prefix_id}" for r in wl}
    for r in wl:
        same = [o for o in wl if o.tenant == r.tenant]
        assert all(o.prompt_token_ids[:64] == r.prompt_token_ids[:64] for o in same)
        assert r.prompt_len == 72
