#!/usr/bin/env bash
# Build llama.cpp's benchmark tools (llama-bench, llama-batched-bench, llama-quantize, llama-perplexity, and
# llama-simple for greedy text) for the CPU peer runs, from the source distribution of llama-cpp-python on the package registry, which
# vendors llama.cpp: no git clone, nothing but pip's index needed.
#
#   benchmarks/build_llama_cpp.sh [OUT_DIR]     # default build/llama.cpp; prints the bin folder
#
# Settings (environment variables):
#   VERSION=0.3.36   llama-cpp-python's version (llama.cpp is whatever it vendors)
#   JOBS=$(nproc)    parallel compile jobs
# The build is native (-march=native through GGML_NATIVE), as llama.cpp's own release advice is for
# a CPU build: its figures are for the CPU it was built on.
set -euo pipefail

out=$(realpath -m "${1:-build/llama.cpp}")
VERSION=${VERSION:-0.3.36} JOBS=${JOBS:-$(nproc)}
for tool in cmake "${CXX:-g++}"; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found: install it (e.g. apt install cmake g++)" >&2; exit 1; }
done
mkdir -p "$out"
if [ ! -d "$out/src" ]; then
    "${PYTHON:-python}" -m pip download --no-binary :all: --no-deps -q -d "$out" "llama-cpp-python==$VERSION"
    mkdir -p "$out/src"
    tar -xzf "$out/llama_cpp_python-$VERSION.tar.gz" -C "$out/src" --strip-components=1
fi
source_dir="$out/src/vendor/llama.cpp"
[ -f "$source_dir/CMakeLists.txt" ] || { echo "error: no vendored llama.cpp in $out/src/vendor" >&2; exit 1; }
cmake -S "$source_dir" -B "$out/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$out/cmake.log" 2>&1 \
    || { tail -30 "$out/cmake.log" >&2; exit 1; }
cmake --build "$out/cmake" -j "$JOBS" --target llama-bench llama-batched-bench llama-quantize llama-perplexity llama-simple >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; exit 1; }
mkdir -p "$out/bin"
for tool in llama-bench llama-batched-bench llama-quantize llama-perplexity llama-simple; do cp "$out/cmake/bin/$tool" "$out/bin/"; done
"$out/bin/llama-bench" --help >/dev/null
echo "$out/bin"
