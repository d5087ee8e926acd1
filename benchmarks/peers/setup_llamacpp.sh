#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-batched-bench from the llama.cpp source inside
# the llama-cpp-python source distribution on PyPI (the only registry reachable here), and
# convert minibatch's embedded tiny checkpoint to an f32 GGUF file. Outside the repository;
# never part of the test suite.
#
#   bash benchmarks/peers/setup_vllm.sh        # first: the converter runs with its torch/transformers
#   bash benchmarks/peers/setup_llamacpp.sh    # into $MINIBATCH_PEERS (default ~/.cache/minibatch/peers)
#
# The build is CMake Release, -march=native (GGML_NATIVE), OpenMP, no OpenSSL, no curl, no
# web UI (neither built nor downloaded), no tests: about 12 minutes on 2 idle cores, far
# longer on a busy machine (it runs at nice 19). tiny's BPE pre-tokenizer is not in
# llama.cpp's table; convert_tiny_gguf.py records it as "gpt-2", and the benchmarks send
# token ids anyway.
set -euo pipefail
PEERS="${MINIBATCH_PEERS:-$HOME/.cache/minibatch/peers}"
HERE="$(cd "$(dirname "$0")" && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
SRC="$PEERS/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$PEERS/llama-build"
mkdir -p "$PEERS/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS/src"
  tar -xzf "$PEERS/src/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS/src"
fi
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_MTMD=OFF > "$PEERS/llama-cmake.log"
nice -n 19 cmake --build "$BUILD" -j"$JOBS" --target llama-server llama-batched-bench
VPY="$PEERS/vllm-venv/bin/python"
[ -x "$VPY" ] || { echo "setup_llamacpp: no $VPY for the converter (run setup_vllm.sh first)"; exit 1; }
env -u PYTHONPATH "$VPY" "$HERE/convert_tiny_gguf.py" "$SRC" "$PEERS/tiny-f32.gguf"
echo "setup_llamacpp: done, $BUILD/bin and $PEERS/tiny-f32.gguf"
