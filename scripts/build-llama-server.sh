#!/usr/bin/env bash
# Build upstream llama.cpp's llama-server (and llama-speculative-simple, llama-bench, llama-batched-bench,
# llama-quantize) from the same source this project builds on: the llama.cpp vendored in the llama-cpp-python 0.3.36
# sdist, taken from the package index. Built as a llama.cpp user gets it, with llama.cpp's default CMake options
# (llamafile sgemm and weight repacking on, GGML_NATIVE), except the web UI's download from a model hub
# (LLAMA_USE_PREBUILT_UI=OFF): no network beyond the package index. The binaries go to .llama-server/bin/ (ignored by
# git) and are reused when present; the last line printed is llama-server's path, for `dflash-local bench --llama-server
# PATH`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.llama-server
SERVER="$OUT/bin/llama-server"
if [ -x "$SERVER" ] && [ -x "$OUT/bin/llama-speculative-simple" ] && [ -x "$OUT/bin/llama-quantize" ]; then
    echo "$PWD/$SERVER"
    exit 0
fi
mkdir -p "$OUT"
if [ ! -d "$OUT/src/llama.cpp" ]; then
    PY=${PYTHON:-python3}
    [ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || PY=.venv/bin/python
    sdist=$(PYTHON=$PY scripts/fetch-sdist.sh)
    rm -rf "$OUT/src" && mkdir -p "$OUT/src"
    tar -xzf "$sdist" -C "$OUT/src" llama_cpp_python-0.3.36/vendor/llama.cpp
    mv "$OUT/src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$OUT/src/llama.cpp"
    rm -rf "$OUT/src/llama_cpp_python-0.3.36"
fi
echo "building llama-server from llama-cpp-python 0.3.36's llama.cpp (about 10 minutes on 2 cores)..." >&2
cmake -S "$OUT/src/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF >"$OUT/cmake.log" 2>&1 ||
    { tail -20 "$OUT/cmake.log" >&2; exit 1; }
cmake --build "$OUT/build" -j "$(nproc 2>/dev/null || sysctl -n hw.ncpu)" \
    --target llama-server llama-speculative-simple llama-bench llama-batched-bench llama-quantize >"$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log" >&2; exit 1; }
ln -sfn build/bin "$OUT/bin"  # llama.cpp's CMakeLists puts every binary in build/bin
[ -x "$SERVER" ] || { echo "error: the build made no $SERVER" >&2; exit 1; }
echo "$PWD/$SERVER"
