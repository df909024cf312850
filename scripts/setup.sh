#!/usr/bin/env bash
# Create .venv and install dflash-local into it, with llama-cpp-python built for this machine.
# GPU users: export CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# llama-cpp-python builds llama.cpp from source (about 8 minutes on 2 cores; pip caches the wheel afterwards).
echo "installing llama-cpp-python==0.3.36 (builds llama.cpp from source on first install)..."
python -m pip install -q "llama-cpp-python==0.3.36" "scikit-build-core>=0.10" "pybind11>=2.12"
# the native extension compiles against the llama.cpp just installed, so no isolated build environment
echo "building dflash-local..."
python -m pip install -q --no-build-isolation ".[${EXTRAS:-test}]"
