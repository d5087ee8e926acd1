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
                 command: str = "serve", ready_status: int = 200):
        """``threads``: torch CPU threads of the server (OMP_NUM_THREADS); tests use one so
        that the server and the test process do not fight over a small machine's cores.
        ``port``: a given port (a restart on the same address) instead of a free one;
        ``command``: the ``python -m minibatch`` subcommand (``serve``, ``router``);
        ``ready_status``: the ``/health`` status that means it is up (a router whose upstreams
        are all down answers 503)."""
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.ready_status = ready_status
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
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == self.ready_status:
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


def start_servers(log_dir, n: int, *args: str) -> list[ServerProcess]:
    """``n`` ``minibatch serve`` processes started side by side (their logs in ``log_dir``);
    those that started are stopped if another one fails."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ServerProcess, log_dir / f"upstream{i}.log", *args) for i in range(n)]
    servers = [f.result() for f in futures if f.exception() is None]
    if len(servers) < n:
        for s in servers:
            s.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return servers


def set_fault(server, **fault) -> None:
    """``POST /admin/fault`` on a server started with ``--enable-fault-injection``."""
    r = httpx.post(f"{server.url}/admin/fault", json=fault, timeout=30)
    assert r.status_code == 200, r.text


def sse_events(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 120) -> list:
    """Every ``data:`` payload of a streamed answer (JSON-decoded, ``[DONE]`` as a string)."""
    import json

    out = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def by_choice(events: list) -> dict[int, dict]:
    """Each choice's text, token ids (when sent) and finish_reason, from a stream's events."""
    out: dict[int, dict] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        for c in e.get("choices") or []:
            ch = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
            ch["text"] += c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or ""
            ch["token_ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                ch["finish_reason"] = c["finish_reason"]
    return out
