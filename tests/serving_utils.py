"""Start ``python -m minibatch serve`` in a subprocess on a free loopback port (test helper)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

# A server's start is mostly importing torch and transformers: ~10 s of CPU, which on a machine
# whose 2 cores are shared with other processes (CI, parallel test workers) can take minutes of
# wall time. This only bounds how long a broken start takes to be reported.
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether a process runs (Linux: a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ServerProcess:
    def __init__(self, log_path, *args: str, threads: int | None = 1, port: int | None = None,
                 command: str = "serve"):
        """``threads``: torch CPU threads of the server (OMP_NUM_THREADS); tests use one so
        that the server and the test process do not fight over a small machine's cores.
        ``port``: a given port (a restart on the same address) instead of a free one;
        ``command``: the ``python -m minibatch`` subcommand (``serve``, ``router``)."""
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minibatch", command, "--port", str(self.port),
             "--uvicorn-log-level", "warning", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def log(self) -> str:
        self._log.flush()
        return open(self.log_path, errors="replace").read()[-4000:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        log = self.log()                 # before stop() closes the log file
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with these labels on a ``/metrics`` page, read with
    ``prometheus_client``'s own parser (so the page must be valid exposition text)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(f"{name} {labels}")


def one_thread_llm():
    """The offline reference ``LLM("tiny")`` on one CPU thread, like the servers (two busy
    processes on few cores); a generator for a module-scoped fixture."""
    import torch

    from minibatch import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM("tiny")
    torch.set_num_threads(threads)


def pace(engine, deadline_s: float):
    """Make ``engine.step`` wait for a release of the returned semaphore before each step,
    so a test decides when every step runs."""
    import threading

    step, allowed = engine.step, threading.Semaphore(0)

    def paced_step():
        assert allowed.acquire(timeout=deadline_s), "the test stopped pacing the engine"
        return step()

    engine.step = paced_step
    return allowed
