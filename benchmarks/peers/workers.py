"""Engines in processes of their own, run one at a time: the idle one is paused.

:class:`Worker` starts ``offline_worker.py`` (minibatch or vLLM) in a new session, so that
SIGSTOP / SIGCONT reach the whole process group (vLLM's front end, engine core and model
worker). Only the engine being measured runs; the others are stopped, so an idle engine's
polling (vLLM's engine core busy-loops when idle: "TODO: make scheduler proc sleep when
idle", ``vllm/utils/ompmultiprocessing.py`` in 0.32.0) takes no CPU from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 1800          # vLLM's first start compiles its model (minutes on a busy machine)
RUN_TIMEOUT_S = 3600


class Worker:
    def __init__(self, engine: str, model: str, python: str, env: dict, log_path: Path,
                 kv_bytes: int = 256 << 20):
        self.engine = engine
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [python, str(HERE / "offline_worker.py"), "--engine", engine, "--model", model,
             "--out-fd", str(w), "--kv-bytes", str(kv_bytes)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            pass_fds=(w,), start_new_session=True)
        os.close(w)
        self._out = os.fdopen(r, "r")
        self.paused = False
        hello = self._read(START_TIMEOUT_S)
        assert hello.get("ready"), hello
        self.pause()

    def _read(self, timeout: float) -> dict:
        import select

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.engine}: no answer in {timeout} s; log {self.log_path}")
            ready, _, _ = select.select([self._out], [], [], min(left, 5.0))
            if ready:
                line = self._out.readline()
                if not line:
                    raise RuntimeError(f"{self.engine} worker exited ({self.proc.poll()}):\n{self.log_tail()}")
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} worker exited ({self.proc.returncode}):\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def run(self, prompts, max_tokens, tokens: bool = False) -> dict:
        """Resume, run the requests, pause again; returns the worker's answer."""
        self.resume()
        try:
            self.proc.stdin.write((json.dumps({"cmd": "run", "prompts": prompts, "max_tokens": max_tokens,
                                               "tokens": tokens}) + "\n").encode())
            self.proc.stdin.flush()
            return self._read(RUN_TIMEOUT_S)
        finally:
            self.pause()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def load_average() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.1f} {b:.1f} {c:.1f}"


def minibatch_python() -> str:
    return sys.executable
