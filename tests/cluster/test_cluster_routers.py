"""Each router's rule on small hand-made ReplicaView states; expected choices worked out by hand."""

from __future__ import annotations

import pytest

from minibatch import cluster
from minibatch.cluster import ReplicaView, routers
from minibatch.workload import RequestSpec, Workload


def V(index, running=0, waiting=0, used=0, total=100, bs=16, tokens=0, active=0, cached=0, model="m"):
    return ReplicaView(index, model, running, waiting, used, total, bs, tokens, active, cached)


def req(n=32, ids=None, tenant=None, model=None):
    return RequestSpec(0.0, n if ids is None else len(ids), 4, prompt_token_ids=ids, tenant=tenant, model=model)


def test_registry():
    assert set(routers.available()) >= {"round_robin", "random", "least_requests", "least_kv", "power_of_two",
                                        "session", "prefix_aware", "kv_aware"}
    assert isinstance(routers.get("kv_aware", temperature=0.5), routers.KVAware)
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        routers.get("nope")


def test_round_robin_takes_turns_per_set_of_replicas():
    r = routers.get("round_robin")
    three = [V(0), V(1), V(2)]
    other = [V(3, model="b"), V(4, model="b")]
    assert [r.choose(req(), three, 0.0) for _ in range(4)] == [0, 1, 2, 0]
    assert [r.choose(req(), other, 0.0) for _ in range(3)] == [0, 1, 0]   # its own counter
    assert r.choose(req(), three, 0.0) == 1


def test_random_is_seeded():
    # random.Random(0).randrange(3) draws 1, 1, 0, 1, 2, 1
    r = routers.get("random", seed=0)
    assert [r.choose(req(), [V(0), V(1), V(2)], 0.0) for _ in range(6)] == [1, 1, 0, 1, 2, 1]


def test_least_requests_counts_running_plus_waiting():
    views = [V(0, running=2, waiting=1), V(1, running=0, waiting=1), V(2, running=1)]
    assert routers.get("least_requests").choose(req(), views, 0.0) == 1   # loads 3, 1, 1: first of the ties


def test_least_kv_then_fewer_requests():
    views = [V(0, used=50), V(1, used=20, running=5), V(2, used=20, running=2), V(3, used=30)]
    assert routers.get("least_kv").choose(req(), views, 0.0) == 2          # 20% twice: 2 has fewer requests
    assert routers.get("least_kv").choose(req(), [V(0, used=5, total=10), V(1, used=40, total=100)], 0.0) == 1


def test_power_of_two_compares_its_sampled_pair():
    # random.Random(0).randrange(4) draws 3, 3, 0, 2, 3, ...: the first pair is (3, 0) (the second 3
    # equals the first and is drawn again), the second pair (2, 3).
    r = routers.get("power_of_two", seed=0)
    views = [V(0, running=1), V(1), V(2, running=4), V(3, running=2)]
    assert r.choose(req(), views, 0.0) == 0          # pair (3, 0): loads 2 vs 1
    assert r.choose(req(), views, 0.0) == 3          # pair (2, 3): loads 4 vs 2; replica 1 (load 0) not drawn
    tie = routers.get("power_of_two", seed=0)
    assert tie.choose(req(), [V(0), V(1), V(2), V(3)], 0.0) == 3   # equal loads: the first drawn
    assert routers.get("power_of_two").choose(req(), [V(7)], 0.0) == 0


def test_session_is_sticky_by_tenant():
    r = routers.get("session")
    assert r.choose(req(tenant="alice"), [V(0, running=3), V(1, running=1), V(2, running=2)], 0.0) == 1
    # alice stays on replica 1 though it is now the busiest
    assert r.choose(req(tenant="alice"), [V(0), V(1, running=9), V(2)], 0.0) == 1
    assert r.choose(req(tenant="bob"), [V(0, running=2), V(1, running=9), V(2, running=1)], 0.0) == 2
    assert r.choose(req(tenant="bob"), [V(0), V(1), V(2, running=7)], 0.0) == 2
    assert r.choose(req(), [V(0, running=2), V(1, running=9), V(2, running=1)], 0.0) == 2  # no tenant: least loaded
    # alice's replica is not among the candidates (another model): a new home among these
    assert r.choose(req(tenant="alice", model="b"), [V(5, running=1, model="b"), V(6, model="b")], 0.0) == 1


PROMPT = list(range(1000, 1100))                       # 100 tokens


def _prefix_router(**kw):
    r = routers.get("prefix_aware", **kw)
    r.tree(0).insert(PROMPT)                           # replica 0 was sent PROMPT before
    return r


def test_prefix_aware_defaults_are_sglangs_launcher_defaults():
    r = routers.get("prefix_aware")
    assert (r.cache_threshold, r.balance_abs_threshold, r.balance_rel_threshold) == (0.3, 64, 1.5)


def test_prefix_aware_balances_when_both_thresholds_are_crossed():
    r = _prefix_router()
    ids = PROMPT[:90] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]      # 90% match on replica 0
    # loads 100 vs 10: 100 - 10 = 90 > 64 and 100 > 1.5 * 10: imbalanced -> least loaded
    assert r.choose(req(ids=ids), [V(0, running=100), V(1, running=10)], 0.0) == 1
    assert r.last_decision == "balance"
    assert r.tree(1).match(ids) == 100                 # the prompt went into replica 1's tree
    # loads 300 vs 230: 70 > 64 but 300 < 1.5 * 230 = 345: balanced -> the cache rule, 90% > 30%
    r = _prefix_router()
    assert r.choose(req(ids=ids), [V(0, running=300), V(1, running=230)], 0.0) == 0
    assert r.last_decision == "cache_hit"
    # loads 60 vs 0: 60 > 1.5 * 0 but 60 - 0 < 64: balanced
    r = _prefix_router()
    assert r.choose(req(ids=ids), [V(0, running=60), V(1)], 0.0) == 0


def test_prefix_aware_cache_threshold_both_ways():
    others = list(range(5000, 5100))
    above = PROMPT[:31] + others[:69]                  # 31/100 > 0.3: the best match
    at = PROMPT[:30] + others[:70]                     # 30/100 is not > 0.3: the smallest tree
    r = _prefix_router()
    assert r.choose(req(ids=above), [V(0), V(1)], 0.0) == 0 and r.last_decision == "cache_hit"
    r = _prefix_router()
    assert r.choose(req(ids=at), [V(0), V(1)], 0.0) == 1 and r.last_decision == "cache_miss"
    # the smallest tree, not the least loaded: replica 1 holds 100 tokens, replica 2 holds 40
    r = _prefix_router()
    r.tree(1).insert(list(range(7000, 7100)))
    r.tree(2).insert(list(range(8000, 8040)))
    assert r.choose(req(ids=at), [V(0), V(1), V(2, running=5)], 0.0) == 2
    assert len(r.tree(2)) == 40 + 100                  # the new prompt is now in replica 2's tree
    # a lower threshold turns the same request into a hit
    r = _prefix_router(cache_threshold=0.2)
    assert r.choose(req(ids=at), [V(0), V(1)], 0.0) == 0


def test_kv_aware_cost():
    # prompt 64 tokens = 4 blocks of 16. Replica 0: 48 tokens cached, 10 active blocks;
    # replica 1: nothing cached, 2 active blocks.
    #   weight 1: r0 = 1 * (64-48)/16 + (10 + 4-3) = 1 + 11 = 12;  r1 = 1 * 64/16 + (2 + 4) = 10 -> r1
    #   weight 3: r0 = 3 + 11 = 14;  r1 = 12 + 6 = 18 -> r0
    views = [V(0, cached=48, active=10), V(1, active=2)]
    r = routers.get("kv_aware")
    assert (r.kv_overlap_score_weight, r.temperature) == (1.0, 0.0)    # Dynamo 0.5.0's defaults
    assert [r.logit(req(64), v) for v in views] == [12.0, 10.0]
    assert r.choose(req(64), views, 0.0) == 1
    r3 = routers.get("kv_aware", kv_overlap_score_weight=3.0)
    assert [r3.logit(req(64), v) for v in views] == [14.0, 18.0]
    assert r3.choose(req(64), views, 0.0) == 0
    # A prompt that is not a whole number of blocks: 40 tokens = 2.5 blocks, 3 blocks to hold.
    # 32 cached: prefill = 8/16 = 0.5, new blocks = 3 - 2 = 1.
    assert r.logit(req(40), V(0, cached=32, active=5)) == 0.5 + 5 + 1


def test_kv_aware_temperature_samples_dynamos_softmax():
    # logits 12 and 10, range 2: weights softmax(-12/2, -10/2) = softmax(-6, -5) at T = 1:
    # p0 = e^-1 / (1 + e^-1) = 0.26894...; random.Random(0).random() = 0.84442 > p0 -> position 1.
    views = [V(0, cached=48, active=10), V(1, active=2)]
    r = routers.get("kv_aware", temperature=1.0, seed=0)
    assert r.probabilities([12.0, 10.0]) == pytest.approx([0.2689414213699951, 0.7310585786300049])
    assert r.probabilities([3.0, 3.0, 3.0]) == pytest.approx([1 / 3] * 3)
    assert r.choose(req(64), views, 0.0) == 1
    picks = [routers.get("kv_aware", temperature=1.0, seed=s).choose(req(64), views, 0.0) for s in range(200)]
    assert 0.15 < picks.count(0) / 200 < 0.4          # about p0 of them go to the costlier replica


def test_a_learner_registers_a_router_in_a_few_lines():
    @routers.register
    class FewestTokens(routers.Router):
        name = "test_fewest_tokens"

        def choose(self, request, replicas, now):
            return min(range(len(replicas)), key=lambda i: replicas[i].in_flight_tokens)

    try:
        assert "test_fewest_tokens" in routers.available()
        wl = Workload([RequestSpec(0.0, 400, 50, request_id="big")] +
                      [RequestSpec(0.001 * (i + 1), 10, 5, request_id=f"s{i}") for i in range(3)])
        res = cluster.run(wl, replicas=2, router="test_fewest_tokens", executor="sim", model="llama-2-7b",
                          hardware="a100-80g")
        assert [r.replica for r in res.requests] == [0, 1, 1, 1]   # the big one keeps replica 0 busiest
    finally:
        routers.ROUTERS.classes.pop("test_fewest_tokens")
