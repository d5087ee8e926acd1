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

    def __init__(self, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minibatch", "serve", "--replicas", "2", "--port", str(self.port),
             "--router-policy", "round_robin", "--max-num-seqs", "4", "--uvicorn-log-level", "warning",
             "--replica-stop-timeout", "20"],
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
