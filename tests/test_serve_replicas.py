"""``python -m minibatch serve --replicas 2``: starts, serves, and leaves no process behind.

The parent prints one ``replica I pid P on URL`` line per child. After SIGTERM every child
is gone; after SIGKILL of the parent (no chance to clean up) the children go too, through
``prctl(PR_SET_PDEATHSIG)``. A zombie (exited, not yet reaped by whoever inherited it)
counts as gone. Every wait has a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serving_utils import alive, free_port

WAIT_S = 120

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Replicated:
    """``serve --replicas 2`` in a subprocess; its log, children's pids and router URL."""

    def __init__(self, log_path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minibatch", "serve", "--replicas", "2", "--port", str(self.port),
             "--router-policy", "round_robin", "--max-num-seqs", "4", "--uvicorn-log-level", "warning",
             "--replica-stop-timeout", "20", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pids: list[int] = []

    def log(self) -> str:
        self._log.flush()
        return open(self.log_path, errors="replace").read()[-4000:]

    def wait_ready(self) -> None:
        def ready():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()}"
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, WAIT_S, "the router of serve --replicas 2")
        self.pids = [int(p) for p in re.findall(r"replica \d+ pid (\d+) on", self.log())]
        assert len(self.pids) == 2, self.log()

    def stop(self) -> None:
        for pid in [self.proc.pid, *self.pids]:        # leave nothing behind if a test failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def replicated(tmp_path):
    r = Replicated(tmp_path / "serve.log")
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def test_serves_through_both_replicas_and_stops_them_on_sigterm(replicated):
    r = replicated
    health = httpx.get(f"{r.url}/health", timeout=10).json()
    assert [u["healthy"] for u in health["upstreams"]] == [True, True]
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    texts = [httpx.post(f"{r.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
             for _ in range(4)]
    assert len(set(texts)) == 1 and texts[0]
    routed = [u["routed"] for u in httpx.get(f"{r.url}/health", timeout=10).json()["upstreams"]]
    assert routed == [2, 2]
    assert all(alive(p) for p in r.pids)

    r.proc.send_signal(signal.SIGTERM)
    assert r.proc.wait(60) == 0, r.log()
    wait_for(lambda: not any(alive(p) for p in r.pids), 30, "the replicas to exit")


def test_children_die_with_a_killed_parent(replicated):
    r = replicated
    r.proc.kill()                      # SIGKILL: the parent cannot clean up; PDEATHSIG does
    r.proc.wait(10)
    wait_for(lambda: not any(alive(p) for p in r.pids), 60, "the replicas to exit after their parent died")


def test_with_an_api_key_the_router_polls_with_it_and_guards_its_own_routes(tmp_path):
    """``serve --replicas 2 --api-key K --api-key-scope all``: the router's /v1/models, /metrics
    need the key; /health answers without it but names no internal address; the router polls
    its replicas with the key (their models, and their load while a request runs)."""
    key = "sk-replicas"
    auth = {"Authorization": f"Bearer {key}"}
    r = Replicated(tmp_path / "serve.log", "--api-key", key, "--api-key-scope", "all")
    try:
        r.wait_ready()
        health = httpx.get(f"{r.url}/health", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
        for path in ("/metrics", "/v1/models"):
            assert httpx.get(f"{r.url}{path}", timeout=10).status_code == 401, path
        ports = re.findall(r"replica \d+ pid \d+ on http://127.0.0.1:(\d+)", r.log())
        assert len(ports) == 2 and not any(p in health.text for p in ports)
        details = httpx.get(f"{r.url}/health", headers=auth, timeout=10).json()
        assert [u["healthy"] for u in details["upstreams"]] == [True, True]
        models = httpx.get(f"{r.url}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]

        def running() -> float:
            page = httpx.get(f"{r.url}/metrics", headers=auth, timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                       if line.startswith("minibatch_router_upstream_num_requests_running{"))

        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, headers=auth, timeout=WAIT_S) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: "))      # the request runs upstream
            wait_for(lambda: running() >= 1, 60, "the router to poll a replica's load (with the key)")
    finally:
        r.stop()

