"""Gateway flow control (minibatch.cluster.flow_control): requests held at the router by priority
band and tenant fairness until a replica has room, one rule per test."""

from __future__ import annotations

import pytest

from minibatch import cluster
from minibatch.cluster.flow_control import FlowControl, FlowQueue
from minibatch.workload import RequestSpec, Workload, synthetic, uniform
from tests.cluster.helpers import record_dicts, tiny_engine

SIM = {"executor": "sim", "model": "llama-2-7b", "hardware": "a100-80g"}


def _req(t, rid, priority=0, tenant=None, prompt=64, out=8):
    return RequestSpec(t, prompt, out, priority=priority, tenant=tenant, request_id=rid)


def _start_order(res):
    """Request ids in the order their first step was scheduled."""
    done = [r for r in res.requests if r.first_scheduled_time is not None]
    return [r.request_id for r in sorted(done, key=lambda r: (r.first_scheduled_time, r.request_id))]


def test_the_most_urgent_band_is_released_first():
    # One replica with room for one request: 'lo' requests came first, then one urgent one.
    wl = Workload([_req(0.0, f"lo{i}", priority=1) for i in range(4)] + [_req(0.001, "hi", priority=0)])
    fc = cluster.run(wl, replicas=1, **SIM, flow_control=FlowControl(max_requests_per_replica=1))
    order = _start_order(fc)
    assert order[:2] == ["lo0", "hi"]                 # hi overtakes lo1..lo3, held at the router
    plain = cluster.run(wl, replicas=1, **SIM, max_num_seqs=1)
    assert _start_order(plain)[-1] == "hi"            # queued inside the engine (FCFS), it waits last


def test_round_robin_keeps_a_heavy_tenant_from_starving_a_light_one():
    wl = Workload([_req(0.0, f"A{i}", tenant="A") for i in range(10)]
                  + [_req(0.001, f"B{i}", tenant="B") for i in range(2)])
    rr = cluster.run(wl, replicas=1, **SIM, flow_control=FlowControl(max_requests_per_replica=1))
    assert _start_order(rr)[:5] == ["A0", "B0", "A1", "B1", "A2"]     # turns alternate between tenants
    strict = cluster.run(wl, replicas=1, **SIM,
                         flow_control=FlowControl(max_requests_per_replica=1, fairness="fcfs"))
    assert _start_order(strict)[-2:] == ["B0", "B1"]                  # global FCFS: B waits for all of A
    ttft_b = {name: max(r.ttft for r in res.requests if r.tenant == "B")
              for name, res in (("rr", rr), ("fcfs", strict))}
    assert ttft_b["rr"] < ttft_b["fcfs"] / 3


def test_a_held_request_is_released_at_the_end_of_the_step_that_freed_room():
    wl = Workload([_req(0.0, f"r{i}", out=4) for i in range(6)])
    seen = []

    def on_step(i, engine, step):
        seen.append(engine.num_running + engine.num_waiting)

    res = cluster.run(wl, replicas=2, **SIM, on_step=on_step,
                      flow_control=FlowControl(max_requests_per_replica=2))
    assert max(seen) <= 2                              # never more than the bound on a replica
    by_id = {r.request_id: r for r in res.requests}
    finishes = sorted(r.finish_time for r in res.requests)
    for rid in ("r4", "r5"):                           # held: released when an earlier one finished
        assert by_id[rid].first_scheduled_time == pytest.approx(min(finishes), abs=1e-9)
        assert res.extra["flow_control"]["held_wait"][rid] == pytest.approx(min(finishes), abs=1e-9)
    assert res.extra["flow_control"]["max_held"] == 2


def test_no_request_is_lost_and_every_wait_counts_in_ttft():
    wl = synthetic(60, rate=40.0, input_len=uniform(16, 200), output_len=uniform(4, 40), seed=2)
    wl = Workload([RequestSpec(r.arrival_time, r.prompt_len, r.max_tokens, priority=i % 3,
                               tenant=f"t{i % 5}") for i, r in enumerate(wl)])
    res = cluster.run(wl, replicas=3, router="least_requests", **SIM,
                      flow_control=FlowControl(max_requests_per_replica=3))
    assert len(res.requests) == 60 and len({r.request_id for r in res.requests}) == 60
    assert all(r.finish_reason == "length" and r.output_len == s.max_tokens
               for r, s in zip(res.requests, wl))
    assert [r.arrival_time for r in res.requests] == [s.arrival_time for s in wl]
    waits = res.extra["flow_control"]["held_wait"]
    assert max(waits.values()) > 0
    for r in res.requests:                             # the router's wait is part of the TTFT
        assert r.first_scheduled_time >= r.arrival_time + waits[r.request_id] - 1e-9


def test_a_generous_bound_changes_nothing():
    wl = synthetic(40, rate=10.0, input_len=uniform(8, 60), output_len=uniform(2, 12), seed=1)
    plain = cluster.run(wl, replicas=2, router="least_requests", **SIM)
    fc = cluster.run(wl, replicas=2, router="least_requests", **SIM,
                     flow_control=FlowControl(max_requests_per_replica=10_000))
    assert record_dicts(fc.requests) == record_dicts(plain.requests)
    assert [r.replica for r in fc.requests] == [r.replica for r in plain.requests]


def test_timeout_and_full_queue_reject_with_the_reason():
    wl = Workload([_req(0.0, f"r{i}", out=200) for i in range(5)])
    res = cluster.run(wl, replicas=1, **SIM,
                      flow_control=FlowControl(max_requests_per_replica=1, max_queued=3, queue_timeout_s=0.05))
    by_id = {r.request_id: r for r in res.requests}
    assert by_id["r0"].finish_reason == "length"
    assert by_id["r4"].finish_reason == "rejected" and "max_queued" in by_id["r4"].error
    for rid in ("r1", "r2", "r3"):                     # held, r0 still running after 0.05 s: timed out
        r = by_id[rid]
        assert r.finish_reason == "rejected" and "queue_timeout_s" in r.error
        assert r.finish_time == pytest.approx(0.05)
    assert res.extra["flow_control"]["rejected"] == 4


def test_greedy_tokens_are_the_same_with_flow_control():
    wl = synthetic(8, rate=50.0, input_len=uniform(4, 24), output_len=uniform(2, 8), seed=4)
    wl = Workload([RequestSpec(r.arrival_time, r.prompt_len, r.max_tokens, priority=i % 2,
                               tenant=f"t{i % 3}") for i, r in enumerate(wl)])
    plain = cluster.run(wl, engines=[tiny_engine(num_kv_blocks=128) for _ in range(2)])
    fc = cluster.run(wl, engines=[tiny_engine(num_kv_blocks=128) for _ in range(2)],
                     flow_control=FlowControl(max_requests_per_replica=1))
    assert max(fc.extra["flow_control"]["held_wait"].values()) > 0        # some really waited
    assert {r.request_id: r.output_token_ids for r in fc.requests} == \
           {r.request_id: r.output_token_ids for r in plain.requests}


@pytest.mark.parametrize("kw, field", [({"max_requests_per_replica": 0}, "max_requests_per_replica"),
                                       ({"max_kv_usage": 1.5}, "max_kv_usage"),
                                       ({"fairness": "lottery"}, "fairness"),
                                       ({"queue_timeout_s": 0}, "queue_timeout_s"),
                                       ({"max_queued": -1}, "max_queued")])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        FlowControl(**kw)


def test_flow_queue_orders_band_then_round_robin_then_fcfs():
    q = FlowQueue(FlowControl())
    for item, band, flow in [("a1", 1, "a"), ("a2", 1, "a"), ("b1", 1, "b"), ("u1", 0, "u"), ("a3", 1, "a")]:
        q.push(item, band, flow, 0.0)
    assert [q.pop() for _ in range(5)] == ["u1", "a1", "b1", "a2", "a3"]
    assert q.pop() is None and len(q) == 0


# -- the HTTP router's flow control (minibatch.serving.flow) -----------------------------------------
def _router_state(cap=1, n=1, **kw):
    from minibatch.serving.router import RouterState

    state = RouterState([f"http://127.0.0.1:{9 + i}" for i in range(n)], "least_requests",
                        flow_control=FlowControl(max_requests_per_replica=cap, **kw))
    for u in state.upstreams:
        u.healthy, u.models = True, ["tiny"]
    return state


def _proxied(state, tenant=None):
    from minibatch.serving.routed import RoutedRequest
    from minibatch.serving.router import Proxied

    routed = RoutedRequest(prompt_len=4, max_tokens=4, prompt_token_ids=None, model="tiny", tenant=tenant)
    return Proxied(path="/v1/completions", chat=False, body={}, headers={}, routed=routed, stream=False)


def test_router_gate_releases_by_band_then_tenant_when_an_upstream_has_room():
    import asyncio

    async def main():
        state = _router_state(cap=1)
        u = state.upstreams[0]
        u.in_flight = 1                                    # full: every request is held
        order = []

        async def one(name, band, flow):
            req = _proxied(state)
            await state.flow.wait(req, band, flow)
            assert req.pinned is u
            order.append(name)
            state.begin(u, req)
            state.flow.unreserve(u)

        tasks = []
        for name, band, flow in [("a1", 1, "a"), ("a2", 1, "a"), ("b1", 1, "b"), ("hi", 0, "c")]:
            tasks.append(asyncio.ensure_future(one(name, band, flow)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert order == [] and len(state.flow.queue) == 4
        for _ in range(4):                                  # one request ends: exactly one goes
            u.in_flight -= 1
            state.flow.pump()
            await asyncio.sleep(0.01)
            assert u.in_flight == 1
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["hi", "a1", "b1", "a2"]


def test_router_gate_answers_429_on_timeout_and_full_queue():
    import asyncio

    from minibatch.serving.protocol import APIError

    async def main():
        state = _router_state(cap=1, queue_timeout_s=0.05, max_queued=1)
        state.upstreams[0].in_flight = 1
        first = asyncio.ensure_future(state.flow.wait(_proxied(state), 0, None))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await state.flow.wait(_proxied(state), 0, None)
        with pytest.raises(APIError) as late:
            await first
        assert len(state.flow.queue) == 0
        return full.value, late.value

    full, late = asyncio.run(main())
    assert full.status == 429 and "--flow-max-queued" in str(full)
    assert late.status == 429 and "--flow-queue-timeout" in str(late)


def test_router_flow_options_are_checked_by_name():
    from minibatch.serving.router import make_parser, state_from_args

    args = make_parser().parse_args(["--upstream", "http://127.0.0.1:9", "--flow-control",
                                     "--flow-max-requests-per-upstream", "0"])
    with pytest.raises(ValueError, match="--flow-max-requests-per-upstream"):
        state_from_args(args, args.upstream)
    from minibatch.serving.flow import band_and_flow
    from minibatch.serving.protocol import APIError

    assert band_and_flow({"x-minibatch-priority": "2"}, {"user": "u"}) == (2, "u")
    assert band_and_flow({"x-gateway-inference-fairness-id": "t"}, {"priority": 1}) == (1, "t")
    with pytest.raises(APIError, match="priority"):
        band_and_flow({}, {"priority": "high"})


def test_router_flow_control_in_front_of_a_real_server(tmp_path):
    """One ``minibatch serve`` (slowed by its fault injection) behind ``minibatch router
    --flow-control`` with room for one request: a held urgent request overtakes the held ones
    that came before it, and every answer equals the server's own greedy answer."""
    import concurrent.futures
    import json
    import time

    import httpx
    from serving_utils import ServerProcess, metric, set_fault

    up = ServerProcess(tmp_path / "up.log", "--max-num-seqs", "8", "--enable-fault-injection")
    router = None
    try:
        router = ServerProcess(tmp_path / "router.log", "--upstream", up.url, "--poll-interval", "0.1",
                               "--flow-control", "--flow-max-requests-per-upstream", "1", command="router")
        prompts = {"lo1": "Once upon a time", "lo2": "The little cat", "hi": "Tom found a box"}

        def complete(url, prompt, band=None, stream=False, max_tokens=8):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            headers = {} if band is None else {"X-Minibatch-Priority": str(band)}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
                assert r.status_code == 200, r.read()
                text = r.read().decode()
            if stream:
                return "".join(json.loads(line[6:])["choices"][0]["text"] for line in text.splitlines()
                               if line.startswith("data: {"))
            return json.loads(text)["choices"][0]["text"]

        direct = {name: complete(up.url, p) for name, p in prompts.items()}
        set_fault(up, kind="slow", delay_s=1.0)                 # every request waits 1 s upstream
        done = []

        def send(name, band, stream=False, max_tokens=8):
            text = complete(router.url, prompts.get(name, "A blocker"), band, stream, max_tokens)
            done.append(name)
            return name, text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            blocker = pool.submit(send, "blocker", 1, True, 16)
            time.sleep(0.2)
            futures = [pool.submit(send, "lo1", 1)]
            time.sleep(0.1)
            futures.append(pool.submit(send, "lo2", 1))
            time.sleep(0.1)
            futures.append(pool.submit(send, "hi", 0))
            answers = dict(f.result(timeout=60) for f in futures)
            blocker.result(timeout=60)
        assert done == ["blocker", "hi", "lo1", "lo2"]          # held, then released by band, then FCFS
        assert answers == direct                                  # greedy tokens unchanged
        page = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert metric(page, "minibatch_router_flow_released") == 4
    finally:
        if router is not None:
            router.stop()
        up.stop()


def test_max_queued_zero_holds_nothing_but_lets_through_what_finds_room():
    wl = Workload([_req(0.0, f"r{i}", out=50) for i in range(5)])
    res = cluster.run(wl, replicas=2, **SIM, flow_control=FlowControl(max_requests_per_replica=2, max_queued=0))
    reasons = [r.finish_reason for r in res.requests]
    assert reasons == ["length"] * 4 + ["rejected"]
    assert set(res.extra["flow_control"]["held_wait"].values()) == {0.0}     # none waited


def test_router_gate_with_max_queued_zero_lets_through_what_finds_room():
    import asyncio

    from minibatch.serving.protocol import APIError

    async def main():
        state = _router_state(cap=1, max_queued=0)
        req = _proxied(state)
        await state.flow.wait(req, 0, None)                     # room: goes at once, pinned
        assert req.pinned is state.upstreams[0]
        state.begin(req.pinned, req)
        state.flow.unreserve(req.pinned)
        with pytest.raises(APIError) as full:                   # no room, no queue: 429
            await state.flow.wait(_proxied(state), 0, None)
        return full.value

    assert asyncio.run(main()).status == 429
