"""``python -m minibatch serve --replicas N``: N engine processes with the HTTP router in front.

    python -m minibatch serve --replicas 2 --port 8000 --model tiny --max-num-seqs 16

Each replica is a plain ``python -m minibatch serve`` child on a free loopback port, given
every flag this command does not take itself (the engine flags, ``--api-key``, ...); the
router (``minibatch.serving.router``) listens on ``--host``/``--port`` once every replica's
``/health`` answers 200. The router's own options carry a ``--router-`` prefix here, since
``serve`` already has ``--policy`` (the scheduling policy) and ``--max-concurrent-requests``
(each replica's limit): ``--router-policy``, ``--router-max-concurrent-requests``,
``--router-max-queue``, ``--router-max-attempts``, ``--router-poll-interval``,
``--router-upstream-timeout``, ``--router-first-token-timeout``,
``--router-inter-token-timeout``. With ``OMP_NUM_THREADS`` unset, each replica gets
``cpu_count // N`` torch threads (at least one), so that N replicas do not oversubscribe.

The router is the public edge (``edge.py``): ``--allowed-hosts``, ``--read-timeout`` and
``--max-connections`` are its own (the replicas listen on loopback ports and answer the
router's ``Host: 127.0.0.1``); ``--max-request-body-bytes`` applies to the router and the
replicas alike. ``--api-key`` (or ``$MINIBATCH_API_KEY``) and ``--api-key-scope`` go to every
replica and to the router, which enforces them on its own routes too (``/health`` answers
without the key, its details only with it) and sends the key on its polls of the replicas.

No orphans. Every child starts in a session (and process group) of its own, so that a
Ctrl-C on the terminal reaches only this process, which then stops them in order; on Linux
each child also asks the kernel for ``SIGTERM`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, through ``ctypes``), which covers a parent killed with
``SIGKILL``. On ``SIGTERM``/``SIGINT``, and on any exit of this process (a failed start
included), the router stops first, then every child's group gets ``SIGTERM``, is waited
for ``--replica-stop-timeout`` seconds, and is killed with ``SIGKILL`` if it is still there.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from minibatch.config import env
from minibatch.serving.edge import add_edge_args, check_edge_args, edge_from_args
from minibatch.serving.router import RouterState, make_server
from minibatch.serving.upstreams import DEFAULT_FIRST_TOKEN_TIMEOUT_S, DEFAULT_INTER_TOKEN_TIMEOUT_S

PR_SET_PDEATHSIG = 1       # <linux/prctl.h>


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int):
    """A ``preexec_fn``: SIGTERM this child when its parent dies (Linux), then check that the
    parent did not die already, between the fork and the prctl."""

    def setup() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class Replicas:
    """The engine child processes: start, wait until healthy, stop (terminate, wait, kill)."""

    def __init__(self, n: int, engine_argv: list[str], stop_timeout: float = 15.0):
        self.n, self.engine_argv, self.stop_timeout = n, engine_argv, stop_timeout
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self) -> None:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        for i in range(self.n):
            port = free_port()
            cmd = [sys.executable, "-m", "minibatch", "serve", "--host", "127.0.0.1", "--port", str(port),
                   *self.engine_argv]
            # preexec_fn is safe here: this process runs no other thread yet (the router starts later).
            proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()))  # noqa: PLW1509
            self.ports.append(port)
            self.procs.append(proc)
            print(f"minibatch: replica {i} pid {proc.pid} on http://127.0.0.1:{port}", file=sys.stderr, flush=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(self.n))
        while pending:
            for i in sorted(pending):
                code = self.procs[i].poll()
                if code is not None:
                    raise RuntimeError(f"replica {i} exited with {code} before it was healthy")
                try:
                    with urllib.request.urlopen(f"{self.urls[i]}/health", timeout=1.0) as r:
                        if r.status == 200:
                            pending.discard(i)
                except (urllib.error.URLError, OSError):
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {sorted(pending)} not healthy after {timeout:g} s")
            if pending:
                time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM every child's process group, wait, then SIGKILL what is left."""
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            _signal_group(p, signal.SIGKILL)      # the child, or anything it left in its group
            if p.poll() is None:
                p.wait(5)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)                       # start_new_session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minibatch serve --replicas N",
                                description="N engine processes behind the HTTP router; the flags not "
                                            "listed here go to every replica's `serve`.")
    p.add_argument("--replicas", type=int, required=True, help="engine processes to start")
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--router-policy", default="least_requests", help="router class (default: least_requests)")
    p.add_argument("--router-max-concurrent-requests", type=int, default=256)
    p.add_argument("--router-max-queue", type=int, default=256)
    p.add_argument("--router-max-attempts", type=int, default=3)
    p.add_argument("--router-poll-interval", type=float, default=0.5)
    p.add_argument("--router-upstream-timeout", type=float, default=300.0)
    p.add_argument("--router-first-token-timeout", type=float, default=DEFAULT_FIRST_TOKEN_TIMEOUT_S)
    p.add_argument("--router-inter-token-timeout", type=float, default=DEFAULT_INTER_TOKEN_TIMEOUT_S)
    add_edge_args(p)
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for every replica to be healthy")
    p.add_argument("--replica-stop-timeout", type=float, default=15.0,
                   help="seconds each replica has to exit after SIGTERM before SIGKILL")
    return p


def _value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def main(argv: list[str]) -> int:
    args, engine_argv = make_parser().parse_known_args(argv)
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    tokenizer = _value(engine_argv, "--tokenizer") or _value(engine_argv, "--model") or "tiny"
    api_key = _value(engine_argv, "--api-key") or env("MINIBATCH_API_KEY")
    scope = _value(engine_argv, "--api-key-scope") or "v1"
    try:
        check_edge_args(args)
        edge = edge_from_args(args, api_key, scope, "router")
        state = RouterState(["http://127.0.0.1:0"] * args.replicas, args.router_policy,
                            max_concurrent=args.router_max_concurrent_requests, max_queue=args.router_max_queue,
                            max_attempts=args.router_max_attempts, poll_interval=args.router_poll_interval,
                            upstream_timeout=args.router_upstream_timeout, tokenizer=tokenizer, edge=edge,
                            first_token_timeout=args.router_first_token_timeout,
                            inter_token_timeout=args.router_inter_token_timeout, upstream_api_key=api_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    child_argv = [*engine_argv, "--max-request-body-bytes", str(args.max_request_body_bytes)]
    replicas = Replicas(args.replicas, child_argv, args.replica_stop_timeout)

    serving = False

    def on_signal(sig, frame):
        # During startup: stop at once. uvicorn re-raises the signal it stopped on after its
        # shutdown: then this is a normal end.
        raise SystemExit(0 if serving else 128 + sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        replicas.start()
        replicas.wait_healthy(args.startup_timeout)
        for u, url in zip(state.upstreams, replicas.urls, strict=True):
            u.url = url
        print(f"minibatch: router ({args.router_policy}) over {args.replicas} replicas on "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        serving = True
        make_server(state, args.host, args.port).run()     # returns after SIGTERM / SIGINT
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        replicas.stop()
