"""The Ray Serve backend (``minibatch.cluster.ray_backend``) on a local Ray instance of its own.

One Ray instance for the whole module (it costs ~10-15 s and ~0.8 GB to start here):
``ray_backend.start_local_ray(num_cpus=2, ...)`` in a module fixture, ``serve.shutdown()`` and
``ray.shutdown()`` after it. Nothing here runs ``ray stop`` (that would end every Ray process
on the machine). Engine replicas ask for 0.5 CPU each. Every wait is a poll with a generous
deadline; nothing depends on how fast this machine is.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import minibatch
from minibatch import LLM, SamplingParams
from minibatch.cluster import ray_backend
from minibatch.cluster.routers import Router, register

PROMPTS = ["Once upon a time", "The little dog", "She opened the door and", "In the morning the sun"]
MAX_TOKENS = 16
# Faster autoscaling metrics than Ray Serve's 10 s defaults (read by the replicas and handles).
SERVE_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
             "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}
DEADLINE_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float = DEADLINE_S, poll: float = 0.25, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


# -- without Ray ---------------------------------------------------------------------------
def test_parse_autoscale_gives_ray_serve_names():
    assert ray_backend.parse_autoscale("min=1,max=4,target_ongoing_requests=8,upscale_delay_s=0.5") == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0, "upscale_delay_s": 0.5}
    assert ray_backend.parse_autoscale(None) is None
    for bad, word in [("min=3,max=1", "min_replicas=3 > max_replicas=1"), ("mx=2", "mx=2"),
                      ("max=two", "not a number"), ("max", "NAME=VALUE")]:
        with pytest.raises(ValueError, match=word):
            ray_backend.parse_autoscale(bad)


def test_local_ray_environment_is_set_for_the_start_only_and_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "7")
    with ray_backend.local_ray_environment():
        assert os.environ["RAY_worker_niceness"] == "0"
        assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "7"
    assert "RAY_worker_niceness" not in os.environ
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "7"


def test_a_tune_sweep_starting_local_ray_gives_it_that_environment(monkeypatch):
    ray = pytest.importorskip("ray")
    from minibatch import tune

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    seen = {}

    def fake_init(address=None, **kwargs):
        seen.update(address=address, niceness=os.environ.get("RAY_worker_niceness"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(RuntimeError, match="stop here"):
        tune.parallel_map(abs, [-1], ray_address="local")
    assert seen == {"address": None, "niceness": "0"}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minibatch", "serve", "--backend", "ray", *args],
                          check=False, capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_bad_options_before_starting_ray():
    r = run_cli("--autoscale", "min=2,max=1")
    assert r.returncode == 2 and "min_replicas=2 > max_replicas=1" in r.stderr
    r = run_cli("--router", "nope")
    assert r.returncode == 2 and "unknown router 'nope'" in r.stderr


# -- on a local Ray instance ----------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_port():
    """A local Ray instance and Serve's HTTP proxy on a free loopback port."""
    global ray, serve
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    saved = {k: os.environ.get(k) for k in SERVE_ENV}
    os.environ.update(SERVE_ENV)
    root = str(Path(minibatch.__file__).resolve().parent.parent)   # the workers import this checkout
    ray_backend.start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
                                runtime_env={"env_vars": {**SERVE_ENV, "PYTHONPATH": root, "OMP_WAIT_POLICY": "PASSIVE"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_local_ray_workers_run_at_normal_priority(ray_port):
    """Ray's own default runs workers at nice 15; start_local_ray sets 0 (see LOCAL_RAY_ENV)."""
    @ray.remote(num_cpus=0.1)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=DEADLINE_S) == 0
    assert "RAY_worker_niceness" not in os.environ       # set for ray.init only


def test_tune_on_ray_tasks_gives_the_same_trials_as_in_process(ray_port, monkeypatch):
    from minibatch import tune
    from minibatch.workload import load_workload

    sent = []
    real_remote = ray.remote
    monkeypatch.setattr(ray, "remote", lambda fn: sent.append(fn) or real_remote(fn))
    wl, grid, slo = load_workload("chat", n=24), {"max_num_seqs": [4, 32]}, {"ttft": 0.5, "tpot": 0.05}
    on_ray = tune.sweep(wl, grid=grid, slo=slo, ray_address="auto")     # this module's instance
    assert sent, "the sweep did not go to Ray tasks"
    here = tune.sweep(wl, grid=grid, slo=slo, processes=1)
    assert [(t.config, t.goodput, t.latency) for t in on_ray.trials] == \
        [(t.config, t.goodput, t.latency) for t in here.trials]
    assert on_ray.best == here.best


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Each prompt's greedy text from a single engine (the offline API)."""
    llm = LLM(model="tiny")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {o.prompt: o.outputs[0].text for o in llm.generate(PROMPTS, params)}


def body(prompt: str, max_tokens: int = MAX_TOKENS, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def stream_text(port: int, payload: dict, on_first=None) -> tuple[str, int, str | None]:
    """POST a streaming completion; (text, usage.completion_tokens, finish_reason)."""
    text, tokens, finish = [], None, None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=DEADLINE_S,
                      json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                if on_first is not None:
                    on_first()
                    on_first = None
    return "".join(text), tokens, finish


@pytest.fixture(scope="module")
def two_replicas(ray_port):
    handle = ray_backend.deploy(model="tiny", num_replicas=2, router="round_robin", num_cpus=0.5)
    wait_until(lambda: ray_backend.num_running_replicas() == 2, what="2 running replicas")
    return handle


def test_two_replicas_match_a_single_engine(ray_port, two_replicas, reference):
    handle = two_replicas
    outs = [handle.completions.remote(body(p)).result(timeout_s=DEADLINE_S) for p in PROMPTS]
    for p, out in zip(PROMPTS, outs):
        assert out["choices"][0]["text"] == reference[p], p
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
    # round_robin on 2 replicas: both served
    assert len({o["minibatch"]["replica"] for o in outs}) == 2
    # over HTTP, not streaming and streaming
    for p in PROMPTS[:2]:
        r = httpx.post(f"http://127.0.0.1:{ray_port}/v1/completions", json=body(p), timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[p]
        assert r.headers["x-minibatch-replica"]
        text, tokens, finish = stream_text(ray_port, body(p))
        assert (text, tokens, finish) == (reference[p], MAX_TOKENS, "length")
    # bad input: a 4xx in OpenAI's shape naming the field, and the next request is fine
    r = httpx.post(f"http://127.0.0.1:{ray_port}/v1/completions", json=body("x", max_tokens=-1), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # ... and a check only the replica's engine makes (the vocabulary) comes back as a 400 too
    r = httpx.post(f"http://127.0.0.1:{ray_port}/v1/completions", json=body([10 ** 7]), timeout=60)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"], r.text
    r = httpx.post(f"http://127.0.0.1:{ray_port}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_a_killed_replica_loses_no_request(ray_port, two_replicas, reference):
    """Streams are running on both replicas when one replica actor is killed: every request
    still completes with the single engine's greedy text (resumed on the other replica)."""
    handle = two_replicas
    wait_until(lambda: ray_backend.num_running_replicas() == 2, what="2 running replicas")
    # Long enough that every stream is still running when the replica dies, also on a loaded machine
    # (with 48 tokens, the first streams had finished before the last one started: nothing was retried).
    n_tokens = 192
    ref = {o.prompt: o.outputs[0].text for o in LLM(model="tiny").generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))}
    started = [threading.Event() for _ in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream_text, ray_port, body(p, n_tokens), started[i].set)
                   for i, p in enumerate(PROMPTS)]
        for e in started:
            assert e.wait(DEADLINE_S), "a stream did not start"
        calls = [handle.completions.remote(body(p, n_tokens)) for p in PROMPTS]
        victims = ray_backend.replica_actor_handles()
        assert len(victims) == 2
        assert not any(s.done() for s in streams), "a stream finished before the kill: the test needs longer outputs"
        ray.kill(victims[0])
        results = [s.result(timeout=DEADLINE_S) for s in streams]
        outs = [c.result(timeout_s=DEADLINE_S) for c in calls]
    for p, (text, tokens, finish) in zip(PROMPTS, results):
        assert (text, tokens, finish) == (ref[p], n_tokens, "length"), p
    for p, out in zip(PROMPTS, outs):
        assert "error" not in out, out
        assert out["choices"][0]["text"] == ref[p]
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["retried"] >= 1          # the killed replica had requests in flight, sent again
    wait_until(lambda: ray_backend.num_running_replicas() == 2, what="Serve to replace the killed replica")


@register
class AlwaysSecond(Router):
    """A test router: always the replica at position 1."""

    name = "test_always_second"

    def choose(self, request, replicas, now):
        return 1 if len(replicas) > 1 else 0


def test_a_custom_router_choice_is_honoured(ray_port):
    handle = ray_backend.deploy(model="tiny", num_replicas=2, router=AlwaysSecond, num_cpus=0.5)
    wait_until(lambda: ray_backend.num_running_replicas() == 2, what="2 running replicas")
    outs = [handle.completions.remote(body(p, 4)) for p in PROMPTS * 2]
    seen = [o.result(timeout_s=DEADLINE_S)["minibatch"]["replica"] for o in outs]
    assert len(set(seen)) == 1, seen     # round_robin (the test above) spreads the same requests


def test_autoscaling_goes_up_under_load_and_back_down(ray_port):
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
               "downscale_delay_s": 2, "look_back_period_s": 1, "metrics_interval_s": 0.5}
    handle = ray_backend.deploy(model="tiny", autoscale=scaling, router="least_requests", num_cpus=0.5)
    wait_until(lambda: ray_backend.replica_counts() == {"RUNNING": 1}, what="1 running replica")
    stop = threading.Event()

    def load():
        n = 0
        while not stop.is_set() and n < 200:
            out = handle.completions.remote(body("Once upon a time", 64)).result(timeout_s=DEADLINE_S)
            assert out["usage"]["completion_tokens"] == 64
            n += 1
        return n

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        workers = [pool.submit(load) for _ in range(6)]
        try:
            wait_until(lambda: ray_backend.num_running_replicas() == 2, what="a scale-up to 2 replicas")
        finally:
            stop.set()
        assert all(w.result(timeout=DEADLINE_S) >= 1 for w in workers)
    wait_until(lambda: ray_backend.replica_counts() == {"RUNNING": 1}, what="a scale-down to 1 replica")


def test_serve_backend_ray_command_deploys_and_removes_its_app(ray_port, reference, tmp_path):
    """``python -m minibatch serve --backend ray --address ...`` joins this Ray instance, deploys,
    serves over HTTP, and on SIGTERM deletes its application (Ray and Serve stay up)."""
    serve.delete(ray_backend.DEFAULT_APP)        # the previous test's application
    address = ray.get_runtime_context().gcs_address
    with open(tmp_path / "serve.log", "w") as log:
        env = {**os.environ, "PYTHONPATH": str(Path(minibatch.__file__).resolve().parent.parent)}
        proc = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--backend", "ray", "--address", address,
                                 "--num-replicas", "1", "--router", "least_requests"],
                                stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + DEADLINE_S
            out = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    r = httpx.post(f"http://127.0.0.1:{ray_port}/v1/completions", json=body(PROMPTS[0]), timeout=30)
                    if r.status_code == 200 and ray_backend.replica_counts() == {"RUNNING": 1}:
                        out = r.json()
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert out is not None and out["choices"][0]["text"] == reference[PROMPTS[0]]
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=DEADLINE_S)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert "minibatch" not in serve.status().applications
